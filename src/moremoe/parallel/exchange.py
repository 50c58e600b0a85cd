"""The rows of expert parallelism with local tokens (parallel/expert.py, tokens="local"):
each token's row goes once to every rank that holds one of its k experts (not once per
slot), with the slots' expert ids and gates; that rank's experts run on the rows it got
and send back one row per (token, rank), the gated sum of its slots; the sender adds the
rows of each token (ops/token_rows.combine_rows).

The tokens of a rank are cut into C rounds (contiguous ranges); each round is one uneven
all-to-all each way, issued asynchronously, so that round c + 1's rows travel while round
c's experts run (the receiving side runs its experts round by round, ops/swiglu_experts
RowChunks) and round c's results travel back while later rounds compute.

Layouts. Sender: rows in the order (round, destination rank, token), row r of token tok[r];
pos[n, d] the row of token n for rank d (-1: none). Receiver: (round, source rank, the
sender's order), so round c's rows are one contiguous range (the experts' chunk c). One
all-to-all of the (C, E) row counts (with each rank's token count) before any row moves is
the one host synchronisation: the splits of the all-to-alls live on the host.

What crosses the wire per forward: the counts ((C + 1) E integers a rank), the rows (R h
values in the kernels' dtype, R = Σ_n |ranks of token n|), their slot ids and gates (R × 2k
int32: the gates' fp32 bits ride with the ids) and the rows back (R h). Backward: the
gradients of the returned rows out (R h), of the rows and gates back (R h + R k).

Legend: N tokens (this rank's), h hidden, k active, E ranks, C rounds, R rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import CHUNKS, auto_chunks


@dataclass
class RowPlan:
    """Where this rank's rows go and how many arrive (module header)."""
    tok: Tensor                 # (R_send,) int64
    pos: Tensor                 # (N, E) int64
    send: list                  # [round][rank] rows sent
    recv: list                  # [round][rank] rows received
    tokens: int                 # tokens of the whole group (Σ over ranks)

    @staticmethod
    def _bounds(counts) -> list[int]:
        out = [0]
        for per_rank in counts:
            out.append(out[-1] + sum(per_rank))
        return out

    @property
    def send_bounds(self) -> list[int]:
        return self._bounds(self.send)

    @property
    def recv_bounds(self) -> list[int]:
        return self._bounds(self.recv)


def plan_rows(topk_idx_NK: Tensor, per_rank: int, rounds: int | None = None,
              group=None) -> RowPlan:
    """The RowPlan of a routing: rank d holds experts [d·per_rank, (d+1)·per_rank). rounds:
    C, or None for the group's choice from the global batch (every rank must agree on it):
    the counts are then exchanged for CHUNKS sub-rounds, with each rank's token count, and
    C is chosen from the group's tokens (collectives.auto_chunks), a power of two dividing
    CHUNKS, each round a run of sub-rounds."""
    E = dist.get_world_size(group)
    (N, k), dev = topk_idx_NK.shape, topk_idx_NK.device
    G = rounds or CHUNKS
    dest_NK = topk_idx_NK.long() // per_rank
    mask_NE = torch.zeros(N, E, dtype=torch.long, device=dev).scatter_(1, dest_NK, 1)
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
    host = torch.cat([send_GE.reshape(-1), got_EG.reshape(-1)]).tolist()   # the one sync
    got = [host[G * E + s * (G + 1):G * E + (s + 1) * (G + 1)] for s in range(E)]
    tokens = sum(g[G] for g in got)
    C = rounds or auto_chunks(tokens, k, per_rank * E, most=G)
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
    tok = torch.empty(R + 1, dtype=torch.long, device=dev)   # row R: a sink for the -1s
    tok.scatter_(0, torch.where(pos_NE >= 0, pos_NE, R).reshape(-1),
                 torch.arange(N, device=dev).repeat_interleave(E))
    return RowPlan(tok[:R], pos_NE, send, recv, tokens)


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
    ``dispatch`` sends the rows out (differentiable; the rows arrive round by round:
    ``arrived(c)`` before reading round c's), ``send_back(c, y_c)`` returns round c's
    expert outputs as they are final, ``returned(y)`` waits for them (differentiable)."""

    def __init__(self, plan: RowPlan, group=None):
        self.plan, self.group = plan, group
        self.arriving, self.leaving, self.back = [], [], None

    def _for_backward(self) -> "RowExchange":
        """What a backward keeps: the plan and the group, none of this forward's buffers or
        collectives. Keeping ``self`` would close a cycle that refcounting never frees (the
        output's grad_fn -> ctx -> self -> the collectives' work objects, which hold the
        output in C++): every step's rows would stay allocated (a GPU fills in ~20 steps)."""
        return RowExchange(self.plan, self.group)

    def _out(self, dst, src, async_op=False):          # the sender's order -> the receiver's
        p = self.plan
        return _rounds(dst, src, p.recv_bounds, p.send_bounds, p.recv, p.send, self.group,
                       async_op=async_op)

    def _in(self, dst, src, async_op=False):           # the receiver's order -> the sender's
        p = self.plan
        return _rounds(dst, src, p.send_bounds, p.recv_bounds, p.send, p.recv, self.group,
                       async_op=async_op)

    def dispatch(self, x_rows: Tensor, gates_rows: Tensor, ids_rows: Tensor):
        """(x_recv, gates_recv, ids_recv): rows still arriving (see ``arrived``)."""
        return _Dispatch.apply(x_rows, gates_rows, ids_rows, self)

    def arrived(self, c: int) -> None:
        self.arriving[c].wait()

    def send_back(self, c: int, y_c: Tensor) -> None:
        p, b = self.plan, self.plan.send_bounds
        if self.back is None:
            self.back = y_c.new_empty(b[-1], y_c.shape[1])
        self.leaving.append(dist.all_to_all_single(
            self.back[b[c]:b[c + 1]], y_c, output_split_sizes=p.send[c],
            input_split_sizes=p.recv[c], group=self.group, async_op=True))

    def returned(self, y_recv: Tensor) -> Tensor:
        """The rows back in the sender's order (R_send, h), once every round is in."""
        return _Return.apply(y_recv, self)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_rows, gates_rows, ids_rows, ex: RowExchange):
        k, R = ids_rows.shape[1], ex.plan.recv_bounds[-1]
        meta = torch.cat([ids_rows.to(torch.int32), gates_rows.float().view(torch.int32)], 1)
        meta_recv = meta.new_empty(R, 2 * k)
        meta_works = ex._out(meta_recv, meta, async_op=True)
        x_recv = x_rows.new_empty(R, x_rows.shape[1])
        ex.arriving = ex._out(x_recv, x_rows, async_op=True)
        for work in meta_works:
            work.wait()
        ctx.ex = ex._for_backward()
        ids_recv = meta_recv[:, :k].contiguous()
        ctx.mark_non_differentiable(ids_recv)
        return x_recv, meta_recv[:, k:].contiguous().view(torch.float32), ids_recv

    @staticmethod
    def backward(ctx, dx_recv, dgates_recv, _dids):
        ex = ctx.ex
        R = ex.plan.send_bounds[-1]
        dx = dx_recv.new_empty(R, dx_recv.shape[1])
        dgates = dgates_recv.new_empty(R, dgates_recv.shape[1])
        for work in ex._in(dx, dx_recv.contiguous(), async_op=True) + ex._in(
                dgates, dgates_recv.contiguous(), async_op=True):
            work.wait()
        return dx, dgates, None, None


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_recv, ex: RowExchange):
        for work in ex.leaving:
            work.wait()
        back, ex.back, ex.leaving = ex.back, None, []
        ctx.ex = ex._for_backward()
        return back

    @staticmethod
    def backward(ctx, dy_back):
        ex = ctx.ex
        dy_recv = dy_back.new_empty(ex.plan.recv_bounds[-1], dy_back.shape[1])
        for work in ex._out(dy_recv, dy_back.contiguous(), async_op=True):
            work.wait()
        return dy_recv, None
