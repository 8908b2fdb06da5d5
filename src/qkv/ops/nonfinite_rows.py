"""The NaN/inf contract's passes over rows in one C++ pass each (``nonfinite_rows.cpp``).

``ops/nonfinite.py`` keeps the contract in tensor ops: a matrix-vector product per tensor finds
its bad rows, ``nan_to_num`` copies k and v, and a broadcast add sets rows to NaN, each a pass
over its tensor, and at decode sizes each an op to dispatch (a few µs apiece, against torch's
whole kernel of ~20 µs). On the CPU, without gradient and outside tracing, the same steps run
here, fused:

* :func:`copy_rows`: a copy of k or v with its NaN/inf zeroed and its bad rows flagged, in
  one pass (instead of a product and a copy), or with the rows a key mask hides zeroed;
* :func:`restore_rows`: the output's rows set to NaN where the row, its query row or a flag
  says so, and to 0 where the row has no key, in one pass that writes only those rows
  (instead of two products, a sum and a broadcast add over the output).

Which rows are bad is found and acted on inside a pass; nothing is returned to Python, so a
call dispatches the same work whatever its values (no host reads, issue 38). Results are bit
for bit those of the tensor ops (a NaN row is NaN, a zeroed element 0), which stay the slow
twin: where the library cannot be built (no C++ compiler), for other devices, for gradients,
under tracing, and for layouts this does not take (a last dim with a stride, more than three
leading dims). ``tests/test_nonfinite_eager.py`` runs the contract both ways.

Shape alphabet: rows ``(n0, n1, n2)`` (up to three leading dims), E elements each.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._native_build import build

__all__ = ["RowsCheck", "available", "check_rows", "copy_rows", "restore_rows", "takes"]

SOURCE = Path(__file__).with_name("nonfinite_rows.cpp")
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
# the arguments of each function as one array of int64 (layouts in the source): ctypes takes
# one argument in a third of the time of twenty, and a call here costs what an op does
_COPY_ARGS = struct.Struct("16q")
_RESTORE_ARGS = struct.Struct("35q")
_NO_RANGES = (0,) * 12  # restore's last arguments, without key ranges
_log = logging.getLogger(__name__)


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build(SOURCE, "qkv_nonfinite_rows")
    if lib is None:
        _log.debug("the NaN/inf contract takes its tensor ops: %s", why)
        return None, why
    for fn in (lib.qkv_rows_copy, lib.qkv_rows_restore):
        fn.argtypes = [ctypes.c_char_p]  # the arguments packed as int64 (see the source)
        fn.restype = ctypes.c_int
    return lib, ""


def available() -> bool:
    """Whether the library runs here; builds it at the first ask (seconds once, then a cached
    load of milliseconds)."""
    return _build()[0] is not None


def takes(*tensors: Tensor | None) -> bool:
    """Whether the passes here take these tensors (None skipped): plain CPU tensors of a float
    dtype, none wanting a gradient, each of 2 to 4 dims with unit last stride; and the library
    is built."""
    for t in tensors:
        if t is None:
            continue
        if type(t) is not Tensor or not t.is_cpu or t.dtype not in _DTYPES or t.requires_grad:
            return False
        stride = t.stride()
        if not 2 <= len(stride) <= 4 or (stride[-1] != 1 and t.shape[-1] > 1):
            return False
    return _build()[0] is not None


def _aligned(lead: tuple, strides: tuple) -> tuple[int, int, int]:
    """Strides of the dims ``lead`` broadcast to three row dims (the right ones aligned): 0
    along a dim that broadcasts (size 1) or is missing (dims beyond three are 1: callers
    check)."""
    n = len(lead)
    return (
        strides[-3] if n >= 3 and lead[-3] != 1 else 0,
        strides[-2] if n >= 2 and lead[-2] != 1 else 0,
        strides[-1] if n >= 1 and lead[-1] != 1 else 0,
    )


def _rows(shape: tuple) -> tuple[int, int, int]:
    """Up to three leading dims as exactly three, the missing ones in front (size 1)."""
    n = len(shape)
    return (shape[-3] if n >= 3 else 1, shape[-2] if n >= 2 else 1, shape[-1] if n >= 1 else 1)


def copy_rows(
    src: Tensor,
    *,
    zero_nonfinite: bool,
    flags: Tensor | None = None,
    keep: Tensor | None = None,
) -> Tensor:
    """A contiguous copy of ``src`` in one pass: its NaN/inf zeroed with ``zero_nonfinite``
    (else copied as they are), the rows where ``keep`` is False all zeroed, and ``flags`` set
    to 1.0 on each kept row that held a NaN/inf (left as they were on the others). ``src``
    must be one :func:`takes` takes.

    Shape:
        src ``(*lead, L, E)``; flags ``(*lead, L)`` contiguous float32; keep bool broadcastable
        to ``(*lead, L)`` -> ``(*lead, L, E)``.
    """
    lib = _build()[0]
    assert lib is not None
    shape = src.shape
    lead = shape[:-1]
    dst = torch.empty(shape, dtype=src.dtype)
    assert flags is None or (flags.dtype == torch.float32 and flags.is_contiguous())
    assert flags is None or flags.shape == lead
    failed = lib.qkv_rows_copy(
        _COPY_ARGS.pack(
            _DTYPES[src.dtype],
            *_rows(lead),
            shape[-1],
            src.data_ptr(),
            *_aligned(lead, src.stride()[:-1]),
            dst.data_ptr(),
            0 if keep is None else keep.data_ptr(),
            *((0, 0, 0) if keep is None else _aligned(keep.shape, keep.stride())),
            int(zero_nonfinite),
            0 if flags is None else flags.data_ptr(),
        )
    )
    assert not failed
    return dst


def restore_rows(
    out: Tensor,
    *,
    query: Tensor | None = None,
    check_out: bool = False,
    flags: Tensor | None = None,
    has_key: Tensor | None = None,
    ranges: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """``out`` with each row set in place, in one pass: 0 where ``has_key`` is False or its
    range of keys is empty; else NaN where ``flags`` is not 0, or its range holds a bad key,
    or the row of ``query`` holds a NaN/inf, or (``check_out``) the row itself does; else as
    it is. Only the rows set are written. ``out`` and ``query`` must be ones :func:`takes`
    takes.

    ``ranges``: ``(keys, lo, hi)``: which keys are bad (1.0) per batch element and head, and
    the keys ``[lo, hi)`` each row may attend (``key_counts.ranges``: causal, windows, key
    lengths), counted here instead of by ``key_counts.counts``' ops.

    ``out`` must be the kernel's own (no other tensor shares its memory) with no broadcast dim
    (a row written through two indices): the caller checks.

    Shape:
        out ``(*batch, T, Dv)``; query ``(*qbatch, T, D)``; flags float32 and has_key bool,
        each broadcastable to ``(*batch, T)``; keys ``(B, H, S)`` float32 contiguous and lo,
        hi ``(B?, 1, T)`` int64, with ``(B, H)`` the batch as two dims -> out.
    """
    lib = _build()[0]
    assert lib is not None
    shape = out.shape
    lead = shape[:-1]
    strides = out.stride()[:-1]
    assert flags is None or flags.dtype == torch.float32
    tail: tuple[int, ...] = _NO_RANGES
    if ranges is not None:
        keys, lo, hi = ranges
        assert keys.dtype == torch.float32 and keys.stride(-1) == 1 and keys.dim() == 3
        assert lo.dtype == hi.dtype == torch.int64
        k0, k1, _ = _aligned(keys.shape[:-1] + (1,), keys.stride()[:-1] + (0,))  # (B, H)
        tail = (
            keys.data_ptr(),
            k0,
            k1,
            keys.shape[-1],
            lo.data_ptr(),
            *_aligned(lo.shape, lo.stride()),
        )
        tail += (hi.data_ptr(), *_aligned(hi.shape, hi.stride()))
    failed = lib.qkv_rows_restore(
        _RESTORE_ARGS.pack(
            _DTYPES[out.dtype],
            *_rows(lead),
            out.data_ptr(),
            *_aligned(lead, strides),
            shape[-1],
            int(check_out),
            0 if query is None else query.data_ptr(),
            *((0, 0, 0) if query is None else _aligned(query.shape[:-1], query.stride()[:-1])),
            0 if query is None else query.shape[-1],
            0 if flags is None else flags.data_ptr(),
            *((0, 0, 0) if flags is None else _aligned(flags.shape, flags.stride())),
            0 if has_key is None else has_key.data_ptr(),
            *((0, 0, 0) if has_key is None else _aligned(has_key.shape, has_key.stride())),
            *tail,
        )
    )
    assert not failed
    return out


def check_rows(out: Tensor, query: Tensor, inputs: tuple[Tensor, ...] = ()) -> bool:
    """``restore_rows(out, query=query, check_out=True)`` where this module takes them and
    ``out`` is the kernel's own, and whether it ran (False: nothing done, the caller's tensor
    ops keep the contract). The check of a call whose rows see every key, which runs on every
    decoding step: each test is made once, on attributes read once.

    ``out`` is the kernel's own when no gradient needs it, no dim of it is broadcast (a row
    written through two indices), and its memory is its own, or all of a buffer it is a
    permuted view of (torch's CPU flash kernel returns one): none of ``inputs``.

    Shape:
        out ``(*batch, T, Dv)``; query ``(*qbatch, T, D)`` -> out.
    """
    args = _check_args(out, query)
    lib = _build()[0]
    if args is None or lib is None or not _own_memory(out, inputs):
        return False
    failed = lib.qkv_rows_restore(_RESTORE_ARGS.pack(*args))
    assert not failed
    return True


class RowsCheck:
    """:func:`check_rows` for calls whose ``out`` and ``query`` keep one layout (a decoding
    step's): its tests made and its arguments packed at the first call and whenever the
    layout changes; later calls read the two tensors' strides and pointers only. For one kind
    of call (the same dtypes and devices, no gradient): the caller holds one per kind."""

    __slots__ = ("_args", "_fn", "_layout")

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._args = (ctypes.c_int64 * (_RESTORE_ARGS.size // 8))()  # (35 int64)
        self._fn: Any = None  # the library's function, its own handle

    def __call__(self, out: Tensor, query: Tensor, inputs: tuple[Tensor, ...]) -> bool:
        lib = _build()[0]  # (asked each call: a test hides the library)
        layout = (out.shape, out.stride(), query.shape, query.stride(), lib)
        if layout != self._layout:
            packed = _check_args(out, query)
            if packed is None or lib is None:
                return False
            self._args[:] = packed
            self._layout = layout
            self._fn = lib["qkv_rows_restore"]  # its own handle, taking the array as it is
            self._fn.restype = ctypes.c_int
        if not _own_memory(out, inputs):
            return False
        args = self._args
        args[4], args[10] = out.data_ptr(), query.data_ptr()
        failed = self._fn(args)
        assert not failed
        return True


def _check_args(out: Tensor, query: Tensor) -> list | None:
    """The arguments of ``qkv_rows_restore`` for :func:`check_rows`, or None where this module
    does not take ``out`` and ``query`` (see there): everything but whose memory ``out`` is."""
    if type(out) is not Tensor or type(query) is not Tensor or not (out.is_cpu and query.is_cpu):
        return None
    code = _DTYPES.get(out.dtype)
    if code is None or query.dtype != out.dtype or out.requires_grad or query.requires_grad:
        return None
    shape, strides, qshape, qstrides = out.shape, out.stride(), query.shape, query.stride()
    n, nq = len(shape), len(qshape)
    if not (2 <= n <= 4 and 2 <= nq <= 4) or (strides[-1] != 1 and shape[-1] > 1):
        return None
    if qstrides[-1] != 1 and qshape[-1] > 1:
        return None
    for i in range(n - 1):
        if strides[i] == 0 and shape[i] > 1:
            return None  # a broadcast dim
    if _build()[0] is None:
        return None
    lead, qlead = shape[:-1], qshape[:-1]
    return [
        code,
        *_rows(lead),
        out.data_ptr(),  # [4]
        *_aligned(lead, strides[:-1]),
        shape[-1],
        1,
        query.data_ptr(),  # [10]
        *_aligned(qlead, qstrides[:-1]),
        qshape[-1],
        *(0,) * 8,
        *_NO_RANGES,
    ]


def _own_memory(out: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether ``out``'s memory is its own, or all of a buffer it is a view of, and none of
    ``inputs`` (compared by identity: ``in`` would compare values)."""
    base = out._base
    if base is None:
        base = out
    elif base.numel() != out.numel():
        return False  # a slice of something larger
    return all(base is not t and base is not t._base for t in inputs)
