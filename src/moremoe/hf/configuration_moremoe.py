"""MoremoeConfig: a TransformerConfig in Hugging Face's config format (model_type "moremoe").

Fields take the names transformers' generic code reads (vocab_size, num_hidden_layers, ...);
the feed-forward layer is the MoEConfig as a dict under ``moe``.
"""
from __future__ import annotations

from transformers import PretrainedConfig

from ..model.transformer import TransformerConfig, feed_forward_config
from ..nn.moe import MoEConfig

# TransformerConfig field -> MoremoeConfig attribute
_NAMES = {"vocab": "vocab_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
          "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
          "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
          "norm_eps": "rms_norm_eps", "init_std": "initializer_range"}


class MoremoeConfig(PretrainedConfig):
    model_type = "moremoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size: int = 50257, num_hidden_layers: int = 12,
                 num_attention_heads: int = 16, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, max_position_embeddings: int = 1024,
                 rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5,
                 initializer_range: float = 0.02, moe: dict | None = None,
                 hidden_size: int | None = None, use_cache: bool = True,
                 tie_word_embeddings: bool = False, **kwargs):
        moe = dict(moe) if moe is not None else MoEConfig.more(1024, 4, 512, 56, 64).to_dict()
        if hidden_size is not None and hidden_size != moe["hidden"]:
            raise ValueError(f"hidden_size must equal moe['hidden']={moe['hidden']}, "
                             f"got {hidden_size}")
        self.vocab_size = vocab_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.moe = moe
        self.hidden_size = moe["hidden"]
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.to_transformer_config()          # validate now rather than at model build

    def to_transformer_config(self) -> TransformerConfig:
        fields = {name: getattr(self, attr) for name, attr in _NAMES.items()}
        return TransformerConfig(moe=feed_forward_config(self.moe), **fields)

    @classmethod
    def from_transformer_config(cls, cfg: TransformerConfig, **kwargs) -> "MoremoeConfig":
        """With the GPT-2 vocabulary of `moremoe data prepare`, <|endoftext|> is the eos and
        bos token (generation stops there) unless kwargs say otherwise."""
        from ..tasks.tokenizer import EOT_ID, VOCAB_SIZE
        if cfg.vocab == VOCAB_SIZE:
            kwargs.setdefault("eos_token_id", EOT_ID)
            kwargs.setdefault("bos_token_id", EOT_ID)
        d = cfg.to_dict()
        fields = {attr: d[name] for name, attr in _NAMES.items()}
        return cls(moe=d["moe"], **fields, **kwargs)
