"""Custom ops (torch.library, with fake tensors for torch.compile) and autograd for the fused
routers. Each router has three ops: ``<name>`` (inference), ``<name>_train`` (top-k, m, Z and
psum, differentiable) and ``<name>_train_bwd`` (its backward)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def register_router_ops(name: str, infer: Callable, train_forward: Callable,
                        train_backward: Callable):
    """Define moremoe::<name>, moremoe::<name>_train (+ autograd) and moremoe::<name>_train_bwd.

    infer(x, w1, w2, k) runs the fused inference kernel; train_forward(a, w, k, with_psum)
    and train_backward(a, w, m, Z, pbar, idx, dval) the training kernels on the matrix
    operand a (z for the low-rank router, x for the standard one) and weight w."""

    @torch.library.custom_op(f"moremoe::{name}", mutates_args=())
    def infer_op(x: Tensor, w1: Tensor, w2: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        return infer(x, w1, w2, k)

    @infer_op.register_fake
    def _(x, w1, w2, k):
        shape = (x.shape[0], k)
        return (x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32),
                x.new_empty(shape, dtype=torch.float32))

    @torch.library.custom_op(f"moremoe::{name}_train", mutates_args=())
    def train_op(a: Tensor, w: Tensor, k: int,
                 with_psum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        val, idx, _, m, zs, psum = train_forward(a, w, k, with_psum=with_psum)
        if psum is None:
            psum = a.new_zeros(w.shape[0], dtype=torch.float32)
        return val, idx, m, zs, psum

    @train_op.register_fake
    def _(a, w, k, with_psum):
        N, M = a.shape[0], w.shape[0]
        f32 = torch.float32
        return (a.new_empty((N, k), dtype=f32), a.new_empty((N, k), dtype=torch.int32),
                a.new_empty((N,), dtype=f32), a.new_empty((N,), dtype=f32),
                a.new_empty((M,), dtype=f32))

    @torch.library.custom_op(f"moremoe::{name}_train_bwd", mutates_args=())
    def bwd_op(a: Tensor, w: Tensor, m: Tensor, zs: Tensor, pbar: Optional[Tensor], idx: Tensor,
               dval: Tensor) -> tuple[Tensor, Tensor]:
        da, dw = train_backward(a, w, m, zs, pbar, idx, dval)
        return da.to(a.dtype), dw.to(w.dtype)

    @bwd_op.register_fake
    def _(a, w, m, zs, pbar, idx, dval):
        return a.new_empty(a.shape), w.new_empty(w.shape)

    def setup_context(ctx, inputs, output):
        a, w, k, with_psum = inputs
        val, idx, m, zs, _ = output
        ctx.save_for_backward(a, w, m, zs, idx)
        ctx.with_psum = with_psum

    def backward(ctx, dval, didx, dm, dzs, dpsum):
        a, w, m, zs, idx = ctx.saved_tensors
        if dval is None:
            dval = torch.zeros(idx.shape, device=a.device, dtype=torch.float32)
        pbar = dpsum if ctx.with_psum else None
        da, dw = bwd_op(a, w, m, zs, pbar, idx, dval.float())
        return da, dw, None, None

    train_op.register_autograd(backward, setup_context=setup_context)
    return infer_op, train_op, bwd_op
