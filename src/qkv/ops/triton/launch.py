"""How a triton-backend plan becomes kernel launches, and the autograd Function around them.

:func:`_forward` launches ``attn_fwd``; :func:`_backward` ``attn_bwd_dkdv`` (per key block)
then ``attn_bwd_dq`` (per query block), each with the mask's pointers, strides and constexpr
flags (:func:`_mask_args`) and the plan's block lists; :func:`_launch` retries with fewer
pipeline stages on a GPU with too little shared memory. :func:`_kernels` imports triton (and
``kernels.py``) only when a kernel is about to run.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch
from torch import Tensor

from ..base import refuse_second_derivative
from .plan import _pad, _Plan


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
    def backward(ctx, dout: Tensor, _dlse: Tensor):
        refuse_second_derivative(
            "the triton backend", "backend='tiled' or 'reference' has one (plain math)"
        )
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, q, k, v, out, lse, dout)
        return None, dq, dk, dv
