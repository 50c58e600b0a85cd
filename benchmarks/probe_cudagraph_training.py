"""Does the training pass run under CUDA graphs (torch.compile mode="reduce-overhead") when
each micro-step is marked with torch.compiler.cudagraph_mark_step_begin()? (run on the GPU)

A 2-layer h = 512 model of the pair's shape (MoE-256 or MoRE-1792 layers, k = 4, bf16
autocast over fp32 weights, 2 micro-steps of 4 x 1,024 tokens), five ways: eager (the
reference), each block or the whole model compiled without CUDA graphs (blocks_default,
model_default) and with them (reduce-overhead: blocks, model; the gradients kept allocated
and each micro-step marked). For each: whether three steps run (and how long they took,
compiling included), the gradients' largest relative error against eager and the parameter
it is in, and the wall time of a step after warm-up. One JSON line per (layer kind, way).

    PYTHONPATH=src python benchmarks/probe_cudagraph_training.py [--out rows.jsonl]
"""
import argparse
import json
import time

import torch

from moremoe.model.transformer import Transformer, TransformerConfig
from moremoe.nn.moe import MoEConfig


def build(kind: str) -> Transformer:
    moe = (MoEConfig.moe(256, 4, 512, 64) if kind == "moe" else
           MoEConfig.more(1792, 4, 512, 56, 64))
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=50304, layers=2, heads=8, kv_heads=2, moe=moe,
                            max_seq_len=1024)
    return Transformer(cfg).cuda().train()


def step(model, fwd, batches, mark: bool):
    """Under CUDA graphs (mark) the gradients stay allocated: a .grad autograd took over from
    a backward graph's output would be overwritten by the next replay (pytorch #169545)."""
    if mark:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    model.zero_grad(set_to_none=not mark)
    for tokens in batches:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fwd(tokens, tokens)
        (out.loss / len(batches)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def run(kind: str, way: str) -> dict:
    model = build(kind)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 50257, (4, 1024), device="cuda", generator=g)
               for _ in range(2)]
    ref = step(model, model, batches, mark=False)
    row = {"kind": kind, "way": way}
    try:
        if way == "eager":
            fwd, mark = model, False
        elif way == "blocks":
            model.compile_blocks("reduce-overhead")
            fwd, mark = model, True
        elif way == "blocks_default":       # the trainer's compile before this probe
            model.compile_blocks("default")
            fwd, mark = model, False
        elif way == "model":
            fwd, mark = torch.compile(model, mode="reduce-overhead"), True
        else:                               # model_default: one graph, no CUDA graphs
            fwd, mark = torch.compile(model), False
        t0 = time.perf_counter()
        for _ in range(3):
            got = step(model, fwd, batches, mark)
        torch.cuda.synchronize()
        row["first_3_steps_s"] = time.perf_counter() - t0
        errs = {n: ((got[n].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30))
                .item() for n, r in ref.items()}
        worst = max(errs, key=errs.get)
        row.update(worst_param=worst, median_rel_grad_error=sorted(errs.values())[len(errs) // 2])
        err = errs[worst]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(model, fwd, batches, mark)
        torch.cuda.synchronize()
        row.update(ok=True, max_rel_grad_error=err,
                   step_ms=(time.perf_counter() - t0) / 5 * 1e3)
    except Exception as exc:            # the probe reports what fails, one line each
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kinds", default="moe,more", help="comma list of moe, more")
    ap.add_argument("--ways", default="eager,blocks_default,model_default,blocks,model",
                    help="comma list of eager, blocks_default, model_default, blocks, model")
    args = ap.parse_args()
    for kind in args.kinds.split(","):
        for way in args.ways.split(","):
            row = run(kind, way)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
