"""The ``moremoe data`` commands: thin parsing over ``moremoe.tasks.prepare`` and ``.text``."""
from __future__ import annotations

import argparse

from .args import _add_json, _int_at_least, _positive_float
from ..report import check_output_dir, emit, human, table


def cmd_prepare(args) -> int:
    from ..tasks.prepare import PrepareConfig, prepare
    config = PrepareConfig(
        inputs=tuple(args.inputs), out=args.out, seq_len=args.seq_len,
        val_sequences=args.val_sequences, seed=args.seed, workers=args.workers,
        text_field=args.text_field, tokenizer_ranks=args.tokenizer_ranks,
        shard_mb=args.shard_mb, restart=args.restart, force=args.force)
    s = prepare(config, progress=not args.no_progress)
    rows = [["input files", f"{s['input_files']:,}"],
            ["documents", f"{s['documents']:,}"],
            ["tokens (with end-of-text)", f"{s['tokens']:,} ({human(s['tokens'])})"],
            [f"train sequences x {s['seq_len']}", f"{s['train_sequences']:,}"],
            [f"val sequences x {s['seq_len']}", f"{s['val_sequences']:,}"],
            ["dropped tokens (tail)", f"{s['dropped_tokens']:,}"],
            ["shards (reused)", f"{s['shards']:,} ({s['shards_reused']:,})"],
            ["seconds", f"{s['seconds']:.1f}"],
            [f"tokens/s ({s['workers']} workers)", f"{s['tokens_per_second']:,.0f}"]]
    emit(args, s, f"GPT-2 tokens in {s['out']}\n" + table(rows, ["", "value"]))
    return 0


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
    from ..tasks.text import stdlib_corpus
    check_output_dir(args.out, "OUT")
    paths = stdlib_corpus(args.out, format=args.format, source=args.python_source)
    nbytes = sum(p.stat().st_size for p in paths)
    emit(args, {"out": str(args.out), "files": len(paths), "bytes": nbytes},
         f"{len(paths):,} files, {nbytes / 2**20:,.1f} MiB of text in {args.out}\n"
         f"next: moremoe data prepare {args.out} --out DIR")
    return 0


PREPARE_DESCRIPTION = """\
Tokenise text with the GPT-2 BPE (50,257 ids; the ranks ship with moremoe, no download) into
DIR/train.bin and DIR/val.bin: uint16 arrays of --seq-len token sequences, documents joined by
<|endoftext|> (50256); DIR/meta.json records the tokenizer, the counts, the seed and the
sha256 of both files. Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document
per line, its --text-field), folders (searched recursively for those), glob patterns, and
folders written by datasets' save_to_disk (one document per row). The validation sequences
are a seeded random choice; the token tail short of one sequence is dropped.

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
    pp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files, folders or glob patterns (quote globs to keep the shell off)")
    pp.add_argument("--out", required=True, metavar="DIR", help="output folder")
    pp.add_argument("--seq-len", type=_int_at_least(2), default=1024,
                    help="tokens per sequence (default 1024)")
    pp.add_argument("--val-sequences", type=_int_at_least(0), default=5000,
                    help="sequences held out for validation (default 5000)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the validation choice")
    pp.add_argument("--workers", type=_int_at_least(1), default=default_workers(),
                    help=f"tokeniser processes (default min(8, CPUs) = {default_workers()})")
    pp.add_argument("--text-field", default="text",
                    help="the field of a JSON line / column of a dataset (default 'text')")
    pp.add_argument("--tokenizer-ranks", default=None, metavar="PATH",
                    help="a gpt2.tiktoken ranks file to use instead of the packaged one "
                         "(its sha256 must be GPT-2's)")
    pp.add_argument("--shard-mb", type=_positive_float, default=32.0,
                    help="text per shard, the unit of work and of resume (default 32)")
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

    pv = dsub.add_parser("verify", help="check a prepared folder (sizes, sha256, token ids)",
                         description="Read DIR/train.bin and DIR/val.bin in full: sizes against "
                         "meta.json, sha256 recomputed, every id below the vocabulary size. "
                         "Exits with an error naming the file on the first problem.")
    pv.add_argument("dir", metavar="DIR", help="a folder written by `moremoe data prepare`")
    _add_json(pv)
    pv.set_defaults(func=cmd_verify)

    pc = dsub.add_parser("corpus", help="write a corpus of text that ships with Python",
                         description="Write text that needs no download: the documentation "
                         "topics of Python's pydoc_data (79 documents, 139K GPT-2 tokens), and "
                         "with --python-source every .py file of the standard library (tens of "
                         "MB), as a corpus for `moremoe data prepare` on a machine with no "
                         "network (tests, demos, throughput runs).")
    pc.add_argument("out", metavar="OUT", help="folder to write into")
    pc.add_argument("--python-source", action="store_true",
                    help="also the standard library's source files, one document each")
    pc.add_argument("--format", choices=("txt", "jsonl"), default="txt",
                    help="the topics as .txt files (default) or one topics.jsonl")
    _add_json(pc)
    pc.set_defaults(func=cmd_corpus)
