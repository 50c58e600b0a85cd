"""Tuning probe for the fused router kernels (run on the GPU): times block configurations of
the inference sweep at the target point, the same kernel with the selection removed (PROBE:
loads + MMA + one max per tile) and the references, against the measured ceilings.

    python benchmarks/tune_router.py [--out results.json]
"""
import argparse
import json

import torch

from moremoe.bench.harness import ceilings, floor_ms, time_ms
from moremoe.runtime import environment
from moremoe.bench.router import Point, op_cost
from moremoe.kernels import router_linear as kl
from moremoe.kernels import router_lowrank as kr
from moremoe.kernels._common import LOWRANK
from moremoe.kernels.router_topk import launch_sweep
from moremoe.ops import reference as ref

EXACT = {"rounds": 0}
VARIANTS = {
    "exact BM128": dict(BM=128, **EXACT),
    "bounded BM128": dict(BM=128),
    "bounded BM256": dict(BM=256),
    "bounded BM256 warm2": dict(BM=256, warm=2),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--h", type=int, default=512)
    ap.add_argument("--M", type=int, default=8192)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    p = Point(h=args.h, M=args.M)
    x = torch.randn(p.N, p.h, device=dev).bfloat16()
    R1 = (torch.randn(p.M, p.r, device=dev) * 0.1).bfloat16()
    R2 = (torch.randn(p.r, p.h, device=dev) * 0.1).bfloat16()
    W = (torch.randn(p.M, p.h, device=dev) * 0.05).bfloat16()
    flops, nbytes = op_cost(p, "lowrank", False)
    fl = floor_ms(flops, nbytes, ceil)
    out = {"env": environment(dev), "ceilings": ceil, "point": p.__dict__, "floor_ms": fl,
           "rows": []}

    def rec(name, fn, **kw):
        try:
            ms = time_ms(fn, device=dev)
        except Exception as err:  # report and continue: one bad config must not stop the run
            print(f"{name:48s} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
            return
        out["rows"].append({"name": name, "ms": ms, **kw})
        print(f"{name:48s} {ms:8.3f} ms   {ms / fl:5.2f}x floor", flush=True)

    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
          f"{ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; floor {fl:.3f} ms", flush=True)
    rec("unfused lowrank (2 matmuls + topk + softmax)",
        lambda: torch.softmax(ref.router_lowrank_ref(x, R1, R2, p.k)[0], -1))
    rec("matmul x R2^T then z R1^T only (cuBLAS)", lambda: (x @ R2.T) @ R1.T)
    for name, cfg in VARIANTS.items():
        for k in (1, 2, 4, 8, 16):
            rec(f"fused lowrank {name} k={k}", lambda c=cfg, k=k: kr.infer(x, R1, R2, k, config=c),
                variant=name, k=k)
    rec("  probe (no selection) BM128",
        lambda: launch_sweep(x, R1, p.k, r2=R2, mode=LOWRANK, config=EXACT, probe=True), probe=True)
    rec("  probe (no selection) BM256",
        lambda: launch_sweep(x, R1, p.k, r2=R2, mode=LOWRANK, config=dict(BM=256, **EXACT),
                             probe=True), probe=True)
    for k in (1, 4, 16):
        rec(f"unfused lowrank k={k}",
            lambda k=k: torch.softmax(ref.router_lowrank_ref(x, R1, R2, k)[0], -1), k=k)
    xs = x[:2048].clone()
    rec("B=2 fused auto split", lambda: kr.infer(xs, R1, R2, p.k))
    rec("B=2 fused one sweep", lambda: kr.infer(xs, R1, R2, p.k, splits=1))
    rec("B=2 unfused", lambda: torch.softmax(ref.router_lowrank_ref(xs, R1, R2, p.k)[0], -1))
    rec("fused linear default", lambda: kl.infer(x, W, p.k))
    rec("fused linear exact", lambda: kl.infer(x, W, p.k, config=EXACT))
    rec("unfused linear", lambda: torch.softmax(ref.router_linear_ref(x, W, p.k)[0], -1))
    from moremoe.bench.router import measure
    for router in ("lowrank", "linear"):
        for impl in ("triton", "reference"):
            row = measure(p, router, impl, True, dev, ceil)
            out["rows"].append({"name": f"train {router} {impl}", **row})
            print(f"train fwd+bwd {router:8s} {impl:9s} {row['ms'] or float('nan'):8.3f} ms  "
                  f"peak {(row.get('peak_bytes') or 0) / 2**30:6.2f} GiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
