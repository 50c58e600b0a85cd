"""PEER's product-key retrieval (the paper's Appendix B; nn/peer.py) as one kernel: per
(token, head) row, the scores of the two query halves against the two sub-key tables, the
top κ of each, the top κ of their sums, and the winners' exact scores; nothing but the
(NH, κ) results reaches HBM.

Legend: NH (token, head) rows; q (NH, 2D) the queries, D = d_q / 2; keys A, B (R, D) the two
sub-key tables (R = √M); κ (KAPPA) the top per head, KP the next power of two >= κ; i, j
ranks in the sorted per-axis lists; blocks BT rows, BR >= R keys, BD >= D.

  s_a = q_a A^T, s_b = q_b B^T          (BT, BR) fp32, one MMA each, in registers
  top KP of each (tl.topk on keys: the column packed into the low bits, as the routers do)
  top κ of s_a[i] + s_b[j] over the grid cells with (i+1)(j+1) <= κ: the axes are sorted,
      so a cell outside has κ cells at least as large. Each such cell has min(i, j) < T
      (T = ⌊√κ⌋), so two strips hold them all: (i < TP, j < KP) and (i >= TP, j < TP), TP
      the next power of two >= T; 2 TP KP sums a row (1,024 at κ = 56 instead of κ² = 3,136)
  winners' columns: the per-axis lists are stored (IA, IB (NH, KP) int32) and read back at
      the winners' ranks (a register tensor cannot be indexed); exact scores q_a · A[a] +
      q_b · B[b] in fp32 from the gathered key rows
  -> scores (NH, κ) fp32, ids a R + b (NH, κ) int64

HBM traffic: q (NH 2D) + the outputs (NH κ 12 bytes) + IA, IB written and read once (NH KP 8
bytes, from L2 mostly); the key tables (R D) stay in L2. The (NH, R) score tables of the torch
path never exist.

Selection semantics: a key keeps log2(2 BR) bits fewer than fp32 for the column it carries,
and the grid sums (of those truncated values) log2(4 TP KP) fewer: scores within ~2^-12 of
each other (relative; 2^-13 for the axes at R <= 512) may be ranked either way, which is 16x
finer than the bf16 score tables the torch path ranks under autocast. The scores returned
are the exact ones of the chosen (a, b), in the order chosen (descending up to those
near-ties).

Sizes: R <= PEER_MAX_KEYS (a row of BR scores in registers), D <= 64, κ <= R.
"""
import math

import torch
import triton
import triton.language as tl

from . import DTYPES
from ._common import dot_precision, key_column, next_pow2, pack_keys, trunc_keys

PEER_MAX_KEYS = 1024
LOW = tl.constexpr(-3.0e38)      # masked scores: finite, so that their keys stay ordered


@triton.jit
def _axis_top(q, K, rr, r_ok, dd, d_ok, sk_r, BR: tl.constexpr, KP: tl.constexpr,
              PREC: tl.constexpr):
    """The top KP keys (BT, KP) of q's scores against the table K, descending."""
    k = tl.load(K + rr[:, None] * sk_r + dd[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    s = tl.where(r_ok[None, :], s, LOW)
    return tl.topk(pack_keys(s, BR, 0), KP)


@triton.jit
def _exact(q, K, idx, dd, d_ok, sk_r):
    """q · K[idx] in fp32: (BT, KP) from q (BT, BD) and rows idx (BT, KP)."""
    rows = tl.load(K + idx[:, :, None].to(tl.int64) * sk_r + dd[None, None, :],
                   mask=d_ok[None, None, :], other=0.0)
    return tl.sum(rows.to(tl.float32) * q.to(tl.float32)[:, None, :], axis=2)


@triton.jit
def _retrieval_kernel(Q, KA, KB, SCORES, IDS, IA, IB, NH, R, KAPPA, sq_n, sk_r,
                      D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, KP: tl.constexpr,
                      TP: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    row = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ok = row < NH
    dd = tl.arange(0, BD)
    d_ok = dd < D
    rr = tl.arange(0, BR)
    r_ok = rr < R
    qmask = ok[:, None] & d_ok[None, :]
    qa = tl.load(Q + row[:, None] * sq_n + dd[None, :], mask=qmask, other=0.0)
    qb = tl.load(Q + row[:, None] * sq_n + D + dd[None, :], mask=qmask, other=0.0)
    ta = _axis_top(qa, KA, rr, r_ok, dd, d_ok, sk_r, BR, KP, PREC)
    tb = _axis_top(qb, KB, rr, r_ok, dd, d_ok, sk_r, BR, KP, PREC)
    va, vb = trunc_keys(ta, BR), trunc_keys(tb, BR)
    va_t, vb_t = trunc_keys(tl.topk(ta, TP), BR), trunc_keys(tl.topk(tb, TP), BR)
    # the two strips of grid cells: (i < TP, all j) and (i >= TP, j < TP)
    i1 = tl.arange(0, TP)[:, None]
    j1 = tl.arange(0, KP)[None, :]
    s1 = tl.where((i1 + 1) * (j1 + 1) <= KAPPA, va_t[:, :, None] + vb[:, None, :], LOW)
    i2 = tl.arange(0, KP)[:, None]
    j2 = tl.arange(0, TP)[None, :]
    s2 = tl.where(((i2 + 1) * (j2 + 1) <= KAPPA) & (i2 >= TP),
                  va[:, :, None] + vb_t[:, None, :], LOW)
    BC: tl.constexpr = 2 * TP * KP
    # flat position 2 q + strip, q the cell's index within its strip
    sums = tl.reshape(tl.join(tl.reshape(s1, (BT, TP * KP)), tl.reshape(s2, (BT, KP * TP))),
                      (BT, BC))
    p = key_column(tl.topk(pack_keys(sums, BC, 0), KP), BC)
    cell, first = p // 2, (p % 2) == 0
    i = tl.where(first, cell // KP, cell // TP)
    j = tl.where(first, cell % KP, cell % TP)
    # the per-axis columns, stored, then read back at the winners' ranks i and j
    w = tl.arange(0, KP)
    lists = row[:, None] * KP + w[None, :]
    tl.store(IA + lists, key_column(ta, BR), mask=ok[:, None])
    tl.store(IB + lists, key_column(tb, BR), mask=ok[:, None])
    tl.debug_barrier()
    a = tl.load(IA + row[:, None] * KP + i, mask=ok[:, None], other=0)
    b = tl.load(IB + row[:, None] * KP + j, mask=ok[:, None], other=0)
    score = _exact(qa, KA, a, dd, d_ok, sk_r) + _exact(qb, KB, b, dd, d_ok, sk_r)
    out = row[:, None] * KAPPA + w[None, :]
    keep = ok[:, None] & (w < KAPPA)[None, :]
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
    """Blocks: BT rows (16, the MMA's least), a row of BR scores, KP and TP (header)."""
    KP = next_pow2(kappa)
    TP = next_pow2(math.isqrt(kappa))
    BR = max(16, next_pow2(R))
    big = 16 * max(BR, 2 * TP * KP)
    return {"BT": 16, "BR": BR, "KP": KP, "TP": TP, "num_warps": 8 if big >= 16384 else 4}


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
    lists = torch.empty(2, NH, c["KP"], device=q.device, dtype=torch.int32)
    _retrieval_kernel[(triton.cdiv(NH, c["BT"]),)](
        q, keys[0], keys[1], scores, ids, lists[0], lists[1], NH, R, kappa, q.stride(0),
        keys.stride(1), D=D, BD=max(16, next_pow2(D)), BR=c["BR"], KP=c["KP"], TP=c["TP"],
        BT=c["BT"], PREC=dot_precision(q.dtype), num_warps=c["num_warps"])
    return scores, ids
