"""The optimizer-side passes of one training step at a preset's parameter shapes, before and
after issue 27 (part 1), timed with CUDA events (median of REPS after WARMUP):

  zero        the gradients zeroed between steps (CUDA-graph mode): every .grad / only those
              that the expert banks do not restart
  norm+clip+adamw (fp32 moments): clip_grad_norm_ then torch's fused AdamW / the foreach norm
              and clipped_step (the coefficient as the fused AdamW's grad_scale); and, as a
              candidate the trainer does not take, the one-pass Triton update with fp32
              moments (no write-back of the scaled gradient, one launch a parameter)
  norm+clip+adamw (bf16 moments): clip_grad_norm_ then LowPrecisionAdamW on torch's ops in
              slices (the code before) / the norm and the one-pass Triton update
  expert accumulation, one micro-step of one layer's expert bank (N = batch_size x seq_len
              tokens, uniform routing): the fused backward then AccumulateGrad's add of the
              three weight gradients / the backward adding into .grad itself; x L layers and
              x grad_accum micro-steps for the step's figure

    PYTHONPATH=src python benchmarks/step_bench.py OUT.jsonl [--preset NAME ...]

Writes one JSON row a measurement (ms) and prints a table. Needs a CUDA GPU; MoRE-1792's
fp32 weights, gradients and moments take about 38 GB."""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from moremoe.bench.harness import time_fixed_ms
from moremoe.kernels import swiglu_experts as mg
from moremoe.model import Transformer
from moremoe.runtime import environment
from moremoe.ops import adamw as ops_adamw
from moremoe.training import optim as optim_mod
from moremoe.training.optim import LowPrecisionAdamW, clipped_step
from moremoe.training.presets import get_preset

WARMUP, REPS = 2, 10
KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def _params(preset: str, dev):
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = Transformer(cfg.model.transformer_config(50257))
    named = [(n, p.shape) for n, p in model.named_parameters()]
    ps = [torch.nn.Parameter(torch.empty(s, device=dev).normal_(std=0.02)) for _, s in named]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    expert = [p for (n, _), p in zip(named, ps) if ".experts." in n]
    return cfg, ps, expert


def _optimizer_rows(preset, ps, expert, dev):
    grads = [p.grad for p in ps]
    own = {id(p) for p in expert}
    rest = [p.grad for p in ps if id(p) not in own]
    flags = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(len(expert) // 3)]
    t = lambda fn: time_fixed_ms(fn, device=dev, warmup=WARMUP, reps=REPS)    # noqa: E731
    rows = [("zero", "before", t(lambda: torch._foreach_zero_(grads))),
            ("zero", "after", t(lambda: (torch._foreach_zero_(rest),
                                         [f.zero_() for f in flags])))]
    for g in grads:
        g.normal_(std=1e-3)
    fused = torch.optim.AdamW(ps, fused=True, **KW)
    rows.append(("norm+clip+adamw fp32", "before", t(lambda: (
        torch.nn.utils.clip_grad_norm_(ps, 1.0), fused.step()))))
    rows.append(("norm+clip+adamw fp32", "after", t(lambda: clipped_step(
        fused, grads, torch.nn.utils.get_total_norm(grads), 1.0))))
    del fused
    one = LowPrecisionAdamW(ps, moment_dtype=torch.float32, **KW)     # a candidate, not used
    rows.append(("norm+clip+adamw fp32", "one-pass Triton", t(lambda: clipped_step(
        one, grads, torch.nn.utils.get_total_norm(grads), 1.0))))
    del one
    low = LowPrecisionAdamW(ps, **KW)

    def old_low():             # the slices of torch ops the class ran before
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        optim_mod.adamw_ = partial(ops_adamw.adamw_, impl="reference")
        try:
            low.step()
        finally:
            optim_mod.adamw_ = ops_adamw.adamw_
    rows.append(("norm+clip+adamw bf16 moments", "before", t(old_low)))
    rows.append(("norm+clip+adamw bf16 moments", "after", t(lambda: clipped_step(
        low, grads, torch.nn.utils.get_total_norm(grads), 1.0))))
    del low
    return [dict(preset=preset, part=part, code=code, ms=ms) for part, code, ms in rows]


def _accumulation_rows(preset, cfg, dev):
    m, tr = cfg.model, cfg.train
    N, M, s, h, k = tr.batch_size * m.seq_len, m.experts, m.width, m.hidden, m.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, h, device=dev, generator=g).bfloat16()
    idx = torch.randint(0, M, (N, k), device=dev, generator=g, dtype=torch.int32)
    gates = torch.softmax(torch.randn(N, k, device=dev, generator=g), -1)
    ws = [torch.randn(M, s, h, device=dev) * 0.02, torch.randn(M, s, h, device=dev) * 0.02,
          torch.randn(M, h, s, device=dev) * 0.02]
    y, act, xg, xu = mg.forward(x, gates, idx, *ws, save=True)
    dy = torch.randn_like(y)
    into = [torch.zeros_like(w) for w in ws]
    keep = torch.ones(1, dtype=torch.int32, device=dev)

    def before():
        out = mg.backward(dy, x, gates, idx, *ws, act, xg, xu)
        torch._foreach_add_(into, list(out[2:]))      # AccumulateGrad's adds

    def after():
        mg.backward(dy, x, gates, idx, *ws, act, xg, xu, into=into, keep=keep)
    t = lambda fn: time_fixed_ms(fn, device=dev, warmup=WARMUP, reps=REPS)    # noqa: E731
    plain = t(lambda: mg.backward(dy, x, gates, idx, *ws, act, xg, xu))
    scale = m.layers * tr.grad_accum
    return [dict(preset=preset, part="expert backward + accumulation, per step", code=code,
                 ms=ms * scale, per_micro_step_layer_ms=ms, backward_alone_ms=plain,
                 tokens=N, layers=m.layers, grad_accum=tr.grad_accum)
            for code, ms in (("before", t(before)), ("after", t(after)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", action="append")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script "
                    "(tiny presets, TRITON_INTERPRET=1), host-clock times")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("step_bench.py: error: needs a CUDA GPU (or --device cpu for a smoke test)")
    dev = torch.device(a.device)
    rows = []
    for preset in a.preset or ["h512-s64-more1792", "h512-s64-moe256"]:
        cfg, ps, expert = _params(preset, dev)
        rows += _optimizer_rows(preset, ps, expert, dev)
        del ps, expert
        torch.cuda.empty_cache()
        rows += _accumulation_rows(preset, cfg, dev)
        torch.cuda.empty_cache()
    tag = environment(dev)          # device, torch, triton, commit, date
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, **tag}) + "\n")
    print(f"{'preset':20} {'part':45} {'before ms':>10} {'after ms':>10} {'one-pass':>10}")
    keys = dict.fromkeys((r["preset"], r["part"]) for r in rows)
    for preset, part in keys:
        ms = {r["code"]: r["ms"] for r in rows if (r["preset"], r["part"]) == (preset, part)}
        extra = f"{ms['one-pass Triton']:10.2f}" if "one-pass Triton" in ms else ""
        print(f"{preset:20} {part:45} {ms['before']:10.2f} {ms['after']:10.2f} {extra}")


if __name__ == "__main__":
    main()
