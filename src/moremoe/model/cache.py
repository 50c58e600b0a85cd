"""Key/value cache for incremental decoding.

Each layer's keys and values live in one (B, G, T_max, D) buffer allocated at that layer's
first update, in the dtype and on the device of the keys it is given (so autocast's bf16 keys
are cached in bf16). The interface, ``update(k, v, layer_idx) -> (k_all, v_all)`` and
``get_seq_length()``, is the one Hugging Face's ``Cache`` classes have, so the transformer
decodes with either this cache or theirs.

Legend: B batch, G kv heads, T tokens, D head dim.
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

    def update(self, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor, layer_idx: int):
        """Append this step's keys and values to layer layer_idx; return all of them so far."""
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
