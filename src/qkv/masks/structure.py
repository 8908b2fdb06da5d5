"""Structure: a bound mask seen from a piece of its call, and keys for reusing a block plan.

``offset_mask``/``offset_score`` shift a bound mod to a piece of a larger call (a shard in
ring attention: queries from ``q_start``, keys from ``kv_start``). ``shift_invariant`` says
whether a mod depends on positions only through ``kv_idx - q_idx`` (so a tiled backend may
stack tiles), and ``structure_key`` gives a hashable key equal only for masks that allow the
same pairs, under which the tiled backend caches block plans; tensors count by content.

Both read exact types only: a subclass or a plain function may read anything in ``__call__``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib

from torch import Tensor

from .._identity import IdentityCache
from .blocks import _classify_by_evaluation
from .grids import _Neighborhood
from .vocabulary import MaskMod, ScoreMod, _Alibi, _Combined, _Document, _KeysBefore, _Window


class _Offset(MaskMod):
    """A bound mask seen from a piece of its call whose query ``i`` is position
    ``q_start + i`` and whose key ``j`` is position ``kv_start + j``."""

    def __init__(self, inner: MaskMod, q_start: int, kv_start: int) -> None:
        self.inner, self.q_start, self.kv_start = inner, q_start, kv_start

    def bind(self, B, H, T, S):
        return self  # bound already, to the whole call's sizes

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inner(b, h, q_idx + self.q_start, kv_idx + self.kv_start)

    def tensors(self):
        return self.inner.tensors()

    def blocks(self, grid):
        if not _blocks_take_offsets(self.inner):
            return _classify_by_evaluation(self, grid)
        return self.inner.blocks(
            dataclasses.replace(
                grid, q_start=grid.q_start + self.q_start, kv_start=grid.kv_start + self.kv_start
            )
        )

    def __repr__(self):
        return f"{self.inner!r}[q+{self.q_start}, kv+{self.kv_start}]"


class _OffsetScore(ScoreMod):
    """A bound score_mod seen from a piece of its call (see :class:`_Offset`)."""

    def __init__(self, inner: ScoreMod, q_start: int, kv_start: int) -> None:
        self.inner, self.q_start, self.kv_start = inner, q_start, kv_start
        self.additive = inner.additive

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.inner(score, b, h, q_idx + self.q_start, kv_idx + self.kv_start)

    def tensors(self):
        return self.inner.tensors()

    def __repr__(self):
        return f"{self.inner!r}[q+{self.q_start}, kv+{self.kv_start}]"


def offset_mask(mask_mod: MaskMod, q_start: int, kv_start: int) -> MaskMod:
    """``mask_mod`` (bound to a whole call's sizes) for a piece of that call: queries from
    position ``q_start``, keys from ``kv_start``. Blocks are classified from the shifted
    index bounds for qkv's own masks, by evaluation for any other (always exact)."""
    if q_start == 0 and kv_start == 0:
        return mask_mod
    return _Offset(mask_mod, q_start, kv_start)


def offset_score(score_mod: ScoreMod, q_start: int, kv_start: int) -> ScoreMod:
    """``score_mod`` (bound) for a piece of its call, as :func:`offset_mask`."""
    if q_start == 0 and kv_start == 0:
        return score_mod
    return _OffsetScore(score_mod, q_start, kv_start)


def _blocks_take_offsets(mask_mod: MaskMod) -> bool:
    """Whether ``mask_mod.blocks`` reads block positions only through ``Grid``'s bounds (so
    it honours ``q_start``/``kv_start``): qkv's own masks. A subclass with its own
    ``blocks`` may ignore them, so its blocks are found by evaluation instead."""
    method = type(mask_mod).blocks
    if method is _Combined.blocks and isinstance(mask_mod, _Combined):
        return all(_blocks_take_offsets(m) for m in mask_mod.mods)
    if method is _Offset.blocks and isinstance(mask_mod, _Offset):
        return _blocks_take_offsets(mask_mod.inner)
    return method in (_Window.blocks, _KeysBefore.blocks, _Document.blocks, _Neighborhood.blocks)


def shift_invariant(mod) -> bool:
    """Whether ``mod`` (a bound MaskMod or ScoreMod, or None) depends on positions only
    through ``kv_idx - q_idx``: then every query tile sees the same mask relative to its keys,
    and a tiled backend may compute many tiles in one kernel call. True for qkv's windows
    (causal, sliding_window, any alignment), ALiBi, their combinations and offsets; False for
    any other mask, subclasses included (their ``__call__`` may read absolute positions)."""
    if mod is None or type(mod) in (_Window, _Alibi):
        return True
    if type(mod) is _Combined:
        return all(shift_invariant(m) for m in mod.mods)
    if type(mod) in (_Offset, _OffsetScore):
        return shift_invariant(mod.inner)
    return False


def structure_key(mod) -> tuple | None:
    """A hashable key that equals another's only when both (bound) masks allow the same pairs
    at every size, or None when that cannot be told cheaply: the tiled backend reuses a
    block plan across calls under this key. Tensors count by their content (dtype, shape,
    device and a digest of their bytes), so ids or lengths changed in place give a new key.
    Exact types only, as in :func:`shift_invariant`: a subclass, a plain function or a dense
    mask gives None (their ``__call__`` may read anything)."""
    if mod is None:
        return ("none",)
    kind = type(mod)
    if kind is _Window:
        return ("window", mod.left, mod.right, mod.align, mod.offset)
    if kind is _KeysBefore:
        return ("keys_before", mod.n if isinstance(mod.n, int) else _content_key(mod.n))
    if kind is _Document:
        kv = "same" if mod.kv_ids is mod.q_ids else _content_key(mod.kv_ids)
        return ("document", _content_key(mod.q_ids), kv)
    if kind is _Neighborhood:
        layout = None if mod.layout is None else _content_key(mod.layout)
        return ("neighborhood", mod.shape, mod.kernel_size, mod.dilation, mod.is_causal, layout)
    if kind is _Offset:
        inner = structure_key(mod.inner)
        return None if inner is None else ("offset", inner, mod.q_start, mod.kv_start)
    if kind is _Combined:
        parts = tuple(structure_key(m) for m in mod.mods)
        return None if None in parts else (mod.op, parts)
    return None


def _content_key(t: Tensor) -> tuple:
    """dtype, shape, device and a 128-bit digest of ``t``'s values; remembered by ``t``'s
    identity and version (``qkv._identity``), so the next call with the same ids or lengths
    reads nothing on the host (on CUDA, reading them is a device sync)."""
    return _content_keys.get((t,), "content", lambda: _read_content_key(t))


_content_keys = IdentityCache(64)


def _read_content_key(t: Tensor) -> tuple:
    flat = t.detach().reshape(-1).to("cpu").contiguous()
    data = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return (str(t.dtype), tuple(t.shape), str(t.device), digest)
