"""The rows of expert parallelism with local tokens (parallel/expert.py, tokens="local"):
each token's row goes once to every rank that holds one of its k experts (not once per
slot), with the slots' expert ids and gates; that rank's experts run on the rows it got
and send back one row per (token, rank), the gated sum of its slots; the sender adds the
rows of each token (ops/token_rows.sum_rows).

The rows a rank keeps (its tokens with an expert of its own) never enter a collective and
are never copied: they are gathered straight into the experts' input, the experts run on
them first, while the other rows travel, and their results are summed from where the
experts wrote them. The rows for other ranks are cut into C rounds (contiguous ranges of
tokens); each round is one uneven all-to-all each way, issued asynchronously, so that round
c + 1's rows travel while round c's experts run (the experts run chunk by chunk,
ops/swiglu_experts RowChunks: the kept rows, then the rounds) and round c's results travel
back while later rounds compute.

Layouts. One buffer a forward holds the sender's rows and the experts' input:
[out | kept | in]. Sender's order: the rows for other ranks (round, destination rank,
token), then the kept rows (token order): [out | kept], row r of token tok[r]; pos[n, d]
the row of token n for rank d in that order (-1: none). Experts' input: [kept | in], the
rows received laid out (round, source rank, the sender's order), so that chunk 0 is the
kept rows and chunk c + 1 round c's rows, one contiguous range each. One all-to-all of the
(C, E) row counts (with each rank's token count) before any row moves is the one host
synchronisation: the splits of the all-to-alls live on the host.

What crosses the wire per forward: the counts ((C + 1) E integers a rank), the rows for
other ranks (R h values in the kernels' dtype, R = Σ_n |ranks of token n other than this
one|), their slot ids and gates (R × 2k int32: the gates' fp32 bits ride with the ids) and
their rows back (R h). Backward: the gradients of the returned rows out (R h), of the rows
and gates back (R h + R k).

Legend: N tokens (this rank's), h hidden, k active, E ranks, C rounds, R rows sent, S rows
kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.token_rows import sum_rows
from .collectives import CHUNKS, auto_chunks, group_rank


@dataclass
class RowPlan:
    """Where this rank's rows go and how many arrive (module header)."""
    tok: Tensor                 # (R + S,) int64: the sender's rows, [out | kept]
    pos: Tensor                 # (N, E) int64
    send: list                  # [round][rank] rows sent (0 to this rank)
    recv: list                  # [round][rank] rows received (0 from this rank)
    kept: int                   # S
    tokens: int                 # tokens of the whole group (Σ over ranks)

    @staticmethod
    def _bounds(counts, start: int = 0) -> list[int]:
        out = [start]
        for per_rank in counts:
            out.append(out[-1] + sum(per_rank))
        return out

    @property
    def send_bounds(self) -> list[int]:
        """The rounds' ranges of the rows sent, in [out] (from 0 to R)."""
        return self._bounds(self.send)

    @property
    def recv_bounds(self) -> list[int]:
        """The rounds' ranges of the rows received, in the experts' input (from S)."""
        return self._bounds(self.recv, self.kept)

    @property
    def chunk_bounds(self) -> tuple:
        """The experts' chunks: the kept rows, then each round's rows received."""
        return (0, *self.recv_bounds)

    @property
    def sent(self) -> int:
        return sum(map(sum, self.send))

    @property
    def received(self) -> int:
        return sum(map(sum, self.recv))


def plan_rows(topk_idx_NK: Tensor, per_rank: int, rounds: int | None = None,
              group=None) -> RowPlan:
    """The RowPlan of a routing: rank d holds experts [d·per_rank, (d+1)·per_rank). rounds:
    C, or None for the group's choice from the global batch (every rank must agree on it):
    the counts are then exchanged for CHUNKS sub-rounds, with each rank's token count, and
    C is chosen from the group's tokens (collectives.auto_chunks), a power of two dividing
    CHUNKS, each round a run of sub-rounds. Only the rows that travel are cut into rounds
    (the kept rows are a chunk of their own), about (E - 1) / E of a token's pairs: C
    counts those, so that each expert keeps about a block of rows in each chunk."""
    E, me = dist.get_world_size(group), group_rank(group)
    (N, k), dev = topk_idx_NK.shape, topk_idx_NK.device
    G = rounds or CHUNKS
    dest_NK = topk_idx_NK.long() // per_rank
    mask_NE = torch.zeros(N, E, dtype=torch.long, device=dev).scatter_(1, dest_NK, 1)
    keep_N = mask_NE[:, me].clone()
    mask_NE[:, me] = 0                           # the kept rows enter no collective
    # (N + 1, E), scanned along N as the contiguous dimension: a scan over dim 0 of an
    # (N, E) tensor runs one thread a column on CUDA (12 ms at N = 131,072, E = 2; 10 us so)
    cum = torch.cat([mask_NE.new_zeros(E, 1), mask_NE.T.contiguous().cumsum(1)], 1).T
    sub = [g * N // G for g in range(G + 1)]
    cum_b = torch.stack([cum[b] for b in sub])                           # (G + 1, E)
    send_GE = cum_b[1:] - cum_b[:-1]
    # row d of the exchange goes to rank d: its rows per sub-round, and this rank's tokens
    out_EG = torch.cat([send_GE.T, torch.full((E, 1), N, device=dev)], 1).contiguous()
    got_EG = torch.empty_like(out_EG)
    dist.all_to_all_single(got_EG, out_EG, group=group)
    keep_cum = keep_N.cumsum(0)
    host = torch.cat([send_GE.reshape(-1), got_EG.reshape(-1),
                      keep_cum[-1:] if N else keep_N.new_zeros(1)]).tolist()  # the one sync
    got = [host[G * E + s * (G + 1):G * E + (s + 1) * (G + 1)] for s in range(E)]
    tokens, S = sum(g[G] for g in got), host[-1]
    C = rounds or auto_chunks(tokens * (E - 1) // E, k, per_rank * E, most=G)
    step = G // C
    send = [[sum(host[(c * step + j) * E + d] for j in range(step)) for d in range(E)]
            for c in range(C)]
    recv = [[sum(got[s][c * step + j] for j in range(step)) for s in range(E)]
            for c in range(C)]
    bounds = sub[::step]
    send_CE = cum_b[::step][1:] - cum_b[::step][:-1]
    base_CE = (send_CE.reshape(-1).cumsum(0) - send_CE.reshape(-1)).view(C, E)
    n = torch.arange(N, device=dev)
    rnd_N = sum((n >= b).long() for b in bounds[1:-1]) if C > 1 else torch.zeros_like(n)
    pos_NE = base_CE[rnd_N] + cum[1:] - cum_b[::step][rnd_N] - 1
    pos_NE = torch.where(mask_NE.bool(), pos_NE, -1)
    R = sum(map(sum, send))
    pos_NE[:, me] = torch.where(keep_N.bool(), R + keep_cum - 1, -1)
    tok = torch.empty(R + S + 1, dtype=torch.long, device=dev)   # the last row: a sink
    tok.scatter_(0, torch.where(pos_NE >= 0, pos_NE, R + S).reshape(-1),
                 torch.arange(N, device=dev).repeat_interleave(E))
    return RowPlan(tok[:R + S], pos_NE, send, recv, S, tokens)


def _rounds(dst: Tensor, src: Tensor, dst_bounds, src_bounds, dst_counts, src_counts,
            group, *, async_op: bool) -> list:
    """Round c: src rows [src_bounds[c], ...) split by src_counts[c] -> dst's range."""
    works = []
    for c in range(len(src_counts)):
        work = dist.all_to_all_single(
            dst[dst_bounds[c]:dst_bounds[c + 1]], src[src_bounds[c]:src_bounds[c + 1]],
            output_split_sizes=dst_counts[c], input_split_sizes=src_counts[c], group=group,
            async_op=async_op)
        works.append(work)
    return works


class RowExchange:
    """One forward's exchange of a RowPlan (collectives in one order on every rank):
    ``dispatch`` gathers the rows and sends those for other ranks (differentiable; the
    experts' input, chunk by chunk: ``arrived(c)`` before reading chunk c's rows),
    ``send_back(c, y_c)`` returns chunk c's expert outputs as they are final (the kept
    rows' stay where they are), ``returned(y)`` waits for them and sums each token's rows
    (differentiable). impl: the sum's (ops/token_rows)."""

    def __init__(self, plan: RowPlan, group=None, impl: str = "auto"):
        self.plan, self.group, self.impl = plan, group, impl
        self.arriving, self.leaving, self.back = [], [], None

    def _for_backward(self) -> "RowExchange":
        """What a backward keeps: the plan and the group, none of this forward's buffers or
        collectives. Keeping ``self`` would close a cycle that refcounting never frees (the
        output's grad_fn -> ctx -> self -> the collectives' work objects, which hold the
        output in C++): every step's rows would stay allocated (a GPU fills in ~20 steps)."""
        return RowExchange(self.plan, self.group, self.impl)

    def _out(self, dst, src, async_op=False):   # the sender's [out] -> the experts' input
        p = self.plan
        return _rounds(dst, src, p.recv_bounds, p.send_bounds, p.recv, p.send, self.group,
                       async_op=async_op)

    def _in(self, dst, src, async_op=False):    # the experts' input -> the sender's [out]
        p = self.plan
        return _rounds(dst, src, p.send_bounds, p.recv_bounds, p.send, p.recv, self.group,
                       async_op=async_op)

    def dispatch(self, x_NH: Tensor, gates_NK: Tensor, ids_NK: Tensor):
        """(x_in, gates_in, ids_in), the experts' input (S + received rows): the kept rows'
        at once, round c's once ``arrived(c + 1)``."""
        return _Dispatch.apply(x_NH, gates_NK, ids_NK, self)

    def arrived(self, c: int) -> None:
        if c:
            self.arriving[c - 1].wait()

    def send_back(self, c: int, y_c: Tensor) -> None:
        if not c:
            return
        p, b = self.plan, self.plan.send_bounds
        if self.back is None:
            self.back = y_c.new_empty(b[-1], y_c.shape[1])
        self.leaving.append(dist.all_to_all_single(
            self.back[b[c - 1]:b[c]], y_c, output_split_sizes=p.send[c - 1],
            input_split_sizes=p.recv[c - 1], group=self.group, async_op=True))

    def returned(self, y_in: Tensor) -> Tensor:
        """y (N, h) in y_in's dtype: each token's rows summed (its kept row read from y_in,
        the others as they came back), once every round is in."""
        return _Return.apply(y_in, self)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, gates_NK, ids_NK, ex: RowExchange):
        p = ex.plan
        (N, h), k, R, S = x_NH.shape, ids_NK.shape[1], p.sent, p.kept
        size = R + S + p.received
        meta_NK = torch.cat([ids_NK.to(torch.int32), gates_NK.float().view(torch.int32)], 1)
        meta = meta_NK.new_empty(size, 2 * k)               # [out | kept | in]
        torch.index_select(meta_NK, 0, p.tok, out=meta[:R + S])
        meta_works = ex._out(meta[R:], meta[:R], async_op=True)
        rows = x_NH.new_empty(size, h)
        torch.index_select(x_NH, 0, p.tok, out=rows[:R + S])
        ex.arriving = ex._out(rows[R:], rows[:R], async_op=True)
        for work in meta_works:
            work.wait()
        ctx.ex, ctx.gates_dtype = ex._for_backward(), gates_NK.dtype
        ids_in = meta[R:, :k].contiguous()
        ctx.mark_non_differentiable(ids_in)
        return rows[R:], meta[R:, k:].contiguous().view(torch.float32), ids_in

    @staticmethod
    def backward(ctx, dx_in, dgates_in, _dids):
        ex = ctx.ex
        p = ex.plan
        dx_in, dgates_in = dx_in.contiguous(), dgates_in.contiguous()
        dx = dx_in.new_empty(p.sent, dx_in.shape[1])
        dgates = dgates_in.new_empty(p.sent, dgates_in.shape[1])
        for work in ex._in(dx, dx_in, async_op=True) + ex._in(dgates, dgates_in,
                                                              async_op=True):
            work.wait()
        S = p.kept
        return (sum_rows(dx, p.pos, dx_in[:S], impl=ex.impl),
                sum_rows(dgates, p.pos, dgates_in[:S], impl=ex.impl).to(ctx.gates_dtype),
                None, None)


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_in, ex: RowExchange):
        for work in ex.leaving:
            work.wait()
        p = ex.plan
        back = ex.back if ex.back is not None else y_in.new_empty(p.sent, y_in.shape[1])
        ex.back, ex.leaving = None, []
        ctx.ex = ex._for_backward()
        return sum_rows(back, p.pos, y_in[:p.kept], impl=ex.impl)

    @staticmethod
    def backward(ctx, dy_NH):
        ex = ctx.ex
        p = ex.plan
        dy_NH = dy_NH.contiguous()
        R, S = p.sent, p.kept
        dy_in = dy_NH.new_empty(S + p.received, dy_NH.shape[1])
        torch.index_select(dy_NH, 0, p.tok[R:], out=dy_in[:S])
        for work in ex._out(dy_in, dy_NH.index_select(0, p.tok[:R]), async_op=True):
            work.wait()
        return dy_in, None
