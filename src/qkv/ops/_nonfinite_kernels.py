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
