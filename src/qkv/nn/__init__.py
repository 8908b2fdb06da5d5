"""Attention modules: (B, T, C) in, (B, T, C) out."""
from .additive import AdditiveAttention
from .attention import MultiHeadAttention, SelfAttention

__all__ = ["AdditiveAttention", "MultiHeadAttention", "SelfAttention"]
