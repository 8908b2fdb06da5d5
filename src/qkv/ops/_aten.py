"""torch's attention kernels, called only in the ways they compute right.

qkv never inherits a torch bug silently: every call into torch's SDPA kernels goes through
this file, which converts the inputs torch would mishandle (each case has a regression test
against plain math in tests/test_torch_workarounds.py):

* ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) reads q, k and v as
  if their last dim were contiguous: a step in the last dim (``x[..., ::2]``, channels-last
  storage) gave outputs off by ~5. Such tensors are made contiguous first.
* The same kernel takes a mask of 2 or 4 dims only, and reads one with leading dims as if it
  were contiguous: masks are given 4 dims and made contiguous.
* With ``is_causal=True`` and ``scale <= 0``, torch's CPU kernels scale the causal ``-inf``
  too (``-inf * 0 = NaN``, ``-inf * -1 = +inf``): the scale is folded into the queries,
  which is the same math, and the kernel runs with ``scale=1``.
* A float32 additive mask with float64 q/k/v: torch's kernel adds it wrongly (off by ~1.5);
  ``AttentionCall`` casts such masks to the query's dtype before any backend sees them.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "cuda_forward",
    "flash_backward",
    "flash_cpu_available",
    "flash_forward",
    "sdpa",
]

_fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_cpu_available() -> bool:
    """Whether this torch build has the CPU flash kernel that returns the log-sum-exp."""
    return _fwd is not None and _bwd is not None


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the scale folded into q when
    it is not positive.

    Shape:
        as torch: q ``(*batch, T, D)``, k ``(*batch, S, D)``, v ``(*batch, S, Dv)`` ->
        ``(*batch, T, Dv)``.
    """
    q, scale = _fold_scale(q, scale)
    if attn_mask is not None and attn_mask.device.type != "cpu":
        attn_mask = _keys_contiguous(attn_mask, q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _keys_contiguous(mask: Tensor, T: int, S: int) -> Tensor:
    """``mask`` with a real, contiguous key dim: torch's CUDA kernels raise "(*bias): last
    dimension must be contiguous" for a mask broadcast along keys (rank 0 or 1, ``(T, 1)``),
    which they expand with stride 0 themselves.

    Shape:
        ``(..., T?, S?)`` -> ``(..., T, S)`` (unchanged when its keys are already contiguous).
    """
    if mask.dim() >= 2 and mask.shape[-1] == S and mask.stride(-1) == 1:
        return mask
    lead = tuple(mask.shape[:-2]) if mask.dim() > 2 else ()
    return mask.expand(*lead, T, S).contiguous()


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """torch's CPU flash kernel: the output and the log-sum-exp of each row.

    Shape:
        q ``(B, H, T, D)``, k ``(B, H, S, D)``, v ``(B, H, S, D)``, attn_mask additive and
        broadcastable to ``(B, H, T, S)`` -> out ``(B, H, T, D)``, lse ``(B, H, T)`` float32
        (float64 for float64 inputs).
    """
    if _fwd is None:
        raise RuntimeError("this torch has no CPU flash-attention kernel (flash_cpu_available)")
    if _no_pairs(q, k):
        return _empty_forward(q, k, v)  # the kernel dies of SIGFPE on an empty size
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    q, scale = _fold_scale(q, scale)
    return _fwd(q, k, v, is_causal=is_causal, attn_mask=_mask4(attn_mask), scale=scale)


def cuda_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, choice: int):
    """torch's CUDA kernel ``choice`` (``torch._fused_sdp_choice``'s answer for the same call:
    cuDNN's or flash's) without a mask, as ``F.scaled_dot_product_attention`` calls it, and
    the log-sum-exp of each row it computes and F drops.

    Shape:
        q ``(B, H, T, D)``, k ``(B, H, S, D)``, v ``(B, H, S, Dv)`` -> out ``(B, H, T, Dv)``,
        lse ``(B, H, T)`` float32.
    """
    q, scale = _fold_scale(q, scale)
    if choice == _CUDNN:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale
        )[:2]
    return out, lse.reshape(q.shape[:-1])  # (cuDNN's may carry a trailing 1)


_CUDNN = torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value
CUDA_LSE_KERNELS = (_CUDNN, torch.nn.attention.SDPBackend.FLASH_ATTENTION.value)


def _no_pairs(q: Tensor, k: Tensor) -> bool:
    """No (query, key) pair at all: B, H, T or S is 0."""
    return q.shape[:-1].numel() == 0 or k.shape[-2] == 0


def _empty_forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """What the flash kernel means on an empty size, without calling it (torch 2.13's CPU
    kernel divides by zero, and the process dies of SIGFPE): rows with no key output 0 and
    have log-sum-exp ``-inf``; no rows, no output."""
    B, H, T = q.shape[0], q.shape[1], q.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, T), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`flash_forward`'s output with respect to q, k and v.

    ``out`` and ``lse`` may be those of a larger computation that this block is part of
    (FlashAttention's backward decomposes that way).

    Shape:
        as :func:`flash_forward`; dout like out -> dq, dk, dv like q, k, v.
    """
    if _bwd is None:
        raise RuntimeError("this torch has no CPU flash-attention kernel (flash_cpu_available)")
    if _no_pairs(q, k):  # no (query, key) pair: no gradient
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout, q, k, v, out = (_unit_stride(t) for t in (dout, q, k, v, out))
    folded, fscale = _fold_scale(q, scale)
    dq, dk, dv = _bwd(
        dout, folded, k, v, out, lse, 0.0, is_causal, attn_mask=_mask4(attn_mask), scale=fscale
    )
    if fscale != scale:  # the kernel differentiated with respect to q * scale
        dq = dq * scale
    return dq, dk, dv


def _unit_stride(t: Tensor) -> Tensor:
    """``t`` with a contiguous last dim (the flash kernel ignores that dim's stride)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _fold_scale(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``(q * scale, 1.0)`` for a scale <= 0, which torch's causal kernels get wrong."""
    return (q * scale, 1.0) if scale <= 0 else (q, scale)


def _mask4(mask: Tensor | None) -> Tensor | None:
    """A mask of 4 contiguous dims, as the flash kernel needs."""
    if mask is None:
        return None
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return mask.contiguous()
