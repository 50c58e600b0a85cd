"""The low-rank (MoRE) router op: logits (x R2ᵀ) R1ᵀ -> top-k values, indices, gates [, psum].

``router_lowrank(x, R1, R2, k, with_psum=..., impl=...)`` runs the fused Triton kernels on
CUDA (custom ops moremoe::router_lowrank[_train[_bwd]], traceable by torch.compile;
outside torch.compile their bodies run directly, ops/eager.py) and the
plain-torch reference elsewhere. In training (psum requested or gradients needed) z = x R2ᵀ
is a cuBLAS GEMM whose autograd gives dx and dR2 from the kernel's dz.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference as ref
from .dispatch import kernel_dtype, needs_grad, resolve_impl
from .eager import call, call_autograd
from .router_common import infer_fakes, save_for_backward, train_backward, train_fakes


def _kernels():
    from ..kernels import router_lowrank
    return router_lowrank


def _infer(x: Tensor, R1: Tensor, R2: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels().infer(x, R1, R2, k)


infer_op = torch.library.custom_op("moremoe::router_lowrank", _infer, mutates_args=())


@infer_op.register_fake
def _(x, R1, R2, k):
    return infer_fakes(x, k)


def _train(z: Tensor, R1: Tensor, k: int,
           with_psum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(val, idx, m, norm, psum) from z = x R2ᵀ; psum is zeros when not asked for."""
    val, idx, _, m, norm, psum = _kernels().train_forward(z, R1, k, with_psum=with_psum)
    if psum is None:
        psum = z.new_zeros(R1.shape[0], dtype=torch.float32)
    return val, idx, m, norm, psum


train_op = torch.library.custom_op("moremoe::router_lowrank_train", _train, mutates_args=())


@train_op.register_fake
def _(z, R1, k, with_psum):
    return train_fakes(z, R1, k)


def _bwd(z: Tensor, R1: Tensor, m: Tensor, norm: Tensor, pbar: Optional[Tensor], idx: Tensor,
         dval: Tensor) -> tuple[Tensor, Tensor]:
    dz, dR1 = _kernels().train_backward(z, R1, m, norm, pbar, idx, dval)
    return dz.to(z.dtype), dR1.to(R1.dtype)


bwd_op = torch.library.custom_op("moremoe::router_lowrank_train_bwd", _bwd, mutates_args=())


@bwd_op.register_fake
def _(z, R1, m, norm, pbar, idx, dval):
    return z.new_empty(z.shape), R1.new_empty(R1.shape)


def _backward(ctx, *grads):
    return train_backward(bwd_op, ctx, *grads)


def _backward_direct(ctx, *grads):
    return train_backward(_bwd, ctx, *grads)


train_op.register_autograd(_backward, setup_context=save_for_backward)


def router_lowrank(x_NH, R1_MR, R2_RH, k: int, *, with_psum: bool = False, impl: str = "auto"):
    """Returns (topk_val (N,k) fp32, topk_idx (N,k) int32, gates (N,k) fp32, psum (M,) | None)."""
    if resolve_impl(impl, x_NH, k, rank=R2_RH.shape[0]) == "reference":
        val, idx, psum = ref.router_lowrank_ref(x_NH, R1_MR, R2_RH, k, with_psum=with_psum)
        return val, idx, ref.topk_gates(val), psum
    dt = kernel_dtype(x_NH)          # under autocast, the autocast dtype
    x, R1, R2 = x_NH.to(dt), R1_MR.to(dt), R2_RH.to(dt)
    if not (with_psum or needs_grad(x_NH, R1_MR, R2_RH)):
        val, idx, gates = call(infer_op, _infer, x, R1, R2, k)
        return val, idx, gates, None
    z_NR = F.linear(x, R2)
    val, idx, _, _, psum = call_autograd(train_op, _train, save_for_backward,
                                         _backward_direct, z_NR, R1.to(z_NR.dtype), k,
                                         with_psum)
    return val, idx, ref.topk_gates(val), (psum if with_psum else None)
