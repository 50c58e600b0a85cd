"""The SwiGLU experts op: y = Σ_j gates[:, j] · f_{idx[:, j]}(x), router-agnostic.

``swiglu_experts(x, gates, topk_idx, w_gate, w_up, w_down, impl=...)`` runs the grouped
Triton kernels (custom ops moremoe::swiglu_experts[_train[_bwd]], with fake tensors for
torch.compile and autograd for x, gates and the three weights; outside torch.compile their
bodies run directly, ops/eager.py) or the plain-torch reference. impl="auto" takes the kernels on CUDA (for the dtypes they cover), the reference
elsewhere.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_expert_ids
from . import reference as ref
from .dispatch import kernel_dtype, needs_grad, resolve_impl
from .eager import call, call_autograd


def _kernels():
    from ..kernels import swiglu_experts
    return swiglu_experts


def _infer(x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
           w_down: Tensor) -> Tensor:
    return _kernels().forward(x, gates, idx, w_gate, w_up, w_down)


infer_op = torch.library.custom_op("moremoe::swiglu_experts", _infer, mutates_args=())


@infer_op.register_fake
def _(x, gates, idx, w_gate, w_up, w_down):
    return x.new_empty(x.shape)


def _block_rows(w_gate: Tensor) -> int:
    M, s, h = w_gate.shape
    return _kernels().config(h, s)["BM"]


def _train(x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
           w_down: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                    Tensor]:
    """y, the saved act, xg, xu, and the routing metadata (order, offsets, block_expert,
    block_start) that the backward reuses."""
    from ..kernels.routing_meta import routing_meta
    meta = routing_meta(idx, w_gate.shape[0], _block_rows(w_gate))
    y, act, xg, xu = _kernels().forward(x, gates, idx, w_gate, w_up, w_down, save=True,
                                      meta=meta)
    return y, act, xg, xu, meta.order, meta.offsets, meta.block_expert, meta.block_start


train_op = torch.library.custom_op("moremoe::swiglu_experts_train", _train, mutates_args=())


@train_op.register_fake
def _(x, gates, idx, w_gate, w_up, w_down):
    from ..kernels.routing_meta import max_blocks
    P, (M, s, _) = idx.numel(), w_gate.shape
    B = max_blocks(P, M, _block_rows(w_gate))
    i64 = torch.int64
    return (x.new_empty(x.shape), x.new_empty((P, s)), x.new_empty((P, s)),
            x.new_empty((P, s)), idx.new_empty((P,), dtype=i64),
            idx.new_empty((M + 1,), dtype=i64), idx.new_empty((B,), dtype=torch.int32),
            idx.new_empty((B,), dtype=i64))


def _bwd(dy: Tensor, x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
         w_down: Tensor, act: Tensor, xg: Tensor, xu: Tensor, order: Tensor, offsets: Tensor,
         block_expert: Tensor,
         block_start: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from ..kernels.routing_meta import RoutingMeta
    meta = RoutingMeta(order=order, offsets=offsets, block_expert=block_expert,
                       block_start=block_start, block_rows=_block_rows(w_gate),
                       tokens=idx.shape[0], top_k=idx.shape[1])
    dx, dgates, dwg, dwu, dwd = _kernels().backward(dy, x, gates, idx, w_gate, w_up, w_down,
                                                    act, xg, xu, meta=meta)
    return dx, dgates.to(gates.dtype), dwg, dwu, dwd


bwd_op = torch.library.custom_op("moremoe::swiglu_experts_train_bwd", _bwd, mutates_args=())


@bwd_op.register_fake
def _(dy, x, gates, idx, w_gate, w_up, w_down, act, xg, xu, order, offsets, block_expert,
      block_start):
    return (x.new_empty(x.shape), gates.new_empty(gates.shape), w_gate.new_empty(w_gate.shape),
            w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1:])


def _backward(ctx, dy, *_unused, bwd=bwd_op):
    if dy is None:                  # eager, y unused (ops/eager.py passes None, not zeros)
        dy = torch.zeros_like(ctx.saved_tensors[0])
    dx, dgates, dwg, dwu, dwd = bwd(dy, *ctx.saved_tensors)
    return dx, dgates, None, dwg, dwu, dwd


def _backward_direct(ctx, dy, *_unused):
    return _backward(ctx, dy, bwd=_bwd)


train_op.register_autograd(_backward, setup_context=_setup)


def swiglu_experts(x_NH, gates_NK, topk_idx_NK, w_gate, w_up, w_down, *, impl: str = "auto",
                   check_ids: bool = True):
    """y (N, h) in x's dtype (the autocast dtype under autocast on the fused path).

    topk_idx must be int32 / int64 expert ids in [0, M) on every implementation; with
    check_ids (default) their range is checked, which reads two numbers back from the
    device; check_ids=False skips that for ids a router made (in range by construction)."""
    check_expert_ids(topk_idx_NK, w_gate.shape[0], values=check_ids)
    if resolve_impl(impl, x_NH) == "reference":
        return ref.swiglu_experts_ref(x_NH, gates_NK, topk_idx_NK, w_gate, w_up, w_down)
    dt = kernel_dtype(x_NH)
    x, ws = x_NH.to(dt), (w_gate, w_up, w_down)
    if any(w.dtype != torch.float32 for w in ws):     # fp32 weights are read as they are
        ws = tuple(w.to(dt) for w in ws)
    wg, wu, wd = ws
    gates = gates_NK.float()
    if needs_grad(x_NH, gates_NK, w_gate, w_up, w_down):
        return call_autograd(train_op, _train, _setup, _backward_direct, x, gates, topk_idx_NK,
                             wg, wu, wd)[0]
    return call(infer_op, _infer, x, gates, topk_idx_NK, wg, wu, wd)
