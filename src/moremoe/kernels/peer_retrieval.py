"""PEER's product-key retrieval (the paper's Appendix B; nn/peer.py) as one kernel: per
(token, head) row, the scores of the two query halves against the two sub-key tables, the
top κ of each, the top κ of their sums, and the winners' exact scores; nothing but the
(NH, κ) results reaches HBM.

Legend: NH (token, head) rows; q (NH, 2D) the queries, D = d_q / 2; keys A, B (R, D) the two
sub-key tables (R = √M); κ (KAPPA) the top per head, KP the next power of two >= κ; i, j
ranks in the sorted per-axis lists; blocks BT rows, BR >= R keys, BD >= D.

  s_a = q_a A^T, s_b = q_b B^T      (BT, BR) fp32, one MMA each, in registers
  top κ of each axis, sorted        κ steps of a row max over the packed keys (the column in
                                    the low bits, as the routers pack them: each key unique,
                                    so the max names its column and is then masked)
  top κ of s_a[i] + s_b[j]          the sorted lists' frontier: row i of the grid stands at
                                    its next column jp[i]; κ steps take the best row (a max
                                    over KP keys carrying i), record (a, b), advance that row
                                    (the classic k best sums of two sorted lists; only cells
                                    with (i+1)(j+1) <= κ are ever reached)
  exact scores                      q_a · A[a] + q_b · B[b] in fp32 from the gathered key rows
  -> scores (NH, κ) fp32, ids a R + b (NH, κ) int64

Work a row: 2 κ maxima over BR keys and κ steps of six KP-wide reductions; no sort (Triton's
bitonic tl.topk of 64 of 512 and of 1,024 sums ran at 6x the torch path's time on an H100).
HBM traffic: q (NH 2D) in, NH κ 12 bytes out; the key tables (R D) stay in L1/L2. The (NH, R)
score tables of the torch path never exist.

Selection semantics: a key keeps log2(2 BR) bits fewer than fp32 for the column it carries,
a frontier key log2(2 KP) fewer: scores within ~2^-13 of each other (relative; R <= 512) may
be ranked either way, 32x finer than the bf16 score tables the torch path ranks under
autocast. The scores returned are the exact ones of the chosen (a, b), in the order chosen
(descending up to those near-ties).

Sizes: R <= PEER_MAX_KEYS (a row of BR scores in registers), D <= 64, κ <= R.
"""
import torch
import triton
import triton.language as tl

from . import DTYPES
from ._common import dot_precision, key_column, next_pow2, pack_keys, trunc_keys

PEER_MAX_KEYS = 1024
LOW = tl.constexpr(-3.0e38)      # masked scores: finite, so that their keys stay ordered


@triton.jit
def _axis_top(q, K, rr, r_ok, dd, d_ok, sk_r, KAPPA, BT: tl.constexpr, BR: tl.constexpr,
              KP: tl.constexpr, PREC: tl.constexpr):
    """The top κ keys (BT, KP) of q's scores against the table K, descending (LOW after κ):
    κ steps, each taking every row's largest key (unique: it carries its column)."""
    k = tl.load(K + rr[:, None] * sk_r + dd[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    keys = pack_keys(tl.where(r_ok[None, :], s, LOW), BR, 0)
    w = tl.arange(0, KP)[None, :]
    top = tl.full((BT, KP), LOW, tl.float32)
    for t in range(KAPPA):
        m = tl.max(keys, axis=1)[:, None]
        keys = tl.where(keys == m, LOW, keys)
        top = tl.where(w == t, m, top)
    return top


@triton.jit
def _pack(v, col, B: tl.constexpr):
    """pack_keys for one key a row: value v (BT,) carrying column col (BT,) of B."""
    bits = (v.to(tl.int32, bitcast=True) & ~(2 * B - 1)) | ((2 * B - 1) - col)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pick(onehot, t):
    """t's value at the one column a row marks: (BT,) from (BT, KP)."""
    return tl.sum(tl.where(onehot, t, 0), axis=1)


@triton.jit
def _exact(q, K, idx, dd, d_ok, sk_r):
    """q · K[idx] in fp32: (BT, KP) from q (BT, BD) and rows idx (BT, KP)."""
    rows = tl.load(K + idx[:, :, None].to(tl.int64) * sk_r + dd[None, None, :],
                   mask=d_ok[None, None, :], other=0.0)
    return tl.sum(rows.to(tl.float32) * q.to(tl.float32)[:, None, :], axis=2)


@triton.jit
def _retrieval_kernel(Q, KA, KB, SCORES, IDS, NH, R, KAPPA, sq_n, sk_r,
                      D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, KP: tl.constexpr,
                      BT: tl.constexpr, PREC: tl.constexpr):
    row = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ok = row < NH
    dd = tl.arange(0, BD)
    d_ok = dd < D
    rr = tl.arange(0, BR)
    r_ok = rr < R
    qmask = ok[:, None] & d_ok[None, :]
    qa = tl.load(Q + row[:, None] * sq_n + dd[None, :], mask=qmask, other=0.0)
    qb = tl.load(Q + row[:, None] * sq_n + D + dd[None, :], mask=qmask, other=0.0)
    ta = _axis_top(qa, KA, rr, r_ok, dd, d_ok, sk_r, KAPPA, BT, BR, KP, PREC)
    tb = _axis_top(qb, KB, rr, r_ok, dd, d_ok, sk_r, KAPPA, BT, BR, KP, PREC)
    va, vb = trunc_keys(ta, BR), trunc_keys(tb, BR)
    ca, cb = key_column(ta, BR), key_column(tb, BR)
    # the frontier: row i of the grid at its next column jp[i], value va[i] + vb[jp[i]]
    i = tl.arange(0, KP)[None, :]
    front = pack_keys(tl.where(i < KAPPA, va + tl.max(vb, axis=1)[:, None], LOW), KP, 0)
    jp = tl.zeros((BT, KP), tl.int32)
    a = tl.zeros((BT, KP), tl.int32)
    b = tl.zeros((BT, KP), tl.int32)
    for t in range(KAPPA):
        best = tl.max(front, axis=1)
        wi = key_column(best, KP)                   # the winner's row, then its column
        hit = i == wi[:, None]
        wj = _pick(hit, jp)
        a = tl.where(i == t, _pick(hit, ca)[:, None], a)
        b = tl.where(i == t, _pick(i == wj[:, None], cb)[:, None], b)
        nj = wj + 1
        nxt = tl.where(nj < KAPPA, _pick(hit, va) + _pick(i == nj[:, None], vb), LOW)
        front = tl.where(hit, _pack(nxt, wi, KP)[:, None], front)
        jp = tl.where(hit, nj[:, None], jp)
    score = _exact(qa, KA, a, dd, d_ok, sk_r) + _exact(qb, KB, b, dd, d_ok, sk_r)
    out = row[:, None] * KAPPA + i
    keep = ok[:, None] & (i < KAPPA)
    tl.store(SCORES + out, score, mask=keep)
    tl.store(IDS + out, a.to(tl.int64) * R + b, mask=keep)


# ---------------------------------------------------------------- launchers

def check_inputs(q, keys, kappa: int) -> None:
    if q.ndim != 2 or keys.ndim != 3 or keys.shape[0] != 2 or q.shape[1] != 2 * keys.shape[2]:
        raise ValueError(f"q must be (NH, d_q) and keys (2, R, d_q/2), got {tuple(q.shape)} "
                         f"and {tuple(keys.shape)}")
    if q.dtype not in DTYPES or keys.dtype != q.dtype:
        raise TypeError(f"q must have a dtype of {DTYPES} and keys q's dtype, got {q.dtype} "
                        f"and {keys.dtype}")
    R, D = keys.shape[1], keys.shape[2]
    if R > PEER_MAX_KEYS or D > 64:
        raise ValueError(f"the retrieval kernel holds R <= {PEER_MAX_KEYS} keys a table and "
                         f"d_q/2 <= 64, got R={R}, d_q/2={D}")
    if not 1 <= kappa <= R:
        raise ValueError(f"kappa must be in [1, R={R}], got {kappa}")


def config(R: int, kappa: int) -> dict:
    """Blocks: BT rows (16, the MMA's least), a row of BR scores, KP (header)."""
    KP = next_pow2(kappa)
    BR = max(16, next_pow2(R))
    return {"BT": 16, "BR": BR, "KP": KP, "num_warps": 8 if 16 * BR >= 16384 else 4}


def retrieve(q, keys, kappa: int, *, blocks: dict | None = None):
    """(scores (NH, κ) fp32, ids (NH, κ) int64) of product-key retrieval (header). blocks:
    BT and num_warps in place of config()'s (a benchmark's sweep)."""
    check_inputs(q, keys, kappa)
    q, keys = q.contiguous(), keys.contiguous()
    NH, (R, D) = q.shape[0], keys.shape[1:]
    scores = torch.empty(NH, kappa, device=q.device, dtype=torch.float32)
    ids = torch.empty(NH, kappa, device=q.device, dtype=torch.int64)
    if NH == 0:
        return scores, ids
    c = {**config(R, kappa), **(blocks or {})}
    _retrieval_kernel[(triton.cdiv(NH, c["BT"]),)](
        q, keys[0], keys[1], scores, ids, NH, R, kappa, q.stride(0), keys.stride(1), D=D,
        BD=max(16, next_pow2(D)), BR=c["BR"], KP=c["KP"], BT=c["BT"], PREC=dot_precision(q.dtype), num_warps=c["num_warps"])
    return scores, ids
