"""The vocabulary: structured masks and score changes in FlexAttention's terms.

A mask_mod is called as ``mask_mod(b, h, q_idx, kv_idx)`` with integer index tensors that
broadcast against each other, b ``(B, 1, 1, 1)``, h ``(1, H, 1, 1)``, q_idx ``(1, 1, T, 1)``,
kv_idx ``(1, 1, 1, S)`` (or any slice of them), and returns a bool tensor of their broadcast
shape: True = may attend. A score_mod is called as ``score_mod(score, b, h, q_idx, kv_idx)``
with the scaled scores ``(B, H, T, S)`` (or a tile of them) and returns new scores. A plain
function written for torch's FlexAttention works unchanged: it is evaluated per element, as
Flex does (``per_element``, one torch.vmap level per index dim), so it sees 0-d indices and
a 0-d score. The ready-made objects here are called on the broadcast index tensors directly.

The ready-made masks also know, per block of queries x keys, whether the block is full,
partial or empty, from the block's index bounds alone (``MaskMod.blocks``): that is what lets
a tiled backend skip empty blocks and drop the mask on full ones without ever evaluating a
(T, S) mask. For a plain function the blocks are found by evaluation (``qkv.masks.blocks``).

Shape alphabet: B batch, H heads, T query length, S key length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .blocks import Grid, _classify_by_evaluation
from .evaluation import _captured_tensors, _unique, evaluate_mask, per_element


class MaskMod:
    """A structured mask ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).

    Subclasses implement ``__call__`` and, to let a tiled backend skip blocks cheaply,
    ``blocks(grid)``. ``&`` and ``|`` combine masks like :func:`and_masks`/:func:`or_masks`.
    """

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def bind(self, B: int, H: int, T: int, S: int) -> MaskMod:
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

    def __and__(self, other) -> MaskMod:
        return and_masks(self, other)

    def __or__(self, other) -> MaskMod:
        return or_masks(self, other)


class ScoreMod:
    """A change of the scaled scores ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

    ``additive`` is True when the change is ``score + bias(b, h, q_idx, kv_idx)`` with a bias
    that does not depend on the score (ALiBi, a relative bias): a backend may then add the
    bias as a float mask. ``tensors()`` lists the tensors it reads, so a backend can give them
    gradients. ``derivative(...)`` gives ``d score_mod / d score`` in closed form where the
    change knows it (None: a backend differentiates it by autograd).
    """

    additive = False

    def __call__(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        raise NotImplementedError

    def derivative(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor | None:
        """``d score_mod(score, ...) / d score`` at ``score``, broadcastable to its shape, or
        None where only autograd knows it. A backward that has no autograd to call (the tiled
        backend's custom op under ``torch.compile``) takes the score changes that give it."""
        return None

    def bind(self, B: int, H: int, T: int, S: int) -> ScoreMod:
        return self

    def tensors(self) -> tuple[Tensor, ...]:
        return ()


def _offset(align: str, T: int, S: int) -> int:
    """Query position of row 0: 0 top-left, S - T bottom-right (the last query sees the last
    key)."""
    return 0 if align == "top_left" else S - T


def _check_align(align: str) -> str:
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return align


class _Window(MaskMod):
    """Keys within ``[q - left, q + right]`` of the (aligned) query position; None = unbounded."""

    def __init__(
        self, left: int | None, right: int | None, align: str, name: str, offset: int | None = None
    ) -> None:
        self.left, self.right, self.align, self.name, self.offset = left, right, align, name, offset

    def bind(self, B, H, T, S):
        return _Window(self.left, self.right, self.align, self.name, _offset(self.align, T, S))

    def _off(self) -> int:
        if self.offset is None:
            if self.align == "top_left":
                return 0
            raise ValueError(
                f"{self!r} needs the lengths T and S to align bottom-right: pass it as "
                "mask_mod= to scaled_dot_product_attention, or use "
                "qkv.masks.to_dense(mask, B, H, T, S)"
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
            raise ValueError(
                f"{name}: lengths must be an int or a 1-D integer tensor (B,), "
                f"got {n.dtype} of shape {tuple(n.shape)}"
            )
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
    return _Combined(
        (causal(), _KeysBefore(_as_lengths("prefix_lm", prefix), "prefix_lm")),
        "or",
        f"prefix_lm({prefix if isinstance(prefix, int) else 'tensor'})",
    )


class _Document(MaskMod):
    """Attend within the same document id (packed sequences)."""

    def __init__(self, q_ids: Tensor, kv_ids: Tensor) -> None:
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def bind(self, B, H, T, S):
        for name, ids, L in (("ids", self.q_ids, T), ("kv_ids", self.kv_ids, S)):
            if ids.shape[-1] != L or ids.shape[0] not in (1, B):
                raise ValueError(
                    f"document: {name} has shape {tuple(ids.shape)} but the call has B={B} and "
                    f"{'T' if L == T and name == 'ids' else 'S'}={L}; give ({B}, {L}) or "
                    f"(1, {L}) ids"
                )
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        qi, ki = self.q_ids.to(q_idx.device), self.kv_ids.to(q_idx.device)
        shared = b[:1] * 0 if b.dim() else b * 0  # shared ids: batch dim 1 (0-d per element,
        # as FlexAttention calls a mask_mod)
        bq = b if qi.shape[0] > 1 else shared
        bk = b if ki.shape[0] > 1 else shared
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
        q_ids = self.q_ids[:, grid.q_start : grid.q_start + grid.T].to(grid.device)  # (B, T)
        kv_ids = self.kv_ids[:, grid.kv_start : grid.kv_start + grid.S].to(grid.device)  # (B, S)
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
            raise ValueError(
                f"document: {name} must be an integer tensor (B, T) or (T,), got "
                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            )
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
    return _wrap(
        "mask_mod",
        mask_mod,
        MaskMod,
        _Function,
        "(b, h, q_idx, kv_idx) -> bool tensor or a qkv.masks mask",
    )


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

    def derivative(self, score, b, h, q_idx, kv_idx):
        return torch.ones((), dtype=score.dtype, device=score.device)  # a bias: slope 1

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
        raise ValueError(
            f"alibi: slopes must be a 1-D float tensor (H,) or an int H, got {slopes!r}"
        )
    return _Alibi(slopes)


class _Softcap(ScoreMod):
    """``cap * tanh(score / cap)`` (Gemma 2's logit softcapping)."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def derivative(self, score, b, h, q_idx, kv_idx):
        return 1 - torch.tanh(score / self.cap).square()  # d/ds cap * tanh(s / cap)

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


def as_score_mod(score_mod) -> ScoreMod:
    """A ScoreMod for ``score_mod`` (wrapping a plain function); TypeError if not callable."""
    return _wrap(
        "score_mod",
        score_mod,
        ScoreMod,
        _ScoreFunction,
        "(score, b, h, q_idx, kv_idx) -> score or a qkv.masks score mod",
    )
