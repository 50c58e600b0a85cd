"""The paper's PEER table (Appendix B) with the layers as they are: one layer's forward and
forward + backward at matched active FLOPs, MoRE-1792 (s' = 56, k = 4, r = 64, h = 512)
against PEER-388² (H = 8, d_q = 32, kappa = 56 in the paper's reading, 4 in the inference
one) and MoE-256 (s = 64), at 4,096 ... 262,144 tokens, on the GPU: the forward with bf16
weights, the forward + backward with fp32 weights under bf16 autocast (as in training).

PEER's expert stage gathers k = H kappa rows of u and of v per token (2 k h bf16 values): its
memory floor, N k h 4 bytes at the measured copy rate (3x that with the backward, which reads
both rows again and writes their gradients), is reported beside each PEER row: the time no
expert kernel of PEER's could beat, so the MoRE/PEER ratio at it is PEER's best case. A point that does not fit in memory is an
"error" row. One JSON line per (layer, tokens, pass).

PEER runs its torch path here (impl="reference": the gathered u rows and an embedding bag),
as the committed probe rows measured it; `moremoe bench peer` (bench/peer.py) times the fused
expert kernels beside it and supersedes this probe.

    PYTHONPATH=src python benchmarks/probe_peer.py [--tokens 4096,16384] [--out rows.jsonl]
"""
import argparse
import json

import torch

from moremoe.accounting import peer_match
from moremoe.bench.harness import bf16_on, ceilings, free, time_ms
from moremoe.nn.moe import MoEConfig, MoELayer
from moremoe.nn.peer import PEERConfig, PEERLayer
from moremoe.runtime import environment


def layers(device, reading: str, train: bool):
    """bf16 weights for the forward (inference); fp32 weights under bf16 autocast for the
    forward + backward, as the trainer runs them (PEER's embedding-bag backward has no bf16
    CUDA kernel)."""
    match = peer_match(1792, 4, 512, 56, 64)
    kappa = match[reading]["topk_per_head"]
    with (torch.device(device) if train else bf16_on(device)):
        return {
            "more1792": MoELayer(MoEConfig.more(1792, 4, 512, 56, 64)),
            "moe256": MoELayer(MoEConfig.moe(256, 4, 512, 64)),
            f"peer{match['experts']}-k{kappa}": PEERLayer(PEERConfig(
                experts=match["experts"], hidden=512, heads=8, d_q=32, kappa=kappa,
                impl="reference")),
        }


def point(name, pair, N, device, ceil) -> list[dict]:
    rows = []
    x = torch.randn(N, 512, device=device, dtype=torch.bfloat16)
    for phase, layer in zip(("forward", "forward+backward"), pair):
        row = {"layer": name, "tokens": N, "pass": phase}
        try:
            layer.train(phase != "forward")
            xg = x.detach().requires_grad_(phase != "forward")
            if phase == "forward":
                def fn():
                    with torch.no_grad():
                        return layer(xg).y
            else:
                def fn():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = layer(xg).y
                    y.float().sum().backward()
            row["ms"] = time_ms(fn, device=device, warmup_ms=10, rep_ms=60)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        layer.zero_grad(set_to_none=True)
        free(device)
        if name.startswith("peer"):
            k = layer.config.top_k
            gathered = N * k * 512 * 2 * 2 * (1 if phase == "forward" else 3)
            row["gather_floor_ms"] = 1e3 * gathered / ceil["copy_bytes_per_s"]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384,65536,262144")
    ap.add_argument("--reading", default="paper", choices=("paper", "inference"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    ceil = ceilings(device)
    env = environment(device)
    infer, train = layers(device, args.reading, False), layers(device, args.reading, True)
    for name in infer:
        for N in (int(t) for t in args.tokens.split(",")):
            for row in point(name, (infer[name], train[name]), N, device, ceil):
                row.update(env, copy_bytes_per_s=ceil["copy_bytes_per_s"])
                print(json.dumps({k: row[k] for k in row if k in (
                    "layer", "tokens", "pass", "ms", "error", "gather_floor_ms")}), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
