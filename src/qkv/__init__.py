"""qkv: self-attention and multi-head attention for PyTorch, exact, fast and see-through."""
from . import models, tasks
from .capture import Captured, capture, load_capture
from .dispatch import backend_names
from .functional import linear_attention, scaled_dot_product_attention
from .nn import (AdditiveAttention, KVCache, LinearMultiHeadAttention, LocalMultiHeadAttention,
                 MultiHeadAttention, SelfAttention)
from .ops import BackendUnsupportedError
from .ops.linear import Favor, FeatureMap, LinearAttentionState
from .models import (DecoderLM, EncoderClassifier, Seq2SeqTransformer, ViT, attention_kinds)
from .trace import AttentionTrace, MultiHeadTrace

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionTrace",
    "MultiHeadAttention",
    "MultiHeadTrace",
    "SelfAttention",
    "Seq2SeqTransformer",
    "ViT",
    "attention_kinds",
    "BackendUnsupportedError",
    "Captured",
    "DecoderLM",
    "EncoderClassifier",
    "Favor",
    "FeatureMap",
    "KVCache",
    "LinearAttentionState",
    "LinearMultiHeadAttention",
    "LocalMultiHeadAttention",
    "backend_names",
    "capture",
    "linear_attention",
    "load_capture",
    "models",
    "tasks",
    "scaled_dot_product_attention",
]
