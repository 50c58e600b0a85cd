"""The torch._grouped_mm experts baseline computes the experts (CPU: torch's fallback of the
grouped GEMM), with and without padded groups, and the layer/decode summaries read rows."""
import pytest
import torch

from moremoe.bench.grouped_mm import GroupedWeights, grouped_mm_experts
from moremoe.bench.layer_summary import decode_ratios, layer_ratios
from moremoe.ops.reference import swiglu_experts_ref

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm")


@pytest.mark.parametrize("pad", [0, 16])
@pytest.mark.parametrize("N,h,s,M,k", [(37, 32, 16, 9, 3), (5, 16, 16, 64, 4), (64, 16, 32, 3, 1)])
def test_grouped_mm_experts_match_the_reference(N, h, s, M, k, pad):
    g = torch.Generator().manual_seed(N + M)
    x = torch.randn(N, h, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(M, generator=g)[:k] for _ in range(N)])
    idx[: N // 2, 0] = 0                              # one crowded expert, some with none
    gates = torch.softmax(torch.randn(N, k, generator=g), -1)
    ws = [(torch.randn(*shape, generator=g) * 0.3).bfloat16()
          for shape in ((M, s, h), (M, s, h), (M, h, s))]
    y = grouped_mm_experts(x, gates, idx, GroupedWeights.of(*ws), pad=pad)
    ref = swiglu_experts_ref(x, gates, idx, *ws, upcast=True)
    assert y.shape == (N, h) and y.dtype == torch.bfloat16
    # bf16 products, fp32 accumulation over h then s, act rounded to bf16 between them
    tol = 2 ** -7 * (1 + ref.float().abs().max().item())
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=2 ** -6)


def _row(bench, variant, h, M, ms, B=None, **kw):
    return {"bench": bench, "variant": variant, "h": h, "M": M, "B": B, "ms": ms, "s": 64,
            "sweep": "grid", **kw}


def test_layer_ratios_take_the_faster_standard_router_and_the_newest_rows():
    rows = [_row("layer", "moe_unfused", 1024, 8192, 99.0),          # superseded below
            _row("layer", "moe_unfused", 1024, 8192, 30.0), _row("layer", "moe_fused", 1024,
                                                                   8192, 12.0),
            _row("layer", "more_fused", 1024, 8192, 4.0), _row("layer", "more_fused", 64, 512, 1.0)]
    (r,) = layer_ratios(rows)
    assert r["h"] == 1024
    assert (r["vs_unfused"], r["vs_best_standard"]) == (pytest.approx(7.5), pytest.approx(3.0))


def test_decode_ratios_pair_more_at_8x_the_experts_with_moe():
    rows = [_row("decode", "moe_fused", 512, 64, 0.100, B=4, ratio_to_floor=2.0),
            _row("decode", "more_fused", 512, 512, 0.104, B=4, ratio_to_floor=1.2),
            _row("decode", "moe_fused", 512, 128, 0.050, B=4),
            _row("decode", "more_fused", 512, 1024, 0.060, B=4),
            _row("decode", "more_fused_walk", 512, 1024, 0.010, B=4)]
    (r,) = decode_ratios(rows)
    assert r["pairs"] == 2 and r["within_5pct"] == 1 and r["worst"] == pytest.approx(1.2)
    assert r["min_step_ms"] == pytest.approx(0.050) and r["max_to_floor"] == pytest.approx(2.0)
    # (the walk's 0.010 ms is not a step)
