"""AttentionTrace: the intermediates of one attention call, returned (never stored on self).

Shape alphabet: B batch, H query heads, T query length, S key length. ``*batch`` stands for
whatever leading dims the call had (``()``, ``(H,)``, ``(B, H)``, ``(B, X, H)``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["AttentionTrace", "MultiHeadTrace", "probs_from_lse_"]


class AttentionTrace:
    """What attention computed on the way to its output, for inspection.

    The tensors are detached (no gradient flows through them): computing them beside a fast
    kernel must not make training slower or hold memory for a backward nobody asked for.

    ``scores`` may be given as a function that computes them: a fast backend builds only
    ``probs`` (one ``(T, S)`` buffer, not two) and the scores are recomputed from the call's
    inputs the first time they are read.

    Attributes:
        scores: Scaled scores after masking, before softmax; masked entries are ``-inf``.
        probs: Attention weights (before dropout); each row sums to 1, or is all 0 for a
            query row that may attend to nothing.
        lse: Log-sum-exp of each row of ``scores``; ``-inf`` for a fully masked row.
        backend: Name of the backend that computed the output.

    Shape:
        scores, probs: ``(*batch, T, S)``; lse: ``(*batch, T)``.
    """

    def __init__(self, scores: Tensor | Callable[[], Tensor], probs: Tensor, lse: Tensor,
                 backend: str) -> None:
        self._scores = scores
        self.probs, self.lse, self.backend = probs, lse, backend

    @property
    def scores(self) -> Tensor:
        if callable(self._scores):
            self._scores = self._scores()
        return self._scores

    def _lazy_scores(self, fn: Callable[[Tensor], Tensor]) -> Tensor | Callable[[], Tensor]:
        """``fn(self.scores)``, deferred while the scores are."""
        return (lambda: fn(self.scores)) if callable(self._scores) else fn(self._scores)

    def __repr__(self) -> str:
        shape = tuple(self.probs.shape)
        return f"{type(self).__name__}(probs{shape}, lse{tuple(self.lse.shape)}, backend={self.backend!r})"


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

    def __init__(self, trace: AttentionTrace, *, q: Tensor, k: Tensor, v: Tensor,
                 heads: Tensor, index: int | None = None) -> None:
        """Extend ``trace``; with ``index``, keep only that batch element of everything."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        super().__init__(trace._lazy_scores(pick), pick(trace.probs), pick(trace.lse),
                         trace.backend)
        self.q, self.k, self.v, self.heads = (pick(t).detach() for t in (q, k, v, heads))


def probs_from_lse_(scores: Tensor, lse: Tensor) -> Tensor:
    """Turn ``scores`` into attention weights ``exp(scores - lse)`` in place.

    This is how a fast backend that keeps only the log-sum-exp gives its weights back; a row
    whose ``lse`` is ``-inf`` (no key to attend) gets weights 0. In place, so that a trace of
    a long sequence costs one ``(T, S)`` buffer.

    Shape:
        scores ``(*batch, T, S)``, lse ``(*batch, T)`` -> ``(*batch, T, S)`` (the same tensor).
    """
    lse = lse.unsqueeze(-1)  # (*batch, T, 1)
    lse = torch.where(torch.isneginf(lse), 0.0, lse)  # a row with no key: exp(-inf - 0) = 0
    if lse.dtype == scores.dtype:
        return scores.sub_(lse).exp_()
    # Half scores with a float32 lse: an in-place mixed-dtype sub_ runs ~30x slower on CPU
    # (579 ms vs 20 ms for 8 x 4096^2 bf16), and rounding lse to half would scale whole rows
    # by up to e^0.02. Subtract it as two half-precision parts: high, then the remainder.
    high = lse.to(scores.dtype)
    low = (lse - high.to(lse.dtype)).to(scores.dtype)
    return scores.sub_(high).sub_(low).exp_()
