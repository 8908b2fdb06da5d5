"""torch's ``attn_mask`` and ``key_padding_mask`` as one qkv mask.

**torch's polarity here**: a bool mask marks with True what may NOT be attended; the mask
returned is qkv's (True = may attend) or a float one to add.

Shape alphabet: B batch, H heads, T query length, S key length, S' = S plus the extra key
positions of ``add_bias_kv``/``add_zero_attn``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _causal_replaces_mask(
    is_causal: bool, key_padding_mask: Tensor | None, need_weights: bool
) -> bool:
    """torch's rule (``F.multi_head_attention_forward``): ``is_causal`` is a hint that
    ``attn_mask`` is causal; the causal mask replaces ``attn_mask`` only when there is no
    ``key_padding_mask`` and no weights are asked for; otherwise ``attn_mask`` is used."""
    return bool(is_causal) and key_padding_mask is None and not need_weights


def _qkv_mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    sizes: tuple[int, int, int, int],
    extra: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """torch's two masks as one qkv mask: bool True = may attend, or float added.

    Bool masks (True = hidden) are inverted and combined; when either mask is float, each
    becomes torch's additive form (bool -> 0 / -inf in the query dtype) and they are added,
    as torch does. The ``extra`` key positions of ``add_bias_kv``/``add_zero_attn`` are
    visible to every query.

    Shape:
        attn_mask ``(T, S)`` or ``(B*H, T, S)``; key_padding_mask ``(B, S)`` -> broadcastable
        to ``(B, H, T, S + extra)``, with ``sizes = (B, H, T, S)``.
    """
    B, H, T, S = sizes
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(B, H, T, S))
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(B, 1, 1, S))  # (B, 1, 1, S)
    if not masks:
        return None
    if extra:
        masks = [F.pad(m, (0, extra)) for m in masks]  # False / 0.0: the extra keys are seen
    if all(m.dtype == torch.bool for m in masks):
        hidden = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~hidden
    added = [m if m.is_floating_point() else _additive(m, dtype) for m in masks]
    return added[0] if len(added) == 1 else added[0] + added[1]


def _additive(hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's ``_canonical_mask``: a bool mask (True = hidden) as 0 / -inf."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf")
    )
