"""A study's figures, from its rows (through study/report.py), written beside them:

pair.png        validation loss against tokens for the MoE and the MoRE at every budget
                (the mean over seeds, the band from the lowest to the highest seed), and the
                gap MoE - MoRE against tokens (paired by seed; > 0: MoRE lower)
ablations.png   the experts sweep (PPL against M), the rank sweep (PPL against r), the
                init ablation (per rank) and the router learning rate (loss against the
                factor), each point the mean with its seed range
paper.png       validation loss against tokens of the h = 512 presets
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from ..report import human, save_figure


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _band(ax, xs, points, color, label, style="-"):
    """A mean line and its min-max band; points: stats dicts (study/report.py)."""
    keep = [(x, p) for x, p in zip(xs, points) if p["n"]]
    if not keep:
        return
    x = [k[0] for k in keep]
    line, = ax.plot(x, [k[1]["mean"] for k in keep], style, color=color, marker="o", ms=3,
                    label=f"{label} (n={max(k[1]['n'] for k in keep)})")
    ax.fill_between(x, [k[1]["min"] for k in keep], [k[1]["max"] for k in keep],
                    color=line.get_color(), alpha=0.2, lw=0)


def _curve(rows_by_seed: dict) -> tuple[list, list]:
    from .report import stats
    marks = sorted({e["tokens"] for r in rows_by_seed.values() for e in r["evals"]})
    at = [stats(e["val_loss"] for r in rows_by_seed.values() for e in r["evals"]
                if e["tokens"] == t) for t in marks]
    return marks, at


def plot_pair(report: dict, arms: dict, path: Path) -> Path | None:
    """arms: {(arm, tokens): {seed: row}} of the pair's runs."""
    plt = _plt()
    pair = report["experiments"]["pair"]
    if not any(arms.values()):
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    colors = {pair["a"]: "tab:blue", pair["b"]: "tab:red"}
    styles = ["-", "--", ":", "-."]
    for i, b in enumerate(sorted({t for _, t in arms}, reverse=True)):
        for arm in (pair["a"], pair["b"]):
            x, at = _curve(arms.get((arm, b), {}))
            _band(left, x, at, colors[arm], f"{arm}, {human(b)}",
                  styles[i % len(styles)])
    left.set(xlabel="tokens", ylabel="validation loss", title="validation loss, seed bands")
    curve = pair["curve"]
    _band(right, [c["tokens"] for c in curve], [c["gap"] for c in curve], "k",
          f"along the {human(pair['curve_tokens'])}-token runs")
    ends = [b for b in pair["budgets"] if b["gap"]["n"]]
    right.errorbar([b["tokens"] for b in ends], [b["gap"]["mean"] for b in ends],
                   yerr=[[b["gap"]["mean"] - b["gap"]["min"] for b in ends],
                         [b["gap"]["max"] - b["gap"]["mean"] for b in ends]],
                   fmt="s", color="tab:green", capsize=4, label="end of each budget")
    right.axhline(0, color="grey", lw=0.8)
    right.set(xlabel="tokens", ylabel=f"loss {pair['a']} - {pair['b']}",
              title="the gap (> 0: MoRE lower), seed range")
    for ax in (left, right):
        _tokens_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_subtitle(report), fontsize=9)
    return save_figure(fig, path)


def plot_ablations(report: dict, path: Path) -> Path | None:
    exps = report["experiments"]
    panels = [e for e in ("experts", "rank", "init", "router-lr") if e in exps]
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, exp in zip(axes[0], panels):
        e = exps[exp]
        if exp == "init":
            ranks = [r["rank"] for r in e["ranks"]]
            _band(ax, ranks, [r["a_ppl"] for r in e["ranks"]], "tab:orange", "per-entry")
            _band(ax, ranks, [r["b_ppl"] for r in e["ranks"]], "tab:red",
                  "variance-matched")
            ax.set(xscale="log", xlabel="rank r", ylabel="validation PPL", title="init")
            _ticks(ax, ranks)
        else:
            xs = [p["x"] for p in e["points"]]
            key = "loss" if exp == "router-lr" else "ppl"
            _band(ax, xs, [p[key] for p in e["points"]], "tab:red", "MoRE")
            label = {"experts": "experts M", "rank": "rank r (M fitted)",
                     "router-lr": "router lr / lr"}[exp]
            ax.set(xscale="log", xlabel=label, title=exp,
                   ylabel="validation loss" if key == "loss" else "validation PPL")
            _ticks(ax, xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_subtitle(report), fontsize=9)
    return save_figure(fig, path)


def plot_paper(report: dict, arms: dict, path: Path) -> Path | None:
    if not any(arms.values()):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for name, rows in arms.items():
        x, at = _curve(rows)
        _band(ax, x, at, None, name)
    ax.set(xlabel="tokens", ylabel="validation loss", title="the h = 512 presets, one seed")
    _tokens_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(_subtitle(report), fontsize=9)
    return save_figure(fig, path)


def _ticks(ax, xs) -> None:
    """A log axis labelled at the points only."""
    from matplotlib.ticker import NullFormatter
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _tokens_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))


def _subtitle(report: dict, width: int = 130) -> str:
    """The data, devices and commits, wrapped to lines of `width` characters (one line of
    two devices and three commits ran past a two-panel figure's edges)."""
    d = report["data"]
    dev = ", ".join(f"{e['device']} (torch {e['torch']})" for e in report["devices"]) or "-"
    text = (f"data {d['fingerprint']} (corpus {str(d.get('corpus'))[:16]}), "
            f"{human(d['train_tokens'])} training tokens; {dev}; "
            f"commit {', '.join(report['commits']) or '-'}")
    return "\n".join(textwrap.wrap(text, width))
