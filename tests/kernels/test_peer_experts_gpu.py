"""GPU tests of PEER's expert kernels (`pytest -m gpu` on the device machine): the paper's
matched configuration (M = 388², k = H κ = 448, h = 512) in bf16 against the reference,
every gradient, run-to-run determinism, the layer's fused path against its torch path, and
int64-safe offsets (N k and N h past 2^31)."""
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _setup(N, h, M, k, seed=0, ids=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, h, device="cuda", generator=g).bfloat16()
    if ids is None:
        ids = torch.randint(0, M, (N, k), device="cuda", generator=g, dtype=torch.int32)
    gates = torch.softmax(torch.randn(N, k, device="cuda", generator=g), -1)
    u = (torch.randn(M, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
    v = (torch.randn(M, h, device="cuda", generator=g) * 0.05).bfloat16()
    return x, gates, ids, u, v


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_paper_size_forward_within_twice_torch_error_and_every_gradient():
    from moremoe.kernels import peer_experts as pk
    from moremoe.ops.peer_experts import peer_experts_ref
    x, gates, ids, u, v = _setup(4096, 512, 388 ** 2, 448)
    y = pk.forward(x, gates, ids, u, v)
    ref = peer_experts_ref(x, gates, ids, u, v, upcast=True)
    torch_bf16 = peer_experts_ref(x, gates, ids, u, v)
    assert (y.float() - ref).abs().max() <= 2 * (torch_bf16.float() - ref).abs().max() + 1e-3
    dy = torch.randn_like(y)
    got = pk.backward(dy, x, gates, ids, u, v)
    leaves = [t.float().requires_grad_() for t in (x, gates, u, v)]
    peer_experts_ref(leaves[0], leaves[1], ids, leaves[2], leaves[3]).backward(dy.float())
    for name, a, b in zip(("dx", "dgates", "du", "dv"), got, (t.grad for t in leaves)):
        assert _rel(a, b) < 1e-2, name
    again = pk.backward(dy, x, gates, ids, u, v)
    assert all(torch.equal(a, b) for a, b in zip(got, again))        # no atomics


def _layer_grads(layer, x, impl, autocast):
    layer.config = replace(layer.config, impl=impl)
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xg).y
    y.float().square().mean().backward()
    return [y.detach(), xg.grad] + [p.grad for p in layer.parameters()]


def test_layer_fused_path_equals_the_torch_path(monkeypatch):
    """The paper's PEER layer, fused experts against the torch path on the same retrieval
    (the torch one in both runs): in fp32 every output and gradient; with fp32 weights under
    bf16 autocast (as the trainer runs it) y and dx to bf16 rounding; the bf16 forward.
    Then everything fused (the retrieval kernel too, which may rank near-ties otherwise)
    against everything torch, y within 5 %."""
    import moremoe.nn.peer as peer_mod
    from moremoe.nn.peer import PEERConfig, PEERLayer
    torch.manual_seed(0)
    cfg = PEERConfig(experts=388 ** 2, hidden=512, heads=8, d_q=32, kappa=56)
    layer = PEERLayer(cfg).cuda()
    x = torch.randn(2048, 512, device="cuda")
    whole = []
    with torch.no_grad():
        for impl in ("triton", "reference"):
            layer.config = replace(cfg, impl=impl)
            whole.append(layer(x).y)
    assert _rel(*whole) < 5e-2
    retrieval = peer_mod.peer_retrieval
    monkeypatch.setattr(peer_mod, "peer_retrieval",
                        lambda q, keys, kappa, impl: retrieval(q, keys, kappa, impl="reference"))
    fused, plain = (_layer_grads(layer, x, impl, False) for impl in ("triton", "reference"))
    for a, b in zip(fused, plain):
        assert _rel(a, b) < 5e-3          # fp32 (TF32, if a caller allowed it, in torch's)
    fused, plain = (_layer_grads(layer, x, impl, True)[:2] for impl in ("triton", "reference"))
    for a, b in zip(fused, plain):
        assert _rel(a, b) < 2e-2
    layer.bfloat16()
    with torch.no_grad():
        ys = []
        for impl in ("triton", "reference"):
            layer.config = replace(cfg, impl=impl)
            ys.append(layer(x.bfloat16()).y)
    assert _rel(*ys) < 2e-2


@pytest.mark.gpu_serial          # tens of GB: the GPU to itself
def test_int64_offsets_beyond_2_pow_31_forward():
    """N k > 2^31 pairs and N h > 2^31 elements: the last tokens against the reference."""
    from moremoe.kernels import peer_experts as pk
    from moremoe.ops.peer_experts import peer_experts_ref
    N, h, M, k = 2 ** 22 + 3, 512, 1024, 512
    assert N * k > 2 ** 31 and N * h > 2 ** 31
    x, gates, ids, u, v = _setup(N, h, M, k, seed=1)
    y = pk.forward(x, gates, ids, u, v)
    tail = slice(N - 1024, N)
    ref = peer_experts_ref(x[tail], gates[tail], ids[tail], u, v, upcast=True)
    assert _rel(y[tail], ref) < 1e-2


@pytest.mark.gpu_serial          # tens of GB: the GPU to itself
def test_int64_offsets_beyond_2_pow_31_backward():
    """N h > 2^31: the last 1,024 tokens alone use the last 64 experts, so their dx, dgates
    and those experts' du, dv are the reference's on the tail."""
    from moremoe.kernels import peer_experts as pk
    from moremoe.ops.peer_experts import peer_experts_ref
    N, h, M, k, T = 2 ** 22 + 3, 512, 4096, 4, 1024
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, M - 64, (N, k), device="cuda", generator=g, dtype=torch.int32)
    ids[-T:] = torch.randint(M - 64, M, (T, k), device="cuda", generator=g, dtype=torch.int32)
    x, gates, ids, u, v = _setup(N, h, M, k, seed=2, ids=ids)
    dy = torch.randn_like(x)
    dx, dgates, du, dv = pk.backward(dy, x, gates, ids, u, v)
    tail = slice(N - T, N)
    leaves = [t.float().requires_grad_() for t in (x[tail], gates[tail], u, v)]
    peer_experts_ref(leaves[0], leaves[1], ids[tail], leaves[2], leaves[3]).backward(
        dy[tail].float())
    ref = [t.grad for t in leaves]
    assert _rel(dx[tail], ref[0]) < 1e-2 and _rel(dgates[tail], ref[1]) < 1e-2
    assert _rel(du[-64:], ref[2][-64:]) < 1e-2 and _rel(dv[-64:], ref[3][-64:]) < 1e-2
