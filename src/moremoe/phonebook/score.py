"""Phonebook evaluation: exact match of the 8 digits given the name, greedy.

Greedy decoding gets all 8 digits right exactly when, under teacher forcing, the argmax at
each of the 8 digit positions is the right digit: until the first wrong digit the greedy
prefix and the true prefix coincide. So exact match is computed with one forward pass per
batch; ``greedy_decode`` does it step by step (tests check that the two agree).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import task as pb


@dataclass
class PhonebookScore:
    exact_match: float     # fraction of entries whose 8 digits are all right
    char_accuracy: float   # fraction of digits right
    entries: int


@torch.no_grad()
def score(model, tokens_BS: torch.Tensor, *, batch_size: int = 4096, device=None,
          autocast_dtype=None) -> PhonebookScore:
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    exact = right = 0
    try:
        for start in range(0, tokens_BS.shape[0], batch_size):
            batch = tokens_BS[start:start + batch_size].to(device)
            with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype,
                                enabled=autocast_dtype is not None):
                logits = model(batch[:, :-1]).logits
            hit = pb.number_logits(logits).argmax(-1) == pb.number_targets(batch)
            exact += hit.all(dim=1).sum().item()
            right += hit.sum().item()
    finally:
        model.train(was_training)
    n = tokens_BS.shape[0]
    return PhonebookScore(exact / max(n, 1), right / max(n * pb.NUMBER_LEN, 1), n)


@torch.no_grad()
def greedy_decode(model, names: list[str], *, device=None) -> list[str]:
    """Look up each name: feed ``$name|`` and greedily generate 8 tokens (argmax over V)."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    prompt = torch.tensor([pb.encode(pb.BOS + n + pb.SEP, pad_to=None) for n in names],
                          device=device)
    try:
        seq = prompt
        for _ in range(pb.NUMBER_LEN):
            nxt = model(seq).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    finally:
        model.train(was_training)
    return [pb.decode(row[prompt.shape[1]:]) for row in seq.tolist()]
