"""SwiGLU experts, router-agnostic: forward(x, gates, topk_idx) -> y.

M experts of width s, stored as stacked tensors: w_gate, w_up (M, s, h) and w_down (M, h, s).
Expert e computes f_e(x) = W_down,e (silu(W_gate,e x) ⊙ W_up,e x); the layer returns
y_n = Σ_j gates[n, j] · f_{topk_idx[n, j]}(x_n). impl: "auto" (the grouped Triton kernels
on CUDA, else the reference), "triton" or "reference".

Training with the kernels, ``accumulate_grads_in_place()`` makes the fused backward add the
weight gradients into the parameters' fp32 .grad itself, across gradient-accumulation
micro-steps, instead of handing autograd a new tensor that AccumulateGrad adds (one read
and one write of the gradient a micro-step instead of a write, two reads and a write, and
no zeroing pass): the caller calls ``restart_grads()`` where it would zero the gradients.
docs/design.md ("The step's parameter-proportional work") says where that holds.
"""
from __future__ import annotations

import torch
from torch import nn

from ..checks import check_int, check_number, check_same_device, check_tensor
from ..ops.dispatch import IMPLS, resolve_impl
from ..ops.swiglu_experts import GradInto, swiglu_experts


class SwiGLUExperts(nn.Module):
    def __init__(self, hidden: int, width: int, experts: int, *, init_std: float = 0.02,
                 out_init_std: float | None = None, impl: str = "auto"):
        super().__init__()
        if not isinstance(impl, str) or impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        self.hidden = check_int("hidden", hidden)
        self.width = check_int("width", width)
        self.experts = check_int("experts", experts)
        self.init_std = check_number("init_std", init_std)
        self.out_init_std = (self.init_std if out_init_std is None else
                             check_number("out_init_std", out_init_std))
        self.w_gate = nn.Parameter(torch.empty(experts, width, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, width, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, width))
        self.in_place_grads = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate, std=self.init_std)
        nn.init.normal_(self.w_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.out_init_std)

    def weights(self) -> tuple:
        return self.w_gate, self.w_up, self.w_down

    def accumulate_grads_in_place(self) -> None:
        """From now on each backward through the kernels adds the weight gradients into
        fp32 buffers (non-persistent module buffers: static addresses for CUDA graphs, moved
        with the module) that restart_grads() makes the parameters' .grad; the weights must
        be fp32 and every training forward take the kernels (forward raises otherwise)."""
        if any(w.dtype != torch.float32 for w in self.weights()):
            raise ValueError(f"accumulating the expert gradients in place needs fp32 weights, "
                             f"got {self.w_gate.dtype}")
        for name, w in zip(("g_gate", "g_up", "g_down"), self.weights()):
            self.register_buffer(name, torch.zeros_like(w), persistent=False)
        self.register_buffer("grad_keep", torch.zeros(1, dtype=torch.int32,
                                                      device=self.w_gate.device),
                             persistent=False)
        for t in (self.g_gate, self.g_up, self.g_down, self.grad_keep):
            # CUDA graphs read and write them where they are (no static copy to refresh)
            torch._dynamo.mark_static_address(t)
        self.in_place_grads = True
        self.restart_grads()

    def restart_grads(self) -> None:
        """The next backward stores its weight gradients over the buffers (no zeroing), the
        ones after it add; the parameters' .grad are the buffers again (a DDP reducer with
        gradient_as_bucket_view rebinds them to its bucket after each synced backward)."""
        for w, g in zip(self.weights(), (self.g_gate, self.g_up, self.g_down)):
            w.grad = g
        self.grad_keep.zero_()

    def grad_into(self, x_NH: torch.Tensor) -> GradInto | None:
        """Where a training forward's weight gradients go (None: to autograd)."""
        if not (self.in_place_grads and torch.is_grad_enabled() and self.w_gate.requires_grad):
            return None
        if resolve_impl(self.impl, x_NH) == "reference":
            raise RuntimeError("SwiGLUExperts accumulates its gradients in place, which "
                               "needs the fused kernels; this forward takes the reference "
                               "(a CPU tensor, or impl='reference')")
        return GradInto(self.g_gate, self.g_up, self.g_down, self.grad_keep)

    def _check(self, x_NH, gates_NK, topk_idx_NK) -> None:
        check_tensor("x", x_NH, ndim=2, floating=True, last=self.hidden, last_name="hidden")
        check_tensor("topk_idx", topk_idx_NK, ndim=2, integer=True)
        check_tensor("gates", gates_NK, floating=True, shape=topk_idx_NK.shape)
        if topk_idx_NK.shape[0] != x_NH.shape[0]:
            raise ValueError(f"topk_idx has {topk_idx_NK.shape[0]} rows but x has "
                             f"{x_NH.shape[0]} tokens")
        check_same_device(x=x_NH, gates=gates_NK, topk_idx=topk_idx_NK, w_gate=self.w_gate)

    def forward(self, x_NH: torch.Tensor, gates_NK: torch.Tensor,
                topk_idx_NK: torch.Tensor, *, check_ids: bool = True) -> torch.Tensor:
        """check_ids: check that topk_idx holds ids in [0, M) (a host sync on the GPU); a
        MoELayer passes False, its router's ids are in range by construction."""
        self._check(x_NH, gates_NK, topk_idx_NK)
        y_NH = swiglu_experts(x_NH, gates_NK, topk_idx_NK, self.w_gate, self.w_up,
                              self.w_down, impl=self.impl, check_ids=check_ids,
                              grad_into=self.grad_into(x_NH))
        return y_NH.to(x_NH.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, width={self.width}, experts={self.experts}"
