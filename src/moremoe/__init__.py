"""moremoe: MoRE, Mixture of Rank-reduced-routed Experts.

A low-rank router R1 (M×r) · R2 (r×h) in place of the M×h router matrix, so routing costs
O((M+h) r) instead of O(M h). See the README for the two commands that start everything.
"""
__version__ = "0.1.0"

from .nn import LinearRouter, LowRankRouter, MoEConfig, MoELayer, SwiGLUExperts  # noqa: E402

__all__ = ["LinearRouter", "LowRankRouter", "MoEConfig", "MoELayer", "SwiGLUExperts",
           "__version__"]
