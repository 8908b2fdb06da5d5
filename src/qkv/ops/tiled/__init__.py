"""The tiled backend: FlashAttention's algorithm in PyTorch ops, for structured masks.

Read top-down:

* ``backend.py``: :class:`TiledBackend` (what it takes, how a call runs) and the pieces ring
  attention reuses (``piece_forward``, ``piece_backward``, ``merge_by_lse``);
* ``batch.py``: batches whose elements attend other keys (padding, documents per element)
  cut into runs of elements, each planned on its own keys;
* ``plan.py``: which (tile, block) pairs a mask leaves empty, partial or full, the units they
  are joined into, and the plans remembered across calls;
* ``forward.py`` and ``backward.py``: the block loops;
* ``op.py``: the same as ``torch.library`` custom ops, so ``torch.compile`` keeps the O(T + S)
  memory in one graph.
"""

from .backend import (
    MIN_FULL_RUN,
    PLAN_CACHE_SIZE,
    KernelLane,
    TiledBackend,
    _plan,
    _plan_cache,
    clear_plan_cache,
    kernel_lane,
    merge_by_lse,
    piece_backward,
    piece_forward,
    tiled_attention,
)

__all__ = [
    "MIN_FULL_RUN",
    "PLAN_CACHE_SIZE",
    "KernelLane",
    "TiledBackend",
    "_plan",
    "_plan_cache",
    "clear_plan_cache",
    "kernel_lane",
    "merge_by_lse",
    "piece_backward",
    "piece_forward",
    "tiled_attention",
]
