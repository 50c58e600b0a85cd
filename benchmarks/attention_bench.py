"""Attention at the presets' shapes (issue 36, part 3): which kernel runs today and what the
others cost. h = 512, 8 query heads, 2 key/value heads (GQA), head dim 64, 1,024 tokens,
causal, bf16, the micro-batch of 16 sequences; forward and forward + backward of

  model today          repeat_kv, then F.scaled_dot_product_attention (its own dispatch)
  sdpa enable_gqa      no copy of the key/value heads (SDPA's GQA flag)
  sdpa <backend>       each of SDPA's backends forced (flash, efficient, cudnn, math)
  flex_attention       torch's FlexAttention, compiled, a causal block mask
  flash-attn           FlashAttention-2/3 (`flash_attn`), where it is installed

each the median of device-event timings after warm-up, the output and the gradients against
the math backend in fp32 (max relative error), the rate in TFLOP/s (causal: half the square)
beside the measured bf16 matmul ceiling of the same run, and which backend the model's
call selects (the profiler's kernel names). Rows to OUT.jsonl.

    PYTHONPATH=src python benchmarks/attention_bench.py OUT.jsonl
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moremoe.bench.harness import ceilings, time_ms
from moremoe.runtime import environment

B, T, HQ, HKV, D = 16, 1024, 8, 2, 64


def repeat_kv(x, rep):
    return x[:, :, None].expand(-1, -1, rep, -1, -1).reshape(x.shape[0], -1, *x.shape[2:])


def model_today(q, k, v):
    rep = HQ // HKV
    return F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep),
                                          is_causal=True)


def forced(backend):
    def fn(q, k, v):
        with sdpa_kernel([backend]):
            return model_today(q, k, v)
    return fn


def variants() -> dict:
    out = {"model today (sdpa dispatch)": model_today,
           "sdpa enable_gqa": lambda q, k, v: F.scaled_dot_product_attention(
               q, k, v, is_causal=True, enable_gqa=True)}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        out[f"sdpa {name}"] = forced(be)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T)
        flex = torch.compile(flex_attention)
        out["flex_attention (compiled)"] = lambda q, k, v: flex(q, k, v, block_mask=mask,
                                                                 enable_gqa=True)
    except Exception as err:                        # noqa: BLE001 - reported, not fatal
        print(f"flex_attention: not available ({type(err).__name__}: {err})", flush=True)
    for mod in ("flash_attn_interface", "flash_attn"):      # FA3, then FA2
        try:
            fa = __import__(mod).flash_attn_func
            out[f"{mod}.flash_attn_func"] = lambda q, k, v, fa=fa: _fa_out(
                fa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True))
        except Exception as err:                    # noqa: BLE001 - reported, not fatal
            print(f"{mod}: not installed ({type(err).__name__})", flush=True)
    return out


def _fa_out(o):
    return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)


def which_kernels(fn, q, k, v) -> list:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(q, k, v)
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if "attention" in e.key.lower()
                   or "fmha" in e.key.lower() or "flash" in e.key.lower()})[:4]


def main(out: str) -> int:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, HQ, T, D, device=dev, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, HKV, T, D, device=dev, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, HKV, T, D, device=dev, generator=g).bfloat16().requires_grad_()
    do = torch.randn(B, HQ, T, D, device=dev, generator=g).bfloat16()
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = model_today(*ref_in)
    ref.backward(do.float())
    want = [ref.detach()] + [t.grad for t in ref_in]
    ceil = ceilings(dev)
    flops_fwd = 4 * B * HQ * T * T * D / 2                  # QKᵀ and PV, causal half
    env = environment(dev)
    rows = []
    for name, fn in variants().items():
        row = {"bench": "attention", "variant": name, "batch": B, "seq": T, "heads": HQ,
               "kv_heads": HKV, "head_dim": D, **ceil}
        try:
            for t in (q, k, v):
                t.grad = None
            o = fn(q, k, v)
            o.backward(do)
            got = [o.detach().float()] + [t.grad.float() for t in (q, k, v)]
            row["max_rel_err"] = max(float((a - b).abs().max() / b.abs().max())
                                     for a, b in zip(got, want))

            def fwd_bwd():
                for t in (q, k, v):
                    t.grad = None
                fn(q, k, v).backward(do)
            with torch.no_grad():
                row["forward_ms"] = time_ms(lambda: fn(q, k, v), device=dev)
            row["forward_backward_ms"] = time_ms(fwd_bwd, device=dev)
            row["forward_tflops"] = flops_fwd / row["forward_ms"] / 1e9
            row["forward_backward_tflops"] = 3.5 * flops_fwd / row["forward_backward_ms"] / 1e9
            with torch.no_grad():
                row["kernels"] = which_kernels(fn, q, k, v)
        except Exception as err:                    # noqa: BLE001 - a backend that refuses
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append({**row, **env})
        print(f"{name:<34} " + (f"fwd {row['forward_ms']:.3f} ms, fwd+bwd "
                                f"{row['forward_backward_ms']:.3f} ms "
                                f"({row['forward_backward_tflops']:.0f} TFLOP/s), err "
                                f"{row['max_rel_err']:.1e}, {row['kernels']}"
                                if "error" not in row else row["error"]), flush=True)
    print(f"bf16 matmul ceiling {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
