"""Top-k router selection shared by the low-rank and the standard router: the launcher, and
the exact sweep.

Logits ℓ = z R1ᵀ with z = x R2ᵀ (low-rank) or ℓ = x Wᵀ (standard) are computed one
(BN, BM) tile at a time; the (N, M) logits never reach HBM, nor does z in the low-rank
inference. HBM traffic O(N h + M r + N k) plus the candidates below.

launch_sweep runs, for every k and both routers:
  1. router_candidates: per expert tile and row the tile's C best keys (C <= 4 chosen from
     k and the number of tiles), then the top-k of those candidates per row with exact
     values; rows for which the candidates may not hold the top-k are queued in REDO;
  2. _exact_kernel here, over the queued rows, or over all rows where candidates would
     queue most of them (few tiles and large k) or where the rows are too few to fill the
     GPU (then split over the experts and merged; the queued rows' sweep is split so too,
     its few blocks otherwise serial over every tile): each tile inserts, one logit per step,
     every logit that belongs in the row's running top-k (a block-uniform loop), compared
     by value and then by index: exact on the fp32 logits.

Kernels (grid, reads -> writes):
  _exact_kernel      (S/BN·SPLITS + (N-S)/BN,)  x, R1|W [, R2] [, REDO] -> top-k val fp32,
                                    idx int32, gates fp32 [+ online-softmax row max m and
                                    normaliser Z]; the first S rows (queue positions) split,
                                    each split's top-k to scratch (S, SPLITS, KP); a queue's
                                    parts at most 2 programs an SM each, looping over blocks
  _merge_kernel      (S/BN,)        the SPLITS top-k buffers -> top-k val, idx, gates (chosen by
                                    the tiles' logits as one sweep would, ordered by value)

Selection (docs/design.md, "Selection semantics"):
  * the exact sweep's running buffer keeps the fp32 logits of its entries and their
    experts; a logit enters when it is larger than the buffer's worst, or equal to it with
    a lower index, so the top-k is exact on the logits the tiles computed, ties to the
    lower index. The candidates' keys (_common.py) only filter: the pick queues here every
    row whose k-th and best left-out keys tie after truncation (router_candidates).
  * NaN and ±inf logits are never selected. A row with fewer than k
    selectable logits fills the remaining slots with the lowest expert indices not yet
    chosen; values are always the logits of the returned indices: the finite ones
    descending, then the others, ties by lower index. Gates are the softmax over the finite
    values (0 for the fillers; NaN for a row with no finite logit). The training statistics
    (m, Z, psum) count the finite logits only.
Index arithmetic on rows and experts is done in int64 (N·h and M·h pass 2^31).
Z, the softmax normaliser, is named norm in code (z is the projection x R2ᵀ).
"""
import math

import torch
import triton
import triton.language as tl

from ._common import (BIG_IDX, LINEAR, LOWRANK, MODE_LOWRANK, NEG_INF, column, dot_precision,
                      exact_values, fill_splits, logit_tile, next_pow2, sm_count, w_offsets_fit,
                      write_sorted, z_block, z_rows)
from .router_buffer import MAX_K as BUFFER_MAX_K, check_settings, launch_buffer
from .router_candidates import launch_candidates, launch_pick


@triton.jit
def _fill_unselected(bi, base, limit, K: tl.constexpr, KP: tl.constexpr):
    """Replace placeholder slots (negative idx) by the lowest experts in [base, limit) not
    chosen (runtime loops: the code size does not grow with k)."""
    slots = tl.arange(0, KP)
    for j in range(K):
        col_j = column(bi, j, KP)
        cand = tl.zeros_like(col_j) + base
        for _ in range(K):  # at most K-1 chosen indices can be in the way
            taken = tl.max((bi == cand[:, None]).to(tl.int32), axis=1)
            cand = cand + taken
        cand = tl.where(cand < limit, cand, BIG_IDX)
        bi = tl.where((slots[None, :] == j) & (col_j[:, None] < 0), cand[:, None], bi)
    return bi


@triton.jit
def _best_left(lv, cols, m0):
    """Each row's largest value left in the tile, its lowest column among equal ones, and
    that column's expert index: two reductions, the maximum and then the lowest column
    that holds it (one reduction of (value, column) pairs measured slower on an H200:
    1.768 against 1.673 ms, benchmarks/NOTES.md)."""
    top = tl.max(lv, axis=1)
    tcol = tl.min(tl.where(lv == top[:, None], cols[None, :], BIG_IDX), axis=1)
    return top, tcol, m0 + tcol


@triton.jit
def _enters(top, gidx, thr_v, thr_i):
    """Whether (top, gidx) beats the buffer's worst entry (thr_v, thr_i): a larger value, or
    an equal one of a lower index; -inf (non-finite, masked, none left) never enters."""
    return (top > NEG_INF) & ((top > thr_v) | ((top == thr_v) & (gidx < thr_i)))


@triton.jit
def _insert_exact(bv, bi, thr_v, thr_i, top, gidx, ok):
    """Put (top, gidx) into each row's buffer where ok, in place of its worst entry (the
    lowest value, among equal values the highest index); returns the new worst."""
    hit = (bv == thr_v[:, None]) & (bi == thr_i[:, None]) & ok[:, None]
    bv = tl.where(hit, top[:, None], bv)
    bi = tl.where(hit, gidx[:, None], bi)
    thr_v = tl.min(bv, axis=1)
    thr_i = tl.max(tl.where(bv == thr_v[:, None], bi, -BIG_IDX), axis=1)
    return bv, bi, thr_v, thr_i


@triton.jit
def _select_exact(lv, m0, bv, bi, thr_v, thr_i, BM: tl.constexpr):
    """Insert every logit of the tile (lv: the non-finite and masked ones -inf) that belongs
    in the running top-k, best first, by value and then by the lower index: exact on the
    fp32 logits (no key truncation). A row whose best left does not enter has nothing left
    that would, so the block-uniform loop ends when no row's does."""
    cols = tl.arange(0, BM)
    top, tcol, gidx = _best_left(lv, cols, m0)
    ok = _enters(top, gidx, thr_v, thr_i)
    while tl.max(ok.to(tl.int32), axis=0) > 0:
        bv, bi, thr_v, thr_i = _insert_exact(bv, bi, thr_v, thr_i, top, gidx, ok)
        lv = tl.where(cols[None, :] == tcol[:, None], NEG_INF, lv)
        top, tcol, gidx = _best_left(lv, cols, m0)
        ok = _enters(top, gidx, thr_v, thr_i)
    return bv, bi, thr_v, thr_i


@triton.jit
def _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, SC_VAL, SC_IDX, SC_KEY, OUT_M,
                 OUT_NORM, ROWS, start, count, split, splits, m_begin, m_end, N, H, M, R,
                 sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, K: tl.constexpr, KP: tl.constexpr,
                 MODE: tl.constexpr, STATS: tl.constexpr, GIVEN: tl.constexpr,
                 SCRATCH: tl.constexpr, in_split, BN: tl.constexpr,
                 BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr,
                 EVEN: tl.constexpr, FULL_R: tl.constexpr):
    """The exact sweep of the block of rows (queue positions for GIVEN) at start, below
    count, over experts [m_begin, m_end): into the outputs, or (SCRATCH, where in_split)
    into split `split`'s scratch entries."""
    pos = start + tl.arange(0, BN)
    row_ok = pos < count
    rows = tl.load(ROWS + pos, mask=row_ok, other=0) if GIVEN else pos
    rows64 = rows.to(tl.int64)
    if MODE == MODE_LOWRANK:
        z = z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h, BN, BR, BH,
                     PREC)
    else:
        z = z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE, BN, BR)
    slots = tl.arange(0, KP)
    bv = tl.where(slots[None, :] < K, NEG_INF, float("inf")) + tl.zeros((BN, KP),
                                                                        tl.float32)
    bi = -(slots[None, :] + 1) + tl.zeros((BN, KP), tl.int32)
    thr_v = tl.full((BN,), NEG_INF, tl.float32)
    thr_i = tl.full((BN,), -1, tl.int32)
    run_m = tl.full((BN,), NEG_INF, tl.float32)
    run_norm = tl.zeros((BN,), tl.float32)
    for m0 in range(m_begin, m_end, BM):
        cols = m0 + tl.arange(0, BM)
        col_ok = (cols < M) | EVEN
        logits = logit_tile(z, X, W, rows64, row_ok, m0, cols, col_ok, H, R, sx_n, sx_h,
                            sw_m, sw_k, MODE, BN, BM, BR, BH, PREC, FULL_R)
        lv = tl.where(tl.abs(logits) < float("inf"), logits, NEG_INF)   # NaN too
        if not EVEN:
            lv = tl.where(col_ok[None, :], lv, NEG_INF)
        if STATS:   # over the finite logits: a row of none has m = -inf, Z = 0
            new_m = tl.maximum(run_m, tl.max(lv, axis=1))
            safe_m = tl.where(new_m == NEG_INF, 0.0, new_m)
            p = tl.exp(lv - safe_m[:, None])
            run_norm = run_norm * tl.exp(run_m - safe_m) + tl.sum(p, axis=1)
            run_m = new_m
        bv, bi, thr_v, thr_i = _select_exact(lv, m0, bv, bi, thr_v, thr_i, BM)
    if tl.min(tl.min(bi, axis=1), axis=0) < 0:
        bi = _fill_unselected(bi, m_begin, m_end, K, KP)
    vals = exact_values(z, X, W, bi, rows64, row_ok, M, H, R, sx_n, sx_h, sw_m, sw_k,
                        K, KP, MODE, BR, BH)
    if SCRATCH:     # the split's buffer as it is: the tiles' logits, experts, values
        if in_split:
            offs = pos.to(tl.int64)[:, None] * (splits * KP) + split * KP + slots[None, :]
            tl.store(SC_KEY + offs, bv, mask=row_ok[:, None])
            tl.store(SC_IDX + offs, bi, mask=row_ok[:, None])
            tl.store(SC_VAL + offs, vals, mask=row_ok[:, None])
        else:
            write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, K, K, KP)
    else:
        write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, K, K, KP)
    if STATS:
        tl.store(OUT_M + rows64, run_m, mask=row_ok)
        tl.store(OUT_NORM + rows64, run_norm, mask=row_ok)


@triton.jit
def _exact_kernel(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, SC_VAL, SC_IDX, SC_KEY, OUT_M,
                  OUT_NORM, ROWS, ROWS_N, split_rows, splits, split_step, rest_step, N, H, M,
                  R, m_per_split, sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, K: tl.constexpr,
                  KP: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
                  GIVEN: tl.constexpr, SCRATCH: tl.constexpr, BN: tl.constexpr,
                  BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr,
                  EVEN: tl.constexpr = False,
                  FULL_R: tl.constexpr = False):
    """The exact sweep of blocks of BN rows: rows b·BN + i, or (GIVEN) the queued rows
    ROWS[b·BN + i] below ROWS_N. The first split_rows rows are split `splits` ways over the
    experts: program p·splits + s (p < split_step) takes blocks p, p + split_step, ... of
    them over experts [s·m_per_split, (s + 1)·m_per_split) and (SCRATCH) writes each
    split's running buffer (the tiles' logits in SC_KEY, experts, exact values:
    (split_rows, splits, KP)) at the row's position, unsorted, for _merge_kernel; each
    program after them takes every rest_step-th block past the split rows over all experts
    into the outputs. A queue is sized on the device, so its programs are launched for the
    queue's longest and a few blocks each cover it (launch_exact), rather than one program
    a possible block: at N = 262,144 that was some 15 waves of programs that read ROWS_N
    and exit. STATS (no split) adds the online-softmax statistics m, Z over the finite
    logits. EVEN: every tile is full (no expert masks); FULL_R: r == BR (no rank masks)."""
    pid = tl.program_id(0)
    split_programs = split_step * splits
    split = pid % splits
    m_begin = split * m_per_split
    m_end = tl.minimum(M, m_begin + m_per_split)
    if GIVEN:       # a queue: each program walks its part's blocks
        count = tl.load(ROWS_N)
        if pid < split_programs:
            for start in range((pid // splits) * BN, tl.minimum(count, split_rows),
                               split_step * BN):
                _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, SC_VAL, SC_IDX, SC_KEY,
                             OUT_M, OUT_NORM, ROWS, start, count, split, splits, m_begin,
                             m_end, N, H, M, R, sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, K, KP,
                             MODE, STATS, GIVEN, SCRATCH, True, BN, BM, BR, BH, PREC, EVEN,
                             FULL_R)
        else:
            for start in range(split_rows + (pid - split_programs) * BN, count,
                               rest_step * BN):
                _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, SC_VAL, SC_IDX, SC_KEY,
                             OUT_M, OUT_NORM, ROWS, start, count, 0, splits, 0, M, N, H, M, R,
                             sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, K, KP, MODE, STATS, GIVEN,
                             SCRATCH, False, BN, BM, BR, BH, PREC, EVEN, FULL_R)
    else:           # every row: one block a program, one sweep in the code (registers)
        in_split = pid < split_programs
        start = tl.where(in_split, (pid // splits) * BN,
                         split_rows + (pid - split_programs) * BN)
        _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, SC_VAL, SC_IDX, SC_KEY, OUT_M,
                     OUT_NORM, ROWS, start, N, split, splits, tl.where(in_split, m_begin, 0),
                     tl.where(in_split, m_end, M), N, H, M, R, sx_n, sx_h, sw_m, sw_k, s2_r,
                     s2_h, K, KP, MODE, STATS, GIVEN, SCRATCH, in_split, BN, BM, BR, BH, PREC,
                     EVEN, FULL_R)


@triton.jit
def _merge_kernel(IN_VAL, IN_IDX, IN_KEY, OUT_VAL, OUT_IDX, OUT_GATE, ROWS, ROWS_N, limit, N,
                  M, SPLITS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
                  GIVEN: tl.constexpr, BN: tl.constexpr):
    """Top-k of the SPLITS·K candidates the split exact sweep wrote for each row (GIVEN:
    each queued row below limit), chosen as one sweep chooses them: by the tiles' fp32
    logits (IN_KEY), ties (and the fillers, whose logit there is -inf) to the lower expert;
    then ordered by exact value into the row's outputs. Choosing by exact_values' sums
    instead (another summation order) could make a row's routing depend on whether its
    batch was split."""
    start = tl.program_id(0) * BN
    count = tl.minimum(tl.load(ROWS_N), limit) if GIVEN else N
    if start < count:
        pos = start + tl.arange(0, BN)
        ok = pos < count
        rows = (tl.load(ROWS + pos, mask=ok, other=0) if GIVEN else pos).to(tl.int64)
        c = tl.arange(0, CP)
        c_ok = (c < SPLITS * KP) & ((c % KP) < K)
        offs = pos.to(tl.int64)[:, None] * (SPLITS * KP) + c[None, :]
        m = ok[:, None] & c_ok[None, :]
        v = tl.load(IN_VAL + offs, mask=m, other=NEG_INF)
        key = tl.load(IN_KEY + offs, mask=m, other=NEG_INF)
        i = tl.load(IN_IDX + offs, mask=m, other=BIG_IDX)
        i = tl.where(c_ok[None, :] & (i >= 0) & (i < M), i, BIG_IDX)  # a split smaller than k
        slots = tl.arange(0, KP)
        sel_v = tl.zeros((BN, KP), dtype=tl.float32)
        sel_i = tl.full((BN, KP), BIG_IDX, tl.int32)
        for j in range(K):
            top = tl.max(key, axis=1)
            pick = tl.min(tl.where(key == top[:, None], i, BIG_IDX), axis=1)
            hit = i == pick[:, None]
            sel_v = tl.where(slots[None, :] == j,
                             tl.sum(tl.where(hit, v, 0.0), axis=1)[:, None], sel_v)
            sel_i = tl.where(slots[None, :] == j, pick[:, None], sel_i)
            key = tl.where(hit, NEG_INF, key)
            i = tl.where(hit, BIG_IDX, i)
        write_sorted(sel_v, sel_i, rows, ok, OUT_VAL, OUT_IDX, OUT_GATE, K, K, KP)


# ---------------------------------------------------------------- launcher

def _flag_share(k: int, c: int, tiles: int) -> float:
    """Expected share of rows whose top-k has c or more experts in one tile (the pick cannot
    tell whether the tile's next key belongs, or ties the last one after truncation: the
    row is redone), for top-k positions spread evenly over the tiles; none when c > k."""
    if c > k:
        return 0.0
    return min(1.0, math.comb(k, c) / tiles ** (c - 1))


def pick_candidates(k: int, tiles: int, redo_cost: float = 12.0) -> int:
    """Keys kept per tile (1..4), or 0 for the exact sweep over all rows: the least of
    ~2c ALU ops per logit + the share of rows redone × the exact sweep's ops per logit."""
    costs = {c: 2 * c + redo_cost * _flag_share(k, c, tiles)
             for c in range(1, min(k + 1, 4) + 1)}
    c = min(costs, key=costs.get)
    return c if costs[c] < redo_cost else 0


def sweep_config(mode: int, R: int, H: int, K: int, M: int = 1 << 13,
                 overrides: dict | None = None, *, fp32: bool = False) -> dict:
    """Block sizes and the selection schedule, from measurements on an H100 (h=512, M=8192,
    r=64, N=262,144; benchmarks/NOTES.md): BN = 64 rows (one warpgroup MMA); BR the rank
    padded to a power of two >= 16 (the MMA's K); BH the h chunk of x R2ᵀ / x Wᵀ; BM = 128
    experts per tile (keys keep 15 exact mantissa bits; a 256 x 256 R1 tile would not fit in
    shared memory at r = 256); C the keys per tile of the candidates pass (0: exact sweep),
    cand_stages its pipeline depth, bwd_stages that of the low-rank backward's sweeps; path
    the inference selection: "buffer" (router_buffer's one pass) for the low-rank router in
    bf16 / fp16 at k <= 8, faster than the candidates at every shape timed (H100, h = 512
    and 2,048, M = 512 to 16,384, k = 1, 4, 8: 1.02-1.21x; NOTES, fourteenth session), else
    "candidates" (and where the overrides give C, the candidates' own setting); the
    low-rank router's inference paths all with 64-expert tiles at 256 < M <= 512 (the one
    pass 0.262 against 0.285 ms at M = 512), at k = 4 for 2,048 < M <= 4,096 (0.700 against
    0.789 ms at M = 3,072) and at k = 8 for 7,168 < M <= 8,192 (1.958 against 1.987 ms at
    M = 8,192): one tile width, so that the paths compute the same logits. The standard
    router takes 256-expert tiles (h = 2,048: 18 ms against 31 ms at 128) and, from
    h = 1,024, 128-row tiles of 8 warps.
    fp32 inputs multiply exactly (FMA, not the MMA): 32 x 64 tiles keep the unrolled code,
    and with it the first call's compile time, bounded."""
    BR = 16 if mode == LINEAR else max(16, next_pow2(R))
    cfg = {"BN": 64, "BM": 128, "BR": BR, "BH": min(64, max(16, next_pow2(H))),
           "num_warps": 4 if BR <= 64 else 8, "num_stages": 2, "cand_stages": 3, "laneb": 6,
           "bwd_stages": 3}
    one_pass = mode == LOWRANK and not fp32 and K <= BUFFER_MAX_K and "C" not in (overrides or {})
    cfg["path"] = "buffer" if one_pass else "candidates"
    if mode == LOWRANK and 256 < M <= 512:
        # 64-expert tiles: at 4 tiles of 128, four keys a tile still crowd binom(k, 4) / T^3
        # of the rows (1/64: most blocks of 64 rows re-examine a tile), at 8 tiles 1/512;
        # the one pass 0.262 against 0.285 ms at M = 512 (H100, 0e637fc; 13 % slower at
        # M = 8,192, where 64 tiles crowd few rows). Timed at M = 512 only: smaller routers
        # (the phonebook's) keep their tiles and their training path's choice until timed.
        # Every inference path of the low-rank router takes them (the one pass, the
        # candidates, the exact sweep): the MMA of a 64-wide tile may round a logit
        # otherwise than a 128-wide one (1 row of 262,144 at M = 512 chose another expert,
        # H100), and those paths must agree. Training (z given by cuBLAS, so its logits
        # round otherwise anyway) keeps 128
        cfg["BM"] = 64
    if mode == LOWRANK and (K == 4 and 2048 < M <= 4096 or K == 8 and 7168 < M <= 8192):
        # 64-expert tiles where two keys a tile would crowd many tiles of 128: binom(k, 3) /
        # T^2 of the rows re-examine one, at k = 4 over 24 tiles of 128 0.7 % (a third of
        # the blocks of 64 rows), over 48 of 64 0.2 %. Measured (the one pass, ms, H100, one
        # run, 43d09bf; NOTES, twenty-first session): k = 4, M = 3,072 0.700 against 0.789,
        # M = 4,096 0.826 against 0.868 (h = 2,048: 1.005 against 1.068); k = 8, M = 8,192
        # 1.958 against 1.987 (four keys over 64 tiles of 128). Not past them: k = 4, M =
        # 6,144 1.106 against 1.026, k = 8, M = 12,288 2.557 against 2.413; up to 16 tiles
        # (k = 4) and 56 (k = 8) of 128 four keys a tile instead (router_buffer.schedule).
        # Timed at k = 4 and 8 only. Every inference path at this k takes the width, so that
        # they select the same experts
        cfg["BM"] = 64
    if mode == LINEAR:   # GEMM-shaped tiles: the x Wᵀ MMA over h sets the pace
        cfg.update(BM=256, cand_stages=2)
        if H >= 1024:
            cfg.update(BN=128, num_warps=8, num_stages=3, cand_stages=3 if H < 2048 else 4)
    if fp32:
        cfg.update(BN=32, BM=64, BH=min(cfg["BH"], 32), num_warps=4, num_stages=2,
                   cand_stages=2, bwd_stages=2)
    cfg.update(overrides or {})
    if "C" not in cfg:
        cfg["C"] = pick_candidates(K, triton.cdiv(M, cfg["BM"]))
    return cfg


# The queued rows' sweep (GIVEN) is split over the experts too: a few queued rows (about
# 0.05 % of random rows at M = 8,192: 2-3 blocks) otherwise sweep all tiles serially on a
# few SMs, 182 of 1,373 us on an H100 (NOTES, seventeenth session). At most QUEUE_SPLITS
# splits of at least one tile; the first QUEUE_CAP queue positions are split (their
# scratch: QUEUE_CAP x splits x KP entries), the rest swept whole in the same launch (a
# queue that long fills the GPU unsplit).
QUEUE_SPLITS = 16
QUEUE_CAP = 4096
# A queue's length is known on the device only: its sweep is launched for the longest
# (every row), QUEUE_PROGRAMS_PER_SM programs an SM at most for each of its two parts (the
# split positions, the rest), each taking every so-many-th block; at 2 (an SM holds two of
# these programs: 208-240 registers a thread compiled for sm_90) a short queue's idle
# programs are a wave or two, where one program a possible block was some 15 waves at
# N = 262,144 (ncu, 0e637fc: 237 registers, two blocks an SM, 15.5 waves).
QUEUE_PROGRAMS_PER_SM = 2


def queue_splits(M: int, BM: int) -> int:
    """Ways the queued rows' sweep splits the experts (cfg "queue_splits" overrides)."""
    return max(1, min(QUEUE_SPLITS, triton.cdiv(M, BM)))


def launch_exact(x, w, r2, k: int, *, mode: int, cfg: dict, out, rows=None, rows_n=None,
                 stats=None, splits: int = 1):
    """The exact sweep into out = (val, idx, gates) for all rows or the queued ones (rows,
    rows_n: a queue on the device), split over `splits` ways of the experts (each way's
    top-k merged after) when there are too few rows to fill the GPU: the sweep of one block
    is serial over M. The queued rows' sweep splits by queue_splits, its first QUEUE_CAP
    positions, with QUEUE_PROGRAMS_PER_SM programs an SM for each part (cfg
    "queue_splits", "queue_cap", "queue_programs": programs a part, override)."""
    N, H, M = x.shape[0], x.shape[1], w.shape[0]
    R = r2.shape[0] if mode == LOWRANK else H
    r2_ = r2 if r2 is not None else x
    given = rows is not None
    if not given:
        # unread placeholders (GIVEN is off): no fill kernel for them
        rows = rows_n = torch.empty(1, device=x.device, dtype=torch.int32)
    m_row, norm_row = stats if stats is not None else (out[0], out[0])
    BM, BN, KP = cfg["BM"], cfg["BN"], next_pow2(k)
    for key in ("queue_splits", "queue_cap", "queue_programs"):
        v = cfg.get(key)
        if v is not None and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"router config {key} must be a positive int, got {v!r}")
    if given and stats is None:
        splits = cfg.get("queue_splits") or queue_splits(M, BM)
    splits = 1 if stats is not None else max(1, min(splits, triton.cdiv(M, BM)))
    m_per_split = triton.cdiv(triton.cdiv(M, BM), splits) * BM
    splits = triton.cdiv(M, m_per_split)
    # rows split over the experts (queue positions for GIVEN); the rest swept whole
    cap = 0 if splits == 1 else (
        min(N, triton.cdiv(cfg.get("queue_cap", QUEUE_CAP), BN) * BN) if given else N)
    scratch = [torch.empty(cap, splits, KP, device=x.device, dtype=dt) if cap else out[0]
               for dt in (torch.float32, torch.int32, torch.float32)]
    split_step, rest_step = triton.cdiv(cap, BN), triton.cdiv(N - cap, BN)
    if given:       # programs for the queue's longest, a few blocks each (the kernel's doc)
        most = cfg.get("queue_programs") or QUEUE_PROGRAMS_PER_SM * sm_count(x.device)
        split_step = min(split_step, max(1, most // splits))
        rest_step = min(rest_step, most)
    programs = split_step * splits + rest_step
    _exact_kernel[(programs,)](
        x, w, r2_, *out, *scratch, m_row, norm_row, rows, rows_n, cap, splits, split_step,
        rest_step, N, H, M, R,
        m_per_split, x.stride(0), x.stride(1), w.stride(0), w.stride(1), r2_.stride(0),
        r2_.stride(1), K=k, KP=KP, MODE=mode, STATS=stats is not None, GIVEN=given,
        SCRATCH=cap > 0, BN=BN, BM=BM, BR=cfg["BR"], BH=cfg["BH"],
        PREC=dot_precision(x.dtype), EVEN=M % BM == 0 and m_per_split % BM == 0,
        FULL_R=mode != LINEAR and R == cfg["BR"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if cap:
        BNm = 32
        _merge_kernel[(triton.cdiv(cap, BNm),)](
            scratch[0], scratch[1], scratch[2], *out, rows, rows_n, cap, N, M, SPLITS=splits,
            K=k, KP=KP, CP=next_pow2(splits * KP), GIVEN=given, BN=BNm, num_warps=4)


def launch_sweep(x, w, k: int, *, mode: int, r2=None, stats: bool = False,
                 splits: int | None = None, config: dict | None = None):
    """Top-k of x against w (R1, or W) and, for the low-rank inference mode, r2 (R2).
    Returns (val (N,k) fp32, idx (N,k) int32, gates (N,k) fp32, m (N,) fp32 | None,
    Z (N,) fp32 | None). splits: ways to split the experts (default: enough programs to
    fill the GPU; 1 with stats). Too few token blocks to fill the GPU (cfg "small", default
    fewer than half the SMs; inference only): the exact sweep split over the experts, as
    the candidates' pick and redo would add two launches and a serial sweep of latency."""
    N, M, H = x.shape[0], w.shape[0], x.shape[1]
    R = r2.shape[0] if mode == LOWRANK else H
    dev = x.device
    out = tuple(torch.empty(N, k, device=dev, dtype=dt)
                for dt in (torch.float32, torch.int32, torch.float32))
    st = (torch.empty(N, device=dev, dtype=torch.float32),
          torch.empty(N, device=dev, dtype=torch.float32)) if stats else None
    if N > 0:
        cfg = sweep_config(mode, R, H, k, M, config, fp32=x.dtype == torch.float32)
        check_settings(cfg, k)      # whichever path follows (a small batch: the exact sweep)
        if not w_offsets_fit(w, cfg["BM"], H if mode == LINEAR else cfg["BR"]):
            w = w.contiguous()      # a tile past 32-bit offsets (logit_tile): copy, rarely
        n_blocks = triton.cdiv(N, cfg["BN"])
        small = cfg.get("small")
        if small is None:
            small = dev.type == "cuda" and 2 * n_blocks < sm_count(dev)
        buffer = cfg["path"] == "buffer" and not stats and k <= BUFFER_MAX_K
        if (cfg["C"] == 0 and not buffer) or (small and not stats):
            ways = 1 if stats else (splits or fill_splits(dev, n_blocks, M, cfg["BM"]))
            launch_exact(x, w, r2, k, mode=mode, cfg=cfg, out=out, stats=st, splits=ways)
        elif buffer:
            rows, rows_n = launch_buffer(x, w, r2, k, mode=mode, cfg=cfg, out=out)
            launch_exact(x, w, r2, k, mode=mode, cfg=cfg, out=out, rows=rows, rows_n=rows_n)
        else:
            cand, z = launch_candidates(x, w, r2, k, mode=mode, cfg=cfg, stats=st,
                                        splits=splits)
            rows, rows_n = launch_pick(cand, z, x, w, k, mode=mode, cfg=cfg, out=out)
            launch_exact(x, w, r2, k, mode=mode, cfg=cfg, out=out, rows=rows, rows_n=rows_n)
    return (*out, *(st if stats else (None, None)))
