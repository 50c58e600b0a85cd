"""FLOP and parameter accounting for MoE / MoRE layers, and the matched-active-FLOP planner.

Pure Python: no torch, so the CLI's ``flops`` and ``plan`` commands run anywhere.

Letters (the paper's): M experts, k active experts, h hidden, s expert width, r router rank,
L layers, V vocabulary. FLOPs are per token and per layer, one multiply-add = 2 FLOPs.

Per-token active FLOPs of one layer (paper, eq. 1 and Appendix C.2):

    standard router   tau = C_e k h s + C_r M h
    low-rank router   tau = C_e k h s + C_r (M + h) r

with (C_e, C_r) = (6, 6) at inference and (18, 14) in training. The planner follows the
Proposition of Appendix I: the MLP parameters 3 M h s are maximised at a fixed tau by giving
half of the (variable) budget to the router and half to the experts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

INFERENCE = (6, 6)
TRAINING = (18, 14)


def _positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_layer(M, k, h, s, r) -> None:
    for name, v in (("experts M", M), ("top_k k", k), ("hidden h", h), ("width s", s)):
        _positive(name, v)
    _positive("rank r", r, allow_none=True)
    if k > M:
        raise ValueError(f"top_k k must be in [1, experts M={M}], got {k}")


def router_params(M: int, h: int, r: int | None = None) -> int:
    """Router parameters: M h for the standard router, (M + h) r for the low-rank one."""
    return M * h if r is None else (M + h) * r


def expert_params(M: int, h: int, s: int) -> int:
    """Parameters of M SwiGLU experts of width s: 3 M h s."""
    return 3 * M * h * s


def active_flops(M: int, k: int, h: int, s: int, r: int | None = None, *,
                 training: bool = False) -> int:
    """Per-token active FLOPs of one MoE (r=None) or MoRE layer."""
    _check_layer(M, k, h, s, r)
    ce, cr = TRAINING if training else INFERENCE
    return ce * k * h * s + cr * router_params(M, h, r)


def attention_params(h: int, heads: int, kv_heads: int | None = None,
                     head_dim: int | None = None) -> int:
    """Attention parameters 2 h (heads d) + 2 h kv_heads d (q, o and k, v; no biases)."""
    kv_heads = heads if kv_heads is None else kv_heads
    d = h // heads if head_dim is None else head_dim
    return 2 * h * heads * d + 2 * h * kv_heads * d


def total_params(*, vocab: int, hidden: int, layers: int, experts: int, width: int, heads: int,
                 kv_heads: int | None = None, rank: int | None = None,
                 head_dim: int | None = None) -> int:
    """Total parameters of the transformer (Appendix C, eq. for P_total).

    2 V h (untied embedding and LM head) + h (final RMSNorm) + L [router + 3 M h s
    + attention + 2 h (two RMSNorms)].
    """
    h = hidden
    per_layer = (router_params(experts, h, rank) + expert_params(experts, h, width)
                 + attention_params(h, heads, kv_heads, head_dim) + 2 * h)
    return 2 * vocab * h + h + layers * per_layer


def peer_params(M: int, h: int, heads: int, d_q: int) -> tuple[int, int]:
    """PEER (Appendix B): (expert parameters 2 M h, router parameters H h d_q + sqrt(M) d_q).

    M must be a perfect square (product keys).
    """
    root = math.isqrt(M)
    if root * root != M:
        raise ValueError(f"PEER needs a perfect-square number of experts M, got {M}")
    return 2 * M * h, heads * h * d_q + root * d_q


def peer_active_flops(M: int, h: int, heads: int, d_q: int, topk_per_head: int) -> int:
    """PEER per-token active FLOPs 12 k h + 6 H d_q (h + sqrt(M)), k = H kappa."""
    peer_params(M, h, heads, d_q)  # validates M
    k = heads * topk_per_head
    return 12 * k * h + 6 * heads * d_q * (h + math.isqrt(M))


def layer_name(experts: int, rank: int | None = None) -> str:
    """The paper's short name of a layer: "MoE-256" (standard router) or "MoRE-1792"."""
    return f"{'MoE' if rank is None else 'MoRE'}-{experts}"


def _int_in(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        expected = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {expected}, got {value}")


@dataclass(frozen=True)
class LayerShape:
    """The shape of one MoE(M, k, h, s) layer (rank None) or MoRE(M, k, h, s, r) layer: the
    one record the layers (nn.MoEConfig), the planner and the presets build on, checked here
    once: positive integers, k <= M, r <= h."""

    experts: int                      # M
    top_k: int                        # k
    hidden: int                       # h
    width: int                        # s
    rank: int | None = None           # r; None = the standard router

    def __post_init__(self):
        _int_in("experts", self.experts, 1)
        _int_in("top_k", self.top_k, 1, self.experts)
        _int_in("hidden", self.hidden, 1)
        _int_in("width", self.width, 1)
        if self.rank is not None:
            _int_in("rank", self.rank, 1, self.hidden)

    @property
    def name(self) -> str:
        return layer_name(self.experts, self.rank)

    @property
    def label(self) -> str:
        """The full shape, e.g. "MoRE(M=1792, k=4, h=512, s=56, r=64)"."""
        args = f"M={self.experts}, k={self.top_k}, h={self.hidden}, s={self.width}"
        return f"MoE({args})" if self.rank is None else f"MoRE({args}, r={self.rank})"

    def active_flops(self, *, training: bool = False) -> int:
        return active_flops(self.experts, self.top_k, self.hidden, self.width, self.rank,
                            training=training)


@dataclass(frozen=True)
class PlannedLayer(LayerShape):
    """A layer of a plan with its accounting at the planner's (C_e, C_r)."""

    flops: float = 0.0                # active FLOPs at the planner's (C_e, C_r)
    params_mlp: int = 0               # 3 M h s
    params_router: int = 0

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


@dataclass(frozen=True)
class MatchedPlan:
    """The MoE and MoRE layers that maximise MLP parameters at one active-FLOP budget."""

    budget: float              # tau
    ce: float
    cr: float
    moe: PlannedLayer          # optimal MoE (or the reference one when given)
    more: PlannedLayer         # MoRE matched to the same budget
    moe_optimum: tuple[float, float]   # (M*, s*) before rounding
    more_optimum: tuple[float, float]  # (M', s') before rounding

    @property
    def param_ratio(self) -> float:
        return self.more.params_mlp / self.moe.params_mlp

    @property
    def expert_ratio(self) -> float:
        return self.more.experts / self.moe.experts

    def to_dict(self) -> dict:
        return {"budget": self.budget, "ce": self.ce, "cr": self.cr,
                "moe": self.moe.to_dict(), "more": self.more.to_dict(),
                "moe_optimum": {"experts": self.moe_optimum[0], "width": self.moe_optimum[1]},
                "more_optimum": {"experts": self.more_optimum[0], "width": self.more_optimum[1]},
                "param_ratio": self.param_ratio, "expert_ratio": self.expert_ratio}


def _shape(M, s, k, h, r, ce, cr) -> PlannedLayer:
    return PlannedLayer(experts=M, width=s, top_k=k, hidden=h, rank=r,
                        flops=ce * k * h * s + cr * router_params(M, h, r),
                        params_mlp=expert_params(M, h, s), params_router=router_params(M, h, r))


def optimum(budget: float, hidden: int, top_k: int, rank: int | None = None, *,
            ce: float = 6, cr: float = 6) -> tuple[float, float]:
    """Real-valued optimum (M, s) of the Proposition in Appendix I.

    MoE: M* = tau / (2 C_r h), s* = tau / (2 C_e k h).
    MoRE: tau' = tau - C_r h r, M' = tau' / (2 C_r r), s' = tau' / (2 C_e k h).
    """
    h, k = hidden, top_k
    if rank is None:
        return budget / (2 * cr * h), budget / (2 * ce * k * h)
    variable = budget - cr * h * rank
    if variable <= 0:
        raise ValueError(f"budget tau={budget:g} does not cover the low-rank projection "
                         f"C_r h r = {cr * h * rank:g}; raise the budget or lower the rank")
    return variable / (2 * cr * rank), variable / (2 * ce * k * h)


def fit_experts(budget: float, hidden: int, top_k: int, width: int, rank: int | None = None, *,
                ce: float = 6, cr: float = 6) -> int:
    """Largest M whose layer (with width s fixed) stays within the budget tau."""
    rest = budget - ce * top_k * hidden * width
    M = rest / (cr * hidden) if rank is None else rest / (cr * rank) - hidden
    M = math.floor(M + 1e-9)
    if M < top_k:
        raise ValueError(f"width s={width} leaves room for only {max(M, 0)} experts at "
                         f"budget tau={budget:g}; need at least top_k={top_k}")
    return M


def fit_width(budget: float, hidden: int, top_k: int, experts: int, rank: int | None = None, *,
              ce: float = 6, cr: float = 6) -> float:
    """Width s that spends the rest of the budget once M experts are fixed (real-valued)."""
    rest = budget - cr * router_params(experts, hidden, rank)
    if rest <= 0:
        raise ValueError(f"{experts} experts alone exceed the budget tau={budget:g}")
    return rest / (ce * top_k * hidden)


def widest_width(budget: float, hidden: int, top_k: int, rank: int | None = None, *,
                 ce: float = 6, cr: float = 6) -> int:
    """Widest s whose layer with the fewest experts (M = k) stays within the budget tau (0
    when none does): a planned width above it leaves room for fewer than k experts."""
    rest = budget - cr * router_params(top_k, hidden, rank)
    return max(0, math.floor(rest / (ce * top_k * hidden) + 1e-9))


def round_to(x: float, multiple: int) -> int:
    """x rounded to the nearest multiple of `multiple`, at least one multiple: the planner's
    width rounding (round_width)."""
    return max(multiple, multiple * int(math.floor(x / multiple + 0.5)))


def _rounded(opt, budget, h, k, r, ce, cr, round_width, refit) -> PlannedLayer:
    M_opt, s_opt = opt
    s = round_to(s_opt, round_width)
    M = fit_experts(budget, h, k, s, r, ce=ce, cr=cr) if refit else max(k, round(M_opt))
    return _shape(M, s, k, h, r, ce, cr)


def plan_matched(*, hidden: int, top_k: int, rank: int, budget: float | None = None,
                 width: int | None = None, experts: int | None = None, ce: float = 6,
                 cr: float = 6, round_width: int = 1, refit: bool = True) -> MatchedPlan:
    """Plan a matched-active-FLOP MoE / MoRE pair.

    The budget tau is given directly, or set by a reference MoE of width ``width`` with
    ``experts`` experts (default: the optimal M* = C_e k s / C_r for that width). Widths are
    rounded to the nearest multiple of ``round_width``; with ``refit`` the expert count is
    then re-fitted to the largest M that stays within tau, otherwise the optimum's M is kept
    (the paper's phonebook convention, which spends slightly more than tau).
    A reference MoE given by (experts, width) is returned as is.
    """
    _positive("hidden", hidden)
    _positive("top_k", top_k)
    _positive("rank", rank)
    _positive("round_width", round_width)
    _positive("ce", ce)
    _positive("cr", cr)
    if (budget is None) == (width is None):
        raise ValueError("give exactly one of budget (tau) or width (a reference MoE's s)")
    if experts is not None and width is None:
        raise ValueError("experts sets a reference MoE and needs its width")
    h, k, r = hidden, top_k, rank
    reference = None
    if width is not None:
        _positive("width", width)
        M_ref = experts if experts is not None else max(k, round(ce * k * width / cr))
        _check_layer(M_ref, k, h, width, None)
        reference = _shape(M_ref, width, k, h, None, ce, cr)
        budget = reference.flops
    _positive("budget", budget)
    moe_opt = optimum(budget, h, k, None, ce=ce, cr=cr)
    more_opt = optimum(budget, h, k, r, ce=ce, cr=cr)
    moe = reference or _rounded(moe_opt, budget, h, k, None, ce, cr, round_width, refit)
    more = _rounded(more_opt, budget, h, k, r, ce, cr, round_width, refit)
    return MatchedPlan(budget=budget, ce=ce, cr=cr, moe=moe, more=more,
                       moe_optimum=moe_opt, more_optimum=more_opt)


def training_flops_per_token(*, vocab: int, hidden: int, layers: int, experts: int, top_k: int,
                             width: int, heads: int, seq_len: int, rank: int | None = None,
                             kv_heads: int | None = None, head_dim: int | None = None) -> int:
    """Per-token FLOPs of one training step (forward and backward) of the whole model.

    L [18 k h s + 14 router (the MoE layer, Appendix C.2) + 6 attention projections
    + 12 H d T (attention scores and values, causal mask not discounted, as PaLM's MFU)]
    + 6 h V (LM head). Embedding lookups and norms are not counted. Used for MFU.
    """
    _positive("seq_len", seq_len)
    d = hidden // heads if head_dim is None else head_dim
    per_layer = (active_flops(experts, top_k, hidden, width, rank, training=True)
                 + 6 * attention_params(hidden, heads, kv_heads, d)
                 + 12 * heads * d * seq_len)
    return layers * per_layer + 6 * hidden * vocab


def rank_sweep(budget: float, hidden: int, top_k: int, width: int, ranks: list[int], *,
               ce: float = 6, cr: float = 6) -> list[PlannedLayer]:
    """MoRE layers at a fixed expert width s and budget tau, one per rank r, each with the
    most experts that fit (the paper's rank ablation: h = 512, k = 4, s' = 56 at MoE-256's
    tau gives M = 8,704, 4,096, 1,792, 640, 64 for r = 16 ... 256)."""
    return [_shape(fit_experts(budget, hidden, top_k, width, r, ce=ce, cr=cr), width, top_k,
                   hidden, r, ce, cr) for r in ranks]


def peer_match(experts: int, top_k: int, hidden: int, width: int, rank: int, *,
               heads: int = 8, d_q: int = 32) -> dict:
    """The PEER layer the paper compares with a MoRE layer (Appendix B): M = the smallest
    perfect square >= 3/2 M' s' (the expert parameters 3 M' h s' of MoRE against PEER's
    2 M h), and the per-head top-kappa that matches active FLOPs, in two readings:
    "paper" matches PEER's inference-coefficient formula 12 k h + 6 H d_q (h + sqrt M) to
    MoRE's *training* FLOPs (C_e, C_r) = (18, 14), as the paper does (kappa = 56 for
    MoRE-1792); "inference" matches it to MoRE's inference FLOPs (6, 6), the consistent
    reading."""
    M = math.isqrt(3 * experts * width // 2 - 1) + 1
    M *= M
    router = 6 * heads * d_q * (hidden + math.isqrt(M))
    out = {"experts": M, "heads": heads, "d_q": d_q,
           "params_experts": 2 * M * hidden, "params_router": peer_params(M, hidden, heads, d_q)[1]}
    for reading, training in (("paper", True), ("inference", False)):
        tau = active_flops(experts, top_k, hidden, width, rank, training=training)
        kappa = max(1, round((tau - router) / (12 * heads * hidden)))
        out[reading] = {"more_flops": tau, "topk_per_head": kappa, "active": heads * kappa,
                        "peer_flops": peer_active_flops(M, hidden, heads, d_q, kappa)}
    return out
