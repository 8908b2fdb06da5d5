"""Float64 attention written apart from qkv: the golden of the property tests.

Nothing here imports qkv. The mask is a dense ``(B, H, T, S)`` bool tensor built from a
*description* of the call (``causal_allowed``, ``window_allowed``, ...), never by qkv's own
``masks.to_dense`` or a backend, so a bug there cannot hide by agreeing with itself. The math
is einsum and ``torch.where``; the softmax follows qkv's mask contract:

* bool ``allowed`` True = may attend; a float ``bias`` is added to the scores (``-inf`` in it
  also means "may not attend");
* ``score_mod`` changes the scaled scores *before* the masks (FlexAttention's order);
* a query row that may attend to nothing outputs exactly 0 and passes no gradient (0);
* a key a row may not attend to has no effect on that row: masked scores never enter any
  arithmetic (they are replaced, not multiplied by 0).

Plain-function mask_mods and score_mods are evaluated one element at a time, as FlexAttention
defines them, by nesting ``torch.vmap`` over (b, h, q_idx, kv_idx) (``elementwise_mask`` and
``elementwise_score``): a function that only works on broadcast index grids, or only on
scalars, is evaluated here as its author meant it.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "alibi64",
    "attention64",
    "attention64_trace",
    "causal_allowed",
    "document_allowed",
    "elementwise_mask",
    "elementwise_score",
    "key_lengths_allowed",
    "morton_code",
    "neighborhood_allowed",
    "product_size",
    "repeat_kv_heads",
    "softcap64",
    "tile_order",
    "window_allowed",
]


def _indices(B: int, H: int, T: int, S: int, device=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """b ``(B,1,1,1)``, h ``(1,H,1,1)``, q ``(1,1,T,1)``, kv ``(1,1,1,S)``; int64."""
    return (
        torch.arange(B, device=device).view(B, 1, 1, 1),
        torch.arange(H, device=device).view(1, H, 1, 1),
        torch.arange(T, device=device).view(1, 1, T, 1),
        torch.arange(S, device=device).view(1, 1, 1, S),
    )


def _full(x: Tensor, B: int, H: int, T: int, S: int) -> Tensor:
    return x.expand(B, H, T, S)  # (B, H, T, S)


# --- masks from descriptions ------------------------------------------------------------------


def causal_allowed(B: int, H: int, T: int, S: int, *, offset: int = 0) -> Tensor:
    """Key ``j`` allowed for query ``i`` iff ``j <= i + offset`` (0 top-left, S - T bottom-right).

    Shape:
        -> ``(B, H, T, S)``, bool.
    """
    _, _, q, kv = _indices(B, H, T, S)
    return _full(kv <= q + offset, B, H, T, S)


def window_allowed(
    B: int, H: int, T: int, S: int, left: int, right: int, *, offset: int = 0
) -> Tensor:
    """Key ``j`` allowed iff ``p - left <= j <= p + right`` with ``p = i + offset``.

    Shape:
        -> ``(B, H, T, S)``, bool.
    """
    _, _, q, kv = _indices(B, H, T, S)
    pos = q + offset
    return _full((kv >= pos - left) & (kv <= pos + right), B, H, T, S)


def document_allowed(B: int, H: int, q_ids: Tensor, kv_ids: Tensor) -> Tensor:
    """Same id: ``q_ids[b, i] == kv_ids[b, j]``; ids of batch size 1 are shared by the batch.

    Shape:
        q_ids ``(B or 1, T)``, kv_ids ``(B or 1, S)`` -> ``(B, H, T, S)``, bool.
    """
    T, S = q_ids.shape[-1], kv_ids.shape[-1]
    same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]  # (B?, 1, T, S)
    return _full(same, B, H, T, S)


def key_lengths_allowed(B: int, H: int, T: int, S: int, lengths) -> Tensor:
    """Key ``j`` allowed in batch element ``b`` iff ``j < lengths[b]`` (an int: all elements).

    Shape:
        lengths an int or ``(B,)`` -> ``(B, H, T, S)``, bool.
    """
    _, _, _, kv = _indices(B, H, T, S)
    n = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1, 1, 1, 1)  # (B or 1, 1, 1, 1)
    return _full(kv < n, B, H, T, S)


def _natten_window(c: int, n: int, k: int, d: int, causal: bool) -> list[int]:
    """Coordinates a query at ``c`` sees along one dim of ``n`` tokens, by NATTEN's rules
    written as lists: the query's dilation group is every ``d``-th coordinate from ``c % d``;
    a causal window is the ``k`` group members up to the query (fewer at the start); any other
    is the ``k`` members centred on it (``k // 2`` before), slid inwards until it fits."""
    group = list(range(c % d, n, d))
    x = group.index(c)
    if causal:
        return group[max(x - k + 1, 0) : x + 1]
    start = x - k // 2
    start = max(0, min(start, len(group) - k))  # slid inwards at the borders
    return group[start : start + k]


def neighborhood_allowed(
    shape: tuple, kernel: tuple, dilation: tuple, causal: tuple, perm: list | None = None
) -> Tensor:
    """NATTEN's neighborhood attention on a row-major token grid, by loops over coordinates:
    key token ``j`` allowed for query token ``i`` iff along every dim ``j``'s coordinate is in
    ``i``'s window. ``perm[p]``: the row-major token at position ``p`` (None: row-major).

    Shape:
        -> ``(N, N)``, bool, N = prod(shape).
    """
    coords = []
    for t in range(math.prod(shape)):
        c, rest = [], t
        for n in reversed(shape):
            c.append(rest % n)
            rest //= n
        coords.append(tuple(reversed(c)))
    dims = range(len(shape))
    windows = [
        [set(_natten_window(c[a], shape[a], kernel[a], dilation[a], causal[a])) for a in dims]
        for c in coords
    ]
    order = list(range(len(coords))) if perm is None else list(perm)
    rows = [[all(coords[j][a] in windows[i][a] for a in dims) for j in order] for i in order]
    return torch.tensor(rows, dtype=torch.bool).reshape(len(order), len(order))


def tile_order(shape: tuple, tile: tuple) -> list[int]:
    """Row-major tokens of a grid visited tile by tile (tiles row-major over the grid, tokens
    row-major within a tile; edge tiles smaller), by loops.

    Shape:
        -> a list of N = prod(shape) token indices.
    """
    starts = [range(0, n, t) for n, t in zip(shape, tile)]
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    order = []

    def visit(lo, hi, dim, prefix):
        if dim == len(shape):
            order.append(sum(c * s for c, s in zip(prefix, strides)))
            return
        for c in range(lo[dim], hi[dim]):
            visit(lo, hi, dim + 1, prefix + [c])

    def tiles(dim, lo):
        if dim == len(shape):
            visit(lo, [min(a + t, n) for a, t, n in zip(lo, tile, shape)], 0, [])
            return
        for a in starts[dim]:
            tiles(dim + 1, lo + [a])

    tiles(0, [])
    return order


def morton_code(cell: tuple, depth: int) -> int:
    """The z-order (Morton) code of a grid cell, by a loop over Python ints: bit ``j`` of
    coordinate ``i`` (of ``n``) becomes bit ``j * n + (n - 1 - i)`` (the first coordinate the
    most significant at each level, PTv3's ``xyz2key``)."""
    n, code = len(cell), 0
    for j in range(depth):
        for i, c in enumerate(cell):
            code += ((int(c) >> j) & 1) * 2 ** (j * n + n - 1 - i)
    return code


_BHQK = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None))


def _vmap_bhqk(fn: Callable, lead: tuple = ()) -> Callable:
    """``fn(*lead, b, h, q, kv)`` mapped over the four indices, innermost kv (FlexAttention's
    ``_vmap_for_bhqkv``); ``lead`` gives the in_dims of arguments before the indices."""
    for dims in _BHQK:
        fn = torch.vmap(fn, in_dims=lead + dims, out_dims=0)
    return fn


def elementwise_mask(mask_fn: Callable, B: int, H: int, T: int, S: int) -> Tensor:
    """``mask_fn(b, h, q_idx, kv_idx)`` evaluated at every element, each call seeing 0-d
    index tensors (FlexAttention's semantics).

    Shape:
        -> ``(B, H, T, S)``, bool.
    """
    if B * H * T * S == 0:
        return torch.zeros(B, H, T, S, dtype=torch.bool)
    ar = [torch.arange(n) for n in (B, H, T, S)]
    out = _vmap_bhqk(mask_fn)(*ar)  # (B, H, T, S)
    if out.dtype != torch.bool:
        raise TypeError(f"mask function returned {out.dtype}, not bool")
    return out


def elementwise_score(score_fn: Callable, scores: Tensor) -> Tensor:
    """``score_fn(score, b, h, q_idx, kv_idx)`` evaluated at every element, each call seeing a
    0-d score and 0-d indices (FlexAttention's semantics); differentiable.

    Shape:
        scores ``(B, H, T, S)`` -> ``(B, H, T, S)``.
    """
    if scores.numel() == 0:
        return scores
    ar = [torch.arange(n) for n in scores.shape]
    return _vmap_bhqk(score_fn, (0,))(scores, *ar)  # (B, H, T, S)


def alibi64(scores: Tensor, slopes: Tensor) -> Tensor:
    """``score + slopes[h] * (kv_idx - q_idx)``; one slope shared when ``slopes`` has one.

    Shape:
        scores ``(B, H, T, S)``, slopes ``(H,)`` or ``(1,)`` -> ``(B, H, T, S)``.
    """
    B, H, T, S = scores.shape
    _, _, q, kv = _indices(B, H, T, S)
    slope = slopes.to(torch.float64).reshape(1, -1, 1, 1)  # (1, H or 1, 1, 1)
    return scores + slope * (kv - q).to(torch.float64)


def softcap64(scores: Tensor, cap: float) -> Tensor:
    """``cap * tanh(score / cap)``."""
    return cap * torch.tanh(scores / cap)


# --- attention --------------------------------------------------------------------------------


def repeat_kv_heads(x: Tensor, H: int) -> Tensor:
    """Each of G heads repeated ``H // G`` times, consecutively (head h reads kv head h // (H/G)).

    Shape:
        ``(B, G, S, E)`` -> ``(B, H, S, E)``.
    """
    G = x.shape[1]
    if G == H:
        return x
    idx = torch.arange(H) // (H // G)  # (H,)
    return x[:, idx]


def attention64(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention in float64 under qkv's mask contract: the output of
    :func:`attention64_trace`.

    Shape:
        q ``(B, H, T, D)``, k ``(B, G, S, D)``, v ``(B, G, S, Dv)`` -> ``(B, H, T, Dv)``.
    """
    out, _, _, _ = attention64_trace(
        q, k, v, scale=scale, allowed=allowed, bias=bias, score_mod=score_mod, sinks=sinks
    )
    return out


def attention64_trace(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    score_mod: Callable[[Tensor], Tensor] | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact attention in float64 under qkv's mask contract, with what a trace holds.

    Args:
        q, k, v: float64 queries, keys, values (k, v with G heads, H a multiple of G).
        scale: factor on ``q @ k^T``; None means ``1 / sqrt(D)``.
        allowed: bool, True = may attend, broadcastable to ``(B, H, T, S)``.
        bias: float added to the scores, broadcastable to ``(B, H, T, S)``.
        score_mod: ``scores -> scores`` on the dense scaled scores, applied before the masks.
        sinks: ``(H,)`` float64 logits that join each row's softmax with no value (gpt-oss).

    Returns:
        The output (rows that may attend to nothing are exactly 0); the scaled scores after
        the masks (``-inf`` where a row may not attend); the weights (rows of 0 where a row
        may attend to nothing); the log-sum-exp of each row (with the sink's term; ``-inf``
        for a row with nothing to sum).

    Shape:
        q ``(B, H, T, D)``, k ``(B, G, S, D)``, v ``(B, G, S, Dv)`` -> out
        ``(B, H, T, Dv)``, scores and probs ``(B, H, T, S)``, lse ``(B, H, T)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float64:
            raise TypeError(f"attention64 takes float64 {name}, got {t.dtype}")
    B, H, T, D = q.shape
    S = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    k, v = repeat_kv_heads(k, H), repeat_kv_heads(v, H)  # (B, H, S, D), (B, H, S, Dv)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * scale  # (B, H, T, S)
    if score_mod is not None:
        scores = score_mod(scores)  # (B, H, T, S)
    ok = torch.ones(B, H, T, S, dtype=torch.bool)
    if allowed is not None:
        ok = ok & allowed.expand(B, H, T, S)
    if bias is not None:
        bias = bias.to(torch.float64).expand(B, H, T, S)
        ok = ok & (bias != float("-inf"))
        scores = scores + torch.where(ok, bias, 0.0)  # masked bias never enters arithmetic
    ok = ok & (scores != float("-inf"))  # a score_mod may mask too
    safe = torch.where(ok, scores, 0.0)  # (B, H, T, S): no -inf, no value of a masked key
    if S > 0:
        row_max = torch.where(ok, safe, float("-inf")).amax(dim=-1, keepdim=True)  # (B, H, T, 1)
    else:
        row_max = safe.new_zeros(B, H, T, 1)
    sink = None if sinks is None else sinks.view(1, H, 1, 1).expand(B, H, T, 1)
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0).detach()  # (B, H, T, 1)
    exp = torch.where(ok, torch.exp(safe - row_max), 0.0)  # (B, H, T, S)
    total = exp.sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    if sink is not None:
        total = total + torch.exp(sink - row_max)  # the sink's share of the denominator
    probs = exp / torch.where(total > 0, total, 1.0)  # (B, H, T, S); empty rows all 0
    out = torch.einsum("bhts,bhse->bhte", probs, v)  # (B, H, T, Dv)
    lse = torch.where(total > 0, row_max + torch.log(total.clamp_min(1e-300)), float("-inf"))
    lse = lse.squeeze(-1)  # (B, H, T)
    return out, torch.where(ok, scores, float("-inf")), probs, lse


def product_size(q: Tensor, k: Tensor, scale: float | None) -> float:
    """``max(1, |scale| * max(|q| |k|^T))``: the largest sum of absolute products a score
    is formed from. Float32 scores and their log-sum-exp are within about ``D * 2^-24``
    times this of the exact ones, so ``1e-5`` times it bounds a float32 lse for D <= 64.

    Shape:
        q ``(B, H, T, D)``, k ``(B, G, S, D)`` (G divides H).
    """
    H, D = q.shape[1], q.shape[-1]
    if q.numel() == 0 or k.numel() == 0:
        return 1.0
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = repeat_kv_heads(k.detach().double().abs(), H)  # (B, H, S, D)
    sums = q.detach().double().abs() @ k.transpose(-2, -1)  # (B, H, T, S)
    return max(1.0, abs(scale) * float(sums.max()))
