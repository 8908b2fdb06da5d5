"""The Triton kernel of ``nonfinite_triton.copy_rows`` (loaded by that module only: triton is
an optional dependency, and this file imports it at the top).

Shape alphabet: L rows, E entries a row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# the row's max as tl.reduce with triton's own combine function, not tl.max (a jit function of
# triton.language, which an interpreted copy of this file cannot call): see ops/triton/kernels.py
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def zero_rows(
    src,
    dst,
    flags,
    L,
    E,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COPY: tl.constexpr,
    ACCUM: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Rows ``[pid * BLOCK_R, ...)`` of ``src`` ``(L, E)``: ``dst`` the row with each NaN/inf
    replaced by 0 (``COPY``), ``flags`` 1.0 on a row that held one, else 0.0 (``ACCUM``: the
    larger of that and the flag already there). ``WIDE``: ``src`` is float64."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    cols = tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    live = rows < L
    inside = live[:, None] & (cols[None, :] < E)
    at = rows[:, None] * E + cols[None, :]  # (BLOCK_R, BLOCK_E)
    x = tl.load(src + at, mask=inside, other=0.0)
    if WIDE:  # float64: tested as it is  # noqa: SIM108 (a static branch, as triton compiles it)
        xf = x
    else:  # half and float32: in float32, exactly (the interpreter compares half as bits)
        xf = x.to(tl.float32)
    finite = (xf == xf) & (tl.abs(xf) != float("inf"))  # (NaN != NaN)
    bad = tl.reduce(tl.where(finite, 0.0, 1.0), 1, _MAX)  # (BLOCK_R,) float32
    if COPY:
        tl.store(dst + at, tl.where(finite, x, 0.0).to(x.dtype), mask=inside)
    if ACCUM:
        bad = tl.maximum(bad, tl.load(flags + rows, mask=live, other=0.0))
    tl.store(flags + rows, bad, mask=live)


@triton.jit
def nan_rows(
    out,
    cum,
    lo,
    hi,
    rows,
    H,
    T,
    S,
    Dv,
    so_b,
    so_h,
    so_t,
    sl_b,
    sl_t,
    sh_b,
    sh_t,
    sr_b,
    sr_h,
    sr_t,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OWN: tl.constexpr,
):
    """NaN on each row ``t`` of ``out[b, h]`` whose keys ``[lo, hi)`` hold a bad key (``cum``:
    the bad keys' running count, ``(B*H, S)``), or whose query row is bad (``rows``) where it
    may attend some key (``OWN``: every row may); the other rows are not written. Program
    ``(b * H + h, block of T)``."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    live = t < T
    first = tl.load(lo + b * sl_b + t * sl_t, mask=live, other=0)
    end = tl.maximum(tl.load(hi + b * sh_b + t * sh_t, mask=live, other=0), first)
    base = cum + bh.to(tl.int64) * S
    hits = tl.load(base + end - 1, mask=live & (end > 0), other=0.0) - tl.load(
        base + first - 1, mask=live & (first > 0), other=0.0
    )
    bad_row = tl.load(rows + b * sr_b + h * sr_h + t * sr_t, mask=live, other=0.0)
    if OWN:  # noqa: SIM108 (a static branch, as triton compiles it)
        hits = hits + bad_row
    else:
        hits = hits + tl.where(end > first, bad_row, 0.0)
    cols = tl.arange(0, BLOCK_D)
    at = out + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
    at = at + t.to(tl.int64)[:, None] * so_t + cols[None, :]
    nan = tl.full((BLOCK_T, BLOCK_D), float("nan"), out.dtype.element_ty)
    tl.store(at, nan, mask=(live & (hits > 0))[:, None] & (cols[None, :] < Dv))
