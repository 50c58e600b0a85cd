"""Single-device decoder-only transformer with MoE / MoRE feed-forward layers."""
from .cache import KVCache
from .generate import generate
from .transformer import IGNORE_INDEX, Transformer, TransformerConfig, TransformerOutput

__all__ = ["IGNORE_INDEX", "KVCache", "Transformer", "TransformerConfig", "TransformerOutput",
           "generate"]
