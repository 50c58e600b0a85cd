"""The weight gradients' piece plan in one launch (kernels/expert_wgrad._plan_kernel) equals
its torch reference (plan_torch) field for field: integers, compared exactly."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.kernels import expert_wgrad as wgrad  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _offsets(counts):
    """(chunks·M + 1,) int64 offsets of per-(chunk, expert) row counts (chunks, M)."""
    flat = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    return torch.cat([torch.zeros(1, dtype=torch.int64), flat.cumsum(0)]).to(DEV)


def _check(counts, piece_rows, tile):
    counts = torch.as_tensor(counts, dtype=torch.int64)
    chunks, M = counts.shape
    offsets, total = _offsets(counts), int(counts.sum())
    got = wgrad.plan(offsets, M, chunks, piece_rows, total, kernel=True, tile=tile)
    want = wgrad.plan(offsets, M, chunks, piece_rows, total, kernel=False)
    assert (got.bound, got.slots, got.rows) == (want.bound, want.slots, want.rows)
    for name in ("owner", "first", "count", "slot"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    return got


@pytest.mark.parametrize("chunks,M,tile", [(1, 1, 16), (1, 7, 16), (3, 37, 16), (2, 100, 32)])
@pytest.mark.parametrize("routing", ["balanced", "hot", "empty"])
def test_the_plan_kernel_equals_the_torch_plan(chunks, M, tile, routing):
    g = torch.Generator().manual_seed(M * 10 + chunks)
    if routing == "balanced":
        counts = torch.randint(0, 9, (chunks, M), generator=g)
    elif routing == "hot":                   # one expert past many pieces, the rest sparse
        counts = torch.randint(0, 3, (chunks, M), generator=g)
        counts[:, M // 2] = 50
    else:                                    # no rows at all: every expert one empty piece
        counts = torch.zeros(chunks, M, dtype=torch.int64)
    p = _check(counts, 8, tile)
    owned = p.owner[p.owner < M]               # every expert owns its pieces, in order
    assert torch.equal(owned.unique(), torch.arange(M, device=DEV, dtype=torch.int32))
    assert bool((owned[1:] >= owned[:-1]).all()) and bool((p.owner[owned.numel():] == M).all())


def test_the_plan_kernel_grows_the_pieces_like_the_torch_plan():
    """Rows past MAX_SLOTS pieces: P grows in plan() before either path runs."""
    counts = torch.tensor([[5000, 0, 3, 1]])
    p = _check(counts, 4, 16)
    assert p.rows > 4 and p.slots <= wgrad.MAX_SLOTS
