"""MoremoeForCausalLM: the moremoe Transformer as a transformers PreTrainedModel.

The wrapper holds the Transformer itself under ``model`` (weights are shared, never copied:
``from_transformer`` wraps an existing module and ``to_transformer`` hands it back), so the
checkpoint's keys are the Transformer's with a ``model.`` prefix. ``generate()`` runs on
transformers' own DynamicCache, which the Transformer updates through the same
``update``/``get_seq_length`` calls as moremoe's KVCache. transformers passes that cache as
``past_key_values`` up to 5.x and as ``cache`` since; ``forward`` takes either and returns
it under the output field the installed transformers has. With
``generate(..., cache_implementation="static")`` the Transformer writes transformers'
StaticCache at the positions that cache counts on the device (model/transformer.py), so the
step's shapes never change and transformers compiles it on a GPU. Padded batches are
refused: the model has no per-row positions (generate one row at a time or with
equal-length prompts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model.transformer import IGNORE_INDEX, Transformer, rotary_tables
from ..runtime import in_graph
from .configuration_moremoe import MoremoeConfig

# the output field that carries the cache: "cache" in newer transformers, "past_key_values"
# before (the old name still works there, with a deprecation warning on every call)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


class MoremoeForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoremoeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = True              # transformers 4.x: generate() makes a DynamicCache
    _supports_static_cache = True             # transformers 4.x: cache_implementation="static"
    # generate() with a static cache compiles the decoding forward (fullgraph) on a GPU: every
    # step of the Transformer traces (no host sync, runtime.in_graph)
    _can_compile_fullgraph = True

    def __init__(self, config: MoremoeConfig, transformer: Transformer | None = None):
        super().__init__(config)
        self.model = transformer if transformer is not None else Transformer(
            config.to_transformer_config())
        self.post_init()

    @classmethod
    def from_transformer(cls, transformer: Transformer, **config_kwargs) -> "MoremoeForCausalLM":
        """Wrap a trained Transformer; its parameters become this model's (no copy)."""
        config = MoremoeConfig.from_transformer_config(transformer.config, **config_kwargs)
        return cls(config, transformer)

    def to_transformer(self) -> Transformer:
        return self.model

    def _init_weights(self, module):
        """Weights come from the Transformer's own init (or the checkpoint); only the rotary
        tables, buffers never saved, are recomputed here when loading left them unset."""
        if isinstance(module, Transformer):
            c = module.config
            cos, sin = rotary_tables(c.max_seq_len, c.dim_per_head, c.rope_theta)
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, return_dict=None,
                inputs_embeds: torch.FloatTensor | None = None, cache=None,
                **kwargs) -> CausalLMOutputWithPast:
        """labels as in transformers: the input ids themselves (shifted here), -100 ignored;
        inputs_embeds (B, T, h) in place of input_ids; the cache as ``cache`` or
        ``past_key_values`` (whichever the caller's transformers uses)."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("got both cache and past_key_values: pass the cache once")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        T = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        _check_unpadded(attention_mask, cache if use_cache else None, T)
        _check_static_length(cache if use_cache else None, self.config.max_position_embeddings)
        keep = None
        if logits_to_keep and labels is None:      # the output head on those positions only
            keep = torch.arange(max(T - logits_to_keep, 0), T,
                                device=self.model.embed.weight.device)
        out = self.model(input_ids, cache=cache if use_cache else None,
                         embeds_BTh=inputs_embeds, keep_T=keep)
        logits = out.logits if not logits_to_keep else out.logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, out.logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      **{CACHE_FIELD: cache if use_cache else None})


def _check_unpadded(mask, cache, T: int) -> None:
    """ValueError for a padded batch. transformers gives the 2-D mask (B, S) of ones, or with
    a static cache the 4-D one it built (B, 1, T, S): query t at position p must see exactly
    the p + 1 keys at and before it. Not checked inside a graph (it reads the mask back)."""
    if mask is None or in_graph():
        return
    if mask.dim() == 4:
        visible = mask == 0 if mask.is_floating_point() else mask.bool()
        start = cache.get_seq_length() if cache is not None else 0
        ok = (visible.sum(-1) == torch.arange(1, T + 1, device=mask.device) + start).all()
    else:
        ok = mask.bool().all()
    if not bool(ok):
        raise ValueError("padded inputs (zeros in attention_mask) are not supported: "
                         "generate one row at a time or with equal-length prompts")


def _check_static_length(cache, max_seq_len: int) -> None:
    """A static cache longer than the rotary tables (max_seq_len) would index past them."""
    if not getattr(cache, "is_compileable", False):
        return
    length = cache.get_max_length()
    if length > max_seq_len:
        raise ValueError(f"the static cache holds {length} positions (for the prompt and "
                         f"the new tokens), expected <= max_seq_len={max_seq_len}")
