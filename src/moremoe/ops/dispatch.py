"""Which implementation an op runs: the fused Triton kernels or the plain-torch reference."""
from __future__ import annotations

import torch

from .. import kernels

IMPLS = ("auto", "triton", "reference")


def resolve_impl(impl: str, x: torch.Tensor, k: int) -> str:
    """"auto": Triton on CUDA for the dtypes and k the kernels cover, the reference otherwise
    (CPU, float64, no Triton). "triton" insists (on CPU it needs TRITON_INTERPRET=1)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return impl
    ok = kernels.usable_on(x.device) and x.dtype in kernels.DTYPES and k <= kernels.MAX_K
    if impl == "triton":
        if not kernels.usable_on(x.device):
            raise RuntimeError(f"impl='triton' needs Triton and a CUDA tensor (or "
                               f"TRITON_INTERPRET=1 on CPU); x is on {x.device}, Triton "
                               f"{'is' if kernels.HAS_TRITON else 'is not'} installed")
        return impl
    return "triton" if ok and x.device.type == "cuda" else "reference"


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused kernels run in: autocast's when it is on for x's device."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype
