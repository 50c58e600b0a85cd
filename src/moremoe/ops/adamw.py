"""AdamW's update of one parameter with the gradient clip folded in: the Triton kernel
(kernels/adamw.py) where it runs, else the plain-torch reference in slices.

``adamw_(w, g, m, v, ...)`` updates w and the moments m, v in place (torch's AdamW
arithmetic: decoupled weight decay, bias-corrected moments), reading g multiplied by coef
(a device scalar: the clip coefficient; None: 1) without writing g. The moments may be
bfloat16: read into fp32, updated, rounded back to nearest.
"""
from __future__ import annotations

import torch

from .dispatch import IMPLS

CHUNK = 1 << 25     # the reference's slice: its fp32 temporaries stay a few hundred MB


def adamw_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
           beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
           coef: torch.Tensor | None = None, impl: str = "auto", chunk: int = CHUNK) -> None:
    """One update; impl "auto" (the kernel for contiguous CUDA tensors, else the reference
    in slices of `chunk` elements), "triton" (on CPU: TRITON_INTERPRET=1) or "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    args = dict(decay=1 - lr * weight_decay, beta1=beta1, beta2=beta2, eps=eps,
                step_size=lr / (1 - beta1 ** step), bc2_sqrt=(1 - beta2 ** step) ** 0.5)
    if impl == "triton" or (impl == "auto" and _kernel_fits(w, g, m, v)):
        from ..kernels.adamw import adamw_ as kernel
        kernel(w, g, m, v, coef=coef, **args)
    else:
        adamw_ref_(w, g, m, v, coef=coef, chunk=chunk, **args)


def _kernel_fits(*ts: torch.Tensor) -> bool:
    from ..kernels import usable_on
    dev = ts[0].device
    return dev.type == "cuda" and usable_on(dev) and all(t.is_contiguous() for t in ts)


@torch.no_grad()
def adamw_ref_(w, g, m, v, *, decay, beta1, beta2, eps, step_size, bc2_sqrt, coef=None,
               chunk: int = CHUNK) -> None:
    """The reference: torch's AdamW arithmetic (lerp, addcmul, addcdiv) in slices of at
    most `chunk` elements."""
    flat = [x.view(-1) for x in (w, g, m, v)]
    for start in range(0, flat[0].numel(), chunk):
        ws, gs, ms, vs = (x[start:start + chunk] for x in flat)
        gs = gs.float() if coef is None else gs.float() * coef
        m32 = ms.float().lerp_(gs, 1 - beta1)
        v32 = vs.float().mul_(beta2).addcmul_(gs, gs, value=1 - beta2)
        ws.mul_(decay).addcdiv_(m32, (v32.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
        ms.copy_(m32)
        vs.copy_(v32)
