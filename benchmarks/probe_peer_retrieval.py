"""PEER's product-key retrieval alone (kernels/peer_retrieval.py) at the paper's size: the
queries of N tokens × 8 heads (d_q = 32, bf16) against two 388 × 16 sub-key tables, top κ =
56 (the paper's reading) and 4 (the inference one). Times the kernel's block choices (BT rows
a program, warps), the torch path (ops/peer_retrieval.peer_retrieval_ref: the two (N, H, R)
score tables, topk, the pruned grid) and the kernel's forward + backward (d q and d keys)
beside the torch path's; each row with its floor (q read, scores and ids written, at the
measured copy rate) and whether the kernel's ids equal the torch path's (a fraction of rows:
near-ties in bf16 may differ). One JSON line per point.

    PYTHONPATH=src python benchmarks/probe_peer_retrieval.py [--tokens 65536,262144] [--out F]
"""
import argparse
import json

import torch

from moremoe.bench.harness import ceilings, free, time_ms
from moremoe.kernels import peer_retrieval as kr
from moremoe.ops.peer_retrieval import peer_retrieval, peer_retrieval_ref
from moremoe.runtime import environment

BLOCKS = ({"BT": 16, "num_warps": 4}, {"BT": 16, "num_warps": 8}, {"BT": 32, "num_warps": 4},
          {"BT": 32, "num_warps": 8})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="65536,262144")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    env, ceil = environment(dev), ceilings(dev)
    rows = []
    for N in map(int, args.tokens.split(",")):
        for kappa in (56, 4):
            g = torch.Generator(device=dev).manual_seed(N)
            q = torch.randn(N, 8, 32, device=dev, generator=g).bfloat16()
            keys = torch.randn(2, 388, 16, device=dev, generator=g).bfloat16()
            nbytes = N * 8 * (32 * 2 + kappa * 12)
            base = {**env, "N": N, "kappa": kappa, "bytes": nbytes,
                    "floor_ms": 1e3 * nbytes / ceil["copy_bytes_per_s"]}
            ref_ids = peer_retrieval_ref(q, keys, kappa)[1].sort(-1).values
            for blocks in BLOCKS:
                fn = lambda b=blocks: kr.retrieve(q.view(N * 8, 32), keys, kappa, blocks=b)
                ids = fn()[1].view(N, 8, kappa).sort(-1).values
                same = (ids == ref_ids).all(-1).float().mean().item()
                rows.append({**base, "variant": f"kernel BT{blocks['BT']} w{blocks['num_warps']}",
                             "phase": "forward", "ms": time_ms(fn, device=dev),
                             "rows_same_as_torch": same})
            rows.append({**base, "variant": "torch", "phase": "forward",
                         "ms": time_ms(lambda: peer_retrieval_ref(q, keys, kappa), device=dev)})
            for impl in ("triton", "reference"):
                ql, kl = q.clone().requires_grad_(), keys.clone().requires_grad_()

                def step():
                    ql.grad = kl.grad = None
                    scores, _ = peer_retrieval(ql, kl, kappa, impl=impl)
                    scores.float().sum().backward()
                try:
                    ms = time_ms(step, device=dev)
                except torch.OutOfMemoryError:
                    ms = None
                rows.append({**base, "variant": "kernel" if impl == "triton" else "torch",
                             "phase": "forward+backward", "ms": ms})
                free(dev)
            del q, keys
            free(dev)
            for r in rows[-7:]:
                print(json.dumps({k: r.get(k) for k in ("N", "kappa", "variant", "phase", "ms",
                                                        "floor_ms", "rows_same_as_torch")}))
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
