"""The SwiGLU experts op: y = Σ_j gates[:, j] · f_{idx[:, j]}(x), router-agnostic.

``swiglu_experts(x, gates, topk_idx, w_gate, w_up, w_down, impl=...)`` runs the grouped
Triton kernels (custom ops moremoe::swiglu_experts[_train[_bwd]], with fake tensors for
torch.compile and autograd for x, gates and the three weights; outside torch.compile their
bodies run directly, ops/eager.py) or the plain-torch reference. impl="auto" takes the
kernels on CUDA (for the dtypes they cover), the reference elsewhere.

An expert-parallel shard passes first_expert (its weights are experts [first_expert,
first_expert + M) of the whole layer; the slots of other ids add nothing and get no
gradient) and, to overlap its communication with the experts, chunks (RowChunks: the
tokens in chunks, with a callback before and after each; eager only).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from ..checks import check_expert_ids
from . import reference as ref
from .dispatch import kernel_dtype, needs_grad, resolve_impl
from .eager import call, call_autograd


@dataclass(frozen=True)
class RowChunks:
    """The tokens in chunks [bounds[c], bounds[c+1]) (bounds from 0 to N, host ints):
    before(c) is called before chunk c's rows of x are read, after(c, y_c) once y's rows of
    chunk c are final (enqueued on the current stream, so that work the callback enqueues
    on another stream sees them after a wait on this one). Both are called for every chunk,
    in order, empty ones included, so collectives they issue match across ranks."""
    bounds: tuple
    before: Optional[Callable[[int], None]] = None
    after: Optional[Callable[[int, Tensor], None]] = None

    def kernel_args(self) -> dict:
        return {"bounds": self.bounds, "before": self.before, "after": self.after}


def _kernels():
    from ..kernels import swiglu_experts
    return swiglu_experts


def _infer(x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
           w_down: Tensor, first_expert: Optional[int] = None,
           chunks: RowChunks | None = None) -> Tensor:
    kw = chunks.kernel_args() if chunks else {}
    return _kernels().forward(x, gates, idx, w_gate, w_up, w_down, first_expert=first_expert,
                              **kw)


infer_op = torch.library.custom_op("moremoe::swiglu_experts", partial(_infer, chunks=None),
                                   mutates_args=(), schema="(Tensor x, Tensor gates, Tensor "
                                   "idx, Tensor w_gate, Tensor w_up, Tensor w_down, SymInt? "
                                   "first_expert=None) -> Tensor")


@infer_op.register_fake
def _(x, gates, idx, w_gate, w_up, w_down, first_expert=None):
    return x.new_empty(x.shape)


def _block_rows(w_gate: Tensor) -> int:
    M, s, h = w_gate.shape
    return _kernels().config(h, s)["BM"]


def _train(x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
           w_down: Tensor, first_expert: Optional[int] = None,
           chunks: RowChunks | None = None) -> tuple[Tensor, ...]:
    """y, the saved act, xg, xu, and the routing metadata (order, offsets, block_expert,
    block_start) that the backward reuses."""
    from ..kernels.routing_meta import routing_meta
    meta = routing_meta(idx, w_gate.shape[0], _block_rows(w_gate),
                        first_expert=first_expert or 0, bounds=chunks and chunks.bounds)
    kw = {"before": chunks.before, "after": chunks.after} if chunks else {}
    y, act, xg, xu = _kernels().forward(x, gates, idx, w_gate, w_up, w_down, save=True,
                                        meta=meta, first_expert=first_expert, **kw)
    return y, act, xg, xu, meta.order, meta.offsets, meta.block_expert, meta.block_start


def _train_op(x, gates, idx, w_gate, w_up, w_down, first_expert=None, g_gate=None, g_up=None,
              g_down=None, keep=None):
    """The op's body: the accumulation targets (GradInto) are only handed to the backward."""
    return _train(x, gates, idx, w_gate, w_up, w_down, first_expert)


train_op = torch.library.custom_op(
    "moremoe::swiglu_experts_train", _train_op, mutates_args=(),
    schema="(Tensor x, Tensor gates, Tensor idx, Tensor w_gate, Tensor w_up, Tensor w_down, "
           "int? first_expert=None, Tensor? g_gate=None, Tensor? g_up=None, "
           "Tensor? g_down=None, Tensor? keep=None) -> (Tensor, Tensor, Tensor, Tensor, "
           "Tensor, Tensor, Tensor, Tensor)")


@train_op.register_fake
def _(x, gates, idx, w_gate, w_up, w_down, first_expert=None, g_gate=None, g_up=None,
      g_down=None, keep=None):
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
         block_expert: Tensor, block_start: Tensor, first_expert: Optional[int] = None
         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from ..kernels.routing_meta import RoutingMeta
    meta = RoutingMeta(order=order, offsets=offsets, block_expert=block_expert,
                       block_start=block_start, block_rows=_block_rows(w_gate),
                       tokens=idx.shape[0], top_k=idx.shape[1], first_expert=first_expert or 0)
    dx, dgates, dwg, dwu, dwd = _kernels().backward(dy, x, gates, idx, w_gate, w_up, w_down,
                                                    act, xg, xu, meta=meta,
                                                    first_expert=first_expert)
    return dx, dgates.to(gates.dtype), dwg, dwu, dwd


bwd_op = torch.library.custom_op(
    "moremoe::swiglu_experts_train_bwd", _bwd, mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor gates, Tensor idx, Tensor w_gate, Tensor w_up, "
           "Tensor w_down, Tensor act, Tensor xg, Tensor xu, Tensor order, Tensor offsets, "
           "Tensor block_expert, Tensor block_start, int? first_expert=None) -> (Tensor, Tensor, "
           "Tensor, Tensor, Tensor)")


@bwd_op.register_fake
def _(dy, x, gates, idx, w_gate, w_up, w_down, act, xg, xu, order, offsets, block_expert,
      block_start, first_expert=None):
    return (x.new_empty(x.shape), gates.new_empty(gates.shape), w_gate.new_empty(w_gate.shape),
            w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape))


def _bwd_into(dy: Tensor, x: Tensor, gates: Tensor, idx: Tensor, w_gate: Tensor, w_up: Tensor,
              w_down: Tensor, act: Tensor, xg: Tensor, xu: Tensor, order: Tensor,
              offsets: Tensor, block_expert: Tensor, block_start: Tensor, g_gate: Tensor,
              g_up: Tensor, g_down: Tensor, keep: Tensor, first_expert: Optional[int] = None
              ) -> tuple[Tensor, Tensor]:
    """_bwd with the weight gradients accumulated into g_* in place (GradInto)."""
    from ..kernels.routing_meta import RoutingMeta
    meta = RoutingMeta(order=order, offsets=offsets, block_expert=block_expert,
                       block_start=block_start, block_rows=_block_rows(w_gate),
                       tokens=idx.shape[0], top_k=idx.shape[1], first_expert=first_expert or 0)
    dx, dgates, *_ = _kernels().backward(dy, x, gates, idx, w_gate, w_up, w_down, act, xg,
                                         xu, meta=meta, first_expert=first_expert,
                                         into=(g_gate, g_up, g_down), keep=keep)
    return dx, dgates.to(gates.dtype)


# the weight gradients as a side effect: the op mutates g_* and keep (declared, so that
# torch.compile orders and keeps the writes) and autograd gets no weight gradient
bwd_into_op = torch.library.custom_op(
    "moremoe::swiglu_experts_train_bwd_into", _bwd_into,
    mutates_args=("g_gate", "g_up", "g_down", "keep"),
    schema="(Tensor dy, Tensor x, Tensor gates, Tensor idx, Tensor w_gate, Tensor w_up, "
           "Tensor w_down, Tensor act, Tensor xg, Tensor xu, Tensor order, Tensor offsets, "
           "Tensor block_expert, Tensor block_start, Tensor(a!) g_gate, Tensor(b!) g_up, "
           "Tensor(c!) g_down, Tensor(d!) keep, int? first_expert=None) -> (Tensor, Tensor)")


@bwd_into_op.register_fake
def _(dy, x, gates, idx, w_gate, w_up, w_down, act, xg, xu, order, offsets, block_expert,
      block_start, g_gate, g_up, g_down, keep, first_expert=None):
    return x.new_empty(x.shape), gates.new_empty(gates.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6], *output[1:], *inputs[7:11])
    ctx.first_expert = inputs[6]


def _backward(ctx, dy, *_unused, bwd=bwd_op, bwd_into=bwd_into_op):
    saved = ctx.saved_tensors
    if dy is None:                  # eager, y unused (ops/eager.py passes None, not zeros)
        dy = torch.zeros_like(saved[0])
    if saved[13] is not None:       # GradInto: the weights get no gradient through autograd
        dx, dgates = bwd_into(dy, *saved[:13], *saved[13:], ctx.first_expert)
        return dx, dgates, None, None, None, None, None, None, None, None, None
    dx, dgates, dwg, dwu, dwd = bwd(dy, *saved[:13], ctx.first_expert)
    return dx, dgates, None, dwg, dwu, dwd, None, None, None, None, None


def _backward_direct(ctx, dy, *_unused):
    return _backward(ctx, dy, bwd=_bwd, bwd_into=_bwd_into)


train_op.register_autograd(_backward, setup_context=_setup)


@dataclass(frozen=True)
class GradInto:
    """Where the fused backward puts the expert weight gradients instead of returning them
    to autograd: g_gate, g_up, g_down fp32 (the weights' shapes), added into where the
    int32 flag keep[0] is nonzero and stored over (no zeroing pass, old values unread)
    where it is 0; the backward then sets keep[0] = 1. nn/experts.py binds them to the
    parameters' .grad (docs/design.md, "The step's parameter-proportional work")."""
    g_gate: Tensor
    g_up: Tensor
    g_down: Tensor
    keep: Tensor

    def tensors(self) -> tuple:
        return self.g_gate, self.g_up, self.g_down, self.keep


def swiglu_experts(x_NH, gates_NK, topk_idx_NK, w_gate, w_up, w_down, *, impl: str = "auto",
                   check_ids: bool = True, first_expert: int | None = None,
                   chunks: RowChunks | None = None, grad_into: GradInto | None = None):
    """y (N, h) in x's dtype (the autocast dtype under autocast on the fused path).

    topk_idx must be int32 / int64 expert ids in [0, M) on every implementation; with
    check_ids (default) their range is checked, which reads two numbers back from the
    device; check_ids=False skips that for ids a router made (in range by construction).
    first_expert: the weights are a shard, experts [first_expert, first_expert + M) of a
    larger layer; ids outside are other shards' slots (not checked): they add nothing (a
    token with none of the shard's slots gets a zero row) and their gates no gradient.
    chunks: see RowChunks (eager only: the callbacks cannot be traced).
    grad_into: the fused path's weight gradients go there (GradInto; the weights must be
    fp32) and not to autograd; the reference refuses it (its gradients go to autograd)."""
    check_expert_ids(topk_idx_NK, w_gate.shape[0],
                     values=check_ids and first_expert is None)
    if chunks is not None and torch.compiler.is_compiling():
        raise RuntimeError("swiglu_experts(chunks=...) runs eagerly; call it outside "
                           "torch.compile")
    if resolve_impl(impl, x_NH) == "reference":
        if grad_into is not None:
            raise ValueError("grad_into needs the fused kernels (impl='triton', or 'auto' on "
                             "CUDA); the reference's weight gradients go through autograd")
        return _reference(x_NH, gates_NK, topk_idx_NK, w_gate, w_up, w_down, first_expert,
                          chunks)
    dt = kernel_dtype(x_NH)
    x, ws = x_NH.to(dt), (w_gate, w_up, w_down)
    if any(w.dtype != torch.float32 for w in ws):     # fp32 weights are read as they are
        ws = tuple(w.to(dt) for w in ws)
    wg, wu, wd = ws
    gates = gates_NK.float()
    if needs_grad(x_NH, gates_NK, w_gate, w_up, w_down):
        into = (None,) * 4
        if grad_into is not None:
            _check_into(grad_into, (w_gate, w_up, w_down), wg is w_gate)
            into = grad_into.tensors()
        return call_autograd(train_op, partial(_train_op_chunks, chunks=chunks), _setup,
                             _backward_direct, x, gates, topk_idx_NK, wg, wu, wd,
                             first_expert, *into)[0]
    return call(infer_op, partial(_infer, chunks=chunks), x, gates, topk_idx_NK, wg, wu, wd,
                first_expert)


def _check_into(into: GradInto, ws: tuple, fp32_weights: bool) -> None:
    if not fp32_weights:
        raise ValueError(f"grad_into needs fp32 expert weights, got {ws[0].dtype}")
    for name, g, w in zip(("g_gate", "g_up", "g_down"), into.tensors(), ws):
        if g.shape != w.shape or g.dtype != torch.float32 or not g.is_contiguous():
            raise ValueError(f"grad_into.{name} must be a contiguous float32 tensor of shape "
                             f"{tuple(w.shape)}, got {g.dtype} {tuple(g.shape)}")
    if into.keep.numel() != 1 or into.keep.dtype != torch.int32:
        raise ValueError(f"grad_into.keep must be an int32 tensor of one element, got "
                         f"{into.keep.dtype} {tuple(into.keep.shape)}")


def _train_op_chunks(x, gates, idx, w_gate, w_up, w_down, first_expert, *_into, chunks):
    return _train(x, gates, idx, w_gate, w_up, w_down, first_expert, chunks)


def _reference(x_NH, gates_NK, idx_NK, w_gate, w_up, w_down, first_expert, chunks):
    """The reference, its chunks' callbacks called in their order around it."""
    for c in range(len(chunks.bounds) - 1 if chunks and chunks.before else 0):
        chunks.before(c)
    y = ref.swiglu_experts_ref(x_NH, gates_NK, idx_NK, w_gate, w_up, w_down,
                               first_expert=first_expert)
    if chunks and chunks.after:
        for c, (b0, b1) in enumerate(zip(chunks.bounds, chunks.bounds[1:])):
            chunks.after(c, y[b0:b1])
    return y
