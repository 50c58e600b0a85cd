"""The files a phonebook command keeps in its --out folder while it works: the journal of
finished runs (trials.jsonl, one {"key", "record"} object a line, appended as each run ends)
and the checkpoints of running ones (trial_checkpoints/<key>.pt, written atomically).

Reading them back on --resume is where damage shows. A kill during an append leaves the
journal's last line cut short: that line is dropped with a warning (its run trains again)
and cut off the file before the next append. Any other bad line, or a checkpoint that is
empty or truncated (a full disk, a partial copy), is one ValueError naming the file and what
to do, never a traceback from the JSON or zip reader.
"""
from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import torch

from ..report import dumps

JOURNAL, CHECKPOINTS = "trials.jsonl", "trial_checkpoints"  # not a run's checkpoints/


def read_journal(path: Path) -> tuple[dict, int | None]:
    """({key: record} of the journal at path, the byte offset its cut-short last line starts
    at, or None when every line is whole). ValueError naming the file and the line for any
    other line that is not JSON or not a journal record."""
    done: dict = {}
    if not path.exists():
        return done, None
    lines = path.read_bytes().splitlines(keepends=True)
    last = max((n for n, raw in enumerate(lines, 1) if raw.strip()), default=0)
    at = 0
    for n, raw in enumerate(lines, 1):
        start, at = at, at + len(raw)
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as err:       # JSONDecodeError, or bytes that are not UTF-8
            if n == last:
                print(f"warning: {path}, line {n} is cut short (the command was stopped while "
                      f"writing it): it is dropped and its run trains again", file=sys.stderr)
                return done, start
            raise _damaged(path, n, f"not JSON ({_why(err)})") from None
        if not (isinstance(row, dict) and isinstance(row.get("key"), str)
                and isinstance(row.get("record"), dict)):
            raise _damaged(path, n, 'not a journal record (an object with "key" and "record")')
        problem = record_problem(row["record"])
        if problem:
            raise _damaged(path, n, f"its record {problem} (edited, or not a record of "
                                    f"this version)")
        done[row["key"]] = row["record"]
    return done, None


_NUMBER = (int, float)
# what the commands read of a finished run's record (PhonebookRun.to_dict), and of each of
# its evaluations; a loss is null where it was not finite
RECORD = {"name": str, "model": dict, "train": dict, "lr": _NUMBER, "params_total": int,
          "flops_inference": int, "history": list, "reached": bool, "steps": int,
          "exact_match": _NUMBER, "char_accuracy": _NUMBER, "hnorm": list}
EVALUATION = {"step": int, "loss": (*_NUMBER, type(None)), "exact_match": _NUMBER}


def record_problem(record: dict, *, fields=RECORD) -> str | None:
    """What is missing or of the wrong type in a run's record (None when it reads)."""
    for key, types in fields.items():
        if key not in record:
            return f"lacks {key!r}"
        v = record[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in
                                        (types if isinstance(types, tuple) else (types,))):
            return f"has {key!r} = {json.dumps(v)[:40]}, not {_type_names(types)}"
    if fields is RECORD:
        if not isinstance(record["model"].get("moe"), dict):
            return "lacks model.moe"
        for i, ev in enumerate(record["history"]):
            problem = record_problem(ev, fields=EVALUATION) if isinstance(ev, dict) else \
                "is not an object"
            if problem:
                return f"history[{i}] {problem}"
    return None


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false",
             list: "a list", dict: "an object", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _why(err: ValueError) -> str:
    """JSON's complaint at its column of the line (its own "line 1" would mislead)."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} column {err.colno}"
    return str(err).splitlines()[0]


def _damaged(path: Path, line: int, what: str) -> ValueError:
    return ValueError(f"{path}, line {line}: {what}; restore the journal from a copy, or "
                      f"delete that line (its run trains again)")


def append_journal(path: Path, key: str, record: dict, cut: int | None = None) -> None:
    """Append one finished run, synced to the disk (a resume trusts every whole line); cut:
    the offset of a cut-short last line (read_journal), removed first so that the new line
    starts a line of its own."""
    if cut is not None:
        os.truncate(path, cut)
    with open(path, "a") as f:
        f.write(dumps({"key": key, "record": record}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def checkpoint_problem(path: Path) -> str | None:
    """What makes a trial checkpoint unreadable, from its size and zip directory alone (no
    tensor is read): torch.save writes a zip archive whose directory is at its end, so a
    truncated file has none. None when it looks whole."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return f"is truncated or not a torch.save file ({size:,} bytes)"
    return None if any(n.endswith("data.pkl") for n in names) else "holds no saved object"


def _unreadable(path: Path, why: str) -> ValueError:
    return ValueError(f"trial checkpoint {path} {why}; delete it to run that trial again from "
                      f"its start")


def check_checkpoints(folder: Path) -> None:
    """Every checkpoint in folder looks whole (checkpoint_problem): checked before any work,
    so that a damaged one stops the command before it trains, not hours into a search."""
    if folder.is_dir():
        for path in sorted(folder.glob("*.pt")):
            why = checkpoint_problem(path)
            if why:
                raise _unreadable(path, why)


STEP_STATE = {"model": dict, "optimizer": dict, "order": dict, "buffers": (list, tuple),
              "steps": int}


def load_checkpoint(path: Path) -> dict:
    """The state a stopped run continues from; ValueError naming the file when it cannot be
    read or does not hold a trial's state (a run's record and its step's state)."""
    why = checkpoint_problem(path)
    if why is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - bad bytes fail in their own way: EOFError,
            # the zip reader's RuntimeError, pickle's UnpicklingError, a missing class
            text = str(err).splitlines()[0] if str(err) else ""
            why = f"cannot be read ({type(err).__name__}: {text})"
        else:
            why = _state_problem(state)
            if why is None:
                return state
    raise _unreadable(path, why)


def _state_problem(state) -> str | None:
    if not (isinstance(state, dict) and isinstance(state.get("step"), dict)
            and isinstance(state.get("run"), dict)):
        return 'holds no trial state (an object with "step" and "run")'
    problem = (record_problem(state["step"], fields=STEP_STATE)
               or record_problem(state["run"], fields={k: RECORD[k] for k in (
                   "name", "model", "train", "lr", "history", "steps")}))
    return f"holds a trial state that {problem} (edited, or not of this version)" \
        if problem else None


def unusable(path: Path, err: Exception) -> ValueError:
    """A checkpoint whose state a run cannot take (its shapes are another model's)."""
    text = " ".join(str(err).split())[:200]
    return _unreadable(path, f"does not fit this trial ({type(err).__name__}: {text})")
