"""Figures of ``moremoe bench model``: model.png, stacked bars of each model's time by
component (attention, router, experts, rest), MoE beside MoRE, for prefill (per B x T) and
eager decode (per batch, milliseconds per step); model_decode.png, milliseconds per decode
step against the batch for each model and decode mode, with the step's byte floor."""
from __future__ import annotations

from pathlib import Path

from ..report import save_figure
from .model import COMPONENTS
from .router_plots import _pyplot

COLORS = {"attention": "C0", "router": "C3", "experts": "C2", "rest": "C7"}


def _latest(rows, phase):
    """The newest row with components of each (pair, B, T, kind) of a phase."""
    out = {}
    for r in rows:
        if (r.get("bench") == "model" and r.get("phase") == phase and r.get("ms")
                and r.get("components")):
            out[(r["pair"], r["B"], r.get("T"), r["kind"])] = r
    return out


def render_model(rows: list[dict], out_dir) -> list[Path]:
    paths = _render_components(rows, out_dir)
    decode = _render_decode_modes(rows, out_dir)
    if not paths and not decode:
        raise ValueError("no timed rows of `moremoe bench model` in it")
    return paths + decode


def _render_decode_modes(rows, out_dir) -> list[Path]:
    pts = {}
    for r in rows:
        if r.get("bench") == "model" and r.get("phase") == "decode" and r.get("ms"):
            pts[(r["model"], r.get("mode", "eager"), r["B"])] = r
    if not pts:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    models = sorted({m for m, _, _ in pts})
    styles = {"eager": ":", "captured": "--", "compiled": "-"}
    for i, model in enumerate(models):
        for mode, style in styles.items():
            line = sorted((B, r["ms"]) for (m, md, B), r in pts.items()
                          if m == model and md == mode)
            if line:
                ax.plot(*zip(*line), style, marker="o", color=f"C{i}", label=f"{model} {mode}")
        floor = sorted((B, r["floor_ms"]) for (m, _, B), r in pts.items()
                       if m == model and r.get("floor_ms"))
        if floor:
            ax.plot(*zip(*floor), color=f"C{i}", alpha=0.3, lw=4, label=f"{model} byte floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows decoded together)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"decode steps by mode ({rows[0].get('device', '')})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    path = Path(out_dir) / "model_decode.png"
    save_figure(fig, path)
    return [path]


def _render_components(rows, out_dir) -> list[Path]:
    plt = _pyplot()
    phases = [p for p in ("prefill", "decode") if _latest(rows, p)]
    if not phases:
        return []
    bars = max(len(_latest(rows, p)) for p in phases)
    fig, axes = plt.subplots(len(phases), 1, figsize=(max(8, 0.5 * bars + 2), 5.5 * len(phases)),
                             squeeze=False)
    for ax, phase in zip(axes[:, 0], phases):
        pts = _latest(rows, phase)
        groups = sorted({key[:3] for key in pts})
        labels, x = [], 0
        for pair, B, T in groups:
            for kind in ("moe", "more"):
                r = pts.get((pair, B, T, kind))
                if r is None:
                    continue
                bottom = 0.0
                for c in COMPONENTS:
                    v = r["components"].get(c, 0.0)
                    ax.bar(x, v, bottom=bottom, color=COLORS[c],
                           label=c if (x == 0) else None)
                    bottom += v
                ax.text(x, bottom, f"{r['ms']:.1f}" if r["ms"] >= 10 else f"{r['ms']:.2f}",
                        ha="center", va="bottom", fontsize=7)
                shape = f"{B}x{T}" if phase == "prefill" else f"B={B}"
                labels.append((x, f"{pair} {r['model'].split('-')[-1]} {shape}"))
                x += 1
            x += 0.6
        ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7, rotation=90)
        ax.set_ylabel("ms" + (" per step" if phase == "decode" else ""))
        ax.set_title(f"{phase}: time by component (bf16, {rows[0].get('device', '')})",
                     fontsize=9)
        ax.legend(fontsize=7)
    path = Path(out_dir) / "model.png"
    save_figure(fig, path)
    return [path]
