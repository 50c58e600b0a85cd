"""The routing contract (docs/design.md) on the plain-torch path, the CPU's router and the
GPU fallback: bf16 inputs route as the exact top-k of the logits accumulated in fp32 (z
rounded to bf16 for the low-rank router), not of logits rounded to bf16, and a row's experts
do not depend on the rows routed with it."""
import pytest
import torch

from moremoe.ops import reference as ref


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
