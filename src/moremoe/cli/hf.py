"""``moremoe hf export``: a checkpoint as a transformers directory (moremoe.hf), never written
over a checkpoint or into a folder that holds other files unless --force."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..report import check_apart, check_output_dir
from ..tasks.tokenizer import VOCAB_SIZE
from ..report import emit as _emit
from .args import _add_json, _path


def cmd_hf_export(args) -> int:
    from ..eval.zero_shot import quiet_libraries
    from ..hf import export
    from ..hf.card import run_info
    from ..model.checkpoint import load_model, resolve
    out = _export_target(Path(args.checkpoint), Path(args.out_dir), force=args.force)
    ckpt = resolve(args.checkpoint, weights_only=True)
    model = load_model(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        with quiet_libraries(True):        # no "Writing model shards" bar: one line says it
            export(model, staging, info=run_info(ckpt), name=out.name)
        out.mkdir(exist_ok=True)
        written = {f.name for f in staging.iterdir()}
        for name in STALE - written:                 # an earlier export's tokenizer, say
            (out / name).unlink(missing_ok=True)
        for f in staging.iterdir():                  # each file lands whole or not at all
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # what this export wrote: a --force export into a folder of the user's keeps their files,
    # which are not the export's to list
    result = {"checkpoint": str(args.checkpoint), "out_dir": str(out), "files": sorted(written)}
    tokenizer = ("its GPT-2 tokenizer: PreTrainedTokenizerFast.from_pretrained (AutoTokenizer "
                 "after moremoe.hf.register())" if model.config.vocab == VOCAB_SIZE
                 else f"no tokenizer: the vocabulary of {model.config.vocab:,} is not GPT-2's")
    _emit(args, {**result, "tokenizer": model.config.vocab == VOCAB_SIZE},
          f"wrote {out} ({', '.join(result['files'])}); load it with moremoe.hf.register() "
          f"and AutoModelForCausalLM.from_pretrained; {tokenizer}")
    return 0


# what an earlier export may have left that this one does not write: the files of GPT-2's
# tokenizer (a model of another vocabulary gets none)
STALE = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "vocab.json", "merges.txt"}


def _export_target(src: Path, out: Path, *, force: bool) -> Path:
    """OUT_DIR, checked: never a file, never the checkpoint or a folder inside it, never a
    moremoe run or checkpoint (even with --force), and not a non-empty folder unless
    --force; its parent writable. ValueError naming the problem."""
    from ..model.checkpoint import check_not_a_run
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {out} is a file; give a folder to write into")
    check_apart(out, "OUT_DIR", [("CHECKPOINT", src)], "write the export to a folder of its "
                "own")
    check_not_a_run(out, "OUT_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"OUT_DIR {out} is not empty; pass --force to write into it "
                         f"(the export's files are replaced, other files kept)")
    check_output_dir(out.parent, "OUT_DIR")
    return out


def add_hf_parser(sub) -> None:
    h = sub.add_parser("hf", help="Hugging Face transformers interop")
    hsub = h.add_subparsers(dest="hf_command", metavar="SUBCOMMAND", required=True)
    e = hsub.add_parser("export", help="a checkpoint as a transformers directory",
                        description="Write a moremoe checkpoint as config.json + "
                        "model.safetensors that AutoModelForCausalLM loads after "
                        "moremoe.hf.register() (or with trust_remote_code=True), GPT-2's "
                        "tokenizer files (tokenizer.json, tokenizer_config.json) when the "
                        "model's vocabulary is GPT-2's (PreTrainedTokenizerFast reads them; "
                        "AutoTokenizer and pipeline('text-generation') after "
                        "moremoe.hf.register()), and a model card "
                        "(README.md: the architecture, the training configuration, the data "
                        "and the run's last metrics).")
    e.add_argument("checkpoint", type=_path, metavar="CHECKPOINT",
                   help="checkpoint or run directory")
    e.add_argument("out_dir", type=_path, metavar="OUT_DIR",
                   help="folder to write: new or empty (or --force); never a moremoe run")
    e.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT_DIR (the export's files are replaced, "
                        "others kept)")
    _add_json(e)
    e.set_defaults(func=cmd_hf_export)
