"""qkv: self-attention and multi-head attention for PyTorch, exact, fast and see-through."""
from .dispatch import backend_names
from .functional import scaled_dot_product_attention
from .nn import AdditiveAttention, MultiHeadAttention, SelfAttention
from .ops import BackendUnsupportedError
from .trace import AttentionTrace, MultiHeadTrace

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionTrace",
    "MultiHeadAttention",
    "MultiHeadTrace",
    "SelfAttention",
    "BackendUnsupportedError",
    "backend_names",
    "scaled_dot_product_attention",
]
