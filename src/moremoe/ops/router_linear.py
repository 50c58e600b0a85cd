"""The standard router op: logits x Wᵀ -> top-k values, indices, gates [, psum].

``router_linear(x, W, k, with_psum=..., impl=...)`` runs the fused Triton kernels on CUDA
(custom ops moremoe::router_linear[_train[_bwd]]; outside torch.compile their bodies run
directly, ops/eager.py) and the plain-torch reference elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference as ref
from .dispatch import kernel_dtype, needs_grad, resolve_impl
from .eager import call, call_autograd
from .router_common import infer_fakes, save_for_backward, train_backward, train_fakes


def _kernels():
    from ..kernels import router_linear
    return router_linear


def _infer(x: Tensor, W: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels().infer(x, W, k)


infer_op = torch.library.custom_op("moremoe::router_linear", _infer, mutates_args=())


@infer_op.register_fake
def _(x, W, k):
    return infer_fakes(x, k)


def _train(x: Tensor, W: Tensor, k: int,
           with_psum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(val, idx, m, norm, psum); psum is zeros when not asked for."""
    val, idx, _, m, norm, psum = _kernels().train_forward(x, W, k, with_psum=with_psum)
    if psum is None:
        psum = x.new_zeros(W.shape[0], dtype=torch.float32)
    return val, idx, m, norm, psum


train_op = torch.library.custom_op("moremoe::router_linear_train", _train, mutates_args=())


@train_op.register_fake
def _(x, W, k, with_psum):
    return train_fakes(x, W, k)


def _bwd(x: Tensor, W: Tensor, m: Tensor, norm: Tensor, pbar: Optional[Tensor], idx: Tensor,
         dval: Tensor) -> tuple[Tensor, Tensor]:
    dx, dW = _kernels().train_backward(x, W, m, norm, pbar, idx, dval)
    return dx.to(x.dtype), dW.to(W.dtype)


bwd_op = torch.library.custom_op("moremoe::router_linear_train_bwd", _bwd, mutates_args=())


@bwd_op.register_fake
def _(x, W, m, norm, pbar, idx, dval):
    return x.new_empty(x.shape), W.new_empty(W.shape)


def _backward(ctx, *grads):
    return train_backward(bwd_op, ctx, *grads)


def _backward_direct(ctx, *grads):
    return train_backward(_bwd, ctx, *grads)


train_op.register_autograd(_backward, setup_context=save_for_backward)


def router_linear(x_NH, W_MH, k: int, *, with_psum: bool = False, impl: str = "auto"):
    """Returns (topk_val (N,k) fp32, topk_idx (N,k) int32, gates (N,k) fp32, psum (M,) | None)."""
    if resolve_impl(impl, x_NH, k) == "reference":
        val, idx, psum = ref.router_linear_ref(x_NH, W_MH, k, with_psum=with_psum)
        return val, idx, ref.topk_gates(val), psum
    dt = kernel_dtype(x_NH)          # under autocast, the autocast dtype
    x, W = x_NH.to(dt), W_MH.to(dt)
    if not (with_psum or needs_grad(x_NH, W_MH)):
        val, idx, gates = call(infer_op, _infer, x, W, k)
        return val, idx, gates, None
    val, idx, _, _, psum = call_autograd(train_op, _train, save_for_backward,
                                         _backward_direct, x, W, k, with_psum)
    return val, idx, ref.topk_gates(val), (psum if with_psum else None)
