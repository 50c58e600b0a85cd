"""Fused top-k router kernels shared by the low-rank and the standard router.

Logits ℓ = z R1ᵀ with z = x R2ᵀ (low-rank) or ℓ = x Wᵀ (standard) are computed one
(BN, BM) tile at a time with a running top-k per row; the (N, M) logits never reach HBM,
nor does z in the fused inference kernel. HBM traffic O(N h + M r + N k).

Kernels (grid, reads -> writes):
  _sweep_kernel      (N/BN, SPLITS) x, R1|W [, R2] -> top-k val fp32, idx int32, gates fp32
                                    [+ online-softmax row max m and normaliser Z, training]
  _merge_kernel      (N/BN,)        SPLITS per-split top-k lists -> final top-k and gates
SPLITS splits the experts when there are too few token blocks to fill the GPU (small
batches); each split writes its own exact top-k and the merge keeps the best k.
Z, the softmax normaliser, is named norm in code (z is the projection x R2ᵀ).

Selection (documented in docs/design.md, "Selection semantics"):
  * keys: the low log2(BM) + 1 bits of each fp32 logit are replaced by the code BM - column
    (sign-aware), so one float max yields value and position and, among equal keys, the
    lower column; the running buffer keeps keys with those bits cleared and only a strictly
    larger candidate enters, so ties across tiles keep the lower expert index. Logits that
    differ by less than 2^(log2(BM) - 22) relative may therefore be ordered by index rather
    than by value; returned values are recomputed exactly for the winners.
  * NaN and ±inf logits are never selected: no code is 0, so their keys are NaN, and a NaN
    never compares larger. A row with fewer than k selectable logits fills the remaining
    slots with the lowest expert indices not yet chosen; values are always the logits of the
    returned indices: the finite ones descending, then the others, ties by lower index.
    Gates are the softmax over the finite values (0 for the fillers; NaN for a row with no
    finite logit). The training statistics (m, Z, psum) count the finite logits only.
Index arithmetic on rows and experts is done in int64 (N·h and M·h pass 2^31).
"""
import torch
import triton
import triton.language as tl

from . import INTERPRET
from ._common import (BIG_IDX, LINEAR, LOWRANK, MODE_LINEAR, MODE_LOWRANK, NEG_INF,
                      dot_precision, fill_splits, load_rows, logit_tile, next_pow2, z_rows)

# Triton's CPU interpreter reduces with numpy, whose SIMD fmax mishandles signalling NaNs
# (the keys of ±inf logits): there, and only there, they are made -inf before the max.
QUIET_KEYS = tl.constexpr(INTERPRET)


@triton.jit
def _pack(logits, code, MASK: tl.constexpr):
    """(BN, BM) fp32 -> keys whose low bits (MASK = 2 BM - 1) hold the code BM - column:
    one float max yields value and column, the lower column among equal non-negative keys
    (one LOP3 per logit). No code is 0, so every ±inf logit becomes a NaN key, which a max
    never returns: non-finite logits are never selected, at no cost per logit."""
    bits = logits.to(tl.int32, bitcast=True)
    return ((bits & ~MASK) | code[None, :]).to(tl.float32, bitcast=True)


@triton.jit
def _trunc(keys, MASK: tl.constexpr):
    return (keys.to(tl.int32, bitcast=True) & ~MASK).to(tl.float32, bitcast=True)


@triton.jit
def _column(keys, MASK: tl.constexpr, BM: tl.constexpr):
    return BM - (keys.to(tl.int32, bitcast=True) & MASK)


@triton.jit
def _lowest_tied(keys, top, neg, MASK: tl.constexpr, BM: tl.constexpr):
    """For negative maxima the code order is reversed (a larger code is more negative):
    among keys tied with top after truncation, return the key of the lowest column."""
    tt = _trunc(top, MASK)
    cols = tl.arange(0, BM)
    same = _trunc(keys, MASK) == tt[:, None]
    cmin = tl.min(tl.where(same, cols[None, :], BM), axis=1)
    fixed = (tt.to(tl.int32, bitcast=True) | (BM - cmin)).to(tl.float32, bitcast=True)
    return tl.where(neg, fixed, top)


@triton.jit
def _flags(ok, top):
    """Block-wide: 0 nothing to insert, 1 something, 2 something negative (one reduction)."""
    return tl.max(ok.to(tl.int32) + (ok & (top < 0)).to(tl.int32), axis=0)


@triton.jit
def _insert(bk, bi, thr, cand, cidx, ok):
    """Put cand (truncated key) with expert cidx into each row's running buffer where ok:
    it replaces the smallest key (among equal smallest, the highest expert index)."""
    evict = tl.max(tl.where(bk == thr[:, None], bi, -BIG_IDX), axis=1)
    hit = (bi == evict[:, None]) & ok[:, None]
    bk = tl.where(hit, cand[:, None], bk)
    bi = tl.where(hit, cidx[:, None], bi)
    return bk, bi, tl.min(bk, axis=1)


@triton.jit
def _z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h,
             BN: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr):
    """z (BN, BR) = x[rows] R2ᵀ, fp32 accumulate, returned in x's dtype (bf16 stays bf16)."""
    rr = tl.arange(0, BR)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        x = load_rows(X, rows64, row_ok, sx_n, hh, hh < H, sx_h)
        w = load_rows(R2, rr.to(tl.int64), rr < R, s2_r, hh, hh < H, s2_h)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    # padded rank columns are 0 · x, NaN where x is infinite: zero them
    return tl.where((rr < R)[None, :], acc, 0.0).to(X.dtype.element_ty)


@triton.jit
def _exact_logit(z, X, W, rows64, ok, idx, H, R, sx_n, sx_h, sw_m, sw_k,
                 MODE: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """fp32 logit of each row against one expert per row (idx (BN,)); NaN where not ok."""
    idx64 = tl.where(ok, idx, 0).to(tl.int64)
    if MODE == MODE_LINEAR:
        acc = tl.zeros(idx.shape, dtype=tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            x = load_rows(X, rows64, ok, sx_n, hh, hh < H, sx_h).to(tl.float32)
            w = load_rows(W, idx64, ok, sw_m, hh, hh < H, sw_k).to(tl.float32)
            acc += tl.sum(x * w, axis=1)
    else:
        rr = tl.arange(0, BR)
        w = load_rows(W, idx64, ok, sw_m, rr, rr < R, sw_k).to(tl.float32)
        acc = tl.sum(z.to(tl.float32) * w, axis=1)
    return tl.where(ok, acc, float("nan"))


@triton.jit
def _fill_unselected(bi, base, limit, K: tl.constexpr, KP: tl.constexpr):
    """Replace placeholder slots (negative idx) by the lowest experts in [base, limit) not
    chosen; BIG_IDX (no expert) once that range is exhausted (a split smaller than k)."""
    slots = tl.arange(0, KP)
    for j in tl.static_range(K):
        col_j = tl.sum(tl.where(slots[None, :] == j, bi, 0), axis=1)
        cand = tl.zeros_like(col_j) + base
        for _ in tl.static_range(K):  # at most K-1 chosen indices can be in the way
            taken = tl.max((bi == cand[:, None]).to(tl.int32), axis=1)
            cand = cand + taken
        cand = tl.where(cand < limit, cand, BIG_IDX)
        bi = tl.where((slots[None, :] == j) & (col_j[:, None] < 0), cand[:, None], bi)
    return bi


@triton.jit
def _take_sorted(sk, work, vals, K: tl.constexpr, KP: tl.constexpr):
    """The K largest sort keys of each row, descending, ties by lower index: values from
    vals and indices from work (BIG_IDX marks a non-candidate) into (BN, KP) slots."""
    slots = tl.arange(0, KP)
    out_v = tl.zeros((sk.shape[0], KP), dtype=tl.float32)
    out_i = tl.zeros((sk.shape[0], KP), dtype=tl.int32)
    for j in tl.static_range(K):
        mv = tl.max(sk, axis=1)
        pick = tl.min(tl.where(sk == mv[:, None], work, BIG_IDX), axis=1)
        sel = work == pick[:, None]
        out_v = tl.where(slots[None, :] == j, tl.sum(tl.where(sel, vals, 0.0), axis=1)[:, None],
                         out_v)
        out_i = tl.where(slots[None, :] == j, pick[:, None], out_i)
        sk = tl.where(sel, NEG_INF, sk)
        work = tl.where(sel, BIG_IDX, work)
    return out_v, out_i


@triton.jit
def _store_topk(out_v, out_i, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n,
                K: tl.constexpr, KP: tl.constexpr, GATES: tl.constexpr):
    slots = tl.arange(0, KP)
    live = slots[None, :] < K
    mask = row_ok[:, None] & live
    offs = rows64[:, None] * so_n + slots[None, :]
    tl.store(OUT_VAL + offs, out_v, mask=mask)
    tl.store(OUT_IDX + offs, out_i, mask=mask)
    if GATES:   # softmax over the finite values: fillers get 0, a row of none gets NaN
        fin = live & (tl.abs(out_v) < float("inf"))
        top = tl.max(tl.where(fin, out_v, NEG_INF), axis=1)
        e = tl.where(fin, tl.exp(out_v - top[:, None]), 0.0)
        tl.store(OUT_GATE + offs, e / tl.sum(e, axis=1)[:, None], mask=mask)


@triton.jit
def _write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n,
                  K: tl.constexpr, KP: tl.constexpr, GATES: tl.constexpr):
    """Sort (finite values descending, then the non-finite; ties by lower index), store
    values, indices and gates."""
    live = tl.arange(0, KP)[None, :] < K
    sk = tl.where(live & (tl.abs(vals) < float("inf")), vals, NEG_INF)
    out_v, out_i = _take_sorted(sk, tl.where(live, bi, BIG_IDX), vals, K, KP)
    _store_topk(out_v, out_i, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n, K, KP, GATES)


@triton.jit
def _select_exact(keys, top, m0, bk, bi, thr, MASK: tl.constexpr, BM: tl.constexpr):
    """Insert every key of the tile that belongs in the running top-k, one per step."""
    cand = _trunc(top, MASK)
    ok = cand > thr
    flag = _flags(ok, top)
    while flag > 0:
        if flag > 1:
            top = _lowest_tied(keys, top, ok & (top < 0), MASK, BM)
        bk, bi, thr = _insert(bk, bi, thr, cand, m0 + _column(top, MASK, BM), ok)
        keys = tl.where(keys == top[:, None], NEG_INF, keys)
        top = tl.max(keys, axis=1)
        cand = _trunc(top, MASK)
        ok = cand > thr
        flag = _flags(ok, top)
    return bk, bi, thr


@triton.jit
def _select_rounds(keys, top, m0, bk, bi, thr, over, ROUNDS: tl.constexpr,
                   MASK: tl.constexpr, BM: tl.constexpr, CAN_OVERFLOW: tl.constexpr):
    """Insert up to ROUNDS keys of the tile with no data-dependent control flow; a row whose
    last step still inserted (more may belong) or that inserted a negative key (whose ties
    need the exact path) is flagged in over for an exact redo."""
    for j in tl.static_range(ROUNDS):
        if j > 0:
            keys = tl.where(keys == top[:, None], NEG_INF, keys)
            top = tl.max(keys, axis=1)
        cand = _trunc(top, MASK)
        ok = cand > thr
        over = over | (ok & (top < 0))
        bk, bi, thr = _insert(bk, bi, thr, cand, m0 + _column(top, MASK, BM), ok)
    if CAN_OVERFLOW:   # with ROUNDS = K all of a tile's K best went in: nothing more can
        over = over | ok
    return bk, bi, thr, over


@triton.jit
def _tile(z, X, W, rows64, row_ok, m0, m_end, H, R, sx_n, sx_h, sw_m, sw_k, run_m, run_norm,
          MODE: tl.constexpr, STATS: tl.constexpr, EVEN: tl.constexpr, FULL_R: tl.constexpr,
          BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
          PREC: tl.constexpr):
    """Logits of one tile packed into keys, their row maxima, and the online-softmax stats
    over the finite logits (a non-finite logit has probability 0)."""
    MASK: tl.constexpr = 2 * BM - 1
    cols = m0 + tl.arange(0, BM)
    col_ok = (cols < m_end) | EVEN
    logits = logit_tile(z, X, W, rows64, row_ok, cols, col_ok, H, R, sx_n, sx_h, sw_m, sw_k,
                     MODE, BN, BM, BR, BH, PREC, FULL_R)
    keys = _pack(logits, BM - tl.arange(0, BM), MASK)
    if QUIET_KEYS:
        keys = tl.where(keys == keys, keys, NEG_INF)
    if not EVEN:
        keys = tl.where(col_ok[None, :], keys, NEG_INF)
    top = tl.max(keys, axis=1)
    if STATS:   # the keys of non-finite logits are NaN: a row with only those has no max
        new_m = tl.maximum(run_m, tl.where(top == top, top, NEG_INF))
        safe_m = tl.where(new_m == NEG_INF, 0.0, new_m)
        p = tl.exp(logits - safe_m[:, None])
        p = tl.where(col_ok[None, :] & (p < float("inf")), p, 0.0)
        run_norm = run_norm * tl.exp(run_m - safe_m) + tl.sum(p, axis=1)
        run_m = new_m
    return keys, top, run_m, run_norm


@triton.jit
def _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, OUT_M, OUT_NORM, REDO, REDO_N,
                 rows64, row_ok, pid_s, N, H, M, R, m_per_split,
                 sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, so_n, so_s,
                 K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
                 GATES: tl.constexpr, ROUNDS: tl.constexpr, WARM: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                 PREC: tl.constexpr, EVEN: tl.constexpr, FULL_R: tl.constexpr,
                 PROBE: tl.constexpr):
    MASK: tl.constexpr = 2 * BM - 1
    if MODE == MODE_LOWRANK:
        z = _z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h, BN, BR, BH, PREC)
    else:
        z = z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE, BN, BR)
    slots = tl.arange(0, KP)
    bk = tl.where(slots[None, :] < K, NEG_INF, float("inf")) + tl.zeros((BN, KP), tl.float32)
    bi = -(slots[None, :] + 1) + tl.zeros((BN, KP), tl.int32)
    thr = tl.full((BN,), NEG_INF, tl.float32)
    over = tl.zeros((BN,), tl.int1)
    run_m = tl.full((BN,), NEG_INF, tl.float32)
    run_norm = tl.zeros((BN,), tl.float32)
    m_begin = pid_s * m_per_split
    m_end = tl.minimum(M, m_begin + m_per_split)
    warm_end = m_begin
    if ROUNDS > 0:
        # the first WARM tiles fill the buffer: all K may enter from one tile
        warm_end = tl.minimum(m_end, m_begin + WARM * BM)
        for m0 in range(m_begin, warm_end, BM):
            keys, top, run_m, run_norm = _tile(
                z, X, W, rows64, row_ok, m0, m_end, H, R, sx_n, sx_h, sw_m, sw_k,
                run_m, run_norm, MODE, STATS, EVEN, FULL_R, BN, BM, BR, BH, PREC)
            bk, bi, thr, over = _select_rounds(keys, top, m0, bk, bi, thr, over, K, MASK, BM,
                                               False)
    for m0 in range(warm_end, m_end, BM):
        keys, top, run_m, run_norm = _tile(
            z, X, W, rows64, row_ok, m0, m_end, H, R, sx_n, sx_h, sw_m, sw_k,
            run_m, run_norm, MODE, STATS, EVEN, FULL_R, BN, BM, BR, BH, PREC)
        if PROBE:
            run_m = tl.maximum(run_m, top)
        elif ROUNDS > 0:
            bk, bi, thr, over = _select_rounds(keys, top, m0, bk, bi, thr, over, ROUNDS, MASK,
                                               BM, ROUNDS < K)
        else:
            bk, bi, thr = _select_exact(keys, top, m0, bk, bi, thr, MASK, BM)
    if tl.min(tl.min(bi, axis=1), axis=0) < 0:
        bi = _fill_unselected(bi, m_begin, m_end, K, KP)
    vals = tl.zeros((BN, KP), tl.float32)
    for j in tl.static_range(K):
        idx_j = tl.sum(tl.where(slots[None, :] == j, bi, 0), axis=1)
        v = _exact_logit(z, X, W, rows64, row_ok & (idx_j < m_end), idx_j, H, R, sx_n, sx_h,
                         sw_m, sw_k, MODE, BR, BH)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
    if PROBE:  # keep the probe's work alive (x * 0 is not folded for floats)
        vals = vals + 0.0 * run_m[:, None]
    _write_sorted(vals, bi, rows64, row_ok, OUT_VAL + pid_s * so_s, OUT_IDX + pid_s * so_s,
                  OUT_GATE + pid_s * so_s, so_n, K, KP, GATES)
    if STATS:
        tl.store(OUT_M + rows64, run_m, mask=row_ok)
        tl.store(OUT_NORM + rows64, run_norm, mask=row_ok)
    if ROUNDS > 0:   # queue the flagged rows for the exact redo
        flagged = over & row_ok
        n = tl.sum(flagged.to(tl.int32), axis=0)
        if n > 0:
            base = tl.atomic_add(REDO_N, n)
            pos = base + tl.cumsum(flagged.to(tl.int32), axis=0) - 1
            tl.store(REDO + pos, rows64.to(tl.int32), mask=flagged)


@triton.jit
def _sweep_kernel(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, OUT_M, OUT_NORM, REDO, REDO_N,
                  N, H, M, R, m_per_split,
                  sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, so_n, so_s,
                  K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr,
                  STATS: tl.constexpr, GATES: tl.constexpr,
                  BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                  PREC: tl.constexpr, ROUNDS: tl.constexpr = 0, WARM: tl.constexpr = 1,
                  EVEN: tl.constexpr = False, FULL_R: tl.constexpr = False,
                  PROBE: tl.constexpr = False):
    """One sweep over the experts of split program_id(1) with a running top-k per row.

    ROUNDS = 0: exact (each tile inserts as many keys as belong, a block-uniform loop);
    ROUNDS > 0: at most ROUNDS per tile (K in the first WARM tiles), straight-line code that
    Triton can pipeline; rows that may have needed more are queued in REDO for the exact
    redo kernel. EVEN: every tile is full (no expert masks); FULL_R: r == BR (no rank masks).
    PROBE (benchmarks only) keeps the loads, the MMA and one row max per tile and drops the
    selection."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, OUT_M, OUT_NORM, REDO, REDO_N,
                 rows.to(tl.int64), rows < N, tl.program_id(1), N, H, M, R, m_per_split,
                 sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, so_n, so_s, K, KP, MODE, STATS, GATES,
                 ROUNDS, WARM, BN, BM, BR, BH, PREC, EVEN, FULL_R, PROBE)


@triton.jit
def _redo_kernel(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, REDO, REDO_N,
                 N, H, M, R, sx_n, sx_h, sw_m, sw_k, s2_r, s2_h, so_n,
                 K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                 PREC: tl.constexpr, EVEN: tl.constexpr = False, FULL_R: tl.constexpr = False):
    """The exact sweep for the rows the bounded sweep queued; idle programs exit at once."""
    count = tl.load(REDO_N)
    start = tl.program_id(0) * BN
    if start < count:
        pos = start + tl.arange(0, BN)
        ok = pos < count
        rows = tl.load(REDO + pos, mask=ok, other=0)
        _sweep_block(X, W, R2, OUT_VAL, OUT_IDX, OUT_GATE, OUT_VAL, OUT_VAL, REDO, REDO_N,
                     rows.to(tl.int64), ok, 0, N, H, M, R, M, sx_n, sx_h, sw_m, sw_k,
                     s2_r, s2_h, so_n, 0, K, KP, MODE, False, True, 0, 1,
                     BN, BM, BR, BH, PREC, EVEN, FULL_R, False)


@triton.jit
def _merge_kernel(IN_VAL, IN_IDX, OUT_VAL, OUT_IDX, OUT_GATE, N, M, si_n, so_n,
                  SPLITS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr,
                  BN: tl.constexpr):
    """Top-k of the SPLITS·K candidates (exact values) each split wrote for a row."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, CP)
    c_ok = (c < SPLITS * KP) & ((c % KP) < K)
    offs = rows64[:, None] * si_n + c[None, :]
    v = tl.load(IN_VAL + offs, mask=row_ok[:, None] & c_ok[None, :], other=NEG_INF)
    i = tl.load(IN_IDX + offs, mask=row_ok[:, None] & c_ok[None, :], other=BIG_IDX)
    valid = c_ok[None, :] & (i < M)          # a split smaller than k leaves empty slots
    sk = tl.where(valid & (tl.abs(v) < float("inf")), v, NEG_INF)
    out_v, out_i = _take_sorted(sk, tl.where(valid, i, BIG_IDX), v, K, KP)
    _store_topk(out_v, out_i, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n, K, KP, True)


# ---------------------------------------------------------------- launcher

def sweep_config(mode: int, R: int, H: int, K: int, overrides: dict | None = None) -> dict:
    """Block sizes and the selection schedule, from measurements on an H100 (h=512, M=8192,
    r=64, N=262,144; benchmarks/NOTES.md): BN = 64 rows (one warpgroup MMA); BR the rank
    padded to a power of two >= 16 (the MMA's K); BH the h chunk of x R2ᵀ / x Wᵀ.
    Low-rank: k = 1 one step per tile of BM = 128; k <= 4 at most 3 steps per tile of
    BM = 256 (9 code bits: keys exact to 2^-14) with the exact redo; k > 4 the exact sweep
    over BM = 128; r > 128 keeps BM = 128 (a 256 x 256 R1 tile does not fit in shared memory).
    Standard router: the exact sweep over BM = 128."""
    BR = 16 if mode == LINEAR else max(16, next_pow2(R))
    exact = mode == LINEAR or K > 4
    BM = 128 if exact or K == 1 or BR > 128 else 256
    cfg = {"BN": 64, "BM": BM, "BR": BR, "BH": min(64, max(16, next_pow2(H))),
           "num_warps": 4 if BR <= 64 else 8, "num_stages": 2,
           "rounds": 0 if exact else min(K, 3), "warm": 4}
    cfg.update(overrides or {})
    return cfg


def launch_sweep(x, w, k: int, *, mode: int, r2=None, stats: bool = False,
                 splits: int | None = None, config: dict | None = None, probe: bool = False):
    """Run the top-k sweep of x against w (R1, or W) and, for the low-rank inference mode,
    r2 (R2). Returns (val (N,k) fp32, idx (N,k) int32, gates (N,k) fp32,
    m (N,) fp32 | None, Z (N,) fp32 | None)."""
    N, M = x.shape[0], w.shape[0]
    H = x.shape[1]
    R = r2.shape[0] if mode == LOWRANK else H
    KP = next_pow2(k)
    dev = x.device
    val = torch.empty(N, k, device=dev, dtype=torch.float32)
    idx = torch.empty(N, k, device=dev, dtype=torch.int32)
    gates = torch.empty(N, k, device=dev, dtype=torch.float32)
    m_row = torch.empty(N if stats else 1, device=dev, dtype=torch.float32)
    norm_row = torch.empty(N if stats else 1, device=dev, dtype=torch.float32)
    if N == 0:
        return val, idx, gates, (m_row if stats else None), (norm_row if stats else None)
    cfg = sweep_config(mode, R, H, k, config)
    n_blocks = triton.cdiv(N, cfg["BN"])
    splits = 1 if stats else (splits or fill_splits(dev, n_blocks, M, cfg["BM"]))
    m_per_split = triton.cdiv(triton.cdiv(M, splits), cfg["BM"]) * cfg["BM"]
    splits = triton.cdiv(M, m_per_split)
    if splits == 1:
        out_v, out_i, out_g, so_n, so_s = val, idx, gates, k, 0
    else:
        out_v = torch.empty(N, splits, KP, device=dev, dtype=torch.float32)
        out_i = torch.empty(N, splits, KP, device=dev, dtype=torch.int32)
        out_g, so_n, so_s = out_v, splits * KP, KP
    r2_ = r2 if r2 is not None else x
    rounds = cfg["rounds"] if splits == 1 and not probe else 0
    redo = torch.empty(N if rounds else 1, device=dev, dtype=torch.int32)
    redo_n = torch.zeros(1, device=dev, dtype=torch.int32)
    even = M % cfg["BM"] == 0 and m_per_split % cfg["BM"] == 0
    full_r = mode != LINEAR and R == cfg["BR"]
    strides = (x.stride(0), x.stride(1), w.stride(0), w.stride(1), r2_.stride(0), r2_.stride(1))
    blocks = dict(BN=cfg["BN"], BM=cfg["BM"], BR=cfg["BR"], BH=cfg["BH"],
                  PREC=dot_precision(x.dtype), EVEN=even, FULL_R=full_r)
    _sweep_kernel[(n_blocks, splits)](
        x, w, r2_, out_v, out_i, out_g, m_row, norm_row, redo, redo_n, N, H, M, R, m_per_split,
        *strides, so_n, so_s, K=k, KP=KP, MODE=mode, STATS=stats, GATES=splits == 1,
        ROUNDS=rounds, WARM=cfg["warm"], PROBE=probe, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **blocks)
    if rounds:
        _redo_kernel[(n_blocks,)](
            x, w, r2_, val, idx, gates, redo, redo_n, N, H, M, R, *strides, k, K=k, KP=KP,
            MODE=mode, num_warps=cfg["num_warps"], **blocks)
    if splits > 1:
        BNm = 32
        _merge_kernel[(triton.cdiv(N, BNm),)](
            out_v, out_i, val, idx, gates, N, M, splits * KP, k, SPLITS=splits, K=k, KP=KP,
            CP=next_pow2(splits * KP), BN=BNm, num_warps=4)
    return val, idx, gates, (m_row if stats else None), (norm_row if stats else None)
