"""Attention of a few query rows in one C++ call (``few_rows.cpp``): a decoding step, float32,
bfloat16 or float16.

At T=1, S=128, 8 heads of 64 (one thread, AMD Zen 4) torch's CPU flash kernel took 31-45 µs for
some 0.1 M multiply-adds; qkv's call of it, with the NaN/inf contract's pass after, 44-76 µs.
This kernel computes such a call whole, the contract included, reading each key and value row
once for all the rows of its head (no copies of q, k, v; any batch, head and row strides). The
tiled backend runs it for the calls :func:`usable` takes, and ``auto`` takes tiled for them
where its whole calls are measured faster than torch's (``autotune``); a decoding loop's calls
then run it by their lane (``functional._Lane``, :class:`Runner`).

What it computes (the plain math in float32, sums in a fixed order; half inputs widened
exactly as they are read and the output rounded once, the nearest half value to the float32
result, where torch's half kernels round the weights before the values): row ``t`` attends
the keys ``j < S`` (``j <= t`` with ``is_causal``, torch's top-left alignment; a range ``[lo_t,
hi_t)`` under a mask_mod of ranges: a causal mask of either alignment, a window, key lengths)
that a bool key mask ``(B?, 1, 1, S)`` keeps; a row with no key outputs 0 and lse ``-inf``. The
NaN/inf contract of ``ops/nonfinite.py`` by the plain math's rows, as its fused row passes keep
it: hidden keys are never read; a row that attends a key whose value holds a NaN/inf, or whose
score is NaN or ``+inf``, or whose query holds one, is NaN, as is a row whose every score is
``-inf``; a key whose score is ``-inf`` weighs 0 (``few_rows.cpp`` says how, without a pass
before the call).

``QKV_FEW_ROWS=off`` turns it off (the tiled passes and torch's kernel then run these calls, as
where the library cannot be built): tests run the same calls both ways.

Shape alphabet: B batch, H query heads, G key/value heads, T query rows (at most
:data:`MAX_ROWS`), S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import struct
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._measured import env
from . import key_counts
from ._native_build import build_declared
from .base import tracing
from .call import AttentionCall, LastCall

__all__ = [
    "MAX_ROWS",
    "SWITCH",
    "Packed",
    "Runner",
    "attend",
    "available",
    "pack",
    "usable",
    "window_kind",
]

SOURCE = Path(__file__).with_name("few_rows.cpp")
SWITCH = "QKV_FEW_ROWS"  # "off": not used (tests run the other ways on the same calls)
# Query rows a call may have: every row of a head is held at once, and past a few rows the
# tiled passes' GEMMs are the faster way (the bfloat16 kernel's few-row way stops at 4 too)
MAX_ROWS = 4
_ARGS = struct.Struct("32q")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's dtype codes
_DOUBLE, _DOUBLE_BITS = struct.Struct("d"), struct.Struct("q")  # a double passed as its bits
# scales past this could overflow float32 scores; those calls keep the guard's overflow check
_SCALE_BOUND = math.sqrt(torch.finfo(torch.float32).max)
_log = logging.getLogger(__name__)


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build_declared(
        SOURCE,
        "qkv_few_rows",
        {name: [ctypes.c_char_p] for name in ("qkv_few_rows", "qkv_few_rows_step")},
        _log,
        "the tiled passes",
    )
    if lib is not None:
        lib.qkv_few_rows_error.restype = ctypes.c_char_p
    return lib, why


def available() -> bool:
    """Whether the kernel runs here and is not switched off (``QKV_FEW_ROWS=off``); builds it
    at the first ask (seconds once, then a cached load of milliseconds)."""
    return env(SWITCH) != "off" and _build()[0] is not None


def usable(call: AttentionCall) -> bool:
    """:func:`_usable_now`, kept for the last call asked about while the switch holds: the plan
    asks it (``keeps_nonfinite_contract``) and the tiled backend again for the same call."""
    return _last_usable.get(call, env(SWITCH), _usable_now)


_last_usable = LastCall()


def _usable_now(call: AttentionCall) -> bool:
    """Whether :func:`attend` takes ``call``: float32, bfloat16 or float16 (q, k and v alike)
    on the CPU, eager, no gradient wanted, 1 to :data:`MAX_ROWS` query rows and at least one
    key, no score_mod, sinks or dropout; no mask or a bool key mask (one row of keys per batch
    element, shared by every head and row: a padded batch's decoding step); no mask_mod or one
    whose rows attend ranges of keys (a causal mask of either alignment, windows, key lengths:
    :func:`_row_ranges`); a scale that cannot overflow the scores; and the kernel
    :func:`available`."""
    q = call.query
    if (
        call.dtype not in _DTYPES
        or call.key.dtype != call.dtype
        or call.value.dtype != call.dtype
        or type(q) is not Tensor
        or not q.is_cpu
        or not 1 <= call.T <= MAX_ROWS
        or call.S < 1
        or call.D < 1
        or call.Dv < 1
        or call.score_mod is not None
        or call.sinks is not None
        or call.dropout_p > 0
        or not abs(call.scale) <= _SCALE_BOUND
        or call.wants_grad
        or tracing()
    ):
        return False
    if call.attn_mask is not None and _keep(call) is None:
        return False
    if call.mask_mod is not None and _row_ranges(call) is None:
        return False
    return available()


def _row_ranges(call: AttentionCall) -> tuple[Tensor, Tensor] | None:
    """The rows' key ranges ``[lo_t, hi_t)`` of the call's mask_mod and ``is_causal``
    (``key_counts.ranges``: causal masks of either alignment, windows, key lengths, and their
    ``and``), or None where they are not ranges of the call's batch (documents, other
    functions). Asked twice per call (the plan, the run): the last call's answer is kept.

    Shape:
        -> lo, hi ``(B or 1, T)`` int64, contiguous.
    """
    return _last_ranges.get(call, None, _row_ranges_now)


_last_ranges = LastCall()


def _row_ranges_now(call: AttentionCall) -> tuple[Tensor, Tensor] | None:
    r = key_counts.ranges(call, attn_mask=False)
    if r is None or r[2] is not None:
        return None
    lo, hi = torch.broadcast_tensors(r[0], r[1])  # (B?, 1, T)
    if lo.shape[0] not in (1, call.BH[0]):
        return None
    return lo[:, 0].contiguous(), hi[:, 0].contiguous()  # (B?, T)


def _keep(call: AttentionCall) -> Tensor | None:
    """A bool key mask as ``(B or 1, S)`` rows with unit stride (a view), or None for other
    masks."""
    mask = call.attn_mask
    if mask is None or mask.dtype != torch.bool or not mask.is_cpu:
        return None
    m = call.mask_4d(mask)  # (B?, H?, T?, S?)
    if m.shape[1:] != (1, 1, call.S) or m.shape[0] not in (1, call.BH[0]):
        return None
    keep = m[:, 0, 0]  # (B?, S)
    return keep if keep.stride(-1) == 1 or call.S == 1 else keep.contiguous()


def attend(call: AttentionCall, *, lse: bool = True) -> tuple[Tensor, Tensor | None]:
    """``call`` (one :func:`usable` takes) by the kernel: the output, and the log-sum-exp of
    each row (``-inf`` on rows with no key) with ``lse``.

    Shape:
        -> out ``call.out_shape`` in the call's dtype, lse ``call.batch + (T,)`` float32.
    """
    B, H = call.BH
    q, k, v = _four(call)  # (B, H, T, D), (B?, G, S, D), (B?, G, S, Dv)
    out = _empty_out(B, H, call.T, call.Dv, call.dtype)  # (B, H, T, Dv)
    rows = torch.empty(B, H, call.T, dtype=torch.float32, device="cpu") if lse else None
    keep = _keep(call) if call.attn_mask is not None else None
    ranges = _row_ranges(call) if call.mask_mod is not None else None
    causal = call.is_causal and ranges is None  # (the ranges hold it)
    args = _args(q, k, v, out, rows, keep, causal, call.scale, ranges)
    assert args is not None  # (usable: the layouts _four gives are taken)
    _run(args)
    out = out if out.shape == call.out_shape else out.reshape(call.out_shape)
    return out, None if rows is None else rows.reshape(call.batch + (call.T,))


def _empty_out(B: int, H: int, T: int, Dv: int, dtype: torch.dtype) -> Tensor:
    """An output ``(B, H, T, Dv)`` as a view of ``(B, T, H, Dv)`` memory (a module's merge of
    the heads is then a view), made in one op."""
    return torch.empty_strided(
        (B, H, T, Dv), (T * H * Dv, Dv, H * Dv, 1), dtype=dtype, device="cpu"
    )


def _four(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as 4-d views where the call's tensors are 4-d (key and value heads shared by
    groups of query heads, a batch of 1 broadcast: strides of 0), else ``call.as_4d()``; a
    tensor whose last dim has a stride (a transposed or expanded one) is copied."""
    q, k, v = _unit_last(call.query), _unit_last(call.key), _unit_last(call.value)
    if q.dim() == k.dim() == v.dim() == 4 and _takes(q, k, v):
        return q, k, v
    q, k, v = call.as_4d()
    return _unit_last(q), _unit_last(k), _unit_last(v)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernel reads these 4-d tensors as they are: unit last strides (or a last
    dim of 1), key and value heads G dividing the query heads H, their batch B or 1."""
    B, H = q.shape[:2]
    G = k.shape[1]
    return (
        v.shape[1] == G
        and G > 0
        and H % G == 0
        and k.shape[0] in (1, B)
        and v.shape[0] in (1, B)
        and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    )


def _args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor | None,
    keep: Tensor | None,
    causal: bool,
    scale: float,
    ranges: tuple[Tensor, Tensor] | None = None,
) -> list[int] | None:
    """The kernel's packed arguments (``few_rows.cpp``), or None for layouts it does not take.

    Shape:
        q ``(B, H, T, D)``, k ``(B?, G, S, D)``, v ``(B?, G, S, Dv)``, out ``(B, H, T, Dv)``,
        lse ``(B, H, T)`` contiguous, keep ``(B?, S)`` or ``(B?, 1, 1, S)`` (a bool key
        mask: the same memory), unit last stride; ranges ``(B?, T)`` int64 contiguous each.
    """
    if not _takes(q, k, v) or out.stride(-1) != 1 or q.dtype not in _DTYPES:
        return None
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[3]

    def strides(t: Tensor) -> tuple[int, int, int]:
        sb, sh, sr = t.stride()[:3]
        return (0 if t.shape[0] == 1 else sb), sh, sr

    kb = 0
    if keep is not None:  # (B?, ..., S): its rows of keys at a batch stride
        if keep.stride(-1) != 1 and keep.shape[-1] > 1:
            return None
        kb = 0 if keep.shape[0] == 1 else keep.stride(0)
    return [
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        0 if keep is None else keep.data_ptr(),
        B,
        H,
        G,
        T,
        S,
        D,
        Dv,
        *strides(q),
        *strides(k),
        *strides(v),
        *strides(out),
        kb,
        int(causal),
        _DOUBLE_BITS.unpack(_DOUBLE.pack(scale))[0],
        _DTYPES[q.dtype],
        0 if ranges is None else ranges[0].data_ptr(),
        0 if ranges is None else ranges[1].data_ptr(),
        0 if ranges is None or ranges[0].shape[0] == 1 else T,
    ]


def _run(args: list[int]) -> None:
    lib = _build()[0]
    assert lib is not None
    if lib.qkv_few_rows(_ARGS.pack(*args)) != 0:
        raise RuntimeError(f"the few-rows kernel failed: {lib.qkv_few_rows_error().decode()}")


def window_kind(mask_mod) -> tuple | None:
    """What a lane keeps of a mask_mod that is one sliding window or causal mask
    (``key_counts.is_window``): ``(its class, left, right, align)``; its rows' ranges are
    made per call (:func:`window_ranges`), so a decoding loop whose window moves with the
    cache (transformers' windows carry the cache's offset) keeps one lane. None for others."""
    if mask_mod is None or not key_counts.is_window(mask_mod):
        return None
    return (type(mask_mod), mask_mod.left, mask_mod.right, mask_mod.align)


def window_ranges(mask_mod, T: int, S: int, causal: bool) -> list[int]:
    """The rows' key ranges of a window (:func:`window_kind`) for a call of T rows and S keys,
    and ``is_causal`` (top-left): ``[lo_0, .., lo_{T-1}, hi_0, .., hi_{T-1}]`` clamped to
    ``[0, S]`` with ``lo <= hi``, the sets ``key_counts.ranges`` gives.
    """
    off = mask_mod.bind(1, 1, T, S)._off()  # (bound as the call binds it: its alignment)
    left, right = mask_mod.left, mask_mod.right
    lo, hi = [], []
    for t in range(T):
        a = 0 if left is None else min(max(t + off - left, 0), S)
        b = S if right is None else min(max(t + off + right + 1, 0), S)
        if causal:
            b = min(b, t + 1)
        lo.append(a)
        hi.append(max(a, b))
    return lo + hi


class Packed:
    """One kernel call without mask packed for good (:func:`pack`): a decoding loop's call over
    the first S rows of fixed key and value memory (a KV cache's buffers), whose query and
    output keep their layouts. A call writes the query's and output's pointers and the key
    count alone (the caller has checked that the rest holds: its plan's)."""

    __slots__ = ("args", "fn")

    def __init__(self, args: Any, fn: Any) -> None:
        self.args, self.fn = args, fn

    def __call__(self, query: Tensor, out: Tensor, S: int) -> None:
        """Attend ``query`` over the first ``S`` key and value rows into ``out``.

        Shape: query ``(B, H, T, D)``, out ``(B, H, T, Dv)``, as packed (their memory
        anywhere, their strides the packed ones)."""
        args = self.args
        args[0], args[3], args[10] = query.data_ptr(), out.data_ptr(), S
        if self.fn(args) != 0:
            lib = _build()[0]
            assert lib is not None
            raise RuntimeError(f"the few-rows kernel failed: {lib.qkv_few_rows_error().decode()}")


def pack(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    causal: bool,
    scale: float,
    keep: Tensor | None = None,
    new_rows: tuple[int, int, int, int] | None = None,
) -> Packed | None:
    """The kernel's call of ``query`` over ``key`` and ``value`` into ``out``, with the bool
    key mask ``keep`` if any, packed for :class:`Packed`'s calls (the tensors' strides and the
    key, value and mask pointers kept: a KV cache's buffers); None where the kernel does not
    run here or does not take these layouts.

    ``new_rows``: a decoding step's (``nn/_step.py``): each call first copies the new key and
    value row of each (batch, key head) into row ``S - 1`` of ``key`` and ``value`` (its key
    count's last), from the query's memory: ``(key offset, value offset, batch stride, head
    stride)`` in elements from the query's pointer (a fused in-projection's output holds them
    past the query's heads). ``key`` and ``value`` then have the query's batch (no broadcast
    batch: the rows of two elements would meet).

    Shape: query ``(B, H, T, D)``, key ``(B?, G, S, D)``, value ``(B?, G, S, Dv)``, out
    ``(B, H, T, Dv)``, keep ``(B?, 1, 1, S)``."""
    lib = _build()[0] if env(SWITCH) != "off" else None
    packed = None if lib is None else _args(query, key, value, out, None, keep, causal, scale)
    if lib is None or packed is None:
        return None
    name = "qkv_few_rows"
    if new_rows is not None:
        B = query.shape[0]
        if key.shape[0] != B or value.shape[0] != B or query.shape[2] != 1:
            return None
        packed, name = packed + list(new_rows), "qkv_few_rows_step"
    fn = lib[name]  # its own handle, taking the array as it is
    fn.restype = ctypes.c_int
    return Packed((ctypes.c_int64 * len(packed))(*packed), fn)


class _RunnerState(threading.local):
    """One thread's packed arguments (see ``nonfinite_rows._PackedState``)."""

    layout: tuple | None = None
    args: Any = None
    fn: Any = None  # the library's function, its own handle
    ranges: Any = None  # the rows' key ranges of a window's calls (lo then hi, int64)


class Runner:
    """:func:`attend` without lse for a lane's calls (``functional._Lane``): the arguments are
    packed once per layout (shapes but the key count, the query's strides), per thread, and a
    call of a known layout only writes its pointers, its key count and the strides of its keys,
    values and mask. Returns None for a call it
    does not take (its caller takes the usual way)."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = _RunnerState()

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        keep: Tensor | None,
        causal: bool,
        scale: float,
        window=None,
    ) -> Tensor | None:
        """``window``: the call's mask_mod, one of :func:`window_kind`'s (its ranges made
        here), or None.

        Shape: query ``(B, H, T, D)``, key ``(B?, G, S, D)``, value ``(B?, G, S, Dv)``,
        keep ``(B?, 1, 1, S)`` bool or None -> ``(B, H, T, Dv)``."""
        qs, ks, vs = query.shape, key.shape, value.shape
        if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or env(SWITCH) == "off":
            return None  # (the switch read per call: a kept lane follows it too)
        B, H, T, _ = qs
        dtype = query.dtype
        if dtype not in _DTYPES or key.dtype != dtype or value.dtype != dtype:
            return None
        out = _empty_out(B, H, T, vs[3], dtype)
        # what the packed arguments depend on but the pointers, the key count and the strides
        # of the keys, values and mask (which a cache grown by concatenation changes each step)
        kst, vst = key.stride(), value.stride()
        layout = (
            qs,
            dtype,
            ks[0],
            ks[1],
            ks[3],
            kst[3],
            vs[0],
            vs[3],
            vst[3],
            query.stride(),
            None if keep is None else (keep.shape[:3], keep.stride(-1)),
            causal,
            scale,
            window is None,
        )
        state = self._state
        args = state.args
        if layout != state.layout:
            if keep is not None and (keep.dim() != 4 or keep.shape[1] != 1 or keep.shape[2] != 1):
                return None
            packed = _args(query, key, value, out, None, keep, causal, scale)
            lib = _build()[0]
            if packed is None or lib is None:
                return None
            args = (ctypes.c_int64 * len(packed))(*packed)
            fn = lib["qkv_few_rows"]  # its own handle, taking the array as it is
            fn.restype = ctypes.c_int
            state.ranges = None
            if window is not None:  # (the ranges hold the causal rows: no flag)
                state.ranges = ranges = (ctypes.c_int64 * (2 * T))()
                args[26], args[31] = 0, 0
                args[29] = ctypes.addressof(ranges)
                args[30] = args[29] + 8 * T
            state.args, state.fn, state.layout = args, fn, layout
        elif ks[2] != vs[2] or (keep is not None and keep.shape[3] != ks[2]):
            return None  # (what the layout does not fix: the call's own checks ran before)
        args[0], args[1], args[2] = query.data_ptr(), key.data_ptr(), value.data_ptr()
        args[3], args[10] = out.data_ptr(), ks[2]
        args[16] = 0 if ks[0] == 1 else kst[0]  # (as _args packs them)
        args[17], args[18] = kst[1], kst[2]
        args[19] = 0 if vs[0] == 1 else vst[0]
        args[20], args[21] = vst[1], vst[2]
        if keep is not None:
            args[5], args[25] = keep.data_ptr(), 0 if keep.shape[0] == 1 else keep.stride(0)
        if window is not None:
            state.ranges[:] = window_ranges(window, T, ks[2], causal)
        if state.fn(args) != 0:
            lib = _build()[0]
            assert lib is not None
            raise RuntimeError(f"the few-rows kernel failed: {lib.qkv_few_rows_error().decode()}")
        return out
