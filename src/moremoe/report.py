"""Plain-text tables, number formatting and crash-safe JSON files for the CLI and reports."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def emit(args, obj, text: str) -> None:
    """Print obj as JSON when args.json, else the human-readable text."""
    if args.json:
        json.dump(obj, sys.stdout, indent=2, default=_default)
        sys.stdout.write("\n")
    else:
        print(text)


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
    """Write atomically (temp file + rename) so a crash never leaves a torn report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _default(o):
    if isinstance(o, tuple):
        return list(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    raise TypeError(f"cannot write {type(o).__name__} as JSON")
