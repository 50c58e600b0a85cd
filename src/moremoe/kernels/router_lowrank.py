"""Fused low-rank (MoRE) router: top-k of ℓ = (x R2ᵀ) R1ᵀ without the (N, M) logits.

Reads x (N, h), R2 (r, h), R1 (M, r); writes top-k values (N, k) fp32 (exact logits of the
winners, descending), indices (N, k) int32 and gates (N, k) fp32 = softmax over the k.
Inference: z = x R2ᵀ is accumulated in fp32 and narrowed to x's dtype on chip; neither z
(N, r) nor the logits (N, M) touch HBM. Training: z comes from cuBLAS (it is the saved
activation of the backward), the sweep adds the online-softmax row statistics m, Z, a
second kernel the column sums psum (M,), and the backward returns dz, dR1 (dX, dR2 are
GEMMs on dz in the op layer).

Designed for any N >= 0, M >= k, h in [16, 8192] (any h >= 1 works), r in [8, 256]
(up to 512), k in [1, 64], bf16 / fp16 / fp32 inputs of one dtype, any strides.
Constants: see router_topk.sweep_config (BN = 64 rows for one warpgroup MMA, BM = 128
experts per tile so that keys keep 16 exact mantissa bits).
"""
from __future__ import annotations

import torch

from .router_dense import launch_backward, launch_psum
from .router_topk import LOWRANK, ZGIVEN, launch_sweep

MAX_K, MAX_RANK = 64, 512
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(x, R1, R2, k: int) -> None:
    if x.dim() != 2 or R1.dim() != 2 or R2.dim() != 2:
        raise ValueError(f"x, R1, R2 must be 2-D, got shapes {tuple(x.shape)}, "
                         f"{tuple(R1.shape)}, {tuple(R2.shape)}")
    M, r = R1.shape
    if R2.shape != (r, x.shape[1]):
        raise ValueError(f"R2 must have shape (r, h) = ({r}, {x.shape[1]}), got {tuple(R2.shape)}")
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"rank r must be in [1, {MAX_RANK}] for the fused kernel, got {r}")
    if not 1 <= k <= min(M, MAX_K):
        raise ValueError(f"k must be in [1, min(M={M}, {MAX_K})] for the fused kernel, got {k}")
    if x.dtype not in DTYPES or R1.dtype != x.dtype or R2.dtype != x.dtype:
        raise TypeError(f"x, R1, R2 must share one dtype of {DTYPES}, got "
                        f"{x.dtype}, {R1.dtype}, {R2.dtype}")


def infer(x, R1, R2, k: int, *, splits: int | None = None, config: dict | None = None):
    """(val, idx, gates) of the fused inference kernel."""
    check_inputs(x, R1, R2, k)
    val, idx, gates, _, _ = launch_sweep(x, R2, R1, k, mode=LOWRANK, splits=splits,
                                         config=config)
    return val, idx, gates


def train_forward(z, R1, k: int, *, with_psum: bool = True, config: dict | None = None,
                  psum_splits: int | None = None):
    """(val, idx, gates, m, Z, psum | None) from z = x R2ᵀ (N, r)."""
    check_inputs(z, R1, R1.new_empty(R1.shape[1], z.shape[1]), k)
    val, idx, gates, m, zs = launch_sweep(z, None, R1, k, mode=ZGIVEN, stats=True, config=config)
    psum = launch_psum(z, R1, m, zs, mode=ZGIVEN, splits=psum_splits,
                       config=config) if with_psum else None
    return val, idx, gates, m, zs, psum


def train_backward(z, R1, m, zs, pbar, idx, dval, *, splits: int | None = None,
                   config: dict | None = None):
    """(dz (N, r) fp32, dR1 (M, r) fp32); pbar None when psum has no gradient."""
    return launch_backward(z, R1, m, zs, pbar, idx, dval, mode=ZGIVEN, splits=splits,
                           config=config)
