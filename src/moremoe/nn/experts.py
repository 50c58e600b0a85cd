"""SwiGLU experts, router-agnostic: forward(x, gates, topk_idx) -> y.

M experts of width s, stored as stacked tensors: w_gate, w_up (M, s, h) and w_down (M, h, s).
Expert e computes f_e(x) = W_down,e (silu(W_gate,e x) ⊙ W_up,e x); the layer returns
y_n = Σ_j gates[n, j] · f_{topk_idx[n, j]}(x_n). impl: "auto" (the grouped Triton kernels
on CUDA, else the reference), "triton" or "reference".
"""
from __future__ import annotations

import torch
from torch import nn

from ..checks import check_int, check_number, check_same_device, check_tensor
from ..ops.dispatch import IMPLS
from ..ops.swiglu_experts import swiglu_experts


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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate, std=self.init_std)
        nn.init.normal_(self.w_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.out_init_std)

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
                              self.w_down, impl=self.impl, check_ids=check_ids)
        return y_NH.to(x_NH.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, width={self.width}, experts={self.experts}"
