"""The ``moremoe`` command line: thin parsing over the library.

Every command prints a readable table by default and JSON with ``--json``; long work shows
a progress bar on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import accounting
from .runtime import __version__
from .checks import UserError
from .cli_args import (_add_json, _float_list, _fraction, _int_at_least, _int_list,
                       _positive_float, _positive_int)
from .cli_bench import add_bench_parser
from .cli_data import add_data_parser
from .cli_train import add_train_parser
from .cli_eval import add_eval_parser
from .report import check_output_dir, emit, human, table, write_json

EPILOG = "Letters: M experts, k active experts, h hidden, s expert width, r router rank."


_emit = emit


# ---------------------------------------------------------------- flops

def cmd_flops(args) -> int:
    M, k, h, s, r = args.experts, args.top_k, args.hidden, args.width, args.rank
    if k > M:
        raise ValueError(f"--top-k must be in [1, --experts={M}], got {k}")
    model = {"layers": args.layers, "vocab": args.vocab, "heads": args.heads}
    given = [n for n, v in model.items() if v is not None]
    if given and len(given) < len(model):
        missing = ", ".join(f"--{n.replace('_', '-')}" for n, v in model.items() if v is None)
        raise ValueError(f"total parameters need --layers, --vocab and --heads; "
                         f"missing {missing}")
    out = {"name": f"{'MoE' if r is None else 'MoRE'}-{M}", "experts": M, "top_k": k,
           "hidden": h, "width": s, "rank": r,
           "params_router": accounting.router_params(M, h, r),
           "params_experts": accounting.expert_params(M, h, s),
           "flops_inference": accounting.active_flops(M, k, h, s, r),
           "flops_training": accounting.active_flops(M, k, h, s, r, training=True)}
    if given:
        if h % args.heads:
            raise ValueError(f"--heads must divide --hidden={h}, got {args.heads}")
        out["params_total"] = accounting.total_params(
            vocab=args.vocab, hidden=h, layers=args.layers, experts=M, width=s,
            heads=args.heads, kv_heads=args.kv_heads, rank=r)
    rows = [["router parameters (per layer)", f"{out['params_router']:,}"],
            ["expert parameters (per layer)", f"{out['params_experts']:,}"],
            ["active FLOPs / token / layer, inference", f"{out['flops_inference']:,}"],
            ["active FLOPs / token / layer, training", f"{out['flops_training']:,}"]]
    if "params_total" in out:
        rows.append([f"total parameters ({args.layers} layers, V={args.vocab})",
                     f"{out['params_total']:,} ({human(out['params_total'])})"])
    title = (f"{out['name']}: MoE(M={M}, k={k}, h={h}, s={s})" if r is None else
             f"{out['name']}: MoRE(M={M}, k={k}, h={h}, s={s}, r={r})")
    _emit(args, out, title + "\n" + table(rows, ["quantity", "value"]))
    return 0


# ---------------------------------------------------------------- plan

def cmd_plan(args) -> int:
    plan = accounting.plan_matched(
        hidden=args.hidden, top_k=args.top_k, rank=args.rank, budget=args.budget,
        width=None if args.budget is not None else args.width, experts=args.experts,
        ce=args.ce, cr=args.cr, round_width=args.round_width, refit=args.refit)
    moe, more = plan.moe, plan.more
    rows = [["experts M", moe.experts, more.experts],
            ["width s", moe.width, more.width],
            ["rank r", "-", more.rank],
            ["router parameters", f"{moe.params_router:,}", f"{more.params_router:,}"],
            ["MLP parameters 3Mhs", f"{moe.params_mlp:,}", f"{more.params_mlp:,}"],
            [f"active FLOPs (C_e={args.ce:g}, C_r={args.cr:g})", f"{moe.flops:,.0f}",
             f"{more.flops:,.0f}"],
            ["optimum (M, s) before rounding", "({:.1f}, {:.2f})".format(*plan.moe_optimum),
             "({:.1f}, {:.2f})".format(*plan.more_optimum)]]
    text = (f"Matched active-FLOP plan at tau = {plan.budget:,.0f} FLOPs/token/layer "
            f"(h={args.hidden}, k={args.top_k})\n"
            + table(rows, ["", moe.name, more.name])
            + f"\nMoRE holds {plan.expert_ratio:.2f}x the experts and "
              f"{plan.param_ratio:.2f}x the MLP parameters (h/r = {args.hidden / args.rank:g}).")
    _emit(args, plan.to_dict(), text)
    return 0


# ---------------------------------------------------------------- phonebook

def _check_phonebook_args(args) -> None:
    """The arguments the model and the phonebook cannot take, named as the user gave them."""
    from .tasks.phonebook import NAME_SPACE
    h = args.hidden
    if args.heads is not None and h % args.heads:
        raise ValueError(f"--heads {args.heads} must divide --hidden {h}")
    if args.rank > h:
        raise ValueError(f"--rank {args.rank} must be at most --hidden {h} (a rank above h "
                         f"adds router parameters, not expressivity)")
    sizes = [args.size] if hasattr(args, "size") else args.sizes
    if max(sizes) > NAME_SPACE:
        raise ValueError(f"{'--size' if hasattr(args, 'size') else '--sizes'} {max(sizes):,} "
                         f"exceeds the {NAME_SPACE:,} unique five-letter names a phonebook "
                         f"can hold")


def _phonebook_models(args):
    """The model configs to train, from --arch and the planner (paper convention)."""
    from .nn.moe import MoEConfig
    from .training.phonebook import phonebook_model_config
    _check_phonebook_args(args)
    plan = accounting.plan_matched(hidden=args.hidden, top_k=args.top_k, rank=args.rank,
                                   width=args.width, round_width=args.round_width,
                                   refit=args.refit)
    configs = []
    if args.arch in ("moe", "both"):
        M = args.moe_experts or plan.moe.experts
        configs.append(MoEConfig.moe(M, args.top_k, args.hidden, args.width))
    if args.arch in ("more", "both"):
        M = args.more_experts or plan.more.experts
        s = args.more_width or plan.more.width
        configs.append(MoEConfig.more(M, args.top_k, args.hidden, s, args.rank))
    return plan, [phonebook_model_config(c, layers=args.layers, heads=args.heads)
                  for c in configs]


def _train_config(args, size: int):
    from .training.phonebook import PhonebookTrainConfig
    return PhonebookTrainConfig(
        size=size, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
        lr_grid=tuple(args.lr_grid), calibration_steps=args.calibration_steps,
        max_epochs=args.max_epochs, max_steps=args.max_steps, max_minutes=args.max_minutes,
        threshold=args.threshold, eval_every=args.eval_every, eval_entries=args.eval_entries,
        loss_on=args.loss_on, device=args.device)


def _out_dir(args, command: str) -> Path:
    if args.out:
        return Path(args.out)
    return Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def _run_row(run: dict) -> list:
    moe = run["model"]["moe"]
    hn = run["hnorm"]
    return [run["name"].split("(")[0] + f"-{moe['experts']}", moe["experts"], moe["width"],
            moe["rank"] or "-", human(run["params_total"]), f"{run['flops_inference']:,}",
            f"{run['lr']:g}", run["steps"], f"{run['exact_match']:.3f}",
            f"{run['char_accuracy']:.3f}",
            f"{sum(hn) / len(hn):.3f} [{min(hn):.2f}, {max(hn):.2f}]" if hn else "-",
            "yes" if run["reached"] else "no"]


RUN_HEADERS = ["model", "M", "s", "r", "params", "FLOPs/tok/layer", "lr", "steps",
               "exact match", "digit acc", "H_norm mean [min, max]", "reached"]


def cmd_phonebook_train(args) -> int:
    from .plots import plot_phonebook_runs
    from .training.phonebook import train_phonebook
    plan, models = _phonebook_models(args)
    out_dir = check_output_dir(_out_dir(args, "phonebook-train"), "--out")
    report = {"command": "phonebook train", "size": args.size, "plan": plan.to_dict(),
              "runs": []}
    json_path, png_path = out_dir / "phonebook_train.json", out_dir / "phonebook_train.png"
    for model_cfg in models:
        def save(run, _i=len(report["runs"])):
            report["runs"][_i:] = [run.to_dict()]
            write_json(json_path, report)
        run, _ = train_phonebook(model_cfg, _train_config(args, args.size),
                                 progress=not args.no_progress, on_eval=save)
        save(run)
    plot_phonebook_runs(report["runs"], png_path,
                        title=f"phonebook, {args.size:,} entries")
    report["files"] = {"json": str(json_path), "png": str(png_path)}
    write_json(json_path, report)
    text = (table([_run_row(r) for r in report["runs"]], RUN_HEADERS)
            + f"\nreport: {json_path}\nplot:   {png_path}")
    _emit(args, report, text)
    return 0


def cmd_phonebook_capacity(args) -> int:
    from .plots import plot_capacity
    from .training.phonebook import capacity_search
    plan, models = _phonebook_models(args)
    out_dir = check_output_dir(_out_dir(args, "phonebook-capacity"), "--out")
    json_path, png_path = out_dir / "capacity.json", out_dir / "capacity.png"
    report = {"command": "phonebook capacity", "sizes": sorted(set(args.sizes)),
              "plan": plan.to_dict(), "results": []}
    for model_cfg in models:
        def save(result, _i=len(report["results"])):
            report["results"][_i:] = [result.to_dict()]
            write_json(json_path, report)
        result = capacity_search(model_cfg, args.sizes, _train_config(args, args.sizes[0]),
                                 progress=not args.no_progress, on_trial=save)
        save(result)
    plot_capacity(report["results"], png_path)
    report["files"] = {"json": str(json_path), "png": str(png_path)}
    write_json(json_path, report)
    rows = [[r["name"], r["capacity"] if r["capacity"] is not None else "none on grid",
             ", ".join(f"{t['train']['size']:,}: {t['exact_match']:.2f}" for t in r["trials"])]
            for r in report["results"]]
    text = (table(rows, ["model", "capacity", "trials (size: exact match)"])
            + f"\nreport: {json_path}\nplot:   {png_path}")
    _emit(args, report, text)
    return 0


# ---------------------------------------------------------------- demo

def cmd_demo(args) -> int:
    from .demo import DemoConfig, format_demo, run_demo
    out_dir = check_output_dir(Path(args.out) if args.out else Path("runs") / "demo", "--out")
    result = run_demo(DemoConfig(device=args.device, size=args.size, steps=args.steps),
                      out_dir=out_dir, progress=not args.no_progress)
    _emit(args, result, format_demo(result))
    return 0


# ---------------------------------------------------------------- parser

def _add_phonebook_args(p, *, sizes: bool) -> None:
    if sizes:
        p.add_argument("--sizes", type=_int_list, required=True,
                       help="grid of phonebook sizes, e.g. 1000,3000,10000,30000")
    else:
        p.add_argument("--size", type=_positive_int, required=True,
                       help="phonebook entries (unique names)")
    m = p.add_argument_group("model (defaults: the paper's h=64, s=8 point)")
    m.add_argument("--arch", choices=("moe", "more", "both"), default="both",
                   help="train the MoE, the MoRE, or the matched pair (default)")
    m.add_argument("--hidden", type=_positive_int, default=64, help="h (default 64)")
    m.add_argument("--width", type=_positive_int, default=8, help="MoE expert width s (default 8)")
    m.add_argument("--top-k", type=_positive_int, default=4, help="k (default 4)")
    m.add_argument("--rank", type=_positive_int, default=16, help="MoRE router rank r (default 16)")
    m.add_argument("--layers", type=_positive_int, default=6, help="L (default 6)")
    m.add_argument("--heads", type=_positive_int, default=None,
                   help="attention heads (default h/32)")
    m.add_argument("--moe-experts", type=_positive_int, default=None,
                   help="MoE experts M (default: the planner's optimum k s)")
    m.add_argument("--more-experts", type=_positive_int, default=None,
                   help="MoRE experts M' (default: the planner's matched M')")
    m.add_argument("--more-width", type=_positive_int, default=None,
                   help="MoRE expert width s' (default: the planner's, rounded)")
    m.add_argument("--round-width", type=_positive_int, default=8,
                   help="round the planned MoRE width to this multiple (default 8, as the paper)")
    m.add_argument("--refit", action="store_true",
                   help="re-fit M' to the budget after rounding s' (default: keep the optimum's "
                        "M', the paper's convention)")
    t = p.add_argument_group("training")
    t.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="phonebook, init and data-order seed")
    t.add_argument("--batch-size", type=_positive_int, default=1024)
    t.add_argument("--lr", type=_positive_float, default=None,
                   help="learning rate (default: calibrate over --lr-grid by a short run)")
    t.add_argument("--lr-grid", type=_float_list, default=[1e-4, 3e-4, 1e-3],
                   help="calibration grid (default 1e-4,3e-4,1e-3)")
    t.add_argument("--calibration-steps", type=_positive_int, default=200)
    t.add_argument("--max-epochs", type=_positive_float, default=1500.0)
    t.add_argument("--max-steps", type=_positive_int, default=None, help="overrides --max-epochs")
    t.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop each run after this wall-clock time")
    t.add_argument("--threshold", type=_fraction, default=0.9,
                   help="early-stop exact match (default 0.9)")
    t.add_argument("--eval-every", type=_positive_int, default=100, help="steps between evaluations")
    t.add_argument("--eval-entries", type=_positive_int, default=1000,
                   help="training entries sampled for exact match (default 1000)")
    t.add_argument("--loss-on", choices=("number", "all"), default="number",
                   help="tokens that carry the loss: the 8 digits and '.' (default) or all")
    t.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    t.add_argument("--out", default=None, help="output folder (default runs/<command>-<time>)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_json(p)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors in one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="moremoe", epilog=EPILOG,
        description="MoRE: Mixture of Rank-reduced-routed Experts. Accounting, planning and "
                    "experiments for MoE layers with a low-rank router R1 (M×r) · R2 (r×h).")
    parser.add_argument("--version", action="version", version=f"moremoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("flops", epilog=EPILOG, help="parameters and active FLOPs of one layer",
                       description="Router/expert parameters and per-token active FLOPs of one "
                       "MoE layer (MoRE with --rank); total parameters when --layers, --vocab "
                       "and --heads are given (paper Appendix C).")
    p.add_argument("--experts", type=_positive_int, required=True, help="M")
    p.add_argument("--top-k", type=_positive_int, required=True, help="k")
    p.add_argument("--hidden", type=_positive_int, required=True, help="h")
    p.add_argument("--width", type=_positive_int, required=True, help="s")
    p.add_argument("--rank", type=_positive_int, default=None, help="r (MoRE); omit for MoE")
    p.add_argument("--layers", type=_positive_int, default=None, help="L")
    p.add_argument("--vocab", type=_positive_int, default=None, help="V")
    p.add_argument("--heads", type=_positive_int, default=None, help="attention heads")
    p.add_argument("--kv-heads", type=_positive_int, default=None, help="kv heads (default: heads)")
    _add_json(p)
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser("plan", epilog=EPILOG, help="matched-active-FLOP MoE and MoRE side by side",
                       description="The MoE and MoRE layers that maximise MLP parameters at the "
                       "active-FLOP budget of a reference MoE (width --width, experts --experts "
                       "or the optimum k s), by the Proposition of the paper's Appendix I.")
    p.add_argument("--hidden", type=_positive_int, required=True, help="h")
    p.add_argument("--width", type=_positive_int, required=True, help="reference MoE width s")
    p.add_argument("--top-k", type=_positive_int, required=True, help="k")
    p.add_argument("--rank", type=_positive_int, required=True, help="MoRE router rank r")
    p.add_argument("--experts", type=_positive_int, default=None,
                   help="reference MoE experts M (default: the optimum C_e k s / C_r)")
    p.add_argument("--budget", type=_positive_float, default=None,
                   help="give tau directly instead of a reference MoE (--width then ignored)")
    p.add_argument("--round-width", type=_positive_int, default=1,
                   help="round planned widths to this multiple (default 1)")
    p.add_argument("--no-refit", dest="refit", action="store_false",
                   help="keep the optimum's M after rounding s instead of re-fitting it")
    p.add_argument("--ce", type=_positive_float, default=6.0, help="C_e (default 6, inference)")
    p.add_argument("--cr", type=_positive_float, default=6.0, help="C_r (default 6, inference)")
    _add_json(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("phonebook", help="the phonebook memorisation experiment",
                       description="Train MoE and/or MoRE on a phonebook of unique names and "
                       "8-digit numbers, or search the memorisation capacity.")
    psub = p.add_subparsers(dest="phonebook_command", metavar="SUBCOMMAND", required=True)
    pt = psub.add_parser("train", epilog=EPILOG, help="train on one phonebook size",
                         description="Train on one phonebook; writes a JSON report (loss and "
                         "exact match over steps, H_norm per layer) and a PNG plot.")
    _add_phonebook_args(pt, sizes=False)
    pt.set_defaults(func=cmd_phonebook_train)
    pc = psub.add_parser("capacity", epilog=EPILOG, help="largest size memorised, on a grid",
                         description="Binary search of the largest phonebook size on --sizes "
                         "that reaches the exact-match threshold; JSON report and PNG plot.")
    _add_phonebook_args(pc, sizes=True)
    pc.set_defaults(func=cmd_phonebook_capacity)

    add_bench_parser(sub)
    add_data_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)

    p = sub.add_parser("demo", help="the main job: a matched MoE / MoRE pair on a phonebook",
                       description="Plan a matched-FLOP MoE/MoRE pair at h=64, train both on "
                       "the same phonebook and compare experts, parameters, FLOPs, exact match, "
                       "H_norm and router time per token. Uses the GPU when one is present; "
                       "a few minutes on a 2-core CPU.")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda[:N]")
    p.add_argument("--size", type=_positive_int, default=None, help="phonebook entries")
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps per model")
    p.add_argument("--out", default=None, help="output folder (default runs/demo)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_json(p)
    p.set_defaults(func=cmd_demo)
    return parser


# Errors a user can act on: printed as one line, exit status 2. Anything else is a bug:
# one line that says so, exit status 1. --debug or MOREMOE_DEBUG=1 shows the traceback.
EXPECTED = (UserError, ValueError, TypeError, LookupError, OSError, ImportError)


def _leaves(parser: argparse.ArgumentParser):
    """Every parser that runs a command (the ones without subcommands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in action.choices.values():
            yield from _leaves(child)


def _with_debug(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for leaf in _leaves(parser):
        leaf.add_argument("--debug", action="store_true",
                          help="show the traceback of an error (also MOREMOE_DEBUG=1)")
        leaf.set_defaults(prog=leaf.prog)
    return parser


def one_line(err: BaseException) -> str:
    """The message of an error as one line (KeyError's without its quotes)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    text = " ".join(str(text).split())
    return text or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    args = _with_debug(build_parser()).parse_args(argv)
    debug = args.debug or os.environ.get("MOREMOE_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{args.prog}: interrupted; reports written so far are kept", file=sys.stderr)
        return 130
    except EXPECTED as err:
        if debug:
            raise
        print(f"{args.prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:      # noqa: BLE001 - a bug: say so in one line, not a traceback
        if debug:
            raise
        print(f"{args.prog}: error: internal error ({type(err).__name__}: {one_line(err)}); "
              f"run it again with --debug for the traceback and report it", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
