"""The exact decisions the routing contract (docs/design.md, "Routing contract") asks of the
plain-torch routers where float32 alone cannot make them, so that every CPU (another BLAS,
another thread count, another batch: another summation order) routes a token the same way:

- round_z: z = x R2ᵀ rounded to the input dtype (bf16 / fp16) as the exact product rounds:
  the fp64 product (each term of bf16 / fp16 values is exact in fp64) rounded once. Summing
  only the elements near a rounding midpoint again would cost less arithmetic, but an
  fp32 error bound (below) flags most of them at h = 512, and the gather of their rows
  (N r elements of length h) does not fit a GPU at the paper's N.
- settle_rows: the top-k of a row is decided by its fp32 logits when the k-th and the
  (k+1)-th, and each pair of consecutive winners, are further apart than twice the bound
  on an fp32 logit's error (per row, from its norm and the largest weight row's); the
  other rows are decided again on fp64 logits.

settle_rows runs eagerly (data-dependent rows, a host sync); under torch.compile or a CUDA-graph
capture the routers skip them and keep the fp32 decision.

Error bound of an fp32 dot product of length n: |fl(a·b) − a·b| <= γ_n Σ|a_i b_i| with
γ_n = n u / (1 − n u), u = 2^-24; we take n 2^-22 (a margin for blocked and fused sums) and
Σ|a_i b_i| <= ‖a‖₂ ‖b‖₂.

Legend: N tokens, h hidden, M experts, r rank, k active, a the matrix the weight w scores.
"""
from __future__ import annotations

import torch

UNIT = 2.0 ** -22       # per term of a sum: twice fp32's rounding unit, and room


def dot_bound(n: int, a_norm_N: torch.Tensor, w_norm: torch.Tensor | float) -> torch.Tensor:
    """Bound on |fp32 sum − exact| of dot products of length n with these 2-norms."""
    return n * UNIT * a_norm_N * w_norm


def round_z(x_NH: torch.Tensor, R2_RH: torch.Tensor) -> torch.Tensor:
    """z = x R2ᵀ in x's dtype (bf16 / fp16) as the exact products round: the fp64 product
    rounded once (round_once), without autograd. One (N, h) x (h, r) product in fp64 and a
    few elementwise operations, whatever the data: no data-dependent work."""
    with torch.no_grad():
        return round_once(x_NH.double() @ R2_RH.double().T, x_NH.dtype)


def round_once(z64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 values rounded to dtype (bf16 / fp16) once, to nearest, ties to even. Rounding
    through fp32 (what .to(dtype) does) errs only where the fp32 value lands exactly on a
    midpoint of dtype that the fp64 value is not on: those go to the neighbour on the fp64
    value's side."""
    z32 = z64.float()
    a = z32.to(dtype).float()
    b = (2 * z32 - a).to(dtype).float()     # the other neighbour, when z32 is their midpoint
    back = z32.double()
    mid = (b != a) & (b - z32 == z32 - a) & (z64 != back)
    side = torch.where(z64 > back, torch.maximum(a, b), torch.minimum(a, b))
    return torch.where(mid, side, a).to(dtype)


def settle_fp64(a_NR: torch.Tensor, w_MR: torch.Tensor, a64_rows, err_N=None):
    """(bound, rows -> fp64 logits) for select_topk's settle, for logits a wᵀ summed in
    fp32: the per-row bound R 2^-22 ‖a_n‖ max‖w_m‖, plus err_N max‖w_m‖ where a is itself
    an fp32 sum within err_N (‖a_n − exact a_n‖₂) of the exact one; a64_rows(rows) gives
    those rows of a in fp64 (the exact one's)."""
    with torch.no_grad():
        w_max = w_MR.detach().float().norm(dim=1).max()
        bound = dot_bound(a_NR.shape[1], a_NR.detach().float().norm(dim=1), w_max)
        if err_N is not None:
            bound = bound + err_N * w_max
    return bound, lambda rows: a64_rows(rows) @ w_MR.detach().double().T


def doubtful_rows(key_NK1: torch.Tensor, bound) -> torch.Tensor:
    """Rows (bool (N,)) whose top-k fp32 cannot decide: key_NK1 are the k + 1 largest fp32
    logits, descending (k of them when M = k), each within bound (per row (N,), or one for
    the batch) of the exact one; two of them closer than twice the bound, unless the bound
    is 0 (exact sums: a tie is a tie). A non-finite key makes its gap NaN or inf, never
    doubtful: those rows follow the selection's own exact rules."""
    gap_N = (key_NK1[:, :-1] - key_NK1[:, 1:]).amin(dim=1)
    return (gap_N <= 2 * bound) & (bound > 0)


def settle_rows(logits_NM, idx_NK, key_NK1, k: int, bound, exact_rows):
    """(idx, value correction or None): the doubtful rows' experts decided again on fp64
    logits (exact_rows(rows) -> (R, M) fp64) by a stable sort (ties to the lower index,
    non-finite logits last); the correction, added to logits.gather(idx) without gradient,
    makes their values the fp64 ones rounded (so they stay in the exact order)."""
    doubt_N = doubtful_rows(key_NK1.detach(), bound)
    if not doubt_N.any():
        return idx_NK, None
    rows = doubt_N.nonzero()[:, 0]
    l64_RM = exact_rows(rows)
    l64_RM = torch.where(torch.isfinite(l64_RM), l64_RM, float("-inf"))
    v64_RK, i_RK = (t[:, :k] for t in torch.sort(l64_RM, dim=1, descending=True, stable=True))
    idx_NK = idx_NK.clone()
    idx_NK[rows] = i_RK.to(idx_NK.dtype)
    fix_NK = torch.zeros(idx_NK.shape, dtype=logits_NM.dtype, device=logits_NM.device)
    fix_NK[rows] = v64_RK.to(logits_NM.dtype) - logits_NM.detach()[rows].gather(1, i_RK)
    return idx_NK, fix_NK
