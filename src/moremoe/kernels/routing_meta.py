"""Routing metadata for the grouped expert kernels, on the device, with no host sync.

From topk_idx (N, k) it builds the expert-sorted order of the N·k (token, slot) pairs and a
schedule of row blocks that each belong to one expert:

  order     (N·k,)  int64  pair ids n·k + j sorted by expert (stable: by pair id within one)
  offsets   (M+1,)  int64  pairs of expert e are order[offsets[e]:offsets[e+1]]
  block_expert (B,) int32  expert of row block b, -1 for blocks past the last
  block_start  (B,) int64  first sorted row of block b

B = min(N·k, M) + ceil(N·k / BM) is an upper bound on the number of non-empty blocks
(each expert's rows are cut into blocks of at most BM rows; at most min(N·k, M) experts
are present), known without reading the counts back to the host: the kernels are launched
on B programs and the ones past the last block return at once. Experts with no tokens get
no block, so decoding (few tokens, many experts) touches only the experts present and no
loop walks the range of expert ids.

For small N (N·k <= SMALL_PAIRS, decoding) the same metadata comes from one kernel launch
(_small_meta_kernel) instead of ~15 small torch ops: program 0 sorts the pair keys
(expert · PP + pair id, so the sort is stable) in one tile, finds where each expert's run
starts with a segmented scan and cuts the runs into blocks; every program counts
offsets[e] = #{pairs with expert < e} for its own chunk of experts. routing_meta_torch is the
plain-torch reference it is tested against (and the path for larger N).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                     # the torch path still works
    triton = None

SMALL_PAIRS = 1024      # N·k up to which one kernel launch builds the metadata


@dataclass
class RoutingMeta:
    order: torch.Tensor          # (N·k,) int64
    offsets: torch.Tensor        # (M+1,) int64
    block_expert: torch.Tensor   # (B,) int32
    block_start: torch.Tensor    # (B,) int64
    block_rows: int              # BM
    tokens: int                  # N
    top_k: int                   # k

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(pairs: int, experts: int, block_rows: int) -> int:
    return min(pairs, experts) + -(-pairs // block_rows)


def routing_meta(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, *,
                 walk_experts: bool = False) -> RoutingMeta:
    """The metadata of topk_idx: one kernel launch for N·k <= SMALL_PAIRS where the kernels
    run (CUDA, or the interpreter), the torch ops otherwise; the two are equal field by
    field. walk_experts: see routing_meta_torch."""
    from . import usable_on
    N, k = topk_idx_NK.shape
    if (not walk_experts and 0 < N * k <= SMALL_PAIRS and triton is not None
            and usable_on(topk_idx_NK.device)):
        return _routing_meta_small(topk_idx_NK, experts, block_rows)
    return routing_meta_torch(topk_idx_NK, experts, block_rows, walk_experts=walk_experts)


def routing_meta_torch(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, *,
                       walk_experts: bool = False) -> RoutingMeta:
    """walk_experts (benchmarks only): one program per expert id and row block whether the
    expert has rows or not, the cost of a schedule that walks the range of expert ids."""
    N, k = topk_idx_NK.shape
    dev = topk_idx_NK.device
    # 32-bit sort keys where the ids fit: a radix sort of half the key bits
    keys = topk_idx_NK.reshape(-1)
    keys = keys.to(torch.int32 if experts < 2 ** 31 else torch.int64)
    sorted_keys, order = torch.sort(keys, stable=True)
    # offsets[e] = first sorted row of expert >= e: M + 1 binary searches, no atomics
    offsets = torch.searchsorted(sorted_keys, torch.arange(experts + 1, device=dev,
                                                           dtype=keys.dtype))
    counts = offsets[1:] - offsets[:-1]
    if walk_experts:
        per = -(-(N * k) // block_rows) if N * k else 1
        b = torch.arange(experts * per, device=dev)
        e, j = b // per, b % per
        start = offsets[e] + j * block_rows
        valid = start < offsets[e + 1]
        return RoutingMeta(order=order, offsets=offsets,
                           block_expert=torch.where(valid, e, -1).to(torch.int32),
                           block_start=torch.where(valid, start, 0), block_rows=block_rows,
                           tokens=N, top_k=k)
    blocks = (counts + block_rows - 1) // block_rows
    block_end = torch.cumsum(blocks, 0)                       # (M,) blocks up to expert e
    B = max_blocks(N * k, experts, block_rows)
    b = torch.arange(B, device=dev)
    expert = torch.searchsorted(block_end, b, right=True)     # first e with block_end > b
    valid = expert < experts
    e_safe = expert.clamp(max=experts - 1)
    first_block = block_end[e_safe] - blocks[e_safe]
    start = offsets[e_safe] + (b - first_block) * block_rows
    return RoutingMeta(order=order, offsets=offsets,
                       block_expert=torch.where(valid, expert, -1).to(torch.int32),
                       block_start=torch.where(valid, start, 0), block_rows=block_rows,
                       tokens=N, top_k=k)


if triton is not None:
    @triton.jit
    def _run_start(a_e, a_f, b_e, b_f):
        """Segmented scan over sorted experts: (expert, first position of its run)."""
        return b_e, tl.where(a_e == b_e, a_f, b_f)

    @triton.jit
    def _small_meta_kernel(IDX, ORDER, OFFSETS, BLOCK_EXPERT, BLOCK_START, P, M, B,
                           BM: tl.constexpr, PP: tl.constexpr, BB: tl.constexpr,
                           BE: tl.constexpr, BQ: tl.constexpr):
        e = tl.program_id(0) * BE + tl.arange(0, BE)
        less = tl.zeros((BE,), tl.int64)
        for q0 in range(0, P, BQ):
            qq = q0 + tl.arange(0, BQ)
            ids = tl.load(IDX + qq, mask=qq < P, other=M).to(tl.int64)
            less += tl.sum((ids[None, :] < e[:, None]).to(tl.int64), axis=1)
        tl.store(OFFSETS + e, less, mask=e <= M)
        if tl.program_id(0) == 0:
            q = tl.arange(0, PP).to(tl.int64)
            ok = q < P
            ids = tl.load(IDX + q, mask=ok, other=M).to(tl.int64)
            key = tl.sort(ids * PP + q)                 # pads (expert M) sort last
            ex, pair = key // PP, key % PP
            tl.store(ORDER + q, pair, mask=ok)
            _, first = tl.associative_scan((ex, q), 0, _run_start)
            start = ok & ((q - first) % BM == 0)        # a block starts every BM rows of a run
            block = tl.cumsum(start.to(tl.int32), 0) - 1
            tl.store(BLOCK_EXPERT + block, ex.to(tl.int32), mask=start)
            tl.store(BLOCK_START + block, q, mask=start)
            n_blocks = tl.sum(start.to(tl.int32), 0)
            b = tl.arange(0, BB)
            rest = (b >= n_blocks) & (b < B)
            tl.store(BLOCK_EXPERT + b, tl.full((BB,), -1, tl.int32), mask=rest)
            tl.store(BLOCK_START + b, tl.zeros((BB,), tl.int64), mask=rest)


def _routing_meta_small(topk_idx_NK: torch.Tensor, experts: int, block_rows: int) -> RoutingMeta:
    N, k = topk_idx_NK.shape
    P, dev = N * k, topk_idx_NK.device
    B = max_blocks(P, experts, block_rows)
    order = torch.empty(P, dtype=torch.int64, device=dev)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=dev)
    block_expert = torch.empty(B, dtype=torch.int32, device=dev)
    block_start = torch.empty(B, dtype=torch.int64, device=dev)
    PP, BE = triton.next_power_of_2(P), 128
    _small_meta_kernel[(triton.cdiv(experts + 1, BE),)](
        topk_idx_NK.contiguous(), order, offsets, block_expert, block_start, P, experts, B,
        BM=block_rows, PP=PP, BB=triton.next_power_of_2(B), BE=BE, BQ=min(PP, 64),
        num_warps=4)
    return RoutingMeta(order=order, offsets=offsets, block_expert=block_expert,
                       block_start=block_start, block_rows=block_rows, tokens=N, top_k=k)
