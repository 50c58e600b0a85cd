"""Fused standard router: top-k of ℓ = x Wᵀ without the (N, M) logits, for fair comparisons.

Reads x (N, h), W (M, h); writes top-k values (N, k) fp32, indices (N, k) int32 and gates
(N, k) fp32. The same sweep as the low-rank router with the logit tile computed as
Σ_h x_chunk W_chunkᵀ: each token block re-reads a (BM, h) tile of W per expert tile, so the
work grows with h where the low-rank router's grows with r. Training adds m, Z and psum; the
backward recomputes dℓ for chunks of experts into an (N, M_c) buffer of at most 1 GiB and
takes dx and dW from cuBLAS GEMMs on it (router_dense._linear_backward).

Designed for any N >= 0, M >= k, h in [16, 8192], k in [1, 64], bf16 / fp16 / fp32.
"""
from __future__ import annotations

from .router_dense import launch_backward, launch_psum
from .router_lowrank import DTYPES, MAX_K
from .router_topk import LINEAR, launch_sweep


def check_inputs(x, W, k: int) -> None:
    if x.dim() != 2 or W.dim() != 2:
        raise ValueError(f"x and W must be 2-D, got shapes {tuple(x.shape)}, {tuple(W.shape)}")
    M = W.shape[0]
    if W.shape[1] != x.shape[1]:
        raise ValueError(f"W must have shape (M, h) = ({M}, {x.shape[1]}), got {tuple(W.shape)}")
    if not 1 <= k <= min(M, MAX_K):
        raise ValueError(f"k must be in [1, min(M={M}, {MAX_K})] for the fused kernel, got {k}")
    if x.dtype not in DTYPES or W.dtype != x.dtype:
        raise TypeError(f"x and W must share one dtype of {DTYPES}, got {x.dtype}, {W.dtype}")


def infer(x, W, k: int, *, splits: int | None = None, config: dict | None = None):
    check_inputs(x, W, k)
    val, idx, gates, _, _ = launch_sweep(x, None, W, k, mode=LINEAR, splits=splits,
                                         config=config)
    return val, idx, gates


def train_forward(x, W, k: int, *, with_psum: bool = True, config: dict | None = None,
                  psum_splits: int | None = None):
    check_inputs(x, W, k)
    val, idx, gates, m, zs = launch_sweep(x, None, W, k, mode=LINEAR, stats=True,
                                          config=config)
    psum = launch_psum(x, W, m, zs, mode=LINEAR, splits=psum_splits,
                       config=config) if with_psum else None
    return val, idx, gates, m, zs, psum


def train_backward(x, W, m, zs, pbar, idx, dval, *, splits: int | None = None,
                   config: dict | None = None):
    """(dx (N, h) fp32, dW (M, h) fp32)."""
    return launch_backward(x, W, m, zs, pbar, idx, dval, mode=LINEAR, splits=splits,
                           config=config)
