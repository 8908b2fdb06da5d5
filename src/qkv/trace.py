"""AttentionTrace: the intermediates of one attention call, returned (never stored on self).

Shape alphabet: B batch, H query heads, T query length, S key length. ``*batch`` stands for
whatever leading dims the call had (``()``, ``(H,)``, ``(B, H)``, ``(B, X, H)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionTrace", "MultiHeadTrace", "probs_from_lse"]


@dataclass(frozen=True)
class AttentionTrace:
    """What attention computed on the way to its output, for inspection.

    The tensors are detached (no gradient flows through them): computing them beside a fast
    kernel must not make training slower or hold memory for a backward nobody asked for.

    Attributes:
        scores: Scaled scores after masking, before softmax; masked entries are ``-inf``.
        probs: Attention weights (before dropout); each row sums to 1, or is all 0 for a
            query row that may attend to nothing.
        lse: Log-sum-exp of each row of ``scores``; ``-inf`` for a fully masked row.
        backend: Name of the backend that computed the output.

    Shape:
        scores, probs: ``(*batch, T, S)``; lse: ``(*batch, T)``.
    """

    scores: Tensor
    probs: Tensor
    lse: Tensor
    backend: str


@dataclass(frozen=True)
class MultiHeadTrace(AttentionTrace):
    """An AttentionTrace of a multi-head module, with the projections and per-head outputs.

    Attributes:
        q, k, v: The projected queries, keys and values, split into heads (GQA: G heads).
        heads: Each head's output before the heads are concatenated and mixed by W^O.

    Shape:
        scores, probs ``(B, H, T, S)``; lse ``(B, H, T)``; q ``(B, H, T, D)``;
        k ``(B, G, S, D)``; v ``(B, G, S, Dv)``; heads ``(B, H, T, Dv)``.
        (Unbatched module calls drop the B dim.)
    """

    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    heads: Tensor | None = None


def probs_from_lse(scores: Tensor, lse: Tensor) -> Tensor:
    """Attention weights ``exp(scores - lse)``, 0 on rows whose ``lse`` is ``-inf``.

    This is how a fast backend that keeps only the log-sum-exp gives its weights back.

    Shape:
        scores ``(*batch, T, S)``, lse ``(*batch, T)`` -> ``(*batch, T, S)``.
    """
    lse = lse.to(scores.dtype).unsqueeze(-1)  # (*batch, T, 1)
    lse = torch.where(torch.isneginf(lse), 0.0, lse)  # a row with no key: exp(-inf - 0) = 0
    return torch.sub(scores, lse).exp_()  # (*batch, T, S); one allocation
