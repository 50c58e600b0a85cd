"""How far each router path is from the routing contract on a GPU (issue 35), and what an
exact z would cost: the issue's measurement again (bf16, h = 512, M = 8,192, k = 4, r = 64,
16,384 random rows), each path against the exact top-k (fp64 logits; for the low-rank
router of z rounded once from its fp64 product, as the contract defines it):

  fused (triton)    the fused kernels (inference)
  fused (train)     the training op (z from cuBLAS, the kernel's first pass)
  reference         the plain-torch router on the GPU (fp32 sums, then fp64 decisions)

For each disagreement, why: the exact k-th / (k+1)-th gap relative to the k-th value
(below 2^-15: the kernels' key truncation), or the fused path's z differing from the exact
rounding (rows with an element of z one bf16 step away). Then timings at the paper's
N = 262,144: the fused router, z as a bf16 GEMM, and z as an fp64 GEMM (what an exact z
costs, the conversion of x included).

    PYTHONPATH=src python benchmarks/routing_paths_gpu.py OUT.jsonl"""
from __future__ import annotations

import json
import sys

import torch

from moremoe.bench.harness import time_ms
from moremoe.ops import route_exact
from moremoe.ops.router_linear import router_linear
from moremoe.ops.router_lowrank import router_lowrank
from moremoe.runtime import environment

N, H, M, K, R = 16_384, 512, 8_192, 4, 64


def exact_topk(l64):
    l64 = torch.where(torch.isfinite(l64), l64, float("-inf"))
    v, i = torch.sort(l64, dim=1, descending=True, stable=True)
    return v[:, :K + 1], i[:, :K].int()


def compare(name, idx, exact_i, v64, extra=None) -> dict:
    differ = (idx.sort(1).values != exact_i.sort(1).values).any(1)
    order = (idx != exact_i).any(1)
    gap = (v64[:, K - 1] - v64[:, K]) / v64[:, K - 1].abs()
    near = gap < 2.0 ** -15
    row = {"path": name, "rows": N, "set_differs": int(differ.sum()),
           "order_differs": int(order.sum()),
           "set_differs_within_2^-15": int((differ & near).sum()),
           "rows_within_2^-15": int(near.sum())}
    if extra is not None:
        row["set_differs_where_z_differs"] = int((differ & extra).sum())
        row["rows_where_z_differs"] = int(extra.sum())
    print(json.dumps(row), flush=True)
    return row


def main(out: str) -> int:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, H, device=dev, generator=g).bfloat16()
    W = (torch.randn(M, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    R2 = (torch.randn(R, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    R1 = (torch.randn(M, R, device=dev, generator=g) / R ** 0.5).bfloat16()
    rows = []
    # the standard router
    v64, e_i = exact_topk(x.double() @ W.double().T)
    for name, impl in (("linear fused", "triton"), ("linear reference", "reference")):
        rows.append(compare(name, router_linear(x, W, K, impl=impl)[1], e_i, v64))
    Wg = W.clone().requires_grad_()
    rows.append(compare("linear fused (train)", router_linear(x, Wg, K, impl="triton")[1],
                        e_i, v64))
    # the low-rank router: z rounded once (the contract), and as cuBLAS rounds it
    z_exact = route_exact.round_z(x, R2)
    z_blas = torch.nn.functional.linear(x, R2)
    z_differs = (z_exact != z_blas).any(1)
    v64, e_i = exact_topk(z_exact.double() @ R1.double().T)
    for name, impl in (("lowrank fused", "triton"), ("lowrank reference", "reference")):
        rows.append(compare(name, router_lowrank(x, R1, R2, K, impl=impl)[1], e_i, v64,
                            z_differs))
    R1g = R1.clone().requires_grad_()
    rows.append(compare("lowrank fused (train)",
                        router_lowrank(x, R1g, R2, K, impl="triton")[1], e_i, v64, z_differs))
    # timings at the paper's N
    n = 262_144
    xb = torch.randn(n, H, device=dev, generator=g).bfloat16()
    t = {"fused lowrank router": time_ms(lambda: router_lowrank(xb, R1, R2, K), device=dev),
         "fused linear router": time_ms(lambda: router_linear(xb, W, K), device=dev),
         "z bf16 GEMM": time_ms(lambda: xb @ R2.T, device=dev),
         "z fp64 GEMM (x converted)": time_ms(lambda: xb.double() @ R2.double().T,
                                              device=dev),
         "z fp64 GEMM (x already fp64)": time_ms(
             lambda x64=xb.double(), r64=R2.double(): x64 @ r64.T, device=dev),
         "z rounded once (route_exact.round_z)": time_ms(lambda: route_exact.round_z(xb, R2),
                                                         device=dev)}
    for k, v in t.items():
        print(f"{k:<40} {v:8.3f} ms (N = {n:,})", flush=True)
        rows.append({"timing": k, "ms": v, "tokens": n})
    env = environment(dev)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps({"bench": "routing_paths", "hidden": H, "experts": M,
                                "top_k": K, "rank": R, **r, **env}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
