"""``moremoe convert-router``: a trained transformers MoE's routers factored to low rank
(moremoe.hf.convert_router), with the top-k agreement on the hidden states they see."""
from __future__ import annotations

from pathlib import Path

from ..report import check_output_dir, emit, table, write_json
from .args import EPILOG, _add_json, _int_at_least, _int_list, _positive_int


def _load_model(path: str):
    from transformers import AutoModelForCausalLM
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"MODEL {path}: not a transformers model folder (no config.json); "
                         f"real checkpoints need their weights downloaded first, e.g. "
                         f"`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir {path}`")
    from transformers.utils import logging
    logging.disable_progress_bar()          # errors and reports stay the only stderr lines
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)


def _tokens(args, model):
    """(B, T) token ids: the --text file through the model's tokenizer, or random ids."""
    import torch
    if args.text is None:
        g = torch.Generator().manual_seed(args.seed)
        n = max(1, args.random_tokens // args.seq_len)
        return torch.randint(0, model.config.vocab_size, (n, args.seq_len), generator=g)
    text = Path(args.text)
    if not text.is_file():
        raise ValueError(f"--text {args.text}: no such file")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"MODEL {args.model} has no tokenizer to read --text with; give "
                         f"--random-tokens N instead ({type(err).__name__})") from err
    ids = tok(text.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    ids = ids[:args.max_tokens]
    n = ids.numel() // args.seq_len
    if n == 0:
        raise ValueError(f"--text {args.text} gives {ids.numel()} tokens, fewer than "
                         f"--seq-len {args.seq_len}")
    return ids[:n * args.seq_len].reshape(n, args.seq_len)


def cmd_convert_router(args) -> int:
    from safetensors.torch import save_file
    from ..hf.convert_router import (capture_router_inputs, convert_routers, find_routers,
                                     plot_agreement)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ValueError(f"--out {out} is not empty; give a new folder or --force to write "
                         f"into it")
    check_output_dir(out, "--out")
    model = _load_model(args.model)
    limit = min(min(w.shape) for _, w in find_routers(model))
    if max(args.rank) > limit:
        raise ValueError(f"--rank {max(args.rank)} exceeds min(experts, hidden) = {limit} of "
                         f"the model's routers")
    ids = _tokens(args, model)
    inputs = capture_router_inputs(model, ids, progress=not args.no_progress)
    result = convert_routers(model, inputs, args.rank, method=args.method,
                             progress=not args.no_progress)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for r, tensors in result.pop("factors").items():
        path = out / f"routers_r{r}.safetensors"
        save_file(tensors, str(path), metadata={"rank": str(r), "method": args.method,
                                                "source": str(args.model)})
        files.append(path.name)
    plot = plot_agreement(result, out / "agreement.png",
                          f"{Path(args.model).name}: top-{result['top_k']} agreement of the "
                          f"rank-r routers ({ids.numel():,} tokens)")
    result.update(model=str(args.model), tokens=ids.numel(), files=files + [plot.name])
    write_json(out / "report.json", result)
    rows = [[layer["layer"], *(f"{r['set_agreement']:.3f} / {r['mean_overlap']:.3f}"
                              for r in layer["ranks"])] for layer in result["layers"]]
    emit(args, result, f"{args.model}: {len(rows)} routers, k = {result['top_k']}, "
         f"{ids.numel():,} tokens; top-k set agreement / mean overlap per rank\n"
         + table(rows, ["router", *(f"r={r}" for r in args.rank)])
         + f"\nwrote {out}: {', '.join(result['files'])}, report.json")
    return 0


def add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert-router", epilog=EPILOG, help="factor a trained MoE's routers to low rank",
        description="Factor every router of a transformers MoE model (Qwen3-MoE, OLMoE, "
        "Mixtral, DeepSeek-V3: the '*.mlp.gate' weights (E, h)) into R1 (E x r) R2 (r x h) by "
        "truncated SVD with the singular values split evenly, and report per layer, on the "
        "hidden states each router sees while the model reads your tokens, the share of "
        "tokens whose top-k set is unchanged and the mean overlap. Writes "
        "routers_r<R>.safetensors (<layer>.R1, <layer>.R2), report.json and agreement.png. "
        "The model must be on disk (download real checkpoints first).")
    p.add_argument("model", metavar="MODEL", help="a transformers model folder")
    p.add_argument("--rank", type=_int_list, required=True, help="r, or a comma list of r")
    p.add_argument("--out", required=True, help="folder for the factors and the report")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="text to run the model on (its tokenizer); default random tokens")
    p.add_argument("--random-tokens", type=_positive_int, default=4096,
                   help="random token ids when no --text (default 4,096)")
    p.add_argument("--seq-len", type=_positive_int, default=256,
                   help="tokens per sequence (default 256)")
    p.add_argument("--max-tokens", type=_positive_int, default=65_536,
                   help="at most this many tokens of --text (default 65,536)")
    p.add_argument("--method", choices=["svd", "jl"], default="svd",
                   help="factorisation (default svd; jl: the random projection of the "
                        "paper's upper bound)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="random-token seed")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, lines in a log)")
    _add_json(p)
    p.set_defaults(func=cmd_convert_router)
