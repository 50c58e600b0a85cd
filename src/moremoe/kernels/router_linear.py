"""Fused standard router: top-k of ℓ = x Wᵀ without the (N, M) logits, for fair comparisons.

Reads x (N, h), W (M, h); writes top-k values (N, k) fp32, indices (N, k) int32 and gates
(N, k) fp32. The same sweep as the low-rank router with the logit tile computed as
Σ_h x_chunk W_chunkᵀ: each token block re-reads a (BM, h) tile of W per expert tile, so the
work grows with h where the low-rank router's grows with r (tiles of 256 experts, and of
128 rows from h = 1,024: router_topk.sweep_config). Training adds m, Z and psum; the
backward takes chunks of tokens, logits, dx and dW from cuBLAS GEMMs and dℓ from one Triton
kernel, in at most 1 GiB (router_train._linear_backward).

Designed for any N >= 0, M >= k, h in [16, 8192], k in [1, 64], bf16 / fp16 / fp32.
"""
from __future__ import annotations

from .router_train import check_rows, launch_backward
from .router_train import train_forward as _train_forward
from ._common import LINEAR
from .router_topk import launch_sweep


def infer(x, W, k: int, *, splits: int | None = None, config: dict | None = None):
    check_rows(x, W, k)
    val, idx, gates, _, _ = launch_sweep(x, W, k, mode=LINEAR, splits=splits,
                                         config=config)
    return val, idx, gates


def train_forward(x, W, k: int, **kw):
    """(val, idx, gates, m, Z, psum | None); kw: with_psum, config, psum_splits."""
    check_rows(x, W, k)
    return _train_forward(x, W, k, mode=LINEAR, **kw)


def train_backward(x, W, m, norm, pbar, idx, dval, *, splits: int | None = None,
                   config: dict | None = None):
    """(dx (N, h) fp32, dW (M, h) fp32)."""
    return launch_backward(x, W, m, norm, pbar, idx, dval, mode=LINEAR, splits=splits,
                           config=config)
