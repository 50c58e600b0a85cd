"""``moremoe flops`` and ``moremoe plan``: the paper's accounting and the matched-FLOP
planner (moremoe.accounting) from the command line."""
from __future__ import annotations

import math

from .. import accounting
from ..report import emit, human, table
from .args import EPILOG, _add_json, _int_list, _positive_float, _positive_int


# The paper's pretraining models (Appendix C): GPT-2 vocabulary, 12 layers, grouped-query
# attention with 8 heads / 2 key-value heads at h = 512 and 16 / 4 at h = 1024.
PAPER_MODELS = {"h512": dict(hidden=512, layers=12, vocab=50257, heads=8, kv_heads=2),
                "h1024": dict(hidden=1024, layers=12, vocab=50257, heads=16, kv_heads=4)}


def _apply_paper_model(args) -> None:
    """--paper-model fills h, L, V, heads and kv heads; a conflicting explicit value is an
    error that names it."""
    for key, value in PAPER_MODELS[args.paper_model].items():
        given = getattr(args, key)
        if given is not None and given != value:
            raise ValueError(f"--{key.replace('_', '-')}={given} contradicts --paper-model "
                             f"{args.paper_model} ({key.replace('_', ' ')} {value}); drop one")
        setattr(args, key, value)


def cmd_flops(args) -> int:
    if args.paper_model:
        _apply_paper_model(args)
    if args.hidden is None:
        raise ValueError("--hidden is required (or --paper-model h512|h1024)")
    M, k, h, s, r = args.experts, args.top_k, args.hidden, args.width, args.rank
    if k > M:
        raise ValueError(f"--top-k must be in [1, --experts={M}], got {k}")
    _check_rank(r, h)
    model = {"layers": args.layers, "vocab": args.vocab, "heads": args.heads}
    given = [n for n, v in model.items() if v is not None]
    if (given or args.kv_heads is not None) and len(given) < len(model):
        missing = ", ".join(f"--{n.replace('_', '-')}" for n, v in model.items() if v is None)
        raise ValueError(f"total parameters need --layers, --vocab and --heads"
                         f"{' (--kv-heads counts only in them)' if not given else ''}; "
                         f"missing {missing}")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise ValueError(f"--kv-heads must divide --heads={args.heads}, got {args.kv_heads}")
    out = {"name": accounting.layer_name(M, r), "experts": M, "top_k": k,
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
    emit(args, out, title + "\n" + table(rows, ["quantity", "value"]))
    return 0


def _check_rank(rank: int | None, hidden: int, flag: str = "--rank") -> None:
    """A router rank above h adds router parameters, not expressivity (a layer refuses it)."""
    if rank is not None and rank > hidden:
        raise ValueError(f"{flag} {rank} must be at most --hidden {hidden} (a rank above h "
                         f"adds router parameters, not expressivity)")


# Flags that only one mode of plan reads, their defaults and the flag that picks the mode.
MODE_FLAGS = {"ranks": ([16, 32, 64, 128, 256], "--sweep rank"),
              "fixed_width": (None, "--sweep rank"),
              "peer_heads": (8, "--peer"), "peer_dq": (32, "--peer")}


def _check_plan_args(args) -> None:
    """Refuse what plan cannot honour, naming the flags: tau set twice (--width and
    --budget), a flag of a mode not asked for, k above the reference MoE's M; then fill in
    the mode flags' defaults."""
    if args.budget is None and args.width is None:
        raise ValueError("plan needs a reference MoE width --width s, or the active-FLOP "
                         "budget --budget tau")
    if args.budget is not None and args.width is not None:
        raise ValueError(f"--width {args.width} and --budget {args.budget:g} both set tau "
                         f"(--width through the reference MoE it gives); give one")
    if args.budget is not None and args.experts is not None:
        raise ValueError(f"--experts {args.experts} sets the reference MoE of --width, and "
                         f"--budget gives none; drop --experts or give --width instead")
    args.ranks_given = args.ranks is not None     # else the defaults that fit (_sweep_ranks)
    used = {"--sweep rank": args.sweep == "rank", "--peer": args.peer}
    unused = {}                        # mode -> its flags given without it
    for key, (default, mode) in MODE_FLAGS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
        elif not used[mode]:
            unused.setdefault(mode, []).append(f"--{key.replace('_', '-')}")
    if unused:
        raise ValueError("; ".join(f"{' and '.join(flags)} {'is' if len(flags) == 1 else 'are'}"
                                   f" read only with {mode}" for mode, flags in unused.items())
                         + f"; add {' and '.join(unused)} or drop "
                         + ("it" if sum(map(len, unused.values())) == 1 else "them"))
    if args.experts is not None and args.top_k > args.experts:
        raise ValueError(f"--top-k must be in [1, --experts={args.experts}] (the reference "
                         f"MoE's experts), got {args.top_k}")
    _check_rank(args.rank, args.hidden)
    if args.sweep == "rank" and args.ranks_given:
        _check_rank(max(args.ranks), args.hidden, "--ranks")
    if args.peer and args.peer_dq % 2:
        raise ValueError(f"--peer-dq {args.peer_dq} must be even (the query splits in two "
                         f"halves, one per key table)")


def _sweep_ranks(args, budget: float, width: int) -> list[int]:
    """The ranks of --sweep rank: the given ones, each refused unless its router leaves room
    for k experts of width s within tau; else the defaults up to h that do (h alone below
    the smallest default)."""
    rest = budget - args.ce * args.top_k * args.hidden * width
    widest = math.floor(rest / (args.cr * (args.hidden + args.top_k)) + 1e-9)  # M >= k
    ranks = args.ranks if args.ranks_given else \
        [r for r in args.ranks if r <= args.hidden] or [args.hidden]
    fits = [r for r in ranks if r <= widest]
    if (args.ranks_given and len(fits) < len(ranks)) or not fits:
        bad = next(r for r in ranks if r > widest)
        s_from = "--fixed-width" if args.fixed_width else "the planned MoRE width"
        named = f"--ranks {bad}" if args.ranks_given else f"the default ranks from {bad}"
        raise ValueError(f"{named}: a rank-{bad} router at expert width s = {width} "
                         f"({s_from}) leaves room for fewer than k = {args.top_k} experts "
                         f"within tau = {budget:,.0f}; "
                         + (f"give ranks up to {widest}" if widest >= 1 else
                            "no rank fits: give a smaller --fixed-width"))
    return fits


def _plan(args) -> accounting.MatchedPlan:
    """The matched plan, once --round-width is known to round no planned width past the
    widest one tau leaves room for with k experts (the planner's own error there names
    neither the flag nor a width that fits)."""
    given = dict(hidden=args.hidden, top_k=args.top_k, rank=args.rank, budget=args.budget,
                 width=args.width, experts=args.experts, ce=args.ce, cr=args.cr,
                 refit=args.refit)
    if args.round_width > 1:
        _check_round_width(args, accounting.plan_matched(**given, round_width=1))
    return accounting.plan_matched(**given, round_width=args.round_width)


def _check_round_width(args, base: accounting.MatchedPlan) -> None:
    """base: the plan with widths rounded to 1. Each planned layer (the MoRE; the MoE too
    under --budget) as (name, real-valued width, widest width that fits)."""
    layers = [("MoRE", base.more_optimum[1], args.rank)]
    if args.budget is not None:
        layers.append(("MoE", base.moe_optimum[1], None))
    layers = [(name, s, accounting.widest_width(base.budget, args.hidden, args.top_k, r,
                                                ce=args.ce, cr=args.cr))
              for name, s, r in layers]

    def fits(multiple: int) -> bool:
        return all(accounting.round_to(s, multiple) <= widest for _, s, widest in layers)
    for name, s, widest in layers:
        rounded = accounting.round_to(s, args.round_width)
        if rounded > widest:
            best = next((m for m in range(min(args.round_width - 1, widest), 0, -1)
                         if fits(m)), None)
            raise ValueError(f"--round-width {args.round_width} rounds the {name} width "
                             f"{s:.1f} to {rounded}, wider than the {widest} that tau = "
                             f"{base.budget:,.0f} leaves room for with --top-k {args.top_k} "
                             f"experts; give a " + (f"--round-width of at most {best}" if best
                                                    else "smaller --round-width"))


def cmd_plan(args) -> int:
    _check_plan_args(args)
    plan = _plan(args)
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
    out = plan.to_dict()
    if args.sweep == "rank":
        width = args.fixed_width or more.width
        args.ranks = _sweep_ranks(args, plan.budget, width)
        layers = accounting.rank_sweep(plan.budget, args.hidden, args.top_k, width, args.ranks,
                                       ce=args.ce, cr=args.cr)
        out["sweep"] = {"over": "rank", "width": width,
                        "layers": [layer.to_dict() for layer in layers]}
        text += (f"\n\nRank sweep at expert width s = {width} and the same tau:\n"
                 + table([[layer.rank, f"{layer.experts:,}", f"{layer.params_mlp:,}",
                           f"{layer.params_router:,}", f"{layer.flops:,.0f}"]
                          for layer in layers],
                         ["rank r", "experts M", "MLP parameters", "router parameters",
                          "active FLOPs"]))
    if args.peer:
        peer = accounting.peer_match(more.experts, args.top_k, args.hidden, more.width, more.rank,
                                     heads=args.peer_heads, d_q=args.peer_dq)
        out["peer"] = peer
        rows = [[reading, f"{peer[reading]['more_flops']:,}", peer[reading]["topk_per_head"],
                 peer[reading]["active"], f"{peer[reading]['peer_flops']:,}"]
                for reading in ("paper", "inference")]
        text += (f"\n\nPEER matched to {more.name} (Appendix B): M = {peer['experts']:,} "
                 f"(= {math.isqrt(peer['experts'])}^2 >= 3/2 M' s'), H = {peer['heads']}, "
                 f"d_q = {peer['d_q']}, {peer['params_experts']:,} expert parameters\n"
                 + table(rows, ["reading", f"{more.name} FLOPs", "top-kappa per head",
                                "active k = H kappa", "PEER FLOPs"])
                 + "\npaper: PEER's inference-coefficient formula against MoRE's training "
                   "FLOPs (C_e, C_r) = (18, 14), as the paper matches them; inference: both "
                   "at (6, 6)")
    emit(args, out, text)
    return 0


def add_plan_parsers(sub) -> None:
    p = sub.add_parser("flops", epilog=EPILOG, help="parameters and active FLOPs of one layer",
                       description="Router/expert parameters and per-token active FLOPs of one "
                       "MoE layer (MoRE with --rank); total parameters when --layers, --vocab "
                       "and --heads are given, or --paper-model names one of the paper's "
                       "pretraining models (paper Appendix C).")
    p.add_argument("--experts", type=_positive_int, required=True, help="M")
    p.add_argument("--top-k", type=_positive_int, required=True, help="k")
    p.add_argument("--hidden", type=_positive_int, default=None,
                   help="h (required unless --paper-model)")
    p.add_argument("--paper-model", choices=sorted(PAPER_MODELS), default=None,
                   help="the paper's model settings: h512 = h 512, 12 layers, V 50,257, "
                        "8 heads / 2 kv heads; h1024 = h 1024, 16 / 4 heads (the totals of "
                        "its Table of pretraining results)")
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
    p.add_argument("--width", type=_positive_int, default=None,
                   help="reference MoE width s, which sets tau (or --budget, not both)")
    p.add_argument("--top-k", type=_positive_int, required=True, help="k")
    p.add_argument("--rank", type=_positive_int, required=True, help="MoRE router rank r")
    p.add_argument("--experts", type=_positive_int, default=None,
                   help="reference MoE experts M, at least k (default: the optimum C_e k s / "
                        "C_r; with --width only)")
    p.add_argument("--budget", type=_positive_float, default=None,
                   help="give tau directly instead of a reference MoE (no --width)")
    p.add_argument("--round-width", type=_positive_int, default=1,
                   help="round planned widths to this multiple (default 1); a width rounded "
                        "past what tau leaves room for with k experts is refused")
    p.add_argument("--no-refit", dest="refit", action="store_false",
                   help="keep the optimum's M after rounding s instead of re-fitting it")
    p.add_argument("--ce", type=_positive_float, default=6.0, help="C_e (default 6, inference)")
    p.add_argument("--cr", type=_positive_float, default=6.0, help="C_r (default 6, inference)")
    p.add_argument("--sweep", choices=["rank"], default=None,
                   help="also sweep: rank = MoRE layers at a fixed expert width over --ranks, "
                        "each with the most experts tau allows (the paper's rank ablation)")
    p.add_argument("--ranks", type=_int_list, default=None,
                   help="ranks of --sweep rank, each once (default those of 16,32,64,128,256 "
                        "up to --hidden)")
    p.add_argument("--fixed-width", type=_positive_int, default=None,
                   help="expert width of --sweep rank (default: the plan's MoRE width)")
    p.add_argument("--peer", action="store_true",
                   help="also the PEER layer matched to the plan's MoRE (expert parameters and "
                        "active FLOPs), in the paper's reading and the inference one")
    p.add_argument("--peer-heads", type=_positive_int, default=None,
                   help="PEER heads H of --peer (default 8)")
    p.add_argument("--peer-dq", type=_positive_int, default=None,
                   help="PEER query size d_q of --peer (default 32, the paper's)")
    _add_json(p)
    p.set_defaults(func=cmd_plan)
