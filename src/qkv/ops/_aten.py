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

__all__ = ["flash_cpu_available", "flash_forward", "flash_backward", "sdpa"]

_fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_cpu_available() -> bool:
    """Whether this torch build has the CPU flash kernel that returns the log-sum-exp."""
    return _fwd is not None and _bwd is not None


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None, dropout_p: float,
         is_causal: bool, scale: float, enable_gqa: bool) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the scale folded into q when
    it is not positive.

    Shape:
        as torch: q ``(*batch, T, D)``, k ``(*batch, S, D)``, v ``(*batch, S, Dv)`` ->
        ``(*batch, T, Dv)``.
    """
    q, scale = _fold_scale(q, scale)
    if attn_mask is not None and attn_mask.device.type != "cpu" and attn_mask.dim() \
            and attn_mask.stride(-1) != 1:  # a broadcast (rank-0, (T, 1)) mask: torch's CUDA
        attn_mask = attn_mask.contiguous()  # kernel raises "last dimension must be contiguous"
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def flash_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, is_causal: bool = False,
                  attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """torch's CPU flash kernel: the output and the log-sum-exp of each row.

    Shape:
        q ``(B, H, T, D)``, k ``(B, H, S, D)``, v ``(B, H, S, D)``, attn_mask additive and
        broadcastable to ``(B, H, T, S)`` -> out ``(B, H, T, D)``, lse ``(B, H, T)`` float32
        (float64 for float64 inputs).
    """
    q, k, v = (_unit_stride(t) for t in (q, k, v))
    q, scale = _fold_scale(q, scale)
    return _fwd(q, k, v, is_causal=is_causal, attn_mask=_mask4(attn_mask), scale=scale)


def flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                   scale: float, is_causal: bool = False,
                   attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`flash_forward`'s output with respect to q, k and v.

    ``out`` and ``lse`` may be those of a larger computation that this block is part of
    (FlashAttention's backward decomposes that way).

    Shape:
        as :func:`flash_forward`; dout like out -> dq, dk, dv like q, k, v.
    """
    dout, q, k, v, out = (_unit_stride(t) for t in (dout, q, k, v, out))
    folded, fscale = _fold_scale(q, scale)
    dq, dk, dv = _bwd(dout, folded, k, v, out, lse, 0.0, is_causal, attn_mask=_mask4(attn_mask),
                      scale=fscale)
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
