"""What is wrong with a local data file that a reader failed on: empty, a truncated or corrupt
gzip stream, a line that is not a JSON object (with its number), a parquet file that pyarrow
cannot read. ``datasets`` and pyarrow report such files by a row or block index, or not at
all, so the file is read again here, line by line, only after a read failed: a healthy file
is never scanned twice.
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

GZIP_ERRORS = (OSError, EOFError, zlib.error)    # BadGzipFile is an OSError


def file_fault(path: str | Path) -> str | None:
    """What makes the file unreadable, as a phrase ("line 12 is not JSON (...)"), or None when
    nothing is found."""
    path = Path(path)
    if path.stat().st_size == 0:
        return "the file is empty"
    if path.name.endswith(".parquet"):
        return _parquet_fault(path)
    if path.name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return _json_fault(path)
    return None


def _parquet_fault(path: Path) -> str | None:
    try:
        import pyarrow.parquet as pq
        for _ in pq.ParquetFile(path).iter_batches():
            pass
    except ImportError:
        return None
    except Exception as err:      # noqa: BLE001 - pyarrow's OSError, ArrowInvalid and others
        return f"not a readable parquet file ({_short(err)}): it is corrupt or truncated"
    return None


def _json_fault(path: Path) -> str | None:
    gz = path.name.endswith(".gz")
    n = 0
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            if path.name.endswith((".json", ".json.gz")):
                return _json_document_fault(f.read())
            rows = 0
            for n, line in enumerate(f, 1):
                why = _line_fault(line)
                if why:
                    return f"line {n} {why}"
                rows += bool(line.strip())
    except GZIP_ERRORS as err:
        if not gz:
            return f"cannot be read ({_short(err)})"
        return f"corrupt or truncated gzip file{f', after line {n:,}' if n else ''} " \
               f"({_short(err)})"
    return None if rows else "holds no JSON lines (only blank lines)"


def _json_document_fault(data: bytes) -> str | None:
    """A .json file: one JSON document (a list of objects) or JSON lines."""
    try:
        json.loads(data)
        return None
    except ValueError as err:
        if data.lstrip()[:1] == b"[":
            return (f"not JSON at line {getattr(err, 'lineno', '?')} ({_short(err)}): the "
                    f"file is corrupt or truncated")
    for n, line in enumerate(data.splitlines(), 1):
        why = _line_fault(line)
        if why:
            return f"line {n} {why}"
    return None


def _line_fault(line: bytes) -> str | None:
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as err:
        return f"is not UTF-8 (byte {err.start} of the line): the file is corrupt"
    except ValueError as err:
        return f"is not JSON ({_short(err)}): the line is cut short or the file is corrupt"
    if not isinstance(obj, dict):
        return f"holds a JSON {type(obj).__name__}, not an object (one row per line)"
    return None


def line_number(path: str | Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset`` of a file."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def _short(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__
