"""Plain-text tables, number formatting, strict and crash-safe JSON files, and checks that an
output can be written, for the CLI and reports."""
from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import sys
from pathlib import Path


def emit(args, obj, text: str) -> None:
    """Print obj as strict JSON when args.json (NaN and ±inf become null), else the text."""
    if args.json:
        sys.stdout.write(dumps(obj, indent=2) + "\n")
    else:
        print(text)


def dumps(obj, **kw) -> str:
    """Strict JSON (RFC 8259): non-finite floats become null, tuples lists, objects with a
    to_dict() their dict; anything else is a TypeError."""
    return json.dumps(strict(obj), allow_nan=False, default=_default, **kw)


def strict(obj):
    """obj with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if hasattr(obj, "to_dict"):
        return strict(obj.to_dict())
    return obj


def human(n: float, digits: int = 3) -> str:
    """1572864 -> '1.57M'; keeps small numbers as they are."""
    if n is None:
        return "-"
    if isinstance(n, float) and n != n:
        return "nan"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.{digits}g}{suffix}"
    return f"{n:.{digits}g}" if isinstance(n, float) else str(n)


def table(rows: list[list], headers: list[str]) -> str:
    """Left-aligned first column, right-aligned others."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + [fmt(r) for r in cells[1:]])


def write_json(path: str | Path, obj) -> Path:
    """Write strict JSON atomically (temporary file + rename), so a crash never leaves a torn
    report; the file gets the permissions the umask gives (readable by the group, usually)."""
    return write_atomic(path, (dumps(obj, indent=2) + "\n").encode())


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write data to path through a temporary file in the same folder and a rename; the file
    is created with mode 0o666 less the umask (tempfile.mkstemp would make it 0o600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def with_umask(path: str | Path) -> Path:
    """Give a file the mode a new file gets, 0o666 less the umask (as write_atomic does), for
    writers that choose their own: safetensors >= 0.8 writes 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
    return Path(path)


def save_figure(fig, path: str | Path, *, dpi: int = 110) -> Path:
    """Lay out a matplotlib figure, write it as PNG atomically (write_atomic) and close it."""
    import io
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return write_atomic(path, buf.getvalue())


def check_output_dir(path: str | Path, flag: str) -> Path:
    """Prove a file can be written in the folder an output goes to (a read-only folder or
    file system, a path under a file, a full disk), before any work starts: the folders it
    had to create for that are removed again. ValueError naming the flag and the folder."""
    path = Path(path)
    made = [p for p in (path, *path.parents) if not p.exists()]   # removed again after
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".moremoe-write-test.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({_why(err)}); choose a folder "
                         f"you can write to") from err
    finally:      # a command that fails later leaves no empty folders behind
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
    return path


def check_output_file(path: str | Path, flag: str) -> Path:
    """An output file's folder is writable and the path is not a folder (check_output_dir)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    check_output_dir(path.parent, flag)
    return path


def check_new_output(path: str | Path, flag: str, force: bool, *, names=None,
                     folder: bool = False) -> Path:
    """The one check of every writer that must not replace what a user has without --force,
    called before any work: the file path (by default), the files `names` a command writes
    into the folder path, or (folder=True) a folder that holds anything. What exists is
    refused unless force; then the output is probed (check_output_file / check_output_dir).
    ValueError naming the flag and what is there."""
    path = Path(path)
    if names is not None or folder:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{flag} {path} is a file; give a folder to write into")
        found = [n for n in names if (path / n).exists()] if names is not None else []
        if found and not force:
            raise ValueError(f"{flag} {path} already holds {', '.join(found)} from an "
                             f"earlier run; give another folder or --force to replace "
                             f"{'it' if len(found) == 1 else 'them'}")
        if folder and path.is_dir() and any(path.iterdir()) and not force:
            raise ValueError(f"{flag} {path} is not empty; give a new folder or --force to "
                             f"write into it")
        return check_output_dir(path, flag)
    if path.exists() and not path.is_dir() and not force:
        raise ValueError(f"{flag} {path} exists; give another name or --force to replace it")
    return check_output_file(path, flag)


def check_apart(path: str | Path, flag: str, inputs, advice: str) -> None:
    """ValueError when an output is one of a command's inputs or lies inside one, --force or
    not: no command writes over what it reads. inputs: (label, path) pairs such as ("MODEL",
    "runs/a"), None paths skipped; advice: what to do instead."""
    out = Path(path).resolve()
    for label, src in inputs:
        if src is None:
            continue
        src_r = Path(src).resolve()
        if out == src_r:
            raise ValueError(f"{flag} {path} is {label}: {advice}")
        if src_r in out.parents:
            raise ValueError(f"{flag} {path} is inside {label} {src}: {advice}")


def _why(err: OSError) -> str:
    if isinstance(err, (NotADirectoryError, FileExistsError)):
        return "a part of the path is a file, not a folder"
    return err.strerror or str(err)


def _default(o):
    if isinstance(o, (tuple, set)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"cannot write {type(o).__name__} as JSON")
