"""Where the fused low-rank router's training step and its small batches spend their time,
and how often its selection agrees with torch.topk (run on the GPU). One JSON line each.

  parts      training at N = 262,144 (and --small tokens), h = 512, M = 8,192, r = 64, k = 4:
             z = x R2ᵀ, the sweep with m and Z, psum, the backward (and its sparse part alone),
             the whole step as `moremoe bench router` times it
  bwd_split  the backward's row and column sweeps timed alone
  host       the small batch (--small tokens), inference and training, fused and unfused:
             eager device-event time against the replay of the same call as a CUDA graph
             (the GPU's own time): where eager is much slower, the host is the limiter
  profile    cProfile of the small batch's host time (printed, not emitted)
  agreement  the fraction of rows whose ordered top-k equals torch.topk's on the fp32 logits
             of the same z, and the largest logit gap of any difference, at the issue's points

    python benchmarks/probe_router_train.py [--out rows.jsonl] [--small 2048]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from moremoe.bench.harness import time_ms
from moremoe.bench.router import Point, _training_fn, _inference_fn
from moremoe.kernels import router_lowrank as kr
from moremoe.kernels import router_candidates as rc
from moremoe.kernels import router_train as rt
from moremoe.kernels._common import LOWRANK, ZGIVEN
from moremoe.kernels.router_topk import launch_sweep, sweep_config
from moremoe.runtime import environment


def _inputs(N, h, M, r, dev, seed, grad=False):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(N, h, device=dev, generator=g).bfloat16()
    R1 = (torch.randn(M, r, device=dev, generator=g) * 0.1).bfloat16()
    R2 = (torch.randn(r, h, device=dev, generator=g) * 0.1).bfloat16()
    return tuple(t.requires_grad_(grad) for t in (x, R1, R2))


def graph_ms(fn, dev) -> float | None:
    """Median device time of replaying fn() captured as one CUDA graph; None if it cannot
    be captured."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    try:
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return f"not capturable: {type(exc).__name__}: {str(exc)[:120]}"
    return time_ms(graph.replay, device=dev)


def parts(emit, N, dev):
    h, M, r, k = 512, 8192, 64, 4
    x, R1, R2 = _inputs(N, h, M, r, dev, 1)
    z = F.linear(x, R2)
    emit("z = x R2^T (cuBLAS)", N=N, ms=time_ms(lambda: F.linear(x, R2), device=dev))
    emit("sweep with m, Z", N=N, ms=time_ms(
        lambda: launch_sweep(z, R1, k, mode=ZGIVEN, stats=True), device=dev))
    val, idx, _, m, Z = launch_sweep(z, R1, k, mode=ZGIVEN, stats=True)
    emit("psum", N=N, ms=time_ms(lambda: rt.launch_psum(z, R1, m, Z, mode=ZGIVEN), device=dev))
    pbar = torch.randn(M, device=dev) / N
    dval = torch.randn(N, k, device=dev)
    emit("backward (rows sweep, cols sweep, sparse)", N=N, ms=time_ms(
        lambda: kr.train_backward(z, R1, m, Z, pbar, idx, dval), device=dev))
    emit("backward sparse part alone", N=N, ms=time_ms(
        lambda: rt.sparse_weight_grad(z, idx, dval, M), device=dev))
    for stages in (2, 3, 4):
        for warps in (4, 8):
            cfg = {"bwd_stages": stages, "num_warps": warps}
            emit("backward", N=N, cfg=cfg, ms=time_ms(
                lambda: kr.train_backward(z, R1, m, Z, pbar, idx, dval, config=cfg),
                device=dev))
    p = Point(h=h, M=M, r=r, k=k, B=N // 1024, T=1024)
    fn = _training_fn("lowrank", "triton", p, dev)
    xs = _inputs(N, h, M, r, dev, 2, grad=True)
    emit("training step (bench router)", N=N, ms=time_ms(lambda: fn(*xs), device=dev))


def bwd_split(emit, N, dev):
    """The low-rank backward's two sweeps, each timed alone."""
    import triton
    h, M, r, k = 512, 8192, 64, 4
    x, R1, R2 = _inputs(N, h, M, r, dev, 1)
    z = F.linear(x, R2)
    val, idx, _, m, Z = launch_sweep(z, R1, k, mode=ZGIVEN, stats=True)
    pbar = torch.randn(M, device=dev) / N
    dval = torch.randn(N, k, device=dev)
    cfg = sweep_config(ZGIVEN, r, r, 1)
    dz = torch.empty(N, r, device=dev)
    g = torch.zeros(N, device=dev)
    shift = pbar.mean().reshape(1)
    wc = (R1.float() * (pbar - shift)[:, None]).to(R1.dtype)
    tiles = triton.cdiv(M, cfg["BM"])
    n_splits = rt._token_splits(dev, tiles, N, cfg["BN"], None)
    n_per = triton.cdiv(triton.cdiv(N, n_splits), cfg["BN"]) * cfg["BN"]
    n_splits = triton.cdiv(N, n_per)
    dw = torch.zeros(n_splits, M, r, device=dev)
    common = dict(BN=cfg["BN"], BM=cfg["BM"], BR=cfg["BR"], PREC="tf32",
                  num_warps=cfg["num_warps"], num_stages=cfg["bwd_stages"])

    def rows():
        rt._bwd_rows_kernel[(triton.cdiv(N, cfg["BN"]),)](
            z, R1, wc, m, Z, pbar, idx, dval, dz, g, shift, N, M, r, z.stride(0), 1,
            R1.stride(0), 1, wc.stride(0), idx.stride(0), dz.stride(0), K=k, **common)

    def cols():
        rt._bwd_cols_kernel[(tiles, n_splits)](
            z, R1, m, Z, pbar, g, dw, N, M, r, n_per, z.stride(0), 1, R1.stride(0), 1,
            dw.stride(0), dw.stride(1), **common)

    emit("backward rows sweep (dz, g)", N=N, ms=time_ms(rows, device=dev))
    emit("backward cols sweep (dense dR1)", N=N, ms=time_ms(cols, device=dev))


def host(emit, N, dev):
    h, M, r, k = 512, 8192, 64, 4
    p = Point(h=h, M=M, r=r, k=k, B=N // 1024, T=1024)
    for impl in ("triton", "unfused"):
        xs = _inputs(N, h, M, r, dev, 3)
        fn = _inference_fn("lowrank", impl, k)
        emit("small batch inference", N=N, impl=impl, eager_ms=time_ms(lambda: fn(*xs),
             device=dev), graph_ms=graph_ms(lambda: fn(*xs), dev))
        xs = _inputs(N, h, M, r, dev, 4, grad=True)
        fn = _training_fn("lowrank", impl, p, dev)
        emit("small batch training", N=N, impl=impl, eager_ms=time_ms(lambda: fn(*xs),
             device=dev), graph_ms=graph_ms(lambda: fn(*xs), dev))


@torch.no_grad()
def agreement(emit, dev):
    """Against torch.topk on fp32 logits of two z's: the kernel's own (x R2ᵀ accumulated on
    chip, narrowed to bf16; differences are then the key precision and the MMA's summation
    order) and cuBLAS's (its bf16 z may differ from the kernel's by an ulp)."""
    N, M, r = 262144, 8192, 64
    for h, k in ((512, 4), (2048, 4), (512, 8), (512, 16)):
        x, R1, R2 = _inputs(N, h, M, r, dev, 5)
        val, idx, _ = kr.infer(x, R1, R2, k)
        cfg = sweep_config(LOWRANK, r, h, k, M)
        z_own = rc.launch_candidates(x, R1, R2, k, mode=LOWRANK, cfg=cfg)[1][:, :r]
        for which in ("kernel z", "cuBLAS z"):
            same, worst, worst_rel = 0, 0.0, 0.0
            for n0 in range(0, N, 16384):
                sl = slice(n0, n0 + 16384)
                z = z_own[sl] if which == "kernel z" else (x[sl] @ R2.T)
                logits = z.float() @ R1.float().T
                ref_v, ref_i = torch.topk(logits, k, dim=1)
                ours = idx[sl].long()
                eq = (ours == ref_i).all(1)
                same += int(eq.sum())
                if not eq.all():
                    got = logits.gather(1, ours)[~eq]
                    gap = (ref_v[~eq] - got).abs()
                    worst = max(worst, gap.max().item())
                    worst_rel = max(worst_rel, (gap / ref_v[~eq].abs().clamp_min(1e-30))
                                    .max().item())
            emit("agreement with torch.topk", against=which, h=h, k=k, N=N,
                 rows_identical=same / N, rows_differing=N - same, largest_gap=worst,
                 largest_gap_rel=worst_rel)


def host_profile(emit, N, dev):
    """cProfile of the small-batch training step and inference call (the host's time)."""
    import cProfile
    import io
    import pstats
    h, M, r, k = 512, 8192, 64, 4
    p = Point(h=h, M=M, r=r, k=k, B=N // 1024, T=1024)
    for phase in ("inference", "training"):
        xs = _inputs(N, h, M, r, dev, 6, grad=phase == "training")
        fn = (_training_fn("lowrank", "triton", p, dev) if phase == "training"
              else _inference_fn("lowrank", "triton", k))
        for _ in range(20):
            fn(*xs)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fn(*xs)
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"--- host profile, {phase}, N = {N}, 50 calls ---")
        print("\n".join(buf.getvalue().splitlines()[:45]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", type=int, default=2048)
    ap.add_argument("--only", default="parts,host,agreement")
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = environment(dev)

    def emit(what, **row):
        row = {"what": what, **row, **env}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    todo = args.only.split(",")
    if "parts" in todo:
        parts(emit, 262144, dev)
        parts(emit, args.small, dev)
    if "bwd_split" in todo:
        bwd_split(emit, 262144, dev)
    if "host" in todo:
        host(emit, args.small, dev)
    if "agreement" in todo:
        agreement(emit, dev)
    if "profile" in todo:
        host_profile(emit, args.small, dev)


if __name__ == "__main__":
    main()
