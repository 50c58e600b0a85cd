"""``moremoe data corpus --packages``: a text corpus that every machine with Python has, the
source and documentation of its installed packages, deduplicated and split into train and
validation by whole package.

1. roots: the standard library and every site-packages / dist-packages folder of this Python
   and of the installation it was made from (a virtual environment's base), plus any
   ``extra_roots``; a folder inside another root (the stdlib's site-packages) belongs to the
   inner one. Files: SUFFIXES, outside hidden folders and __pycache__, each real file once.
2. package: a file's top-level folder or module under its root (``name-1.0.dist-info`` ->
   ``name``), or, under a vendoring folder (VENDOR_DIRS: ``pip/_vendor/rich/...``), the
   vendored package (``rich``), so a copy and its original share a split. Names are lower
   case with ``-`` and ``.`` as ``_``.
3. order: by (package, path under the root, root), so the kept copy of a duplicate does not
   depend on the order of the roots.
4. dropped: files that are not UTF-8, or hold only whitespace; exact duplicates (equal bytes:
   the first kept); near-duplicates (MinHash Jaccard >= ``near_dup`` within a group found by
   LSH, tasks/near_dup.py: the group's first kept).
5. split: packages in the order of sha256(f"{seed}:{name}") go to validation while they fit
   in ``val_fraction`` of the kept bytes (a package larger than the room left is skipped), so
   the validation text is whole packages that training never sees in any form, a copy
   included (step 4 leaves no near-duplicate of anything).
6. written: OUT/train.jsonl and OUT/val.jsonl (one document a line: text, package, path as
   "<root kind>/<path under the root>"), then OUT/corpus.json (what each step removed, the
   packages of each split, and the fingerprint: sha256 over the two files), last.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..report import check_output_dir, write_json
from ..runtime import __version__, progress_bar
from . import near_dup

SUFFIXES = (".py", ".md", ".rst")
VENDOR_DIRS = frozenset({"_vendor", "vendor", "_vendored", "vendored", "extern", "_extern",
                         "third_party", "_bundled", "externals"})
FILES = ("train.jsonl", "val.jsonl", "corpus.json")
FORMAT, VERSION = "moremoe-corpus", 1
_START = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class CorpusConfig:
    out: str
    extra_roots: tuple[str, ...] = ()   # more folders of packages, after this Python's own
    installed: bool = True              # the standard library and this Python's site-packages
    val_fraction: float = 0.02          # of the kept bytes, in whole packages
    seed: int = 0                       # the order in which packages fill validation
    near_dup: float | None = 0.8        # MinHash Jaccard threshold; None: exact duplicates only
    workers: int = 1
    force: bool = False

    def __post_init__(self):
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction:g}")
        if self.near_dup is not None and not 0 < self.near_dup <= 1:
            raise ValueError(f"--near-dup must be in (0, 1], got {self.near_dup:g}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not self.installed and not self.extra_roots:
            raise ValueError("no folders to read: give --root DIR, or leave out --no-installed")


@dataclass(frozen=True)
class Root:
    path: Path
    kind: str           # "stdlib", "site-packages" or "root" (given)


@dataclass(frozen=True)
class Doc:
    root: int           # index into the roots
    rel: str            # path under the root, "/"-separated
    package: str
    size: int


def installed_roots() -> list[Root]:
    """The standard library and every site-packages / dist-packages folder that exists."""
    import site
    import sysconfig
    paths = [sysconfig.get_paths()]
    paths.append(sysconfig.get_paths(vars={"base": sys.base_prefix,
                                           "platbase": sys.base_exec_prefix}))
    found = [*site.getsitepackages(), site.getusersitepackages(), *sys.path,
             *(p[k] for p in paths for k in ("purelib", "platlib"))]
    sites = [Path(p) for p in found if p and Path(p).name in ("site-packages", "dist-packages")]
    stdlib = [Path(p["stdlib"]) for p in paths]
    return _unique([Root(p, "stdlib") for p in stdlib] + [Root(p, "site-packages")
                                                          for p in sites])


def _unique(roots: list[Root]) -> list[Root]:
    seen, out = set(), []
    for r in roots:
        real = r.path.resolve()
        if real.is_dir() and real not in seen:
            seen.add(real)
            out.append(Root(real, r.kind))
    return out


def package_of(parts: tuple[str, ...]) -> str:
    """The package a file belongs to, from its path under its root (module docstring)."""
    top = 0
    for i, part in enumerate(parts[:-1]):
        if part in VENDOR_DIRS:
            top = i + 1
    name = parts[top]
    if top == len(parts) - 1:                   # a module file
        name = name.rsplit(".", 1)[0]
    for tail in (".dist-info", ".egg-info"):
        if name.endswith(tail):
            name = name[:-len(tail)].split("-")[0]
    return name.lower().replace("-", "_").replace(".", "_")


def collect(roots: list[Root]) -> list[Doc]:
    """Every file of SUFFIXES under the roots, each real file once, in the corpus order."""
    inner = {r.path for r in roots}
    docs, seen = [], set()
    for i, root in enumerate(roots):
        for folder, dirs, files in os.walk(root.path):
            here = Path(folder)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                             and here / d not in inner and not (root.kind == "stdlib" and d in
                             ("site-packages", "dist-packages")))
            for name in files:
                path = here / name
                if not name.endswith(SUFFIXES) or not path.is_file():
                    continue
                real = path.resolve()
                if real in seen:
                    continue
                seen.add(real)
                parts = path.relative_to(root.path).parts
                docs.append(Doc(i, "/".join(parts), package_of(parts), path.stat().st_size))
    return sorted(docs, key=lambda d: (d.package, d.rel, d.root))


def split_packages(sizes: dict[str, int], fraction: float, seed: int) -> set[str]:
    """The validation packages (module docstring, step 5)."""
    room = fraction * sum(sizes.values())
    val, taken = set(), 0
    for name in sorted(sizes, key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).digest()):
        if taken + sizes[name] <= room:
            val.add(name)
            taken += sizes[name]
    return val


def _signatures(paths: list[str]) -> np.ndarray:
    return np.stack([near_dup.signature(Path(p).read_bytes()) for p in paths])


def _all_signatures(paths: list[str], workers: int, progress: bool) -> np.ndarray:
    chunks = [paths[i:i + 64] for i in range(0, len(paths), 64)]
    bar = progress_bar(len(paths), desc="near-duplicates", enabled=progress)
    out = []
    try:
        if workers <= 1 or len(chunks) <= 1:
            results = map(_signatures, chunks)
            pool = None
        else:
            pool = multiprocessing.get_context(_START).Pool(min(workers, len(chunks)))
            results = pool.imap(_signatures, chunks)
        for chunk, sig in zip(chunks, results):
            out.append(sig)
            bar.update(len(chunk))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    return np.concatenate(out) if out else np.zeros((0, near_dup.PERMS), np.uint64)


def build_corpus(config: CorpusConfig, *, progress: bool = True) -> dict:
    """Run the whole pipeline (module docstring); returns corpus.json's contents."""
    t0 = time.perf_counter()
    out = Path(config.out)
    check_replace_corpus(out, config.force)
    check_output_dir(out, "OUT")
    for p in config.extra_roots:
        if not Path(p).expanduser().is_dir():
            raise ValueError(f"--root {p}: not a folder; give a folder of packages")
    roots = _unique((installed_roots() if config.installed else []) +
                    [Root(Path(p).expanduser(), "root") for p in config.extra_roots])
    found = collect(roots)
    kept, removed, texts = _read_unique(found, roots, progress)
    if config.near_dup is not None and kept:
        sigs = _all_signatures([str(roots[d.root].path / d.rel) for d in kept],
                               config.workers, progress)
        keep_of = near_dup.groups(sigs, config.near_dup)
        near = [d for i, d in enumerate(kept) if keep_of[i] != i]
        removed["near_duplicate"] = _count(near)
        texts = [t for i, t in enumerate(texts) if keep_of[i] == i]
        kept = [d for i, d in enumerate(kept) if keep_of[i] == i]
    if not kept:
        raise ValueError(f"no text found under {', '.join(str(r.path) for r in roots)}: no "
                         f"{', '.join(SUFFIXES)} files that are UTF-8 text")
    sizes: dict[str, int] = {}
    for d, text in zip(kept, texts):
        sizes[d.package] = sizes.get(d.package, 0) + len(text.encode())
    val = split_packages(sizes, config.val_fraction, config.seed)
    if not val:
        raise ValueError(f"--val-fraction {config.val_fraction:g}: no whole package fits in "
                         f"{config.val_fraction:g} of the {sum(sizes.values()):,} kept bytes "
                         f"(the smallest of the {len(sizes):,} packages holds "
                         f"{min(sizes.values()):,}); give a larger --val-fraction")
    fingerprint = _write_splits(out, kept, texts, roots, val)
    summary = {
        "format": FORMAT, "version": VERSION, "moremoe_version": __version__,
        "fingerprint": fingerprint, "python": sys.version.split()[0],
        "roots": [{"path": str(r.path), "kind": r.kind} for r in roots],
        "suffixes": list(SUFFIXES), "found": _count(found), "removed": removed,
        "near_dup_threshold": config.near_dup, "val_fraction": config.val_fraction,
        "seed": config.seed, "kept": _count(kept),
        "splits": {s: _split_counts(kept, texts, val, s == "val") for s in ("train", "val")},
        "val_packages": sorted(val), "seconds": time.perf_counter() - t0}
    write_json(out / "corpus.json", summary)
    return summary


def _read_unique(found: list[Doc], roots: list[Root], progress: bool):
    """The files' texts, less those not UTF-8 or empty and the exact duplicates."""
    seen, kept, texts = set(), [], []
    removed = {k: [] for k in ("not_utf8", "empty", "exact_duplicate")}
    bar = progress_bar(len(found), desc="reading", enabled=progress)
    for d in found:
        data = (roots[d.root].path / d.rel).read_bytes()
        bar.update()
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            removed["exact_duplicate"].append(d)
            continue
        seen.add(digest)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            removed["not_utf8"].append(d)
            continue
        if not text.strip():
            removed["empty"].append(d)
            continue
        kept.append(d)
        texts.append(text)
    bar.close()
    return kept, {k: _count(v) for k, v in removed.items()}, texts


def _count(docs: list[Doc]) -> dict:
    return {"files": len(docs), "bytes": sum(d.size for d in docs)}


def _split_counts(kept, texts, val: set[str], is_val: bool) -> dict:
    chosen = [(d, t) for d, t in zip(kept, texts) if (d.package in val) == is_val]
    return {"files": len(chosen), "bytes": sum(len(t.encode()) for _, t in chosen),
            "packages": len({d.package for d, _ in chosen})}


def _write_splits(out: Path, kept, texts, roots, val: set[str]) -> str:
    """OUT/train.jsonl and OUT/val.jsonl (each through a temporary file and a rename);
    returns the fingerprint: the sha256 of the two files' bytes, train first."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.json").unlink(missing_ok=True)       # until it lands, OUT is unfinished
    digest = hashlib.sha256()
    for split, is_val in (("train", False), ("val", True)):
        tmp = out / f".{split}.jsonl.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                for d, text in zip(kept, texts):
                    if (d.package in val) == is_val:
                        line = (json.dumps({"text": text, "package": d.package, "path":
                                            f"{roots[d.root].kind}/{d.rel}"}) + "\n").encode()
                        f.write(line)
                        digest.update(line)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out / f"{split}.jsonl")
        except BaseException:               # a full disk, a kill: no stray temporary file
            tmp.unlink(missing_ok=True)
            raise
    return digest.hexdigest()


def check_replace_corpus(out: Path, force: bool) -> None:
    """A folder that holds a corpus (or files of its names) is written over only with force."""
    held = [n for n in FILES if (out / n).exists()]
    if held and not force:
        raise ValueError(f"{out} already holds {', '.join(held)}; pass --force to replace "
                         f"{'it' if len(held) == 1 else 'them'}, or give another OUT")


def read_corpus(folder: str | Path) -> dict | None:
    """corpus.json of a corpus folder, or None where there is none (or it is not ours)."""
    try:
        meta = json.loads((Path(folder) / "corpus.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None
