"""The routing metadata (routing_meta.py's fields, equal to routing_meta_torch's) of more pairs
than one tile holds, in three launches instead of the torch path's ~40 ops (a radix sort of
several kernels among them): a stable counting sort by blocks of BP pairs. Where the model is
small the step is its kernel count (a phonebook step: about 4 us a kernel on an H100), and
the metadata's ~30 kernels a layer are a sixth of it.

  _count_kernel  (P,)   block p's pairs' keys counted in VB = next_pow2(M + 2) bins:
                        COUNTS[p, v] (key: the local expert id; M for another shard's; M + 1
                        for a pad)
  _scan_kernel   (1,)   the (P, VB) counts in one tile (P·VB <= MAX_TILE): offsets[v] = pairs
                        of smaller key; BASE[p, v] = offsets[v] + the earlier blocks' pairs
                        of key v; BLOCK_END[v] = blocks of BM rows up to expert v
  _place_kernel  (G,)   block p, BC pairs at a time: a pair's rank among the block's earlier
                        pairs of its key (a running count per key and a cumulative sum over
                        the BC x VB one-hot tile): order[BASE[p, key] + rank] = pair; and
                        programs b < ceil(B / BS) write slots [b·BS, (b + 1)·BS) of the
                        schedule, each slot's expert by a binary search of BLOCK_END (the
                        torch path's searchsorted)

Stable like torch.sort(stable=True): within a key, blocks in order and, in a block, pairs in
order. Device arithmetic only, no host sync (CUDA graphs capture it). One chunk of tokens;
BP = the power of two (64 to 1,024) that keeps P·VB within one tile: more pairs, or more
than 254 experts, do not fit().

sorted_meta takes any size: the order from torch's stable sort of the same keys, then
_keys_count_kernel (keys and each expert's pairs counted by integer atomics),
_scan_counts_kernel (one program: offsets and BLOCK_END, 1,024 experts at a time) and
_slots_kernel (the schedule, by the same binary search as _place_kernel's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BS = 256             # schedule slots a program
MAX_TILE = 1 << 14   # P·VB: the scan's counts held in one program
MAX_BP = 1024        # pairs a block at most
MAX_BINS = 256       # VB at most: M <= 254 (the launch-bound small models; a one-hot tile
                     # of BC x VB a placement step)


def bins(experts: int) -> int:
    """VB: the keys 0..M-1, M (another shard's) and M + 1 (a pad), rounded to a power of 2."""
    return triton.next_power_of_2(experts + 2)


def step_pairs(experts: int) -> int:
    """BC: pairs a placement step, a BC x VB one-hot tile of at most 8,192 entries."""
    return max(8, min(64, 8192 // bins(experts)))


def block_pairs(pairs: int, experts: int) -> int:
    """BP: the smallest power of two from 64 whose P = ceil(pairs / BP) blocks' counts fit
    the scan's tile; 0 where none up to MAX_BP does."""
    bp = 64
    while triton.cdiv(pairs, bp) * bins(experts) > MAX_TILE:
        bp *= 2
        if bp > MAX_BP:
            return 0
    return bp


def fits(pairs: int, experts: int) -> bool:
    """Whether the counting sort takes these sizes (else the torch path)."""
    return pairs > 0 and bins(experts) <= MAX_BINS and block_pairs(pairs, experts) > 0


@triton.jit
def _keys(IDX, q, NK, M, FIRST):
    """Pairs q's keys: local expert id, M for an id outside [FIRST, FIRST + M), M + 1 past
    the last pair."""
    ok = q < NK
    ids = tl.load(IDX + q, mask=ok, other=0).to(tl.int64) - FIRST
    ids = tl.where((ids >= 0) & (ids < M), ids, M)
    return tl.where(ok, ids, M + 1).to(tl.int32)


@triton.jit
def _count_kernel(IDX, COUNTS, NK, M, FIRST, VB: tl.constexpr, BP: tl.constexpr):
    p = tl.program_id(0)
    key = _keys(IDX, p * BP + tl.arange(0, BP), NK, M, FIRST)
    tl.store(COUNTS + p * VB + tl.arange(0, VB), tl.histogram(key, VB))


@triton.jit
def _scan_kernel(COUNTS, BASE, OFFSETS, BLOCK_END, P, M, BM, VB: tl.constexpr,
                 PP: tl.constexpr):
    p = tl.arange(0, PP)[:, None]
    v = tl.arange(0, VB)[None, :]
    counts = tl.load(COUNTS + p * VB + v, mask=p < P, other=0)        # (PP, VB) int32
    total = tl.sum(counts, 0)                                          # (VB,)
    offsets = tl.cumsum(total, 0) - total
    tl.store(BASE + p * VB + v, offsets[None, :] + tl.cumsum(counts, 0) - counts,
             mask=p < P)
    w = tl.arange(0, VB)
    tl.store(OFFSETS + w, offsets.to(tl.int64), mask=w <= M)
    blocks = tl.where(w < M, (total + BM - 1) // BM, 0)
    tl.store(BLOCK_END + w, tl.cumsum(blocks, 0).to(tl.int64), mask=w < M)


@triton.jit
def _place_kernel(IDX, BASE, ORDER, OFFSETS, BLOCK_END, BLOCK_EXPERT, BLOCK_START,
                  NK, M, FIRST, P, B, BM, VB: tl.constexpr, BP: tl.constexpr,
                  BCC: tl.constexpr, BSC: tl.constexpr, STEPS: tl.constexpr):
    p = tl.program_id(0)
    if p < P:
        v = tl.arange(0, VB)
        running = tl.zeros((VB,), tl.int32)          # the block's pairs so far, per key
        for c in tl.static_range(BP // BCC):
            q = p * BP + c * BCC + tl.arange(0, BCC)
            key = _keys(IDX, q, NK, M, FIRST)
            hot = (key[:, None] == v[None, :]).to(tl.int32)             # (BCC, VB)
            before = tl.cumsum(hot, 0) - hot + running[None, :]
            rank = tl.sum(hot * before, 1)
            dest = tl.load(BASE + p * VB + key, mask=key <= M, other=0) + rank
            tl.store(ORDER + dest.to(tl.int64), q.to(tl.int64), mask=key <= M)
            running += tl.sum(hot, 0)
    _write_slots(OFFSETS, BLOCK_END, BLOCK_EXPERT, BLOCK_START, p, M, B, BM, BSC, STEPS)


@triton.jit
def _write_slots(OFFSETS, BLOCK_END, BLOCK_EXPERT, BLOCK_START, p, M, B, BM,
                 BSC: tl.constexpr, STEPS: tl.constexpr):
    """Slots [p·BSC, (p + 1)·BSC) of the schedule: each slot's expert by a binary search of
    BLOCK_END (the torch path's searchsorted), its first row, -1 / 0 past the last block."""
    b = p * BSC + tl.arange(0, BSC)
    if p * BSC < B:
        # the first expert whose blocks end past slot b: lo in [0, M], M where none does
        lo = tl.zeros((BSC,), tl.int64)
        hi = tl.zeros((BSC,), tl.int64) + M
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(BLOCK_END + mid, mask=active, other=0)
            lo = tl.where(active & (end <= b), mid + 1, lo)
            hi = tl.where(active & (end > b), mid, hi)
        valid = lo < M
        begin = tl.load(BLOCK_END + lo - 1, mask=valid & (lo > 0), other=0)
        start = tl.load(OFFSETS + lo, mask=valid, other=0) + (b - begin) * BM
        tl.store(BLOCK_EXPERT + b, tl.where(valid, lo, -1).to(tl.int32), mask=b < B)
        tl.store(BLOCK_START + b, tl.where(valid, start, 0), mask=b < B)


def counting_meta(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, blocks: int,
                  first_expert: int = 0) -> tuple:
    """(order, offsets, block_expert, block_start) of one chunk: routing_meta's fields, in
    three launches; blocks: B, the schedule's slots (routing_meta.max_blocks). Requires
    fits(N·k, experts)."""
    NK, dev = topk_idx_NK.numel(), topk_idx_NK.device
    VB, BP = bins(experts), block_pairs(NK, experts)
    if not fits(NK, experts):
        raise ValueError(f"{NK} pairs over {experts} experts exceed the counting sort's tile "
                         f"({MAX_TILE} counts, {MAX_BINS} bins); use routing_meta, which "
                         f"keeps the torch path")
    P = triton.cdiv(NK, BP)
    idx = topk_idx_NK.contiguous()
    counts = torch.empty(P, VB, dtype=torch.int32, device=dev)
    base = torch.empty(P, VB, dtype=torch.int32, device=dev)
    block_end = torch.empty(experts, dtype=torch.int64, device=dev)
    order = torch.empty(NK, dtype=torch.int64, device=dev)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    block_start = torch.empty(blocks, dtype=torch.int64, device=dev)
    _count_kernel[(P,)](idx, counts, NK, experts, first_expert, VB=VB, BP=BP, num_warps=4)
    _scan_kernel[(1,)](counts, base, offsets, block_end, P, experts, block_rows, VB=VB,
                       PP=triton.next_power_of_2(P), num_warps=8)
    _place_kernel[(max(P, triton.cdiv(blocks, BS)),)](
        idx, base, order, offsets, block_end, block_expert, block_start, NK, experts,
        first_expert, P, blocks, block_rows, VB=VB, BP=BP, BCC=step_pairs(experts), BSC=BS,
        STEPS=_steps(experts), num_warps=4)
    return order, offsets, block_expert, block_start


def _steps(experts: int) -> int:
    """Binary-search steps that narrow [0, M] to one expert."""
    return max(1, experts.bit_length() + 1)


# ---------------------------------------------------------------- any size: sort, then count
# Past the counting sort's tile (more than 254 experts, or too many pairs for one scan), the
# order comes from torch's stable radix sort of the same keys, and everything else from
# three launches: the keys with each expert's pairs counted (integer atomics: exact, so
# deterministic), one program scanning the counts, and the schedule's slots. About 11
# launches with the sort's own, against the torch ops' ~49.

@triton.jit
def _keys_count_kernel(IDX, KEYS, COUNTS, NK, M, FIRST, BP: tl.constexpr):
    q = tl.program_id(0) * BP + tl.arange(0, BP)
    key = _keys(IDX, q, NK, M, FIRST)
    tl.store(KEYS + q, key, mask=q < NK)
    tl.atomic_add(COUNTS + key, 1, mask=key < M, sem="relaxed")


@triton.jit
def _scan_counts_kernel(COUNTS, OFFSETS, BLOCK_END, M, BM, BE: tl.constexpr):
    """One program over the experts, BE at a time: offsets[v] = pairs of experts below v,
    BLOCK_END[v] = blocks of BM rows up to expert v."""
    pairs = tl.sum(tl.zeros((BE,), tl.int64), 0)        # int64 scalars carried by the loop
    blocks = pairs
    for e0 in range(0, M, BE):
        v = e0 + tl.arange(0, BE)
        c = tl.load(COUNTS + v, mask=v < M, other=0).to(tl.int64)
        b = (c + BM - 1) // BM
        tl.store(OFFSETS + v, pairs + tl.cumsum(c, 0) - c, mask=v < M)
        tl.store(BLOCK_END + v, blocks + tl.cumsum(b, 0), mask=v < M)
        pairs += tl.sum(c, 0)
        blocks += tl.sum(b, 0)
    tl.store(OFFSETS + M, pairs)


@triton.jit
def _slots_kernel(OFFSETS, BLOCK_END, BLOCK_EXPERT, BLOCK_START, M, B, BM,
                  BSC: tl.constexpr, STEPS: tl.constexpr):
    _write_slots(OFFSETS, BLOCK_END, BLOCK_EXPERT, BLOCK_START, tl.program_id(0), M, B, BM,
                 BSC, STEPS)


SORT_MAX_EXPERTS = 1 << 16   # _scan_counts_kernel's one program walks M / 1,024 chunks


def sorts(experts: int) -> bool:
    """Whether sorted_meta takes this many experts (its scan is one program over them)."""
    return 0 < experts <= SORT_MAX_EXPERTS


def sorted_meta(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, blocks: int,
                first_expert: int = 0) -> tuple:
    """(order, offsets, block_expert, block_start) of one chunk of any size: routing_meta's
    fields, the order by torch's stable sort of the keys, the rest in three launches."""
    NK, dev = topk_idx_NK.numel(), topk_idx_NK.device
    BP = 1024
    idx = topk_idx_NK.contiguous()
    keys = torch.empty(NK, dtype=torch.int32, device=dev)
    counts = torch.zeros(experts, dtype=torch.int32, device=dev)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=dev)
    block_end = torch.empty(experts, dtype=torch.int64, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    block_start = torch.empty(blocks, dtype=torch.int64, device=dev)
    _keys_count_kernel[(triton.cdiv(NK, BP),)](idx, keys, counts, NK, experts, first_expert,
                                               BP=BP, num_warps=4)
    order = torch.sort(keys, stable=True)[1]
    _scan_counts_kernel[(1,)](counts, offsets, block_end, experts, block_rows, BE=1024,
                              num_warps=4)
    _slots_kernel[(triton.cdiv(blocks, BS),)](offsets, block_end, block_expert, block_start,
                                              experts, blocks, block_rows, BSC=BS,
                                              STEPS=_steps(experts), num_warps=4)
    return order, offsets, block_expert, block_start
