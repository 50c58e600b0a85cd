"""The models of a phonebook experiment: the matched MoE / MoRE pair from the planner (the
paper's convention: s' rounded, M' kept), either alone, or PEER matched to the MoRE."""
from __future__ import annotations

import math

from .. import accounting
from ..nn.moe import MoEConfig
from ..nn.peer import PEERConfig
from .trainer import phonebook_model_config

def plan_models(*, arch: str, hidden: int, top_k: int, rank: int, width: int,
                round_width: int = 8, refit: bool = False, moe_experts: int | None = None,
                more_experts: int | None = None, more_width: int | None = None,
                router_init: str = "variance_matched", layers: int = 6,
                heads: int | None = None, peer_heads: int = 2, peer_dq: int = 8,
                peer_reading: str = "inference"):
    """(the matched plan, the model configs to train: PEER, the MoE, the MoRE as `arch`
    asks); experts and widths given replace the planner's."""
    plan = accounting.plan_matched(hidden=hidden, top_k=top_k, rank=rank, width=width,
                                   round_width=round_width, refit=refit)
    configs = []
    if arch == "peer":
        configs.append(peer_config(plan, top_k=top_k, heads=peer_heads, d_q=peer_dq,
                                   reading=peer_reading))
    if arch in ("moe", "both"):
        configs.append(MoEConfig.moe(moe_experts or plan.moe.experts, top_k, hidden, width))
    if arch in ("more", "both"):
        configs.append(MoEConfig.more(more_experts or plan.more.experts, top_k, hidden,
                                      more_width or plan.more.width, rank,
                                      router_init=router_init))
    return plan, [phonebook_model_config(c, layers=layers, heads=heads) for c in configs]


def peer_config(plan, *, top_k: int, heads: int, d_q: int, reading: str) -> PEERConfig:
    """PEER matched to the plan's MoRE layer (expert parameters, active FLOPs in the chosen
    reading; accounting.peer_match), with the heads and query size given."""
    more = plan.more
    match = accounting.peer_match(more.experts, top_k, more.hidden, more.width, more.rank,
                                  heads=heads, d_q=d_q)
    kappa = min(math.isqrt(match["experts"]), match[reading]["topk_per_head"])
    return PEERConfig(experts=match["experts"], hidden=more.hidden, heads=heads, d_q=d_q,
                      kappa=kappa)
