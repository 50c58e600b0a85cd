"""The routing metadata's kernels (kernels/routing_count.py: the counting sort, three launches
where its tile holds the pairs; the sort and count, torch's sort and three launches, at any
size) against the torch ops (about 49 launches, a radix sort among them), timed in one
process on one GPU: the metadata alone at the phonebook pair's, the presets' and the study's
shapes (median of device-event timings after warm-up, and the kernels each launches), then a
phonebook training step of MoE-32, MoRE-96 and MoRE-768 (L = 6, batch 1,024, the CUDA graph
of `bench phonebook`) with routing_meta.COUNTING and SORTED off and on: ms and kernels a
step. Issue 54 parts 2 and 3: do the kernels take the launches off, and are they no slower
where they run. Also pair_order (the routers' sparse dW, PEER) three ways where the counting
sort's tile holds the pairs: is its counting sort slower past COUNTING_MAX_BINS too.

    PYTHONPATH=src python benchmarks/routing_meta_ab.py OUT.jsonl
    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/routing_meta_ab.py OUT.jsonl --quick
        (a CPU check of the script: small shapes in the interpreter, no timing, no step)
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

# (tokens, k, experts): the phonebook's h = 64 pair (a step of 1,024 entries of 16 tokens),
# its pairs over 254 experts (the counting sort's most) and MoRE-768's, a micro-batch of
# 65,536 tokens at k = 1 (past the counting sort's tile), the study's and the presets' M
SHAPES = [(16384, 4, 32), (16384, 4, 96), (16384, 4, 254), (16384, 4, 768), (65536, 1, 128),
          (65536, 4, 256), (65536, 4, 1920), (65536, 4, 8192)]
QUICK_SHAPES = [(600, 4, 32), (600, 4, 300)]
PATHS = {"torch": None, "counting": {"counting": True, "sorting": False},
         "sorted": {"counting": False, "sorting": True}}


def _ids(N: int, k: int, M: int, device) -> torch.Tensor:
    """Random expert ids (N, k), seeded by the shape: every path of a shape sees the same."""
    g = torch.Generator(device=device).manual_seed(N + M)
    return torch.randint(0, M, (N, k), device=device, generator=g, dtype=torch.int32)


def _timed(fn, device) -> dict:
    from moremoe.bench.harness import kernel_profile, time_ms
    return {"ms": time_ms(fn, device=device), **kernel_profile(fn, device=device)}


def metadata_rows(device, quick: bool) -> list[dict]:
    from moremoe.kernels import routing_count
    from moremoe.kernels.routing_meta import routing_meta, routing_meta_torch
    rows = []
    for N, k, M in QUICK_SHAPES if quick else SHAPES:
        idx = _ids(N, k, M, device)
        calls = {name: (lambda: routing_meta_torch(idx, M, 64)) if kw is None else
                 (lambda kw=kw: routing_meta(idx, M, 64, **kw)) for name, kw in PATHS.items()
                 if name != "counting" or routing_count.fits(N * k, M)}
        ref = calls["torch"]()
        for name, fn in calls.items():
            got = fn()
            same = all(torch.equal(getattr(got, f), getattr(ref, f))
                       for f in ("order", "offsets", "block_expert", "block_start"))
            row = {"bench": "routing_meta", "path": name, "N": N, "k": k, "M": M,
                   "fits": routing_count.fits(N * k, M), "same_as_torch": same}
            if not quick:
                row.update(_timed(fn, device))
            rows.append(row)
    return rows


def pair_order_rows(device, quick: bool) -> list[dict]:
    """routing_meta.pair_order (order and offsets only: the routers' sparse dW, PEER) three
    ways where the counting sort's tile holds the pairs: the counting sort (its default on a
    GPU, up to 254 experts), routing_meta's sort and count, and one sort of the ids with M + 1
    binary searches (its path past the tile). Is the counting sort slower past
    COUNTING_MAX_BINS here too, as it is for routing_meta?"""
    from moremoe.kernels import routing_count
    from moremoe.kernels.routing_meta import pair_order, routing_meta
    rows = []
    for N, k, M in QUICK_SHAPES if quick else SHAPES:
        if not routing_count.fits(N * k, M):
            continue
        idx = _ids(N, k, M, device)

        def sorted_meta(idx=idx, M=M):
            meta = routing_meta(idx, M, 64, counting=False, sorting=True)
            return meta.order, meta.offsets
        calls = {"counting": lambda idx=idx, M=M: pair_order(idx, M, kernels=True),
                 "sorted": sorted_meta,
                 "sort_search": lambda idx=idx, M=M: pair_order(idx, M, kernels=False)}
        ref = calls["sort_search"]()
        for name, fn in calls.items():
            got = fn()
            row = {"bench": "pair_order", "path": name, "N": N, "k": k, "M": M,
                   "bins": routing_count.bins(M),
                   "same_as_torch": all(torch.equal(a.long(), b.long())
                                        for a, b in zip(got, ref))}
            if not quick:
                row.update(_timed(fn, device))
            rows.append(row)
    return rows


def step_rows(device) -> list[dict]:
    from moremoe.kernels import routing_meta as rm
    from moremoe.phonebook import bench
    rows = []
    models = ("MoE-32", "MoRE-96", "MoRE-768")
    bench._MODELS.update({k: bench.MODELS[k] for k in models})
    saved = rm.COUNTING, rm.SORTED
    for name in models:
        for counting, sorting in ((False, False), (True, False), (True, True)):
            rm.COUNTING, rm.SORTED = counting, sorting
            try:
                row = bench.measure_step(name, "graph", device, quick=False)
            finally:
                rm.COUNTING, rm.SORTED = saved
            rows.append({"bench": "routing_meta_step", "counting": counting,
                         "sorting": sorting,
                         **{k: v for k, v in row.items() if k != "top_kernels"}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON lines to append to")
    ap.add_argument("--quick", action="store_true", help="CPU check: small shapes, no timing")
    args = ap.parse_args(argv)
    from moremoe.runtime import environment
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        print("error: the A/B times a GPU; on a CPU give --quick (with TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    rows = (metadata_rows(device, args.quick) + pair_order_rows(device, args.quick)
            + ([] if args.quick else step_rows(device)))
    env = environment(device)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **env}) + "\n")
    for r in rows:
        print({k: r.get(k) for k in ("bench", "path", "counting", "sorting", "model", "N", "M",
                                      "bins", "ms", "kernels_per_call", "kernel_time", "kernels",
                                      "same_as_torch")
               if k in r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
