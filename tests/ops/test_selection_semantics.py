"""The documented selection semantics (docs/design.md, "Selection semantics"), first on the
plain-torch reference that is the oracle, then on both routers through every
implementation: the same tokens go to the same experts on CPU and GPU.

NaN and ±inf logits are never selected; ties go to the lower index; a row with fewer than
k finite logits is filled with the lowest unchosen indices; gates are the softmax over the
finite values; psum and the balancing loss count the finite logits only."""
import pytest
import torch

from moremoe.nn import LinearRouter, LowRankRouter
from moremoe.ops import reference as ref
from moremoe.ops.balance import switch_loss

NAN, INF = float("nan"), float("inf")


def test_reference_selection_on_every_kind_of_logit():
    logits = torch.tensor([[1.0, NAN, 3.0, 3.0, INF, -INF, 2.0],     # ties, ±inf, NaN
                           [NAN] * 7,                                # nothing selectable
                           [0.0] * 7,                                # all tied
                           [NAN, 5.0, INF, NAN, -1.0, -INF, 0.0]])   # 3 finite, k = 5
    val, idx = ref.select_topk(logits, 5)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [[2, 3, 6, 0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4],
                            [1, 6, 4, 0, 2]]
    torch.testing.assert_close(val, logits.gather(1, idx.long()), equal_nan=True)
    gates = ref.topk_gates(val)
    assert torch.isnan(gates[1]).all()                           # no defined routing
    assert gates[3, 3:].tolist() == [0.0, 0.0]                   # fillers get no weight
    torch.testing.assert_close(gates[3, :3], torch.softmax(val[3, :3], 0))
    torch.testing.assert_close(gates[0, :4], torch.softmax(val[0, :4], 0))
    assert gates[0, 4] == 0.0


def test_reference_psum_counts_the_finite_logits_only():
    logits = torch.tensor([[1.0, NAN, 3.0, INF], [NAN, NAN, NAN, NAN], [0.5, -INF, 0.5, 1.0]])
    want = (torch.softmax(torch.tensor([1.0, -INF, 3.0, -INF]), 0)
            + torch.softmax(torch.tensor([0.5, -INF, 0.5, 1.0]), 0))
    torch.testing.assert_close(ref.softmax_colsum(logits), want)


def test_reference_ties_go_to_the_lower_index_at_any_size():
    logits = torch.zeros(3, 300)
    logits[:, [7, 150, 299]] = 1.0
    assert ref.select_topk(logits, 2)[1].tolist() == [[7, 150]] * 3
    assert ref.select_topk(logits, 5)[1].tolist() == [[7, 150, 299, 0, 1]] * 3
    assert ref.select_topk(torch.zeros(0, 9), 3)[1].shape == (0, 3)


def test_reference_matches_torch_topk_without_ties():
    logits = torch.randn(64, 97, dtype=torch.float64)
    val, idx = ref.select_topk(logits, 6)
    want = logits.topk(6, dim=1)
    assert torch.equal(idx.long(), want.indices) and torch.equal(val, want.values)


def _router(kind, impl, M=150, h=16, k=4, r=8):
    torch.manual_seed(3)
    return LowRankRouter(h, M, k, r, impl=impl) if kind == "lowrank" else \
        LinearRouter(h, M, k, impl=impl)


def _weights(router):
    return router.R1 if isinstance(router, LowRankRouter) else router.weight


def _spoil(router, how):
    """Non-finite or degenerate router weights, as a diverged run or a bad init gives."""
    w = _weights(router)
    with torch.no_grad():
        if how == "nan_expert":
            w[5] = NAN
        elif how == "inf_experts":                   # +inf and -inf logits, at tile edges
            w[[127, 128, 149]] = INF
            w[[0, 126]] = -INF
            if isinstance(router, LowRankRouter):
                router.R2.abs_()
        elif how == "zeros":
            w.zero_()


@pytest.mark.parametrize("kind", ["lowrank", "linear"])
@pytest.mark.parametrize("how", ["nan_expert", "inf_experts", "zeros"])
@pytest.mark.parametrize("training", [False, True])
def test_every_implementation_routes_alike(kind, how, training):
    """The reference (CPU) and the fused kernels (GPU; Triton's interpreter in CI) pick the
    same experts, never a non-finite one, and the balancing loss stays finite."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.rand(37, 16, device=dev) + 0.1          # positive: inf weights give +inf logits
    outs = {}
    for impl in ("reference", "triton"):
        router = _router(kind, impl).to(dev).train(training)
        _spoil(router, how)
        outs[impl] = router(x)
    a, b = outs["reference"], outs["triton"]
    assert torch.equal(a.topk_idx, b.topk_idx)
    torch.testing.assert_close(a.topk_val, b.topk_val, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(a.gates, b.gates, rtol=1e-5, atol=1e-6, equal_nan=True)
    if how == "zeros":
        assert a.topk_idx.tolist() == [[0, 1, 2, 3]] * 37
    if how == "nan_expert":
        assert not (a.topk_idx == 5).any() and torch.isfinite(a.gates).all()
    if how == "inf_experts":
        assert not torch.isin(a.topk_idx, torch.tensor([0, 126, 127, 128, 149],
                                                       device=dev, dtype=torch.int32)).any()
    if training:
        for out in (a, b):
            assert torch.isfinite(out.psum).all()
            assert torch.isfinite(switch_loss(out.psum, out.counts, 37, 4))
        torch.testing.assert_close(a.psum, b.psum, rtol=1e-5, atol=1e-5)
