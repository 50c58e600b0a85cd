"""Triton helpers the kernel files share: the launch modes of the routers, the row loader,
the logit tile of both routers, and the block and split choices. Kernel files import these,
never each other's private functions.

Legend: N tokens, h hidden (H in kernels), M experts, r rank (R), k active, BN / BM / BR / BH
block sizes along N, M, r and h.
"""
import torch
import triton
import triton.language as tl

from . import INTERPRET

LOWRANK, ZGIVEN, LINEAR = 0, 1, 2   # router launch modes (Python side)
MODE_LOWRANK = tl.constexpr(LOWRANK)  # x, R1, R2: z = x R2ᵀ computed on chip, never stored
MODE_Z = tl.constexpr(ZGIVEN)         # z given (training: x R2ᵀ from cuBLAS, kept for backward)
MODE_LINEAR = tl.constexpr(LINEAR)    # x, W: the standard router; "z" = x, R1 = W, r = h

NEG_INF = tl.constexpr(float("-inf"))
# Triton's CPU interpreter reduces with numpy, whose SIMD fmax mishandles signalling NaNs
# (the keys of ±inf logits): there, and only there, they are made -inf before the max.
QUIET_KEYS = tl.constexpr(INTERPRET)
BIG_IDX = tl.constexpr(2 ** 30)       # "no expert": larger than any expert index


@triton.jit
def load_rows(PTR, rows64, row_ok, stride_n, cols, col_ok, stride_c):
    """(rows, cols) of a 2-D tensor, zero where a row or a column is masked."""
    return tl.load(PTR + rows64[:, None] * stride_n + cols[None, :] * stride_c,
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def insert_key(bk, bi, thr, cand, cidx, ok):
    """Put cand (truncated key) with expert cidx into each row's running buffer where ok:
    it replaces the smallest key (among equal smallest, the highest expert index)."""
    evict = tl.max(tl.where(bk == thr[:, None], bi, -BIG_IDX), axis=1)
    hit = (bi == evict[:, None]) & ok[:, None]
    bk = tl.where(hit, cand[:, None], bk)
    bi = tl.where(hit, cidx[:, None], bi)
    return bk, bi, tl.min(bk, axis=1)


@triton.jit
def z_block(X, R2, rows64, row_ok, H, R, sx_n, sx_h, s2_r, s2_h,
            BN: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr,
            EVEN_H: tl.constexpr = False, FULL_R: tl.constexpr = False):
    """z (BN, BR) = x[rows] R2ᵀ, fp32 accumulate, returned in x's dtype (bf16 stays bf16).
    EVEN_H: H % BH == 0 and FULL_R: R == BR leave the h and rank masks out of the loads (the
    same values, fewer instructions a chunk)."""
    rr = tl.arange(0, BR)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        if EVEN_H:
            x = tl.load(X + rows64[:, None] * sx_n + hh[None, :] * sx_h,
                        mask=row_ok[:, None], other=0.0)
        else:
            x = load_rows(X, rows64, row_ok, sx_n, hh, hh < H, sx_h)
        if EVEN_H and FULL_R:
            w = tl.load(R2 + rr[:, None] * s2_r + hh[None, :] * s2_h)
        else:
            w = load_rows(R2, rr.to(tl.int64), rr < R, s2_r, hh, hh < H, s2_h)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if FULL_R:
        return acc.to(X.dtype.element_ty)
    # padded rank columns are 0 · x, NaN where x is infinite: zero them
    return tl.where((rr < R)[None, :], acc, 0.0).to(X.dtype.element_ty)


@triton.jit
def z_rows(X, rows64, row_ok, R, sx_n, sx_h, MODE: tl.constexpr, BN: tl.constexpr,
           BR: tl.constexpr):
    """The block's rows of a given z (N, r); zeros for the standard router, which has none."""
    if MODE == MODE_LINEAR:
        return tl.zeros((BN, BR), dtype=X.dtype.element_ty)
    rr = tl.arange(0, BR)
    return load_rows(X, rows64, row_ok, sx_n, rr, rr < R, sx_h)


@triton.jit
def logit_tile(z, X, W, rows64, row_ok, m0, cols, col_ok, H, R, sx_n, sx_h, sw_m, sw_k,
               MODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
               BH: tl.constexpr, PREC: tl.constexpr, FULL_R: tl.constexpr = False):
    """fp32 logits (BN, BM) of the rows against experts cols = m0 + [0, BM): z R1ᵀ, or x Wᵀ
    summed over h chunks for the standard router (W in R1's place). W's tile is addressed
    as one 64-bit scalar, m0 · sw_m, plus 32-bit offsets within the tile (the same every
    tile: computed once); the launcher makes W contiguous where those would overflow
    (w_offsets_fit)."""
    base = W + tl.cast(m0, tl.int64) * sw_m
    tile_rows = tl.arange(0, BM)[:, None] * sw_m
    if MODE == MODE_LINEAR:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for h0 in range(0, H, BH):
            hh = h0 + tl.arange(0, BH)
            x = load_rows(X, rows64, row_ok, sx_n, hh, hh < H, sx_h)
            w = tl.load(base + tile_rows + hh[None, :] * sw_k,
                        mask=col_ok[:, None] & (hh < H)[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        return acc
    else:
        rr = tl.arange(0, BR)
        w = tl.load(base + tile_rows + rr[None, :] * sw_k,
                    mask=col_ok[:, None] & ((rr < R) | FULL_R)[None, :], other=0.0)
        return tl.dot(z, tl.trans(w), input_precision=PREC)


def w_offsets_fit(w, BM: int, width: int) -> bool:
    """Whether BM rows of w by `width` columns (r; the standard router's whole h, which its
    tile's offsets span over the h chunks) are addressed by 32-bit offsets (logit_tile)."""
    return (BM - 1) * abs(w.stride(0)) + (width - 1) * abs(w.stride(1)) < 2 ** 31


# ---------------------------------------------------------------- selection keys
# A key is an fp32 logit whose low log2(BM) + 1 bits hold the code 2 BM - 1 - column of its
# place in the tile: one float max yields value and column and, among keys equal after the
# code bits are cleared (truncated), the lower column (for non-negative values). Every code
# has the bit BM set, so no code is 0 and every ±inf logit becomes a NaN key, which no max
# selects. Keys filter the candidates' pass (router_candidates.py): where the k-th key and
# the best one left out tie after truncation (logits within 2^(log2(BM) - 22) relative) the
# row goes to the exact sweep, which compares the logits themselves.

@triton.jit
def key_code(cols, BM: tl.constexpr):
    """Code of tile columns cols (in [0, BM)): their bits complemented, plus the bit BM."""
    return (2 * BM - 1) - cols


@triton.jit
def pack_keys(logits, BM: tl.constexpr, LANEB: tl.constexpr):
    """(BN, BM) fp32 -> keys. LANEB (GPU only) names the column bits that come from the lane
    in the MMA accumulator's layout: the code is then split into B (its lane bits; one
    register per thread) and C (the rest, with the bit BM; an immediate per element), both
    with every bit above the code set, and (bits & B & C) | (B ^ C) = (bits & ~MASK) | code
    is one LOP3 (0xE6) per logit instead of two. Exact for any LANEB."""
    MASK: tl.constexpr = 2 * BM - 1
    cols = tl.arange(0, BM)
    bits = logits.to(tl.int32, bitcast=True)
    if LANEB == 0:
        keys = (bits & ~MASK) | key_code(cols, BM)[None, :]
    else:
        code = key_code(cols, BM)
        lane_b = (code & LANEB) | ~MASK
        reg_c = (code & (MASK & ~LANEB)) | ~MASK
        keys = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xE6;", "=r,r,r,r",
            [bits, tl.zeros_like(bits) + lane_b[None, :], tl.zeros_like(bits) + reg_c[None, :]],
            dtype=tl.int32, is_pure=True, pack=1)
    return keys.to(tl.float32, bitcast=True)


@triton.jit
def trunc_keys(keys, BM: tl.constexpr):
    """Keys with the code bits cleared: what the running buffers compare."""
    return (keys.to(tl.int32, bitcast=True) & ~(2 * BM - 1)).to(tl.float32, bitcast=True)


@triton.jit
def key_column(keys, BM: tl.constexpr):
    return (2 * BM - 1) - (keys.to(tl.int32, bitcast=True) & (2 * BM - 1))


@triton.jit
def _mx(a, b):
    # NaN-propagating: a NaN key anywhere in a row's tile makes its first candidate NaN (the
    # pick queues the row), and LLVM folds max(x, -inf) -> x, so the in-thread part of the
    # reduction costs 2C - 1 ops per key. The mins are the plain ones: min(x, -inf) -> -inf.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _top2(a1, a2, b1, b2):
    """The best 2 of two sorted pairs; the j-th best of two sorted lists a, b is
    max over i of min(a_i, b_(j-i)) with a_0 = b_0 = +inf."""
    return _mx(a1, b1), _mx(_mx(a2, b2), tl.minimum(a1, b1))


@triton.jit
def _top3(a1, a2, a3, b1, b2, b3):
    return (_mx(a1, b1), _mx(_mx(a2, b2), tl.minimum(a1, b1)),
            _mx(_mx(a3, b3), _mx(tl.minimum(a1, b2), tl.minimum(a2, b1))))


@triton.jit
def _top4(a1, a2, a3, a4, b1, b2, b3, b4):
    return (_mx(a1, b1), _mx(_mx(a2, b2), tl.minimum(a1, b1)),
            _mx(_mx(a3, b3), _mx(tl.minimum(a1, b2), tl.minimum(a2, b1))),
            _mx(_mx(a4, b4), _mx(_mx(tl.minimum(a1, b3), tl.minimum(a3, b1)),
                                 tl.minimum(a2, b2))))


@triton.jit
def _peel(keys, top):
    """The next best key after top (keys are distinct per row, or -inf)."""
    keys = tl.where(keys == top[:, None], NEG_INF, keys)
    return keys, tl.max(keys, axis=1)


@triton.jit
def best_keys(keys, C: tl.constexpr, TUPLE: tl.constexpr):
    """The C best keys of each row (C (BN,) tensors, best first). TUPLE: one reduction
    over C-tuples (the GPU path, 2C - 1 ops per key); otherwise C max-and-mask rounds (the
    same result: Triton's interpreter calls a tuple combine once per element)."""
    ninf = tl.full(keys.shape, NEG_INF, tl.float32)
    if TUPLE:
        if C == 1:
            c1 = tl.reduce(keys, 1, _mx)
            c2 = c1
            c3 = c1
            c4 = c1
        elif C == 2:
            c1, c2 = tl.reduce((keys, ninf), 1, _top2)
            c3 = c2
            c4 = c2
        elif C == 3:
            c1, c2, c3 = tl.reduce((keys, ninf, ninf), 1, _top3)
            c4 = c3
        else:
            c1, c2, c3, c4 = tl.reduce((keys, ninf, ninf, ninf), 1, _top4)
    else:
        c1 = tl.max(keys, axis=1)
        c2 = c1
        c3 = c1
        c4 = c1
        if C > 1:
            keys, c2 = _peel(keys, c1)
        if C > 2:
            keys, c3 = _peel(keys, c2)
        if C > 3:
            keys, c4 = _peel(keys, c3)
    return c1, c2, c3, c4


@triton.jit
def exact_logit(z, X, W, rows64, ok, idx, H, R, sx_n, sx_h, sw_m, sw_k,
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
def column(t, j, KP: tl.constexpr):
    """Column j (runtime) of a (BN, KP) tensor."""
    return tl.sum(tl.where(tl.arange(0, KP)[None, :] == j, t, 0), axis=1)


@triton.jit
def exact_values(z, X, W, bi, rows64, row_ok, M, H, R, sx_n, sx_h, sw_m, sw_k,
                 K: tl.constexpr, KP: tl.constexpr, MODE: tl.constexpr, BR: tl.constexpr,
                 BH: tl.constexpr):
    """(BN, KP) exact logits of the experts bi (NaN where bi is no expert); a runtime loop
    over the k slots keeps the compiled code the same size for every k."""
    slots = tl.arange(0, KP)
    vals = tl.zeros(bi.shape, tl.float32)
    for j in range(K):
        idx_j = column(bi, j, KP)
        v = exact_logit(z, X, W, rows64, row_ok & (idx_j >= 0) & (idx_j < M), idx_j, H, R,
                        sx_n, sx_h, sw_m, sw_k, MODE, BR, BH)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
    return vals


@triton.jit
def write_sorted(vals, bi, rows64, row_ok, OUT_VAL, OUT_IDX, OUT_GATE, so_n,
                 K: tl.constexpr, KP: tl.constexpr, GATES: tl.constexpr = True):
    """The K best of each row's candidates (vals, bi) (BN, W) (bi < 0 or >= BIG_IDX: none)
    in order: finite values descending, then the non-finite, ties by lower index; stores
    values and indices in K of KP slots, and (GATES) the softmax over the finite values
    (fillers get 0, a row of none NaN)."""
    valid = (bi >= 0) & (bi < BIG_IDX)
    sk = tl.where(valid & (tl.abs(vals) < float("inf")), vals, NEG_INF)
    work = tl.where(valid, bi, BIG_IDX)
    slots = tl.arange(0, KP)
    out_v = tl.zeros((vals.shape[0], KP), dtype=tl.float32)
    out_i = tl.zeros((vals.shape[0], KP), dtype=tl.int32)
    for j in range(K):
        mv = tl.max(sk, axis=1)
        pick = tl.min(tl.where(sk == mv[:, None], work, BIG_IDX), axis=1)
        sel = work == pick[:, None]
        v = tl.sum(tl.where(sel, vals, 0.0), axis=1)   # one entry (all BIG_IDX ones: unused)
        out_v = tl.where(slots[None, :] == j, v[:, None], out_v)
        out_i = tl.where(slots[None, :] == j, pick[:, None], out_i)
        sk = tl.where(sel, NEG_INF, sk)
        work = tl.where(sel, BIG_IDX, work)
    live = slots[None, :] < K
    mask = row_ok[:, None] & live
    offs = rows64[:, None] * so_n + slots[None, :]
    tl.store(OUT_VAL + offs, out_v, mask=mask)
    tl.store(OUT_IDX + offs, out_i, mask=mask)
    if GATES:
        fin = live & (tl.abs(out_v) < float("inf"))
        top = tl.max(tl.where(fin, out_v, NEG_INF), axis=1)
        e = tl.where(fin, tl.exp(out_v - top[:, None]), 0.0)
        tl.store(OUT_GATE + offs, e / tl.sum(e, axis=1)[:, None], mask=mask)


@triton.jit
def queue_rows(bad, rows, REDO, REDO_N):
    """Append the rows where bad to REDO (REDO_N counts them) for the exact sweep."""
    n = tl.sum(bad.to(tl.int32), axis=0)
    if n > 0:
        pos = tl.atomic_add(REDO_N, n) + tl.cumsum(bad.to(tl.int32), axis=0) - 1
        tl.store(REDO + pos, rows, mask=bad)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype) -> str:
    """fp32 inputs get exact fp32 products (the reference's selection); others the MMA's own."""
    return "ieee" if dtype == torch.float32 else "tf32"


def matmul_precision(dtype) -> str:
    """The products of fp32 inputs as torch makes its own fp32 matmuls: exact fp32 products
    at torch.get_float32_matmul_precision() "highest" (torch's default), TF32 at "high" or
    "medium" (the trainer's setting); other dtypes the MMA's own. Read at launch."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def sm_count(device) -> int:
    """The GPU's streaming multiprocessors; 1 on the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def fill_splits(device, programs: int, length: int, block: int) -> int:
    """How many ways to split a dimension of `length` (in blocks of `block`) so that
    `programs` × splits fills the GPU twice over; 1 on the CPU or when `programs` already
    does. Each split keeps at least 4 blocks of work."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    return max(1, min(triton.cdiv(2 * sms, max(programs, 1)), triton.cdiv(length, 4 * block)))
