"""The tiled backend under ``torch.compile``: its forward and backward as ``torch.library``
custom ops, so that a structured mask keeps its block skipping (and O(T + S) memory) in a
compiled graph instead of becoming a dense ``(T, S)`` mask.

Planning reads the mask's tensors (document ids, lengths) on the host, which a graph cannot
do; inside a custom op it runs on the real tensors at run time, where the graph cannot see
it. What crosses the op boundary is what a graph can hold:

* the masks' *description*, a string of constants (``spec``): which qkv mask types, how they
  combine, their alignment. It is fixed at trace time, so a new description is a new graph;
* their integers (window sizes, offsets, lengths given as ints) as a ``SymInt`` list, so a
  bottom-right window's offset ``S - T`` stays symbolic and new lengths do not recompile;
* their floats (a softcap) and their tensors (ids, lengths, slopes, a dense bool mask) as
  graph inputs, so new ids in the same shape recompile nothing.

Only qkv's own mask and score types (exact types, as :func:`qkv.masks.structure_key`) are
described; a plain-function mask_mod/score_mod, a score_mod reading a tensor that requires
grad, or dropout keep the dense traceable path (:func:`usable` says no). A score_mod the
matmul kernel runs (softcap; ALiBi where torch's flash kernel cannot take the call) is
differentiated by its closed-form ``derivative``, since an op's kernel cannot call autograd. Under
``torch.export`` the dense path is kept too, so that exported programs (and ONNX) hold only
standard operators. Attention sinks ride along as one more tensor input, with their gradient.

The same descriptions carry the NaN/inf part of the mask contract into two small ops for the
other compiled paths, which return at once on finite inputs as eager qkv does:
``qkv::nonfinite_rows`` (the rows to set to NaN) and ``qkv::checked_output`` (an inference
call's output, checked, and redone under the eager contract only when it is not finite).

Shape alphabet: B batch, H heads, T query length, S key length, D head dim, Dv value dim.
"""

from __future__ import annotations

import ast
import functools

import torch
from torch import Tensor

from ... import masks as M
from .. import nonfinite
from ..base import compiling_plainly
from ..call import AttentionCall
from ..reference import ReferenceBackend
from .backend import sinks_by_row, work_inputs
from .backward import _backward, _sink_grad
from .forward import _acc, _forward, _with_sinks
from .plan import (
    BLOCK_K,
    BLOCK_Q,
    _DenseMask,
    _pick_inner,
    _plan_for,
    _refuse_flash,
)

__all__ = ["tiled_attention_op", "usable"]


def usable(call: AttentionCall) -> bool:
    """Whether ``call`` can run as the custom op here: under ``torch.compile`` (not export,
    not inside a ``torch.func`` transform), with masks this module can describe."""
    if not compiling_plainly():
        return False  # export keeps standard operators; vmap and torch.func.grad have no
        # rules for custom ops here
    if call.dropout_p > 0:
        return False
    score = call.score_mod
    if score is not None:
        score = score.bind(*call.BH, call.T, call.S)
        matmul = _pick_inner(call, call.work_dtype) != "flash" or (
            call.attn_mask is not None and call.attn_mask.requires_grad
        )
        if matmul and not _differentiable_in_op(score):
            return False  # the matmul kernel pulls dS back through the score_mod; inside a
            # custom op there is no autograd to call, only a closed-form derivative
    return _describe(_bound_mask(call), _Parts()) is not None and (
        score is None or _describe(score, _Parts()) is not None
    )


def _differentiable_in_op(score: M.ScoreMod) -> bool:
    """Whether the op's backward can pull dS back through ``score`` without autograd: it gives
    its derivative (softcap, ALiBi: only qkv's own types are described, and both give it) and
    none of its tensors wants a gradient of its own."""
    gives = type(score).derivative is not M.ScoreMod.derivative
    return gives and not any(t.requires_grad for t in score.tensors())


def tiled_attention_op(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """:func:`qkv.ops.tiled.tiled_attention` through the custom ops (``usable(call)``).

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)``.
    """
    q, k, v, bias = work_inputs(call)  # (B, H, L, E) each, in the work dtype
    B, H = call.BH
    inner = _pick_inner(call, q.dtype)
    if bias is not None and bias.requires_grad:
        inner = _refuse_flash(None, "a float attn_mask that requires grad")
    parts = _Parts()
    mask_spec = _describe(_bound_mask(call), parts)
    score = call.score_mod
    score_spec = _describe(None if score is None else score.bind(B, H, call.T, call.S), parts)
    spec = f"({mask_spec}, {score_spec})"
    sinks = sinks_by_row(call)  # (B, H, T) or None
    out, lse = torch.ops.qkv.tiled_forward(
        q,
        k,
        v,
        bias,
        sinks,
        parts.tensors,
        parts.ints,
        parts.floats,
        spec,
        float(call.scale),
        inner,
    )
    out = out.to(call.dtype).reshape(call.out_shape)
    return out, lse.reshape(call.batch + (call.T,))


def nonfinite_rows(call: AttentionCall, bad_q: Tensor, bad_keys: Tensor) -> Tensor | None:
    """The rows the mask contract makes NaN: those that may attend to a bad key, and bad
    query rows that may attend to some key; through the ``qkv::nonfinite_rows`` op, which
    returns at once when nothing is bad. None where the op cannot be used (not compiling
    plainly, or masks it cannot carry); the caller then searches in the graph.

    Shape:
        bad_q ``(*qbatch, T)``; bad_keys ``(*kbatch, S)`` (GQA heads expanded) -> ``(*batch, T)``.
    """
    if not compiling_plainly():
        return None
    parts = _Parts()
    spec = _describe(_bound_mask(call), parts)
    if spec is None:
        return None
    mask = call.attn_mask
    bias = call.mask_4d(mask) if mask is not None and mask.is_floating_point() else None
    B, H = call.BH
    hit = torch.ops.qkv.nonfinite_rows(
        bad_q.expand(call.batch + (call.T,)).reshape(B, H, call.T),
        bad_keys.expand(call.batch + (call.S,)).reshape(B, H, call.S),
        bias,
        parts.tensors,
        parts.ints,
        parts.floats,
        spec,
    )  # (B, H, T)
    return hit.reshape(call.batch + (call.T,))


def checked_inference(call: AttentionCall, run_call) -> Tensor | None:
    """``run_call(call)`` with the NaN/inf part of the mask contract checked as eager qkv
    checks it with no gradient wanted: the output summed, and only when that is not finite
    the call run again on cleaned inputs (``ops/nonfinite.run``, eagerly, inside the
    ``qkv::checked_output`` op; the reference math runs that repair). None where the op
    cannot be used (gradients, traces, dropout, masks it cannot carry).

    Shape:
        -> ``(*batch, T, Dv)``.
    """
    if not compiling_plainly() or call.dropout_p > 0 or call.return_trace or call.sinks is not None:
        return None
    parts = _Parts()
    mask_spec = _describe(_bound_mask(call), parts)
    score = call.score_mod
    score_spec = _describe(None if score is None else score.bind(*call.BH, call.T, call.S), parts)
    if mask_spec is None or score_spec is None:
        return None
    mask = call.attn_mask
    bias = mask if mask is not None and mask.is_floating_point() else None
    out = run_call(call)
    return torch.ops.qkv.checked_output(
        out,
        call.query,
        call.key,
        call.value,
        bias,
        parts.tensors,
        parts.ints,
        parts.floats,
        f"({mask_spec}, {score_spec})",
        float(call.scale),
        call.enable_gqa,
    )


def _bound_mask(call: AttentionCall):
    """The call's masks as one bound mask_mod (``tiled._plan`` combines them alike)."""
    mods = [m for m in (call.mask_mod, M.causal() if call.is_causal else None) if m is not None]
    mask = call.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        mods.append(_DenseMask(call.mask_4d(mask)))
    if not mods:
        return None
    mod = mods[0] if len(mods) == 1 else M.and_masks(*mods)
    return mod.bind(*call.BH, call.T, call.S)


# --- describing masks -----------------------------------------------------------------------


class _Parts:
    """The values a description refers to by position: ``('i', n)``, ``('f', n)``, ``('t', n)``."""

    def __init__(self) -> None:
        self.ints: list = []
        self.floats: list[float] = []
        self.tensors: list[Tensor] = []

    def int(self, n) -> str:
        if n is None:
            return "None"
        self.ints.append(n)
        return f"('i', {len(self.ints) - 1})"

    def float(self, x: float) -> str:
        self.floats.append(float(x))
        return f"('f', {len(self.floats) - 1})"

    def tensor(self, t: Tensor) -> str:
        for i, seen in enumerate(self.tensors):
            if seen is t:
                return f"('t', {i})"
        self.tensors.append(t)
        return f"('t', {len(self.tensors) - 1})"


def _is_window(mod) -> bool:
    """A ``_Window``, or a subclass that changes neither what it allows nor its blocks (the
    Hugging Face integration's fixed-offset window)."""
    kind = type(mod)
    return (
        isinstance(mod, M._Window)
        and kind.__call__ is M._Window.__call__
        and (kind.blocks is M._Window.blocks and kind._off is M._Window._off)
    )


def _describe(mod, parts: _Parts) -> str | None:
    """A literal (tuples of constants) describing the bound ``mod``; None when it cannot be
    described (then the op is not used)."""
    if mod is None:
        return "None"
    kind = type(mod)
    if _is_window(mod):
        return (
            f"('window', {parts.int(mod.left)}, {parts.int(mod.right)}, '{mod.align}', "
            f"'{mod.name}', {parts.int(mod.offset)})"
        )
    if kind is M._KeysBefore:
        n = parts.tensor(mod.n) if isinstance(mod.n, Tensor) else parts.int(mod.n)
        return f"('keys_before', {n}, '{mod.name}')"
    if kind is M._Document:
        return f"('document', {parts.tensor(mod.q_ids)}, {parts.tensor(mod.kv_ids)})"
    if kind is M._Combined:
        inner = [_describe(m, parts) for m in mod.mods]
        described = [s for s in inner if s is not None]
        if len(described) < len(inner):
            return None
        return f"('{mod.op}', ({', '.join(described)},))"
    if kind is _DenseMask:
        return f"('dense', {parts.tensor(mod.mask)})"
    if kind is M._Alibi:
        return f"('alibi', {parts.tensor(mod.slopes)})"
    if kind is M._Softcap:
        return f"('softcap', {parts.float(mod.cap)})"
    return None


@functools.lru_cache(maxsize=256)
def _parse(spec: str):
    return ast.literal_eval(spec)


def _rebuild(node, ints, floats, tensors):
    """The bound mask or score object a description stands for, with these values."""

    def value(ref):
        if ref is None:
            return None
        where, i = ref
        return {"i": ints, "f": floats, "t": tensors}[where][i]

    if node is None:
        return None
    kind = node[0]
    if kind == "window":
        _, left, right, align, name, offset = node
        return M._Window(value(left), value(right), align, name, value(offset))
    if kind == "keys_before":
        return M._KeysBefore(value(node[1]), node[2])
    if kind == "document":
        return M._Document(value(node[1]), value(node[2]))
    if kind in ("and", "or"):
        return M._Combined(tuple(_rebuild(n, ints, floats, tensors) for n in node[1]), kind)
    if kind == "dense":
        return _DenseMask(value(node[1]))
    if kind == "alibi":
        return M._Alibi(value(node[1]))
    if kind == "softcap":
        return M._Softcap(value(node[1]))
    raise ValueError(f"qkv.tiled_forward: unknown mask description {kind!r}")


def _plan(q: Tensor, k: Tensor, bias, tensors, ints, floats, spec: str, scale: float, inner: str):
    mask_node, score_node = _parse(spec)
    mask_mod = _rebuild(mask_node, ints, floats, tensors)
    score_mod = _rebuild(score_node, ints, floats, tensors)
    plan = _plan_for(
        q.shape[0],
        q.shape[1],
        q.shape[2],
        k.shape[2],
        scale,
        mask_mod,
        score_mod,
        inner,
        q.device,
        bias is None or bias.dtype == torch.bool,
        BLOCK_Q,
        BLOCK_K,
    )
    plan.bias = bias
    return plan


# --- the ops --------------------------------------------------------------------------------


def _nonfinite(plan, q: Tensor, k: Tensor, v: Tensor, bias):
    """The inputs with NaN/inf rows zeroed, and the rows the mask contract makes NaN ``(B, H,
    T, 1)`` bool; ``(None, None)`` when every input is finite (one reduction each, as eager
    qkv checks: ``ops/nonfinite.py``)."""
    call = AttentionCall.build(
        q, k, v, bias, 0.0, False, plan.scale, False, False, plan.mask_mod, None
    )
    cleaned, bad = nonfinite._clean(call)
    if bad is None:
        return None, None
    hit = nonfinite._poison(q.new_zeros(q.shape[:-1] + (1,)), call, bad).isnan()  # (B, H, T, 1)
    return cleaned, hit


@torch.library.custom_op("qkv::tiled_forward", mutates_args=())
def _tiled_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    tensors: list[Tensor],
    ints: list[int],
    floats: list[float],
    spec: str,
    scale: float,
    inner: str,
) -> tuple[Tensor, Tensor]:
    """Output ``(B, H, T, Dv)`` and log-sum-exp ``(B, H, T)``, both in the accumulation dtype
    (float32, or float64 for float64 inputs; lse ``-inf`` on rows with no key): the caller
    rounds the output, and the backward's ``rowsum(dO * O)`` reads it unrounded, as eager's
    tiled backend does. The mask contract for NaN/inf inputs is kept here, as eager qkv keeps
    it around every backend."""
    plan = _plan(q, k, bias, tensors, ints, floats, spec, scale, inner)
    cleaned, hit = _nonfinite(plan, q, k, v, bias)
    if cleaned is not None:
        q, k, v = cleaned.query, cleaned.key, cleaned.value
    out, lse = _forward(plan, q, k, v, out_dtype=_acc(q.dtype))
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks)
    return (out, lse) if hit is None else (out.masked_fill(hit, float("nan")), lse)


@_tiled_forward.register_fake
def _(q, k, v, bias, sinks, tensors, ints, floats, spec, scale, inner):
    B, H, T = q.shape[0], q.shape[1], q.shape[2]
    acc = _acc(q.dtype)
    return q.new_empty(B, H, T, v.shape[-1], dtype=acc), q.new_empty(B, H, T, dtype=acc)


@torch.library.custom_op("qkv::tiled_backward", mutates_args=())
def _tiled_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    tensors: list[Tensor],
    ints: list[int],
    floats: list[float],
    spec: str,
    scale: float,
    inner: str,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias, dsinks)``; dbias is empty unless ``bias_grad``, dsinks unless
    there are sinks (out and lse are then the sink-inclusive ones). With NaN/inf inputs, the
    gradients of eager qkv's contract: none through a NaN row, none to a bad input row."""
    plan = _plan(q, k, bias, tensors, ints, floats, spec, scale, inner)
    cleaned, hit = _nonfinite(plan, q, k, v, bias)
    qc, kc, vc = (q, k, v) if cleaned is None else (cleaned.query, cleaned.key, cleaned.value)
    if hit is not None:
        out, dout = out.masked_fill(hit, 0.0), dout.masked_fill(hit, 0.0)
    dq, dk, dv, dbias, _ = _backward(plan, qc, kc, vc, out, lse, dout, (), bias_grad)
    if cleaned is not None:
        dq, dk, dv = (
            g.masked_fill(~torch.isfinite(t).all(-1, keepdim=True), 0.0)
            for g, t in ((dq, q), (dk, k), (dv, v))
        )
    dsinks = q.new_empty(0) if sinks is None else _sink_grad(sinks, out, lse, dout)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias, dsinks


@_tiled_backward.register_fake
def _(q, k, v, out, lse, dout, bias, sinks, tensors, ints, floats, spec, scale, inner, bias_grad):
    dbias = torch.empty_like(bias) if bias_grad else q.new_empty(0)  # zeros_like's layout
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),  # contiguous
        dbias,
        dsinks,
    )


def _setup_context(ctx, inputs, output):
    q, k, v, bias, sinks, tensors, ints, floats, spec, scale, inner = inputs
    out, lse = output
    ctx.bias_grad = bias is not None and bias.requires_grad
    ctx.has_bias, ctx.has_sinks, ctx.n_tensors = bias is not None, sinks is not None, len(tensors)
    ctx.args = (ints, floats, spec, scale, inner)
    saved = (
        (q, k, v, out, lse)
        + ((bias,) if bias is not None else ())
        + ((sinks,) if sinks is not None else ())
        + tuple(tensors)
    )
    ctx.save_for_backward(*saved)


def _backward_rule(ctx, dout, _dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    bias = rest.pop(0) if ctx.has_bias else None
    sinks = rest.pop(0) if ctx.has_sinks else None
    ints, floats, spec, scale, inner = ctx.args
    dq, dk, dv, dbias, dsinks = torch.ops.qkv.tiled_backward(
        q, k, v, out, lse, dout, bias, sinks, rest, ints, floats, spec, scale, inner, ctx.bias_grad
    )
    # the structure of the op's inputs, as torch.library flattens them: a list of tensors is
    # a list, a non-empty list of numbers is one leaf, an empty list an empty list
    return (
        dq,
        dk,
        dv,
        dbias if ctx.bias_grad else None,
        dsinks if ctx.has_sinks else None,
        [None] * ctx.n_tensors,
        None if ints else [],
        None if floats else [],
        None,
        None,
        None,
    )


_tiled_forward.register_autograd(_backward_rule, setup_context=_setup_context)


@torch.library.custom_op("qkv::nonfinite_rows", mutates_args=())
def _nonfinite_rows(
    bad_q: Tensor,
    bad_keys: Tensor,
    bias: Tensor | None,
    tensors: list[Tensor],
    ints: list[int],
    floats: list[float],
    spec: str,
) -> Tensor:
    """``(B, H, T)`` bool: rows that may attend to a bad key, and bad rows that may attend to
    some key (``ops/nonfinite._poison``), from ``bad_q`` ``(B, H, T)`` and ``bad_keys``
    ``(B, H, S)``. All False, at the cost of two reductions, when nothing is bad."""
    B, H, T = bad_q.shape
    S = bad_keys.shape[-1]
    if not (bad_q.any() or bad_keys.any()):
        return torch.zeros(B, H, T, dtype=torch.bool, device=bad_q.device)
    mask_mod = _rebuild(_parse(spec), ints, floats, tensors)  # spec: the mask alone
    q = torch.zeros((B, H, T, 1), device=bad_q.device)
    k = torch.zeros((B, H, S, 1), device=bad_q.device)
    call = AttentionCall.build(q, k, k, bias, 0.0, False, 1.0, False, False, mask_mod, None)
    bad = nonfinite._Bad(bad_keys if bad_keys.any() else None, bad_q if bad_q.any() else None)
    return nonfinite._poison(q, call, bad).isnan()[..., 0]


@_nonfinite_rows.register_fake
def _(bad_q, bad_keys, bias, tensors, ints, floats, spec):
    return bad_q.new_empty(bad_q.shape)


@torch.library.custom_op("qkv::checked_output", mutates_args=())
def _checked_output(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    tensors: list[Tensor],
    ints: list[int],
    floats: list[float],
    spec: str,
    scale: float,
    enable_gqa: bool,
) -> Tensor:
    """``out`` (a copy) when it is finite; else the call again under eager qkv's contract."""
    if nonfinite._finite_sum(out):
        return out.clone()
    mask_node, score_node = _parse(spec)
    call = AttentionCall.build(
        q,
        k,
        v,
        bias,
        0.0,
        False,
        scale,
        enable_gqa,
        False,
        _rebuild(mask_node, ints, floats, tensors),
        _rebuild(score_node, ints, floats, tensors),
    )
    repaired = nonfinite.run(call, lambda c: ReferenceBackend().run(c).out)
    assert isinstance(repaired, Tensor)  # run returns what its run_call does: the output
    return repaired.to(out.dtype)


@_checked_output.register_fake
def _(out, q, k, v, bias, tensors, ints, floats, spec, scale, enable_gqa):
    return torch.empty_like(out)
