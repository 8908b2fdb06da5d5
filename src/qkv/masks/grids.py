"""Neighborhood attention (NATTEN's semantics) on 1D, 2D and 3D token grids, and tile layouts.

``neighborhood(kernel_size, shape)`` lets the token at grid coordinate ``c`` attend to the
``kernel_size`` tokens around it along each dim, the window shifted at the borders so that
every query sees the same number of keys (Hassani et al., "Neighborhood Attention
Transformer", CVPR 2023; NATTEN). Per dim, with length ``n``, kernel ``k`` and dilation ``d``:

* tokens fall into ``d`` dilation groups by ``c % d``; a query sees keys of its own group
  only, in group coordinates ``x = c // d`` over the group's ``n_g = ceil((n - g) / d)``
  tokens (DiNAT, Hassani & Shi 2022);
* not causal: the window is ``[s, s + k - 1]`` with ``s = clamp(x - k // 2, 0, n_g - k)``:
  ``k // 2`` keys before the query and ``(k - 1) // 2`` after, shifted inwards at a border
  (an even ``k`` has one key more before than after, as NATTEN has it);
* causal: the window is ``[x - k + 1, x]`` cut at 0, not shifted (the first queries see
  fewer keys), as NATTEN's causal neighborhood attention.

A key is allowed when it is in the query's window along every dim. Tokens are the grid
flattened row-major (last dim fastest): ``T == S == prod(shape)``. ``layout=`` puts them in
another order (``tile_layout``: tiles of the grid one after another), in which a tiled
backend's blocks cover compact patches of the grid and skip more of the keys.

Blocks are classified from per-dim coordinate ranges, never a ``(T, S)`` mask: each block's
tokens lie in a box of grid coordinates, and along each dim the union and the intersection of
the windows of a range of queries are intervals, so "some pair allowed" and "every pair
allowed" are interval tests (per dilation group), O(nq * nk * dims * dilation). Exact when
each block's tokens fill their box (row-major blocks of whole rows, tiles of one block's
size), conservative otherwise.

Shape alphabet: T query length, S key length, N = prod(shape) tokens; nq, nk query and key
blocks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .blocks import Grid
from .vocabulary import MaskMod

__all__ = ["TileLayout", "neighborhood", "tile_layout"]


def _per_dim(fn: str, name: str, value, ndim: int, kind: type) -> tuple:
    """``value`` (one ``kind`` or a tuple of ``ndim``) as a tuple of ``ndim``."""

    def ok(v) -> bool:  # a bool is an int to Python: told apart both ways
        return isinstance(v, bool) == (kind is bool) and isinstance(v, int)

    if ok(value):
        return (value,) * ndim
    if isinstance(value, (tuple, list)) and len(value) == ndim and all(ok(v) for v in value):
        return tuple(value)
    what = "a bool" if kind is bool else "an int"
    raise ValueError(
        f"{fn}: {name} must be {what} or a tuple of {ndim} (one per dim of the grid), got {value!r}"
    )


def _check_shape(fn: str, shape) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if (
        not isinstance(shape, (tuple, list))
        or not 1 <= len(shape) <= 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)
    ):
        raise ValueError(
            f"{fn}: shape must be the token grid, 1 to 3 ints >= 1 such as (64, 64) or "
            f"(16, 32, 32), got {shape!r}"
        )
    return tuple(shape)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides: token ``t`` has coordinate ``(t // stride) % n`` along each dim."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _coords(tokens: Tensor, shape: tuple[int, ...]) -> list[Tensor]:
    """Grid coordinates of row-major token indices ``< prod(shape)``, one tensor per dim
    (tokens' shape). No division by a stride of 1 and no modulo on the first dim: integer
    division is the costly part of a mask Flex evaluates per element."""
    out = []
    for i, (s, n) in enumerate(zip(_strides(shape), shape)):
        c = tokens if s == 1 else tokens // s
        out.append(c if i == 0 else c % n)
    return out


class TileLayout(NamedTuple):
    """A token order: ``perm[p]`` is the row-major token at position ``p``, ``inverse`` its
    inverse (``inverse[perm] == arange(N)``). Unpacks as ``perm, inverse = layout``.

    Shape:
        perm, inverse ``(N,)``, int64.
    """

    perm: Tensor
    inverse: Tensor

    def to_tiles(self, x: Tensor, dim: int = -2) -> Tensor:
        """``x`` (tokens along ``dim``, row-major) in this layout's order."""
        return x.index_select(dim, self.perm.to(x.device))

    def from_tiles(self, x: Tensor, dim: int = -2) -> Tensor:
        """``x`` (tokens along ``dim``, in this layout's order) back in row-major order."""
        return x.index_select(dim, self.inverse.to(x.device))


def tile_layout(shape, tile, *, device=None) -> TileLayout:
    """Tokens of a grid laid out tile by tile: tiles in row-major order over the grid, the
    tokens of each tile in row-major order within it. Edge tiles of a shape that ``tile``
    does not divide are smaller.

    With ``neighborhood(..., layout=layout)`` a tiled backend's block of ``prod(tile)``
    consecutive tokens is one compact patch of the grid, so a 2D or 3D neighborhood's keys of
    a block sit in a few blocks and the rest are skipped (a row-major block is a strip of one
    row, whose windows reach ``kernel_size`` rows above and below). A tile of 64 tokens, the
    tiled backend's block (``(8, 8)``, ``(4, 4, 4)``), dividing the shape keeps the block
    classification exact.

    Example:
        >>> layout = qkv.masks.tile_layout((64, 64), (8, 8))
        >>> x_tiles = layout.to_tiles(x)            # x (B, H, 4096, D) row-major
        >>> out = layout.from_tiles(out_tiles)      # back to row-major

    Shape:
        perm, inverse ``(N,)``, int64, N = prod(shape).
    """
    shape = _check_shape("tile_layout", shape)
    ndim = len(shape)
    tile = _per_dim("tile_layout", "tile", tile, ndim, int)
    if any(not 1 <= t <= n for t, n in zip(tile, shape)):
        raise ValueError(
            f"tile_layout: tile {tile} must be >= 1 and at most the grid {shape} along each dim"
        )
    N = math.prod(shape)
    coords = _coords(torch.arange(N, device=device), shape)  # ndim x (N,)
    tiles_per_dim = tuple(-(-n // t) for n, t in zip(shape, tile))
    tile_index = sum((c // t) * s for c, t, s in zip(coords, tile, _strides(tiles_per_dim)))
    within = sum((c % t) * s for c, t, s in zip(coords, tile, _strides(tile)))
    perm = torch.argsort(tile_index * math.prod(tile) + within)  # (N,) keys are unique
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(N, device=perm.device)
    return TileLayout(perm, inverse)


class _Neighborhood(MaskMod):
    """NATTEN's neighborhood on a token grid (see the module docstring)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        kernel_size: tuple[int, ...],
        dilation: tuple[int, ...],
        is_causal: tuple[bool, ...],
        layout: Tensor | None,
    ) -> None:
        self.shape, self.kernel_size, self.dilation = shape, kernel_size, dilation
        self.is_causal, self.layout = is_causal, layout
        # the whole description as a string: keys built from a mask's scalar attributes
        # (the flex backend's block-mask cache) then tell two neighborhoods apart
        self.spec = repr(self)

    def bind(self, B, H, T, S):
        N = math.prod(self.shape)
        if T != N or S != N:
            raise ValueError(
                f"neighborhood: the grid {self.shape} has {N} tokens but the call has T={T} "
                f"queries and S={S} keys; neighborhood attention is self-attention over the "
                f"grid's tokens, so T and S must both be {N}"
            )
        return self

    def tensors(self):
        return () if self.layout is None else (self.layout,)

    def _tokens(self, idx: Tensor) -> Tensor:
        """Row-major token indices of positions ``idx``."""
        if self.layout is None:
            return idx
        return self.layout.to(idx.device)[idx]

    def __call__(self, b, h, q_idx, kv_idx):
        qc = _coords(self._tokens(q_idx), self.shape)
        kc = _coords(self._tokens(kv_idx), self.shape)
        ok = None
        for i, n in enumerate(self.shape):
            allowed = _allowed_1d(
                qc[i], kc[i], n, self.kernel_size[i], self.dilation[i], self.is_causal[i]
            )
            ok = allowed if ok is None else ok & allowed
        return ok  # (1, 1, T, S): the broadcast of q_idx and kv_idx

    def _boxes(self, start: int, length: int, size: int, device) -> tuple[Tensor, Tensor]:
        """Per block of ``size`` positions from ``start``, the lowest and highest grid
        coordinate along each dim of the tokens it holds (its bounding box).

        Shape:
            -> lo, hi ``(ndim, n)``, n = ceil(length / size).
        """
        pos = torch.arange(start, start + length, device=device)  # (L,)
        c = torch.stack(_coords(self._tokens(pos), self.shape))  # (ndim, L)
        pad = -length % size
        if pad:  # the last block padded with its own last token
            c = torch.cat([c, c[:, -1:].expand(-1, pad)], dim=1)  # (ndim, n * size)
        c = c.reshape(c.shape[0], -1, size)  # (ndim, n, size)
        return c.amin(-1), c.amax(-1)

    def blocks(self, grid: Grid) -> tuple[Tensor, Tensor]:
        if grid.nq == 0 or grid.nk == 0:
            none = torch.zeros(grid.nq, grid.nk, dtype=torch.bool, device=grid.device)
            return none, none
        q_lo, q_hi = self._boxes(grid.q_start, grid.T, grid.bq, grid.device)  # (ndim, nq)
        k_lo, k_hi = self._boxes(grid.kv_start, grid.S, grid.bk, grid.device)  # (ndim, nk)
        full = torch.ones(grid.nq, grid.nk, dtype=torch.bool, device=grid.device)
        empty = torch.zeros_like(full)
        for i, n in enumerate(self.shape):
            some, every = _box_1d(
                q_lo[i][:, None],
                q_hi[i][:, None],
                k_lo[i][None, :],
                k_hi[i][None, :],
                n,
                self.kernel_size[i],
                self.dilation[i],
                self.is_causal[i],
            )  # (nq, nk) each
            empty |= ~some
            full &= every
        return full, empty

    def key_counts(self, marked: Tensor) -> tuple[Tensor, Tensor]:
        """Per query position, how many of the ``marked`` keys its window holds, and how
        many keys it holds, in O(N * dims) without evaluating the mask: the window is a box
        of the grid, so the marks are summed dim by dim over each coordinate's window, by
        differences of one cumulative sum per dim (taken every ``d``-th token, dilation
        groups apart). What the NaN/inf part of the mask contract counts per row.

        Shape:
            marked ``(..., N)`` float (0 and 1, in the call's token order) -> hits
            ``(..., N)`` in marked's dtype (exact up to 2^24 in float32) and keys ``(N,)``
            int64.
        """
        N = math.prod(self.shape)
        lead = marked.shape[:-1]
        order = None if self.layout is None else self.layout.to(marked.device)
        if order is not None:  # into row-major order: token order[p] sits at position p
            marked = torch.zeros_like(marked).index_copy_(-1, order, marked)  # (..., N)
        grid = marked.reshape(*lead, *self.shape)  # (..., *shape)
        keys = torch.ones((), dtype=torch.long, device=marked.device)
        for i, n in enumerate(self.shape):
            lo, hi = _window_bounds(
                n, self.kernel_size[i], self.dilation[i], self.is_causal[i], marked.device
            )  # (n,) each: the first and last key coordinate of each query coordinate
            grid = _window_sums(grid, len(lead) + i, lo, hi, self.dilation[i])
            count = (hi - lo) // self.dilation[i] + 1  # (n,)
            keys = keys.unsqueeze(-1) * count  # (n_0, ..., n_i)
        hits, keys = grid.reshape(*lead, N), keys.reshape(N)
        if order is not None:  # back to the call's order
            hits, keys = hits.index_select(-1, order), keys.index_select(-1, order)
        return hits, keys

    def __repr__(self):
        def one(t):
            return t[0] if len(set(t)) == 1 else t

        parts = [f"{one(self.kernel_size)}", f"{self.shape}"]
        if any(d != 1 for d in self.dilation):
            parts.append(f"dilation={one(self.dilation)}")
        if any(self.is_causal):
            parts.append(f"is_causal={one(self.is_causal)}")
        if self.layout is not None:
            parts.append("layout=tensor")
        return f"neighborhood({', '.join(parts)})"


def _allowed_1d(cq: Tensor, ck: Tensor, n: int, k: int, d: int, causal: bool) -> Tensor:
    """Whether key coordinate ``ck`` is in the window of query coordinate ``cq`` along one
    dim of length ``n`` (kernel ``k``, dilation ``d``), elementwise on broadcast tensors."""
    if d == 1:
        x, y = cq, ck
    else:
        g = cq % d
        x, y = cq // d, ck // d  # coordinates within the dilation group
    if causal:
        ok = (y <= x) & (y > x - k)
    else:
        # shifted inwards at the far border; the query's group holds ceil((n - g) / d) tokens
        if d == 1:
            lo = (x - k // 2).clamp(0, n - k)
        else:
            lo = torch.minimum((x - k // 2).clamp(min=0), (n - g + d - 1) // d - k)
        offset = y - lo
        ok = (offset >= 0) & (offset < k)
    if d > 1:
        ok = ok & (ck % d == g)  # the same dilation group
    return ok


def _window_bounds(n: int, k: int, d: int, causal: bool, device) -> tuple[Tensor, Tensor]:
    """The first and last key coordinate of the window of each query coordinate along a dim
    of ``n`` tokens (the keys between them are every ``d``-th).

    Shape:
        -> lo, hi ``(n,)`` int64.
    """
    c = torch.arange(n, device=device)  # (n,)
    g, x = c % d, c // d
    if causal:
        start = (x - k + 1).clamp(min=0)
        return start * d + g, c
    start = torch.minimum((x - k // 2).clamp(min=0), (n - g + d - 1) // d - k)
    return start * d + g, (start + k - 1) * d + g


def _window_sums(grid: Tensor, dim: int, lo: Tensor, hi: Tensor, d: int) -> Tensor:
    """Along ``dim`` of ``grid``: at each coordinate ``c``, the sum of ``grid`` at ``lo[c],
    lo[c] + d, ..., hi[c]``, by the difference of two entries of a cumulative sum taken
    every ``d``-th element (``cum[j] = grid[j] + cum[j - d]``).

    Shape:
        grid ``(..., n, ...)`` -> the same.
    """
    n = grid.shape[dim]
    pad = -n % d
    x = grid.movedim(dim, -1)  # (..., n)
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))  # (..., n + pad)
    cum = x.unflatten(-1, (-1, d)).cumsum(-2).flatten(-2)  # (..., n + pad): every d-th summed
    cum = torch.nn.functional.pad(cum, (d, 0))  # (..., d + n + pad): cum[j] at j + d, 0 before
    sums = cum.index_select(-1, hi + d) - cum.index_select(-1, lo)  # (..., n)
    return sums.movedim(-1, dim)


def _interval_1d(xa, xb, ya, yb, n: int, k: int, causal: bool) -> tuple[Tensor, Tensor]:
    """For query coordinates ``[xa, xb]`` and key coordinates ``[ya, yb]`` (non-empty ranges
    along a dim of ``n`` tokens, no dilation): whether some pair is allowed and whether every
    pair is. Window bounds grow with the query by at most 1 per step, so the windows of the
    range cover ``[lo(xa), hi(xb)]`` without a gap and all contain ``[lo(xb), hi(xa)]``."""
    if causal:
        lo_a, lo_b, hi_a, hi_b = (xa - k + 1).clamp(min=0), (xb - k + 1).clamp(min=0), xa, xb
    else:
        lo_a = (xa - k // 2).clamp(0, n - k)
        lo_b = (xb - k // 2).clamp(0, n - k)
        hi_a, hi_b = lo_a + (k - 1), lo_b + (k - 1)
    some = (ya <= hi_b) & (yb >= lo_a)
    every = (ya >= lo_b) & (yb <= hi_a)
    return some, every


def _box_1d(qa, qb, ka, kb, n: int, k: int, d: int, causal: bool) -> tuple[Tensor, Tensor]:
    """Whether some / every pair of query coordinates ``[qa, qb]`` and key coordinates
    ``[ka, kb]`` is allowed along one dim, exactly (shapes broadcast)."""
    if d == 1:
        return _interval_1d(qa, qb, ka, kb, n, k, causal)
    some = torch.zeros((), dtype=torch.bool, device=qa.device)
    for g in range(d):  # each dilation group is a neighborhood without dilation
        n_g = (n - g + d - 1) // d
        xa, xb = -((g - qa) // d), (qb - g) // d  # the group's coordinates in [qa, qb]
        ya, yb = -((g - ka) // d), (kb - g) // d
        s, _ = _interval_1d(xa, xb, ya, yb, n_g, k, causal)
        some = some | (s & (xa <= xb) & (ya <= yb))
    # two coordinates in a range of either side fall in two groups: a pair of them is masked
    every = some & (qa == qb) & (ka == kb)
    return some, every


def neighborhood(
    kernel_size,
    shape,
    dilation=1,
    is_causal=False,
    *,
    layout: Tensor | TileLayout | None = None,
) -> MaskMod:
    """Neighborhood attention on a 1D, 2D or 3D token grid, with NATTEN's semantics.

    The token at grid coordinate ``c`` attends to ``kernel_size`` keys along each dim: the
    window centred on it, shifted inwards at the borders so that every query sees exactly
    ``prod(kernel_size)`` keys. ``dilation`` takes every ``d``-th token (the query's own
    dilation group); ``is_causal`` (per dim) keeps the keys at or before the query along that
    dim, ``kernel_size`` of them, not shifted. Each of ``kernel_size``, ``dilation`` and
    ``is_causal`` is one value for every dim or a tuple with one per dim.

    Tokens are the grid flattened row-major (last dim fastest), so ``T == S == prod(shape)``;
    ``layout`` (a permutation, or :func:`tile_layout`'s result) says which row-major token
    sits at each position instead, for inputs laid out tile by tile.

    A 1D neighborhood of ``kernel_size=5`` over 7 tokens (x = may attend)::

        x x x x x . .
        x x x x x . .
        x x x x x . .
        . x x x x x .
        . . x x x x x
        . . x x x x x
        . . x x x x x

    Args:
        kernel_size: keys per dim, ``1 <= kernel_size * dilation <= shape`` along each dim.
        shape: the token grid, e.g. ``(64, 64)`` or ``(16, 32, 32)``.
        dilation: the step between keys of a window, >= 1.
        is_causal: keys at or before the query only, per dim.
        layout: ``perm`` with ``perm[p]`` the row-major token at position ``p``.

    Shape:
        layout ``(N,)`` int, N = prod(shape); the call's T = S = N.
    """
    shape = _check_shape("neighborhood", shape)
    ndim = len(shape)
    kernel_size = _per_dim("neighborhood", "kernel_size", kernel_size, ndim, int)
    dilation = _per_dim("neighborhood", "dilation", dilation, ndim, int)
    is_causal = _per_dim("neighborhood", "is_causal", is_causal, ndim, bool)
    for i, (k, d, n) in enumerate(zip(kernel_size, dilation, shape)):
        if k < 1 or d < 1:
            raise ValueError(
                f"neighborhood: kernel_size and dilation must be >= 1, got kernel_size="
                f"{kernel_size} and dilation={dilation}"
            )
        if k * d > n:
            raise ValueError(
                f"neighborhood: along dim {i} the window spans kernel_size * dilation = "
                f"{k} * {d} = {k * d} tokens but the grid {shape} has only {n}; use a "
                f"kernel_size of at most {n // d} there"
            )
    return _Neighborhood(shape, kernel_size, dilation, is_causal, _check_layout(layout, shape))


def _check_layout(layout, shape: tuple[int, ...]) -> Tensor | None:
    if layout is None:
        return None
    if isinstance(layout, TileLayout):
        layout = layout.perm
    N = math.prod(shape)
    if (
        not isinstance(layout, Tensor)
        or layout.dtype.is_floating_point
        or layout.dtype == torch.bool
        or layout.shape != (N,)
    ):
        raise ValueError(
            f"neighborhood: layout must be an integer tensor ({N},) (a permutation of the "
            f"grid's {N} tokens, e.g. qkv.masks.tile_layout(shape, tile)), got "
            f"{getattr(layout, 'dtype', type(layout).__name__)} "
            f"{tuple(getattr(layout, 'shape', ()))}"
        )
    layout = layout.long()
    if not torch.equal(layout.sort().values.cpu(), torch.arange(N, device="cpu")):
        raise ValueError(
            f"neighborhood: layout must hold each of the grid's {N} tokens once (a "
            f"permutation of 0..{N - 1}); some are missing or repeated"
        )
    return layout
