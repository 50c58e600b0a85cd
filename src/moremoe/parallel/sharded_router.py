"""A router sharded over the expert-parallel group (beyond the paper, which replicates it):
rank e holds only the rows of its M_e = M/E experts (W_e of the standard router, R1_e of
the low-rank one; R2 replicated), over a batch every rank holds whole.

Forward: each rank scores all N tokens against its experts, keeps a local top-k_e
(k_e = min(k, M_e); the fused training sweep on CUDA, or in inference the router's own
inference kernel, the reference elsewhere) and (training) its row log-sum-exp; one all-gather brings the E lists (values, lse and the global ids, exact as
fp32 below 2^24 experts) to every rank and an exact merge (a kernel on CUDA) gives the
global top-k, ties to the lower global index as one process orders them
(ops/router_shard.merge_topk); on the reference path the shards also send their winners'
fp64 logits and the merge orders by those, so that near-ties across shards are decided as
the one-process reference decides them (docs/design.md, "Routing contract"). The router computes in the kernels' dtype (x's, or
autocast's), whatever its weights' dtype, as the single-process routers do. In training the global lse (N,) combines the local ones, each
rank computes its experts' columns of psum with it, and a second all-gather assembles psum.

Backward: the partial gradients of the scored matrix a (z = x R2ᵀ, or x) are summed over
the group once (dz is (N, r): the low-rank router's communication is r wide, not h), so
R2's and x's gradients are complete on every rank; R1_e's or W_e's are complete locally.
The global psum's gradient reaches every expert's logits through lse, whose partial
gradients are summed too; inside a layer that sum rides with the layer's own
(parallel/expert.py), so that all of a layer's backward collectives lie on one chain.

Legend: N tokens, h hidden, r rank, M experts, M_e = M/E per rank, k active, E ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_tensor
from ..nn.moe import MoEConfig
from ..nn.router import LinearRouter, LowRankRouter, RouterOutput
from ..ops.balance import expert_counts
from ..ops.dispatch import kernel_dtype, resolve_impl
from ..ops.reference import topk_gates
from ..ops.dispatch import needs_grad
from ..ops.router_shard import (combine_lse, exact_inputs, merge_topk, shard_psum, shard_select,
                               shard_topk)
from .collectives import (all_gather_stack, copy_to_group, gather_from_group, group_rank,
                          group_size)


EXACT_FLOAT_IDS = 2 ** 24     # expert ids below it travel exactly as fp32 with the values


def expert_range(experts: int, shards: int, shard: int) -> tuple[int, int]:
    """[lo, hi): the contiguous experts of rank `shard` among `shards` expert-parallel ranks."""
    if experts % shards:
        raise ValueError(f"experts M={experts} must be divisible by the expert-parallel size "
                         f"E={shards}: each rank owns M/E experts")
    per = experts // shards
    return shard * per, (shard + 1) * per


class ShardedRouter(nn.Module):
    """The router of `config` with its expert rows split over `group` (None: WORLD).

    Parameters: ``weight`` (M_e, h) or ``R1`` (M_e, r), sharded (rank e: rows
    [e·M_e, (e+1)·M_e) of the full router's); ``R2`` (r, h) replicated. Drawn as a router over
    M_e experts draws them; ``from_router`` copies a single-process router's."""

    def __init__(self, config: MoEConfig, group=None):
        super().__init__()
        self.group = group
        self.shard, self.shards = group_rank(group), group_size(group)
        M, k = config.experts, config.top_k
        self.lo, self.hi = expert_range(M, self.shards, self.shard)
        self.hidden, self.experts, self.top_k = config.hidden, M, k
        self.local_k = min(k, self.hi - self.lo)
        self.lowrank = config.is_lowrank
        self.impl = config.router_impl
        if self.lowrank:   # the rows of a router over M_e experts: the same init as one
            proto = LowRankRouter(config.hidden, self.hi - self.lo, self.local_k, config.rank,
                                  init=config.router_init, init_std=config.init_std)
            self.R1, self.R2 = proto.R1, proto.R2
        else:
            proto = LinearRouter(config.hidden, self.hi - self.lo, self.local_k,
                                 init_std=config.init_std)
            self.weight = proto.weight

    @classmethod
    def from_router(cls, router: LinearRouter | LowRankRouter, config: MoEConfig,
                    group=None) -> "ShardedRouter":
        """This rank's shard of a full router (the same on every rank)."""
        out = cls(config, group)
        with torch.no_grad():
            for name, full in router.named_parameters():
                getattr(out, name).copy_(full[out.lo:out.hi] if name in out.sharded_names()
                                         else full)
        param = next(router.parameters())
        return out.to(param.device, param.dtype)

    def sharded_names(self) -> set[str]:
        """Names of the parameters split by rows over the group (the others are replicated)."""
        return {"R1"} if self.lowrank else {"weight"}

    def scored(self, x_NH):
        """(a, w, exact): the matrix the shard's rows score, in the kernels' dtype, those
        rows (cast where they are read), and on the reference path what its exact
        selection needs (ops/router_shard.exact_inputs; None on the kernels' path)."""
        dt = kernel_dtype(x_NH)
        w = self.R1 if self.lowrank else self.weight
        R2 = self.R2.to(dt) if self.lowrank else None
        rank = self.R2.shape[0] if self.lowrank else None
        if resolve_impl(self.impl, x_NH, self.local_k, rank=rank) == "reference":
            a, exact = exact_inputs(x_NH.to(dt), R2)
            return a, w, exact
        return (F.linear(x_NH.to(dt), R2) if self.lowrank else x_NH.to(dt)), w, None

    def route(self, x_NH: torch.Tensor):
        """(RouterOutput with psum None, a, lse): the global top-k, gates and counts, the
        scored matrix as this rank's copy (its gradient summed over the group), and in
        training the global row log-sum-exp (N,) for ``global_psum`` (else None)."""
        check_tensor("x", x_NH, ndim=2, floating=True, last=self.hidden, last_name="hidden")
        if not self.training and not needs_grad(x_NH, *self.parameters()):
            val_e, idx_e, keys_e = shard_select(x_NH, *self.select_args(), self.local_k,
                                                impl=self.impl)
            topk_val, topk_idx, _ = self.merge(val_e, idx_e, None, keys_e)
            return RouterOutput(topk_val, topk_idx, topk_gates(topk_val), None, None), None, \
                None
        a, w, exact = self.scored(x_NH)
        a, = copy_to_group([a], self.group)
        val_e, idx_e, lse_e, keys_e = shard_topk(a, w, self.local_k, lowrank=self.lowrank,
                                                 impl=self.impl, exact=exact)
        topk_val, topk_idx, lse = self.merge(val_e, idx_e, lse_e if self.training else None,
                                             keys_e)
        counts = expert_counts(topk_idx, self.experts) if self.training else None
        return RouterOutput(topk_val, topk_idx, topk_gates(topk_val), None, counts), a, lse

    def select_args(self):
        """(w, R2 | None): the shard's rows and the replicated factor, for shard_select."""
        return (self.R1, self.R2) if self.lowrank else (self.weight, None)

    def merge(self, val_e, idx_e, lse_e=None, keys_e=None):
        """(global top-k values, their ids, the global lse when lse_e is given (training)
        else None) from this rank's local top-k (values, local ids) and row lse: one
        all-gather, one merge; with keys_e (the reference path's fp64 logits of the local
        winners) a second all-gather, and the merge orders by them (exact)."""
        ke, ids = self.local_k, (idx_e + self.lo).float()      # exact below 2^24 experts
        stats = [] if lse_e is None else [lse_e[:, None]]
        if self.experts < EXACT_FLOAT_IDS:
            packed = gather_from_group(torch.cat([val_e, *stats, ids], 1), self.group)
            idx_all = packed.detach()[..., ke + len(stats):].to(torch.int32)
        else:
            packed = gather_from_group(torch.cat([val_e, *stats], 1), self.group)
            idx_all = all_gather_stack(idx_e + self.lo, self.group)
        keys_all = None if keys_e is None else all_gather_stack(keys_e, self.group)
        topk_val, topk_idx = merge_topk(packed[..., :ke], idx_all, self.top_k, impl=self.impl,
                                        keys_ENK=keys_all)
        return topk_val, topk_idx, None if lse_e is None else combine_lse(packed[..., ke])

    def global_psum(self, a: torch.Tensor, lse_shard: torch.Tensor) -> torch.Tensor:
        """psum (M,), replicated, from ``route``'s a and this rank's copy of its lse (taken
        with copy_to_group, so that lse's partial gradients are summed)."""
        w = self.R1 if self.lowrank else self.weight
        psum_e = shard_psum(a, w, lse_shard, lowrank=self.lowrank, impl=self.impl)
        return gather_from_group(psum_e, self.group).reshape(-1)

    def forward(self, x_NH: torch.Tensor) -> RouterOutput:
        """A standalone router: RouterOutput as LinearRouter / LowRankRouter return it."""
        routed, a, lse = self.route(x_NH)
        if lse is not None:
            lse_shard, = copy_to_group([lse], self.group)
            routed.psum = self.global_psum(a, lse_shard)
        return routed

    def extra_repr(self) -> str:
        rows = f"experts [{self.lo}, {self.hi}) of {self.experts}"
        return f"hidden={self.hidden}, {rows}, top_k={self.top_k}, shards={self.shards}"
