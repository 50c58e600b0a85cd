"""Figures of ``moremoe bench router``, rendered from its JSON lines: time against k, r, the
batch size and M (the paper's Figure 4 left and middle and its batch-size figure, also at
the paper's own router point), with the fused-over-unfused speedup and the paper's
Algorithm 1 beside them, and training time and peak memory against M."""
from __future__ import annotations

from pathlib import Path

from ..report import save_figure

LABELS = {("lowrank", "triton"): "MoRE fused", ("lowrank", "unfused"): "MoRE unfused",
          ("lowrank", "alg1"): "MoRE, paper's Algorithm 1",
          ("linear", "triton"): "MoE fused", ("linear", "unfused"): "MoE unfused"}
STYLE = {("lowrank", "triton"): ("C0", "-"), ("lowrank", "unfused"): ("C0", "--"),
         ("lowrank", "alg1"): ("C2", ":"),
         ("linear", "triton"): ("C3", "-"), ("linear", "unfused"): ("C3", "--")}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(rows, sweep, phase, x_key, **fixed):
    """{(router, impl): [(x, ms, row)]} with the newest row of each x (a results file
    collects every run's rows)."""
    out = {}
    for r in rows:
        if r.get("sweep") != sweep or r["phase"] != phase or r.get("ms") is None:
            continue
        if any(r[k] != v for k, v in fixed.items()):
            continue
        impl = "unfused" if r["impl"] == "reference" else r["impl"]   # rows before 2026-11
        out.setdefault((r["router"], impl), {})[r[x_key]] = (r[x_key], r["ms"], r)
    return {key: sorted(v.values(), key=lambda t: t[0]) for key, v in out.items()}


def _log_axes(ax, x_label, y_label, title, *, logx=True) -> None:
    """The benchmarks' panel style: log y (log2 x), labels, a grid and a small legend."""
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:   # a phase the run left out (--no-training): said on the panel, not a blank one
        ax.text(0.5, 0.5, "not measured in this run", transform=ax.transAxes, ha="center",
                va="center", fontsize=8, color="0.4")


def _panel(ax, series, x_label, title, *, speedup=("lowrank",), logx=True):
    for key, pts in series.items():
        color, ls = STYLE[key]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, linestyle=ls,
                marker="o", label=LABELS[key])
    for router in speedup:
        fused = dict((p[0], p[1]) for p in series.get((router, "triton"), []))
        for x, ms, _ in series.get((router, "unfused"), []):
            if x in fused:
                ax.annotate(f"{ms / fused[x]:.1f}x", (x, fused[x]), textcoords="offset points",
                            xytext=(0, -12), ha="center", fontsize=7, color=STYLE[(router, "triton")][0])
    _log_axes(ax, x_label, "ms (median)", title, logx=logx)


def render(rows: list[dict], out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = rows[0].get("device", "") if rows else ""
    paths = []
    figs = [("router_k.png", "k", "k", "inference vs k (h=512, M=8192, r=64, N=262,144)"),
            ("router_r.png", "r", "r", "inference vs rank r (h=512, M=8192, k=4, N=262,144)"),
            ("router_batch.png", "B", "B", "inference vs batch B (T=1024; h=512, M=8192, r=64)"),
            ("router_paper_batch.png", "paper", "B",
             "inference vs batch B, the paper's point (T=1024; h=2048, M=4096, r=16)")]
    for name, sweep, key, title in figs:
        fixed = {"M": 8192} if sweep == "k" else {}     # the k sweep's M = 512 and 2,048 rows
        series = _series(rows, sweep, "inference", key, **fixed)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4.2))
        _panel(ax, series, key, f"{title}\n{device}")
        save_figure(fig, out_dir / name)
        paths.append(out_dir / name)
    if any(r.get("sweep") == "M" for r in rows):
        fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
        for i, h in enumerate((512, 2048)):
            for phase, ax in zip(("inference", "training"), axes[i][:2]):
                _panel(ax, _series(rows, "M", phase, "M", h=h), "M",
                       f"{phase} vs M (h={h}, r=64, k=4)", speedup=("lowrank", "linear"))
            mem = _series(rows, "M", "training", "M", h=h)
            ax = axes[i][2]
            for key, pts in mem.items():
                color, ls = STYLE[key]
                ax.plot([p[0] for p in pts], [p[2].get("peak_bytes", 0) / 2 ** 30 for p in pts],
                        color=color, linestyle=ls, marker="o", label=LABELS[key])
            _log_axes(ax, "M", "peak memory, forward + backward (GiB)",
                      f"training peak memory (h={h})")
        fig.suptitle(device)
        save_figure(fig, out_dir / "router_M.png")
        paths.append(out_dir / "router_M.png")
    return paths
