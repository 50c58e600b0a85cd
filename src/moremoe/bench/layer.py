"""``moremoe bench layer``, ``bench decode`` and ``bench experts``: whole MoE / MoRE layers.

layer   prefill forward over h x M (s = 64, k = 4, r = 64, N = 262,144, bf16) for MoE with the
        unfused standard router, MoE with the fused standard router and MoRE with the fused
        low-rank router, all three with the same grouped expert kernels; s in {128, 256, 512}
        at h = 512; forward + backward peak memory of MoRE unfused vs fused; the matched
        wall-clock point (largest M at which MoRE is no slower than MoE at M = 512, h = 512).
decode  one layer's step at B tokens (one per sequence), MoE vs MoRE over h x M, and the
        expert kernels with a schedule that walks the range of expert ids; steps are timed
        as CUDA-graph replays so launch latency does not swamp them.
experts the grouped expert kernels alone, forward and backward, achieved FLOP/s against the
        measured matmul rate and each row's floor.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..nn.moe import MoEConfig, MoELayer
from .harness import ceilings, environment, floor_ms, peak_bytes, time_ms

HS = (64, 128, 256, 512, 1024, 2048, 4096)
MS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
WIDE_S = (128, 256, 512)
MATCH_MS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BS = (4, 16, 64, 256)
VARIANTS = {"moe_unfused": (None, "reference"), "moe_fused": (None, "triton"),
            "more_fused": (64, "triton")}


@dataclass(frozen=True)
class LayerPoint:
    h: int
    M: int
    s: int = 64
    k: int = 4
    N: int = 262144


def make_layer(p: LayerPoint, variant: str, device, *, experts_impl="triton", train=False):
    rank, router_impl = VARIANTS[variant] if variant in VARIANTS else (64, "reference")
    cfg = MoEConfig(experts=p.M, top_k=p.k, hidden=p.h, width=p.s, rank=rank,
                    router_impl=router_impl, experts_impl=experts_impl)
    layer = MoELayer(cfg).to(device=device, dtype=torch.bfloat16)
    return layer.train(train)


def _x(p: LayerPoint, device, seed=0, grad=False):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(p.N, p.h, device=device, generator=g).to(torch.bfloat16)
    return x.requires_grad_(grad)


def layer_cost(p: LayerPoint, rank) -> tuple[float, float]:
    """(FLOPs, minimal bytes) of one layer's forward: router + experts (3 projections)."""
    router = 2 * p.N * ((p.M + p.h) * rank if rank else p.M * p.h)
    experts = 6 * p.N * p.k * p.h * p.s
    nbytes = 2 * (2 * p.N * p.h) + 2 * (3 * p.M * p.h * p.s) + 2 * (p.M * p.h if not rank
                                                                   else (p.M + p.h) * rank)
    return router + experts, nbytes


def _row(bench, p: LayerPoint, variant, env, ceil, **extra) -> dict:
    return {"bench": bench, "variant": variant, **p.__dict__, **env,
            **{f"ceiling_{k}": v for k, v in ceil.items()}, **extra}


def prefill(p: LayerPoint, variant: str, device, env, ceil, sweep: str) -> dict:
    try:
        layer = make_layer(p, variant, device)
        x = _x(p, device)
        with torch.no_grad():
            ms = time_ms(lambda: layer(x), device=device)
        flops, nbytes = layer_cost(p, VARIANTS[variant][0])
        fl = floor_ms(flops, nbytes, ceil)
        row = _row("layer", p, variant, env, ceil, sweep=sweep, phase="forward", ms=ms,
                   floor_ms=fl, flops=flops, bytes=nbytes)
        if fl:
            row["ratio_to_floor"] = ms / fl
    except torch.OutOfMemoryError:
        row = _row("layer", p, variant, env, ceil, sweep=sweep, phase="forward", ms=None,
                   oom=True)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def train_memory(p: LayerPoint, router_impl: str, device, env, ceil) -> dict:
    """Peak memory of forward + backward (with the balancing loss) of a MoRE layer."""
    variant = "more_fused" if router_impl == "triton" else "more_unfused"
    try:
        layer = make_layer(p, "more_fused", device, train=True)
        layer.router.impl = router_impl
        x = _x(p, device, grad=True)

        def step():
            out = layer(x)
            (out.y.float().square().mean() + out.aux_loss).backward()
        step()
        row = _row("layer", p, variant, env, ceil, sweep="memory", phase="forward+backward",
                   peak_bytes=peak_bytes(step, device=device))
    except torch.OutOfMemoryError:
        row = _row("layer", p, variant, env, ceil, sweep="memory", phase="forward+backward",
                   oom=True)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def run_layer(device, *, quick=False, progress=None):
    env, ceil = environment(device), ceilings(device)
    n = 256 if quick else 262144
    hs, ms = ((32,), (16,)) if quick else (HS, MS)
    plan = [("grid", LayerPoint(h, M, N=n), v) for h, M in itertools.product(hs, ms)
            for v in VARIANTS]
    plan += [("wide_s", LayerPoint(512 if not quick else 32, M, s=s, N=n), v)
             for s in ((32,) if quick else WIDE_S) for M in ms for v in VARIANTS]
    plan += [("match", LayerPoint(512 if not quick else 32, M, N=n), "more_fused")
             for M in ((64,) if quick else MATCH_MS)]
    mem = [LayerPoint(h, M, N=n) for h, M in itertools.product(hs, ms)]
    total = len(plan) + 2 * len(mem)
    for i, (sweep, p, variant) in enumerate(plan):
        row = prefill(p, variant, device, env, ceil, sweep)
        progress and progress(i + 1, total, row)
        yield row
    for j, p in enumerate(mem):
        for impl in ("reference", "triton"):
            row = train_memory(p, impl, device, env, ceil)
            progress and progress(len(plan) + 2 * j + 1 + (impl == "triton"), total, row)
            yield row


def _graph_or_plain(fn, device):
    """A CUDA graph of fn (replayed per call) where capture works, else fn itself."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_step(p: LayerPoint, variant: str, device, env, ceil, *, walk=False) -> dict:
    from ..kernels import moe_gemm
    layer = make_layer(p, variant, device)
    x = _x(p, device)
    ex = layer.experts

    def walking():
        routed = layer.router(x)
        return moe_gemm.forward(x, routed.gates, routed.topk_idx, ex.w_gate, ex.w_up,
                                ex.w_down, walk_experts=True)
    with torch.no_grad():
        fn = _graph_or_plain(walking if walk else (lambda: layer(x)), device)
        ms = time_ms(fn, device=device)
    name = variant + ("_walk" if walk else "")
    return _row("decode", p, name, env, ceil, B=p.N, phase="decode", ms=ms)


def run_decode(device, *, quick=False, progress=None):
    env, ceil = environment(device), ceilings(device)
    hs, ms, bs = ((32,), (16, 64), (4,)) if quick else (HS, MS, DECODE_BS)
    plan = [(LayerPoint(h, M, N=B), v, w) for B in bs for h in hs for M in ms
            for v, w in (("moe_fused", False), ("more_fused", False), ("more_fused", True))]
    plan += [(LayerPoint(512 if not quick else 32, 8 * M, N=B), "more_fused", False)
             for B in bs for M in ((16,) if quick else (256, 1024))]
    for i, (p, v, walk) in enumerate(plan):
        row = decode_step(p, v, device, env, ceil, walk=walk)
        progress and progress(i + 1, len(plan), row)
        yield row


def run_experts(device, *, quick=False, progress=None):
    """Expert kernels alone at h = 512, k = 4, N = 262,144, s in {64, 128, 512}."""
    from ..kernels import moe_gemm
    env, ceil = environment(device), ceilings(device)
    widths, n, h = ((16,), 256, 32) if quick else ((64, 128, 512), 262144, 512)
    for i, s in enumerate(widths):
        p = LayerPoint(h, 8192 if not quick else 16, s=s, N=n)
        layer = make_layer(p, "more_fused", device)
        x = _x(p, device)
        with torch.no_grad():
            routed = layer.router(x)
        ex = layer.experts
        args = (x, routed.gates, routed.topk_idx, ex.w_gate, ex.w_up, ex.w_down)
        fwd = 6 * p.N * p.k * p.h * s
        nbytes = 2 * (2 * p.N * p.h) + 2 * (3 * p.M * p.h * s)
        y, act, g, u = moe_gemm.forward(*args, save=True)
        dy = torch.randn_like(y)
        for phase, fn, flops, byts in (
                ("forward", lambda: moe_gemm.forward(*args), fwd, nbytes),
                ("backward", lambda: moe_gemm.backward(dy, *args, act, g, u), 2 * fwd,
                 2 * nbytes + 2 * 3 * p.M * p.h * s)):
            ms = time_ms(fn, device=device)
            fl = floor_ms(flops, byts, ceil)
            row = _row("experts", p, "experts", env, ceil, phase=phase, ms=ms, flops=flops,
                       bytes=byts, floor_ms=fl, tflops=flops / ms / 1e9,
                       ratio_to_floor=(ms / fl) if fl else None)
            progress and progress(2 * i + 1 + (phase == "backward"), 2 * len(widths), row)
            yield row


def matched_wallclock(rows: list[dict], h: int = 512) -> dict | None:
    """Largest M at which the MoRE layer is no slower than the MoE layer (unfused standard
    router) at M = 512, from the grid and match rows."""
    ref = [r for r in rows if r.get("variant") == "moe_unfused" and r["h"] == h
           and r["M"] == 512 and r.get("ms") and r.get("sweep") == "grid"]
    if not ref:
        return None
    budget = ref[0]["ms"]
    more = [r for r in rows if r.get("variant") == "more_fused" and r["h"] == h and r.get("ms")
            and r.get("s", 64) == 64 and r.get("sweep") in ("grid", "match")]
    fits = [r["M"] for r in more if r["ms"] <= budget]
    return {"h": h, "moe_M": 512, "moe_ms": budget,
            "more_M": max(fits) if fits else None,
            "ratio": (max(fits) / 512) if fits else None}
