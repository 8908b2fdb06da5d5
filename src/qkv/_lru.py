"""A bounded, thread-safe, least-recently-used memo: what the plan caches (``ops/plan_cache.py``)
and the tensor-identity caches (``_identity.py``) keep their entries in."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["LRU"]


class LRU:
    """At most ``size`` values by key, the least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, key: tuple, make: Callable[[], Any], valid: Callable[[Any], bool] | None = None
    ) -> Any:
        """The value under ``key``: remembered (and ``valid(value)``, when given), or ``make()``
        and remembered. ``make`` runs outside the lock: it may be slow, and two threads may
        both make a value (the later one stays)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                if valid is None or valid(hit):
                    self._entries.move_to_end(key)
                    return hit
                del self._entries[key]
        entry = make()
        with self._lock:
            self._entries[key] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
