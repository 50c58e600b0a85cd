"""The phonebook memorisation task (paper Section 3.2, Appendix C.1).

Each entry is a unique five-letter lowercase name and an eight-digit number, written
``$abcde|12345678.`` ($ BOS, | separator, . EOS) and padded with ``*`` to 16 tokens;
the vocabulary has V = 40 symbols. A phonebook is generated deterministically from its
size and seed: names are drawn without replacement from the 26^5 name codes, numbers
independently and uniformly from [0, 10^8) (the number space is never materialised).

Which tokens carry the loss: by default the model is trained to predict the number given
the name, i.e. the 8 digits and the closing ``.`` (``loss_on="number"``); the name letters
are random and carry no information to memorise. ``loss_on="all"`` trains on every
next-token prediction after BOS instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.transformer import IGNORE_INDEX

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
BOS, EOS, SEP, PAD = "$", ".", "|", "*"
VOCAB = LETTERS + DIGITS + BOS + EOS + SEP + PAD
VOCAB_SIZE = len(VOCAB)                 # 40
SEQ_LEN = 16
NAME_LEN, NUMBER_LEN = 5, 8
NAME_SPACE, NUMBER_SPACE = 26 ** NAME_LEN, 10 ** NUMBER_LEN
SEP_POS = 1 + NAME_LEN                  # position of '|' in the sequence
DIGIT_POS = SEP_POS + 1                 # first digit
LOSS_ON = ("number", "all")
_ID = {c: i for i, c in enumerate(VOCAB)}
_DIGIT0, _PAD_ID = _ID["0"], _ID[PAD]


def encode(text: str, *, pad_to: int | None = SEQ_LEN) -> list[int]:
    """Text -> token ids, padded with ``*`` to ``pad_to`` tokens."""
    try:
        ids = [_ID[c] for c in text]
    except KeyError as err:
        raise ValueError(f"character {err.args[0]!r} is not in the phonebook vocabulary "
                         f"{VOCAB!r}") from None
    if pad_to is not None:
        if len(ids) > pad_to:
            raise ValueError(f"text has {len(ids)} tokens, more than pad_to={pad_to}")
        ids += [_PAD_ID] * (pad_to - len(ids))
    return ids


def decode(ids, *, strip_pad: bool = True) -> str:
    text = "".join(VOCAB[int(i)] for i in ids)
    return text.rstrip(PAD) if strip_pad else text


def format_entry(name: str, number: int) -> str:
    return f"{BOS}{name}{SEP}{number:0{NUMBER_LEN}d}{EOS}"


def _digits(values: np.ndarray, base: int, width: int) -> np.ndarray:
    out = np.empty((values.shape[0], width), dtype=np.int64)
    v = values.astype(np.int64).copy()
    for j in range(width - 1, -1, -1):
        out[:, j] = v % base
        v //= base
    return out


@dataclass
class Phonebook:
    """``size`` unique (name, number) pairs drawn deterministically from ``seed``."""

    size: int
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or \
                not 1 <= self.size <= NAME_SPACE:
            raise ValueError(f"size must be an int in [1, {NAME_SPACE}] (the number of unique "
                             f"five-letter names), got {self.size!r}")
        rng = np.random.Generator(np.random.PCG64(self.seed))
        self.name_codes = rng.choice(NAME_SPACE, size=self.size, replace=False)
        self.numbers = rng.integers(0, NUMBER_SPACE, size=self.size, dtype=np.int64)
        self._tokens = None

    def name(self, i: int) -> str:
        return "".join(LETTERS[d] for d in _digits(self.name_codes[i:i + 1], 26, NAME_LEN)[0])

    def entry(self, i: int) -> str:
        return format_entry(self.name(i), int(self.numbers[i]))

    def tokens(self) -> torch.Tensor:
        """(size, 16) int64 token ids of every entry (built once, vectorised)."""
        if self._tokens is None:
            n = self.size
            tok = np.full((n, SEQ_LEN), _PAD_ID, dtype=np.int64)
            tok[:, 0] = _ID[BOS]
            tok[:, 1:SEP_POS] = _digits(self.name_codes, 26, NAME_LEN)      # letters are ids 0..25
            tok[:, SEP_POS] = _ID[SEP]
            tok[:, DIGIT_POS:DIGIT_POS + NUMBER_LEN] = _digits(self.numbers, 10, NUMBER_LEN) + _DIGIT0
            tok[:, DIGIT_POS + NUMBER_LEN] = _ID[EOS]
            self._tokens = torch.from_numpy(tok)
        return self._tokens

    def eval_indices(self, n: int = 1000, seed: int = 1) -> torch.Tensor:
        """``n`` entries sampled uniformly without replacement from the training set."""
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(self.size, generator=g)[:min(n, self.size)]


def inputs_and_targets(tokens_BS: torch.Tensor, loss_on: str = "number"):
    """Next-token inputs (B, 15) and targets (B, 15), IGNORE_INDEX where no loss is taken.
    No host synchronisation (no boolean-mask assignment), so a CUDA graph can capture it."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    inputs = tokens_BS[:, :-1]
    targets = tokens_BS[:, 1:]
    ignore = targets == _PAD_ID
    if loss_on == "number":                        # predictions of the name and of '|'
        ignore = ignore | (torch.arange(targets.shape[1], device=targets.device) < SEP_POS)
    return inputs, torch.where(ignore, IGNORE_INDEX, targets)


def number_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """The logits (B, 8, V) that predict the 8 digits (input positions 6..13)."""
    return logits_BTV[:, SEP_POS:SEP_POS + NUMBER_LEN]


def number_targets(tokens_BS: torch.Tensor) -> torch.Tensor:
    return tokens_BS[:, DIGIT_POS:DIGIT_POS + NUMBER_LEN]
