"""Expert parallelism for one MoE / MoRE layer (the paper's Appendix F.3 and its figure of
the two data flows): E ranks of a process group (None: WORLD) each own M/E contiguous experts, rank
e the experts [e·M/E, (e+1)·M/E).

tokens="replicated" (the paper's (a)): every rank holds the whole batch x (N, h), routes all
N tokens with the whole router, runs its experts on the (token, slot) pairs routed to them
only (a compact pair list), and one all-reduce sums the E partial outputs. With
shard_router=True the router is split too (parallel/sharded_router.py).

tokens="local" (the paper's (b), data + expert parallelism): rank e holds its own N_e
tokens (any N_e >= 0), routes them with a replicated router, and an all-to-all sends each
(token, slot) pair to the rank owning its expert (counts exchanged first, uneven splits); the
experts run on the rows received, a second all-to-all brings their outputs back, and the
gates combine them locally. The Switch loss uses counts, psum and N summed over the group,
so it equals one process's on the global batch.

Gradient conventions (what a trainer must reduce, over which group):
- tokens="replicated": x and the loss are replicated; the output all-reduce passes the
  (complete) gradient back unchanged and the experts' partial gradients of x, the gates and
  (sharded router) the global lse are summed over the group before they reach the router.
  Every parameter's gradient is then complete where it lives and the router's (replicated)
  equal on every rank: nothing to reduce over the EP group (sync_gradients is a no-op).
- tokens="local": each rank's backward gives its share of the gradient of S = Σ_e loss_e,
  loss_e = rank e's loss with the layer's aux loss added once (the same value on every
  rank). The trainer's objective is the rank mean J = S / E (DDP's convention): replicated
  parameters (the router, and the model outside the experts) must be averaged over the
  group, as DDP does; expert shards already hold their complete ∂S/∂W (the reverse
  all-to-all brings every rank's share) and must be divided by E, never all-reduced.
  ``sync_gradients`` does both. The psum all-reduce's backward is a sum over ranks (formed
  as E · grad, collectives.sum_replicated), so the mean of the ranks' router gradients of
  the balancing loss equals one process's gradient of it on the global batch. Under DDP,
  keep the expert shards out of DDP (DDP._set_params_and_buffers_to_ignore_for_model with
  sharded_names()) and give DDP a process group of its own (dist.new_group over the same
  ranks), so that its gradient buckets never interleave with this layer's all-to-alls on
  one communicator.

An expert shard that receives no pairs still takes part in every collective and gets zero
gradients, as one process gives an expert without tokens.

Legend: N tokens, h hidden, M experts, M_e = M/E per rank, k active, E ranks, P pairs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_tensor
from ..nn.experts import SwiGLUExperts
from ..nn.moe import MoEConfig, MoELayer, MoEOutput
from ..nn.router import LinearRouter, LowRankRouter
from ..ops.balance import expert_counts, switch_loss
from .collectives import (all_reduce_many, all_gather_stack, all_to_all, copy_to_group,
                          exchange_counts, group_rank, group_size, reduce_from_group,
                          sum_replicated)
from .sharded_router import ShardedRouter, expert_range

TOKENS = ("replicated", "local")


def _full_router(c: MoEConfig) -> LinearRouter | LowRankRouter:
    if c.is_lowrank:
        return LowRankRouter(c.hidden, c.experts, c.top_k, c.rank, init=c.router_init,
                             init_std=c.init_std, impl=c.router_impl)
    return LinearRouter(c.hidden, c.experts, c.top_k, init_std=c.init_std,
                        impl=c.router_impl)


class ExpertParallelMoE(nn.Module):
    """This rank's part of a MoELayer of `config`: ``router`` (replicated, or a
    ShardedRouter) and ``experts``, a SwiGLUExperts of the rank's M_e experts. Parameter
    names are MoELayer's; ``sharded_names`` says which are split by rows over the group.

    The constructor draws this rank's shard and a router of its own: call
    ``broadcast_replicated()`` once on the device so every rank holds rank 0's router.
    ``shard_moe_layer`` instead takes each rank's slice of a single-process layer."""

    def __init__(self, config: MoEConfig, group=None, *, tokens: str = "replicated",
                 shard_router: bool = False):
        super().__init__()
        if tokens not in TOKENS:
            raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
        if shard_router and tokens != "replicated":
            raise ValueError(f"shard_router=True needs tokens='replicated' (each rank scores "
                             f"every token against its experts), got tokens={tokens!r}")
        self.config, self.group, self.tokens = config, group, tokens
        self.shard, self.shards = group_rank(group), group_size(group)
        self.lo, self.hi = expert_range(config.experts, self.shards, self.shard)
        self.router = ShardedRouter(config, group) if shard_router else _full_router(config)
        self.experts = SwiGLUExperts(config.hidden, config.width, self.hi - self.lo,
                                     init_std=config.init_std, impl=config.experts_impl)

    def sharded_names(self) -> set[str]:
        """Parameters split by rows over the group (rank e holds rows [lo, hi) of the
        single-process tensor); every other parameter is replicated."""
        names = {f"experts.{n}" for n, _ in self.experts.named_parameters()}
        if isinstance(self.router, ShardedRouter):
            names |= {f"router.{n}" for n in self.router.sharded_names()}
        return names

    def forward(self, x: torch.Tensor, *, return_counts: bool = False) -> MoEOutput:
        """x (..., h): the whole batch (tokens="replicated") or this rank's tokens ("local")
        -> MoEOutput as MoELayer's, with the global counts and losses; with tokens="local"
        its `router` (psum included) describes this rank's tokens."""
        c = self.config
        check_tensor("x", x, floating=True, last=c.hidden, last_name="hidden")
        x_NH = x.reshape(-1, c.hidden)
        if self.tokens == "local":
            y_NH, routed = self._forward_local(x_NH)
        else:
            y_NH, routed = self._forward_replicated(x_NH)
        counts, psum = routed.counts, routed.psum
        if counts is None and return_counts:
            counts = expert_counts(routed.topk_idx, c.experts)
        n_tokens = x_NH.shape[0]
        if self.tokens == "local" and counts is not None:
            counts = reduce_from_group(counts, self.group)
            n_tokens = int(counts.sum()) // c.top_k          # the global batch
        switch = aux = None
        if psum is not None:
            if self.tokens == "local":
                psum = sum_replicated(psum, self.group)
            switch = switch_loss(psum, counts, n_tokens, c.top_k)
            aux = c.balance_coef * switch
        return MoEOutput(y_NH.reshape(x.shape), aux, switch, counts, routed)

    def _experts_on_pairs(self, x_PH, gates_P1, ids_P1):
        """The gated expert outputs gates · f_id(x) of P pairs, (P, h) in x's dtype."""
        if x_PH.shape[0]:
            return self.experts(x_PH, gates_P1, ids_P1, check_ids=False)
        # no pairs here: an empty output that is still in the graph of x, the gates and the
        # weights, so that this rank's backward runs the collectives the others run (and
        # the weights get zero gradients, as one process gives an expert without tokens)
        anchor = sum(w.reshape(-1)[:0].sum() for w in self.experts.parameters())
        return (x_PH * gates_P1 + anchor).to(x_PH.dtype)

    def _forward_replicated(self, x_NH):
        """(y (N, h), RouterOutput): the whole batch routed, this rank's pairs, one sum."""
        if isinstance(self.router, ShardedRouter):
            routed, a, lse = self.router.route(x_NH)
        else:
            routed, a, lse = self.router(x_NH), None, None
        # one node sums the partial gradients of x, the gates and lse in backward
        x_in, gates_in, lse_in = copy_to_group([x_NH, routed.gates, lse], self.group)
        if lse is not None:
            routed.psum = self.router.global_psum(a, lse_in)
        N, k = routed.topk_idx.shape
        flat = routed.topk_idx.reshape(-1).long()
        pair = ((flat >= self.lo) & (flat < self.hi)).nonzero().squeeze(1)
        tok = pair // k
        ids = (flat.index_select(0, pair) - self.lo).to(torch.int32)[:, None]
        gates = gates_in.reshape(-1).index_select(0, pair)[:, None]
        y_PH = self._experts_on_pairs(x_in.index_select(0, tok), gates, ids)
        y_NH = x_NH.new_zeros(N, x_NH.shape[1], dtype=torch.float32)
        y_NH = y_NH.index_add(0, tok, y_PH.float()).to(x_NH.dtype)
        return reduce_from_group(y_NH, self.group), routed

    def _forward_local(self, x_NH):
        """(y (N_e, h), RouterOutput of the local tokens): dispatch, experts, combine."""
        routed = self.router(x_NH)
        N, k = routed.topk_idx.shape
        M_e = self.hi - self.lo
        flat = routed.topk_idx.reshape(-1).long()
        dest = flat // M_e
        order = torch.argsort(dest, stable=True)      # pairs grouped by destination rank
        send_E = torch.bincount(dest, minlength=self.shards)
        send, recv = send_E.tolist(), exchange_counts(send_E, self.group)
        tok = order // k
        ids = (flat - dest * M_e).index_select(0, order).to(torch.int32)
        x_recv = all_to_all(x_NH.index_select(0, tok), send, recv, self.group)
        ids_recv = all_to_all(ids, send, recv, self.group)[:, None]
        ones = torch.ones(x_recv.shape[0], 1, device=x_NH.device, dtype=torch.float32)
        y_recv = self._experts_on_pairs(x_recv, ones, ids_recv)
        y_back = all_to_all(y_recv, recv, send, self.group)
        gates = routed.gates.reshape(-1).index_select(0, order)[:, None]
        y_NH = x_NH.new_zeros(N, x_NH.shape[1], dtype=torch.float32)
        return y_NH.index_add(0, tok, y_back.float() * gates).to(x_NH.dtype), routed

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """tokens="local": average the replicated parameters' gradients over the group (as
        DDP would) and divide the expert shards' by E, so that each equals one process's
        gradient of the rank-mean loss. tokens="replicated": nothing to do."""
        if self.tokens == "replicated":
            return
        sharded = self.sharded_names()
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        replicated = [p for n, p in params if n not in sharded]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
        for p, g in zip(replicated, all_reduce_many(grads, self.group)):
            p.grad = g / self.shards
        for n, p in params:
            if n in sharded and p.grad is not None:
                p.grad /= self.shards

    @torch.no_grad()
    def broadcast_replicated(self) -> None:
        """Every rank takes group rank 0's replicated parameters."""
        group = dist.group.WORLD if self.group is None else self.group
        src = dist.get_global_rank(group, 0)
        sharded = self.sharded_names()
        for name, p in self.named_parameters():
            if name not in sharded:
                dist.broadcast(p.data, src=src, group=self.group)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process MoELayer's state dict, whole, on every rank (a collective:
        every rank of the group calls it)."""
        sharded = self.sharded_names()
        return {name: all_gather_stack(t, self.group).flatten(0, 1) if name in sharded
                else t.detach().clone() for name, t in self.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's rows of a single-process MoELayer's state dict."""
        sharded = self.sharded_names()
        for name, p in self.named_parameters():
            if name not in state:
                raise ValueError(f"state has no {name!r}; expected a MoELayer state dict "
                                 f"with keys {sorted(dict(self.named_parameters()))}")
            piece = state[name][self.lo:self.hi] if name in sharded else state[name]
            if piece.shape != p.shape:
                raise ValueError(f"state[{name!r}] has shape {tuple(state[name].shape)}, "
                                 f"expected the layer's {self.config.label}")
            p.copy_(piece)

    def extra_repr(self) -> str:
        return (f"{self.config.label}, tokens={self.tokens}, experts [{self.lo}, {self.hi}) "
                f"on rank {self.shard} of {self.shards}")


def shard_moe_layer(layer: MoELayer, group=None, *, tokens: str = "replicated",
                    shard_router: bool = False) -> ExpertParallelMoE:
    """This rank's ExpertParallelMoE holding its slice of `layer` (built alike on every
    rank, e.g. from one seed): the same function as `layer`, spread over the group."""
    ep = ExpertParallelMoE(layer.config, group, tokens=tokens, shard_router=shard_router)
    ep.load_full_state_dict(layer.state_dict())
    return ep.to(next(layer.parameters()).device)
