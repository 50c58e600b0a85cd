"""A token's rows for the ranks that hold its experts, and their sum back (expert
parallelism with local tokens, parallel/expert.py).

``gather_rows(x, tok, pos)``: rows (R, h) = x[tok], row r for the rank its token goes to;
``combine_rows(rows, pos, tok)``: y (N, h), y[n] = Σ_j rows[pos[n, j]] (pos -1: no row),
summed in fp32 in the order of j and written in rows' dtype. Each is the other's adjoint,
so each one's backward is the other (tok and pos describe the same rows: pos[tok[r], j] = r
for the j of row r). The sum runs the Triton kernel (kernels/token_rows.py) on CUDA, the
reference elsewhere; the gather is a torch index_select (a copy, nothing to fuse).

Legend: N tokens, h hidden, R rows, E ranks (the columns of pos).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as ref
from .dispatch import resolve_impl


def _sum(rows_RH: Tensor, pos_NE: Tensor, impl: str) -> Tensor:
    if resolve_impl(impl, rows_RH) == "reference":
        return ref.combine_rows_ref(rows_RH, pos_NE)
    from ..kernels.token_rows import combine_rows as kernel
    return kernel(rows_RH, pos_NE)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, tok_R, pos_NE, impl):
        ctx.save_for_backward(pos_NE)
        ctx.impl = impl
        return x_NH.index_select(0, tok_R)

    @staticmethod
    def backward(ctx, drows):
        pos, = ctx.saved_tensors
        return _sum(drows, pos, ctx.impl), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RH, pos_NE, tok_R, impl):
        ctx.save_for_backward(tok_R)
        return _sum(rows_RH, pos_NE, impl)

    @staticmethod
    def backward(ctx, dy):
        tok, = ctx.saved_tensors
        return dy.index_select(0, tok), None, None, None


def gather_rows(x_NH: Tensor, tok_R: Tensor, pos_NE: Tensor, *, impl: str = "auto") -> Tensor:
    """x[tok] (R, h); its gradient sums each token's rows (combine_rows)."""
    return _Gather.apply(x_NH, tok_R, pos_NE, impl)


def combine_rows(rows_RH: Tensor, pos_NE: Tensor, tok_R: Tensor, *,
                 impl: str = "auto") -> Tensor:
    """y (N, h) in rows' dtype, the sum of each token's rows; its gradient is dy[tok]."""
    return _Combine.apply(rows_RH, pos_NE, tok_R, impl)
