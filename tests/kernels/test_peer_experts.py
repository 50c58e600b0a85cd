"""PEER's expert kernels against the torch path (CPU: Triton interpreter): the forward and every
gradient (x, gates, u, v) within twice the error torch makes in the same dtype (flash-
attention's test), odd sizes (N = 1, 5, 123; h not a power of two), k = 1, an expert twice in
one token's row (two heads retrieving it), all tokens on one expert, fp32 master weights,
determinism and the op's dispatch."""
import pytest
import torch

pytest.importorskip("triton")
pk = pytest.importorskip("moremoe.kernels.peer_experts")
from moremoe.ops.peer_experts import peer_experts, peer_experts_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(N, h, M, k, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, h, generator=g)
    ids = torch.randint(0, M, (N, k), generator=g)
    gates = torch.softmax(torch.randn(N, k, generator=g), -1)
    u = torch.randn(M, h, generator=g) * h ** -0.5
    v = torch.randn(M, h, generator=g) * 0.3
    return [t.to(DEV) for t in (x.to(dtype), gates, ids, u.to(dtype), v.to(dtype))]


def within(got, torch_same, ref, atol):
    """|kernel - ref| <= 2 |torch - ref| + atol (max over elements)."""
    err = (got.double() - ref.double()).abs().max().item()
    base = (torch_same.double() - ref.double()).abs().max().item()
    assert err <= 2 * base + atol, (err, base)


def ref_grads(x, gates, ids, u, v, act, dy, dtype):
    """y and (dx, dgates, du, dv) of the torch path with every input in dtype."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gates, u, v)]
    xl, gl, ul, vl = leaves
    y = peer_experts_ref(xl, gl, ids, ul, vl, act)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def check(x, gates, ids, u, v, act="gelu", atol=1e-5):
    """Kernel against the torch path in the same dtype, both against the reference one
    precision up (fp64 for fp32 inputs, fp32 for half)."""
    hi = torch.float64 if x.dtype == torch.float32 else torch.float32
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    y_ref, g_ref = ref_grads(x, gates, ids, u, v, act, dy, hi)
    y_pt, g_pt = ref_grads(x, gates, ids, u, v, act, dy, x.dtype)
    y = pk.forward(x, gates, ids, u, v, act)
    assert y.dtype == x.dtype and y.shape == x.shape
    within(y, y_pt, y_ref, atol)
    got = pk.backward(dy.to(x.dtype), x, gates, ids, u, v, act)
    for name, a, b, r in zip(("dx", "dgates", "du", "dv"), got, g_pt, g_ref):
        assert a.shape == r.shape, name
        within(a, b, r, atol)


@pytest.mark.parametrize("N,h,M,k,act", [(1, 16, 9, 1, "gelu"), (5, 24, 16, 3, "relu"),
                                         (123, 40, 25, 6, "silu"), (37, 100, 49, 8, "gelu"),
                                         (6, 512, 64, 56, "gelu")])
def test_forward_and_gradients_fp32(N, h, M, k, act):
    check(*make(N, h, M, k), act=act)


@pytest.mark.parametrize("N,h,M,k,act", [(5, 24, 16, 3, "gelu"), (123, 40, 25, 6, "silu")])
def test_forward_and_gradients_fp16(N, h, M, k, act):
    check(*make(N, h, M, k, dtype=torch.float16), act=act, atol=1e-3)


def test_an_expert_twice_in_a_row_and_all_tokens_on_one_expert():
    x, gates, ids, u, v = make(40, 24, 36, 4)
    ids[:, 1] = ids[:, 0]                  # two heads retrieve the same expert
    check(x, gates, ids, u, v)
    ids = torch.full_like(ids, 7)           # one expert walks all N k pairs, 35 get none
    check(x, gates, ids, u, v)
    du = pk.backward(torch.ones_like(x), x, gates, ids, u, v)[2]
    assert du[7].abs().sum() > 0 and not du[torch.arange(36, device=DEV) != 7].any()


@pytest.mark.parametrize("N", [3, 60])      # rounded as loaded (N k <= 3 M), cast once
def test_fp32_weights_with_half_x_equal_the_cast_weights(N):
    x, gates, ids, u, v = make(N, 24, 49, 3)
    x = x.half()
    y32 = pk.forward(x, gates, ids, u, v)
    assert torch.equal(y32, pk.forward(x, gates, ids, u.half(), v.half()))
    dy = torch.randn_like(x)
    got = pk.backward(dy, x, gates, ids, u, v)
    want = pk.backward(dy, x, gates, ids, u.half(), v.half())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])   # dx, dgates
    for d32, d16 in zip(got[2:], want[2:]):
        assert d32.dtype == torch.float32 and torch.equal(d32.half(), d16)


def test_deterministic_run_to_run():
    x, gates, ids, u, v = make(50, 40, 16, 6)
    dy = torch.randn_like(x)
    a = pk.backward(dy, x, gates, ids, u, v)
    b = pk.backward(dy, x, gates, ids, u, v)
    assert all(torch.equal(s, t) for s, t in zip(a, b))


def test_empty_batch():
    x, gates, ids, u, v = make(0, 16, 9, 2)
    assert pk.forward(x, gates, ids, u, v).shape == (0, 16)
    dx, dg, du, dv = pk.backward(x, x, gates, ids, u, v)
    assert dx.shape == (0, 16) and dg.shape == (0, 2) and not du.any() and not dv.any()


@pytest.mark.parametrize("kernels", [False, True])
def test_pair_order_sorts_pairs_stably_with_int64_offsets(kernels):
    """routing_meta.pair_order (the PEER backward's and the router's sparse dW's sort): the
    sort and binary searches, or the metadata kernels (one launch here), the same."""
    from moremoe.kernels.routing_meta import pair_order
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [7, 3], [0, 7]], device=DEV)
    order, offsets = pair_order(ids, 9, kernels=kernels)
    assert order.dtype == torch.int64 and order.tolist() == [1, 5, 8, 3, 0, 2, 4, 7, 6, 9]
    assert offsets.dtype == torch.int64 and offsets.tolist() == [0, 3, 4, 4, 8, 8, 8, 8, 10, 10]


def test_op_autograd_equals_the_kernels_and_dispatch_checks():
    x, gates, ids, u, v = make(17, 24, 25, 4)
    leaves = [t.clone().requires_grad_() for t in (x, gates, u, v)]
    y = peer_experts(leaves[0], leaves[1], ids, leaves[2], leaves[3], impl="triton")
    dy = torch.randn_like(x)
    y.backward(dy)
    assert torch.equal(y.detach(), pk.forward(x, gates, ids, u, v))
    for got, want in zip((t.grad for t in leaves), pk.backward(dy, x, gates, ids, u, v)):
        assert torch.equal(got, want)
    ref = peer_experts(x, gates, ids, u, v, impl="reference")
    torch.testing.assert_close(ref, peer_experts_ref(x, gates, ids, u, v))
    with pytest.raises(ValueError, match=r"ids from \d+ to 25; they must be in \[0, 25\)"):
        peer_experts(x, gates, torch.where(ids == 0, 25, ids), u, v, impl="triton")
    with pytest.raises(ValueError, match="activation must be one of"):
        peer_experts(x, gates, ids, u, v, activation="tanh")
    wide = torch.zeros(1, 8193, device=DEV)
    with pytest.raises(ValueError, match="PEER kernels hold h <= 8192, got h=8193"):
        peer_experts(wide, gates[:1], ids[:1], u[:, :1].expand(25, 8193),
                     v[:, :1].expand(25, 8193), impl="triton")


def test_custom_ops_pass_opcheck():
    """Schema, fake tensors, autograd registration and AOT dispatch (torch.compile's path)."""
    from moremoe.ops import peer_experts as ope
    x, gates, ids, u, v = make(5, 24, 16, 3)
    leaves = [t.requires_grad_() for t in (x, gates, u, v)]
    torch.library.opcheck(ope.fwd_op, (*leaves[:2], ids, *leaves[2:], "silu"))
    dy = torch.randn_like(x)
    torch.library.opcheck(ope.bwd_op, (dy, *(t.detach() for t in leaves[:2]), ids,
                                       *(t.detach() for t in leaves[2:]), "silu"),
                          test_utils=("test_schema", "test_faketensor"))
