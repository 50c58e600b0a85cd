"""``moremoe eval``: validation perplexity and lm-eval tasks (moremoe.eval) from the command
line, the report printed before it is written."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from ..checks import UserError
from .args import _add_json, _int_at_least, _path, _positive_int
from .memory import advise_on_memory
from ..report import check_apart, check_new_output, table, write_json
from ..report import emit as _emit


def _model_and_device(args):
    """(model, device, checkpoint): checkpoint is {"path", "step"} of the moremoe checkpoint
    evaluated (None for a transformers directory); a run's newer checkpoints passed over
    because they are incomplete are named in a warning."""
    from ..eval.zero_shot import load_eval_model, resolve_eval_model
    from ..model.checkpoint import describe_incomplete
    from ..runtime import resolve_device
    device = resolve_device(args.device)
    path, checkpoint, passed = resolve_eval_model(args.model)
    if passed:
        print(f"{args.prog}: warning: the newest checkpoint of {args.model} is incomplete: "
              f"{describe_incomplete(passed)}; evaluating {path} (step {checkpoint['step']}), "
              f"the newest complete one", file=sys.stderr)
    try:
        return load_eval_model(path, device), device, checkpoint
    except ImportError as err:
        raise ImportError(f"cannot load {args.model}: {err}") from err


def _read_paths(args) -> list[tuple[str, Path | None]]:
    """What eval reads, which its report never goes into: MODEL, the run that MODEL is a
    checkpoint of, and --data."""
    from ..model.checkpoint import CKPT_DIR
    model = Path(args.model)
    run = model.parent.parent if model.parent.name == CKPT_DIR else None
    return [("MODEL", model), ("the run of MODEL", run), ("--data", args.data)]


def _check_data(data: str) -> None:
    """--data is prepared data with validation sequences, before any model is loaded: a
    perplexity of no tokens would be nan."""
    from ..tasks.text import read_meta
    try:
        meta = read_meta(data)
    except ValueError as err:
        raise ValueError(f"--data {data}: {err}") from err
    if meta["val_sequences"] == 0:
        raise ValueError(f"--data {data} holds no validation sequences (prepared with "
                         f"--val-sequences 0): there is no perplexity to measure; prepare the "
                         f"text again with --val-sequences 1 or more")


def _val_rows(data: str, config):
    """The validation rows of a prepared directory, cut to the model's max_seq_len when they
    are longer (as training reads them), after checking the vocabulary fits the model."""
    import numpy as np

    from ..tasks.text import open_tokens, read_meta
    from ..training.data import check_ids, rows_of
    vocab = int(read_meta(data)["vocab_size"])
    if vocab > config.vocab:
        raise ValueError(f"the data's vocab_size={vocab} exceeds the model's vocab="
                         f"{config.vocab}")
    rows = open_tokens(data, "val")
    check_ids(np.asarray(rows), config.vocab, str(Path(data) / "val.bin"))
    return rows_of(rows, config.max_seq_len) if rows.shape[1] > config.max_seq_len else rows


def cmd_eval(args) -> int:
    from ..eval.zero_shot import offline_unless_hub_reachable, quiet_libraries, task_manager
    tasks = [t for t in args.tasks.replace(" ", "").split(",") if t and t != "none"]
    twice = next((t for i, t in enumerate(tasks) if t in tasks[:i]), None)
    if twice is not None:
        raise ValueError(f"--tasks {args.tasks} lists {twice} twice; give each task once")
    if not tasks and not args.data:
        raise ValueError("nothing to evaluate: give --data DIR and/or --tasks")
    if args.out:
        check_apart(args.out, "--out", _read_paths(args), "eval never writes into what "
                    "it reads (not even with --force); give a report path outside MODEL and "
                    "--data")
        check_new_output(args.out, "--out", args.force)
    if args.data:
        _check_data(args.data)
    if tasks:                 # before transformers or datasets read their offline settings
        offline_unless_hub_reachable()
    with advise_on_memory(f"{args.model} at --batch-size {args.batch_size}",
                          "lower --batch-size (and --max-gen-toks for generation tasks), or "
                          "evaluate on a device with more memory (--device)"), \
            quiet_libraries(not args.no_progress, lm_eval=bool(tasks)):
        model, device, checkpoint = _model_and_device(args)
        # every task is known before any work (and progress line) starts
        manager = task_manager(tasks, include_path=args.include_path) if tasks else None
        result = {"model": str(args.model), "checkpoint": checkpoint, "device": str(device),
                  "perplexity": None, "tasks": {}}
        _evaluate(args, model, device, tasks, manager, result)
    _emit(args, result, format_eval(result))       # the numbers first, whatever happens next
    if args.out:
        _write_report(Path(args.out), result)
    return 0


def _evaluate(args, model, device, tasks: list[str], manager, result: dict) -> None:
    """Validation perplexity (--data) and the lm-eval tasks, into result."""
    from ..eval.zero_shot import run_harness
    if args.data:
        from ..eval.perplexity import evaluate_perplexity
        try:
            seqs = _val_rows(args.data, model.config)
        except ValueError as err:
            raise ValueError(f"--data {args.data}: {err}") from err
        result["perplexity"] = evaluate_perplexity(model, seqs, batch_size=args.batch_size,
                                                   max_batches=args.val_batches, device=device,
                                                   progress=not args.no_progress)
    if tasks:
        from ..eval.lm_eval_adapter import MoremoeLM
        lm = MoremoeLM(model=model, batch_size=args.batch_size, device=str(device),
                       max_gen_toks=args.max_gen_toks, progress=not args.no_progress)
        result["tasks"] = run_harness(lm, tasks, num_fewshot=args.num_fewshot,
                                      limit=args.limit, manager=manager)
        result["lm_eval"] = {"num_fewshot": args.num_fewshot, "limit": args.limit}


def _write_report(path: Path, result: dict) -> None:
    """Write the report; if that fails (a full disk), write it to the temporary folder and
    say where, so the evaluated numbers are never lost."""
    try:
        write_json(path, result)
    except OSError as err:
        spare = Path(tempfile.gettempdir()) / f"moremoe-eval-{time.strftime('%Y%m%d-%H%M%S')}-" \
                                              f"{os.getpid()}.json"
        write_json(spare, result)
        raise UserError(f"--out {path}: cannot write the report ({err.strerror or err}); it "
                        f"is in {spare} (and printed above)") from err
    print(f"report: {path}", file=sys.stderr)


def format_eval(result: dict) -> str:
    """The paper's layout: value ± standard error in %, the paper's metric of each task
    first and starred."""
    from ..eval.zero_shot import PAPER_METRIC
    rows = []
    ppl = result.get("perplexity")
    if ppl:
        rows.append(["validation", "perplexity", f"{ppl['perplexity']:.2f}", "",
                     f"{ppl['tokens']:,} tokens"])
    for task, r in result["tasks"].items():
        paper = PAPER_METRIC.get(task)
        for name in sorted(r["metrics"], key=lambda m: (m != paper, m)):
            m = r["metrics"][name]
            value = "-" if m["value"] is None else f"{100 * m['value']:.2f}"
            se = "" if m["stderr"] is None else f"± {100 * m['stderr']:.2f}"
            rows.append([task, name + (" *" if name == paper else ""), value, se, r["n"]])
    ckpt = result.get("checkpoint")
    head = f"checkpoint {ckpt['path']} (step {ckpt['step']})\n" if ckpt else ""
    return (head + table(rows, ["task", "metric", "value %", "stderr", "n"])
            + "\n* the paper's metric; lm-eval's values in %, ± the standard error")


def add_eval_parser(sub) -> None:
    from ..eval.zero_shot import PAPER_TASKS
    p = sub.add_parser("eval", help="validation perplexity and zero-shot lm-eval tasks",
                       description="Validation perplexity on a prepared data directory (--data) "
                       "and zero-shot lm-evaluation-harness tasks, each task's metrics with "
                       "standard errors, as the paper's table. MODEL is a checkpoint, a run "
                       "directory (its newest checkpoint with complete model files; newer "
                       "incomplete ones are named in a warning) or a transformers directory; "
                       "the report records the checkpoint's path and step.")
    p.add_argument("model", type=_path, metavar="MODEL",
                   help="checkpoint, run or transformers directory")
    p.add_argument("--data", type=_path, default=None, metavar="DIR",
                   help="prepared data directory (moremoe data prepare): perplexity on val.bin")
    p.add_argument("--val-batches", type=_positive_int, default=None,
                   help="perplexity over at most this many batches (default: all of val.bin)")
    p.add_argument("--tasks", default=",".join(PAPER_TASKS),
                   help=f"comma-separated lm-eval tasks, or none (default {','.join(PAPER_TASKS)})")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="at most this many examples per task (for a quick check)")
    p.add_argument("--num-fewshot", type=_int_at_least(0), default=0,
                   help="few-shot examples (default 0)")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="sequences per forward pass (default 8)")
    p.add_argument("--max-gen-toks", type=_positive_int, default=256,
                   help="most tokens a generation task may produce (default 256), decoded "
                        "greedily with a static cache (one CUDA-graph replay a token on a GPU)")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--include-path", type=_path, default=None, metavar="DIR",
                   help="extra folder of lm-eval task YAMLs (e.g. local copies of the tasks)")
    p.add_argument("--out", type=_path, default=None, metavar="FILE.json",
                   help="also write the report here, never inside MODEL or --data (checked "
                        "before evaluating; if it cannot be written the report goes to the "
                        "temporary folder, which is named)")
    p.add_argument("--force", action="store_true", help="replace an existing --out report")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, lines in a log)")
    _add_json(p)
    p.set_defaults(func=cmd_eval)
