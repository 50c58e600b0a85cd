"""Validation loss and perplexity: next-token cross-entropy over whole sequences.

Each sequence of T tokens gives T - 1 predictions (token t+1 from tokens <= t). The loss is
their mean over all sequences (a token-weighted mean, so batches of different sizes combine
exactly) and the perplexity its exponential. The model runs in eval mode, under bf16
autocast on CUDA. The cross-entropy takes the logits in chunks of at most CE_CHUNK
elements, each cast to fp32 alone: a whole batch's fp32 logits and log-probabilities were
the run's peak memory (MoRE-1792's 52 GiB on an H200 at 64 sequences a batch, 31 of them
these two copies).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..parallel.ddp import unwrap
from ..runtime import autocast_dtype, progress_bar

CE_CHUNK = 1 << 26      # logits a cross-entropy call casts to fp32 (256 MB)


def _loss_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Σ of the next-token cross-entropy over the rows, fp64, in chunks of CE_CHUNK logits."""
    V = logits_BTV.shape[-1]
    flat, tgt = logits_BTV.reshape(-1, V), targets_BT.reshape(-1)
    rows = max(1, CE_CHUNK // V)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for i in range(0, flat.shape[0], rows):
        total += F.cross_entropy(flat[i:i + rows].float(), tgt[i:i + rows],
                                 reduction="sum").double()
    return total


@torch.no_grad()
def evaluate_perplexity(model, seqs_NT: np.ndarray | torch.Tensor, *, batch_size: int = 8,
                        max_batches: int | None = None, device=None,
                        return_counts: bool = False, progress: bool = False) -> dict:
    """dict(loss, perplexity, tokens); with return_counts also expert_counts, a list of
    per-layer (M,) int64 counts of routed (token, slot) pairs (for H_norm). progress: a
    bar over the batches on stderr."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seqs_NT.ndim != 2 or seqs_NT.shape[1] < 2:
        raise ValueError(f"seqs_NT must be (N, T) with T >= 2, got shape {tuple(seqs_NT.shape)}")
    model = unwrap(model)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    amp = autocast_dtype(device)
    n = seqs_NT.shape[0] if max_batches is None else min(seqs_NT.shape[0], max_batches * batch_size)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    counts, tokens = None, 0
    bar = progress_bar(-(-n // batch_size), desc="perplexity", enabled=progress)
    try:
        for start in range(0, n, batch_size):
            batch = seqs_NT[start:min(start + batch_size, n)]
            batch = torch.as_tensor(np.asarray(batch, dtype=np.int64)
                                    if not isinstance(batch, torch.Tensor) else batch)
            batch = batch.to(device, dtype=torch.long, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=amp, enabled=amp is not None):
                out = model(batch[:, :-1], return_counts=return_counts)
            loss_sum += _loss_sum(out.logits, batch[:, 1:])
            tokens += batch[:, 1:].numel()
            if return_counts:
                c = out.expert_counts
                counts = c if counts is None else [a + b for a, b in zip(counts, c)]
            bar.update()
        bar.close()
    finally:
        model.train(was_training)
    loss = loss_sum.item() / tokens if tokens else float("nan")
    result = {"loss": loss, "perplexity": math.exp(loss) if tokens else float("nan"),
              "tokens": tokens}
    if return_counts:
        result["expert_counts"] = [c.cpu() for c in counts] if counts else []
    return result
