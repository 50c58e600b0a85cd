"""GPU tests of the grouped expert kernels (`pytest -m gpu` on the device machine): full size
in bf16 against the reference, and int64-safe offsets with N·k·h > 2^31."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _setup(N, h, s, M, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(N, M, device="cuda", generator=g) if N * M <= 2 ** 31 else None
    idx = (logits.topk(k, 1).indices if logits is not None else
           torch.randint(0, M, (N, k), device="cuda", generator=g))
    gates = torch.softmax(torch.randn(N, k, device="cuda", generator=g), -1)
    ws = [(torch.randn(*shape, device="cuda", generator=g) * 0.05).bfloat16()
          for shape in ((M, s, h), (M, s, h), (M, h, s))]
    return x, gates, idx.int(), ws


def test_full_size_forward_and_backward_bf16():
    from moremoe.kernels import moe_gemm as mg
    from moremoe.ops.reference import swiglu_experts_ref
    x, gates, idx, ws = _setup(65536, 512, 64, 8192, 4)
    y, act, g, u = mg.forward(x, gates, idx, *ws, save=True)
    ref = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    dy = torch.randn_like(y)
    got = mg.backward(dy, x, gates, idx, *ws, act, g, u)
    xr, gr = x.float().requires_grad_(), gates.clone().requires_grad_()
    wr = [w.float().requires_grad_() for w in ws]
    (swiglu_experts_ref(xr, gr, idx, *wr) * dy.float()).sum().backward()
    for a, b in zip(got, (xr.grad, gr.grad, *[w.grad for w in wr])):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-2


def test_int64_offsets_beyond_2_pow_31():
    from moremoe.kernels import moe_gemm as mg
    from moremoe.ops.reference import swiglu_experts_ref
    N, h, s, M, k = 2 ** 20 + 5, 512, 64, 256, 4
    assert N * k * h > 2 ** 31
    x, gates, idx, ws = _setup(N, h, s, M, k, seed=1)
    y = mg.forward(x, gates, idx, *ws)
    tail = slice(N - 2048, N)
    ref = swiglu_experts_ref(x[tail], gates[tail], idx[tail], *ws, upcast=True)
    assert ((y[tail].float() - ref).norm() / ref.norm()).item() < 1e-2
