"""Hugging Face transformers interop: MoremoeConfig, MoremoeForCausalLM, register().

Needs the ``text`` extra (transformers, safetensors). After ``register()``,
``AutoConfig`` and ``AutoModelForCausalLM`` load moremoe directories saved with
``save_pretrained`` (safetensors weights and config.json).
"""
from __future__ import annotations

try:
    from .configuration_moremoe import MoremoeConfig
    from .modeling_moremoe import MoremoeForCausalLM
except ImportError as err:         # the message names the extra to install
    raise ImportError(f"moremoe.hf needs transformers: pip install 'moremoe[text]' ({err})") \
        from err

__all__ = ["MoremoeConfig", "MoremoeForCausalLM", "register", "export"]


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know model_type "moremoe" (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    AutoConfig.register("moremoe", MoremoeConfig, exist_ok=True)
    AutoModelForCausalLM.register(MoremoeConfig, MoremoeForCausalLM, exist_ok=True)


def export(transformer, out_dir, **config_kwargs):
    """Save a moremoe Transformer as a transformers directory (config.json,
    model.safetensors); returns the path."""
    MoremoeForCausalLM.from_transformer(transformer, **config_kwargs).save_pretrained(out_dir)
    return out_dir
