"""PNG plots rendered from run records (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

from ..report import save_figure


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_phonebook_runs(runs: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Loss, exact match and H_norm per layer against training step, one colour per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        hist, color = run["history"], colors[i % len(colors)]
        steps = [h["step"] for h in hist]
        axes[0].plot(steps, [h["loss"] for h in hist], color=color, label=run["name"])
        axes[1].plot(steps, [h["exact_match"] for h in hist], color=color, label=run["name"])
        layers = len(hist[0]["hnorm"]) if hist else 0
        for layer in range(layers):
            axes[2].plot(steps, [h["hnorm"][layer] for h in hist], color=color,
                         alpha=0.35 + 0.65 * (layer + 1) / layers,
                         label=f"{run['name']} L{layer}" if layer in (0, layers - 1) else None)
    threshold = runs[0]["train"]["threshold"] if runs else None
    if threshold is not None and threshold <= 1:
        axes[1].axhline(threshold, color="gray", linestyle=":", label="threshold")
    for ax, ylabel in zip(axes, ("training loss (number tokens)", "exact match",
                                 "H_norm per layer")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:       # a run stopped before any evaluation
            ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_ylim(-0.02, 1.02)
    axes[2].set_ylim(0, 1.02)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_capacity(results: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Final exact match against phonebook size for each model; the capacity starred."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for res in results:
        trials = sorted(res["trials"], key=lambda t: t["train"]["size"])
        sizes = [t["train"]["size"] for t in trials]
        line, = ax.plot(sizes, [t["exact_match"] for t in trials], marker="o", label=res["name"])
        if res["capacity"] is not None:
            best = next(t for t in trials if t["train"]["size"] == res["capacity"])
            ax.plot([res["capacity"]], [best["exact_match"]], marker="*", markersize=16,
                    color=line.get_color())
    if results and results[0]["trials"]:
        ax.axhline(results[0]["trials"][0]["train"]["threshold"], color="gray", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("phonebook size (entries)")
    ax.set_ylabel("exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if results:
        ax.legend()
    ax.set_title(title or "phonebook capacity (star: largest size reaching the threshold)")
    return save_figure(fig, path)


def plot_sweep(report: dict, path: str | Path) -> Path:
    """Exact match against the swept value for MoRE (and the MoE: a line per value when
    the sweep changes it, else one dashed level)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arch, color in (("more", "C0"), ("moe", "C3")):
        pts = sorted((r["value"], r["exact_match"]) for r in report["runs"] if r["arch"] == arch)
        if len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                    label="MoRE" if arch == "more" else "MoE")
        elif pts:
            ax.axhline(pts[0][1], color=color, linestyle="--",
                       label="MoE" if arch == "moe" else "MoRE")
    ax.set_xscale("log", base=2)
    ax.set_xlabel({"rank": "router rank r", "experts": "MoRE experts M'",
                   "hidden": "hidden size h"}[report["over"]])
    ax.set_ylabel("exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"phonebook of {report['size']:,} entries: exact match against "
                 f"{report['over']}", fontsize=9)
    return save_figure(fig, path)
