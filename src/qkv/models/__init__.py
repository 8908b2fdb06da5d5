"""Transformer models on qkv's attention modules: encoder/decoder layers, an encoder-decoder
Transformer, a decoder-only language model, an encoder classifier and a ViT.

The attention kind is a constructor argument of every model (``attention="exact" | "linear" |
"performer" | "local"``, ``attention_options={...}``); :func:`make_attention` is the only
place that maps it to a module.
"""

from .embeddings import LearnedPositions, PatchEmbedding, SinusoidalPositions, TokenEmbedding
from .generate import TokenChooser
from .kinds import attention_kinds, make_attention, register_attention
from .layers import (
    AttentionMaps,
    Decoder,
    DecoderLayer,
    DecodingCache,
    Encoder,
    EncoderLayer,
    FeedForward,
)
from .transformer import DecoderLM, EncoderClassifier, Seq2SeqTransformer
from .vit import ViT

__all__ = [
    "AttentionMaps",
    "Decoder",
    "DecoderLM",
    "DecoderLayer",
    "DecodingCache",
    "Encoder",
    "EncoderClassifier",
    "EncoderLayer",
    "FeedForward",
    "LearnedPositions",
    "PatchEmbedding",
    "Seq2SeqTransformer",
    "SinusoidalPositions",
    "TokenChooser",
    "TokenEmbedding",
    "ViT",
    "attention_kinds",
    "make_attention",
    "register_attention",
]
