"""``moremoe theory``: the paper's theory checked by sampling (moremoe.eval.theory)."""
from __future__ import annotations

from pathlib import Path

from ..report import check_new_output, emit, table
from ..runtime import progress_bar
from .args import EPILOG, _add_json, _int_list, _positive_float, _positive_int, _seed


def cmd_hypercube(args) -> int:
    from ..eval.theory import hypercube_check, plot_hypercube
    if args.experts is not None and args.experts != 1 << args.rank:
        raise ValueError(f"--experts must be 2^--rank = {1 << args.rank} for the hypercube "
                         f"construction, got {args.experts}")
    _check_plot(args)
    bar, seen = progress_bar(args.tokens, desc="routing tokens",
                             enabled=not args.no_progress), [0]

    def progress(done, total):
        bar.update(done - seen[0])
        seen[0] = done
    out = hypercube_check(args.rank, args.top_k, args.tokens, hidden=args.hidden,
                          delta=args.delta, seed=args.seed, progress=progress)
    bar.close()               # after the work only: no closing line before an error
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


def _load_matrix(path: str, key: str | None, flag: str, noun: str, shape: str):
    """A 2-D real tensor, finite and not empty, from a .safetensors or torch file (a tensor
    or a name -> tensor map); errors name the flag, the file and what it must hold."""
    import torch
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a .safetensors or torch file")
    if not file.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            obj = load_file(str(file))
        else:
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:   # a torn or foreign file: one line that names it
        raise ValueError(f"{flag} {path}: not a safetensors or torch tensor file "
                         f"({type(err).__name__})") from err
    must = (f"it must hold the {noun} as a 2-D tensor {shape}, or a mapping of names to "
            f"tensors (with {flag}-key naming it)")
    if isinstance(obj, torch.Tensor):
        tensor = obj
    elif isinstance(obj, dict):
        tensor = _pick_matrix(obj, key, flag, path, must)
    else:
        raise ValueError(f"{flag} {path} holds a {type(obj).__name__}; {must}")
    if tensor.dim() != 2:
        raise ValueError(f"{flag} {path}: expected the {noun} as a 2-D tensor {shape}, got "
                         f"shape {tuple(tensor.shape)}")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{flag} {path}: expected real numbers, got a {tensor.dtype} tensor")
    if tensor.numel() == 0:
        raise ValueError(f"{flag} {path}: the tensor is empty (shape {tuple(tensor.shape)})")
    tensor = tensor.float()
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{flag} {path}: the {noun} {'has' if noun == 'router' else 'have'} "
                         f"{bad:,} non-finite entries (NaN or inf) of {tensor.numel():,}; "
                         f"give finite values")
    return tensor


def _pick_matrix(obj: dict, key: str | None, flag: str, path: str, must: str):
    import torch
    mats = sorted(str(k) for k, v in obj.items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    if key is None and not mats:
        raise ValueError(f"{flag} {path} holds no 2-D tensor; {must}")
    if key is None and len(mats) > 1:
        raise ValueError(f"{flag} {path} holds {len(mats)} 2-D tensors; name one with "
                         f"{flag}-key (e.g. {', '.join(mats[:4])})")
    name = key if key is not None else mats[0]
    if name not in obj or not isinstance(obj[name], torch.Tensor):
        why = "is not in" if name not in obj else "is not a tensor in"
        raise ValueError(f"{flag}-key {name!r} {why} {path}; 2-D tensors: "
                         f"{', '.join(mats[:8]) or 'none'}")
    return obj[name]


def _count(n: int) -> str:
    return f"{n:,}" if n < 10 ** 15 else f"{n:.3g}"


def _check_rank_memory(M: int, h: int, tokens: int, top_k: int, flag: str) -> None:
    """Refuse, before anything is allocated, a router and token count that cannot fit,
    naming flag (what gives the tokens) and how many tokens would fit."""
    import torch
    from ..checks import check_fits
    from ..eval.theory import rank_memory
    from ..runtime import memory_bytes
    fixed, per_token = rank_memory(M, h, 0, top_k), rank_memory(M, h, 1, top_k) - \
        rank_memory(M, h, 0, top_k)
    most = (memory_bytes(torch.device("cpu")) - fixed) // per_token
    if most < 1:
        check_fits(rank_memory(M, h, 1, top_k), f"a router of {_count(M)} x {_count(h)} "
                   f"(M x h)", "give a smaller router (--experts, --hidden or --weights)")
    check_fits(rank_memory(M, h, tokens, top_k), f"{flag}: routing {_count(tokens)} tokens of h "
               f"= {_count(h)} through a router of M = {_count(M)}",
               f"give {flag} in [1, {most:,}]" if flag == "--tokens" else
               f"give at most {most:,} tokens in {flag}")


def _check_rank_sources(args) -> None:
    """The router and the tokens each come from one source: a file (--weights, --inputs,
    each with its -key) or a random draw (--experts and --hidden, --tokens). A flag of the
    source not taken is refused rather than ignored; --tokens gets its default here."""
    unused = []
    if args.weights is not None:
        unused += [f for f, v in (("--experts", args.experts), ("--hidden", args.hidden))
                   if v is not None]
        reason = "the router's M and h are those of --weights"
    elif args.weights_key is not None:
        unused, reason = ["--weights-key"], "it names a tensor in --weights, not given"
    if unused:
        raise ValueError(f"{' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} not "
                         f"read: {reason}; drop {'it' if len(unused) == 1 else 'them'}")
    if args.inputs is not None and args.tokens is not None:
        raise ValueError("--tokens is not read: the tokens are those of --inputs; drop it")
    if args.inputs is None and args.inputs_key is not None:
        raise ValueError("--inputs-key is not read: it names a tensor in --inputs, not given; "
                         "drop it")
    if args.tokens is None:
        args.tokens = TOKENS


TOKENS = 20_000            # Gaussian tokens of theory rank without --inputs


def cmd_rank(args) -> int:
    import torch
    from ..eval.theory import plot_rank, rank_agreement, rank_bounds
    _check_rank_sources(args)
    plot = _check_plot(args)
    g = torch.Generator().manual_seed(args.seed)
    if args.weights:
        W = _load_matrix(args.weights, args.weights_key, "--weights", "router", "(M, h)")
        if W.abs().max() == 0:
            raise ValueError(f"--weights {args.weights}: the router is all zeros; it routes "
                             f"nothing, so there is nothing to factor")
    else:
        if args.experts is None or args.hidden is None:
            raise ValueError("a random router needs --experts and --hidden (or --weights FILE)")
        _check_rank_memory(args.experts, args.hidden, 1, args.top_k, "--tokens")
        W = torch.randn(args.experts, args.hidden, generator=g)
    M, h = W.shape
    if args.inputs:
        x = _load_matrix(args.inputs, args.inputs_key, "--inputs", "tokens", "(N, h)")
        if x.shape[1] != h:
            router = f"--weights {args.weights}" if args.weights else "--hidden"
            raise ValueError(f"--inputs {args.inputs}: tokens of h = {x.shape[1]} (shape "
                             f"{tuple(x.shape)}) for a router of h = {h} ({router}); give "
                             f"tokens (N, {h})")
        _check_rank_memory(M, h, x.shape[0], args.top_k, f"--inputs {args.inputs}")
    else:
        _check_rank_memory(M, h, args.tokens, args.top_k, "--tokens")
        x = torch.randn(args.tokens, h, generator=g)
    ranks = args.ranks or [r for r in (2 ** i for i in range(12)) if r <= min(M, h)]
    methods = ("svd", "jl") if args.method == "both" else (args.method,)
    bar = progress_bar(len(methods) * len(ranks), desc="factoring the router",
                       enabled=not args.no_progress)
    rows = rank_agreement(W, x, args.top_k, ranks, methods=methods, seed=args.seed,
                          progress=lambda done, total: bar.update())
    bar.close()
    bounds = rank_bounds(M, args.top_k, args.bits)
    source = args.weights or f"Gaussian {M} x {h}"
    out = {"router": source, "experts": M, "hidden": h, "top_k": args.top_k,
           "tokens": x.shape[0], "rows": rows, "bounds": bounds}
    if plot is not None:
        out["plot"] = str(plot_rank(rows, bounds, plot, f"top-{args.top_k} sets kept by a "
                                    f"rank-r router ({source}, {x.shape[0]:,} tokens)"))
    text = (f"Top-{args.top_k} sets of {x.shape[0]:,} tokens under rank-r factorisations of "
            f"the router ({source}); theorems' ranks with constants 1: sufficient "
            f"{bounds['sufficient_jl']:.0f}, necessary {bounds['necessary_counting']:.1f} "
            f"at {bounds['bits']} bits\n"
            + table([[r["method"], r["rank"], f"{r['set_preserved']:.4f}",
                      f"{r['mean_overlap']:.4f}", f"{r['rel_error']:.4f}"] for r in rows],
                    ["method", "r", "set preserved", "mean overlap", "|R1R2 - W| / |W|"])
            + (f"\nplot: {out['plot']}" if "plot" in out else ""))
    emit(args, out, text)
    return 0


def _check_plot(args):
    if args.plot is None:
        return None
    return check_new_output(Path(args.plot), "--plot", args.force)


def _add_plot(p) -> None:
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw the result")
    p.add_argument("--force", action="store_true", help="replace an existing --plot file")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, lines in a log)")


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
    h.add_argument("--seed", type=_seed, default=0, help="sampling seed (default 0)")
    _add_plot(h)
    _add_json(h)
    h.set_defaults(func=cmd_hypercube)
    r = tsub.add_parser(
        "rank", epilog=EPILOG, help="top-k sets a rank-r router keeps, against r",
        description="The paper's expressivity bounds made empirical: factor an M x h router "
        "(Gaussian, or a trained one from --weights) into R1 (M x r) R2 (r x h) by truncated "
        "SVD or by the Johnson-Lindenstrauss projection, and report for each r the share of "
        "tokens whose top-k set is unchanged and the mean overlap, beside the theorems' "
        "sufficient rank k ln(M + C(M,k)) and necessary rank ln C(M,k) / ln(1 + 2^(p+1)) "
        "(universal constants set to 1: their shapes, not their values).")
    r.add_argument("--experts", type=_positive_int, default=None,
                   help="M of a random router (not with --weights)")
    r.add_argument("--hidden", type=_positive_int, default=None,
                   help="h of a random router (not with --weights)")
    r.add_argument("--weights", default=None, metavar="FILE",
                   help="a trained router (M, h) in a .safetensors or torch file")
    r.add_argument("--weights-key", default=None, help="its tensor's name in FILE")
    r.add_argument("--inputs", default=None, metavar="FILE",
                   help="tokens (N, h) to route (e.g. captured hidden states; default "
                        "Gaussian)")
    r.add_argument("--inputs-key", default=None, help="their tensor's name in FILE")
    r.add_argument("--tokens", type=_positive_int, default=None,
                   help=f"Gaussian tokens when no --inputs (default {TOKENS:,})")
    r.add_argument("--top-k", type=_positive_int, required=True, help="k")
    r.add_argument("--ranks", type=_int_list, default=None,
                   help="comma list of r (default powers of two up to min(M, h))")
    r.add_argument("--method", choices=["svd", "jl", "both"], default="both",
                   help="factorisation (default both)")
    r.add_argument("--bits", type=_positive_int, default=8,
                   help="p of the necessary rank's margin 2^-p (default 8, bf16)")
    r.add_argument("--seed", type=_seed, default=0, help="seed (default 0)")
    _add_plot(r)
    _add_json(r)
    r.set_defaults(func=cmd_rank)
