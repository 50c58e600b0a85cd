"""``moremoe bench peer``: the paper's PEER comparison (Appendix B, "Single-layer wall-clock
time at matched active FLOPs"): one layer's forward and forward + backward, PEER against MoRE
and MoE at matched active FLOPs, over the tokens of a step (4,096 ... 262,144).

Layers (h = 512): MoRE-1792 (s' = 56, k = 4, r = 64), its matched MoE-256 (s = 64, k = 4),
and PEER-388² (H = 8, d_q = 32, M = 150,544 >= 3/2 M' s') with κ from accounting.peer_match
in both readings: "paper" (κ = 56, k = 448: PEER's inference-coefficient FLOPs matched to
MoRE's training FLOPs, as the paper does) and "inference" (κ = 4, k = 32: both sides at
inference coefficients). PEER runs on the same weights as peer_fused (the retrieval and
expert kernels, kernels/peer_retrieval.py and peer_experts.py) and peer_torch (the two
score tables and torch.topk, the u rows gathered, (N, k, h), and an embedding bag: a plain
implementation); peer_retrieval times its fused product-key retrieval alone (query, the two
key tables, top κ per head, gates). MoRE and MoE run their fused routers and the
grouped expert kernels.

Passes (as the trainer runs them): forward with bf16 weights
and no autograd; forward + backward with fp32 weights under bf16 autocast, y and the
auxiliary loss backpropagated, the peak memory above the inputs beside the time. A point
that does not fit is an "oom" row. PEER's rows carry a floor: the rows the fused kernels
gather, 2 N k h bf16 values forward and 5 N k h forward + backward, at the measured copy rate.
Legend: N tokens, h hidden, M experts, k active experts a token, κ top per head.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from ..accounting import peer_match
from ..nn.moe import MoEConfig, MoELayer
from ..nn.peer import PEERConfig, PEERLayer
from ..ops.peer_retrieval import peer_retrieval
from ..runtime import environment
from .harness import bf16_on, ceilings, free, peak_bytes, time_ms

TOKENS = (4096, 16384, 65536, 262144)
QUICK_TOKENS = (16, 48)
READINGS = ("paper", "inference")
PHASES = ("forward", "forward+backward")
# PEER / MoRE wall-clock in the paper's table (one B200, bf16), by tokens a step
PAPER_RATIO = {"forward": {4096: 5.2, 16384: 18.0, 65536: 45.6, 262144: 71.4},
               "forward+backward": {4096: 5.5, 16384: 20.3, 65536: 51.4, 262144: 68.7}}


@dataclass(frozen=True)
class PeerSetup:
    """The matched layers: MoRE(M', k, h, s', r), MoE(M, k, h, s), PEER's H and d_q."""
    h: int = 512
    more_M: int = 1792
    more_s: int = 56
    k: int = 4
    r: int = 64
    moe_M: int = 256
    moe_s: int = 64
    heads: int = 8
    d_q: int = 32


QUICK = PeerSetup(h=32, more_M=16, more_s=8, k=2, r=8, moe_M=4, moe_s=16, heads=2, d_q=8)


def layer_configs(setup: PeerSetup) -> dict:
    """{name: config}: "more", "moe" and "peer_<reading>" (the fused experts)."""
    s = setup
    match = peer_match(s.more_M, s.k, s.h, s.more_s, s.r, heads=s.heads, d_q=s.d_q)
    out = {"more": MoEConfig.more(s.more_M, s.k, s.h, s.more_s, s.r, router_impl="triton",
                                  experts_impl="triton"),
           "moe": MoEConfig.moe(s.moe_M, s.k, s.h, s.moe_s, router_impl="triton",
                                experts_impl="triton")}
    for reading in READINGS:
        out[f"peer_{reading}"] = PEERConfig(
            experts=match["experts"], hidden=s.h, heads=s.heads, d_q=s.d_q,
            kappa=match[reading]["topk_per_head"], impl="triton")
    return out


def _build(cfg, phase: str, device):
    """bf16 weights for the forward, fp32 (master) weights for forward + backward."""
    with bf16_on(device) if phase == "forward" else torch.device(device):
        layer = PEERLayer(cfg) if isinstance(cfg, PEERConfig) else MoELayer(cfg)
    return layer.train(phase != "forward")


def _retrieval(layer: PEERLayer, x):
    c = layer.config
    q = layer.query(x).view(-1, c.heads, c.d_q)
    scores, ids = peer_retrieval(q, layer.keys.to(q.dtype), c.kappa, impl=c.impl)
    return torch.softmax(scores.float(), dim=-1), ids


def step_fn(layer, variant: str, x, phase: str, device):
    """The timed call of one variant: the layer's forward (no autograd), or forward +
    backward under bf16 autocast with the gradients set to None first."""
    cast = (torch.autocast(device.type, dtype=torch.bfloat16) if phase != "forward"
            else nullcontext())
    if phase == "forward":
        def run():
            with torch.no_grad():
                return _retrieval(layer, x) if variant == "peer_retrieval" else layer(x).y
        return run
    dy = torch.randn_like(x)

    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with cast:
            if variant == "peer_retrieval":
                gates, _ = _retrieval(layer, x)
                outs, grads = [gates], [torch.ones_like(gates)]
            else:
                out = layer(x)
                outs, grads = [out.y], [dy]
                if out.aux_loss is not None and out.aux_loss.requires_grad:
                    outs.append(out.aux_loss)
                    grads.append(torch.ones_like(out.aux_loss))
        torch.autograd.backward(outs, grads)
    return run


def _floor(cfg, N: int, phase: str, ceil: dict):
    """(bytes, ms) of the rows PEER's fused kernels gather (bf16), None for MoE / MoRE."""
    if not isinstance(cfg, PEERConfig):
        return None, None
    nbytes = (2 if phase == "forward" else 5) * N * cfg.top_k * cfg.hidden * 2
    rate = ceil.get("copy_bytes_per_s")
    return nbytes, (1e3 * nbytes / rate if rate else None)


def measure(layer, cfg, variant: str, N: int, phase: str, device, base: dict, ceil) -> dict:
    """One row: the median time (and, with a backward, the peak memory) of a variant."""
    training = phase != "forward"
    flops = N * cfg.active_flops(training=training)
    nbytes, floor = _floor(cfg, N, phase, ceil)
    if variant == "peer_retrieval":
        flops, nbytes, floor = None, None, None
    row = {**base, "variant": variant, "N": N, "phase": phase, "flops": flops,
           "bytes": nbytes, "floor_ms": floor}
    try:
        g = torch.Generator(device=device).manual_seed(N)
        x = torch.randn(N, cfg.hidden, device=device, generator=g).to(torch.bfloat16)
        fn = step_fn(layer, variant, x.requires_grad_(training), phase, device)
        row["ms"] = time_ms(fn, device=device, cpu_reps=1)     # CPU: a code-path check
        if training:
            row["peak_bytes"] = peak_bytes(fn, device=device)
        row["ratio_to_floor"] = row["ms"] / floor if floor else None
    except torch.OutOfMemoryError:
        row.update(ms=None, oom=True)
    layer.zero_grad(set_to_none=True)
    free(device)
    return row


def _variants(name: str) -> list[str]:
    if not name.startswith("peer"):
        return [name]
    return ["peer_fused", "peer_torch", "peer_retrieval"]


def _base(name: str, cfg, env: dict, ceil: dict) -> dict:
    peer = isinstance(cfg, PEERConfig)
    return {"bench": "peer", "layer": cfg.label if peer else cfg.name,
            "reading": name.removeprefix("peer_") if peer else None, "h": cfg.hidden,
            "M": cfg.experts, "k": cfg.top_k, "kappa": cfg.kappa if peer else None, **env,
            **{f"ceiling_{k}": v for k, v in ceil.items()}}


def run_peer(device, *, quick: bool = False, progress=None, tokens=None):
    """Rows of every layer x variant x tokens x pass; each layer is built once a pass (its
    weights are shared by the fused and the torch PEER rows). tokens: the N values (default
    TOKENS; QUICK_TOKENS with quick)."""
    env, ceil = environment(device), ceilings(device)
    configs = layer_configs(QUICK if quick else PeerSetup())
    tokens = tuple(tokens or (QUICK_TOKENS if quick else TOKENS))
    total = len(PHASES) * len(tokens) * sum(len(_variants(n)) for n in configs)
    i = 0
    for phase in PHASES:
        for name, cfg in configs.items():
            try:
                layer = _build(cfg, phase, device)
            except torch.OutOfMemoryError:
                layer = None
            base = _base(name, cfg, env, ceil)
            for N in tokens:
                for variant in _variants(name):
                    if layer is None:
                        row = {**base, "variant": variant, "N": N, "phase": phase, "ms": None,
                               "oom": True}
                    else:
                        if isinstance(cfg, PEERConfig):
                            impl = "reference" if variant == "peer_torch" else "triton"
                            layer.config = replace(cfg, impl=impl)
                        row = measure(layer, cfg, variant, N, phase, device, base, ceil)
                    i += 1
                    progress and progress(i, total, row)
                    yield row
            del layer
            free(device)


def _latest(rows) -> dict:
    """{(variant, reading, N, phase): ms} of the newest row of each point."""
    out = {}
    for r in rows:
        if r.get("bench") == "peer" and r.get("ms") is not None:
            out[(r["variant"], r.get("reading"), r["N"], r["phase"])] = r["ms"]
    return out


def _over(a, b):
    return a / b if a and b else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per reading, pass and N: PEER fused and torch over MoRE (None where one is missing or
    out of memory), MoE over MoRE, PEER's retrieval share of its fused time, the paper's
    PEER / MoRE."""
    pts = _latest(rows)
    order = {r: i for i, r in enumerate(READINGS)}
    keys = sorted({(rd, N, ph) for (v, rd, N, ph) in pts if rd is not None},
                  key=lambda t: (order.get(t[0], len(order)), t[2], t[1]))
    out = []
    for reading, N, phase in keys:
        more, moe = pts.get(("more", None, N, phase)), pts.get(("moe", None, N, phase))
        fused, plain, retr = (pts.get((v, reading, N, phase))
                              for v in ("peer_fused", "peer_torch", "peer_retrieval"))
        out.append({"reading": reading, "N": N, "phase": phase, "more_ms": more,
                    "fused_vs_more": _over(fused, more), "torch_vs_more": _over(plain, more),
                    "moe_vs_more": _over(moe, more), "retrieval_share": _over(retr, fused),
                    "paper": PAPER_RATIO.get(phase, {}).get(N) if reading == "paper" else None})
    return out


def _x(v) -> str:
    return f"{v:.1f}x" if v else "-"


def summary_text(rows: list[dict]) -> str:
    """Lines of PEER / MoRE ratios (the paper's beside the paper reading's)."""
    lines = []
    for r in ratios(rows):
        paper = f"; paper {r['paper']:.1f}x" if r["paper"] else ""
        share = f"{100 * r['retrieval_share']:.0f}%" if r["retrieval_share"] else "-"
        lines.append(f"PEER ({r['reading']}) {r['phase']} N={r['N']:,}: fused / MoRE "
                     f"{_x(r['fused_vs_more'])}, torch / MoRE {_x(r['torch_vs_more'])}, "
                     f"MoE / MoRE {_x(r['moe_vs_more'])}, retrieval {share} of fused{paper}")
    return "\n" + "\n".join(lines) if lines else ""
