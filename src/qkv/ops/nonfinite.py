"""Inputs holding NaN or inf: they may reach only the rows that may attend to them.

The mask contract says a key a row may not attend to has no effect on that row, whatever its
values, and a row that may attend to nothing outputs 0. Every kernel breaks that by
arithmetic alone: a masked weight is exactly 0, but ``0 * inf = NaN`` in ``probs @ value``,
an additive mask leaves ``NaN + -inf = NaN`` in the scores, and a NaN query spoils its row's
statistics even when the row has no key. So :func:`run` runs a call whose keys, values or
queries hold NaN/inf on zeros in their place, and then sets to NaN exactly the rows that may
attend to a bad key and the rows of a bad query that have a key to attend to: what plain
math gives those rows is not finite either.

Cost: when a gradient is wanted, one reduction over q, k and v per call (gradients can be
spoiled while the output is finite), and one over the output. Otherwise only the output is
checked, and the inputs only when it is not finite (a masked bad input always shows there as
NaN). A non-finite output from finite inputs is looked at once more: when the scaled scores
can overflow (a scale like 1e38), the call raises a ValueError naming that.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..masks import evaluate_mask, index_grid
from .base import tracing
from .call import AttentionCall

__all__ = ["run"]


@dataclasses.dataclass
class _Bad:
    """Which keys and query rows held NaN/inf: ``keys`` ``(*kbatch, S)`` (GQA heads expanded),
    ``rows`` ``(*qbatch, T)``; None where all were finite."""

    keys: Tensor | None
    rows: Tensor | None


def run(call: AttentionCall, run_call: Callable[[AttentionCall], object]):
    """``run_call(call)`` (an output, or ``(output, trace)``) under the contract above."""
    if call.device.type == "meta" or call.query.numel() == 0 or call.key.numel() == 0:
        return run_call(call)
    if tracing():
        return _run_traced(call, run_call)
    if not _wants_grad(call):
        result = run_call(call)
        out = result[0] if call.return_trace else result
        if _finite_sum(out):
            return result
    cleaned, bad = _clean(call)
    if bad is None:  # every input finite
        if _wants_grad(call):
            result = run_call(call)
            out = result[0] if call.return_trace else result
            if _finite_sum(out):
                return result
        _refuse_overflow(call)  # a non-finite output from finite inputs: overflowing scores?
        return result
    result = run_call(cleaned)
    if call.return_trace:
        return _poison(result[0], cleaned, bad), result[1]
    return _poison(result, cleaned, bad)


def _run_traced(call: AttentionCall, run_call: Callable[[AttentionCall], object]):
    """The same contract in tensor ops only, for a traced call (``torch.compile``): no
    ``.item()``, no branch on values, so the call stays one graph. Every call runs on the
    cleaned inputs (one copy of q, k and v). The rows to poison come from a custom op that
    returns at once when every input is finite (``tiled_op.nonfinite_rows``) where the masks
    can be carried to it; otherwise from a search of the whole ``(T, S)`` grid of allowed
    pairs, which the compiler fuses into one reduction instead of materialising it.

    (``torch.cond`` would skip the search on finite inputs, but dynamo then lost the
    attribute writes of Hugging Face's KV cache in the same graph: not used.)

    With no gradient wanted, the output alone is checked, as eagerly
    (``tiled_op.checked_inference``), where the masks can be carried to that op."""
    from . import tiled_op

    if not _wants_grad(call):
        out = tiled_op.checked_inference(call, run_call)
        if out is not None:
            return out
    q, k, v = call.query, call.key, call.value
    bad_q = ~torch.isfinite(q).all(-1)  # (*qbatch, T)
    bad_k = ~torch.isfinite(k).all(-1)  # (*kbatch, S)
    bad_v = ~torch.isfinite(v).all(-1)  # (*kbatch, S)
    cleaned = dataclasses.replace(
        call,
        **{
            name: torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=t.dtype, device=t.device), t)
            for name, bad, t in (("query", bad_q, q), ("key", bad_k, k), ("value", bad_v, v))
        },
    )
    result = run_call(cleaned)
    out = result[0] if call.return_trace else result
    keys = bad_k | bad_v  # (*kbatch, S)
    if call.enable_gqa:
        keys = keys.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-2)
    hit = tiled_op.nonfinite_rows(call, bad_q, keys)  # (*batch, T), or None
    if hit is None:
        ok = allowed(call)  # (*batch, T, S)
        hit = (ok & keys.unsqueeze(-2)).any(-1) | (bad_q & ok.any(-1))  # (*batch, T)
    out = out.masked_fill(hit.unsqueeze(-1), float("nan"))
    return (out, result[1]) if call.return_trace else out


def _refuse_overflow(call: AttentionCall) -> None:
    """ValueError when the scaled scores can overflow: ``|scale| * max|q_i| * max|k_j|`` beyond
    the largest float the scores are computed in (float32 for half inputs). Softmax of such
    scores is ``inf - inf = NaN`` on every backend; the caller asked for a temperature the
    dtype cannot hold. Called only when finite inputs gave a non-finite output."""
    with torch.no_grad():
        q_norm = call.query.detach().double().norm(dim=-1).max()
        k_norm = call.key.detach().double().norm(dim=-1).max()
        bound = abs(call.scale) * float(q_norm) * float(k_norm)
    largest = torch.finfo(torch.promote_types(call.dtype, torch.float32)).max
    if bound > largest:
        raise ValueError(
            f"the scaled scores overflow: scale={call.scale:g} times |q||k| up to "
            f"{float(q_norm) * float(k_norm):.3g} reaches {bound:.3g}, beyond the largest "
            f"{torch.promote_types(call.dtype, torch.float32)} ({largest:.3g}), so softmax "
            f"would be NaN; pass a smaller scale (a sharper softmax than this is the hard max: "
            f"take the argmax of the scores)"
        )


def _wants_grad(call: AttentionCall) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (call.query, call.key, call.value)
    )


def _finite_sum(t: Tensor) -> bool:
    """Whether ``t`` holds no NaN/inf, by one reduction: a sum is finite when every term is
    (one that overflows only sends the call the slow, still exact, way)."""
    return math.isfinite(t.detach().sum().item())


def _clean(call: AttentionCall) -> tuple[AttentionCall, _Bad | None]:
    """The call with non-finite keys, values and query rows zeroed, and which they were."""
    q, k, v = call.query, call.key, call.value
    if _finite_sum(q) and _finite_sum(k) and _finite_sum(v):
        return call, None
    with torch.no_grad():
        bad_q = ~torch.isfinite(q).all(-1)  # (*qbatch, T)
        bad_k = ~torch.isfinite(k).all(-1)  # (*kbatch, S)
        bad_v = ~torch.isfinite(v).all(-1)  # (*kbatch, S)
    if not (bad_q.any() or bad_k.any() or bad_v.any()):
        return call, None
    q, k, v = (
        torch.where(bad.unsqueeze(-1), 0.0, t).to(t.dtype)
        for bad, t in ((bad_q, q), (bad_k, k), (bad_v, v))
    )
    keys = torch.broadcast_tensors(bad_k, bad_v)
    keys = keys[0] | keys[1]  # (*kbatch, S)
    if call.enable_gqa:
        keys = keys.repeat_interleave(call.query.shape[-3] // call.key.shape[-3], dim=-2)
    bad = _Bad(keys if keys.any() else None, bad_q if bad_q.any() else None)
    return dataclasses.replace(call, query=q, key=k, value=v), bad


def _poison(out: Tensor, call: AttentionCall, bad: _Bad) -> Tensor:
    """``out`` with NaN on every row that may attend to a bad key, and on every bad query row
    that may attend to some key.

    Shape:
        out ``(*batch, T, Dv)`` -> the same.
    """
    hit = torch.zeros(call.batch + (call.T,), dtype=torch.bool, device=out.device)  # (*batch, T)
    if bad.keys is not None:
        cols = bad.keys.reshape(-1, call.S).any(0).nonzero().squeeze(-1)  # (nc,) bad somewhere
        hit = hit | (allowed(call, cols=cols) & bad.keys[..., None, cols]).any(-1)
    if bad.rows is not None:
        rows = bad.rows.reshape(-1, call.T).any(0).nonzero().squeeze(-1)  # (nr,) bad somewhere
        alive = allowed(call, rows=rows).any(-1)  # (*batch, nr)
        hit[..., rows] |= alive & bad.rows[..., rows]
    return out.masked_fill(hit.unsqueeze(-1), float("nan"))


def allowed(
    call: AttentionCall, *, rows: Tensor | None = None, cols: Tensor | None = None
) -> Tensor:
    """Whether query ``rows`` may attend to keys ``cols`` (None: all), under every mask of the
    call (attn_mask, is_causal, mask_mod; a float mask's ``-inf`` hides a key).

    Shape:
        rows ``(nr,)``, cols ``(nc,)`` int64 -> ``(*batch, nr, nc)`` bool.
    """
    B, H = call.BH
    dev = call.device
    rows = torch.arange(call.T, device=dev) if rows is None else rows
    cols = torch.arange(call.S, device=dev) if cols is None else cols
    nr, nc = rows.numel(), cols.numel()
    out = torch.ones(1, 1, nr, nc, dtype=torch.bool, device=dev)  # (1, 1, nr, nc)
    q, kv = rows.view(1, 1, nr, 1), cols.view(1, 1, 1, nc)
    if call.attn_mask is not None:
        mask = call.mask_4d(call.attn_mask)  # (B?, H?, T?, S?)
        mask = mask[..., rows, :] if mask.shape[-2] > 1 else mask
        mask = mask[..., cols] if mask.shape[-1] > 1 else mask
        out = out & (mask if mask.dtype == torch.bool else ~torch.isneginf(mask))
    if call.is_causal:
        out = out & (kv <= q)
    if call.mask_mod is not None:
        b, h, _, _ = index_grid(B, H, 1, 1, device=dev)
        out = out & evaluate_mask(call.mask_mod, b, h, q, kv)
    return out.expand(B, H, nr, nc).reshape(call.batch + (nr, nc))
