"""A bounded, thread-safe memo of block plans, shared by the backends that plan per call.

A model calls attention with the same mask and sizes in every layer and step; planning which
blocks to visit (``qkv.masks.block_states`` and what follows) costs a tenth of a CPU call and,
on a GPU, more than the kernel itself for a window or a document mask (1.5 ms of host work
against a 0.4 ms kernel, H100, T=4096). Keys are built from ``qkv.masks.structure_key`` and
the sizes, so a mask whose tensors change in place gets a new plan. An entry's units are
never modified after they are made; the chunk masks kept beside them are added at first use
(``tiled.plan._Plan.kernel_mask``).
"""

from __future__ import annotations

from .._lru import LRU


class PlanCache(LRU):
    """Least-recently-used memo of at most ``size`` plans (``get(key, make)``)."""
