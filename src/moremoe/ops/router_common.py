"""What the two routers' custom ops share: their fake tensors (shapes and dtypes for
torch.compile) and the backward of the training op, given that router's backward op. Each
router defines its own three ops explicitly (ops/router_lowrank.py, ops/router_linear.py):
``<name>`` (inference), ``<name>_train`` (top-k, m, Z and psum; differentiable) and
``<name>_train_bwd`` (its backward).

Outside torch.compile the ops' bodies run directly (ops/eager.py).

Legend: a the matrix the router's weight w scores (z = x R2ᵀ with w = R1 for the low-rank
router, x with w = W for the standard one); m, norm the online softmax's row max and
normaliser Z; p̄ the gradient of psum; dval the gradient of the top-k values.
"""
from __future__ import annotations

import torch
from torch import Tensor


def infer_fakes(x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(val fp32, idx int32, gates fp32), each (N, k)."""
    shape = (x.shape[0], k)
    return (x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32),
            x.new_empty(shape, dtype=torch.float32))


def train_fakes(a: Tensor, w: Tensor, k: int) -> tuple[Tensor, ...]:
    """(val, idx, m, norm, psum): (N, k) fp32, (N, k) int32, (N,) fp32 twice, (M,) fp32."""
    N, M, f32 = a.shape[0], w.shape[0], torch.float32
    return (a.new_empty((N, k), dtype=f32), a.new_empty((N, k), dtype=torch.int32),
            a.new_empty((N,), dtype=f32), a.new_empty((N,), dtype=f32),
            a.new_empty((M,), dtype=f32))


def save_for_backward(ctx, inputs, output) -> None:
    a, w, k, with_psum = inputs
    val, idx, m, norm, _ = output
    ctx.save_for_backward(a, w, m, norm, idx)
    ctx.with_psum = with_psum


def train_backward(bwd_op, ctx, dval, didx, dm, dnorm, dpsum):
    """Gradients of (a, w) through the router's backward op (or its body); psum's gradient
    only when the forward computed psum (its zeros otherwise carry none) and one arrived."""
    a, w, m, norm, idx = ctx.saved_tensors
    if dval is None:
        dval = torch.zeros(idx.shape, device=a.device, dtype=torch.float32)
    pbar = dpsum if ctx.with_psum else None          # None: only the top-k values' part
    da, dw = bwd_op(a, w, m, norm, pbar, idx, dval.float())
    return da, dw, None, None

