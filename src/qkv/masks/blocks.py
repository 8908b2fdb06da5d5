"""Blocks: which blocks of queries x keys a mask leaves full, partial or empty.

A tiled backend walks the ``(T, S)`` scores in blocks of ``bq`` queries x ``bk`` keys
(``Grid``). Each block is ``EMPTY`` (skipped), ``PARTIAL`` (computed with the mask) or
``FULL`` (computed without one). qkv's own masks classify blocks from the blocks' index
bounds alone (their ``blocks`` method); any other mask is classified here by evaluating it
one block row at a time (``_classify_by_evaluation``: O(T * S) work, O(bq * S) memory).
``block_states`` gives the states as a tensor and ``block_summary`` draws them.

Shape alphabet: B batch, H heads, T query length, S key length; nq, nk query and key blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .evaluation import evaluate_mask, index_grid

if TYPE_CHECKING:
    from .vocabulary import MaskMod


EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Grid:
    """Sizes of one attention call and its blocks, for mask_mods to classify blocks on.

    Block ``(i, j)`` covers queries ``[i*bq, min((i+1)*bq, T))`` and keys
    ``[j*bk, min((j+1)*bk, S))``. ``q_lo``/``q_hi`` and ``kv_lo``/``kv_hi`` are each block's
    first and last index (inclusive), counted from ``q_start``/``kv_start``: a grid of a piece
    of a larger call (a shard in ring attention) has its queries at ``q_start + i``.

    Shape:
        q_lo, q_hi ``(nq, 1)``; kv_lo, kv_hi ``(1, nk)``; int64.
    """

    B: int
    H: int
    T: int
    S: int
    bq: int
    bk: int
    device: torch.device
    q_start: int = 0
    kv_start: int = 0

    @property
    def nq(self) -> int:
        return -(-self.T // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.S // self.bk)

    def _bounds(self, n: int, size: int, length: int, start: int) -> tuple[Tensor, Tensor]:
        lo = torch.arange(n, device=self.device) * size  # (n,)
        return lo + start, (lo + size).clamp(max=length) - 1 + start

    @property
    def q_lo(self) -> Tensor:
        return self._bounds(self.nq, self.bq, self.T, self.q_start)[0][:, None]  # (nq, 1)

    @property
    def q_hi(self) -> Tensor:
        return self._bounds(self.nq, self.bq, self.T, self.q_start)[1][:, None]  # (nq, 1)

    @property
    def kv_lo(self) -> Tensor:
        return self._bounds(self.nk, self.bk, self.S, self.kv_start)[0][None, :]  # (1, nk)

    @property
    def kv_hi(self) -> Tensor:
        return self._bounds(self.nk, self.bk, self.S, self.kv_start)[1][None, :]  # (1, nk)

    def indices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Index tensors b ``(B,1,1,1)``, h ``(1,H,1,1)``, q ``(1,1,T,1)``, kv ``(1,1,1,S)``,
        the positions from ``q_start``/``kv_start``."""
        return index_grid(
            self.B,
            self.H,
            self.T,
            self.S,
            device=self.device,
            q_start=self.q_start,
            kv_start=self.kv_start,
        )


def _classify_by_evaluation(mask_mod, grid: Grid) -> tuple[Tensor, Tensor]:
    """Blocks of any mask_mod, by evaluating it one block row at a time (O(bq * S) memory)."""
    if grid.nq == 0 or grid.nk == 0:  # no block at all
        none = torch.zeros(1, 1, grid.nq, grid.nk, dtype=torch.bool, device=grid.device)
        return none, none
    b, h, _, kv = grid.indices()
    pad = -grid.S % grid.bk
    fulls, empties = [], []
    for i in range(grid.nq):
        q0 = i * grid.bq
        q = torch.arange(q0, min(q0 + grid.bq, grid.T), device=grid.device).view(1, 1, -1, 1)
        q = q + grid.q_start
        allowed = evaluate_mask(mask_mod, b, h, q, kv)  # (B?, H?, bq?, S?)
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        lead = allowed.shape[:-2]
        allowed = allowed.expand(*lead, q.shape[2], grid.S)  # (B?, H?, bq, S)
        if pad:  # pad keys: a pad column counts as allowed for "full", not for "any"
            allowed = torch.nn.functional.pad(allowed, (0, pad))
        tiles = allowed.reshape(*lead, allowed.shape[-2], grid.nk, grid.bk)  # (B?, H?, bq, nk, bk)
        any_ = tiles.any(-1).any(-2)  # (B?, H?, nk)
        if pad:
            tiles = tiles.clone()
            tiles[..., -1, grid.bk - pad :] = True
        fulls.append(tiles.all(-1).all(-2))
        empties.append(~any_)
    return torch.stack(fulls, dim=-2), torch.stack(empties, dim=-2)  # (B?, H?, nq, nk)


@dataclass
class BlockSummary:
    """Which blocks of queries x keys a mask leaves full, partial or empty.

    ``state[b, h, i, j]`` is ``EMPTY`` (0: skipped), ``PARTIAL`` (1: computed with the mask)
    or ``FULL`` (2: computed without a mask), for query block ``i`` and key block ``j``;
    ``print(summary)`` draws it (``#`` full, ``+`` partial, ``.`` empty).

    Shape:
        state ``(B or 1, H or 1, nq, nk)``, int8.
    """

    state: Tensor
    grid: Grid
    mask: str

    def counts(self) -> dict[str, int]:
        """Blocks of each kind, over all (b, h)."""
        n = self.state.expand(self.grid.B, self.grid.H, -1, -1)
        return {
            k: int((n == v).sum())
            for k, v in (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))
        }

    @property
    def density(self) -> float:
        """The share of blocks that must be computed (full or partial)."""
        c = self.counts()
        return (c["full"] + c["partial"]) / max(1, sum(c.values()))

    def __str__(self) -> str:
        g = self.grid
        c = self.counts()
        lines = [
            (
                f"{self.mask}: T={g.T}, S={g.S}, blocks {g.bq}x{g.bk} -> {g.nq}x{g.nk}; full "
                f"{c['full']}, partial {c['partial']}, empty {c['empty']} "
                f"(computed {self.density:.1%})"
            )
        ]
        glyph = {EMPTY: ".", PARTIAL: "+", FULL: "#"}
        for b in range(self.state.shape[0]):
            for h in range(self.state.shape[1]):
                if self.state.shape[0] * self.state.shape[1] > 1:
                    lines.append(
                        f"b={b if self.state.shape[0] > 1 else '*'} "
                        f"h={h if self.state.shape[1] > 1 else '*'}"
                    )
                rows = self.state[b, h].tolist()
                shown = rows[:64]
                lines += [
                    "".join(glyph[v] for v in r[:128]) + (" ..." if len(r) > 128 else "")
                    for r in shown
                ]
                if len(rows) > 64:
                    lines.append(f"... ({len(rows) - 64} more block rows)")
        return "\n".join(lines)


def block_states(mask_mod: MaskMod, grid: Grid) -> Tensor:
    """``EMPTY``/``PARTIAL``/``FULL`` of every block of a bound mask.

    Shape:
        -> ``(B or 1, H or 1, nq, nk)``, int8.
    """
    full, empty = mask_mod.blocks(grid)
    full, empty = torch.broadcast_tensors(full, empty)
    lead = full.shape[:-2] if full.dim() > 2 else ()
    full, empty = (t.expand(*lead, grid.nq, grid.nk) for t in (full, empty))
    state = torch.full(full.shape, PARTIAL, dtype=torch.int8, device=full.device)
    state.masked_fill_(full, FULL).masked_fill_(empty, EMPTY)
    return state.reshape((1,) * (4 - state.dim()) + tuple(state.shape))


def block_summary(
    mask_mod, B: int, H: int, T: int, S: int, *, block: int | tuple[int, int] = 128, device=None
) -> BlockSummary:
    """Summarise ``mask_mod`` block by block: what the tiled backend skips and what it masks.

    Example:
        >>> print(qkv.masks.block_summary(qkv.masks.sliding_window(2), 1, 1, 8, 8, block=2))
        sliding_window(2, 0, align='top_left'): T=8, S=8, blocks 2x2 -> 4x4; full 0, partial 7, ...

    Shape:
        state ``(B or 1, H or 1, ceil(T / bq), ceil(S / bk))``.
    """
    from .vocabulary import as_mask_mod  # the layer above

    bq, bk = (block, block) if isinstance(block, int) else block
    if min(bq, bk) < 1:
        raise ValueError(f"block sizes must be >= 1, got {block!r}")
    mod = as_mask_mod(mask_mod).bind(B, H, T, S)
    grid = Grid(B, H, T, S, bq, bk, torch.device(device or "cpu"))
    return BlockSummary(block_states(mod, grid).cpu(), grid, repr(mod))
