"""Tuning probe for the fused router kernels (run on the GPU): times configurations of the
candidates pass (keys per tile C, tile BM, the one-LOP3 packing, warps and stages) at the
target points, the share of rows the exact sweep redoes, the pass alone, the exact sweep
alone, the prototype and Algorithm 1 of `.anchors/` when present (the anchors of the issue,
copied there to run beside us), and block configurations of the standard router at
h = 2,048. One JSON line per measurement.

    python benchmarks/tune_router.py [--out rows.jsonl] [--only lowrank|linear]
"""
import argparse
import importlib.util
import json
import os
import sys

import torch

from moremoe.bench.harness import ceilings, floor_ms, time_ms
from moremoe.bench.router import Point, op_cost
from moremoe.kernels import router_linear as kl
from moremoe.kernels import router_lowrank as kr
from moremoe.kernels._common import LOWRANK
from moremoe.kernels.router_candidates import launch_candidates, launch_pick
from moremoe.kernels.router_topk import sweep_config
from moremoe.ops import reference as ref
from moremoe.runtime import environment

POINTS = [(512, 4), (2048, 4), (512, 8), (512, 16), (512, 1)]
VARIANTS = {4: [{}, {"cand_stages": 2}, {"cand_stages": 4}, {"BM": 64}, {"C": 0}],
            8: [{}, {"C": 4}, {"cand_stages": 2}],
            16: [{}, {"C": 4}, {"C": 0}],
            1: [{}, {"cand_stages": 2}]}
LINEAR = [{}, {"BM": 128}, {"cand_stages": 3}, {"BH": 128}, {"BN": 64, "num_warps": 4}]


def _anchor(name):
    path = os.path.join(".anchors", f"{name}.py")
    if not os.path.exists(path):
        return None
    sys.path.insert(0, ".anchors")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def emit(rows, out, **row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def lowrank(dev, ceil, rows, out, env):
    fast, alg1 = _anchor("fast_router"), _anchor("paper_alg1")
    for h, k in POINTS:
        p = Point(h=h, k=k)
        g = torch.Generator(device=dev).manual_seed(h)
        x = torch.randn(p.N, h, device=dev, generator=g).bfloat16()
        R1 = (torch.randn(p.M, p.r, device=dev, generator=g) * 0.1).bfloat16()
        R2 = (torch.randn(p.r, h, device=dev, generator=g) * 0.1).bfloat16()
        fl = floor_ms(*op_cost(p, "lowrank", False), ceil)
        base = dict(h=h, M=p.M, r=p.r, k=k, N=p.N, floor_ms=fl, **env)
        exact = kr.infer(x, R1, R2, k, config={"C": 0})[1]
        for v in VARIANTS[k]:
            cfg = sweep_config(LOWRANK, p.r, h, k, p.M, v)
            try:
                ms = time_ms(lambda: kr.infer(x, R1, R2, k, config=v), device=dev)
                same = torch.equal(kr.infer(x, R1, R2, k, config=v)[1], exact)
                pass_ms, share = None, 1.0
                if cfg["C"]:
                    outs = tuple(torch.empty(p.N, k, device=dev, dtype=dt)
                                 for dt in (torch.float32, torch.int32, torch.float32))
                    cand, z = launch_candidates(x, R1, R2, k, mode=LOWRANK, cfg=cfg)
                    share = launch_pick(cand, z, x, R1, k, mode=LOWRANK, cfg=cfg,
                                        out=outs)[1].item() / p.N
                    pass_ms = time_ms(lambda: launch_candidates(x, R1, R2, k, mode=LOWRANK,
                                                                cfg=cfg), device=dev)
                emit(rows, out, impl="moremoe", variant=v, cfg=cfg, ms=ms, x_floor=ms / fl,
                     same_as_exact=same, candidates_ms=pass_ms, redo_share=share, **base)
            except Exception as err:  # one bad config must not stop the run
                emit(rows, out, impl="moremoe", variant=v, error=repr(err)[:300], **base)
        emit(rows, out, impl="unfused", ms=time_ms(
            lambda: torch.softmax(ref.router_lowrank_ref(x, R1, R2, k)[0], -1), device=dev),
            **base)
        if fast is not None and k in (4, 8):
            for st, bm in ((3, 128), (4, 128), (3, 64)):
                ms = time_ms(lambda: fast.topcf(x, R2, R1, k, 64, bm, 64, 4, st, C=2, pf=False,
                                                ifr=True), device=dev)
                emit(rows, out, impl="prototype", cfg=dict(BM=bm, stages=st), ms=ms, **base)
            ms = time_ms(lambda: fast.topcf(x, R2, R1, k, 64, 128, 64, 4, 3, floor=True,
                                            pf=False, ifr=True), device=dev)
            emit(rows, out, impl="prototype skeleton (loads+MMA+pack+max)", ms=ms, **base)
        if alg1 is not None and k == 4:
            ms = time_ms(lambda: alg1.alg1(x, R2, R1, k, 64, 128, 64, 4), device=dev)
            emit(rows, out, impl="anchor alg1 64x128", ms=ms, **base)
        del x, R1, R2
        torch.cuda.empty_cache()


def linear(dev, ceil, rows, out, env):
    for h in (2048, 1024, 512):
        p = Point(h=h)
        g = torch.Generator(device=dev).manual_seed(7)
        x = torch.randn(p.N, h, device=dev, generator=g).bfloat16()
        W = (torch.randn(p.M, h, device=dev, generator=g) * 0.05).bfloat16()
        fl = floor_ms(*op_cost(p, "linear", False), ceil)
        base = dict(h=h, M=p.M, k=p.k, N=p.N, floor_ms=fl, **env)
        emit(rows, out, impl="cuBLAS x W^T (bf16 out)", ms=time_ms(lambda: x @ W.T, device=dev),
             **base)
        emit(rows, out, impl="unfused", ms=time_ms(
            lambda: torch.softmax(ref.router_linear_ref(x, W, p.k)[0], -1), device=dev), **base)
        for v in LINEAR if h == 2048 else LINEAR[:3]:
            try:
                ms = time_ms(lambda: kl.infer(x, W, p.k, config=v), device=dev)
                emit(rows, out, impl="moremoe linear", variant=v, ms=ms, x_floor=ms / fl, **base)
            except Exception as err:
                emit(rows, out, impl="moremoe linear", variant=v, error=repr(err)[:300], **base)
        del x, W
        torch.cuda.empty_cache()


def training(dev, ceil, rows, out, env):
    from moremoe.bench.router import measure
    for router, h in (("lowrank", 512), ("linear", 512), ("linear", 2048)):
        for impl in ("triton", "reference"):
            row = measure(Point(h=h), router, impl, True, dev, ceil)
            emit(rows, out, what="training step", **{k: v for k, v in row.items()
                                                     if k not in env}, **env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["lowrank", "linear", "training"], default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = environment(dev)
    ceil = ceilings(dev)
    rows = []
    emit(rows, args.out, ceilings=ceil, **env)
    if args.only in (None, "lowrank"):
        lowrank(dev, ceil, rows, args.out, env)
    if args.only in (None, "linear"):
        linear(dev, ceil, rows, args.out, env)
    if args.only in (None, "training"):
        training(dev, ceil, rows, args.out, env)


if __name__ == "__main__":
    main()
