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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._native_build import build_declared

__all__ = [
    "KeymaskRows",
    "RowsCheck",
    "available",
    "check_rows",
    "copy_rows",
    "flag_rows",
    "keymask_rows",
    "restore_rows",
    "takes",
    "takes_keymask",
]

SOURCE = Path(__file__).with_name("nonfinite_rows.cpp")
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
# the arguments of each function as one array of int64 (layouts in the source): ctypes takes
# one argument in a third of the time of twenty, and a call here costs what an op does
_COPY_ARGS = struct.Struct("16q")
_RESTORE_ARGS = struct.Struct("53q")
_KEYMASK_ARGS = struct.Struct("32q")
_DOUBLE, _DOUBLE_BITS = struct.Struct("d"), struct.Struct("q")  # a double passed as its bits
_NO_RANGES = (0,) * 12  # restore's arguments of key ranges, without
_NO_RECOMPUTE = (0,) * 18  # restore's last arguments: no row computed again
_log = logging.getLogger(__name__)


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    packed = [ctypes.c_char_p]  # the arguments packed as int64 (see the source)
    names = ("qkv_rows_copy", "qkv_rows_restore", "qkv_rows_keymask")
    instead = "the NaN/inf contract takes its tensor ops"
    return build_declared(SOURCE, "qkv_nonfinite_rows", dict.fromkeys(names, packed), _log, instead)


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
    dst = torch.empty(shape, dtype=src.dtype, device=src.device)
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


def flag_rows(src: Tensor, flags: Tensor) -> None:
    """``flags`` set to 1.0 on each row of ``src`` that holds a NaN/inf (left as they were on
    the others), in one pass that reads ``src`` only. ``src`` must be one :func:`takes` takes.

    Shape:
        src ``(*lead, L, E)``; flags ``(*lead, L)`` contiguous float32.
    """
    lib = _build()[0]
    assert lib is not None
    lead = src.shape[:-1]
    assert flags.dtype == torch.float32 and flags.is_contiguous() and flags.shape == lead
    failed = lib.qkv_rows_copy(
        _COPY_ARGS.pack(
            _DTYPES[src.dtype],
            *_rows(lead),
            src.shape[-1],
            src.data_ptr(),
            *_aligned(lead, src.stride()[:-1]),
            0,  # no copy: the flags alone
            0,
            0,
            0,
            0,
            0,
            flags.data_ptr(),
        )
    )
    assert not failed


def restore_rows(
    out: Tensor,
    *,
    query: Tensor | None = None,
    check_out: bool = False,
    flags: Tensor | None = None,
    has_key: Tensor | None = None,
    ranges: tuple[Tensor | None, Tensor, Tensor] | None = None,
    recompute: tuple[Tensor, Tensor, float, int] | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """``out`` with each row set in place, in one pass: 0 where ``has_key`` is False or its
    range of keys is empty; else NaN where ``flags`` is not 0, or its range holds a bad key,
    or the row of ``query`` holds a NaN/inf, or (``check_out``) the row itself does; else as
    it is. Only the rows set are written. ``out`` and ``query`` must be ones :func:`takes`
    takes.

    ``ranges``: ``(keys, lo, hi)``: which keys are bad (1.0) per batch element and head, and
    the keys ``[lo, hi)`` each row may attend (``key_counts.ranges``: causal, windows, key
    lengths), counted here instead of by ``key_counts.counts``' ops. ``keys`` None: no key
    was flagged, and with ``recompute`` the rows are found as without ranges (below).

    ``recompute``: ``(key, value, scale, group)`` with ``query``, the keys and values the
    rows see as they are: each row whose query row is
    finite and that the kernel may have got wrong is computed again by the plain math over
    the keys it sees (float64 rows in float64, others in float32), instead of set to NaN.
    With flagged ``ranges`` (the kernel ran on k and v as they are) those are the rows whose
    range holds a bad key, where a visible key whose scores are all ``-inf`` weighs 0 (the
    kernel may give anything), and the rows that are not finite (a hidden bad key reached
    them, as a NaN). Without flags, every row that is not finite or is all zero: a kernel
    gives 0 to a row whose scores are all NaN or ``-inf`` (torch's CPU flash kernel, tiled's),
    where the plain math gives NaN; and in bfloat16 and float16 every row whose ``lse`` (the
    kernel's, float32 ``(*batch, T)``) is not finite, or without one every row of a head whose
    keys hold a NaN/inf (see :func:`check_rows`). ``key`` and ``value`` as
    :func:`keymask_rows` takes them (of ``out``'s dtype); ``group`` query heads per key head.

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
        assert lo.dtype == hi.dtype == torch.int64
        flagged: tuple[int, ...] = (0, 0, 0, 0)
        if keys is not None:
            assert keys.dtype == torch.float32 and keys.stride(-1) == 1 and keys.dim() == 3
            k0, k1, _ = _aligned(keys.shape[:-1] + (1,), keys.stride()[:-1] + (0,))  # (B, H)
            flagged = (keys.data_ptr(), k0, k1, keys.shape[-1])
        tail = flagged + (lo.data_ptr(), *_aligned(lo.shape, lo.stride()))
        tail += (hi.data_ptr(), *_aligned(hi.shape, hi.stride()))
    tail += _NO_RECOMPUTE if recompute is None else _recompute_args(*recompute)
    if lse is not None:
        rows = _lse_args(lse, lead)
        assert recompute is not None and rows is not None
        tail = tail[:-4] + rows
    assert recompute is None or query is not None
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


def takes_keymask(query: Tensor, key: Tensor, value: Tensor, keep: Tensor) -> bool:
    """Whether :func:`keymask_rows` takes these inputs (with an output of their dtype, its own
    memory and a unit last stride): :func:`takes` takes each of q, k and v, they share a
    dtype, and ``keep`` is a bool CPU tensor of at most two leading dims and S contiguous
    keys."""
    return (
        takes(query, key, value)
        and query.dtype == key.dtype == value.dtype
        and type(keep) is Tensor
        and keep.dtype == torch.bool
        and keep.is_cpu
        and 1 <= keep.dim() <= 3
        and keep.shape[-1] == key.shape[-2] == value.shape[-2]
        and keep.stride(-1) == 1
    )


def keymask_rows(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep: Tensor,
    *,
    scale: float,
    group: int,
    lse: Tensor | None = None,
) -> bool:
    """The rows of a key mask's output after a kernel ran the mask on ``key`` and ``value`` as
    they are, set in place in one pass: 0 where the row has no key; where the row or its query
    row is not finite, or is all zero, the row again from its visible keys (float64 rows in
    float64, others in float32; NaN for a bad query row, and where the plain math gives a row
    that is not finite); the other rows as they are. In bfloat16 and float16 also the rows
    whose log-sum-exp ``lse`` (the kernel's, float32 ``(B?, H?, T)``) is not finite, or
    without one every row of a head whose keys hold a NaN/inf (a scan of k: torch's kernel
    gives a finite row for a ``+inf`` score there, see :func:`check_rows`).
    Whether it ran (False: tensors this does not take, and nothing done).

    Why a finite row stands: a key the mask hides reaches a row only as a NaN (its NaN score
    is NaN under any mask; its weight 0 times an inf value is NaN) or not at all. So the
    zeroed copies of k and v that the tensor ops make are not needed, and which rows are
    computed again is found inside the pass (nothing read back: no host read).

    ``out`` must be the kernel's own (see :func:`check_rows`; False otherwise).

    Shape:
        out ``(B?, H?, T, Dv)``; query ``(B?, H?, T, D)``; key, value ``(B?, G?, S, D|Dv)``;
        keep bool ``(B?, H?, S)`` (True: a visible key), contiguous keys.
    """
    return KeymaskRows()(out, query, key, value, keep, scale, group, lse=lse)  # (for one call)


class _PackedState(threading.local):
    """One thread's packed arguments: each thread writes its pointers into its own array, so
    two threads calling the same lane at once never read each other's (ctypes lets go of the
    GIL for the call, between the writes and the library's read)."""

    layout: tuple | None = None
    args: Any = None
    fn: Any = None  # the library's function, its own handle


class _Packed:
    """A function of the library called with one array of arguments, packed when the layout
    of its tensors is first met or changes (ctypes passes the array as it is); a call of a
    known layout writes its tensors' pointers into the array and calls. Per thread
    (:class:`_PackedState`)."""

    __slots__ = ("_size", "_state")

    def __init__(self, struct_: struct.Struct) -> None:
        self._size = struct_.size // 8
        self._state = _PackedState()

    def _ready(self, layout: tuple, pack: Callable[[], list | None], name: str) -> bool:
        """Whether this thread's arguments of ``layout`` (whose last item is the library, or
        None) are packed, packing them by ``pack()`` (None: not taken) when the layout is
        new."""
        state = self._state
        if layout == state.layout:
            return True
        packed, lib = pack(), layout[-1]
        if packed is None or lib is None:
            return False
        args = (ctypes.c_int64 * self._size)()
        args[:] = packed
        fn = lib[name]  # its own handle, taking the array as it is
        fn.restype = ctypes.c_int
        state.args, state.fn, state.layout = args, fn, layout
        return True


class KeymaskRows(_Packed):
    """:func:`keymask_rows` for calls whose tensors keep one layout (a decoding step's, with
    its padding mask): its tests made and its arguments packed at the first call and whenever
    the layout changes; later calls read strides and pointers only. That ``out``'s memory is
    its own (:func:`check_rows`'s test) is asked with a new layout: whether a kernel's output
    shares its inputs' memory follows from the layout. For one kind of call: the caller holds
    one per kind."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_KEYMASK_ARGS)

    def __call__(
        self,
        out: Tensor,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        keep: Tensor,
        scale: float,
        group: int,
        kind: tuple | None = None,
        of_mask: bool = False,
        lse: Tensor | None = None,
    ) -> bool:
        """``kind``: a key that fixes the tensors' shapes, ``scale`` and ``group`` (the
        caller's kind of call), read in their place. ``of_mask``: ``keep`` is given as a
        mask ``(*lead, 1, S)``, whose one row (its memory) is the keep ``(*lead, S)``.
        ``lse``: the kernel's log-sum-exp of the rows, where it gave one (see
        :func:`keymask_rows`)."""
        lib = _build()[0]  # (asked each call: a test hides the library)
        strides = (out.stride(), query.stride(), key.stride(), value.stride(), keep.stride())
        if kind is None:
            kind = (out.shape, key.shape, value.shape, keep.shape, scale, group)
        layout = (kind, strides, None if lse is None else lse.stride(), lib)
        state = self._state
        if layout != state.layout:  # (a known layout asks nothing more: no call, no closure)
            pack = lambda: (  # noqa: E731
                _keymask_args(
                    out,
                    query,
                    key,
                    value,
                    keep.select(-2, 0) if of_mask else keep,
                    scale,
                    group,
                    lse,
                )
                if _own_memory(out, (query, key, value))
                else None
            )
            if not self._ready(layout, pack, "qkv_rows_keymask"):
                return False
        args = state.args
        args[4], args[9], args[14] = out.data_ptr(), query.data_ptr(), key.data_ptr()
        args[18], args[23] = value.data_ptr(), keep.data_ptr()
        if lse is not None:
            args[28] = lse.data_ptr()
        failed = state.fn(args)
        assert not failed
        return True


def _keymask_args(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep: Tensor,
    scale: float,
    group: int,
    lse: Tensor | None = None,
) -> list | None:
    """The arguments of ``qkv_rows_keymask`` for :func:`keymask_rows`, or None where it does
    not take these tensors."""
    if _build()[0] is None or not takes_keymask(query, key, value, keep):
        return None
    if type(out) is not Tensor or out.dtype != query.dtype or out.requires_grad:
        return None
    if not out.is_cpu or not 2 <= out.dim() <= 4 or out.stride(-1) != 1:
        return None
    code, S, lead = _DTYPES[out.dtype], key.shape[-2], out.shape[:-1]
    rows = _lse_args(lse, lead)
    if rows is None:
        return None
    kb, kh, _ = _aligned(key.shape[:-1], key.stride()[:-1])
    vb, vh, _ = _aligned(value.shape[:-1], value.stride()[:-1])
    mb, mh, _ = _aligned(keep.shape[:-1] + (1,), keep.stride()[:-1] + (0,))
    return [
        code,
        *_rows(lead),
        out.data_ptr(),  # [4]
        *_aligned(lead, out.stride()[:-1]),
        out.shape[-1],
        query.data_ptr(),  # [9]
        *_aligned(query.shape[:-1], query.stride()[:-1]),
        query.shape[-1],
        key.data_ptr(),  # [14]
        kb,
        kh,
        key.stride(-2),
        value.data_ptr(),  # [18]
        vb,
        vh,
        value.stride(-2),
        group,
        keep.data_ptr(),  # [23]
        mb,
        mh,
        S,
        _DOUBLE_BITS.unpack(_DOUBLE.pack(scale))[0],
        *rows,  # [28] lse
    ]


def check_rows(
    out: Tensor,
    query: Tensor,
    inputs: tuple[Tensor, ...],
    scale: float,
    group: int,
    lse: Tensor | None = None,
    torch_kernel: bool = False,
) -> bool:
    """``restore_rows(out, query=query, check_out=True, recompute=(key, value, scale, group))``
    with ``inputs`` = ``(query, key, value)``, where this module takes them and ``out`` is the
    kernel's own, and whether it ran (False: nothing done, the caller's tensor ops keep the
    contract). The check of a call whose rows see every key, which runs on every decoding
    step: each test is made once, on attributes read once. The keys are read only for the rows
    computed again (not finite, or all zero), never to check the others; in a half dtype
    they are scanned for a NaN/inf unless the kernel's log-sum-exp ``lse`` ``(*batch, T)`` is
    given (see :class:`RowsCheck`). The query rows are swept for a NaN/inf unless the lse is
    given or ``torch_kernel`` says ``out`` is torch's kernel's in float32 or float64, whose row of
    a bad query is itself not finite or all zero (``nonfinite_rows.cpp``, restore).

    ``out`` is the kernel's own when no gradient needs it, no dim of it is broadcast (a row
    written through two indices), and its memory is its own, or all of a buffer it is a
    permuted view of (torch's CPU flash kernel returns one): none of ``inputs``.

    Shape:
        out ``(*batch, T, Dv)``; query ``(*qbatch, T, D)``; key, value ``(*kbatch, S, D|Dv)``
        -> out.
    """
    args = _check_args(out, query, inputs, scale, group, lse, torch_kernel)
    lib = _build()[0]
    if args is None or lib is None or not _own_memory(out, inputs):
        return False
    failed = lib.qkv_rows_restore(_RESTORE_ARGS.pack(*args))
    assert not failed
    return True


class RowsCheck(_Packed):
    """:func:`check_rows` for calls whose tensors keep one layout (a decoding step's, whose
    key count grows): its tests made and its arguments packed at the first call and whenever
    the layout changes; later calls read the tensors' strides, pointers and key count only
    (that ``out``'s memory is its own is asked with a new layout, as in :class:`KeymaskRows`).
    For one kind of call (the same dtypes and devices, no gradient): the caller holds one per
    kind. ``out`` is torch's kernel's (``torch_kernel``: the lanes run torch's kernel)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_RESTORE_ARGS)

    def __call__(
        self,
        out: Tensor,
        query: Tensor,
        inputs: tuple[Tensor, Tensor, Tensor],
        scale: float,
        group: int,
        kind: tuple | None = None,
        lse: Tensor | None = None,
        strides: tuple | None = None,
    ) -> bool:
        """``inputs``: ``(query, key, value)``. ``kind``: a key that fixes the tensors' shapes
        but for the key count, ``scale`` and ``group`` (the caller's kind of call), read in
        their place. ``lse``: the kernel's log-sum-exp ``(*batch, T)`` float32, where it gave
        one: the rows whose lse is not finite are computed again, and the keys of a half
        dtype are not scanned for a NaN/inf (see ``nonfinite_rows.cpp``). ``strides``: the
        ``stride()`` of q, k and v, where the caller has read them."""
        lib = _build()[0]  # (asked each call: a test hides the library)
        key, value = inputs[1], inputs[2]
        if kind is None:
            kind = (out.shape, query.shape, key.shape[:-2], value.shape[:-2], scale, group)
        if strides is None:
            strides = (query.stride(), key.stride(), value.stride())
        layout = (kind, out.stride(), strides, None if lse is None else lse.stride(), lib)
        state = self._state
        if layout != state.layout:  # (a known layout asks nothing more: no call, no closure)
            pack = lambda: (  # noqa: E731
                _check_args(out, query, inputs, scale, group, lse, torch_kernel=True)
                if _own_memory(out, inputs)
                else None
            )
            if not self._ready(layout, pack, "qkv_rows_restore"):
                return False
        args = state.args
        args[4], args[10] = out.data_ptr(), query.data_ptr()
        args[35], args[39], args[48] = key.data_ptr(), value.data_ptr(), key.shape[-2]
        if lse is not None:
            args[49] = lse.data_ptr()
        failed = state.fn(args)
        assert not failed
        return True


def _recompute_args(key: Tensor, value: Tensor, scale: float, group: int) -> tuple[int, ...]:
    """``qkv_rows_restore``'s arguments of the rows computed again: k and v, their strides
    (b, kv head, key), ``group``, ``scale``, no keep (every key), the key count and no
    log-sum-exp."""
    kb, kh, _ = _aligned(key.shape[:-1], key.stride()[:-1])
    vb, vh, _ = _aligned(value.shape[:-1], value.stride()[:-1])
    scale_bits = _DOUBLE_BITS.unpack(_DOUBLE.pack(scale))[0]
    return (key.data_ptr(), kb, kh, key.stride(-2), value.data_ptr(), vb, vh, value.stride(-2)) + (
        group,
        scale_bits,
        0,
        0,
        0,
        key.shape[-2],
        0,
        0,
        0,
        0,
    )


def _check_args(
    out: Tensor,
    query: Tensor,
    inputs: tuple[Tensor, ...],
    scale: float,
    group: int,
    lse: Tensor | None = None,
    torch_kernel: bool = False,
) -> list | None:
    """The arguments of ``qkv_rows_restore`` for :func:`check_rows`, or None where this module
    does not take ``out``, ``query`` and the key and value of ``inputs`` (see there):
    everything but whose memory ``out`` is."""
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
    key, value = inputs[1], inputs[2]
    if not (_readable(key, out.dtype) and _readable(value, out.dtype)):
        return None
    if _build()[0] is None:
        return None
    lead, qlead = shape[:-1], qshape[:-1]
    rows = _lse_args(lse, lead)
    if rows is None:
        return None
    return [
        code,
        *_rows(lead),
        out.data_ptr(),  # [4]
        *_aligned(lead, strides[:-1]),
        shape[-1],
        3 if torch_kernel else 1,  # [9] check_out, and whether its rows tell of bad queries
        query.data_ptr(),  # [10]
        *_aligned(qlead, qstrides[:-1]),
        qshape[-1],
        *(0,) * 8,
        *_NO_RANGES,
        *_recompute_args(key, value, scale, group)[:-4],  # [35] k, [39] v, [48] S
        *rows,  # [49] lse
    ]


def _lse_args(lse: Tensor | None, lead: tuple) -> tuple[int, ...] | None:
    """The passes' arguments of a kernel's log-sum-exp over the rows ``lead`` (its pointer
    and strides; zeros for none), or None where it is not one: float32 CPU, of shape
    ``lead``."""
    if lse is None:
        return (0, 0, 0, 0)
    if lse.dtype != torch.float32 or not lse.is_cpu or tuple(lse.shape) != tuple(lead):
        return None
    return (lse.data_ptr(), *_aligned(lead, lse.stride()))


def _readable(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether the pass may read rows of ``t`` as :func:`takes` takes them, of ``dtype``; it
    may want a gradient (a cache written in a step that did: only read here, for an output
    that wants none)."""
    if type(t) is not Tensor or not t.is_cpu or t.dtype != dtype:
        return False
    stride = t.stride()
    return 2 <= len(stride) <= 4 and (stride[-1] == 1 or t.shape[-1] <= 1)


def _own_memory(out: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether ``out``'s memory is its own, or all of a buffer it is a view of, and none of
    ``inputs`` (compared by identity: ``in`` would compare values)."""
    base = out._base
    if base is None:
        base = out
    elif base.numel() != out.numel():
        return False  # a slice of something larger
    return all(base is not t and base is not t._base for t in inputs)
