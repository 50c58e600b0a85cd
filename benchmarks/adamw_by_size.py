"""Where the split AdamW update should switch (issue 36, part 6): torch's fused AdamW against
the one-pass Triton update (ops/adamw.py, fp32 moments), both with the clip folded in
(clipped_step), timed with CUDA events (median of REPS after WARMUP) in one call:

  by size     tensors of 2^18 .. 2^26 elements, as many as make 2^27 elements (at most 512),
              each implementation over the whole set: ms, ns an element and GB/s at the
              bytes each moves (fused 36 a parameter: it writes the scaled gradient back;
              one-pass 32), beside the device's copy bandwidth measured in the same run
  presets     the real parameter sets of MoE-256 and MoRE-1792 (random gradients) under
              SplitAdamW with its threshold at 2^22 (today's), 2^23, 2^24, 2^25 and 2^27,
              and torch's fused AdamW for every tensor

    PYTHONPATH=src python benchmarks/adamw_by_size.py OUT.jsonl [--preset NAME ...]

Writes one JSON row a measurement and prints both tables; the threshold to take is the
fastest split of each preset. Needs a CUDA GPU; MoRE-1792's fp32 weights, gradients and
moments take about 38 GB."""
from __future__ import annotations

import argparse
import json

import torch

from moremoe.bench.harness import time_fixed_ms
from moremoe.runtime import environment
from moremoe.training.optim import LowPrecisionAdamW, SplitAdamW, clipped_step

WARMUP, REPS = 3, 15
KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
BYTES = {"fused": 36, "one-pass": 32}           # per parameter: p, g, m, v read and written


def _tensors(shapes, dev):
    ps = [torch.nn.Parameter(torch.empty(s, device=dev).normal_(std=0.02)) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def _timer(opt, ps, dev):
    grads = [p.grad for p in ps]
    norm = torch.ones((), device=dev) * 2.0            # a clip that scales (coefficient 0.5)
    return time_fixed_ms(lambda: clipped_step(opt, grads, norm, 1.0), device=dev,
                         warmup=WARMUP, reps=REPS)


def _copy_gbs(dev) -> float:
    a = torch.empty(1 << 28, device=dev)
    b = torch.empty_like(a)
    ms = time_fixed_ms(lambda: b.copy_(a), device=dev, warmup=WARMUP, reps=REPS)
    return 2 * a.numel() * 4 / ms / 1e6


def by_size(dev, env) -> list[dict]:
    rows = []
    for log2 in range(18, 27):
        count = max(1, min(512, (1 << 27) >> log2))
        ps = _tensors([(1 << log2,)] * count, dev)
        for impl in ("fused", "one-pass"):
            opt = (torch.optim.AdamW(ps, fused=True, **KW) if impl == "fused" else
                   LowPrecisionAdamW(ps, moment_dtype=torch.float32, **KW))
            ms = _timer(opt, ps, dev)
            n = count << log2
            rows.append({"bench": "adamw_by_size", "log2_elements": log2, "tensors": count,
                         "impl": impl, "ms": ms, "ns_per_element": ms * 1e6 / n,
                         "gbs": BYTES[impl] * n / ms / 1e6, **env})
            del opt
        del ps
        torch.cuda.empty_cache()
    return rows


def presets(names, dev, env) -> list[dict]:
    from moremoe.model import Transformer
    from moremoe.training.presets import get_preset
    rows = []
    for name in names:
        with torch.device("meta"):
            model = Transformer(get_preset(name).model.transformer_config(50257))
        ps = _tensors([p.shape for p in model.parameters()], dev)
        for big in (22, 23, 24, 25, 27, None):
            opt = (torch.optim.AdamW(ps, fused=True, **KW) if big is None
                   else SplitAdamW(ps, **KW))
            if big is not None:
                opt.BIG = 1 << big
            rows.append({"bench": "adamw_split", "preset": name,
                         "split_at_log2": big, "ms": _timer(opt, ps, dev),
                         "one_pass_tensors": 0 if big is None else
                         sum(p.numel() >= (1 << big) for p in ps), **env})
            del opt
        del ps
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", action="append",
                    help="a preset's parameter set (default: h512-s64-moe256 and "
                         "h512-s64-more1792)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    env = environment(dev)
    copy = _copy_gbs(dev)
    rows = by_size(dev, env) + presets(args.preset or ["h512-s64-moe256",
                                                       "h512-s64-more1792"], dev, env)
    for row in rows:
        row["copy_gbs"] = copy
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"copy bandwidth {copy:,.0f} GB/s\n\n2^n elements  tensors  fused ms  one-pass ms"
          f"  one-pass / fused")
    sized = {(r["log2_elements"], r["impl"]): r for r in rows if r["bench"] == "adamw_by_size"}
    for log2 in range(18, 27):
        f, o = sized[log2, "fused"], sized[log2, "one-pass"]
        print(f"{log2:>12}  {f['tensors']:>7}  {f['ms']:>8.3f}  {o['ms']:>11.3f}  "
              f"{o['ms'] / f['ms']:>16.2f}")
    print("\npreset              split at 2^n (None: fused for all)  ms")
    for r in rows:
        if r["bench"] == "adamw_split":
            print(f"{r['preset']:<20}{str(r['split_at_log2']):>34}  {r['ms']:.3f}")


if __name__ == "__main__":
    main()
