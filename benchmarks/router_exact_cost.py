"""What the exact selection costs (issue 35): the fused routers of two source trees timed in
one call, alternately, each in a process of its own (two versions of one package cannot
share a process): BEFORE (the keys' selection, 04db889's parent) and AFTER (the exact
decision on fp32 logits). The issue's shape, bf16, h = 512, M = 8,192, k = 4, r = 64:

  lowrank / linear infer      the fused inference routers at N = 262,144 (the paper's N)
  lowrank / linear train      the training forward + backward (dval = 1) at N = 262,144
  lowrank exact sweep         the exact sweep alone (config C = 0) at N = 262,144
  lowrank infer N=16, N=64    decoding: the exact sweep split over the experts
  lowrank infer k=1           two keys a tile now, one before
  ... (floor), (argmax)       two variants measured on an H200 and removed (236bfd6's
                              rows: neither was faster; benchmarks/NOTES.md)

Each process times every variant (median of device-event timings after warm-up,
moremoe.bench.harness.time_ms); the parent runs ROUNDS rounds of (before, after) and
reports each variant's median over rounds and after / before. Rows go to OUT.jsonl.

    git archive 04db889~1 src | tar -x -C /tmp/before
    PYTHONPATH=src python benchmarks/router_exact_cost.py /tmp/before/src src OUT.jsonl
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

H, M, K, R, N = 512, 8_192, 4, 64, 262_144


def child() -> None:
    import torch

    from moremoe.bench.harness import time_ms
    from moremoe.kernels import router_lowrank as klr
    from moremoe.ops.router_linear import router_linear
    from moremoe.ops.router_lowrank import router_lowrank

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, H, device=dev, generator=g).bfloat16()
    W = (torch.randn(M, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    R2 = (torch.randn(R, H, device=dev, generator=g) / H ** 0.5).bfloat16()
    R1 = (torch.randn(M, R, device=dev, generator=g) / R ** 0.5).bfloat16()
    R1g, Wg = R1.clone().requires_grad_(), W.clone().requires_grad_()

    def train(fn):
        def step():
            val = fn()[0]
            val.sum().backward()
        return step

    variants = {
        "lowrank infer": lambda: router_lowrank(x, R1, R2, K),
        "linear infer": lambda: router_linear(x, W, K),
        "lowrank train": train(lambda: router_lowrank(x, R1g, R2, K)),
        "linear train": train(lambda: router_linear(x, Wg, K)),
        "lowrank exact sweep": lambda: klr.infer(x, R1, R2, K, config={"C": 0}),
        "lowrank infer N=16": lambda: router_lowrank(x[:16], R1, R2, K),
        "lowrank infer N=64": lambda: router_lowrank(x[:64], R1, R2, K),
        "lowrank infer k=1": lambda: router_lowrank(x, R1, R2, 1),
    }
    for name, fn in variants.items():
        try:
            ms = time_ms(fn, device=dev)
        except Exception as e:   # a variant the older tree lacks: say so, go on
            ms, name = None, f"{name} ({type(e).__name__}: {e})"[:200]
        print(json.dumps({"variant": name, "ms": ms}), flush=True)


def run(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                         capture_output=True, text=True, timeout=400)
    return {r["variant"]: r["ms"] for r in map(json.loads, out.stdout.splitlines())}


def main(before: str, after: str, out: str, rounds: int = 2) -> int:
    times = {"before": [], "after": []}
    for i in range(rounds):
        for tag, src in (("before", before), ("after", after)):
            times[tag].append(run(src))
            print(f"round {i + 1}, {tag}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in times[tag][-1].items() if v is not None), flush=True)
    sys.path.insert(0, after)
    import torch

    from moremoe.runtime import environment
    env = environment(torch.device("cuda"))
    rows = []
    for name in times["after"][0]:
        med = {t: statistics.median(r[name] for r in times[t])
               if all(r.get(name) is not None for r in times[t]) else None for t in times}
        ratio = med["after"] / med["before"] if None not in med.values() else None
        rows.append({"bench": "router_exact_cost", "variant": name, "hidden": H,
                     "experts": M, "top_k": K, "rank": R, "ms_before": med["before"],
                     "ms_after": med["after"], "after_over_before": ratio, "rounds": rounds,
                     **env})
        print(f"{name:<24} before {med['before'] or float('nan'):8.3f} ms   after "
              f"{med['after'] or float('nan'):8.3f} ms   "
              f"{'' if ratio is None else f'{ratio:.3f}x'}", flush=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    else:
        sys.exit(main(*sys.argv[1:4]))
