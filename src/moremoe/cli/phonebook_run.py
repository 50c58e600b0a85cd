"""The execution options the phonebook commands share (devices, runs at once, resume, a time
budget) and the loop that runs their plans while keeping the report and plot current."""
from __future__ import annotations

import json
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
    from ..phonebook.step import STEP_MODES
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
                   help="start afresh in an --out that holds an earlier run: its journal and "
                        "checkpoints are deleted, its report and plots replaced, once every "
                        "check has passed (a refused command changes nothing)")
    e.add_argument("--resume", action="store_true",
                   help="continue the work in --out: finished runs (OUT/trials.jsonl) are "
                        "reused, interrupted ones continue from OUT/trial_checkpoints; give the "
                        "settings its report records again (the execution options, and "
                        "reproduce's choice of searches, may change)")
    e.add_argument("--stop-after", type=_positive_float, default=None, metavar="MINUTES",
                   help="after this many minutes checkpoint every running run and stop (exit "
                        "status 75; on a CPU after the current step, on a GPU at the next "
                        "evaluation); --resume continues")
    e.add_argument("--checkpoint-minutes", type=_positive_float, default=5.0,
                   help="checkpoint each running run this often (default 5)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")


# Each command's report, by its stem in --out; one folder holds one command's work.
REPORTS = {"phonebook_train": "train", "capacity": "capacity", "sweep": "sweep",
           "reproduce": "reproduce"}
# How a command runs, not what it measures: the flags a --resume may change.
HOW = ("out", "resume", "force", "device", "jobs", "concurrent", "checkpoint_minutes",
       "stop_after", "step", "no_progress", "json", "debug")
# reproduce: the rows file, and the selection of searches out of one journal; --ahead only
# orders a search's trials (each keyed by its own settings), and earlier sessions resumed
# with another (benchmarks/NOTES.md)
SELECTION = ("rows", "points", "arch", "ranks", "ahead")


def settings(args) -> dict:
    """The flags that define the experiment, as JSON has them: what a report records and a
    --resume must give again (every flag but HOW, and reproduce's SELECTION)."""
    from ..report import dumps
    skip = {*HOW, "command", "phonebook_command", "func", "prog",
            *(SELECTION if args.phonebook_command == "reproduce" else ())}
    got = {k: v for k, v in vars(args).items() if k not in skip}
    if isinstance(got.get("seed"), list) and len(got["seed"]) == 1:
        got["seed"] = got["seed"][0]    # reproduce's one seed, as its reports recorded it
    return json.loads(dumps(got))


def outputs(args, command: str, stem: str, writes=()) -> tuple[Path, Path]:
    """The report and plot paths in --out (default runs/<command>-<time>), after every check
    that can refuse the command (devices, the step mode on them, what --out holds), so that
    a refused command leaves --out as it was: an earlier run's files (report, plot, the
    other files it `writes`, journal, checkpoints) are kept unless --force (which clears
    them once the work starts: execute) or --resume (which continues the same experiment)."""
    from ..model.checkpoint import check_not_a_run
    from ..phonebook.step import check_mode
    out = Path(args.out) if args.out else \
        Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_not_a_run(out, "--out")          # --force would delete its checkpoints folder
    for dev in devices(args):
        check_mode(args.step, resolve_device(dev), "--step")
    names = (f"{stem}.json", f"{stem}.png", *writes)
    if args.resume:
        _check_resumable(args, out, stem)
        check_output_dir(out, "--out")
    else:
        check_new_output(out, "--out", args.force, names=(*names, *_work(out)))
    return out / names[0], out / names[1]


def _work(out: Path) -> list[str]:
    """The journal and checkpoints folder in out when they hold an earlier run's work (an
    empty journal, which a refused command of an older version left, holds none)."""
    from ..phonebook.journal import CHECKPOINTS, JOURNAL
    ckpts = out / CHECKPOINTS
    held = ckpts.is_dir() and any(ckpts.glob("*.pt"))
    journal = (out / JOURNAL).is_file() and (out / JOURNAL).stat().st_size > 0
    return [JOURNAL] * journal + [CHECKPOINTS] * held


def _check_resumable(args, out: Path, stem: str) -> None:
    """--resume continues this command's work in out with the settings its report records
    (a report without them, from an older version, is taken as it is)."""
    from ..phonebook.journal import JOURNAL
    if args.out is None:
        raise ValueError("--resume continues the work in --out: give --out")
    if not (out / JOURNAL).exists():
        raise ValueError(f"--resume: {out} holds no {JOURNAL}, so there is nothing to "
                         f"continue; drop --resume to start")
    for other, cmd in REPORTS.items():
        if other != stem and (out / f"{other}.json").exists():
            raise ValueError(f"--resume: {out} holds {other}.json, the work of `moremoe "
                             f"phonebook {cmd}`; continue it with that command, or give "
                             f"another --out")
    path = out / f"{stem}.json"
    if not path.exists():
        return
    try:
        report = json.loads(path.read_text())
    except ValueError:
        report = None
    if not isinstance(report, dict):
        raise ValueError(f"--resume: {path} is not a JSON report of this command; move it "
                         f"away, or give another --out")
    old = report.get("settings") or {}
    for key, value in settings(args).items():
        if key in old and old[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--resume: {path} records {_shown(flag, old[key])}, this "
                             f"command gives {_shown(flag, value)}; give the same settings, "
                             f"or another --out")


def _shown(flag: str, value) -> str:
    """A setting as the command line gives it: --size 10, --refit, no --lr."""
    if value is None or value is False:
        return f"no {flag}"
    if value is True:
        return flag
    if isinstance(value, list):
        return f"{flag} {','.join(map(str, value))}"
    return f"{flag} {value}"


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
    from ..phonebook.pool import CHECKPOINTS, JOURNAL, Executor
    devs = devices(args)
    slots = args.concurrent or (1 if devs == ["cpu"] else DEFAULT_CONCURRENT)
    if args.force and not args.resume:      # every check passed (outputs): the work starts
        (json_path.parent / JOURNAL).unlink(missing_ok=True)
        shutil.rmtree(json_path.parent / CHECKPOINTS, ignore_errors=True)
    ex = Executor(devs, slots, json_path.parent, progress=not args.no_progress,
                  checkpoint_minutes=args.checkpoint_minutes,
                  stop_after=None if args.stop_after is None else 60 * args.stop_after)
    t0 = time.monotonic()
    report["settings"] = settings(args)

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
    from ..phonebook.journal import CHECKPOINTS
    emit(args, report, text)
    if not ex.stopped:
        return 0
    run = report["execution"]
    out = Path(report["files"]["json"]).parent
    print(f"stopped after {duration(run['seconds'])}: {len(run['stopped'])} run(s) "
          f"checkpointed in {out / CHECKPOINTS}; the same command with "
          f"--resume continues", file=sys.stderr)
    for r in run.get("stopped_at", []):
        print(f"  {r['name']}: step {r['steps']:,} of {r['total']:,}, last evaluated at epoch "
              f"{r['epoch']:,.0f} (exact match {r['exact_match']:.3f})", file=sys.stderr)
    return EXIT_STOPPED
