"""Modules: routers, experts, the MoE / MoRE layer, and PEER (the paper's baseline)."""
from .experts import SwiGLUExperts
from .moe import MoEConfig, MoELayer, MoEOutput
from .peer import PEERConfig, PEERLayer
from .router import LinearRouter, LowRankRouter, RouterOutput

__all__ = ["LinearRouter", "LowRankRouter", "RouterOutput", "SwiGLUExperts", "MoEConfig",
           "MoELayer", "MoEOutput", "PEERConfig", "PEERLayer"]
