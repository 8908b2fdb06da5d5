"""The trace of a call whose kernel gave no weights, or gave them once: made lazily.

A backend returns the output and, at best, the log-sum-exp of each row; the weights are
``exp(scores - lse)``. They are recomputed when first read, a block of query rows at a time
(``trace.select`` computes only the rows asked for), from the call's inputs, which must be
unchanged since the call: a change in place is noticed by the tensors' version counters, and
reading then raises instead of giving the weights of other inputs.

:func:`trace_from_lse` makes such a trace from a backend's lse (or none);
:func:`trace_of_weights` wraps the weights formed with the output in one pass
(``ops.reference.attention_with_weights``), whose scores and lse are recomputed alike.
``qkv.dispatch`` decides which a call gets.

Shape alphabet: B batch, H heads, T query length, S key length; ``*batch`` as in the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from .ops.call import AttentionCall
from .ops.reference import _shaped, attention_scores_at, take, widened
from .trace import AttentionTrace, probs_from_lse_

__all__ = ["trace_from_lse", "trace_of_weights"]


def trace_of_weights(
    call: AttentionCall, probs: Tensor, lse: Tensor | Callable[[], Tensor]
) -> AttentionTrace:
    """The trace of :func:`attention_with_weights`: its weights, and scores recomputed when
    first read; its lse too when given as a function (``lazy_lse``), which is right only
    while the weights are as it made them: once they were changed in place (they are the
    caller's), the lse is computed from the inputs instead. Inference tensors keep no record
    of such changes, so their lse is computed now."""
    call = _detached(call)
    probs4 = _shaped(probs, call.BH + (call.T, call.S))  # (B, H, T, S)

    def subset(b, h, rows):
        scores = attention_scores_at(widened(call), b, h, rows)  # (nb, nh, nr, S)
        return scores.to(call.dtype), take(probs4, b, h, rows)

    if callable(lse):
        lse = lse() if probs.is_inference() else _lse_while_unchanged(call, probs, lse)
    return AttentionTrace(
        _recompute(call, lambda: _by_row_blocks(call, attention_scores_at)),
        probs,
        lse,
        "reference",
        subset=_recompute(call, subset),
    )


def _detached(call: AttentionCall) -> AttentionCall:
    """The call with its query, key and value (and the tensors they were copied from)
    detached, to be kept by a trace (the same call when none of them requires a gradient: no
    op to dispatch). A detached tensor shares its version counter: changes are still seen."""
    if not any(t.requires_grad for t in (call.query, call.key, call.value, *call.sources)):
        return call
    return dataclasses.replace(
        call,
        query=call.query.detach(),
        key=call.key.detach(),
        value=call.value.detach(),
        sources=tuple(t.detach() for t in call.sources),
    )


def _lse_while_unchanged(
    call: AttentionCall, probs: Tensor, from_weights: Callable[[], Tensor]
) -> Callable[[], Tensor]:
    """``from_weights()`` while ``probs`` is unchanged since now, else the lse recomputed
    from the call's inputs (which must be unchanged: :func:`_recompute`)."""
    version = probs._version
    recompute = _recompute(call, lambda: _lse_by_blocks(call))

    def lse() -> Tensor:
        if probs._version == version:
            return from_weights()
        return recompute()

    return lse


def trace_from_lse(call: AttentionCall, lse, backend: str) -> AttentionTrace:
    """The trace of a backend that gives no weights: ``exp(scores - lse)``, recomputed.

    Lazy: nothing ``(T, S)``-sized exists until it is read. ``trace.scores``/``trace.probs``
    are then computed a block of query rows at a time into one ``(*batch, T, S)`` buffer,
    and ``trace.select`` computes only the rows asked for. Without the backend's lse, it is
    computed now, block by block, from the scores.

    Scores of float16/bfloat16 inputs are recomputed in float32, and the weights formed
    there before rounding to the inputs' dtype: the backend's lse comes from float32 scores,
    and half scores (bfloat16 keeps 8 bits: +-0.125 at a score of 40) minus it would scale
    whole rows by up to e^0.125. Reading after the inputs were modified in place raises.
    """
    call = _detached(call)
    lse = _lse_by_blocks(call) if lse is None else lse.detach()  # (*batch, T)
    lse4 = lse.reshape(call.BH + (call.T,))  # (B, H, T)

    def probs_at(wide: AttentionCall, b, h, rows) -> Tensor:
        scores = attention_scores_at(wide, b, h, rows)  # (nb, nh, nr, S)
        return probs_from_lse_(scores, take(lse4, b, h, rows))

    def subset(b, h, rows):
        scores = attention_scores_at(widened(call), b, h, rows)  # (nb, nh, nr, S)
        probs = probs_from_lse_(scores.clone(), take(lse4, b, h, rows))
        return scores.to(call.dtype), probs.to(call.dtype)

    return AttentionTrace(
        _recompute(call, lambda: _by_row_blocks(call, attention_scores_at)),
        _recompute(call, lambda: _by_row_blocks(call, probs_at)),
        lse,
        backend,
        subset=_recompute(call, subset),
    )


# A block of trace rows holds about 2^24 scores (64 MiB in float32), and at least 16 rows, so
# that the per-block indexing of keys stays small beside the block's matmul.
_BLOCK_ELEMENTS, _BLOCK_ROWS_MIN = 2**24, 16


def _by_row_blocks(
    call: AttentionCall, fn, dtype: torch.dtype | None = None, tail: tuple[int, ...] | None = None
) -> Tensor:
    """``fn(wide_call, b, h, rows)`` for every query row, a block of rows at a time, in one
    buffer of ``dtype`` (default the inputs'): the float32 scores of a half call never exist
    at full size, only a block of them.

    Shape:
        fn gives ``(B, H, nr, *tail)`` (tail default ``(S,)``) -> ``(*batch, T, *tail)``.
    """
    wide = widened(call)
    B, H = call.BH
    tail = (call.S,) if tail is None else tail
    dev = "cpu"  # host-side indices (a view is taken where they are consecutive), whatever
    b, h = torch.arange(B, device=dev), torch.arange(H, device=dev)  # the default device
    step = max(_BLOCK_ROWS_MIN, _BLOCK_ELEMENTS // max(B * H * call.S, 1))
    if step >= call.T:  # one block: its result is the buffer
        whole = fn(wide, b, h, torch.arange(call.T, device=dev)).to(
            dtype or call.dtype
        )  # (B, H, T, *tail)
        return whole.reshape(call.batch + (call.T,) + tail)
    out = torch.empty((B, H, call.T) + tail, dtype=dtype or call.dtype, device=call.device)
    for start in range(0, call.T, step):
        rows = torch.arange(start, min(start + step, call.T), device=dev)
        out[:, :, start : start + len(rows)] = fn(wide, b, h, rows)  # (B, H, nr, *tail)
    return out.reshape(call.batch + (call.T,) + tail)


def _lse_by_blocks(call: AttentionCall) -> Tensor:
    """Log-sum-exp of each row of the scores (in at least float32), block by block.

    Shape:
        ``(*batch, T)``; ``-inf`` for a row with no key.
    """

    def lse_at(wide: AttentionCall, b, h, rows) -> Tensor:
        return torch.logsumexp(attention_scores_at(wide, b, h, rows), dim=-1)  # (B, H, nr)

    return _by_row_blocks(call, lse_at, torch.promote_types(call.dtype, torch.float32), ())


def _recompute(call: AttentionCall, fn):
    """``fn`` run without grad, refusing when the call's inputs changed in place since."""
    versions = _versions(call)

    def run(*args):
        if _versions(call) != versions:
            raise RuntimeError(
                "the inputs of this attention call (query, key, value, attn_mask or a tensor "
                "its mask_mod/score_mod reads) were modified in place after it ran, so its "
                "weights can no longer be recomputed; read trace.probs (or trace.select(...)) "
                "before changing them, or pass copies"
            )
        with torch.no_grad():
            return fn(*args)

    return run


def _versions(call: AttentionCall) -> tuple[int, ...]:
    """Version counters of the call's inputs, to notice changes in place: query, key,
    value, attn_mask, the tensors they were copied from (``AttentionCall.sources``), and the
    tensors its mask_mod and score_mod read (ALiBi slopes, lengths, document ids, tensors a
    plain function captured).

    Inference tensors (made under ``torch.inference_mode()``) have no counter, so they are
    skipped: outside inference mode they cannot be changed in place at all; a change inside
    it goes unnoticed (torch keeps no record of it to check).
    """
    tensors = [call.query, call.key, call.value, call.attn_mask, *call.sources]
    for mod in (call.mask_mod, call.score_mod):
        if mod is not None:
            tensors.extend(mod.tensors())
    return tuple(t._version for t in tensors if t is not None and not t.is_inference())
