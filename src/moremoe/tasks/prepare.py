"""``moremoe data prepare``: text -> GPT-2 tokens -> fixed-length sequences (format: tasks/text.py).

1. discover (tasks/sources.py): INPUT arguments (files, folders searched recursively, globs)
   -> sources: .txt files, .jsonl / .jsonl.gz files, folders written by ``datasets``.
2. plan: sources -> shards of about ``shard_mb`` of text. The plan depends on the inputs only,
   never on the worker count, so the output does not either.
3. tokenise, one shard per task in a process pool: ``encode_ordinary`` per document followed by
   <|endoftext|>, written to DIR/.partial/shards/NNNNNN.bin (temp file + rename) and then its
   record NNNNNN.json (tokens, documents, sha256). A shard is finished exactly when its record
   exists and the .bin matches it.
4. assemble: the shards in order are one token stream, cut into ``seq_len`` sequences (the
   tail short of one sequence is dropped and reported). Validation = ``val_sequences``
   sequences chosen by a seeded draw without replacement (numpy ``default_rng(seed).choice``),
   train = the rest; both keep stream order. Random rather than the last sequences because
   inputs are often sorted (by source, by date) and the tail would then be one source only.
   train.bin and val.bin are written in .partial and renamed into DIR, meta.json is written
   last, then .partial is removed.

Validation held out by input (``val_inputs``, e.g. a corpus's val.jsonl from `moremoe data
corpus --packages`): those inputs are tokenised in shards of their own after the training
inputs' and cut into sequences of their own; validation is all of their sequences, or a seeded
draw of ``val_sequences`` of them, in a seeded random order (so that every prefix, such as
the first N a run evaluates, is a uniform sample), and train is every sequence of the other
inputs, in stream order. Where the inputs lie in a corpus folder (its corpus.json), meta.json records the
corpus's fingerprint.

Resume: .partial/manifest.json records the sources (path, size, mtime), the text field, the
tokenizer and the shard plan. A rerun with the same ones keeps the finished shards (their
sha256 checked again) and redoes the rest; seq_len, val_sequences and seed act only in step 4,
so changing them reuses every shard. A rerun with other inputs stops unless ``restart``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..report import check_output_dir, write_json
from ..runtime import __version__, progress_bar
from .corpus import read_corpus
from .fill import check_enough_text, check_held_out, no_text, seq_len_fixes
from .sources import Source, check_text_field, discover_sources, documents, encode, plan_shards
from .text import DTYPE, FORMAT, SPLITS, VERSION, check_replace, file_sha256
from .tokenizer import EOT_ID, NAME, RANKS_SHA256, VOCAB_SIZE, gpt2_encoding

# fork shares the loaded tokenizer and skips re-importing torch in every worker
_START = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


MIN_SHARD_MB = 0.01


def default_workers() -> int:
    return min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    out: str
    seq_len: int = 1024
    val_sequences: int | None = 5000    # None: every sequence of val_inputs
    val_inputs: tuple[str, ...] = ()    # validation held out by input (module docstring)
    seed: int = 0
    workers: int = field(default_factory=default_workers)
    text_field: str = "text"
    tokenizer_ranks: str | None = None
    shard_mb: float = 32.0      # text per shard: the unit of work and of resume
    restart: bool = False       # discard an unfinished run's state instead of resuming it
    force: bool = False         # replace a finished output

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("inputs: give at least one file, folder or glob")
        if self.val_sequences is None and not self.val_inputs:
            raise ValueError("val_sequences=None (all of them) needs val_inputs")
        for name, low in (("seq_len", 2), ("val_sequences", 1 if self.val_inputs else 0),
                          ("workers", 1)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                if name == "val_sequences":     # held out by input: validation is their job
                    raise ValueError("--val-sequences 0 with --val-input would hold those "
                                     "inputs out for no validation; give --val-sequences N "
                                     ">= 1 (default: all of them), or drop --val-input")
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not self.shard_mb >= MIN_SHARD_MB:    # each shard is two files in DIR/.partial
            raise ValueError(f"--shard-mb must be at least {MIN_SHARD_MB} (10 KB), got "
                             f"{self.shard_mb:g}")


# ---------------------------------------------------------------- shards

class ShardTokeniser:
    """Tokenises one shard into DIR/.partial/shards/NNNNNN.bin and its record .json."""

    def __init__(self, sources: list[Source], text_field: str, ranks: str | None,
                 shard_dir: Path):
        self.sources, self.text_field, self.shard_dir = sources, text_field, shard_dir
        self.enc = gpt2_encoding(ranks)

    def __call__(self, index: int, parts) -> tuple[int, dict]:
        pieces, docs = [], 0
        eot = np.array([EOT_ID], dtype=DTYPE)
        for i, start, end in parts:
            for text in documents(self.sources[i], start, end, self.text_field):
                if text:
                    pieces += [encode(self.enc, text), eot]
                    docs += 1
        data = (np.concatenate(pieces) if pieces else np.zeros(0, DTYPE)).tobytes()
        record = {"tokens": len(data) // DTYPE.itemsize, "documents": docs,
                  "sha256": hashlib.sha256(data).hexdigest()}
        _write_atomic(self.shard_dir / f"{index:06d}.bin", data)
        _write_atomic(self.shard_dir / f"{index:06d}.json", json.dumps(record).encode())
        return index, record


_worker: ShardTokeniser | None = None   # one per pool process, set by its initializer


def _init_worker(*args) -> None:
    global _worker
    _worker = ShardTokeniser(*args)


def _run_shard(job) -> tuple[int, dict]:
    return _worker(*job)


def _write_atomic(path: Path, data: bytes) -> None:
    # the pid keeps two writers of one shard apart: a worker orphaned by a killed run may
    # still finish its shard while the resumed run redoes it (same bytes, atomic renames)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finished_shard(shard_dir: Path, index: int) -> dict | None:
    """The record of a shard whose .bin matches it, else None."""
    data = shard_dir / f"{index:06d}.bin"
    try:
        record = json.loads((shard_dir / f"{index:06d}.json").read_text())
        if data.stat().st_size == record["tokens"] * DTYPE.itemsize and \
                file_sha256(data) == record["sha256"]:
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


@contextlib.contextmanager
def _shard_results(jobs, context: tuple, workers: int):
    """(index, record) per finished job; leaving the block early terminates the workers."""
    if workers <= 1:
        tokenise = ShardTokeniser(*context)
        yield (tokenise(*job) for job in jobs)
        return
    pool = multiprocessing.get_context(_START).Pool(workers, _init_worker, context)
    with pool:
        yield pool.imap_unordered(_run_shard, jobs)


# ---------------------------------------------------------------- the run

def _manifest(config: PrepareConfig, sources: list[Source], shards, val_shards: int) -> dict:
    return json.loads(json.dumps({
        "format": "moremoe-prepare-state", "version": 1, "tokenizer_sha256": RANKS_SHA256,
        "text_field": config.text_field, "sources": [asdict(s) for s in sources],
        "shards": shards, "val_shards": val_shards}))


def _plan(config: PrepareConfig, sources: list[Source], n_train: int):
    """The shards: the training inputs', then (held out by input) the validation inputs',
    each part naming its source's index in ``sources``; and how many are validation's."""
    shard_bytes = max(1, int(config.shard_mb * 2 ** 20))
    train = plan_shards(sources[:n_train], shard_bytes)
    val = [[(i + n_train, a, b) for i, a, b in shard]
           for shard in plan_shards(sources[n_train:], shard_bytes)]
    return train + val, len(val)


def _open_state(partial: Path, manifest: dict, *, restart: bool) -> None:
    """Keep a matching unfinished run in ``partial``, or start a fresh one."""
    path = partial / "manifest.json"
    if partial.exists() and not restart:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None      # died before its manifest landed: nothing there can be trusted
        if old == manifest:
            return
        if old is not None:
            what = [k for k in manifest if old.get(k) != manifest[k]]
            raise ValueError(f"{partial} holds an unfinished run with other "
                             f"{', '.join(what)}; pass --restart to discard it")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "shards").mkdir(parents=True)
    write_json(path, manifest)


@contextlib.contextmanager
def locked(out: Path, command: str = "moremoe data prepare"):
    """Hold an exclusive lock on the output folder, so two runs never write into it. Forked
    workers share the lock, so the workers of a killed run hold it until they exit."""
    try:
        import fcntl
    except ImportError:     # not POSIX: no lock
        yield
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `{command}` is writing into {out} (or the workers of "
                             f"a killed one are finishing their shards)") from None
        yield
    finally:
        os.close(fd)


def prepare(config: PrepareConfig, *, progress: bool = True, on_shard=None) -> dict:
    """Run the whole pipeline (module docstring) and return a summary. ``on_shard(done,
    total)`` is called after each finished shard (an exception there stops the run the way
    an interruption does)."""
    t0 = time.perf_counter()
    out = Path(config.out)
    check_replace(out, config.force)
    check_output_dir(out, "--out")                # as a bad ranks file: before any work
    gpt2_encoding(config.tokenizer_ranks)
    sources = discover_sources(config.inputs)
    val_sources = discover_sources(config.val_inputs) if config.val_inputs else []
    both = [s.path for s in sources if s in val_sources]
    if both:
        raise ValueError(f"{both[0]} is both an INPUT and a --val-input: validation held out "
                         f"by input must not be trained on; give it once")
    check_text_field(sources + val_sources, config.text_field)
    check_enough_text(config, sources, val_sources)   # sizes bytes can never fill: now
    shards, val_shards = _plan(config, sources + val_sources, len(sources))
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    partial = out / ".partial"
    with locked(out):
        fresh = not partial.exists()
        _open_state(partial, _manifest(config, sources + val_sources, shards, val_shards),
                    restart=config.restart)
        try:
            records, new_shards, new_tokens = _tokenise(
                config, sources + val_sources, shards, partial / "shards",
                progress=progress, on_shard=on_shard)
            summary = _assemble(config, sources + val_sources, records, partial,
                                val_shards=val_shards, progress=progress)
        except BaseException:
            _drop_unfinished(out, partial, fresh, made_out)
            raise
    seconds = time.perf_counter() - t0
    summary.update(shards=len(shards), shards_reused=len(shards) - new_shards,
                   workers=config.workers, seconds=seconds,
                   tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0)
    return summary


def _drop_unfinished(out: Path, partial: Path, fresh: bool, made_out: bool) -> None:
    """A run that failed before any shard was finished leaves nothing (an interrupted one
    with finished shards keeps them for its resume): its state, and the folder it made."""
    if fresh and not any((partial / "shards").glob("*.json")):
        shutil.rmtree(partial, ignore_errors=True)
        if made_out:
            with contextlib.suppress(OSError):
                out.rmdir()


def _tokenise(config, sources, shards, shard_dir: Path, *, progress, on_shard):
    for tmp in shard_dir.glob("*.tmp"):
        tmp.unlink()
    records = [_finished_shard(shard_dir, k) for k in range(len(shards))]
    jobs = [(k, shards[k]) for k, r in enumerate(records) if r is None]
    context = (sources, config.text_field, config.tokenizer_ranks, shard_dir)
    new_tokens, t0 = 0, time.perf_counter()
    with _shard_results(jobs, context, min(config.workers, len(jobs))) as results:
        # the bar after the pool: tqdm's monitor thread should not exist when workers fork
        bar = progress_bar(len(shards), desc="tokenising", enabled=progress,
                           initial=len(shards) - len(jobs))
        try:
            for done, (k, record) in enumerate(results, len(shards) - len(jobs) + 1):
                records[k] = record
                new_tokens += record["tokens"]
                bar.update()
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):,.0f}")
                if on_shard is not None:
                    on_shard(done, len(shards))
        finally:
            bar.close()
    return records, len(jobs), new_tokens


def _assemble(config, sources, records, partial: Path, *, val_shards: int, progress) -> dict:
    """Shards -> train.bin, val.bin (in .partial, then renamed into DIR) -> meta.json."""
    T, tokens = config.seq_len, sum(r["tokens"] for r in records)
    if tokens == 0:
        raise ValueError(no_text(sources, config.text_field))
    rng = np.random.default_rng(config.seed)
    cut = len(records) - val_shards
    if config.val_inputs:     # held out by input: two streams, validation from its own
        n_train = sum(r["tokens"] for r in records[:cut]) // T
        n_val = sum(r["tokens"] for r in records[cut:]) // T
        v = n_val if config.val_sequences is None else config.val_sequences
        check_held_out(n_train, n_val, v, T, partial)
        keep = np.zeros(n_val, dtype=bool)
        keep[rng.choice(n_val, size=v, replace=False)] = True
        streams = [(range(cut), n_train, np.ones(n_train, bool), None),
                   (range(cut, len(records)), n_val, None, keep)]
        how = (f"held out by input: {'all' if v == n_val else f'a seeded draw of {v:,} of the'}"
               f" {n_val:,} sequences of the --val-input texts (numpy default_rng(seed).choice), "
               f"in a seeded random order (default_rng(seed).permutation after the draw), so "
               f"every prefix is a uniform sample; train is every sequence of the other inputs, "
               f"in stream order")
    else:
        n_seq, v = tokens // T, config.val_sequences
        if v >= n_seq:
            raise ValueError(f"too few sequences: the inputs give {tokens:,} tokens = "
                             f"{n_seq:,} sequences of --seq-len {T}, and --val-sequences {v:,} "
                             f"leaves none for training; {seq_len_fixes([tokens], T, v)} (the "
                             f"tokenised text stays in {partial}: the next run reuses it)")
        is_val = np.zeros(n_seq, dtype=bool)
        is_val[rng.choice(n_seq, size=v, replace=False)] = True
        n_train, streams = n_seq - v, [(range(len(records)), n_seq, ~is_val, is_val)]
        how = ("seeded draw without replacement, numpy default_rng(seed).choice; train is "
               "the rest; both in stream order")
    paths = {s: partial / f"{s}.bin" for s in SPLITS}
    hashes = {s: hashlib.sha256() for s in SPLITS}
    bar = progress_bar(len(records), desc="writing", enabled=progress)
    held_out = []               # validation's own rows, written in a seeded order at the end
    with open(paths["train"], "wb") as f_train, open(paths["val"], "wb") as f_val:
        for shards, n, to_train, to_val in streams:
            row = 0
            for rows in stream_rows(partial / "shards", shards, T, n, bar):
                here = slice(row, row + len(rows))
                if to_train is None:                 # validation's own stream
                    held_out.append(rows[to_val[here]])
                else:
                    _append(f_train, hashes["train"], rows[to_train[here]])
                    if to_val is not None:
                        _append(f_val, hashes["val"], rows[to_val[here]])
                row += len(rows)
        if held_out:
            _append(f_val, hashes["val"], np.concatenate(held_out)[rng.permutation(v)])
        for f in (f_train, f_val):
            f.flush()
            os.fsync(f.fileno())
    bar.close()
    out = Path(config.out)
    meta = {"format": FORMAT, "version": VERSION, "tokenizer": NAME, "vocab_size": VOCAB_SIZE,
            "eot_id": EOT_ID, "seq_len": T, "dtype": "uint16", "train_sequences": n_train,
            "val_sequences": v, "seed": config.seed,
            "sources": [_absolute(a) for a in config.inputs],
            "input_files": len(sources), "documents": sum(r["documents"] for r in records),
            "tokens": tokens, "dropped_tokens": tokens - (n_train + v) * T,
            "text_field": config.text_field, "tokenizer_sha256": RANKS_SHA256,
            "val_split": how, "sha256": {f"{s}.bin": hashes[s].hexdigest() for s in SPLITS},
            "moremoe_version": __version__}
    if config.val_inputs:
        meta["val_sources"] = [_absolute(a) for a in config.val_inputs]
    corpus = corpus_of(config.inputs + config.val_inputs)
    if corpus is not None:
        meta["corpus"] = corpus
    # from here the old output (--force) is gone; until meta.json lands, DIR is unfinished
    (out / "meta.json").unlink(missing_ok=True)
    for s in SPLITS:
        os.replace(paths[s], out / f"{s}.bin")
    write_json(out / "meta.json", meta)
    shutil.rmtree(partial)
    return {"out": str(out), **{k: meta[k] for k in (
        "documents", "tokens", "train_sequences", "val_sequences", "dropped_tokens",
        "seq_len", "input_files")}, "corpus": corpus,
        "files": {s: str(out / f"{s}.bin") for s in SPLITS} | {"meta": str(out / "meta.json")}}


def _append(f, digest, rows: np.ndarray) -> None:
    data = rows.tobytes()
    f.write(data)
    digest.update(data)


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def corpus_of(inputs) -> dict | None:
    """{"fingerprint", "folder"} of the corpus (`moremoe data corpus --packages`) whose
    folder holds every input, or None when they are not all of one corpus."""
    found = set()
    for arg in inputs:
        path = Path(arg).expanduser()
        folder = path if path.is_dir() else path.parent
        meta = read_corpus(folder)
        if meta is None:
            return None
        found.add((meta["fingerprint"], str(folder.resolve())))
    if len(found) != 1:
        return None
    fingerprint, folder = found.pop()
    return {"fingerprint": fingerprint, "folder": folder}


def stream_rows(shard_dir: Path, shards, T: int, n_seq: int, bar):
    """The token stream of the shards (their indices, or their count from 0), in order, as
    (rows, T) blocks; the tail is dropped."""
    carry, left = np.zeros(0, DTYPE), n_seq
    for k in (range(shards) if isinstance(shards, int) else shards):
        data = np.concatenate([carry, np.fromfile(shard_dir / f"{k:06d}.bin", dtype=DTYPE)])
        n = min(len(data) // T, left)
        if n:
            yield data[:n * T].reshape(n, T)
        carry, left = data[n * T:], left - n
        bar.update()
