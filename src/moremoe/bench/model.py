"""``moremoe bench model``: whole models, the paper's whole-model tables.

For each matched pair (an MoE and a MoRE preset of equal active FLOPs; the CLI resolves the
presets into TransformerConfigs) on one GPU in bf16:

prefill  the forward of the 12-layer model over B x T tokens (64 x 1,024 and 256 x 1,024),
         logits included, median of device-event timings after warm-up;
decode   tokens per second of greedy decoding with the key/value cache at batch 1, 8 and 64:
         a 16-token prompt, then 128 new tokens one step at a time as a user's loop runs them
         (eager, no host sync between steps), median of 3 runs.

Each row carries a per-component breakdown — attention, router, experts (summed over the
layers, from device events recorded around those modules in a separate instrumented pass)
and the rest (embedding, norms, residuals, the output head: the total minus the three) — so
the MoRE/MoE ratio can be read by component. A model that does not fit is an OOM row.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from ..model.cache import KVCache
from ..model.transformer import Transformer, TransformerConfig
from ..runtime import environment
from .harness import bf16_on, ceilings, free, time_ms

PREFILL_SHAPES = ((64, 1024), (256, 1024))
DECODE_BATCHES = (1, 8, 64)
NEW_TOKENS = 128
PROMPT = 16
COMPONENTS = ("attention", "router", "experts", "rest")


def build(cfg: TransformerConfig, device) -> Transformer:
    """The model in bf16, initialised directly on the device, in eval mode."""
    with bf16_on(device):
        model = Transformer(cfg)
    return model.eval()


class _Clock:
    """Marks on the stream (CUDA events) or on the host clock (CPU, synchronous)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


@contextmanager
def component_spans(model: Transformer, device):
    """Within the block, spans around every block's attention, router and experts; yields a
    function that returns {component: ms} summed over what ran (synchronising first)."""
    clock, spans, handles = _Clock(device), [], []

    def hooks(name):
        def pre(module, args):
            module._span_start = clock.mark()

        def post(module, args, out):
            spans.append((name, module._span_start, clock.mark()))
        return pre, post

    for block in model.blocks:
        parts = [("attention", block.attn)]
        if hasattr(block.moe, "router"):
            parts += [("router", block.moe.router), ("experts", block.moe.experts)]
        for name, module in parts:
            pre, post = hooks(name)
            handles += [module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post)]

    def totals() -> dict:
        if clock.cuda:
            torch.cuda.synchronize()
        out = defaultdict(float)
        for name, a, b in spans:
            out[name] += clock.ms(a, b)
        return dict(out)
    try:
        yield totals
    finally:
        for h in handles:
            h.remove()


def _breakdown(total_ms: float, parts: dict, scale: float = 1.0) -> dict:
    out = {c: parts.get(c, 0.0) * scale for c in COMPONENTS[:3]}
    out["rest"] = max(total_ms - sum(out.values()), 0.0)
    return out


def _tokens(cfg, B, T, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, cfg.vocab, (B, T), device=device, generator=g)


@torch.no_grad()
def prefill(model, B: int, T: int, device) -> dict:
    tokens = _tokens(model.config, B, T, device)
    ms = time_ms(lambda: model(tokens), device=device, warmup_ms=50, rep_ms=300)
    with component_spans(model, device) as totals:
        model(tokens)
        parts = totals()
    return {"phase": "prefill", "B": B, "T": T, "ms": ms,
            "tokens_per_s": B * T / (ms / 1e3), "components": _breakdown(ms, parts)}


@torch.no_grad()
def _decode_run(model, prompt, new_tokens: int, device, spans: bool = False):
    """(seconds, {component: ms} or None) of new_tokens greedy steps after a prefill of the
    prompt (not timed, not in the spans)."""
    cache = KVCache(prompt.shape[1] + new_tokens)
    nxt = model(prompt, cache=cache).logits[:, -1].argmax(-1)[:, None]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    parts = None
    t0 = time.perf_counter()
    with component_spans(model, device) if spans else nullcontext() as totals:
        for _ in range(new_tokens):
            nxt = model(nxt, cache=cache).logits[:, -1].argmax(-1)[:, None]
        sync()
        seconds = time.perf_counter() - t0
        if spans:
            parts = totals()
    return seconds, parts


def decode(model, B: int, new_tokens: int, device, runs: int = 3) -> dict:
    prompt = _tokens(model.config, B, PROMPT, device, seed=1)
    _decode_run(model, prompt, min(new_tokens, 8), device)                 # warm-up
    seconds = statistics.median(_decode_run(model, prompt, new_tokens, device)[0]
                                for _ in range(runs))
    step_ms = 1e3 * seconds / new_tokens
    _, parts = _decode_run(model, prompt, new_tokens, device, spans=True)
    return {"phase": "decode", "B": B, "new_tokens": new_tokens, "prompt": PROMPT,
            "ms": step_ms, "tokens_per_s": B / (step_ms / 1e3),
            "components": _breakdown(step_ms, parts, 1 / new_tokens)}


def run_model(device, *, pairs, quick=False, progress=None):
    """pairs: [(pair name, [(model name, kind, TransformerConfig), ...])] — the CLI's presets.
    Yields one row per (model, phase, batch)."""
    env, ceil = environment(device), ceilings(device)
    shapes = ((2, 16),) if quick else PREFILL_SHAPES
    batches, new = ((1, 2), 4) if quick else (DECODE_BATCHES, NEW_TOKENS)
    total = sum(len(models) for _, models in pairs) * (len(shapes) + len(batches))
    i = 0
    for pair, models in pairs:
        for name, kind, cfg in models:
            base = {"bench": "model", "pair": pair, "model": name, "kind": kind,
                    "layers": cfg.layers, "h": cfg.hidden, "M": cfg.moe.experts,
                    "s": cfg.moe.width, "k": cfg.moe.top_k, "r": cfg.moe.rank,
                    "params": cfg.total_params(),
                    "moe_flops_per_token": cfg.moe.active_flops(), **env,
                    **{f"ceiling_{k}": v for k, v in ceil.items()}}
            try:
                model = build(cfg, device)
            except torch.OutOfMemoryError:
                model = None
            jobs = [("prefill", B, T) for B, T in shapes] + [("decode", B, new) for B in batches]
            for phase, B, n in jobs:
                row = dict(base, phase=phase, B=B)
                if model is None:
                    row.update(oom=True, ms=None)
                else:
                    try:
                        row.update(prefill(model, B, n, device) if phase == "prefill"
                                   else decode(model, B, n, device))
                    except torch.OutOfMemoryError:
                        row.update(oom=True, ms=None)
                    free(device)
                i += 1
                progress and progress(i, total, row)
                yield row
            del model
            free(device)


def ratios(rows: list[dict]) -> list[dict]:
    """MoRE over MoE per pair, phase and batch (newest rows), total and per component."""
    latest = {}
    for r in rows:
        if r.get("bench") == "model" and r.get("ms"):
            latest[(r["pair"], r["kind"], r["phase"], r["B"], r.get("T"))] = r
    out = []
    for (pair, kind, phase, B, T), more in latest.items():
        moe = latest.get((pair, "moe", phase, B, T))
        if kind != "more" or not moe:
            continue
        comp = {c: (more["components"][c] / moe["components"][c]
                    if moe["components"].get(c) else None) for c in COMPONENTS}
        out.append({"pair": pair, "phase": phase, "B": B, "T": T, "moe_ms": moe["ms"],
                    "more_ms": more["ms"], "ratio": more["ms"] / moe["ms"],
                    "components": comp})
    return out
