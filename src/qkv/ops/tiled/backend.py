"""Tiled backend: FlashAttention's algorithm in PyTorch ops, for structured masks.

Supports: CPU and CUDA; float64/32, bfloat16, float16; ``mask_mod``/``score_mod`` (see
``qkv.masks``), dense bool or float ``attn_mask``, ``is_causal``, GQA, broadcast leading dims,
forward and backward (a float ``attn_mask`` that requires grad gets its gradient, through the
``matmul`` inner kernel). Not supported: dropout (use ``torch`` or ``reference``).

Its slow twin is the reference backend (``reference.py``, the plain math): tests/test_tiled.py
holds the one against the other by the tolerance policy.

The algorithm (Dao et al. 2022, FlashAttention; Rabe & Staats 2021): queries are cut into tiles
of ``bq`` rows and keys into blocks of ``bk``. Before any arithmetic, the mask classifies every
(tile, block) pair as empty, partial or full from index bounds alone (``MaskMod.blocks``):
empty pairs are never computed, full ones need no mask. Each query tile visits the key blocks
it needs in chunks of consecutive blocks; each chunk gives an output normalised over its keys
and the log-sum-exp of its scores, and chunks merge by their log-sum-exps (the online
softmax). Only the output and the log-sum-exp are kept: extra memory is O(T + S) plus one
chunk's scores. Backward recomputes each chunk's weights from the saved log-sum-exp.

Tiles are joined into units before any arithmetic (``plan.py``: ``_units``), so that
the kernel sees few, large calls: consecutive tiles that visit the same keys become one tall
tile (a document's rows; its partial edge blocks are then cut to the keys every row may
attend, and a tile straddling two documents is cut at the boundary, so it needs no mask:
``_trim_edges``, ``_split_rows``), and, for masks and score_mods that depend on ``kv - q``
only (``masks.shift_invariant``: windows, ALiBi), consecutive tiles whose chunks sit at the
same place relative to the tile become a *diagonal group*: one kernel call for all of them,
with the keys read through an overlapping strided view and one mask shared by every tile.
The units of a call are cached by mask structure and sizes (``masks.structure_key``,
``clear_plan_cache``), so a model's next layer or step with the same mask skips planning.

Eager inference of some calls skips the tiles for a C++ kernel that keeps the NaN/inf contract
itself: up to four query rows in float32 or bfloat16 without mask or with a bool key mask
(``ops/few_rows.py``: a decoding step), and bfloat16 rows that attend ranges of keys
(``ops/bf16_scores.py``). A kind of call that took the bfloat16 kernel keeps a lane
(:class:`KernelLane`, kept by ``functional``'s lanes): its later calls run the kernel on the
key ranges the first made, without the steps around it.

Two inner kernels compute a chunk:
  * ``flash``: torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
    and its backward), which returns the chunk's log-sum-exp. Its backward takes the *global*
    output and log-sum-exp, which is exactly the per-chunk decomposition FlashAttention's
    backward needs. Used on CPU when D == Dv and the score_mod is absent or additive.
  * ``matmul``: matmul, softmax and matmul in PyTorch ops; any device, any score_mod (its
    gradient by autograd on the chunk), and gradients for tensors a score_mod reads.
Half precision: the ``matmul`` kernel multiplies in float32 (a score_mod sees scores not
rounded to half, and the weights meet the values unrounded), and the softmax, the merge and
all gradient accumulation are float32 on both kernels; on CPU, float16 inputs and half inputs
with a float32 attn_mask run in float32 (``AttentionCall.work_dtype``).

The package's files, one job each, importing one way (backend -> batch, backward ->
forward -> plan):
  * ``backend.py`` (this file): the backend and its ``supports`` reason, the entry points
    (:func:`tiled_attention`; :func:`piece_forward` and :func:`piece_backward` for a ring's
    pieces) and the autograd Function that joins the two passes, sinks included;
  * ``batch.py``: a batch whose elements attend other keys (padding, documents per
    element) cut into runs of elements, each with a plan of its own keys;
  * ``plan.py``: block planning, from the masks to the units to compute, and the cache
    of plans;
  * ``forward.py``: the pass over the units, each inner kernel's chunk, the merge by
    log-sum-exp;
  * ``backward.py``: FlashAttention's backward over the same units, recomputing each
    chunk's weights with the forward's score helpers.
``op.py`` runs the same passes as ``torch.library`` custom ops under ``torch.compile``.

Shape alphabet: B batch, H query heads, T query length, S key length, D head dim, Dv value
head dim; a tile has ``tq`` queries and a chunk ``kc`` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._identity import identity_key
from ...masks import _Document, score_mod_gradient_inputs
from .. import bf16_scores, few_rows, key_counts
from ..base import BackendResult, tracing
from ..call import AttentionCall
from ..kinds import call_kind
from ..reference import ReferenceBackend, bf16_fusable, bf16_kernel_here, inference_ranges
from . import route
from .backward import _backward, _dense_backward, _sink_grad
from .batch import _Piece, batch_pieces
from .batch import clear_plan_cache as clear_plan_cache
from .forward import _acc, _forward, _with_sinks, merge_by_lse
from .plan import BLOCK_K, BLOCK_Q, _Plan, _plan, _refuse_flash

# names read from here before planning had a file of its own (tests, docs): a monkeypatch
# goes to plan.py, the module that reads them
from .plan import MIN_FULL_RUN as MIN_FULL_RUN
from .plan import PLAN_CACHE_SIZE as PLAN_CACHE_SIZE
from .plan import _plan_cache as _plan_cache

__all__ = [
    "KernelLane",
    "TiledBackend",
    "clear_plan_cache",
    "kernel_lane",
    "merge_by_lse",
    "piece_backward",
    "piece_forward",
    "tiled_attention",
]


class TiledBackend:
    """Blockwise exact attention with block skipping for structured masks."""

    name = "tiled"
    priority = 20  # after torch and triton, before reference

    def supports(self, call: AttentionCall) -> str | None:
        if call.dropout_p > 0:
            return "tiled has no dropout (use torch or reference, or dropout_p=0.0)"
        return None

    def traceable(self, call: AttentionCall) -> bool:
        """Under torch.compile, calls whose masks the custom ops can carry (``tiled_op``)."""
        from . import op as tiled_op

        return tiled_op.usable(call)

    def run(self, call: AttentionCall) -> BackendResult:
        if _nothing_to_tile(call) or call.has_tangents():  # (forward-mode AD: plain math)
            return ReferenceBackend().run(call)
        if tracing():
            from . import op as tiled_op

            if tiled_op.usable(call):
                out, lse = tiled_op.tiled_attention_op(call)
                return BackendResult(out=out, lse=lse)
            # Planning reads mask tensors on the host, which a graph cannot; what the custom op
            # cannot carry (a plain-function mask_mod or score_mod, a score_mod whose tensors
            # want gradients; everything under torch.export and torch.func) runs the dense
            # math in the graph instead, as ``auto`` does there (docs/compile.md): same
            # numbers, a (T, S) score matrix
            return ReferenceBackend().run(call)
        if few_rows.usable(call):  # float32 inference of a few query rows: one C++ call
            rows_out, rows_lse = few_rows.attend(call)
            return BackendResult(out=rows_out, lse=rows_lse)
        if _kernel_runs(call):  # bfloat16 inference with ranges of keys: the fused kernel
            return _by_kernel(call)
        out, lse = tiled_attention(call)
        return BackendResult(out=out, lse=lse)

    def way(self, call: AttentionCall) -> str | None:
        """How this backend runs ``call`` where a measured route decides it, and why, in
        words; runs nothing (``dispatch.explain``). bfloat16 inference with ranges of keys:
        the fused kernel or the plan (``route.py``). None for other calls (one way)."""
        if not _routed(call):
            return None
        return f"{route.RANGES.name.replace('_', ' ')} -> {route.choice(call).reason()}"

    def tune_way(self, call: AttentionCall) -> str | None:
        """Measure the way :meth:`way` names afresh and keep it (``qkv tune``); the same words
        after it, or None where no measured route decides ``call``."""
        if not _routed(call):
            return None
        route.tune(call, _held)
        return self.way(call)

    def keeps_nonfinite_contract(self, call: AttentionCall) -> bool:
        """Whether an eager call keeps the NaN/inf contract itself: the bfloat16 kernel of
        range masks does (see :func:`qkv.ops.reference.bf16_fusable`), and the float32 kernel
        of a few query rows (:func:`qkv.ops.few_rows.usable`)."""
        return (
            not tracing()
            and not _nothing_to_tile(call)
            and not call.has_tangents()
            and (few_rows.usable(call) or _kernel_runs(call))
        )


def _routed(call: AttentionCall) -> bool:
    """Whether :meth:`TiledBackend.run` would decide ``call``'s way by the measured route:
    an eager call with something to tile that the few-rows kernel does not take and the fused
    kernel can (else the way is fixed)."""
    return (
        not tracing()
        and not _nothing_to_tile(call)
        and not call.has_tangents()
        and not few_rows.usable(call)
        and bf16_fusable(call)
    )


def _kernel_runs(call: AttentionCall) -> bool:
    """Whether the fused bfloat16 kernel runs this call: one it can take (inference with
    ranges of keys, :func:`qkv.ops.reference.bf16_fusable`) whose kind measured it faster
    than the plan, or forced (``route.py``)."""
    return bf16_fusable(call) and route.kernel_runs(call, _held)


def _held(call: AttentionCall, way: str) -> object:
    """The backend's run of ``call`` by ``way`` (``"kernel"`` or ``"plan"``): what is timed
    where no whole call is set."""
    return _by_kernel(call) if way == "kernel" else tiled_attention(call)


def _by_kernel(call: AttentionCall) -> BackendResult:
    """``call`` by the fused bfloat16 kernel (``ops/bf16_scores.py``) over its rows' ranges."""
    ranges = inference_ranges(call)
    assert ranges is not None  # (bf16_fusable)
    q, k, v = call.as_4d(grouped=True)  # (B, H, T, D), (B, Hk, S, D), (B, Hk, S, Dv)
    lo, hi, ids = ranges
    out, _, lse = bf16_scores.attend_kernel(q, k, v, call.scale, lo, hi, weights=False, ids=ids)
    return BackendResult(out=out.reshape(call.out_shape), lse=lse.reshape(call.batch + (call.T,)))


class KernelLane:
    """The lane (``functional._Lane.rows``) of a kind of call that :meth:`TiledBackend.run`
    ran by the fused bfloat16 kernel: one sliding window or causal mask_mod
    (``few_rows.window_kind``), or one document mask alone or ``and`` such windows; 4-dim
    inputs of one batch, no ``attn_mask``, no gradient. A later call of the kind runs the
    kernel on the rows' key ranges (and ids) the first call made, without the steps around it
    (the call checked and built, the plan chosen, the guard prepared: 0.2-0.5 ms of Python
    a call, 6-8% of a window call at T = 1024, a third at T = 256). Its choices are asked
    again on each call (the kernel on the native route here, and its kind's measured way,
    ``route.py``), and its ranges are for its key count, its windows' offsets and its
    document ids as they were (the same memory, unchanged since:
    ``_identity.identity_key``; the lane holds them), only (:func:`_fitted`); a call they
    do not fit returns None (the caller takes the steps, which keep a new lane). The kernel
    keeps the NaN/inf contract itself, as in the steps."""

    __slots__ = ("S", "fit", "held", "hi", "ids", "kind", "lo")

    def __init__(
        self,
        kind: str,
        S: int,
        fit: tuple,
        lo: Tensor,
        hi: Tensor,
        ids: tuple | None,
        held: tuple = (),
    ) -> None:
        self.kind, self.S, self.fit, self.lo, self.hi, self.ids = kind, S, fit, lo, hi, ids
        # the document ids whose identity keys ``fit`` holds, kept alive: while they live, no
        # other tensor can have been given their memory (``_identity``), so a key that matches
        # is the same values
        self.held = held

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        keep: Tensor | None,
        causal: bool,
        scale: float,
        mask_mod=None,
    ) -> Tensor | None:
        """``mask_mod``: the call's (of the lane's kind: its ``functional`` kind fixes the
        shapes but the key count, the dtypes and the flags).

        Shape: query ``(B, H, T, D)``, key ``(B, Hk, S, D)``, value ``(B, Hk, S, Dv)`` ->
        ``(B, H, T, Dv)``."""
        S = self.S
        if keep is not None or mask_mod is None or key.shape[-2] != S or route.measuring():
            return None
        if _fitted(mask_mod, query.shape[-2], S) != self.fit:
            return None  # (a window that moves with a cache, other ids, ids changed)
        if not bf16_kernel_here() or route.RANGES.route(self.kind) != "kernel":
            return None
        out, _, _ = bf16_scores.attend_kernel(
            query, key, value, scale, self.lo, self.hi, weights=False, ids=self.ids
        )
        return out


def _fitted(mod, T: int, S: int) -> tuple | None:
    """What a lane's rows' key ranges depend on beyond its kind, for a call of T rows and S
    keys with mask_mod ``mod`` (a window, a document, or their ``and``): each window's offset
    (its alignment bound to the sizes, or the one it carries) and the document ids' identity
    keys (None where one cannot be keyed); None for other masks."""
    offs, docs = [], []
    for part in key_counts.and_parts(mod):
        if type(part) is _Document:
            docs.append((identity_key(part.q_ids), identity_key(part.kv_ids)))
        elif key_counts.is_window(part):
            offs.append(part.bind(1, 1, T, S)._off())
        else:
            return None
    return tuple(offs), tuple(docs)


def kernel_lane(call: AttentionCall, mask_mod) -> KernelLane | None:
    """The lane of ``call``'s kind (see :class:`KernelLane`) where :meth:`TiledBackend.run`
    runs ``call`` by the fused kernel and the lane takes such calls, else None; asked after
    the call ran (its choices are made then), never while a kind's ways are timed (the
    caller's to see to). ``mask_mod``: the caller's (a causal one is the call's
    ``is_causal``)."""
    q, k, v = call.query, call.key, call.value
    fit = None if mask_mod is None else _fitted(mask_mod, call.T, call.S)
    if (
        fit is None
        or len(fit[1]) > 1
        or any(None in keys for keys in fit[1])  # (inference tensors, and others whose
        # changes cannot be seen)
        or call.attn_mask is not None
        or not q.dim() == k.dim() == v.dim() == 4
        or not q.shape[0] == k.shape[0] == v.shape[0]
        or (not call.enable_gqa and k.shape[1] != q.shape[1])
        or tracing()
        or _nothing_to_tile(call)
        or call.has_tangents()
        or few_rows.usable(call)
        or not _kernel_runs(call)
    ):
        return None
    ranges = inference_ranges(call)
    if ranges is None or (ranges[2] is not None) != bool(fit[1]):
        return None
    lo, hi = (r.to(torch.int64).clamp(0, call.S).contiguous() for r in ranges[:2])  # (B?, T)
    held = tuple(
        t
        for part in key_counts.and_parts(mask_mod)
        if type(part) is _Document
        for t in (part.q_ids, part.kv_ids)
    )
    return KernelLane(call_kind(call), call.S, fit, lo, hi, ranges[2], held)


def _nothing_to_tile(call: AttentionCall) -> bool:
    """Empty sizes (no tile at all) and meta tensors (no values to plan blocks on): the
    reference gives the right shapes, dtypes and autograd graph at no cost there."""
    return (
        call.query.numel() == 0 or call.S == 0 or 0 in call.out_shape or call.device.type == "meta"
    )


def tiled_attention(
    call: AttentionCall, *, inner: str | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> tuple[Tensor, Tensor]:
    """Run ``call`` tiled; return the output and the log-sum-exp (``-inf`` on rows with no key).

    ``inner`` forces ``"flash"`` or ``"matmul"`` (tests compare the two); None picks.

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)`` float32 (float64 for float64 inputs).
    """
    q, k, v, bias = work_inputs(call)
    B, H = call.BH
    if bias is not None and bias.requires_grad:
        inner = _refuse_flash(inner, "a float attn_mask that requires grad")
    # tensors the score_mod reads that want gradients (ValueError if hidden)
    grads: tuple[Tensor, ...] = ()
    if call.score_mod is not None:
        grads = score_mod_gradient_inputs(call.score_mod, dtype=_acc(q.dtype), device=q.device)
    sinks = sinks_by_row(call)  # (B, H, T) or None
    pieces = batch_pieces(call, B, H, inner, block_q, block_k, q.dtype)
    if pieces is not None:  # elements attending other keys: each run on its own
        out, lse = _in_pieces(pieces, q, k, v, sinks, grads)
    else:
        plan = _plan(call, B, H, inner, block_q, block_k, q.dtype)
        out, lse = _TiledAttention.apply(plan, q, k, v, bias, sinks, *grads)
    out = out.to(call.dtype).reshape(call.out_shape)  # (B, H, T, Dv), lse (B, H, T)
    return out, lse.reshape(call.batch + (call.T,))


def _in_pieces(
    pieces: list[_Piece],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    grads: tuple[Tensor, ...],
) -> tuple[Tensor, Tensor]:
    """Each piece of a batch (``batch.batch_pieces``: consecutive elements) attends
    its own keys; the outputs and log-sum-exps are joined in batch order. Autograd takes the
    gradients back through the slices (padding keys get 0).

    Shape:
        q ``(B, H, T, D)``, k ``(B, H, S, D)``, v ``(B, H, S, Dv)``, sinks ``(B, H, T)``
        -> out ``(B, H, T, Dv)``, lse ``(B, H, T)``.
    """
    outs, lses = [], []
    for p in pieces:
        keys = slice(p.k0, p.k1)
        rows = None if sinks is None else sinks[p.index]
        out, lse = _TiledAttention.apply(
            p.plan, q[p.index], k[p.index, :, keys], v[p.index, :, keys], None, rows, *grads
        )
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return out, lse


def work_inputs(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v as ``(B, H, L, E)`` in the work dtype (GQA heads expanded), and a float
    attn_mask as the additive bias ``(B?, H?, T, S)`` (None for none or a bool mask)."""
    q, k, v = call.as_4d(call.work_dtype)  # (B, H, T, D), (B, H, S, D), (B, H, S, Dv)
    mask = call.attn_mask
    bias = call.mask_4d(mask) if mask is not None and mask.is_floating_point() else None
    return q, k, v, bias


def piece_forward(
    call: AttentionCall, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of ``call`` as one piece of a larger attention (a ring step):
    no autograd graph, the output in the accumulation dtype so that pieces merge unrounded.
    ``call`` has no dense ``attn_mask`` and no dropout; its mask_mod and score_mod carry the
    piece's positions (``qkv.masks.offset_mask``).

    Shape:
        -> out ``(B, H, T, Dv)`` float32 (float64 for float64 inputs), lse ``(B, H, T)``.
    """
    q, k, v = _work_4d(call)
    B, H = call.BH
    plan = _plan(call, B, H, None, block_q, block_k, q.dtype)
    with torch.no_grad():
        return _forward(plan, q, k, v, out_dtype=_acc(q.dtype))


def piece_backward(
    call: AttentionCall,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
):
    """Gradients of one piece (see :func:`piece_forward`) from the *whole* attention's output
    and log-sum-exp of these query rows, FlashAttention's decomposition: the pieces' dq add
    up to the whole dq, and each piece's dk and dv are its keys' share.

    Returns:
        ``(dq, dk, dv, d_score_tensors)`` in the accumulation dtype; dk and dv with the
        call's G key/value heads (GQA groups summed).

    Shape:
        out, dout ``(B, H, T, Dv)``, lse ``(B, H, T)`` -> dq ``(B, H, T, D)``,
        dk ``(B, G, S, D)``, dv ``(B, G, S, Dv)``.
    """
    q, k, v = _work_4d(call)
    B, H = call.BH
    plan = _plan(call, B, H, None, block_q, block_k, q.dtype)
    grads: tuple[Tensor, ...] = ()
    if plan.score_mod is not None:
        grads = score_mod_gradient_inputs(plan.score_mod, dtype=_acc(q.dtype), device=q.device)
    with torch.no_grad():
        dq, dk, dv, _, dts = _backward(
            plan, q, k, v, out.to(q.dtype), lse, dout, grads, False, cast=False
        )
    if call.enable_gqa:
        G = call.key.shape[-3]
        dk = dk.view(B, G, H // G, *dk.shape[2:]).sum(2)  # (B, G, S, D)
        dv = dv.view(B, G, H // G, *dv.shape[2:]).sum(2)  # (B, G, S, Dv)
    return dq, dk, dv, dts


def _work_4d(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    return work_inputs(call)[:3]


class _TiledAttention(torch.autograd.Function):
    """Forward keeps out and lse; backward recomputes each chunk's weights from lse."""

    @staticmethod
    def forward(
        ctx,
        plan: _Plan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        sinks: Tensor | None,
        *grad_tensors: Tensor,
    ):
        plan.bias = None if bias is None else bias.detach()
        # out kept in the accumulation dtype for the backward's rowsum(dO * O): from a half
        # output, rounded, that sum cancels against dO V^T in dS = P * (dO V^T - rowsum), and
        # a bias gradient (dS summed) came out several ulps off (bf16, 3 ulps where the
        # reference's own error is under 1; tests/test_properties.py found it)
        out, lse = _forward(plan, q, k, v, out_dtype=_acc(q.dtype))  # (B, H, T, Dv), (B, H, T)
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks.detach())
        ctx.plan, ctx.bias_grad = plan, bias is not None and bias.requires_grad
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks, bias, *grad_tensors)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor):
        q, k, v, out, lse, sinks, bias, *grad_tensors = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that are differentiable
            inputs = (q, k, v, bias, sinks, *grad_tensors)
            return (None, *_dense_backward(ctx.plan, inputs, ctx.needs_input_grad[1:], dout))
        # With sinks, out and lse are the whole softmax's (the sink a key with no value), and
        # FlashAttention's backward from them is exactly the sink-augmented attention's.
        dq, dk, dv, dbias, dts = _backward(
            ctx.plan, q, k, v, out, lse, dout, grad_tensors, ctx.bias_grad
        )
        dsinks = None
        if ctx.has_sinks and ctx.needs_input_grad[5]:
            dsinks = _sink_grad(sinks, out, lse, dout)
        return (None, dq, dk, dv, dbias, dsinks, *dts)


def sinks_by_row(call: AttentionCall) -> Tensor | None:
    """The call's sinks as one logit per row of the 4-D view, ``(B, H, T)``, in the
    accumulation dtype (or the sinks' own, if wider). Autograd sums the gradient back over
    the rows a head's logit stands for, so that sum runs in float32 and is rounded to a half
    sink once: summed in the half dtype, one rounding per row put a per-head sink's gradient
    several times the reference's error off (bfloat16, float16; the property suite found it).
    """
    if call.sinks is None:
        return None
    B, H = call.BH
    wide = torch.promote_types(_acc(call.work_dtype), call.sinks.dtype)
    return call.sinks.to(wide).expand(call.batch + (call.T,)).reshape(B, H, call.T)
