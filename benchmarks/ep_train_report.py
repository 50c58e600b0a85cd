"""The pieces of benchmarks/ep_train_gpu.sh that are Python: the memory plans of several
layouts before anything runs, and the report of its runs afterwards.

    python benchmarks/ep_train_report.py plans --device cuda --world 2 --data DIR \\
        "h512-s64-more8192 parallel.expert=2 optim.moments=bf16" "h512-s64-moe1024"
    python benchmarks/ep_train_report.py report WORK OUT

`plans` prints each layout's plan per GPU (training/footprint.py, as `moremoe train` prints
it at start) for `--world` ranks of `--device`; each argument is a preset and its --set
values. `report` reads what the script kept in WORK, for each run NAME among ep2, resumed
and moe1024: NAME.json (the summary), NAME_log.jsonl (its log) and NAME_config.json (its run
config), and WORK/plans.txt. It writes into OUT (few files: the device machine sends back
eight): loss.png (training loss against tokens: the E = 2 run, then the resumed segment
from its checkpoint), summaries.json (each run's summary and config) and ep_train.txt (the
plans, then one row a run: layout, steps, ms/step, tokens/s, peak memory of each GPU, last
loss, where the resume continued, and the losses on both sides of the resume).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = ("ep2", "resumed", "moe1024")


def plans(args) -> None:
    import torch
    from moremoe.runtime import memory_bytes
    from moremoe.tasks.text import read_meta
    from moremoe.training.compose import build_run_config
    from moremoe.training.footprint import memory_plan
    device = torch.device(args.device)
    vocab = int(read_meta(args.data)["vocab_size"])
    for spec in args.layouts:
        preset, *sets = spec.split()
        cfg = build_run_config(preset=preset, overrides=sets, data=args.data)
        model = cfg.model.transformer_config(cfg.model.vocab or vocab)
        plan = memory_plan(cfg, model, device, world=args.world, have=memory_bytes(device))
        flags = " ".join(f"--set {s}" for s in sets)
        print(f"== {preset} {flags}\n{plan.table()}\n", flush=True)


def _read(work: Path, name: str):
    """(summary, train events after the last resume, [that resume event] or the first
    event, run config) of run `name`, or None when the run left no summary."""
    path = work / f"{name}.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    log = work / f"{name}_log.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    resumes = [i for i, e in enumerate(events) if e.get("event") == "resume"]
    after = events[resumes[-1]:] if resumes else events
    config = work / f"{name}_config.json"
    cfg = json.loads(config.read_text()) if config.is_file() else {}
    return summary, [e for e in after if e.get("event") == "train"], after[:1], cfg


def _layout(cfg: dict, world: int) -> str:
    p, t, o = cfg.get("parallel", {}), cfg.get("train", {}), cfg.get("optim", {})
    parts = [f"E={p.get('expert', 1)}", f"{p.get('data', 'ddp')} rest",
             f"{o.get('moments', 'fp32')} moments"]
    if t.get("activation_checkpointing"):
        parts.append("act. ckpt")
    return f"{world} ranks, " + ", ".join(parts)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row(name: str, run) -> list[str]:
    summary, train, head, cfg = run
    peaks = summary.get("peak_memory_gib_per_rank") or []
    first = train[0]["step"] if train else None
    resumed = head[0]["step"] if head and head[0].get("event") == "resume" else None
    return [name, f"{summary['name']} ({_layout(cfg, summary['world'])})",
            f"{summary['steps_this_run']} ({_fmt(first, 'd')} → {summary['step']})",
            _fmt(summary["mean_step_ms"], ",.0f"), _fmt(summary["tokens_per_s"], ",.0f"),
            ", ".join(f"{g:.1f}" for g in peaks) or "-",
            _fmt(train[-1]["loss"] if train else None, ".3f"),
            "-" if resumed is None else f"from step {resumed}", summary["stopped"]]


def _continuity(ep2, resumed) -> str:
    """The loss the first run logged last before the resume step (the mean of its logging
    window) against the resumed run's first steps, and their mean over as many steps."""
    step = resumed[2][0]["step"] if resumed[2] else None
    before = [e for e in ep2[1] if step is not None and e["step"] <= step]
    if not before or not resumed[1]:
        return "resume: no logged steps on both sides"
    b = before[-1]
    window = b["step"] - (before[-2]["step"] if len(before) > 1 else 0)
    after = resumed[1][:window]
    mean = sum(e["loss"] for e in after) / len(after)
    return (f"resume at step {step}: the first run's loss {b['loss']:.3f} (steps "
            f"{b['step'] - window + 1}-{b['step']}); resumed {mean:.3f} (steps "
            f"{after[0]['step']}-{after[-1]['step']}), step by step "
            + ", ".join(f"{e['loss']:.3f}" for e in after))


def _plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from moremoe.report import save_figure
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (_summary, train, head, _cfg) in runs.items():
        ax.plot([e["tokens"] / 1e6 for e in train], [e["loss"] for e in train],
                marker="." if len(train) < 40 else None, label=label)
        if head and head[0].get("event") == "resume" and train:
            ax.axvline(train[0]["tokens"] / 1e6, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def report(args) -> None:
    work, out = Path(args.work), Path(args.out)
    runs = {name: run for name in RUNS if (run := _read(work, name)) is not None}
    plans_txt = work / "plans.txt"
    plans = plans_txt.read_text() if plans_txt.is_file() else ""
    if not runs:
        (out / "ep_train.txt").write_text(plans + "no run left a summary\n")
        raise SystemExit(f"ep_train_report.py: error: no run summaries in {work}")
    (out / "summaries.json").write_text(json.dumps(
        {name: {"summary": run[0], "config": run[3]} for name, run in runs.items()},
        indent=1) + "\n")
    head = ["run", "model (layout)", "steps (first → last)", "ms/step", "tokens/s",
            "peak GiB per GPU", "last loss", "resumed", "stopped"]
    rows = [_row(name, run) for name, run in runs.items()]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    first = next(iter(runs.values()))[0]
    tags = (f"{first.get('env_device')} x{first['world']}, torch {first.get('env_torch')}, "
            f"triton {first.get('env_triton')}, commit {first.get('env_commit')}, "
            f"{first.get('env_date')}")
    if "ep2" in runs and "resumed" in runs:
        lines.append(_continuity(runs["ep2"], runs["resumed"]))
    text = "\n".join([tags] + lines) + "\n"
    (out / "ep_train.txt").write_text(plans + text)
    print(text, end="")
    curves = {f"{name}: {run[0]['name']}, {_layout(run[3], run[0]['world'])}": run
              for name, run in runs.items() if name != "moe1024" and run[1]}
    if curves:
        _plot(curves, out / "loss.png", tags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plans")
    pp.add_argument("layouts", nargs="+", metavar="'PRESET SECTION.KEY=VALUE ...'")
    pp.add_argument("--device", default="cuda")
    pp.add_argument("--world", type=int, default=2)
    pp.add_argument("--data", required=True, help="prepared data (for its vocabulary)")
    pr = sub.add_parser("report")
    pr.add_argument("work")
    pr.add_argument("out")
    args = p.parse_args()
    plans(args) if args.cmd == "plans" else report(args)


if __name__ == "__main__":
    main()
