"""Batches whose elements attend different keys, cut into pieces for the tiled backend
(``backend.py``): a padded batch (key lengths, a bool key mask per element) and packed rows
with documents of their own (``document(ids)`` with ids per batch element).

One plan (``plan.py``) shares its units across the batch: every chunk that some element's
padding or document boundary cuts is masked for all elements, every block some element needs
is visited by all, and a window with padding is no longer shift-invariant (it loses its
diagonal groups). Cut into runs of consecutive elements that attend the same keys, each run
is planned on its own keys alone: its windows are windows again (rebased on the first key),
its documents are the runs' own (tall tiles, causal units), and no padding needs a mask.

A batch is cut only where the scores its pieces leave out are worth more than the pieces'
own calls (``PIECE_SCORES``). The layout (each element's keys and documents) is read on the
host once per tensor, remembered by the tensors' identity and version
(``qkv._identity``), so a model's next layer reads nothing.

Shape alphabet: B batch, H query heads, T query length, S key length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._identity import IdentityCache
from ...masks import (
    MaskMod,
    _Alibi,
    _Combined,
    _Document,
    _KeysBefore,
    _Window,
    and_masks,
    offset_score,
)
from ..call import AttentionCall
from .plan import PLAN_CACHE_SIZE, _inner, _Plan, _plan_for
from .plan import clear_plan_cache as _clear_plans

__all__ = ["PIECE_SCORES", "batch_pieces", "clear_plan_cache"]


@dataclass
class _Piece:
    """Consecutive batch elements (``index`` into the 4-D view's B) that attend the same
    keys ``[k0, k1)`` (the rest padding) within the same documents, and the plan of their
    attention on those keys alone (``k1 == k0 + 1`` with a mask that allows none where
    they have no key)."""

    index: slice
    k0: int
    k1: int
    plan: _Plan


# What a piece costs beside its scores (its kernel calls, its slices, the join), counted in
# scores (query-key pairs x heads): on the Zen 4 (2 threads, float32) a piece cost 90-180 µs
# more than its work, and torch's flash kernel computes ~0.5 G scores a second. Cut into
# 8-32 pieces of T=64-128 rows, batches took 1.2-1.6x the shared plan's time; cut where each
# piece saves more than this, 0.6-0.95x.
PIECE_SCORES = 1 << 16


def batch_pieces(
    call: AttentionCall, B: int, H: int, inner: str | None, bq: int, bk: int, dtype: torch.dtype
) -> list[_Piece] | None:
    """The pieces of a batch whose elements attend different keys, or None to plan it whole.

    Taken: a mask made of key padding (``key_lengths``, a bool ``attn_mask`` of one range of
    keys per element ``(B, 1, 1, S)``, padded right or left), windows (causal,
    sliding_window, any alignment), at most one ``document`` (ids shared or per element),
    and ALiBi or no score_mod; where the elements' keys or documents differ and cutting pays
    (:func:`_worth_cutting`). Padded float32 batches at B=4, T=2048 (keys 2048/1500/900/300)
    took 1.54x compiled Flex's time whole and 0.77x cut (causal), 1.28x and 0.75x (a
    window of 256), Zen 4, 2 threads."""
    mask, score_mod = call.attn_mask, call.score_mod
    if B == 1:
        return None
    if (mask is not None and mask.dtype != torch.bool) or (
        score_mod is not None and type(score_mod) is not _Alibi
    ):
        return None
    parts = _and_parts(call.mask_mod)
    if parts is None:
        return None
    windows = [m for m in parts if type(m) is _Window]
    lengths = [m for m in parts if type(m) is _KeysBefore]
    docs = [m for m in parts if type(m) is _Document]
    if len(windows) + len(lengths) + len(docs) != len(parts) or len(docs) > 1:
        return None
    doc = docs[0] if docs else None
    per_element = doc is not None and max(doc.q_ids.shape[0], doc.kv_ids.shape[0]) > 1
    if call.is_causal:
        windows.append(_Window(None, 0, "top_left", "causal", 0))  # causal(), bound
    dense = None if mask is None else call.mask_4d(mask)  # (B?, H?, T?, S?)
    if dense is not None and (dense.shape[1] != 1 or dense.shape[2] != 1):
        return None  # a mask per head or per query row: not padding
    if not lengths and dense is None and not per_element:
        return None  # every element attends the same keys
    tensors = tuple(m.n for m in lengths if isinstance(m.n, Tensor))
    tensors += () if dense is None else (dense,)
    tensors += () if doc is None or not per_element else _doc_tensors(doc)
    ints = tuple(m.n for m in lengths if not isinstance(m.n, Tensor))
    layout = _layouts.get(
        tensors,
        (B, call.T, call.S, per_element, ints),
        lambda: _layout(lengths, dense, doc if per_element else None, B, call.T, call.S),
    )
    if layout is None or len(layout.runs) == 1 or not _worth_cutting(layout, windows, H):
        return None
    best = _inner(call, inner, dtype)
    pieces = []
    for b0, b1, first, end in layout.runs:
        empty = first == end
        k0, k1 = (0, 1) if empty else (first, end)  # no key: one that none may attend
        mods: list[MaskMod] = [
            _Window(w.left, w.right, w.align, w.name, w._off() - k0) for w in windows
        ]
        if doc is not None:
            mods.append(_doc_piece(doc, b0, k0, k1, call.S))
        if empty:  # (rows of 0, lse -inf)
            mods = [_KeysBefore(0, "key_lengths")]
        piece_mask = None if not mods else mods[0] if len(mods) == 1 else and_masks(*mods)
        piece_score = None if score_mod is None else offset_score(score_mod, 0, k0)
        plan = _plan_for(
            b1 - b0,
            H,
            call.T,
            k1 - k0,
            call.scale,
            piece_mask,
            piece_score,
            best,
            call.device,
            True,
            bq,
            bk,
        )
        pieces.append(_Piece(slice(b0, b1), k0, k1, plan))
    return pieces


def clear_plan_cache() -> None:
    """Forget every remembered block plan and batch layout (they are rebuilt on the next
    call)."""
    _clear_plans()
    _layouts.clear()


@dataclass
class _Layout:
    """Which keys each element of a batch attends, read once from the mask's tensors.

    ``runs``: ``(b0, b1, k0, k1)``, consecutive elements with the same keys ``[k0, k1)``
    (``k0 == k1``: none) and the same documents. ``lo``, ``hi``: each row's first and last
    key from the padding and documents (``lo > hi``: none), for :func:`_worth_cutting`.
    ``worth``: its answers, by windows, heads and cost.

    Shape: lo, hi ``(B, T)`` int64 on the CPU.
    """

    runs: list[tuple[int, int, int, int]]
    lo: Tensor
    hi: Tensor
    worth: dict = field(default_factory=dict)


def _layout(
    lengths: list[_KeysBefore], dense: Tensor | None, doc: _Document | None, B: int, T: int, S: int
) -> _Layout | None:
    """The batch's :class:`_Layout` (None when some element's keys are not consecutive):
    reads the key lengths, the key mask and per-element document ids on the host."""
    cpu = torch.device("cpu")  # (host bookkeeping: never the default device)
    k0, k1 = torch.zeros(B, dtype=torch.long, device=cpu), torch.full((B,), S, device=cpu)
    for m in lengths:
        n = torch.as_tensor(m.n, device=cpu).reshape(-1).long()
        k1 = torch.minimum(k1, n.expand(B))
    if dense is not None:
        rows = dense[:, 0, 0, :].expand(B, S).to("cpu")  # (B, S)
        count = rows.sum(-1)
        first = rows.to(torch.int8).argmax(-1)
        last = S - 1 - rows.flip(-1).to(torch.int8).argmax(-1)
        if not ((count == last - first + 1) | (count == 0)).all():
            return None  # holes in some element's keys: not padding
        k0 = torch.where(count > 0, torch.maximum(k0, first), S)
        k1 = torch.where(count > 0, torch.minimum(k1, last + 1), 0)
    some = k1 > k0  # (B,): elements with a key; the others get k0 == k1 == 0
    k0, k1 = torch.where(some, k0, 0), torch.where(some, k1, 0)
    lo = k0[:, None].expand(B, T).clone()  # (B, T): each row's keys, from the padding
    hi = (k1 - 1)[:, None].expand(B, T).clone()
    same = torch.ones(B, dtype=torch.bool, device=cpu)  # element b attends the documents of b - 1
    if doc is not None:
        q_ids = doc.q_ids.expand(B, T).to("cpu")
        kv_ids = doc.kv_ids.expand(B, S).to("cpu")
        d_lo, d_hi = _document_spans(q_ids, kv_ids)  # (B, T) each
        lo, hi = torch.maximum(lo, d_lo), torch.minimum(hi, d_hi)
        same[1:] = (q_ids[1:] == q_ids[:-1]).all(-1) & (kv_ids[1:] == kv_ids[:-1]).all(-1)
    runs: list[tuple[int, int, int, int]] = []
    for b, (a, e, s) in enumerate(zip(k0.tolist(), k1.tolist(), same.tolist())):
        if runs and s and runs[-1][2:] == (a, e):
            runs[-1] = (runs[-1][0], b + 1, a, e)
        else:
            runs.append((b, b + 1, a, e))
    return _Layout(runs, lo, hi)


def _document_spans(q_ids: Tensor, kv_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each query, the first and last key of its document (``lo > hi`` where its id has
    no key): the keys between, for a document that is one run of positions.

    Shape: q_ids ``(B, T)``, kv_ids ``(B, S)`` -> lo, hi ``(B, T)``."""
    B, S = kv_ids.shape
    both = torch.cat([q_ids, kv_ids], 1)  # (B, T + S)
    _, idx = both.unique(return_inverse=True)  # ids as 0..n-1
    n = int(idx.max()) + 1
    q_idx, kv_idx = idx[:, : q_ids.shape[1]], idx[:, q_ids.shape[1] :]
    pos = torch.arange(S, device="cpu").expand(B, S)
    first = torch.full((B, n), S, device="cpu").scatter_reduce(1, kv_idx, pos, "amin")
    last = torch.full((B, n), -1, device="cpu").scatter_reduce(1, kv_idx, pos, "amax")
    return first.gather(1, q_idx), last.gather(1, q_idx)


def _worth_cutting(layout: _Layout, windows: list[_Window], H: int) -> bool:
    """Whether cutting saves more scores than its pieces cost (``PIECE_SCORES`` each). Whole,
    each row visits for every element the span of keys some element attends (within the
    windows); cut, each element its own."""
    shape = tuple((w.left, w.right, w._off()) for w in windows)
    key = (shape, H, PIECE_SCORES)
    if key not in layout.worth:
        lo, hi = layout.lo, layout.hi  # (B, T)
        q = torch.arange(lo.shape[1], device="cpu")
        for left, right, off in shape:
            if left is not None:
                lo = torch.maximum(lo, q + off - left)
            if right is not None:
                hi = torch.minimum(hi, q + off + right)
        some = hi >= lo  # (B, T): rows with a key
        own = int((hi - lo + 1).clamp(min=0).sum())
        first = torch.where(some, lo, hi.shape[1] + 2**40).amin(0)  # (T,) over the batch
        last = torch.where(some, hi, -1).amax(0)
        whole = int((last - first + 1).clamp(min=0).sum())
        saved = H * (lo.shape[0] * whole - own)
        layout.worth[key] = saved > PIECE_SCORES * len(layout.runs)
    return layout.worth[key]


def _doc_tensors(doc: _Document) -> tuple[Tensor, ...]:
    return (doc.q_ids,) if doc.kv_ids is doc.q_ids else (doc.q_ids, doc.kv_ids)


def _doc_piece(doc: _Document, b0: int, k0: int, k1: int, S: int) -> _Document:
    """``doc`` for the elements from ``b0`` on (one element's ids: a run's are the same) on
    keys ``[k0, k1)``; self-attention's ids stay one tensor where the keys are all of them
    (causal documents are then one kernel call each: ``plan._causal_documents``)."""
    q = doc.q_ids[b0 : b0 + 1] if doc.q_ids.shape[0] > 1 else doc.q_ids  # (1, T)
    if doc.kv_ids is doc.q_ids and (k0, k1) == (0, S):
        return _Document(q, q)
    kv = doc.kv_ids[b0 : b0 + 1] if doc.kv_ids.shape[0] > 1 else doc.kv_ids
    return _Document(q, kv[:, k0:k1])


def _and_parts(mod: MaskMod | None) -> list[MaskMod] | None:
    """The masks that ``mod`` is the ``and_masks`` of (nested ones flattened), or ``[mod]``."""
    if mod is None:
        return []
    if type(mod) is not _Combined:
        return [mod]
    if mod.op != "and":
        return None
    parts: list[MaskMod] = []
    for m in mod.mods:
        inner = _and_parts(m)
        if inner is None:
            return None
        parts += inner
    return parts


# Layouts of batches, by the identity of the tensors they were read from (lengths, a bool key
# mask, document ids): a model passes the same ones to every layer, read on the host once.
_layouts = IdentityCache(PLAN_CACHE_SIZE)
