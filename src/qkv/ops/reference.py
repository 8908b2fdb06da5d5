"""Reference backend: attention as plain math, the ground truth of qkv.

Supports every call the dispatcher accepts (any dtype including float64, any mask, causal,
GQA, dropout, leading dims) and returns the full trace directly. It computes in the input
dtype with no upcast, so in float16/bfloat16 it is also the "baseline" of the tolerance policy:
plain math in that dtype, its scores rounded to it as FlashAttention's own baseline
(``attention_ref(upcast=False)``) rounds them. That makes it less accurate in bfloat16 than
the fast backends, which keep scores in float32 (at scale=3, D=32: off by 0.19-0.27 where
torch's kernel is off by 0.011), and it stays so on purpose: with float32 scores here, every
half-precision bound of the suite tightens below what FlashAttention's algorithm meets (the
tiled backend's gradients went beyond 3x that baseline's error on 3 of the property suite's
cases, issue 37). The one-pass weights
(:func:`attention_with_weights`) and the traces of the fast backends form half scores in
float32. Memory is O(T * S) per (batch, head): use a fast backend for long sequences.

Shape alphabet: T query length, S key length, D head dim, Dv value head dim; ``*batch`` is the
broadcast of the inputs' leading dims.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._identity import IdentityCache
from ..masks import apply_mask_, causal_bool, evaluate_mask, evaluate_score, index_grid
from . import bf16_scores, cpu_isa, key_counts, softmax_rows
from ._memory import empty_large
from .base import BackendResult, tracing
from .call import AttentionCall, LastCall

__all__ = [
    "ReferenceBackend",
    "attention_scores",
    "attention_scores_at",
    "attention_with_weights",
    "bf16_fusable",
    "fused_ranges",
    "keeps_nonfinite_contract",
    "masked_softmax",
    "widened",
]


class ReferenceBackend:
    """Plain math: ``softmax(q k^T * scale + mask) v``, with the mask contract built in."""

    name = "reference"
    priority = 100  # slowest: auto picks it only when nothing faster takes the call
    traceable = True  # plain torch ops

    def supports(self, call: AttentionCall) -> str | None:
        return None

    def run(self, call: AttentionCall) -> BackendResult:
        scores = attention_scores(call)  # (*batch, T, S)
        if call.sinks is not None:  # one more column per row: the head's sink, no value
            sink = call.sinks.to(scores.dtype).expand(*call.batch, call.T).unsqueeze(-1)
            probs, lse = masked_softmax(torch.cat([scores, sink], dim=-1))  # (*batch, T, S+1)
            probs = probs[..., :-1]  # (*batch, T, S): the real keys' weights
        else:
            probs, lse = masked_softmax(scores)  # (*batch, T, S), (*batch, T)
        weights = F.dropout(probs, call.dropout_p) if call.dropout_p > 0 else probs
        _, value = call.kv_heads_expanded()
        out = weights.to(value.dtype) @ value  # (*batch, T, Dv)
        return BackendResult(out=out, lse=lse, scores=scores, probs=probs)


def attention_scores(call: AttentionCall) -> Tensor:
    """Scaled scores after masking, before softmax; masked entries are ``-inf``.

    Shape:
        ``(*batch, T, S)``.
    """
    key, _ = call.kv_heads_expanded()
    # Scale the (T, D) queries rather than the (T, S) scores: the same math, T*D work not T*S.
    scores = (call.query * call.scale) @ key.transpose(-2, -1)  # (*batch, T, S)
    if call.score_mod is not None:
        scores = _modified_scores(call, scores)  # (*batch, T, S)
    mask = call.mask()
    if mask is None and call.is_causal:
        mask = causal_bool(call.T, call.S, device=call.device)  # (T, S)
    return apply_mask_(scores, mask)


def attention_scores_at(call: AttentionCall, b: Tensor, h: Tensor, rows: Tensor) -> Tensor:
    """The scores of some batch elements, heads and query rows only, seeing the call as
    ``(B, H, T, S)``: what a trace of a long sequence recomputes instead of all of them.

    Shape:
        b ``(nb,)``, h ``(nh,)``, rows ``(nr,)`` int64 -> ``(nb, nh, nr, S)``.
    """
    query, key, _ = call.as_4d()  # (B, H, T, D), (B, H, S, D)
    q = take(query, b, h, rows)  # (nb, nh, nr, D); indices read on the host (no device sync)
    scores = (q * call.scale) @ take(key, b, h).transpose(-2, -1)  # (nb, nh, nr, S)
    return _modify_at(call, scores, b, h, rows)


def _modify_at(call: AttentionCall, scores: Tensor, b: Tensor, h: Tensor, rows: Tensor) -> Tensor:
    """score_mod and every mask of the call on the scaled scores of these indices, in place
    where it can be (a score_mod, or a float mask widening half scores, gives a new tensor).

    Shape:
        scores ``(nb, nh, nr, S)``, b ``(nb,)``, h ``(nh,)``, rows ``(nr,)`` -> the same.
    """
    dev = call.device  # b, h, rows stay on the host for take(); the mods see them on dev
    idx = (
        b.to(dev).view(-1, 1, 1, 1),
        h.to(dev).view(1, -1, 1, 1),
        rows.to(dev).view(1, 1, -1, 1),
        torch.arange(call.S, device=dev).view(1, 1, 1, -1),
    )
    if call.score_mod is not None:
        scores = evaluate_score(call.score_mod, scores, *idx)
    if call.attn_mask is not None:
        mask = take(call.mask_4d(call.attn_mask), b, h, rows, broadcast=True)  # (nb?, nh?, nr?, S?)
        scores = apply_mask_(scores, mask)
    if call.is_causal:
        scores = apply_mask_(scores, idx[3] <= idx[2])  # (1, 1, nr, S)
    if call.mask_mod is not None:
        scores = apply_mask_(scores, evaluate_mask(call.mask_mod, *idx))
    return scores


def widened(call: AttentionCall) -> AttentionCall:
    """The call with float16/bfloat16 queries and keys in float32, for scores not rounded to
    half (the weights are formed there before rounding)."""
    if call.dtype not in (torch.float16, torch.bfloat16):
        return call
    return dataclasses.replace(call, query=call.query.float(), key=call.key.float())


# attention_with_weights works on blocks of about 2^24 scores (64 MiB in float32; a block is
# a view of the weights returned, so its size costs no memory): torch's GEMMs spread over the
# threads pay per call, and larger blocks amortise that better than smaller ones keep the
# scores in cache. Measured on the 2-core Xeon box, 8 heads, float32, interleaved: 8 x 1024^2
# took 14.8 ms in blocks of 2^22, 19.6 in 2^19 (cache-sized) and 49 in 2^17; blocks of 2^24
# against 2^22 took 4% less at T=4096 and 7-10% less at T=2048, level at T=1024, on the
# native AVX-512 class and with torch held to AVX2. Half inputs use an eighth of it (their
# float32 scores live in a work buffer besides the weights): bf16, T=1024/4096, blocks of
# 2^21 took 16.5-18.2/300-312 ms against 18.4-21.5/313-329 in 2^20 and 17.6-21.2/296-309 in
# 2^22. Not measured per machine (issue 38): past the per-call cost the budget is flat (the
# 4-10% above, on both ISA classes), and it is the bound of the half inputs' work buffer.
_BLOCK_ELEMENTS = 2**24


@torch.no_grad()
def attention_with_weights(
    call: AttentionCall, *, lazy_lse: bool = False
) -> tuple[Tensor, Tensor, Tensor | Callable[[], Tensor]]:
    """Output, weights and log-sum-exp together, in one pass of plain math, without an
    autograd graph: for inference that wants the weights (a trace, ``output_attentions``).

    Block by block (rows of one head, or several whole heads of a short call; about 2^24
    scores): the scores are computed into the weights' own buffer, turned into weights there
    in place and multiplied with the values, so that nothing ``(T, S)``-sized is allocated
    besides the weights returned.
    Half inputs: both products, the softmax and the lse in float32 (one block-sized buffer),
    on every device and CPU route; the weights are rounded once into the weights returned,
    and the output is the float32 weights times the values, rounded once. No dropout.

    ``lazy_lse``: for float32/float64 inputs, return instead of the log-sum-exp a function
    that computes it when called, ``max(scores) - log(max(weights))`` from the row maxima
    kept here and the weights returned (a pass over the weights that a caller who never reads
    the lse does not pay). It is right only while the weights are as returned: the caller
    checks that (``qkv.lazy_trace.trace_of_weights``).

    Shape:
        -> out ``(*batch, T, Dv)``, probs ``(*batch, T, S)``, lse ``(*batch, T)`` (float32,
        float64 for float64 inputs).
    """
    if call.dropout_p > 0:
        raise ValueError("attention_with_weights has no dropout")
    B, H = call.BH
    T, S, dev = call.T, call.S, call.device
    half = call.dtype in (torch.float16, torch.bfloat16)
    acc = torch.float32 if half else call.dtype  # scores and softmax
    # Half inputs: both products in float32, on every device and CPU route (issue 37). torch's
    # CPU half GEMMs round their output to half, and torch 2.13 has no CPU GEMM of half inputs
    # with a float32 output (mm/bmm/baddbmm(out_dtype=) are CUDA only): scores rounded to
    # bfloat16 (+-0.125 at a score of 40) moved the weights by up to 0.08 and the lse by 4e-3
    # at scale=3, and a half baddbmm with alpha=0 reads its output buffer even with beta=0
    # (NaN from the garbage of torch.empty at scale=0, issue 41). The output is the float32
    # weights times the values, rounded once: the rounded weights times the values (a half
    # GEMM) were outside the tolerance policy on 29 of 400 one-row bfloat16 calls, where
    # torch's kernel and the tiled backend were on none. On the AMX Xeon, 8 heads, T=1024,
    # D=64, that product took 3.8 ms in float32 against 0.8 ms as a bfloat16 GEMM.
    # bfloat16 scores on the native route: by oneDNN's bf16 x bf16 -> f32 micro-kernel
    # (ops/bf16_scores.py; the same float32 sums, no widened copies of q and k), where it runs.
    bf16_kernel = _bf16_scores_here(call)
    fused = fused_ranges(call) if bf16_kernel else None
    if fused is not None:  # rows attend ranges of keys: the whole pass in the kernel
        return _bf16_fused(call, *call.as_4d(grouped=True), *fused)  # (GQA: heads not repeated)
    q, k, v = call.as_4d()  # (B, H, T, D), (B, H, S, D), (B, H, S, Dv)
    budget = _BLOCK_ELEMENTS // 8 if half else _BLOCK_ELEMENTS  # a float32 work buffer besides
    rows = max(1, min(T, budget // max(S, 1)))  # rows of a block
    heads = max(1, min(H, budget // max(T * S, 1))) if rows == T else 1  # heads of a block
    probs = empty_large((B, H, T, S), dtype=call.dtype, device=dev)  # written once, block by block
    # The output contiguous (B, H, T, Dv): bmm into a strided view of (B, T, H, Dv) memory was
    # 1.4x slower at 4 heads x T=1024 (2-core Xeon); a module's merge of the heads copies it.
    out = torch.empty(B, H, T, v.shape[-1], dtype=call.dtype, device=dev)
    score_max = torch.empty(B, H, T, dtype=acc, device=dev)
    lse = None if lazy_lse and not half else torch.empty(B, H, T, dtype=acc, device=dev)
    work = torch.empty(heads, rows, S, dtype=acc, device=dev) if half else None
    plain = (
        call.attn_mask is None
        and call.mask_mod is None
        and call.score_mod is None
        and not call.is_causal
    )
    # q and k are multiplied as the views they are (a module's heads, strided: as fast as
    # copies in bmm and mm, measured at T=256..4096); the values of a block of several heads
    # are copied (bmm on strided values was up to 1.2x slower), one head's are not.
    for bi in range(B):
        for h0 in range(0, H, heads):
            h1 = min(H, h0 + heads)
            kb = k[bi, h0:h1]  # (nh, S, D)
            kb = kb.contiguous() if bf16_kernel else kb  # copied once, not per block of rows
            kt = (kb if bf16_kernel else _as(kb, acc)).transpose(-2, -1)  # (nh, D, S)
            vb = _as(v[bi, h0:h1], acc)  # (nh, S, Dv)
            vb = vb.contiguous() if heads > 1 else vb
            for t0 in range(0, T, rows):
                t1 = min(T, t0 + rows)
                block = probs[bi, h0:h1, t0:t1]  # (nh, nr, S)
                scores = block if work is None else work[: h1 - h0, : t1 - t0]
                qb = q[bi, h0:h1, t0:t1]  # (nh, nr, D)
                if bf16_kernel:  # (nh, nr, S): scale * q k^T, float32 sums of bf16 products
                    bf16_scores.scores_kernel_(scores, qb, kb, call.scale)
                else:
                    # (scale * q) k^T, as the reference forms it: scale * (q k^T) rounds
                    # as well, but differently, and a peaked softmax (scale 50) moved its
                    # weights apart: outputs up to 2x the reference's error (test_properties,
                    # TRACE_REGRESSIONS)
                    torch.baddbmm(  # (nh, nr, S)
                        scores, _as(qb, acc) * call.scale, kt, beta=0, alpha=1, out=scores
                    )
                if not plain:
                    scores = _modify_at(
                        call,
                        scores.unsqueeze(0),
                        torch.tensor([bi], device="cpu"),
                        torch.arange(h0, h1, device="cpu"),
                        torch.arange(t0, t1, device="cpu"),
                    )[0]
                row_max = score_max[bi, h0:h1, t0:t1]  # (nh, nr)
                _softmax_rows_(scores, row_max)
                if lse is not None:
                    lse[bi, h0:h1, t0:t1] = _lse_of(row_max, scores.amax(-1))
                if scores.data_ptr() != block.data_ptr():
                    block.copy_(scores)  # rounded to half once, or a score_mod's new tensor
                dst = out[bi, h0:h1, t0:t1]  # (nh, nr, Dv)
                if half:  # the float32 weights, the output rounded once
                    dst.copy_(torch.matmul(scores, vb))
                else:
                    torch.matmul(block, vb, out=dst)
    lead = call.batch
    probs_out = _shaped(probs, lead + (T, S))
    out = _shaped(out, call.out_shape)
    if lse is not None:
        return out, probs_out, _shaped(lse, lead + (T,))

    def deferred_lse() -> Tensor:
        return _lse_of(score_max, probs.amax(-1)).reshape(lead + (T,))

    return out, probs_out, deferred_lse


def keeps_nonfinite_contract(call: AttentionCall) -> bool:
    """Whether :func:`attention_with_weights` keeps the NaN/inf part of the mask contract for
    ``call`` itself, so that ``ops/nonfinite.py`` has nothing to add: the fused bfloat16
    kernel does (NaN/inf entries count as 0, then NaN on the bad query rows and the rows that
    may attend a bad key, as the eager guard gives). Decided without forming the ranges."""
    return _fusable(call) is not None


def bf16_fusable(call: AttentionCall) -> bool:
    """Whether the tiled backend runs this eager call by the fused bfloat16 kernel (see
    :func:`_fusable`; inference only: no gradient wanted). Decided without forming the
    ranges (:func:`fused_ranges` forms them)."""
    return _no_grad(call) and _fusable(call) is not None


def inference_ranges(call: AttentionCall):
    """:func:`fused_ranges` where :func:`bf16_fusable`, else None: what the tiled backend
    runs by the kernel, decided once (a decoding step's call is short)."""
    return fused_ranges(call) if _no_grad(call) else None


def _no_grad(call: AttentionCall) -> bool:
    return not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (call.query, call.key, call.value))
    )


def _fusable(call: AttentionCall) -> tuple | None:
    """:func:`_fusable_now`, remembered for the last call asked about while the environment
    that decides it holds: the plan asks it (``keeps_nonfinite_contract``) and the tiled
    backend asks again for the same call object (17 of a decoding step's ~130 us)."""
    env = os.environ
    routes = (env.get("QKV_BF16_GEMM"), env.get("QKV_CPU_HALF_GEMM"), env.get("QKV_AUTOTUNE"))
    return _last_fusable.get(call, (*routes, tracing()), _fusable_now)


_last_fusable = LastCall()


def _fusable_now(call: AttentionCall) -> tuple | None:
    """The rows' key ranges of ``call`` as ``key_counts.ranges`` gives them (``(lo, hi, doc)``)
    when the fused bfloat16 kernel can run it, else None: bfloat16 on the CPU's native route
    where the kernel runs (see :func:`_bf16_scores_here`), 1 to ``FUSED_MAX_KEYS`` keys, no
    score_mod, sinks or dropout, masks that are ranges (none, causal, sliding windows, key
    lengths, documents and their ``and``) of the call's batch, or a bool key mask (see
    :func:`_key_mask_ids`) with ranges but documents, and a scale that cannot overflow
    float32 scores (those are checked after the call by the guard). Tests force it off to run
    the unfused ways on the same calls."""
    if not _bf16_scores_here(call) or not 0 < call.S <= FUSED_MAX_KEYS or call.T == 0:
        return None
    if call.score_mod is not None or call.sinks is not None or call.dropout_p > 0:
        return None
    if abs(call.scale) > _FLOAT32_SCALE_BOUND:
        return None
    keyed = None
    if call.attn_mask is not None:
        keyed = _key_mask_ids(call)
        if keyed is None:
            return None
    # (lo, hi, doc): lo, hi (B?, 1, T), remembered per masks; a key mask's: the other masks'
    ranges = key_counts.ranges(call, attn_mask=keyed is None)
    if ranges is None or (keyed is not None and ranges[2] is not None):
        return None
    lo, hi, doc = ranges
    doc = keyed if keyed is not None else doc
    batches = [lo.shape[0], hi.shape[0]]
    if doc is not None:
        batches += [doc.q_ids.shape[0], doc.kv_ids.shape[0]]
    return (lo, hi, doc) if all(n in (1, call.BH[0]) for n in batches) else None


@dataclasses.dataclass(frozen=True)
class _KeyMaskIds:
    """A bool key mask as the kernel's document ids: every query row of id 0, the keys it
    shows of id 0 and those it hides of id 1. A row attends the keys of its own id, so the
    hidden keys, NaN/inf ones included, have no effect, and a row whose keys are all hidden
    outputs 0 (the mask contract)."""

    q_ids: Tensor  # (Bm, T) int64 zeros
    kv_ids: Tensor  # (Bm, S) int64


def _key_mask_ids(call: AttentionCall) -> _KeyMaskIds | None:
    """The ids of ``call``'s attn_mask where it is a bool key mask, one row of keys per batch
    element shared by every head and query row (``(B?, 1, 1, S)`` as :meth:`mask_4d` gives
    it: a padded batch's mask, a decoding step's); None for other masks."""
    mask = call.attn_mask
    if mask is None or mask.dtype != torch.bool:
        return None
    m = call.mask_4d(mask)  # (B?, H?, T?, S?)
    if m.shape[1:] != (1, 1, call.S) or m.shape[0] not in (1, call.BH[0]):
        return None

    def make() -> _KeyMaskIds:
        hidden = (~m[:, 0, 0]).to(torch.int64)  # (Bm, S)
        return _KeyMaskIds(
            torch.zeros(m.shape[0], call.T, dtype=torch.int64, device=m.device), hidden
        )

    # a decoding loop passes its mask to every layer: made once per mask (unchanged) and shape
    return _key_mask_memo.get((mask,), (tuple(m.shape), call.T), make)


_key_mask_memo = IdentityCache(8)


def fused_ranges(
    call: AttentionCall,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor] | None] | None:
    """``(lo, hi, ids)`` where :func:`_fusable`: row ``t`` attends keys ``[lo_t, hi_t)``, of
    its own document when ``ids`` (the queries' and keys' document ids, and which rows' spans
    hold other ids) is given; a bool key mask's ids (:class:`_KeyMaskIds`) come without the
    third, compared in every row.

    Shape:
        -> lo, hi ``(B or 1, T)`` int64; ids ``(B or 1, T)``, ``(B or 1, S)`` and
        ``(B or 1, T)`` bool.
    """
    ranges = _fusable(call)
    if ranges is None:
        return None
    lo, hi, doc = ranges  # (B?, 1, T) each, and a document mask or None
    if isinstance(doc, _KeyMaskIds):  # ids compared in every row: no spans to sort for
        lo, hi = torch.broadcast_tensors(lo, hi)  # (B?, 1, T)
        return lo.squeeze(-2), hi.squeeze(-2), (doc.q_ids, doc.kv_ids)
    if doc is not None:  # each row's document span, ids compared within it by the kernel
        lo, hi, mixed = key_counts.document_ranges(call, lo, hi, doc)  # (B?, T) each
        return lo, hi, (doc.q_ids, doc.kv_ids, mixed)
    lo, hi = torch.broadcast_tensors(lo, hi)  # (B?, 1, T)
    return lo.squeeze(-2), hi.squeeze(-2), None  # (B?, T) each


_FLOAT32_SCALE_BOUND = math.sqrt(torch.finfo(torch.float32).max)

# The fused kernel holds a float32 score row and two bfloat16 rows per query row of a task
# (16-64 rows a thread): 128 MiB a thread at this many keys. Longer calls take the other ways.
FUSED_MAX_KEYS = 1 << 20


def _bf16_fused(
    call: AttentionCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor,
    hi: Tensor,
    ids: tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attention_with_weights` of a bfloat16 call whose rows attend ranges of keys, by
    the fused kernel (``bf16_scores.attend_kernel``): the same float32 scores, softmax and
    lse, the weights rounded once, the output the float32 weights times the values rounded
    once. On the AMX Xeon, 8 heads, T=S=1024, D=64, it replaces a float32 product of the
    weights and the values, the softmax, two passes for the row maxima, the copies to
    bfloat16 and the guard's zeroed copies of q, k and v.

    Shape:
        q ``(B, H, T, D)``, k ``(B, Hk, S, D)``, v ``(B, Hk, S, Dv)`` (Hk: GQA heads), lo,
        hi ``(B?, T)``, ids as :func:`fused_ranges` -> as :func:`attention_with_weights`.
    """
    out, probs, lse = bf16_scores.attend_kernel(q, k, v, call.scale, lo, hi, weights=True, ids=ids)
    assert probs is not None
    lead = call.batch
    return (
        _shaped(out, call.out_shape),  # (B, H, T, Dv) view of (B, T, H, Dv) memory, or copied
        _shaped(probs, lead + (call.T, call.S)),
        _shaped(lse, lead + (call.T,)),
    )


def _bf16_scores_here(call: AttentionCall) -> bool:
    """Whether the one-pass weights form this call's scores by ``ops/bf16_scores.py``'s
    kernel: bfloat16 on the CPU, the native half route (where torch's bfloat16 GEMMs are the
    fast ones, measured: ``cpu_isa.half_gemm_route``), not traced, and the kernel runs here.
    Else the float32 GEMM of the widened inputs, the same sums. On the AMX Xeon, 8 heads,
    T=S=1024, D=64, one thread: 5.5-6.9 ms by the kernel against 13.7-14.5 ms widened."""
    return (
        call.dtype == torch.bfloat16
        and call.device.type == "cpu"
        and call.query.shape[-1] > 0
        and not tracing()
        and bf16_kernel_here()
    )


def bf16_kernel_here() -> bool:
    """What :func:`_bf16_scores_here` asks of this process rather than of a call: bfloat16
    on the native half route, and the kernel runs here (environment reads and dict lookups
    after the first ask; a lane asks it again on each call it takes)."""
    return cpu_isa.half_gemm_route(torch.bfloat16) == "native" and bf16_scores.available()


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, without dispatching an op when it has that dtype already (the
    per-call cost of a short call is the ops it dispatches)."""
    return x if x.dtype == dtype else x.to(dtype)


def _shaped(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``x.reshape(shape)``, without dispatching an op when it has that shape already."""
    return x if x.shape == shape else x.reshape(shape)


def _softmax_rows_(scores: Tensor, score_max: Tensor) -> None:
    """``masked_softmax`` of a block in place: the weights overwrite ``scores``, each row's
    largest score goes to ``score_max``, and a row with no key gets weights 0.

    On the CPU a contiguous block of float32/float64 goes through one pass of C++ that keeps
    the maxima too (``ops/softmax_rows.py``). Otherwise through ``amax`` and torch's fused
    softmax kernel, on CPU with its output on its input (the kernel reads a row before it
    writes it; tests/test_weights_one_pass.py checks both ways against ``masked_softmax``;
    other devices get a copy).

    Shape:
        scores ``(..., S)`` with S > 0, score_max ``(...)``.
    """
    if softmax_rows.softmax_rows_(scores, score_max):  # (CPU: one pass of C++, not two)
        return
    if score_max.dtype == scores.dtype:
        torch.amax(scores, -1, out=score_max)
    else:  # a score_mod widened the scores
        score_max.copy_(scores.amax(-1))
    # a row that may attend to nothing (all -inf) gets its first score 0, so the softmax
    # gives it the weights (1, 0, ..., 0) instead of NaN, and that 1 goes after: two ops on a
    # column, where zeroing its NaN row would be a pass over the block (or a host read of
    # whether there is one)
    empty = score_max == float("-inf")  # (...)
    first = scores[..., 0]  # (...), a view of the first column
    first.masked_fill_(empty, 0.0)
    if scores.device.type == "cpu":  # written over its input: checked on CPU only
        torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    else:
        scores.copy_(torch.softmax(scores, dim=-1))
    first.masked_fill_(empty, 0.0)


def _lse_of(score_max: Tensor, prob_max: Tensor) -> Tensor:
    """``lse = max(scores) - log(max(weights))``, which holds because the largest weight is
    ``exp(max(scores) - lse)``; ``-inf`` for a row with no key."""
    return torch.where(torch.isneginf(score_max), float("-inf"), score_max - prob_max.log())


def take(t: Tensor, *indices: Tensor, broadcast: bool = False) -> Tensor:
    """``t[b][:, h][:, :, rows]`` for the indices given, as a view (no copy) along each dim
    whose indices are consecutive (a trace's blocks of rows, all heads, all batch elements).

    With ``broadcast``, dims of size 1 are left as they are, to broadcast.
    """
    for dim, idx in enumerate(indices):
        if broadcast and t.shape[dim] == 1:
            continue
        n = idx.numel()
        first = int(idx[0]) if n else 0
        if n and torch.equal(idx, torch.arange(first, first + n, device=idx.device)):
            t = t.narrow(dim, first, n)
        else:
            t = t.index_select(dim, idx.to(t.device))
    return t


def _modified_scores(call: AttentionCall, scores: Tensor) -> Tensor:
    """``score_mod`` applied to the full scores, seen as (B, H, T, S)."""
    B, H = call.BH
    scores4 = scores.expand(call.batch + scores.shape[-2:]).reshape(B, H, call.T, call.S)
    out = evaluate_score(
        call.score_mod, scores4, *index_grid(B, H, call.T, call.S, device=call.device)
    )
    return out.reshape(call.batch + (call.T, call.S))  # (*batch, T, S)


def masked_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that gives 0 (not NaN) on a row that is all ``-inf``.

    Returns the weights and the log-sum-exp of each row (``-inf`` for a fully masked row).
    The row max is detached: softmax does not depend on it, and keeping it out of the graph
    keeps the gradient of a fully masked row exactly 0.

    Shape:
        scores ``(*batch, T, S)`` -> probs ``(*batch, T, S)``, lse ``(*batch, T)``.
    """
    if scores.shape[-1] == 0:  # no keys at all: every row attends to nothing
        lse = scores.new_full(scores.shape[:-1], float("-inf"))  # (*batch, T)
        return scores, lse
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (*batch, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    exp = torch.exp(scores - row_max)  # (*batch, T, S); masked entries are exactly 0
    total = exp.sum(dim=-1, keepdim=True)  # (*batch, T, 1)
    empty = total == 0  # rows that may attend to nothing
    probs = exp / torch.where(empty, 1.0, total)  # (*batch, T, S)
    lse = (row_max + torch.log(torch.where(empty, 1.0, total))).masked_fill(empty, float("-inf"))
    return probs, lse.squeeze(-1)  # (*batch, T, S), (*batch, T)
