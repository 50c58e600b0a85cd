"""MoE / MoRE layer: composition, the Switch loss, configs and errors."""
import pytest
import torch

from moremoe.nn import MoEConfig, MoELayer
from moremoe.ops.reference import swiglu_experts_ref


@pytest.mark.parametrize("cfg", [MoEConfig.moe(8, 2, 16, 8), MoEConfig.more(12, 3, 16, 8, 4)])
def test_layer_composes_router_and_experts(cfg):
    layer = MoELayer(cfg).train()
    x = torch.randn(2, 5, 16)
    out = layer(x)
    assert out.y.shape == x.shape
    r = out.router
    expected = swiglu_experts_ref(x.reshape(-1, 16), r.gates, r.topk_idx, layer.experts.w_gate,
                                  layer.experts.w_up, layer.experts.w_down)
    torch.testing.assert_close(out.y.reshape(-1, 16), expected)


def test_switch_loss_formula_and_coefficient():
    cfg = MoEConfig.more(10, 2, 16, 4, 4, balance_coef=0.05)
    layer = MoELayer(cfg).train()
    x = torch.randn(30, 16)
    out = layer(x)
    logits = (x @ layer.router.R2.T) @ layer.router.R1.T
    P = torch.softmax(logits, -1)
    f = torch.bincount(out.router.topk_idx.reshape(-1).long(), minlength=10).float() / (30 * 2)
    expected = 10 * (f * P.mean(0)).sum()
    torch.testing.assert_close(out.switch_loss, expected)
    torch.testing.assert_close(out.aux_loss, 0.05 * expected)
    # gradient flows only through p (f is detached): d loss / d psum_i = M f_i / N
    out.router.psum.retain_grad()
    out.switch_loss.backward()
    torch.testing.assert_close(out.router.psum.grad, 10 * f / 30)


def test_expert_counts_equal_bincount_and_compile_to_no_index_put():
    """int64 counts, exact; compiled, no sort-based index_put fallback (the int64 scatter's)."""
    from torch._inductor.utils import run_and_get_code

    from moremoe.ops.balance import expert_counts
    idx = torch.randint(0, 37, (301, 3), dtype=torch.int32)
    idx[:50] = 5                                             # many duplicates of one expert
    want = torch.bincount(idx.reshape(-1).long(), minlength=37)
    got = expert_counts(idx, 37)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(expert_counts(idx[:0], 37), torch.zeros(37, dtype=torch.int64))
    torch._dynamo.reset()
    # no SIMD code: inductor picks its CPU vector ISA by itself and its generated C++ does
    # not build when ATEN_CPU_CAPABILITY lowers ATen's (the lowering tested here is the same)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        compiled, code = run_and_get_code(torch.compile(expert_counts), idx, 37)
    assert torch.equal(compiled, want)
    assert not any("index_put" in c for c in code)


def test_switch_loss_is_one_when_balanced():
    from moremoe.ops.balance import switch_loss
    M, N, k = 8, 64, 2
    counts = torch.full((M,), N * k // M)
    psum = torch.full((M,), N / M)
    assert switch_loss(psum, counts, N, k).item() == pytest.approx(1.0)


def test_eval_mode_has_no_aux_loss_but_counts_on_request():
    layer = MoELayer(MoEConfig.moe(8, 2, 16, 8)).eval()
    out = layer(torch.randn(7, 16), return_counts=True)
    assert out.aux_loss is None and out.switch_loss is None
    assert int(out.counts.sum()) == 14


def test_config_names_and_flops():
    moe, more = MoEConfig.moe(32, 4, 64, 8), MoEConfig.more(96, 4, 64, 8, 16)
    assert (moe.name, more.name) == ("MoE-32", "MoRE-96")           # the paper's names
    assert moe.label == "MoE(M=32, k=4, h=64, s=8)"
    assert more.label == "MoRE(M=96, k=4, h=64, s=8, r=16)"
    assert moe.active_flops() == 6 * 4 * 64 * 8 + 6 * 32 * 64
    assert more.active_flops(training=True) == 18 * 4 * 64 * 8 + 14 * (96 + 64) * 16
    assert not moe.is_lowrank and more.is_lowrank


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\], got 5"):
        MoEConfig.moe(4, 5, 16, 8)
    with pytest.raises(ValueError, match="top_k must be in"):
        MoEConfig.moe(4, 0, 16, 8)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 16\], got 0"):
        MoEConfig.more(4, 2, 16, 8, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 16\], got 17"):
        MoEConfig.more(4, 2, 16, 8, 17)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="balance_coef must be a finite number >= 0"):
            MoEConfig.moe(4, 2, 16, 8, balance_coef=bad)
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="init_std must be a finite number > 0"):
            MoEConfig.moe(4, 2, 16, 8, init_std=bad)
    with pytest.raises(TypeError, match="experts must be an int"):
        MoEConfig.moe(4.5, 2, 16, 8)
    layer = MoELayer(MoEConfig.moe(4, 2, 16, 8))
    with pytest.raises(ValueError, match="hidden = 16"):
        layer(torch.randn(3, 15))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(3, 16, dtype=torch.int32))


def test_constructor_arguments_of_the_modules_name_themselves():
    from moremoe.nn import LinearRouter, LowRankRouter, PEERConfig, SwiGLUExperts
    cfg = MoEConfig.moe(4, 2, 16, 8)
    with pytest.raises(TypeError, match="experts must be a SwiGLUExperts .*got str"):
        MoELayer(cfg, experts="not experts")
    with pytest.raises(TypeError, match="config must be a MoEConfig, got dict"):
        MoELayer({"experts": 4})
    with pytest.raises(TypeError, match="a PEERConfig builds a PEERLayer"):
        MoELayer(PEERConfig(experts=16, hidden=16, kappa=2))
    with pytest.raises(TypeError, match="balance_coef must be a number, got str"):
        MoEConfig.moe(4, 2, 16, 8, balance_coef="0.01")
    with pytest.raises(TypeError, match="init_std must be a number, got bool"):
        MoEConfig.moe(4, 2, 16, 8, init_std=True)
    with pytest.raises(ValueError, match="init_std must be a finite number > 0, got -1"):
        LinearRouter(16, 4, 2, init_std=-1)
    with pytest.raises(TypeError, match="init_std must be a number, got str"):
        LowRankRouter(16, 4, 2, 4, init_std="big")
    with pytest.raises(ValueError, match="init must be one of"):
        LowRankRouter(16, 4, 2, 4, init=None)
    with pytest.raises(ValueError, match="out_init_std must be a finite number > 0, got nan"):
        SwiGLUExperts(16, 8, 4, out_init_std=float("nan"))
    with pytest.raises(ValueError, match="impl must be one of"):
        SwiGLUExperts(16, 8, 4, impl=["reference"])
    with pytest.raises(TypeError, match="W must be a torch.Tensor, got list"):
        LowRankRouter.from_weight([[1.0, 2.0]], 1, 1)
