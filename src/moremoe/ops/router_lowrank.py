"""The low-rank (MoRE) router op: logits (x R2ᵀ) R1ᵀ -> top-k values, indices, gates [, psum].

``router_lowrank(x, R1, R2, k, with_psum=..., impl=...)`` runs the fused Triton kernels on
CUDA (custom ops moremoe::router_lowrank[_train[_bwd]], traceable by torch.compile) and the
plain-torch reference elsewhere. In training (psum requested or gradients needed) z = x R2ᵀ
is a cuBLAS GEMM whose autograd gives dx and dR2 from the kernel's dz.
"""
from __future__ import annotations

import torch.nn.functional as F

from . import reference as ref
from .dispatch import compute_dtype, needs_grad, resolve_impl
from .router_common import register_router_ops


def _kernels():
    from ..kernels import router_lowrank
    return router_lowrank


infer_op, train_op, bwd_op = register_router_ops(
    "router_lowrank",
    infer=lambda x, R1, R2, k: _kernels().infer(x, R1, R2, k),
    train_forward=lambda z, R1, k, with_psum: _kernels().train_forward(z, R1, k,
                                                                       with_psum=with_psum),
    train_backward=lambda *args: _kernels().train_backward(*args))


def router_lowrank(x_NH, R1_MR, R2_RH, k: int, *, with_psum: bool = False, impl: str = "auto"):
    """Returns (topk_val (N,k) fp32, topk_idx (N,k) int32, gates (N,k) fp32, psum (M,) | None)."""
    if resolve_impl(impl, x_NH, k) == "reference":
        val, idx, psum = ref.router_lowrank_ref(x_NH, R1_MR, R2_RH, k, with_psum=with_psum)
        return val, idx, ref.topk_gates(val), psum
    dt = compute_dtype(x_NH)          # under autocast, the autocast dtype
    x, R1, R2 = x_NH.to(dt), R1_MR.to(dt), R2_RH.to(dt)
    if not (with_psum or needs_grad(x_NH, R1_MR, R2_RH)):
        val, idx, gates = infer_op(x, R1, R2, k)
        return val, idx, gates, None
    z_NR = F.linear(x, R2)
    val, idx, _, _, psum = train_op(z_NR, R1.to(z_NR.dtype), k, with_psum)
    return val, idx, ref.topk_gates(val), (psum if with_psum else None)
