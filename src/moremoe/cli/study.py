"""The ``moremoe study`` commands: thin parsing over ``moremoe.study``."""
from __future__ import annotations

import argparse
import sys

from .args import (_add_json, _float_list, _int_at_least, _int_list, _path, _positive_float,
                   _distinct, _integer)
from ..report import emit, human, table

DESCRIPTION = """\
Measure the paper's language-model claims at a scale one GPU trains: plan the runs from the
matched-FLOP planner, train them (several at once on each GPU, each a `moremoe train`
process), continue them from their checkpoints on the next command, and report every
number with its seeds and their spread.

Experiments (--experiments, comma list; the paper's figure in brackets):
  pair       MoE (M = k s) against the matched MoRE at each --budgets, every seed
             [tab:fineweb_p3_results, fig:gap_vs_tokens_ep_pair]
  experts    MoRE at (h, s', r) with M = M'/16 ... M'                 [fig:more_experts]
  rank       MoRE at s' and the pair's FLOPs, M fitted to each --ranks  [fig:rank_sweeps]
  init       variance-matched against per-entry router init, --init-ranks
                                                              [fig:initialization_ablation]
  router-lr  the router at --router-lr-factors times the lr          [fig:rlr_switch]
  paper      the h = 512 presets MoE-256 and MoRE-1792 (--peer: and PEER), one seed,
             lr 1e-3, --paper-tokens                                   [tab:peer_quality]
Learning rates follow the paper: each configuration of pair, experts and rank takes the
--lrs rate whose --lr-tokens run (first seed) ends lowest in validation loss; init and
router-lr take the pair MoRE's; --lr fixes one for all. Validation: every --eval-tokens
(the same marks for every run) on --val-sequences of the data's validation split (default
all). AdamW with fp32 moments, cosine schedule, 5 % warmup, clip 1.0 (the paper's); on a
GPU each run is compiled (--set train.compile=false to run eagerly). --set applies to
every run.

OUT holds study.json (the settings and the data's fingerprint: a later command continues
only with the same data and run settings, and may add experiments, budgets or seeds),
runs/ (each run's log and checkpoints), logs/ (each process's output), rows.jsonl (one row
per finished run: the evaluation curve, H_norm per layer, tokens per parameter, epochs,
time, device, versions, commit, fingerprints), report.json and the figures pair.png,
ablations.png and paper.png. A finished run's checkpoints are deleted once its row is
written (--keep-checkpoints keeps them); rows.jsonl and study.json are what a study needs
on another machine to continue: copy them into a new OUT.

Exit status: 0 every run done; 75 runs left (--max-minutes, a signal: run it again);
2 an error or a failed run (its output is in OUT/logs)."""

EXAMPLES = """\
examples:
  moremoe data corpus corpus --packages && moremoe data prepare corpus/train.jsonl \\
      --val-input corpus/val.jsonl --out data
  moremoe study lm --data data --out study --plan          # the runs, their sizes, no training
  moremoe study lm --data data --out study --max-minutes 9 # train; run again to continue
  moremoe study lm --data data --out study --experiments pair,experts,rank,init,router-lr
  moremoe study report study                              # the verdicts and figures again"""


def _seeds(text: str) -> list[int]:
    values = [_integer(t) for t in text.replace(" ", "").split(",") if t]
    if not values or None in values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 like 0,1,2, "
                                         f"got {text!r}")
    return _distinct(values, text)


def _experiments(text: str) -> list[str]:
    from ..study.plan import EXPERIMENTS
    names = [t for t in text.replace(" ", "").split(",") if t]
    names = list(EXPERIMENTS) if names == ["all"] else names
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(EXPERIMENTS)} "
                                         f"(or all), got {text!r}")
    return _distinct(names, text)


def _settings(args):
    from ..study.plan import StudySettings
    return StudySettings(
        experiments=tuple(args.experiments), hidden=args.hidden, layers=args.layers,
        heads=args.heads, kv_heads=args.kv_heads, top_k=args.top_k, width=args.width,
        rank=args.rank, seq_len=args.seq_len, batch=args.batch, budgets=tuple(args.budgets),
        sweep_tokens=args.sweep_tokens, paper_tokens=args.paper_tokens,
        seeds=tuple(args.seeds), lrs=tuple(args.lrs), lr_tokens=args.lr_tokens, lr=args.lr,
        eval_tokens=args.eval_tokens, val_sequences=args.val_sequences,
        experts=tuple(args.experts_sweep) if args.experts_sweep else None,
        ranks=tuple(args.ranks), init_ranks=tuple(args.init_ranks),
        router_lr_factors=tuple(args.router_lr_factors), peer=args.peer,
        max_epochs=args.max_epochs, overrides=tuple(args.set or ()))


def cmd_lm(args) -> int:
    from ..report import check_output_dir
    from ..study.runner import Launch, Study
    from ..training.metrics import printer
    check_output_dir(args.out, "--out")
    launch = Launch(device=args.device, parallel=args.parallel, max_minutes=args.max_minutes,
                    start_minutes=args.start_minutes, keep_checkpoints=args.keep_checkpoints,
                    progress=not args.no_progress)
    echo = printer(sys.stderr)
    study = Study(args.out, args.data, _settings(args), launch, echo=echo, force=args.force,
                  write=not args.plan)
    plan = _plan_rows(study)
    if args.plan:
        emit(args, {"plan": plan, "data": study.record}, _plan_text(study, plan))
        return 0
    result = study.train()
    report = _write(study)
    emit(args, {"result": result, "plan": _plan_rows(study), "report": report},
         _result_text(result) + "\n" + report_text(report))
    if result["failed"]:
        raise ValueError(f"{len(result['failed'])} run(s) failed: "
                         f"{', '.join(result['failed'][:3])}; their output is in "
                         f"{args.out}/logs/ (the next command tries them again)")
    if result["blocked"]:
        raise ValueError(f"{len(result['blocked'])} run(s) have no learning rate, every "
                         f"candidate of their selection having diverged (the first: "
                         f"{result['blocked'][0]}); start the study again with lower --lrs "
                         f"in another --out (or --force)")
    return 75 if result["left"] else 0


def _write(study):
    from ..study.outputs import write_outputs
    return write_outputs(study.out, study.settings, study.runs, study.rows, study.record)


def cmd_report(args) -> int:
    from pathlib import Path
    from ..study.plan import plan_runs
    from ..study.outputs import write_outputs
    from ..study.rows import read_rows
    from ..study.runner import read_study, settings_of
    study = read_study(Path(args.out))
    settings = settings_of(study, Path(args.out) / "study.json")
    report = write_outputs(args.out, settings, plan_runs(settings), read_rows(args.out),
                           study["data"])
    emit(args, report, report_text(report))
    return 0


def _plan_rows(study) -> list[dict]:
    from ..study.plan import arm_label, model_spec
    out = []
    for run in study.runs:
        tc = model_spec(run.model, study.settings).transformer_config(50257)
        params = tc.total_params()
        out.append({"run": run.name, "kind": run.kind, "model": arm_label(run.model),
                    "params": params, "tokens": run.tokens, "seed": run.seed,
                    "tokens_per_param": run.tokens / params,
                    "epochs": run.tokens / study.record["train_tokens"],
                    "lr": study.lr_of(run), "lr_from": run.lr_config,
                    "router_lr_factor": run.router_lr_factor,
                    "uses": [f"{e}: {a}" for e, a in run.uses], "state": study.state(run)})
    return out


def _plan_text(study, plan: list[dict]) -> str:
    rows = [[p["run"], p["model"], human(p["params"]), human(p["tokens"]),
             f"{p['tokens_per_param']:.2f}", f"{p['epochs']:.2f}",
             f"{p['lr']:g}" if p["lr"] is not None else f"from {p['lr_from']}", p["state"]]
            for p in plan]
    total = sum(p["tokens"] for p in plan if p["state"] != "done")
    d = study.record
    return (f"data {d['fingerprint']} (corpus {str(d['corpus'])[:16]}): "
            f"{d['train_tokens']:,} training tokens, {study.val_rows:,} validation sequences\n"
            + table(rows, ["run", "model", "params", "tokens", "tok/param", "epochs", "lr",
                           "state"])
            + f"\n{len(plan)} runs; {human(total)} tokens still to train "
              f"(params at the GPT-2 vocabulary)")


def _result_text(r: dict) -> str:
    parts = [f"{len(r['finished'])} finished", f"{len(r['stopped'])} stopped at a checkpoint",
             f"{len(r['failed'])} failed", f"{len(r['left'])} left"]
    if r.get("blocked"):
        parts.append(f"{len(r['blocked'])} without a learning rate")
    return f"this command: {', '.join(parts)} in {r['seconds'] / 60:.1f} min"


def _st(s: dict, digits: int = 4) -> str:
    if not s or not s["n"]:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f} (1 seed)"
    return f"{s['mean']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}] n={s['n']}"


def report_text(report: dict) -> str:
    """The verdicts as tables (report.json has every number)."""
    lines = [f"{report['runs']['done']}/{report['runs']['total']} runs done; data "
             f"{report['data']['fingerprint']}"]
    for config, sel in report["lr"].items():
        cands = ", ".join(f"{c['lr']:g}: " + (
            f"diverged at step {c['diverged']:,}" if c.get("diverged") is not None else
            "-" if c["val_loss"] is None else f"{c['val_loss']:.4f}")
            for c in sel["candidates"])
        chosen = "-" if sel["chosen"] is None else f"{sel['chosen']:g}"
        lines.append(f"lr of {config}: {chosen} ({cands})")
    for d in report.get("diverged", ()):
        if d["kind"] == "lr":           # on its configuration's lr line above
            continue
        lines.append(f"diverged: {d['run']} (lr {d['lr']:g}) at step {d['step']:,}: no "
                     f"seed of its arm")
    for exp, e in report["experiments"].items():
        lines.append(f"\n{exp} - paper: {e['paper']}")
        lines.append(_experiment_table(exp, e))
    if report.get("figures"):
        lines.append("\nfigures: " + ", ".join(report["figures"].values()))
    return "\n".join(lines)


def _signs(entry: dict) -> str:
    """On how many seed-paired gaps the paper's direction holds ("1 of 2 seeds")."""
    n = entry["gap"]["n"]
    return f"{entry['paper_sign_seeds']} of {n} seed{'s' if n > 1 else ''}" if n else "-"


def _experiment_table(exp: str, e: dict) -> str:
    if exp in ("pair", "paper"):
        entries = e["budgets"] if exp == "pair" else [{"tokens": None, **e}]
        a, b = (e["a"], e["b"]) if exp == "pair" else ("MoE-256", "MoRE-1792")
        rows = [[human(x["tokens"]) if x["tokens"] else "-", _st(x["a"]), _st(x["b"]),
                 _st(x["gap"]), _st(x["gap_ppl_pct"], 1), _signs(x), x["verdict"]]
                for x in entries]
        out = table(rows, ["tokens", f"{a} loss", f"{b} loss", "gap (a - b)", "PPL gap %",
                           "paper's sign", "verdict"])
        if exp == "pair" and e["gap_grows_with_tokens"] is not None:
            out += f"\ngap grows with the budget: {'yes' if e['gap_grows_with_tokens'] else 'no'}"
        return out
    if exp == "init":
        rows = [[f"r={x['rank']}", _st(x["a"]), _st(x["b"]), _st(x["gap"]), _signs(x),
                 x["verdict"]] for x in e["ranks"]]
        return table(rows, ["rank", "per-entry loss", "variance-matched loss", "gap",
                            "paper's sign", "verdict"])
    rows = [[p["arm"], _st(p["loss"]), _st(p["ppl"], 2)] for p in e["points"]]
    return table(rows, ["arm", "val loss", "val PPL"]) + f"\nverdict: {e['verdict']}"


def add_study_parser(sub) -> None:
    from ..study.plan import LRS, StudySettings
    d = StudySettings()
    p = sub.add_parser("study", help="measure the paper's language-model claims: many runs, "
                                     "seeds, verdicts")
    ssub = p.add_subparsers(dest="study_command", metavar="SUBCOMMAND", required=True)
    lm = ssub.add_parser("lm", help="plan, train and report the language-model study",
                         description=DESCRIPTION, epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    lm.add_argument("--data", type=_path, required=True, metavar="DIR",
                    help="prepared data (`moremoe data prepare`); its fingerprint is recorded")
    lm.add_argument("--out", type=_path, required=True, metavar="DIR",
                    help="the study's folder (continued when it holds this study)")
    lm.add_argument("--experiments", type=_experiments, default=list(d.experiments),
                    help="comma list of pair, experts, rank, init, router-lr, paper, or all "
                         "(default pair)")
    g = lm.add_argument_group("the models (the pair's MoE; the rest planned from it)")
    for flag, default, text in (("--hidden", d.hidden, "h"), ("--layers", d.layers, "L"),
                                ("--top-k", d.top_k, "k"),
                                ("--width", d.width, "the MoE's expert width s (M = k s)"),
                                ("--rank", d.rank, "the MoRE's router rank r"),
                                ("--seq-len", d.seq_len, "T, tokens a sequence"),
                                ("--batch", d.batch, "sequences a step")):
        g.add_argument(flag, type=_int_at_least(1), default=default,
                       help=f"{text} (default {default})")
    g.add_argument("--heads", type=_int_at_least(1), default=None,
                   help="attention heads (default h / 64)")
    g.add_argument("--kv-heads", type=_int_at_least(1), default=None,
                   help="key/value heads (default heads / 4 where 4 divides it)")
    t = lm.add_argument_group("tokens, seeds, learning rates, evaluation")
    t.add_argument("--budgets", type=_int_list, default=list(d.budgets),
                   help="pair: tokens a run, comma list (default 60e6,120e6)")
    t.add_argument("--sweep-tokens", type=_int_at_least(1), default=d.sweep_tokens,
                   help="experts, rank, init, router-lr: tokens a run (default 120e6)")
    t.add_argument("--paper-tokens", type=_int_at_least(1), default=d.paper_tokens,
                   help="paper: tokens a run (default 250e6)")
    t.add_argument("--seeds", type=_seeds, default=list(d.seeds),
                   help="seeds of every run (initialisation and data order; default 0,1,2)")
    t.add_argument("--lrs", type=_float_list, default=list(LRS),
                   help="the selection's candidates (default 5e-4,1e-3,3e-3,5e-3)")
    t.add_argument("--lr-tokens", type=_int_at_least(1), default=d.lr_tokens,
                   help="tokens of a selection run (default 20e6)")
    t.add_argument("--lr", type=_positive_float, default=None,
                   help="one learning rate for every run: no selection")
    t.add_argument("--eval-tokens", type=_int_at_least(1), default=d.eval_tokens,
                   help="tokens between validations (default 10e6)")
    t.add_argument("--val-sequences", type=_int_at_least(1), default=None,
                   help="validation sequences (default all of the data's)")
    t.add_argument("--experts-sweep", type=_int_list, default=None, metavar="M,...",
                   help="experts: the M (default M'/16, M'/8, M'/4, M'/2, M')")
    t.add_argument("--ranks", type=_int_list, default=list(d.ranks),
                   help="rank: the r (default 16,32,64,128)")
    t.add_argument("--init-ranks", type=_int_list, default=list(d.init_ranks),
                   help="init: the r (default 16,32,64)")
    t.add_argument("--router-lr-factors", type=_float_list, default=list(d.router_lr_factors),
                   help="router-lr: router lr / lr (default 0.3,1,3)")
    t.add_argument("--peer", action="store_true", help="paper: PEER too")
    t.add_argument("--max-epochs", type=_positive_float, default=d.max_epochs,
                   help="refuse runs past this many epochs of the data (default 4)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="a `moremoe train` setting for every run (repeat)")
    r = lm.add_argument_group("running")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: "
                                                    "every GPU, else the CPU)")
    r.add_argument("--parallel", type=_int_at_least(1), default=None,
                   help="runs at once on each GPU (default 2) or on the CPU (default 1); "
                        "four of the default pair train 1.29x the tokens a second of two on "
                        "one H200, at up to 21 GiB a process (27 evaluating); a run out of "
                        "GPU memory beside others waits for room, and its GPU takes one fewer")
    r.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop every run at a checkpoint in time to end within this budget")
    r.add_argument("--start-minutes", type=_positive_float, default=None,
                   help="start no new run after this many minutes of the command (runs "
                        "with a checkpoint here still resume): where the machine's disk "
                        "goes at a known time, a run that cannot finish by then is not "
                        "begun")
    r.add_argument("--keep-checkpoints", action="store_true",
                   help="keep a finished run's checkpoints (default: deleted once its row "
                        "is written)")
    r.add_argument("--plan", action="store_true",
                   help="show the runs (sizes, tokens per parameter, epochs, state) and stop")
    r.add_argument("--force", action="store_true",
                   help="start over in an --out holding a study of other settings (its runs "
                        "and rows are deleted)")
    r.add_argument("--no-progress", action="store_true", help="no progress lines")
    _add_json(lm)
    lm.set_defaults(func=cmd_lm)
    rep = ssub.add_parser("report", help="the verdicts and figures of a study from its rows",
                          description="Read OUT/study.json and OUT/rows.jsonl, write "
                          "OUT/report.json and the figures again, and print the verdicts: "
                          "for rows gathered from several machines.")
    rep.add_argument("out", type=_path, metavar="OUT", help="a study's folder")
    _add_json(rep)
    rep.set_defaults(func=cmd_report)
