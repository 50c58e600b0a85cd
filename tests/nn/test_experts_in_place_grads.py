"""SwiGLUExperts.accumulate_grads_in_place: the fused backward adds the weight gradients into
the parameters' fp32 .grad across micro-steps (CPU: Triton interpreter, odd sizes)."""
import pytest
import torch

pytest.importorskip("triton")
from moremoe.nn import SwiGLUExperts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# beyond plain torch's own error, relative to the largest value: one fp32 ulp where the
# kernels' products are exact fp32 (the CPU interpreter); 16 TF32 ulps on a GPU, where tl.dot
# takes fp32 operands in TF32 (two chained products of rounded operands, three micro-steps;
# measured on an H100: 0.048 at a largest value of 17, 5.8 ulps), while torch's fp32
# reference matmuls stay fp32
KERNEL_TOL = 16 * 2.0 ** -10 if DEV == "cuda" else torch.finfo(torch.float32).eps
N, H, S, M, K = 13, 24, 20, 5, 2


def _pair(seed=0):
    torch.manual_seed(seed)
    fused = SwiGLUExperts(H, S, M, impl="triton", init_std=0.3).to(DEV)
    ref = SwiGLUExperts(H, S, M, impl="reference").to(DEV).double()
    ref.load_state_dict({k: v.double() for k, v in fused.state_dict().items()})
    return fused, ref


def _batches(steps, n=N):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(n, H, generator=g)
        idx = torch.stack([torch.randperm(M, generator=g)[:K] for _ in range(n)] or
                          [torch.zeros(0, K, dtype=torch.long)]).int().reshape(n, K)
        gates = torch.softmax(torch.randn(n, K, generator=g), -1)
        dy = torch.randn(n, H, generator=g)
        out.append(tuple(t.to(DEV) for t in (x, gates, idx, dy)))
    return out


def _micro_steps(module, batches, dtype=torch.float32):
    for x, gates, idx, dy in batches:
        (module(x.to(dtype), gates.to(dtype), idx) * dy.to(dtype)).sum().backward()
    return [w.grad.clone() for w in module.weights()]


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_in_place_gradients_equal_autograds_and_the_fp64_reference(steps):
    """After 1, 2, 3 micro-steps: bit for bit what AccumulateGrad makes of the same kernels'
    gradients (the same fp32 adds, in the same order), and within the kernels' error of the
    fp64 reference: twice plain fp32 torch's own error plus KERNEL_TOL of the largest value."""
    fused, ref64 = _pair()
    batches = _batches(steps)
    want_autograd = _micro_steps(fused, batches)
    fused.zero_grad(set_to_none=True)
    fused.accumulate_grads_in_place()
    got = _micro_steps(fused, batches)
    want = _micro_steps(ref64, batches, torch.float64)
    ref32 = SwiGLUExperts(H, S, M, impl="reference").to(DEV)
    ref32.load_state_dict(fused.state_dict())
    plain = _micro_steps(ref32, batches)
    for g, a, w, p in zip(got, want_autograd, want, plain):
        assert g.dtype == torch.float32
        assert torch.equal(g, a)
        err, bound = (g.double() - w).abs().max(), (p.double() - w).abs().max()
        assert err <= 2 * bound + KERNEL_TOL * w.abs().max()


def test_a_restart_overwrites_stale_values_without_reading_them():
    fused, _ = _pair()
    batches = _batches(2)
    fused.accumulate_grads_in_place()
    want = _micro_steps(fused, batches)
    for w in fused.weights():
        w.grad.fill_(float("nan"))          # stale memory: never read after a restart
    fused.restart_grads()
    assert fused.grad_keep.item() == 0
    got = _micro_steps(fused, batches)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert fused.grad_keep.item() == 1
    assert all(w.grad is g for w, g in zip(fused.weights(), (fused.g_gate, fused.g_up,
                                                              fused.g_down)))


def test_a_micro_step_with_no_tokens_stores_zeros_or_keeps_the_sum():
    fused, _ = _pair()
    fused.accumulate_grads_in_place()
    for w in fused.weights():
        w.grad.fill_(float("nan"))
    _micro_steps(fused, _batches(1, n=0))
    assert all(torch.equal(w.grad, torch.zeros_like(w)) for w in fused.weights())
    one = _micro_steps(fused, _batches(1))
    assert all(torch.equal(a, b) for a, b in zip(_micro_steps(fused, _batches(1, n=0)), one))


def test_compiled_micro_steps_accumulate_like_eager():
    """torch.compile keeps the backward's declared writes into the buffers (graph inputs)."""
    fused, _ = _pair()
    batches = _batches(2)
    fused.accumulate_grads_in_place()
    want = _micro_steps(fused, batches)
    fused.restart_grads()
    step = torch.compile(lambda x, g, i: fused(x, g, i), backend="aot_eager", fullgraph=True)
    for x, gates, idx, dy in batches:
        (step(x, gates, idx) * dy).sum().backward()
    assert all(torch.equal(w.grad, g) for w, g in zip(fused.weights(), want))


def test_the_reference_path_refuses_in_place_gradients():
    fused, _ = _pair()
    fused.impl = "reference"
    fused.accumulate_grads_in_place()
    x, gates, idx, _ = _batches(1)[0]
    with pytest.raises(RuntimeError, match="needs the fused kernels"):
        fused(x, gates, idx)
    with torch.no_grad():                   # evaluation: nothing to accumulate
        fused(x, gates, idx)


def test_the_in_place_backward_op_declares_its_writes():
    """opcheck: the schema's mutated arguments (g_*, keep) are the ones the body writes, and
    the fake implementation matches, which torch.compile relies on to keep the writes."""
    from moremoe.ops import swiglu_experts as ose
    fused, _ = _pair()
    x, gates, idx, dy = _batches(1)[0]
    ws = [w.detach() for w in fused.weights()]
    saved = ose._train(x, gates, idx, *ws)
    into = [torch.zeros_like(w) for w in ws] + [torch.zeros(1, dtype=torch.int32, device=DEV)]
    torch.library.opcheck(ose.bwd_into_op, (dy, x, gates, idx, *ws, *saved[1:], *into))
