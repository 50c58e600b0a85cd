"""Deterministic batches over a prepared token directory (train.bin / val.bin / meta.json).

Format (written by ``moremoe data prepare``): raw little-endian uint16 rows of meta
``seq_len`` tokens. A model with a shorter seq_len T reads each row as seq_len / T rows.

Order: epoch e visits the rows in the order of a permutation seeded by (seed, e); optimizer
step i of an epoch takes rows [i G, (i + 1) G) of it, G = the global batch in rows
(batch_size × world × grad_accum). Micro-step j of rank r takes chunk c = j · world + r of
b = batch_size rows, so DDP over R ranks sees exactly the rows one process sees with R
accumulation micro-steps, and its global batch is the one process's batch of G rows. The
position (epoch, step within the epoch) is all the state; it goes into checkpoints. The files
are read with moremoe.tasks.text (open_tokens, read_meta).
"""
from __future__ import annotations

import numpy as np

from ..tasks.text import data_fingerprint


def rows_of(seqs_NL: np.ndarray, seq_len: int) -> np.ndarray:
    """The (n, L) rows as (n L / T, T) rows of the model's seq_len T (a view, no copy)."""
    L = seqs_NL.shape[1]
    if L == seq_len:
        return seqs_NL
    if seq_len > L or L % seq_len:
        raise ValueError(f"model.seq_len must divide the data's seq_len={L}, got {seq_len}")
    return seqs_NL.reshape(-1, seq_len)


def check_ids(rows_NT: np.ndarray, vocab: int | None, source: str, row_ids=None) -> None:
    """ValueError naming the first row of rows_NT (its id in row_ids) with a token id that
    is not below vocab."""
    if vocab is None or rows_NT.size == 0:
        return
    top_N = rows_NT.max(axis=1)
    if top_N.max() >= vocab:
        i = int(np.argmax(top_N >= vocab))
        row = int(row_ids[i]) if row_ids is not None else i
        raise ValueError(f"{source}: sequence {row} holds token id {int(top_N[i])}, not below "
                         f"the model's vocabulary of {vocab}: the file is corrupt or was "
                         f"prepared for another model; check it with `moremoe data verify`")


class Batches:
    """Training rows in a seeded, epoch-wise order; see the module docstring."""

    def __init__(self, rows_NT: np.ndarray, *, batch_size: int, world: int, grad_accum: int,
                 seed: int, vocab: int | None = None, source: str = "the training rows"):
        """vocab: every id a micro-batch returns is checked to be below it (ValueError
        naming `source` and the row otherwise: one max over the batch on the host)."""
        self.rows, self.b, self.world, self.accum = rows_NT, batch_size, world, grad_accum
        self.vocab, self.source = vocab, source
        self.seed, self.epoch, self.offset = seed, 0, 0
        self.global_batch = batch_size * world * grad_accum
        self.steps_per_epoch = rows_NT.shape[0] // self.global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"the training split has {rows_NT.shape[0]} rows, fewer than one "
                             f"global batch of {self.global_batch} (batch_size {batch_size} × "
                             f"world {world} × grad_accum {grad_accum})")
        self._perm_epoch, self._perm = None, None

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm, self._perm_epoch = rng.permutation(self.rows.shape[0]), self.epoch
        return self._perm

    def micro_batch(self, micro: int, rank: int) -> np.ndarray:
        """(b, T) int64 rows of micro-step `micro` for `rank` at the current step."""
        chunk = micro * self.world + rank
        start = self.offset * self.global_batch + chunk * self.b
        idx = np.sort(self._order()[start:start + self.b])   # sorted: sequential reads
        batch = self.rows[idx].astype(np.int64)
        check_ids(batch, self.vocab, self.source, idx)
        return batch

    def advance(self) -> None:
        self.offset += 1
        if self.offset == self.steps_per_epoch:
            self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "rows": int(self.rows.shape[0]), "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "rows", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume: the checkpoint's data {key} is {state[key]}, "
                                 f"this run's is {mine[key]} (the global batch is batch_size × "
                                 f"world × grad_accum and must not change)")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def data_record(meta: dict, folder: str, train_tokens: int, val_tokens: int) -> dict:
    """What a run's summary says of its data: the folder, its fingerprint (tasks/text.py),
    the corpus it was prepared from (where meta.json names one) and the tokens of the two
    splits at the model's sequence length."""
    return {"dir": str(folder), "fingerprint": data_fingerprint(meta),
            "corpus": (meta.get("corpus") or {}).get("fingerprint"),
            "train_tokens": int(train_tokens), "val_tokens": int(val_tokens)}


def check_same_data(saved: str | None, data: dict, checkpoint) -> None:
    """A checkpoint continues only on the data it was trained on: ValueError when the data's
    fingerprint differs from the one the checkpoint recorded (older checkpoints recorded
    none and are not checked)."""
    if saved is not None and saved != data["fingerprint"]:
        raise ValueError(f"cannot resume {checkpoint}: it was trained on data of fingerprint "
                         f"{saved}, and --data {data['dir']} has {data['fingerprint']} (other "
                         f"sequences: the corpus or its preparation changed); resume with the "
                         f"run's data, or start a new run with another --out")
