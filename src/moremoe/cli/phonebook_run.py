"""The execution options the phonebook commands share (devices, runs at once, resume, a time
budget) and the loop that runs their plans while keeping the report and plot current."""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from ..report import check_new_output, check_output_dir, emit, write_json
from ..runtime import duration, resolve_device
from .args import _positive_float, _positive_int

DEFAULT_CONCURRENT = 4      # runs at once on one GPU (benchmarks/NOTES.md, issue 33)
EXIT_STOPPED = 75           # as `moremoe train`'s budget stop: checkpointed, --resume continues


def add_execution_args(p) -> None:
    from ..training.phonebook_step import STEP_MODES
    e = p.add_argument_group("execution")
    e.add_argument("--device", default="auto",
                   help="auto (every visible GPU, else the CPU), cpu, cuda or cuda:N")
    e.add_argument("--jobs", type=_positive_int, default=None,
                   help="GPUs to spread the runs over, one worker process each (default: "
                        "every visible GPU with --device auto or cuda)")
    e.add_argument("--concurrent", type=_positive_int, default=None,
                   help=f"runs at once on each GPU, each on a CUDA stream of its own (default "
                        f"{DEFAULT_CONCURRENT} on a GPU, 1 on a CPU)")
    e.add_argument("--step", choices=STEP_MODES, default="auto",
                   help="how a training step runs: graph (one CUDA graph replayed a step; "
                        "GPU), compiled (the same, the blocks torch.compile'd first: faster "
                        "steps, seconds of compiling), eager (op by op: the reference, and the "
                        "CPU path) or auto (the default: on a GPU compiled for runs of 5,000 "
                        "steps or more, graph for shorter ones; eager on a CPU)")
    e.add_argument("--out", default=None, help="output folder (default runs/<command>-<time>)")
    e.add_argument("--force", action="store_true",
                   help="replace the report, plot and journal of an earlier run in --out")
    e.add_argument("--resume", action="store_true",
                   help="continue the work in --out: finished runs (OUT/trials.jsonl) are "
                        "reused, interrupted ones continue from OUT/trial_checkpoints")
    e.add_argument("--stop-after", type=_positive_float, default=None, metavar="MINUTES",
                   help="after this many minutes checkpoint every running run and stop (exit "
                        "status 75); --resume continues")
    e.add_argument("--checkpoint-minutes", type=_positive_float, default=5.0,
                   help="checkpoint each running run this often (default 5)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")


def outputs(args, command: str, stem: str) -> tuple[Path, Path]:
    """The report and plot paths in --out (default runs/<command>-<time>), checked before
    any work: an earlier report, plot or journal kept unless --force (which starts afresh)
    or --resume (which continues it)."""
    from ..model.checkpoint import check_not_a_run
    from ..training.phonebook_pool import CHECKPOINTS, JOURNAL
    out = Path(args.out) if args.out else \
        Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_not_a_run(out, "--out")          # --force would delete its checkpoints folder
    names = (f"{stem}.json", f"{stem}.png")
    if args.resume:
        if args.out is None:
            raise ValueError("--resume continues the work in --out: give --out")
        if not (out / JOURNAL).exists():
            raise ValueError(f"--resume: {out} holds no {JOURNAL}, so there is nothing to "
                             f"continue; drop --resume to start")
        check_output_dir(out, "--out")
    else:
        check_new_output(out, "--out", args.force, names=(*names, JOURNAL))
        if args.force:
            (out / JOURNAL).unlink(missing_ok=True)
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    return out / names[0], out / names[1]


def devices(args) -> list[str]:
    """The devices the runs go to: the CPU, one GPU (cuda:N), or --jobs GPUs."""
    import torch
    dev = resolve_device(args.device)
    if dev.type == "cpu" or dev.index is not None:
        if args.jobs not in (None, 1):
            raise ValueError(f"--jobs {args.jobs} spreads the runs over GPUs, but --device "
                             f"{args.device} names one device; use --device auto or cuda")
        return ["cpu"] if dev.type == "cpu" else [f"cuda:{dev.index}"]
    count = torch.cuda.device_count()
    if args.jobs is not None and args.jobs > count:
        raise ValueError(f"--jobs {args.jobs}: this machine has {count} GPU(s)")
    return [f"cuda:{i}" for i in range(args.jobs or count)]


def execute(args, plans: dict, json_path: Path, report: dict, render):
    """Run the plans; render(results, in_round) fills the report and draws the plot after
    every finished run and at the end (the report is written each time). in_round: plan
    name -> the finished training runs of the round an unfinished plan still waits on."""
    from ..training.phonebook_pool import Executor
    devs = devices(args)
    slots = args.concurrent or (1 if devs == ["cpu"] else DEFAULT_CONCURRENT)
    ex = Executor(devs, slots, json_path.parent, progress=not args.no_progress,
                  checkpoint_minutes=args.checkpoint_minutes,
                  stop_after=None if args.stop_after is None else 60 * args.stop_after)
    t0 = time.monotonic()

    def update(results):
        render(results, ex.in_round)
        report["execution"] = {
            "devices": devs, "concurrent": slots, "step": args.step,
            "seconds": time.monotonic() - t0, "finished": len(results) == len(plans),
            "reused": ex.report.reused, "resumed": ex.report.resumed,
            "stopped": ex.report.stopped, "stopped_at": ex.report.stopped_at}
        write_json(json_path, report)
    ex.run(plans, on_change=update)
    update(ex.results)
    return ex


def capacity_text(result: dict) -> str:
    """10,000; >= 10,000 while the search is unfinished; none on grid."""
    if result["capacity"] is None:
        return "none yet" if result.get("unfinished") else "none on grid"
    return (">= " if result.get("unfinished") else "") + f"{result['capacity']:,}"


def finish(args, ex, report: dict, text: str) -> int:
    """Print the report (a table, or JSON); a stopped command says how to continue and
    exits 75."""
    from ..training.phonebook_pool import CHECKPOINTS
    emit(args, report, text)
    if not ex.stopped:
        return 0
    run = report["execution"]
    print(f"stopped after {duration(run['seconds'])}: {len(run['stopped'])} run(s) "
          f"checkpointed in {Path(args.out or '.') / CHECKPOINTS}; the same command with "
          f"--resume continues", file=sys.stderr)
    for r in run.get("stopped_at", []):
        print(f"  {r['name']}: step {r['steps']:,} of {r['total']:,}, last evaluated at epoch "
              f"{r['epoch']:,.0f} (exact match {r['exact_match']:.3f})", file=sys.stderr)
    return EXIT_STOPPED
