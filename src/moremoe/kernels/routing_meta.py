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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """walk_experts (benchmarks only): one program per expert id and row block whether the
    expert has rows or not, the cost of a schedule that walks the range of expert ids."""
    N, k = topk_idx_NK.shape
    dev = topk_idx_NK.device
    flat = topk_idx_NK.reshape(-1).long()
    _, order = torch.sort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).index_add_(
        0, flat, torch.ones_like(flat))
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
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
