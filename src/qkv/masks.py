"""Masks: one contract for every backend.

A boolean mask means True = may attend. A float mask is added to the scores. Both broadcast
to the scores' shape ``(*batch, T, S)`` as in PyTorch.

Structured masks (``mask_mod``) and score changes (``score_mod``) in FlexAttention's
vocabulary are in the second half of this file: ``causal``, ``sliding_window``, ``prefix_lm``,
``document``, ``key_lengths``, ``and_masks``/``or_masks``, ``alibi``, ``softcap``, with
``to_dense`` (the dense twin of a mask) and ``block_summary`` (what a tiled backend skips).

Shape alphabet: T query length, S key length.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import types
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    # structured masks and score changes (the public vocabulary)
    "MaskMod", "ScoreMod", "causal", "sliding_window", "prefix_lm", "document", "key_lengths",
    "and_masks", "or_masks", "alibi", "alibi_slopes", "softcap", "to_dense", "block_summary",
    "BlockSummary", "as_mask_mod", "as_score_mod", "evaluate_mask", "evaluate_score", "index_grid",
    "per_element", "score_mod_gradient_inputs", "shift_invariant", "structure_key",
    # dense masks
    "apply_mask_", "causal_bool", "merge_causal", "merge_key_mask",
]


def causal_bool(T: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """Top-left aligned causal mask: query ``i`` may attend to key ``j`` iff ``j <= i``.

    This is the alignment of ``torch.nn.functional.scaled_dot_product_attention``. For
    ``T != S`` (x = may attend)::

        T=2, S=4      T=4, S=2
        x . . .       x .
        x x . .       x x
                      x x
                      x x

    Shape:
        ``(T, S)``, bool.
    """
    return torch.ones(T, S, dtype=torch.bool, device=device).tril()  # (T, S)


def merge_causal(attn_mask: Tensor, T: int, S: int) -> Tensor:
    """Combine ``attn_mask`` with the top-left causal mask: a key must pass both.

    A bool mask is AND-ed with the causal mask; a float mask gets ``-inf`` above the diagonal.

    Shape:
        attn_mask broadcastable to ``(*batch, T, S)`` -> broadcast of it with ``(T, S)``.
    """
    causal = causal_bool(T, S, device=attn_mask.device)  # (T, S)
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return torch.where(causal, attn_mask, float("-inf"))


def apply_mask_(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Apply ``mask`` to ``scores`` in place: ``-inf`` where a bool mask is False, a float
    mask added. Returns the result, a new tensor only when a float mask widens the dtype.

    In place because a (T, S) score matrix is large: a fresh allocation costs page faults
    (~14 ms for 32 MiB on the CPU machine) that exceed the arithmetic. Pass scores you own.

    Shape:
        scores ``(*batch, T, S)``, mask broadcastable to it -> ``(*batch, T, S)``.
    """
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    if mask.dtype != scores.dtype:
        return scores + mask  # a float32 mask on half scores gives float32 scores, as in torch
    return scores.add_(mask)


def merge_key_mask(attn_mask: Tensor | None, key_mask: Tensor | None) -> Tensor | None:
    """Fold a ``key_mask`` (True = a real key) into ``attn_mask``: a key must pass both.

    Shape:
        attn_mask broadcastable to ``(B, H, T, S)``; key_mask ``(B, S)`` -> a mask
        broadcastable to ``(B, H, T, S)``.
    """
    if key_mask is None:
        return attn_mask
    keys = key_mask[:, None, None, :]  # (B, 1, 1, S)
    if attn_mask is None:
        return keys
    if attn_mask.dtype == torch.bool:
        return attn_mask & keys
    return torch.where(keys, attn_mask, float("-inf"))


# --------------------------------------------------------------------------------------------
# Structured masks and score changes: FlexAttention's vocabulary.
#
# A mask_mod is called as ``mask_mod(b, h, q_idx, kv_idx)`` with integer index tensors that
# broadcast against each other, b ``(B, 1, 1, 1)``, h ``(1, H, 1, 1)``, q_idx ``(1, 1, T, 1)``,
# kv_idx ``(1, 1, 1, S)`` (or any slice of them), and returns a bool tensor of their broadcast
# shape: True = may attend. A score_mod is called as ``score_mod(score, b, h, q_idx, kv_idx)``
# with the scaled scores ``(B, H, T, S)`` (or a tile of them) and returns new scores. A plain
# function written for torch's FlexAttention works unchanged: it is evaluated per element, as
# Flex does (``per_element``, one torch.vmap level per index dim), so it sees 0-d indices and
# a 0-d score. The ready-made objects below are called on the broadcast index tensors directly.
#
# The ready-made ones below are objects that also know, per block of queries x keys, whether
# the block is full, partial or empty, from the block's index bounds alone: that is what lets
# a tiled backend skip empty blocks and drop the mask on full ones without ever evaluating a
# (T, S) mask. For a plain function the blocks are found by evaluating it one block row at a
# time (O(T * S) work, O(block * S) memory).
# --------------------------------------------------------------------------------------------

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
        return index_grid(self.B, self.H, self.T, self.S, device=self.device,
                          q_start=self.q_start, kv_start=self.kv_start)


def index_grid(B: int, H: int, T: int, S: int, *, device=None, q_start: int = 0,
               kv_start: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The index tensors a mask_mod/score_mod is called with, for queries from ``q_start``
    and keys from ``kv_start``.

    Shape:
        b ``(B, 1, 1, 1)``, h ``(1, H, 1, 1)``, q_idx ``(1, 1, T, 1)``, kv_idx ``(1, 1, 1, S)``.
    """
    def ar(n, start=0):
        return torch.arange(start, start + n, device=device)
    return (ar(B).view(B, 1, 1, 1), ar(H).view(1, H, 1, 1), ar(T, q_start).view(1, 1, T, 1),
            ar(S, kv_start).view(1, 1, 1, S))


class MaskMod:
    """A structured mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

    Subclasses implement ``__call__`` and, to let a tiled backend skip blocks cheaply,
    ``blocks(grid)``. ``&`` and ``|`` combine masks like :func:`and_masks`/:func:`or_masks`.
    """

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def bind(self, B: int, H: int, T: int, S: int) -> "MaskMod":
        """This mask for a call with these sizes: validates its tensors against them and
        resolves what depends on them (the bottom-right alignment). Returns a MaskMod."""
        return self

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors this mask reads (lengths, document ids, a dense mask...): a trace
        recomputed later checks that none of them changed in place since the call."""
        return ()

    def blocks(self, grid: Grid) -> tuple[Tensor, Tensor]:
        """Which blocks are full (every pair may attend) and which are empty (none may).

        Must be exact or conservative: a block it calls full must be full, one it calls
        empty must be empty; anything else is treated as partial and evaluated.

        Returns:
            ``(full, empty)``, bool tensors broadcastable to ``(B, H, nq, nk)``.
        """
        return _classify_by_evaluation(self, grid)

    def __and__(self, other) -> "MaskMod":
        return and_masks(self, other)

    def __or__(self, other) -> "MaskMod":
        return or_masks(self, other)


class ScoreMod:
    """A change of the scaled scores ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

    ``additive`` is True when the change is ``score + bias(b, h, q_idx, kv_idx)`` with a bias
    that does not depend on the score (ALiBi, a relative bias): a backend may then add the
    bias as a float mask. ``tensors()`` lists the tensors it reads, so a backend can give them
    gradients.
    """

    additive = False

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def bind(self, B: int, H: int, T: int, S: int) -> "ScoreMod":
        return self

    def tensors(self) -> tuple[Tensor, ...]:
        return ()


def _offset(align: str, T: int, S: int) -> int:
    """Query position of row 0: 0 top-left, S - T bottom-right (the last query sees the last key)."""
    return 0 if align == "top_left" else S - T


def _check_align(align: str) -> str:
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return align


class _Window(MaskMod):
    """Keys within ``[q - left, q + right]`` of the (aligned) query position; None = unbounded."""

    def __init__(self, left: int | None, right: int | None, align: str, name: str,
                 offset: int | None = None) -> None:
        self.left, self.right, self.align, self.name, self.offset = left, right, align, name, offset

    def bind(self, B, H, T, S):
        return _Window(self.left, self.right, self.align, self.name, _offset(self.align, T, S))

    def _off(self) -> int:
        if self.offset is None:
            if self.align == "top_left":
                return 0
            raise ValueError(
                f"{self!r} needs the lengths T and S to align bottom-right: pass it as "
                f"mask_mod= to scaled_dot_product_attention, or use qkv.masks.to_dense(mask, B, H, T, S)"
            )
        return self.offset

    def __call__(self, b, h, q_idx, kv_idx):
        pos = q_idx + self._off()
        ok = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if self.left is not None:
            ok = ok & (kv_idx >= pos - self.left)
        if self.right is not None:
            ok = ok & (kv_idx <= pos + self.right)
        return ok  # (1, 1, T, S): dims the mask does not depend on stay 1

    def blocks(self, grid):
        off = self._off()
        lo, hi = grid.q_lo + off, grid.q_hi + off  # (nq, 1) positions
        full = torch.ones(grid.nq, grid.nk, dtype=torch.bool, device=grid.device)
        empty = torch.zeros_like(full)
        if self.left is not None:
            full &= grid.kv_lo >= hi - self.left
            empty |= grid.kv_hi < lo - self.left
        if self.right is not None:
            full &= grid.kv_hi <= lo + self.right
            empty |= grid.kv_lo > hi + self.right
        return full, empty

    def __repr__(self):
        if self.name == "causal":
            return f"causal(align={self.align!r})"
        return f"sliding_window({self.left}, {self.right}, align={self.align!r})"


def causal(align: str = "top_left") -> MaskMod:
    """Causal mask: query ``i`` may attend to key ``j`` iff ``j <= i + offset``.

    ``align="top_left"`` (offset 0) is ``is_causal=True`` of torch's SDPA; ``"bottom_right"``
    (offset ``S - T``) aligns the last query with the last key, as decoding against a KV cache
    needs. For ``T=2, S=4`` (x = may attend)::

        top_left      bottom_right
        x . . .       x x x .
        x x . .       x x x x

    With ``T > S`` and bottom-right, the first ``T - S`` query rows may attend to nothing
    (they output 0, by the mask contract).
    """
    return _Window(None, 0, _check_align(align), "causal")


def sliding_window(left: int, right: int = 0, *, align: str = "top_left") -> MaskMod:
    """Local attention: query ``i`` may attend to keys ``j`` with ``i - left <= j <= i + right``.

    ``sliding_window(w)`` is causal local attention over the last ``w`` keys and the query's
    own position (``w + 1`` keys); ``sliding_window(w, w)`` is the symmetric band. ``align`` as
    in :func:`causal`. For ``T = S = 5``, ``sliding_window(1, 1)``::

        x x . . .
        x x x . .
        . x x x .
        . . x x x
        . . . x x
    """
    for name, n in (("left", left), ("right", right)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"sliding_window: {name} must be an int >= 0, got {n!r}")
    return _Window(left, right, _check_align(align), "window")


class _KeysBefore(MaskMod):
    """Keys at index < n (per batch element when n is a tensor)."""

    def __init__(self, n: int | Tensor, name: str) -> None:
        self.n, self.name = n, name

    def _n(self, like: Tensor) -> Tensor | int:
        if isinstance(self.n, int):
            return self.n
        return self.n.to(like.device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)

    def bind(self, B, H, T, S):
        if isinstance(self.n, Tensor) and self.n.numel() not in (1, B):
            raise ValueError(
                f"{self.name}: got {self.n.numel()} lengths for a batch of B={B}; give one per "
                f"batch element, shape ({B},)"
            )
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        n = self.n
        if isinstance(n, Tensor):
            n = n.to(kv_idx.device)
            n = n[b] if n.numel() != 1 else n.view(1, 1, 1, 1)  # (B, 1, 1, 1)
        return kv_idx < n  # (B?, 1, 1, S)

    def tensors(self):
        return (self.n,) if isinstance(self.n, Tensor) else ()

    def blocks(self, grid):
        n = self._n(grid.kv_lo)
        return grid.kv_hi < n, grid.kv_lo >= n  # (B or 1, 1, 1, nk)

    def __repr__(self):
        n = self.n if isinstance(self.n, int) else f"tensor{tuple(self.n.shape)}"
        return f"{self.name}({n})"


def _as_lengths(name: str, n) -> int | Tensor:
    if isinstance(n, Tensor):
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.dim() > 1:
            raise ValueError(f"{name}: lengths must be an int or a 1-D integer tensor (B,), "
                             f"got {n.dtype} of shape {tuple(n.shape)}")
        return n.long()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name}: expected an int >= 0 or a (B,) integer tensor, got {n!r}")
    return n


def key_lengths(lengths: int | Tensor) -> MaskMod:
    """Padding by length: in batch element ``b``, keys at index ``>= lengths[b]`` are padding.

    The structured twin of a module's ``key_mask`` (``key_mask[b, j] = j < lengths[b]``).

    Shape:
        lengths: an int, or ``(B,)`` integers.
    """
    return _KeysBefore(_as_lengths("key_lengths", lengths), "key_lengths")


def prefix_lm(prefix: int | Tensor) -> MaskMod:
    """Prefix-LM: every query sees the first ``prefix`` keys (bidirectional prefix), and the
    rest causally (top-left). ``prefix`` may be an int or one length per batch element ``(B,)``.
    """
    mod = or_masks(causal(), _KeysBefore(_as_lengths("prefix_lm", prefix), "prefix_lm"))
    mod.name = f"prefix_lm({prefix if isinstance(prefix, int) else 'tensor'})"
    return mod


class _Document(MaskMod):
    """Attend within the same document id (packed sequences)."""

    def __init__(self, q_ids: Tensor, kv_ids: Tensor) -> None:
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def bind(self, B, H, T, S):
        for name, ids, L in (("ids", self.q_ids, T), ("kv_ids", self.kv_ids, S)):
            if ids.shape[-1] != L or ids.shape[0] not in (1, B):
                raise ValueError(
                    f"document: {name} has shape {tuple(ids.shape)} but the call has B={B} and "
                    f"{'T' if L == T and name == 'ids' else 'S'}={L}; give ({B}, {L}) or (1, {L}) ids"
                )
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        qi, ki = self.q_ids.to(q_idx.device), self.kv_ids.to(q_idx.device)
        bq = b if qi.shape[0] > 1 else b[:1] * 0  # shared ids: batch dim 1
        bk = b if ki.shape[0] > 1 else b[:1] * 0
        return qi[bq, q_idx] == ki[bk, kv_idx]  # (B?, 1, T, S)

    def tensors(self):
        return (self.q_ids,) if self.kv_ids is self.q_ids else (self.q_ids, self.kv_ids)

    @staticmethod
    def _block_range(ids: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Min and max id of each block (the last block padded with its own last id)."""
        L = ids.shape[-1]
        pad = -L % size
        if pad:
            ids = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)  # (B, n*size)
        ids = ids.reshape(ids.shape[0], -1, size)  # (B, n, size)
        return ids.amin(-1), ids.amax(-1)  # (B, n), (B, n)

    def blocks(self, grid):
        q_ids = self.q_ids[:, grid.q_start:grid.q_start + grid.T].to(grid.device)  # (B, T)
        kv_ids = self.kv_ids[:, grid.kv_start:grid.kv_start + grid.S].to(grid.device)  # (B, S)
        qmin, qmax = self._block_range(q_ids, grid.bq)  # (B, nq)
        kmin, kmax = self._block_range(kv_ids, grid.bk)  # (B, nk)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]  # (B, 1, nq, 1)
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]  # (B, 1, 1, nk)
        empty = (qmax < kmin) | (qmin > kmax)
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        return full, empty

    def __repr__(self):
        return f"document(ids{tuple(self.q_ids.shape)})"


def document(ids: Tensor, kv_ids: Tensor | None = None) -> MaskMod:
    """Packed sequences: query ``i`` may attend to key ``j`` iff both carry the same id.

    Documents need not be contiguous or sorted; when each id is one contiguous run (the usual
    packing) whole blocks between documents are skipped. ``kv_ids`` defaults to ``ids``
    (self-attention); give it for cross-attention.

    Shape:
        ids ``(B, T)`` or ``(T,)`` (shared by the batch); kv_ids ``(B, S)`` or ``(S,)``.
    """
    def check(name, t):
        if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dim() not in (1, 2):
            raise ValueError(f"document: {name} must be an integer tensor (B, T) or (T,), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        return (t if t.dim() == 2 else t[None]).long()
    ids = check("ids", ids)
    return _Document(ids, ids if kv_ids is None else check("kv_ids", kv_ids))


class _Combined(MaskMod):
    """and_masks / or_masks."""

    def __init__(self, mods: tuple, op: str, name: str | None = None) -> None:
        self.mods, self.op, self.name = mods, op, name

    def bind(self, B, H, T, S):
        return _Combined(tuple(m.bind(B, H, T, S) for m in self.mods), self.op, self.name)

    def __call__(self, b, h, q_idx, kv_idx):
        parts = [evaluate_mask(m, b, h, q_idx, kv_idx) for m in self.mods]
        out = parts[0]
        for p in parts[1:]:
            out = (out & p) if self.op == "and" else (out | p)
        return out

    def tensors(self):
        return _unique(t for m in self.mods for t in m.tensors())

    def blocks(self, grid):
        fulls, empties = zip(*(m.blocks(grid) for m in self.mods))
        full, empty = fulls[0], empties[0]
        for f, e in zip(fulls[1:], empties[1:]):
            if self.op == "and":  # full when all are; empty when any is
                full, empty = full & f, empty | e
            else:  # full when any is; empty when all are
                full, empty = full | f, empty & e
        return full, empty

    def __repr__(self):
        if self.name:
            return self.name
        return f"{self.op}_masks({', '.join(map(repr, self.mods))})"


class _Function(MaskMod):
    """A plain function used as a mask_mod, evaluated per element (FlexAttention's semantics);
    its blocks are found by evaluation."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, b, h, q_idx, kv_idx):
        return per_element(self.fn, None, b, h, q_idx, kv_idx)

    def tensors(self):
        return _captured_tensors(self.fn)

    def __repr__(self):
        return getattr(self.fn, "__name__", repr(self.fn))


def as_mask_mod(mask_mod) -> MaskMod:
    """A MaskMod for ``mask_mod`` (wrapping a plain function); TypeError if not callable."""
    return _wrap("mask_mod", mask_mod, MaskMod, _Function,
                 "(b, h, q_idx, kv_idx) -> bool tensor or a qkv.masks mask")


def _wrap(name: str, obj, kind: type, wrapper: type, signature: str):
    """``obj`` if it already is a ``kind``, else a callable wrapped in ``wrapper``."""
    if isinstance(obj, kind):
        return obj
    if not callable(obj):
        raise TypeError(f"{name} must be a function {signature}, got {type(obj).__name__}")
    return wrapper(obj)


def and_masks(*mask_mods) -> MaskMod:
    """A key may be attended iff every mask allows it."""
    if not mask_mods:
        raise ValueError("and_masks needs at least one mask_mod")
    return _Combined(tuple(as_mask_mod(m) for m in mask_mods), "and")


def or_masks(*mask_mods) -> MaskMod:
    """A key may be attended iff any mask allows it."""
    if not mask_mods:
        raise ValueError("or_masks needs at least one mask_mod")
    return _Combined(tuple(as_mask_mod(m) for m in mask_mods), "or")


def evaluate_mask(mask_mod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod(b, h, q_idx, kv_idx)``, checked to be a bool tensor of the right shape.

    Shape:
        -> broadcastable to the broadcast of the four index shapes.
    """
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"mask_mod {mask_mod!r} returned {got}; it must return a bool tensor "
            f"(True = may attend), e.g. `return q_idx >= kv_idx`"
        )
    full = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    if out.dim() > 4 or out.shape[-2:] != full[-2:] and _broadcast_fails(out.shape, full):
        raise ValueError(
            f"mask_mod {mask_mod!r} returned shape {tuple(out.shape)} for indices of shape "
            f"{tuple(full)}; compute it from the index tensors so it broadcasts like them"
        )
    return out


def _broadcast_fails(shape, full) -> bool:
    try:
        return torch.broadcast_shapes(shape, full) != full
    except RuntimeError:
        return True


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
            tiles[..., -1, grid.bk - pad:] = True
        fulls.append(tiles.all(-1).all(-2))
        empties.append(~any_)
    return torch.stack(fulls, dim=-2), torch.stack(empties, dim=-2)  # (B?, H?, nq, nk)


# --- score mods ------------------------------------------------------------------------------

class _Alibi(ScoreMod):
    """ALiBi (Press et al. 2022): ``score + slopes[h] * (kv_idx - q_idx)``."""

    additive = True

    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes

    def bind(self, B, H, T, S):
        if self.slopes.shape[0] not in (1, H):
            raise ValueError(
                f"alibi: got {self.slopes.shape[0]} slopes for H={H} heads; give one per query "
                f"head, e.g. qkv.masks.alibi_slopes({H})"
            )
        return self

    def __call__(self, score, b, h, q_idx, kv_idx):
        dtype = torch.promote_types(score.dtype, self.slopes.dtype)  # float64 stays exact
        slopes = self.slopes.to(score.device, dtype)
        slope = slopes[h] if slopes.shape[0] > 1 else slopes.view(1, 1, 1, 1)  # (1, H, 1, 1)
        bias = (kv_idx - q_idx).to(dtype) * slope  # (1, H, T, S)
        return score + bias.to(score.dtype)

    def tensors(self):
        return (self.slopes,)

    def __repr__(self):
        return f"alibi(slopes{tuple(self.slopes.shape)})"


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes: the geometric sequence ``2^(-8/n * i)``, i = 1..n, for ``n`` a power
    of two, and the paper's interleaving of the next power of two otherwise.

    Shape:
        ``(num_heads,)``, float32.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be an int >= 1, got {num_heads!r}")

    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    p = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(p)
    if p < num_heads:
        slopes += power_of_two(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes)


def alibi(slopes: Tensor | int) -> ScoreMod:
    """ALiBi's linear bias: ``score + slopes[h] * (kv_idx - q_idx)`` (use with a causal mask,
    where it penalises distant past keys). ``alibi(H)`` uses :func:`alibi_slopes` ``(H)``.

    Shape:
        slopes ``(H,)`` (or ``(1,)``, shared by all heads).
    """
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        slopes = alibi_slopes(slopes)
    if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise ValueError(f"alibi: slopes must be a 1-D float tensor (H,) or an int H, got {slopes!r}")
    return _Alibi(slopes)


class _Softcap(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2's logit softcapping)."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def __repr__(self):
        return f"softcap({self.cap})"


def softcap(cap: float) -> ScoreMod:
    """Soft capping: ``cap * tanh(score / cap)`` keeps every score within ``(-cap, cap)``."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    return _Softcap(float(cap))


class _ScoreFunction(ScoreMod):
    """A plain function used as a score_mod, evaluated per element (FlexAttention's semantics)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, score, b, h, q_idx, kv_idx):
        return per_element(self.fn, score, b, h, q_idx, kv_idx)

    def tensors(self):
        """Tensors the function can read: closure cells, defaults, the globals it names, the
        parameters and buffers of a module it is bound to, a partial's arguments, and what
        containers and the functions and score mods it captures hold."""
        return _captured_tensors(self.fn)

    def __repr__(self):
        return getattr(self.fn, "__name__", repr(self.fn))


def per_element(fn, score: Tensor | None, b: Tensor, h: Tensor, q_idx: Tensor,
                kv_idx: Tensor) -> Tensor:
    """``fn`` evaluated at every (b, h, q_idx, kv_idx) as if on scalars, as FlexAttention does.

    A plain function sees 0-d index tensors (and a 0-d score), so ``bias[b][q_idx]`` or
    ``ids[b, q_idx] == ids[b, kv_idx]`` mean what they say. It runs as one vectorised call
    (``torch.vmap``), one vmap level per index dim when each index varies along its own dim
    only (the index grids qkv builds), else over the flattened broadcast of the indices.

    Shape:
        b, h, q_idx, kv_idx broadcastable to ``(B, H, T, S)``; score that shape or
        broadcastable to it -> ``(B, H, T, S)``.
    """
    idx = (b, h, q_idx, kv_idx)
    args = idx if score is None else (score,) + idx
    shape = torch.broadcast_shapes(*(t.shape for t in args))
    if 0 in shape:  # nothing to evaluate (vmap cannot map over an empty dim)
        return torch.empty(shape, dtype=torch.bool if score is None else score.dtype, device=b.device)
    if len(shape) == 4 and all(_varies_only_along(t, d) for d, t in enumerate(idx)):
        vecs = [t.reshape(-1) for t in idx]  # (B,), (H,), (T,), (S,) or size 1
        f = fn
        for d in (3, 2, 1, 0):  # innermost vmap maps over kv_idx
            dims = tuple(0 if i == d else None for i in range(4))
            f = torch.vmap(f, in_dims=dims if score is None else (0,) + dims)
        if score is None:
            out = f(*vecs)
        else:
            out = f(score.expand(tuple(v.numel() for v in vecs)), *vecs)
        _check_per_element(fn, out, 4)
        if score is None:  # dims the mask does not depend on come back expanded: keep them 1
            return out[tuple(slice(0, 1) if st == 0 else slice(None) for st in out.stride())]
        return out.expand(shape) if out.shape != shape else out
    flat = [t.expand(shape).reshape(-1) for t in args]  # (N,) each
    out = torch.vmap(fn)(*flat)
    _check_per_element(fn, out, 1)
    return out.reshape(shape)


def _check_per_element(fn, out, mapped: int) -> None:
    """A function evaluated per element must give one value per element."""
    if isinstance(out, Tensor) and out.dim() > mapped:
        raise ValueError(
            f"{getattr(fn, '__name__', repr(fn))} returned shape {tuple(out.shape[mapped:])} for a "
            f"single (b, h, q_idx, kv_idx); mask_mod and score_mod are evaluated per element "
            f"(as in FlexAttention) and must return one value, e.g. `return q_idx >= kv_idx`"
        )


def _varies_only_along(t: Tensor, dim: int) -> bool:
    return t.dim() == 4 and all(n == 1 for i, n in enumerate(t.shape) if i != dim)


def score_mod_gradient_inputs(score_mod: ScoreMod, *, dtype: torch.dtype,
                              device: torch.device) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` reads, for a backend that computes their
    gradients itself; ValueError when it reads one that cannot be found.

    The tensors come from :meth:`ScoreMod.tensors`. To be sure none is missed, the score_mod
    is run once on a 1 x 1 x 1 x 1 probe and its autograd graph walked: every leaf tensor
    requiring grad that the score depends on must be one of them, or lie behind one.
    """
    found = tuple(t for t in score_mod.tensors() if t.requires_grad)
    if not torch.is_grad_enabled():
        return found
    probe = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device, requires_grad=True)
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    out = evaluate_score(score_mod, probe, zero, zero, zero, zero)
    stops = {id(t.grad_fn) for t in found if t.grad_fn is not None}
    known = {id(t) for t in found if t.grad_fn is None}
    missed = _leaves_needing_grad(out.grad_fn, stops, known | {id(probe)})
    if missed:
        shapes = ", ".join(f"{tuple(t.shape)}" for t in missed)
        raise ValueError(
            f"score_mod {score_mod!r} reads tensors that require grad ({shapes}) where qkv "
            f"cannot find them to give them their gradient (it looks in closures, defaults, "
            f"globals, bound modules, functools.partial arguments and containers). Capture the "
            f"tensor in the function's closure or defaults, or use backend='reference'"
        )
    return found


def _leaves_needing_grad(node, stops: set[int], known: set[int]) -> list[Tensor]:
    """Leaf tensors requiring grad behind autograd ``node``, not behind a node in ``stops``
    and not in ``known`` (ids)."""
    missed, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen or id(n) in stops:
            continue
        seen.add(id(n))
        var = getattr(n, "variable", None)  # AccumulateGrad: a leaf tensor
        if var is not None and id(var) not in known:
            missed.append(var)
        todo.extend(nxt for nxt, _ in n.next_functions)
    return missed


def _captured_tensors(obj, depth: int = 4) -> tuple[Tensor, ...]:
    """Tensors reachable from a function: see :meth:`_ScoreFunction.tensors`."""
    if isinstance(obj, Tensor):
        return (obj,)
    if isinstance(obj, (ScoreMod, MaskMod)) and not isinstance(obj, (_ScoreFunction, _Function)):
        return obj.tensors()
    if depth == 0 or isinstance(obj, (type, types.ModuleType, str, bytes)):
        return ()
    found: list[Tensor] = []
    for child in _children(getattr(obj, "fn", obj) if isinstance(obj, (_ScoreFunction, _Function)) else obj):
        found += _captured_tensors(child, depth - 1)
    return _unique(found)


def _children(obj) -> list:
    """What a function or object holds that may be or lead to a tensor."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _cell_filled(c)]
        named = [obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
        return cells + named + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
    if hasattr(obj, "__dict__"):  # another object: its attributes
        return list(vars(obj).values())
    return []


def _names(code: types.CodeType) -> list[str]:
    """Global names a code object (and the functions and lambdas defined in it) reads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return names


def _unique(tensors) -> tuple[Tensor, ...]:
    """Tensors without repeats (by identity), in first-seen order."""
    return tuple({id(t): t for t in tensors}.values())


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def as_score_mod(score_mod) -> ScoreMod:
    """A ScoreMod for ``score_mod`` (wrapping a plain function); TypeError if not callable."""
    return _wrap("score_mod", score_mod, ScoreMod, _ScoreFunction,
                 "(score, b, h, q_idx, kv_idx) -> score or a qkv.masks score mod")


def evaluate_score(score_mod, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor,
                   kv_idx: Tensor) -> Tensor:
    """``score_mod(score, ...)``, checked to keep the scores' shape.

    Shape:
        score ``(B, H, T, S)`` (or a tile) -> the same.
    """
    out = score_mod(score, b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(f"score_mod {score_mod!r} must return a float tensor, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != score.shape:
        if _broadcast_fails(out.shape, score.shape):
            raise ValueError(f"score_mod {score_mod!r} returned shape {tuple(out.shape)} for scores "
                             f"of shape {tuple(score.shape)}")
        out = out.expand(score.shape)
    return out


# --- a piece of a larger call ----------------------------------------------------------------

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
        return self.inner.blocks(dataclasses.replace(
            grid, q_start=grid.q_start + self.q_start, kv_start=grid.kv_start + self.kv_start))

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
    if method is _Combined.blocks:
        return all(_blocks_take_offsets(m) for m in mask_mod.mods)
    if method is _Offset.blocks:
        return _blocks_take_offsets(mask_mod.inner)
    return method in (_Window.blocks, _KeysBefore.blocks, _Document.blocks)


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
    if kind is _Offset:
        inner = structure_key(mod.inner)
        return None if inner is None else ("offset", inner, mod.q_start, mod.kv_start)
    if kind is _Combined:
        parts = tuple(structure_key(m) for m in mod.mods)
        return None if None in parts else (mod.op, parts)
    return None


def _content_key(t: Tensor) -> tuple:
    """dtype, shape, device and a 128-bit digest of ``t``'s values."""
    flat = t.detach().reshape(-1).to("cpu").contiguous()
    data = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return (str(t.dtype), tuple(t.shape), str(t.device), digest)


# --- inspection ------------------------------------------------------------------------------

def to_dense(mask_mod, B: int, H: int, T: int, S: int, *, device=None) -> Tensor:
    """The bool mask ``mask_mod`` stands for, as a tensor (True = may attend).

    Dims the mask does not depend on stay 1 (``sliding_window`` gives ``(1, 1, T, S)``,
    ``document`` ``(B, 1, T, S)``). Pass the result as ``attn_mask`` to any backend for the
    same result as ``mask_mod=`` (that is its dense twin).

    Shape:
        -> broadcastable to ``(B, H, T, S)``, bool.
    """
    mod = as_mask_mod(mask_mod).bind(B, H, T, S)
    b, h, q, kv = index_grid(B, H, T, S, device=device)
    out = evaluate_mask(mod, b, h, q, kv)
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))


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
        return {k: int((n == v).sum()) for k, v in (("full", FULL), ("partial", PARTIAL), ("empty", EMPTY))}

    @property
    def density(self) -> float:
        """The share of blocks that must be computed (full or partial)."""
        c = self.counts()
        return (c["full"] + c["partial"]) / max(1, sum(c.values()))

    def __str__(self) -> str:
        g = self.grid
        c = self.counts()
        lines = [
            f"{self.mask}: T={g.T}, S={g.S}, blocks {g.bq}x{g.bk} -> {g.nq}x{g.nk}; full "
            f"{c['full']}, partial {c['partial']}, empty {c['empty']} (computed {self.density:.1%})"
        ]
        glyph = {EMPTY: ".", PARTIAL: "+", FULL: "#"}
        for b in range(self.state.shape[0]):
            for h in range(self.state.shape[1]):
                if self.state.shape[0] * self.state.shape[1] > 1:
                    lines.append(f"b={b if self.state.shape[0] > 1 else '*'} "
                                 f"h={h if self.state.shape[1] > 1 else '*'}")
                rows = self.state[b, h].tolist()
                shown = rows[:64]
                lines += ["".join(glyph[v] for v in r[:128]) + (" ..." if len(r) > 128 else "")
                          for r in shown]
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


def block_summary(mask_mod, B: int, H: int, T: int, S: int, *, block: int | tuple[int, int] = 128,
                  device=None) -> BlockSummary:
    """Summarise ``mask_mod`` block by block: what the tiled backend skips and what it masks.

    Example:
        >>> print(qkv.masks.block_summary(qkv.masks.sliding_window(2), 1, 1, 8, 8, block=2))
        sliding_window(2, 0, align='top_left'): T=8, S=8, blocks 2x2 -> 4x4; full 0, partial 7, ...

    Shape:
        state ``(B or 1, H or 1, ceil(T / bq), ceil(S / bk))``.
    """
    bq, bk = (block, block) if isinstance(block, int) else block
    if min(bq, bk) < 1:
        raise ValueError(f"block sizes must be >= 1, got {block!r}")
    mod = as_mask_mod(mask_mod).bind(B, H, T, S)
    grid = Grid(B, H, T, S, bq, bk, torch.device(device or "cpu"))
    return BlockSummary(block_states(mod, grid).cpu(), grid, repr(mod))
