"""Values derived from a tensor, remembered by the tensor's identity and version.

Planning reads tensors on the host (a document's ids, a dense mask's empty blocks), and on
CUDA each read is a device sync. A model passes the same mask to every layer and every step,
so what was derived from it is remembered under a key made without reading a value: where
the tensor's values are (data pointer, storage offset, shape, strides, dtype, device) and its
version counter, which every change in place bumps (a view shares its base's counter). The
entry also holds a weak reference to the tensor's base (or to the tensor itself): while that
lives, no other tensor can have been given its memory, so a hit is the same values.

Not remembered: inference tensors (they keep no version counter: a change in place inside
``torch.inference_mode`` could not be noticed), tensors that require grad (``gradcheck`` and
some optimizers change them through ``tensor.data``, which bumps no counter) and tensors
without storage (meta, fake tensors under tracing); for them :meth:`IdentityCache.get` makes
the value every call. Any other change made through ``tensor.data`` goes unnoticed, as it
does for autograd.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ._lru import LRU

__all__ = ["IdentityCache", "identity_key"]


def identity_key(t: Tensor) -> tuple | None:
    """Where ``t``'s values are and its version, or None when ``t`` cannot be keyed so."""
    if t.is_inference() or t.requires_grad or t.device.type == "meta":
        return None
    try:
        return (
            t.data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            t.device,
            t._version,
        )
    except (RuntimeError, NotImplementedError):  # no storage (fake, functional, sparse)
        return None


class IdentityCache:
    """Least-recently-used memo of at most ``size`` values derived from tensors."""

    def __init__(self, size: int) -> None:
        self._memo = LRU(size)

    @property
    def size(self) -> int:
        return self._memo.size

    def __len__(self) -> int:
        return len(self._memo)

    def get(
        self,
        tensors: tuple[Tensor, ...],
        extra: Any,
        make: Callable[[], Any],
        fresh: Callable[[], Any] | None = None,
    ) -> Any:
        """``make()``, remembered for these tensors (unchanged since) and ``extra`` (a hashable
        of whatever else the value depends on). ``fresh`` (default ``make``) makes the value
        for tensors that cannot be remembered: one that reads on the host to save work in
        later calls has no later call to save it for."""
        keys = tuple(identity_key(t) for t in tensors)
        if None in keys:
            return (fresh or make)()

        def made() -> tuple:
            value = make()
            return tuple(weakref.ref(t if t._base is None else t._base) for t in tensors), value

        # a base freed since: its memory may hold another tensor, so the entry is made anew
        _, value = self._memo.get((keys, extra), made, _bases_alive)
        return value

    def clear(self) -> None:
        self._memo.clear()


def _bases_alive(entry: tuple) -> bool:
    refs, _ = entry
    return all(r() is not None for r in refs)
