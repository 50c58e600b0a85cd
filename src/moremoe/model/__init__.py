"""Single-device decoder-only transformer with MoE / MoRE feed-forward layers."""
from .transformer import IGNORE_INDEX, Transformer, TransformerConfig, TransformerOutput

__all__ = ["IGNORE_INDEX", "Transformer", "TransformerConfig", "TransformerOutput"]
