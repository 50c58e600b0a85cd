"""What the layer and decode rows say against the targets, as lines of text: MoRE over MoE
per h at the largest M (against the unfused and the best standard router), and per batch
size the decode ratio of MoRE with 8x the experts to MoE, the fixed cost of a step and the
ratio to each row's memory floor. Each uses the newest run's row of a point."""
from __future__ import annotations

import statistics


def _latest(rows, bench, **fixed) -> dict:
    """{(variant, h, M, B): row} of the rows matching fixed, the last one of each point."""
    out = {}
    for r in rows:
        if r.get("bench") != bench or r.get("ms") is None:
            continue
        if any(r.get(k) != v for k, v in fixed.items()):
            continue
        out[(r["variant"], r["h"], r["M"], r.get("B"))] = r
    return out


def layer_ratios(rows: list[dict], M: int = 8192) -> list[dict]:
    """Per h at M: MoRE's time and its speedup over MoE with the unfused router and over
    MoE with the faster of the two standard routers."""
    pts = _latest(rows, "layer", sweep="grid", s=64)
    out = []
    for h in sorted({key[1] for key in pts if key[2] == M}):
        more = pts.get(("more_fused", h, M, None))
        unf, fus = pts.get(("moe_unfused", h, M, None)), pts.get(("moe_fused", h, M, None))
        if not more:
            continue
        best = min((r["ms"] for r in (unf, fus) if r), default=None)
        out.append({"h": h, "M": M, "more_ms": more["ms"],
                    "vs_unfused": unf["ms"] / more["ms"] if unf else None,
                    "vs_best_standard": best / more["ms"] if best else None})
    return out


def decode_ratios(rows: list[dict], factor: int = 8) -> list[dict]:
    """Per B: MoRE at factor·M over MoE at M for every (h, M) pair both have (median, worst,
    how many within 5 %), the cheapest step (the fixed cost: the smallest point's time), and
    the largest ratio of a step to its own memory floor."""
    pts = _latest(rows, "decode")
    out = []
    for B in sorted({key[3] for key in pts}):
        ratios = [pts[("more_fused", h, factor * M, B)]["ms"] / r["ms"]
                  for (v, h, M, b), r in pts.items()
                  if v == "moe_fused" and b == B and ("more_fused", h, factor * M, B) in pts]
        steps = [r for (v, *_, b), r in pts.items() if b == B and not v.endswith("_walk")]
        floors = [r["ratio_to_floor"] for r in steps if r.get("ratio_to_floor")]
        out.append({"B": B, "pairs": len(ratios),
                    "median": statistics.median(ratios) if ratios else None,
                    "worst": max(ratios) if ratios else None,
                    "within_5pct": sum(x <= 1.05 for x in ratios),
                    "min_step_ms": min(r["ms"] for r in steps) if steps else None,
                    "max_to_floor": max(floors) if floors else None})
    return out


def layer_text(rows) -> str:
    lines = [f"h={r['h']} M={r['M']}: MoRE {r['more_ms']:.2f} ms, "
             + ", ".join(f"{r[k]:.2f}x {name}" for k, name in (
                 ("vs_unfused", "vs MoE unfused"), ("vs_best_standard", "vs MoE best router"))
                 if r[k]) for r in layer_ratios(rows)]
    return "\n" + "\n".join(lines) if lines else ""


def decode_text(rows) -> str:
    lines = []
    for r in decode_ratios(rows):
        if r["median"] is None:
            continue
        lines.append(f"B={r['B']}: MoRE(8M)/MoE(M) median {r['median']:.2f}, worst "
                     f"{r['worst']:.2f}, {r['within_5pct']}/{r['pairs']} within 5 %; cheapest "
                     f"step {1e3 * r['min_step_ms']:.1f} us"
                     + (f"; worst step/floor {r['max_to_floor']:.2f}x" if r["max_to_floor"]
                        else ""))
    return "\n" + "\n".join(lines) if lines else ""
