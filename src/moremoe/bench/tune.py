"""Block configurations of the fused kernels, to rerun on a new GPU: ``moremoe bench router
--sweeps tune`` and ``moremoe bench experts --tune``.

Each configuration (overrides of kernels/router_topk.sweep_config or
kernels/swiglu_experts.config) is timed beside the launcher's default on the same inputs in
the same run; a row carries its overrides ("config", {} for the default), its speedup over
the default and, for the low-rank router, whether it selects exactly what the exact sweep
(C = 0) selects. A configuration the GPU cannot compile or launch (shared memory,
registers) gives an "error" row. The defaults come from such runs on an H100
(benchmarks/NOTES.md, issues 4, 13 and 14).
"""
from __future__ import annotations

import torch

from ..kernels import router_linear, router_lowrank, swiglu_experts
from ..runtime import environment
from .harness import ceilings, floor_ms, free, time_ms
from .layer import LayerPoint, _row, expert_cost
from .router import QUICK, Point, _make_inputs, op_cost

# the low-rank router's inference at h = 512, M = 8,192, r = 64, by k. The default is the
# one-pass selection (kernels/router_buffer.py) at k <= 8: crowded tiles examined after the
# sweep (lazy; eager: in rounds after each tile), two or four keys a tile (schedule() chooses
# by the number of tiles), cand_stages its depth. CAND the candidates pass (the default up to
# the fourteenth session): C keys per tile (0: the exact sweep alone), BM experts per tile.
LAZY, EAGER = {"path": "buffer", "rounds": "lazy"}, {"path": "buffer", "rounds": "eager"}
CAND = {"path": "candidates"}
ONE_PASS = [EAGER, {"tile_keys": 2}, {"tile_keys": 4}]
LOWRANK = {1: [CAND, {**CAND, "cand_stages": 2}, {"cand_stages": 2}],
           4: [CAND, {**CAND, "cand_stages": 2}, {**CAND, "cand_stages": 4},
               {**CAND, "BM": 64}, {"C": 3}, {"C": 0}, *ONE_PASS, {"cand_stages": 4},
               {"maxnreg": 0}],
           8: [CAND, {"C": 4}, {"C": 0}, *ONE_PASS],
           16: [{"C": 4}, {"C": 0}]}
# issue 54's other shapes (k = 4): the one pass against the candidates
LOWRANK_POINTS = [Point(M=512), Point(M=2048), Point(M=16384), Point(h=2048)]
# the standard router at M = 8,192, k = 4, h = 1,024 and 2,048 (GEMM-shaped tiles)
LINEAR = [{"BM": 128}, {"cand_stages": 3}, {"BH": 128}, {"BN": 64, "num_warps": 4}, LAZY,
          EAGER]
# the expert kernels: BM rows a block, BS / BH the s and h chunks, warps, stages; dw_* the
# weight-gradient kernel's own tiles (they change only the backward)
EXPERTS = [dict(BM=bm, BS=bs, BH=bh, num_warps=w, num_stages=st)
           for bm, bs, bh, w, st in ((64, 64, 64, 4, 3), (64, 64, 128, 4, 3),
                                     (128, 64, 64, 8, 3), (128, 64, 128, 8, 3),
                                     (128, 128, 64, 8, 3), (64, 32, 128, 4, 4))]
EXPERTS += [{"dw_BR": 32}, {"dw_BR": 128}, {"dw_BH": 128}, {"dw_warps": 8, "dw_stages": 3},
            {"dw_piece_rows": 256}, {"dw_piece_rows": 2048}, {"dw_piece_rows": 2 ** 62},
            {"dw_pair": False}]    # the gate and up gradients in two launches (default one)
# the layer benchmarks' point (bf16 weights), and the h = 512 pair's training micro-batch
# (16,384 tokens; fp32 weights, as the trainer's kernels read them under autocast), with
# uniform routing and with a Zipf-skewed one (a run's first steps: H_norm about 0.5)
EXPERT_POINTS = [(LayerPoint(512, 8192), torch.bfloat16, "uniform"),
                 (LayerPoint(512, 8192, s=128), torch.bfloat16, "uniform"),
                 (LayerPoint(512, 256, N=16384), torch.float32, "uniform"),
                 (LayerPoint(512, 1792, s=56, N=16384), torch.float32, "uniform"),
                 (LayerPoint(512, 256, N=16384), torch.float32, "zipf"),
                 (LayerPoint(512, 1792, s=56, N=16384), torch.float32, "zipf")]
ZIPF = 1.2     # expert e (in a random order) chosen with weight 1 / (e + 1)^ZIPF


def _launch_errors() -> tuple:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    return RuntimeError, CompilationError, OutOfResources


def _error(err: Exception) -> dict:
    return {"ms": None, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


def _timed(fn, cfg: dict, device) -> dict:
    """{"ms": ...}, or {"error": ...} for a configuration other than the default that the
    GPU cannot run (the default must run: its failure is raised)."""
    try:
        return {"ms": time_ms(fn, device=device)}
    except _launch_errors() as err:
        if not cfg:
            raise
        return _error(err)


def _router_plan(quick: bool):
    if quick:
        return [(QUICK, "lowrank", [{"C": 0}, LAZY, EAGER]), (QUICK, "linear", [{"BM": 64}])]
    return ([(Point(k=k), "lowrank", v) for k, v in LOWRANK.items()]
            + [(p, "lowrank", [CAND, *ONE_PASS]) for p in LOWRANK_POINTS]
            + [(Point(h=h), "linear", LINEAR) for h in (1024, 2048)])


@torch.no_grad()
def router_tune(device, *, quick=False, progress=None):
    """Rows of `bench router --sweeps tune`: inference of each router configuration."""
    env, ceil = environment(device), ceilings(device)
    plan = _router_plan(quick)
    total, i = sum(1 + len(v) for _, _, v in plan), 0
    for p, router, variants in plan:
        x, *w = _make_inputs(p, router, device, grad=False, seed=0)
        if router == "lowrank":
            def call(cfg):
                return router_lowrank.infer(x, w[0], w[1], p.k, config=cfg)
        else:
            def call(cfg):
                return router_linear.infer(x, w[0], p.k, config=cfg)
        exact = call({"C": 0})[1] if router == "lowrank" else None
        flops, nbytes = op_cost(p, router, False)
        fl, default_ms = floor_ms(flops, nbytes, ceil), None
        for cfg in [{}] + variants:
            got = _timed(lambda: call(cfg), cfg, device)
            default_ms = got["ms"] if not cfg else default_ms
            row = {"bench": "router", "sweep": "tune", "phase": "inference", "router": router,
                   "impl": "triton", "fused": True, **p.__dict__, "N": p.N,
                   "dtype": "bfloat16", "config": cfg, "flops": flops, "bytes": nbytes,
                   **got, "floor_ms": fl, **env,
                   **{f"ceiling_{k}": v for k, v in ceil.items()}}
            if got["ms"]:
                row.update(ratio_to_floor=got["ms"] / fl if fl else None,
                           speedup_vs_default=default_ms / got["ms"])
                if exact is not None:
                    row["same_as_exact"] = torch.equal(call(cfg)[1], exact)
            i += 1
            progress and progress(i, total, row)
            yield row
        del x, w
        free(device)


def _expert_inputs(p: LayerPoint, wdtype, device, routing: str = "uniform"):
    """Uniform random routing (a repeated expert within a row is rare and harmless to
    timing), or "zipf": k distinct experts a row drawn with weights 1 / (rank + 1)^ZIPF, the
    ranks a random order of the experts; bf16 tokens, weights in wdtype."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(p.N, p.h, device=device, generator=g).to(torch.bfloat16)
    if routing == "zipf":
        weight = (torch.arange(p.M, device=device) + 1.0) ** -ZIPF
        weight = weight[torch.randperm(p.M, device=device, generator=g)]
        idx = torch.multinomial(weight.expand(p.N, p.M), p.k, generator=g).int()
    else:
        idx = torch.randint(0, p.M, (p.N, p.k), device=device, generator=g).int()
    gates = torch.softmax(torch.randn(p.N, p.k, device=device, generator=g), -1)
    ws = [(torch.randn(*shape, device=device, generator=g) * 0.05).to(wdtype)
          for shape in ((p.M, p.s, p.h), (p.M, p.s, p.h), (p.M, p.h, p.s))]
    return x, gates, idx, ws


def _dw_only(cfg: dict) -> bool:
    return bool(cfg) and all(key.startswith("dw_") for key in cfg)


def _expert_phases(p: LayerPoint, cfg: dict, args, device) -> dict:
    """{phase: {"ms": ...} or {"error": ...}} of one configuration; the backward reuses the
    forward's routing metadata, as in training."""
    try:
        meta = swiglu_experts.routing_meta(args[2], p.M,
                                           swiglu_experts.config(p.h, p.s, cfg)["BM"])
        y, act, xg, xu = swiglu_experts.forward(*args, save=True, cfg=cfg, meta=meta)
    except _launch_errors() as err:      # the forward that saves what the backward reads
        if not cfg:
            raise
        return {"backward": _error(err)}
    dy = torch.randn_like(y)
    out = {} if _dw_only(cfg) else {
        "forward": _timed(lambda: swiglu_experts.forward(*args, cfg=cfg), cfg, device)}
    out["backward"] = _timed(lambda: swiglu_experts.backward(dy, *args, act, xg, xu, cfg=cfg,
                                                             meta=meta), cfg, device)
    return out


def run_experts_tune(device, *, quick=False, progress=None):
    """Rows of `bench experts --tune`: forward and backward of each block configuration."""
    env, ceil = environment(device), ceilings(device)
    points = ([(LayerPoint(32, 8, s=16, N=32), torch.bfloat16, "uniform"),
               (LayerPoint(32, 8, s=16, N=32), torch.bfloat16, "zipf")] if quick
              else EXPERT_POINTS)
    configs = [{"BM": 32}] if quick else EXPERTS
    plan = [(p, wdtype, routing, [{}] + [c for c in configs     # BS no wider than s needs
                                         if c.get("BS", 0) <= 1 << (p.s - 1).bit_length()])
            for p, wdtype, routing in points]
    total, i = sum(2 - _dw_only(c) for *_, cfgs in plan for c in cfgs), 0
    for p, wdtype, routing, cfgs in plan:
        x, gates, idx, ws = _expert_inputs(p, wdtype, device, routing)
        fwd, fwd_bytes, bwd_bytes = expert_cost(p)
        default = {}
        for cfg in cfgs:
            for phase, got in _expert_phases(p, cfg, (x, gates, idx, *ws), device).items():
                flops, nbytes = (fwd, fwd_bytes) if phase == "forward" else (2 * fwd,
                                                                              bwd_bytes)
                default.setdefault(phase, got["ms"])         # the default comes first
                fl = floor_ms(flops, nbytes, ceil)
                row = _row("experts", p, "experts", env, ceil, sweep="tune", phase=phase,
                           config=cfg, weights=str(wdtype).removeprefix("torch."),
                           routing=routing, **got,
                           flops=flops, bytes=nbytes, floor_ms=fl)
                if got["ms"]:
                    row.update(ratio_to_floor=got["ms"] / fl if fl else None,
                               speedup_vs_default=default[phase] / got["ms"])
                i += 1
                progress and progress(i, total, row)
                yield row
        del x, gates, idx, ws
        free(device)
