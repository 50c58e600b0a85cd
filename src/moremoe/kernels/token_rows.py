"""Sums of each token's rows, in fp32 in a fixed order (deterministic: no atomics), written
in the rows' dtype; the rows are read once and y written once (no (N, h) fp32 buffer, no
index_add).

  _combine_pairs_kernel (N/BN, h/BH)  pair rows (N·k, h) -> y (N, h) = Σ_j rows[n·k + j]:
      the grouped expert kernels' gated outputs (swiglu_experts.py), with SHARD only the
      slots whose expert id is in [FIRST, FIRST + M) (an expert-parallel shard: the others'
      rows were never written); a token range [N0, N1) at a time (a chunk).
  _sum_rows_kernel (N/BN, h/BH)       rows (R, h), kept (S, h), pos (N, E) -> y (N, h):
      y[n] = Σ_j src[pos[n, j]] over the j with pos[n, j] >= 0 (a token with no row gets
      zeros), src the rows followed by the kept rows, each read where it lies: the return
      path of expert parallelism with local tokens (parallel/exchange.py), a token's row
      back from each rank that holds one of its experts, its own rank's from the experts'
      output.

k and E (the columns of pos, one per rank) are compile-time constants: the loops unroll.
Legend: N tokens, k slots, h hidden (H), R rows, E ranks.
"""
import torch
import triton
import triton.language as tl

from ._common import load_rows, next_pow2


@triton.jit
def _combine_pairs_kernel(IN, Y, IDX, N0, N1, H, FIRST, M, K: tl.constexpr, SHARD: tl.constexpr,
                    BN: tl.constexpr, BH: tl.constexpr):
    """y[n] = Σ_j IN[n·K + j] for the tokens n in [N0, N1); SHARD: only the slots j whose
    expert id IDX[n·K + j] is in [FIRST, FIRST + M) (the others' rows were never written)."""
    n = N0 + tl.program_id(0) * BN + tl.arange(0, BN).to(tl.int64)
    n_ok = n < N1
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = hh < H
    acc = tl.zeros((BN, BH), tl.float32)
    for j in tl.static_range(K):
        ok = n_ok
        if SHARD:
            e = tl.load(IDX + n * K + j, mask=n_ok, other=0).to(tl.int64) - FIRST
            ok = n_ok & (e >= 0) & (e < M)
        acc += load_rows(IN, n * K + j, ok, H, hh, h_ok, 1).to(tl.float32)
    tl.store(Y + n[:, None] * H + hh[None, :], acc.to(Y.dtype.element_ty),
             mask=n_ok[:, None] & h_ok[None, :])


@triton.jit
def _sum_rows_kernel(ROWS, KEPT, POS, Y, N, H, R, E: tl.constexpr, BN: tl.constexpr,
                     BH: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN).to(tl.int64)
    n_ok = n < N
    hh = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = hh < H
    acc = tl.zeros((BN, BH), tl.float32)
    for j in tl.static_range(E):
        p = tl.load(POS + n * E + j, mask=n_ok, other=-1)
        sent = n_ok & (p >= 0) & (p < R)
        kept = n_ok & (p >= R)
        # one of the two is the row, the other exactly 0: the sum is the row's
        acc += (load_rows(ROWS, p, sent, H, hh, h_ok, 1).to(tl.float32)
                + load_rows(KEPT, p - R, kept, H, hh, h_ok, 1).to(tl.float32))
    tl.store(Y + n[:, None] * H + hh[None, :], acc.to(Y.dtype.element_ty),
             mask=n_ok[:, None] & h_ok[None, :])


def combine_pairs(y, pair_rows, idx, n0: int, n1: int, first_expert, M: int) -> None:
    """y[n0:n1] = the sums of the tokens' pair rows (N·k, h), in place; only the slots of
    experts [first_expert, first_expert + M) unless first_expert is None."""
    h = y.shape[1]
    if n1 > n0 and h:
        BN, BH = 32, min(128, next_pow2(h))
        _combine_pairs_kernel[(triton.cdiv(n1 - n0, BN), triton.cdiv(h, BH))](
            pair_rows, y, idx, n0, n1, h, first_expert or 0, M, K=idx.shape[1],
            SHARD=first_expert is not None, BN=BN, BH=BH)


def sum_rows(rows_RH: torch.Tensor, pos_NE: torch.Tensor,
             kept_SH: torch.Tensor | None = None) -> torch.Tensor:
    """y (N, h) in rows' dtype from the rows (R, h), the kept rows (S, h) after them and pos
    (N, E) int64 (-1: no row)."""
    rows_RH, pos_NE = rows_RH.contiguous(), pos_NE.contiguous()
    kept_SH = rows_RH[:0] if kept_SH is None else kept_SH.contiguous()
    N, E = pos_NE.shape
    R, h = rows_RH.shape
    if not (R or kept_SH.shape[0]):             # no row at all: nothing to read
        return rows_RH.new_zeros(N, h)
    y = torch.empty(N, h, device=rows_RH.device, dtype=rows_RH.dtype)
    if N and h:
        BN, BH = 32, min(128, next_pow2(h))
        # an empty source is never read: the other stands in for its pointer
        _sum_rows_kernel[(triton.cdiv(N, BN), triton.cdiv(h, BH))](
            rows_RH if R else kept_SH, kept_SH if kept_SH.shape[0] else rows_RH, pos_NE, y,
            N, h, R, E=E, BN=BN, BH=BH)
    return y
