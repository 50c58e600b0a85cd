"""Single-device decoder-only transformer with MoE / MoRE feed-forward layers."""
from .cache import KVCache, StaticKVCache
from .generate import generate
from .sampling import Sampling
from .static import StaticDecoder, generate_static
from .transformer import IGNORE_INDEX, Transformer, TransformerConfig, TransformerOutput

__all__ = ["IGNORE_INDEX", "KVCache", "Sampling", "StaticDecoder", "StaticKVCache",
           "Transformer", "TransformerConfig", "TransformerOutput", "generate",
           "generate_static"]
