"""kernels/routing_count.py, the routing metadata of more pairs than one tile in three
launches (a stable counting sort by blocks), against routing_meta_torch field by field (CPU:
Triton interpreter; tests/kernels/test_swiglu_experts_gpu.py runs it on a GPU): every
pair once, sorted stably; another shard's pairs last; runs longer than a block (hot
experts); one expert; the most experts and blocks its tile holds; and where it does not
take the sizes, the torch path."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.kernels import routing_count as rc  # noqa: E402
from moremoe.kernels.routing_meta import (SMALL_PAIRS, routing_meta,  # noqa: E402
                                          routing_meta_torch)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("order", "offsets", "block_expert", "block_start")


def idx_of(N, k, M, *, hot=False, first=0, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + N + M)
    hi = min(M, 3) if hot else M
    idx = torch.randint(first, first + hi, (N, k), generator=g)
    idx[0, 0] = first + M - 1                                 # the last expert id
    return idx.to(DEV, torch.int32)


def assert_same(idx, M, BM, first=0):
    a = routing_meta(idx, M, BM, first_expert=first, counting=True, sorting=False)
    b = routing_meta_torch(idx, M, BM, first_expert=first)
    for field in FIELDS:
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), field
    assert (a.block_rows, a.tokens, a.top_k, a.first_expert) == (BM, *idx.shape, first)


@pytest.mark.parametrize("N, k, M, BM, hot", [
    (SMALL_PAIRS // 4 + 1, 4, 7, 16, False),       # one past the one-launch kernel's pairs
    (2000, 4, 32, 64, True),                       # runs of hundreds of rows
    (1100, 1, 1, 64, False),                       # one expert
    (600, 4, 254, 128, False),                     # 256 bins, the most the tile takes
    (5000, 2, 129, 128, False),                    # blocks of 256 pairs
    (16384, 4, 96, 64, False)])                    # a phonebook step's MoRE-96 layer
def test_the_counting_sort_equals_the_torch_ops(N, k, M, BM, hot):
    assert rc.fits(N * k, M)
    assert_same(idx_of(N, k, M, hot=hot), M, BM)


def test_an_expert_shards_pairs_and_other_shards_pairs_sort_as_the_torch_ops():
    """first_expert = 20 of 64 local experts: ids below 20 and past 83 sort last, in pair
    order, past offsets[M]."""
    idx = torch.randint(0, 120, (3000, 4), generator=torch.Generator().manual_seed(3))
    assert_same(idx.to(DEV, torch.int32), 64, 64, first=20)


def test_sizes_past_the_tile_keep_the_torch_path():
    assert rc.fits(65536, 96) and rc.block_pairs(65536, 96) == 512
    assert not rc.fits(65536, 255)                  # 257 keys: 512 bins
    assert not rc.fits(1 << 20, 96)                 # 1,024 blocks of 1,024 pairs: 131,072 counts
    assert not rc.fits(0, 8)
    idx = idx_of(2000, 4, 300)
    a = routing_meta(idx, 300, 64, counting=True, sorting=False)  # 300: the torch ops
    b = routing_meta_torch(idx, 300, 64)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
    with pytest.raises(ValueError, match=r"8000 pairs over 300 experts exceed the counting "
                                         r"sort's tile .*use routing_meta"):
        rc.counting_meta(idx, 300, 64, 400)


def test_on_by_default_on_a_gpu_and_asked_for_in_the_interpreter(monkeypatch):
    """COUNTING is on (timed on an H200: 0.05 against 0.30 ms): routing_meta takes the
    counting sort by default for CUDA tensors, and in the interpreter only when asked
    (counting=True); counting=False takes the torch ops everywhere."""
    from moremoe.kernels import routing_meta as rm

    def refuse(*args, **kw):
        raise AssertionError("the counting sort ran")
    monkeypatch.setattr(rc, "counting_meta", refuse)
    assert rm.COUNTING is True
    idx = idx_of(2000, 4, 32)
    rm.routing_meta(idx, 32, 64, counting=False)            # the torch ops: no error
    with pytest.raises(AssertionError, match="ran"):
        rm.routing_meta(idx, 32, 64, counting=True)
    if DEV == "cuda":
        with pytest.raises(AssertionError, match="ran"):
            rm.routing_meta(idx, 32, 64)
    else:
        rm.routing_meta(idx, 32, 64)                        # the interpreter: not unasked


def assert_sorted_same(idx, M, BM, first=0):
    a = routing_meta(idx, M, BM, first_expert=first, counting=False, sorting=True)
    b = routing_meta_torch(idx, M, BM, first_expert=first)
    for field in FIELDS:
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), field


@pytest.mark.parametrize("N, k, M, BM, hot", [
    (SMALL_PAIRS // 4 + 1, 4, 7, 16, False),       # one past the one-launch kernel's pairs
    (2000, 4, 300, 64, False),                     # past the counting sort's 254 experts
    (2000, 4, 2500, 64, True),                     # runs of hundreds of rows; 3 scan chunks
    (1100, 1, 1, 64, False),                       # one expert
    (3000, 8, 1536, 128, False)])                  # the presets' shape at a smaller N
def test_the_sort_and_count_equals_the_torch_ops(N, k, M, BM, hot):
    """routing_count.sorted_meta (any size: torch's stable sort of the keys, the counts by
    integer atomics, one scanning program, the schedule's slots) field by field."""
    assert_sorted_same(idx_of(N, k, M, hot=hot), M, BM)


def test_the_sort_and_count_sorts_another_shards_pairs_last():
    idx = torch.randint(0, 700, (3000, 4), generator=torch.Generator().manual_seed(5))
    assert_sorted_same(idx.to(DEV, torch.int32), 400, 64, first=150)


def test_on_a_gpu_the_sort_and_count_takes_past_128_bins_and_the_tile(monkeypatch):
    """SORTED is on (timed on an H100: 0.13-0.15 against the torch ops' 0.52 ms at every
    size, and against the counting sort's 0.17 at 256 bins): with both paths allowed, the
    counting sort up to COUNTING_MAX_BINS (M = 126), the sort and count past it and past
    the counting sort's tile; the interpreter keeps the torch ops unless asked."""
    from moremoe.kernels import routing_meta as rm
    ran = []
    monkeypatch.setattr(rc, "counting_meta", lambda *a, **kw: ran.append("counting"))
    monkeypatch.setattr(rc, "sorted_meta", lambda *a, **kw: ran.append("sorted"))
    assert rm.SORTED is True and rm.COUNTING_MAX_BINS == 128
    for M in (32, 126, 127, 254, 300):
        rm.routing_meta(idx_of(2000, 4, M), M, 64, counting=True, sorting=True)
    assert ran == ["counting", "counting", "sorted", "sorted", "sorted"]
    ran.clear()
    rm.routing_meta(idx_of(2000, 4, 200), 200, 64, counting=True, sorting=False)
    rm.routing_meta(idx_of(2000, 4, 300), 300, 64, counting=False, sorting=False)
    assert ran == ["counting"]                      # asked for; the torch ops at 300
    ran.clear()
    rm.routing_meta(idx_of(2000, 4, 300), 300, 64)  # the defaults
    assert ran == (["sorted"] if DEV == "cuda" else [])


@pytest.mark.parametrize("N, k, M", [(2000, 4, 96), (600, 4, 300), (300, 2, 17),
                                     (2000, 4, 200)])
def test_pair_order_by_the_kernels_equals_the_sort(N, k, M):
    """routing_meta.pair_order with kernels (the counting sort at 96 experts, the sort where
    its tile does not hold 300 or its bins pass 128, one launch at 600 pairs) equals one
    stable sort and M + 1 binary searches."""
    from moremoe.kernels.routing_meta import pair_order
    idx = idx_of(N, k, M)
    for a, b in zip(pair_order(idx, M, kernels=True), pair_order(idx, M, kernels=False)):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_pair_order_counts_up_to_128_bins_and_sorts_past_them(monkeypatch):
    """The counting sort's placement grows with its bins: past COUNTING_MAX_BINS (M > 126)
    pair_order sorts (0.066 against the counting sort's 0.17 ms at 256 bins, H100)."""
    from moremoe.kernels import routing_meta as rm
    ran = []
    real = rm.routing_meta
    monkeypatch.setattr(rm, "routing_meta",
                        lambda *a, **kw: ran.append(a[1]) or real(*a, **kw))
    for M in (96, 126, 127, 200):
        rm.pair_order(idx_of(2000, 4, M), M, kernels=True)
    assert ran == [96, 126]
    rm.pair_order(idx_of(100, 4, 200), 200, kernels=True)     # one launch at 400 pairs
    assert ran == [96, 126, 200]
