"""The output head and the loss in one op: mean cross-entropy of softmax(x Wᵀ) against the
targets, without the (N, V) logits in memory. Rows go through in chunks of at most
chunk_elements(device) logits: the forward keeps each row's log-sum-exp (N,) only, the
backward forms each chunk's logits again, turns them into p − onehot and multiplies them
into dx (N, H) and dW (V, H). On CUDA each chunk's loss and gradient are torch.compile'd
into one pass over its logits (no fp32 copy); elsewhere they run eagerly, in place. W's
rows are padded with zeros to a multiple of PAD_ROWS (the padded logits are −inf: no
probability, no gradient).

The logits are formed as the head forms them today (``x @ Wᵀ`` in the inputs' dtype, the
autocast dtype under autocast: bf16 logits, fp32 accumulation in the GEMM) and the loss is
computed on them in fp32 (``model.transformer.lm_loss``): the same loss, and gradients
within bf16's rounding of the unfused path's. ``linear_cross_entropy_ref`` is that unfused
path, the reference of the tests.

Legend: N rows (tokens), H hidden, V vocabulary, P = V padded, C rows of a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 24        # logits of an eager chunk: 64 MiB in fp32
CUDA_CHUNK_ELEMENTS = 1 << 27   # of a compiled one: its bf16 logits and gradient, 512 MiB.
                                # H200, h = 512, V = 50,257, 8,192 / 32,768 tokens: 13.1 /
                                # 62 ms at 2^24 (each chunk's launches, and dW's fp32 add,
                                # cost about 0.5 ms), 5.3 / 20.1 ms at 2^27, 4.9 / 19.5 at
                                # 2^28 with twice the memory (benchmarks/NOTES.md)
PAD_ROWS = 64                   # W's rows padded to a multiple of this (model.padded_linear's
                                # reason: V = 50,257 leaves the logits' rows unaligned, and
                                # cuBLAS falls back to slow kernels)


def linear_cross_entropy_ref(x_NH: Tensor, W_VH: Tensor, targets_N: Tensor) -> Tensor:
    """The unfused head and loss: logits in x's dtype, cross-entropy in fp32."""
    logits_NV = F.linear(x_NH, W_VH)
    return F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX)


def linear_cross_entropy(x_NH: Tensor, W_VH: Tensor, targets_N: Tensor, *,
                         chunk_rows: int | None = None) -> Tensor:
    """Mean fp32 cross-entropy over the rows whose target is not IGNORE_INDEX (NaN when
    there is none, as F.cross_entropy), differentiable in x and W; chunk_rows overrides
    the chunk size (tests)."""
    if torch.is_autocast_enabled(x_NH.device.type):
        dt = torch.get_autocast_dtype(x_NH.device.type)
        x_NH, W_VH = x_NH.to(dt), W_VH.to(dt)
    elif W_VH.dtype != x_NH.dtype:
        raise ValueError(f"x is {x_NH.dtype} and W {W_VH.dtype}: give them one dtype")
    if x_NH.ndim != 2 or W_VH.ndim != 2 or x_NH.shape[1] != W_VH.shape[1] \
            or targets_N.shape != x_NH.shape[:1]:
        raise ValueError(f"x (N, H), W (V, H) and targets (N,) expected, got "
                         f"{tuple(x_NH.shape)}, {tuple(W_VH.shape)}, {tuple(targets_N.shape)}")
    V = W_VH.shape[0]
    rows = chunk_rows or max(1, chunk_elements(x_NH.device) // max(1, V))
    W_PH = F.pad(W_VH, (0, 0, 0, -V % PAD_ROWS))          # P = V rounded up; zeros, masked
    with torch.autocast(x_NH.device.type, enabled=False):
        return _LinearCrossEntropy.apply(x_NH, W_PH, targets_N, rows, V)


def chunk_elements(device: torch.device) -> int:
    """The most logits a chunk holds on this device."""
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


def _chunks(n: int, rows: int):
    return ((i, min(i + rows, n)) for i in range(0, n, rows))


def _chunk_loss(logits_CP: Tensor, t_C: Tensor, V: int) -> tuple[Tensor, Tensor]:
    """(lse (C,) fp32, Σ of lse − the target's logit over the valid rows) of a chunk's
    logits in the inputs' dtype (the padded columns ignored), in fp32."""
    l_CV = logits_CP[:, :V].float()
    lse_C = torch.logsumexp(l_CV, dim=1)
    picked_C = l_CV.gather(1, t_C.clamp(min=0).long()[:, None])[:, 0]
    return lse_C, torch.where(t_C != IGNORE_INDEX, lse_C - picked_C, 0.0).sum()


def _chunk_grad(logits_CP: Tensor, lse_C: Tensor, t_C: Tensor, scale: Tensor,
                V: int) -> Tensor:
    """d = (p − onehot(t)) · scale in the logits' dtype, 0 in the padded columns and the
    ignored rows, eagerly: in place on one fp32 copy of the chunk (written out of place,
    as _chunk_grad_fused is for torch.compile, it would hold four)."""
    d_CP = logits_CP.float().sub_(lse_C[:, None]).exp_()
    d_CP[:, V:] = 0.0
    valid_C = t_C != IGNORE_INDEX
    d_CP.scatter_add_(1, t_C.clamp(min=0).long()[:, None], -valid_C.float()[:, None])
    return d_CP.mul_(torch.where(valid_C, scale, 0.0)[:, None]).to(logits_CP.dtype)


def _chunk_grad_fused(logits_CP: Tensor, lse_C: Tensor, t_C: Tensor, scale: Tensor,
                      V: int) -> Tensor:
    """_chunk_grad written out of place, for torch.compile to fuse into one pass."""
    cols_P = torch.arange(logits_CP.shape[1], device=logits_CP.device)
    p_CP = torch.exp(logits_CP.float() - lse_C[:, None])
    onehot_CP = (cols_P[None, :] == t_C[:, None]).float()
    coef_C = torch.where(t_C != IGNORE_INDEX, scale, 0.0)
    d_CP = torch.where(cols_P[None, :] < V, (p_CP - onehot_CP) * coef_C[:, None], 0.0)
    return d_CP.to(logits_CP.dtype)


_COMPILED: dict = {}


def _chunk_fns(device: torch.device):
    """(loss, grad) of a chunk: compiled on CUDA (each a single pass over the chunk's
    logits, no fp32 copy of them), the eager ones elsewhere and while tracing."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return _chunk_loss, _chunk_grad
    if not _COMPILED:
        _COMPILED["fns"] = (torch.compile(_chunk_loss, dynamic=True),
                            torch.compile(_chunk_grad_fused, dynamic=True))
    return _COMPILED["fns"]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, W_PH, targets_N, rows, V):
        N = x_NH.shape[0]
        loss_fn, _ = _chunk_fns(x_NH.device)
        lse_N = torch.empty(N, dtype=torch.float32, device=x_NH.device)
        total = torch.zeros((), dtype=torch.float32, device=x_NH.device)
        for a, b in _chunks(N, rows):
            lse_N[a:b], part = loss_fn(F.linear(x_NH[a:b], W_PH), targets_N[a:b], V)
            total += part
        count = (targets_N != IGNORE_INDEX).sum()
        ctx.save_for_backward(x_NH, W_PH, targets_N, lse_N, count)
        ctx.rows, ctx.V = rows, V
        return total / count

    @staticmethod
    def backward(ctx, dloss):
        x_NH, W_PH, targets_N, lse_N, count = ctx.saved_tensors
        _, grad_fn = _chunk_fns(x_NH.device)
        scale = dloss.float() / count
        dx_NH = torch.empty_like(x_NH) if ctx.needs_input_grad[0] else None
        dW_PH = torch.zeros(W_PH.shape, dtype=torch.float32, device=W_PH.device) \
            if ctx.needs_input_grad[1] else None
        for a, b in _chunks(x_NH.shape[0], ctx.rows):
            d_CP = grad_fn(F.linear(x_NH[a:b], W_PH), lse_N[a:b], targets_N[a:b], scale,
                           ctx.V)
            if dx_NH is not None:
                dx_NH[a:b] = d_CP @ W_PH
            if dW_PH is not None:
                dW_PH += (d_CP.T @ x_NH[a:b]).float()
        return dx_NH, None if dW_PH is None else dW_PH.to(W_PH.dtype), None, None, None
