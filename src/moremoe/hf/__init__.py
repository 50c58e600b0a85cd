"""Hugging Face transformers interop: MoremoeConfig, MoremoeForCausalLM, register(), export().

Needs the ``text`` extra (transformers, safetensors). After ``register()``,
``AutoConfig`` and ``AutoModelForCausalLM`` load moremoe directories saved with
``save_pretrained`` (safetensors weights and config.json); an ``export`` folder also holds
GPT-2's tokenizer files (for a model of GPT-2's vocabulary) and a model card.
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


# Written beside the weights and named by config.json's auto_map, so that
# AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) loads the model with
# moremoe installed but not imported (no register() call).
REMOTE_CODE = {
    "configuration_moremoe.py": "from moremoe.hf.configuration_moremoe import MoremoeConfig\n",
    "modeling_moremoe.py": "from moremoe.hf.modeling_moremoe import MoremoeForCausalLM\n",
}
AUTO_MAP = {"AutoConfig": "configuration_moremoe.MoremoeConfig",
            "AutoModelForCausalLM": "modeling_moremoe.MoremoeForCausalLM"}


def export(transformer, out_dir, *, info: dict | None = None, name: str | None = None,
           **config_kwargs):
    """Save a moremoe Transformer as a transformers directory: config.json with auto_map,
    model.safetensors, the two remote-code modules, the GPT-2 tokenizer files when the
    vocabulary is GPT-2's (hf/tokenizer.py) and the model card README.md (hf/card.py; info:
    card.run_info of the checkpoint, name: the card's title). Returns the path."""
    from pathlib import Path

    from ..report import with_umask
    from ..tasks.tokenizer import VOCAB_SIZE
    from .card import model_card
    from .tokenizer import write_gpt2_tokenizer
    model = MoremoeForCausalLM.from_transformer(transformer, **config_kwargs)
    model.config.auto_map = dict(AUTO_MAP)
    # transformers 4.x marks the classes once loaded with trust_remote_code for copying
    # their source files on save, which would follow moremoe's own imports: the two modules
    # below are the remote code
    model._auto_class = model.config._auto_class = None
    cfg = transformer.config
    gpt2 = cfg.vocab == VOCAB_SIZE
    if gpt2:    # transformers < 5's pipeline() loads a tokenizer only for a config that names one
        model.config.tokenizer_class = "PreTrainedTokenizerFast"
    model.save_pretrained(out_dir)
    for module, code in REMOTE_CODE.items():
        (Path(out_dir) / module).write_text('"""moremoe\'s transformers classes (pip install '
                                            '\'moremoe[text]\')."""\n' + code)
    if gpt2:
        write_gpt2_tokenizer(out_dir, cfg.max_seq_len)
    (Path(out_dir) / "README.md").write_text(
        model_card(cfg, info or {}, name=name or Path(out_dir).name))
    for f in Path(out_dir).iterdir():      # the weights too, not 0600 beside 0644 files
        if f.is_file():
            with_umask(f)
    return out_dir
