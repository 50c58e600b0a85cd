"""``moremoe data mixture``: a pretraining mixture (tasks/recipe.py) -> GPT-2 token sequences in
the format of ``data prepare`` (tasks/text.py), which ``moremoe train`` reads as it is.

1. plan: the recipe at its scale, less --skip; each source from the Hub or a local copy
   (tasks/streams.py), all opened and checked against their formatter before any work.
2. tokenise, source by source, in recipe order: rows -> documents (tasks/formats.py) ->
   ``encode_ordinary`` + <|endoftext|>, in batches of _BATCH rows encoded by ``workers``
   threads, until the source's token budget (the last document cut to fit) or its end. A
   chunk closes after the batch that brings it to ``chunk_tokens``: DIR/.partial/NAME/
   NNNNNN.bin and its record NNNNNN.json (tokens, sha256, the stream's state_dict after the
   batch, whether the source is done). A benchmark at scale f < 1 keeps row i when a hash
   of (seed, name, i) falls below f.
3. assemble: each source's stream is cut into ``seq_len`` rows on its own (its tail short
   of a row is dropped), as the paper chunks each source. The pool is every source's rows,
   ``repeats`` times. Validation = ``val_sequences`` distinct rows drawn uniformly from the
   pool with numpy ``default_rng(seed)`` (positions without replacement, redrawn while two
   land on copies of one row), and every copy of a validation row is left out of train, so
   no row of the pool is in both splits. train.bin: per source in recipe order, its copies one after
   another, each in stream order (the trainer permutes rows every epoch); val.bin in pool
   order. Without repeats this is ``data prepare``'s draw exactly. mixture.json (the
   manifest: recipe, hub ids, configs, budgets, what each source gave) and meta.json (last)
   are written after the arrays are renamed into DIR.

Resume: .partial/manifest.json records per source its origin (Hub id, or the local files'
sizes and mtimes), format, budget and sampling, and the tokenizer and chunk size. A rerun
keeps every source whose entry is unchanged: its finished chunks are checked (sha256) and
the stream continues from the last one's state, so the result is the same bytes as an
uninterrupted build. A source whose entry changed and has chunks stops the run unless
--restart (or --force). seq_len, val_sequences, seed (benchmark sampling aside) and repeats
act in step 3 only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

from ..report import check_output_dir, write_atomic, write_json
from ..runtime import __version__, progress_bar
from .formats import render
from .fill import seq_len_fixes
from .prepare import default_workers, locked, stream_rows
from .recipe import RECIPES, describe, nominal_tokens, scale_for, scaled, select
from .sources import encode
from .streams import local_origin, open_sources, quiet_datasets, read_failure
from .text import DTYPE, FORMAT, SPLITS, VERSION, check_replace, file_sha256
from .tokenizer import EOT_ID, NAME, RANKS_SHA256, VOCAB_SIZE, gpt2_encoding

_BATCH = 64     # rows per read: the encode threads' unit of work; chunk ends fall after one


@dataclass(frozen=True)
class MixtureConfig:
    out: str
    recipe: str = "paper"
    scale: float = 1.0
    tokens: int | None = None           # a total to write, in place of scale
    sources: tuple[tuple[str, str], ...] = ()   # (name, local path) pairs
    skip: tuple[str, ...] = ()
    seq_len: int = 1024
    val_sequences: int = 5000
    seed: int = 0
    workers: int = field(default_factory=default_workers)
    chunk_tokens: int = 1 << 24         # tokens per chunk: the unit of resume (32 MiB)
    tokenizer_ranks: str | None = None
    restart: bool = False               # discard the unfinished state instead of resuming
    force: bool = False                 # replace a finished output or a conflicting state
    specs: tuple | None = None          # a recipe as SourceSpecs, in place of `recipe`

    def __post_init__(self):
        if self.specs is None and self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {', '.join(RECIPES)}, got "
                             f"{self.recipe!r}")
        for name, low in (("seq_len", 2), ("val_sequences", 0), ("workers", 1),
                          ("chunk_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")

    def plan(self) -> tuple:
        """The sources to build: the recipe at its scale, less skip."""
        base = tuple(self.specs) if self.specs is not None else RECIPES[self.recipe]
        scale = scale_for(base, self.tokens) if self.tokens is not None else self.scale
        specs = select(scaled(base, scale), self.skip)
        names = [s.name for s in base]
        for name, path in self.sources:     # a local copy of a skipped source is not read
            if name not in names:
                raise ValueError(f"--source {name}={path}: {name!r} is not in the recipe; "
                                 f"expected one of {','.join(names)}")
        return specs

    @property
    def effective_scale(self) -> float:
        base = tuple(self.specs) if self.specs is not None else RECIPES[self.recipe]
        return scale_for(base, self.tokens) if self.tokens is not None else self.scale


def build_mixture(config: MixtureConfig, *, progress: bool = True, on_chunk=None) -> dict:
    """Build the mixture (module docstring) and return a summary. ``on_chunk(name, index)``
    is called after each chunk is written (an exception there stops the run the way an
    interruption does)."""
    t0 = time.perf_counter()
    out = Path(config.out)
    check_replace(out, config.force)
    specs = config.plan()
    check_output_dir(out, "--out")
    enc = gpt2_encoding(config.tokenizer_ranks)
    names = {s.name for s in specs}
    local = {n: local_origin(n, path) for n, path in config.sources if n in names}
    out.mkdir(parents=True, exist_ok=True)
    partial = out / ".partial"
    with locked(out, "moremoe data mixture"), quiet_datasets():
        _open_state(partial, _manifest(config, specs, local), config)
        records = {s.name: _finished_chunks(partial / s.name) for s in specs}
        todo = [s for s in specs if not (records[s.name] and records[s.name][-1]["done"])]
        streams = open_sources(todo, {s.name: local[s.name] for s in todo if s.name in local})
        reused = sum(len(r) for r in records.values())
        new_tokens = 0
        with ThreadPoolExecutor(config.workers) as pool:
            for spec in todo:
                new_tokens += _tokenise(spec, streams[spec.name], partial / spec.name,
                                        records[spec.name], (enc, pool, config, local),
                                        progress=progress, on_chunk=on_chunk)
        summary = _assemble(config, specs, local, records, partial, progress=progress)
    seconds = time.perf_counter() - t0
    summary.update(chunks=sum(len(r) for r in records.values()), chunks_reused=reused,
                   workers=config.workers, seconds=seconds,
                   tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0)
    return summary


# ---------------------------------------------------------------- state

def _origin(spec, local: dict) -> dict:
    return local.get(spec.name) or {"hub": spec.hub_ref, "split": spec.split}


def _manifest(config: MixtureConfig, specs, local: dict) -> dict:
    sources = {}
    for s in specs:
        entry = {"origin": _origin(s, local), "format": s.format, "budget": s.budget,
                 "fraction": s.fraction}
        if s.fraction < 1:
            entry["seed"] = config.seed     # the seed picks the benchmark examples
        sources[s.name] = entry
    return json.loads(json.dumps({
        "format": "moremoe-mixture-state", "version": 1, "tokenizer_sha256": RANKS_SHA256,
        "chunk_tokens": config.chunk_tokens, "sources": sources}))


def _open_state(partial: Path, manifest: dict, config: MixtureConfig) -> None:
    """Keep the unfinished work in ``partial`` that the new plan shares; stop on a conflict
    unless restart or force (module docstring)."""
    path = partial / "manifest.json"
    old = None
    if partial.exists() and not config.restart:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None        # died before its manifest landed: nothing there is trusted
    if old is None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write_json(path, manifest)
        return
    same = all(old.get(k) == manifest[k] for k in manifest if k != "sources")
    olds = old.get("sources", {}) if same else {}
    worked = sorted(p.name for p in partial.iterdir() if p.is_dir() and any(p.glob("*.json")))
    stale = [n for n in worked if not same or
             (n in manifest["sources"] and olds.get(n) != manifest["sources"][n])]
    if stale and not config.force:
        what = "sources" if same else "tokenizer or --chunk-tokens, for the sources"
        raise ValueError(f"{partial} holds unfinished work with other {what} {', '.join(stale)}"
                         f" (origin, budget or sampling); run with the same options to resume "
                         f"it, or pass --restart to discard it")
    for name in stale:
        shutil.rmtree(partial / name, ignore_errors=True)
    manifest["sources"] = {**olds, **manifest["sources"]}    # skipped ones stay resumable
    write_json(path, manifest)


def _finished_chunks(folder: Path) -> list[dict]:
    """The records of the leading chunks whose .bin matches; later files are removed."""
    records = []
    while True:
        bin_, rec = folder / f"{len(records):06d}.bin", folder / f"{len(records):06d}.json"
        try:
            record = json.loads(rec.read_text())
            ok = bin_.stat().st_size == record["tokens"] * DTYPE.itemsize and \
                file_sha256(bin_) == record["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok or (records and records[-1]["done"]):
            break
        records.append(record)
    if folder.is_dir():
        for f in folder.iterdir():
            stem = f.name.split(".")[0]
            if not (stem.isdigit() and int(stem) < len(records)) or f.name.endswith(".tmp"):
                f.unlink()
    return records


# ---------------------------------------------------------------- tokenise

def _keep(name: str, seed: int, fraction: float, index: int) -> bool:
    if fraction >= 1:
        return True
    h = hashlib.blake2b(f"{seed}:{name}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2 ** 64


def _documents(spec, rows, first: int, seed: int) -> list[str]:
    texts = []
    for i, row in enumerate(rows, first):
        if _keep(spec.name, seed, spec.fraction, i):
            text = render(spec.format, row, f"source {spec.name}, row {i}")
            if text:
                texts.append(text)
    return texts


def _tokenise(spec, stream, folder: Path, records: list, ctx, *, progress, on_chunk) -> int:
    """Continue the source's chunks after ``records`` (appended to it) until it is done;
    returns the tokens added."""
    enc, pool, config, local = ctx
    folder.mkdir(exist_ok=True)
    if records:
        stream.load_state_dict(records[-1]["state"])
    taken = sum(r["tokens"] for r in records)
    read = records[-1]["rows_read"] if records else 0
    budget, start = spec.budget, taken
    bar = progress_bar(budget, desc=f"tokenising {spec.name}", enabled=progress, initial=taken)
    rows, pieces, docs, held = iter(stream), [], 0, 0     # held: tokens in pieces
    done = budget == 0 or spec.fraction == 0
    eot = np.array([EOT_ID], dtype=DTYPE)
    try:
        while not done:
            try:
                batch = list(islice(rows, _BATCH))
            except Exception as err:    # noqa: BLE001 - a corrupt file, a lost connection
                why = (read_failure(spec.name, local[spec.name], err) if spec.name in local
                       else f"source {spec.name}: reading after row {read:,} failed "
                            f"({type(err).__name__}: {' '.join(str(err).split())[:300]})")
                raise ValueError(f"{why}; the finished chunks are kept for a rerun") from err
            texts = _documents(spec, batch, read, config.seed)
            read += len(batch)
            done = len(batch) < _BATCH
            for ids in pool.map(lambda t: encode(enc, t), texts):
                ids = np.concatenate([ids, eot])
                if budget is not None:
                    ids, done = ids[:budget - taken], done or len(ids) >= budget - taken
                pieces.append(ids)
                taken, held, docs = taken + len(ids), held + len(ids), docs + 1
                bar.update(len(ids))
                if budget is not None and taken >= budget:
                    break
            if done or held >= config.chunk_tokens:
                state = None if done else stream.state_dict()
                ended = len(batch) < _BATCH and (budget is None or taken < budget)
                records.append(_write_chunk(folder, len(records), pieces, docs, read, state,
                                            ended))
                pieces, docs, held = [], 0, 0
                if on_chunk is not None:
                    on_chunk(spec.name, len(records) - 1)
        if not records or not records[-1]["done"]:     # nothing to read: an empty record
            records.append(_write_chunk(folder, len(records), [], 0, read, None, False))
    finally:
        bar.close()
    return taken - start


def _write_chunk(folder: Path, index: int, pieces, docs: int, read: int, state,
                 ended: bool) -> dict:
    """ended: every row of the source was read (for a budget, before it was reached)."""
    data = (np.concatenate(pieces) if pieces else np.zeros(0, DTYPE)).astype(DTYPE).tobytes()
    record = {"tokens": len(data) // DTYPE.itemsize, "documents": docs, "rows_read": read,
              "sha256": hashlib.sha256(data).hexdigest(), "done": state is None,
              "ended": ended, "state": state}
    write_atomic(folder / f"{index:06d}.bin", data)
    write_json(folder / f"{index:06d}.json", record)
    return record


# ---------------------------------------------------------------- assemble

def draw_validation(rows, repeats, v: int, seed: int) -> list[np.ndarray]:
    """Per source, the sorted indices of its distinct rows held out: ``v`` rows drawn
    uniformly from the pool of every row ``repeats`` times (module docstring, step 3)."""
    rows_S = np.asarray(rows, dtype=np.int64)
    sizes_S = rows_S * np.asarray(repeats, dtype=np.int64)
    ends_S = np.cumsum(sizes_S)
    starts_S, first_S = ends_S - sizes_S, np.cumsum(rows_S) - rows_S
    if v > rows_S.sum():
        raise ValueError(f"cannot hold out {v} of {int(rows_S.sum())} distinct rows")
    rng = np.random.default_rng(seed)
    chosen, seen = [], set()
    draw = rng.choice(int(ends_S[-1]), size=v, replace=False) if v else []
    while len(chosen) < v:
        s_P = np.searchsorted(ends_S, draw, side="right")     # the source of each position
        for g in (first_S[s_P] + (draw - starts_S[s_P]) % rows_S[s_P]).tolist():
            if g not in seen and len(chosen) < v:
                seen.add(g)
                chosen.append(g)
        draw = rng.integers(int(ends_S[-1]), size=v - len(chosen))
    ids = np.sort(np.array(chosen, dtype=np.int64))
    return [ids[(ids >= a) & (ids < a + n)] - a for a, n in zip(first_S, rows_S)]


def _assemble(config, specs, local, records, partial: Path, *, progress) -> dict:
    """Chunks -> train.bin, val.bin (in .partial, then renamed into DIR) -> mixture.json ->
    meta.json."""
    T, v = config.seq_len, config.val_sequences
    taken = [sum(r["tokens"] for r in records[s.name]) for s in specs]
    rows = [t // T for t in taken]
    if v >= sum(rows):
        raise ValueError(f"too few sequences: the mixture gives {sum(rows):,} distinct "
                         f"sequences of --seq-len {T}, and --val-sequences {v:,} leaves none "
                         f"for training; "
                         f"{seq_len_fixes(taken, T, v, more='a larger --scale / --tokens')}")
    held = draw_validation(rows, [s.repeats for s in specs], v, config.seed)
    hashes = _write_splits(specs, records, rows, held, partial, T, progress=progress)
    table = [_source_row(spec, local, records[spec.name], t, n, len(h), T)
             for spec, t, n, h in zip(specs, taken, rows, held)]
    train_rows = sum(r["train_sequences"] for r in table)
    dropped = sum(r["dropped_tokens"] for r in table)
    out = Path(config.out)
    name = config.recipe if config.specs is None else "custom"
    mixture = {"format": "moremoe-mixture", "version": 1, "recipe": name,
               "scale": config.effective_scale, "full_tokens": nominal_tokens(
                   tuple(config.specs) if config.specs is not None else RECIPES[name]),
               "seed": config.seed, "seq_len": T, "val_sequences": v,
               "skipped": list(config.skip), "sources": table,
               "tokens_written": (train_rows + v) * T}
    meta = {"format": FORMAT, "version": VERSION, "tokenizer": NAME, "vocab_size": VOCAB_SIZE,
            "eot_id": EOT_ID, "seq_len": T, "dtype": "uint16", "train_sequences": train_rows,
            "val_sequences": v, "seed": config.seed, "recipe": name, "mixture": "mixture.json",
            "sources": [f"{r['name']}={r['origin'].get('hub') or r['origin']['path']}"
                        for r in table],
            "documents": sum(r["documents"] for r in table),
            "tokens": (train_rows + v) * T + dropped, "dropped_tokens": dropped,
            "tokenizer_sha256": RANKS_SHA256,
            "val_split": "distinct rows drawn uniformly from the pool (repeats included), "
                         "numpy default_rng(seed); every copy of a validation row is out of "
                         "train; see mixture.json",
            "sha256": {f"{s}.bin": hashes[s].hexdigest() for s in SPLITS},
            "moremoe_version": __version__}
    (out / "meta.json").unlink(missing_ok=True)  # from here DIR is unfinished until it lands
    for s in SPLITS:
        os.replace(partial / f"{s}.bin", out / f"{s}.bin")
    write_json(out / "mixture.json", mixture)
    write_json(out / "meta.json", meta)
    shutil.rmtree(partial)
    return {"out": str(out), "recipe": name, "scale": mixture["scale"], "sources": table,
            **{k: meta[k] for k in ("documents", "tokens", "train_sequences", "val_sequences",
                                    "dropped_tokens", "seq_len")},
            "tokens_written": mixture["tokens_written"],
            "files": {s: str(out / f"{s}.bin") for s in SPLITS}
            | {"meta": str(out / "meta.json"), "mixture": str(out / "mixture.json")}}


def _write_splits(specs, records, rows, held, partial: Path, T: int, *, progress) -> dict:
    """train.bin and val.bin in .partial; returns their sha256 objects."""
    hashes = {s: hashlib.sha256() for s in SPLITS}
    bar = progress_bar(sum(len(records[s.name]) * s.repeats for s in specs), desc="writing",
                       enabled=progress)
    with open(partial / "train.bin", "wb") as f_train, open(partial / "val.bin", "wb") as f_val:
        files = {"train": f_train, "val": f_val}
        for spec, n, held_R in zip(specs, rows, held):
            is_val = np.zeros(n, dtype=bool)
            is_val[held_R] = True
            for copy in range(spec.repeats):
                row = 0
                for block in stream_rows(partial / spec.name, len(records[spec.name]), T, n,
                                         bar):
                    mask = is_val[row:row + len(block)]
                    parts = [("train", block[~mask])] + ([("val", block[mask])] if copy == 0
                                                         else [])
                    for split, part in parts:
                        data = part.tobytes()
                        files[split].write(data)
                        hashes[split].update(data)
                    row += len(block)
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    return hashes


def _source_row(spec, local, records, taken: int, n: int, n_val: int, T: int) -> dict:
    train = (n - n_val) * spec.repeats
    return {**describe(spec), "origin": _origin(spec, local),
            "rows_read": records[-1]["rows_read"],
            "documents": sum(r["documents"] for r in records), "tokens_taken": taken,
            "whole_source": records[-1]["ended"], "sequences": n,
            "dropped_tokens": taken - n * T, "val_sequences": n_val, "train_sequences": train,
            "tokens_written": (train + n_val) * T}
