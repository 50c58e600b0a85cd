"""MoE / MoRE layer: a router (standard or low-rank) composed with SwiGLU experts.

MoEConfig names the paper's MoE(M, k, h, s) (rank None) and MoRE(M, k, h, s, r).
The Switch balancing loss is M · Σ_i f_i p_i with f = counts / (N k) (no gradient) and
p = psum / N; the layer returns it both raw and scaled by ``balance_coef``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import nn

from .. import accounting
from ..checks import check_number, check_tensor
from ..ops.balance import expert_counts, switch_loss
from ..ops.dispatch import IMPLS
from .experts import SwiGLUExperts
from .router import ROUTER_INITS, LinearRouter, LowRankRouter, RouterOutput


@dataclass(frozen=True)
class MoEConfig(accounting.LayerShape):
    """A layer: its shape (M, k, h, s, r; accounting.LayerShape checks it) and how it is
    built and run."""

    router_init: str = "variance_matched"
    init_std: float = 0.02
    balance_coef: float = 0.001
    router_impl: str = "auto"         # "auto" | "triton" | "reference"
    experts_impl: str = "auto"        # "auto" (Triton on CUDA) | "triton" | "reference"

    def __post_init__(self):
        super().__post_init__()
        if self.router_init not in ROUTER_INITS:
            raise ValueError(f"router_init must be one of {ROUTER_INITS}, "
                             f"got {self.router_init!r}")
        for name in ("router_impl", "experts_impl"):
            if getattr(self, name) not in IMPLS:
                raise ValueError(f"{name} must be one of {IMPLS}, got {getattr(self, name)!r}")
        check_number("balance_coef", self.balance_coef, low_open=False)
        check_number("init_std", self.init_std)

    @classmethod
    def moe(cls, M: int, k: int, h: int, s: int, **kw) -> "MoEConfig":
        """The paper's MoE(M, k, h, s): standard router."""
        return cls(experts=M, top_k=k, hidden=h, width=s, rank=None, **kw)

    @classmethod
    def more(cls, M: int, k: int, h: int, s: int, r: int, **kw) -> "MoEConfig":
        """The paper's MoRE(M, k, h, s, r): low-rank router of rank r."""
        return cls(experts=M, top_k=k, hidden=h, width=s, rank=r, **kw)

    @property
    def is_lowrank(self) -> bool:
        return self.rank is not None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MoEOutput:
    y: torch.Tensor                    # (..., h), x's dtype
    aux_loss: torch.Tensor | None      # balance_coef · switch_loss (training)
    switch_loss: torch.Tensor | None   # unscaled Switch loss (training)
    counts: torch.Tensor | None        # (M,) int64 (training, or when asked)
    router: RouterOutput

    def for_the_model(self) -> MoEOutput:
        """What a model reads of the layer past its residual add: aux_loss (in the loss) with
        its gradient; y, the Switch loss (logged) and the router's tensors detached. A
        compiled block returns them, and AOTAutograd gives every returned tensor that
        requires grad a tangent, zeros where no gradient arrives: five fills a layer (one
        the size of the activations) and the backward's work through them."""
        r = self.router
        if r is not None:
            r = replace(r, **{f.name: getattr(r, f.name).detach() for f in fields(r)
                              if torch.is_tensor(getattr(r, f.name))})
        switch = self.switch_loss
        return replace(self, y=self.y.detach(), router=r,
                       switch_loss=None if switch is None else switch.detach())


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, *, experts: SwiGLUExperts | None = None):
        """experts: an existing SwiGLUExperts of the same (h, s, M) to share (e.g. to compare
        routers over the same experts) instead of building new ones."""
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}"
                            + (" (a PEERConfig builds a PEERLayer)"
                               if type(config).__name__ == "PEERConfig" else ""))
        self.config = c = config
        if c.is_lowrank:
            self.router = LowRankRouter(c.hidden, c.experts, c.top_k, c.rank,
                                        init=c.router_init, init_std=c.init_std,
                                        impl=c.router_impl)
        else:
            self.router = LinearRouter(c.hidden, c.experts, c.top_k, init_std=c.init_std,
                                       impl=c.router_impl)
        if experts is not None and not isinstance(experts, SwiGLUExperts):
            raise TypeError(f"experts must be a SwiGLUExperts (or None to build new ones), got "
                            f"{type(experts).__name__}")
        if experts is None:
            experts = SwiGLUExperts(c.hidden, c.width, c.experts, init_std=c.init_std,
                                    impl=c.experts_impl)
        elif (experts.hidden, experts.width, experts.experts) != (c.hidden, c.width, c.experts):
            raise ValueError(f"experts has (h, s, M) = ({experts.hidden}, {experts.width}, "
                             f"{experts.experts}), expected ({c.hidden}, {c.width}, {c.experts})")
        self.experts = experts

    def forward(self, x: torch.Tensor, *, return_counts: bool = False) -> MoEOutput:
        """x (..., h) -> MoEOutput; y has x's shape and dtype."""
        c = self.config
        check_tensor("x", x, floating=True, last=c.hidden, last_name="hidden")
        x_NH = x.reshape(-1, c.hidden)
        routed = self.router(x_NH)
        y_NH = self.experts(x_NH, routed.gates, routed.topk_idx, check_ids=False)
        counts = routed.counts
        if counts is None and return_counts:
            counts = expert_counts(routed.topk_idx, c.experts)
        switch = aux = None
        if routed.psum is not None:
            switch = switch_loss(routed.psum, routed.counts, x_NH.shape[0], c.top_k)
            aux = c.balance_coef * switch
        return MoEOutput(y_NH.reshape(x.shape), aux, switch, counts, routed)

    def extra_repr(self) -> str:
        return self.config.label
