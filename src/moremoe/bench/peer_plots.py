"""Figure of ``moremoe bench peer``, from its JSON lines: per pass, one layer's time against
the tokens of a step (MoRE, MoE, PEER fused and torch in both readings, PEER's retrieval
alone), and PEER / MoRE against the tokens with the paper's ratios beside them."""
from __future__ import annotations

from pathlib import Path

from ..report import save_figure
from .peer import PAPER_RATIO, PHASES, READINGS, ratios
from .router_plots import _pyplot

STYLES = {("more", None): ("C0", "-", "MoRE"), ("moe", None): ("C3", "-", "MoE"),
          **{(v, rd): (color, ls, f"PEER {label} ({rd})")
             for rd, ls in zip(READINGS, ("-", "--"))
             for v, color, label in (("peer_fused", "C2", "fused"),
                                     ("peer_torch", "C1", "torch"),
                                     ("peer_retrieval", "C7", "retrieval"))}}


def _series(rows, variant, reading, phase) -> list[tuple[int, float]]:
    """[(N, ms)] of the newest row of each N."""
    pts = {}
    for r in rows:
        if (r.get("bench") == "peer" and r["variant"] == variant and r.get("reading") == reading
                and r["phase"] == phase and r.get("ms") is not None):
            pts[r["N"]] = r["ms"]
    return sorted(pts.items())


def render_peer(rows: list[dict], out_dir) -> list[Path]:
    rows = [r for r in rows if r.get("bench") == "peer"]
    if not rows:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(PHASES), figsize=(6.5 * len(PHASES), 9), squeeze=False)
    for col, phase in enumerate(PHASES):
        ax = axes[0][col]
        for (variant, reading), (color, ls, label) in STYLES.items():
            pts = _series(rows, variant, reading, phase)
            if pts:
                ax.plot(*zip(*pts), color=color, ls=ls, marker="o", ms=3, label=label)
        ax.set_title(f"one layer, {phase}", fontsize=10)
        ax.set_ylabel("ms")
        ax = axes[1][col]
        for reading, ls in zip(READINGS, ("-", "--")):
            for key, color, name in (("fused_vs_more", "C2", "fused"),
                                     ("torch_vs_more", "C1", "torch")):
                pts = [(r["N"], r[key]) for r in ratios(rows)
                       if r["reading"] == reading and r["phase"] == phase and r[key]]
                if pts:
                    ax.plot(*zip(*pts), color=color, ls=ls, marker="o", ms=3,
                            label=f"PEER {name} / MoRE ({reading})")
        paper = sorted(PAPER_RATIO[phase].items())
        ax.plot(*zip(*paper), color="k", ls=":", marker="x", label="paper (B200)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_ylabel("PEER / MoRE")
        for a in axes[:, col]:
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xlabel("tokens a step (N)")
            a.legend(fontsize=7)
    fig.suptitle(f"PEER vs MoRE at matched active FLOPs ({rows[0].get('device', '')})")
    path = Path(out_dir) / "peer.png"
    save_figure(fig, path)
    return [path]
