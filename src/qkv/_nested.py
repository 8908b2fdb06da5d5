"""Nested (jagged) tensors as attention's inputs: a batch of sequences of different lengths
without padding, as torch's SDPA takes them (``torch.nested.nested_tensor(...,
layout=torch.jagged)``, viewed ``(B, H, j, D)``).

qkv runs such a batch as what it is: the sequences packed end to end, one call over the
packed positions with ``masks.document`` (each query sees the keys of its own sequence), so
the tiled backend skips every block between two sequences. ``is_causal`` is causal within
each sequence (torch's CPU kernels refuse it for nested inputs). The output is a nested tensor
with the query's offsets, so ``x + attention(x)`` adds as it does for torch's output.

Shape:
    query ``(B, H, j, D)``, key ``(B, G, k, D)``, value ``(B, G, k, Dv)`` jagged in ``j``/``k``
    -> ``(B, H, j, Dv)`` jagged in ``j``; or one head, ``(B, j, D)`` each -> ``(B, j, Dv)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._identity import IdentityCache
from .masks import and_masks, causal, document

__all__ = ["any_nested", "attend_nested"]

_TAKES = "is_causal, scale, dropout_p, enable_gqa and sinks of one logit per head (H,)"


def attend_nested(
    attend: Callable[..., Any],
    query,
    key,
    value,
    attn_mask,
    dropout_p: float,
    is_causal: bool,
    scale,
    enable_gqa: bool,
    return_trace: bool,
    mask_mod,
    score_mod,
    sinks,
) -> Tensor:
    """Attention over nested (jagged) inputs as one call over the packed sequences (see the
    module's docstring); ``attend`` runs that dense call (``q, k, v, **keywords -> out``)."""
    refused = [
        what
        for what, given in (
            ("attn_mask", attn_mask is not None),
            ("mask_mod", mask_mod is not None),
            ("score_mod", score_mod is not None),
            ("return_trace", return_trace),
            ("sinks by row", sinks is not None and sinks.dim() != 1),
        )
        if given
    ]
    if refused:
        raise ValueError(
            f"nested (jagged) inputs take {_TAKES}, not {', '.join(refused)}: their positions "
            f"are per sequence. Pack the sequences yourself (values() of the nested tensor, "
            f"(1, H, total, D)) and pass masks.document(ids) with your masks on the packed "
            f"positions"
        )
    if all(getattr(t, "is_nested", False) and t.dim() == 3 for t in (query, key, value)):
        # one head, (B, j, D) as a single-head module projects them: (B, 1, j, D)
        heads = (query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1))
        out = attend_nested(
            attend, *heads, None, dropout_p, is_causal, scale, False, False, None, None, sinks
        )
        return out.transpose(1, 2).flatten(-2)  # (B, j, Dv)
    q, q_offsets = _packed(query, "query")
    k, kv_offsets = _packed(key, "key")
    v, v_offsets = _packed(value, "value")
    if q_offsets.numel() != kv_offsets.numel():
        raise ValueError(
            f"query holds {q_offsets.numel() - 1} sequences, key {kv_offsets.numel() - 1}: "
            f"nested inputs pair the i-th query sequence with the i-th key sequence"
        )
    if not _equal(v_offsets, kv_offsets):
        raise ValueError("key and value are nested tensors of different sequence lengths")
    same = q.shape[2] == k.shape[2] and _equal(kv_offsets, q_offsets)
    q_ids = _sequence_ids(q_offsets, q.shape[2])
    mask = document(q_ids) if same else document(q_ids, _sequence_ids(kv_offsets, k.shape[2]))
    if is_causal:
        if not same:
            raise ValueError(
                "is_causal with nested queries and keys of different lengths: causal within a "
                "sequence needs the query and key sequences aligned (self-attention)"
            )
        mask = and_masks(mask, causal())  # packed positions: causal within each sequence
    out = attend(
        q,
        k,
        v,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=enable_gqa,
        mask_mod=mask,
        sinks=sinks,
    )  # (1, H, total, Dv)
    values = out[0].transpose(0, 1)  # (total, H, Dv): the jagged layout's values
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=q_offsets)
    return nested.transpose(1, 2)  # (B, H, j, Dv)


def any_nested(*tensors) -> bool:
    """Whether any of ``tensors`` is a nested tensor (a cheap attribute read each)."""
    return any(getattr(t, "is_nested", False) for t in tensors)


def _packed(t, name: str) -> tuple[Tensor, Tensor]:
    """The sequences of a jagged ``(B, H, j, D)`` tensor packed end to end, and its offsets.

    Shape:
        -> ``(1, H, total, D)``, offsets ``(B + 1,)``.
    """
    if not getattr(t, "is_nested", False):
        raise ValueError(
            f"{name} is a dense tensor while another input is nested: pass query, key and "
            f"value all nested (jagged) or all dense"
        )
    if t.layout != torch.jagged:
        raise ValueError(
            f"{name} is a nested tensor of layout {t.layout}; qkv takes the jagged layout, as "
            f"torch's SDPA does: torch.nested.nested_tensor(..., layout=torch.jagged)"
        )
    if t.dim() != 4 or t._ragged_idx != 2:
        raise ValueError(
            f"{name} is a nested tensor of shape {tuple(t.shape)} whose ragged dim is "
            f"{t._ragged_idx}; attention takes (B, H, j, D), the ragged dim second to last, as "
            f"torch's SDPA does: x.transpose(1, 2) of a (B, j, H, D) nested tensor"
        )
    if t.lengths() is not None:
        raise ValueError(
            f"{name} is a nested tensor with holes (lengths set besides offsets, from a narrow "
            f"or a slice); make it whole first, e.g. with .contiguous()"
        )
    return t.values().unsqueeze(0), t.offsets()  # (H, total, D) is values' own layout here


def _sequence_ids(offsets: Tensor, total: int) -> Tensor:
    """Which sequence each packed position belongs to; no read on the host. The same tensor
    for the same offsets (unchanged): the document mask made of it is then planned once, and
    a model's next layer reads nothing on the host (``_offsets_seen``).

    Shape:
        offsets ``(B + 1,)`` -> ``(total,)`` int64.
    """

    def make() -> Tensor:
        seq = torch.arange(offsets.numel() - 1, device=offsets.device)
        return torch.repeat_interleave(seq, offsets.diff(), output_size=total)

    return _offsets_seen.get((offsets,), ("ids", total), make)


def _equal(a: Tensor, b: Tensor) -> bool:
    """Whether two offsets are the same sequence lengths: read on the host once for the pair
    (``_offsets_seen``); the same tensor, not at all."""
    return a is b or _offsets_seen.get((a, b), "equal", lambda: torch.equal(a, b))


# What was derived from nested inputs' offsets, by the offsets' identity and version: the
# layers of a model fed nested inputs share them (a projection keeps its input's offsets)
_offsets_seen = IdentityCache(64)
