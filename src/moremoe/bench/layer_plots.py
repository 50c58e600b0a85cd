"""Figures of ``moremoe bench layer`` and ``bench decode``, rendered from their JSON lines:
heatmaps over (h, M) like the paper's Figure 3 (MoE, MoRE, speedup; also against the fused
standard router), the peak-memory ratio, and decode time against M per batch size."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..report import save_figure
from .layer import HS, MS
from .router_plots import _log_axes, _pyplot


def _grid(rows, variant, key="ms", **fixed):
    g = np.full((len(HS), len(MS)), np.nan)
    for r in rows:
        if r.get("variant") != variant or any(r.get(k) != v for k, v in fixed.items()):
            continue
        if r["h"] in HS and r["M"] in MS and r.get(key) is not None:
            g[HS.index(r["h"]), MS.index(r["M"])] = r[key]
    return g


def _heat(ax, g, title, fmt, cmap):
    im = ax.imshow(g, cmap=cmap, aspect="auto", origin="lower")
    ax.set_xticks(range(len(MS)), [str(m) for m in MS], fontsize=7)
    ax.set_yticks(range(len(HS)), [str(h) for h in HS], fontsize=7)
    ax.set_xlabel("M")
    ax.set_ylabel("h")
    ax.set_title(title, fontsize=9)
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            if not np.isnan(g[i, j]):
                ax.text(j, i, fmt.format(g[i, j]), ha="center", va="center", fontsize=6)
    return im


def render_layer(rows: list[dict], out_dir) -> list[Path]:
    plt = _pyplot()
    out_dir = Path(out_dir)
    device = rows[0].get("device", "") if rows else ""
    paths = []
    moe = _grid(rows, "moe_unfused", sweep="grid")
    moe_f = _grid(rows, "moe_fused", sweep="grid")
    more = _grid(rows, "more_fused", sweep="grid")
    if not np.isnan(more).all():
        fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
        _heat(axes[0], moe, "MoE, unfused standard router (ms)", "{:.2f}", "viridis")
        _heat(axes[1], more, "MoRE, fused low-rank router (ms)", "{:.2f}", "viridis")
        _heat(axes[2], moe / more, "speedup vs MoE unfused", "{:.2f}x", "RdYlGn")
        _heat(axes[3], moe_f / more, "speedup vs MoE with fused router", "{:.2f}x", "RdYlGn")
        fig.suptitle(f"prefill forward of one layer, s=64, k=4, r=64, N=262,144, bf16 ({device})")
        save_figure(fig, out_dir / "layer_prefill.png")
        paths.append(out_dir / "layer_prefill.png")
    unf = _grid(rows, "more_unfused", key="peak_bytes", sweep="memory")
    fus = _grid(rows, "more_fused", key="peak_bytes", sweep="memory")
    if not np.isnan(fus).all():
        fig, ax = plt.subplots(figsize=(7, 4.8))
        _heat(ax, unf / fus, f"peak memory fwd+bwd, unfused / fused MoRE ({device})",
              "{:.1f}x", "RdYlGn")
        save_figure(fig, out_dir / "layer_memory.png")
        paths.append(out_dir / "layer_memory.png")
    return paths


def render_decode(rows: list[dict], out_dir) -> list[Path]:
    plt = _pyplot()
    out_dir = Path(out_dir)
    bs = sorted({r["B"] for r in rows if r.get("bench") == "decode"})
    if not bs:
        return []
    hs = {r["h"] for r in rows if r.get("bench") == "decode"}
    h = 512 if 512 in hs else max(hs)
    fig, axes = plt.subplots(1, len(bs), figsize=(5 * len(bs), 4.2), squeeze=False)
    for ax, B in zip(axes[0], bs):
        for variant, style in (("moe_fused", "C3-"), ("more_fused", "C0-"),
                               ("more_fused_walk", "C0:")):
            pts = sorted({r["M"]: r["ms"] for r in rows if r.get("variant") == variant
                          and r["B"] == B and r["h"] == h and r.get("ms")}.items())  # newest
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=variant)
        _log_axes(ax, "M", "ms per step", f"decode, h={h}, B={B}")
    save_figure(fig, out_dir / "decode.png")
    return [out_dir / "decode.png"]
