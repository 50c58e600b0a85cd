"""SwiGLU experts against a per-token loop; float64 gradcheck of x, gates and every weight."""
import pytest
import torch
import torch.nn.functional as F

from moremoe.nn import SwiGLUExperts
from moremoe.ops.reference import swiglu_experts_ref


def loop_experts(ex, x, gates, idx):
    y = torch.zeros(x.shape[0], ex.hidden, dtype=torch.float64)
    for n in range(x.shape[0]):
        xn = x[n].double()
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            act = F.silu(ex.w_gate[e].double() @ xn) * (ex.w_up[e].double() @ xn)
            y[n] += gates[n, j].double() * (ex.w_down[e].double() @ act)
    return y


def routing(N, M, k, *, one_expert=None):
    if one_expert is not None:
        idx = torch.full((N, k), one_expert)
    else:
        idx = torch.stack([torch.randperm(M)[:k] for _ in range(N)]) if N else \
            torch.zeros(0, k, dtype=torch.long)
    return torch.softmax(torch.randn(N, k), -1), idx.int()


@pytest.mark.parametrize("N,h,s,M,k", [(1, 16, 8, 4, 1), (5, 24, 6, 7, 3), (123, 16, 16, 37, 4),
                                       (17, 8, 4, 5, 5)])
def test_experts_match_per_token_loop(N, h, s, M, k):
    ex = SwiGLUExperts(h, s, M, init_std=0.3)
    x = torch.randn(N, h)
    gates, idx = routing(N, M, k)
    y = ex(x, gates, idx)
    assert y.shape == (N, h) and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), loop_experts(ex, x, gates, idx), rtol=1e-4, atol=1e-5)


def test_empty_experts_and_all_tokens_on_one_expert():
    ex = SwiGLUExperts(16, 8, 50, init_std=0.3)       # most experts receive nothing
    x = torch.randn(9, 16)
    gates, idx = routing(9, 50, 1, one_expert=7)
    torch.testing.assert_close(ex(x, gates, idx).double(), loop_experts(ex, x, gates, idx),
                               rtol=1e-4, atol=1e-5)
    y = ex(x[:0], gates[:0], idx[:0])
    assert y.shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_upcast_reference(dtype):
    ex = SwiGLUExperts(32, 16, 6, init_std=0.2)
    x = torch.randn(40, 32)
    gates, idx = routing(40, 6, 2)
    ref32 = swiglu_experts_ref(x, gates, idx, ex.w_gate, ex.w_up, ex.w_down, upcast=True)
    y = ex.to(dtype)(x.to(dtype), gates, idx)
    assert y.dtype == dtype
    rel = (y.float() - ref32).norm() / ref32.norm()
    assert rel < 2e-2


def test_gradcheck_x_gates_and_expert_weights():
    torch.manual_seed(4)
    ex = SwiGLUExperts(6, 4, 5, init_std=0.5).double()
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    gates, idx = routing(7, 5, 2)
    gates = gates.double().requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in (ex.w_gate, ex.w_up, ex.w_down)]

    def f(x_, g_, wg, wu, wd):
        return swiglu_experts_ref(x_, g_, idx, wg, wu, wd)

    assert torch.autograd.gradcheck(f, (x, gates, *weights), eps=1e-6, atol=1e-7)


def test_bad_arguments():
    ex = SwiGLUExperts(8, 4, 3)
    x = torch.randn(5, 8)
    gates, idx = routing(5, 3, 2)
    with pytest.raises(ValueError, match="hidden = 8"):
        ex(torch.randn(5, 9), gates, idx)
    with pytest.raises(TypeError, match="topk_idx must be an integer tensor"):
        ex(x, gates, idx.float())
    with pytest.raises(ValueError, match=r"gates must have shape \(5, 2\)"):
        ex(x, gates[:, :1], idx)
    with pytest.raises(ValueError, match="topk_idx has 4 rows but x has 5 tokens"):
        ex(x, gates[:4], idx[:4])
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        ex(x.long(), gates, idx)
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        SwiGLUExperts(8, 0, 3)


def test_auto_takes_the_reference_on_cpu():
    from moremoe.ops.dispatch import resolve_impl
    x = torch.randn(3, 32)
    assert resolve_impl("auto", x) == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("fast", x)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_expert_ids_out_of_range_or_of_a_wrong_dtype_are_named_errors(impl):
    """On every implementation: the Triton path must never see (and read past) a bad id."""
    if impl == "triton":
        pytest.importorskip("triton")
    from moremoe.ops.swiglu_experts import swiglu_experts
    ex = SwiGLUExperts(16, 8, 5, impl=impl)
    x = torch.randn(3, 16)
    gates, idx = routing(3, 5, 2)
    for bad in (5, -1):
        wrong = idx.clone()
        wrong[1, 1] = bad
        lo, hi = min(int(idx.min()), bad), max(int(idx.max()), bad)
        with pytest.raises(ValueError, match=rf"expert ids from {lo} to {hi}; they must be in "
                                             r"\[0, 5\) for M=5"):
            ex(x, gates, wrong)
        with pytest.raises(ValueError, match=r"must be in \[0, 5\)"):
            swiglu_experts(x, gates, wrong, ex.w_gate, ex.w_up, ex.w_down, impl=impl)
    with pytest.raises(TypeError, match="topk_idx must be an int32 or int64 tensor"):
        ex(x, gates, idx.to(torch.int16))
    with pytest.raises(TypeError, match="topk_idx must be an int32 or int64 tensor"):
        swiglu_experts(x, gates, idx.float(), ex.w_gate, ex.w_up, ex.w_down, impl=impl)
    torch.testing.assert_close(ex(x, gates, idx.long()), ex(x, gates, idx))
