"""Tuning probe for the grouped SwiGLU expert kernels (run on the GPU): times block
configurations (BM rows, BS / BH chunks, warps, pipeline stages) of the forward and the
backward at several (h, s) with N = 262,144, k = 4, M = 8,192, bf16, against the floor
(FLOPs / measured matmul rate or bytes / measured copy bandwidth, each input read once and
each output written once), and the combine kernel alone.

    python benchmarks/tune_experts.py [--out results.jsonl]

--dw instead times the backward at the training shapes of the h = 512 pair (16,384 tokens a
micro-batch, k = 4, MoE-256 s = 64 and MoRE-1792 s = 56, bf16 activations, fp32 weights as
under autocast) over the weight-gradient kernel's own tiles (config keys dw_*), the rest of
the backward fixed: the row with the default dw_* is the baseline.
"""
import argparse
import json
import sys

import torch

from moremoe.bench.harness import ceilings, floor_ms, time_ms
from moremoe.runtime import environment
from moremoe.kernels import swiglu_experts

CONFIGS = [dict(BM=bm, BS=bs, BH=bh, num_warps=w, num_stages=st)
           for bm, bs, bh, w, st in (
               (64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (64, 64, 128, 4, 3),
               (64, 64, 128, 8, 4), (128, 64, 64, 4, 3), (128, 64, 64, 8, 3),
               (128, 64, 128, 8, 3), (128, 64, 128, 4, 3), (128, 128, 64, 8, 3),
               (128, 64, 64, 8, 4), (128, 32, 128, 8, 3), (64, 32, 128, 4, 4))]
SHAPES = [(512, 64), (128, 64), (2048, 64), (4096, 64), (512, 128), (512, 512)]


def setup(N, h, s, M, k, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, h, device=dev, generator=g).bfloat16()
    # uniform random experts (a repeated expert within a row is rare and harmless to timing)
    idx = torch.randint(0, M, (N, k), device=dev, generator=g)
    gates = torch.softmax(torch.randn(N, k, device=dev, generator=g), -1)
    ws = [(torch.randn(*shape, device=dev, generator=g) * 0.05).bfloat16()
          for shape in ((M, s, h), (M, s, h), (M, h, s))]
    return x, gates, idx.int(), ws


DW_CONFIGS = [None] + [dict(dw_BR=br, dw_BS=bs, dw_BH=bh, dw_warps=w, dw_stages=st)
                       for br in (32, 64, 128) for bs, bh in ((64, 64), (64, 128), (32, 128),
                                                              (64, 256))
                       for w in (4, 8) for st in (2, 3)]
DW_SHAPES = [(16384, 512, 64, 256), (16384, 512, 56, 1792)]      # N tokens, h, s, M


def tune_dw(out, env, dev):
    k = 4
    for N, h, s, M in DW_SHAPES:
        x, gates, idx, ws = setup(N, h, s, M, k, dev)
        ws = [w.float() for w in ws]
        meta = swiglu_experts.routing_meta(idx, M, swiglu_experts.config(h, s)["BM"])
        y, act, xg, xu = swiglu_experts.forward(x, gates, idx, *ws, save=True, meta=meta)
        dy = torch.randn_like(y)
        base, best = None, None
        for cfg in DW_CONFIGS:
            row = {"phase": "dw", "h": h, "s": s, "N": N, "M": M, "k": k,
                   **swiglu_experts.config(h, s, cfg), "default": cfg is None, **env}
            try:
                row["bwd_ms"] = time_ms(lambda: swiglu_experts.backward(dy, x, gates, idx, *ws, act,
                                                                  g, u, cfg=cfg, meta=meta),
                                        device=dev)
            except Exception as err:               # out of shared memory / registers
                row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if "bwd_ms" not in row:
                print(f"M={M} s={s} {cfg}: {row['error']}", flush=True)
                continue
            base = row["bwd_ms"] if cfg is None else base
            if best is None or row["bwd_ms"] < best[0]:
                best = (row["bwd_ms"], cfg)
            print(f"M={M} s={s} {cfg or 'default'}: backward {row['bwd_ms']:.3f} ms "
                  f"({row['bwd_ms'] / base:.2f}x default)", flush=True)
        print(f"BEST dw M={M} s={s}: {best[0]:.3f} ms vs default {base:.3f} ms: {best[1]}",
              flush=True)
        del x, gates, idx, ws, y, act, xg, xu, dy


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="append JSON rows to this file")
    ap.add_argument("--N", type=int, default=262144)
    ap.add_argument("--M", type=int, default=8192)
    ap.add_argument("--dw", action="store_true",
                    help="sweep the weight-gradient tiles at the training shapes instead")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil, env = ceilings(dev), environment(dev)
    out = open(args.out, "a") if args.out else None
    if args.dw:
        tune_dw(out, env, dev)
        return 0
    N, M, k = args.N, args.M, 4
    for h, s in SHAPES:
        x, gates, idx, ws = setup(N, h, s, M, k, dev)
        fwd_flops = 6 * N * k * h * s
        fwd_bytes = 2 * (2 * N * h) + 2 * 3 * M * h * s
        bwd_bytes = 2 * (3 * N * h) + 2 * 2 * 3 * M * h * s
        best = {}
        for cfg in CONFIGS:
            if cfg["BS"] > s:
                continue
            row = {"h": h, "s": s, "N": N, "M": M, "k": k, **cfg, **env}
            try:
                # the backward reuses the forward's routing metadata, as in training
                meta = swiglu_experts.routing_meta(idx, M, swiglu_experts.config(h, s, cfg)["BM"])
                y, act, xg, xu = swiglu_experts.forward(x, gates, idx, *ws, save=True, cfg=cfg,
                                                meta=meta)
                dy = torch.randn_like(y)
                row["fwd_ms"] = time_ms(lambda: swiglu_experts.forward(x, gates, idx, *ws, cfg=cfg),
                                        device=dev)
                row["bwd_ms"] = time_ms(lambda: swiglu_experts.backward(dy, x, gates, idx, *ws, act,
                                                                  g, u, cfg=cfg, meta=meta),
                                        device=dev)
                row["fwd_floor"] = floor_ms(fwd_flops, fwd_bytes, ceil)
                row["bwd_floor"] = floor_ms(2 * fwd_flops, bwd_bytes, ceil)
                del y, act, xg, xu, dy
            except Exception as err:               # out of shared memory / registers
                row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
            torch.cuda.empty_cache()
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            if "fwd_ms" in row:
                for ph in ("fwd", "bwd"):
                    if row[f"{ph}_ms"] < best.get(ph, (1e9,))[0]:
                        best[ph] = (row[f"{ph}_ms"], cfg)
                print(f"h={h} s={s} {cfg}: fwd {row['fwd_ms']:.3f} ms "
                      f"({row['fwd_ms'] / row['fwd_floor']:.2f}x floor) bwd "
                      f"{row['bwd_ms']:.3f} ms ({row['bwd_ms'] / row['bwd_floor']:.2f}x)",
                      flush=True)
            else:
                print(f"h={h} s={s} {cfg}: {row['error']}", flush=True)
        print(f"BEST h={h} s={s}: {best}", flush=True)
        del x, gates, idx, ws
    # the combine alone: reads k pair rows per token, writes one
    for h in (512, 4096):
        pairs = torch.randn(N * k, h, device=dev).bfloat16()
        ms = time_ms(lambda: swiglu_experts._combine(pairs, N, k, h, torch.bfloat16), device=dev)
        nbytes = 2 * (N * k * h + N * h)
        print(f"combine h={h}: {ms:.3f} ms, {nbytes / ms / 1e9:.0f} GB/s "
              f"({nbytes / ceil['copy_bytes_per_s'] * 1e3:.3f} ms at the copy rate)")
        del pairs
    return 0


if __name__ == "__main__":
    sys.exit(main())
