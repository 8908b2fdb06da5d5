"""Large CPU buffers backed by transparent huge pages where Linux allows it.

A freshly allocated tensor is only address space; its pages are faulted in and zeroed by the
kernel on first write, 4 KiB at a time. For the weights of a long call (a ``(B, H, T, S)``
tensor of hundreds of MiB) that first touch costs more than the softmax written into them:
8 x 4096^2 float32 weights take 109 ms to fault in, 45 ms with 2 MiB pages (and 7.5 vs 2.6 ms
at 1024^2), measured on the 2-core Xeon box. ``madvise(MADV_HUGEPAGE)`` asks for huge pages on
the range before it is touched; with transparent huge pages set to ``madvise`` (a common
default) that is the only way to get them. It changes no value and no global setting: the
advice belongs to the allocation and goes with it.

Not measured per machine (issue 38 measures the CPU's speed choices), for want of a choice to
make: where the kernel honours the advice (transparent huge pages ``madvise``), it halves
the first touch (the AMX Xeon box, THP ``madvise``: 128 MiB filled in 35 ms advised against
71 ms, median of 7, one thread); where it does not (``never``, or ``always``, which gives huge
pages unasked), it costs one system call. What could make huge pages slower, direct
compaction of a fragmented memory on fault, is a state of the moment, which a verdict timed
once and kept on disk would not describe. The threshold (4 MiB) is no tuning either: below
it, faulting in is a small part of the work on every machine.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import Tensor

__all__ = ["empty_large"]

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MIN_BYTES = 4 << 20  # below this, faulting in is cheap beside the work


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty_large(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty(shape)``, with its whole 2 MiB pages advised to be huge pages when it is a
    large CPU tensor on Linux (silently not where the advice cannot be given)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is None or out.device.type != "cpu" or nbytes < _MIN_BYTES:
        return out
    start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # first whole huge page inside
    stop = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if stop > start:
        _MADVISE(start, stop - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out
