"""Autoregressive decoding: a prefill over the prompt, then one token per step.

With the key/value cache each step runs the model on the one new token; without it each step
reruns the whole sequence (the reference the cached path is tested against). Greedy unless
``temperature > 0`` (then sampled, restricted by top_k / top_p: model/sampling.py). The
static cache and the captured decode step (model/static.py) give the same tokens faster;
this loop is their reference. A row stops at eos_id, at the end of any of stop_sequences
(token ids), or when stop_fn(row's new tokens) says so (lm-eval's stop strings, checked on
decoded text); decoding ends when every row has stopped.

Legend: B batch, T prompt length, V vocabulary.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch

from ..checks import check_int, check_tensor
from .cache import KVCache
from .sampling import Sampling, sample


@torch.no_grad()
def generate(model, prompt_BT: torch.Tensor, max_new_tokens: int, *, eos_id: int | None = None,
             stop_sequences: Sequence[Sequence[int]] | None = None,
             stop_fn: Callable[[list[int]], bool] | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
             generator: torch.Generator | None = None) -> list[list[int]]:
    """The new tokens of each row (the stop token or sequence included), at most
    max_new_tokens each. Rows share one length of prompt (no padding)."""
    check_arguments(model, prompt_BT, max_new_tokens, eos_id, stop_sequences, generator)
    sampling = Sampling(temperature, top_k, top_p)
    B, T = prompt_BT.shape
    was_training = model.training
    model.eval()
    cache = KVCache(T + max_new_tokens) if use_cache else None
    tokens_BT, step_BT = prompt_BT, prompt_BT
    new: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    try:
        for _ in range(max_new_tokens):
            logits_BV = model(step_BT if use_cache else tokens_BT, cache=cache).logits[:, -1]
            next_B = sample(logits_BV.float(), sampling, generator)
            if not record(new, done, next_B.tolist(), eos_id, stop_sequences, stop_fn):
                break
            step_BT = next_B[:, None].to(prompt_BT.dtype)
            tokens_BT = torch.cat([tokens_BT, step_BT], dim=1)
    finally:
        model.train(was_training)
    return new


def check_arguments(model, prompt_BT, max_new_tokens, eos_id, stop_sequences,
                    generator) -> None:
    """TypeError / ValueError naming the argument, before any decoding; the prompt and the
    new tokens must fit max_seq_len."""
    config = getattr(model, "config", None)
    if not (callable(model) and hasattr(config, "vocab") and hasattr(config, "max_seq_len")):
        raise TypeError(f"model must be a moremoe Transformer, got {type(model).__name__}")
    check_tensor("prompt", prompt_BT, ndim=2, integer=True)
    check_int("max_new_tokens", max_new_tokens)
    if 0 in prompt_BT.shape:
        raise ValueError(f"prompt must hold at least one row of at least one token, got shape "
                         f"{tuple(prompt_BT.shape)}")
    V = model.config.vocab
    lo, hi = (int(v) for v in torch.aminmax(prompt_BT))
    if lo < 0 or hi >= V:
        raise ValueError(f"prompt holds token ids from {lo} to {hi}; they must be in [0, {V}) "
                         f"for the model's vocabulary of {V}")
    if eos_id is not None:
        check_int("eos_id", eos_id, low=0)
    try:
        for seq in stop_sequences or ():
            for t in seq:
                operator.index(t)
    except TypeError:
        raise TypeError(f"stop_sequences must be a list of token-id lists, got "
                        f"{stop_sequences!r}") from None
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    T, max_len = prompt_BT.shape[1], model.config.max_seq_len
    if T + max_new_tokens > max_len:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds "
                         f"max_seq_len={max_len}; truncate the prompt from the left")


def record(new: list[list[int]], done: list[bool], tokens: list[int], eos_id, stop_sequences,
           stop_fn) -> bool:
    """Append a step's token to each row still going; False once every row has stopped."""
    for b, tok in enumerate(tokens):
        if not done[b]:
            new[b].append(tok)
            done[b] = _stopped(new[b], eos_id, stop_sequences, stop_fn)
    return not all(done)


def _stopped(row: list[int], eos_id, stop_sequences, stop_fn) -> bool:
    if eos_id is not None and row[-1] == eos_id:
        return True
    if stop_sequences and any(len(s) and row[-len(s):] == list(s) for s in stop_sequences):
        return True
    return bool(stop_fn and stop_fn(row))
