"""Routers: the standard linear router (W, M×h) and the MoRE low-rank router (R1 M×r, R2 r×h).

Both map x (N, h) to the k largest logits per token (fp32, largest first), their expert
indices (int32) and the gates = softmax over those k logits. In training mode they also
return what the Switch balancing loss needs: psum (M,), the column sums over tokens of the
softmax over all M experts, and counts (M,), the number of (token, slot) pairs per expert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_int, check_number, check_same_device, check_tensor, check_top_k
from ..ops.balance import expert_counts
from ..ops.dispatch import IMPLS
from ..ops.router_linear import router_linear
from ..ops.router_lowrank import router_lowrank

ROUTER_INITS = ("variance_matched", "default")


@dataclass
class RouterOutput:
    topk_val: torch.Tensor          # (N, k) float32, sorted descending
    topk_idx: torch.Tensor          # (N, k) int32
    gates: torch.Tensor             # (N, k) float32, softmax over the k logits
    psum: torch.Tensor | None       # (M,) float32, training only
    counts: torch.Tensor | None     # (M,) int64, training only


def _finish(routed, experts: int, training: bool) -> RouterOutput:
    topk_val_NK, topk_idx_NK, gates_NK, psum_M = routed
    counts_M = expert_counts(topk_idx_NK, experts) if training else None
    return RouterOutput(topk_val_NK, topk_idx_NK, gates_NK, psum_M, counts_M)


class _Router(nn.Module):
    """impl: "auto" (fused Triton kernels on CUDA, the plain-torch reference elsewhere),
    "triton" or "reference" to force either."""

    def __init__(self, hidden: int, experts: int, top_k: int, impl: str = "auto"):
        super().__init__()
        self.hidden = check_int("hidden", hidden)
        self.experts = check_int("experts", experts)
        self.top_k = check_top_k(top_k, experts)
        if not isinstance(impl, str) or impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl

    def _check_input(self, x_NH: torch.Tensor) -> None:
        check_tensor("x", x_NH, ndim=2, floating=True, last=self.hidden, last_name="hidden")
        check_same_device(x=x_NH, **{name: p for name, p in self.named_parameters()})


class LinearRouter(_Router):
    """Standard router: logits = x Wᵀ with W (M, h), entries N(0, init_std²) (Switch: 0.02)."""

    def __init__(self, hidden: int, experts: int, top_k: int, *, init_std: float = 0.02,
                 impl: str = "auto"):
        super().__init__(hidden, experts, top_k, impl)
        self.init_std = check_number("init_std", init_std)
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, x_NH: torch.Tensor) -> RouterOutput:
        self._check_input(x_NH)
        routed = router_linear(x_NH, self.weight, self.top_k, with_psum=self.training,
                               impl=self.impl)
        return _finish(routed, self.experts, self.training)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}, impl={self.impl}"


def factor_router(W_MH: torch.Tensor, rank: int, method: str = "svd", seed: int = 0, *,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(R1 (M, r), R2 (r, h)) with R1 R2 ≈ W, computed in float64 and returned in dtype: the
    truncated SVD with the singular values split evenly (√S to each side: the best rank-r
    approximation in the Frobenius norm, factors of equal scale), or ("jl") the
    Johnson–Lindenstrauss projection of the paper's upper bound (R2 Gaussian / √r,
    R1 = W R2ᵀ)."""
    check_tensor("W", W_MH, ndim=2, floating=True)
    check_int("rank", rank)
    if not 1 <= rank <= min(W_MH.shape):
        raise ValueError(f"rank must be in [1, min(M, h) = {min(W_MH.shape)}] for a router of "
                         f"shape {tuple(W_MH.shape)}, got {rank}")
    W = W_MH.detach().double().cpu()
    if method == "svd":
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        root = S[:rank].sqrt()
        return (U[:, :rank] * root).to(dtype), (root[:, None] * Vh[:rank]).to(dtype)
    if method == "jl":
        g = torch.Generator().manual_seed(seed)
        R2 = torch.randn(rank, W.shape[1], generator=g, dtype=torch.float64) / math.sqrt(rank)
        return (W @ R2.T).to(dtype), R2.to(dtype)
    raise ValueError(f"method must be svd or jl, got {method!r}")


def topk_agreement(idx_NK: torch.Tensor, ref_NK: torch.Tensor) -> tuple[float, float]:
    """(share of rows whose top-k set equals the reference's, mean overlap |S ∩ S_ref| / k)
    of two (N, k) index tensors, in any order within a row."""
    got, ref = idx_NK.long().sort(dim=1).values, ref_NK.long().sort(dim=1).values
    # membership by binary search in the sorted reference rows: (N, k) memory, where an
    # all-pairs comparison would take N k² (250 GB at k = 50,000 and 100 tokens)
    at = torch.searchsorted(ref, got).clamp_(max=ref.shape[1] - 1)
    overlap = (ref.gather(1, at) == got).double().mean(dim=1)
    return float((got == ref).all(dim=1).double().mean()), float(overlap.mean())


class LowRankRouter(_Router):
    """MoRE router: logits = (x R2ᵀ) R1ᵀ with R1 (M, r) and R2 (r, h).

    init="variance_matched" (default, Appendix D): σ1 = σ2 = sqrt(σ) / r^(1/4), so the logits
    have the variance σ²‖x‖² of a standard router with N(0, σ²) entries.
    init="default": every entry N(0, σ²), as a standard router's.
    """

    def __init__(self, hidden: int, experts: int, top_k: int, rank: int, *,
                 init: str = "variance_matched", init_std: float = 0.02, impl: str = "auto"):
        super().__init__(hidden, experts, top_k, impl)
        self.rank = check_int("rank", rank)
        if not isinstance(init, str) or init not in ROUTER_INITS:
            raise ValueError(f"init must be one of {ROUTER_INITS}, got {init!r}")
        self.init, self.init_std = init, check_number("init_std", init_std)
        self.R1 = nn.Parameter(torch.empty(experts, rank))
        self.R2 = nn.Parameter(torch.empty(rank, hidden))
        self.reset_parameters()

    @property
    def factor_std(self) -> float:
        if self.init == "default":
            return self.init_std
        return math.sqrt(self.init_std) / self.rank ** 0.25

    def reset_parameters(self) -> None:
        nn.init.normal_(self.R1, mean=0.0, std=self.factor_std)
        nn.init.normal_(self.R2, mean=0.0, std=self.factor_std)

    def forward(self, x_NH: torch.Tensor) -> RouterOutput:
        self._check_input(x_NH)
        routed = router_lowrank(x_NH, self.R1, self.R2, self.top_k, with_psum=self.training,
                                impl=self.impl)
        return _finish(routed, self.experts, self.training)

    @classmethod
    def from_weight(cls, W_MH: torch.Tensor, top_k: int, rank: int, *, method: str = "svd",
                    impl: str = "auto") -> "LowRankRouter":
        """The MoRE router nearest a trained standard router's W (M, h) at rank r
        (factor_router); e.g. LowRankRouter.from_weight(linear_router.weight, k, 64)."""
        check_tensor("W", W_MH, ndim=2, floating=True)
        M, h = W_MH.shape
        router = cls(h, M, top_k, rank, impl=impl)
        R1, R2 = factor_router(W_MH, rank, method)
        with torch.no_grad():
            router.R1.copy_(R1)
            router.R2.copy_(R2)
        return router

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}, "
                f"rank={self.rank}, init={self.init}, impl={self.impl}")
