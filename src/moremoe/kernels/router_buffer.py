"""The one-pass inference selection of the top-k routers: each row's running top-k held in
registers across the expert tiles, no candidates in HBM, one launch (plus the exact sweep of
the rare doubtful rows).

Reads x (N, h) [, R2 (r, h)], R1 | W (M, r | h); writes top-k values (N, k) fp32 (exact
logits of the winners, descending), indices (N, k) int32, gates (N, k) fp32, and REDO,
REDO_N: the rows the exact sweep (router_topk) must decide. Neither the (N, M) logits nor z
nor any candidate leaves the chip.

Per tile and row, the tile's C best keys (C = 2, or 4 where the tiles are few; _common: an
fp32 logit with its column's code in the low bits, so a max yields value and column; 2C - 1
ops a logit) are merged into a sorted buffer of KP = next_pow2(k) slots (s0 >= s1 >= ...;
each slot holds a key and its tile) by a bitonic merge, per row, not per logit. What the
buffer pushes out raises LEFT, the best key seen and not kept. A tile can hide a member of
the top-k only behind C of its keys that all made the top-k (its next was never looked at):
after the sweep those crowded tiles are examined again, lowest first and once each, one
block-uniform round after another below the row's lowest key from the tile until no row's
C-th key enters ("lazy", the default), or the rounds follow each tile ("eager", slower at
every shape timed). For top-k positions spread evenly over T tiles, C = 2 crowds about
binom(k, 2) / T of the rows (9 % at k = 4, T = 64) and, in a block of BN rows,
1 - (1 - 1/T)^(BN binom(k, 2) / T) of the tiles (9 % at M = 8,192), where eager rounds
would follow half the tiles; schedule() picks C. Where C = k = 4 a crowded row's top four
are one tile's four best, and the tile's fifth is out of the top four; only a tie of it with
the fourth would go unseen, so such rows (1 / T^3 of them) are queued for the exact sweep
instead of the tile examined again (at 4 tiles that was a round in most blocks of 64 rows).
The inference default of the low-rank router in bf16 / fp16 at k <= 8
(router_topk.sweep_config). The R1 | W tiles are addressed by _common.logit_tile (32-bit
in-tile offsets), and the launch is bounded to MAXNREG registers a thread.

Exactness: the buffer orders keys, whose low bits are the column code, not the logit. A row
is queued for the exact sweep where its k-th key and the best key it left out are equal with
the code bits cleared (then either logit may be the larger), where a tile held a non-finite
logit (the GPU's NaN-propagating max makes the tile's first key NaN), or where fewer than k
keys were finite. Elsewhere every selected logit is larger than every other, whatever their
signs, so the set is the exact top-k; the values are recomputed exactly and ordered by
write_sorted. Designed for k <= 8 (KP slots unrolled in registers); larger k takes the
candidates pass.
"""
import torch
import triton
import triton.language as tl

from ._common import (BIG_IDX, LOWRANK, LINEAR, MODE_LOWRANK, NEG_INF, QUIET_KEYS, best_keys,
                      dot_precision, exact_values, key_column, logit_tile, next_pow2,
                      pack_keys, queue_rows, trunc_keys, write_sorted, z_block, z_rows)

MAX_K = 8      # the buffer's slots are unrolled: k up to 8


@triton.jit
def _cx(s, ps, v, pv):
    """Compare-exchange: (the larger key and its tile, the smaller and its tile); an equal
    key stays behind the one already there (an earlier tile, a lower expert)."""
    swap = v > s
    return (tl.where(swap, v, s), tl.where(swap, pv, ps), tl.where(swap, s, v),
            tl.where(swap, ps, pv))


@triton.jit
def _join(s, ps, v, pv):
    """The larger of slot s and v with its tile (an equal v stays out), and the smaller."""
    swap = v > s
    return tl.where(swap, v, s), tl.where(swap, pv, ps), tl.minimum(s, v)


@triton.jit
def _sort4(s0, s1, s2, s3, p0, p1, p2, p3):
    """A bitonic sequence of four slots sorted: compare-exchanges at distance 2, then 1."""
    s0, p0, s2, p2 = _cx(s0, p0, s2, p2)
    s1, p1, s3, p3 = _cx(s1, p1, s3, p3)
    s0, p0, s1, p1 = _cx(s0, p0, s1, p1)
    s2, p2, s3, p3 = _cx(s2, p2, s3, p3)
    return s0, s1, s2, s3, p0, p1, p2, p3


@triton.jit
def _merge(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, c1, c2, c3, c4,
           t, KP: tl.constexpr, C: tl.constexpr):
    """The best KP of the sorted slots and the C (2 or 4) sorted keys c1 >= c2 >= ... of tile
    t, by a bitonic merge: the keys reversed against slots KP-C..KP-1 keep the best KP in a
    bitonic sequence, which compare-exchanges at distances KP/2 .. 1 sort (at distance KP/2,
    only those reaching a joined slot: the others are sorted already). Returns the slots,
    the larger key pushed out, and whether the C-th key entered. KP = 1 takes c1 and pushes
    c2 out (C = 2)."""
    if KP == 1:
        entered = c2 > c2
        s0, p0, out = _join(s0, p0, c1, t)
        out = tl.maximum(out, c2)
    elif KP == 2:
        entered = c2 > s0
        s0, p0, out2 = _join(s0, p0, c2, t)
        s1, p1, out1 = _join(s1, p1, c1, t)
        out = tl.maximum(out1, out2)
        s0, p0, s1, p1 = _cx(s0, p0, s1, p1)
    elif KP == 4:
        if C == 2:
            entered = c2 > s2
        else:
            entered = c4 > s0
            s0, p0, out4 = _join(s0, p0, c4, t)
            s1, p1, out3 = _join(s1, p1, c3, t)
        s2, p2, out2 = _join(s2, p2, c2, t)
        s3, p3, out1 = _join(s3, p3, c1, t)
        out = tl.maximum(out1, out2)
        if C == 4:
            out = tl.maximum(out, tl.maximum(out3, out4))
        s0, s1, s2, s3, p0, p1, p2, p3 = _sort4(s0, s1, s2, s3, p0, p1, p2, p3)
    else:
        if C == 2:
            entered = c2 > s6
        else:
            entered = c4 > s4
            s4, p4, out4 = _join(s4, p4, c4, t)
            s5, p5, out3 = _join(s5, p5, c3, t)
        s6, p6, out2 = _join(s6, p6, c2, t)
        s7, p7, out1 = _join(s7, p7, c1, t)
        out = tl.maximum(out1, out2)
        if C == 4:
            out = tl.maximum(out, tl.maximum(out3, out4))
            s0, p0, s4, p4 = _cx(s0, p0, s4, p4)
            s1, p1, s5, p5 = _cx(s1, p1, s5, p5)
        s2, p2, s6, p6 = _cx(s2, p2, s6, p6)
        s3, p3, s7, p7 = _cx(s3, p3, s7, p7)
        s0, s1, s2, s3, p0, p1, p2, p3 = _sort4(s0, s1, s2, s3, p0, p1, p2, p3)
        s4, s5, s6, s7, p4, p5, p6, p7 = _sort4(s4, s5, s6, s7, p4, p5, p6, p7)
    return s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, out, entered


@triton.jit
def _take(keys, t, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left,
          nan_seen, KP: tl.constexpr, C: tl.constexpr, TUPLE: tl.constexpr):
    """Merge the C (2 or 4) best of keys (BN, BM) of tile t into the slots. Returns the
    slots, LEFT, the NaN flags, the C-th key (every key of the tile not taken is below it)
    and whether it entered (then the tile's next key might too)."""
    # a NaN c1 (the tile held a non-finite logit) queues the row: its slots are not
    # cleaned (a NaN key never passes a compare; only that row's buffer is wrong)
    c1, c2, c3, c4 = best_keys(keys, C, TUPLE)
    nan_seen = nan_seen | (c1 != c1).to(tl.int32)
    tile = tl.zeros_like(p0) + t
    s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, out, entered = _merge(
        s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, c1, c2, c3, c4, tile,
        KP, C)
    if C == 2:
        last = c2
    else:
        last = c4
    left = tl.maximum(left, out)
    return (s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left, nan_seen,
            last, entered)


@triton.jit
def _tile_keys(z, X, W, rows64, row_ok, t, M, H, R, sx_n, sx_h, sw_m, sw_k,
               MODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
               BH: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr,
               FULL_R: tl.constexpr, LANEB: tl.constexpr):
    """The keys (BN, BM) of tile t; masked experts -inf."""
    cols = t * BM + tl.arange(0, BM)
    col_ok = (cols < M) | EVEN
    logits = logit_tile(z, X, W, rows64, row_ok, t * BM, cols, col_ok, H, R, sx_n, sx_h,
                        sw_m, sw_k, MODE, BN, BM, BR, BH, PREC, FULL_R)
    keys = pack_keys(logits, BM, LANEB)
    if QUIET_KEYS:
        keys = tl.where(keys == keys, keys, NEG_INF)
    if not EVEN:
        keys = tl.where(col_ok[None, :], keys, NEG_INF)
    return keys


@triton.jit
def _pairs(s, p, sa, pa):
    """1 where slot (s, p) and slot (sa, pa) hold keys of one tile."""
    return ((p == pa) & (s > NEG_INF) & (sa > NEG_INF)).to(tl.int32)


@triton.jit
def _crowded(s, p, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, after,
             K: tl.constexpr, C: tl.constexpr):
    """Slot (s, p)'s tile where it holds C of the row's top K and lies after `after`; else
    BIG_IDX."""
    n = _pairs(s, p, s0, p0)
    if K > 1:
        n += _pairs(s, p, s1, p1)
    if K > 2:
        n += _pairs(s, p, s2, p2)
    if K > 3:
        n += _pairs(s, p, s3, p3)
    if K > 4:
        n += _pairs(s, p, s4, p4)
    if K > 5:
        n += _pairs(s, p, s5, p5)
    if K > 6:
        n += _pairs(s, p, s6, p6)
    if K > 7:
        n += _pairs(s, p, s7, p7)
    return tl.where((n >= C) & (p > after), p, BIG_IDX)


@triton.jit
def _next_crowded(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, after,
                  K: tl.constexpr, C: tl.constexpr):
    """The lowest tile after `after` that holds C of some row's top K (BIG_IDX: none)."""
    t = _crowded(s0, p0, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7,
                 after, K, C)
    if K > 1:
        t = tl.minimum(t, _crowded(s1, p1, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
    if K > 2:
        t = tl.minimum(t, _crowded(s2, p2, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
    if K > 3:
        t = tl.minimum(t, _crowded(s3, p3, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
    if K > 4:
        t = tl.minimum(t, _crowded(s4, p4, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
        t = tl.minimum(t, _crowded(s5, p5, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
        t = tl.minimum(t, _crowded(s6, p6, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
        t = tl.minimum(t, _crowded(s7, p7, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                   p4, p5, p6, p7, after, K, C))
    return tl.min(t, axis=0)


@triton.jit
def _lowest_of(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, u,
               KP: tl.constexpr):
    """Each row's lowest key from tile u in the slots (+inf where none): the tile's keys
    above it are all in the buffer, those below were not taken."""
    low = tl.where(p0 == u, s0, float("inf"))
    if KP > 1:
        low = tl.minimum(low, tl.where(p1 == u, s1, float("inf")))
    if KP > 2:
        low = tl.minimum(low, tl.where(p2 == u, s2, float("inf")))
        low = tl.minimum(low, tl.where(p3 == u, s3, float("inf")))
    if KP > 4:
        low = tl.minimum(low, tl.where(p4 == u, s4, float("inf")))
        low = tl.minimum(low, tl.where(p5 == u, s5, float("inf")))
        low = tl.minimum(low, tl.where(p6 == u, s6, float("inf")))
        low = tl.minimum(low, tl.where(p7 == u, s7, float("inf")))
    return low


@triton.jit
def _slot(bi, s, p, j: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, KP: tl.constexpr):
    """Column j of the (BN, KP) experts: slot (s, p)'s expert; -1 for an empty slot and for
    the slots past the k-th (seen, not kept)."""
    idx = tl.where(s > NEG_INF, p * BM + key_column(s, BM), -1)
    if j >= K:
        idx = tl.full(idx.shape, -1, tl.int32)
    return tl.where(tl.arange(0, KP)[None, :] == j, idx[:, None], bi)


@triton.jit
def _buffer_kernel(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, REDO, REDO_N, N, H, M, R,
                   sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, so_n,
                   K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr,
                   BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                   PREC: tl.constexpr, EVEN: tl.constexpr, FULL_R: tl.constexpr,
                   LANEB: tl.constexpr, TUPLE: tl.constexpr, C: tl.constexpr,
                   EAGER: tl.constexpr, EVEN_H: tl.constexpr):
    """The sweep of one block of rows, the crowded tiles again (EAGER: rounds after each
    tile instead, while a row's second key enters), the outputs and the queue."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    if MODE == MODE_LOWRANK:
        z = z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h, BN, BR, BH, PREC,
                    EVEN_H, FULL_R)
    else:
        z = z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE, BN, BR)
    s0 = tl.full((BN,), NEG_INF, tl.float32)
    s1, s2, s3, s4, s5, s6, s7, left = s0, s0, s0, s0, s0, s0, s0, s0
    p0 = tl.full((BN,), -1, tl.int32)
    p1, p2, p3, p4, p5, p6, p7 = p0, p0, p0, p0, p0, p0, p0
    nan_seen = tl.zeros((BN,), tl.int32)
    T = tl.cdiv(M, BM)
    for t in range(0, T):
        keys = _tile_keys(z, X, W, rows64, row_ok, t, M, H, R, sx_n, sx_h, sw_m, sw_k, MODE,
                          BN, BM, BR, BH, PREC, EVEN, FULL_R, LANEB)
        (s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left, nan_seen,
         below, entered) = _take(keys, t, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
                                 p4, p5, p6, p7, left, nan_seen, KP, C, TUPLE)
        if EAGER:   # KP // C more takes: the last can never enter (unrolled: no nested loop)
            more = tl.max(entered.to(tl.int32), axis=0)
            for _ in tl.static_range(KP // C):
                if more > 0:
                    keys = tl.where(keys < below[:, None], keys, NEG_INF)
                    (s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left,
                     nan_seen, below, entered) = _take(
                        keys, t, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5,
                        p6, p7, left, nan_seen, KP, C, TUPLE)
                    more = tl.max(entered.to(tl.int32), axis=0)
    if EAGER or C > K or (C == 4 and K == 4):   # no tile left crowded, none can be, or see _finish
        u = T
    else:
        u = _next_crowded(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7,
                          -1, K, C)
    while u < T:
        keys = _tile_keys(z, X, W, rows64, row_ok, u, M, H, R, sx_n, sx_h, sw_m, sw_k, MODE,
                          BN, BM, BR, BH, PREC, EVEN, FULL_R, LANEB)
        below = _lowest_of(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7,
                           u, KP)
        more = (u >= 0).to(tl.int32)
        while more > 0:
            keys = tl.where(keys < below[:, None], keys, NEG_INF)
            (s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left, nan_seen,
             below, entered) = _take(keys, u, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2,
                                     p3, p4, p5, p6, p7, left, nan_seen, KP, C, TUPLE)
            more = tl.max(entered.to(tl.int32), axis=0)
        u = _next_crowded(s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7,
                          u, K, C)
    crowded = tl.zeros((BN,), tl.int32)
    if C == 4 and K == 4 and not EAGER:   # 1 / T^3 of the rows: queued, not examined again
        crowded = _one_tile(s0, s1, s2, s3, p0, p1, p2, p3).to(tl.int32)
    _finish(z, X, W, OUT_VAL, OUT_IDX, OUT_GATE, REDO, REDO_N, rows, rows64, row_ok,
            s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left, nan_seen,
            crowded, M, H, R, sx_n, sx_h, sw_m, sw_k, so_n, K, KP, MODE, BM, BR, BH)


@triton.jit
def _kth_and_left(s0, s1, s2, s3, s4, s5, s6, s7, left, K: tl.constexpr):
    """The k-th key, and the best key not kept: LEFT or the slots past the k-th."""
    if K == 1:
        return s0, left
    elif K == 2:
        return s1, left
    elif K == 3:
        return s2, tl.maximum(left, s3)
    elif K == 4:
        return s3, left
    elif K == 5:
        return s4, tl.maximum(left, s5)
    elif K == 6:
        return s5, tl.maximum(left, s6)
    elif K == 7:
        return s6, tl.maximum(left, s7)
    else:
        return s7, left


@triton.jit
def _one_tile(s0, s1, s2, s3, p0, p1, p2, p3):
    """1 where the row's four best keys are finite and all of one tile: the tile's fifth,
    never looked at, is below the fourth and out of the top four, but may equal it once
    the code bits are cleared (a tie the exact sweep decides)."""
    return (p0 == p1) & (p1 == p2) & (p2 == p3) & (s3 > NEG_INF)


@triton.jit
def _finish(z, X, W, OUT_VAL, OUT_IDX, OUT_GATE, REDO, REDO_N, rows, rows64, row_ok,
            s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, left, nan_seen,
            crowded, M, H, R, sx_n, sx_h, sw_m, sw_k, so_n, K: tl.constexpr,
            KP: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
            BH: tl.constexpr):
    """The slots' experts with exact values, sorted, with gates; the doubtful rows queued."""
    bi = tl.zeros((rows.shape[0], KP), tl.int32)
    bi = _slot(bi, s0, p0, 0, K, BM, KP)
    if KP > 1:
        bi = _slot(bi, s1, p1, 1, K, BM, KP)
    if KP > 2:
        bi = _slot(bi, s2, p2, 2, K, BM, KP)
        bi = _slot(bi, s3, p3, 3, K, BM, KP)
    if KP > 4:
        bi = _slot(bi, s4, p4, 4, K, BM, KP)
        bi = _slot(bi, s5, p5, 5, K, BM, KP)
        bi = _slot(bi, s6, p6, 6, K, BM, KP)
        bi = _slot(bi, s7, p7, 7, K, BM, KP)
    kth, left = _kth_and_left(s0, s1, s2, s3, s4, s5, s6, s7, left, K)
    # a k-th key equal to one left out once the codes are cleared: either logit may be the
    # larger; fewer than k finite keys (kth -inf): the fillers are the exact sweep's
    tie = trunc_keys(kth, BM) == trunc_keys(left, BM)
    bad = (tie | (kth == NEG_INF) | (nan_seen > 0) | (crowded > 0)) & row_ok
    vals = exact_values(z, X, W, bi, rows64, row_ok, M, H, R, sx_n, sx_h, sw_m, sw_k,
                        K, KP, MODE, BR, BH)
    write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n, K, KP)
    queue_rows(bad, rows, REDO, REDO_N)


def schedule(k: int, tiles: int) -> tuple[int, str]:
    """(C, rounds): C = 4 keys a tile where there are few tiles (a tile then hides a member
    of the top k only behind four of its keys: binom(k, 4) / T^3 of the rows), else 2; the
    rounds "lazy" (the crowded tiles examined again after the sweep). Measured on an H100
    (bf16, h = 512 and 2,048, N = 262,144; NOTES, fourteenth session): four keys a tile
    0.283 against 0.331 ms at 4 tiles and 0.593 against 0.743 at 16, two keys 1.360 against
    1.925 at 64 tiles (k = 4); "eager" rounds (after a tile while some row of the block can
    still gain from it, config rounds="eager") 6-27 % slower than lazy at every shape timed,
    the few tiles where a cost model had chosen them included. At k = 8 four keys up to 56
    tiles: two keys there crowd binom(8, 3) / T^2 of the rows, 5.5 % at 32 tiles (nearly
    every block of 64). Four keys over 32 / 40 / 48 / 56 tiles of 128 1.113 / 1.362 / 1.545
    / 1.775 ms against two keys over twice the tiles of 64 1.51 / 1.585 / 1.700 / 1.806 (the
    prototype 1.224 / 1.453 / 1.633 / 1.807); at 64 tiles 1.987 against 1.958, at 96 2.916
    against two keys over 128-wide tiles 2.413 (H100; NOTES, twentieth and twenty-first
    sessions)."""
    C = 4 if k >= 3 and tiles <= 16 or k >= 8 and tiles <= 56 else 2
    return C, "lazy"


def check_settings(cfg: dict, k: int) -> None:
    """Name a bad one-pass setting of cfg (tile_keys, rounds) for top-k; router_topk's
    launch_sweep calls it whichever path follows (a batch too small to fill the GPU takes
    the exact sweep, which would not look)."""
    C = cfg.get("tile_keys", 2)
    if C not in (2, 4) or (C == 4 and k < 3):
        raise ValueError(f"tile_keys must be 2, or 4 for k >= 3; got {C} at k={k}")
    if cfg.get("rounds", "lazy") not in ("lazy", "eager"):
        raise ValueError(f"rounds must be 'lazy' or 'eager'; got {cfg['rounds']!r}")


MAXNREG = 168     # registers a thread: 3 blocks of 4 warps an SM (unbounded, ptxas takes 183)


def _registers(cfg: dict, x) -> dict:
    """The launch's register bound on a GPU (cfg "maxnreg"; 0: none)."""
    n = cfg.get("maxnreg", MAXNREG)
    return {"maxnreg": n} if n and x.device.type == "cuda" else {}


def launch_buffer(x, w, r2, k: int, *, mode: int, cfg: dict, out):
    """The one-pass selection into out = (val, idx, gates); returns the rows to decide again
    (REDO, REDO_N) for router_topk's exact sweep. k <= MAX_K, inference only."""
    if not 1 <= k <= MAX_K:
        raise ValueError(f"the one-pass selection keeps k in [1, {MAX_K}], got k={k}")
    N, H, M = x.shape[0], x.shape[1], w.shape[0]
    R = r2.shape[0] if mode == LOWRANK else H
    BN, BM = cfg["BN"], cfg["BM"]
    C, rounds = schedule(k, triton.cdiv(M, BM))
    C, rounds = cfg.get("tile_keys", C), cfg.get("rounds", rounds)   # launch_sweep checked
    rows = torch.empty(N, device=x.device, dtype=torch.int32)
    rows_n = torch.zeros(1, device=x.device, dtype=torch.int32)
    r2_ = r2 if r2 is not None else x
    _buffer_kernel[(triton.cdiv(N, BN),)](
        x, w, r2_, *out, rows, rows_n, N, H, M, R, x.stride(0), x.stride(1), w.stride(0),
        w.stride(1), r2_.stride(0), r2_.stride(1), k, K=k, KP=next_pow2(k), MODE=mode,
        BN=BN, BM=BM, BR=cfg["BR"], BH=cfg["BH"], PREC=dot_precision(x.dtype),
        EVEN=M % BM == 0, FULL_R=mode != LINEAR and R == cfg["BR"],
        LANEB=cfg["laneb"] if x.device.type == "cuda" else 0,
        TUPLE=cfg.get("tuple", x.device.type == "cuda"),
        C=C, EAGER=rounds == "eager", EVEN_H=cfg.get("z_even", True) and H % cfg["BH"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["cand_stages"], **_registers(cfg, x))
    return rows, rows_n
