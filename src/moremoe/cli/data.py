"""The ``moremoe data`` commands: thin parsing over ``moremoe.tasks.prepare``, ``.mixture``
and ``.text``."""
from __future__ import annotations

import argparse
import sys
import textwrap

from .args import (_add_json, _distinct, _int_at_least, _open_fraction, _path, _positive_float,
                   _seed, _unit_or_zero)
from ..report import check_output_dir, emit, human, table
from ..tasks.recipe import PAPER, RECIPES, describe, nominal_tokens


def cmd_prepare(args) -> int:
    from ..tasks.prepare import PrepareConfig, prepare
    val_inputs = tuple(args.val_input or ())
    config = PrepareConfig(
        inputs=tuple(args.inputs), out=args.out, seq_len=args.seq_len, val_inputs=val_inputs,
        val_sequences=(args.val_sequences if args.val_sequences is not None else
                       None if val_inputs else 5000), seed=args.seed, workers=args.workers,
        text_field=args.text_field, tokenizer_ranks=args.tokenizer_ranks,
        shard_mb=args.shard_mb, restart=args.restart, force=args.force)
    s = prepare(config, progress=not args.no_progress)
    rows = [["input files", f"{s['input_files']:,}"],
            ["documents", f"{s['documents']:,}"],
            ["tokens (with end-of-text)", f"{s['tokens']:,} ({human(s['tokens'])})"],
            [f"train sequences x {s['seq_len']}", f"{s['train_sequences']:,}"],
            [f"val sequences x {s['seq_len']}", f"{s['val_sequences']:,}"
             + (" (held out by input)" if val_inputs else "")],
            ["dropped tokens (tail)", f"{s['dropped_tokens']:,}"],
            ["shards (reused)", f"{s['shards']:,} ({s['shards_reused']:,})"],
            ["seconds", f"{s['seconds']:.1f}"],
            [f"tokens/s ({s['workers']} workers)", f"{s['tokens_per_second']:,.0f}"]]
    if s["corpus"]:
        rows.append(["corpus fingerprint", s["corpus"]["fingerprint"][:16]])
    emit(args, s, f"GPT-2 tokens in {s['out']}\n" + table(rows, ["", "value"]))
    _note_no_val(args, s)
    return 0


def _note_no_val(args, summary: dict) -> None:
    """Prepared data without validation sequences trains, but has nothing to validate on:
    say so on stderr (stdout stays the table or the JSON)."""
    if summary["val_sequences"] == 0:
        print(f"{args.prog}: note: {summary['out']} holds no validation sequences "
              f"(--val-sequences 0): `moremoe train` on it reports no validation loss and "
              f"`moremoe eval --data` refuses it", file=sys.stderr)


def cmd_verify(args) -> int:
    from ..tasks.text import verify_tokens
    report = verify_tokens(args.dir)
    rows = [[split, f"{r['sequences']:,}", f"{r['bytes']:,}", r["max_id"], r["sha256"][:16]]
            for split, r in report["splits"].items()]
    emit(args, report, f"{args.dir}: sizes, sha256 and token ids OK (seq_len "
                       f"{report['seq_len']})\n"
         + table(rows, ["split", "sequences", "bytes", "max id", "sha256"]))
    return 0


def cmd_corpus(args) -> int:
    if args.packages:
        return _packages_corpus(args)
    given = [flag for flag, value in (("--root", args.root),
                                      ("--no-installed", args.no_installed),
                                      ("--val-fraction", args.val_fraction),
                                      ("--seed", args.seed), ("--near-dup", args.near_dup),
                                      ("--workers", args.workers))
             if value is not None and value is not False and value != []]
    if given:
        raise ValueError(f"{given[0]} is an option of the packages' corpus; add --packages "
                         f"(the topics corpus takes --python-source and --format)")
    from ..tasks.text import stdlib_corpus
    check_output_dir(args.out, "OUT")
    paths = stdlib_corpus(args.out, format=args.format, source=args.python_source,
                          force=args.force)
    nbytes = sum(p.stat().st_size for p in paths)
    emit(args, {"out": str(args.out), "files": len(paths), "bytes": nbytes},
         f"{len(paths):,} files, {nbytes / 2**20:,.1f} MiB of text in {args.out}\n"
         f"next: moremoe data prepare {args.out} --out DIR")
    return 0


def _packages_corpus(args) -> int:
    if args.python_source or args.format != "txt":
        raise ValueError("--python-source and --format write the topics corpus; --packages "
                         "reads the standard library itself: give one or the other")
    from ..tasks.corpus import CorpusConfig, build_corpus
    from ..tasks.prepare import default_workers
    d = CorpusConfig(out=args.out)
    near = d.near_dup if args.near_dup is None else args.near_dup or None
    s = build_corpus(CorpusConfig(
        out=args.out, extra_roots=tuple(args.root), installed=not args.no_installed,
        val_fraction=d.val_fraction if args.val_fraction is None else args.val_fraction,
        seed=d.seed if args.seed is None else args.seed, near_dup=near,
        workers=args.workers or default_workers(), force=args.force),
        progress=not args.no_progress)
    rows = [[step, f"{c['files']:,}", f"{c['bytes'] / 2**20:,.1f}"] for step, c in
            [("found", s["found"])] + [(f"- {k.replace('_', ' ')}", v)
                                        for k, v in s["removed"].items()]
            + [("kept", s["kept"])]]
    rows += [[f"{split} ({c['packages']:,} packages)", f"{c['files']:,}",
              f"{c['bytes'] / 2**20:,.1f}"] for split, c in s["splits"].items()]
    near = (f"near duplicates: MinHash Jaccard >= {s['near_dup_threshold']:g}"
            if s["near_dup_threshold"] else "near duplicates: not looked for (--near-dup 0)")
    out = args.out
    emit(args, s, f"{len(s['roots'])} roots: "
         + ", ".join(r["path"] for r in s["roots"]) + f"\n{near}\n"
         + table(rows, ["files", "count", "MiB"])
         + f"\nfingerprint {s['fingerprint'][:16]}; {s['seconds']:.1f} s\n"
         f"next: moremoe data prepare {out}/train.jsonl --val-input {out}/val.jsonl --out DIR")
    return 0


def _budget(spec) -> str:
    if spec.budget is not None:
        return human(spec.budget)
    return "whole split" if spec.fraction >= 1 else f"{spec.fraction:.3g} of the split"


def _mixture_config(args, out: str = ""):
    from ..tasks.mixture import MixtureConfig
    return MixtureConfig(
        out=out, recipe=args.recipe, scale=args.scale, tokens=args.tokens,
        sources=tuple(args.source), skip=tuple(args.skip), seq_len=args.seq_len,
        val_sequences=args.val_sequences, seed=args.seed, workers=args.workers,
        chunk_tokens=args.chunk_tokens, tokenizer_ranks=args.tokenizer_ranks,
        restart=args.restart, force=args.force)


def cmd_mixture(args) -> int:
    if args.list:
        return _list_mixture(args)
    if not args.out:
        raise ValueError("--out is required: the folder to build the mixture in (or --list to "
                         "show the recipe)")
    from ..tasks.mixture import build_mixture
    s = build_mixture(_mixture_config(args, args.out), progress=not args.no_progress)
    rows = [[r["name"], r["origin"].get("hub") or r["origin"]["path"], r["documents"],
             f"{r['tokens_taken']:,}" + ("" if r["budget_tokens"] is None or not
                                         r["whole_source"] else " (source ended)"),
             f"x{r['repeats']}", f"{r['train_sequences']:,}", f"{r['val_sequences']:,}",
             human(r["tokens_written"])] for r in s["sources"]]
    totals = (f"{s['train_sequences']:,} train + {s['val_sequences']:,} val sequences x "
              f"{s['seq_len']} = {s['tokens_written']:,} tokens ({human(s['tokens_written'])});"
              f" chunks {s['chunks']:,} ({s['chunks_reused']:,} reused); {s['seconds']:.1f} s, "
              f"{s['tokens_per_second']:,.0f} tokens/s")
    emit(args, s, f"{s['recipe']} mixture at scale {s['scale']:.3g} in {s['out']}\n"
         + table(rows, ["source", "from", "documents", "tokens taken", "repeats",
                        "train seq", "val seq", "written"]) + "\n" + totals)
    _note_no_val(args, s)
    return 0


def _list_mixture(args) -> int:
    config = _mixture_config(args)
    specs, local = config.plan(), dict(args.source)
    entries = [{**describe(s), "local": local.get(s.name)} for s in specs]
    rows = [[s.name, local.get(s.name) or s.hub_ref, _budget(s), f"x{s.repeats}"]
            for s in specs]
    written = nominal_tokens(specs)
    emit(args, {"recipe": args.recipe, "scale": config.effective_scale, "sources": entries,
                "budgeted_tokens_written": written},
         f"{args.recipe} recipe at scale {config.effective_scale:.3g}: {written:,} tokens "
         f"({human(written)}) from the budgeted sources, repeats included, plus the "
         f"benchmarks\n" + table(rows, ["source", "dataset (id:config) or local copy",
                                         "budget", "repeats"]))
    return 0


def _name_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH like fineweb_edu=/data/fineweb, "
                                         f"got {text!r}")
    return name, path


def _names(text: str) -> tuple[str, ...]:
    return tuple(_distinct([n for n in text.replace(" ", "").split(",") if n], text))


def _recipe_help() -> str:
    lines = []
    for s in PAPER:
        if s.budget is not None:
            lines.append(f"  {s.title:<27} {human(s.budget):>4} tokens x{s.repeats}   "
                         f"{s.hub_ref}")
    bench = ", ".join(s.title for s in PAPER if s.budget is None)
    return "\n".join(lines) + "\n" + textwrap.fill(
        f"and the train splits of {bench}: whole, x3 each.", width=92, initial_indent="  ",
        subsequent_indent="  ")


MIXTURE_DESCRIPTION = """\
Build a pretraining mixture from Hugging Face datasets, streamed with `datasets`, into
DIR/train.bin, DIR/val.bin and DIR/meta.json in the format of `moremoe data prepare` (GPT-2
tokens in --seq-len rows), so `moremoe train --data DIR` reads it as it is. DIR/mixture.json
is the manifest: per source its Hub id, config, split, budget, repeats and what it gave
(rows read, documents, tokens, sequences), and the seed.

--recipe paper, the paper's pretraining mixture (its Appendix on real-world pretraining):
{recipe}
Only train splits. A budget takes the first tokens of a source in its published order (the
last document cut to fit); a benchmark example is written as lm-evaluation-harness asks it
zero-shot, then the gold answer ("Question: ...\\nAnswer: ..."). The whole mixture writes
{full} tokens (37 + 14 + 3 x 4) plus about 0.1% of benchmarks; --scale F or --tokens N
builds a proportionally smaller one: budgets x F, and each benchmark example kept with
probability F (a seeded hash, so a uniform subset). `--list` shows every source, its dataset
and its budget at that scale.

Each source is cut into rows on its own (its tail short of a row dropped), each row written
`repeats` times. Validation: --val-sequences distinct rows drawn uniformly from that pool
with --seed; every copy of a validation row is left out of train.

Without a network, download the sources elsewhere and pass each as --source NAME=PATH: a
.jsonl / .jsonl.gz / .json / .parquet file or a folder of them, or a folder written by
save_to_disk, in the source's Hub schema. Work is kept chunk by chunk in DIR/.partial: the
same command run again after an interruption resumes to the same bytes; --force replaces a
finished output."""


CORPUS_DESCRIPTION = """\
Write text that needs no download, as a corpus for `moremoe data prepare` on a machine with
no network.

By default: the documentation topics of Python's pydoc_data (79 documents, 139K GPT-2
tokens), and with --python-source every .py file of the standard library (tens of MB), for
tests, demos and throughput runs.

--packages: the installed packages' corpus, for measuring language models: the .py, .md
and .rst files of the standard library and of every site-packages / dist-packages folder of
this Python (and of the installation a virtual environment was made from), and of each
--root. Dropped: files that are not UTF-8 or are empty, exact duplicates, and near
duplicates (MinHash over 5-word shingles, Jaccard >= --near-dup, such as two versions of one
package, or a vendored copy and its original). Split by whole package into train and
validation, so no validation text is ever trained on: a vendored copy (pip/_vendor/rich)
counts as its package (rich). Writes OUT/train.jsonl, OUT/val.jsonl (fields text, package,
path) and OUT/corpus.json: what each step removed, the packages of each split and the
fingerprint (sha256 of the two files), which `data prepare` and every run record. Then:
  moremoe data prepare OUT/train.jsonl --val-input OUT/val.jsonl --out DATA
On a 2-core CPU with this repository's test environment: 454 MB in 35,883 files found, 362
MB kept, 167M GPT-2 tokens; 23 s, and `data prepare` 19 s."""


PREPARE_DESCRIPTION = """\
Tokenise text with the GPT-2 BPE (50,257 ids; the ranks ship with moremoe, no download) into
DIR/train.bin and DIR/val.bin: uint16 arrays of --seq-len token sequences, documents joined by
<|endoftext|> (50256); DIR/meta.json records the tokenizer, the counts, the seed and the
sha256 of both files. Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document
per line, its --text-field), folders (searched recursively for those), glob patterns, and
folders written by datasets' save_to_disk (one document per row). The validation sequences
are a seeded random choice, or with --val-input the sequences of those inputs (held out
by input); the token tail short of one sequence is dropped.

Work is done shard by shard in DIR/.partial: an interrupted run resumes from its finished
shards when run again with the same inputs (byte-identical result); the outputs appear only
when complete, meta.json last. The output is the same for any --workers."""


def add_data_parser(sub) -> None:
    from ..tasks.prepare import default_workers
    p = sub.add_parser("data", help="prepare and check tokenised text for pretraining")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    pp = dsub.add_parser("prepare", help="tokenise text into train/val sequences",
                         description=PREPARE_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    pp.add_argument("inputs", type=_path, nargs="+", metavar="INPUT",
                    help="files, folders or glob patterns (quote globs to keep the shell off)")
    pp.add_argument("--out", type=_path, required=True, metavar="DIR", help="output folder")
    pp.add_argument("--seq-len", type=_int_at_least(2), default=1024,
                    help="tokens per sequence (default 1024)")
    pp.add_argument("--val-sequences", type=_int_at_least(0), default=None,
                    help="sequences held out for validation (default 5000, drawn from the "
                         "inputs; with --val-input, default all of its sequences, at least 1; "
                         "0 trains with no validation loss and cannot be evaluated)")
    pp.add_argument("--val-input", type=_path, nargs="+", metavar="INPUT",
                    help="validation held out by input: these files, folders or globs give "
                         "the validation sequences (all, or --val-sequences of them) and the "
                         "INPUTs only training ones, e.g. a corpus's val.jsonl from `moremoe "
                         "data corpus --packages`")
    pp.add_argument("--seed", type=_seed, default=0, help="seed of the validation choice")
    pp.add_argument("--workers", type=_int_at_least(1), default=default_workers(),
                    help=f"tokeniser processes (default min(8, CPUs) = {default_workers()})")
    pp.add_argument("--text-field", default="text",
                    help="the field of a JSON line / column of a dataset (default 'text')")
    pp.add_argument("--tokenizer-ranks", type=_path, default=None, metavar="PATH",
                    help="a gpt2.tiktoken ranks file to use instead of the packaged one "
                         "(its sha256 must be GPT-2's)")
    pp.add_argument("--shard-mb", type=_positive_float, default=32.0,
                    help="text per shard, the unit of work and of resume (default 32, at "
                         "least 0.01)")
    state = pp.add_mutually_exclusive_group()
    state.add_argument("--resume", dest="restart", action="store_false", default=False,
                       help="continue an interrupted run in DIR/.partial if it has the same "
                            "inputs (default; other inputs are an error)")
    state.add_argument("--restart", action="store_true",
                       help="discard an interrupted run's DIR/.partial and start over")
    pp.add_argument("--force", action="store_true",
                    help="replace a finished output in DIR (kept until the new one is ready)")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_json(pp)
    pp.set_defaults(func=cmd_prepare)

    _add_mixture_parser(dsub)

    pv = dsub.add_parser("verify", help="check a prepared folder (sizes, sha256, token ids)",
                         description="Read DIR/train.bin and DIR/val.bin in full: sizes against "
                         "meta.json, sha256 recomputed, every id below the vocabulary size. "
                         "Exits with an error naming the file on the first problem.")
    pv.add_argument("dir", type=_path, metavar="DIR",
                    help="a folder written by `moremoe data prepare`")
    _add_json(pv)
    pv.set_defaults(func=cmd_verify)

    pc = dsub.add_parser("corpus", help="write a corpus of text that ships with Python",
                         description=CORPUS_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    pc.add_argument("out", type=_path, metavar="OUT", help="folder to write into")
    pc.add_argument("--python-source", action="store_true",
                    help="also the standard library's source files, one document each")
    pc.add_argument("--format", choices=("txt", "jsonl"), default="txt",
                    help="the topics as .txt files (default) or one topics.jsonl")
    pc.add_argument("--packages", action="store_true",
                    help="the installed packages' corpus: the standard library's and every "
                         "site-packages' .py/.md/.rst files, deduplicated, split by package")
    pc.add_argument("--root", type=_path, action="append", default=[], metavar="DIR",
                    help="with --packages: one more folder of packages to read (repeat)")
    pc.add_argument("--no-installed", action="store_true",
                    help="with --packages: only the --root folders, not this Python's")
    pc.add_argument("--val-fraction", type=_open_fraction, default=None,
                    help="with --packages: the share of the kept bytes that whole packages "
                         "fill in validation (default 0.02)")
    pc.add_argument("--seed", type=_seed, default=None,
                    help="with --packages: the seed of the order packages fill validation in "
                         "(default 0)")
    pc.add_argument("--near-dup", type=_unit_or_zero, default=None, metavar="J",
                    help="with --packages: drop near duplicates, MinHash Jaccard >= J (default "
                         "0.8; 0: exact duplicates only)")
    pc.add_argument("--workers", type=_int_at_least(1), default=None,
                    help=f"with --packages: processes for the near-duplicate signatures "
                         f"(default {default_workers()})")
    pc.add_argument("--force", action="store_true",
                    help="replace files of OUT that hold other text (an earlier corpus is "
                         "written again without it)")
    pc.add_argument("--no-progress", action="store_true", help="no progress lines")
    _add_json(pc)
    pc.set_defaults(func=cmd_corpus)


def _add_mixture_parser(dsub) -> None:
    from ..tasks.prepare import default_workers
    full = nominal_tokens(PAPER)
    pm = dsub.add_parser(
        "mixture", help="build the paper's pretraining mixture from Hugging Face datasets",
        description=MIXTURE_DESCRIPTION.format(recipe=_recipe_help(), full=f"{full:,}"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pm.add_argument("--recipe", choices=sorted(RECIPES), default="paper",
                    help="the mixture to build (default paper)")
    pm.add_argument("--out", type=_path, metavar="DIR",
                    help="output folder (required unless --list)")
    pm.add_argument("--list", action="store_true",
                    help="show the recipe's sources, datasets and budgets, and build nothing")
    size = pm.add_mutually_exclusive_group()
    size.add_argument("--scale", type=_positive_float, default=1.0,
                      help="fraction of the whole mixture, in (0, 1] (default 1)")
    size.add_argument("--tokens", type=_int_at_least(1), default=None,
                      help=f"tokens to write in all, in place of --scale (the whole recipe: "
                           f"{human(full)})")
    pm.add_argument("--source", type=_name_path, action="append", default=[],
                    metavar="NAME=PATH", help="a local copy of a source, in place of the Hub "
                    "(repeat for each; names as in --list)")
    pm.add_argument("--skip", type=_names, default=(), metavar="NAMES",
                    help="comma-separated sources to leave out")
    pm.add_argument("--seq-len", type=_int_at_least(2), default=1024,
                    help="tokens per sequence (default 1024)")
    pm.add_argument("--val-sequences", type=_int_at_least(0), default=5000,
                    help="distinct sequences held out for validation (default 5000; 0 "
                         "trains with no validation loss and cannot be evaluated)")
    pm.add_argument("--seed", type=_seed, default=0,
                    help="seed of the validation draw and of the benchmark subsets")
    pm.add_argument("--workers", type=_int_at_least(1), default=default_workers(),
                    help=f"tokeniser threads (default min(8, CPUs) = {default_workers()})")
    pm.add_argument("--chunk-tokens", type=_int_at_least(1), default=1 << 24,
                    help="tokens per chunk, the unit of resume (default 16,777,216)")
    pm.add_argument("--tokenizer-ranks", type=_path, default=None, metavar="PATH",
                    help="a gpt2.tiktoken ranks file to use instead of the packaged one")
    state = pm.add_mutually_exclusive_group()
    state.add_argument("--resume", dest="restart", action="store_false", default=False,
                       help="continue the unfinished work in DIR/.partial (default)")
    state.add_argument("--restart", action="store_true",
                       help="discard DIR/.partial and start over")
    pm.add_argument("--force", action="store_true",
                    help="replace a finished output in DIR (kept until the new one is ready), "
                         "and discard unfinished work that conflicts with these options")
    pm.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_json(pm)
    pm.set_defaults(func=cmd_mixture)
