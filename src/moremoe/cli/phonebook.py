"""``moremoe phonebook train``, ``capacity`` and ``sweep``: the phonebook memorisation
experiment (moremoe.phonebook) from the command line; ``reproduce`` is in
phonebook_paper.py, the execution options they share in phonebook_run.py."""
from __future__ import annotations

from ..checks import UserError
from ..report import human, table
from .args import (EPILOG, _add_json, _float_list, _fraction, _int_list, _positive_float,
                   _positive_int, _seed)
from .phonebook_paper import add_reproduce_parser
from .phonebook_run import add_execution_args, capacity_text, execute, finish, outputs as _outputs


MODEL_FLAGS = ("hidden", "width", "top_k", "rank", "layers", "heads", "moe_experts",
               "more_experts", "more_width", "peer_heads", "peer_dq")
MAX_DIM = 2 ** 62           # beyond this the planner's floats overflow (below it the memory
                            # check names what a size needs)


def _check_phonebook_args(args) -> None:
    """The arguments the model and the phonebook cannot take, named as the user gave them."""
    from ..phonebook.task import NAME_SPACE
    for name in MODEL_FLAGS:
        v = getattr(args, name, None)
        if v is not None and v > MAX_DIM:
            raise ValueError(f"--{name.replace('_', '-')} {v:.3g} is more than 2^62: no model "
                             f"of that size fits in memory; give a smaller one")
    h = args.hidden
    _check_heads(h, args.heads)
    _check_top_k(args)
    if args.rank > h:
        raise ValueError(f"--rank {args.rank} must be at most --hidden {h} (a rank above h "
                         f"adds router parameters, not expressivity)")
    if args.arch == "peer" and args.peer_dq % 2:
        raise ValueError(f"--peer-dq {args.peer_dq} must be even (the query splits in two "
                         f"halves, one per key table)")
    sizes = _sizes(args)
    if max(sizes) > NAME_SPACE:
        raise ValueError(f"{'--size' if hasattr(args, 'size') else '--sizes'} {max(sizes):,} "
                         f"exceeds the {NAME_SPACE:,} unique five-letter names a phonebook "
                         f"can hold")


def _check_heads(h: int, heads: int | None) -> None:
    """The attention heads split h evenly into an even head dim (rotary positions rotate
    pairs); named as --hidden and --heads, with the default heads when none are given."""
    from ..phonebook.trainer import default_heads
    if heads is not None:
        if h % heads:
            raise ValueError(f"--heads {heads} must divide --hidden {h}")
        given = f"--heads {heads}"
    else:
        heads = default_heads(h)
        given = f"{heads} head{'s' if heads > 1 else ''} (the default, h/32; --heads sets them)"
        if h % heads:
            raise ValueError(f"--hidden {h} does not split over {given}; give --heads that "
                             f"divides --hidden")
    if (h // heads) % 2:
        fix = ("give an even --hidden" if h % 2 else
               "give --heads so that --hidden / --heads is even")
        raise ValueError(f"--hidden {h} over {given} gives a head dim of {h // heads}: rotary "
                         f"positions need an even head dim; {fix}")


# flags whose defaults stand for "not given" until _given() fills them in
IMPLICIT = {"lr_grid": [1e-4, 3e-4, 1e-3], "calibration_steps": 200, "peer_heads": 2,
            "peer_dq": 8, "peer_reading": "inference"}


def _given(args) -> set[str]:
    """The IMPLICIT flags the command line gave; the others get their defaults (the values
    a report's settings record, as before these could be told apart)."""
    given = {k for k in IMPLICIT if getattr(args, k) is not None}
    for k, v in IMPLICIT.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return given


def _check_unread(args, given: set[str]) -> None:
    """A flag the run would not read is refused, not ignored: the calibration's with --lr,
    PEER's without --arch peer."""
    if args.lr is not None:
        for k in sorted(given & {"lr_grid", "calibration_steps"}):
            raise ValueError(f"--{k.replace('_', '-')} is not read: --lr {args.lr:g} skips the "
                             f"learning-rate calibration; drop one of them")
    if args.arch != "peer":
        for k in sorted(given & {"peer_heads", "peer_dq", "peer_reading"}):
            raise ValueError(f"--{k.replace('_', '-')} sets PEER, which --arch {args.arch} "
                             f"does not train; drop it or give --arch peer")


def _check_arch_flags(args) -> None:
    """A model flag for a model --arch does not train is refused, not ignored."""
    used = {"moe": ("--moe-experts",), "more": ("--more-experts", "--more-width"),
            "both": ("--moe-experts", "--more-experts", "--more-width"), "peer": ()}[args.arch]
    for flag in ("--moe-experts", "--more-experts", "--more-width"):
        if getattr(args, flag[2:].replace("-", "_")) is not None and flag not in used:
            model = "MoE" if flag == "--moe-experts" else "MoRE"
            raise ValueError(f"{flag} sets the {model} model, which --arch {args.arch} does "
                             f"not train; drop {flag} or give --arch both")


def _check_top_k(args) -> None:
    """k at most the experts given for a model that is trained (the planner's counts are at
    least k): named as --top-k and --moe-experts / --more-experts."""
    for arches, flag, M in ((("moe", "both"), "--moe-experts", args.moe_experts),
                            (("more", "both"), "--more-experts", args.more_experts)):
        if args.arch in arches and M is not None and args.top_k > M:
            raise ValueError(f"--top-k {args.top_k} must be at most {flag} {M} (a token's "
                             f"experts are chosen among them); give a smaller --top-k or a "
                             f"larger {flag}")


def _phonebook_models(args):
    """The model configs to train, from --arch and the planner (paper convention), each
    checked to fit before any output or training."""
    from ..phonebook.models import plan_models
    from ..phonebook.trainer import check_fits_phonebook
    _check_phonebook_args(args)
    plan, models = plan_models(
        arch=args.arch, hidden=args.hidden, top_k=args.top_k, rank=args.rank,
        width=args.width, round_width=args.round_width, refit=args.refit,
        moe_experts=args.moe_experts, more_experts=args.more_experts,
        more_width=args.more_width, router_init=args.router_init, layers=args.layers,
        heads=args.heads, peer_heads=args.peer_heads, peer_dq=args.peer_dq,
        peer_reading=args.peer_reading)
    for model in models:
        check_fits_phonebook(model, _train_config(args, max(_sizes(args))))
    return plan, models


def _sizes(args) -> list[int]:
    return [args.size] if hasattr(args, "size") else args.sizes


def _train_config(args, size: int):
    from ..phonebook.trainer import PhonebookTrainConfig
    return PhonebookTrainConfig(
        size=size, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
        lr_grid=tuple(args.lr_grid), calibration_steps=args.calibration_steps,
        max_epochs=args.max_epochs, max_steps=args.max_steps, max_minutes=args.max_minutes,
        threshold=args.threshold, eval_every=args.eval_every, eval_entries=args.eval_entries,
        loss_on=args.loss_on, device=args.device, step=args.step)


def _run_row(run: dict) -> list:
    moe = run["model"]["moe"]
    hn = run["hnorm"]
    name = run["name"].split(" (")[0] if moe.get("kind") == "peer" else \
        run["name"].split("(")[0] + f"-{moe['experts']}"
    return [name, moe["experts"], moe.get("width", 1), moe.get("rank") or "-",
            human(run["params_total"]), f"{run['flops_inference']:,}",
            f"{run['lr']:g}", run["steps"], f"{run['exact_match']:.3f}",
            f"{run['char_accuracy']:.3f}",
            f"{sum(hn) / len(hn):.3f} [{min(hn):.2f}, {max(hn):.2f}]" if hn else "-",
            "yes" if run["reached"] else "no"]


RUN_HEADERS = ["model", "M", "s", "r", "params", "FLOPs/tok/layer", "lr", "steps",
               "exact match", "digit acc", "H_norm mean [min, max]", "reached"]


def _label(model_cfg) -> str:
    """The model's full shape, e.g. MoRE(M=96, k=4, h=64, s=8, r=16): a plan's name."""
    return model_cfg.moe.label


def cmd_phonebook_train(args) -> int:
    from ..phonebook.search import trial
    _check_unread(args, _given(args))
    _check_arch_flags(args)
    plan, models = _phonebook_models(args)
    json_path, png_path = _outputs(args, "phonebook-train", "phonebook_train")
    report = {"command": "phonebook train", "size": args.size, "plan": plan.to_dict(),
              "runs": [], "files": {"json": str(json_path), "png": str(png_path)}}
    plans = {_label(m): trial(m, _train_config(args, args.size), _label(m)) for m in models}

    def render(results, in_round):
        from ..phonebook.plots import plot_phonebook_runs
        report["runs"] = [results[k] for k in plans if k in results]
        plot_phonebook_runs(report["runs"], png_path,
                            title=f"phonebook, {args.size:,} entries")
    ex = execute(args, plans, json_path, report, render)
    for run in report["runs"]:
        if run["diverged_at"]:          # the report keeps the run; the user learns why
            raise UserError(f"{run['name']}: step {run['diverged_at']}: the loss is not "
                            f"finite; lower the learning rate (--lr {run['lr']:g})")
    text = (table([_run_row(r) for r in report["runs"]], RUN_HEADERS)
            + f"\nreport: {json_path}\nplot:   {png_path}")
    return finish(args, ex, report, text)


def cmd_phonebook_capacity(args) -> int:
    from ..phonebook.search import capacity, unfinished
    _check_unread(args, _given(args))
    _check_arch_flags(args)
    plan, models = _phonebook_models(args)
    json_path, png_path = _outputs(args, "phonebook-capacity", "capacity")
    report = {"command": "phonebook capacity", "sizes": sorted(set(args.sizes)),
              "start": args.start, "plan": plan.to_dict(), "results": [],
              "files": {"json": str(json_path), "png": str(png_path)}}
    partial = {}

    def noted(name):
        return lambda result: partial.__setitem__(name, result.to_dict())
    plans = {_label(m): capacity(m, args.sizes, _train_config(args, args.sizes[0]),
                                 name=_label(m), start=args.start, on_trial=noted(_label(m)))
             for m in models}

    def render(results, in_round):
        from ..phonebook.plots import plot_capacity
        report["results"] = [results[k].to_dict() if k in results else
                             unfinished(k, partial.get(k), in_round.get(k, []))
                             for k in plans if k in results or k in partial or k in in_round]
        plot_capacity(report["results"], png_path)
    ex = execute(args, plans, json_path, report, render)
    rows = [[r["name"], capacity_text(r),
             ", ".join(f"{t['train']['size']:,}: {t['exact_match']:.2f}" for t in r["trials"])
             + (" (unfinished)" if r.get("unfinished") else "")]
            for r in report["results"]]
    text = (table(rows, ["model", "capacity", "trials (size: exact match)"])
            + f"\nreport: {json_path}\nplot:   {png_path}")
    return finish(args, ex, report, text)


SWEEP_KEY = {"rank": "rank", "experts": "more_experts", "hidden": "hidden"}


def _sweep_models(args):
    """(value, arch, model config) for every run of the sweep: MoRE at each value and, with
    --arch both, the MoE once (rank, experts: the MoE does not change); --over hidden: the
    models of --arch at each value."""
    import argparse
    if args.arch == "peer" or (args.arch == "moe" and args.over != "hidden"):
        raise ValueError(f"--arch {args.arch}: --over {args.over} sweeps "
                         f"{'the MoRE' if args.over != 'hidden' else 'MoE and MoRE'}; give "
                         f"--arch more, or both (the MoRE beside the MoE)")
    if args.over == "experts" and args.more_experts is not None:
        raise ValueError(f"--more-experts {args.more_experts}: --over experts sets M' to each "
                         f"of --values; drop --more-experts")
    runs = []
    for i, v in enumerate(args.values):
        vargs = argparse.Namespace(**{**vars(args), SWEEP_KEY[args.over]: v})
        if args.over == "hidden":
            arches = ["moe", "more"] if args.arch == "both" else [args.arch]
        else:
            arches = (["moe"] if args.arch == "both" and i == 0 else []) + ["more"]
        for arch in arches:
            vargs.arch = arch
            try:
                _, models = _phonebook_models(vargs)
            except (ValueError, UserError) as err:
                shown = v if v < 10 ** 15 else f"{v:.3g}"
                raise type(err)(f"--over {args.over} --values {shown}: {err}") from err
            runs.append((v, arch, models[0]))
    return runs


def cmd_phonebook_sweep(args) -> int:
    from ..phonebook.search import trial
    _check_unread(args, _given(args))
    runs = _sweep_models(args)             # every config checked before any training
    json_path, png_path = _outputs(args, "phonebook-sweep", "sweep")
    report = {"command": "phonebook sweep", "over": args.over, "values": args.values,
              "size": args.size, "runs": [],
              "files": {"json": str(json_path), "png": str(png_path)}}
    names = {f"{args.over}={v} {_label(m)}": (v, arch) for v, arch, m in runs}
    plans = {name: trial(m, _train_config(args, args.size), name)
             for name, (_, _, m) in zip(names, runs)}

    def render(results, in_round):
        from ..phonebook.plots import plot_sweep
        report["runs"] = [{"value": names[k][0], "arch": names[k][1], **results[k]}
                          for k in plans if k in results]
        plot_sweep(report, png_path)
    ex = execute(args, plans, json_path, report, render)
    text = (table([[r["value"], *_run_row(r)] for r in report["runs"]],
                  [args.over, *RUN_HEADERS])
            + f"\nreport: {json_path}\nplot:   {png_path}")
    return finish(args, ex, report, text)


def _add_phonebook_args(p, *, sizes: bool) -> None:
    if sizes:
        p.add_argument("--sizes", type=_int_list, required=True,
                       help="grid of phonebook sizes, e.g. 1000,3000,10000,30000")
        p.add_argument("--start", type=_positive_int, default=None,
                       help="the size to try first (the nearest on the grid; e.g. the paper's "
                            "capacity): it and the next size up run at once, then one size "
                            "at a time up or down until bracketed (default: binary search)")
    else:
        p.add_argument("--size", type=_positive_int, required=True,
                       help="phonebook entries (unique names)")
    m = p.add_argument_group("model (defaults: the paper's h=64, s=8 point)")
    m.add_argument("--arch", choices=("moe", "more", "both", "peer"), default="both",
                   help="train the MoE, the MoRE, the matched pair (default), or PEER matched "
                        "to the MoRE (expert parameters and active FLOPs)")
    m.add_argument("--hidden", type=_positive_int, default=64, help="h (default 64)")
    m.add_argument("--width", type=_positive_int, default=8, help="MoE expert width s (default 8)")
    m.add_argument("--top-k", type=_positive_int, default=4, help="k (default 4)")
    m.add_argument("--rank", type=_positive_int, default=16, help="MoRE router rank r (default 16)")
    m.add_argument("--router-init", choices=("variance_matched", "default"),
                   default="variance_matched",
                   help="MoRE router init: variance_matched (R1, R2 entries sqrt(σ)/r^(1/4), "
                        "the logits' variance of a standard router; the default) or default "
                        "(every entry N(0, σ²)): the paper's init ablation")
    m.add_argument("--peer-heads", type=_positive_int, default=None,
                   help="PEER heads H of --arch peer (default 2 at phonebook sizes)")
    m.add_argument("--peer-dq", type=_positive_int, default=None,
                   help="PEER query size d_q (even; default 8)")
    m.add_argument("--peer-reading", choices=("inference", "paper"), default=None,
                   help="match PEER to MoRE's inference FLOPs (default) or, as the paper, "
                        "PEER's formula to MoRE's training FLOPs")
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
    t.add_argument("--seed", type=_seed, default=0,
                   help="phonebook, init and data-order seed")
    t.add_argument("--batch-size", type=_positive_int, default=1024)
    t.add_argument("--lr", type=_positive_float, default=None,
                   help="learning rate (default: calibrate over --lr-grid by a short run)")
    t.add_argument("--lr-grid", type=_float_list, default=None,
                   help="calibration grid (default 1e-4,3e-4,1e-3; not with --lr)")
    t.add_argument("--calibration-steps", type=_positive_int, default=None,
                   help="steps of each calibration run (default 200; not with --lr)")
    t.add_argument("--max-epochs", type=_positive_float, default=1500.0)
    t.add_argument("--max-steps", type=_positive_int, default=None, help="overrides --max-epochs")
    t.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop each run after this wall-clock time")
    t.add_argument("--threshold", type=_fraction, default=0.9,
                   help="the exact match a run must reach, in (0, 1]: training stops there "
                        "and the run counts as reached (default 0.9)")
    t.add_argument("--eval-every", type=_positive_int, default=100, help="steps between evaluations")
    t.add_argument("--eval-entries", type=_positive_int, default=1000,
                   help="training entries sampled for exact match (default 1000)")
    t.add_argument("--loss-on", choices=("number", "all"), default="number",
                   help="tokens that carry the loss: the 8 digits and '.' (default) or all")
    add_execution_args(p)
    _add_json(p)


def add_phonebook_parser(sub) -> None:
    p = sub.add_parser("phonebook", help="the phonebook memorisation experiment",
                       description="Train MoE and/or MoRE on a phonebook of unique names and "
                       "8-digit numbers, search the memorisation capacity, or reproduce the "
                       "paper's capacity figures. Runs that can go at once do: several on "
                       "each GPU, over every GPU (--jobs, --concurrent).")
    psub = p.add_subparsers(dest="phonebook_command", metavar="SUBCOMMAND", required=True)
    pt = psub.add_parser("train", epilog=EPILOG, help="train on one phonebook size",
                         description="Train on one phonebook; writes a JSON report (loss and "
                         "exact match over steps, H_norm per layer) and a PNG plot.")
    _add_phonebook_args(pt, sizes=False)
    pt.set_defaults(func=cmd_phonebook_train)
    pc = psub.add_parser("capacity", epilog=EPILOG, help="largest size memorised, on a grid",
                         description="Search of the largest phonebook size on --sizes that "
                         "reaches the exact-match threshold (each size: the learning-rate "
                         "calibration, then the run at the best rate), the MoE's and the "
                         "MoRE's at the same time; JSON report and PNG plot.")
    _add_phonebook_args(pc, sizes=True)
    pc.set_defaults(func=cmd_phonebook_capacity)
    ps = psub.add_parser("sweep", epilog=EPILOG, help="exact match against r, M or h",
                         description="The paper's phonebook sweeps on one phonebook size: "
                         "--over rank (MoRE at each r, beside the MoE), experts (MoRE at each "
                         "M', beside the MoE) or hidden (the matched MoE/MoRE pair at each "
                         "h); --arch more leaves the MoE out (and with --over hidden, --arch "
                         "moe the MoRE); JSON report and a PNG of exact match against the "
                         "value.")
    ps.add_argument("--over", choices=sorted(SWEEP_KEY), required=True, help="what to sweep")
    ps.add_argument("--values", type=_int_list, required=True,
                    help="its values, e.g. 2,4,8,16,32 (rank) or 64,128,256,512 (hidden)")
    _add_phonebook_args(ps, sizes=False)
    ps.set_defaults(func=cmd_phonebook_sweep)
    add_reproduce_parser(psub)
