"""Routing statistics: normalised routing entropy H_norm (paper Appendix G.1).

H_norm = -Σ_a p_a log p_a / log M with p_a = c_a / Σ_b c_b, the share of a layer's routed
(token, slot) pairs that expert a receives, counted over a whole data set. 1 means every
expert carries the same load, 0 that all routing went to one expert.
"""
from __future__ import annotations

import math

import torch


def normalized_entropy(counts_M: torch.Tensor) -> float:
    """H_norm of per-expert counts (M,); 0 for M = 1 or no routed pairs."""
    counts = counts_M.double()
    M, total = counts.numel(), counts.sum().item()
    if M <= 1 or total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * p.log()).sum().item() / math.log(M))


@torch.no_grad()
def layer_expert_counts(model, tokens_BT: torch.Tensor, *, batch_size: int = 4096,
                        device=None, autocast_dtype=None) -> list[torch.Tensor]:
    """Per-layer (M,) counts of routed (token, slot) pairs over all rows of tokens_BT."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    totals = None
    try:
        for start in range(0, tokens_BT.shape[0], batch_size):
            batch = tokens_BT[start:start + batch_size].to(device, non_blocking=True)
            with torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype,
                                enabled=autocast_dtype is not None):
                counts = model(batch, return_counts=True).expert_counts
            totals = counts if totals is None else [t + c for t, c in zip(totals, counts)]
    finally:
        model.train(was_training)
    return [t.cpu() for t in totals] if totals is not None else []


def routing_hnorm(model, tokens_BT: torch.Tensor, **kw) -> list[float]:
    """H_norm per layer over every token of tokens_BT."""
    return [normalized_entropy(c) for c in layer_expert_counts(model, tokens_BT, **kw)]
