"""Expert parallelism for one MoE / MoRE layer (the paper's Appendix F.3 and its figure of
the two data flows): E ranks of a process group (None: WORLD) each own M/E contiguous experts, rank
e the experts [e·M/E, (e+1)·M/E).

tokens="replicated" (the paper's (a)): every rank holds the whole batch x (N, h) and routes
all N tokens with the whole router (with shard_router=True the router is split too,
parallel/sharded_router.py). The routing goes as it is, (N, k) ids and gates, into the
fused expert kernels restricted to this rank's experts (ops/swiglu_experts, first_expert):
they gather the rows of the rank's slots themselves, skip the others' and write y (N, h) in
the kernels' dtype, zero for a token with no slot here. One all-reduce sums the E partial
outputs, in C chunks of tokens, each started as soon as its rows are written, so that it
travels while the next chunk's experts run. On the wire: N h values (the kernels' dtype).

tokens="local" (the paper's (b), data + expert parallelism): rank e holds its own N_e
tokens (any N_e >= 0) and routes them with a replicated router; each token's row goes once
to each other rank holding one of its experts, with its slots' ids and gates, in C rounds
of uneven all-to-alls; the rows for rank e's own experts stay (gathered straight into the
experts' input, no collective and no copy) and are computed first, while the others
travel; the receiving rank runs the same restricted kernels on the rows it got (round by
round, as they arrive) and sends back one row per (token, rank), already gated and summed
over that rank's slots; the sender adds each token's rows in one kernel (ops/token_rows),
its kept rows read from its own experts' output. parallel/exchange.py has the layouts and
what crosses the wire. The
Switch loss uses counts, psum and N summed over the group, so it equals one process's on
the global batch.

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
  all-to-alls bring every rank's share) and must be divided by E, never all-reduced.
  ``sync_gradients`` does both. The psum all-reduce's backward is a sum over ranks (formed
  as E · grad, collectives.sum_replicated), so the mean of the ranks' router gradients of
  the balancing loss equals one process's gradient of it on the global batch. Under DDP,
  keep the expert shards out of DDP (DDP._set_params_and_buffers_to_ignore_for_model with
  sharded_names()) and give DDP a process group of its own (dist.new_group over the same
  ranks), so that its gradient buckets never interleave with this layer's all-to-alls on
  one communicator.

Every collective of a layer's backward lies on one dependency chain, so all ranks issue
them in one order. An expert shard that gets no pairs still takes part in every collective
and gets zero gradients, as one process gives an expert without tokens. The results do not
depend on C (chunks): only when communication is issued does.

Legend: N tokens, h hidden, M experts, M_e = M/E per rank, k active, E ranks, C chunks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_int, check_tensor
from ..nn.experts import SwiGLUExperts
from ..nn.moe import MoEConfig, MoELayer, MoEOutput
from ..nn.router import LinearRouter, LowRankRouter
from ..ops.balance import expert_counts, switch_loss
from ..ops.dispatch import kernel_dtype
from ..ops.swiglu_experts import RowChunks, swiglu_experts
from .collectives import (PendingSum, all_gather_stack, all_reduce_many, auto_chunks,
                          copy_to_group, group_rank, group_size, reduce_from_group,
                          sum_replicated)
from .exchange import RowExchange, plan_rows
from .sharded_router import ShardedRouter, expert_range

TOKENS = ("replicated", "local")


def _full_router(c: MoEConfig) -> LinearRouter | LowRankRouter:
    if c.is_lowrank:
        return LowRankRouter(c.hidden, c.experts, c.top_k, c.rank, init=c.router_init,
                             init_std=c.init_std, impl=c.router_impl)
    return LinearRouter(c.hidden, c.experts, c.top_k, init_std=c.init_std,
                        impl=c.router_impl)


def chunk_bounds(n: int, chunks: int) -> tuple[int, ...]:
    """C + 1 bounds of n rows in C near-equal chunks (the same on every rank for one n)."""
    return tuple(c * n // chunks for c in range(chunks + 1))


def _anchored(y, *inputs):
    """y, in the autograd graph of the inputs that need a gradient even where y is not (the
    reference experts with no pair here): this rank's backward then runs the collectives
    the other ranks run, and the inputs get zero gradients, as one process gives them."""
    if not torch.is_grad_enabled() or y.requires_grad:
        return y
    graded = [t for t in inputs if t.requires_grad]
    return y + sum(t.reshape(-1)[:0].sum() for t in graded) if graded else y


class ExpertParallelMoE(nn.Module):
    """This rank's part of a MoELayer of `config`: ``router`` (replicated, or a
    ShardedRouter) and ``experts``, a SwiGLUExperts of the rank's M_e experts. Parameter
    names are MoELayer's; ``sharded_names`` says which are split by rows over the group.

    The constructor draws this rank's shard and a router of its own: call
    ``broadcast_replicated()`` once on the device so every rank holds rank 0's router.
    ``shard_moe_layer`` instead takes each rank's slice of a single-process layer."""

    def __init__(self, config: MoEConfig, group=None, *, tokens: str = "replicated",
                 shard_router: bool = False, chunks: int | None = None):
        """chunks: C, the chunks of tokens (replicated) or rounds (local) whose
        communication overlaps the experts of the next; 1 sends everything at once; None
        (default) chooses from the batch (collectives.auto_chunks)."""
        super().__init__()
        if tokens not in TOKENS:
            raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
        if shard_router and tokens != "replicated":
            raise ValueError(f"shard_router=True needs tokens='replicated' (each rank scores "
                             f"every token against its experts), got tokens={tokens!r}")
        self.config, self.group, self.tokens = config, group, tokens
        self.chunks = None if chunks is None else check_int("chunks", chunks)
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
            y_NH, routed, n_tokens = self._forward_local(x_NH)
        else:
            (y_NH, routed), n_tokens = self._forward_replicated(x_NH), x_NH.shape[0]
        counts, psum = routed.counts, routed.psum
        if counts is None and return_counts:
            counts = expert_counts(routed.topk_idx, c.experts)
        if self.tokens == "local" and counts is not None:
            counts = reduce_from_group(counts, self.group)
        switch = aux = None
        if psum is not None:
            if self.tokens == "local":
                psum = sum_replicated(psum, self.group)
            switch = switch_loss(psum, counts, n_tokens, c.top_k)
            aux = c.balance_coef * switch
        return MoEOutput(y_NH.to(x.dtype).reshape(x.shape), aux, switch, counts, routed)

    def route(self, x_NH: torch.Tensor):
        """(RouterOutput, a, lse): the router's output for x (N, h); with a sharded router
        also its scored matrix and global lse for the psum (else None, None)."""
        if isinstance(self.router, ShardedRouter):
            return self.router.route(x_NH)
        return self.router(x_NH), None, None

    def run_experts(self, x_NH, gates_NK, idx_NK, chunks: RowChunks | None = None):
        """This rank's experts on every slot of theirs in (x, gates, idx) (the slots of
        other ranks' experts skipped): y (N, h) in the kernels' dtype, zero rows for tokens
        with no slot here; chunks as ops/swiglu_experts.RowChunks."""
        ex = self.experts
        return swiglu_experts(x_NH, gates_NK, idx_NK, ex.w_gate, ex.w_up, ex.w_down,
                              impl=ex.impl, check_ids=False, first_expert=self.lo,
                              chunks=chunks, grad_into=ex.grad_into(x_NH))

    def _forward_replicated(self, x_NH):
        """(y (N, h), RouterOutput): the whole batch routed, this rank's slots, one sum."""
        routed, a, lse = self.route(x_NH)
        # one node sums the partial gradients of x, the gates and lse in backward
        x_in, gates_in, lse_in = copy_to_group([x_NH, routed.gates, lse], self.group)
        if lse is not None:
            routed.psum = self.router.global_psum(a, lse_in)
        N, c = x_NH.shape[0], self.config
        pending = PendingSum(self.group)
        C = self.chunks or auto_chunks(N, c.top_k, c.experts)
        chunks = RowChunks(chunk_bounds(N, C), after=pending.start)
        y_NH = pending.settle(self.run_experts(x_in, gates_in, routed.topk_idx, chunks))
        return _anchored(y_NH, x_in, gates_in, *self.experts.parameters()), routed

    def _forward_local(self, x_NH):
        """(y (N_e, h), RouterOutput of the local tokens, the group's tokens)."""
        routed = self.router(x_NH)
        plan = plan_rows(routed.topk_idx, self.hi - self.lo, self.chunks, self.group)
        exchange = RowExchange(plan, self.group, impl=self.experts.impl)
        x_in, gates_in, ids_in = exchange.dispatch(x_NH.to(kernel_dtype(x_NH)), routed.gates,
                                                   routed.topk_idx)
        chunks = RowChunks(plan.chunk_bounds, before=exchange.arrived,
                           after=exchange.send_back)
        y_in = self.run_experts(x_in, gates_in, ids_in, chunks)
        y_in = _anchored(y_in, x_in, gates_in, *self.experts.parameters())
        return exchange.returned(y_in), routed, plan.tokens

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
                f"on rank {self.shard} of {self.shards}, chunks={self.chunks}")


def shard_moe_layer(layer: MoELayer, group=None, *, tokens: str = "replicated",
                    shard_router: bool = False,
                    chunks: int | None = None) -> ExpertParallelMoE:
    """This rank's ExpertParallelMoE holding its slice of `layer` (built alike on every
    rank, e.g. from one seed): the same function as `layer`, spread over the group, with
    the layer's device and dtype."""
    ep = ExpertParallelMoE(layer.config, group, tokens=tokens, shard_router=shard_router,
                           chunks=chunks)
    param = next(layer.parameters())
    ep.to(param.device, param.dtype)
    ep.load_full_state_dict(layer.state_dict())
    return ep
