"""PEER's experts op: y = Σ_j gates[:, j] · σ(x · u_{ids[:, j]}) v_{ids[:, j]}, M single-neuron
experts (the paper's Appendix B), given the retrieval's (N, k) ids and gates.

``peer_experts(x, gates, ids, u, v, activation=..., impl=...)`` runs the fused Triton kernels
(kernels/peer_experts.py; custom ops moremoe::peer_experts[_bwd] with fake tensors for
torch.compile and autograd for x, gates, u and v; outside torch.compile their bodies run
directly, ops/eager.py) or the plain-torch path ``peer_experts_ref``, which is also the
oracle the kernels are tested against. impl="auto" takes the kernels on CUDA for the dtypes
and widths they cover (h <= PEER_MAX_HIDDEN), the torch path elsewhere.

Legend: N tokens, h hidden, M experts, k = H κ slots a token (H heads, κ per head).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_expert_ids
from ..kernels import PEER_MAX_HIDDEN
from .dispatch import kernel_dtype, needs_grad, resolve_impl
from .eager import call, call_autograd
from .reference import upcast_dtype

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


def peer_experts_ref(x_NH, gates_NK, ids_NK, u_MH, v_MH, activation: str = "gelu", *,
                     upcast: bool = False) -> Tensor:
    """The torch path: the u rows gathered (N, k, h) and contracted with x, the v side an
    embedding bag (no gathered copy). upcast: compute in float32 (float64 stays float64).
    Returns y (N, h) in the dtype the embedding bag computes in (v's, or the upcast one)."""
    ids = ids_NK.long()
    if upcast:
        dt = upcast_dtype(x_NH.dtype, True)
        x_NH, gates_NK, u_MH, v_MH = (t.to(dt) for t in (x_NH, gates_NK, u_MH, v_MH))
    hidden_NK = ACTIVATIONS[activation](torch.einsum("nkh,nh->nk", F.embedding(ids, u_MH),
                                                     x_NH))
    weights_NK = (gates_NK * hidden_NK).to(v_MH.dtype)
    return F.embedding_bag(ids, v_MH, per_sample_weights=weights_NK, mode="sum")


def _kernels():
    from ..kernels import peer_experts
    return peer_experts


def _fwd(x: Tensor, gates: Tensor, ids: Tensor, u: Tensor, v: Tensor,
         activation: str) -> Tensor:
    return _kernels().forward(x, gates, ids, u, v, activation)


fwd_op = torch.library.custom_op("moremoe::peer_experts", _fwd, mutates_args=())


@fwd_op.register_fake
def _(x, gates, ids, u, v, activation):
    return x.new_empty(x.shape)


def _bwd(dy: Tensor, x: Tensor, gates: Tensor, ids: Tensor, u: Tensor, v: Tensor,
         activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dgates, du, dv = _kernels().backward(dy, x, gates, ids, u, v, activation)
    return dx, dgates.to(gates.dtype), du, dv


bwd_op = torch.library.custom_op("moremoe::peer_experts_bwd", _bwd, mutates_args=())


@bwd_op.register_fake
def _(dy, x, gates, ids, u, v, activation):
    return (x.new_empty(x.shape), gates.new_empty(gates.shape), u.new_empty(u.shape),
            v.new_empty(v.shape))


def _setup(ctx, inputs, output):
    x, gates, ids, u, v, activation = inputs
    ctx.save_for_backward(x, gates, ids, u, v)
    ctx.activation = activation


def _backward(ctx, dy, bwd=bwd_op):
    if dy is None:                  # eager, y unused (ops/eager.py passes None, not zeros)
        dy = torch.zeros_like(ctx.saved_tensors[0])
    dx, dgates, du, dv = bwd(dy, *ctx.saved_tensors, ctx.activation)
    return dx, dgates, None, du, dv, None


def _backward_direct(ctx, dy):
    return _backward(ctx, dy, bwd=_bwd)


fwd_op.register_autograd(_backward, setup_context=_setup)


def peer_impl(impl: str, x: Tensor) -> str:
    """"triton" or "reference" for this call: resolve_impl's choice, and the torch path for
    "auto" where h is wider than the kernels hold (impl="triton" there raises)."""
    chosen = resolve_impl(impl, x)
    if chosen == "triton" and x.shape[-1] > PEER_MAX_HIDDEN:
        if impl == "triton":
            raise ValueError(f"impl='triton': the PEER kernels hold h <= {PEER_MAX_HIDDEN}, "
                             f"got h={x.shape[-1]}; use impl='auto' or 'reference'")
        return "reference"
    return chosen


def peer_experts(x_NH, gates_NK, ids_NK, u_MH, v_MH, *, activation: str = "gelu",
                 impl: str = "auto", check_ids: bool = True) -> Tensor:
    """y (N, h): in x's dtype on the fused path (the autocast dtype under autocast), in the
    embedding bag's dtype on the torch path. ids must be int32 / int64 expert ids in [0, M);
    check_ids (default) checks their range (a host sync), which retrieval's ids skip."""
    check_expert_ids(ids_NK, u_MH.shape[0], values=check_ids)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}")
    if peer_impl(impl, x_NH) == "reference":
        return peer_experts_ref(x_NH, gates_NK, ids_NK, u_MH, v_MH, activation)
    dt = kernel_dtype(x_NH)
    x = x_NH.to(dt)
    # fp32 weights are read as they are (rounded as loaded or cast once, in the launcher),
    # so that their gradients come out in fp32
    u, v = (w if w.dtype == torch.float32 else w.to(dt) for w in (u_MH, v_MH))
    gates = gates_NK.float()
    args = (x, gates, ids_NK, u, v, activation)
    if needs_grad(x_NH, gates_NK, u_MH, v_MH):
        return call_autograd(fwd_op, _fwd, _setup, _backward_direct, *args)
    return call(fwd_op, _fwd, *args)
