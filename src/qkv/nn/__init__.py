"""Attention modules: (B, T, C) in, (B, T, C) out."""

from .additive import AdditiveAttention
from .attention import MultiHeadAttention, SelfAttention
from .cache import KVCache
from .deformable import MultiScaleDeformableAttention
from .efficient import LinearMultiHeadAttention, LocalMultiHeadAttention

__all__ = [
    "AdditiveAttention",
    "KVCache",
    "LinearMultiHeadAttention",
    "LocalMultiHeadAttention",
    "MultiHeadAttention",
    "MultiScaleDeformableAttention",
    "SelfAttention",
]
