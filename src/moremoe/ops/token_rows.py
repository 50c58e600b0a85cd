"""The sum of a token's rows back from the ranks that hold its experts (expert parallelism
with local tokens, parallel/exchange.py).

``sum_rows(rows, pos, kept)``: y (N, h), y[n] = Σ_j src[pos[n, j]] (pos -1: no row) where
src is rows (R, h) followed by kept (S, h), read where they lie (no concatenation: kept is
the rows a rank keeps, in the experts' own output); summed in fp32 in the order of j and
written in rows' dtype. Not differentiable by itself: the exchange's backward forms the
adjoint (each row's gradient is dy[tok]). The sum runs the Triton kernel
(kernels/token_rows.py) on CUDA, the reference elsewhere.

Legend: N tokens, h hidden, R rows, S kept rows, E ranks (the columns of pos).
"""
from __future__ import annotations

from torch import Tensor

from . import reference as ref
from .dispatch import resolve_impl


def sum_rows(rows_RH: Tensor, pos_NE: Tensor, kept_SH: Tensor | None = None, *,
             impl: str = "auto") -> Tensor:
    """y (N, h) in rows' dtype: each token's rows summed (module header)."""
    if kept_SH is not None and kept_SH.dtype != rows_RH.dtype:
        raise ValueError(f"kept rows are {kept_SH.dtype}, expected rows' {rows_RH.dtype}")
    if resolve_impl(impl, rows_RH) == "reference":
        return ref.sum_rows_ref(rows_RH, pos_NE, kept_SH)
    from ..kernels.token_rows import sum_rows as kernel
    return kernel(rows_RH, pos_NE, kept_SH)
