"""First-call compile time of every router kernel variant (run on the GPU): each
dtype x k x (router, phase) in its own process with an empty Triton cache, timed as the first
call minus the second. One JSON line per variant; the worst is printed last.

    python benchmarks/compile_router.py [--out rows.jsonl] [--workers 8]
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

DTYPES = ["bfloat16", "float16", "float32"]
KS = [1, 2, 4, 8, 16, 64]
KINDS = ["lowrank infer", "linear infer", "lowrank train", "linear train"]

CHILD = r"""
import json, sys, time, torch
from moremoe.kernels import router_linear as kl, router_lowrank as kr
dtype, k, kind = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3]
N, h, M, r = 4096, 512, 8192, 64
x = torch.randn(N, h, device="cuda").to(dtype)
R1 = (torch.randn(M, r, device="cuda") * 0.1).to(dtype)
R2 = (torch.randn(r, h, device="cuda") * 0.1).to(dtype)
W = (torch.randn(M, h, device="cuda") * 0.05).to(dtype)
def call():
    if kind == "lowrank infer":
        kr.infer(x, R1, R2, k)
    elif kind == "linear infer":
        kl.infer(x, W, k)
    else:
        mod, a, b = (kr, x @ R2.T, R1) if kind.startswith("lowrank") else (kl, x, W)
        val, idx, gates, m, Z, psum = mod.train_forward(a, b, k)
        mod.train_backward(a, b, m, Z, torch.ones_like(psum), idx, torch.ones_like(val))
    torch.cuda.synchronize()
times = []
for _ in range(2):
    t = time.perf_counter(); call(); times.append(time.perf_counter() - t)
print(json.dumps({"first_s": times[0], "second_s": times[1], "compile_s": times[0] - times[1]}))
"""


def one(dtype, k, kind):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        proc = subprocess.run([sys.executable, "-c", CHILD, dtype, str(k), kind], env=env,
                              capture_output=True, text=True, timeout=590)
    row = {"dtype": dtype, "k": k, "kind": kind}
    if proc.returncode == 0:
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    else:
        row["error"] = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr else "failed"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    jobs = list(itertools.product(DTYPES, KS, KINDS))
    rows = []
    with ThreadPoolExecutor(args.workers) as pool:
        for row in pool.map(lambda job: one(*job), jobs):
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    done = [r for r in rows if "compile_s" in r]
    worst = max(done, key=lambda r: r["compile_s"]) if done else None
    print(json.dumps({"worst": worst, "variants": len(rows), "failed": len(rows) - len(done),
                      "workers": args.workers}), flush=True)


if __name__ == "__main__":
    main()
