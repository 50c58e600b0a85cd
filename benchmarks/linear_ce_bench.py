"""The output head and the loss, forward + backward, four ways at the presets' shapes (issue 36,
part 2): the unfused head and fp32 cross-entropy (eager, and torch.compile'd: the best plain
version), ours (ops/linear_ce.py), Liger-Kernel's fused linear cross-entropy and Apple's
cut-cross-entropy (exact, filter_eps=None, and its default gradient filter, which skips
small probabilities: an approximation). Timed with device events (median after warm-up,
moremoe.bench.harness.time_ms), peak memory above the inputs, and the loss and gradients
against an fp32 reference of the same bf16 values.

    PYTHONPATH=src python benchmarks/linear_ce_bench.py OUT.jsonl [--tokens 8192 16384]

Liger-Kernel and cut-cross-entropy are optional (pure-Python wheels: pip install --no-deps);
a missing one is reported, not fatal. Needs a CUDA GPU."""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from moremoe.bench.harness import ceilings, peak_bytes, time_ms
from moremoe.ops.linear_ce import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_ref
from moremoe.runtime import environment

H, V = 512, 50_257          # the presets' hidden size and the GPT-2 vocabulary


def variants() -> dict:
    out = {"unfused (eager)": linear_cross_entropy_ref,
           "unfused (compiled)": torch.compile(linear_cross_entropy_ref),
           "moremoe": linear_cross_entropy,
           "moremoe (chunks of 2^26 logits)": lambda x, w, t: linear_cross_entropy(
               x, w, t, chunk_rows=(1 << 26) // V)}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss)
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        out["liger-kernel"] = lambda x, w, t: liger(w, x, t)
    except Exception as err:                        # noqa: BLE001 - reported, not fatal
        print(f"liger-kernel: not available ({type(err).__name__}: {err})")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cut-cross-entropy (exact)"] = lambda x, w, t: cce(x, w, t, filter_eps=None)
        out["cut-cross-entropy (filtered)"] = lambda x, w, t: cce(x, w, t)
    except Exception as err:                        # noqa: BLE001
        print(f"cut-cross-entropy: not available ({type(err).__name__}: {err})")
    return out


def measure(n: int, dev, ceil: dict, only=None) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(n)
    x = (torch.randn(n, H, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (n,), device=dev, generator=g)
    t[::97] = IGNORE_INDEX
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(x32, w32), t, ignore_index=IGNORE_INDEX)
    dx_ref, dw_ref = torch.autograd.grad(ref, (x32, w32))
    flops = 3 * 2 * n * H * V                      # the logits, dx and dW GEMMs
    floor = 1e3 * flops / ceil["bf16_flops_per_s"]
    rows = []
    for name, fn in variants().items():
        if only and not any(name.startswith(o) for o in only):
            continue

        def step():
            loss = fn(x, w, t)
            return (loss, *torch.autograd.grad(loss, (x, w)))
        try:
            loss, dx, dw = step()                   # compiles, autotunes
            ms = time_ms(step, device=dev, warmup_ms=100, rep_ms=400)
            peak = peak_bytes(step, device=dev)
        except Exception as err:                    # noqa: BLE001 - one failing variant
            print(f"{name}: failed ({type(err).__name__}: {str(err)[:200]})")
            continue

        def rel(a, b):
            return float((a.float() - b).norm() / b.norm())
        rows.append({"bench": "linear_ce", "variant": name, "tokens": n, "hidden": H,
                     "vocab": V, "dtype": "bfloat16", "ms": ms, "floor_ms": floor,
                     "peak_bytes": peak, "loss_abs_err": abs(loss.item() - ref.item()),
                     "dx_rel_err": rel(dx, dx_ref), "dw_rel_err": rel(dw, dw_ref)})
        r = rows[-1]
        print(f"{n:>6} {name:<30} {ms:8.2f} ms  floor {floor:5.2f}  peak "
              f"{peak / 2**30:6.2f} GiB  loss err {r['loss_abs_err']:.1e}  dx {r['dx_rel_err']:.1e}"
              f"  dW {r['dw_rel_err']:.1e}", flush=True)
        del loss, dx, dw
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON-lines file to append the rows to")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--only", nargs="+", default=None, help="variants to time (default all)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_ce_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    env = environment(dev)
    print(f"bf16 matmul ceiling {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; "
          f"{env['device']}")
    rows = []
    for n in args.tokens:
        rows += measure(n, dev, ceil, args.only)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **ceil, **env}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
