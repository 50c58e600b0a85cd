"""The collectives of expert parallelism, with the autograd each needs (torch.distributed:
gloo on CPU, NCCL on GPU; every function takes a process group, None for WORLD).

A tensor is either replicated (every rank holds the same value and, downstream of a
replicated loss, the same complete gradient) or partial/sharded (each rank holds its part).
The wrappers move between the two (Megatron's convention):

  copy_to_group      identity forward, all-reduce (sum) backward: a replicated tensor read
                     by per-rank work, whose gradients are per-rank partials;
  reduce_from_group  all-reduce (sum) forward, identity backward: partials summed into a
                     replicated tensor whose gradient is already complete on every rank;
  gather_from_group  all-gather forward, own slice backward (a replicated consumer);
  sum_replicated     all-reduce (sum) forward; backward the SUM over ranks of the gradient,
                     computed as E · grad because its consumer is replicated (see there);
  PendingSum         reduce_from_group of a tensor in pieces, each all-reduced in place
                     (asynchronously) as soon as it is final, so that the communication of
                     one piece overlaps the computation of the next.

Ordering: ranks must issue collectives in one order, and autograd's order among
independent branches depends on the graph, which differs between ranks (which experts hold
tokens). So each layer keeps its backward collectives on one dependency chain: one merged
copy_to_group per layer, sum_replicated without a backward collective, the row
all-to-alls of parallel/exchange.py chained by data.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def group_rank(group=None) -> int:
    return dist.get_rank(group)


def group_size(group=None) -> int:
    return dist.get_world_size(group)


@torch.no_grad()
def all_reduce_many(tensors: list[Tensor], group=None) -> list[Tensor]:
    """Sums of each tensor over the group, one all-reduce per dtype (tensors flattened into
    one buffer); the same shapes on every rank, so an empty buffer is skipped everywhere."""
    out = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for ids in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in ids])
        if flat.numel():
            dist.all_reduce(flat, group=group)
        for i, piece in zip(ids, flat.split([tensors[i].numel() for i in ids])):
            out[i] = piece.view(tensors[i].shape)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *all_reduce_many(list(grads), ctx.group))


def copy_to_group(tensors: list[Tensor | None], group=None) -> list[Tensor | None]:
    """The tensors as they are; in backward the gradients of those that need one are summed
    over the group in one node, so the layer has one collective there, not one per tensor
    (whether a tensor needs a gradient must agree across ranks, as its shape does)."""
    graded = [i for i, t in enumerate(tensors)
              if t is not None and t.requires_grad and torch.is_grad_enabled()]
    out = list(tensors)
    if graded:
        for i, t in zip(graded, _CopyToGroup.apply(group, *(tensors[i] for i in graded))):
            out[i] = t
    return out


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        out = t.contiguous().clone()
        if out.numel():
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_group(t: Tensor, group=None) -> Tensor:
    """Σ over the group of t (same shape everywhere); the gradient passes unchanged."""
    return _ReduceFromGroup.apply(t, group)


class _SumReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.size = group_size(group)
        out = t.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def sum_replicated(t: Tensor, group=None) -> Tensor:
    """Σ over the group of t, whose consumer is replicated: every rank computes the same
    function of the sum and adds it to its loss with the same weight (the balancing loss
    from all-reduced statistics). The gradient of Σ_e loss_e with respect to rank e's t is
    then the sum over ranks of identical gradients, E · grad, formed locally: no collective
    in backward whose order against the layer's all-to-alls autograd would have to keep."""
    return _SumReplicated.apply(t, group)


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.rank = group_rank(group)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(group_size(group))]
        dist.all_gather(parts, t, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


def gather_from_group(t: Tensor, group=None) -> Tensor:
    """(E, *t.shape): every rank's t (same shape everywhere), for a replicated consumer, so
    the gradient of this rank's t is its own slice of the (complete) gradient."""
    return _GatherFromGroup.apply(t, group)


@torch.no_grad()
def all_gather_stack(t: Tensor, group=None) -> Tensor:
    """(E, *t.shape) without autograd (indices, weights for a checkpoint)."""
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)


CHUNKS = 4          # the most chunks (rounds) a layer's communication is cut into
BLOCK_ROWS = 64     # rows of an expert-kernel block (kernels/swiglu_experts.config, "BM")


def auto_chunks(tokens: int, top_k: int, experts: int, most: int = CHUNKS) -> int:
    """The chunks of a layer's overlap of communication with its experts: the largest power
    of two up to `most` that leaves each expert about a block of rows in each chunk
    (N k / (M C) >= BM). More chunks hide more of the communication, but each cuts every
    expert's rows into one more, emptier block, and each block reads its expert's weights
    again (benchmarks/NOTES.md, issue 26)."""
    chunks = 1
    while chunks * 2 <= most and tokens * top_k >= chunks * 2 * experts * BLOCK_ROWS:
        chunks *= 2
    return chunks


class PendingSum:
    """The in-place sums over the group of pieces of one tensor, started as each piece is
    final (``start``, an async all-reduce) and waited for by ``settle``, which returns the
    summed tensor with reduce_from_group's gradient (passed unchanged). Every rank must
    start the same pieces in the same order (shapes agree across ranks)."""

    def __init__(self, group=None):
        self.group, self.works = group, []

    def start(self, _chunk: int, piece: Tensor) -> None:
        if piece.numel():
            self.works.append(dist.all_reduce(piece, group=self.group, async_op=True))

    def settle(self, t: Tensor) -> Tensor:
        return _Settled.apply(t, self)


class _Settled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, pending):
        for work in pending.works:
            work.wait()
        pending.works = []      # they hold views of t: no cycle through t's graph to them
        ctx.mark_dirty(t)                  # the all-reduces summed t in place
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None
