"""Where the expert forward's time goes, and the variants against it (run on the GPU):

- forward at s = 64, h = 512, M = 8,192, N = 262,144, k = 4, bf16: the two kernels + combine
  (default), the one-kernel forward (act on chip) with pair rows, and with fp32 atomics
  (opt-in, not deterministic); each kernel of the default timed alone; the floor (x read
  once, y written once, the weights) and the expert-major floor (x gathered per slot, pair
  rows written and read) at the measured copy rate;
- routing metadata at decode sizes (N·k = 4 … 1,024, M = 8,192): the one-launch kernel
  against the torch ops, GPU time (CUDA-graph replay) and host time per call (eager).

    PYTHONPATH=src python benchmarks/probe_experts.py --out results.jsonl
"""
import argparse
import json
import time

import torch
import triton

from moremoe.bench.harness import ceilings, time_ms
from moremoe.bench.layer import _graph_or_plain
from moremoe.kernels import swiglu_experts as mg
from moremoe.kernels.routing_meta import routing_meta, routing_meta_torch
from moremoe.runtime import environment
from tune_experts import setup          # the same inputs as the tuning probe (benchmarks/)


def graph_ms(fn, dev):
    return time_ms(_graph_or_plain(fn, dev), device=dev)


def host_ms(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (t1 - t0) / reps


def forward_rows(dev, ceil):
    N, h, s, M, k = 262144, 512, 64, 8192, 4
    x, gates, idx, ws = setup(N, h, s, M, k, dev)
    c = mg.config(h, s)
    meta = routing_meta(idx, M, c["BM"])
    P, copy = N * k, ceil["copy_bytes_per_s"]
    floor = 2 * (2 * N * h + 3 * M * h * s) / copy * 1e3
    expert_major = 2 * (P * h + 3 * M * h * s + 2 * P * h + N * h) / copy * 1e3
    yield {"what": "floor", "ms": floor, "expert_major_floor_ms": expert_major}
    for name, kw in (("two_kernels", {"cfg": {"fused": False}}),
                     ("one_kernel", {"cfg": {"fused": True}}),
                     ("one_kernel_atomic", {"cfg": {"fused": True}, "combine": "atomic"})):
        ms = time_ms(lambda: mg.forward(x, gates, idx, *ws, meta=meta, **kw), device=dev)
        yield {"what": "forward", "variant": name, "ms": ms, "to_floor": ms / floor}
    # the default forward's kernels alone
    gf = gates.reshape(-1).contiguous()
    act = torch.empty(P, s, device=dev, dtype=x.dtype)
    out = torch.empty(P, h, device=dev, dtype=x.dtype)
    args = (meta.block_expert, meta.block_start, meta.offsets, meta.order)
    blk = mg._launch(c)
    B = meta.max_blocks
    parts = {
        "gate_up": lambda: mg._gate_up_kernel[(B, triton.cdiv(s, c["BS"]), 1)](
            x, ws[0], ws[1], act, act, act, *args, h, s, k, P, h, x.stride(0),
            *ws[0].stride(), SAVE=False, SPLIT=False, **blk),
        "down": lambda: mg._down_kernel[(B, triton.cdiv(h, c["BH"]))](
            act, act, act, ws[2], gf, out, *args, h, s, P, 1, *ws[2].stride(), SPLIT=False,
            **blk),
        "combine": lambda: mg._combine(out, N, k, h, x.dtype),
        "routing_meta": lambda: routing_meta(idx, M, c["BM"]),
        "sort_int64": lambda: torch.sort(idx.reshape(-1).long(), stable=True),
        "sort_int32": lambda: torch.sort(idx.reshape(-1), stable=True)}
    for name, fn in parts.items():
        yield {"what": "part", "variant": name, "ms": time_ms(fn, device=dev)}


def decode_rows(dev):
    """The forward at decode sizes, GPU time of a CUDA-graph replay (metadata included)."""
    s, M, k = 64, 8192, 4
    for h, N in ((512, 4), (512, 16), (512, 64), (512, 256), (4096, 4), (4096, 16),
                 (4096, 64), (4096, 256)):
        x, gates, idx, ws = setup(N, h, s, M, k, dev)
        for name, cfg in (("two_kernels", {"fused": False, "split_h": 1}),
                          ("two_kernels_split_h", {"fused": False}),
                          ("one_kernel", {"fused": True}), ("default", {})):
            ms = graph_ms(lambda: mg.forward(x, gates, idx, *ws, cfg=cfg), dev)
            yield {"what": "decode_forward", "variant": name, "h": h, "N": N, "ms": ms}


def meta_rows(dev):
    M = 8192
    for P in (4, 16, 64, 256, 1024):
        idx = torch.randint(0, M, (P // 4, 4), device=dev, dtype=torch.int32)
        for name, fn in (("one_launch", routing_meta), ("torch_ops", routing_meta_torch)):
            call = (lambda f=fn: f(idx, M, 64))
            yield {"what": "routing_meta", "variant": name, "pairs": P, "M": M,
                   "gpu_ms": graph_ms(call, dev), "host_ms": host_ms(call)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="forward,decode,meta",
                    help="comma list of forward (and its kernels), decode, meta")
    args = ap.parse_args()
    dev = torch.device("cuda")
    env, ceil = environment(dev), ceilings(dev)
    out = open(args.out, "a") if args.out else None
    parts = {"forward": lambda: forward_rows(dev, ceil), "decode": lambda: decode_rows(dev),
             "meta": lambda: meta_rows(dev)}
    for row in (r for name in args.only.split(",") for r in parts[name]()):
        row = {**row, **env, **{f"ceiling_{k}": v for k, v in ceil.items()}}
        print(json.dumps({k: v for k, v in row.items() if k not in env}), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
