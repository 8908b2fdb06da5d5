"""Keys and values holding NaN or inf: they may reach only the rows that may attend to them.

The mask contract says a key a row may not attend to has no effect on that row, whatever its
values. Every kernel breaks that by arithmetic alone: a masked weight is exactly 0, but
``0 * inf = NaN`` in ``probs @ value``, and an additive mask leaves ``NaN + -inf = NaN`` in
the scores. So before any backend runs, keys and values with a non-finite entry are replaced
by zeros (:func:`clean`), and afterwards the rows that may attend to one of them are set to
NaN (:func:`poison`): what plain math gives such a row is not finite either.

Detecting them costs one reduction over key and value (and a device sync) per call.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..masks import evaluate_mask, index_grid
from .call import AttentionCall

__all__ = ["clean", "poison"]


def clean(call: AttentionCall) -> tuple[AttentionCall, Tensor | None]:
    """The call with non-finite keys/values zeroed, and which keys those were.

    Returns ``(call, None)`` unchanged when every key and value is finite (the usual case).

    Shape:
        -> bad ``(*kbatch, S)`` bool, broadcastable to ``(*batch, S)`` (GQA heads expanded).
    """
    key, value = call.key, call.value
    if call.device.type == "meta" or key.numel() == 0:
        return call, None
    with torch.no_grad():  # a sum is finite when every term is (an overflow only costs time)
        if bool(torch.isfinite(key.sum() + value.sum())):
            return call, None
        bad_k = ~torch.isfinite(key).all(-1)  # (*kbatch, S)
        bad_v = ~torch.isfinite(value).all(-1)  # (*kbatch, S)
    key = torch.where(bad_k.unsqueeze(-1), 0.0, key).to(key.dtype)  # (*kbatch, S, D)
    value = torch.where(bad_v.unsqueeze(-1), 0.0, value).to(value.dtype)  # (*kbatch, S, Dv)
    bad = torch.broadcast_tensors(bad_k, bad_v)
    bad = bad[0] | bad[1]  # (*kbatch, S)
    if call.enable_gqa:
        bad = bad.repeat_interleave(call.query.shape[-3] // call.key.shape[-3], dim=-2)
    return dataclasses.replace(call, key=key, value=value), bad


def poison(out: Tensor, call: AttentionCall, bad: Tensor) -> Tensor:
    """``out`` with NaN on every row that may attend to a key marked ``bad``.

    Shape:
        out ``(*batch, T, Dv)``; bad ``(*kbatch, S)`` -> ``(*batch, T, Dv)``.
    """
    cols = bad.reshape(-1, call.S).any(0).nonzero().squeeze(-1)  # (nc,) keys bad somewhere
    hit = allowed_columns(call, cols) & bad[..., None, cols]  # (*batch, T, nc)
    return out.masked_fill(hit.any(-1, keepdim=True), float("nan"))


def allowed_columns(call: AttentionCall, cols: Tensor) -> Tensor:
    """Whether each query row may attend to the keys ``cols``, under all the call's masks.

    Shape:
        cols ``(nc,)`` int64 -> ``(*batch, T, nc)`` bool.
    """
    B, H = call.BH
    T, nc = call.T, cols.numel()
    allowed = torch.ones(1, 1, T, nc, dtype=torch.bool, device=call.device)  # (1, 1, T, nc)
    kv = cols.view(1, 1, 1, nc)
    if call.attn_mask is not None:
        mask = call.mask_4d(call.attn_mask)  # (B?, H?, T?, S?)
        mask = mask[..., cols] if mask.shape[-1] > 1 else mask
        allowed = allowed & (mask if mask.dtype == torch.bool else ~torch.isneginf(mask))
    b, h, q, _ = index_grid(B, H, T, 1, device=call.device)
    if call.is_causal:
        allowed = allowed & (kv <= q)
    if call.mask_mod is not None:
        allowed = allowed & evaluate_mask(call.mask_mod, b, h, q, kv)
    allowed = allowed.expand(B, H, T, nc)  # (B, H, T, nc)
    return allowed.reshape(call.batch + (T, nc))
