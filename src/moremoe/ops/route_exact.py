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
    """z = x R2ᵀ in x's dtype (bf16 / fp16 / fp32) as the exact products round: the fp64 product
    rounded once (round_once), without autograd. One (N, h) x (h, r) product in fp64 and a
    few elementwise operations, whatever the data: no data-dependent work."""
    with torch.no_grad():
        return round_once(x_NH.double() @ R2_RH.double().T, x_NH.dtype)


def round_once(z64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 values rounded to dtype (bf16 / fp16 / fp32) once, to nearest, ties to even. Rounding
    through fp32 (what .to(dtype) does) errs only where the fp32 value lands exactly on a
    midpoint of dtype that the fp64 value is not on: those go to the neighbour on the fp64
    value's side."""
    z32 = z64.float()
    if dtype == torch.float32:
        return z32                          # one rounding: fp64 to fp32
    a = z32.to(dtype).float()
    b = (2 * z32 - a).to(dtype).float()     # the other neighbour, when z32 is their midpoint
    back = z32.double()
    mid = (b != a) & (b - z32 == z32 - a) & (z64 != back)
    side = torch.where(z64 > back, torch.maximum(a, b), torch.minimum(a, b))
    return torch.where(mid, side, a).to(dtype)


def settle_fp64(a_NR: torch.Tensor, w_MR: torch.Tensor, a64_rows, err_N=None, *,
                w_max: torch.Tensor | None = None):
    """(bound, exact) for select_topk's settle, for logits a wᵀ summed in fp32: the per-row
    bound R 2^-22 ‖a_n‖ max‖w_m‖, plus err_N max‖w_m‖ where a is itself an fp32 sum within
    err_N (‖a_n − exact a_n‖₂) of the exact one; exact(rows, cols) gives fp64 logits of those
    rows (of a: a64_rows(rows) gives them in fp64, the exact one's) at the columns cols (R, C),
    or at every column when cols is None. w_max: max‖w_m‖ when the caller has it."""
    with torch.no_grad():
        if w_max is None:
            w_max = w_MR.detach().float().norm(dim=1).max()
        bound = dot_bound(a_NR.shape[1], a_NR.detach().float().norm(dim=1), w_max)
        if err_N is not None:
            bound = bound + err_N * w_max

    def exact(rows, cols=None):
        a64_RR = a64_rows(rows)
        if cols is None:
            return a64_RR @ w_MR.detach().double().T
        w64_RCR = w_MR.detach()[cols].double()               # only the candidates' rows
        return torch.bmm(w64_RCR, a64_RR[:, :, None])[..., 0]
    return bound, exact


def doubtful_rows(key_NK1: torch.Tensor, bound) -> torch.Tensor:
    """Rows (bool (N,)) whose top-k fp32 cannot decide: key_NK1 are the k + 1 largest fp32
    logits, descending (k of them when M = k), each within bound (per row (N,), or one for
    the batch) of the exact one; two of them closer than twice the bound, unless the bound
    is 0 (exact sums: a tie is a tie). A non-finite key makes its gap NaN or inf, never
    doubtful: those rows follow the selection's own exact rules."""
    gap_N = (key_NK1[:, :-1] - key_NK1[:, 1:]).amin(dim=1)
    return (gap_N <= 2 * bound) & (bound > 0)


CANDIDATES = 256    # the most experts a doubtful row is decided among; a wider one: its row


def settle_rows(logits_NM, idx_NK, key_NK1, k: int, bound, exact):
    """(idx, value correction or None): the doubtful rows' experts decided again on fp64
    logits, ties to the lower index, non-finite fp32 logits never taken; the correction,
    added to logits.gather(idx) without gradient, makes their values the fp64 ones rounded
    (so they stay in the exact order). Only candidates are summed in fp64: an expert whose
    fp32 logit is below the k-th key less twice the bound cannot reach the exact top k
    (each logit is within the bound of the exact one); a row with more than CANDIDATES of
    them is summed whole."""
    doubt_N = doubtful_rows(key_NK1.detach(), bound)
    if not doubt_N.any():
        return idx_NK, None
    rows = doubt_N.nonzero()[:, 0]
    l_RM = logits_NM.detach()[rows]
    b = bound[rows, None] if torch.is_tensor(bound) and bound.dim() else bound
    near_RM = torch.where(l_RM >= key_NK1[rows, k - 1:k] - 2 * b, l_RM, float("-inf"))
    C = int((near_RM > float("-inf")).sum(1).max())          # NaN: not near; +inf: below
    if C > CANDIDATES:
        cols_RC = torch.arange(l_RM.shape[1], device=l_RM.device).expand_as(l_RM)
        l64_RC, l32_RC = exact(rows), l_RM
    else:
        cols_RC = torch.topk(near_RM, C, dim=1).indices
        l64_RC, l32_RC = exact(rows, cols_RC), near_RM.gather(1, cols_RC)
    ok_RC = torch.isfinite(l32_RC) & torch.isfinite(l64_RC)
    l64_RC = torch.where(ok_RC, l64_RC, float("-inf"))
    cols_RC, by_id = torch.sort(cols_RC, dim=1)              # ties to the lower index:
    l64_RC = l64_RC.gather(1, by_id)                         # by id, then stably by value
    order = torch.sort(l64_RC, dim=1, descending=True, stable=True).indices[:, :k]
    i_RK, v64_RK = cols_RC.gather(1, order), l64_RC.gather(1, order)
    idx_NK = idx_NK.clone()
    idx_NK[rows] = i_RK.to(idx_NK.dtype)
    fix_NK = torch.zeros(idx_NK.shape, dtype=logits_NM.dtype, device=logits_NM.device)
    fix_NK[rows] = v64_RK.to(logits_NM.dtype) - l_RM.gather(1, i_RK)
    return idx_NK, fix_NK
