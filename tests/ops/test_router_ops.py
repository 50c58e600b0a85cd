"""The router ops: fused path against the reference through autograd, the custom ops'
registrations (opcheck), torch.compile tracing, and implementation dispatch."""
import pytest
import torch

from moremoe.nn import LinearRouter, LowRankRouter, MoEConfig, MoELayer
from moremoe.ops import router_linear as orl
from moremoe.ops import router_lowrank as orr
from moremoe.ops.dispatch import resolve_impl

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N=29, h=24, M=140, r=8):
    x = torch.randn(N, h, device=DEV, requires_grad=True)
    R1 = (torch.randn(M, r, device=DEV) * 0.4).requires_grad_()
    R2 = (torch.randn(r, h, device=DEV) * 0.4).requires_grad_()
    W = (torch.randn(M, h, device=DEV) * 0.2).requires_grad_()
    return x, R1, R2, W


def _loss(val, gates, psum, seed=1):
    g = torch.Generator(device=val.device).manual_seed(seed)
    a = torch.randn(val.shape, generator=g, device=val.device)
    b = torch.randn(psum.shape, generator=g, device=val.device)
    return (val * a).sum() + (gates * a.flip(1)).sum() + (psum * b).sum()


@pytest.mark.parametrize("router", ["lowrank", "linear"])
def test_fused_training_path_matches_reference_gradients(router):
    x, R1, R2, W = _inputs()
    params = (x, R1, R2) if router == "lowrank" else (x, W)
    results = {}
    for impl in ("reference", "triton"):
        if router == "lowrank":
            val, idx, gates, psum = orr.router_lowrank(x, R1, R2, 4, with_psum=True, impl=impl)
        else:
            val, idx, gates, psum = orl.router_linear(x, W, 4, with_psum=True, impl=impl)
        grads = torch.autograd.grad(_loss(val, gates, psum), params)
        results[impl] = (val, idx, psum, grads)
    (v0, i0, p0, g0), (v1, i1, p1, g1) = results["reference"], results["triton"]
    assert torch.equal(i0, i1)
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_inference_path_without_grad():
    x, R1, R2, _ = _inputs()
    with torch.no_grad():
        fused = orr.router_lowrank(x, R1, R2, 3, impl="triton")
        ref = orr.router_lowrank(x, R1, R2, 3, impl="reference")
    assert fused[3] is None and torch.equal(fused[1], ref[1])
    torch.testing.assert_close(fused[2], ref[2])


def test_gradient_without_balancing_loss_uses_the_sparse_path():
    x, R1, R2, _ = _inputs()
    grads = []
    for impl in ("reference", "triton"):
        val, _, gates, psum = orr.router_lowrank(x, R1, R2, 4, impl=impl)
        assert psum is None
        grads.append(torch.autograd.grad((gates * val).sum(), (x, R1, R2)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_custom_op_registrations_pass_opcheck():
    z = torch.randn(20, 16, device=DEV)
    R1 = torch.randn(70, 16, device=DEV) * 0.3
    x = torch.randn(20, 16, device=DEV)
    R2 = torch.randn(16, 16, device=DEV) * 0.3
    torch.library.opcheck(orr.infer_op, (x, R1, R2, 3))
    torch.library.opcheck(orr.train_op, (z.requires_grad_(), R1.requires_grad_(), 3, True))
    torch.library.opcheck(orl.train_op, (x.requires_grad_(), R1.requires_grad_(), 2, True))


@pytest.mark.parametrize("cls", [LowRankRouter, LinearRouter])
def test_torch_compile_traces_the_custom_ops(cls):
    torch.manual_seed(3)
    router = (cls(16, 70, 3, 8, impl="triton") if cls is LowRankRouter
              else cls(16, 70, 3, impl="triton")).to(DEV).train()
    x = torch.randn(25, 16, device=DEV)

    def step(x_):
        out = router(x_)
        return (out.gates * out.topk_val).sum() + out.psum.square().sum()

    eager = step(x)
    eager_grads = torch.autograd.grad(eager, list(router.parameters()))
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    got_grads = torch.autograd.grad(got, list(router.parameters()))
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_layer_with_fused_router_equals_reference_layer():
    cfg = MoEConfig.more(40, 2, 16, 8, 4, router_impl="triton")
    fused = MoELayer(cfg).to(DEV).train()
    ref = MoELayer(MoEConfig.more(40, 2, 16, 8, 4, router_impl="reference")).to(DEV).train()
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, 16, device=DEV)
    a, b = fused(x), ref(x)
    torch.testing.assert_close(a.y, b.y)
    torch.testing.assert_close(a.aux_loss, b.aux_loss)


def test_dispatch():
    cpu = torch.zeros(2, 3)
    assert resolve_impl("auto", cpu, 2) == "reference"      # CPU: the reference by default
    assert resolve_impl("reference", cpu, 2) == "reference"
    assert resolve_impl("auto", cpu.double(), 2) == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("cuda", cpu, 2)
    with pytest.raises(ValueError, match="router_impl must be one of"):
        MoEConfig.moe(4, 2, 8, 8, router_impl="fast")


def test_every_kernel_limit_is_decided_in_dispatch(monkeypatch):
    """A rank, k or dtype beyond the kernels: "auto" takes the reference, "triton" names
    the limit. (usable_on is made true so that the decision is the limit's alone.)"""
    from moremoe import kernels
    from moremoe.ops.dispatch import kernel_limit
    monkeypatch.setattr(kernels, "usable_on", lambda device: True)
    x = torch.zeros(3, 8)
    assert kernel_limit(x, 4, 64) is None
    assert "rank r=600" in kernel_limit(x, 4, 600)
    assert "top_k=65" in kernel_limit(x, 65)
    assert "float64" in kernel_limit(x.double())
    from types import SimpleNamespace
    cuda_like = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert resolve_impl("auto", cuda_like, 4, rank=64) == "triton"
    assert resolve_impl("auto", cuda_like, 4, rank=600) == "reference"
    assert resolve_impl("auto", cuda_like, 65) == "reference"
    with pytest.raises(ValueError, match=r"impl='triton': the kernels do not cover rank "
                                         r"r=600 \(they hold at most 512\)"):
        resolve_impl("triton", cuda_like, 4, rank=600)
