"""Reference backend: attention as plain math, the ground truth of qkv.

Supports every call the dispatcher accepts (any dtype including float64, any mask, causal,
GQA, dropout, leading dims) and returns the full trace directly. It computes in the input
dtype with no upcast, so in float16/bfloat16 it is also the "baseline" of the tolerance policy.
Memory is O(T * S) per (batch, head): use a fast backend for long sequences.

Shape alphabet: T query length, S key length, D head dim, Dv value head dim; ``*batch`` is the
broadcast of the inputs' leading dims.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import apply_mask_, causal_bool, evaluate_score, index_grid
from .base import BackendResult
from .call import AttentionCall

__all__ = ["ReferenceBackend", "attention_scores", "masked_softmax"]


class ReferenceBackend:
    """Plain math: ``softmax(q k^T * scale + mask) v``, with the mask contract built in."""

    name = "reference"
    priority = 100  # slowest: auto picks it only when nothing faster takes the call

    def supports(self, call: AttentionCall) -> str | None:
        return None

    def run(self, call: AttentionCall) -> BackendResult:
        scores = attention_scores(call)  # (*batch, T, S)
        probs, lse = masked_softmax(scores)  # (*batch, T, S), (*batch, T)
        weights = F.dropout(probs, call.dropout_p) if call.dropout_p > 0 else probs
        _, value = call.kv_heads_expanded()
        out = weights.to(value.dtype) @ value  # (*batch, T, Dv)
        return BackendResult(out=out, lse=lse, scores=scores, probs=probs)


def attention_scores(call: AttentionCall) -> Tensor:
    """Scaled scores after masking, before softmax; masked entries are ``-inf``.

    Shape:
        ``(*batch, T, S)``.
    """
    key, _ = call.kv_heads_expanded()
    # Scale the (T, D) queries rather than the (T, S) scores: the same math, T*D work not T*S.
    scores = (call.query * call.scale) @ key.transpose(-2, -1)  # (*batch, T, S)
    if call.score_mod is not None:
        scores = _modified_scores(call, scores)  # (*batch, T, S)
    mask = call.mask()
    if mask is None and call.is_causal:
        mask = causal_bool(call.T, call.S, device=call.device)  # (T, S)
    return apply_mask_(scores, mask)


def _modified_scores(call: AttentionCall, scores: Tensor) -> Tensor:
    """``score_mod`` applied to the full scores, seen as (B, H, T, S)."""
    B, H = call.BH
    scores4 = scores.expand(call.batch + scores.shape[-2:]).reshape(B, H, call.T, call.S)
    out = evaluate_score(call.score_mod, scores4, *index_grid(B, H, call.T, call.S, device=call.device))
    return out.reshape(call.batch + (call.T, call.S))  # (*batch, T, S)


def masked_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim that gives 0 (not NaN) on a row that is all ``-inf``.

    Returns the weights and the log-sum-exp of each row (``-inf`` for a fully masked row).
    The row max is detached: softmax does not depend on it, and keeping it out of the graph
    keeps the gradient of a fully masked row exactly 0.

    Shape:
        scores ``(*batch, T, S)`` -> probs ``(*batch, T, S)``, lse ``(*batch, T)``.
    """
    if scores.shape[-1] == 0:  # no keys at all: every row attends to nothing
        lse = scores.new_full(scores.shape[:-1], float("-inf"))  # (*batch, T)
        return scores, lse
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (*batch, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    exp = torch.exp(scores - row_max)  # (*batch, T, S); masked entries are exactly 0
    total = exp.sum(dim=-1, keepdim=True)  # (*batch, T, 1)
    empty = total == 0  # rows that may attend to nothing
    probs = exp / torch.where(empty, 1.0, total)  # (*batch, T, S)
    lse = (row_max + torch.log(torch.where(empty, 1.0, total))).masked_fill(empty, float("-inf"))
    return probs, lse.squeeze(-1)  # (*batch, T, S), (*batch, T)
