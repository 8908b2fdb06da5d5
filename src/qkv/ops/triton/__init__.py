"""The ``triton`` backend: fused FlashAttention-2 kernels with qkv's mask contract.

``kernels.py`` holds the kernels (its docstring says what they support and what not);
``backend.py`` the backend behind the dispatcher. Importing this package does not import
triton: that happens when a kernel first runs, so ``import qkv`` works without it.
"""

from .backend import (
    MAX_HEAD_DIM,
    Blocks,
    TritonBackend,
    default_blocks,
    interpreter,
    interpreting,
    triton_attention,
    triton_available,
)

__all__ = [
    "MAX_HEAD_DIM",
    "Blocks",
    "TritonBackend",
    "default_blocks",
    "interpreter",
    "interpreting",
    "triton_attention",
    "triton_available",
]
