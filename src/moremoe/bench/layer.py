"""``moremoe bench layer``, ``bench decode`` and ``bench experts``: whole MoE / MoRE layers.

layer   prefill forward over h x M (s = 64, k = 4, r = 64, N = 262,144, bf16) for MoE with the
        unfused standard router (as plain torch writes it: cuBLAS logits, torch.topk, the
        softmax of the k values), MoE with the fused standard router and MoRE with the fused
        low-rank router, all three with the same grouped expert kernels; at M <= 1,024 also
        MoE written the torchtitan way (the plain-torch router, torch._grouped_mm experts);
        s in {128, 256, 512} at h = 512; forward + backward peak memory of MoRE unfused vs
        fused; the matched wall-clock point (largest M at which MoRE is no slower than MoE at
        M = 512, h = 512).
decode  one layer's step at B tokens (one per sequence), MoE vs MoRE over h x M, and the
        expert kernels with a schedule that walks the range of expert ids; steps are timed
        as CUDA-graph replays so launch latency does not swamp them. Each row carries its
        memory floor: the weights of the experts the step touches (counted from its routing)
        plus the router's, x and y, at the measured copy rate.
experts the grouped expert kernels alone, forward and backward, achieved FLOP/s against the
        measured matmul rate and each row's floor; at M <= 1,024 the torch._grouped_mm
        experts beside them (forward, and forward + backward for both); with --tune the
        kernels' block configurations instead (bench/tune.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..nn.moe import MoEConfig, MoELayer
from ..runtime import environment
from .harness import bf16_on, ceilings, floor_ms, free, kernel_profile, peak_bytes, time_ms

HS = (64, 128, 256, 512, 1024, 2048, 4096)
MS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
WIDE_S = (128, 256, 512)
MATCH_MS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BS = (4, 16, 64, 256)
VARIANTS = {"moe_unfused": (None, "reference"), "moe_fused": (None, "triton"),
            "more_fused": (64, "triton"), "moe_grouped_mm": (None, "reference")}
GROUPED_MM_MAX_M = 1024     # torchtitan refuses more experts (torch 2.11: also 1,024 groups)


@dataclass(frozen=True)
class LayerPoint:
    h: int
    M: int
    s: int = 64
    k: int = 4
    N: int = 262144


def make_layer(p: LayerPoint, variant: str, device, *, experts_impl="triton", train=False,
               experts=None):
    """The layer of one variant, built directly on the device in bf16 (a CPU init of the
    M = 8,192, h = 4,096 experts alone would take most of a minute); ``experts`` (an
    SwiGLUExperts of the same point) is shared instead of building another copy."""
    rank, router_impl = VARIANTS[variant] if variant in VARIANTS else (64, "reference")
    cfg = MoEConfig(experts=p.M, top_k=p.k, hidden=p.h, width=p.s, rank=rank,
                    router_impl=router_impl, experts_impl=experts_impl)
    with bf16_on(device):
        layer = MoELayer(cfg, experts=experts)
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


def expert_cost(p: LayerPoint) -> tuple[int, int, int]:
    """(forward FLOPs, forward bytes, backward bytes) of the expert kernels, each input read
    once and each output written once (bf16): forward x, W -> y; backward dy, x, W, the
    saved (act, xg, xu) -> dx, dW. The backward's FLOPs are twice the forward's."""
    nbytes = 2 * (2 * p.N * p.h) + 2 * (3 * p.M * p.h * p.s)
    bwd_bytes = 2 * (3 * p.N * p.h) + 2 * (2 * 3 * p.M * p.h * p.s) + 2 * (3 * p.N * p.k * p.s)
    return 6 * p.N * p.k * p.h * p.s, nbytes, bwd_bytes


def expert_design_bytes(p: LayerPoint) -> tuple[int, int]:
    """(forward, backward) bytes of our expert kernels' own dataflow, each kernel reading
    each operand it needs once (kernels/swiglu_experts): the (P, h) pair rows that make the
    combine deterministic are written and read back, and a token's row is read once a slot.
    Forward: x gathered per pair, the pair rows written, the combine's read and y, the
    weights. Backward: dy per pair twice (the down projection's backward and dW_down), x per
    pair (dW_gate, dW_up), the dx pair rows written and read by the combine, dx, the (P, s)
    act, xg, xu, dxg, dxu (ten reads and writes), the weights read and their fp32 gradients
    written. A floor of this design, not of the layer: expert_cost's is the layer's."""
    P, h, s, N, W = p.N * p.k, p.h, p.s, p.N, 3 * p.M * p.h * p.s
    fwd = 2 * (3 * P * h + N * h + W)
    bwd = 2 * (5 * P * h + 10 * P * s + N * h + W) + 4 * W
    return fwd, bwd


def _row(bench, p: LayerPoint, variant, env, ceil, **extra) -> dict:
    return {"bench": bench, "variant": variant, **p.__dict__, **env,
            **{f"ceiling_{k}": v for k, v in ceil.items()}, **extra}


def _experts(p: LayerPoint, device):
    """The point's experts, built once and shared by every variant timed there."""
    return make_layer(p, "more_fused", device).experts


def _plain_router(layer):
    """The standard router as plain torch writes it (bench.router's unfused baseline), not
    the library's reference (the selection oracle, slower by design)."""
    from .router import _unfused
    W = layer.router.weight
    return lambda x: _unfused("linear", x, W, k=layer.config.top_k, with_psum=False)[1:3]


def forward_fn(layer, variant: str, x):
    """The timed forward of one variant: the layer itself for the fused routers; for
    moe_unfused the plain-torch router and our experts, for moe_grouped_mm the plain-torch
    router and the torch._grouped_mm experts."""
    from ..ops.swiglu_experts import swiglu_experts
    if variant not in ("moe_unfused", "moe_grouped_mm"):
        return lambda: layer(x)
    route, ex = _plain_router(layer), layer.experts
    if variant == "moe_grouped_mm":
        from .grouped_mm import GroupedWeights, grouped_mm_experts
        w = GroupedWeights.of(ex.w_gate, ex.w_up, ex.w_down)
        return lambda: grouped_mm_experts(x, *reversed(route(x)), w)
    return lambda: swiglu_experts(x, *reversed(route(x)), ex.w_gate, ex.w_up, ex.w_down,
                                  impl=ex.impl, check_ids=False)


def prefill(p: LayerPoint, variant: str, device, env, ceil, sweep: str, experts) -> dict:
    base = dict(sweep=sweep, phase="forward")
    try:
        layer = make_layer(p, variant, device, experts=experts)
        x = _x(p, device)
        try:
            with torch.no_grad():
                ms = time_ms(forward_fn(layer, variant, x), device=device)
        except RuntimeError as err:       # torch._grouped_mm's own limits (e.g. groups)
            if variant != "moe_grouped_mm" or isinstance(err, torch.OutOfMemoryError):
                raise
            free(device)
            return _row("layer", p, variant, env, ceil, **base, ms=None,
                        error=str(err).splitlines()[0])
        flops, nbytes = layer_cost(p, VARIANTS[variant][0])
        fl = floor_ms(flops, nbytes, ceil)
        row = _row("layer", p, variant, env, ceil, **base, ms=ms, floor_ms=fl, flops=flops,
                   bytes=nbytes, ratio_to_floor=(ms / fl) if fl else None)
    except torch.OutOfMemoryError:
        row = _row("layer", p, variant, env, ceil, **base, ms=None, oom=True)
    free(device)
    return row


def train_memory(p: LayerPoint, router_impl: str, device, env, ceil, experts) -> dict:
    """Peak memory of forward + backward (with the balancing loss) of a MoRE layer above the
    weights, the input and the weights' gradients left by a first step."""
    variant = "more_fused" if router_impl == "triton" else "more_unfused"
    base = dict(sweep="memory", phase="forward+backward")
    try:
        layer = make_layer(p, "more_fused", device, train=True, experts=experts)
        layer.router.impl = router_impl
        x = _x(p, device, grad=True)
        dy = torch.randn_like(x)        # an upstream gradient, allocated before the peak

        def step():    # the layer alone: no loss temporaries (an fp32 copy of y) in the peak
            out = layer(x)
            torch.autograd.backward([out.y, out.aux_loss], [dy, torch.ones_like(out.aux_loss)])
        step()
        row = _row("layer", p, variant, env, ceil, **base,
                   peak_bytes=peak_bytes(step, device=device))
    except torch.OutOfMemoryError:
        row = _row("layer", p, variant, env, ceil, **base, oom=True)
    for w in experts.parameters():
        w.grad = None
    free(device)
    return row


LAYER_SWEEPS = ("grid", "wide_s", "match", "memory")   # also in cli/bench.py (no torch there)


def _variants(M: int, quick: bool) -> list[str]:
    """The grouped_mm baseline where torchtitan's experts run (M <= 1,024) and the GEMM
    does (CUDA, sm90+; its CPU fallback under --quick)."""
    from .grouped_mm import available
    grouped = M <= GROUPED_MM_MAX_M and (quick or (torch.cuda.is_available()
                                                   and available("cuda")))
    return [v for v in VARIANTS if v != "moe_grouped_mm" or grouped]


def _layer_plan(quick: bool, sweeps, expert_counts=None) -> list[tuple[LayerPoint, list]]:
    """[(point, [(sweep, variant or memory impl), ...])] grouped so that each point's
    experts are built once."""
    n = 256 if quick else 262144
    hs, ms = ((64,), (16,)) if quick else (HS, tuple(expert_counts or MS))
    h0 = 64 if quick else 512
    plan: dict[LayerPoint, list] = {}
    for h, M in itertools.product(hs, ms):
        p = LayerPoint(h, M, N=n)
        if "grid" in sweeps:
            plan.setdefault(p, []).extend(("grid", v) for v in _variants(M, quick))
        if "memory" in sweeps:
            plan.setdefault(p, []).extend(("memory", impl) for impl in ("reference", "triton"))
    if "wide_s" in sweeps:
        for s, M in itertools.product((32,) if quick else WIDE_S, ms):
            plan.setdefault(LayerPoint(h0, M, s=s, N=n), []).extend(
                ("wide_s", v) for v in _variants(M, quick))
    if "match" in sweeps:
        for M in (64,) if quick else MATCH_MS:
            p = LayerPoint(h0, M, N=n)
            if ("grid", "more_fused") not in plan.get(p, []):
                plan.setdefault(p, []).append(("match", "more_fused"))
    return list(plan.items())


def run_layer(device, *, quick=False, progress=None, sweeps=LAYER_SWEEPS, expert_counts=None):
    """expert_counts: the M values of the grid and memory sweeps (default MS)."""
    env, ceil = environment(device), ceilings(device)
    plan = _layer_plan(quick, sweeps, expert_counts)
    total, i = sum(len(jobs) for _, jobs in plan), 0
    for p, jobs in plan:
        try:
            experts = _experts(p, device)
        except torch.OutOfMemoryError:
            experts = None
        for sweep, what in jobs:
            if experts is None:
                row = _row("layer", p, what, env, ceil, sweep=sweep, oom=True, ms=None)
            elif sweep == "memory":
                row = train_memory(p, what, device, env, ceil, experts)
            else:
                row = prefill(p, what, device, env, ceil, sweep, experts)
            i += 1
            progress and progress(i, total, row)
            yield row
        del experts
        free(device)


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


DECODE_VARIANTS = (("moe_fused", False), ("more_fused", False), ("more_fused", True))


def decode_step(p: LayerPoint, variant: str, device, env, ceil, experts, *,
                walk=False) -> dict:
    from ..kernels import swiglu_experts as grouped
    layer = make_layer(p, variant, device, experts=experts)
    x = _x(p, device)

    def walking():
        routed = layer.router(x)
        return grouped.forward(x, routed.gates, routed.topk_idx, experts.w_gate,
                                experts.w_up, experts.w_down, walk_experts=True)
    with torch.no_grad():
        touched = int(torch.unique(layer.router(x).topk_idx).numel())
        fn = _graph_or_plain(walking if walk else (lambda: layer(x)), device)
        ms = time_ms(fn, device=device)
    name = variant + ("_walk" if walk else "")
    nbytes = decode_bytes(p, VARIANTS[variant][0], touched)
    fl = floor_ms(0, nbytes, ceil)
    return _row("decode", p, name, env, ceil, B=p.N, phase="decode", ms=ms, experts_touched=touched,
                bytes=nbytes, floor_ms=fl, ratio_to_floor=(ms / fl) if fl else None)


def decode_bytes(p: LayerPoint, rank, touched: int) -> int:
    """A decode step's memory floor in bytes (bf16): the weights of the experts it touches,
    the router's weights, x read and y written."""
    router = p.M * p.h if not rank else (p.M + p.h) * rank
    return 2 * (3 * touched * p.h * p.s + router + 2 * p.N * p.h)


def run_decode(device, *, quick=False, progress=None, expert_counts=None, hidden=None):
    """Each (h, M) builds its experts once; every B and variant reuses them. expert_counts,
    hidden: the M and h values (default MS, HS)."""
    env, ceil = environment(device), ceilings(device)
    hs, ms, bs = ((64,), (16, 128), (4,)) if quick else (
        tuple(hidden or HS), tuple(expert_counts or MS), DECODE_BS)
    total, i = len(hs) * len(ms) * len(bs) * len(DECODE_VARIANTS), 0
    for h, M in itertools.product(hs, ms):
        experts = _experts(LayerPoint(h, M, N=1), device)
        for B, (v, walk) in itertools.product(bs, DECODE_VARIANTS):
            row = decode_step(LayerPoint(h, M, N=B), v, device, env, ceil, experts, walk=walk)
            i += 1
            progress and progress(i, total, row)
            yield row
        del experts
        free(device)


def _expert_rows(p: LayerPoint, device, env, ceil, quick: bool):
    """Our expert kernels at one point, forward and backward (reusing the forward's routing
    metadata, as in training); at M <= 1,024 also forward + backward of ours and forward
    and forward + backward of the torch._grouped_mm experts on the same routing."""
    from ..kernels import swiglu_experts as grouped
    from .grouped_mm import GroupedWeights, available, grouped_mm_experts
    layer = make_layer(p, "more_fused", device)
    x = _x(p, device)
    with torch.no_grad():
        routed = layer.router(x)
    ex = layer.experts
    ws = (ex.w_gate, ex.w_up, ex.w_down)
    args = (x, routed.gates, routed.topk_idx, *ws)
    fwd, nbytes, bwd_bytes = expert_cost(p)
    design = dict(zip(("forward", "backward"), expert_design_bytes(p)))
    design["forward+backward"] = design["forward"] + design["backward"]
    meta = grouped.routing_meta(routed.topk_idx, p.M, grouped.config(p.h, p.s)["BM"])
    y, act, xg, xu = grouped.forward(*args, save=True, meta=meta)
    dy = torch.randn_like(y)
    cases = [("experts", "forward", lambda: grouped.forward(*args), fwd, nbytes),
             ("experts", "backward", lambda: grouped.backward(dy, *args, act, xg, xu,
                                                               meta=meta), 2 * fwd, bwd_bytes)]
    if p.M <= GROUPED_MM_MAX_M and (quick or available(device)):
        leaves = [t.detach().requires_grad_() for t in (x, routed.gates, *ws)]
        xl, gl, *wl = leaves
        gw = GroupedWeights.of(*(w.detach() for w in ws))
        gwl = GroupedWeights(gw.w_gate_up.requires_grad_(), gw.w_down.requires_grad_())

        def ours_step():
            from ..ops.swiglu_experts import swiglu_experts
            out = swiglu_experts(xl, gl, routed.topk_idx, *wl, impl=ex.impl, check_ids=False)
            torch.autograd.backward(out, dy)

        def grouped_step():
            torch.autograd.backward(grouped_mm_experts(xl, gl, routed.topk_idx, gwl), dy)
        cases += [("experts", "forward+backward", ours_step, 3 * fwd, nbytes + bwd_bytes),
                  ("grouped_mm", "forward", lambda: grouped_mm_experts(x, routed.gates,
                                                                       routed.topk_idx, gw),
                   fwd, nbytes),
                  ("grouped_mm", "forward+backward", grouped_step, 3 * fwd,
                   nbytes + bwd_bytes)]
    for variant, phase, fn, flops, byts in cases:
        grad = phase == "forward+backward"
        try:
            with torch.set_grad_enabled(grad):
                ms = time_ms(fn, device=device)
        except RuntimeError as err:       # torch._grouped_mm's own limits (e.g. groups)
            if variant != "grouped_mm":
                raise
            yield _row("experts", p, variant, env, ceil, phase=phase, ms=None,
                       error=str(err).splitlines()[0])
            continue
        fl = floor_ms(flops, byts, ceil)
        own = {}
        if variant == "experts":                  # the floor of the pair rows' dataflow
            dfl = floor_ms(flops, design[phase], ceil)
            own = dict(design_bytes=design[phase], design_floor_ms=dfl,
                       ratio_to_design_floor=(ms / dfl) if dfl else None)
        with torch.set_grad_enabled(grad):        # what limits the row: its kernels' times
            where = kernel_profile(fn, device=device)
        yield _row("experts", p, variant, env, ceil, phase=phase, ms=ms, flops=flops,
                   bytes=byts, floor_ms=fl, tflops=flops / ms / 1e9,
                   ratio_to_floor=(ms / fl) if fl else None, **own, **where)


PAPER_EXPERT_POINTS = [("paper", LayerPoint(512, 8192, s=s)) for s in (64, 128, 512)] + [
    ("paper", LayerPoint(512, M)) for M in (512, GROUPED_MM_MAX_M)]


def run_experts(device, *, quick=False, progress=None, points=None):
    """Expert kernels alone, forward and backward, each row with its kernels' share of the
    device time (kernel_profile): by default the paper's points, h = 512, k = 4, N =
    262,144: s in {64, 128, 512} at M = 8,192, and s = 64 at M in {512, 1,024} with the
    torch._grouped_mm experts beside them; points: [(label, LayerPoint)] instead (the
    CLI's --shapes: the presets', the study's and the phonebook's shapes at their own
    micro-batch)."""
    env, ceil = environment(device), ceilings(device)
    if quick:
        points = [("quick", LayerPoint(64, 16, s=16, N=256))]
    elif points is None:
        points = PAPER_EXPERT_POINTS
    from .grouped_mm import available
    ok = quick or available(device)
    total = sum(2 + 3 * (ok and p.M <= GROUPED_MM_MAX_M) for _, p in points)
    rows = 0
    for label, p in points:
        for row in _expert_rows(p, device, env, ceil, quick):
            rows += 1
            row["shape"] = label
            progress and progress(rows, total, row)
            yield row
        free(device)


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
