"""Multi-scale deformable attention in plain PyTorch ops, forward and backward written out.

The portable path: it runs wherever torch runs, and it is the CPU path when no C++ compiler is
found (``native.py`` is the fast one). Unlike the slow twin (``naive.py``), it materialises
nothing of size ``L * P`` times the output: a loop over levels and points gathers the four
bilinear corners of each sample and accumulates them into the output. The index math (corner
rows, bilinear weights, which corners fall inside the map) is done once per level, for all
points at once. Half precision gathers in its own dtype and accumulates in float32.

The backward is written out too (no autograd graph is kept): the value gradient is
accumulated with ``index_add_``, which is deterministic on CPU (torch documents only its CUDA
form as nondeterministic, and deterministic under ``torch.use_deterministic_algorithms``);
the location and weight gradients come from the dot product of
each corner's value row with the output gradient.

Corners outside a map read a zero row appended to the value (and scatter into a row that is
dropped), so a non-finite value elsewhere never leaks into an outside sample through a
``0 * inf``. Nothing here reads a tensor's value on the host.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points; N = B * Lq * M.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["deformable_backward_gather", "deformable_forward_gather"]

# corners in the order (y0, x0), (y0, x0 + 1), (y0 + 1, x0), (y0 + 1, x0 + 1)
_DX = (0, 1, 0, 1)
_DY = (0, 0, 1, 1)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (they accumulate there), the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Level(NamedTuple):
    """One level's sampling, for all queries, heads and points at once."""

    rows: Tensor  # (B, Lq, M, P, 4) rows of the padded (B*S*M + 1, D) value; the pad if outside
    bilinear: Tensor  # (B, Lq, M, P, 4) bilinear weight of each corner, 0 outside the map
    fx: Tensor  # (B, Lq, M, P) fractional parts of the pixel coordinates
    fy: Tensor  # (B, Lq, M, P)
    inside: Tensor  # (B, Lq, M, P, 4) bool


def _pixel(loc: Tensor, size: Tensor) -> Tensor:
    """Pixel coordinates of locations in [0, 1] over ``size`` pixels, rounded as grid_sample
    rounds them (``grid = 2 * loc - 1``, then ``((grid + 1) * size - 1) / 2``): a point on a
    pixel centre or edge falls on the same side, and takes the same one-sided derivative."""
    return ((2 * loc - 1 + 1) * size.to(loc.dtype) - 1) / 2


def _level(
    loc: Tensor, shapes: Tensor, starts: Tensor, lvl: int, S: int, M: int, pad_row: int
) -> _Level:
    """Corner rows and weights of level ``lvl`` for ``loc`` ``(B, Lq, M, L, P, 2)`` (acc dtype).

    Pixel coordinates are ``loc * (W, H) - 0.5`` (``grid_sample`` with ``align_corners=False``),
    rounded as grid_sample rounds them.
    """
    B = loc.shape[0]
    h, w = shapes[lvl, 0], shapes[lvl, 1]  # 0-d int64 tensors: no host read
    x = _pixel(loc[:, :, :, lvl, :, 0], w)  # (B, Lq, M, P)
    y = _pixel(loc[:, :, :, lvl, :, 1], h)
    x0, y0 = torch.floor(x), torch.floor(y)
    fx, fy = x - x0, y - y0
    dx = torch.tensor(_DX, dtype=loc.dtype, device=loc.device)
    dy = torch.tensor(_DY, dtype=loc.dtype, device=loc.device)
    xi = x0.unsqueeze(-1) + dx  # (B, Lq, M, P, 4)
    yi = y0.unsqueeze(-1) + dy
    inside = (xi >= 0) & (xi <= w - 1) & (yi >= 0) & (yi <= h - 1)  # NaN is outside
    zero = torch.zeros((), dtype=loc.dtype, device=loc.device)
    pix = torch.where(inside, yi, zero).long() * w + torch.where(inside, xi, zero).long()
    b = torch.arange(B, device=loc.device).view(B, 1, 1, 1, 1)
    m = torch.arange(M, device=loc.device).view(1, 1, M, 1, 1)
    rows = torch.where(inside, (b * S + starts[lvl] + pix) * M + m, pad_row)  # (B, Lq, M, P, 4)
    wx = torch.stack((1 - fx, fx), -1)  # (B, Lq, M, P, 2)
    wy = torch.stack((1 - fy, fy), -1)
    bilinear = (wy.unsqueeze(-1) * wx.unsqueeze(-2)).flatten(-2)  # (B, Lq, M, P, 4)
    bilinear = torch.where(inside, bilinear, zero)
    return _Level(rows, bilinear, fx, fy, inside)


def _padded_rows(value: Tensor) -> Tensor:
    """value ``(B, S, M, D)`` as rows ``(B*S*M + 1, D)``, the last one zero."""
    rows = value.reshape(-1, value.shape[-1])  # (B*S*M, D)
    return torch.cat((rows, rows.new_zeros(1, rows.shape[-1])))  # (B*S*M + 1, D)


def deformable_forward_gather(
    value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor, *, inplace=True
) -> Tensor:
    """The output, accumulated in float32 for half inputs.

    Made of differentiable torch ops: autograd (and ``torch.func``) can take it whole, with
    ``inplace=False`` (under vmap, a sum started from zeros cannot take a batched addend in
    place).

    Shape:
        value ``(B, S, M, D)``; shapes ``(L, 2)``; starts ``(L,)`` (int64, value's device);
        loc ``(B, Lq, M, L, P, 2)``; attn ``(B, Lq, M, L, P)`` -> ``(B, Lq, M * D)`` in
        value's dtype.
    """
    B, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    acc = acc_dtype(value.dtype)
    rows = _padded_rows(value)  # (B*S*M + 1, D)
    out = torch.zeros(B, Lq, M, D, dtype=acc, device=value.device)
    loc, attn = loc.to(acc), attn.to(acc)
    for lvl in range(L):
        lv = _level(loc, shapes, starts, lvl, S, M, rows.shape[0] - 1)
        weights = lv.bilinear * attn[:, :, :, lvl].unsqueeze(-1)  # (B, Lq, M, P, 4)
        for p in range(P):
            for c in range(4):
                picked = rows.index_select(0, lv.rows[..., p, c].reshape(-1))  # (N, D)
                w, picked = weights[..., p, c, None], picked.view(B, Lq, M, D)
                out = out.addcmul_(w, picked) if inplace else out.addcmul(w, picked.to(acc))
    return out.to(value.dtype).view(B, Lq, M * D)  # (B, Lq, M*D)


def deformable_backward_gather(
    grad_out: Tensor, value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for value, loc and attn (in their dtypes, accumulated in float32 for half).

    Shape:
        grad_out ``(B, Lq, M * D)``; the rest as :func:`deformable_forward_gather` ->
        ``(B, S, M, D)``, ``(B, Lq, M, L, P, 2)``, ``(B, Lq, M, L, P)``.
    """
    B, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    acc = acc_dtype(value.dtype)
    rows = _padded_rows(value)  # (B*S*M + 1, D)
    go = grad_out.to(acc).reshape(B * Lq * M, D)  # (N, D)
    grad_rows = torch.zeros(rows.shape, dtype=acc, device=value.device)  # (B*S*M + 1, D)
    grad_loc = torch.empty(B, Lq, M, L, P, 2, dtype=acc, device=value.device)
    grad_attn = torch.empty(B, Lq, M, L, P, dtype=acc, device=value.device)
    loc_acc, attn_acc = loc.to(acc), attn.to(acc)
    for lvl in range(L):
        lv = _level(loc_acc, shapes, starts, lvl, S, M, rows.shape[0] - 1)
        a = attn_acc[:, :, :, lvl]  # (B, Lq, M, P)
        weights = lv.bilinear * a.unsqueeze(-1)  # (B, Lq, M, P, 4)
        dots = torch.empty_like(weights)  # (B, Lq, M, P, 4): corner value . grad_out
        for p in range(P):
            for c in range(4):
                idx = lv.rows[..., p, c].reshape(-1)  # (N,)
                picked = rows.index_select(0, idx).to(acc)  # (N, D); the pad row gives 0
                dots[..., p, c] = torch.linalg.vecdot(picked, go).view(B, Lq, M)
                grad_rows.index_add_(0, idx, go * weights[..., p, c].reshape(-1, 1))
        grad_attn[:, :, :, lvl] = (dots * lv.bilinear).sum(-1)
        # d bilinear / dx per corner: -(1 - fy), (1 - fy), -fy, fy; / dy: -(1 - fx), -fx, 1 - fx, fx
        one_fy, one_fx = 1 - lv.fy, 1 - lv.fx
        dwx = torch.stack((-one_fy, one_fy, -lv.fy, lv.fy), -1)  # (B, Lq, M, P, 4)
        dwy = torch.stack((-one_fx, -lv.fx, one_fx, lv.fx), -1)
        dwx, dwy = (torch.where(lv.inside, t, 0.0) for t in (dwx, dwy))
        h, w = shapes[lvl, 0].to(acc), shapes[lvl, 1].to(acc)
        grad_loc[:, :, :, lvl, :, 0] = (dots * dwx).sum(-1) * a * w
        grad_loc[:, :, :, lvl, :, 1] = (dots * dwy).sum(-1) * a * h
    grad_value = grad_rows[:-1].view(B, S, M, D).to(value.dtype)
    return grad_value, grad_loc.to(loc.dtype), grad_attn.to(attn.dtype)
