"""The standard router op: logits x Wᵀ -> top-k values, indices, gates [, psum].

``router_linear(x, W, k, with_psum=..., impl=...)`` runs the fused Triton kernels on CUDA
(custom ops moremoe::router_linear[_train[_bwd]]) and the plain-torch reference elsewhere.
"""
from __future__ import annotations

from . import reference as ref
from .dispatch import compute_dtype, needs_grad, resolve_impl
from .router_common import register_router_ops


def _kernels():
    from ..kernels import router_linear
    return router_linear


infer_op, train_op, bwd_op = register_router_ops(
    "router_linear",
    infer=lambda x, W, _unused, k: _kernels().infer(x, W, k),
    train_forward=lambda x, W, k, with_psum: _kernels().train_forward(x, W, k,
                                                                      with_psum=with_psum),
    train_backward=lambda *args: _kernels().train_backward(*args))


def router_linear(x_NH, W_MH, k: int, *, with_psum: bool = False, impl: str = "auto"):
    """Returns (topk_val (N,k) fp32, topk_idx (N,k) int32, gates (N,k) fp32, psum (M,) | None)."""
    if resolve_impl(impl, x_NH, k) == "reference":
        val, idx, psum = ref.router_linear_ref(x_NH, W_MH, k, with_psum=with_psum)
        return val, idx, ref.topk_gates(val), psum
    dt = compute_dtype(x_NH)          # under autocast, the autocast dtype
    x, W = x_NH.to(dt), W_MH.to(dt)
    if not (with_psum or needs_grad(x_NH, W_MH)):
        val, idx, gates = infer_op(x, W, W, k)
        return val, idx, gates, None
    val, idx, _, _, psum = train_op(x, W, k, with_psum)
    return val, idx, ref.topk_gates(val), (psum if with_psum else None)
