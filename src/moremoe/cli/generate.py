"""``moremoe generate``: text from a trained model (a checkpoint, a run's newest complete one,
or a folder of `moremoe hf export`), through the GPT-2 tokenizer and the static decode path
(model/static.py: a CUDA graph per step on a GPU).

Prompts of one token length decode as one batch; prompts of other lengths go in batches of
their own (the model has no per-row positions, so rows are never padded). One prompt streams
its text to stdout as the tokens come; several print each prompt with its continuation as
its batch finishes. A row stops at <|endoftext|> (not printed; --ignore-eos goes on) or after
--max-new-tokens.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .args import _add_json, _finite, _path, _positive_int, _seed

DEFAULT_NEW_TOKENS = 64


def _read_prompts(args) -> list[tuple[int, str]]:
    """(line number, text) of each prompt: --prompt, or each non-empty line of --prompt-file."""
    if args.prompt is not None:
        if not args.prompt:
            raise ValueError("--prompt is empty; give some text to continue")
        return [(1, args.prompt)]
    path = Path(args.prompt_file)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "no such file"
        raise ValueError(f"--prompt-file {path}: {what}; give a text file with one prompt a "
                         f"line")
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte {err.start:,})") from None
    prompts = [(n, line.rstrip("\r")) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompt (only empty lines)")
    return prompts


def _sampling(args):
    from ..model.sampling import Sampling
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k and --top-p restrict sampling; give --temperature > 0 with "
                         "them (temperature 0 is greedy)")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    return Sampling(args.temperature, args.top_k, args.top_p)


# the reports of the phonebook commands: their models read names and digits, and none is kept
PHONEBOOK_REPORTS = ("demo.json", "phonebook_train.json", "capacity.json", "sweep.json")


def _refuse_phonebook_report(path: Path) -> None:
    """A folder of `moremoe demo` or `moremoe phonebook` holds a report and a plot, no model:
    say so, and what generate needs, instead of 'not a checkpoint'."""
    if not path.is_dir() or (path / "checkpoints").is_dir():
        return
    for name in PHONEBOOK_REPORTS:
        if (path / name).is_file():
            command = "demo" if name == "demo.json" else "phonebook"
            raise ValueError(f"MODEL {path} holds the report of `moremoe {command}` ({name}) "
                             f"and no checkpoint: its phonebook models are not kept, and they "
                             f"read names and digits, not text; generate needs a language model "
                             f"of `moremoe train` on GPT-2 tokens (e.g. --preset tiny-more on "
                             f"data of `moremoe data prepare`)")


def _load(args):
    """(model in eval mode on its device and dtype, {"path", "step"} or None)."""
    import torch

    from ..eval.zero_shot import load_eval_model, quiet_libraries, resolve_eval_model
    from ..model.checkpoint import describe_incomplete
    from ..runtime import resolve_device
    from ..tasks.tokenizer import VOCAB_SIZE
    device = resolve_device(args.device)
    _refuse_phonebook_report(Path(args.model))
    path, checkpoint, passed = resolve_eval_model(args.model)
    if passed:
        print(f"{args.prog}: warning: the newest checkpoint of {args.model} is incomplete: "
              f"{describe_incomplete(passed)}; generating with {path}, the newest complete "
              f"one", file=sys.stderr)
    with quiet_libraries(not args.no_progress):
        model = load_eval_model(path, device)
    if model.config.vocab != VOCAB_SIZE:
        raise ValueError(f"MODEL {args.model} has a vocabulary of {model.config.vocab:,} "
                         f"tokens, not GPT-2's {VOCAB_SIZE:,}: generate reads the prompt with "
                         f"the GPT-2 tokenizer, so it needs a model trained on data of `moremoe "
                         f"data prepare` (GPT-2 tokens)")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    return model.to(dtype), checkpoint


def _tokenize(args, prompts, enc, max_seq_len: int) -> list[list[int]]:
    from ..tasks.tokenizer import EOT
    out = []
    for line, text in prompts:
        ids = enc.encode(text, allowed_special={EOT})
        where = "--prompt" if args.prompt is not None else f"--prompt-file line {line}"
        if len(ids) + args.max_new_tokens > max_seq_len:
            raise ValueError(f"{where} has {len(ids):,} tokens; with --max-new-tokens "
                             f"{args.max_new_tokens} that is more than the model's "
                             f"max_seq_len={max_seq_len:,}: shorten the prompt or lower "
                             f"--max-new-tokens")
        out.append(ids)
    return out


def _complete(data: bytes) -> int:
    """The length of data's prefix that ends on a character boundary (a multi-byte UTF-8
    character whose last bytes are still to come is held back)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:                  # the last character's first byte
            need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


class _Stream:
    """A row's text on stdout as its tokens come, whole characters only."""

    def __init__(self, enc, out):
        self.enc, self.out, self.tokens, self.shown = enc, out, [], 0

    def add(self, token: int, last: bool = False) -> None:
        if token is not None:
            self.tokens.append(token)
        data = self.enc.decode_bytes(self.tokens)
        end = len(data) if last else _complete(data)
        self.out.write(data[self.shown:end].decode("utf-8", errors="replace"))
        self.out.flush()
        self.shown = end


def _groups(ids: list[list[int]], batch: int | None) -> list[list[int]]:
    """Row indices grouped by token length (in the order lengths first appear), at most
    `batch` rows a group."""
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        by_length.setdefault(len(row), []).append(i)
    out = []
    for rows in by_length.values():
        step = batch or len(rows)
        out += [rows[j:j + step] for j in range(0, len(rows), step)]
    return out


def _decode(args, model, rows: list[list[int]], sampling, eos, stream):
    """(each row's new tokens, the batch's timings): one StaticDecoder for the batch."""
    import torch

    from ..model.generate import record
    from ..model.static import StaticDecoder, cache_length
    B, T = len(rows), len(rows[0])
    t0 = time.perf_counter()
    decoder = StaticDecoder(model, B, cache_length(T, args.max_new_tokens,
                                                   model.config.max_seq_len),
                            compile=args.compile,
                            cuda_graph=False if args.no_cuda_graph else None)
    decoder.prepare(sampling)
    t1 = time.perf_counter()
    new, done = [[] for _ in rows], [False] * B
    steps = decoder.stream(torch.tensor(rows, device=decoder.device), args.max_new_tokens,
                           sampling)
    first = t1
    for i, tokens in enumerate(steps):
        first = time.perf_counter() if i == 0 else first
        going = record(new, done, tokens, eos, None, None)
        if stream is not None and tokens[0] != eos:
            stream.add(tokens[0])
        if not going:
            steps.close()
            break
    end = time.perf_counter()
    n = max(len(r) for r in new)
    return new, {"batch": B, "setup_ms": 1e3 * (t1 - t0), "prefill_ms": 1e3 * (first - t1),
                 "ms_per_token": 1e3 * (end - first) / (n - 1) if n > 1 else None,
                 "replays": decoder.replays}


def _row(prompt: tuple[int, str], ids, new, eos, timing, enc) -> dict:
    stopped = "eos" if eos is not None and new and new[-1] == eos else "length"
    shown = new[:-1] if stopped == "eos" else new
    return {"line": prompt[0], "prompt": prompt[1], "prompt_ids": ids, "token_ids": new,
            "text": enc.decode(shown), "stopped": stopped, **timing}


def cmd_generate(args) -> int:
    import random

    import torch

    from ..report import dumps
    from ..runtime import progress_bar
    from ..tasks.tokenizer import EOT_ID, gpt2_encoding
    from .memory import advise_on_memory
    sampling = _sampling(args)
    prompts = _read_prompts(args)                   # every input checked before loading
    enc = gpt2_encoding()
    eos = None if args.ignore_eos else EOT_ID
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 62)
    single = len(prompts) == 1 and not args.json
    with advise_on_memory(f"{args.model} at {len(prompts)} prompt(s)",
                          "lower --batch-size or --max-new-tokens, or use another --device"):
        model, checkpoint = _load(args)
        ids = _tokenize(args, prompts, enc, model.config.max_seq_len)
        torch.manual_seed(seed)
        results = [None] * len(prompts)
        bar = progress_bar(len(prompts), desc="generating",
                           enabled=not (args.no_progress or single))
        for rows in _groups(ids, args.batch_size):
            stream = _Stream(enc, sys.stdout) if single else None
            if stream is not None:
                sys.stdout.write(prompts[0][1])
            new, timing = _decode(args, model, [ids[r] for r in rows], sampling, eos, stream)
            for r, tokens in zip(rows, new):
                results[r] = _row(prompts[r], ids[r], tokens, eos, timing, enc)
                if not (args.json or single):
                    print(f"--- line {prompts[r][0]}\n{prompts[r][1]}{results[r]['text']}",
                          flush=True)
            bar.update(len(rows))
        bar.close()
    if single:
        stream.add(None, last=True)
        print()
    if args.json:
        print(dumps({"model": str(args.model), "checkpoint": checkpoint,
                     "device": str(model.embed.weight.device),
                     "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
                     "seed": seed, "temperature": sampling.temperature, "top_k": sampling.top_k,
                     "top_p": sampling.top_p, "max_new_tokens": args.max_new_tokens,
                     "results": results}, indent=2))
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="text from a trained model (GPT-2 tokenizer, fast decoding)",
        description="Continue a prompt with a trained model: a checkpoint, a run directory "
        "(its newest complete checkpoint) or a folder of `moremoe hf export`, trained on GPT-2 "
        "tokens. Greedy by default; --temperature samples (with --top-k / --top-p). The key/"
        "value cache is static and, on a GPU, each new token is one CUDA-graph replay of the "
        "whole step. One prompt streams its text; with --prompt-file each line is a prompt, "
        "prompts of one token length decode as one batch (rows are never padded), and each "
        "prompt is printed with its continuation when its batch finishes. The phonebook "
        "models of `moremoe demo` and `moremoe phonebook` are not language models and are not "
        "kept: train one with `moremoe train` (e.g. --preset tiny-more) on data of `moremoe "
        "data prepare`.")
    p.add_argument("model", type=_path, metavar="RUN_OR_CHECKPOINT",
                   help="a run directory, a checkpoint, or a `moremoe hf export` folder")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", default=None, metavar="TEXT", help="the text to continue")
    which.add_argument("--prompt-file", type=_path, default=None, metavar="FILE",
                       help="UTF-8 text, one prompt a line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=DEFAULT_NEW_TOKENS,
                   help=f"at most this many new tokens a prompt (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--temperature", type=_finite, default=0.0,
                   help="0 (default): greedy; > 0: sample from softmax(logits / T)")
    p.add_argument("--top-k", type=_positive_int, default=None,
                   help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=_finite, default=None,
                   help="sample among the most likely tokens whose probability reaches p, in "
                        "(0, 1]")
    p.add_argument("--seed", type=_seed, default=None,
                   help="seed of the sampling (default a random one, printed under --json)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past <|endoftext|> up to --max-new-tokens")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="at most this many prompts of one length a batch (default all)")
    p.add_argument("--device", default="auto",
                   help="auto (default: the GPU if any), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   default="auto", help="the weights' dtype (default bfloat16 on a GPU, "
                                        "float32 on the CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the blocks and the head first (fewer, fused kernels: "
                        "faster steps after a compilation of tens of seconds)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="run each step's kernels one by one instead of replaying a CUDA graph")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar over the prompts on stderr")
    _add_json(p)
    p.set_defaults(func=cmd_generate)
