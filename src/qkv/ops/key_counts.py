"""How many keys each query row may attend, and how many of them are marked: tensor ops only.

``ops/nonfinite.py`` needs, for every query row of a call, whether the row may attend any key
and whether it may attend a key that holds NaN/inf; eagerly and under tracing alike, without
reading a value on the host (each read is a device sync on CUDA). Three ways, by the masks:

* **ranges**: causal, sliding windows and key lengths (and ``and_masks`` of them, and
  ``or_masks`` of those that start at key 0, as ``prefix_lm``) let row ``i`` attend the keys
  ``[lo_i, hi_i)``; counts are differences of one cumulative sum over the
  keys: O(T + S).
* **documents** (``and`` ranges): the keys sorted by id, once per ids tensor (remembered by
  identity, ``qkv._identity``), hold a row's keys of its own id within its range
  consecutively: one cumulative sum in that order and two binary searches a row,
  O((T + S) log S).
* **anything else** (a dense ``attn_mask``, other ``or_masks``, plain functions): the allowed
  pairs as a 0/1 matrix times the keys' 0/1 columns, a block of rows at a time: O(T S). The
  matrix of an ``attn_mask`` alone is remembered by the mask's identity.

Shape alphabet: B batch, H heads, T query length, S key length (``(B, H) = call.BH``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._identity import IdentityCache
from ..masks import _Combined, _Document, _KeysBefore, _Window, evaluate_mask, index_grid
from .call import AttentionCall
from .plan_cache import PlanCache

__all__ = [
    "and_parts",
    "causal_ranges",
    "counts",
    "covers_every_key",
    "document_ranges",
    "is_window",
    "key_counts",
    "ranges",
    "sees_own_position",
]

# 0/1 matrices of dense masks and the sorted keys of document ids, by the tensors' identity: a
# model passes one mask to every layer and step
_matrices = IdentityCache(8)
_sorted_ids = IdentityCache(16)

# a block of the generic count holds at most this many (row, key) pairs: a memory bound (the
# 0/1 float32 matrix of a block is 64 MiB, and a remembered mask's matrix at most that), not
# a speed choice, so it is not measured per machine (issue 38): the count is one GEMM per
# block, whose cost per pair does not depend on the block once it is this large
_BLOCK_PAIRS = 1 << 24


def counts(call: AttentionCall, marked: Tensor) -> tuple[Tensor, Tensor]:
    """Per query row, how many of the marked keys it may attend, and how many keys it may
    attend (the latter from the masks alone: remembered with them where they are).

    Shape:
        marked ``(B, H, S)`` float32 of 0 and 1 -> ``(B, H, T)`` float32 counts (exact up
        to 2^24 keys; only ``> 0`` is meant), and counts broadcastable to ``(B, H, T)``.
    """
    ranges = _ranges(call)
    if ranges is None:
        count = getattr(call.mask_mod, "key_counts", None)
        if call.attn_mask is None and not call.is_causal and count is not None:
            hits, keys = count(marked)  # a mask that counts its own windows (a
            # neighborhood: box sums in O(N), no (T, S) evaluation)
            return hits, keys.to(torch.float32)
        return _by_matrix(call, marked)
    lo, hi, doc = ranges
    if doc is not None:
        return _by_document(call, marked, lo, hi, doc)
    B, H = call.BH
    cum = _cumulative(marked)  # (B, H, S + 1)
    hi = torch.maximum(hi, lo)  # (B?, 1, T): an empty range is [lo, lo)
    hits = cum.gather(-1, hi.expand(B, H, call.T)) - cum.gather(-1, lo.expand(B, H, call.T))
    return hits, hi - lo


def key_counts(call: AttentionCall, marked: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`counts` of a bool ``marked`` ``(B, H, S)``, both as ``(B, H, T)``."""
    hits, keys = counts(call, marked.float())
    return hits, keys.expand(hits.shape)


def covers_every_key(call: AttentionCall) -> bool:
    """Whether every query row may attend every key: no mask at all, or only windows (causal
    included) and integer lengths that leave every key to every row. Told from the sizes and
    the masks' integers alone."""
    if call.attn_mask is not None:
        return False
    if not call.is_causal and call.mask_mod is None:
        return True  # no mask at all
    mods = _flat_and([_causal()] if call.is_causal else [])
    if call.mask_mod is not None:
        mods = _flat_and([call.mask_mod] + mods)
    T, S = call.T, call.S
    for mod in mods:
        if _is_window(mod):
            off = mod._off()
            if mod.left is not None and T - 1 + off - mod.left > 0:
                return False  # the last row cannot see key 0
            if mod.right is not None and off + mod.right < S - 1:
                return False  # the first row cannot see key S - 1
        elif type(mod) is _KeysBefore and isinstance(mod.n, int):
            if mod.n < S:
                return False
        else:
            return False
    return True


def sees_own_position(call: AttentionCall) -> bool:
    """Whether every query row ``i`` may attend key ``i`` (so every row has a key): causal,
    windows of offset 0, integer lengths of at least T and self-attention documents, and
    ``and_masks`` of them, with T <= S. Told from the sizes and the masks alone."""
    if call.attn_mask is not None or call.T > call.S:
        return False
    mods = _flat_and([call.mask_mod] if call.mask_mod is not None else [])
    for mod in mods:
        if _is_window(mod):
            if mod._off() != 0 or (mod.left is not None and mod.left < 0):
                return False
            if mod.right is not None and mod.right < 0:
                return False
        elif type(mod) is _KeysBefore:
            if not isinstance(mod.n, int) or mod.n < call.T:
                return False
        elif type(mod) is not _Document or mod.kv_ids is not mod.q_ids:
            return False
    return True


# --- ranges ---------------------------------------------------------------------------------


def _causal() -> _Window:
    return _Window(None, 0, "top_left", "causal", 0)


def is_window(mod) -> bool:
    """Whether ``mod`` is one sliding window or causal mask (:func:`_is_window`)."""
    return _is_window(mod)


def _is_window(mod) -> bool:
    """A ``_Window``, or a subclass that changes neither what it allows nor its offset."""
    kind = type(mod)
    return (
        isinstance(mod, _Window) and kind.__call__ is _Window.__call__ and kind._off is _Window._off
    )


def and_parts(mod) -> list:
    """The masks that must all allow a pair for ``mod`` to: ``and_masks`` opened up."""
    return _flat_and([mod])


def _flat_and(mods: list) -> list:
    """The masks that must all allow a pair: ``and_masks`` opened up, recursively."""
    out = []
    for mod in mods:
        if type(mod) is _Combined and mod.op == "and":
            out.extend(_flat_and(list(mod.mods)))
        else:
            out.append(mod)
    return out


def _ranges(call: AttentionCall, attn_mask: bool = True):
    """``(lo, hi, doc)``: row ``i`` may attend keys ``[lo_i, hi_i)`` (of its own document
    when ``doc`` is a document mask); None when the masks are not of that form. The ranges of
    windows and integer lengths are made once per (masks, T, S, device) and remembered.
    ``attn_mask=False``: the ranges of the other masks, the caller taking the tensor itself.

    Shape:
        lo, hi ``(B?, 1, T)`` int64, clamped to ``[0, S]``.
    """
    if attn_mask and call.attn_mask is not None:
        return None
    mods = _flat_and([call.mask_mod] if call.mask_mod is not None else [])
    if call.is_causal:
        mods.append(_causal())
    static: list[tuple] = []  # windows and integer lengths: ranges made once
    lengths: list[Tensor] = []  # lengths per batch element
    unions: list[tuple[tuple, list[Tensor]]] = []  # or_masks of ranges from key 0
    doc = None
    for mod in mods:
        if _is_window(mod):
            static.append(("window", mod.left, mod.right, mod._off()))
        elif type(mod) is _KeysBefore:
            if isinstance(mod.n, int):
                static.append(("keys", mod.n))
            else:
                lengths.append(mod.n)
        elif type(mod) is _Document and doc is None:
            doc = mod
        elif (reach := _from_first_key(mod)) is not None:
            unions.append(reach)
        else:
            return None
    T, S, dev = call.T, call.S, call.device
    key = (tuple(static), T, S, str(dev))
    lo, hi = _static_ranges.get(key, lambda: _window_ranges(static, T, S, dev))
    for n in lengths:  # per batch element: (B?, 1, 1)
        hi = torch.minimum(hi, n.to(dev).view(-1, 1, 1).clamp(0, S))
    for parts, tensors in unions:  # each a range from key 0: its farthest end
        reach_key = ("reach", parts, T, S, str(dev))  # (not a windows' key: (lo, hi) there)
        reach_hi: Tensor = _static_ranges.get(
            reach_key, functools.partial(_reach, parts, T, S, dev)
        )  # (1, 1, T)
        for n in tensors:
            reach_hi = torch.maximum(reach_hi, n.to(dev).view(-1, 1, 1).clamp(0, S))
        hi = torch.minimum(hi, reach_hi)
    return lo, hi, doc


def _from_first_key(mod) -> tuple[tuple, list[Tensor]] | None:
    """An ``or_masks`` whose every part lets a row attend keys from key 0 on (windows with no
    left bound, causal of either alignment, key lengths: ``prefix_lm`` is causal or the
    prefix's keys): their union is the range from key 0 to the farthest part's end. As
    ``(parts, lengths)``: the windows' and integer lengths' parts (made once, as
    :func:`_window_ranges`' are) and the lengths per batch element. None for other masks."""
    if type(mod) is not _Combined or mod.op != "or" or not mod.mods:
        return None
    parts: list[tuple] = []
    tensors: list[Tensor] = []
    for part in mod.mods:
        if _is_window(part) and part.left is None:
            parts.append(("window", None, part.right, part._off()))
        elif type(part) is _KeysBefore and isinstance(part.n, int):
            parts.append(("keys", part.n))
        elif type(part) is _KeysBefore and isinstance(part.n, Tensor):
            tensors.append(part.n)
        elif (inner := _from_first_key(part)) is not None:
            parts.extend(inner[0])
            tensors.extend(inner[1])
        else:
            return None
    return tuple(parts), tensors


def _reach(parts: tuple, T: int, S: int, device) -> Tensor:
    """The farthest end of ranges that all start at key 0 (see :func:`_from_first_key`); 0
    where there is no part (lengths per batch element alone).

    Shape:
        -> ``(1, 1, T)`` int64 in ``[0, S]``.
    """
    hi = torch.zeros((1, 1, T), dtype=torch.int64, device=device)
    for part in parts:
        hi = torch.maximum(hi, _window_ranges([part], T, S, device)[1])
    return hi


_static_ranges = PlanCache(64)  # a model has a few mask shapes (never changed in place)


def ranges(call: AttentionCall, attn_mask: bool = True):
    """``(lo, hi, doc)`` of :func:`_ranges`, for kernels that take rows' key ranges
    (``ops/bf16_scores.py``); None when the masks are not of that form. ``attn_mask=False``:
    of the masks but the tensor (which the caller takes itself)."""
    return _ranges(call, attn_mask)


def causal_ranges(T: int, S: int, device) -> tuple[Tensor, Tensor]:
    """The ranges of top-left causal attention, row ``i`` keys ``[0, min(i + 1, S))``: the
    ones :func:`ranges` makes for ``is_causal`` alone and keeps (the same tensors).

    Shape:
        -> lo, hi ``(1, 1, T)`` int64.
    """
    static = [("window", None, 0, 0)]  # (_causal()'s part)
    key = (tuple(static), T, S, str(device))
    return _static_ranges.get(key, lambda: _window_ranges(static, T, S, device))


def document_ranges(
    call: AttentionCall, lo: Tensor, hi: Tensor, doc
) -> tuple[Tensor, Tensor, Tensor]:
    """``[lo_i, hi_i)`` narrowed to the span of row ``i``'s document among the keys, from the
    first key of its id to the last (empty where no key has it): a kernel that also compares
    ids within it (``ops/bf16_scores.py``) then visits only that span, which is the whole
    document for packed sequences. Tensor ops, with the sorted keys remembered per ids tensor.
    Also which rows' spans hold keys of other ids (an id in more than one run): only there
    must ids be compared.

    Shape:
        lo, hi ``(B?, 1, T)`` -> lo, hi ``(Bd, T)`` int64 (Bd: B or 1), mixed ``(Bd, T)`` bool.
    """
    S, dev = call.S, call.device
    ids, order, _ = _sorted_ids.get(
        (doc.kv_ids,), ("sorted", dev), lambda: _sorted_keys(doc.kv_ids.to(dev))
    )  # (Bk, S) each
    q = doc.q_ids.to(dev)  # (Bq, T)
    # (broadcast, not max: an empty batch, B = 0, against a shared range of 1 is empty)
    Bd = torch.broadcast_shapes(ids.shape[:1], q.shape[:1], lo.shape[:1], hi.shape[:1])[0]
    ids, order = ids.expand(Bd, S).contiguous(), order.expand(Bd, S)
    q = q.expand(Bd, call.T).contiguous()
    first = torch.searchsorted(ids, q, side="left")  # (Bd, T): the id's first sorted index
    last = torch.searchsorted(ids, q, side="right") - 1  # its last; < first: no key has it
    # a stable sort keeps an id's keys in order of position: its first and last positions
    d_lo = order.gather(-1, first.clamp(max=S - 1))  # (Bd, T)
    d_hi = torch.where(last >= first, order.gather(-1, last.clamp(min=0)) + 1, d_lo)
    mixed = d_hi - d_lo != last - first + 1  # (Bd, T): the span holds more than its id's keys
    lo = torch.maximum(lo.reshape(-1, call.T), d_lo)  # (Bd, T)
    return lo, torch.maximum(torch.minimum(hi.reshape(-1, call.T), d_hi), lo), mixed


def _window_ranges(static: list, T: int, S: int, device) -> tuple[Tensor, Tensor]:
    """The ranges ``[lo_i, hi_i)`` of windows and integer lengths (see :func:`_ranges`).

    Shape:
        -> lo, hi ``(1, 1, T)`` int64 in ``[0, S]``.
    """
    rows = torch.arange(T, device=device).view(1, 1, T)  # (1, 1, T)
    lo = torch.zeros_like(rows)
    hi = torch.full_like(rows, S)
    for part in static:
        if part[0] == "window":
            _, left, right, off = part
            if left is not None:
                lo = torch.maximum(lo, rows + (off - left))
            if right is not None:
                hi = torch.minimum(hi, rows + (off + right + 1))
        else:
            hi = hi.clamp(max=part[1])
    return lo.clamp(0, S), hi.clamp(0, S)


def _cumulative(marked: Tensor) -> Tensor:
    """Marked keys before each key position: ``cum[..., j]`` counts keys ``< j``.

    Shape:
        ``(B, H, S)`` float32 of 0 and 1 -> ``(B, H, S + 1)`` float32 (exact to 2^24).
    """
    return torch.nn.functional.pad(marked.cumsum(-1), (1, 0))


# --- documents ------------------------------------------------------------------------------


def _sorted_keys(kv_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The keys sorted by document id (stably: by position within an id), as ``(ids, order,
    code)``: the sorted ids, the key positions in that order, and ``start * (S + 1) + j`` for
    key ``j`` whose id starts at sorted index ``start``, increasing along the order.

    Shape:
        kv_ids ``(B?, S)`` -> three ``(B?, S)`` int64.
    """
    ids, order = torch.sort(kv_ids, dim=-1, stable=True)  # (B?, S)
    start = torch.searchsorted(ids, ids, side="left")  # (B?, S): first sorted index of an id
    return ids, order, start * (kv_ids.shape[-1] + 1) + order


def _by_document(call, marked, lo, hi, doc) -> tuple[Tensor, Tensor]:
    """:func:`key_counts` for ``document(ids) & ranges``: a row's keys are those of its own id
    with positions in ``[lo_i, hi_i)``, consecutive in the sorted order of :func:`_sorted_keys`
    (an id's keys are one run there, in order of position)."""
    B, H = call.BH
    T, S, dev = call.T, call.S, call.device
    ids, order, code = _sorted_ids.get(
        (doc.kv_ids,), ("sorted", dev), lambda: _sorted_keys(doc.kv_ids.to(dev))
    )  # (Bk, S) each, Bk 1 (ids shared by the batch) or B
    Bk = ids.shape[0]
    q = doc.q_ids.to(dev).expand(B, T).reshape(Bk, -1).contiguous()  # (Bk, B / Bk * T)
    first = torch.searchsorted(ids, q, side="left")  # where the row's id starts, sorted
    found = torch.searchsorted(ids, q, side="right") > first  # some key has the row's id
    base = (first * (S + 1)).view(B, 1, T)  # (B, 1, T)
    lo = lo.expand(B, 1, T)
    hi = torch.maximum(hi.expand(B, 1, T), lo)  # (B, 1, T): an empty range is [lo, lo)
    at_lo = torch.searchsorted(code, (base + lo).reshape(Bk, -1)).view(B, 1, T)
    at_hi = torch.searchsorted(code, (base + hi).reshape(Bk, -1)).view(B, 1, T)
    at_hi = torch.where(found.view(B, 1, T), at_hi, at_lo)  # an id no key has: no key
    in_order = marked.gather(-1, order.view(Bk, 1, S).expand(B, H, S))  # (B, H, S), sorted
    cum = _cumulative(in_order)  # (B, H, S + 1)
    at_lo, at_hi = at_lo.expand(B, H, T), at_hi.expand(B, H, T)
    return cum.gather(-1, at_hi) - cum.gather(-1, at_lo), at_hi - at_lo


# --- any mask -------------------------------------------------------------------------------


def _by_matrix(call: AttentionCall, marked: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`counts` for any masks: the allowed pairs as a 0/1 float32 matrix (exact counts
    up to 2^24 keys) times the marked keys, a block of rows at a time; the matrix of an
    ``attn_mask`` alone (up to 2^24 pairs) and its rows' counts are remembered by the mask's
    identity.

    Shape:
        marked ``(B, H, S)`` -> ``(B, H, T)`` and ``(B?, H?, T?)``.
    """
    B, H = call.BH
    T, S = call.T, call.S
    mask = call.attn_mask
    alone = call.mask_mod is None and not call.is_causal and mask is not None
    if alone and mask is not None and mask.numel() <= _BLOCK_PAIRS:
        matrix, keys = _matrices.get((mask,), call.batch, lambda: _with_counts(call, 0, T))
        return _product(matrix, marked, T), keys
    hits = torch.empty(B, H, T, dtype=torch.float32, device=call.device)
    keys = torch.empty(B, H, T, dtype=torch.float32, device=call.device)
    step = max(1, _BLOCK_PAIRS // max(B * H * S, 1))
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        matrix, n = _with_counts(call, r0, r1)
        hits[:, :, r0:r1] = _product(matrix, marked, r1 - r0)
        keys[:, :, r0:r1] = n
    return hits, keys


def _with_counts(call: AttentionCall, r0: int, r1: int) -> tuple[Tensor, Tensor]:
    """:func:`_allowed` and how many keys each of its rows allows.

    Shape:
        -> ``(B?, H?, nr?, S?)`` and ``(B?, H?, nr?)`` (times S when the mask has S? = 1).
    """
    matrix = _allowed(call, r0, r1)
    keys = matrix.sum(-1) * (call.S if matrix.shape[-1] == 1 else 1)
    return matrix, keys


def _allowed(call: AttentionCall, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of every mask of the call together, as 0/1 float32.

    Shape:
        ``(B?, H?, nr?, S?)`` float32, 1 where the masks do not vary (a key padding mask has
        ``nr? = 1``).
    """
    B, H = call.BH
    ok = None
    if call.attn_mask is not None:
        mask = call.mask_4d(call.attn_mask)  # (B?, H?, T?, S?)
        mask = mask[..., r0:r1, :] if mask.shape[-2] > 1 else mask
        ok = mask if mask.dtype == torch.bool else mask > float("-inf")
    if call.is_causal or call.mask_mod is not None:
        b, h, q, kv = index_grid(B, H, r1 - r0, call.S, q_start=r0, device=call.device)
        if call.is_causal:
            ok = (kv <= q) if ok is None else ok & (kv <= q)
        if call.mask_mod is not None:
            mod = evaluate_mask(call.mask_mod, b, h, q, kv)
            ok = mod if ok is None else ok & mod
    assert ok is not None  # _ranges took the calls without masks
    ok = ok.reshape((1,) * (4 - ok.dim()) + tuple(ok.shape))
    return ok.view(torch.uint8).to(torch.float32)  # (bool -> float32 by uint8: 3x faster)


def _product(matrix: Tensor, marked: Tensor, nr: int) -> Tensor:
    """``matrix @ marked`` per batch element and head, the matrix's broadcast dims expanded.
    A small matrix is broadcast by ``matmul`` (which copies it per batch element and head);
    a large one is multiplied once, with the batch elements and heads it does not depend on
    as the columns.

    Shape:
        matrix ``(B?, H?, nr?, S?)`` 0/1; marked ``(B, H, S)`` -> ``(B, H, nr)``.
    """
    B, H, S = marked.shape
    if matrix.shape[-1] == 1:  # a mask that does not depend on the key: every key or none
        marked = marked.sum(-1, keepdim=True)  # (B, H, 1)
        S = 1
    Bm, Hm, Tm = matrix.shape[0], matrix.shape[1], matrix.shape[2]
    if Bm * Hm == B * H or B * H * Tm * S <= _BLOCK_PAIRS // 16:
        prod = (matrix @ marked.unsqueeze(-1)).squeeze(-1)  # (B, H, nr?)
        return prod.expand(B, H, nr)
    m = matrix.expand(Bm, Hm, Tm, S)
    # the dims the matrix broadcasts over go to the columns: (Bm, Hm, S, B/Bm * H/Hm)
    c = marked.reshape(Bm, B // Bm, Hm, H // Hm, S).permute(0, 2, 4, 1, 3)
    prod = m @ c.reshape(Bm, Hm, S, -1)  # (Bm, Hm, nr?, B/Bm * H/Hm)
    prod = prod.view(Bm, Hm, Tm, B // Bm, H // Hm).permute(0, 3, 1, 4, 2)
    return prod.reshape(B, H, Tm).expand(B, H, nr)
