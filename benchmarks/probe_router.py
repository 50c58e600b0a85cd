"""Where the fused low-rank router's time goes (run on the GPU), at h = 512, M = 8,192,
r = 64, N = 262,144, k = 4 unless given: the candidates pass alone for C = 1..3, the pick
alone, the exact sweep of the queued rows alone, the whole call, the prototype of `.anchors/`
beside them. One JSON line each.

    python benchmarks/probe_router.py [--out rows.jsonl] [--k 4] [--h 512]
"""
import argparse
import importlib.util
import json
import os
import sys

import torch

from moremoe.bench.harness import time_ms
from moremoe.kernels import router_lowrank as kr
from moremoe.kernels._common import LOWRANK
from moremoe.kernels import router_candidates as rc
from moremoe.kernels.router_topk import launch_exact, sweep_config
from moremoe.runtime import environment

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--h", type=int, default=512)
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = environment(dev)
    N, h, M, r, k = 262144, args.h, 8192, 64, args.k
    g = torch.Generator(device=dev).manual_seed(h)
    x = torch.randn(N, h, device=dev, generator=g).bfloat16()
    R1 = (torch.randn(M, r, device=dev, generator=g) * 0.1).bfloat16()
    R2 = (torch.randn(r, h, device=dev, generator=g) * 0.1).bfloat16()

    def emit(what, **row):
        row = {"what": what, "h": h, "M": M, "r": r, "k": k, "N": N, **row, **env}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    out = tuple(torch.empty(N, k, device=dev, dtype=dt)
                for dt in (torch.float32, torch.int32, torch.float32))
    for v in ({"C": 1}, {"C": 2}, {"C": 3}, {"C": 2, "cand_stages": 3},
              {"C": 2, "cand_stages": 3, "laneb": 0}):
        cfg = sweep_config(LOWRANK, r, h, k, M, v)
        ms = time_ms(lambda: rc.launch_candidates(x, R1, R2, k, mode=LOWRANK, cfg=cfg), device=dev)
        emit("candidates kernel", cfg=v, ms=ms)
    cfg = sweep_config(LOWRANK, r, h, k, M)
    cand, z = rc.launch_candidates(x, R1, R2, k, mode=LOWRANK, cfg=cfg)
    ms = time_ms(lambda: rc.launch_pick(cand, z, x, R1, k, mode=LOWRANK, cfg=cfg, out=out),
                 device=dev)
    rows, rows_n = rc.launch_pick(cand, z, x, R1, k, mode=LOWRANK, cfg=cfg, out=out)
    emit("pick kernel", cfg=cfg, ms=ms, queued=rows_n.item())
    ms = time_ms(lambda: launch_exact(x, R1, R2, k, mode=LOWRANK, cfg=cfg, out=out, rows=rows,
                                      rows_n=rows_n), device=dev)
    emit("exact sweep of the queued rows", ms=ms, queued=rows_n.item())
    ms = time_ms(lambda: launch_exact(x, R1, R2, k, mode=LOWRANK, cfg=cfg, out=out), device=dev)
    emit("exact sweep of all rows", ms=ms)
    ms = time_ms(lambda: kr.infer(x, R1, R2, k), device=dev)
    emit("whole call", ms=ms)
    from moremoe.kernels import router_train as rt
    from moremoe.kernels._common import ZGIVEN
    from moremoe.kernels.router_topk import launch_sweep
    z = (x @ R2.T).contiguous()
    val, idx, _, m, Z, psum = kr.train_forward(z, R1, k)
    pbar, dval = torch.randn_like(psum), torch.randn_like(val)
    for what, fn in (("train: sweep with m, Z", lambda: launch_sweep(z, R1, k, mode=ZGIVEN,
                                                                        stats=True)),
                     ("train: psum", lambda: rt.launch_psum(z, R1, m, Z, mode=ZGIVEN)),
                     ("train: backward (dz, dR1)", lambda: kr.train_backward(z, R1, m, Z, pbar,
                                                                             idx, dval)),
                     ("train: x R2^T (cuBLAS)", lambda: x @ R2.T)):
        emit(what, ms=time_ms(fn, device=dev))
    path = os.path.join(".anchors", "fast_router.py")
    if os.path.exists(path) and k in (4, 8):
        sys.path.insert(0, ".anchors")
        spec = importlib.util.spec_from_file_location("fast_router", path)
        fast = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fast)
        ms = time_ms(lambda: fast.topcf(x, R2, R1, k, 64, 128, 64, 4, 3, C=2, pf=False, ifr=True),
                     device=dev)
        emit("prototype top2f_ifr 64x128 st3", ms=ms)
        ms = time_ms(lambda: fast.topcf(x, R2, R1, k, 64, 128, 64, 4, 3, floor=True, pf=False,
                                        ifr=True), device=dev)
        emit("prototype skeleton", ms=ms)


if __name__ == "__main__":
    main()
