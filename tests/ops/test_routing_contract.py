"""The routing contract (docs/design.md) on the plain-torch path, the CPU's router and the
GPU fallback: bf16 inputs route as the exact top-k of the logits accumulated in fp32 (z
rounded to bf16 for the low-rank router), not of logits rounded to bf16, and a row's experts
do not depend on the rows routed with it."""
import pytest
import torch

from moremoe.ops import reference as ref
from numerics import another_blas as _another_blas


def _inputs(N=4096, h=256, M=1024, r=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, h, generator=g).bfloat16()
    R1 = (torch.randn(M, r, generator=g) * 0.2).bfloat16()
    R2 = (torch.randn(r, h, generator=g) * 0.1).bfloat16()
    W = (torch.randn(M, h, generator=g) * 0.05).bfloat16()
    return x, R1, R2, W


def _exact_lowrank(x, R1, R2):
    """float64 logits from z = x R2ᵀ rounded to bf16 (through fp32, as the contract)."""
    z = (x.double() @ R2.double().T).float().bfloat16()
    return z.double() @ R1.double().T


def _sets(idx):
    return idx.long().sort(1).values


@pytest.mark.parametrize("router", ["lowrank", "linear"])
def test_bf16_routes_as_the_exact_top_k(router):
    x, R1, R2, W = _inputs()
    if router == "lowrank":
        val, idx, _ = ref.router_lowrank_ref(x, R1, R2, 4)
        exact = _exact_lowrank(x, R1, R2)
        in_bf16 = (x @ R2.T) @ R1.T                   # what the reference used to select on
    else:
        val, idx, _ = ref.router_linear_ref(x, W, 4)
        exact = x.double() @ W.double().T
        in_bf16 = x @ W.T
    want = exact.topk(4, dim=1)
    assert torch.equal(idx.long(), want.indices)
    # values: fp32 accumulation's error, and for the low-rank router an element of z that
    # fp32 and fp64 accumulation round to neighbouring bf16 values (one ulp, 2^-8 relative)
    z_ulp = 2 ** -8 * float((x.float() @ R2.float().T).abs().max() * R1.float().abs().max())
    torch.testing.assert_close(val.double(), want.values, rtol=2e-6,
                               atol=z_ulp if router == "lowrank" else 1e-6)
    # logits rounded to bf16 tie and reorder: a share of the rows would route otherwise
    old = ref.select_topk(in_bf16, 4)[1]
    assert (_sets(old) != _sets(idx)).any(1).float().mean() > 0.01


@pytest.mark.parametrize("router", ["lowrank", "linear"])
def test_a_rows_experts_do_not_depend_on_its_batch(router):
    x, R1, R2, W = _inputs(N=1024)

    def route(rows):
        if router == "lowrank":
            return ref.router_lowrank_ref(rows, R1, R2, 4)[1]
        return ref.router_linear_ref(rows, W, 4)[1]
    whole = route(x)
    for chunk in (1, 7, 64, 333):
        n = 128 if chunk < 64 else 1024
        got = torch.cat([route(x[i:min(i + chunk, n)]) for i in range(0, n, chunk)])
        assert torch.equal(got, whole[:n]), f"chunks of {chunk}"


def test_fp32_inputs_keep_fp32_and_fp64_keeps_fp64():
    x, R1, R2, _ = _inputs(N=16, h=32, M=40, r=8)
    for dt in (torch.float32, torch.float64):
        logits = ref.router_logits_lowrank(x.to(dt), R1.to(dt), R2.to(dt))
        assert logits.dtype == dt
        want = (x.to(dt) @ R2.to(dt).T) @ R1.to(dt).T
        torch.testing.assert_close(logits, want)


def _tied_inputs(N=512, h=64, M=48, r=16):
    """Experts 3 and 7 identical and the strongest for most rows: an exact tie at the top
    that fp32 sums in another order split either way."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(N, h, generator=g) + 0.5).bfloat16()
    W = (torch.randn(M, h, generator=g) * 0.02).bfloat16()
    W[3] = W[7] = 0.05
    R2 = (torch.randn(r, h, generator=g) * 0.1).bfloat16()
    R2[0] = 0.1
    R1 = (torch.randn(M, r, generator=g) * 0.02).bfloat16()
    R1[3] = R1[7] = 0.5
    return x, W, R1, R2


@pytest.mark.parametrize("router", ["lowrank", "linear"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_another_summation_order_routes_the_same(router, seed, monkeypatch):
    """What a CPU with another BLAS computes differs in the fp32 sums' last bits; the rows
    fp32 cannot decide (here the exact tie of experts 3 and 7) are decided on fp64, so
    every machine routes as the exact top-k: 3 before 7."""
    x, W, R1, R2 = _tied_inputs()
    if router == "lowrank":
        exact = _exact_lowrank(x, R1, R2)
        route = lambda: ref.router_lowrank_ref(x, R1, R2, 2)          # noqa: E731
    else:
        exact = x.double() @ W.double().T
        route = lambda: ref.router_linear_ref(x, W, 2)                # noqa: E731
    want_val, want_idx = ref.select_topk(exact, 2)
    assert (want_idx == torch.tensor([3, 7], dtype=torch.int32)).all(1).float().mean() > 0.8
    _another_blas(monkeypatch, seed)
    val, idx, _ = route()
    assert torch.equal(idx, want_idx)
    assert torch.all(val[:, 0] >= val[:, 1])
    torch.testing.assert_close(val.double(), want_val, rtol=1e-5, atol=1e-6)


def test_z_at_a_rounding_midpoint_rounds_as_the_exact_product(monkeypatch):
    """z = 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): it rounds to
    even, 1, whatever side of it an fp32 sum in another order lands on."""
    x = torch.zeros(64, 16)
    x[:, 0], x[:, 1] = 1.0, 2.0 ** -8
    x[:, 2:] = torch.randn(64, 14) * 2.0 ** -14          # tiny terms, summed in some order
    x = x.bfloat16()
    R2 = torch.zeros(4, 16).bfloat16()
    R2[:, :2] = 1.0
    R2[:, 2:] = torch.randn(4, 14).bfloat16()
    want = (x.double() @ R2.double().T).float().bfloat16()
    for seed in range(3):
        with monkeypatch.context() as m:
            _another_blas(m, seed)
            assert torch.equal(ref.lowrank_z(x, R2), want)


def test_z_is_rounded_once_not_through_float32():
    """z = 1 + 2^-8 + 2^-30: fp32 rounds it onto the bf16 midpoint 1 + 2^-8, where bf16's
    ties-to-even would then give 1; rounded once it is above the midpoint: 1 + 2^-7. The
    same for fp16 (1 + 2^-11 + 2^-24, fp16's smallest value, -> 1 + 2^-10), and below."""
    import moremoe.ops.route_exact as exact
    for dtype, half, tiny in ((torch.bfloat16, 2.0 ** -8, 2.0 ** -30),
                              (torch.float16, 2.0 ** -11, 2.0 ** -24)):
        x = torch.tensor([[1.0, half, tiny], [1.0, half, -tiny]]).to(dtype)
        R2 = torch.ones(1, 3, dtype=dtype)
        z = ref.lowrank_z(x, R2)[:, 0].double()
        assert z.tolist() == [1 + 2 * half, 1.0]
        z64 = torch.tensor([1 + half + tiny, 1 + half, -(1 + half + tiny)],
                           dtype=torch.float64)
        assert exact.round_once(z64, dtype).double().tolist() == [1 + 2 * half, 1.0,
                                                                  -(1 + 2 * half)]


def test_rows_of_zeros_route_to_the_lowest_experts():
    """Padding tokens (x = 0): every logit ties at 0, so the lowest indices, with zero z."""
    x, R1, R2, W = _inputs(N=64, h=32, M=40, r=8)
    x[::2] = 0
    assert not ref.lowrank_z(x, R2)[::2].any()
    val, idx, _ = ref.router_lowrank_ref(x, R1, R2, 3)
    assert (idx[::2] == torch.tensor([0, 1, 2], dtype=torch.int32)).all()  # ties: lowest


def test_an_empty_batch_routes():
    x, R1, R2, W = _inputs(N=0, h=32, M=40, r=8)
    assert ref.router_lowrank_ref(x, R1, R2, 3)[1].shape == (0, 3)
    assert ref.router_linear_ref(x, W, 3)[1].shape == (0, 3)


@pytest.mark.parametrize("router", ["lowrank", "linear"])
def test_blocks_of_rows_route_as_the_whole_batch(router, monkeypatch):
    """Eager inference takes the rows a block of logits at a time; with blocks of 3 rows
    (and a tied pair of experts on most rows, so the fp64 decision runs in every block) it
    routes as the whole batch does, which training's autograd path computes at once."""
    x, W, R1, R2 = _tied_inputs(N=100)
    route = ((lambda x: ref.router_lowrank_ref(x, R1, R2, 2)) if router == "lowrank" else
             (lambda x: ref.router_linear_ref(x, W, 2)))
    whole = route(x.clone().requires_grad_())            # autograd: one (N, M) tensor
    monkeypatch.setattr(ref, "BLOCK_BYTES", 3 * 4 * W.shape[0])
    blocks = route(x)
    assert torch.equal(blocks[1], whole[1])
    torch.testing.assert_close(blocks[0], whole[0].detach(), rtol=1e-6, atol=1e-6)


def test_only_a_cpu_selects_in_blocks():
    """The blocks pay where a block's logits stay in cache; on a GPU 1,024 blocks of a few
    launches each put the reference router past 1.5x plain torch's (the GPU test
    test_reference_router_costs_about_the_plain_torch_router failed at 7bf53c2)."""
    assert ref.in_blocks(torch.device("cpu"))
    assert not ref.in_blocks(torch.device("cuda"))
    assert not ref.in_blocks(torch.device("cuda", 1))


def test_a_wide_doubt_is_decided_on_whole_rows(monkeypatch):
    """A row doubtful among more experts than route_exact.CANDIDATES is summed whole in
    fp64: the same experts as the candidates' way."""
    import moremoe.ops.route_exact as exact
    x, W, R1, R2 = _tied_inputs()
    want = ref.router_linear_ref(x, W, 2)[1]
    monkeypatch.setattr(exact, "CANDIDATES", 1)
    assert torch.equal(ref.router_linear_ref(x, W, 2)[1], want)


def test_fp32_z_is_the_exact_product_rounded_once():
    """fp32 inputs: z is the fp64 product rounded once to fp32 (not the fp32 sum), so the
    low-rank router routes as the exact top-k of those z, whatever the summation order."""
    g = torch.Generator().manual_seed(3)
    x, R2 = torch.randn(256, 64, generator=g), torch.randn(16, 64, generator=g) * 0.1
    R1 = torch.randn(300, 16, generator=g) * 0.2
    z = ref.lowrank_z(x, R2)
    assert torch.equal(z, (x.double() @ R2.double().T).float())
    want = ref.select_topk(z.double() @ R1.double().T, 4)[1]
    assert torch.equal(ref.router_lowrank_ref(x, R1, R2, 4)[1], want)
