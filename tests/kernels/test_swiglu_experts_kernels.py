"""Grouped SwiGLU expert kernels against the reference (CPU: Triton interpreter): forward and
every gradient, odd sizes, k = 1 and k = M, empty experts, all tokens on one expert, N = 1,
the decoding schedule, the routing metadata and the custom ops."""
import pytest
import torch

pytest.importorskip("triton")
mg = pytest.importorskip("moremoe.kernels.swiglu_experts")
from moremoe.kernels.routing_meta import (SMALL_PAIRS, max_blocks, routing_meta,  # noqa: E402
                                          routing_meta_torch)
from moremoe.nn import SwiGLUExperts  # noqa: E402
from moremoe.ops import swiglu_experts as ose  # noqa: E402
from moremoe.ops.reference import swiglu_experts_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(N, h, s, M, k, *, one_expert=None, dtype=torch.float32, scale=0.3):
    x = torch.randn(N, h, device=DEV)
    if one_expert is not None:
        idx = torch.full((N, k), one_expert, device=DEV)
    else:
        idx = torch.stack([torch.randperm(M)[:k] for _ in range(N)]).to(DEV) if N else \
            torch.zeros(0, k, dtype=torch.long, device=DEV)
    gates = torch.softmax(torch.randn(N, k, device=DEV), -1)
    ws = [torch.randn(M, s, h, device=DEV) * scale, torch.randn(M, s, h, device=DEV) * scale,
          torch.randn(M, h, s, device=DEV) * scale]
    return x.to(dtype), gates, idx.int(), [w.to(dtype) for w in ws]


@pytest.mark.parametrize("N,h,s,M,k", [(1, 16, 16, 3, 1), (5, 32, 16, 7, 3), (37, 48, 32, 11, 4),
                                       (70, 16, 48, 5, 5), (9, 32, 16, 200, 2),
                                       (23, 40, 56, 9, 4), (6, 24, 8, 4, 2), (11, 8, 52, 5, 3)])
def test_forward_and_gradients_match_reference(N, h, s, M, k):
    check_against_reference(*make(N, h, s, M, k))


def check_against_reference(x, gates, idx, ws):
    """Forward against the fp64 reference, every gradient against fp64 autograd."""
    N, h = x.shape
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    ref = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn(N, h, device=DEV)
    dx, dgates, dwg, dwu, dwd = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
    x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in ws]
    (swiglu_experts_ref(x64, g64, idx, *w64) * dy.double()).sum().backward()
    for got, want in ((dx, x64.grad), (dgates, g64.grad), (dwg, w64[0].grad),
                      (dwu, w64[1].grad), (dwd, w64[2].grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_all_tokens_on_one_expert_and_empty_experts():
    # 3 blocks of one expert (its weight gradients sum over all of them), 39 empty experts
    check_against_reference(*make(150, 32, 16, 40, 1, one_expert=17))


def test_fp16_within_fp16_error():
    x, gates, idx, ws = make(40, 32, 16, 6, 2, dtype=torch.float16)
    ref32 = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    y = mg.forward(x, gates, idx, *ws)
    assert y.dtype == torch.float16
    torch_fp16 = swiglu_experts_ref(x, gates, idx, *ws)         # torch in the same dtype
    err = (y.float() - ref32).norm() / ref32.norm()
    assert err <= 2 * (torch_fp16.float() - ref32).norm() / ref32.norm() + 1e-4


def test_fp32_weights_with_half_x_equal_the_cast_weights():
    """fp32 weights are rounded to x's dtype as loaded: the same products as casting them
    first, and fp32 weight gradients that round to the half ones."""
    x, gates, idx, ws32 = make(37, 40, 24, 7, 3)
    x = x.half()
    ws16 = [w.half() for w in ws32]
    y32, act32, g32, u32 = mg.forward(x, gates, idx, *ws32, save=True)
    y16, act16, g16, u16 = mg.forward(x, gates, idx, *ws16, save=True)
    assert y32.dtype == torch.float16
    for a, b in ((y32, y16), (act32, act16), (g32, g16), (u32, u16)):
        assert torch.equal(a, b)
    dy = torch.randn_like(y16)
    got = mg.backward(dy, x, gates, idx, *ws32, act32, g32, u32)
    want = mg.backward(dy, x, gates, idx, *ws16, act16, g16, u16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])     # dx, dgates
    for dw32, dw16 in zip(got[2:], want[2:]):
        assert dw32.dtype == torch.float32
        assert torch.equal(dw32.half(), dw16)


def test_empty_batch_gives_empty_outputs_and_zero_weight_gradients():
    x, gates, idx, ws = make(0, 16, 16, 4, 2)
    assert mg.forward(x, gates, idx, *ws).shape == (0, 16)
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    dx, dgates, *dws = mg.backward(torch.zeros_like(y), x, gates, idx, *ws, act, xg, xu)
    assert dx.shape == (0, 16) and dgates.shape == (0, 2)
    assert all(torch.equal(d, torch.zeros_like(w)) for d, w in zip(dws, ws))


def test_deterministic_run_to_run():
    x, gates, idx, ws = make(64, 32, 16, 5, 3)
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    dy = torch.randn(64, 32, device=DEV)
    a = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
    b = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
    for t1, t2 in zip(a, b):
        assert torch.equal(t1, t2)


def test_routing_meta_blocks_cover_every_pair_once():
    idx = torch.tensor([[3, 0], [3, 1], [3, 0], [7, 3], [0, 7]], device=DEV)
    meta = routing_meta(idx, 9, 2)
    flat = idx.reshape(-1)
    assert torch.equal(flat[meta.order], flat.sort(stable=True).values)
    assert meta.offsets.dtype == torch.int64 and meta.offsets.tolist() == [
        0, 3, 4, 4, 8, 8, 8, 8, 10, 10]
    rows = []
    for e, start in zip(meta.block_expert.tolist(), meta.block_start.tolist()):
        if e < 0:
            continue
        end = min(start + 2, int(meta.offsets[e + 1]))
        assert start >= int(meta.offsets[e])
        rows += list(range(start, end))
    assert sorted(rows) == list(range(10))
    assert meta.max_blocks == max_blocks(10, 9, 2) == min(10, 9) + 5


def test_decoding_schedule_touches_only_the_experts_present():
    idx = torch.tensor([[4000, 17, 9000, 3]], device=DEV)        # one token, M = 16,384
    meta = routing_meta(idx, 16384, 64)
    present = meta.block_expert[meta.block_expert >= 0].tolist()
    assert present == [3, 17, 4000, 9000]
    assert meta.max_blocks == 5                                    # min(4, M) + ceil(4 / 64)


@pytest.mark.parametrize("N,k,M,BM,hot", [
    (1, 1, 1, 64, False), (1, 4, 16384, 64, False), (3, 2, 5, 2, False), (7, 3, 9, 2, True),
    (37, 4, 300, 64, False), (64, 4, 8, 16, True), (256, 4, 64, 64, True),
    (SMALL_PAIRS // 4, 4, 2000, 64, False), (100, 8, 129, 128, True)])
def test_one_launch_metadata_equals_the_torch_ops(N, k, M, BM, hot):
    """The single-kernel metadata of small N (decoding) is the torch path's, field by field:
    runs longer than a block (hot: most pairs on a few experts), one expert, M > N·k, the
    last expert id, and N·k = SMALL_PAIRS."""
    g = torch.Generator().manual_seed(N * 7 + M)
    hi = min(M, 3) if hot else M
    idx = torch.randint(0, hi, (N, k), generator=g)
    idx[0, 0] = M - 1
    idx = idx.to(DEV, torch.int32)
    a, b = routing_meta(idx, M, BM), routing_meta_torch(idx, M, BM)
    for field in ("order", "offsets", "block_expert", "block_start"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), field
    assert (a.block_rows, a.tokens, a.top_k) == (BM, N, k)


def test_walking_schedule_gives_the_same_result():
    x, gates, idx, ws = make(9, 32, 16, 50, 3)
    assert torch.equal(mg.forward(x, gates, idx, *ws, walk_experts=True),   # same rows, same
                       mg.forward(x, gates, idx, *ws))                      # arithmetic
    meta = routing_meta(idx, 50, 64, walk_experts=True)
    assert meta.max_blocks == 50                         # one program per expert id


def test_requirements_are_checked():
    x, gates, idx, ws = make(4, 24, 16, 3, 2)
    with pytest.raises(ValueError, match="w_gate, w_up"):
        mg.forward(x, gates, idx, ws[0], ws[1], ws[1])
    x, gates, idx, ws = make(4, 16, 16, 3, 2)
    with pytest.raises(TypeError, match="expert weights all x's dtype or all float32"):
        mg.forward(x, gates, idx, ws[0].double(), ws[1], ws[2])
    w_up_t = ws[1].transpose(1, 2).contiguous().transpose(1, 2)       # same shape, strides differ
    with pytest.raises(ValueError, match="w_up must have w_gate's strides"):
        mg.forward(x, gates, idx, ws[0], w_up_t, ws[2])


def test_custom_ops_opcheck_and_autograd_through_the_module():
    x, gates, idx, ws = make(20, 16, 16, 6, 2)
    torch.library.opcheck(ose.train_op, (x.requires_grad_(), gates.requires_grad_(), idx,
                                         *[w.requires_grad_() for w in ws]))
    fused = SwiGLUExperts(16, 16, 6, impl="triton").to(DEV)
    ref = SwiGLUExperts(16, 16, 6, impl="reference").to(DEV)
    ref.load_state_dict(fused.state_dict())
    xs = torch.randn(20, 16, device=DEV)
    g1 = torch.autograd.grad(fused(xs, gates, idx).square().sum(), list(fused.parameters()))
    g2 = torch.autograd.grad(ref(xs, gates, idx).square().sum(), list(ref.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    compiled = torch.compile(lambda t: fused(t, gates, idx), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(xs), fused(xs, gates, idx))
    g3 = torch.autograd.grad(compiled(xs).square().sum(), list(fused.parameters()))
    for a, b in zip(g3, g1):            # through the fake routing-metadata outputs too
        torch.testing.assert_close(a, b)


def test_backward_reuses_the_forwards_routing_metadata():
    x, gates, idx, ws = make(13, 32, 16, 7, 3)
    meta = routing_meta(idx, 7, mg.config(32, 16)["BM"])
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True, meta=meta)
    dy = torch.randn_like(y)
    for a, b in zip(mg.backward(dy, x, gates, idx, *ws, act, xg, xu, meta=meta),
                    mg.backward(dy, x, gates, idx, *ws, act, xg, xu)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="meta was built for BM=32"):
        mg.forward(x, gates, idx, *ws, meta=routing_meta(idx, 7, 32))
    with pytest.raises(ValueError, match=r"\(N, k\) = \(12, 3\)"):
        mg.forward(x, gates, idx, *ws, meta=routing_meta(idx[:12], 7, 64))


def test_weight_gradient_tiles_are_their_own_config():
    c = mg.config(512, 56)
    assert (c["dw_BR"], c["dw_BS"], c["dw_BH"], c["dw_warps"]) == (c["BM"], c["BS"], c["BH"],
                                                                   c["num_warps"])
    c = mg.config(512, 56, {"BM": 128, "dw_BR": 32, "dw_BH": 128})
    assert (c["BM"], c["dw_BR"], c["dw_BS"], c["dw_BH"]) == (128, 32, 64, 128)
    with pytest.raises(ValueError, match=r"unknown expert kernel config keys \['BX'\]"):
        mg.config(512, 56, {"BX": 1})
    for bad in ({"dw_BR": 8}, {"BS": 48}, {"BH": 16.0}):   # a GPU's tl.dot needs >= 16
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a power of two >= 16"):
            mg.config(512, 56, bad)
    x, gates, idx, ws = make(29, 40, 24, 5, 3)
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    dy = torch.randn_like(y)
    want = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
    got = mg.backward(dy, x, gates, idx, *ws, act, xg, xu,
                      cfg={"dw_BR": 16, "dw_BS": 16, "dw_BH": 32})
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("combine", ["pairs", "atomic"])
@pytest.mark.parametrize("N,h,s,M,k", [(1, 16, 16, 3, 1), (37, 48, 32, 11, 4), (70, 40, 56, 5, 2)])
def test_fused_forward_matches_the_reference(N, h, s, M, k, combine, split, monkeypatch):
    """The one-kernel inference forward (act on chip; pair rows or fp32 atomics; h split over
    programs as when decoding, or not as at prefill) equals the reference and the two-kernel
    forward."""
    if not split:
        monkeypatch.setattr(mg, "FILL_BLOCKS", 1)
    x, gates, idx, ws = make(N, h, s, M, k)
    y = mg.forward(x, gates, idx, *ws, cfg={"fused": True}, combine=combine)
    ref = swiglu_experts_ref(x, gates, idx, *ws)
    torch.testing.assert_close(y, ref, atol=1e-4 * h, rtol=1e-4)
    torch.testing.assert_close(y, mg.forward(x, gates, idx, *ws), atol=1e-5 * h, rtol=1e-5)
    with pytest.raises(ValueError, match="combine must be"):
        mg.forward(x, gates, idx, *ws, combine="sum")
    with pytest.raises(ValueError, match="combine='atomic' needs inference"):
        mg.forward(x, gates, idx, *ws, save=True, combine="atomic")


@pytest.mark.parametrize("split_h", [1, 2, 3, 5])
@pytest.mark.parametrize("N,h,s,M,k", [(3, 80, 16, 4, 2), (37, 48, 40, 11, 4), (200, 160, 16, 3, 1)])
def test_split_h_gate_up_matches_the_reference(N, h, s, M, k, split_h):
    """The two-kernel inference forward with the gate/up reduction over h split across
    programs (fp32 partials, added and activated by the down kernel), h not a multiple of
    the split, more splits than h chunks."""
    x, gates, idx, ws = make(N, h, s, M, k)
    cfg = {"fused": False, "split_h": split_h, "BH": 16}
    y = mg.forward(x, gates, idx, *ws, cfg=cfg)
    torch.testing.assert_close(y, swiglu_experts_ref(x, gates, idx, *ws), atol=1e-4 * h,
                               rtol=1e-4)


def shard_reference_grads(x, gates, idx, ws, lo, dy):
    """fp64 autograd of the reference on the shard's weights (its slots only)."""
    x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in ws]
    y = swiglu_experts_ref(x64, g64, idx, *w64, first_expert=lo)
    y = y + sum(t.sum() for t in (x64, g64, *w64)) * 0    # no slot here: zero gradients
    (y * dy.double()).sum().backward()
    return y.detach(), [x64.grad, g64.grad, *(w.grad for w in w64)]


@pytest.mark.parametrize("N,h,s,M,k,lo,hi", [
    (23, 40, 24, 9, 3, 3, 7), (5, 16, 16, 4, 4, 0, 1), (37, 48, 56, 11, 2, 6, 11),
    (9, 24, 8, 200, 2, 150, 157), (1, 16, 16, 3, 1, 2, 3), (7, 32, 16, 6, 2, 6, 9)])
def test_an_expert_shard_runs_only_its_slots(N, h, s, M, k, lo, hi):
    """Weights of experts [lo, hi) (first_expert=lo): y sums the gated outputs of the slots
    with those ids only (zero rows for tokens with none: a range that holds no slot, odd
    sizes, the last experts, a range past M), every gradient as the reference's on those
    slots, zero gate gradients for the others."""
    x, gates, idx, ws = make(N, h, s, M, k)
    shard = [torch.cat([w, torch.randn_like(w[:1]).expand(max(hi - M, 0), *w.shape[1:])])
             [lo:hi].contiguous() for w in ws]
    dy = torch.randn(N, h, device=DEV)
    want, want_grads = shard_reference_grads(x, gates, idx, shard, lo, dy)
    y, act, xg, xu = mg.forward(x, gates, idx, *shard, save=True, first_expert=lo)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    mine = ((idx >= lo) & (idx < hi))
    assert torch.equal(y[~mine.any(1)], torch.zeros_like(y[~mine.any(1)]))
    got = mg.backward(dy, x, gates, idx, *shard, act, xg, xu, first_expert=lo)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[1][~mine], torch.zeros_like(got[1][~mine]))


def test_the_shards_of_a_partition_add_up_to_the_whole_layer():
    x, gates, idx, ws = make(31, 32, 16, 10, 3)
    parts = [mg.forward(x, gates, idx, *(w[a:b].contiguous() for w in ws), first_expert=a)
             for a, b in [(0, 3), (3, 4), (4, 10)]]
    torch.testing.assert_close(sum(parts), mg.forward(x, gates, idx, *ws), rtol=1e-5,
                               atol=1e-5)
    ref = sum(swiglu_experts_ref(x, gates, idx, *(w[a:b] for w in ws), first_expert=a)
              for a, b in [(0, 3), (3, 4), (4, 10)])
    torch.testing.assert_close(ref, swiglu_experts_ref(x, gates, idx, *ws), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("first_expert", [None, 2])
def test_chunks_give_the_whole_result_and_call_back_in_order(save, first_expert):
    """Chunks of tokens (one empty, one of a single token) launched one by one: the same y
    and gradients as one launch, the callbacks called before and after each chunk with its
    rows of y final."""
    x, gates, idx, ws = make(29, 40, 24, 7, 3)
    lo = first_expert or 0
    shard = [w[lo:lo + 4].contiguous() for w in ws] if first_expert is not None else ws
    bounds, calls = (0, 9, 9, 10, 29), []
    whole = mg.forward(x, gates, idx, *shard, save=save, first_expert=first_expert)
    meta = routing_meta(idx, shard[0].shape[0], mg.config(40, 24)["BM"], first_expert=lo,
                        bounds=bounds)
    got = mg.forward(x, gates, idx, *shard, save=save, first_expert=first_expert, meta=meta,
                     before=lambda c: calls.append(("before", c)),
                     after=lambda c, y_c: calls.append(("after", c, y_c.clone())))
    y, y_whole = (got[0], whole[0]) if save else (got, whole)
    torch.testing.assert_close(y, y_whole, rtol=1e-6, atol=1e-6)
    assert [c[:2] for c in calls] == [(w, c) for c in range(4) for w in ("before", "after")]
    for (_, c, y_c) in calls[1::2]:
        assert torch.equal(y_c, y[bounds[c]:bounds[c + 1]])
    if save:
        dy = torch.randn_like(y)
        chunked = mg.backward(dy, x, gates, idx, *shard, *got[1:], meta=meta,
                              first_expert=first_expert)
        # the weight gradients sum each expert's token rows chunk by chunk: the same fp32
        # terms in another order, apart by at most (terms) x eps x their largest partial
        # sum (numpy 1.23's interpreter summed one element 3.8e-6 apart at 0.26)
        eps = torch.finfo(torch.float32).eps
        for a, b in zip(chunked, mg.backward(dy, x, gates, idx, *shard, *whole[1:],
                                             first_expert=first_expert)):
            bound = 2 * x.shape[0] * eps * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=0, atol=bound)


def test_chunked_metadata_keeps_each_chunks_pairs_in_its_slots():
    """Chunk c's slots hold blocks of its own tokens' pairs only, each block one expert of
    the shard [3, 7) (virtual expert c·M + e); together every pair of the shard once."""
    idx = torch.tensor([[3, 0], [5, 1], [3, 4], [7, 3], [0, 6], [4, 4]], device=DEV)
    bounds = (0, 2, 2, 6)
    meta = routing_meta(idx, 4, 2, first_expert=3, bounds=bounds)
    assert meta.offsets.numel() == 3 * 4 + 1 and meta.chunks == 3
    flat, seen = idx.reshape(-1).tolist(), []
    for c, (first, n) in enumerate(meta.slots):
        for v, start in zip(meta.block_expert[first:first + n].tolist(),
                            meta.block_start[first:first + n].tolist()):
            if v < 0:
                continue
            assert v // 4 == c
            for pair in meta.order[start:min(start + 2, int(meta.offsets[v + 1]))].tolist():
                assert bounds[c] <= pair // 2 < bounds[c + 1] and flat[pair] - 3 == v % 4
                seen.append(pair)
    assert sorted(seen) == [p for p, e in enumerate(flat) if 3 <= e < 7]


@pytest.mark.parametrize("N,k,M,first", [(5, 2, 3, 2), (37, 4, 9, 100), (64, 4, 8, 0),
                                         (SMALL_PAIRS // 4, 4, 300, 150), (3, 1, 1, 0)])
def test_one_launch_metadata_of_a_shard_equals_the_torch_ops(N, k, M, first):
    g = torch.Generator().manual_seed(N + M)
    idx = torch.randint(0, 2 * M + first, (N, k), generator=g).to(DEV, torch.int32)
    a = routing_meta(idx, M, 16, first_expert=first)
    b = routing_meta_torch(idx, M, 16, first_expert=first)
    for field in ("order", "offsets", "block_expert", "block_start"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert ta.dtype == tb.dtype and torch.equal(ta, tb), field
    assert int(a.offsets[-1]) == int(((idx >= first) & (idx < first + M)).sum())


def test_a_shards_custom_ops_opcheck():
    """The ops with first_expert: schema, fake tensors and autograd. (The saved act, xg, xu
    rows past the shard's pairs are never written, so the comparison of two runs' outputs,
    test_aot_dispatch, does not apply to the training op.)"""
    x, gates, idx, ws = make(20, 16, 16, 6, 2)
    args = (x.requires_grad_(), gates.requires_grad_(), idx, *[w[2:5].contiguous()
                                                              .requires_grad_() for w in ws], 2)
    torch.library.opcheck(ose.train_op, args, test_utils=(
        "test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(ose.infer_op, tuple(t.detach() if torch.is_tensor(t) else t
                                              for t in args))


@pytest.mark.parametrize("rows,chunked,plan_kernel", [
    (8, False, False), (16, False, False), (2 ** 62, False, False), (8, True, False),
    (16, True, False), (2 ** 62, True, False), (8, True, True), (2 ** 62, False, True)])
def test_hot_experts_split_into_pieces_give_every_weight_gradient(rows, chunked, plan_kernel,
                                                                   monkeypatch):
    """A router that sends most pairs to two experts (as at the start of training): their
    rows are cut into pieces of `rows` (several programs, then the pieces added in order;
    2^62: one program an expert), across chunks of tokens too; the weight gradients match
    fp64 autograd, with empty experts zero, and the in-place accumulation (keep = 0: stored,
    keep = 1: added) gives the sum of two backwards (the gate and up gradients in one launch
    or, with pieces of 16, in two). plan_kernel: the pieces planned by the
    one launch a GPU takes (expert_wgrad.KERNEL), not the torch ops. The backward's
    torch.empty memory is NaN-filled: what it allocates and does not zero (dgate among them)
    must be written."""
    from moremoe.kernels import expert_wgrad
    from test_router_lowrank import poison
    monkeypatch.setattr(expert_wgrad, "KERNEL", plan_kernel)
    poison(monkeypatch, True, mg)
    x, gates, _, ws = make(53, 40, 24, 9, 3)
    g, rows_ = torch.Generator().manual_seed(3), []
    for n in range(53):          # 40 and 35 pairs on experts 2 and 6, expert 8 empty
        hot = [2] * (n < 40) + [6] * (n < 35)
        rest = [e for e in torch.randperm(8, generator=g).tolist() if e not in (2, 6)]
        rows_.append(hot + rest[:3 - len(hot)])
    idx = torch.tensor(rows_, dtype=torch.int32, device=DEV)
    cfg = {"dw_piece_rows": rows, "dw_BR": 16,       # pieces of 8 rows: half a row block
           "dw_pair": rows != 16}                     # gate and up in one launch, or two
    meta = routing_meta(idx, 9, mg.config(40, 24, cfg)["BM"],
                        bounds=(0, 20, 21, 53) if chunked else None)
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True, meta=meta)
    dy = torch.randn_like(y)
    got = mg.backward(dy, x, gates, idx, *ws, act, xg, xu, cfg=cfg, meta=meta)
    x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in ws]
    (swiglu_experts_ref(x64, g64, idx, *w64) * dy.double()).sum().backward()
    for g, w in zip(got[2:], w64):
        torch.testing.assert_close(g.double(), w.grad, rtol=1e-4, atol=1e-5)
        assert torch.equal(g[8], torch.zeros_like(g[8]))
    for g, w in zip(got[:2], (x64, g64)):
        torch.testing.assert_close(g.double(), w.grad, rtol=1e-4, atol=1e-5)
    into = [torch.full_like(w, float("nan")) for w in ws]
    keep = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):           # the first stores over the NaNs, the second adds
        mg.backward(dy, x, gates, idx, *ws, act, xg, xu, cfg=cfg, meta=meta, into=into,
                    keep=keep)
    for g, w in zip(into, w64):
        torch.testing.assert_close(g.double(), 2 * w.grad, rtol=1e-4, atol=2e-5)
