"""Times the fused routers' inference at the paper's point (N = 262,144, h = 512, M = 8,192,
r = 64, bf16) for several k, one JSON line per row, so that two source trees can be compared
on one machine in one call (run it once per tree, with PYTHONPATH pointing at each):

    PYTHONPATH=src python benchmarks/router_ab.py --label new >> rows.jsonl
    PYTHONPATH=old/src python benchmarks/router_ab.py --label old >> rows.jsonl

Medians of device-event timings after warm-up (moremoe.bench.harness.time_ms); inputs are
fixed by a seed, so both trees see the same logits. The first call of each k compiles
and is not timed.
"""
import argparse
import json

import torch

from moremoe.bench.harness import time_ms
from moremoe.kernels import router_linear as kl
from moremoe.kernels import router_lowrank as kr

try:
    from moremoe.runtime import environment
except ImportError:                                 # a tree from before moremoe.runtime
    from moremoe.bench.harness import environment


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--ks", default="4,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    N, h, M, r = 262144, 512, 8192, 64
    x = torch.randn(N, h, device=dev, generator=g).bfloat16()
    R1 = (torch.randn(M, r, device=dev, generator=g) * 0.1).bfloat16()
    R2 = (torch.randn(r, h, device=dev, generator=g) * 0.1).bfloat16()
    W = (torch.randn(M, h, device=dev, generator=g) * 0.05).bfloat16()
    env = environment(dev)
    for k in (int(t) for t in args.ks.split(",")):
        for router, fn in (("lowrank", lambda k=k: kr.infer(x, R1, R2, k)),
                           ("linear", lambda k=k: kl.infer(x, W, k))):
            fn()
            torch.cuda.synchronize()
            row = {"label": args.label, "router": router, "N": N, "h": h, "M": M, "r": r,
                   "k": k, "ms": time_ms(fn, device=dev), **env}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
