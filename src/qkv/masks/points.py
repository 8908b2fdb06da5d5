"""Point clouds laid out along a space-filling curve: Point Transformer V3's serialization.

PTv3 (Wu et al., "Point Transformer V3", CVPR 2024) quantises the points to a grid
(``floor(coord / grid_size)``), sorts them by the place of their cell on a space-filling
curve, and cuts the sorted sequence into patches of K points (1,024 in the paper); attention
runs within each patch. OctFormer (Wang, SIGGRAPH 2023) does the same with the z-order of
octree nodes. Cells that follow each other on the curve are near in space, so a patch is a
compact piece of the cloud. In qkv a patch is a document: ``masks.document(patch_ids)``, and
the last patch may be shorter (no padding, unlike PTv3's kernels).

``serialize(grid_coords, curve)`` gives the order as a :class:`TileLayout`: ``to_tiles``
sorts points along the curve, ``from_tiles`` puts them back. The curves, with ``n`` dims and
``depth`` bits per coordinate, give each cell a code of ``n * depth`` bits:

* ``"z"``: the Morton (z-order) code, the coordinates' bits interleaved, the first dim the
  most significant at each level (3D: ``x_i << 3i+2 | y_i << 3i+1 | z_i << 3i``), PTv3's and
  OctFormer's ``xyz2key``.
* ``"hilbert"``: the Hilbert code by Skilling's algorithm ("Programming the Hilbert curve",
  AIP Conf. Proc. 707, 2004): the coordinates are transformed bit level by bit level, then
  interleaved as for ``"z"`` (the encoding PTv3 uses). Consecutive codes are neighbouring
  cells, which z-order's jumps are not.

PTv3's transposed orders (``"z-trans"``, ``"hilbert-trans"``) are the same curves over the
coordinates with x and y swapped: ``serialize(grid[:, [1, 0, 2]], curve)``.

Shape alphabet: N points, n dims of the grid (1 to 3).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .grids import TileLayout

__all__ = ["serialize"]

CURVES = ("z", "hilbert")


def _interleave(coords: list[Tensor], depth: int) -> Tensor:
    """Bit ``j`` of dim ``i`` to bit ``j * n + (n - 1 - i)`` of the code (dim 0 the most
    significant at each level)."""
    n = len(coords)
    code = torch.zeros_like(coords[0])
    for j in range(depth):
        for i, c in enumerate(coords):
            code = code | (((c >> j) & 1) << (j * n + n - 1 - i))
    return code  # (N,)


def _hilbert_transpose(coords: list[Tensor], depth: int) -> list[Tensor]:
    """Skilling's ``AxestoTranspose``: coordinates to the Hilbert index in transposed form
    (interleaving its coordinates' bits gives the index). One elementwise step per bit level
    and dim, in the paper's order: each step reads what the previous one wrote."""
    x = list(coords)
    n = len(x)
    q = 1 << (depth - 1)
    while q > 1:  # undo the excess work, from the top level down
        low = q - 1
        for i in range(n):
            on = (x[i] & q) != 0
            x[0] = torch.where(on, x[0] ^ low, x[0])  # invert x[0]'s lower bits
            t = torch.where(on, 0, (x[0] ^ x[i]) & low)  # or exchange them with x[i]'s
            x[0], x[i] = x[0] ^ t, x[i] ^ t
        q >>= 1
    for i in range(1, n):  # Gray encode
        x[i] = x[i] ^ x[i - 1]
    t = torch.zeros_like(x[0])
    q = 1 << (depth - 1)
    while q > 1:
        t = torch.where((x[n - 1] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    return [xi ^ t for xi in x]


def _codes(grid_coords: Tensor, curve: str, depth: int) -> Tensor:
    """The curve's code of each cell, ``(N, n)`` -> ``(N,)`` int64."""
    coords = list(grid_coords.long().unbind(-1))  # n x (N,)
    if curve == "hilbert":
        coords = _hilbert_transpose(coords, depth)
    return _interleave(coords, depth)  # (N,)


def _check(grid_coords, curve, batch, depth) -> None:
    if (
        not isinstance(grid_coords, Tensor)
        or grid_coords.dtype.is_floating_point
        or grid_coords.dtype == torch.bool
        or grid_coords.dim() != 2
        or not 1 <= grid_coords.shape[1] <= 3
    ):
        raise ValueError(
            "serialize: grid_coords must be an integer tensor (N, n) of grid cells, n = 1 to 3 "
            "(quantise first: ((coord - coord.min(0).values) / grid_size).floor().long()), got "
            f"{getattr(grid_coords, 'dtype', type(grid_coords).__name__)} "
            f"{tuple(getattr(grid_coords, 'shape', ()))}"
        )
    if curve not in CURVES:
        raise ValueError(f"serialize: curve must be one of {CURVES}, got {curve!r}")
    n = grid_coords.shape[1]
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth * n <= 62:
        raise ValueError(
            f"serialize: depth (bits per coordinate) must be an int >= 1 with n * depth <= 62 "
            f"for an int64 code; got depth={depth!r} with n={n} dims"
        )
    N = grid_coords.shape[0]
    if batch is not None and (
        not isinstance(batch, Tensor)
        or batch.dtype.is_floating_point
        or batch.dtype == torch.bool
        or tuple(batch.shape) != (N,)
    ):
        raise ValueError(
            f"serialize: batch must be an integer tensor ({N},), the cloud of each point, got "
            f"{getattr(batch, 'dtype', type(batch).__name__)} {tuple(getattr(batch, 'shape', ()))}"
        )
    if torch.compiler.is_compiling() or N == 0:
        return  # a graph cannot read the values; eagerly, a cell off the grid is refused
    lo, hi = int(grid_coords.min()), int(grid_coords.max())
    if lo < 0 or hi >= 1 << depth:
        raise ValueError(
            f"serialize: grid_coords run from {lo} to {hi} but depth={depth} bits hold 0 to "
            f"{(1 << depth) - 1}; subtract the minimum cell, or raise depth"
        )
    if batch is not None:
        blo, bhi = int(batch.min()), int(batch.max())
        if blo < 0 or bhi >= 1 << (63 - n * depth):
            raise ValueError(
                f"serialize: batch ids run from {blo} to {bhi}; with n * depth = {n * depth} "
                f"code bits they must lie in 0..{(1 << (63 - n * depth)) - 1}"
            )


def serialize(
    grid_coords: Tensor, curve: str = "z", *, batch: Tensor | None = None, depth: int = 16
) -> TileLayout:
    """Points sorted along a space-filling curve (PTv3's serialization; see the module).

    Points are ordered by their cell's code on ``curve`` (``"z"`` or ``"hilbert"``), points
    of one cell in their input order (a stable sort). With ``batch``, the clouds of a
    concatenated batch stay apart, in batch order (the code's high bits, as PTv3's
    ``batch << depth * 3 | code``).

    Example:
        >>> grid = ((xyz - xyz.min(0).values) / 0.02).floor().long()   # (N, 3) cells
        >>> layout = qkv.masks.serialize(grid, "hilbert")
        >>> patch = torch.arange(len(grid)) // 1024                  # patches along the curve
        >>> out = qkv.scaled_dot_product_attention(
        ...     layout.to_tiles(q), layout.to_tiles(k), layout.to_tiles(v),
        ...     mask_mod=qkv.masks.document(patch))
        >>> out = layout.from_tiles(out)                              # back in input order

    Args:
        grid_coords: Integer grid cells ``>= 0``, one row per point.
        curve: ``"z"`` (Morton) or ``"hilbert"``.
        batch: The cloud of each point, when several are concatenated (PTv3's ``batch``).
        depth: Bits per coordinate (16, PTv3's default: cells 0 to 65,535).

    Returns:
        A :class:`TileLayout`: ``perm[p]`` is the input point at position ``p`` along the
        curve, ``inverse[i]`` the position of input point ``i``.

    Shape:
        grid_coords ``(N, n)``, n = 1 to 3; batch ``(N,)`` -> perm, inverse ``(N,)``, int64.
    """
    _check(grid_coords, curve, batch, depth)
    code = _codes(grid_coords, curve, depth)  # (N,)
    if batch is not None:
        code = code | (batch.long() << (grid_coords.shape[1] * depth))
    perm = torch.argsort(code, stable=True)  # (N,)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm), device=perm.device)
    return TileLayout(perm, inverse)
