"""Functional attention: a superset of ``torch.nn.functional.scaled_dot_product_attention``.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim of query/key, Dv head dim of value.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention as _F_sdpa

from . import autotune, dispatch, recording
from ._nested import any_nested, attend_nested
from .autotune import bucket
from .masks import _Combined, _Document
from .ops import (
    AttentionCall,
    TorchBackend,
    few_rows,
    key_counts,
    nonfinite,
    nonfinite_rows,
    torch_sdpa,
)
from .ops import deformable as _deformable
from .ops import linear as _linear
from .ops._aten import flash_forward, sdpa
from .ops.base import BackendFailedError, tracing
from .ops.call import forward_ad_on
from .ops.deformable.inputs import as_spatial_shapes
from .ops.key_counts import causal_ranges
from .ops.tiled import KernelLane, TiledBackend, kernel_lane
from .ops.tiled import route as tiled_route
from .trace import AttentionTrace, DeformableTrace

__all__ = ["deformable_attention", "linear_attention", "scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    return_trace: bool = False,
    mask_mod=None,
    score_mod=None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """``softmax(query @ key^T * scale + mask) @ value``, exact on every edge case.

    Every input that ``torch.nn.functional.scaled_dot_product_attention`` accepts gives the
    same result here. On top of torch:

    * **One mask contract.** A bool ``attn_mask`` means True = may attend; a float mask is
      added to the scores (cast to the query's dtype, except a float32 mask with float16 or
      bfloat16 queries, which keeps its precision). torch's ``causal_upper_left`` /
      ``causal_lower_right`` objects are taken with their meaning. A query row that may
      attend to nothing outputs exactly 0, its gradients are 0, and nothing is NaN, on every
      backend and dtype, with dropout too. A key a row may not attend to has no effect on
      that row, whatever its values (NaN or inf included).
    * **attn_mask with is_causal=True** is allowed (torch raises): the two are combined, a key
      must pass both. ``is_causal`` is aligned top-left, as in torch: query ``i`` sees keys
      ``j <= i``. For ``T != S`` (x = may attend)::

          T=2, S=4      T=4, S=2
          x . . .       x .
          x x . .       x x
                        x x
                        x x

    * **Structured masks and score changes** (FlexAttention's vocabulary, see ``qkv.masks``):
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)``.
      They combine with ``attn_mask`` and ``is_causal`` (a key must pass all). The ``tiled``
      backend runs them in O(T + S) extra memory, skipping blocks the mask leaves empty;
      ``auto`` sends such calls there.
    * **Attention sinks** (gpt-oss): ``sinks`` holds one logit per query head (or per query
      row) that joins the row's softmax as a key with no value, so a row can put weight on
      "nothing". Gradients reach it. A row that may attend to no key still outputs 0; the
      trace's ``probs`` are the real keys' weights (summing to 1 minus the sink's share) and
      its ``lse`` includes the sink. The tiled and reference backends take sinks (torch's
      SDPA has none).
    * **Traces.** ``return_trace=True`` also returns an :class:`AttentionTrace` with the
      scores, weights (before dropout) and log-sum-exp, from any backend.
    * **Backends.** ``backend="auto"`` picks the fastest that supports the call; naming one
      (``"torch"``, ``"tiled"``, ``"reference"``) that cannot take it raises with the reason.
    * **Checked input.** Bad shapes, dtypes, devices, masks, ``scale`` or ``dropout_p``
      raise ValueError/TypeError naming the numbers and the fix. ``dropout_p`` must be in
      [0, 1) and ``scale`` finite.

    Dropout draws from torch's global generator exactly as torch does, so a call is
    reproducible under ``torch.manual_seed``.

    Args:
        query: Queries.
        key: Keys.
        value: Values.
        attn_mask: Bool (True = may attend) or float (added) mask, broadcastable to the
            scores' shape ``(*batch, T, S)``.
        dropout_p: Probability of dropping an attention weight (kept weights are scaled by
            ``1 / (1 - dropout_p)``). Applied whenever > 0, as in torch: pass 0.0 in eval.
        is_causal: Hide keys after the query position (top-left aligned).
        scale: Factor on ``query @ key^T``; None means ``1 / sqrt(D)``.
        enable_gqa: Share each of G key/value heads across H / G query heads (dim -3).
        backend: ``"auto"`` or a registered backend name.
        return_trace: Also return the AttentionTrace.
        mask_mod: A structured mask, e.g. ``qkv.masks.sliding_window(256)`` (True = may
            attend), or a plain function of the same signature.
        score_mod: A change of the scaled scores before softmax, e.g.
            ``qkv.masks.alibi(slopes)``, ``qkv.masks.softcap(30.0)``, or a plain function.
        sinks: Attention sinks: a logit per query head ``(H,)``, or per query row
            (broadcastable to ``(*batch, T)``), in the units of the scaled (and
            score_mod-changed) scores.

    Returns:
        The output, or ``(output, trace)`` when ``return_trace`` is True.

    Shape:
        query ``(*batch, H, T, D)``; key ``(*batch, G, S, D)``; value ``(*batch, G, S, Dv)``;
        output ``(*batch, H, T, Dv)``. Inputs may have 2 to any number of dims and leading
        dims broadcast as in torch; G == H unless ``enable_gqa`` (then H % G == 0).

    Example:
        >>> q = torch.tensor([[0.0, 2 ** 0.5]]); k = torch.eye(2); v = torch.eye(2)
        >>> qkv.scaled_dot_product_attention(q, k, v)  # [[1, e]] / (1 + e)
        tensor([[0.2689, 0.7311]])
    """
    if recording._STARTED[0] or _ANY_AUTOCAST is None or _ANY_AUTOCAST():
        record = recording.wanted()  # None unless a qkv.capture wants this call's weights
        amp = _autocast_dtype(query)  # None unless torch.autocast is on for the query's device
    else:  # (neither on anywhere: two flags read, where asking made two calls of its own)
        record = amp = None
    args = (attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mods = (mask_mod, score_mod, sinks)
    if record is None and amp is None:  # (almost every call: no context to enter)
        lane = None
        plain = mask_mod is None and score_mod is None and sinks is None  # (by identity:
        # a tensor's == None raises under a torch function mode, torch.device("cuda") too)
        window = None if plain else _lane_mask(mods)
        if not return_trace and (window is not None or plain):
            lane = _lane_key(query, key, value, args, backend, window)  # None: no lane's call
            if lane is not None:
                out = _run_lane(lane, query, key, value, attn_mask, mask_mod)
                if out is not None:
                    return out
        return _attend(query, key, value, args, return_trace, mods, backend, lane)
    if record is not None and any_nested(query, key, value):
        record = None  # nested inputs return no trace: the capture records the packed call
        # they make (qkv._nested), its sequences end to end, weights 0 between them
    query, key, value = (_amp_cast(t, amp) for t in (query, key, value))
    with _autocast_off(query, amp), _recording_paused(record):
        trace_wanted = True if record is not None else return_trace
        result = _attend(query, key, value, args, trace_wanted, mods, backend)
    if record is None:
        return result
    out, trace = result
    record(trace)
    return (out, trace) if return_trace else out


def _whole_call(call: AttentionCall, backend: str):
    """``call`` made again by :func:`scaled_dot_product_attention` with ``backend`` named:
    what ``auto``'s measurement times (``autotune.time_whole_calls``)."""
    return scaled_dot_product_attention(
        call.query,
        call.key,
        call.value,
        call.attn_mask,
        call.dropout_p,
        call.is_causal,
        call.scale,
        call.enable_gqa,
        backend=backend,
        return_trace=call.return_trace,
        mask_mod=call.mask_mod,
        score_mod=call.score_mod,
        sinks=call.sinks,
    )


autotune.time_whole_calls(_whole_call)
tiled_route.time_whole_calls(_whole_call)


def _attend(query, key, value, args: tuple, return_trace, mods: tuple, backend: str, lane=None):
    """One call top-down: check (ops/call.py), plan (dispatch.py), kernel (a backend), and the
    NaN/inf contract around it (ops/nonfinite.py): inputs zeroed before or the output checked
    after, rows set after. ``lane``: the exact kind of call (:func:`_lane_key`) whose kind
    keeps the steps of this call when they make a lane (:func:`_keep_lane`)."""
    parts = (query, key, value, *args, return_trace, *mods)  # AttentionCall.build's order
    if any_nested(query, key, value):  # jagged: packed sequences (see qkv._nested)
        return attend_nested(
            functools.partial(scaled_dot_product_attention, backend=backend), *parts
        )
    # check: ValueError/TypeError naming the numbers and fix
    call = AttentionCall.build(*parts)
    runs = nonfinite.without_hidden_keys(call)  # inference: the keys no row sees dropped
    plan = dispatch.choose(runs, backend)  # plan: the backend, and how a trace is made
    guard = nonfinite.prepare(runs, plan.keeps_nonfinite_contract)  # bad inputs zeroed
    try:
        result, lse = dispatch.run_with_lse(guard.call, plan)  # out (*batch, T, Dv), or (out,
        # trace)
    except BackendFailedError as e:  # its compiler failed for this kind of call (ops/flex.py)
        if backend != "auto":
            raise
        plan = dispatch.choose(runs, backend)  # the failed backend declines the kind now
        by = "the one-pass trace" if plan.backend is None else plan.backend.name
        warnings.warn(f"qkv: {e}; auto runs such calls by {by}", RuntimeWarning, stacklevel=3)
        guard = nonfinite.prepare(runs, plan.keeps_nonfinite_contract)
        result, lse = dispatch.run_with_lse(guard.call, plan)
    if not guard.holds(result):  # an optimistic run met NaN/inf: the full way
        guard = nonfinite.prepare(runs, plan.keeps_nonfinite_contract, optimistic=False)
        result, lse = dispatch.run_with_lse(guard.call, plan)
    if lane is not None:
        _keep_lane(lane, call, plan, guard, mods[0])
    # contract: NaN rows, overflowing scores refused
    return guard.restore(result, lse, plan.torch_kernel)


# --- the lane: a decoding step's call, its steps kept --------------------------------------
#
# At decode sizes (one query, a few hundred keys) torch's kernel takes ~20 us and the steps
# above ~20 more in Python: checking the call, choosing its plan, preparing its guard. A call
# without trace, gradient or dropout that ``auto`` sends to torch's kernel comes to the same
# two steps every time when it has
#   * no mask, and its check after the kernel ("output": every row sees every key): torch's
#     kernel (causal with fewer queries than keys: on the first T keys, which are all a row
#     can see), then the contract's fused pass over the output and the queries;
#   * a bool key mask ``(..., 1, S)`` checked in place ("keys_in_place"): torch's kernel with
#     the mask, then the fused pass that computes again the rows a NaN/inf reached.
# The first call of a kind takes the steps above and keeps those two as its lane; later
# calls of the kind run the lane alone, to the same bits. A kind is what the steps depend on:
# the inputs' shapes (the keys' count by its power-of-two bucket, as ``auto``'s measured
# choice is kept, so that a decoding loop whose cache grows by a key a step stays in it),
# the mask's shape but for its key count, dtypes, the flags, and the dispatcher's state
# (``dispatch.kept_plans_state``).


class _Lane:
    """The kept steps of one kind of call (see above); ``ok`` False for a kind that has none."""

    __slots__ = (
        "causal",
        "check",
        "gqa",
        "group",
        "hidden",
        "keys",
        "lse",
        "narrow",
        "ok",
        "ranged",
        "rows",
        "scale",
        "scale_arg",
        "state",
        "visible",
    )

    def __init__(
        self,
        state,
        ok=False,
        scale=0.0,
        causal=False,
        gqa=False,
        narrow=False,
        D=0,
        group=1,
        lse=False,
        dtype=None,
    ):
        self.state, self.ok, self.scale = state, ok, scale
        # half dtypes without GQA: torch's flash kernel called for its log-sum-exp too, which
        # tells the check the rows it got wrong (a +inf score: a finite row in bf16/fp16)
        # without a scan of the keys (see nonfinite_rows.RowsCheck)
        self.lse = lse
        # a bool key mask's additive form for that kernel, as torch makes it: 0 where visible
        self.visible = self.hidden = None
        if lse:
            self.visible = torch.zeros((), dtype=dtype, device="cpu")  # (lanes are CPU's)
            self.hidden = torch.full((), float("-inf"), dtype=dtype, device="cpu")
        self.causal, self.gqa, self.narrow = causal, gqa, narrow
        self.group = group  # query heads per key head (the kind's shapes fix it)
        # torch's own default scale (the same double) is passed as None: a scale given costs
        # torch's call 0.7 µs at decode sizes (T=1, S=128)
        self.scale_arg = None if D > 0 and scale == 1.0 / math.sqrt(D) else scale
        self.check = nonfinite_rows.RowsCheck()
        self.keys = nonfinite_rows.KeymaskRows()
        # a kind that the tiled backend runs by the few-rows kernel (which keeps the contract
        # itself): the kernel alone, its arguments packed once (``few_rows.Runner``); or by
        # the fused bfloat16 kernel, a window's rows' ranges kept (``tiled.KernelLane``)
        self.rows: few_rows.Runner | KernelLane | None = None
        # top-left causal with a query a key or more (T >= S), checked by its rows' ranges of
        # keys (``nonfinite``'s "ranges_in_place"; the ranges the steps made, kept there)
        self.ranged = False

    def attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        """torch's kernel, as the steps above call it (``ops/_aten.sdpa``); its log-sum-exp
        is :meth:`attend_lse`'s.

        Shape:
            query ``(*batch, T, D)``, key ``(*kbatch, S, D)``, value ``(*kbatch, S, Dv)``,
            mask ``(*mbatch, 1, S)`` -> ``(*batch, T, Dv)``.
        """
        if self.scale <= 0:  # folded into q there
            return sdpa(
                query,
                key,
                value,
                attn_mask=mask,
                dropout_p=0.0,
                is_causal=self.causal,
                scale=self.scale,
                enable_gqa=self.gqa,
            )
        return _F_sdpa(
            query, key, value, mask, 0.0, self.causal, scale=self.scale_arg, enable_gqa=self.gqa
        )

    def attend_lse(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        strides: tuple | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """torch's CPU flash kernel, the one ``torch.nn.functional``'s call takes here, called
        for its log-sum-exp too (a lane with ``lse``: 4-dim half inputs, one key head per
        query head, see ``torch_sdpa._with_lse``), a bool key mask made additive as torch's
        call makes it; a call whose last dims have a step is :meth:`attend`'s, with no lse
        (torch's call takes its math kernel for those, as the usual way does).

        Shape:
            query ``(B, H, T, D)``, key ``(B, H, S, D)``, value ``(B, H, S, Dv)``, mask
            ``(*mbatch, 1, S)`` -> ``(B, H, T, Dv)``, ``(B, H, T)`` float32; ``strides``:
            the ``stride()`` of q, k and v where the caller has read them.
        """
        fast = _flash_cpu
        if strides is None:
            strides = (query.stride(), key.stride(), value.stride())
        if fast is None or not strides[0][-1] == strides[1][-1] == strides[2][-1] == 1:
            return self.attend(query, key, value, mask), None
        additive = None
        if mask is not None:
            additive = torch.where(mask, self.visible, self.hidden)  # (*mbatch, 1, S)
            if additive.dim() < 4:
                additive = additive.reshape((1,) * (4 - additive.dim()) + additive.shape)
        if self.scale <= 0:
            return flash_forward(
                query, key, value, scale=self.scale, is_causal=self.causal, attn_mask=additive
            )
        # (flash_forward's checks come to this for a lane's call: its kind has a key and a
        # row, and a positive scale needs no folding; torch's own scale passed as None)
        return fast(
            query, key, value, is_causal=self.causal, attn_mask=additive, scale=self.scale_arg
        )

    def check_ranges(
        self, out: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor | None
    ) -> bool:
        """A ranged lane's output's pass (``nonfinite_rows.restore_rows`` over each row's
        causal keys ``[0, min(i + 1, S))``, as the steps' guard runs it); False where the
        fused passes cannot take these tensors (then the steps run the call).

        Shape:
            out ``(*batch, T, Dv)``, query ``(*batch, T, D)``, key ``(*kbatch, S, D)``, lse
            ``(*batch, T)`` float32 or None.
        """
        if not nonfinite_rows.takes(query, key, value):
            return False
        spans = causal_ranges(query.shape[-2], key.shape[-2], query.device)  # (1, 1, T) x2
        if lse is not None and lse.shape != out.shape[:-1]:
            lse = None  # (not the kernel's rows: the keys are scanned instead)
        nonfinite_rows.restore_rows(
            out,
            query=query,
            ranges=(None, *spans),
            recompute=(key, value, self.scale, self.group),
            lse=lse,
        )
        return True


def _lane_mask(mods: tuple) -> tuple | None:
    """The kind of a call's mask_mod where its mods are that alone and it may have a lane, else
    None: one sliding window or causal mask (``few_rows.window_kind``: the few-rows kernel's
    lane, its rows' ranges made per call, or the fused bfloat16 kernel's), or one document
    mask alone or ``and`` windows (:data:`_DOCUMENT` first: the fused kernel's lane, which
    checks the ids are the ones it kept; the few-rows kernel takes no documents)."""
    mask_mod, score_mod, sinks = mods
    if score_mod is not None or sinks is not None:
        return None
    if type(mask_mod) is _Document:
        return _DOCUMENT
    if type(mask_mod) is not _Combined:
        return few_rows.window_kind(mask_mod)
    parts = key_counts.and_parts(mask_mod)
    kinds = [_DOCUMENT if type(p) is _Document else few_rows.window_kind(p) for p in parts]
    if None in kinds or kinds.count(_DOCUMENT) != 1:
        return None
    return (*_DOCUMENT, *kinds)


_DOCUMENT = ("document",)  # the lane kind of every document mask (its ids: the lane's to check)


_LANES: dict[tuple, _Lane] = {}  # by kind, and by exact kind (two tuples of other lengths)
_LANES_MAX = 1024  # kinds and exact kinds kept (a growing cache makes one exact kind a step)


def _lane_key(query, key, value, args: tuple, backend, window: tuple | None = None) -> tuple | None:
    """The exact kind of a call that may have a lane (its shapes, dtypes and flags as they
    are), or None: plain CPU tensors, nothing wanting a gradient, outside tracing, flags of
    their own types, no dropout, at least one key, no mask or a bool key mask with contiguous
    keys. :func:`_kind` makes the kind a lane is kept under from it."""
    attn_mask, dropout_p, is_causal, scale, enable_gqa = args
    if (
        type(query) is not Tensor
        or type(key) is not Tensor
        or type(value) is not Tensor
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or query.is_nested  # (a strided nested tensor is a Tensor without sizes)
        or key.is_nested
        or value.is_nested
        or type(dropout_p) is not float
        or dropout_p != 0.0
        or type(is_causal) is not bool
        or type(enable_gqa) is not bool
        or (scale is not None and type(scale) is not float)
        or type(backend) is not str
        or tracing()
        or forward_ad_on()  # (a dual tensor's tangent: the lane's C++ passes have no rule)
    ):
        return None
    if torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    ):
        return None
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(ks) < 2 or len(vs) < 2 or len(qs) < 2:
        return None
    S = ks[-2]
    if S == 0 or vs[-2] != S:
        return None
    mask = None
    if attn_mask is not None:
        if type(attn_mask) is not Tensor:
            return None
        mask = attn_mask.shape
        if (
            attn_mask.dtype != torch.bool
            or not attn_mask.is_cpu
            or len(mask) < 2
            or mask[-2] != 1
            or mask[-1] != S
            or attn_mask.stride(-1) != 1
        ):
            return None
    dtypes = (query.dtype, key.dtype, value.dtype)
    return (qs, ks, vs, dtypes, is_causal, scale, enable_gqa, backend, mask, window)


def _kind(exact: tuple) -> tuple:
    """The kind a lane is kept under, of a call's exact kind (:func:`_lane_key`): its key
    count by power-of-two bucket (and the mask's shape without it)."""
    qs, ks, vs, dtypes, is_causal, scale, enable_gqa, backend, mask, window = exact
    S = ks[-2]
    return (
        qs,
        ks[:-2],
        ks[-1],
        vs[:-2],
        vs[-1],
        bucket(S),
        is_causal and qs[-2] < S,
        dtypes,
        is_causal,
        scale,
        enable_gqa,
        backend,
        None if mask is None else mask[:-1],
        window,
    )


def _run_lane(
    exact: tuple, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, mask_mod=None
) -> Tensor | None:
    """The call by its kind's lane; None when it has none (yet), or its check cannot take
    this output (then the steps above run it). ``exact``: the call's exact kind, under which
    its kind's lane is found again without making the kind (the other layers of a model's
    decoding step meet the same sizes)."""
    lane = _LANES.get(exact)
    state = dispatch.kept_plans_state()
    if lane is None or lane.state != state:
        lane = _LANES.get(_kind(exact))
        if lane is None or lane.state != state:
            return None
        _keep(exact, lane)
    if not lane.ok:
        return None
    if lane.rows is not None:  # (None where the runner does not take these tensors: the steps)
        return lane.rows(query, key, value, mask, lane.causal, lane.scale, mask_mod)
    if mask_mod is not None:  # (a window's kind keeps only the few-rows kernel's lane)
        return None
    if mask is not None:
        if lane.lse:
            out, lse = lane.attend_lse(query, key, value, mask)  # (B, H, T, Dv), (B, H, T)
        else:
            out, lse = lane.attend(query, key, value, mask), None  # (*batch, T, Dv)
        args = (lane.scale, lane.group, exact)
        if lane.keys(out, query, key, value, mask, *args, of_mask=True, lse=lse):
            return out
        if nonfinite_rows.available():  # (as below)
            lane.ok = False
        return None
    if lane.narrow:  # top-left causal, T < S: keys T.. reach no row
        T = query.shape[-2]
        key, value = key.narrow(-2, 0, T), value.narrow(-2, 0, T)  # (*kbatch, T, D|Dv)
    strides = (query.stride(), key.stride(), value.stride())  # (read once for both)
    if lane.lse:
        out, lse = lane.attend_lse(query, key, value, None, strides)  # (B, H, T, Dv), (B, H, T)
    else:
        out, lse = lane.attend(query, key, value, None), None  # (*batch, T, Dv)
    if lane.ranged:
        if lane.check_ranges(out, query, key, value, lse):
            return out
    elif lane.check(out, query, (query, key, value), lane.scale, lane.group, exact, lse, strides):
        return out
    if nonfinite_rows.available():  # the check cannot take this layout: the steps above from
        lane.ok = False  # now on, for every exact kind of its kind (without the library:
    return None  # until it is back)


def _keep(key: tuple, lane: _Lane) -> None:
    """``_LANES[key] = lane``, all of them forgotten when there are ``_LANES_MAX``."""
    if len(_LANES) >= _LANES_MAX:
        _LANES.clear()
    _LANES[key] = lane


def _keep_lane(
    exact: tuple, call: AttentionCall, plan: dispatch.Plan, guard, mask_mod=None
) -> None:
    """Keep the lane of ``call``'s kind, or that it has none (the steps it took, see above).
    ``exact``: the call's exact kind (:func:`_lane_key`); ``mask_mod``: the one the caller
    passed (the call may hold it as its ``is_causal``)."""
    kind = _kind(exact)
    state = dispatch.kept_plans_state()
    kept = _LANES.get(kind)
    if (
        state is None
        or tiled_route.measuring()
        or (kept is not None and kept.state == state and not kept.ok)
    ):
        return  # (none kept while foreign backends are registered, nor of the calls that time
        # a kind's ways (each held to one); a kind found to have none keeps that: a lane whose
        # check cannot take its layout would run the kernel twice)
    narrow = call.is_causal and call.T < call.S
    ranged = call.is_causal and not narrow and call.attn_mask is None
    if ranged:  # top-left causal, T >= S: the rows' ranges of keys checked
        steps = guard.check == "ranges_in_place" and guard.call is call
    elif call.attn_mask is None:
        steps = guard.check == "output" and guard.call.key.shape[-2] == (
            call.T if narrow else call.S
        )
    else:  # a bool key mask (``_lane_key``)
        steps = (
            guard.check == "keys_in_place"
            and guard.call is call
            and not call.is_causal
            and call.attn_mask.dtype == torch.bool
        )
    rows = _rows_lane(call, plan)
    kernel = None if rows else _kernel_lane(call, plan, mask_mod)
    ok = (
        rows
        or kernel is not None
        or (
            steps
            and type(plan.backend) is TorchBackend
            and not plan.keeps_nonfinite_contract
            and call.mask_mod is None
            and call.work_dtype == call.dtype
            and not nonfinite.scale_may_overflow(call)
        )
    )
    group = call.query.shape[-3] // call.key.shape[-3] if call.enable_gqa else 1
    lse = (  # (the usual way's own choice; a kind with a row, see attend_lse)
        torch_sdpa._with_lse(call, call.attn_mask)
        and call.query.numel() > 0
        and _flash_cpu is not None
    )
    lane = _Lane(
        state,
        ok,
        call.scale,
        call.is_causal,
        call.enable_gqa,
        narrow,
        call.D,
        group,
        lse and not rows and kernel is None,
        call.dtype,
    )
    if rows:
        lane.rows, lane.narrow = few_rows.Runner(), False  # (the kernel takes the causal rows)
    elif kernel is not None:
        lane.rows, lane.narrow = kernel, False  # (a window's ranges hold the causal rows)
    else:
        lane.ranged = ranged
    _keep(kind, lane)
    if kernel is not None:  # (its key count's own: kept under the exact kind too, where the
        _keep(exact, lane)  # kind's lane of another count may have been kept before)


def _rows_lane(call: AttentionCall, plan: dispatch.Plan) -> bool:
    """Whether ``call``'s kind keeps the few-rows kernel as its lane: the tiled backend ran it
    by that kernel (:func:`few_rows.usable`), on 4-dim inputs and a 4-dim mask if any (what
    ``few_rows.Runner`` takes as it is)."""
    mask = call.attn_mask
    return (
        type(plan.backend) is TiledBackend
        and plan.keeps_nonfinite_contract
        and call.query.dim() == call.key.dim() == call.value.dim() == 4
        and (mask is None or mask.dim() == 4)
        and few_rows.usable(call)
    )


def _kernel_lane(call: AttentionCall, plan: dispatch.Plan, mask_mod) -> KernelLane | None:
    """The fused bfloat16 kernel's lane of ``call``'s kind (``tiled.kernel_lane``) where the
    tiled backend ran it by that kernel, else None."""
    if type(plan.backend) is not TiledBackend or not plan.keeps_nonfinite_contract:
        return None
    return kernel_lane(call, mask_mod)


class KeptLane:
    """One caller's lane, kept by the caller for a call it repeats with the same shapes but
    for the key count (a module's decoding step, whose cache grows a key a step): later calls
    run it without the lookups above (the exact kind made and hashed, the tables read; a
    decoding step of ``MultiHeadAttention`` went from 1.33-1.36x to 1.24-1.26x torch's by
    hand with this and the module's own trims, benchmarks/RESULTS.md).

    The caller passes a ``mark`` of what fixes its call's kind besides the key count (the
    query's shape and dtypes, the keys' dtype, the backend). :meth:`run` takes a call whose
    mark is the one kept, whose key count is in the kept bucket, and whose context is still
    a lane's (no gradient, recording, autocast or tracing; the dispatcher's state the one the
    lane was kept under); otherwise it returns None and the caller makes the call the usual
    way, then keeps its lane by :meth:`keep`. A plain call without mask, trace or dropout
    only. A NaN/inf a step meets is the lane's check's to handle, as in ``_run_lane``.
    """

    __slots__ = ("held", "hi", "lane", "lo", "mark")

    def __init__(self) -> None:
        self.lane: _Lane | None = None
        self.mark: tuple | None = None
        self.lo = self.hi = 0
        self.held: Any = None  # the caller's own plan made with this lane (dropped by keep)

    def __deepcopy__(self, memo) -> KeptLane:  # (a copied module finds its own lane: the
        return KeptLane()  # library's handles inside a lane are not to be copied)

    def __reduce__(self):
        return KeptLane, ()

    def keep(
        self,
        mark: tuple,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        backend: str,
        enable_gqa: bool = False,
        mask: Tensor | None = None,
    ) -> None:
        """Keep the lane that the call just made the usual way found or made (none: nothing
        is kept, and :meth:`run` declines until a later :meth:`keep` finds one). The mark
        is the caller's: it fixes ``enable_gqa`` with the shapes. ``mask``: the call's bool
        key mask ``(B, 1, 1, S)`` if it had one (its lane is then kept for the caller's own
        plan: :meth:`run` takes calls without mask, and the mark tells them apart)."""
        self.lane = self.held = None
        exact = _lane_key(query, key, value, (mask, 0.0, False, None, enable_gqa), backend)
        if exact is None:
            return
        state = dispatch.kept_plans_state()
        lane = _LANES.get(exact)
        if lane is None or lane.state != state:  # (as _run_lane: an exact kind's lane kept
            lane = _LANES.get(_kind(exact))  # under another state yields to its kind's)
        if lane is None or not lane.ok or lane.narrow or lane.state != state:
            return
        S = key.shape[-2]
        self.hi = bucket(S)  # the keys' counts of this kind: (hi / 2, hi]
        self.lo = self.hi // 2
        self.lane, self.mark = lane, mark

    def run(self, mark: tuple, query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
        """``scaled_dot_product_attention(query, key, value, enable_gqa=..., backend=...)`` by
        the kept lane, to the same bits; None where this call is not the kept lane's (see
        above).

        Shape:
            query ``(*batch, T, D)``, key ``(*kbatch, S, D)``, value ``(*kbatch, S, Dv)`` ->
            ``(*batch, T, Dv)``.
        """
        lane = self.lane
        if lane is None or not lane.ok or mark != self.mark:
            return None
        if not self.lo < key.shape[-2] <= self.hi:
            return None
        if (
            type(query) is not Tensor
            or type(key) is not Tensor
            or type(value) is not Tensor
            or not (query.is_cpu and key.is_cpu and value.is_cpu)
            or (
                torch.is_grad_enabled()
                and (query.requires_grad or key.requires_grad or value.requires_grad)
            )
            or not lane_context(lane.state)
        ):
            return None
        if lane.rows is not None:
            return lane.rows(query, key, value, None, lane.causal, lane.scale)
        strides = (query.stride(), key.stride(), value.stride())  # (read once for both)
        if lane.lse:
            out, lse = lane.attend_lse(query, key, value, None, strides)  # (B, H, T, Dv), (B, H, T)
        else:
            out, lse = lane.attend(query, key, value, None), None  # (*batch, T, Dv)
        group = lane.group
        if lane.check(out, query, (query, key, value), lane.scale, group, None, lse, strides):
            return out
        if nonfinite_rows.available():  # (as in ``_run_lane``)
            lane.ok = False
        return None


def lane_context(state: tuple | None) -> bool:
    """Whether a call kept under the dispatcher's ``state`` may run by what was kept, here and
    now: no recorder started (the usual way asks it whether it wants the call), no autocast,
    tracing or forward-mode AD, and the dispatcher's state still ``state``."""
    return not (
        recording._STARTED[0]
        or _ANY_AUTOCAST is None
        or _ANY_AUTOCAST()
        or tracing()
        or forward_ad_on()
        or state != dispatch.kept_plans_state()
    )


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)  # (a private name)
# torch's CPU flash kernel as a bound function (its op's packet costs more to call); lanes with
# ``lse`` exist only where ``flash_cpu_available`` (the same kernel)
_flash_cpu = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)


def _autocast_dtype(query) -> torch.dtype | None:
    """The dtype torch.autocast runs SDPA in on the query's device, or None when it is off."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():  # (off everywhere: half the cost)
        return None
    device_type: str | None = "cpu"  # (``device.type`` makes a string each call)
    if type(query) is not Tensor or not query.is_cpu:
        device_type = getattr(getattr(query, "device", None), "type", None)
    try:
        if device_type is None or not torch.is_autocast_enabled(device_type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return None
    return torch.get_autocast_dtype(device_type)


def _amp_cast(t, dtype: torch.dtype | None):
    """Cast as autocast does: floating tensors except float64 (which autocast leaves alone)."""
    if dtype is None or not isinstance(t, Tensor):
        return t
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


def _autocast_off(query, amp: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Under torch.autocast, attention runs in the autocast dtype as torch's SDPA does, on
    every backend alike (``_amp_cast``), and the backends' own matmuls are not autocast
    again."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(query.device.type, enabled=False)


def _recording_paused(record) -> contextlib.AbstractContextManager:
    """A call whose trace a recorder wants runs with recording paused (the recorder is asked
    once, here, not by calls made inside it)."""
    return contextlib.nullcontext() if record is None else recording.paused()


def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    feature_map="elu",
    is_causal: bool = False,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
    return_trace: bool = False,
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

    The softmax kernel ``exp(q . k)`` is replaced by ``phi(q) . phi(k)``, so the sums over keys
    can be taken once::

        out_i = phi(q_i) (sum_j phi(k_j) v_j^T) / (phi(q_i) . sum_j phi(k_j) + eps)

    Non-causal, that is ``phi(Q) (phi(K)^T V)``: O(T + S) time and memory instead of O(T S).
    Causal (``j <= i``; needs T == S), the running sums are computed chunk-wise (matmuls
    inside a chunk of 64 positions, a carried ``M x Dv`` state between chunks): O(T) memory,
    matmul speed. :class:`qkv.LinearAttentionState` continues a causal sequence one token at
    a time in O(1) per token.

    This is a different function from softmax attention (except as FAVOR+'s estimate), not an
    approximation of it by default; with ``feature_map=qkv.Favor(D, M)`` it estimates
    ``softmax(q k^T / sqrt(D))`` without bias, better as M grows.

    * **Feature maps**: ``"elu"`` (``elu(x) + 1``, the paper's), ``"relu"``, ``"favor"`` (alias
      ``"performer"``: FAVOR+ with M = D ln D features, seed 0), a :class:`qkv.Favor` for other
      settings, or any function ``(..., L, D) -> (..., L, M)`` of nonnegative features.
    * **Padding**: ``key_mask`` False keys contribute nothing to either sum (LRA's reference
      linear attention ignores its padding mask; this one does not), whatever their values.
    * A query with nothing to attend (all keys padded, or all-zero features) outputs exactly 0.
    * float16/bfloat16 inputs are computed in float32 (the running sums need it) and the output
      is returned in the input dtype.

    Args:
        query: Queries.
        key: Keys.
        value: Values.
        feature_map: See above.
        is_causal: Position i sees keys j <= i.
        key_mask: Bool, True marks a real key.
        eps: Added to the normaliser; >= 0.
        return_trace: Also return an :class:`AttentionTrace` from the quadratic form:
            ``scores = log(phi(q_i) . phi(k_j))``, ``lse = log(sum_j exp(scores) + eps)``,
            ``probs = exp(scores - lse)`` (so ``out = probs @ value``). It costs (T, S) memory.

    Returns:
        The output, or ``(output, trace)`` when ``return_trace``.

    Shape:
        query ``(*batch, H, T, D)``; key ``(*batch, G, S, D)``; value ``(*batch, G, S, Dv)``
        -> ``(*batch, H, T, Dv)``, with H a multiple of G (grouped heads share keys and
        values); ``(T, D)`` and ``(H, T, D)`` inputs too. key_mask ``(*batch, S)``.

    Example:
        >>> q = k = v = torch.randn(2, 8, 4096, 64)
        >>> out = qkv.linear_attention(q, k, v, is_causal=True)        # (2, 8, 4096, 64)
        >>> out = qkv.linear_attention(q, k, v, feature_map=qkv.Favor(64, 256, seed=1))
    """
    record = recording.wanted()  # None unless a qkv.capture wants this call's weights
    if record is not None:
        with recording.paused():
            out, trace = linear_attention(
                query,
                key,
                value,
                feature_map=feature_map,
                is_causal=is_causal,
                key_mask=key_mask,
                eps=eps,
                return_trace=True,
            )
        record(trace)
        return (out, trace) if return_trace else out
    inp = _linear.prepare(query, key, value, key_mask, is_causal=bool(is_causal))
    eps = _linear.check_eps(eps)
    phi = _linear.resolve_feature_map(feature_map, query.shape[-1])
    if isinstance(phi, _linear.FeatureMap):
        phi.begin_call()  # FAVOR+ redraws here, once for queries and keys
    if is_causal:
        out, _ = _linear.linear_attention_chunked(phi, inp.q, inp.k, inp.v, inp.key_mask, eps)
    else:
        out = _linear.linear_attention_global(phi, inp.q, inp.k, inp.v, inp.key_mask, eps)
    if not return_trace:
        return inp.restore(out)
    with torch.no_grad():
        _, scores, lse = _linear.linear_attention_quadratic(
            phi(inp.q), phi(inp.k), inp.v, is_causal=bool(is_causal), key_mask=inp.key_mask, eps=eps
        )
    lead = inp.out_shape[:-1]  # (*batch, T)
    scores = scores.reshape(lead + (scores.shape[-1],))
    trace = AttentionTrace(scores, _probs(scores, lse.reshape(lead)), lse.reshape(lead), "linear")
    return inp.restore(out), trace


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1))


def deformable_attention(
    value: Tensor,
    spatial_shapes: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    *,
    level_start_index: Tensor | None = None,
    return_trace: bool = False,
) -> Tensor | tuple[Tensor, DeformableTrace]:
    """Multi-scale deformable attention (Deformable DETR; BEVFormer's two attentions), with
    mmcv's meaning and argument order (``multi_scale_deformable_attn``).

    Each query ``q`` and head ``m`` samples every level ``l`` of the value at ``P`` points and
    sums the samples with its weights::

        out[b, q, m] = sum_{l, p} attention_weights[b, q, m, l, p]
                       * bilinear(value_l[b, :, m], sampling_locations[b, q, m, l, p])

    * **Locations** are ``(x, y)`` in ``[0, 1]`` over each level's map, ``(0, 0)`` the top-left
      corner of the top-left pixel: pixel coordinates are ``x * W - 0.5, y * H - 0.5``. The
      sampling is ``F.grid_sample(..., mode="bilinear", padding_mode="zeros",
      align_corners=False)`` at ``grid = 2 * location - 1``: a bilinear corner outside the map
      counts as zero, so a point outside by a pixel or more gives nothing (its gradients are 0).
    * **The weights** are used as given (Deformable DETR softmaxes them over ``L * P`` before).
    * **Exact and deterministic**: held to a float64 ``grid_sample`` reference, forward and
      gradients for value, locations and weights; the backward gives the same bits on every
      run (no atomics: on CPU at every thread count; on CUDA the Triton kernel sums each value
      row's samples in a fixed order). float16/bfloat16 accumulate in float32 and round once.
    * **Fast on CPU**: a C++ kernel, built at first use and cached, that never materialises the
      ``L * P`` samples per output that the ``grid_sample`` form does; where no C++ compiler is
      found, the same computation in PyTorch ops, with a warning. On CUDA a Triton kernel
      (not yet measured on a GPU), else the PyTorch ops. ``QKV_DEFORMABLE_KERNEL=cpp``,
      ``triton`` or ``torch`` forces one.
    * **Compiles and exports**: one custom op, ``qkv::deformable_attention``, with fake and
      autograd rules, so ``torch.compile(fullgraph=True)`` and ``torch.export`` take it whole.
      ``torch.onnx.export`` (ONNX has no such op) writes standard operators instead: one
      ``GridSample`` (opset 16) per level, the level sizes read from spatial_shapes at run time.
    * **See-through**: ``return_trace=True`` also returns a :class:`qkv.DeformableTrace`,
      every sampling point in pixels of its level (``x * W - 0.5, y * H - 0.5``) with its
      weight; ``qkv.capture`` records it from a call inside a model.

    Args:
        value: The levels' maps flattened and concatenated, level by level, each row-major.
        spatial_shapes: ``(H, W)`` per level, an integer tensor (or a list of pairs).
        sampling_locations: ``(x, y)`` per query, head, level and point, in ``[0, 1]``.
        attention_weights: The weight of each sample.
        level_start_index: Where each level starts in ``value`` (mmcv's argument; computed from
            spatial_shapes when None, and checked against it when given).
        return_trace: Also return the :class:`qkv.DeformableTrace` of the call (its
            ``reference_points`` are None: a bare call is given only the locations).

    Returns:
        The weighted samples, heads concatenated; with ``return_trace``, ``(output, trace)``.

    Raises:
        ValueError: Shapes that disagree, or spatial_shapes whose ``sum(H * W)`` is not ``S``,
            or a level_start_index that disagrees with them (the message names the numbers).
        TypeError: Non-float values, or the three float tensors in different dtypes.

    Shape:
        value ``(B, S, M, D)`` with ``S = sum_l H_l * W_l``; spatial_shapes ``(L, 2)``;
        sampling_locations ``(B, Lq, M, L, P, 2)``; attention_weights ``(B, Lq, M, L, P)``;
        level_start_index ``(L,)`` -> ``(B, Lq, M * D)``.
    """
    record = recording.wanted()  # None unless a qkv.capture wants this call's points
    with _recording_paused(record):
        out = _deformable.deformable_attention(
            value,
            spatial_shapes,
            sampling_locations,
            attention_weights,
            level_start_index=level_start_index,
        )  # (B, Lq, M * D); the inputs are checked here, before the trace reads them
    if record is None and not return_trace:
        return out
    trace = DeformableTrace.from_normalized(
        as_spatial_shapes(spatial_shapes), sampling_locations, attention_weights
    )
    if record is not None:
        record(trace)
    return (out, trace) if return_trace else out
