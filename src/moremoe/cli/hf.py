"""``moremoe hf export``: a checkpoint as a transformers directory (moremoe.hf), never written
over a checkpoint or into a folder that holds other files unless --force."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..report import check_output_dir
from ..report import emit as _emit
from .args import _add_json


def cmd_hf_export(args) -> int:
    from ..hf import export
    from ..model.checkpoint import load_model
    out = _export_target(Path(args.checkpoint), Path(args.out_dir), force=args.force)
    model = load_model(args.checkpoint)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        export(model, staging)
        out.mkdir(exist_ok=True)
        for f in staging.iterdir():                  # each file lands whole or not at all
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result = {"checkpoint": str(args.checkpoint), "out_dir": str(out),
              "files": sorted(f.name for f in out.iterdir())}
    _emit(args, result, f"wrote {out} ({', '.join(result['files'])}); load it with "
          f"moremoe.hf.register() and AutoModelForCausalLM.from_pretrained")
    return 0


def _export_target(src: Path, out: Path, *, force: bool) -> Path:
    """OUT_DIR, checked: never a file, never the checkpoint or a folder inside it, never a
    moremoe run or checkpoint (even with --force), and not a non-empty folder unless
    --force; its parent writable. ValueError naming the problem."""
    from ..model.checkpoint import CKPT_DIR, STATE_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT_DIR {out} is a file; give a folder to write into")
    src_r, out_r = src.resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents:
        raise ValueError(f"OUT_DIR {out} is {'the checkpoint' if out_r == src_r else 'inside'} "
                         f"{src}: write the export to a folder of its own")
    if (out / STATE_FILE).exists() or (out / CKPT_DIR).is_dir() or (out / "log.jsonl").exists():
        raise ValueError(f"OUT_DIR {out} holds a moremoe run or checkpoint; it is never "
                         f"written into (not even with --force): choose another folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"OUT_DIR {out} is not empty; pass --force to write into it "
                         f"(config.json and model.safetensors are replaced, other files kept)")
    check_output_dir(out.parent, "OUT_DIR")
    return out


def add_hf_parser(sub) -> None:
    h = sub.add_parser("hf", help="Hugging Face transformers interop")
    hsub = h.add_subparsers(dest="hf_command", metavar="SUBCOMMAND", required=True)
    e = hsub.add_parser("export", help="a checkpoint as a transformers directory",
                        description="Write a moremoe checkpoint as config.json + model.safetensors "
                        "that AutoModelForCausalLM loads after moremoe.hf.register().")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint or run directory")
    e.add_argument("out_dir", metavar="OUT_DIR",
                   help="folder to write: new or empty (or --force); never a moremoe run")
    e.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT_DIR (config.json and model.safetensors "
                        "are replaced)")
    _add_json(e)
    e.set_defaults(func=cmd_hf_export)
