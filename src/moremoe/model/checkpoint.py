"""Reading checkpoints: a checkpoint directory, or the newest complete one of a run directory,
as a Transformer (``load_model``), its config and weights, and which checkpoints of a run are
complete.

A checkpoint is the directory RUN/checkpoints/step_XXXXXXXX with
  model.safetensors  the model's state_dict (fp32 master weights; no DDP/compile prefixes)
  config.json        {"model": TransformerConfig.to_dict(), "train": the run's config}
  state.pt           the training state an exact resume needs (moremoe.training.checkpoint
                     writes and reads it)
A step directory can be incomplete (copied in part, a disk that filled, a file truncated or
deleted by hand): ``problems`` checks each file's structure (the safetensors header against
the file's size, state.pt's zip directory, config.json's keys) without reading the tensors,
``checkpoints`` lists the complete ones and ``incomplete_checkpoints`` the others with what
is wrong. Every failure to read a file is a ValueError that names it and, where the run has
one, the previous complete checkpoint.
"""
from __future__ import annotations

import json
import re
import struct
import zipfile
from pathlib import Path

import torch

from .transformer import Transformer, TransformerConfig

CKPT_DIR = "checkpoints"
MODEL_FILE, CONFIG_FILE, STATE_FILE = "model.safetensors", "config.json", "state.pt"
_NAME = re.compile(r"^step_(\d{8,})$")


def safetensors_torch():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError("checkpoints need safetensors: pip install 'moremoe[text]'") from None
    return st


def problems(ckpt: str | Path, *, weights_only: bool = False) -> list[str]:
    """What makes a checkpoint directory incomplete ([] when it is complete): a file missing,
    or one whose structure does not hold (truncated, or not what it should be).
    weights_only: only what loading the model needs (model.safetensors, config.json)."""
    ckpt, out = Path(ckpt), []
    checks = ((MODEL_FILE, _safetensors_ok), (CONFIG_FILE, _config_ok), (STATE_FILE, _state_ok))
    for name, check in checks[:2] if weights_only else checks:
        path = ckpt / name
        if not path.is_file():
            out.append(f"{name} is missing")
            continue
        try:
            why = check(path)
        except (OSError, ValueError, LookupError, TypeError) as err:   # any bytes at all
            why = f"cannot be read ({err})"
        if why:
            out.append(f"{name} {why}")
    return out


def safetensors_problem(path: str | Path) -> str | None:
    """What is wrong with a .safetensors file's structure (truncated, a header that is not
    one), as a phrase, or None; the tensors themselves are not read."""
    try:
        return _safetensors_ok(Path(path))
    except (OSError, ValueError, LookupError, TypeError) as err:   # any bytes at all
        return f"cannot be read ({err})"


def _safetensors_ok(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes)"
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            return f"is truncated ({size:,} bytes, its header alone needs {n + 8:,})"
        header = json.loads(f.read(n))
    if not isinstance(header, dict) or not all(isinstance(t, dict) for t in header.values()):
        return "holds no safetensors header"
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end != size:
        return f"has {size:,} bytes, its header describes {8 + n + end:,} (truncated)"
    return None


def _config_ok(path: Path) -> str | None:
    d = json.loads(path.read_text())
    if not isinstance(d, dict) or not {"model", "train"} <= d.keys():
        return "lacks the sections model and train"
    return None


def holds_moremoe_run(path: str | Path) -> str | None:
    """What of a moremoe run or checkpoint `path` holds ("a run", "a checkpoint"), or None:
    the folders no command writes into, not even with --force. A checkpoint is any folder
    whose config.json has the sections model and train (a weights-only one included: the
    kind `generate` and `hf export` read)."""
    path = Path(path)
    if (path / "log.jsonl").exists() or _step_dirs(path):
        return "a run"
    if (path / STATE_FILE).exists() or _NAME.match(path.name) and path.is_dir() and \
            any(path.iterdir()):
        return "a checkpoint"
    try:
        if _config_ok(path / CONFIG_FILE) is None:
            return "a checkpoint"
    except (OSError, ValueError):
        pass
    return None


def check_not_a_run(path: str | Path, flag: str) -> None:
    """ValueError when an output folder holds a moremoe run or checkpoint: no command writes
    into one, --force or not (it would replace or delete what training made)."""
    held = holds_moremoe_run(path)
    if held:
        raise ValueError(f"{flag} {path} holds {held} of moremoe; it is never written into "
                         f"(not even with --force): choose another folder")


def _state_ok(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile:
        return f"is truncated or not a torch.save archive ({path.stat().st_size:,} bytes)"
    return None if any(n.endswith("data.pkl") for n in names) else "holds no saved object"


def _step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := _NAME.match(p.name)) and p.is_dir())


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return [p for _, p in _step_dirs(run_dir) if not problems(p)]


def incomplete_checkpoints(run_dir: str | Path) -> list[tuple[Path, list[str]]]:
    """(step directory, what is wrong) of every incomplete checkpoint of a run, oldest first."""
    return [(p, why) for _, p in _step_dirs(run_dir) if (why := problems(p))]


def step_of(ckpt: Path) -> int | None:
    """The step of a step_N checkpoint directory; None for a folder named otherwise."""
    m = _NAME.match(Path(ckpt).name)
    return int(m.group(1)) if m else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def describe_incomplete(found: list[tuple[Path, list[str]]]) -> str:
    return "; ".join(f"{p} ({', '.join(why)})" for p, why in found)


def resolve(path: str | Path, *, weights_only: bool = False) -> Path:
    """A complete checkpoint directory as given, or a run directory's latest complete one
    (choose)."""
    return choose(path, weights_only=weights_only)[0]


def choose(path: str | Path, *, weights_only: bool = False
           ) -> tuple[Path, list[tuple[Path, list[str]]]]:
    """(checkpoint, passed over): a complete checkpoint directory as given, or a run
    directory's latest complete one, with the incomplete checkpoints newer than it (and what
    is wrong with each) that were passed over. weights_only: complete means the model files
    (model.safetensors, config.json) are. FileNotFoundError when there is none; ValueError
    naming the problem when the checkpoint given is incomplete."""
    path = Path(path)
    if _NAME.match(path.name) and path.is_dir() or (path / MODEL_FILE).is_file():
        why = problems(path, weights_only=weights_only)
        if why:
            raise ValueError(f"checkpoint {path} is incomplete: {', '.join(why)}"
                             f"{_previous_hint(path)}")
        return path, []
    found = [(p, problems(p, weights_only=weights_only)) for _, p in _step_dirs(path)]
    complete = [p for p, why in found if not why]
    if not complete:
        broken = [(p, why) for p, why in found if why]
        if broken:
            raise FileNotFoundError(f"{path} has no complete checkpoint; incomplete: "
                                    f"{describe_incomplete(broken)}")
        raise FileNotFoundError(f"{str(path)!r} is neither a checkpoint directory (with "
                                f"{MODEL_FILE}) nor a run directory with checkpoints")
    latest = complete[-1]
    return latest, [(p, why) for p, why in found if why and step_of(p) > step_of(latest)]


def _previous_hint(ckpt: Path) -> str:
    """'; the previous complete checkpoint is ...' when the run holds one before ckpt."""
    if ckpt.parent.name != CKPT_DIR or not _NAME.match(ckpt.name):
        return ""
    before = [p for p in checkpoints(ckpt.parent.parent) if step_of(p) < step_of(ckpt)]
    if not before:
        return ""
    return (f"; the previous complete checkpoint is {before[-1]} (move {ckpt.name} out of "
            f"{ckpt.parent} and --resume continues from it)")


def read_file(ckpt: Path, name: str, load):
    """load() of one file of a checkpoint; any failure is a ValueError naming the file."""
    try:
        return load(ckpt / name)
    except Exception as err:      # noqa: BLE001 - every reader fails its own way on bad bytes
        raise ValueError(f"{ckpt / name} cannot be read ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}): the file is "
                         f"corrupt{_previous_hint(ckpt)}") from err


def read_config(path: str | Path) -> dict:
    return read_file(resolve(path, weights_only=True), CONFIG_FILE,
                 lambda p: json.loads(p.read_text()))


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    ckpt = resolve(path, weights_only=True)
    device = str(next(model.parameters()).device)
    tensors = read_file(ckpt, MODEL_FILE, lambda p: safetensors_torch().load_file(str(p), device=device))
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{ckpt / MODEL_FILE} does not fit the model of {ckpt / CONFIG_FILE}: "
                         f"{str(err).splitlines()[0]}") from err


def load_model(path: str | Path, *, device="cpu") -> Transformer:
    """The Transformer of a checkpoint directory or of a run directory's latest checkpoint."""
    ckpt = resolve(path, weights_only=True)
    config = read_config(ckpt)
    try:
        cfg = TransformerConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{ckpt / CONFIG_FILE} holds no valid model config: {err}") from err
    model = Transformer(cfg).to(device)
    load_weights(model, ckpt)
    return model
