"""The reproduction's figures, in the paper's layout, ours beside the paper's values:
capacity against h (s = 8) and against s (h = 64) (Figure phonebook_capacity), and the rank
figure (Figure memorization_in_training: capacity against r with the MoE's level, H_norm per
layer against step for MoRE r = 32 and the MoE)."""
from __future__ import annotations

from pathlib import Path
from statistics import median_low

from ..report import save_figure
from .plots import _pyplot

COLORS = {"moe": "C3", "more": "C0"}
NAMES = {"moe": "MoE", "more": "MoRE"}


def _seeds(rows: list[dict]) -> list[dict]:
    """A row per search and seed: a finished one where there is one, else the newest
    lower bound (the rows of a search stopped and then finished)."""
    by = {}
    for r in rows:
        key = (r["point"], r["arch"], r.get("rank"), r.get("seed", 0))
        if key not in by or by[key].get("unfinished") or not r.get("unfinished"):
            by[key] = r
    return list(by.values())


def _middle(rows: list[dict]) -> dict:
    """The row of the seeds' median capacity (the lower of the two middle ones), where the
    line goes; each seed is drawn as its own dot."""
    return next(r for r in rows if r["capacity"] == median_low([r["capacity"] for r in rows]))


def plot_reproduction(rows: list[dict], path: str | Path) -> Path:
    """Largest phonebook memorised against h (s = 8) and s (h = 64): ours filled and solid
    (a dot per seed, the line through their median), the paper's hollow and dotted; log-log
    as the paper draws it."""
    from .paper import POINTS
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ours = {}
    for r in _seeds(rows):
        if r["point"] != "rank" and r["capacity"]:
            ours.setdefault((r["point"], r["arch"]), []).append(r)
    for ax, sweep, xkey, xlabel in ((axes[0], "h", "hidden", "hidden size h (s = 8)"),
                                    (axes[1], "s", "width", "expert width s (h = 64)")):
        pts = sorted((p for p in POINTS.values() if sweep in p.sweeps),
                     key=lambda p: getattr(p, xkey))
        for arch in ("moe", "more"):
            xs = [getattr(p, xkey) for p in pts]
            paper = [p.paper_moe if arch == "moe" else p.paper_more for p in pts]
            ax.plot(xs, paper, linestyle=":", marker="o", markerfacecolor="none",
                    color=COLORS[arch], label=f"{NAMES[arch]}, paper")
            got = [(getattr(p, xkey), ours[(p.key, arch)]) for p in pts
                   if (p.key, arch) in ours]
            if got:
                seeds = max(len(seeded) for _, seeded in got)
                ax.plot([x for x, _ in got], [_middle(seeded)["capacity"] for _, seeded in got],
                        linestyle="-", color=COLORS[arch], label=f"{NAMES[arch]}, moremoe"
                        + (f" (median of up to {seeds} seeds)" if seeds > 1 else ""))
                for x, seeded in got:   # a stopped search: at least this (an up-triangle)
                    for r in seeded:
                        ax.plot([x], [r["capacity"]], marker="^" if r.get("unfinished")
                                else "o", color=COLORS[arch], alpha=0.6 if seeds > 1 else 1)
        ax.plot([], [], marker="^", linestyle="none", color="gray",
                label="at least (search not finished)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("largest phonebook memorised (entries)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Largest phonebook reaching exact match 0.9 at matched active FLOPs "
                 "(r = 16, k = 4, L = 6; up to 1,500 epochs)",
                 fontsize=10)
    return save_figure(fig, path)


def plot_rank_figure(rows: list[dict], path: str | Path, below: list[dict] = ()) -> Path:
    """Capacity of MoRE-192 (h = 128, s = 8) against r with the MoE-192's as a dashed level;
    H_norm per layer against step for MoRE r = 32 and the MoE, at their capacity runs.
    below: ranks that did not memorise their search's start, each {"rank", "size",
    "exact_match", "epoch", "stopped"} (a failed trial, or one stopped short of its epochs),
    drawn as a down-triangle at that size with its exact match."""
    from .paper import RANK_START, RANKS
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    # a stopped search's row is a lower bound (up-triangle); a finished one replaces it
    rank = [r for r in rows if r["point"] == "rank"]
    if not any(r["arch"] == "more" and r["rank"] == 16 for r in rank):
        # r = 16 is the h = 128, s = 8 dot's MoRE-192: the same model, protocol and start
        rank += [{**r, "point": "rank"} for r in rows if r["point"] == "h128-s8"
                 and r["arch"] == "more" and r["experts"] == 192 and r["rank"] == 16]
    rank = _seeds(rank)
    more = sorted((r["rank"], r["capacity"], bool(r.get("unfinished"))) for r in rank
                  if r["arch"] == "more" and r["capacity"])
    if more:
        line = {k: _middle([r for r in rank if r["arch"] == "more" and r["rank"] == k
                            and r["capacity"]])["capacity"] for k in sorted({m[0] for m in more})}
        seeds = max(sum(m[0] == k for m in more) for k in line)
        axes[0].plot(list(line), list(line.values()), color=COLORS["more"],
                     label="MoRE-192, moremoe" + (f" (median of up to {seeds} seeds)"
                                                  if seeds > 1 else ""))
        for marker, low in (("o", False), ("^", True)):
            pts = [m[:2] for m in more if m[2] == low]
            if pts:
                axes[0].plot(*zip(*pts), marker=marker, linestyle="none", color=COLORS["more"],
                             label="lower bound (search stopped)" if low else None)
    have = {m[0] for m in more}
    short = sorted((b for b in below if b["rank"] not in have), key=lambda b: b["rank"])
    for i, b in enumerate(short):
        axes[0].plot([b["rank"]], [b["size"]], marker="v", linestyle="none",
                     color=COLORS["more"],
                     label=None if i else "below this size (its exact match)")
        line = sum(o["rank"] == b["rank"] for o in short[:i])     # a seed's line below
        axes[0].annotate(f"{b['exact_match']:.2f} at epoch {b['epoch']:,.0f}"
                         + (" (stopped)" if b.get("stopped") else ""),
                         (b["rank"], b["size"]), textcoords="offset points",
                         xytext=(-6, -14 - 9 * line), ha="left", fontsize=7,
                         color=COLORS["more"])
    moes = [r for r in rank if r["arch"] == "moe" and r["capacity"]]
    moe = _middle(moes) if moes else None
    if moe is not None:
        axes[0].axhline(moe["capacity"], color=COLORS["moe"], linestyle="--",
                        label="MoE-192, moremoe" + (" (lower bound)" if moe.get("unfinished")
                                                     else ""))
    axes[0].plot([16], [RANK_START], marker="o", markerfacecolor="none", linestyle="none",
                 color=COLORS["more"], label="paper (r = 16: 100K; matches the MoE)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(RANKS, [str(r) for r in RANKS])
    axes[0].set_xlim(RANKS[0] / 1.3, RANKS[-1] * 1.3)
    ys = [RANK_START, *(m[1] for m in more), *(b["size"] for b in below),
          *([moe["capacity"]] if moe else [])]
    axes[0].set_ylim(min(ys) / 3, max(ys) * 3)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("router rank r")
    axes[0].set_ylabel("largest phonebook memorised")
    for ax, row, title in ((axes[1], next((r for r in rank if r["rank"] == 32), None),
                            "MoRE-192, r = 32"), (axes[2], moe, "MoE-192")):
        hist = row["history_at_capacity"] if row else []
        layers = len(hist[0]["hnorm"]) if hist and hist[0]["hnorm"] else 0
        for layer in range(layers):
            ax.plot([h["step"] for h in hist], [h["hnorm"][layer] for h in hist],
                    label=f"layer {layer}")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("H_norm")
        ax.set_title(title + (f" ({row['capacity']:,} entries)" if row and row["capacity"]
                              else " (not measured)"), fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save_figure(fig, path)
