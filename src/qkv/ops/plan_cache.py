"""A bounded, thread-safe memo of block plans, shared by the backends that plan per call.

A model calls attention with the same mask and sizes in every layer and step; planning which
blocks to visit (``qkv.masks.block_states`` and what follows) costs a tenth of a CPU call and,
on a GPU, more than the kernel itself for a window or a document mask (1.5 ms of host work
against a 0.4 ms kernel, H100, T=4096). Keys are built from ``qkv.masks.structure_key`` and
the sizes, so a mask whose tensors change in place gets a new plan. Entries are never
modified after they are made.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class PlanCache:
    """Least-recently-used memo of at most ``size`` plans."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The plan under ``key``: remembered, or ``make()`` and remembered."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        entry = make()  # outside the lock: planning may be slow, and two threads may both plan
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
