"""Routers against explicit per-token loops, gradients in float64, init variance, errors."""
import math

import pytest
import torch

from moremoe.nn import LinearRouter, LowRankRouter


def loop_logits(router, x):
    """Per-token float64 logits, one matrix-vector product at a time."""
    rows = []
    for n in range(x.shape[0]):
        xn = x[n].double()
        if isinstance(router, LowRankRouter):
            rows.append(router.R1.double() @ (router.R2.double() @ xn))
        else:
            rows.append(router.weight.double() @ xn)
    return torch.stack(rows) if rows else torch.zeros(0, router.experts, dtype=torch.float64)


def make(kind, h, M, k, r=8):
    return LowRankRouter(h, M, k, r) if kind == "lowrank" else LinearRouter(h, M, k)


@pytest.mark.parametrize("kind", ["linear", "lowrank"])
@pytest.mark.parametrize("N,h,M,k", [(1, 16, 5, 1), (5, 24, 7, 3), (123, 32, 37, 4),
                                     (9, 16, 8, 8), (6, 16, 9, 8)])
def test_router_matches_per_token_loop(kind, N, h, M, k):
    router = make(kind, h, M, k).train()
    x = torch.randn(N, h)
    out = router(x)
    logits = loop_logits(router, x)
    assert out.topk_val.dtype == torch.float32 and out.topk_idx.dtype == torch.int32
    assert out.topk_val.shape == out.topk_idx.shape == out.gates.shape == (N, k)
    # routing invariants: in range, distinct, sorted, gather(logits, idx) == values
    assert int(out.topk_idx.min()) >= 0 and int(out.topk_idx.max()) < M
    assert all(len(set(row)) == k for row in out.topk_idx.tolist())
    assert torch.all(out.topk_val[:, :-1] >= out.topk_val[:, 1:])
    gathered = logits.gather(1, out.topk_idx.long())
    torch.testing.assert_close(out.topk_val.double(), gathered, rtol=1e-5, atol=1e-6)
    # the selected values are the k largest (value sets equal; ties may reorder indices)
    torch.testing.assert_close(out.topk_val.double(), logits.topk(k, dim=1).values,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.gates.double(), torch.softmax(gathered, 1), rtol=1e-5,
                               atol=1e-6)
    # balancing statistics
    torch.testing.assert_close(out.psum.double(), torch.softmax(logits, 1).sum(0), rtol=1e-5,
                               atol=1e-5)
    hist = torch.bincount(out.topk_idx.reshape(-1).long(), minlength=M)
    assert torch.equal(out.counts, hist) and int(out.counts.sum()) == N * k


@pytest.mark.parametrize("kind", ["linear", "lowrank"])
def test_eval_mode_returns_no_balancing_statistics(kind):
    router = make(kind, 16, 6, 2).eval()
    out = router(torch.randn(4, 16))
    assert out.psum is None and out.counts is None
    assert out.gates.shape == (4, 2)


@pytest.mark.parametrize("kind", ["linear", "lowrank"])
def test_empty_batch(kind):
    out = make(kind, 16, 6, 2).train()(torch.randn(0, 16))
    assert out.topk_idx.shape == (0, 2)
    assert torch.equal(out.counts, torch.zeros(6, dtype=torch.int64))
    assert torch.all(out.psum == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_precision_inputs_give_fp32_values(dtype):
    router = LowRankRouter(32, 16, 4, 8).to(dtype)
    out = router(torch.randn(10, 32, dtype=dtype))
    expect = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.topk_val.dtype == expect and out.gates.dtype == expect


def _loss(out, w_gates, w_psum):
    return (out.gates * w_gates).sum() + (out.topk_val * w_gates).sum() + (out.psum * w_psum).sum()


@pytest.mark.parametrize("kind", ["linear", "lowrank"])
def test_gradcheck_router_weights_and_x(kind):
    """float64 gradcheck of gates, top-k values and psum w.r.t. x and R1, R2 (or W)."""
    torch.manual_seed(2)
    router = make(kind, 10, 6, 2, r=3).double().train()
    names = [n for n, _ in router.named_parameters()]
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    w_g, w_p = torch.randn(4, 2, dtype=torch.float64), torch.randn(6, dtype=torch.float64)

    def f(x_, *ps):
        out = torch.func.functional_call(router, dict(zip(names, ps)), (x_,))
        return _loss(out, w_g, w_p)

    inputs = (x, *[p.detach().clone().requires_grad_() for p in router.parameters()])
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("init,expected", [
    ("variance_matched", lambda s, r: s ** 2),      # Lemma D.1: r σ1² σ2² = σ²
    ("default", lambda s, r: r * s ** 4)])          # per-entry σ: r σ⁴
def test_lowrank_init_variance_lemma_d1(init, expected):
    """Var([R1 R2 x]_m) over random inits equals σ² ||x||² (variance-matched)."""
    torch.manual_seed(3)
    h, r, M, draws, sigma = 32, 16, 64, 600, 0.02
    x = torch.randn(h)
    samples = []
    for _ in range(draws):
        router = LowRankRouter(h, M, 1, r, init=init)
        samples.append(router.R1.detach().double() @ (router.R2.detach().double() @ x.double()))
    var = torch.cat(samples).var().item()
    target = expected(sigma, r) * x.double().pow(2).sum().item()
    # 38,400 samples of a product-normal: relative standard error of the variance ~ 3 %
    assert abs(var / target - 1) < 0.12, (var, target)


def test_linear_init_std():
    router = LinearRouter(512, 512, 2)
    assert abs(router.weight.std().item() - 0.02) < 0.001
    lr = LowRankRouter(512, 1024, 2, 64)
    assert abs(lr.R1.std().item() - math.sqrt(0.02) / 64 ** 0.25) < 0.002
    assert abs(lr.factor_std - math.sqrt(0.02) / 64 ** 0.25) < 1e-12


def test_bad_arguments_name_the_argument_and_value():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, experts=4\], got 0"):
        LinearRouter(8, 4, 0)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, experts=4\], got 5"):
        LowRankRouter(8, 4, 5, 2)
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        LowRankRouter(8, 4, 2, 0)
    with pytest.raises(ValueError, match="init must be one of"):
        LowRankRouter(8, 4, 2, 2, init="xavier")
    router = LowRankRouter(8, 4, 2, 2)
    with pytest.raises(ValueError, match="last dimension 7, expected hidden = 8"):
        router(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        router(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x must be 2-D, got shape \(2, 3, 8\)"):
        router(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="R1 is on cpu but x is on meta"):
        router(torch.randn(3, 8, device="meta"))


def test_topk_agreement_at_a_large_k_needs_no_k_squared_memory():
    """k = 200,000 on 2 tokens: the all-pairs comparison would take 80 GB."""
    from moremoe.nn.router import topk_agreement
    g = torch.Generator().manual_seed(0)
    ref = torch.randperm(400_000, generator=g)[:200_000].reshape(1, -1).repeat(2, 1)
    got = ref.clone()
    got[1, :50_000] = torch.arange(400_000, 450_000)          # a quarter replaced
    got[0] = got[0].flip(0)                                    # same set, another order
    same, overlap = topk_agreement(got.int(), ref)
    assert same == 0.5 and overlap == pytest.approx((1 + 0.75) / 2)
