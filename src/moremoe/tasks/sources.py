"""The inputs of ``moremoe data prepare``: finding them, cutting them into shards, reading
their documents, and encoding a document.

A .txt file is one document; a .jsonl / .jsonl.gz line is one document (its text field); a
folder written by ``datasets``' ``save_to_disk`` is one document per row (``datasets`` is
imported only for such a folder). A shard is a list of (source index, start, end) parts: byte
ranges of a .jsonl cut at line starts, row ranges of a dataset, (0, size) for a whole .txt or
.jsonl.gz. The plan depends on the inputs only, never on the worker count.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .file_faults import GZIP_ERRORS, line_number
from .text import DTYPE

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")
_PIECE_CHARS = 1 << 20      # longer documents are encoded in pieces, to bound the id lists
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")  # GPT-2's pre-tokenizer always splits here
_ROWS_PER_READ = 1024       # rows per dataset read


@dataclass(frozen=True)
class Source:
    path: str
    kind: str       # "txt", "jsonl", "jsonl.gz" or "datasets"
    size: int       # bytes; rows for a dataset
    stamp: str      # mtime in ns for a file, the fingerprint for a dataset


# ---------------------------------------------------------------- discover and plan

def discover_sources(inputs) -> list[Source]:
    """Files, folders (searched recursively for SUFFIXES) and globs -> sources, in argument
    order, each folder's and glob's files sorted, duplicates dropped."""
    seen, sources = set(), []
    for arg in inputs:
        for path in _expand(str(arg)):
            path = path.resolve()
            if path not in seen:
                seen.add(path)
                sources.append(_source(path))
    return sources


def _expand(arg: str) -> list[Path]:
    path = Path(arg).expanduser()
    if path.is_dir() and not _is_dataset(path):
        files = sorted(f for f in path.rglob("*") if f.is_file() and _kind(f) and
                       not any(p.startswith(".") for p in f.relative_to(path).parts))
        if not files:
            raise ValueError(f"input folder {arg} holds no {', '.join(SUFFIXES)} files")
        return files
    if path.exists():
        return [path]
    if any(c in arg for c in "*?["):
        import glob
        matches = sorted(glob.glob(os.path.expanduser(arg), recursive=True))
        if not matches:
            raise ValueError(f"input pattern {arg!r} matches nothing")
        return [p for m in matches for p in _expand(m)]
    raise ValueError(f"input {arg} does not exist")


def _kind(path: Path) -> str | None:
    return next((s[1:] for s in reversed(SUFFIXES) if path.name.endswith(s)), None)


def _is_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _source(path: Path) -> Source:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            raise ValueError(f"input {path} is a DatasetDict with splits {splits}; give one "
                             f"split's folder, e.g. {path / splits[0]}")
        stamp = json.loads((path / "state.json").read_text()).get("_fingerprint", "")
        return Source(str(path), "datasets", len(_dataset(str(path))), stamp)
    kind = _kind(path)
    if kind is None:
        raise ValueError(f"input {path}: unsupported file type; expected {', '.join(SUFFIXES)}"
                         f" or a folder written by datasets' save_to_disk")
    stat = path.stat()
    return Source(str(path), kind, stat.st_size, str(stat.st_mtime_ns))


@lru_cache(maxsize=8)
def _dataset(path: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading the saved dataset {path} needs the datasets package: "
                          f"pip install datasets") from None
    try:
        return datasets.load_from_disk(path)
    except Exception as err:      # noqa: BLE001 - pyarrow's ArrowInvalid, OSError and others
        raise _unreadable_dataset(path, err) from err


def _unreadable_dataset(path: str, err: Exception) -> ValueError:
    return ValueError(f"dataset {path}: cannot read it ({type(err).__name__}: "
                      f"{' '.join(str(err).split())[:200]}); the folder is corrupt or "
                      f"truncated: write it again with save_to_disk")


def check_text_field(sources: list[Source], text_field: str) -> None:
    """Fail before any work when a dataset or the first JSON line lacks the text field."""
    for src in sources:
        if src.kind == "datasets":
            columns = _dataset(src.path).column_names
            if text_field not in columns:
                raise ValueError(f"dataset {src.path} has no column {text_field!r} (columns: "
                                 f"{', '.join(columns)}); choose one with --text-field")
        elif src.kind == "jsonl" and src.size:
            next(iter(_jsonl_documents(src.path, 0, 1, text_field)), None)


def plan_shards(sources: list[Source], shard_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Sources -> shards, each a list of (source index, start, end) parts: byte ranges of a
    .jsonl, row ranges of a dataset, (0, size) for a whole .txt or .jsonl.gz."""
    shards, current, weight = [], [], 0
    for i, src in enumerate(sources):
        for start, end, w in _pieces(src, shard_bytes):
            current.append((i, start, end))
            weight += w
            if weight >= shard_bytes:
                shards.append(current)
                current, weight = [], 0
    return shards + ([current] if current else [])


def _pieces(src: Source, shard_bytes: int) -> list[tuple[int, int, int]]:
    if src.kind == "jsonl":
        cuts = [0]
        with open(src.path, "rb") as f:
            for b in range(shard_bytes, src.size, shard_bytes):
                if b > cuts[-1]:
                    f.seek(b - 1)       # a line that starts exactly at b starts the next piece
                    f.readline()
                    cuts.append(f.tell())
        cuts = sorted(set(c for c in cuts if c < src.size)) + [src.size]
        return [(a, b, b - a) for a, b in zip(cuts, cuts[1:])]
    if src.kind == "datasets":
        row_bytes = max(1, _dataset(src.path).data.nbytes // max(1, src.size))
        rows = max(1, shard_bytes // row_bytes)
        return [(a, min(a + rows, src.size), (min(a + rows, src.size) - a) * row_bytes)
                for a in range(0, src.size, rows)]
    return [(0, src.size, src.size)]    # gzip cannot seek: a .jsonl.gz is read whole


# ---------------------------------------------------------------- documents and encoding

def documents(src: Source, start: int, end: int, text_field: str):
    """The documents of one part of a source, as strings."""
    if src.kind == "txt":
        yield _decode(Path(src.path).read_bytes(), src.path)
    elif src.kind == "jsonl":
        yield from _jsonl_documents(src.path, start, end, text_field)
    elif src.kind == "jsonl.gz":
        n = 0
        try:
            with gzip.open(src.path, "rb") as f:
                for n, line in enumerate(f, 1):
                    yield _json_text(line, text_field)
        except _BadLine as err:
            raise ValueError(f"{src.path}, line {n:,}: {err}") from None
        except GZIP_ERRORS as err:
            raise ValueError(f"{src.path}: corrupt or truncated gzip file ({err}); compress "
                             f"or download it again") from None
    else:
        ds = _dataset(src.path)
        for a in range(start, end, _ROWS_PER_READ):
            try:
                texts = ds[a:min(a + _ROWS_PER_READ, end)][text_field]
            except (OSError, ValueError) as err:        # pyarrow's on a damaged .arrow file
                raise _unreadable_dataset(src.path, err) from err
            for n, text in enumerate(texts, a):
                if not isinstance(text, str):
                    raise ValueError(f"dataset {src.path}, row {n}: {text_field!r} is "
                                     f"{type(text).__name__}, expected a string")
                yield text


def _jsonl_documents(path: str, start: int, end: int, text_field: str):
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < end and (line := f.readline()):
            try:
                yield _json_text(line, text_field)
            except _BadLine as err:   # the line's number only now: counting costs a read
                raise ValueError(f"{path}, line {line_number(path, pos):,} (byte {pos:,}): "
                                 f"{err}") from None
            pos += len(line)


class _BadLine(ValueError):
    """A JSON line that cannot be read; the caller adds where it is."""


def _json_text(line: bytes, text_field: str) -> str:
    if not line.strip():
        return ""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _BadLine(f"not UTF-8 at byte {err.start} of the line") from None
    except json.JSONDecodeError as err:
        raise _BadLine(f"not a JSON line ({err}); the line is cut short or the file is "
                       f"corrupt") from None
    if not isinstance(obj, dict) or text_field not in obj:
        keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
        raise _BadLine(f"no field {text_field!r} (has: {keys}); choose the text field with "
                       f"--text-field")
    if not isinstance(obj[text_field], str):
        raise _BadLine(f"{text_field!r} is {type(obj[text_field]).__name__}, expected a "
                       f"string")
    return obj[text_field]


def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 at byte {err.start} of the file") from None


def encode(enc, text: str, *, piece_chars: int = _PIECE_CHARS) -> np.ndarray:
    """``enc.encode_ordinary(text)`` as uint16; long texts are encoded in pieces cut at a
    newline between two non-space characters, where GPT-2's pre-tokenizer always splits, so
    the ids are the same as in one call."""
    out, start = [], 0
    while len(text) - start > piece_chars:
        cut = _SAFE_CUT.search(text, start + piece_chars)
        if cut is None:
            break
        out.append(np.array(enc.encode_ordinary(text[start:cut.end()]), dtype=DTYPE))
        start = cut.end()
    out.append(np.array(enc.encode_ordinary(text[start:]), dtype=DTYPE))
    return np.concatenate(out)
