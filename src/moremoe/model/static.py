"""The fast decode path: a static key/value cache, a prefill compiled per length bucket and a
decode step captured once as a CUDA graph and replayed for every token.

A StaticDecoder holds, for one batch size B and one cache length L, everything a step reads
or writes at a fixed address: the cache (model/cache.py, StaticKVCache), the position of the
next token as a device tensor, and the last token (B, 1). A step (embedding, every block's
attention, router and experts, the output head, the sampling of model/sampling.py, and
writing the token and the position for the next step) has the same shapes at every token and
never reads a value back to the host, so on CUDA it is captured once (torch.cuda.CUDAGraph)
and each token is one graph replay: no Python, no per-kernel launch cost. The routers and
experts take their fused kernels (no host sync: kernels/routing_meta.py builds the experts'
schedule on the device); the plain-torch references take their traceable paths while a
graph is captured or compiled (runtime.in_graph).

The prefill runs the prompt right-padded to a length bucket (a power of two from 16, at most
L): each token only sees the ones before it, so the padding changes nothing but fills cache
positions past the prompt, which the decode steps overwrite before any query reaches them.
With compile, one block is the compiled unit (torch.compile, fullgraph): the blocks share
its graph, and each prefill bucket compiles once (dynamic=False); the decode step compiles
once per batch size. Capture and compile happen at the first generate, before its prefill,
so the warm-up steps write only positions the prefill then overwrites.

The eager loop of model/generate.py stays the reference: tests hold the greedy tokens equal.
Legend: B batch, T prompt length, L cache length, V vocabulary.
"""
from __future__ import annotations

import types
from typing import Iterator

import torch
import torch.nn.functional as F

from ..checks import check_int
from .cache import StaticKVCache
from .generate import check_arguments, record
from .sampling import Sampling, sample
from .transformer import HEAD_ROWS_MULTIPLE

BUCKET_MIN = 16          # the shortest prefill bucket
WARMUP_STEPS = 2         # eager steps before a capture (Triton compiles, allocator pools)


def bucket(T: int, max_len: int) -> int:
    """The prefill length of a T-token prompt: a power of two >= max(T, 16), at most max_len."""
    return min(max(BUCKET_MIN, 1 << (T - 1).bit_length()), max_len)


def cache_length(T: int, max_new_tokens: int, max_seq_len: int) -> int:
    """The cache a generation needs: its prefill bucket and every position a step writes (the
    last new token is never written)."""
    return max(T + max_new_tokens - 1, bucket(T, max_seq_len))


def compute_dtype(model) -> torch.dtype:
    """The dtype the keys come in: autocast's where it is on, else the model's weights'."""
    weight = model.embed.weight
    dev = weight.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _own_code(fn):
    """fn with a code object of its own: torch.compile keeps compiled graphs (and counts
    recompiles, at most 8) per code object, so a decoder's graphs stay its own, however many
    models and batch sizes a process decodes, and go with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _block(block, x_BTh, cos_TD, sin_TD, layer, positions_T):
    return block(x_BTh, cos_TD, sin_TD, False, layer, positions_T)[0]


def _prefill_block(block, x_BTh, cos_TD, sin_TD, layer, positions_T):
    """A block over the prompt (its own function: its compiled graphs, one per bucket, are
    kept apart from the decode step's)."""
    return _block(block, x_BTh, cos_TD, sin_TD, layer, positions_T)


def _prefill_head(model, x_BTh, keep_T, head_VH):
    return _head(model, x_BTh, keep_T, head_VH)


def _head(model, x_BTh, keep_T, head_VH):
    """The logits at keep_T (all positions if None); head_VH: the output head's weight with
    its rows padded as padded_linear pads them on CUDA (kept padded: no 50 MB pad a step)."""
    if keep_T is not None:
        x_BTh = x_BTh.index_select(1, keep_T)
    return F.linear(model.norm(x_BTh), head_VH)[..., :model.config.vocab]


def _functions(step: bool, prefill: bool, backend: str) -> dict:
    """The block and head functions of the decode step and of the prefill, torch.compile'd
    (fullgraph) where asked: the prefill's with static shapes (one graph per bucket)."""
    def wrap(fn, on: bool, **kw):
        return torch.compile(_own_code(fn), fullgraph=True, backend=backend, **kw) if on else fn
    return {"block": wrap(_block, step), "head": wrap(_head, step),
            "prefill_block": wrap(_prefill_block, prefill, dynamic=False),
            "prefill_head": wrap(_prefill_head, prefill, dynamic=False)}


class StaticDecoder:
    """Greedy or sampled decoding of `batch` rows with a cache of max_len positions.

    compile: torch.compile the blocks and the head (backend, default inductor) of the step
    and (compile_prefill, default: compile) of the prefill; like: a decoder of the same model
    and the same compile settings whose compiled functions to share (a new batch size then
    recompiles them once with the batch dynamic, not from nothing; settings that differ are
    refused rather than silently taken from like); cuda_graph: capture the decode step
    (default: on CUDA). replays counts the steps a graph ran."""

    def __init__(self, model, batch: int, max_len: int, *, compile: bool = False,
                 backend: str = "inductor", compile_prefill: bool | None = None,
                 like: "StaticDecoder | None" = None, cuda_graph: bool | None = None):
        check_int("batch", batch)
        self.model, cfg = model, model.config
        self.device = model.embed.weight.device
        self.cache = StaticKVCache.for_model(cfg, batch, max_len, dtype=compute_dtype(model),
                                             device=self.device)
        self.batch, self.max_len = batch, max_len
        self.pos = torch.zeros((), dtype=torch.int64, device=self.device)
        self.tokens_B1 = torch.zeros(batch, 1, dtype=torch.int64, device=self.device)
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs the model on a CUDA device, it is on "
                             f"{self.device}")
        self.compiled = (compile, compile if compile_prefill is None else compile_prefill,
                         backend)
        if like is not None and like.model is not model:
            raise ValueError("like must be a decoder of the same model")
        if like is not None and like.compiled != self.compiled:
            raise ValueError(f"like was built with (compile, compile_prefill, backend) = "
                             f"{like.compiled}, this decoder asks {self.compiled}")
        self.fns = like.fns if like is not None else _functions(*self.compiled)
        weight, pad = model.lm_head.weight, -cfg.vocab % HEAD_ROWS_MULTIPLE
        self.head_VH = (weight.new_zeros(cfg.vocab + pad, cfg.hidden) if weight.is_cuda and pad
                        else weight)
        self.graph, self._graph_key, self._out_B = None, None, None
        self.replays = 0

    def _forward(self, block_fn, head_fn, tokens_BT, positions_T, keep_T):
        """Transformer.forward over the static cache, one block_fn call per block (the unit
        that compiles), handing each block its own layer of the cache."""
        m = self.model
        x = m.embed(tokens_BT)
        cos, sin = m.rope_cos.index_select(0, positions_T), m.rope_sin.index_select(0, positions_T)
        for block, layer in zip(m.blocks, self.cache.layers):
            x = block_fn(block, x, cos, sin, layer, positions_T)
        return head_fn(m, x, keep_T, self.head_VH)

    def _step(self, sampling: Sampling, generator) -> torch.Tensor:
        """One token for every row: reads tokens_B1 and pos, writes the cache at pos, then
        the new token into tokens_B1 and pos + 1 into pos."""
        logits_BV = self._forward(self.fns["block"], self.fns["head"], self.tokens_B1,
                                  self.pos.view(1), None)
        next_B = sample(logits_BV[:, -1], sampling, generator)
        self.tokens_B1.copy_(next_B[:, None])
        self.pos.add_(1)
        return next_B

    def _capture(self, sampling: Sampling, generator) -> None:
        """Warm-up steps on a side stream, then the capture; run before a prefill (the
        warm-up writes cache positions 0, 1, which the prefill overwrites)."""
        self.graph = self._out_B = None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(min(WARMUP_STEPS, self.max_len)):
                self.pos.zero_()
                self._step(sampling, generator)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:       # a generator of its own replays with fresh offsets too
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            out_B = self._step(sampling, generator)
        self.graph, self._out_B = graph, out_B
        self._graph_key = (sampling, id(generator))

    @torch.no_grad()
    def prepare(self, sampling: Sampling = Sampling(),
                generator: torch.Generator | None = None) -> None:
        """Capture the step for this sampling when it is not yet (begin() does it when
        needed; call it first to time the capture apart from the prefill)."""
        if self.cuda_graph and self._graph_key != (sampling, id(generator)):
            self._capture(sampling, generator)

    @torch.no_grad()
    def begin(self, prompt_BT: torch.Tensor, sampling: Sampling = Sampling(),
              generator: torch.Generator | None = None) -> torch.Tensor:
        """The prefill of a new prompt (B, T) on the device: its first new token (B,), left
        in tokens_B1 for the next step. Captures the step first when it is not yet."""
        B, T = prompt_BT.shape
        if B != self.batch or T > self.max_len:
            raise ValueError(f"prompt has shape {tuple(prompt_BT.shape)}; this decoder holds "
                             f"{self.batch} rows of at most max_len={self.max_len} positions")
        self.prepare(sampling, generator)
        weight = self.model.lm_head.weight
        if self.head_VH is not weight:      # the head as it is now, into the same buffer
            self.head_VH[:weight.shape[0]].copy_(weight)
        Tb = bucket(T, self.max_len)
        tokens_BT = torch.zeros(B, Tb, dtype=torch.int64, device=self.device)
        tokens_BT[:, :T] = prompt_BT
        positions_T = torch.arange(Tb, device=self.device)
        keep_T = torch.full((1,), T - 1, dtype=torch.int64, device=self.device)
        logits_BV = self._forward(self.fns["prefill_block"], self.fns["prefill_head"],
                                  tokens_BT, positions_T, keep_T)
        next_B = sample(logits_BV[:, -1], sampling, generator)
        self.tokens_B1.copy_(next_B[:, None])
        self.pos.fill_(T)
        return next_B

    @torch.no_grad()
    def advance(self, sampling: Sampling = Sampling(),
                generator: torch.Generator | None = None) -> torch.Tensor:
        """One decode step after begin(): the next token of every row (B,) on the device
        (a graph replay when captured; no host sync either way)."""
        if self.graph is None:
            return self._step(sampling, generator)
        if self._graph_key != (sampling, id(generator)):
            raise ValueError("advance() must use the sampling and generator of begin()")
        self.graph.replay()
        self.replays += 1
        return self._out_B

    def stream(self, prompt_BT: torch.Tensor, max_new_tokens: int,
               sampling: Sampling = Sampling(),
               generator: torch.Generator | None = None) -> Iterator[list[int]]:
        """Each step's tokens, one per row, as they come (at most max_new_tokens steps)."""
        check_int("max_new_tokens", max_new_tokens)
        T = prompt_BT.shape[1]
        if T + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} needs "
                             f"{T + max_new_tokens - 1} cache positions; this decoder holds "
                             f"max_len={self.max_len}")
        was_training = self.model.training
        self.model.eval()
        try:
            yield self.begin(prompt_BT, sampling, generator).tolist()
            for _ in range(max_new_tokens - 1):
                yield self.advance(sampling, generator).tolist()
        finally:
            self.model.train(was_training)

    def generate(self, prompt_BT: torch.Tensor, max_new_tokens: int, *,
                 eos_id: int | None = None, stop_sequences=None, stop_fn=None,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None,
                 generator: torch.Generator | None = None) -> list[list[int]]:
        """model/generate.py's generate() on this decoder: the same arguments and result."""
        check_arguments(self.model, prompt_BT, max_new_tokens, eos_id, stop_sequences,
                        generator)
        sampling = Sampling(temperature, top_k, top_p)
        new: list[list[int]] = [[] for _ in range(prompt_BT.shape[0])]
        done = [False] * prompt_BT.shape[0]
        steps = self.stream(prompt_BT, max_new_tokens, sampling, generator)
        for tokens in steps:
            if not record(new, done, tokens, eos_id, stop_sequences, stop_fn):
                steps.close()
                break
        return new


def generate_static(model, prompt_BT: torch.Tensor, max_new_tokens: int, *,
                    compile: bool = False, backend: str = "inductor",
                    cuda_graph: bool | None = None, **kwargs) -> list[list[int]]:
    """generate() through a StaticDecoder sized for this prompt (kwargs: generate()'s)."""
    check_arguments(model, prompt_BT, max_new_tokens, kwargs.get("eos_id"),
                    kwargs.get("stop_sequences"), kwargs.get("generator"))
    B, T = prompt_BT.shape
    decoder = StaticDecoder(model, B, cache_length(T, max_new_tokens, model.config.max_seq_len),
                            compile=compile, backend=backend, cuda_graph=cuda_graph)
    return decoder.generate(prompt_BT, max_new_tokens, **kwargs)
