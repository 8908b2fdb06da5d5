"""qkv: self-attention and multi-head attention for PyTorch, exact, fast and see-through.

The documented submodules (``qkv.viz``, ``qkv.analysis``, ``qkv.torch_compat``,
``qkv.testing``, ``qkv.distributed``, ``qkv.integrations``, ...) are reached as attributes
after a plain ``import qkv``; the ones not imported here load on first use, so ``import qkv``
stays fast and needs nothing beyond torch.
"""

import importlib as _importlib

from . import models, tasks
from .capture import Captured, capture, load_capture
from .dispatch import backend_names
from .functional import deformable_attention, linear_attention, scaled_dot_product_attention
from .models import DecoderLM, EncoderClassifier, Seq2SeqTransformer, ViT, attention_kinds
from .nn import (
    AdditiveAttention,
    KVCache,
    LinearMultiHeadAttention,
    LocalMultiHeadAttention,
    MultiHeadAttention,
    SelfAttention,
)
from .ops import BackendUnsupportedError
from .ops.linear import Favor, FeatureMap, LinearAttentionState
from .trace import AttentionTrace, DeformableTrace, MultiHeadTrace

__version__ = "0.1.0"

# loaded on first attribute access (module __getattr__, PEP 562)
_LAZY_SUBMODULES = (
    "analysis",
    "bench",
    "cli",
    "distributed",
    "examples",
    "integrations",
    "masks",
    "ops",
    "sources",
    "testing",
    "torch_compat",
    "training",
    "viz",
    "walkthrough",
)


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "AdditiveAttention",
    "AttentionTrace",
    "BackendUnsupportedError",
    "Captured",
    "DecoderLM",
    "DeformableTrace",
    "EncoderClassifier",
    "Favor",
    "FeatureMap",
    "KVCache",
    "LinearAttentionState",
    "LinearMultiHeadAttention",
    "LocalMultiHeadAttention",
    "MultiHeadAttention",
    "MultiHeadTrace",
    "SelfAttention",
    "Seq2SeqTransformer",
    "ViT",
    "attention_kinds",
    "backend_names",
    "capture",
    "deformable_attention",
    "linear_attention",
    "load_capture",
    "models",
    "scaled_dot_product_attention",
    "tasks",
]
