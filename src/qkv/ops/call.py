"""AttentionCall: one validated attention call, the thing every backend is asked about.

All input checking of the functional API happens here, at the public boundary, so that a bad
input raises a ValueError/TypeError naming the shapes or dtypes and the fix, never a raw
internal traceback, and backends can trust what they receive.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim of query/key, Dv head dim of value. ``*batch`` is every dim before the last two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..masks import (
    MaskMod,
    ScoreMod,
    _Window,
    and_masks,
    as_mask_mod,
    as_score_mod,
    causal,
    evaluate_mask,
    index_grid,
    merge_causal,
)

__all__ = ["AttentionCall", "LastCall"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# A bfloat16 CPU call without gradient that returns few numbers (an output of at most
# ``EXACT_HALF_OUTPUTS`` elements) and costs at most ``EXACT_HALF_WORK`` multiply-adds
# (``B*H*T*S*(D+Dv)``) computes in float32 and is rounded once, whichever kernel runs it. Its
# results are then the bfloat16 values nearest the exact ones (float32's own error is ~1e-7),
# never farther from them than any bfloat16 answer, the plain math's in bfloat16 included: the
# tolerance policy holds by construction. torch's bfloat16 kernels round the weights to bfloat16
# before they meet the values, and the policy's maximum over a handful of numbers shows it:
# torch's kernel with a bool attn_mask, T=1, S=64, one head, 2000 draws each, missed the policy on
# 71 at D=2, 23 at D=4, 2 at D=8, 1 at D=16 and none at D=32, 64, or 2 heads of 16; with a
# gradient, torch's bfloat16 backward missed it on 19 of 200 dq (4 numbers) at T=1, S=2, D=4, and
# on 13 of 200 dv (3 numbers) at T=40, S=1, D=3 (now every bfloat16 call wanting a gradient is
# widened: "bfloat16 gradients" below). Drawn at random, outputs of 32 numbers and more did not
# miss it; the long property profile found calls of 18, 18, 24 and 32 numbers that did (tiled's
# flash chunks, torch's kernel), so the bound is 64: a decoding step of real sizes (heads x head
# dim >= 128) is far beyond it. The work bound keeps the widening's copies of k and v (at most as
# many elements as the kernel's multiply-adds) below a millisecond. qkv's fused bfloat16 kernel
# (``bf16_scores``, exact to the policy: its weights are not rounded) does not read this and still
# takes the calls it can; a call widened keeps no decoding lane (``functional._keep_lane``).
EXACT_HALF_OUTPUTS = 64
EXACT_HALF_WORK = 1 << 20

# bfloat16 gradients: a bfloat16 CPU call that wants a gradient computes in float32 (q, k and v
# widened, the output rounded once, the gradients rounded once on the way back), at every size.
# torch's bfloat16 CPU backward is outside the tolerance policy, and more so the longer the rows:
# against the float64 golden, its dk/dv error was up to 2.6x plain bfloat16 math's at T=S=128, 3.6x
# at 512 and 4.4x at 2048 (causal, D=64, 8-20 draws; the policy allows 3x), the median 2.5x at 2048;
# at the sizes the property tests draw it missed too (19 of 200 dq at T=1, S=2, D=4; grad v at
# T=S=40, D=16, scale 0). Its forward is within it (at most 1.07x). The float32 backward is within
# it at every size measured (at most 0.91x), with a bfloat16 forward beside it too, but the backward
# is most of the cost: on the Zen 4 (AVX-512-BF16, 2 threads) forward and backward cost 1.22x,
# 1.36x, 1.28x the bfloat16 kernels' at T=512, 1024, 2048, and less than them up to T=256; without
# AVX-512-BF16 float32 is 3-5x faster (``benchmarks/bench_bf16_backward.py``). Until 2026-11-28 this
# was a route measured per size class, bfloat16 where faster (``QKV_CPU_HALF_GRAD``); correctness
# comes first.


def forward_ad_on() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (one read of a module
    global): only then may a tensor carry a tangent."""
    return getattr(fwAD, "_current_level", 0) >= 0


@dataclass(frozen=True)
class AttentionCall:
    """A validated call of ``scaled_dot_product_attention``.

    ``scale`` is resolved (``1/sqrt(D)`` when the caller gave None). ``attn_mask`` is the
    caller's mask; ``mask()`` gives it merged with the causal mask when both were asked for.
    ``mask_mod``/``score_mod`` are bound to the call's sizes (see ``qkv.masks``); a
    ``mask_mod`` that is exactly the top-left causal mask becomes ``is_causal=True``.

    Shape:
        query ``(*qbatch, T, D)``, key ``(*kbatch, S, D)``, value ``(*kbatch, S, Dv)``;
        ``batch`` is the broadcast of the three leading shapes (after GQA expansion), and the
        output is ``(*batch, T, Dv)``.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    return_trace: bool
    batch: tuple[int, ...]
    mask_mod: MaskMod | None = None
    score_mod: ScoreMod | None = None
    sinks: Tensor | None = None
    # the caller's tensors that query, key and value were made from (the NaN/inf contract
    # runs a kernel on copies with those zeroed): a trace recomputed later checks that they
    # too are unchanged
    sources: tuple[Tensor, ...] = ()
    # a key for what the call's checks depended on (``_structure``), for the calls ``build``
    # remembers: one object per remembered structure (hashed by identity, not over the
    # structure's fifteen fields on every call); None for others and for every call made
    # from one (``dataclasses.replace`` leaves it out). A choice kept under it holds for any
    # call of the same structure.
    structure: object | None = dataclasses.field(default=None, init=False, compare=False)

    @classmethod
    def build(
        cls,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_trace: bool = False,
        mask_mod=None,
        score_mod=None,
        sinks: Tensor | None = None,
    ) -> AttentionCall:
        """Validate the arguments of ``scaled_dot_product_attention`` and resolve defaults.

        A call of a structure met before (the same shapes, dtypes, devices, mask layout and
        flags, see :func:`_structure`) takes what its checks found then: they depend on
        nothing else, and at decode sizes they cost half of torch's kernel.
        """
        structure = (
            _structure(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_trace
            )
            if mask_mod is None and score_mod is None and sinks is None
            else None
        )
        if structure is not None:
            known = _CHECKED.get(structure)
            if known is not None:
                new = object.__new__(cls)
                new.__dict__.update(known, query=query, key=key, value=value, attn_mask=attn_mask)
                return new  # (frozen: set as dataclasses' own __init__ does, in its dict)
        given = attn_mask
        _check_tensors(query, key, value)
        batch = _check_shapes(query, key, value, bool(enable_gqa))
        T, S = query.shape[-2], key.shape[-2]
        is_causal = _check_flag("is_causal", is_causal)
        if _is_causal_bias(attn_mask):  # torch's causal mask objects: their meaning
            attn_mask, is_causal, mask_mod = _from_causal_bias(attn_mask, T, S, is_causal, mask_mod)
        attn_mask = _check_mask(attn_mask, query, batch + (T, S))
        mask_mod, score_mod = _check_mods(mask_mod, score_mod, batch, T, S)
        if _is_top_left_causal(mask_mod):  # the same mask; torch's causal kernels can take it
            mask_mod, is_causal = None, True
        call = cls(
            query=query,
            key=key,
            value=value,
            attn_mask=attn_mask,
            dropout_p=_check_dropout(dropout_p),
            is_causal=is_causal,
            scale=_check_scale(scale, query.shape[-1]),
            enable_gqa=_check_flag("enable_gqa", enable_gqa),
            return_trace=_check_flag("return_trace", return_trace),
            batch=batch,
            mask_mod=mask_mod,
            score_mod=score_mod,
            sinks=_check_sinks(sinks, query, batch),
        )
        if structure is not None and call.attn_mask is given:
            object.__setattr__(call, "structure", _StructureKey())  # (frozen)
            _remember(structure, call)  # (a mask reshaped or cast, rare: checked each time)
        return call

    # Derived facts backends ask about.
    @property
    def T(self) -> int:
        return self.query.shape[-2]

    @property
    def S(self) -> int:
        return self.key.shape[-2]

    @property
    def D(self) -> int:
        return self.query.shape[-1]

    @property
    def Dv(self) -> int:
        return self.value.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype the CPU kernels compute in: float32 for float16 inputs (torch's float16
        CPU kernel is slow and inexact, see ``torch_sdpa.py``), for half inputs with a
        float32 ``attn_mask`` (the mask keeps its precision through the softmax, as plain math
        promotes it), for bfloat16 inputs of a call that wants a gradient (see "bfloat16
        gradients" at the top of this module), and for a bfloat16 call with few numbers to
        return (see ``EXACT_HALF_OUTPUTS``); otherwise the inputs' dtype."""
        if self.dtype not in (torch.float16, torch.bfloat16):
            return self.dtype
        mask = self.attn_mask
        if not self.query.is_cpu:  # a float mask of another dtype: torch's CUDA kernels gave
            # NaN and wrong rows for bfloat16 inputs with a float32 mask (torch 2.11, H200)
            other = mask is not None and mask.is_floating_point() and mask.dtype != self.dtype
            return torch.float32 if other else self.dtype
        float32_mask = mask is not None and mask.dtype == torch.float32
        if self.dtype == torch.float16 or float32_mask or self.wants_grad:
            return torch.float32
        return torch.float32 if self._few_outputs() else self.dtype

    def has_tangents(self) -> bool:
        """Whether a tensor the call reads carries a forward-mode AD tangent (a dual tensor of
        ``torch.autograd.forward_ad``): the fused kernels (torch's, tiled's autograd Function,
        the C++ passes) have no forward-mode rule; the reference's plain math has one."""
        if not forward_ad_on():
            return False
        mods = (self.mask_mod, self.score_mod)
        held = [t for mod in mods if mod is not None for t in mod.tensors()]
        tensors = (self.query, self.key, self.value, self.attn_mask, self.sinks, *held)
        return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)

    def _few_outputs(self) -> bool:
        """Whether the call returns at most ``EXACT_HALF_OUTPUTS`` numbers at a cost of at most
        ``EXACT_HALF_WORK`` multiply-adds: computed in float32 then (see there)."""
        # (sizes traced as symbols count only where the bound holds for every size they may
        # take: asking would guard on them, and torch.export refused a dynamic T)
        B, H = self.BH
        T, S, D, Dv = self.T, self.S, self.D, self.Dv
        if not statically_known_true(B * H * T * S * (D + Dv) <= EXACT_HALF_WORK):
            return False
        return statically_known_true(B * H * T * Dv <= EXACT_HALF_OUTPUTS)

    @property
    def wants_grad(self) -> bool:
        """Whether a gradient is wanted of a tensor the call reads: q, k, v, a float mask,
        sinks, or one a mask_mod or score_mod holds (a learned bias); or a forward-mode
        derivative (:meth:`has_tangents`). What the backend's choice, the kernel's dtype and
        the NaN/inf contract's way depend on: a derivative takes the ways of tensor ops."""
        if forward_ad_on() and self.has_tangents():  # (forward AD works under no_grad too)
            return True
        if not torch.is_grad_enabled():
            return False
        if any(
            t is not None and t.requires_grad
            for t in (self.query, self.key, self.value, self.attn_mask, self.sinks)
        ):
            return True
        mods = (self.mask_mod, self.score_mod)
        return any(t.requires_grad for mod in mods if mod is not None for t in mod.tensors())

    @property
    def mask_kind(self) -> str:
        """``"none"``, ``"bool"`` or ``"float"``."""
        if self.attn_mask is None:
            return "none"
        return "bool" if self.attn_mask.dtype == torch.bool else "float"

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.batch + (self.T, self.Dv)

    @property
    def BH(self) -> tuple[int, int]:
        """The batch as ``(B, H)``: ``()`` -> (1, 1), ``(H,)`` -> (1, H), ``(B, X, H)`` ->
        (B * X, H). mask_mod/score_mod see these indices (they need at most 4-D inputs)."""
        if not self.batch:
            return 1, 1
        return math.prod(self.batch[:-1]), self.batch[-1]

    def as_4d(
        self, dtype: torch.dtype | None = None, *, grouped: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """query, key, value as ``(B, H, L, E)``: GQA heads repeated, leading dims broadcast
        and folded into B (views where possible); cast to ``dtype`` first, where given, so
        that the gradient of a key or value shared by heads or broadcast over the batch is
        summed in ``dtype`` and rounded once (cast after, bfloat16 summed per-head gradients
        already rounded: 3.05x the policy's error on a shared key's). ``grouped``: key and
        value keep their Hk GQA heads, not repeated (for a kernel that reads head
        ``h // (H // Hk)`` for query head h).

        Shape:
            ``(B, H, T, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)`` with ``(B, H) = self.BH``;
            key and value ``(B, Hk, S, *)`` when ``grouped`` (Hk = H without GQA).
        """
        B, H = self.BH
        query, key, value = self.query, self.key, self.value
        if dtype is not None and dtype != query.dtype:
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        Hk = key.shape[-3] if grouped and self.enable_gqa else H
        if not grouped:
            key, value = self._heads_expanded(key, value)

        def four(t: Tensor, heads: int) -> Tensor:
            if t.shape[:-2] == (B, heads):  # already so (a module's heads): no op to dispatch
                return t
            lead = self.batch[:-1] + (heads,)
            return t.expand(lead + t.shape[-2:]).reshape(B, heads, *t.shape[-2:])

        return four(query, H), four(key, Hk), four(value, Hk)

    def mask_4d(self, mask: Tensor) -> Tensor:
        """A mask broadcastable to ``(*batch, T, S)`` as ``(B?, H?, T?, S?)``, 1 where it
        broadcasts (leading dims beyond two are folded into B, as in ``as_4d``)."""
        batch = self.batch
        mask = mask.reshape((1,) * (len(batch) + 2 - mask.dim()) + tuple(mask.shape))
        if len(batch) < 2:
            return mask.reshape((1,) * (2 - len(batch)) + tuple(mask.shape))
        if len(batch) > 2:
            return mask.expand(batch + mask.shape[-2:]).reshape(-1, batch[-1], *mask.shape[-2:])
        return mask

    def mask(self, dtype: torch.dtype | None = None) -> Tensor | None:
        """The dense mask to apply: ``attn_mask`` merged with the causal mask when both are
        set, and with ``mask_mod`` evaluated densely (O(T * S): for the plain backends).
        ``dtype``: a float ``attn_mask`` is cast to it first, so that the merge, and the sum of
        its gradient back to its own shape, happen in that dtype.

        With ``is_causal`` alone this returns None (backends use their causal fast path).

        Shape:
            broadcastable to ``(*batch, T, S)``.
        """
        mask = self.attn_mask
        if mask is not None and dtype is not None and mask.is_floating_point():
            mask = mask.to(dtype)
        if self.mask_mod is not None:
            structured = self.dense_mask_mod()  # (*batch or 1s, T, S)
            if self.is_causal:
                structured = merge_causal(structured, self.T, self.S)
            if mask is None:
                return structured
            return (
                mask & structured
                if mask.dtype == torch.bool
                else mask.masked_fill(~structured, float("-inf"))
            )
        if mask is not None and self.is_causal:
            return merge_causal(mask, self.T, self.S)
        return mask

    def dense_mask_mod(self) -> Tensor:
        """``mask_mod`` evaluated at every (b, h, q, kv), in the call's batch layout.

        Shape:
            ``(*batch, T, S)`` with 1 where the mask does not depend on a dim, bool.
        """
        B, H = self.BH
        dense = evaluate_mask(self.mask_mod, *index_grid(B, H, self.T, self.S, device=self.device))
        dense = dense.reshape((1,) * (4 - dense.dim()) + tuple(dense.shape))  # (B?, H?, T, S)
        return (
            dense.reshape(dense.shape[4 - len(self.batch) - 2 :]) if len(self.batch) < 2 else dense
        )

    def kv_heads_expanded(self) -> tuple[Tensor, Tensor]:
        """key and value with each of the G heads repeated H // G times (GQA), as torch does."""
        return self._heads_expanded(self.key, self.value)

    def _heads_expanded(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if not self.enable_gqa:
            return key, value
        groups = self.query.shape[-3] // key.shape[-3]
        return (
            key.repeat_interleave(groups, dim=-3),  # (*batch, H, S, D)
            value.repeat_interleave(groups, dim=-3),  # (*batch, H, S, Dv)
        )


class LastCall:
    """A value derived from a call, kept for the last call object asked about while a state
    (what else decides the value: switches read from the environment) holds. A call's plan
    and its backend ask the same questions of the same call (the kernel it takes, its key
    ranges): the second asking is a lookup. Another thread may replace the kept value; each
    asking reads it once."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple | None = None  # (weakref to the call, the state, the value)

    def get(self, call: AttentionCall, state, make: Callable[[AttentionCall], Any]) -> Any:
        """``make(call)``, or the value kept for this call under this state."""
        last = self._last
        if last is not None and last[0]() is call and last[1] == state:
            return last[2]
        value = make(call)
        self._last = (weakref.ref(call), state, value)
        return value


def _check_mods(mask_mod, score_mod, batch: tuple, T: int, S: int):
    """Wrap and bind mask_mod/score_mod; they see (B, H) indices, so at most 4-D inputs."""
    if mask_mod is None and score_mod is None:
        return None, None
    if len(batch) > 2:
        raise ValueError(
            f"mask_mod/score_mod index (b, h, q_idx, kv_idx), so inputs must have at most 4 dims "
            f"(B, H, T, D); got leading dims {batch}: reshape to (B * X, H, T, D)"
        )
    B, H = ((1, 1) + batch)[-2:]
    if mask_mod is not None:
        mask_mod = as_mask_mod(mask_mod).bind(B, H, T, S)
    if score_mod is not None:
        score_mod = as_score_mod(score_mod).bind(B, H, T, S)
    return mask_mod, score_mod


# structure -> the fields of a call of that structure besides its tensors
_CHECKED: dict[tuple, dict] = {}
_CHECKED_MAX = 256


def _structure(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_trace
) -> tuple | None:
    """What ``build``'s checks depend on, for a call of plain tensors and flags (no mods,
    sinks, tensor subclasses or look-alike flags such as ``is_causal=1``, which the checks
    refuse), outside tracing; None for any other call, which is checked in full."""
    if (
        type(query) is not Tensor
        or type(key) is not Tensor
        or type(value) is not Tensor
        or (attn_mask is not None and type(attn_mask) is not Tensor)
        or query.layout is not torch.strided  # (a sparse tensor: the checks refuse it; its
        or key.layout is not torch.strided  # shape and dtype alone matched a dense call's)
        or value.layout is not torch.strided
        or (attn_mask is not None and attn_mask.layout is not torch.strided)
        or type(dropout_p) is not float
        or type(is_causal) is not bool
        or type(enable_gqa) is not bool
        or type(return_trace) is not bool
        or (scale is not None and type(scale) is not float)
        or torch.compiler.is_compiling()
    ):
        return None
    mask = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype, attn_mask.device)
    return (
        query.shape,
        key.shape,
        value.shape,
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_trace,
    )


class _StructureKey:
    """The identity of one remembered call structure (``AttentionCall.structure``)."""

    __slots__ = ()


def _remember(structure: tuple, call: AttentionCall) -> None:
    """Keep the checked fields of ``call`` under its structure (the oldest dropped past
    ``_CHECKED_MAX``: a model meets a handful of structures)."""
    if len(_CHECKED) >= _CHECKED_MAX:
        with contextlib.suppress(StopIteration, RuntimeError):  # (another thread emptied
            _CHECKED.pop(next(iter(_CHECKED)), None)  # or changed it)
    fields = dict(call.__dict__)
    for name in ("query", "key", "value", "attn_mask"):
        fields.pop(name)
    _CHECKED[structure] = fields


def _is_top_left_causal(mask_mod) -> bool:
    return isinstance(mask_mod, _Window) and mask_mod.name == "causal" and mask_mod.offset == 0


def _check_layout(name: str, t: Tensor) -> None:
    """A dense (strided) tensor, or a TypeError naming the layout and the fix (a sparse
    tensor failed inside torch with "Cannot access storage of SparseTensorImpl")."""
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} is a {t.layout} tensor; attention takes dense tensors: use {name}.to_dense()"
        )


def _check_tensors(query: Tensor, key: Tensor, value: Tensor) -> None:
    named = {"query": query, "key": key, "value": value}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_layout(name, t)
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have at least 2 dims (..., L, E), got shape {tuple(t.shape)}; "
                f"for a single vector use {name}.unsqueeze(0)"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attention needs floating point "
                f"(float16, bfloat16, float32 or float64): use {name}.float()"
            )
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"query, key and value must share a dtype, got query {query.dtype}, key {key.dtype}, "
            f"value {value.dtype}; cast them with .to({query.dtype})"
        )
    if not query.device == key.device == value.device:
        raise ValueError(
            f"query, key and value must be on one device, got query on {query.device}, key on "
            f"{key.device}, value on {value.device}; move them with .to({str(query.device)!r})"
        )


def _check_shapes(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> tuple[int, ...]:
    """Check head dims, lengths, heads and batch; return the broadcast batch shape."""
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if q[-1] != k[-1]:
        raise ValueError(
            f"head-dim mismatch: query {q} has D={q[-1]} but key {k} has D={k[-1]}; query and "
            f"key need the same last dim (value's may differ)"
        )
    if k[-2] != v[-2]:
        raise ValueError(
            f"length mismatch: key {k} has S={k[-2]} positions but value {v} has {v[-2]}; key "
            f"and value need the same second-to-last dim"
        )
    qlead, klead, vlead = q[:-2], k[:-2], v[:-2]
    if enable_gqa:
        klead, vlead = _gqa_leads(q, k, v)
    batch = _broadcast(qlead, klead, vlead)
    if batch is not None:
        return batch
    if not enable_gqa and len(q) >= 3 and len(k) >= 3 and q[-3] != k[-3] and k[-3] != 1:
        hint = (
            f"; to share each key/value head across {q[-3] // k[-3]} query heads pass "
            f"enable_gqa=True"
            if q[-3] % k[-3] == 0
            else ""
        )
        raise ValueError(
            f"head mismatch: query {q} has H={q[-3]} heads but key {k} has {k[-3]}{hint}; "
            f"otherwise give key and value {q[-3]} heads (or 1, to broadcast)"
        )
    raise ValueError(
        f"batch mismatch: the leading dims of query {qlead}, key {k[:-2]} and value {v[:-2]} "
        f"do not broadcast together; each leading dim must be equal or 1"
    )


def _broadcast(*shapes: tuple) -> tuple | None:
    """The broadcast of plain int shapes, or None where they do not broadcast.

    (torch.broadcast_shapes does the same in ~8 us per call; this is on every call's path.)
    """
    if all(s == shapes[0] for s in shapes):
        return tuple(shapes[0])
    out = []
    for dims in itertools.zip_longest(*(reversed(s) for s in shapes), fillvalue=1):
        sizes = [d for d in dims if d != 1]  # (a list: symbolic sizes are not hashable)
        if any(d != sizes[0] for d in sizes[1:]):
            return None
        out.append(sizes[0] if sizes else 1)
    return tuple(reversed(out))


def _gqa_leads(q: tuple, k: tuple, v: tuple) -> tuple[tuple, tuple]:
    """Leading dims of key and value as seen after repeating their heads to match query's."""
    if min(len(q), len(k), len(v)) < 3:
        raise ValueError(
            f"enable_gqa=True needs a heads dim (-3) on query, key and value, got shapes {q}, "
            f"{k}, {v}; use (H, T, D) / (G, S, D) or more dims"
        )
    H, G, Gv = q[-3], k[-3], v[-3]
    if Gv != G:
        raise ValueError(f"key has G={G} heads but value has {Gv}; they must be equal for GQA")
    if G == 0 or H % G != 0:
        raise ValueError(
            f"got H={H} query heads and G={G} key/value heads; H must be a multiple of G "
            f"for enable_gqa=True"
        )
    return k[:-3] + (H,), v[:-3] + (H,)


def _is_causal_bias(attn_mask) -> bool:
    """Whether ``attn_mask`` is torch's ``CausalBias``. Its module is not imported here: it
    pulls in ``torch._dynamo`` (a second to ``import qkv``), and a caller holding a
    ``CausalBias`` has imported it already."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(attn_mask, bias.CausalBias)


def _from_causal_bias(bias, T: int, S: int, is_causal: bool, mask_mod):
    """torch's ``causal_upper_left``/``causal_lower_right`` as ``(attn_mask, is_causal,
    mask_mod)``: upper-left is ``is_causal``, lower-right the bottom-right causal mask_mod."""
    if (bias.seq_len_q, bias.seq_len_kv) != (T, S):
        raise ValueError(
            f"attn_mask is a torch CausalBias for (T, S) = ({bias.seq_len_q}, {bias.seq_len_kv}) "
            f"but the call has (T, S) = ({T}, {S}); build it with the call's lengths"
        )
    from torch.nn.attention.bias import CausalVariant

    if bias.variant == CausalVariant.UPPER_LEFT:
        return None, True, mask_mod
    bottom_right = causal(align="bottom_right")
    return None, is_causal, bottom_right if mask_mod is None else and_masks(mask_mod, bottom_right)


def _check_mask(attn_mask: Tensor | None, query: Tensor, scores_shape: tuple) -> Tensor | None:
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    _check_layout("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"attn_mask has dtype {attn_mask.dtype}; use a bool mask (True = may attend), "
            f"e.g. attn_mask.bool(), or a float mask added to the scores"
        )
    if attn_mask.device != query.device:
        raise ValueError(
            f"attn_mask is on {attn_mask.device} but query is on {query.device}; move it with "
            f".to({str(query.device)!r})"
        )
    shape = tuple(attn_mask.shape)
    if _broadcast(shape, scores_shape) != scores_shape:
        raise ValueError(
            f"attn_mask of shape {shape} does not broadcast to the scores' shape "
            f"(*batch, T, S) = {scores_shape}; each of its dims must equal the scores' dim "
            f"or be 1, with the last two (T, S) = {scores_shape[-2:]}"
        )
    if attn_mask.dim() < 2:  # torch broadcasts masks of rank 0 and 1: (T?, S?) from here on
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + shape)
    # A float mask is cast to the query's dtype, except a float32 mask with half queries
    # (kept for its precision, as torch does). torch adds a float32 mask to float64 scores
    # wrongly (off by ~1.5), so that pair is cast too (documented in the functional API).
    half = query.dtype in (torch.float16, torch.bfloat16)
    keeps = attn_mask.dtype == query.dtype or (half and attn_mask.dtype == torch.float32)
    if attn_mask.is_floating_point() and not keeps:
        attn_mask = attn_mask.to(query.dtype)
    return attn_mask


def _check_sinks(sinks, query: Tensor, batch: tuple[int, ...]) -> Tensor | None:
    """Attention sinks on the query's device, as a float tensor broadcastable to the rows
    ``(*batch, T)``: one logit per query head ``(H,)`` (kept as ``(H, 1)``), or one per row."""
    if sinks is None:
        return None
    want = "one logit per query head (H,) or per query row, broadcastable to (*batch, T)"
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a tensor of {want}, got {type(sinks).__name__}")
    T = query.shape[-2]
    rows = batch + (T,)
    if sinks.dim() == 1 and len(batch) >= 1:
        if sinks.shape[0] != batch[-1]:
            raise ValueError(
                f"sinks must hold {want}: {batch[-1]} heads, got shape {tuple(sinks.shape)}"
            )
        sinks = sinks.view(-1, 1)  # (H, 1): the same logit for every row of a head
    if not sinks.is_floating_point() or _broadcast_fails(tuple(sinks.shape), rows):
        raise ValueError(
            f"sinks must be a float tensor of {want}, here {rows}; got "
            f"{sinks.dtype} of shape {tuple(sinks.shape)}"
        )
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device} but the query is on {query.device}")
    return sinks


def _broadcast_fails(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` does not broadcast to exactly ``target``."""
    try:
        return torch.broadcast_shapes(shape, target) != torch.Size(target)
    except RuntimeError:
        return True


def _check_dropout(dropout_p: float) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(
            f"dropout_p must be in [0, 1), got {dropout_p}; 0 disables dropout, and 1 would "
            f"drop every weight"
        )
    return float(dropout_p)


def _check_scale(scale: float | None, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(
            f"scale must be finite, got {scale}; pass None for the default 1/sqrt(D) = "
            f"{1.0 / math.sqrt(max(D, 1)):.6g}"
        )
    return float(scale)


def _check_flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
