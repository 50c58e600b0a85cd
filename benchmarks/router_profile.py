"""Where the one-pass router's time goes, beside the prototype's (issue 54 part 1: "find out,
with the profiler and the prototype side by side, where the prototype's time goes that ours
does not"). One GPU, bf16, r = 64, N = 262,144, the inputs of the prototype's own harness.

Each variant of each shape is timed (median of CUDA-event timings after warm-up) and
profiled by kernel (torch.profiler: the one-pass kernel against the exact sweep of its queued
rows, the queue's memset and anything else a call launches). The variants leave one thing
out or change one setting, so that differences place the time:

  ours              the default (moremoe.kernels.router_lowrank.infer)
  ours_keys2/keys4  two / four keys a tile (the schedule picks four up to 16 tiles, 56 at k = 8)
  ours_bm32/64/128  32-, 64-, 128-expert tiles (the default: 64 up to M = 512, at k = 4
                    for 2,048 < M <= 4,096 and at k = 8 for 7,168 < M <= 8,192, else 128)
  ours_bm64_keys2   a tile width and the keys a tile together (bm64 / bm128 x keys2 / keys4)
  ours_zmasks       the z projection's loads masked on h and the rank even where H % BH == 0
                    and r == BR (the default leaves those masks out: config z_even)
  ours_queue1       the queued rows' exact sweep unsplit (the default splits it over the
                    experts, up to 16 ways)
  ours_qwide        the queued rows' sweep launched one program a possible block (at most
                    16 splits x 64 + (N - 4,096) / 64 at N = 262,144) instead of two a part
                    an SM walking the blocks: the idle programs' waves
  ours_eager2       the prototype's schedule: 128-expert tiles, two keys a tile, the rounds
                    right after each tile while a row's second key enters
  ours_noreg        no register bound (the launch's maxnreg)
  ours_stages2/4    the pipeline depth of the tile loop
  ours_exact3/4     the pipeline depth of the queued rows' exact sweep (default 2: at h = 2,048
                    its z loop is 32 serial h-chunks a program); ours_stages4_exact4 both
  proto             the prototype's best (top-2 a tile, in-flight rounds, BM 128, 3 stages)
  proto_floor       the prototype's z and one max a tile: the selection left out (at k = 1
                    the bare sweep: ours / it - 1 is k = 1's exactness cost)

With --ncu the script only warms every variant up and then runs each once between
cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off`
(benchmarks/router_ncu.sh). The prototype is not part of the repository: --anchors names the
folder that holds fast_router.py (copy ../shared/anchors and carry it).

  PYTHONPATH=src python benchmarks/router_profile.py --anchors runs/anchors OUT.jsonl
  TRITON_INTERPRET=1 ... --rows 256 --shapes 64:256:4   a CPU dry run of the harness
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from moremoe import runtime
from moremoe.bench import harness
from moremoe.kernels import router_lowrank as kr

OURS = {"ours": {}, "ours_keys2": {"tile_keys": 2}, "ours_keys4": {"tile_keys": 4},
        "ours_bm64": {"BM": 64}, "ours_bm128": {"BM": 128}, "ours_bm32": {"BM": 32},
        "ours_bm64_keys2": {"BM": 64, "tile_keys": 2},
        "ours_bm64_keys4": {"BM": 64, "tile_keys": 4},
        "ours_bm128_keys2": {"BM": 128, "tile_keys": 2},
        "ours_bm128_keys4": {"BM": 128, "tile_keys": 4},
        "ours_noreg": {"maxnreg": 0}, "ours_zmasks": {"z_even": False},
        "ours_stages2": {"cand_stages": 2}, "ours_stages4": {"cand_stages": 4},
        "ours_exact3": {"num_stages": 3}, "ours_exact4": {"num_stages": 4},
        "ours_stages4_exact4": {"cand_stages": 4, "num_stages": 4},
        "ours_queue1": {"queue_splits": 1}, "ours_qwide": {"queue_programs": 10 ** 6},
        "ours_eager2": {"BM": 128, "tile_keys": 2, "rounds": "eager"}}


def load_prototype(folder: str):
    path = Path(folder) / "fast_router.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; copy ../shared/anchors/*.py into "
                         f"{folder} (--anchors) and carry it")
    spec = importlib.util.spec_from_file_location("fast_router", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(N: int, h: int, M: int, r: int, device, dtype):
    """The prototype harness's inputs: x ~ N(0, 1), R2 and R1 ~ 0.05 N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(h)
    x = torch.randn(N, h, device=device, generator=g).to(dtype)
    R2 = (torch.randn(r, h, device=device, generator=g) * 0.05).to(dtype)
    g = torch.Generator(device=device).manual_seed(1000 + M)
    R1 = (torch.randn(M, r, device=device, generator=g) * 0.05).to(dtype)
    return x, R2, R1


def variants(k: int, proto) -> dict:
    out = {name: (lambda x, R2, R1, c=cfg: kr.infer(x, R1, R2, k, config={"path": "buffer",
                                                                          **c}))
           for name, cfg in OURS.items() if not (name.endswith("keys4") and k < 3)}
    if proto is not None and k in (4, 8):
        out["proto"] = lambda x, R2, R1: proto.topcf(x, R2, R1, k, 64, 128, 64, 4, 3, C=2,
                                                     pf=False, ifr=True)
    if proto is not None:      # z and one max a tile, whatever k: at k = 1 the bare sweep
        kf = max(k, 4)         # that ours adds exactness to (issue 54: its cost <= 5 %)
        out["proto_floor"] = lambda x, R2, R1: proto.topcf(x, R2, R1, kf, 64, 128, 64, 4, 3,
                                                           floor=True, pf=False, ifr=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="JSON lines to append the rows to")
    ap.add_argument("--anchors", default="runs/anchors", help="folder of fast_router.py "
                    "(default runs/anchors; '' leaves the prototype out)")
    ap.add_argument("--shapes", default="512:512:4,512:8192:4,512:8192:1",
                    help="h:M:k comma list (default 512:512:4,512:8192:4,512:8192:1)")
    ap.add_argument("--rows", type=int, default=262144, help="N (default 262,144)")
    ap.add_argument("--rank", type=int, default=64, help="r (default 64)")
    ap.add_argument("--variants", default="",
                    help="comma list of the variants to run (default all)")
    ap.add_argument("--ncu", action="store_true", help="warm up, then one call of each "
                    "variant between cudaProfilerStart/Stop (for ncu)")
    a = ap.parse_args(argv)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    device = torch.device("cpu" if interpret else "cuda")
    dtype = torch.float32 if interpret else torch.bfloat16
    proto = load_prototype(a.anchors) if a.anchors else None
    shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    meta = runtime.environment(device)
    rows = []
    for h, M, k in shapes:
        x, R2, R1 = inputs(a.rows, h, M, a.rank, device, dtype)
        fns = variants(k, proto)
        if a.variants:
            wanted = a.variants.split(",")
            unknown = sorted(set(wanted) - set(fns))
            if unknown:
                ap.error(f"--variants: unknown {unknown} at k={k}; expected some of "
                         f"{sorted(fns)}")
            fns = {name: fn for name, fn in fns.items() if name in wanted}
        for fn in fns.values():      # compile every variant first
            fn(x, R2, R1)
        if a.ncu:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for fn in fns.values():
                fn(x, R2, R1)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(json.dumps({"ncu": list(fns), "h": h, "M": M, "k": k}), flush=True)
            continue
        for name, fn in fns.items():
            row = {"bench": "router_profile", "variant": name, "h": h, "M": M, "k": k,
                   "N": a.rows, "r": a.rank, "dtype": str(dtype).replace("torch.", "")}
            row["ms"] = harness.time_ms(lambda: fn(x, R2, R1), device=device)
            row.update(harness.kernel_profile(lambda: fn(x, R2, R1), device=device, top=6))
            row.update(meta)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:                    # as measured: a call cut short keeps its rows
                harness.append_jsonl(a.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
