"""``moremoe bench router``: the fused routers against their unfused references.

One run measures the device's copy bandwidth and bf16 matmul rate, then times on the same
inputs: the fused low-rank (MoRE) inference kernel, the unfused low-rank reference (two
matmuls + torch.topk + softmax), the paper's Algorithm 1 (bench/paper_alg1.py, inference),
the fused and the unfused standard router, and the training forward + backward with the
Switch balancing loss of each, with its peak memory. Every row carries its floor: the
larger of FLOPs / measured matmul rate and minimal bytes / measured copy bandwidth (each
input read once, each output written once), for the operation (not the implementation), so
rows of one point compare directly; a fused row also carries its speedup over the unfused
router and (low-rank inference) over Algorithm 1, timed in the same run. The "tune" sweep
(not run by default) times the fused kernels' block configurations instead (bench/tune.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from ..ops.balance import expert_counts, switch_loss
from ..ops.router_linear import router_linear
from ..ops.router_lowrank import router_lowrank
from ..runtime import environment
from .harness import ceilings, floor_ms, peak_bytes, rotation, time_ms


@dataclass(frozen=True)
class Point:
    h: int = 512
    M: int = 8192
    r: int = 64
    k: int = 4
    B: int = 256
    T: int = 1024

    @property
    def N(self) -> int:
        return self.B * self.T


BASE = Point()
SWEEPS = {
    "M": [Point(h=h, M=M) for h in (512, 2048) for M in (512, 1024, 2048, 4096, 8192, 16384)],
    "r": [Point(r=r) for r in (16, 32, 64, 128, 256)],
    # k at M = 8,192, and k = 8 at the prototype's smaller M (issue 54's anchor shapes)
    "k": [Point(k=k) for k in (1, 2, 4, 8, 16)] + [Point(M=M, k=8) for M in (512, 2048)],
    "B": [Point(B=B) for B in (2, 8, 32, 128, 256)],
    # the paper's fusion-benefit figure: h = 2,048, M = 4,096, r = 16, k = 4 over B
    "paper": [Point(h=2048, M=4096, r=16, B=B) for B in (2, 8, 32, 128, 256)],
}
SWEEP_NAMES = (*SWEEPS, "tune")    # tune: block configurations, bench/tune.py (not default)
QUICK = Point(h=32, M=300, r=16, k=4, B=2, T=40)   # code-path check (CPU interpreter)
# baselines first, so that each fused row can carry its speedup over them
IMPLS = [("lowrank", "unfused"), ("lowrank", "alg1"), ("lowrank", "triton"),
         ("linear", "unfused"), ("linear", "triton")]


def op_cost(p: Point, router: str, training: bool) -> tuple[float, float]:
    """(FLOPs, minimal bytes) of the operation at bf16 inputs, fp32/int32 outputs."""
    N, h, M, r, k = p.N, p.h, p.M, p.r, p.k
    if router == "lowrank":
        flops = 2 * N * h * r + 2 * N * M * r
        weights = 2 * (M + h) * r
    else:
        flops = 2 * N * h * M
        weights = 2 * M * h
    nbytes = 2 * N * h + weights + 12 * N * k
    if training:   # backward: dℓ R1 and dℓᵀ z (or x), and dx, dR2 from dz: 2x the forward
        flops *= 3
        nbytes += 2 * N * h + weights + 4 * M + 8 * N * k
    return flops, nbytes


def _make_inputs(p: Point, router: str, device, *, grad: bool, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(p.N, p.h, device=device, generator=g).to(torch.bfloat16)
    if router == "lowrank":
        w = (torch.randn(p.M, p.r, device=device, generator=g) * 0.1,
             torch.randn(p.r, p.h, device=device, generator=g) * 0.1)
    else:
        w = (torch.randn(p.M, p.h, device=device, generator=g) * 0.05,)
    w = tuple(t.to(torch.bfloat16) for t in w)
    if grad:
        x.requires_grad_()
        for t in w:
            t.requires_grad_()
    return (x, *w)


def _unfused(router, x, *w, k, with_psum):
    """The router as plain torch writes it (the bar the fused kernels are held to): logits in
    x's dtype from cuBLAS, torch.topk, the softmax of the k values; psum the fp32 softmax
    over all M summed over tokens. The library's reference (ops/reference.py) is the oracle
    of the documented selection semantics, slower by design: not a fair speed baseline."""
    logits = (x @ w[1].T) @ w[0].T if router == "lowrank" else x @ w[0].T
    val, idx = torch.topk(logits, k, dim=1)
    val = val.float()
    psum = torch.softmax(logits.float(), dim=1).sum(0) if with_psum else None
    return val, idx, torch.softmax(val, dim=1), psum


def _route(router, impl, x, *w, k, with_psum):
    if impl == "unfused":
        return _unfused(router, x, *w, k=k, with_psum=with_psum)
    if impl == "alg1":
        from .paper_alg1 import route
        return route(x, w[0], w[1], k)
    if router == "lowrank":
        return router_lowrank(x, w[0], w[1], k, with_psum=with_psum, impl=impl)
    return router_linear(x, w[0], k, with_psum=with_psum, impl=impl)


def _inference_fn(router, impl, k):
    @torch.no_grad()
    def run(*inputs):
        return _route(router, impl, *inputs, k=k, with_psum=False)
    return run


def _training_fn(router, impl, p: Point, device):
    gw = torch.randn(p.N, p.k, device=device)

    def run(*inputs):
        val, idx, gates, psum = _route(router, impl, *inputs, k=p.k, with_psum=True)
        counts = expert_counts(idx, p.M)
        loss = (gates * gw).sum() + switch_loss(psum, counts, p.N, p.k)
        return torch.autograd.grad(loss, inputs)
    return run


def measure(p: Point, router: str, impl: str, training: bool, device, ceil: dict) -> dict:
    """One row: time, floor, ratio and (training) peak memory of one implementation."""
    flops, nbytes = op_cost(p, router, training)
    row = {"bench": "router", "phase": "training" if training else "inference",
           "router": router, "impl": impl, "fused": impl == "triton", **p.__dict__, "N": p.N,
           "dtype": "bfloat16", "flops": flops, "bytes": nbytes}
    seeds = itertools.count()
    try:
        inputs = rotation(lambda: _make_inputs(p, router, device, grad=training,
                                               seed=next(seeds)), 2 * p.N * p.h, device)
        fn = _training_fn(router, impl, p, device) if training else _inference_fn(router, impl,
                                                                                   p.k)
        row["ms"] = time_ms(fn, device=device, rotate=inputs)
        row["peak_bytes"] = peak_bytes(lambda: fn(*inputs[0]), device=device)
    except torch.OutOfMemoryError:
        row["ms"], row["oom"] = None, True
    finally:
        torch.cuda.empty_cache() if device.type == "cuda" else None
    row["floor_ms"] = floor_ms(flops, nbytes, ceil)
    if row["ms"] is not None and row["floor_ms"]:
        row["ratio_to_floor"] = row["ms"] / row["floor_ms"]
    return row


def points(sweeps: list[str], quick: bool) -> list[tuple[str, Point]]:
    if quick:
        return [("quick", QUICK), ("quick", replace(QUICK, k=1))]
    return [(name, pt) for name in sweeps for pt in SWEEPS[name]]


def run(sweeps: list[str], *, device, training: bool = True, quick: bool = False,
        progress=None):
    """Yield the environment header's fields merged into every measured row."""
    env = environment(device)
    ceil = ceilings(device)
    plan = []
    for sweep, pt in points(sweeps, quick):
        for phase, (router, impl) in itertools.product((False, True), IMPLS):
            if router == "linear" and sweep == "r":
                continue          # the standard router has no rank
            if phase and (not training or impl == "alg1"):
                continue          # Algorithm 1 is the paper's inference kernel
            plan.append((sweep, pt, router, impl, phase))
    times = {}
    for i, (sweep, pt, router, impl, phase) in enumerate(plan):
        row = measure(pt, router, impl, phase, device, ceil)
        row.update(env, sweep=sweep, **{f"ceiling_{k}": v for k, v in ceil.items()})
        times[(pt, router, impl, phase)] = row["ms"]
        if impl == "triton" and row["ms"]:
            for base, key in (("unfused", "speedup_vs_unfused"), ("alg1", "speedup_vs_alg1")):
                if times.get((pt, router, base, phase)):
                    row[key] = times[(pt, router, base, phase)] / row["ms"]
        if progress:
            progress(i + 1, len(plan), row)
        yield row
