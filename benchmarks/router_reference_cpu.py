"""The exact plain-torch routers on a CPU against the same products and one torch.topk in the
input dtype (issue 53): issue 53's shape (N = 4,096, h = 256, M = 2,048, r = 32, k = 4) and
the demo's (N = 16,384, h = 32, MoRE-112 at r = 8 against MoE-32), fp32 and bf16, each
pair timed alternately in one process (median of REPEAT). One JSON row per (shape, dtype)
is appended to OUT with the machine, versions, commit and date; run it on two trees
(PYTHONPATH=that tree's src) to compare them.

    PYTHONPATH=src python benchmarks/router_reference_cpu.py benchmarks/results/cpu/router_reference.jsonl
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from moremoe.ops import reference as ref
from moremoe.runtime import environment

SHAPES = {"issue53": dict(N=4096, h=256, M=2048, r=32, M_moe=2048),
          "demo": dict(N=16384, h=32, M=112, r=8, M_moe=32)}


def median_ms(fns: dict, repeat: int) -> dict:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: sorted(v)[repeat // 2] for k, v in times.items()}


def rows(repeat: int):
    for shape, s in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(s["N"], s["h"], generator=g).to(dtype)
            R1 = (torch.randn(s["M"], s["r"], generator=g) * 0.1).to(dtype)
            R2 = (torch.randn(s["r"], s["h"], generator=g) * 0.1).to(dtype)
            W = (torch.randn(s["M_moe"], s["h"], generator=g) * 0.02).to(dtype)
            ms = median_ms({
                "lowrank_ref": lambda: ref.router_lowrank_ref(x, R1, R2, 4),
                "lowrank_plain": lambda: torch.topk((x @ R2.T) @ R1.T, 4, dim=-1),
                "linear_ref": lambda: ref.router_linear_ref(x, W, 4),
                "linear_plain": lambda: torch.topk(x @ W.T, 4, dim=-1)}, repeat)
            yield {"bench": "router_reference_cpu", "shape": shape, **s,
                   "dtype": str(dtype).split(".")[-1], "k": 4, "ms": ms,
                   "lowrank_ratio": ms["lowrank_ref"] / ms["lowrank_plain"],
                   "linear_ratio": ms["linear_ref"] / ms["linear_plain"],
                   "lowrank_ns_per_token": 1e6 * ms["lowrank_ref"] / s["N"],
                   "linear_ns_per_token": 1e6 * ms["linear_ref"] / s["N"],
                   "threads": torch.get_num_threads(), "repeat": repeat,
                   "cpu": platform.processor() or platform.machine(),
                   **environment(torch.device("cpu"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="JSONL file the rows are appended to")
    p.add_argument("--repeat", type=int, default=25)
    args = p.parse_args()
    with open(args.out, "a") as f:
        for row in rows(args.repeat):
            f.write(json.dumps(row) + "\n")
            print(f"{row['shape']:8} {row['dtype']:9} low-rank {row['ms']['lowrank_ref']:7.2f}"
                  f" / {row['ms']['lowrank_plain']:7.2f} ms = {row['lowrank_ratio']:.2f}x   "
                  f"linear {row['ms']['linear_ref']:7.2f} / {row['ms']['linear_plain']:7.2f} ms"
                  f" = {row['linear_ratio']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
