"""Which implementation an op runs: the fused Triton kernels or the plain-torch reference.

Every limit of the kernels (dtype, k, rank: moremoe.kernels.DTYPES, MAX_K, MAX_RANK) is
decided here, once: impl="auto" takes the kernels on CUDA for what they cover and the
reference for anything else; impl="triton" insists and names the limit it breaks.
"""
from __future__ import annotations

import torch

from .. import kernels

IMPLS = ("auto", "triton", "reference")


def kernel_limit(x: torch.Tensor, k: int = 1, rank: int | None = None) -> str | None:
    """Why the kernels cannot take this call (dtype, k, rank), or None when they can."""
    if x.dtype not in kernels.DTYPES:
        return f"x's dtype {x.dtype} (they take {', '.join(map(str, kernels.DTYPES))})"
    if k > kernels.MAX_K:
        return f"top_k={k} (they keep at most {kernels.MAX_K})"
    if rank is not None and rank > kernels.MAX_RANK:
        return f"rank r={rank} (they hold at most {kernels.MAX_RANK})"
    return None


def resolve_impl(impl: str, x: torch.Tensor, k: int = 1, *, rank: int | None = None) -> str:
    """"auto": Triton on CUDA for what the kernels cover, the reference otherwise (CPU, float64,
    k or r beyond the kernels, no Triton). "triton" insists (on CPU it needs
    TRITON_INTERPRET=1) and raises naming the limit a call breaks."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return impl
    limit = kernel_limit(x, k, rank)
    if impl == "triton":
        if not kernels.usable_on(x.device):
            raise ValueError(f"impl='triton' needs Triton and a CUDA tensor (or "
                             f"TRITON_INTERPRET=1 on CPU); x is on {x.device}, Triton "
                             f"{'is' if kernels.HAS_TRITON else 'is not'} installed: use "
                             f"impl='auto' or 'reference'")
        if limit is not None:
            raise ValueError(f"impl='triton': the kernels do not cover {limit}; use "
                             f"impl='auto' or 'reference'")
        return impl
    usable = kernels.usable_on(x.device) and x.device.type == "cuda"
    return "triton" if usable and limit is None else "reference"


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused kernels run in: autocast's when it is on for x's device."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype
