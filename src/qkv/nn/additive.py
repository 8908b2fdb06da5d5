"""Additive (Bahdanau) attention: seed 004's alternative to the dot product.

``score(q_i, k_j) = v^T tanh(W_q q_i + W_k k_j)`` (Bahdanau, Cho and Bengio 2015), then the
same masked softmax and weighted sum as dot-product attention, under the same mask contract.

Memory: the ``tanh`` term is ``(B, T, S, hidden)``, so this is for short sequences (the
decoder-over-encoder setting it was made for), not long ones.

Shape alphabet: B batch, T query length, S key length, C channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import apply_mask_, causal_bool, merge_causal
from ..ops.reference import masked_softmax
from ..trace import AttentionTrace
from ._inputs import module_inputs

__all__ = ["AdditiveAttention"]


class AdditiveAttention(nn.Module):
    """Bahdanau attention with qkv's mask contract (bool True = may attend; a query row with
    nothing to attend gives exactly 0, with 0 gradients).

    Args:
        query_dim: Channels of the queries.
        hidden_dim: Size of the ``tanh`` layer.
        key_dim: Channels of the keys (default ``query_dim``).

    Shape:
        query ``(B, T, query_dim)``; key ``(B, S, key_dim)``; value ``(B, S, Cv)`` (default:
        key) -> ``(B, T, Cv)``; or all unbatched. attn_mask broadcastable to ``(B, T, S)``;
        key_mask ``(B, S)``.
    """

    def __init__(
        self,
        query_dim: int,
        hidden_dim: int,
        *,
        key_dim: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.query_dim, self.key_dim = query_dim, key_dim or query_dim
        self.W_q = nn.Linear(query_dim, hidden_dim, bias=False, **kw)
        self.W_k = nn.Linear(self.key_dim, hidden_dim, bias=False, **kw)
        self.v = nn.Linear(hidden_dim, 1, bias=False, **kw)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        return_trace: bool = False,
    ):
        """Weighted sum of ``value`` by softmax over additive scores.

        Returns the output, or ``(output, AttentionTrace)`` with ``(B, T, S)`` scores/probs.
        """
        inp = module_inputs(
            query,
            key,
            value,
            attn_mask,
            key_mask,
            (self.query_dim, self.key_dim, None),
            (self.W_q.weight.dtype, self.W_k.weight.dtype, None),
        )
        mask = inp.single_head_mask()  # (B, T, S)-broadcastable
        T, S = inp.query.shape[1], inp.key.shape[1]
        if is_causal:
            causal = causal_bool(T, S, device=inp.query.device)  # (T, S)
            mask = causal if mask is None else merge_causal(mask, T, S)
        hidden = self.W_q(inp.query).unsqueeze(2) + self.W_k(inp.key).unsqueeze(1)  # (B, T, S, h)
        scores = apply_mask_(self.v(torch.tanh(hidden)).squeeze(-1), mask)  # (B, T, S)
        probs, lse = masked_softmax(scores)  # (B, T, S), (B, T)
        out = probs.to(inp.value.dtype) @ inp.value  # (B, T, Cv)
        if inp.unbatched:
            out, scores, probs, lse = out[0], scores[0], probs[0], lse[0]
        if not return_trace:
            return out
        return out, AttentionTrace(scores.detach(), probs.detach(), lse.detach(), "additive")
