"""Dense masks: bool or float tensors, and the dense twin of a structured mask.

A boolean mask means True = may attend; a float mask is added to the scores. Both broadcast
to the scores' shape ``(*batch, T, S)`` as in PyTorch. ``causal_bool`` is SDPA's top-left
causal mask, ``merge_causal``/``merge_key_mask`` fold the causal mask or a key padding mask
into ``attn_mask``, ``apply_mask_`` applies a mask to scores in place, and ``to_dense`` turns
any mask_mod into the bool tensor it stands for.

Shape alphabet: B batch, H heads, T query length, S key length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .evaluation import evaluate_mask, index_grid
from .vocabulary import as_mask_mod


def causal_bool(T: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """Top-left aligned causal mask: query ``i`` may attend to key ``j`` iff ``j <= i``.

    This is the alignment of ``torch.nn.functional.scaled_dot_product_attention``. For
    ``T != S`` (x = may attend)::

        T=2, S=4      T=4, S=2
        x . . .       x .
        x x . .       x x
                      x x
                      x x

    Shape:
        ``(T, S)``, bool.
    """
    return torch.ones(T, S, dtype=torch.bool, device=device).tril()  # (T, S)


def merge_causal(attn_mask: Tensor, T: int, S: int) -> Tensor:
    """Combine ``attn_mask`` with the top-left causal mask: a key must pass both.

    A bool mask is AND-ed with the causal mask; a float mask gets ``-inf`` above the diagonal.

    Shape:
        attn_mask broadcastable to ``(*batch, T, S)`` -> broadcast of it with ``(T, S)``.
    """
    causal = causal_bool(T, S, device=attn_mask.device)  # (T, S)
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return torch.where(causal, attn_mask, float("-inf"))


def apply_mask_(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Apply ``mask`` to ``scores`` in place: ``-inf`` where a bool mask is False, a float
    mask added. Returns the result, a new tensor only when a float mask widens the dtype.

    In place because a (T, S) score matrix is large: a fresh allocation costs page faults
    (~14 ms for 32 MiB on the CPU machine) that exceed the arithmetic. Pass scores you own.

    Shape:
        scores ``(*batch, T, S)``, mask broadcastable to it -> ``(*batch, T, S)``.
    """
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    if mask.dtype != scores.dtype:
        return scores + mask  # a float32 mask on half scores gives float32 scores, as in torch
    return scores.add_(mask)


def merge_key_mask(attn_mask: Tensor | None, key_mask: Tensor | None) -> Tensor | None:
    """Fold a ``key_mask`` (True = a real key) into ``attn_mask``: a key must pass both.

    Shape:
        attn_mask broadcastable to ``(B, H, T, S)``; key_mask ``(B, S)`` -> a mask
        broadcastable to ``(B, H, T, S)``.
    """
    if key_mask is None:
        return attn_mask
    keys = key_mask[:, None, None, :]  # (B, 1, 1, S)
    if attn_mask is None:
        return keys
    if attn_mask.dtype == torch.bool:
        return attn_mask & keys
    return torch.where(keys, attn_mask, float("-inf"))


def to_dense(mask_mod, B: int, H: int, T: int, S: int, *, device=None) -> Tensor:
    """The bool mask ``mask_mod`` stands for, as a tensor (True = may attend).

    Dims the mask does not depend on stay 1 (``sliding_window`` gives ``(1, 1, T, S)``,
    ``document`` ``(B, 1, T, S)``). Pass the result as ``attn_mask`` to any backend for the
    same result as ``mask_mod=`` (that is its dense twin).

    Shape:
        -> broadcastable to ``(B, H, T, S)``, bool.
    """
    mod = as_mask_mod(mask_mod).bind(B, H, T, S)
    b, h, q, kv = index_grid(B, H, T, S, device=device)
    out = evaluate_mask(mod, b, h, q, kv)
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
