"""Modules: routers, experts and the MoE / MoRE layer."""
from .experts import SwiGLUExperts
from .moe import MoEConfig, MoELayer, MoEOutput
from .router import LinearRouter, LowRankRouter, RouterOutput

__all__ = ["LinearRouter", "LowRankRouter", "RouterOutput", "SwiGLUExperts", "MoEConfig",
           "MoELayer", "MoEOutput"]
