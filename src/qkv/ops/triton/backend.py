"""The ``triton`` backend: which calls the fused kernels take, and how a call becomes launches.

The kernels and what they support are described in ``kernels.py``; this file turns an
``AttentionCall`` into their arguments: the mask as a few numbers (a band ``lo <= kv - q <=
hi``, key lengths, document ids), the score mod as flags, and the block lists -- per query
block the FULL and PARTIAL key blocks from ``qkv.masks.block_states``, the classification the
tiled backend uses -- plus the autograd Function around the forward and backward kernels.

triton is imported only when a kernel is about to run (``import qkv`` never needs it). On CPU
tensors the backend refuses every call except inside :func:`interpreter`, which runs the
kernels under triton's interpreter (``TRITON_INTERPRET=1``) for tests; ``backend="auto"``
therefore never sends a CPU call here.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim; nq/nk query/key blocks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import torch
from torch import Tensor

from ...masks import (
    FULL,
    PARTIAL,
    Grid,
    _Alibi,
    _Combined,
    _Document,
    _KeysBefore,
    _Softcap,
    _Window,
    and_masks,
    block_states,
    causal,
    structure_key,
)
from ..base import BackendResult
from ..call import AttentionCall
from ..plan_cache import PlanCache
from ..reference import ReferenceBackend

__all__ = [
    "MAX_HEAD_DIM",
    "Blocks",
    "TritonBackend",
    "clear_block_list_cache",
    "default_blocks",
    "interpreter",
    "triton_attention",
    "triton_available",
]

MAX_HEAD_DIM = 128  # the accumulators of a (BLOCK_M, D) tile live in registers
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dim, where (batch, head) goes

_INTERPRET = {"on": False}  # set by interpreter(): CPU calls run under triton's interpreter


@contextlib.contextmanager
def interpreter():
    """Within this block the backend takes CPU tensors and runs its kernels under triton's
    interpreter (``TRITON_INTERPRET=1``), for tests without a GPU. Slow: numpy per block.

    triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so the interpreted kernels
    are a second copy of ``kernels.py`` loaded with the variable set (see :func:`_kernels`);
    the environment and triton's settings are restored at once, and nothing leaks out of this
    block: after it, CPU calls are refused again.
    """
    before = _INTERPRET["on"]
    _INTERPRET["on"] = True
    try:
        yield
    finally:
        _INTERPRET["on"] = before


@functools.cache
def triton_available() -> str | None:
    """None when triton can be imported, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"triton cannot be imported ({type(e).__name__}: {e}); pip install 'qkv[triton]'"
    return None


@functools.cache
def _kernels(interpret: bool):
    """The kernel module: compiled for the GPU, or (``interpret``) a copy whose kernels were
    decorated while ``TRITON_INTERPRET=1``, loaded under a name of its own."""
    if not interpret:
        from . import kernels

        return kernels
    from triton import knobs

    path = Path(__file__).with_name("kernels.py")
    spec = importlib.util.spec_from_file_location(f"{__package__}._kernels_interpreted", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"qkv: cannot load the triton kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    with knobs.runtime.scope():  # restores knobs and the environment variable on exit
        knobs.runtime.interpret = True
        spec.loader.exec_module(module)
    return module


class TritonBackend:
    """Fused FlashAttention-2 forward and backward kernels in Triton, with block skipping."""

    name = "triton"
    # after torch, before tiled: on an H100 (bf16, T = 1k-16k, D = 64/128) torch's cuDNN and
    # flash kernels beat these on every call torch takes (plain, causal, dense masks),
    # so auto runs triton only for the structured masks torch cannot take
    # (benchmarks/RESULTS.md, "Triton on an H100")
    priority = 15
    traceable = False  # kernels not yet registered as torch.library custom ops

    def supports(self, call: AttentionCall) -> str | None:
        return _why_not(call)

    def run(self, call: AttentionCall) -> BackendResult:
        if call.query.numel() == 0 or call.S == 0 or 0 in call.out_shape:
            return ReferenceBackend().run(call)  # no block to run: shapes and grads as plain math
        out, lse = triton_attention(call)
        return BackendResult(out=out, lse=lse)


def _why_not(call: AttentionCall) -> str | None:
    """None when the kernels can take ``call``, else the reason, naming what can."""
    if call.sinks is not None:
        return "the triton kernels have no attention sinks (the tiled and reference backends do)"
    device = call.device.type
    if device == "cpu" and not _INTERPRET["on"]:
        return (
            "the triton kernels run on CUDA tensors; these are on cpu (tiled and torch run "
            "there; on CPU the kernels run only under qkv.ops.triton.interpreter(), for tests)"
        )
    if device not in ("cuda", "cpu"):
        return f"the triton kernels run on CUDA tensors; these are on {device}"
    missing = triton_available()
    if missing is not None:
        return missing
    if call.dropout_p > 0:
        return "the triton kernels have no dropout (use torch or reference, or dropout_p=0.0)"
    if call.attn_mask is not None:
        return (
            "the triton kernels take no dense attn_mask; describe the mask as a mask_mod "
            "(qkv.masks) or use tiled"
        )
    if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels take float16, bfloat16 or float32, got {call.dtype} (use tiled)"
    if call.dtype == torch.float32 and device == "cuda":
        return (
            "the triton kernels take float16 or bfloat16 on CUDA: their float32 path (exact "
            "IEEE dots, for the CPU interpreter's tests) spills registers on a GPU; cast to "
            "bfloat16, or use torch or tiled for float32"
        )
    B, H = call.BH
    if B * H > _MAX_GRID_Y:
        return (
            f"the triton kernels launch one program row per (batch, head): B * H = {B * H} "
            f"exceeds CUDA's grid limit {_MAX_GRID_Y}; split the batch (or use tiled)"
        )
    for name, n in (("D", call.D), ("Dv", call.Dv)):
        if not 1 <= n <= MAX_HEAD_DIM:
            return (
                f"the triton kernels take head dims up to {MAX_HEAD_DIM}, got {name}={n} "
                f"(use tiled)"
            )
    mask = _kernel_mask(call)
    if isinstance(mask, str):
        return mask
    return _score_reason(call)


def _score_reason(call: AttentionCall) -> str | None:
    mod = call.score_mod
    if mod is None or isinstance(mod, _Softcap):
        return None
    if isinstance(mod, _Alibi):
        if mod.slopes.requires_grad and torch.is_grad_enabled():
            return (
                "the triton kernels give no gradient to ALiBi slopes that require grad "
                "(use tiled, or pass slopes.detach())"
            )
        return None
    return (
        f"the triton kernels apply only qkv.masks.softcap and qkv.masks.alibi as score_mod, "
        f"not {mod!r} (use tiled)"
    )


@dataclass
class _Mask:
    """A mask the kernels evaluate: ``lo <= kv - q <= hi`` (None = unbounded), ``kv <
    kv_len[b]`` and ``q_doc[b, q] == kv_doc[b, kv]``."""

    lo: int | None = None
    hi: int | None = None
    kv_len: int | Tensor | None = None
    docs: tuple[Tensor, Tensor] | None = None
    parts: list = field(default_factory=list)  # the mask_mods, for the block classification


def _and_parts(mod):
    if isinstance(mod, _Combined) and mod.op == "and":
        for m in mod.mods:
            yield from _and_parts(m)
    else:
        yield mod


def _kernel_mask(call: AttentionCall) -> _Mask | str:
    """The call's mask_mod and is_causal as a ``_Mask``, or why the kernels cannot evaluate it."""
    mask = _Mask()
    parts = list(_and_parts(call.mask_mod)) if call.mask_mod is not None else []
    if call.is_causal:
        parts.append(causal().bind(*call.BH, call.T, call.S))
    for m in parts:
        if isinstance(m, _Window):
            off = m._off()
            if m.left is not None:
                lo = off - m.left
                mask.lo = lo if mask.lo is None else max(mask.lo, lo)
            if m.right is not None:
                hi = off + m.right
                mask.hi = hi if mask.hi is None else min(mask.hi, hi)
        elif isinstance(m, _KeysBefore) and m.name == "key_lengths":
            n = m.n
            if mask.kv_len is None:
                mask.kv_len = n
            elif isinstance(n, int) and isinstance(mask.kv_len, int):
                mask.kv_len = min(n, mask.kv_len)
            else:
                mask.kv_len = torch.minimum(
                    torch.as_tensor(mask.kv_len).cpu(), torch.as_tensor(n).cpu()
                )  # (B,) or (1,)
        elif isinstance(m, _Document) and mask.docs is None:
            mask.docs = (m.q_ids, m.kv_ids)
        else:
            return (
                f"the triton kernels evaluate causal, sliding_window, key_lengths and one "
                f"document mask and their and_masks, not {m!r} (use tiled)"
            )
    mask.parts = parts
    return mask


# --- launching -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """Block sizes of the forward (m queries x n keys), the backward's dK/dV (m1 x n1) and
    dQ (m2 x n2) kernels, and their warps and pipeline stages (forward, dK/dV, dQ; the
    interpreter ignores these two)."""

    m: int = 128
    n: int = 64
    m1: int = 32
    n1: int = 128
    m2: int = 128
    n2: int = 32
    warps: tuple[int, int, int] = (8, 8, 8)
    stages: tuple[int, int, int] = (3, 3, 3)


def default_blocks(D: int, banded: bool = False) -> Blocks:
    """Blocks for half inputs with head dims padded to at most ``D``; ``banded``: the mask
    has an upper band (causal, sliding windows), which changes the best forward at D <= 64.

    Measured on an H100 and an H200 (bf16, 16k tokens, H*D = 2048; each kernel's
    configurations timed with the others fixed: ``benchmarks/tune_triton.py``, RESULTS.md
    "Triton block sizes, measured"). The first choice (:func:`first_blocks`, picked by
    compiling for sm_90 without a GPU: no register spills, shared memory within an A100's
    164 KiB) stays where nothing beat it.

    * D <= 64: the forward with 4 warps for banded masks (causal 1.4x faster than 8 warps at
      T = 1k-16k) and 8 otherwise (4 warps lost 4-6% without a mask and 23-26% on documents);
      dK/dV on 64 x 64 blocks with 4 warps, dQ on 128 x 64 blocks with 2 stages.
    * D = 128: the forward on 128 x 128 blocks (1.07-1.29x), dK/dV on 64 x 128, dQ on 128 x 64.

    A GPU with less shared memory gets fewer stages at launch (:func:`_launch`).
    """
    if _pad(D) <= 64:
        return Blocks(
            m=128,
            n=64,
            m1=64,
            n1=64,
            m2=128,
            n2=64,
            warps=(4 if banded else 8, 4, 8),
            stages=(3, 3, 2),
        )
    return Blocks(m=128, n=128, m1=64, n1=128, m2=128, n2=64, warps=(8, 8, 8), stages=(3, 2, 3))


def first_blocks(D: int) -> Blocks:
    """The untuned blocks :func:`default_blocks` gave before the H100 measurements (kept as the
    baseline of ``benchmarks/tune_triton.py --baseline``)."""
    return Blocks() if _pad(D) <= 64 else Blocks(stages=(3, 2, 3))


def _pad(n: int) -> int:
    """The block width a head dim is padded to: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


class _Extras(TypedDict, total=False):
    """The mask's tensors on the device, as the kernels read them."""

    kv_len: Tensor  # (B,) int32
    docs: tuple[Tensor, Tensor]  # (B?, T), (B?, S) int32


@dataclass
class _Plan:
    """What the three kernels need besides q, k, v, out, lse."""

    B: int
    H: int
    G: int
    T: int
    S: int
    scale: float
    mask: _Mask
    cap: float | None
    slopes: Tensor | None  # (H,) float32 on the device, or None
    blocks: Blocks
    interpret: bool
    device: torch.device
    extras: _Extras = field(default_factory=_Extras)  # kv_len, docs on the device
    _lists: dict = field(default_factory=dict)  # (bm, bn, transposed) -> block lists

    def lists(self, bm: int, bn: int, transposed: bool = False) -> tuple[Tensor, ...]:
        """``(full_num, full_idx, part_num, part_idx)`` for blocks of bm x bn: per query block
        (per key block when ``transposed``) how many FULL / PARTIAL blocks and which, in order.
        The states are ``qkv.masks.block_states``'s, except that a last key block cut short by
        S is PARTIAL rather than FULL (its mask checks ``kv < S``).

        Shape:
            num ``(B, H, nq)`` (expanded views: stride 0 where the mask does not depend on
            b or h), idx ``(B?, H?, nq, nk)`` int32; transposed: nq and nk swapped.
        """
        key = (bm, bn, transposed)
        if key not in self._lists:
            structure = tuple(structure_key(p) for p in self.mask.parts)
            if None in structure:  # a mask that cannot be keyed: planned anew
                self._lists[key] = _block_lists(self, bm, bn, transposed)
            else:
                self._lists[key] = _block_list_cache.get(
                    ("triton", structure, self.B, self.H, self.T, self.S, *key, str(self.device)),
                    lambda: _block_lists(self, bm, bn, transposed),
                )
        return self._lists[key]


# Block lists of recent calls, by mask structure and sizes (qkv.ops.plan_cache): on an H100 at
# T=4096 listing a window's blocks took 1.7 ms of host work per call against 0.4 ms of kernel.
_block_list_cache = PlanCache(64)


def clear_block_list_cache() -> None:
    """Forget every remembered block list (they are rebuilt on the next call)."""
    _block_list_cache.clear()


def _block_lists(plan: _Plan, bm: int, bn: int, transposed: bool) -> tuple[Tensor, ...]:
    grid = Grid(plan.B, plan.H, plan.T, plan.S, bm, bn, plan.device)
    parts = plan.mask.parts
    if not parts:
        states = torch.full((1, 1, grid.nq, grid.nk), FULL, dtype=torch.int8, device=plan.device)
    else:
        mod = parts[0] if len(parts) == 1 else and_masks(*parts)
        states = block_states(mod.bind(plan.B, plan.H, plan.T, plan.S), grid)  # (B?, H?, nq, nk)
        states = states.to(plan.device)
    assert states.shape[1] == 1, "the dK/dV kernel shares block lists across a group's heads"
    if plan.S % bn:  # the last key block ends at S: visited as PARTIAL, which checks kv < S,
        states = states.clone()  # so FULL blocks never test bounds
        last = states[..., -1]
        states[..., -1] = torch.where(last == FULL, PARTIAL, last)
    if transposed:
        states = states.transpose(-1, -2)  # (B?, H?, nk, nq)
    n = states.shape[-1]
    order = torch.arange(n, device=plan.device, dtype=torch.int32)
    out = []
    for kind in (FULL, PARTIAL):
        chosen = states == kind
        num = chosen.sum(-1, dtype=torch.int32)  # (B?, H?, rows)
        idx = torch.where(chosen, order, order + n).argsort(-1).to(torch.int32)  # chosen first
        out += [num.expand(plan.B, plan.H, -1), idx.contiguous()]
    return tuple(out)


def triton_attention(call: AttentionCall, *, blocks: Blocks | None = None) -> tuple[Tensor, Tensor]:
    """Run ``call`` on the kernels; return the output and the log-sum-exp (``-inf`` on rows
    with no key). ``blocks`` overrides the block sizes (tests use small ones to get many).

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)`` float32.
    """
    reason = _why_not(call)
    if reason is not None:
        raise ValueError(reason)
    B, H = call.BH
    q, k, v, G = _inputs_4d(call)  # (B, H, T, D), (B, G, S, D), (B, G, S, Dv)
    mask = _kernel_mask(call)
    if isinstance(mask, str):  # refused by _why_not above
        raise ValueError(mask)
    mod = call.score_mod
    slopes = None
    if isinstance(mod, _Alibi):
        slopes = mod.slopes.detach().to(call.device, torch.float32).expand(H).contiguous()  # (H,)
    plan = _Plan(
        B,
        H,
        G,
        call.T,
        call.S,
        call.scale,
        mask,
        mod.cap if isinstance(mod, _Softcap) else None,
        slopes,
        blocks or default_blocks(max(call.D, call.Dv), banded=mask.hi is not None),
        call.device.type == "cpu",
        call.device,
    )
    plan.extras = _mask_tensors(plan)
    out, lse = _TritonAttention.apply(plan, q, k, v)  # (B, H, T, Dv), (B, H, T)
    return out.reshape(call.out_shape), lse.reshape(call.batch + (call.T,))


def _inputs_4d(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, int]:
    """query as (B, H, T, D) and key/value with their own G heads (no GQA copy): the kernels
    map query head h to kv head h // (H // G). Broadcast dims are expanded views."""
    B, H = call.BH
    q = call.query.expand(call.batch + call.query.shape[-2:]).reshape(B, H, call.T, call.D)
    if call.enable_gqa:
        G = call.key.shape[-3]
        kv_batch = call.batch[:-1] + (G,)
    else:
        G, kv_batch = H, call.batch

    def four(t: Tensor) -> Tensor:
        return t.expand(kv_batch + t.shape[-2:]).reshape(B, G, *t.shape[-2:])

    return q, four(call.key), four(call.value), G


def _mask_tensors(plan: _Plan) -> _Extras:
    """Key lengths ``(B,)`` and document ids ``(B?, T)``, ``(B?, S)`` as int32 on the device."""
    dev, extras = plan.device, _Extras()
    n = plan.mask.kv_len
    if n is not None:
        n = torch.as_tensor(n).reshape(-1).to(dev).clamp(max=plan.S)
        extras["kv_len"] = n.expand(plan.B).to(torch.int32).contiguous()  # (B,)
    if plan.mask.docs is not None:
        q_ids, kv_ids = (t.to(dev, torch.int32).contiguous() for t in plan.mask.docs)
        extras["docs"] = (q_ids, kv_ids)  # (B?, T), (B?, S)
    return extras


def _mask_args(
    plan: _Plan, like: Tensor
) -> tuple[list[Tensor], list[int], dict[str, bool | str | None]]:
    """Pointers, strides and constexpr flags of the mask and score mod, shared by the kernels."""
    dummy = like.new_zeros(1, dtype=torch.int32)
    kv_len = plan.extras.get("kv_len", dummy)
    q_ids, kv_ids = plan.extras.get("docs", (dummy[None], dummy[None]))
    slopes = plan.slopes if plan.slopes is not None else like.new_zeros(1, dtype=torch.float32)
    ptrs = [kv_len, q_ids, kv_ids, slopes]
    strides = [
        q_ids.stride(0) if q_ids.shape[0] > 1 else 0,
        kv_ids.stride(0) if kv_ids.shape[0] > 1 else 0,
        1,
    ]
    flags = dict(
        SOFTCAP=plan.cap is not None,
        ALIBI=plan.slopes is not None,
        HAS_LO=plan.mask.lo is not None,
        HAS_HI=plan.mask.hi is not None,
        HAS_KVLEN="kv_len" in plan.extras,
        HAS_DOC="docs" in plan.extras,
        UPCAST=plan.interpret and like.dtype == torch.bfloat16,
        PRECISION="ieee" if like.dtype == torch.float32 else None,
    )
    return ptrs, strides, flags


def _numbers(plan: _Plan) -> list:
    """scale, cap, lo, hi (0 where unused: the flags switch them off)."""
    m = plan.mask
    return [
        plan.scale,
        plan.cap or 1.0,
        m.lo if m.lo is not None else 0,
        m.hi if m.hi is not None else 0,
    ]


def _list_strides(lists: tuple[Tensor, ...]) -> list[int]:
    num, idx = lists[0], lists[1]
    return [
        num.stride(0),
        num.stride(1),
        idx.stride(0) if idx.shape[0] > 1 else 0,
        idx.stride(1) if idx.shape[1] > 1 else 0,
        idx.stride(2),
    ]


def _launch(plan: _Plan, kernel, which: int, grid: tuple, *args, **kwargs) -> None:
    """Launch ``kernel`` with the plan's warps and stages (``which``: 0 forward, 1 dK/dV,
    2 dQ); on a GPU with too little shared memory, retry with fewer pipeline stages."""
    if plan.interpret:
        kernel[grid](*args, **kwargs)
        return
    from triton.runtime.errors import OutOfResources

    warps, stages = plan.blocks.warps[which], plan.blocks.stages[which]
    while True:
        try:
            kernel[grid](
                *args, **kwargs, num_warps=warps, num_stages=stages, enable_fp_fusion=True
            )  # FMA contraction, said (triton 3.9 warns)
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, H, T, D = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    bm, bn = plan.blocks.m, plan.blocks.n
    out = q.new_empty(B, H, T, Dv)  # (B, H, T, Dv)
    lse = q.new_empty(B, H, T, dtype=torch.float32)  # (B, H, T)
    lists = plan.lists(bm, bn)
    ptrs, strides, flags = _mask_args(plan, q)
    K = _kernels(plan.interpret)
    _launch(
        plan,
        K.attn_fwd,
        0,
        (triton_cdiv(T, bm), B * H),
        q,
        k,
        v,
        out,
        lse,
        *lists,
        *ptrs,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *_list_strides(lists),
        *strides,
        H,
        T,
        S,
        H // plan.G,
        *_numbers(plan),
        D=D,
        DV=Dv,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=_pad(D),
        BLOCK_DV=_pad(Dv),
        EVEN_M=T % bm == 0,
        EVEN_N=S % bn == 0,
        **flags,
    )
    return out, lse


def _backward(plan: _Plan, q, k, v, out, lse, dout) -> tuple[Tensor, Tensor, Tensor]:
    B, H, T, D = q.shape
    G, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dout = dout.contiguous()
    delta = (out.float() * dout.float()).sum(-1)  # (B, H, T): rowsum(dO * O), 0 on empty rows
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ptrs, strides, flags = _mask_args(plan, q)
    K = _kernels(plan.interpret)
    common = dict(D=D, DV=Dv, BLOCK_D=_pad(D), BLOCK_DV=_pad(Dv), **flags)
    bm, bn = plan.blocks.m1, plan.blocks.n1
    lists = plan.lists(bm, bn, transposed=True)  # per key block: the query blocks that see it
    _launch(
        plan,
        K.attn_bwd_dkdv,
        1,
        (triton_cdiv(S, bn), B * G),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        *lists,
        *ptrs,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *dk.stride(),
        *dv.stride(),
        *_list_strides(lists),
        *strides,
        H,
        G,
        T,
        S,
        H // G,
        *_numbers(plan),
        BLOCK_M=bm,
        BLOCK_N=bn,
        EVEN_M=T % bm == 0,
        EVEN_N=S % bn == 0,
        **common,
    )
    bm, bn = plan.blocks.m2, plan.blocks.n2
    lists = plan.lists(bm, bn)
    _launch(
        plan,
        K.attn_bwd_dq,
        2,
        (triton_cdiv(T, bm), B * H),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        *lists,
        *ptrs,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *dq.stride(),
        *_list_strides(lists),
        *strides,
        H,
        T,
        S,
        H // G,
        *_numbers(plan),
        BLOCK_M=bm,
        BLOCK_N=bn,
        EVEN_M=T % bm == 0,
        EVEN_N=S % bn == 0,
        **common,
    )
    return dq, dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _TritonAttention(torch.autograd.Function):
    """Forward keeps out and lse; backward runs the dK/dV and dQ kernels from them."""

    @staticmethod
    def forward(ctx, plan: _Plan, q: Tensor, k: Tensor, v: Tensor):
        out, lse = _forward(plan, q, k, v)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor, _dlse: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, q, k, v, out, lse, dout)
        return None, dq, dk, dv
