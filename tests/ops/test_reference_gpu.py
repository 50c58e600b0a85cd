"""The plain-torch reference router on the GPU (`pytest -m gpu -s` prints the figures): it is
the fallback beyond the fused kernels' limits, so its selection must cost about one
torch.topk of the same logits and the whole router about the router as plain torch writes
it. The paper's point: N = 262,144 tokens, h = 512, M = 8,192, r = 64, k = 4, bf16."""
import pytest
import torch

from gpu_share import others_on_this_gpu, skip_timing_if_shared
from moremoe.ops import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_serial,       # timings: the GPU alone
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _ms(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=40, return_mode="median")


def _inputs(N=262144, h=512, M=8192, r=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, h, device="cuda", generator=g).bfloat16()
    R1 = (torch.randn(M, r, device="cuda", generator=g) * 0.1).bfloat16()
    R2 = (torch.randn(r, h, device="cuda", generator=g) * 0.1).bfloat16()
    return x, R1, R2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_reference_selection_costs_about_one_topk(dtype, k):
    skip_timing_if_shared()
    x, R1, R2 = _inputs()
    logits = ((x @ R2.T) @ R1.T).to(dtype)
    del x
    select = _ms(lambda: ref.select_topk(logits, k))
    topk = _ms(lambda: torch.topk(logits, k, dim=-1))
    print(f"\nselect_topk {select:.2f} ms, torch.topk {topk:.2f} ms, ratio {select / topk:.2f} "
          f"({dtype}, k={k}, {torch.cuda.get_device_name()})")
    assert select <= 1.5 * topk


def test_reference_router_costs_about_the_plain_torch_router():
    x, R1, R2 = _inputs()

    def plain():       # the same logits (fp32 accumulation, z rounded to bf16), torch.topk
        z = (x.float() @ R2.float().T).bfloat16()
        val, idx = torch.topk(z.float() @ R1.float().T, 4, dim=1)
        return torch.softmax(val, dim=1), val

    def reference():
        val, idx, _ = ref.router_lowrank_ref(x, R1, R2, 4)
        return ref.topk_gates(val), val

    a, b = _ms(reference), _ms(plain)
    shared = bool(others_on_this_gpu())
    print(f"\nreference router {a:.2f} ms, plain torch {b:.2f} ms, ratio {a / b:.2f} "
          f"({torch.cuda.get_device_name()})")
    assert shared or a <= 1.5 * b       # the timing only on a GPU of its own
    # the same k values, within fp32's error bound, in every row whose z rounds the same
    # (fp32 sums round onto the other side of a bf16 midpoint in a few elements)
    from moremoe.ops import route_exact as exact
    z_ref, z_plain = ref.lowrank_z(x, R2), (x.float() @ R2.float().T).bfloat16()
    same = (z_ref == z_plain).all(1)
    assert same.float().mean() > 0.99
    bound = exact.dot_bound(R1.shape[1], z_ref.float().norm(dim=1).max(),
                            R1.float().norm(dim=1).max())
    torch.testing.assert_close(reference()[1][same],
                               plain()[1].sort(1, descending=True).values[same],
                               rtol=0, atol=2 * bound.item())
