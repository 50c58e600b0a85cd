"""``moremoe theory``: the paper's theory checked by sampling (moremoe.eval.theory)."""
from __future__ import annotations

from pathlib import Path

from ..report import check_output_file, emit, table
from ..runtime import progress_bar
from .args import EPILOG, _add_json, _int_at_least, _positive_float, _positive_int


def cmd_hypercube(args) -> int:
    from ..eval.theory import hypercube_check, plot_hypercube
    if args.experts is not None and args.experts != 1 << args.rank:
        raise ValueError(f"--experts must be 2^--rank = {1 << args.rank} for the hypercube "
                         f"construction, got {args.experts}")
    if args.plot is not None:
        plot = check_output_file(Path(args.plot), "--plot")
        if plot.exists() and not args.force:
            raise ValueError(f"--plot {plot} exists; give another name or --force to replace it")
    bar, seen = progress_bar(args.tokens, desc="routing tokens"), [0]

    def progress(done, total):
        bar.update(done - seen[0])
        seen[0] = done
    try:
        out = hypercube_check(args.rank, args.top_k, args.tokens, hidden=args.hidden,
                              delta=args.delta, seed=args.seed, progress=progress)
    finally:
        bar.close()
    if args.plot is not None:
        out["plot"] = str(plot_hypercube(out, args.plot))
    rows = [["experts M = 2^r", f"{out['experts']:,}"],
            ["expected load k n / M", f"{out['expected_load']:,.1f}"],
            ["max |N_a - k n / M|", f"{out['max_deviation']:,.1f}"],
            [f"bound (confidence {1 - out['delta']:g})", f"{out['bound']:,.1f}"],
            ["within the bound", "yes" if out["within_bound"] else "NO"],
            ["selection probability min / max / k/M",
             f"{out['selection_prob_min']:.5f} / {out['selection_prob_max']:.5f} / "
             f"{out['selection_prob_exact']:.5f}"],
            ["H_norm", f"{out['hnorm']:.5f}"]]
    title = (f"Hypercube router: r={args.rank}, k={args.top_k}, n={args.tokens:,} Gaussian "
             f"tokens (h={out['hidden']}), through moremoe's low-rank router")
    shown = {k: v for k, v in out.items() if k != "counts" or args.json}
    emit(args, shown, title + "\n" + table(rows, ["quantity", "value"])
         + (f"\nplot: {out['plot']}" if "plot" in out else ""))
    return 0 if out["within_bound"] else 1


def add_theory_parser(sub) -> None:
    p = sub.add_parser("theory", help="the paper's theory, checked by sampling",
                       description="The paper's theoretical statements, checked by sampling.")
    tsub = p.add_subparsers(dest="theory_command", metavar="CHECK", required=True)
    h = tsub.add_parser(
        "hypercube", epilog=EPILOG, help="the load-balancing construction (rank r, 2^r experts)",
        description="The paper's load-balancing Proposition: a rank-r router over M = 2^r "
        "experts (R1 rows the sign vectors a/√r, R2 = [I_r | 0]) selects every expert with "
        "probability exactly k/M on Gaussian tokens, so max_a |N_a - n k/M| <= √(2 n k L/M) "
        "+ 2L/3 with L = log(2M/δ), with probability 1 - δ. Samples n tokens, routes them "
        "through moremoe's low-rank router and reports the largest deviation against the "
        "bound, the selection probabilities and H_norm. Exit status 1 if the bound fails.")
    h.add_argument("--rank", type=_positive_int, required=True, help="r (M = 2^r experts)")
    h.add_argument("--experts", type=_positive_int, default=None,
                   help="M; must be 2^r (default 2^r)")
    h.add_argument("--top-k", type=_positive_int, required=True, help="k")
    h.add_argument("--tokens", type=_positive_int, default=200_000, help="n (default 200,000)")
    h.add_argument("--hidden", type=_positive_int, default=None,
                   help="h >= r of the Gaussian tokens (default r; R2 keeps the first r)")
    h.add_argument("--delta", type=_positive_float, default=0.01,
                   help="δ: the bound holds with probability 1 - δ (default 0.01)")
    h.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed (default 0)")
    h.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the per-expert loads with the bound's band")
    h.add_argument("--force", action="store_true", help="replace an existing --plot file")
    _add_json(h)
    h.set_defaults(func=cmd_hypercube)
