"""The sharded router's local pieces, collective-free (parallel/sharded_router.py moves the
tensors between ranks): each of E ranks scores only its M_e = M/E experts, ℓ_e = a w_eᵀ.

- ``shard_topk``: the shard's top-k_e (k_e = min(k, M_e)) values and local indices under the
  selection semantics of ``reference.select_topk``, and its row log-sum-exp lse_e (N,) over
  the finite logits (−inf for a row with none); the fused training sweep on CUDA, the
  reference elsewhere.
- ``shard_select``: inference, the same selection without statistics or autograd (the
  routers' inference kernels on CUDA, which form z = x R2ᵀ on chip).
- ``merge_topk``: the exact global top-k from the E local lists (a Triton kernel on CUDA,
  kernels/router_shard.py; a torch sort elsewhere).
- ``combine_lse``: the global lse (N,) from the E local ones, differentiable.
- ``shard_psum``: the shard's columns of psum = Σ_n softmax over ALL M logits, given the
  global lse (the fused psum kernel with m = lse, Z = 1 on CUDA, the reference elsewhere).

Gradients: dℓ_e = scatter(dval) + P_e ⊙ (p̄ − g) needs g_n = Σ_i p̄_i P_ni over all M
experts; it arrives through lse: shard_psum gives d lse = −Σ_{i in shard} p̄_i P_ni (a
partial the caller sums over ranks) and shard_topk turns d lse_e into P_e ⊙ d lse_e. Both
are dℓ = P ⊙ (p̄ − g) + scatter(dval) with g handed in: the routers' fused backward kernels
with g given (kernels/router_train.launch_backward, g_given) on CUDA, one sweep each;
elsewhere the logits recomputed in chunks of tokens in plain torch, fp32 (_contract, the
reference).

Legend: N tokens, E ranks, M_e a shard's experts, k_e its top-k, R the width of the scored
matrix a: r for the low-rank router (a = z = x R2ᵀ, w = R1's rows), h for the standard one
(a = x, w = W's rows); P the softmax over all M experts, p̄ the gradient of psum.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as ref
from . import route_exact
from .dispatch import kernel_dtype, resolve_impl

CHUNK_ELEMENTS = 1 << 24      # logits per chunk of the backward: 64 MiB of fp32 at most


def _finite(t: Tensor) -> Tensor:
    return torch.where(torch.isfinite(t), t, float("-inf"))


def _lse(m_N: Tensor, norm_N: Tensor) -> Tensor:
    """log-sum-exp from the kernel's row max m and normaliser Z (−inf for a row with Z = 0)."""
    ok = norm_N > 0
    return torch.where(ok, m_N + torch.log(torch.where(ok, norm_N, 1.0)), float("-inf"))


def _kernels(lowrank: bool):
    from ..kernels import router_linear, router_lowrank
    return (router_lowrank, router_lowrank.ZGIVEN) if lowrank else \
        (router_linear, router_linear.LINEAR)


def _use_kernels(impl: str, a: Tensor, k: int, lowrank: bool) -> bool:
    return resolve_impl(impl, a, k, rank=a.shape[1] if lowrank else None) == "triton"


def exact_inputs(x_NH: Tensor, R2_RH: Tensor | None):
    """(a, exact) for the reference path: a the matrix the shard's rows score (x, or z as
    the one-process reference forms it: rounded once to x's dtype), with its autograd;
    exact = (a64, err) for ``shard_topk`` / ``shard_select``: a in fp64 and err None (x, or
    z rounded: exact as given); exact is None for fp64 inputs (their sums decide as they
    are)."""
    a = x_NH if R2_RH is None else ref.lowrank_z(x_NH, R2_RH)
    if x_NH.dtype == torch.float64:
        return a, None
    with torch.no_grad():
        return a, (a.double(), None)


def _select_ref(a_NR, w_MR, k: int, exact):
    """The reference's logits, exact selection and the winners' fp64 logits (the merge's
    keys; None without exact): rows fp32 cannot decide are decided on a64's fp64 logits,
    as the one-process reference decides them (route_exact)."""
    logits_NM = ref.router_logits_linear(a_NR, w_MR)
    if exact is None:
        return (logits_NM, *ref.select_topk(logits_NM, k), None)
    a64_NR, err_N = exact
    val, idx = ref.select_topk(logits_NM, k, settle=lambda: route_exact.settle_fp64(
        a_NR, w_MR, lambda rows: a64_NR[rows], err_N))
    keys = torch.einsum("nr,nkr->nk", a64_NR, w_MR.detach().double()[idx.long()])
    keys = torch.where(torch.isfinite(val.detach()), keys, float("-inf"))   # the fillers
    return logits_NM, val, idx, keys


def _topk_forward(a_NR, w_MR, k: int, lowrank: bool, impl: str, exact=None):
    if _use_kernels(impl, a_NR, k, lowrank):
        dt = kernel_dtype(a_NR)
        kern, _ = _kernels(lowrank)
        val, idx, _, m, norm, _ = kern.train_forward(a_NR.to(dt), w_MR.to(dt), k,
                                                     with_psum=False)
        return val, idx, _lse(m, norm), None
    logits_NM, val, idx, keys = _select_ref(a_NR, w_MR, k, exact)
    return val, idx, torch.logsumexp(_finite(logits_NM), dim=1), keys


def _psum_forward(a_NR, w_MR, lse_N, lowrank: bool, impl: str):
    if _use_kernels(impl, a_NR, 1, lowrank):
        from ..kernels.router_train import launch_psum
        dt = kernel_dtype(a_NR)
        _, mode = _kernels(lowrank)
        # P = exp(ℓ − m) / Z with m = lse, Z = 1; Z = inf zeroes a row with no finite logit
        norm = torch.where(torch.isfinite(lse_N), 1.0, float("inf"))
        return launch_psum(a_NR.to(dt), w_MR.to(dt), lse_N.float().contiguous(), norm,
                           mode=mode)
    logits_NM = ref.router_logits_linear(a_NR, w_MR)
    return _probs(logits_NM, lse_N).sum(dim=0)


def _probs(logits_NM: Tensor, lse_N: Tensor) -> Tensor:
    """exp(ℓ − lse), 0 where ℓ is not finite or the row has no finite logit (NaN or inf
    there, made 0 as the kernels do)."""
    p = torch.exp(_finite(logits_NM) - lse_N[:, None])
    return torch.where(p < float("inf"), p, 0.0)


def _contract(a_NR, w_MR, lse_N, *, col_M=None, row_N=None, idx_NK=None, dval_NK=None,
              rows_per_chunk: int | None = None):
    """(da, dw, g | None) for dℓ = P ⊙ col (col given) or P ⊙ row (row given), plus
    scatter(dval at idx); P = exp(ℓ − lse); g = P col. Chunks of tokens (CHUNK_ELEMENTS
    logits each unless rows_per_chunk), fp32."""
    N, R = a_NR.shape
    w32 = w_MR.float()
    da = torch.empty(N, R, device=a_NR.device, dtype=torch.float32)
    dw = torch.zeros(w_MR.shape, device=a_NR.device, dtype=torch.float32)
    g = None if col_M is None else torch.empty(N, device=a_NR.device, dtype=torch.float32)
    step = rows_per_chunk or max(1, CHUNK_ELEMENTS // max(1, w_MR.shape[0]))
    for n0 in range(0, N, step):
        a32 = a_NR[n0:n0 + step].float()
        p = _probs(a32 @ w32.T, lse_N[n0:n0 + step].float())
        if col_M is not None:
            d = p * col_M.float()[None, :]
            g[n0:n0 + step] = p @ col_M.float()
        else:
            d = p * row_N[n0:n0 + step].float()[:, None]
        if idx_NK is not None:
            d.scatter_add_(1, idx_NK[n0:n0 + step].long(), dval_NK[n0:n0 + step].float())
        da[n0:n0 + step] = d @ w32
        dw += d.T @ a32
    return da.to(a_NR.dtype), dw.to(w_MR.dtype), g


def _backward(a_NR, w_MR, lse_N, lowrank: bool, impl: str, *, col_M=None, row_N=None,
              idx_NK=None, dval_NK=None):
    """_contract's (da, dw, g | None), on the fused kernels where the forward took them:
    dℓ = P ⊙ (col − (−row)) + scatter(dval), P = exp(ℓ − lse) (m = lse, Z = 1)."""
    if not _use_kernels(impl, a_NR, 1, lowrank):
        return _contract(a_NR, w_MR, lse_N, col_M=col_M, row_N=row_N, idx_NK=idx_NK,
                         dval_NK=dval_NK)
    from ..kernels.router_train import launch_backward
    dt = kernel_dtype(a_NR)
    _, mode = _kernels(lowrank)
    N, M = a_NR.shape[0], w_MR.shape[0]
    dev = a_NR.device
    lse = lse_N.detach().float().contiguous()
    norm = torch.where(torch.isfinite(lse), 1.0, float("inf"))
    g_in = (-row_N.float() if row_N is not None
            else torch.zeros(N, device=dev, dtype=torch.float32))
    if idx_NK is None:
        idx_NK = torch.zeros(N, 0, device=dev, dtype=torch.int32)
        dval_NK = torch.zeros(N, 0, device=dev, dtype=torch.float32)
    da, dw, g = launch_backward(a_NR.detach().to(dt).contiguous(), w_MR.detach().to(dt),
                                lse, norm, col_M, idx_NK.int(), dval_NK, mode=mode,
                                g_given=g_in)
    return da.to(a_NR.dtype), dw.to(w_MR.dtype), (g if col_M is not None else None)


class _ShardTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_NR, w_MR, k, lowrank, impl, exact):
        val, idx, lse, keys = _topk_forward(a_NR.detach(), w_MR.detach(), k, lowrank, impl,
                                            exact)
        ctx.lowrank, ctx.impl = lowrank, impl
        ctx.save_for_backward(a_NR, w_MR, idx, lse)
        ctx.mark_non_differentiable(idx)
        if keys is None:
            return val, idx, lse, None
        ctx.mark_non_differentiable(keys)
        return val, idx, lse, keys

    @staticmethod
    def backward(ctx, dval, _didx, dlse, _dkeys):
        a, w, idx, lse = ctx.saved_tensors
        da, dw, _ = _backward(a, w, lse, ctx.lowrank, ctx.impl, row_N=dlse, idx_NK=idx,
                              dval_NK=dval)
        return da, dw, None, None, None, None


class _ShardPsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_NR, w_MR, lse_N, lowrank, impl):
        ctx.lowrank, ctx.impl = lowrank, impl
        ctx.save_for_backward(a_NR, w_MR, lse_N)
        return _psum_forward(a_NR.detach(), w_MR.detach(), lse_N.detach(), lowrank, impl)

    @staticmethod
    def backward(ctx, dpsum_M):
        a, w, lse = ctx.saved_tensors
        da, dw, g = _backward(a, w, lse, ctx.lowrank, ctx.impl, col_M=dpsum_M)
        return da, dw, (-g).to(lse.dtype), None, None


def shard_topk(a_NR: Tensor, w_MR: Tensor, k: int, *, lowrank: bool, impl: str = "auto",
               exact=None):
    """(val (N, k) fp32 descending, idx (N, k) int32 in [0, M_e), lse (N,) fp32, keys) of
    the shard's logits a w_eᵀ; val and lse are differentiable in a and w. On the reference
    path with exact (``exact_inputs``) the selection is exact and keys (N, k) fp64 are the
    winners' fp64 logits, for an exact merge; else keys is None."""
    return _ShardTopk.apply(a_NR, w_MR, k, lowrank, impl, exact)


def shard_select(x_NH: Tensor, w_MR: Tensor, R2_RH: Tensor | None, k: int, *,
                 impl: str = "auto"):
    """Inference: (val (N, k) fp32, idx (N, k) int32 in [0, M_e), keys (N, k) fp64 or None)
    of the shard's logits, (x R2ᵀ) w_eᵀ (low-rank, R2 given) or x w_eᵀ, in the kernels'
    dtype; keys as ``shard_topk``'s (the reference path)."""
    rank = None if R2_RH is None else R2_RH.shape[0]
    if resolve_impl(impl, x_NH, k, rank=rank) == "reference":
        a, exact = exact_inputs(x_NH, R2_RH)
        _, val, idx, keys = _select_ref(a, w_MR, k, exact)
        return val, idx, keys
    from ..kernels import router_linear, router_lowrank
    dt = kernel_dtype(x_NH)
    x, w = x_NH.to(dt), w_MR.to(dt)
    val, idx, _ = (router_linear.infer(x, w, k) if R2_RH is None
                   else router_lowrank.infer(x, w, R2_RH.to(dt), k))
    return val, idx, None


def shard_psum(a_NR: Tensor, w_MR: Tensor, lse_N: Tensor, *, lowrank: bool,
               impl: str = "auto") -> Tensor:
    """(M_e,) fp32: Σ_n exp(ℓ_n − lse_n) over the shard's columns, lse the GLOBAL row
    log-sum-exp; differentiable in a, w and lse (whose gradient is a per-rank partial)."""
    return _ShardPsum.apply(a_NR, w_MR, lse_N, lowrank, impl)


def merge_topk(val_ENK: Tensor, idx_ENK: Tensor, k: int, *, impl: str = "auto",
               keys_ENK: Tensor | None = None):
    """The global top-k from E local top-k lists (values, GLOBAL int indices), exactly
    ``reference.select_topk`` of the whole row: the finite values descending, ties and the
    non-finite fillers by the lower index. Exact because each local list holds the shard's
    k_e best under that same order (value descending, index ascending), and a row short of
    k finite logits finds its lowest unchosen indices among the shards' own fillers.
    Returns (val (N, k), idx (N, k) int32); val is differentiable. The merge kernel
    (kernels/router_shard.py) on CUDA, the torch sort elsewhere; ordered by keys_ENK (the
    candidates' fp64 logits, the reference path's) where given, by the values otherwise."""
    if keys_ENK is not None or resolve_impl(impl, val_ENK, k) == "reference":
        return _merge_torch(val_ENK, idx_ENK, k, keys_ENK)
    return _MergeTopk.apply(val_ENK, idx_ENK, k)


class _MergeTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, val_ENK, idx_ENK, k):
        from ..kernels.router_shard import merge
        val, idx = merge(val_ENK.detach(), idx_ENK, k)
        ctx.save_for_backward(idx_ENK, idx)
        ctx.mark_non_differentiable(idx)
        return val, idx

    @staticmethod
    def backward(ctx, dval_NK, _didx):
        cand_ENK, idx_NK = ctx.saved_tensors
        # each winner's value came from the one candidate of its (distinct) index
        hit = cand_ENK.long()[:, :, None, :] == idx_NK.long()[None, :, :, None]
        dval = (hit * dval_NK.float()[None, :, :, None]).sum(dim=2)
        return dval, None, None


def _merge_torch(val_ENK: Tensor, idx_ENK: Tensor, k: int, keys_ENK: Tensor | None = None):
    E, N, k_e = val_ENK.shape
    val_NC = val_ENK.permute(1, 0, 2).reshape(N, E * k_e)
    idx_NC = idx_ENK.permute(1, 0, 2).reshape(N, E * k_e).long()
    by_index = idx_NC.argsort(dim=1)                        # indices are distinct in a row
    order_by = val_NC.detach() if keys_ENK is None else \
        keys_ENK.permute(1, 0, 2).reshape(N, E * k_e)
    keys = _finite(order_by).gather(1, by_index)
    order = by_index.gather(1, keys.sort(dim=1, descending=True, stable=True).indices[:, :k])
    return val_NC.gather(1, order), idx_NC.gather(1, order).to(torch.int32)


def combine_lse(lse_EN: Tensor) -> Tensor:
    """log Σ_e exp(lse_e) per row, −inf (and no NaN gradient) for a row with no finite
    logit on any shard."""
    m = lse_EN.detach().amax(dim=0)
    m = torch.where(torch.isfinite(m), m, 0.0)
    s = torch.exp(lse_EN - m).sum(dim=0)
    ok = s > 0
    return torch.where(ok, m + torch.log(torch.where(ok, s, 1.0)), float("-inf"))
