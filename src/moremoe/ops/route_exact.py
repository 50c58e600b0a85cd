"""The exact decisions the routing contract (docs/design.md, "Routing contract") asks of the
plain-torch routers where float32 alone cannot make them, so that every CPU (another BLAS,
another thread count, another batch: another summation order) routes a token the same way:

- round_z: z = x R2ᵀ rounded to the input dtype (bf16 / fp16) as the exact product rounds.
  An fp32 sum lies within its error bound of the exact one, so it rounds the same way unless
  it lies that close to a rounding midpoint: those few elements are summed again in fp64.
- settle_rows: the top-k of a row is decided by its fp32 logits when the k-th and the
  (k+1)-th, and each pair of consecutive winners, are further apart than twice the bound
  on an fp32 logit's error (one bound for the batch, from the largest row norm); the other
  rows are decided again on fp64 logits.

Both run eagerly (data-dependent rows, a host sync); under torch.compile or a CUDA-graph
capture the routers skip them and keep the fp32 decision.

Error bound of an fp32 dot product of length n: |fl(a·b) − a·b| <= γ_n Σ|a_i b_i| with
γ_n = n u / (1 − n u), u = 2^-24; we take n 2^-22 (a margin for blocked and fused sums) and
Σ|a_i b_i| <= ‖a‖₂ ‖b‖₂.

Legend: N tokens, h hidden, M experts, r rank, k active, a the matrix the weight w scores.
"""
from __future__ import annotations

import torch

UNIT = 2.0 ** -22       # per term of a sum: twice fp32's rounding unit, and room
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}     # stored mantissa bits


def dot_bound(n: int, a_norm_N: torch.Tensor, w_norm: torch.Tensor | float) -> torch.Tensor:
    """Bound on |fp32 sum − exact| of dot products of length n with these 2-norms."""
    return n * UNIT * a_norm_N * w_norm


def round_z(x_NH: torch.Tensor, R2_RH: torch.Tensor, z32_NR: torch.Tensor) -> torch.Tensor:
    """z32 (fp32 sums of x R2ᵀ) rounded to x's dtype as the exact products round; the
    result keeps z32's autograd (rounding passes gradients through unchanged). One bound
    for the whole matrix (the largest row norms): a few more elements are summed again than
    a bound per element would ask, for a handful of operations per call."""
    zr_NR = z32_NR.to(x_NH.dtype)
    if not zr_NR.numel():
        return zr_NR
    with torch.no_grad():
        flag_NR = midpoint_flags(x_NH, R2_RH, z32_NR.detach(), zr_NR)
        if not flag_NR.any():
            return zr_NR
        i, j = flag_NR.nonzero(as_tuple=True)
        exact = (x_NH[i].double() * R2_RH[j].double()).sum(dim=1)
        fix_NR = torch.zeros_like(zr_NR)
        fix_NR[i, j] = exact.float().to(zr_NR.dtype) - zr_NR[i, j]
    return zr_NR + fix_NR


def midpoint_flags(x_NH, R2_RH, z32_NR, zr_NR) -> torch.Tensor:
    """The elements of z whose rounding fp32 cannot vouch for (bool (N, r)): near a
    midpoint by the batch's bound, in a row of x that is not all zeros (padding sums
    exactly)."""
    x_norm_N = x_NH.float().norm(dim=1)
    bound = dot_bound(x_NH.shape[1], x_norm_N.max(), R2_RH.float().norm(dim=1).max())
    return _near_midpoint(z32_NR, zr_NR, bound) & (x_norm_N > 0)[:, None]


def _near_midpoint(z32: torch.Tensor, zr: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Where z32 may lie within bound of the midpoint between zr (its rounding) and the
    neighbour on its side, or of 0 (a superset); never where the bound is 0 (a row of
    zeros sums exactly). bf16 keeps fp32's top 16 bits, so the midpoint is where the low 16
    are 0x8000: d fp32 steps from it is at least d |z| 2^-24 away."""
    if zr.dtype == torch.bfloat16:
        steps = ((z32.view(torch.int32) & 0xFFFF) - 0x8000).abs()
        return (steps * z32.abs() * 2.0 ** -24 <= bound) & (bound > 0)
    mant, exp = torch.frexp(zr.float())                  # |zr| = |mant| 2^exp, |mant| in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(mant), exp - 1 - MANTISSA[zr.dtype])
    d = z32 - zr.float()
    down = (d * zr.float()) < 0                          # towards 0 from a power of two: finer
    half = torch.where(down & (mant.abs() == 0.5), ulp / 4, ulp / 2)
    near = (d.abs() >= half - bound) | (z32.abs() <= bound)
    return near & (bound > 0) & torch.isfinite(z32)


def doubtful_rows(key_NK1: torch.Tensor, bound) -> torch.Tensor:
    """Rows (bool (N,)) whose top-k fp32 cannot decide: key_NK1 are the k + 1 largest fp32
    logits, descending (k of them when M = k), each within bound (a scalar: the largest
    row's) of the exact one; two of them closer than twice the bound, unless the bound is 0
    (exact sums: a tie is a tie). A non-finite key makes its gap NaN or inf, never doubtful:
    those rows follow the selection's own exact rules."""
    gap_N = (key_NK1[:, :-1] - key_NK1[:, 1:]).amin(dim=1)
    return (gap_N <= 2 * bound) & (bound > 0)


def settle_rows(logits_NM, idx_NK, key_NK1, k: int, bound, exact_rows, select):
    """(idx, value correction or None): the doubtful rows' experts decided again on fp64
    logits (exact_rows(rows) -> (R, M) fp64; select(logits, k) the exact selection); the
    correction, added to logits.gather(idx) without gradient, makes their values the fp64
    ones rounded (so they stay in the exact order)."""
    doubt_N = doubtful_rows(key_NK1.detach(), bound)
    if not doubt_N.any():
        return idx_NK, None
    rows = doubt_N.nonzero()[:, 0]
    v64_RK, i_RK = select(exact_rows(rows), k)
    idx_NK = idx_NK.clone()
    idx_NK[rows] = i_RK.to(idx_NK.dtype)
    fix_NK = torch.zeros(idx_NK.shape, dtype=logits_NM.dtype, device=logits_NM.device)
    fix_NK[rows] = v64_RK.to(logits_NM.dtype) - logits_NM.detach()[rows].gather(
        1, i_RK.long())
    return idx_NK, fix_NK
