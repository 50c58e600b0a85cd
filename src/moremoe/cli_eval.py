"""The ``moremoe eval`` and ``moremoe hf export`` commands: thin parsing over ``moremoe.eval``
and ``moremoe.hf``."""
from __future__ import annotations

from .cli_args import _add_json, _positive_int
from .report import emit as _emit
from .report import table, write_json


def _model_and_device(args):
    from .eval.harness import load_eval_model
    from .training.common import resolve_device
    try:
        device = resolve_device(args.device)
        return load_eval_model(args.model, device), device
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    except ImportError as err:
        raise SystemExit(f"error: cannot load {args.model!r}: {err}") from None


def _val_rows(data: str, config):
    """The validation rows of a prepared directory, cut to the model's max_seq_len when they
    are longer (as training reads them), after checking the vocabulary fits the model."""
    from .tasks.text import open_tokens, read_meta
    from .training.data import rows_of
    vocab = int(read_meta(data)["vocab_size"])
    if vocab > config.vocab:
        raise ValueError(f"the data's vocab_size={vocab} exceeds the model's vocab="
                         f"{config.vocab}")
    rows = open_tokens(data, "val")
    return rows_of(rows, config.max_seq_len) if rows.shape[1] > config.max_seq_len else rows


def cmd_eval(args) -> int:
    from .eval.harness import run_harness
    tasks = [t for t in args.tasks.replace(" ", "").split(",") if t and t != "none"]
    if not tasks and not args.data:
        raise SystemExit("error: nothing to evaluate: give --data DIR and/or --tasks")
    model, device = _model_and_device(args)
    result = {"model": str(args.model), "device": str(device), "perplexity": None, "tasks": {}}
    if args.data:
        from .eval.perplexity import evaluate_perplexity
        try:
            seqs = _val_rows(args.data, model.config)
        except ValueError as err:
            raise SystemExit(f"error: --data {args.data}: {err}") from None
        result["perplexity"] = evaluate_perplexity(model, seqs, batch_size=args.batch_size,
                                                   max_batches=args.val_batches, device=device)
    if tasks:
        try:
            from .eval.lm_eval_adapter import MoremoeLM
        except ImportError as err:
            raise SystemExit(f"error: --tasks: {err}") from None
        lm = MoremoeLM(model=model, batch_size=args.batch_size, device=str(device),
                       max_gen_toks=args.max_gen_toks)
        result["tasks"] = run_harness(lm, tasks, num_fewshot=args.num_fewshot,
                                      limit=args.limit, include_path=args.include_path)
        result["lm_eval"] = {"num_fewshot": args.num_fewshot, "limit": args.limit}
    if args.out:
        write_json(args.out, result)
    _emit(args, result, format_eval(result) + (f"\nreport: {args.out}" if args.out else ""))
    return 0


def format_eval(result: dict) -> str:
    """The paper's layout: value ± standard error in %, the paper's metric of each task
    first and starred."""
    from .eval.harness import PAPER_METRIC
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
    return (table(rows, ["task", "metric", "value %", "stderr", "n"])
            + "\n* the paper's metric; lm-eval's values in %, ± the standard error")


def cmd_hf_export(args) -> int:
    try:
        from .hf import export
        from .training.checkpoint import load_model
    except ImportError as err:
        raise SystemExit(f"error: {err}") from None
    try:
        model = load_model(args.checkpoint)
    except (ValueError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    export(model, args.out_dir)
    out = {"checkpoint": str(args.checkpoint), "out_dir": str(args.out_dir)}
    _emit(args, out, f"wrote {args.out_dir} (config.json, model.safetensors); load it with "
          f"moremoe.hf.register() and AutoModelForCausalLM.from_pretrained")
    return 0


def add_eval_parser(sub) -> None:
    from .eval.harness import PAPER_TASKS
    p = sub.add_parser("eval", help="validation perplexity and zero-shot lm-eval tasks",
                       description="Validation perplexity on a prepared data directory (--data) "
                       "and zero-shot lm-evaluation-harness tasks, each task's metrics with "
                       "standard errors, as the paper's table. MODEL is a checkpoint, a run "
                       "directory (its latest checkpoint) or a transformers directory.")
    p.add_argument("model", metavar="MODEL", help="checkpoint, run or transformers directory")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="prepared data directory (moremoe data prepare): perplexity on val.bin")
    p.add_argument("--val-batches", type=_positive_int, default=None,
                   help="perplexity over at most this many batches (default: all of val.bin)")
    p.add_argument("--tasks", default=",".join(PAPER_TASKS),
                   help=f"comma-separated lm-eval tasks, or none (default {','.join(PAPER_TASKS)})")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="at most this many examples per task (for a quick check)")
    p.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples (default 0)")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="sequences per forward pass (default 8)")
    p.add_argument("--max-gen-toks", type=_positive_int, default=256,
                   help="most tokens a generation task may produce (default 256)")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="extra folder of lm-eval task YAMLs (e.g. local copies of the tasks)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the report here")
    _add_json(p)
    p.set_defaults(func=cmd_eval)

    h = sub.add_parser("hf", help="Hugging Face transformers interop")
    hsub = h.add_subparsers(dest="hf_command", metavar="SUBCOMMAND", required=True)
    e = hsub.add_parser("export", help="a checkpoint as a transformers directory",
                        description="Write a moremoe checkpoint as config.json + model.safetensors "
                        "that AutoModelForCausalLM loads after moremoe.hf.register().")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint or run directory")
    e.add_argument("out_dir", metavar="OUT_DIR", help="folder to write")
    _add_json(e)
    e.set_defaults(func=cmd_hf_export)
