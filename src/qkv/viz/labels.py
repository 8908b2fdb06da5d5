"""The labels and tables of a :func:`qkv.viz.html` page: token lists aligned to each entry's
query rows and keys, and the Explain view's tables (the caller's ``steps=``, or a small
``MultiHeadTrace``'s Q, K, V, scores, softmax and output per head).

Shape alphabet: H query heads, G key/value heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..trace import MultiHeadTrace

if TYPE_CHECKING:  # entries imports this module (for _trace_steps)
    from .entries import _Entry

_STEP_CELLS = 4096  # numbers per explain table
_AUTO_STEPS = 32  # a MultiHeadTrace with T, S <= 32 explains itself
_WEIGHT_NAMES = ("score", "softmax", "prob", "weight", "attn")  # steps whose columns are keys


def _token_list(x: Any, what: str) -> list[str]:
    if isinstance(x, (str, bytes)):
        raise TypeError(
            f"{what} must be a list of str, got a {type(x).__name__}; split it "
            f"first, e.g. text.split() or tokenizer.convert_ids_to_tokens(ids)"
        )
    try:
        return [str(t) for t in x]
    except TypeError:
        raise TypeError(f"{what} must be a list of str, got {type(x).__name__}") from None


def _tokens(tokens: Any, entries: list[_Entry]) -> tuple[list[list[str]], list[tuple]]:
    """The token lists to embed, and per entry ``(qtok, ktok)``: ``[list_id, offset]`` with
    query row r labelled ``list[offset + r]`` and key j ``list[j]``, or None (numbered)."""
    if tokens is None:
        return [], [(None, None) for _ in entries]
    pair = (
        isinstance(tokens, (list, tuple))
        and len(tokens) == 2
        and all(isinstance(t, (list, tuple)) for t in tokens)
    )
    if pair:
        lists = [_token_list(tokens[0], "query_tokens"), _token_list(tokens[1], "key_tokens")]
        for e in entries:
            if len(lists[0]) != e.T or len(lists[1]) != e.S:
                raise ValueError(
                    f"{e.label}: tokens=(query_tokens, key_tokens) have "
                    f"{len(lists[0])} and {len(lists[1])} entries, need T={e.T} "
                    f"and S={e.S}"
                )
        return lists, [([0, 0], 1) for _ in entries]
    lst = _token_list(tokens, "tokens")
    out: list[tuple[list[int], int | None]] = []
    for e in entries:
        if e.S >= e.T and len(lst) >= e.S:
            out.append(([0, e.S - e.T], 0))  # keys tokens[:S]; queries end-aligned
        elif len(lst) == e.T:
            out.append(([0, 0], None))
        else:
            raise ValueError(
                f"{e.label}: {len(lst)} tokens for T={e.T} queries and S={e.S} "
                f"keys; pass T tokens (or at least S when S >= T), or a pair "
                f"(query_tokens, key_tokens)"
            )
    return [lst], out


def _matrix(x: Any, name: str) -> Tensor:
    try:
        t = torch.as_tensor(x.detach() if isinstance(x, Tensor) else x).cpu()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"steps[{name!r}] must be a 2-D array, tensor or nested list of "
            f"numbers, got {type(x).__name__}"
        ) from None
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() == 1:
        t = t.unsqueeze(0)  # (1, n): one row
    if t.dim() != 2:
        raise ValueError(
            f"steps[{name!r}] must be 2-D, got shape {tuple(t.shape)}; pass one head, e.g. x[0, h]"
        )
    if t.numel() > _STEP_CELLS:
        raise ValueError(
            f"steps[{name!r}] has {t.numel()} numbers {tuple(t.shape)}; explain "
            f"tables are for small inputs (at most {_STEP_CELLS} numbers each): "
            f"pass a slice such as x[:16, :16]"
        )
    if t.dtype == torch.bool or not (t.dtype.is_floating_point or t.dtype.is_complex):
        t = t.double()
    if t.is_complex():
        raise TypeError(f"steps[{name!r}] is complex; pass real numbers")
    return t.double()


def _numbers(t: Tensor) -> list[list]:
    """A 2-D tensor as nested lists, 6 significant digits; non-finite numbers as strings."""

    def one(v: float):
        return float(f"{v:.6g}") if math.isfinite(v) else str(v)

    return [[one(v) for v in row] for row in t.tolist()]


def _table(name: str, t: Tensor, head: int | None, rows: Any = None, cols: Any = None) -> dict:
    return {"name": name, "head": head, "data": _numbers(t), "rows": rows, "cols": cols}


def _user_steps(steps: Any, first: _Entry, labels: tuple, lists: list) -> list[dict]:
    if steps is None:
        return []
    if not isinstance(steps, dict):
        raise TypeError(
            f"steps must be a dict name -> 2-D array (in display order), got {type(steps).__name__}"
        )
    out = []
    for name, x in steps.items():
        t = _matrix(x, str(name))
        n, m = t.shape
        rows = "q" if n == first.T else ("k" if n == first.S else None)
        weights = any(w in str(name).lower() for w in _WEIGHT_NAMES)
        cols = "k" if (weights and m == first.S) else None
        out.append(_table(str(name), t, None, rows, cols))
    return out


def _trace_steps(trace: MultiHeadTrace, b: int | None, T: int, S: int) -> list[dict]:
    """Q, K, V, scores, softmax, output of each head, for a small MultiHeadTrace."""
    if T > _AUTO_STEPS or S > _AUTO_STEPS:
        return []
    pick = (lambda t: t) if b is None else (lambda t: t[b])

    def heads_of(t: Tensor) -> Tensor:
        t = pick(t)
        return t.unsqueeze(0) if t.dim() == 2 else t  # (H or G, n, D)

    try:
        q, k, v, out = (heads_of(t) for t in (trace.q, trace.k, trace.v, trace.heads))
        scores, probs = (heads_of(t) for t in (trace.scores, trace.probs))
    except (AttributeError, IndexError, RuntimeError):
        return []
    H, G = q.shape[0], k.shape[0]
    if H % G or q.shape[-1] > 128 or v.shape[-1] > 128:
        return []
    found = []
    for h in range(H):
        g = h // (H // G)
        for name, t, rows, cols in (
            ("Q", q[h], "q", None),
            ("K", k[g], "k", None),
            ("V", v[g], "k", None),
            ("scores", scores[h], "q", "k"),
            ("softmax", probs[h], "q", "k"),
            ("output", out[h], "q", None),
        ):
            found.append(_table(name, t.detach().double().cpu(), h, rows, cols))
    return found
