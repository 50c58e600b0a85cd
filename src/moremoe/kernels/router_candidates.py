"""The candidates pass of the top-k routers: per expert tile only the C best keys of each row
leave the chip, then a small kernel picks the top-k among them.

One logit costs the selection about 2C ALU ops here (the key packing, then C running maxima
in the MMA accumulator's registers), against 1 + 3 per extraction in a running top-k that
inserts key by key: at k = 4, C = 2, four ops instead of about eight. The candidates are
exact whenever no tile holds more than C of a row's top-k; the pick detects the rows where a
tile might (C of its keys selected), where a tile held a non-finite logit, where a
selected key is negative (the code order of equal negative keys is reversed), or where the
k-th key and the best one left out are equal after truncation (either logit may be the
larger), and queues them for the exact sweep (router_topk), which compares logits. For
top-k positions spread evenly over T tiles the queued share is about binom(k, C + 1) / T^C:
9 % at k = 4, C = 2, T = 64 (M = 8,192).

Kernels (grid, reads -> writes):
  _candidates_kernel (N/BN, SPLITS) x, R1|W [, R2] -> CAND (T, C, N) fp32 keys,
                                    z (N, r) in x's dtype (low-rank inference), m and Z
                                    (training: the online softmax over the finite logits)
  _pick_kernel       (N/BNP,)       CAND, z|x, R1|W -> top-k val fp32, idx int32, gates fp32;
                                    REDO, REDO_N: the queued rows
T = ceil(M / BM) tiles; SPLITS splits the tiles when there are too few token blocks to fill
the GPU; BNP, BT the rows and candidates per step of the pick. HBM traffic of the candidates:
4 T C N bytes written and read (134 MB at N = 262,144, M = 8,192, C = 2), z 2 N r.
"""
import torch
import triton
import triton.language as tl

from . import INTERPRET
from ._common import (BIG_IDX, LOWRANK, LINEAR, MODE_LOWRANK, NEG_INF, QUIET_KEYS, best_keys,
                      column, dot_precision, exact_values, fill_splits, insert_key,
                      key_column, logit_tile, next_pow2, pack_keys, queue_rows, trunc_keys,
                      write_sorted, z_block, z_rows)


@triton.jit
def _store_best(c1, c2, c3, c4, CAND, t, rows64, row_ok, N, C: tl.constexpr):
    """The C best keys c1.. of each row of the tile t into CAND[t, 0:C, rows]."""
    base = CAND + (tl.zeros_like(rows64) + t) * C * N + rows64   # int64: T C N may pass 2^31
    tl.store(base, c1, mask=row_ok)
    if C > 1:
        tl.store(base + N, c2, mask=row_ok)
    if C > 2:
        tl.store(base + 2 * N, c3, mask=row_ok)
    if C > 3:
        tl.store(base + 3 * N, c4, mask=row_ok)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _spoiled(c1, NAN_SEEN: tl.constexpr):
    """Whether a row of the tile may hold a non-finite logit: NAN_SEEN, c1 (the first
    candidates) is NaN exactly then; otherwise always assumed."""
    if NAN_SEEN:
        return tl.max((c1 != c1).to(tl.int32), axis=0) > 0
    else:
        return True


@triton.jit
def _candidates_kernel(X, W, R2, CAND, ZOUT, OUT_M, OUT_NORM, N, H, M, R, m_per_split,
                       sx_n, sx_h, sw_m, sw_k, s2_r, s2_h,
                       C: tl.constexpr, MODE: tl.constexpr, STATS: tl.constexpr,
                       BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                       BH: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr,
                       FULL_R: tl.constexpr, LANEB: tl.constexpr, TUPLE: tl.constexpr):
    """The C best keys per row of every tile of split program_id(1); STATS (one split)
    adds m, Z; the low-rank mode stores z for the pick's exact values (split 0 only)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    pid_s = tl.program_id(1)
    if MODE == MODE_LOWRANK:
        z = z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h, BN, BR, BH, PREC)
        if pid_s == 0:
            rr = tl.arange(0, BR)
            tl.store(ZOUT + rows64[:, None] * BR + rr[None, :], z, mask=row_ok[:, None])
    else:
        z = z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE, BN, BR)
    run_m = tl.full((BN,), NEG_INF, tl.float32)
    run_norm = tl.zeros((BN,), tl.float32)
    m_begin = pid_s * m_per_split
    for m0 in range(m_begin, tl.minimum(M, m_begin + m_per_split), BM):
        cols = m0 + tl.arange(0, BM)
        col_ok = (cols < M) | EVEN
        logits = logit_tile(z, X, W, rows64, row_ok, m0, cols, col_ok, H, R, sx_n, sx_h, sw_m,
                            sw_k, MODE, BN, BM, BR, BH, PREC, FULL_R)
        keys = pack_keys(logits, BM, LANEB)
        if QUIET_KEYS:
            keys = tl.where(keys == keys, keys, NEG_INF)
        if not EVEN:
            keys = tl.where(col_ok[None, :], keys, NEG_INF)
        c1, c2, c3, c4 = best_keys(keys, C, TUPLE)
        if STATS:   # the online softmax over the finite logits: 3 ops per logit
            top = c1
            # the tuple reduction's first key is NaN where the tile held a non-finite logit
            # (their keys are NaN): then, and wherever that is not known, the slow path
            if _spoiled(c1, TUPLE and not QUIET_KEYS):
                top = tl.max(keys, axis=1)              # skips NaN keys
                top = tl.where(top == top, top, NEG_INF)
            new_m = tl.maximum(run_m, top)
            safe_m = tl.where(new_m == NEG_INF, 0.0, new_m)
            p = tl.math.exp2(logits * LOG2E - (safe_m * LOG2E)[:, None])
            if _spoiled(c1, TUPLE and not QUIET_KEYS):
                p = tl.where(p < float("inf"), p, 0.0)
            if not EVEN:
                p = tl.where(col_ok[None, :], p, 0.0)
            run_norm = run_norm * tl.math.exp2((run_m - safe_m) * LOG2E) + tl.sum(p, axis=1)
            run_m = new_m
        _store_best(c1, c2, c3, c4, CAND, m0 // BM, rows64, row_ok, N, C)
    if STATS:
        tl.store(OUT_M + rows64, run_m, mask=row_ok)
        tl.store(OUT_NORM + rows64, run_norm, mask=row_ok)


@triton.jit
def _crowded_slots(bi, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr, BM: tl.constexpr):
    """(BN, KP): the selected slots whose tile holds C or more of the row's selection (then
    the tile's next key might belong, or tie the last after truncation); none when C > K."""
    live = tl.arange(0, KP)[None, :] < K
    tile = tl.where(live & (bi >= 0), bi // BM, -1)
    count = tl.zeros(bi.shape, tl.int32)
    if C <= K:
        for j in range(K):
            t_j = column(tile, j, KP)
            count += ((tile == t_j[:, None]) & (tile >= 0)).to(tl.int32)
    return (count >= C) & (tile >= 0)


@triton.jit
def _weak(bk, bi, K: tl.constexpr, KP: tl.constexpr):
    """Rows with a slot left empty or a negative key selected (the code order of equal
    negative keys is reversed): only the exact sweep can vouch for them."""
    live = tl.arange(0, KP)[None, :] < K
    weak = live & ((bi < 0) | (bk.to(tl.int32, bitcast=True) < 0))
    return tl.max(weak.to(tl.int32), axis=1) > 0


@triton.jit
def _pick_kernel(CAND, X, W, ZS, OUT_VAL, OUT_IDX, OUT_GATE, REDO, REDO_N,
                 N, H, M, R, TC, sx_n, sx_h, sw_m, sw_k, sz_n, sz_r, so_n,
                 K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr, MODE: tl.constexpr,
                 BN: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                 BH: tl.constexpr):
    """Top-k of the TC = T·C candidates of each row by truncated key, ties by lower expert
    index (candidates are read in tile order, so a strictly larger key is needed to enter),
    exact values and gates; doubtful rows are queued in REDO, among them those whose k-th
    key ties after truncation with the best one left out (the exact sweep then orders them
    by value)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    slots = tl.arange(0, KP)
    bk = tl.where(slots[None, :] < K, NEG_INF, float("inf")) + tl.zeros((BN, KP), tl.float32)
    bi = -(slots[None, :] + 1) + tl.zeros((BN, KP), tl.int32)
    thr = tl.full((BN,), NEG_INF, tl.float32)
    left = tl.full((BN,), NEG_INF, tl.float32)     # the best truncated key left out
    nan_seen = tl.zeros((BN,), tl.int32)
    for c0 in range(0, TC, BT):
        cc = c0 + tl.arange(0, BT)
        # loaded (BT, BN) with rows contiguous (coalesced), then turned to (BN, BT)
        keys = tl.trans(tl.load(CAND + cc.to(tl.int64)[:, None] * N + rows64[None, :],
                                mask=(cc < TC)[:, None] & row_ok[None, :], other=NEG_INF))
        nan_seen = tl.maximum(nan_seen, tl.max((keys != keys).to(tl.int32), axis=1))
        tk = trunc_keys(tl.where(keys == keys, keys, NEG_INF), BM)
        gidx = (cc // C)[None, :] * BM + key_column(keys, BM)
        top = tl.max(tk, axis=1)
        ok = top > thr
        while tl.max(ok.to(tl.int32), axis=0) > 0:
            pick = tl.min(tl.where(tk == top[:, None], gidx, BIG_IDX), axis=1)
            left = tl.maximum(left, tl.where(ok, thr, top))    # evicted, or not taken
            bk, bi, thr = insert_key(bk, bi, thr, top, pick, ok)
            tk = tl.where(gidx == pick[:, None], NEG_INF, tk)
            top = tl.max(tk, axis=1)
            ok = top > thr
        left = tl.maximum(left, top)
    # a key left out that ties the k-th after truncation may be the larger logit: the exact
    # sweep decides those rows by value
    tie = (left == thr) & (thr > NEG_INF)
    crowded = tl.max(_crowded_slots(bi, K, KP, C, BM).to(tl.int32), axis=1) > 0
    bad = (_weak(bk, bi, K, KP) | (nan_seen > 0) | tie | crowded) & row_ok
    z = z_rows(ZS, rows64, row_ok, R, sz_n, sz_r, MODE, BN, BR)
    vals = exact_values(z, X, W, bi, rows64, row_ok, M, H, R, sx_n, sx_h, sw_m, sw_k,
                        K, KP, MODE, BR, BH)
    write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n, K, KP)
    queue_rows(bad, rows, REDO, REDO_N)


def launch_candidates(x, w, r2, k: int, *, mode: int, cfg: dict, stats=None,
                      splits: int | None = None):
    """The candidates pass: returns CAND (T·C, N) fp32 and z (N, BR) (low-rank; else a
    placeholder); stats = (m, Z) to fill, or None."""
    N, H, M = x.shape[0], x.shape[1], w.shape[0]
    R = r2.shape[0] if mode == LOWRANK else H
    dev = x.device
    BN, BM, BR, C = cfg["BN"], cfg["BM"], cfg["BR"], cfg["C"]
    if not 1 <= C <= 4:
        raise ValueError(f"keys per tile C must be in [1, 4], got {C}")
    T = triton.cdiv(M, BM)
    n_blocks = triton.cdiv(N, BN)
    if stats is not None:
        splits = 1
    splits = splits or fill_splits(dev, n_blocks, M, BM)
    m_per_split = triton.cdiv(T, max(1, min(splits, T))) * BM
    cand = torch.empty(T * C, N, device=dev, dtype=torch.float32)
    z_out = torch.empty(N if mode == LOWRANK else 1, BR, device=dev, dtype=x.dtype)
    m_row, norm_row = stats if stats is not None else (cand, cand)
    r2_ = r2 if r2 is not None else x
    laneb = cfg["laneb"] if dev.type == "cuda" else 0
    _candidates_kernel[(n_blocks, triton.cdiv(M, m_per_split))](
        x, w, r2_, cand, z_out, m_row, norm_row, N, H, M, R, m_per_split,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), r2_.stride(0), r2_.stride(1),
        C=C, MODE=mode, STATS=stats is not None, BN=BN, BM=BM, BR=BR, BH=cfg["BH"],
        PREC=dot_precision(x.dtype), EVEN=M % BM == 0, FULL_R=mode != LINEAR and R == BR,
        LANEB=laneb, TUPLE=cfg.get("tuple", not INTERPRET), num_warps=cfg["num_warps"],
        num_stages=cfg["cand_stages"])
    return cand, z_out


def launch_pick(cand, z_out, x, w, k: int, *, mode: int, cfg: dict, out):
    """Top-k of the candidates into out = (val, idx, gates); returns the queued rows
    (REDO, REDO_N) for the exact sweep."""
    N, H, M = x.shape[0], x.shape[1], w.shape[0]
    R = w.shape[1]                      # r (R1 is (M, r)), or h for the standard router
    BM, C = cfg["BM"], cfg["C"]
    TC = cand.shape[0]
    zs, sz = (z_out, (z_out.stride(0), 1)) if mode == LOWRANK else (x, (x.stride(0), x.stride(1)))
    rows = torch.empty(N, device=x.device, dtype=torch.int32)
    rows_n = torch.zeros(1, device=x.device, dtype=torch.int32)
    BNP = 32
    _pick_kernel[(triton.cdiv(N, BNP),)](
        cand, x, w, zs, *out, rows, rows_n, N, H, M, R, TC, x.stride(0),
        x.stride(1), w.stride(0), w.stride(1), *sz, k, K=k, KP=next_pow2(k), C=C, MODE=mode,
        BN=BNP, BT=min(64, next_pow2(TC)), BM=BM, BR=cfg["BR"], BH=cfg["BH"], num_warps=4)
    return rows, rows_n
