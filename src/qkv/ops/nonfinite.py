"""Inputs holding NaN or inf: they may reach only the rows that may attend to them.

The mask contract says a key a row may not attend to has no effect on that row, whatever its
values, and a row that may attend to nothing outputs 0. Every kernel breaks that by
arithmetic alone: a masked weight is exactly 0, but ``0 * inf = NaN`` in ``probs @ value``,
an additive mask leaves ``NaN + -inf = NaN`` in the scores, and a NaN query spoils its row's
statistics even when the row has no key. So a call whose keys, values or queries hold NaN/inf
runs on zeros in their place, and then exactly the rows that may attend to a bad key, and the
rows of a bad query that have a key to attend to, are set to NaN: what plain math gives those
rows is not finite either.

The contract is kept in steps around the kernel, which ``scaled_dot_product_attention``
(``functional.py``) takes in order::

    guard = prepare(call)              # the call to run: bad inputs zeroed now, or not yet
    result = kernel(guard.call)
    guard = guard.inspect(result)      # inference: inputs looked at only if out is not finite
    if guard.rerun:
        result = kernel(guard.call)    # ... and run again when some were bad
    result = guard.restore(result)     # NaN on the rows plain math makes NaN

Cost: when a gradient is wanted, one reduction over q, k and v per call (gradients can be
spoiled while the output is finite), and one over the output. Otherwise only the output is
checked, and the inputs only when it is not finite (a masked bad input always shows there as
NaN). A non-finite output from finite inputs is looked at once more: when the scaled scores
can overflow (a scale like 1e38), the call raises a ValueError naming that.

Under tracing (``torch.compile``, ``torch.export``, ``torch.func``) the same steps are tensor
ops only: no ``.item()``, no branch on values, so the call stays one graph.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from ..masks import evaluate_mask, index_grid
from .base import compiling_plainly, tracing
from .call import AttentionCall

__all__ = ["Guard", "prepare", "run"]

# What a kernel gives: the output, or ``(output, trace)`` when the call asks for a trace.
Result = Tensor | tuple[Tensor, Any]


@dataclasses.dataclass
class _Bad:
    """Which keys and query rows held NaN/inf: ``keys`` ``(*kbatch, S)`` (GQA heads expanded),
    ``rows`` ``(*qbatch, T)``; None where all were finite."""

    keys: Tensor | None
    rows: Tensor | None


@dataclasses.dataclass(frozen=True)
class Guard:
    """The NaN/inf contract of one call, between its steps.

    ``call`` is what the kernel runs: the caller's call, or a copy with the bad rows of q, k
    and v zeroed. ``check`` is what is left to do after the kernel:

    * ``"none"``: nothing (all finite, or a kernel that keeps the contract itself);
    * ``"output"``: eager, no gradient wanted: look at the output, and only when it is not
      finite at the inputs (:meth:`inspect`);
    * ``"eager"``: the inputs were looked at, ``bad`` says which were bad (None: none);
    * ``"traced"``: the same in tensor ops, ``bad`` holds both masks, all False when finite;
    * ``"in_graph"``: traced inference whose output the ``qkv::checked_output`` op checks.

    ``rerun``: the kernel must run again, on ``call`` (the inputs were cleaned after it ran).
    """

    call: AttentionCall
    check: Literal["none", "output", "eager", "traced", "in_graph"]
    bad: _Bad | None = None
    rerun: bool = False

    def inspect(self, result: Result) -> Guard:
        """After the kernel's first run. Eager inference checks the output alone: a finite
        one is done; otherwise the inputs are cleaned now, and the call is to run again when
        some were bad. Every other guard is returned as it is."""
        if self.check != "output":
            return self
        if _finite_sum(_output(result)):
            return Guard(self.call, "none")
        cleaned, bad = _clean(self.call)
        return Guard(cleaned, "eager", bad, rerun=bad is not None)

    def restore(self, result: Result) -> Result:
        """The kernel's result under the contract: NaN on every row that may attend to a bad
        key, and on every bad query row that may attend to some key; a ValueError when finite
        inputs gave a non-finite output because the scaled scores overflow.

        Shape:
            output ``(*batch, T, Dv)`` -> the same.
        """
        if self.check == "eager":
            return _restore_eager(self.call, self.bad, result)
        if self.check == "traced":
            return _restore_traced(self.call, self.bad, result)
        if self.check == "in_graph":
            return _checked_in_graph(self.call, result)
        return result


def prepare(call: AttentionCall, kept: bool = False) -> Guard:
    """The first step: the call the kernel is to run, and what is left to check after it.

    ``kept``: the kernel keeps the contract itself (``dispatch.Plan.keeps_nonfinite_contract``).
    """
    if kept or call.device.type == "meta" or call.query.numel() == 0 or call.key.numel() == 0:
        return Guard(call, "none")
    if tracing():
        return _prepare_traced(call)
    if not _wants_grad(call):
        return Guard(call, "output")  # one reduction over the output, after the kernel
    cleaned, bad = _clean(call)
    return Guard(cleaned, "eager", bad)


def run(call: AttentionCall, run_call: Callable[[AttentionCall], Result]) -> Result:
    """``run_call(call)`` under the contract, the steps above in order: for a caller that
    holds its kernel as a function (the ``qkv::checked_output`` op repairs an output so)."""
    guard = prepare(call)
    result = run_call(guard.call)
    guard = guard.inspect(result)
    if guard.rerun:
        result = run_call(guard.call)
    return guard.restore(result)


# --- eager ----------------------------------------------------------------------------------


def _restore_eager(call: AttentionCall, bad: _Bad | None, result: Result) -> Result:
    out = _output(result)
    if bad is not None:
        return _with_output(result, _poison(out, call, bad))
    if not _finite_sum(out):
        _refuse_overflow(call)  # a non-finite output from finite inputs: overflowing scores?
    return result


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


# --- traced ---------------------------------------------------------------------------------


def _prepare_traced(call: AttentionCall) -> Guard:
    """The contract in tensor ops only, for a traced call. With no gradient wanted, the
    output alone is checked, as eagerly, by the ``qkv::checked_output`` op where the masks
    can be carried to it. Otherwise every call runs on the cleaned inputs (one copy of q, k
    and v) and :func:`_restore_traced` finds the rows to poison.

    (``torch.cond`` would skip the cleaning on finite inputs, but dynamo then lost the
    attribute writes of Hugging Face's KV cache in the same graph: not used.)
    """
    if not _wants_grad(call) and _output_checkable_in_graph(call):
        return Guard(call, "in_graph")
    q, k, v = call.query, call.key, call.value
    bad_q = ~torch.isfinite(q).all(-1)  # (*qbatch, T)
    bad_k = ~torch.isfinite(k).all(-1)  # (*kbatch, S)
    bad_v = ~torch.isfinite(v).all(-1)  # (*kbatch, S)
    cleaned = dataclasses.replace(
        call, query=_zeroed(q, bad_q), key=_zeroed(k, bad_k), value=_zeroed(v, bad_v)
    )
    keys = bad_k | bad_v  # (*kbatch, S)
    if call.enable_gqa:
        keys = keys.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-2)
    return Guard(cleaned, "traced", _Bad(keys, bad_q))


def _zeroed(t: Tensor, bad: Tensor) -> Tensor:
    """``t`` with its ``bad`` rows 0, one traceable op."""
    return torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _restore_traced(call: AttentionCall, bad: _Bad | None, result: Result) -> Result:
    """NaN on the rows to poison. They come from a custom op that returns at once when every
    input is finite (``tiled_op.nonfinite_rows``) where the masks can be carried to it;
    otherwise from a search of the whole ``(T, S)`` grid of allowed pairs, which the compiler
    fuses into one reduction instead of materialising it."""
    from . import tiled_op

    assert bad is not None and bad.keys is not None and bad.rows is not None  # _prepare_traced
    hit = tiled_op.nonfinite_rows(call, bad.rows, bad.keys)  # (*batch, T), or None
    if hit is None:
        ok = allowed(call)  # (*batch, T, S)
        hit = (ok & bad.keys.unsqueeze(-2)).any(-1) | (bad.rows & ok.any(-1))  # (*batch, T)
    out = _output(result).masked_fill(hit.unsqueeze(-1), float("nan"))
    return _with_output(result, out)


def _output_checkable_in_graph(call: AttentionCall) -> bool:
    """Whether ``tiled_op.checked_inference`` takes ``call``: its own conditions (compiling
    plainly; no dropout, trace or sinks; masks and score_mod it can describe), asked before
    the kernel runs, since the inputs are cleaned before it where the op cannot be used."""
    from . import tiled_op

    if not compiling_plainly() or call.dropout_p > 0 or call.return_trace or call.sinks is not None:
        return False
    parts, score = tiled_op._Parts(), call.score_mod
    score = None if score is None else score.bind(*call.BH, call.T, call.S)
    mask_spec = tiled_op._describe(tiled_op._bound_mask(call), parts)
    return mask_spec is not None and tiled_op._describe(score, parts) is not None


def _checked_in_graph(call: AttentionCall, result: Result) -> Result:
    """The output of an inference call, summed in the ``qkv::checked_output`` op and redone
    there under the eager contract only when it is not finite."""
    from . import tiled_op

    # checked_inference takes the kernel as a function; the kernel has already run here
    checked = tiled_op.checked_inference(call, lambda _: result)
    assert checked is not None  # _output_checkable_in_graph(call) said it would take it
    return checked


# --- both -----------------------------------------------------------------------------------


def _output(result: Result) -> Tensor:
    return result[0] if isinstance(result, tuple) else result


def _with_output(result: Result, out: Tensor) -> Result:
    return (out, result[1]) if isinstance(result, tuple) else out


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
