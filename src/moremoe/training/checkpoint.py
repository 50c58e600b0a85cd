"""Checkpoints of a pretraining run: weights, config and everything an exact resume needs.

A checkpoint is the directory RUN/checkpoints/step_XXXXXXXX with
  model.safetensors  the model's state_dict (fp32 master weights; no DDP/compile prefixes)
  config.json        {"model": TransformerConfig.to_dict(), "train": RunConfig.to_dict()}
  state.pt           torch.save'd {"step", "tokens", "optimizer", "scheduler", "data",
                     "rng": one {python, numpy, torch, cuda} per rank, ...}
It is written to a hidden temporary directory and renamed into place, so a checkpoint
directory that exists is complete; the last ``keep`` are kept. state.pt holds numpy and
Python RNG states, so it is loaded with weights_only=False: load only your own runs' files.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ..model import Transformer, TransformerConfig

CKPT_DIR = "checkpoints"
MODEL_FILE, CONFIG_FILE, STATE_FILE = "model.safetensors", "config.json", "state.pt"
_NAME = re.compile(r"^step_(\d{8,})$")


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError("checkpoints need safetensors: pip install 'moremoe[text]'") from None
    return st


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _flat_tensors(model: torch.nn.Module) -> dict:
    """state_dict on the CPU, contiguous, with no two entries sharing memory."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        t = t.to("cpu", copy=key in seen).contiguous()
        seen.add(key)
        out[name] = t
    return out


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()
             and all((p / f).is_file() for f in (MODEL_FILE, CONFIG_FILE, STATE_FILE))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, *,
                    model_config: TransformerConfig, run_config: dict, state: dict,
                    keep: int) -> Path:
    """Write checkpoint `step` atomically, then drop all but the newest `keep`. A step that is
    already saved (a stop right after a periodic save) is the same state and is kept as it
    is; what a killed save left half-written is removed first."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    if final.exists():
        return final
    for partial in root.glob(".step_*"):        # one writer (rank 0): none is in progress
        shutil.rmtree(partial, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    _safetensors().save_file(_flat_tensors(model), str(tmp / MODEL_FILE),
                             metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(
        {"model": model_config.to_dict(), "train": run_config}, indent=2) + "\n")
    torch.save(state, tmp / STATE_FILE)
    os.replace(tmp, final)
    for stale in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory as given, or a run directory's latest checkpoint."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{str(path)!r} is neither a checkpoint directory (with "
                                f"{MODEL_FILE}) nor a run directory with checkpoints")
    return latest


def read_config(path: str | Path) -> dict:
    return json.loads((resolve(path) / CONFIG_FILE).read_text())


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    ckpt = resolve(path)
    tensors = _safetensors().load_file(str(ckpt / MODEL_FILE),
                                       device=str(next(model.parameters()).device))
    model.load_state_dict(tensors, strict=True)


def load_model(path: str | Path, *, device="cpu") -> Transformer:
    """The Transformer of a checkpoint directory or of a run directory's latest checkpoint."""
    ckpt = resolve(path)
    cfg = TransformerConfig.from_dict(read_config(ckpt)["model"])
    model = Transformer(cfg).to(device)
    load_weights(model, ckpt)
    return model


def load_state(path: str | Path) -> dict:
    return torch.load(resolve(path) / STATE_FILE, map_location="cpu", weights_only=False)
