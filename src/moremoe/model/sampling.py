"""Picking the next token from the logits: greedy, or sampled with a temperature, top-k and
top-p (nucleus) restriction.

Every operation has shapes fixed by (B, V) and no host sync, so the same function runs in the
eager loop (model/generate.py) and inside a captured decode step (model/static.py). A sample
is the argmax of p / E with E ~ Exp(1) drawn per logit (the exponential race: P(token i wins)
= p_i), which needs no torch.multinomial and draws from the generator given, or the default
one of the logits' device (the one a CUDA graph replays with fresh offsets).

Legend: B rows, V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_int, check_number


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (top_k and top_p unused). top_k: keep the k largest logits;
    top_p: keep the smallest set of the largest probabilities whose mass reaches p (the
    largest is always kept); both: top-k first, then top-p on what is left."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        check_number("temperature", self.temperature, low_open=False)
        if self.top_k is not None:
            check_int("top_k", self.top_k)
        if self.top_p is not None:
            check_number("top_p", self.top_p)
            if self.top_p > 1:
                raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def restrict(logits_BV: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The logits with those outside the top-k / top-p set at -inf (float32)."""
    logits_BV = logits_BV.float()
    V = logits_BV.shape[-1]
    if top_k is not None and top_k < V:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        before_BV = probs_BV.cumsum(-1) - probs_BV        # mass of the larger ones
        drop_BV = before_BV >= top_p                      # a top_p under fp32's range is 0:
        drop_BV[:, 0] = False                             # the largest is kept all the same
        sorted_BV = sorted_BV.masked_fill(drop_BV, -math.inf)
        logits_BV = torch.full_like(logits_BV, -math.inf).scatter(-1, order_BV, sorted_BV)
    return logits_BV


def sample(logits_BV: torch.Tensor, sampling: Sampling = Sampling(),
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row (B,) int64."""
    if sampling.greedy:
        return logits_BV.argmax(-1)
    # the largest logit made 0 before dividing: a temperature so small that logits / T would
    # overflow (1e-40) leaves the largest at 0 and the others at -inf, i.e. greedy, not NaN
    logits_BV = logits_BV.float()
    logits_BV = (logits_BV - logits_BV.amax(-1, keepdim=True)) / sampling.temperature
    logits_BV = restrict(logits_BV, sampling.top_k, sampling.top_p)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    race_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
    # a draw of exactly 0 would make 0 / 0 = NaN for an excluded token, which argmax takes
    return (probs_BV / race_BV.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)
