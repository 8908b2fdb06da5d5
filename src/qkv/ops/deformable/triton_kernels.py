"""Triton kernels of multi-scale deformable attention: forward and a deterministic backward.

Supported:
  * CUDA tensors in float16, bfloat16, float32 and float64; CPU tensors under triton's
    interpreter (``qkv.ops.triton.interpreter()``), for tests.
  * mmcv's layouts, contiguous: value ``(B, S, M, D)``; shapes ``(L, 2)`` int64 as (H, W);
    starts ``(L,)`` int64; loc ``(B, Lq, M, L, P, 2)`` as (x, y) in [0, 1]; attn
    ``(B, Lq, M, L, P)``; out ``(B, Lq, M, D)``. Any D (padded inside to a power of two by
    masked loads), any L, P, Lq.
  * ``F.grid_sample``'s sampling (bilinear, ``align_corners=False``, zeros outside the map):
    pixel coordinates ``((2 * loc - 1 + 1) * size - 1) / 2``, rounded as grid_sample rounds
    them (the launches turn FMA contraction off, as kernel.cpp is built with
    ``-ffp-contract=off``); a corner outside the map is never read (a masked load), so an inf
    or NaN elsewhere in the value never reaches an outside sample.
  * Half types are read as they are and accumulated in float32, rounded once; float32 and
    float64 accumulate in their own type (``F64``).

Not supported: strided inputs (the caller makes them contiguous), double backward.

Algorithm. The forward (:func:`deformable_fwd`) runs one program per (block of BLOCK_Q
queries, batch, head): for each level and point it gathers the four corner rows of D
elements of every query in the block and accumulates them with their weights; nothing of
``L * P`` times the output is written. The backward runs in three steps, none with atomics:

  1. :func:`deformable_bwd_samples`, tiled as the forward: each sample's gradients for its
     location and weight (the dot products of its corner rows with the query's output
     gradient), and the sample's *key*: which value pixels it touches, as the index of its
     top-left corner ``(y0, x0)`` in a grid padded by one row and column above and left
     (corners may sit at -1), per (batch, head, level): ``((b * M + m) * L + l) * 4S +
     (y0 + 1) * (W + 1) + (x0 + 1)``; -1 for a sample that touches no pixel. (``4S`` bounds
     every level's ``(H + 1) * (W + 1)``.)
  2. In torch ops (``triton_launch.py``): a stable sort of the keys, so each key's samples
     are a run in sample order (queries in order, as kernel.cpp's backward walks them), and
     for every value row and each of its four corner roles the run of samples for which it
     is that corner (``searchsorted``: the row at (y, x) is corner (dy, dx) of the samples
     whose top-left is (y - dy, x - dx)).
  3. :func:`deformable_bwd_value`: one program per block of BLOCK_R value rows sums, in a
     fixed order (the j-th sample of each of the four runs, for j = 0, 1, ...),
     ``attn * bilinear weight * grad_out`` over its runs, in the accumulator dtype, and
     writes each row once.

The value gradient is therefore the same bits on every run (torch's sort and searchsorted
are deterministic; each row is summed by one program in a fixed order), where the original
CUDA kernel's ``atomicAdd`` is not. A sample's bilinear weights are recomputed in step 3
from its location by the same code as in step 1; which pixel it lands on comes from its key
alone, so the two steps cannot disagree about it.

Cost: the forward and step 1 read each sample's four corner rows once, as the original kernel
does. Step 3 reads each sample's location, weight and output-gradient row once per corner (four
times), and a row sums its runs serially: on a coarse level many samples share a pixel (40,000
queries x 4 points on BEVFormer's 15 x 25 map: about 400 a pixel per head), so its programs run
longest; ``benchmarks/gpu_deformable.py`` measures the whole against grid_sample, whose
backward adds with atomics.

Interpreter: reductions go through ``tl.reduce`` with triton's own combine functions (see
``qkv/ops/triton/kernels.py``: ``tl.sum``/``tl.max`` are jit functions decorated when triton
was imported, which an interpreted copy of this file could not call).

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points; N = B * Lq * M (query, head) rows; R = B * S * M value rows.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


_SUM = getattr(tl.standard, "_sum_combine", _add)
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def _acc(x, F64: tl.constexpr):
    """``x`` in the accumulator dtype: float64 for float64 inputs, float32 otherwise."""
    if F64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def _pixel(loc, size):
    """Pixel coordinate of ``loc`` in [0, 1] over ``size`` pixels, as grid_sample rounds it."""
    grid = 2.0 * loc - 1.0
    return ((grid + 1.0) * size.to(loc.dtype) - 1.0) / 2.0


@triton.jit
def _sample(loc, attn, i, W, H, ok, F64: tl.constexpr):
    """Sample ``i`` (a vector of sample indices): its weight, whether it touches the map, the
    floor of its pixel coordinates and their fractional parts (0 where it touches nothing, so
    no NaN or inf reaches an index)."""
    lx = _acc(tl.load(loc + 2 * i, mask=ok, other=0.0), F64)
    ly = _acc(tl.load(loc + 2 * i + 1, mask=ok, other=0.0), F64)
    a = _acc(tl.load(attn + i, mask=ok, other=0.0), F64)
    x = _pixel(lx, W)
    y = _pixel(ly, H)
    # NaN compares false: a NaN location touches nothing, as in kernel.cpp
    touch = ok & (x >= -1.0) & (x < W.to(x.dtype)) & (y >= -1.0) & (y < H.to(y.dtype))
    x = tl.where(touch, x, 0.0)
    y = tl.where(touch, y, 0.0)
    xf = tl.floor(x)
    yf = tl.floor(y)
    return a, touch, xf.to(tl.int64), yf.to(tl.int64), x - xf, y - yf


@triton.jit
def _corner(value, base, xc, yc, W, H, touch, d, d_ok, M: tl.constexpr, D: tl.constexpr):
    """The (BLOCK_Q, BLOCK_D) tile of corner rows at pixels (yc, xc) of a level whose pixel 0
    is value row ``base`` (rows of D, M apart); zeros for corners outside the map."""
    inside = touch & (xc >= 0) & (xc < W) & (yc >= 0) & (yc < H)
    row = base + (yc * W + xc) * M
    ptrs = value + row[:, None] * D + d[None, :]
    return tl.load(ptrs, mask=inside[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def deformable_fwd(value, shapes, starts, loc, attn, out, S, Lq, L, P, n_qblocks,
                   M: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_D: tl.constexpr, F64: tl.constexpr):
    """out[b, q, m] = sum over (l, p, corner) of attn * bilinear weight * corner row; grid:
    (n_qblocks * B * M,), head fastest, so the programs running together read the same
    pixels' rows of neighbouring heads."""
    pid = tl.program_id(0)
    m = pid % M
    b = (pid // M) // n_qblocks
    qb = (pid // M) % n_qblocks
    q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    q_ok = q < Lq
    d_ok = d < D
    n = (b.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,) the (query, head) rows
    acc = _acc(tl.full([BLOCK_Q, BLOCK_D], 0.0, tl.float32), F64)  # (BLOCK_Q, BLOCK_D)
    for lvl in range(L):
        H = tl.load(shapes + 2 * lvl)
        W = tl.load(shapes + 2 * lvl + 1)
        base = (b.to(tl.int64) * S + tl.load(starts + lvl)) * M + m  # row of the level's pixel 0
        for p in range(P):
            i = (n * L + lvl) * P + p  # (BLOCK_Q,) sample indices
            a, touch, x0, y0, fx, fy = _sample(loc, attn, i, W, H, q_ok, F64)
            gx = 1.0 - fx
            gy = 1.0 - fy
            v = _acc(_corner(value, base, x0, y0, W, H, touch, d, d_ok, M, D), F64)
            acc += (a * (gy * gx))[:, None] * v
            v = _acc(_corner(value, base, x0 + 1, y0, W, H, touch, d, d_ok, M, D), F64)
            acc += (a * (gy * fx))[:, None] * v
            v = _acc(_corner(value, base, x0, y0 + 1, W, H, touch, d, d_ok, M, D), F64)
            acc += (a * (fy * gx))[:, None] * v
            v = _acc(_corner(value, base, x0 + 1, y0 + 1, W, H, touch, d, d_ok, M, D), F64)
            acc += (a * (fy * fx))[:, None] * v
    ptrs = out + n[:, None] * D + d[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _dot_rows(value, base, xc, yc, W, H, touch, go, d, d_ok, M: tl.constexpr, D: tl.constexpr,
              F64: tl.constexpr):
    """Per query of the block: corner row (yc, xc) . grad_out row, 0 outside the map."""
    v = _acc(_corner(value, base, xc, yc, W, H, touch, d, d_ok, M, D), F64)
    return tl.reduce(v * go, 1, _SUM)  # (BLOCK_Q,)


@triton.jit
def deformable_bwd_samples(grad_out, value, shapes, starts, loc, attn, grad_loc, grad_attn, keys,
                           S, Lq, L, P, n_qblocks, M: tl.constexpr, D: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr):
    """Step 1 of the backward: grad_loc, grad_attn and the key of every sample; tiled and
    gridded as :func:`deformable_fwd`. Each sample is written by one program: no atomics."""
    pid = tl.program_id(0)
    m = pid % M
    b = (pid // M) // n_qblocks
    qb = (pid // M) % n_qblocks
    q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    q_ok = q < Lq
    d_ok = d < D
    n = (b.to(tl.int64) * Lq + q) * M + m  # (BLOCK_Q,)
    go_ptrs = grad_out + n[:, None] * D + d[None, :]
    go = _acc(tl.load(go_ptrs, mask=q_ok[:, None] & d_ok[None, :], other=0.0), F64)
    span = 4 * S  # >= (H + 1) * (W + 1) of every level: the keys of two levels never meet
    for lvl in range(L):
        H = tl.load(shapes + 2 * lvl)
        W = tl.load(shapes + 2 * lvl + 1)
        base = (b.to(tl.int64) * S + tl.load(starts + lvl)) * M + m
        first_key = ((b.to(tl.int64) * M + m) * L + lvl) * span
        for p in range(P):
            i = (n * L + lvl) * P + p  # (BLOCK_Q,)
            a, touch, x0, y0, fx, fy = _sample(loc, attn, i, W, H, q_ok, F64)
            gx = 1.0 - fx
            gy = 1.0 - fy
            d00 = _dot_rows(value, base, x0, y0, W, H, touch, go, d, d_ok, M, D, F64)
            d01 = _dot_rows(value, base, x0 + 1, y0, W, H, touch, go, d, d_ok, M, D, F64)
            d10 = _dot_rows(value, base, x0, y0 + 1, W, H, touch, go, d, d_ok, M, D, F64)
            d11 = _dot_rows(value, base, x0 + 1, y0 + 1, W, H, touch, go, d, d_ok, M, D, F64)
            # d out / d attn: the bilinear sample; d / dx, dy: the weights' derivatives, in
            # pixels, times the pixels per unit of location (W, H)
            g_attn = gy * gx * d00 + gy * fx * d01 + fy * gx * d10 + fy * fx * d11
            g_x = -gy * d00 + gy * d01 - fy * d10 + fy * d11
            g_y = -gx * d00 - fx * d01 + gx * d10 + fx * d11
            g_x = g_x * a * W.to(a.dtype)
            g_y = g_y * a * H.to(a.dtype)
            g_attn = tl.where(touch, g_attn, 0.0)
            g_x = tl.where(touch, g_x, 0.0)
            g_y = tl.where(touch, g_y, 0.0)
            tl.store(grad_attn + i, g_attn.to(grad_attn.dtype.element_ty), mask=q_ok)
            tl.store(grad_loc + 2 * i, g_x.to(grad_loc.dtype.element_ty), mask=q_ok)
            tl.store(grad_loc + 2 * i + 1, g_y.to(grad_loc.dtype.element_ty), mask=q_ok)
            key = first_key + (y0 + 1) * (W + 1) + (x0 + 1)
            key = tl.where(touch, key, -1)
            tl.store(keys + i, key.to(keys.dtype.element_ty), mask=q_ok)


@triton.jit
def _term(grad_out, shapes, loc, attn, order, lo, count, j, L, P, d, d_ok, DX: tl.constexpr,
          DY: tl.constexpr, D: tl.constexpr, F64: tl.constexpr):
    """Per value row of the block, the ``j``-th sample of its run ``order[lo:lo + count]``
    (the samples for which the row is corner (DY, DX)) times its corner weight times its
    query's output gradient: a (BLOCK_R, BLOCK_D) tile, zero past the run's end."""
    ok = j < count  # (BLOCK_R,)
    i = tl.load(order + lo + j, mask=ok, other=0)  # (BLOCK_R,) sample indices
    lvl = (i // P) % L
    H = tl.load(shapes + 2 * lvl, mask=ok, other=1)
    W = tl.load(shapes + 2 * lvl + 1, mask=ok, other=1)
    # the pixel comes from the key, not from x0 and y0; the weights from the same code as
    # step 1's
    a, _, _, _, fx, fy = _sample(loc, attn, i, W, H, ok, F64)
    wx = fx if DX == 1 else 1.0 - fx
    wy = fy if DY == 1 else 1.0 - fy
    coef = tl.where(ok, a * (wy * wx), 0.0)  # (BLOCK_R,)
    n = i // (L * P)  # (BLOCK_R,) the sample's (query, head) row of grad_out
    go_ptrs = grad_out + n[:, None] * D + d[None, :]
    go = _acc(tl.load(go_ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0), F64)
    return coef[:, None] * go


@triton.jit
def deformable_bwd_value(grad_out, shapes, loc, attn, order, runs, grad_value, R, L, P,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         F64: tl.constexpr):
    """Step 3 of the backward: value rows ``(b, s, m)`` ``r`` of the block, each the sum of its
    four runs of samples (``runs`` (R, 4, 2): start and end in ``order`` per corner role
    (0, 0), (0, 1), (1, 0), (1, 1)), written once.

    Step ``j`` adds the ``j``-th sample of the four runs at once (in role order), so a row's
    serial chain of loads is its longest run, not the four end to end; the order of adding is
    still fixed."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    r_ok = r < R
    d_ok = d < D
    acc = _acc(tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32), F64)  # (BLOCK_R, BLOCK_D)
    lo0 = tl.load(runs + r * 8 + 0, mask=r_ok, other=0)
    n0 = tl.load(runs + r * 8 + 1, mask=r_ok, other=0) - lo0
    lo1 = tl.load(runs + r * 8 + 2, mask=r_ok, other=0)
    n1 = tl.load(runs + r * 8 + 3, mask=r_ok, other=0) - lo1
    lo2 = tl.load(runs + r * 8 + 4, mask=r_ok, other=0)
    n2 = tl.load(runs + r * 8 + 5, mask=r_ok, other=0) - lo2
    lo3 = tl.load(runs + r * 8 + 6, mask=r_ok, other=0)
    n3 = tl.load(runs + r * 8 + 7, mask=r_ok, other=0) - lo3
    most = tl.maximum(tl.maximum(n0, n1), tl.maximum(n2, n3))  # (BLOCK_R,)
    longest = tl.reduce(most, 0, _MAX).to(tl.int32)  # a run is shorter than 2**31
    for j in range(longest):
        t = _term(grad_out, shapes, loc, attn, order, lo0, n0, j, L, P, d, d_ok, 0, 0, D, F64)
        t += _term(grad_out, shapes, loc, attn, order, lo1, n1, j, L, P, d, d_ok, 1, 0, D, F64)
        t += _term(grad_out, shapes, loc, attn, order, lo2, n2, j, L, P, d, d_ok, 0, 1, D, F64)
        t += _term(grad_out, shapes, loc, attn, order, lo3, n3, j, L, P, d, d_ok, 1, 1, D, F64)
        acc += t
    ptrs = grad_value + r[:, None] * D + d[None, :]
    tl.store(ptrs, acc.to(grad_value.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
