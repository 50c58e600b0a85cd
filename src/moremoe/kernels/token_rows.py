"""The sum of each token's rows (the return path of expert parallelism with local tokens,
parallel/expert.py): a token's row went to each rank that holds one of its experts, once
per rank, and came back as that rank's gated expert output; here they are added up.

  _combine_rows_kernel (N/BN, h/BH)  rows (R, h), pos (N, E) -> y (N, h):
      y[n] = Σ_j rows[pos[n, j]] over the j with pos[n, j] >= 0, summed in fp32 in the
      order of j (deterministic: no atomics), written in rows' dtype; a token with no row
      gets zeros.

The rows are read once and y written once: no (N, h) fp32 buffer and no index_add. E (the
columns of pos, one per rank) is a compile-time constant, so the loop over ranks unrolls.
Legend: N tokens, h hidden (H), R rows, E ranks.
"""
import torch
import triton
import triton.language as tl

from ._common import load_rows, next_pow2


@triton.jit
def _combine_rows_kernel(ROWS, POS, Y, N, H, E: tl.constexpr, BN: tl.constexpr,
                         BH: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN).to(tl.int64)
    n_ok = n < N
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = hh < H
    acc = tl.zeros((BN, BH), tl.float32)
    for j in tl.static_range(E):
        p = tl.load(POS + n * E + j, mask=n_ok, other=-1)
        acc += load_rows(ROWS, p, n_ok & (p >= 0), H, hh, h_ok, 1).to(tl.float32)
    tl.store(Y + n[:, None] * H + hh[None, :], acc.to(Y.dtype.element_ty),
             mask=n_ok[:, None] & h_ok[None, :])


def combine_rows(rows_RH: torch.Tensor, pos_NE: torch.Tensor) -> torch.Tensor:
    """y (N, h) in rows' dtype from the rows (R, h) and pos (N, E) int64 (-1: no row)."""
    rows_RH, pos_NE = rows_RH.contiguous(), pos_NE.contiguous()
    N, E = pos_NE.shape
    h = rows_RH.shape[1]
    y = torch.empty(N, h, device=rows_RH.device, dtype=rows_RH.dtype)
    if N and h:
        BN, BH = 32, min(128, next_pow2(h))
        _combine_rows_kernel[(triton.cdiv(N, BN), triton.cdiv(h, BH))](
            rows_RH, pos_NE, y, N, h, E=E, BN=BN, BH=BH)
    return y
