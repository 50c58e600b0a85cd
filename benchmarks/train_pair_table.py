"""Table of train_pair.sh results: one row per run, with the MoRE / MoE step-time ratio of each
pair and the profiled device and host time per step.

    python benchmarks/train_pair_table.py benchmarks/results            # markdown
    python benchmarks/train_pair_table.py benchmarks/results --json     # one JSON row per run

Each run folder holds <preset>_x<N>.json (the trainer's summary) and, when it was profiled,
<preset>_x<N>_profile.txt. "kernels ms/step" is the sum of the GPU kernels' times over the
profiled steps (on rank 0; with DDP it counts the all-reduce that overlaps the backward), and
"host ms/step" the host's own operator time: a step longer than its kernels is bound by the
host launching them.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _profile_per_step(path: Path) -> dict:
    if not path.exists():
        return {}
    text = path.read_text()
    steps = int(re.match(r"(\d+) steps", text).group(1))
    out = {}
    for key, name in (("CUDA", "kernels_ms_per_step"), ("CPU", "host_ms_per_step")):
        m = re.search(rf"Self {key} time total: ([\d.]+)(ms|s)", text)
        if m:
            value = float(m.group(1)) * (1000 if m.group(2) == "s" else 1)
            out[name] = value / steps
    return out


def rows(root: Path) -> list[dict]:
    out = []
    for path in sorted(root.rglob("*_x*.json")):
        s = json.loads(path.read_text())
        if "mean_step_ms" not in s:
            continue
        row = {"run": str(path.parent.relative_to(root)), "name": s["name"],
               "device": s.get("env_device"), "world": s["world"],
               "commit": s.get("env_commit"), "step_ms": s["mean_step_ms"],
               "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"],
               "steps_timed": s["steps_this_run"] - s["timing_warmup_steps"],
               "wall_s": s["wall_s"], "val_loss": s["val_loss"],
               "peak_memory_gib": s["peak_memory_gib"]}
        row.update(_profile_per_step(path.with_name(path.stem + "_profile.txt")))
        out.append(row)
    for row in out:       # MoRE / MoE step time within the same run folder
        moe = [r for r in out if r["run"] == row["run"] and r["name"].startswith("MoE")]
        if row["name"].startswith("MoRE") and moe:
            row["step_ratio_vs_moe"] = row["step_ms"] / moe[0]["step_ms"]
            if "kernels_ms_per_step" in row and "kernels_ms_per_step" in moe[0]:
                row["kernel_ratio_vs_moe"] = (row["kernels_ms_per_step"]
                                              / moe[0]["kernels_ms_per_step"])
    return out


def markdown(table: list[dict]) -> str:
    head = ("| run (commit) | model | GPUs | ms/step | tokens/s | MFU | MoRE/MoE step | kernels ms/step "
            "| host ms/step | MoRE/MoE kernels | steps timed | val loss | peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)
    for r in table:
        lines.append(
            f"| {r['run']} ({r['commit']}) | {r['name']} | {r['world']}x {r['device']} | {f(r['step_ms'], '.1f')} "
            f"| {f(r['tokens_per_s'], ',.0f')} | {f(100 * (r['mfu'] or 0), '.1f')} % "
            f"| {f(r.get('step_ratio_vs_moe'), '.2f')} | {f(r.get('kernels_ms_per_step'), '.0f')} "
            f"| {f(r.get('host_ms_per_step'), '.0f')} | {f(r.get('kernel_ratio_vs_moe'), '.2f')} "
            f"| {r['steps_timed']} | {f(r['val_loss'], '.3f')} | {f(r['peak_memory_gib'], '.1f')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="folder searched for run summaries")
    ap.add_argument("--json", action="store_true", help="JSON rows instead of markdown")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        ap.error(f"root must be a folder, got {args.root}")
    table = rows(args.root)
    print(json.dumps(table, indent=1) if args.json else markdown(table))


if __name__ == "__main__":
    main()
