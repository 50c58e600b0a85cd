"""Prepared text for language-model pretraining: the on-disk format and its reader.

A prepared directory (written by ``moremoe data prepare``, see tasks/prepare.py) holds

    train.bin, val.bin   raw little-endian uint16, row-major (n_sequences, seq_len): GPT-2
                         token ids, documents joined by <|endoftext|> (50256)
    meta.json            {"format": "moremoe-tokens", "version": 1, "tokenizer": "gpt2",
                          "vocab_size": 50257, "eot_id": 50256, "seq_len", "dtype": "uint16",
                          "train_sequences", "val_sequences", "seed", "sources", "documents",
                          "tokens", "sha256": {"train.bin", "val.bin"}, ...}

``tokens`` counts every token of the stream (end-of-text included); the last
``dropped_tokens`` of it, short of one sequence, are in neither split. ``meta.json`` is written
last, so a directory without it is not (yet) prepared data.

``open_tokens`` always checks each file's size against meta.json (a truncated file is an
error, never a shorter array); ``verify=True`` also recomputes the sha256 and checks every id
is below vocab_size.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FORMAT, VERSION = "moremoe-tokens", 1
SPLITS = ("train", "val")
DTYPE = np.dtype("<u2")
_REQUIRED = ("tokenizer", "vocab_size", "eot_id", "seq_len", "dtype", "train_sequences",
             "val_sequences", "sha256")
_COUNTS = (("vocab_size", 1), ("eot_id", 0), ("seq_len", 2), ("train_sequences", 0),
           ("val_sequences", 0), ("tokens", 0), ("dropped_tokens", 0))   # (key, least value)
_BLOCK_TOKENS = 1 << 24     # 32 MiB of tokens per read when hashing and range-checking


def check_replace(out: str | Path, force: bool) -> None:
    """Before `data prepare` or `data mixture` writes into out: prepared data (meta.json), or
    files of the names they write without one (another tool's, or an output whose --force
    rerun was stopped), are replaced only with force. ValueError naming them."""
    out = Path(out)
    if force:
        return
    if (out / "meta.json").exists():
        raise ValueError(f"{out} already holds prepared data ({out / 'meta.json'}); pass "
                         f"--force to replace it")
    held = [n for n in [f"{s}.bin" for s in SPLITS] + ["mixture.json"] if (out / n).exists()]
    if held:
        raise ValueError(f"{out} holds {', '.join(held)} but no meta.json (not a finished "
                         f"prepared folder); pass --force to replace what is there, or give "
                         f"another --out")


def read_meta(dir: str | Path) -> dict:
    """meta.json of a prepared directory; ValueError if it is missing or not this format."""
    path = Path(dir) / "meta.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: {dir} is not a prepared data directory, or its "
                         f"preparation has not finished (run `moremoe data prepare ... --out "
                         f"{dir}` again to resume it)")
    try:
        meta = json.loads(path.read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}): the file is corrupt; "
                         f"prepare the data again (--force)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): the file is corrupt") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT!r} metadata file")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path} has format version {meta.get('version')!r}; this moremoe "
                         f"reads version {VERSION}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks the keys {', '.join(missing)}: the file is corrupt")
    if meta["dtype"] != "uint16":
        raise ValueError(f"{path} has dtype {meta['dtype']!r}, expected 'uint16'")
    for key, low in _COUNTS:
        v = meta.get(key, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{path}: {key} must be an integer >= {low}, got {v!r}: the file "
                             f"is corrupt")
    sha = meta["sha256"]
    if not isinstance(sha, dict) or not all(isinstance(v, str) for v in sha.values()):
        raise ValueError(f"{path}: sha256 must map file names to hex digests, got {sha!r}")
    return meta


def data_fingerprint(meta: dict) -> str:
    """A prepared folder's identity, from its meta.json alone (no file is read): the first 16
    hex digits of the sha256 of its seq_len and its two token files' sha256. Two folders
    with equal fingerprints hold the same sequences in the same splits."""
    sha = meta["sha256"]
    text = json.dumps([meta["seq_len"], sha.get("train.bin"), sha.get("val.bin")])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_digest(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def open_tokens(dir: str | Path, split: str, *, verify: bool = False) -> np.memmap:
    """The split's sequences as a read-only (n, seq_len) uint16 memmap (an empty array when
    the split has no sequences). ValueError names the file on a missing, truncated or (with
    verify) corrupt file, or (with verify) an id >= vocab_size."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    meta = read_meta(dir)
    path, n, seq_len = _checked_path(Path(dir), split, meta)
    if verify:
        _verify_contents(path, meta)
    if n == 0:
        return np.zeros((0, seq_len), dtype=DTYPE)
    return np.memmap(path, dtype=DTYPE, mode="r", shape=(n, seq_len))


def verify_tokens(dir: str | Path) -> dict:
    """Check every file of a prepared directory in full (sizes, sha256, id range); returns
    a per-split report and raises ValueError on the first problem."""
    meta = read_meta(dir)
    n_total = (meta["train_sequences"] + meta["val_sequences"]) * meta["seq_len"]
    if "tokens" in meta and "dropped_tokens" in meta and \
            n_total + meta["dropped_tokens"] != meta["tokens"]:     # before reading the arrays
        raise ValueError(f"{Path(dir) / 'meta.json'}: train + val + dropped tokens = "
                         f"{n_total + meta['dropped_tokens']:,}, but tokens = "
                         f"{meta['tokens']:,}: the file is inconsistent")
    lacking = [f"{s}.bin" for s in SPLITS if not _is_digest(meta["sha256"].get(f"{s}.bin"))]
    if lacking:      # the metadata is what lacks them, not the token files it describes
        raise ValueError(f"{Path(dir) / 'meta.json'}: its sha256 map holds no digest of "
                         f"{' or '.join(lacking)} (64 hex digits each), so the files cannot be "
                         f"verified; prepare the data again (--force) to record them")
    report = {"dir": str(dir), "seq_len": meta["seq_len"], "splits": {}}
    for split in SPLITS:
        path, n, seq_len = _checked_path(Path(dir), split, meta)
        top = _verify_contents(path, meta)
        report["splits"][split] = {"sequences": n, "bytes": n * seq_len * DTYPE.itemsize,
                                   "sha256": meta["sha256"][f"{split}.bin"],
                                   "max_id": top if n else None}
    report["ok"] = True
    return report


def stdlib_corpus(out_dir: str | Path, *, format: str = "txt", source: bool = False,
                  force: bool = False) -> list[Path]:
    """Write text that ships with Python, so a corpus needs no download: the documentation
    topics (``pydoc_data.topics``, about 465K characters, 139K GPT-2 tokens in 79 documents)
    as one ``<topic>.txt`` per document, or one ``topics.jsonl`` with a "text" field; with
    ``source`` also every ``.py`` file of the standard library (site-packages left out) as
    ``source/<path>.txt``, tens of MB of code and docstrings, enough for a throughput run.
    A file of the same name that holds other text is replaced only with ``force`` (checked
    before anything is written; an earlier corpus is written again as it is). Returns the
    files written."""
    if format not in ("txt", "jsonl"):
        raise ValueError(f"format must be 'txt' or 'jsonl', got {format!r}")
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise RuntimeError("this Python has no pydoc_data (some distributions strip it); "
                           "give the corpus as text files instead") from None
    out = Path(out_dir)
    if format == "jsonl":
        files = {out / "topics.jsonl": "".join(json.dumps({"topic": k, "text": topics[k]}) +
                                               "\n" for k in sorted(topics))}
    else:
        files = {out / f"{k}.txt": topics[k] for k in sorted(topics)}
    if source:
        files.update(_stdlib_source(out / "source"))
    _check_replaced(files, force)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(files)


def _check_replaced(files: dict[Path, str], force: bool) -> None:
    if force:
        return
    for path, text in files.items():
        if path.exists() and (not path.is_file() or path.read_bytes() != text.encode()):
            raise ValueError(f"{path} exists and holds other text; pass --force to replace "
                             f"it (and the corpus's other files), or give another OUT")


def _stdlib_source(out: Path) -> dict[Path, str]:
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {}
    for src in sorted(root.rglob("*.py")):
        rel = src.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        try:
            files[out / rel.with_suffix(".txt")] = src.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue          # a few test files are deliberately not UTF-8
    return files


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _checked_path(dir: Path, split: str, meta: dict) -> tuple[Path, int, int]:
    """The split's file, its sequences and seq_len, after checking its size against meta."""
    n, seq_len = int(meta[f"{split}_sequences"]), int(meta["seq_len"])
    expected, path = n * seq_len * DTYPE.itemsize, dir / f"{split}.bin"
    if not path.is_file():
        raise ValueError(f"{path} is missing (meta.json expects {expected:,} bytes)")
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(f"{path} has {actual:,} bytes, expected {expected:,} ({n:,} sequences x "
                         f"{seq_len:,} tokens x 2 bytes): the file is truncated or does not "
                         f"belong to this meta.json")
    return path, n, seq_len


def _verify_contents(path: Path, meta: dict) -> int:
    """sha256 and id range of a whole file; returns the largest id."""
    h, top = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK_TOKENS * DTYPE.itemsize):
            h.update(block)
            top = max(top, int(np.frombuffer(block, dtype=DTYPE).max()))
    expected = meta["sha256"].get(path.name)
    if h.hexdigest() != expected:
        raise ValueError(f"{path} has sha256 {h.hexdigest()}, expected {expected} (meta.json): "
                         f"the file is corrupt")
    if top >= meta["vocab_size"]:
        raise ValueError(f"{path} holds token id {top}, not below vocab_size "
                         f"{meta['vocab_size']}: the file is corrupt")
    return top
