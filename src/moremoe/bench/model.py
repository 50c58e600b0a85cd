"""``moremoe bench model``: whole models, the paper's whole-model tables.

For each matched pair (an MoE and a MoRE preset of equal active FLOPs; the CLI resolves the
presets into TransformerConfigs) on one GPU in bf16:

prefill  the forward of the 12-layer model over B x T tokens (64 x 1,024 and 256 x 1,024),
         logits included, median of device-event timings after warm-up;
decode   milliseconds per step of greedy decoding at batch 1, 8 and 64 after a 16-token
         prompt, 128 new tokens, median of 3 runs, in three modes:
         eager     the key/value cache and a user's Python loop (model/generate.py's path,
                   no host sync between steps);
         captured  the static cache, each step one CUDA-graph replay (model/static.py);
         compiled  the same with the blocks and the head torch.compile'd (inductor) before
                   the capture, the compilation shared by a model's batch sizes.
         Each row carries the step's byte floor: the bytes a step must read (the weights it
         uses: attention, norms, router, the experts the batch reaches under uniform routing,
         the output head; and the key/value cache up to the mean position) at the measured
         copy rate.

Prefill and eager decode rows carry a per-component breakdown — attention, router, experts
(summed over the layers, from device events recorded around those modules in a separate
instrumented pass) and the rest (embedding, norms, residuals, the output head: the total
minus the three) — so the MoRE/MoE ratio can be read by component; a graph replay has none.
A model that does not fit is an OOM row.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

from ..model.cache import KVCache
from ..model.static import StaticDecoder
from ..model.transformer import Transformer, TransformerConfig
from ..nn.peer import PEERConfig
from ..runtime import environment
from .harness import bf16_on, ceilings, free, time_ms

PREFILL_SHAPES = ((64, 1024), (256, 1024))
DECODE_BATCHES = (1, 8, 64)
DECODE_MODES = ("eager", "captured", "compiled")
PHASES = ("prefill", "decode")
NEW_TOKENS = 128
PROMPT = 16
COMPONENTS = ("attention", "router", "experts", "rest")


def step_bytes(cfg: TransformerConfig, B: int, S: float, itemsize: int = 2) -> float:
    """Bytes one decode step of B rows must read with S cached positions a row: every
    layer's attention and norm weights, its router, the experts the B rows reach (expected
    under uniform routing: M (1 - (1 - k/M)^B) of them), the key/value cache (B G S D
    twice), the embedding rows and the output head."""
    h, D, G = cfg.hidden, cfg.dim_per_head, cfg.n_kv_heads
    m = cfg.moe
    attention = h * D * (2 * cfg.heads + 2 * G) + 2 * h
    if isinstance(m, PEERConfig):
        reached = m.experts * (1 - (1 - m.top_k / m.experts) ** B)
        ffn = m.heads * m.d_q * h + m.d_q * int(m.experts ** 0.5) + 2 * h * reached
    else:
        router = m.experts * m.rank + m.rank * h if m.is_lowrank else m.experts * h
        ffn = router + 3 * m.width * h * m.experts * (1 - (1 - m.top_k / m.experts) ** B)
    cache = 2 * B * G * S * D
    return itemsize * (cfg.layers * (attention + ffn + cache) + B * h + h + cfg.vocab * h)


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


@torch.no_grad()
def decode_static(model, B: int, new_tokens: int, device, mode: str, *, like=None,
                  runs: int = 3):
    """(row, decoder) of new_tokens greedy steps through a StaticDecoder after the prompt:
    captured as a CUDA graph (compiled first in mode "compiled", sharing like's compiled
    functions); on the CPU (--quick) the same steps run without a graph. The milliseconds
    per step are the steps' after the prefill, timed as one stretch of replays."""
    cuda = device.type == "cuda"
    decoder = StaticDecoder(model, B, PROMPT + new_tokens, compile=mode == "compiled",
                            compile_prefill=False, like=like, cuda_graph=cuda,
                            backend="inductor" if cuda else "aot_eager")
    prompt = _tokens(model.config, B, PROMPT, device, seed=1)
    clock, times = _Clock(device), []
    for _ in range(runs + 1):                        # the first warms the kernels up
        decoder.begin(prompt)
        a = clock.mark()
        for _ in range(new_tokens - 1):
            decoder.advance()
        b = clock.mark()
        if cuda:
            torch.cuda.synchronize()
        times.append(clock.ms(a, b) / (new_tokens - 1))
    ms = statistics.median(times[1:])
    return {"phase": "decode", "mode": mode, "B": B, "new_tokens": new_tokens,
            "prompt": PROMPT, "ms": ms, "tokens_per_s": B / (ms / 1e3), "components": None,
            "graph": decoder.graph is not None, "replays": decoder.replays}, decoder


def _with_floor(row: dict, cfg, ceil: dict) -> dict:
    """The decode row with its byte floor (bytes at the copy rate) and its ratio to it."""
    if row.get("phase") != "decode" or row.get("ms") is None:
        return row
    nbytes = step_bytes(cfg, row["B"], PROMPT + row["new_tokens"] / 2)
    floor = 1e3 * nbytes / ceil["copy_bytes_per_s"] if ceil.get("copy_bytes_per_s") else None
    return dict(row, step_bytes=nbytes, floor_ms=floor,
                ratio_to_floor=row["ms"] / floor if floor else None)


def _jobs(phases, shapes, batches, modes, new):
    """(phase, B, T or new tokens, mode) of one model, prefill first, then each decode mode
    over the batches (so a compiled mode's batch sizes share one compilation)."""
    jobs = [("prefill", B, T, None) for B, T in shapes] if "prefill" in phases else []
    if "decode" in phases:
        jobs += [("decode", B, new, mode) for mode in modes for B in batches]
    return jobs


def _measure(model, job, device, shared: dict, runs: int):
    phase, B, n, mode = job
    if phase == "prefill":
        return prefill(model, B, n, device)
    if mode == "eager":
        return dict(decode(model, B, n, device, runs=runs), mode="eager")
    row, shared[mode] = decode_static(model, B, n, device, mode, like=shared.get(mode),
                                      runs=runs)
    return row


def run_model(device, *, pairs, quick=False, progress=None, phases=PHASES,
              batches=None, modes=DECODE_MODES, new_tokens=None):
    """pairs: [(pair name, [(model name, kind, TransformerConfig), ...])] — the CLI's presets.
    Yields one row per (model, phase, batch)."""
    env, ceil = environment(device), ceilings(device)
    shapes = ((2, 16),) if quick else PREFILL_SHAPES
    batches = batches or ((1, 2) if quick else DECODE_BATCHES)
    new = new_tokens or (4 if quick else NEW_TOKENS)
    jobs = _jobs(phases, shapes, batches, modes, new)
    total, i = sum(len(models) for _, models in pairs) * len(jobs), 0
    for pair, models in pairs:
        for name, kind, cfg in models:
            base = {"bench": "model", "pair": pair, "model": name, "kind": kind,
                    "layers": cfg.layers, "h": cfg.hidden, "M": cfg.moe.experts,
                    "s": getattr(cfg.moe, "width", None), "k": cfg.moe.top_k,
                    "r": getattr(cfg.moe, "rank", None), "params": cfg.total_params(),
                    "moe_flops_per_token": cfg.moe.active_flops(), **env,
                    **{f"ceiling_{k}": v for k, v in ceil.items()}}
            try:
                model = build(cfg, device)
            except torch.OutOfMemoryError:
                model = None
            shared = {}                       # the compiled decoders of this model
            for job in jobs:
                row = dict(base, phase=job[0], B=job[1], **({"mode": job[3]} if job[3] else {}))
                if model is None:
                    row.update(oom=True, ms=None)
                else:
                    try:
                        row.update(_measure(model, job, device, shared, 1 if quick else 3))
                    except torch.OutOfMemoryError:
                        row.update(oom=True, ms=None)
                    free(device)
                row = _with_floor(row, cfg, ceil)
                i += 1
                progress and progress(i, total, row)
                yield row
            del model, shared
            free(device)


def ratios(rows: list[dict]) -> list[dict]:
    """MoRE over MoE per pair, phase, decode mode and batch (newest rows), total and per
    component (where both rows have components)."""
    latest = {}
    for r in rows:
        if r.get("bench") == "model" and r.get("ms"):
            mode = r.get("mode", "eager") if r["phase"] == "decode" else None
            latest[(r["pair"], r["kind"], r["phase"], mode, r["B"], r.get("T"))] = r
    out = []
    for (pair, kind, phase, mode, B, T), more in latest.items():
        moe = latest.get((pair, "moe", phase, mode, B, T))
        if kind != "more" or not moe:
            continue
        comp = {c: (more["components"][c] / moe["components"][c]
                    if (moe.get("components") or {}).get(c) and more.get("components")
                    else None) for c in COMPONENTS}
        out.append({"pair": pair, "phase": phase, "mode": mode, "B": B, "T": T,
                    "moe_ms": moe["ms"], "more_ms": more["ms"], "ratio": more["ms"] / moe["ms"],
                    "components": comp})
    return out
