"""Key/value caches for incremental decoding.

KVCache (the reference path, model/generate.py): each layer's keys and values live in one
(B, G, T_max, D) buffer allocated at that layer's first update, in the dtype and on the
device of the keys it is given (so autocast's bf16 keys are cached in bf16), filled in order;
the cached length is a Python int and attention reads the filled part. The interface,
``update(k, v, layer_idx) -> (k_all, v_all)`` and ``get_seq_length()``, is the one Hugging
Face's ``Cache`` classes have, so the transformer decodes with either this cache or theirs.

StaticKVCache (the captured decode step, model/static.py): every layer's (B, G, L, D)
buffers allocated up front, written at positions given as a tensor (``cache_position``, as
transformers' StaticCache takes them), never resized: a step's shapes and addresses do not
change from one token to the next, so the step can be captured once as a CUDA graph. The
cache does not know how much of it is filled; the caller passes the positions, and
attention masks the keys past them (model/transformer.py).

Legend: B batch, G kv heads, T tokens, L the static cache's length, D head dim.
"""
from __future__ import annotations

import torch

from ..checks import check_int


class KVCache:
    def __init__(self, max_len: int):
        check_int("max_len", max_len)
        self.max_len = max_len
        self.k_BGTD: list[torch.Tensor] = []
        self.v_BGTD: list[torch.Tensor] = []
        self.lengths: list[int] = []

    def update(self, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None):
        """Append this step's keys and values to layer layer_idx; return all of them so far.
        cache_kwargs: transformers' argument, unused (the positions follow the length)."""
        if layer_idx == len(self.lengths):
            B, G, _, D = k_BGTD.shape
            self.k_BGTD.append(k_BGTD.new_empty(B, G, self.max_len, D))
            self.v_BGTD.append(v_BGTD.new_empty(B, G, self.max_len, D))
            self.lengths.append(0)
        elif layer_idx > len(self.lengths):
            raise ValueError(f"layer_idx must be <= {len(self.lengths)} (layers are filled in "
                             f"order), got {layer_idx}")
        start, T = self.lengths[layer_idx], k_BGTD.shape[2]
        end = start + T
        if end > self.max_len:
            raise ValueError(f"the cache holds max_len={self.max_len} tokens; {start} cached "
                             f"plus {T} new is {end}")
        k_all, v_all = self.k_BGTD[layer_idx], self.v_BGTD[layer_idx]
        if k_BGTD.shape[:2] != k_all.shape[:2] or k_BGTD.shape[3] != k_all.shape[3]:
            raise ValueError(f"keys of shape {tuple(k_BGTD.shape)} do not fit the cache of "
                             f"shape {tuple(k_all.shape)} (B, G, T_max, D)")
        k_all[:, :, start:end] = k_BGTD
        v_all[:, :, start:end] = v_BGTD
        self.lengths[layer_idx] = end
        return k_all[:, :, :end], v_all[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached so far (0 before the first update)."""
        return self.lengths[layer_idx] if layer_idx < len(self.lengths) else 0


class LayerKV:
    """One layer's slot of a StaticKVCache: keys and values (B, G, L, D)."""

    def __init__(self, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor):
        self.k_BGLD, self.v_BGLD = k_BGLD, v_BGLD

    def update(self, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, layer_idx: int | None = None,
               cache_kwargs: dict | None = None):
        """Write the T new keys and values at cache_kwargs["cache_position"] (T,) int64;
        return the whole buffers (B, G, L, D). layer_idx: unused (this is one layer's)."""
        pos_T = (cache_kwargs or {}).get("cache_position")
        if pos_T is None:
            raise ValueError("a static cache is written at given positions: pass "
                             "cache_kwargs={'cache_position': positions (T,) int64}")
        self.k_BGLD.index_copy_(2, pos_T, k_BGTD)
        self.v_BGLD.index_copy_(2, pos_T, v_BGTD)
        return self.k_BGLD, self.v_BGLD


class StaticKVCache:
    """Preallocated keys and values for `layers` layers: (B, G, L, D) each, zeros."""

    def __init__(self, *, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device):
        for name, v in (("layers", layers), ("batch", batch), ("kv_heads", kv_heads),
                        ("max_len", max_len), ("head_dim", head_dim)):
            check_int(name, v)
        self.batch, self.max_len = batch, max_len
        shape = (batch, kv_heads, max_len, head_dim)
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(layers)]

    @classmethod
    def for_model(cls, config, batch: int, max_len: int, *, dtype: torch.dtype,
                  device) -> "StaticKVCache":
        """The cache of a TransformerConfig's layers, max_len <= its max_seq_len."""
        check_int("max_len", max_len, high=config.max_seq_len)
        return cls(layers=config.layers, batch=batch, kv_heads=config.n_kv_heads,
                   max_len=max_len, head_dim=config.dim_per_head, dtype=dtype, device=device)

    def update(self, k_BGTD, v_BGTD, layer_idx: int, cache_kwargs: dict | None = None):
        return self.layers[layer_idx].update(k_BGTD, v_BGTD, cache_kwargs=cache_kwargs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers
                   for t in (kv.k_BGLD, kv.v_BGLD))
