"""moremoe: MoRE, Mixture of Rank-reduced-routed Experts.

A low-rank router R1 (M×r) · R2 (r×h) in place of the M×h router matrix, so routing costs
O((M+h) r) instead of O(M h). See the README for the two commands that start everything.
"""
from .nn import LinearRouter, LowRankRouter, MoEConfig, MoELayer, SwiGLUExperts
from .runtime import __version__

__all__ = ["LinearRouter", "LowRankRouter", "MoEConfig", "MoELayer", "SwiGLUExperts",
           "__version__"]
