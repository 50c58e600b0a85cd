"""``moremoe convert-router``: a trained transformers MoE's routers factored to low rank
(moremoe.hf.convert_router), with the top-k agreement on the hidden states they see, and
(--write-model) the model routed by the factors with the change in its loss."""
from __future__ import annotations

from pathlib import Path

from ..model.checkpoint import safetensors_problem
from ..report import check_apart, check_new_output, emit, table, with_umask, write_json
from .args import EPILOG, _add_json, _int_at_least, _int_list, _path, _positive_int
from .memory import advise_on_memory, out_of_memory


def _check_model_folder(path: str) -> None:
    """A transformers model folder whose safetensors files are whole, before any loading."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"MODEL {path}: not a transformers model folder (no config.json); "
                         f"real checkpoints need their weights downloaded first, e.g. "
                         f"`huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir {path}`")
    if _model_type(folder / "config.json") == "moremoe":
        raise ValueError(f"MODEL {path} is a moremoe model (config.json model_type 'moremoe', "
                         f"from `moremoe hf export`); convert-router reads transformers MoE "
                         f"models whose routers are '*.mlp.gate' weights (Qwen3-MoE, OLMoE, "
                         f"Mixtral, DeepSeek-V3)")
    for weights in sorted(folder.glob("*.safetensors")):    # before transformers reads them
        why = safetensors_problem(weights)
        if why:
            raise ValueError(f"MODEL {path}: {weights.name} {why}; the file is damaged: "
                             f"download or copy it again")


def _model_type(config: Path):
    """config.json's model_type, or None when it cannot be read (transformers names that)."""
    import json
    try:
        d = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def _load_model(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()          # errors and reports stay the only stderr lines
    try:
        # no model's own code runs, and transformers never asks at a prompt whether it may
        return AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True,
                                                    trust_remote_code=False)
    except Exception as err:    # noqa: BLE001 - a damaged .bin, an unknown model_type, ...
        if out_of_memory(err):
            raise
        if "trust_remote_code" in str(err):
            raise ValueError(f"MODEL {path}: its model_type "
                             f"{_model_type(Path(path) / 'config.json')!r} needs the folder's "
                             f"own code (config.json auto_map), which convert-router does not "
                             f"run; give a model transformers reads itself (Qwen3-MoE, OLMoE, "
                             f"Mixtral, DeepSeek-V3)") from err
        text = " ".join(str(err).split())[:300]
        raise ValueError(f"MODEL {path}: transformers cannot load it ({type(err).__name__}: "
                         f"{text}); is it a complete transformers model folder?") from err


# files one of which a transformers tokenizer folder holds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def _tokenizer(model: str):
    """The model folder's tokenizer; ValueError when it has none. transformers 5 builds an
    empty tokenizer (only special tokens: every text -> []) for a folder without tokenizer
    files, so the files are looked for first and the vocabulary checked after."""
    instead = "copy the model's tokenizer files into it, or give --random-tokens N instead"
    if not any((Path(model) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"MODEL {model} has no tokenizer to read --text with (none of "
                         f"{', '.join(TOKENIZER_FILES)}); {instead}")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True,
                                            trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"MODEL {model}: its tokenizer cannot be loaded to read --text "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
                         f"{instead}") from err
    if not set(tok.get_vocab()) - set(tok.all_special_tokens):
        raise ValueError(f"MODEL {model}: its tokenizer is empty (only the special tokens "
                         f"{', '.join(tok.all_special_tokens) or 'none'}), so --text would "
                         f"give no tokens; {instead}")
    return tok


def _read_text(args) -> str | None:
    """The --text file's text (checked before the model is loaded), or None."""
    if args.text is None:
        return None
    text = Path(args.text)
    if not text.is_file():
        what = "is a folder, not a file" if text.is_dir() else "no such file"
        raise ValueError(f"--text {args.text}: {what}; give a text file")
    try:
        return text.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text {args.text}: not UTF-8 text (byte {err.start:,}); give a "
                         f"UTF-8 text file") from None


def _tokens(args, model, text: str | None, tok):
    """(B, T) token ids: the --text through the model's tokenizer, or random ids."""
    import torch
    if text is None:
        g = torch.Generator().manual_seed(args.seed)
        n = max(1, args.random_tokens // args.seq_len)
        return torch.randint(0, model.config.vocab_size, (n, args.seq_len), generator=g)
    ids = tok(text, return_tensors="pt").input_ids[0]
    ids = ids[:args.max_tokens]
    n = ids.numel() // args.seq_len
    if n == 0:
        raise ValueError(f"--text {args.text} gives {ids.numel()} tokens, fewer than "
                         f"--seq-len {args.seq_len}")
    return ids[:n * args.seq_len].reshape(n, args.seq_len)


# files of a tokenizer that --write-model copies beside the converted model
TOKENIZER_COPIES = TOKENIZER_FILES + ("special_tokens_map.json", "merges.txt",
                                      "added_tokens.json", "chat_template.jinja")


def _write_model(args, model, factors: dict, ids) -> dict:
    """The source model with its routers replaced by the rank-r factors (W = R1 R2 in the
    gate's own (E, h) weight: the architecture is unchanged, so AutoModelForCausalLM loads
    it with no moremoe code, and it routes as the rank-r router does; the gate still costs
    E h a token), saved to --write-model with the source's tokenizer files; the loss and
    perplexity on the tokens before and after."""
    import math
    import shutil

    from ..hf.convert_router import lm_loss, write_factors
    (rank,) = args.rank
    before = lm_loss(model, ids)
    routers = write_factors(model, factors[rank])
    after = lm_loss(model, ids)
    model.config.moremoe_router_factors = {"rank": rank, "method": args.method,
                                           "source": str(args.model)}
    out = Path(args.write_model)
    model.save_pretrained(out)
    for name in TOKENIZER_COPIES:
        if (Path(args.model) / name).is_file():
            shutil.copyfile(Path(args.model) / name, out / name)
    for f in out.iterdir():
        if f.is_file():
            with_umask(f)
    return {"path": str(out), "rank": rank, "routers": routers, "loss": before,
            "loss_converted": after, "loss_change": after - before,
            "perplexity": math.exp(before), "perplexity_converted": math.exp(after)}


def cmd_convert_router(args) -> int:
    from safetensors.torch import save_file
    from ..hf.convert_router import (capture_router_inputs, convert_routers, find_routers,
                                     plot_agreement)
    from ..model.checkpoint import check_not_a_run
    for flag, folder in (("--out", args.out), ("--write-model", args.write_model)):
        if folder is not None:
            check_not_a_run(folder, flag)
    out = check_new_output(args.out, "--out", args.force, folder=True)
    if args.write_model is not None:
        if len(args.rank) != 1:
            raise ValueError(f"--write-model writes one converted model: give one --rank, "
                             f"got {','.join(map(str, args.rank))}")
        own = "write the converted model to a folder of its own"
        check_apart(args.write_model, "--write-model", [("MODEL", args.model)], own)
        if Path(args.write_model).resolve() == Path(args.out).resolve():
            raise ValueError(f"--write-model {args.write_model} is --out: {own}")
        check_new_output(args.write_model, "--write-model", args.force, folder=True)
    text = _read_text(args)                  # every input checked before the model loads
    _check_model_folder(args.model)
    tok = _tokenizer(args.model) if text is not None else None
    with advise_on_memory(f"MODEL {args.model} with the hidden states of its routers",
                          "lower --random-tokens or --max-tokens (the hidden states of every "
                          "router are kept), or run it on a machine with more memory"):
        model = _load_model(args.model)
        limit = min(min(w.shape) for _, w in find_routers(model))
        if max(args.rank) > limit:
            raise ValueError(f"--rank {max(args.rank)} exceeds min(experts, hidden) = {limit} "
                             f"of the model's routers")
        ids = _tokens(args, model, text, tok)
        inputs = capture_router_inputs(model, ids, progress=not args.no_progress)
        result = convert_routers(model, inputs, args.rank, method=args.method,
                                 progress=not args.no_progress)
        factors = result.pop("factors")
        if args.write_model is not None:
            result["model_written"] = _write_model(args, model, factors, ids)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for r, tensors in factors.items():
        path = out / f"routers_r{r}.safetensors"
        save_file(tensors, str(path), metadata={"rank": str(r), "method": args.method,
                                                "source": str(args.model)})
        with_umask(path)                     # safetensors >= 0.8 writes 0600
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
         + f"\nwrote {out}: {', '.join(result['files'])}, report.json" + _written(result))
    return 0


def _written(result: dict) -> str:
    w = result.get("model_written")
    if not w:
        return ""
    return (f"\nwrote {w['path']}: the model with its {w['routers']} routers at rank "
            f"{w['rank']} (W = R1 R2); loss {w['loss']:.4f} -> {w['loss_converted']:.4f} "
            f"({w['loss_change']:+.4f}), perplexity {w['perplexity']:.2f} -> "
            f"{w['perplexity_converted']:.2f} on the same {result['tokens']:,} tokens")


def add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert-router", epilog=EPILOG, help="factor a trained MoE's routers to low rank",
        description="Factor every router of a transformers MoE model (Qwen3-MoE, OLMoE, "
        "Mixtral, DeepSeek-V3: the '*.mlp.gate' weights (E, h)) into R1 (E x r) R2 (r x h) by "
        "truncated SVD with the singular values split evenly, and report per layer, on the "
        "hidden states each router sees while the model reads your tokens, the share of "
        "tokens whose top-k set is unchanged and the mean overlap. Writes "
        "routers_r<R>.safetensors (<layer>.R1, <layer>.R2), report.json and agreement.png; "
        "with --write-model also the model routed by its rank-r factors (W = R1 R2 written "
        "into each gate: the same architecture, so it loads as MODEL does, its routers "
        "still costing E x h a token) and the change in loss and perplexity on the tokens. "
        "The model must be on disk (download real checkpoints first); no model's own code is "
        "run (a folder that needs it, a moremoe export among them, is refused).")
    p.add_argument("model", type=_path, metavar="MODEL", help="a transformers model folder")
    p.add_argument("--rank", type=_int_list, required=True, help="r, or a comma list of r")
    p.add_argument("--out", type=_path, required=True,
                   help="folder for the factors and the report")
    p.add_argument("--text", type=_path, default=None, metavar="FILE",
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
    p.add_argument("--write-model", type=_path, default=None, metavar="DIR",
                   help="also write the model with every router replaced by its rank-r "
                        "factors (one --rank; W = R1 R2 in the gate's weight, so "
                        "AutoModelForCausalLM loads it as it loads MODEL) and report the "
                        "loss and perplexity before and after on the tokens")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out or --write-model")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, lines in a log)")
    _add_json(p)
    p.set_defaults(func=cmd_convert_router)
