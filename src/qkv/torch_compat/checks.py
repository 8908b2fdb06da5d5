"""Input checks of the drop-in: torch's, in torch's order, with its exception types.

Each error is a ValueError (or TypeError) naming the numbers and the fix, and also the
AssertionError or RuntimeError torch raises for the same input, so ported ``except`` clauses
keep working.

Shape alphabet: B batch, T query length, S key length, C embed_dim, Ck/Cv key/value channels.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .module import MultiheadAttention


class _InputError(ValueError, AssertionError):
    """A bad input: a ValueError, and the AssertionError torch raises for it."""


class _MaskError(ValueError, RuntimeError):
    """A bad mask or flag: a ValueError, and the RuntimeError torch raises for it."""


def _check_tensors(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_call(
    m: MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> bool:
    """torch's checks of a forward call up to the lengths (:func:`_check_lengths`), in its
    order; returns whether the call is batched."""
    _check_mask_dtypes(key_padding_mask, attn_mask)
    batched = _check_dims(query, key, value, key_padding_mask, attn_mask, m.num_heads)
    if is_causal and attn_mask is None:
        raise _MaskError(
            "Need attn_mask if specifying the is_causal hint. (torch's MultiheadAttention "
            "takes is_causal=True as a hint that attn_mask is causal: pass attn_mask="
            "nn.Transformer.generate_square_subsequent_mask(T) with it; qkv.MultiHeadAttention "
            "takes is_causal=True alone)"
        )
    _check_channels(m, query, key, value)
    return batched


def _check_mask_dtypes(key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise _InputError(
                f"only bool and floating types of {name} are supported, got {mask.dtype}: "
                f"pass a bool mask (True = NOT allowed, torch's polarity) or a float one "
                f"(added to the scores), e.g. {name}.bool()"
            )
    if (
        key_padding_mask is not None
        and attn_mask is not None
        and (key_padding_mask.dtype != attn_mask.dtype)
    ):
        warnings.warn(
            "Support for mismatched key_padding_mask and attn_mask is deprecated. "
            "Use same type for both instead.",
            stacklevel=3,
        )


def _check_dims(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    num_heads: int,
) -> bool:
    """torch's ``_mha_shape_check``: returns whether the call is batched."""
    if query.dim() not in (2, 3):
        raise _InputError(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D "
            f"query tensor (shape {tuple(query.shape)})"
        )
    batched = query.dim() == 3
    kind, want = ("batched (3-D)", 3) if batched else ("unbatched (2-D)", 2)
    if key.dim() != want or value.dim() != want:
        raise _InputError(
            f"For {kind} `query`, expected `key` and `value` to be {want}-D but found "
            f"{key.dim()}-D and {value.dim()}-D tensors respectively; batch all three or none"
        )
    if key_padding_mask is not None and key_padding_mask.dim() != want - 1:
        raise _InputError(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {want - 1}-D but "
            f"found {key_padding_mask.dim()}-D tensor instead (shape (B, S), or (S,) unbatched)"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise _InputError(
            f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.dim()}-D tensor instead (shape (T, S) or (B*num_heads, T, S))"
        )
    if not batched and attn_mask is not None and attn_mask.dim() == 3:
        expected = (num_heads, query.shape[0], key.shape[0])
        if tuple(attn_mask.shape) != expected:
            raise _InputError(
                f"Expected `attn_mask` shape to be {expected} but got "
                f"{tuple(attn_mask.shape)} (num_heads, T, S)"
            )
    return batched


def _check_channels(m: MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, t, c in (
        ("query", query, m.embed_dim),
        ("key", key, m.kdim),
        ("value", value, m.vdim),
    ):
        if t.size(-1) != c:  # size(-1), not shape: a nested tensor has no shape
            what = "embed_dim" if name == "query" else name[0] + "dim"
            raise _InputError(
                f"was expecting embedding dimension of {c}, but got {t.size(-1)}: {name} "
                f"must have {what}={c} channels in its last dim"
            )


def _check_lengths(
    m: MultiheadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
) -> None:
    """Batch and lengths of batch-first inputs and masks (torch's messages, then ours).

    Shape:
        q ``(B, T, C)``, k ``(B, S, Ck)``, v ``(B, S, Cv)``.
    """
    (B, T), S = q.shape[:2], k.shape[1]
    if k.shape[:2] != v.shape[:2] or k.shape[0] != B:
        raise _InputError(
            f"key's sequence and batch dims do not match value's or query's batch: got (B, L) "
            f"query {tuple(q.shape[:2])}, key {tuple(k.shape[:2])}, value {tuple(v.shape[:2])} "
            f"in batch-first order; key and value need the same S, all three the same B"
        )
    if attn_mask is not None:
        want = (T, S) if attn_mask.dim() == 2 else (B * m.num_heads, T, S)
        if tuple(attn_mask.shape) != want:
            raise _MaskError(
                f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, "
                f"but should be {want} (T={T} queries, S={S} keys"
                f"{'' if attn_mask.dim() == 2 else f', B*num_heads={B}*{m.num_heads}'})"
            )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, S):
        raise _InputError(
            f"Expected key_padding_mask of shape (B, S) = {(B, S)}, but got "
            f"{tuple(key_padding_mask.shape)}"
        )


def _check_nested(
    m: MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> None:
    if not (query.is_nested and key.is_nested and value.is_nested):
        raise _InputError(
            "nested query, key and value go together: pass all three nested, "
            "or all three padded with a key_padding_mask"
        )
    if key_padding_mask is not None or attn_mask is not None or is_causal:
        raise _InputError(
            "nested tensors carry their own padding and take no key_padding_mask, attn_mask or "
            "is_causal (as on torch's fast path); pass padded tensors to mask more"
        )
    if not m.batch_first:
        raise _InputError(
            "nested tensors are (B, L_b, C), batch first: build the module with "
            "batch_first=True, or pass padded (L, B, C) tensors"
        )
    sizes = [t.size(0) for t in (query, key, value)]
    if len(set(sizes)) != 1:
        raise _InputError(
            f"nested query, key and value must hold the same number of sequences, got {sizes}"
        )
    _check_channels(m, query, key, value)
