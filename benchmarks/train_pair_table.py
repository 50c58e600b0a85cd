"""Table of train_pair.sh results beside issue 27's numbers, the step ratios of the matched
pair (MoRE-1792 / MoE-256) and the same-shape pair (MoE-1792 / MoRE-1792), the 2-GPU speed-up
when OUT holds both layouts, and one plot of the training loss against tokens of these runs
and the committed ones.

    python benchmarks/train_pair_table.py OUT                      # markdown on stdout
    python benchmarks/train_pair_table.py OUT --out OUT/table.md --plot OUT/loss.png
    python benchmarks/train_pair_table.py OUT --json               # one JSON row per run

OUT holds <preset>_x<N>.json (the trainer's summary), <preset>_x<N>_log.jsonl (its metrics)
and, when profiled, <preset>_x<N>_profile.txt ("kernels ms/step": the GPU kernels' time per
profiled step on rank 0; "host ms/step": the host's own operator time; a step longer than
its kernels is bound by the host). "today" is issue 27's table (one H100, e5e3f90,
MINUTES=1.3); --reference names the committed runs whose loss curves the plot and the
loss comparison take (their summaries are an earlier commit's, named in the legend).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

REFERENCE = (Path(__file__).resolve().parent / "results" / "nvidia-h100-80gb-hbm3"
             / "train_pair")
# issue 27's table: (model name, GPUs) -> ms/step, tokens/s, MFU, peak GiB
TODAY = {("MoE-256", 1): (171.2, 382_748, 0.127, 13.1),
         ("MoRE-1792", 1): (271.5, 241_415, 0.080, 36.2),
         ("MoE-1792", 1): (276.3, 237_222, 0.109, 36.3),
         ("MoRE-1792", 2): (360.4, 363_656, 0.060, 44.4)}
# (numerator, denominator, the issue's target) of the step-time ratios
RATIOS = [("MoRE-1792", "MoE-256", "<= 1.15 (paper 1.34)"),
          ("MoE-1792", "MoRE-1792", ">= 1.13 (paper)")]


def _profile_per_step(path: Path) -> dict:
    if not path.exists():
        return {}
    text = path.read_text()
    steps = int(re.match(r"(\d+) steps", text).group(1))
    out = {}
    for key, name in (("CUDA", "kernels_ms_per_step"), ("CPU", "host_ms_per_step")):
        m = re.search(rf"Self {key} time total: ([\d.]+)(ms|s)", text)
        if m:
            out[name] = float(m.group(1)) * (1000 if m.group(2) == "s" else 1) / steps
    return out


def rows(root: Path) -> list[dict]:
    out = []
    for path in sorted(root.glob("*_x*.json")):
        s = json.loads(path.read_text())
        if "mean_step_ms" not in s:
            continue
        row = {"file": path.stem, "name": s["name"], "world": s["world"],
               "device": s.get("env_device"), "commit": s.get("env_commit"),
               "stopped": s.get("stopped"), "step_ms": s["mean_step_ms"],
               "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
               "peak_memory_gib": s["peak_memory_gib"], "val_loss": s["val_loss"],
               "steps_timed": s["steps_this_run"] - s["timing_warmup_steps"],
               # the routing's balance at the end (per-expert kernels slow down when a few
               # experts take most rows, as in a run's first steps): the mean over layers
               "hnorm": (sum(s["hnorm"]) / len(s["hnorm"])) if s.get("hnorm") else None}
        today = TODAY.get((s["name"], s["world"]))
        if today and s["mean_step_ms"]:
            row["today_step_ms"] = today[0]
            row["step_vs_today"] = s["mean_step_ms"] / today[0]
        row.update(_profile_per_step(path.with_name(path.stem + "_profile.txt")))
        out.append(row)
    return out


def ratios(table: list[dict]) -> list[str]:
    """The issue's ratios where OUT holds both runs, beside today's."""
    by = {(r["name"], r["world"]): r for r in table}
    lines = []
    for a, b, target in RATIOS:
        for w in sorted({r["world"] for r in table}):
            if (a, w) in by and (b, w) in by:
                new = by[a, w]["step_ms"] / by[b, w]["step_ms"]
                old = (f"{TODAY[a, w][0] / TODAY[b, w][0]:.2f}" if (a, w) in TODAY
                       and (b, w) in TODAY else "-")
                lines.append(f"- {a} / {b} step, {w} GPU(s): {new:.2f} (today {old}; "
                             f"target {target})")
    for (name, w), r in sorted(by.items()):
        if w > 1 and (name, 1) in by and by[name, 1]["device"] == r["device"]:
            up = r["tokens_per_s"] / by[name, 1]["tokens_per_s"]
            old = (f"{TODAY[name, w][1] / TODAY[name, 1][1]:.2f}x"
                   if (name, w) in TODAY and (name, 1) in TODAY else "-")
            lines.append(f"- {name} on {w} ranks: {up:.2f}x one rank's tokens/s (today {old}; "
                         f"target >= 1.85x)")
    return lines


def markdown(table: list[dict]) -> str:
    head = ("| model | GPUs | ms/step | tokens/s | MFU | peak GiB | today ms/step (e5e3f90) "
            "| tokens/s | MFU | peak GiB | step / today | kernels ms/step | host ms/step "
            "| steps timed | val loss | H_norm | commit |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    for r in table:
        t = TODAY.get((r["name"], r["world"]), (None,) * 4)
        lines.append(
            f"| {r['name']} | {r['world']}x {r['device']} | {f(r['step_ms'], '.1f')} "
            f"| {f(r['tokens_per_s'], ',.0f')} | {f(100 * (r['mfu'] or 0), '.1f')} % "
            f"| {f(r['peak_memory_gib'], '.1f')} | {f(t[0], '.1f')} | {f(t[1], ',')} "
            f"| {f(t[2] and 100 * t[2], '.1f')} % | {f(t[3], '.1f')} "
            f"| {f(r.get('step_vs_today'), '.2f')} | {f(r.get('kernels_ms_per_step'), '.0f')} "
            f"| {f(r.get('host_ms_per_step'), '.0f')} | {r['steps_timed']} "
            f"| {f(r['val_loss'], '.3f')} | {f(r['hnorm'], '.2f')} | {r['commit']} |")
    return "\n".join(lines)


def _curve(path: Path) -> tuple[np.ndarray, np.ndarray]:
    ev = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    pts = [(e["tokens"], e["loss"]) for e in ev if e.get("event") == "train"
           and e.get("loss") is not None and e.get("tokens")]
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)


def curves(root: Path, reference: Path) -> list[dict]:
    """Each run's loss curve and the committed run's of the same file name, if any."""
    out = []
    for path in sorted(root.glob("*_x*_log.jsonl")):
        ref = reference / path.name
        if ref.resolve() == path.resolve():
            continue
        name = path.name[:-len("_log.jsonl")]
        summary = reference / f"{name}.json"
        commit = json.loads(summary.read_text()).get("env_commit") if summary.exists() else None
        out.append({"name": name, "new": _curve(path),
                    "ref": _curve(ref) if ref.exists() else None, "ref_commit": commit})
    return out


def loss_lines(found: list[dict]) -> list[str]:
    """The training loss after the same tokens, new against committed: the mean of each
    curve over the last quarter of the tokens both reached (linear interpolation)."""
    lines = []
    for c in found:
        if c["ref"] is None or len(c["new"][0]) < 2 or len(c["ref"][0]) < 2:
            continue
        top = min(c["new"][0][-1], c["ref"][0][-1])
        grid = np.linspace(0.75 * top, top, 50)
        new, ref = (np.interp(grid, *c[k]).mean() for k in ("new", "ref"))
        lines.append(f"- {c['name']}: loss over {grid[0] / 1e6:.1f}M to {top / 1e6:.1f}M "
                     f"tokens {new:.3f}, committed run {ref:.3f} (new - committed "
                     f"{new - ref:+.3f})")
    return lines


def plot(found: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, c in enumerate(found):
        color = f"C{i}"
        ax.plot(c["new"][0] / 1e6, c["new"][1], color=color, label=f"{c['name']} (new)")
        if c["ref"] is not None:
            ax.plot(c["ref"][0] / 1e6, c["ref"][1], color=color, ls="--",
                    label=f"{c['name']} (committed, {c['ref_commit']})")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("training loss (mean over each logging window)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("train_pair.sh: loss against tokens, new runs (solid) and committed (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="folder of train_pair.sh outputs (its OUT)")
    ap.add_argument("--reference", type=Path, default=REFERENCE,
                    help="folder of the committed runs to compare the loss with")
    ap.add_argument("--out", type=Path, help="also write the markdown to this file")
    ap.add_argument("--plot", type=Path, help="PNG of the loss against tokens")
    ap.add_argument("--json", action="store_true", help="JSON rows instead of markdown")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"root must be a folder, got {args.root}")
    table = rows(args.root)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    found = curves(args.root, args.reference)
    text = "\n".join([markdown(table), "", *ratios(table), *loss_lines(found)])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot and found:
        plot(found, args.plot)


if __name__ == "__main__":
    main()
