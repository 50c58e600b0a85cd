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

An expert shard (first_expert = lo, M = the shard's experts): only the slots whose id is in
[lo, lo + M) get rows (as local expert id - lo); the others sort last, past offsets[M], and
no block holds them, so the kernels never read or write them.

Chunks of tokens (bounds b_0 = 0 < ... < b_C = N, for a caller that overlaps communication
with the experts chunk by chunk): the pairs are sorted by (chunk, expert), each (chunk,
expert) a "virtual expert" v = c·M + e with its own offsets (C·M + 1 of them) and blocks,
and chunk c's blocks sit in their own slots [S_c, S_c + B_c) of the schedule, B_c the bound
above for the chunk's pairs: one launch of B_c programs at S_c runs chunk c, one of all
Σ B_c slots runs every chunk (the backward). block_expert holds v; a kernel takes its
weights from expert v mod M.

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
# past it, on a GPU, routing_count's three launches instead of the ~49 of the torch ops
# (where they fit): 0.05 against 0.30 ms at N = 16,384, k = 4, M = 32, and 0.17 against 0.42
# at M = 254 on an H200; the phonebook's graph step 6.05 -> 5.50 ms, 222 kernels fewer
# (benchmarks/routing_meta_ab.py; NOTES, fifteenth session). The interpreter keeps the torch
# ops unless asked (counting=True): the CPU suites' time stays where it was.
COUNTING = True
# past the counting sort's tile (over 254 experts, or too many pairs), and where its bins
# pass COUNTING_MAX_BINS: torch's stable sort of the keys and three launches for the rest
# (routing_count.sorted_meta, 18 kernels with the sort's): 0.13-0.15 ms against the torch
# ops' 0.52-0.53 at every size timed (N = 16,384 and 65,536, M = 32 to 8,192; H100,
# 0e637fc), MoRE-768's phonebook step 24.88 -> 24.59 ms, 174 kernels fewer
# (benchmarks/routing_meta_ab.py; NOTES, seventeenth session)
SORTED = True
# the counting sort's placement grows with its bins (VB): 78 us at 256 bins (M = 128 or 254)
# against 26 us at 128 (M = 96); the sort and count took 0.126-0.134 ms where the counting
# sort took 0.168 (M = 254 at N = 16,384; M = 128 at 65,536) and lost at M = 32 and 96
# (0.13 against 0.07-0.08): with SORTED, the counting sort only up to 128 bins (M <= 126)
COUNTING_MAX_BINS = 128
PAIR_ORDER_EXPERTS = 1 << 14    # pair_order's kernels up to this many experts


@dataclass
class RoutingMeta:
    order: torch.Tensor          # (N·k,) int64
    offsets: torch.Tensor        # (C·M+1,) int64
    block_expert: torch.Tensor   # (B,) int32: the virtual expert c·M + e, -1 for none
    block_start: torch.Tensor    # (B,) int64
    block_rows: int              # BM
    tokens: int                  # N
    top_k: int                   # k
    first_expert: int = 0        # the id of local expert 0
    chunk_slots: tuple = ()      # ((S_c, B_c), ...) per chunk; () for one chunk of all B
    bounds: tuple = ()           # the chunks' token bounds (b_0, ..., b_C); () for one chunk

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]

    @property
    def slots(self) -> tuple:
        """((first slot, slots), ...) of each chunk's blocks."""
        return self.chunk_slots or ((0, self.max_blocks),)

    @property
    def chunks(self) -> int:
        return len(self.slots)


def max_blocks(pairs: int, experts: int, block_rows: int) -> int:
    return min(pairs, experts) + -(-pairs // block_rows)


def check_bounds(bounds, tokens: int) -> tuple[int, ...]:
    """Chunk bounds 0 = b_0 <= b_1 <= ... <= b_C = N (host ints; empty chunks allowed)."""
    bounds = tuple(int(b) for b in bounds)
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tokens
            or any(a > b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"chunk bounds must rise from 0 to N={tokens}, got {list(bounds)}")
    return bounds


def routing_meta(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, *,
                 walk_experts: bool = False, first_expert: int = 0,
                 bounds=None, counting: bool | None = None,
                 sorting: bool | None = None) -> RoutingMeta:
    """The metadata of topk_idx where the kernels run (CUDA, or the interpreter): one kernel
    launch for N·k <= SMALL_PAIRS; with counting (default: COUNTING on a GPU), three
    (routing_count's counting sort) for more pairs where its tile holds them; with sorting
    (default: SORTED on a GPU) torch's sort and three launches for the sizes past that tile
    and, with both, where the counting sort's bins pass COUNTING_MAX_BINS (it is slower there);
    the torch ops otherwise (and for chunks); all equal field by field. walk_experts: see
    routing_meta_torch; first_expert, bounds: the module header."""
    from . import usable_on
    N, k = topk_idx_NK.shape
    one_chunk = bounds is None or len(check_bounds(bounds, N)) == 2
    kernels = not walk_experts and one_chunk and triton is not None and usable_on(
        topk_idx_NK.device)
    if kernels and 0 < N * k <= SMALL_PAIRS:
        return _routing_meta_small(topk_idx_NK, experts, block_rows, first_expert)
    gpu = topk_idx_NK.device.type == "cuda"
    counting = COUNTING and gpu if counting is None else counting
    sorting = SORTED and gpu if sorting is None else sorting
    if kernels and N * k > SMALL_PAIRS and (counting or sorting):
        from . import routing_count
        B = max_blocks(N * k, experts, block_rows)
        fields = None
        sorts = sorting and routing_count.sorts(experts)
        if counting and routing_count.fits(N * k, experts) and not (
                sorts and routing_count.bins(experts) > COUNTING_MAX_BINS):
            fields = routing_count.counting_meta(topk_idx_NK, experts, block_rows, B,
                                                 first_expert)
        elif sorts:
            fields = routing_count.sorted_meta(topk_idx_NK, experts, block_rows, B,
                                               first_expert)
        if fields is not None:
            return RoutingMeta(*fields, block_rows=block_rows, tokens=N, top_k=k,
                               first_expert=first_expert)
    return routing_meta_torch(topk_idx_NK, experts, block_rows, walk_experts=walk_experts,
                              first_expert=first_expert, bounds=bounds)


def pair_order(topk_idx_NK: torch.Tensor, experts: int, *,
               kernels: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order (N·k,) int64: pair ids n·k + j sorted by expert, stable; offsets (M+1,) int64:
    expert e's pairs are order[offsets[e]:offsets[e+1]]) of ids in [0, M), with no host
    sync: routing_meta's order and offsets. With kernels (default: on a GPU) and where they
    take the sizes (one launch up to SMALL_PAIRS, the counting sort's three past it up to
    COUNTING_MAX_BINS bins; at most PAIR_ORDER_EXPERTS experts: the one launch counts
    offsets in M·N·k compares, and PEER's million experts would cost it a millisecond),
    those; else one stable sort of the 32-bit ids and M + 1 binary searches (past 128 bins
    0.066-0.067 ms against the counting sort's 0.166-0.169 and the sort and count's
    0.127-0.130: N = 16,384, M = 254 and N = 65,536, M = 128; H100, 4936895)."""
    from . import usable_on
    N, k = topk_idx_NK.shape
    if kernels is None:
        kernels = topk_idx_NK.device.type == "cuda" and COUNTING
    if (kernels and triton is not None and usable_on(topk_idx_NK.device) and N * k > 0
            and experts <= PAIR_ORDER_EXPERTS):
        from . import routing_count
        if N * k <= SMALL_PAIRS or (routing_count.fits(N * k, experts)
                                    and routing_count.bins(experts) <= COUNTING_MAX_BINS):
            meta = routing_meta(topk_idx_NK, experts, 64, counting=True, sorting=False)
            return meta.order, meta.offsets
    keys = topk_idx_NK.reshape(-1).to(torch.int32)   # M < 2^31: a radix sort of 32-bit keys
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(experts + 1, device=topk_idx_NK.device, dtype=torch.int32)
    return order, torch.searchsorted(sorted_keys, bounds)


def _virtual_keys(topk_idx_NK, experts: int, first_expert: int, bounds) -> torch.Tensor:
    """(N·k,) sort keys: c·M + (id - first_expert) of the pairs in range, C·M the others."""
    N, k = topk_idx_NK.shape
    C = len(bounds) - 1
    dt = torch.int32 if (C + 1) * experts + abs(first_expert) < 2 ** 31 else torch.int64
    local = topk_idx_NK.reshape(-1).to(dt) - first_expert
    keep = (local >= 0) & (local < experts)
    if C > 1:        # + c·M, c the chunk of the pair's token (C - 1 compares: no host copy)
        tok = torch.arange(N * k, device=local.device) // k
        local = local + sum((tok >= b).to(dt) for b in bounds[1:-1]) * experts
    return torch.where(keep, local, C * experts)


def routing_meta_torch(topk_idx_NK: torch.Tensor, experts: int, block_rows: int, *,
                       walk_experts: bool = False, first_expert: int = 0,
                       bounds=None) -> RoutingMeta:
    """walk_experts (benchmarks only): one program per expert id and row block whether the
    expert has rows or not, the cost of a schedule that walks the range of expert ids."""
    N, k = topk_idx_NK.shape
    dev = topk_idx_NK.device
    bounds = check_bounds((0, N) if bounds is None else bounds, N)
    if walk_experts and len(bounds) > 2:
        raise ValueError("walk_experts takes one chunk")
    # 32-bit sort keys where the ids fit: a radix sort of half the key bits
    keys = _virtual_keys(topk_idx_NK, experts, first_expert, bounds)
    sorted_keys, order = torch.sort(keys, stable=True)
    V = (len(bounds) - 1) * experts                           # virtual experts
    # offsets[v] = first sorted row of key >= v: V + 1 binary searches, no atomics
    offsets = torch.searchsorted(sorted_keys, torch.arange(V + 1, device=dev,
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
                           tokens=N, top_k=k, first_expert=first_expert)
    return _schedule(order, offsets, counts, experts, block_rows, bounds, k, first_expert)


def _schedule(order, offsets, counts, experts: int, block_rows: int, bounds, k: int,
              first_expert: int) -> RoutingMeta:
    """Blocks of at most BM rows per virtual expert, chunk c's in its slots [S_c, S_c + B_c)."""
    dev = order.device
    C = len(bounds) - 1
    sizes = [max_blocks((b1 - b0) * k, experts, block_rows) for b0, b1 in zip(bounds, bounds[1:])]
    firsts = [sum(sizes[:c]) for c in range(C)]
    blocks = (counts + block_rows - 1) // block_rows
    block_end = torch.cumsum(blocks, 0)                       # (V,) blocks up to v
    # G[c]: chunk c's first block in the order of virtual experts
    G = torch.cat([block_end.new_zeros(1), block_end.view(C, experts)[:, -1]])
    # slot S_c + j holds block G[c] + j of the order of virtual experts, while j is within
    # chunk c's (device arithmetic only: the schedule needs no host sync)
    g = torch.cat([G[c] + torch.arange(sizes[c], device=dev) for c in range(C)])
    valid = torch.cat([g_c < G[c + 1] for c, g_c in enumerate(g.split(sizes))])
    v = torch.searchsorted(block_end, g, right=True).clamp(max=C * experts - 1)
    start = offsets[v] + (g - (block_end[v] - blocks[v])) * block_rows
    return RoutingMeta(order=order, offsets=offsets,
                       block_expert=torch.where(valid, v, -1).to(torch.int32),
                       block_start=torch.where(valid, start, 0), block_rows=block_rows,
                       tokens=bounds[-1], top_k=k, first_expert=first_expert,
                       chunk_slots=tuple(zip(firsts, sizes)) if C > 1 else (),
                       bounds=tuple(bounds) if C > 1 else ())


if triton is not None:
    @triton.jit
    def _run_start(a_e, a_f, b_e, b_f):
        """Segmented scan over sorted experts: (expert, first position of its run)."""
        return b_e, tl.where(a_e == b_e, a_f, b_f)

    @triton.jit
    def _local_ids(IDX, q, ok, FIRST, M):
        """Local expert ids of pairs q, M for a pad or an id outside [FIRST, FIRST + M)."""
        ids = tl.load(IDX + q, mask=ok, other=0).to(tl.int64) - FIRST
        return tl.where(ok & (ids >= 0) & (ids < M), ids, M)

    @triton.jit
    def _small_meta_kernel(IDX, ORDER, OFFSETS, BLOCK_EXPERT, BLOCK_START, P, M, B, FIRST,
                           BM: tl.constexpr, PP: tl.constexpr, BB: tl.constexpr,
                           BE: tl.constexpr, BQ: tl.constexpr):
        e = tl.program_id(0) * BE + tl.arange(0, BE)
        less = tl.zeros((BE,), tl.int64)
        for q0 in range(0, P, BQ):
            qq = q0 + tl.arange(0, BQ)
            ids = _local_ids(IDX, qq, qq < P, FIRST, M)
            less += tl.sum((ids[None, :] < e[:, None]).to(tl.int64), axis=1)
        tl.store(OFFSETS + e, less, mask=e <= M)
        if tl.program_id(0) == 0:
            q = tl.arange(0, PP).to(tl.int64)
            ok = q < P
            ids = _local_ids(IDX, q, ok, FIRST, M)
            key = tl.sort(ids * PP + q)                 # pads and other shards' sort last
            ex, pair = key // PP, key % PP
            tl.store(ORDER + q, pair, mask=ok)
            _, first = tl.associative_scan((ex, q), 0, _run_start)
            # a block starts every BM rows of a run of one of the shard's experts
            start = ok & (ex < M) & ((q - first) % BM == 0)
            block = tl.cumsum(start.to(tl.int32), 0) - 1
            tl.store(BLOCK_EXPERT + block, ex.to(tl.int32), mask=start)
            tl.store(BLOCK_START + block, q, mask=start)
            n_blocks = tl.sum(start.to(tl.int32), 0)
            b = tl.arange(0, BB)
            rest = (b >= n_blocks) & (b < B)
            tl.store(BLOCK_EXPERT + b, tl.full((BB,), -1, tl.int32), mask=rest)
            tl.store(BLOCK_START + b, tl.zeros((BB,), tl.int64), mask=rest)


def _routing_meta_small(topk_idx_NK: torch.Tensor, experts: int, block_rows: int,
                        first_expert: int = 0) -> RoutingMeta:
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
        first_expert, BM=block_rows, PP=PP, BB=triton.next_power_of_2(B), BE=BE, BQ=min(PP, 64),
        num_warps=4)
    return RoutingMeta(order=order, offsets=offsets, block_expert=block_expert,
                       block_start=block_start, block_rows=block_rows, tokens=N, top_k=k,
                       first_expert=first_expert)
