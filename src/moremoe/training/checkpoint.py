"""Writing checkpoints of a pretraining run, and the training state an exact resume needs
(reading them, and which are complete: moremoe.model.checkpoint).

A checkpoint is the directory RUN/checkpoints/step_XXXXXXXX with
  model.safetensors  the model's state_dict (fp32 master weights; no DDP/compile prefixes)
  config.json        {"model": TransformerConfig.to_dict(), "train": RunConfig.to_dict()}
  state.pt           torch.save'd {"step", "tokens", "optimizer" (whole, keyed by parameter
                     name, whatever the ranks held), "scheduler", "data",
                     "rng": one {python, numpy, torch, cuda} per rank, ...}
It is written to a hidden temporary directory and renamed into place; the last ``keep``
complete ones are kept. A save replaces a step directory it did not write rather than
trusting it, and removes the incomplete ones older than itself (superseded, never
resumable). state.pt holds numpy and Python RNG states, so it is loaded with
weights_only=False: load only your own runs' files.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..model.checkpoint import (CKPT_DIR, CONFIG_FILE, MODEL_FILE, STATE_FILE, read_config,
                                read_file, safetensors_torch, checkpoints,
                                incomplete_checkpoints, resolve, step_of)
from ..model.transformer import TransformerConfig
from ..report import with_umask
from .config import RunConfig


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


def _flat_tensors(weights: dict) -> dict:
    """A state_dict on the CPU, contiguous, with no two entries sharing memory."""
    out, seen = {}, set()
    for name, t in weights.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        t = t.to("cpu", copy=key in seen).contiguous()
        seen.add(key)
        out[name] = t
    return out


def save_checkpoint(run_dir: str | Path, step: int, weights: dict, *,
                    model_config: TransformerConfig, run_config: dict, state: dict,
                    keep: int) -> Path:
    """Write checkpoint `step` (weights: the model's whole state_dict) to a temporary
    directory, rename it into place, then drop all but the newest `keep` complete ones. A step directory already there was not written by
    this save (the caller skips a step it saved itself): it is an older run's or an
    incomplete one, and is replaced, never trusted. What a killed save left half-written is
    removed first."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    for partial in root.glob(".step_*"):        # one writer (rank 0): none is in progress
        shutil.rmtree(partial, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    safetensors_torch().save_file(_flat_tensors(weights), str(tmp / MODEL_FILE),
                                  metadata={"format": "pt"})
    with_umask(tmp / MODEL_FILE)             # safetensors >= 0.8 writes 0600
    (tmp / CONFIG_FILE).write_text(json.dumps(
        {"model": model_config.to_dict(), "train": run_config}, indent=2) + "\n")
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    for stale in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for stale, _ in incomplete_checkpoints(run_dir):      # superseded: never resumable
        if step_of(stale) < step:
            shutil.rmtree(stale, ignore_errors=True)
    return final


# what a run writes into its directory (--force removes these and only these)
RUN_FILES = ("log.jsonl", "summary.json", "config.json", "profile.txt", "loss.png")
RUN_DIRS = (CKPT_DIR, "tb")
# what marks a folder as a moremoe run: a log, a summary, checkpoints, an lr grid
_RUN_MARKS = ("log.jsonl", "summary.json", CKPT_DIR, "lr-grid", "lr_grid.json")


def clear_run(out: Path) -> None:
    """--force on a run directory (check_run_dir says it holds a run): remove what the
    earlier run wrote into it (and only that)."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)


def has_steps(run_dir: Path) -> bool:
    """Whether the run's log records work: a step trained, an evaluation, a checkpoint or a
    resume. A log of a run that failed before its first step (its start, and its end with
    the error, a non-finite first step) holds nothing to keep, so a new run may take the
    folder without --force."""
    log = Path(run_dir) / "log.jsonl"
    if not log.is_file():
        return False
    with open(log, "rb") as f:
        for line in f:
            try:
                event = json.loads(line).get("event")
            except (ValueError, AttributeError):
                return True             # not ours to read: keep it
            if event in ("train", "eval", "checkpoint", "resume"):
                return True
    return False


def run_writes(train) -> tuple[str, ...]:
    """The files and folders a run of TrainSpec `train` writes beside its marks (log,
    summary, config, checkpoints): loss.png, and profile.txt and tb when it profiles or logs
    to TensorBoard."""
    return (("loss.png",) + (("profile.txt",) if train.profile_steps else ())
            + (("tb",) if train.tensorboard else ()))


def check_run_dir(out: Path, *, force: bool, writes=("loss.png", "profile.txt", "tb")) -> bool:
    """The run directory of ``moremoe train --out``, before any work: new, empty, or a moremoe
    run. A folder that holds other things is written into only with force (its files are
    kept), and never one whose files the run would replace: a config.json that is not a
    run's (a transformers export, a checkpoint), model weights, or, in a folder that holds no
    run, any of `writes` (the user's, not a run's). ValueError naming --out. Returns whether
    out holds a run: what --force deletes (clear_run); a folder of other files loses nothing."""
    if not out.is_dir() or not any(out.iterdir()):
        return False
    config = out / CONFIG_FILE
    foreign = _foreign_config(config) if config.is_file() else None
    if foreign or (out / MODEL_FILE).exists() or (out / STATE_FILE).exists():
        what = foreign or f"a checkpoint or model weights ({MODEL_FILE} or {STATE_FILE})"
        raise ValueError(f"--out {out} holds {what}, which a run would replace: it is never "
                         f"written into (not even with --force); give another --out")
    if any((out / name).exists() for name in _RUN_MARKS + (CONFIG_FILE,)):
        return True
    mine = [name for name in writes if (out / name).exists()]
    if mine:
        raise ValueError(f"--out {out} holds no moremoe run but holds {', '.join(mine)}, "
                         f"which the run would write over: it is never written into (not "
                         f"even with --force); give another --out, or move "
                         f"{'it' if len(mine) == 1 else 'them'} away")
    if not force:
        first = sorted(p.name for p in out.iterdir())[0]
        raise ValueError(f"--out {out} is not empty (it holds {first}, ...) and holds no "
                         f"moremoe run; give a new or empty folder, or --force to write the "
                         f"run into it (its files are kept)")
    return False


def _foreign_config(path: Path) -> str | None:
    """What a config.json that is not a run's is, or None for a run's."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return "a config.json that is not a run's (not JSON)"
    if isinstance(d, dict) and "train" in d and set(d) <= {"model", "optim", "train",
                                                           "parallel", "preset"}:
        return None if "optim" in d else "a checkpoint's config.json"
    if isinstance(d, dict) and ("model_type" in d or "architectures" in d):
        return (f"a transformers model's config.json (model_type "
                f"{d.get('model_type')!r}, e.g. from `moremoe hf export`)")
    return "a config.json that is not a run's"


def check_resumable(path: Path, cfg, vocab: int, data_vocab: int, model: dict | None = None):
    """The RunConfig that checkpoint `path` was written by, when run config `cfg` (with a
    model of `vocab` tokens, for data of `data_vocab`, whose TransformerConfig is `model`)
    may continue it; else ValueError naming the file."""
    config = read_config(path)
    where = f"{resolve(path)}/{CONFIG_FILE}"
    try:
        saved = RunConfig.from_dict(config["train"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"cannot resume {path}: {where} holds no run config this version "
                         f"reads ({' '.join(str(err).split())[:200]}): the file was edited; "
                         f"restore it, or start a new run with another --out") from None
    changed = saved.differences(cfg)
    if changed:
        raise ValueError(f"cannot resume {path}: the config differs in "
                         f"{'; '.join(changed)} (only budget, logging, device and layout "
                         f"fields may change)")
    if model is not None and _model_keys(config.get("model")) != _model_keys(model):
        raise ValueError(f"cannot resume {path}: {where} describes another model than its run "
                         f"config builds ({_first_difference(config.get('model'), model)}): "
                         f"the file was edited; restore it, or start a new run with another "
                         f"--out")
    if config["model"].get("vocab") != vocab:   # model.vocab: null, from the data
        raise ValueError(f"cannot resume {path}: the run's model has a vocabulary of "
                         f"{config['model'].get('vocab')} (from its data, "
                         f"{saved.train.data}), the data --data {cfg.train.data} has "
                         f"vocab_size {data_vocab}; resume with data of the run's vocabulary, "
                         f"or start a new run with another --out")
    return saved


def load_state(path: str | Path) -> dict:
    return read_file(resolve(path), STATE_FILE,
                 lambda p: torch.load(p, map_location="cpu", weights_only=False))


_IMPLS = ("router_impl", "experts_impl")      # how a layer runs: a resume may change them


def _model_keys(d) -> dict | None:
    """A model config as a resume compares it: not how its layers run, not its vocabulary
    (the data's, checked on its own)."""
    if not isinstance(d, dict) or not isinstance(d.get("moe"), dict):
        return None
    return {**{k: v for k, v in d.items() if k != "vocab"},
            "moe": {k: v for k, v in d["moe"].items() if k not in _IMPLS}}


def _first_difference(saved, built: dict) -> str:
    if not isinstance(saved, dict):
        return "no model section"
    for key in sorted((set(saved) | set(built)) - {"vocab"}):
        a, b = saved.get(key, "missing"), built.get(key, "missing")
        if key == "moe" and isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in _IMPLS and a.get(k, "missing") != b.get(k, "missing"):
                    return f"model.moe.{k}: {a.get(k, 'missing')!r}, the run's {b.get(k)!r}"
        elif a != b:
            return f"model.{key}: {a!r}, the run's {b!r}"
    return "its model section"
