"""The optimiser and schedule of every trainer (paper Appendix C): AdamW with decoupled weight
decay on every matrix (embeddings, attention, experts, routers) and none on the RMSNorm
scales, the router weights (W, or R1 and R2; PEER's query networks and sub-keys) in a group
of their own (at router_lr, default lr), and a cosine learning rate after a linear warmup."""
from __future__ import annotations

import math

import torch

from ..nn.peer import PEERLayer
from ..nn.router import LinearRouter, LowRankRouter

ROUTERS = (LinearRouter, LowRankRouter)


def param_groups(model: torch.nn.Module, *, lr: float, weight_decay: float,
                 router_lr: float | None = None) -> list[dict]:
    """decay (matrices), no_decay (norm scales), router (router matrices, at router_lr)."""
    router = {id(p) for m in model.modules() if isinstance(m, ROUTERS) for p in m.parameters()}
    router |= {id(p) for m in model.modules() if isinstance(m, PEERLayer)
               for p in (m.query.weight, m.keys)}
    groups = {"decay": [], "no_decay": [], "router": []}
    for p in (p for p in model.parameters() if p.requires_grad):
        key = "router" if id(p) in router else ("decay" if p.dim() >= 2 else "no_decay")
        groups[key].append(p)
    lrs = {"decay": lr, "no_decay": lr, "router": router_lr if router_lr is not None else lr}
    wds = {"decay": weight_decay, "no_decay": 0.0, "router": weight_decay}
    return [{"name": k, "params": v, "lr": lrs[k], "weight_decay": wds[k]}
            for k, v in groups.items() if v]


def make_optimizer(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                   weight_decay: float = 0.01, router_lr: float | None = None,
                   fused: bool = False) -> torch.optim.AdamW:
    """AdamW over param_groups (fused: the one-kernel CUDA implementation)."""
    groups = param_groups(model, lr=lr, weight_decay=weight_decay, router_lr=router_lr)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                             **({"fused": True} if fused else {}))


def cosine_with_warmup(total: int, warmup_frac: float, min_frac: float):
    """LR factor for the (i+1)-th step: linear warmup, then cosine down to min_frac."""
    warm = max(1, round(warmup_frac * total)) if warmup_frac > 0 else 0

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        progress = min(1.0, (i - warm) / max(1, total - warm))
        return min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
