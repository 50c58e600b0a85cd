"""Fused low-rank (MoRE) router: top-k of ℓ = (x R2ᵀ) R1ᵀ without the (N, M) logits.

Reads x (N, h), R2 (r, h), R1 (M, r); writes top-k values (N, k) fp32 (exact logits of the
winners, descending), indices (N, k) int32 and gates (N, k) fp32 = softmax over the k.
Inference: z = x R2ᵀ is accumulated in fp32 and narrowed to x's dtype on chip; the (N, M)
logits never touch HBM (per tile only C candidate keys per row do, and z (N, r) for the
pick: router_candidates). Training: z comes from cuBLAS (it is the saved activation of the
backward), the first pass adds the online-softmax row statistics m, Z, a second kernel the
column sums psum (M,), and the backward returns dz, dR1 (dX, dR2 are GEMMs on dz in the op
layer).

Designed for any N >= 0, M >= k, h in [16, 8192] (any h >= 1 works), r in [8, 256]
(up to 512), k in [1, 64], bf16 / fp16 / fp32 inputs of one dtype, any strides.
Constants: router_topk.sweep_config (BN = 64 rows for one warpgroup MMA, BM = 128 experts
per tile so that keys keep 15 exact mantissa bits; fp32 32 x 64 tiles).
"""
from __future__ import annotations

from .router_train import check_rows, launch_backward
from .router_train import train_forward as _train_forward
from . import MAX_RANK
from ._common import LOWRANK, ZGIVEN
from .router_topk import launch_sweep


def check_inputs(x, R1, R2, k: int) -> None:
    """x (N, h), R2 (r, h), R1 (M, r)."""
    check_rows(x, R2, 1, w_name="R2", rows="r")
    r = R2.shape[0]
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"rank r must be in [1, {MAX_RANK}] for the fused kernel, got {r}")
    check_rows(R2.T, R1, k, x_name="R2", w_name="R1", width="r")   # R1 (M, r) against R2ᵀ (h, r)


def infer(x, R1, R2, k: int, *, splits: int | None = None, config: dict | None = None):
    """(val, idx, gates) of the fused inference kernel."""
    check_inputs(x, R1, R2, k)
    val, idx, gates, _, _ = launch_sweep(x, R1, k, r2=R2, mode=LOWRANK, splits=splits,
                                         config=config)
    return val, idx, gates


def train_forward(z, R1, k: int, **kw):
    """(val, idx, gates, m, Z, psum | None) from z = x R2ᵀ (N, r); kw: with_psum, config,
    psum_splits."""
    check_rows(z, R1, k, x_name="z", w_name="R1", width="r")
    return _train_forward(z, R1, k, mode=ZGIVEN, **kw)


def train_backward(z, R1, m, norm, pbar, idx, dval, *, splits: int | None = None,
                   config: dict | None = None):
    """(dz (N, r) fp32, dR1 (M, r) fp32); pbar None when psum has no gradient."""
    return launch_backward(z, R1, m, norm, pbar, idx, dval, mode=ZGIVEN, splits=splits,
                           config=config)
