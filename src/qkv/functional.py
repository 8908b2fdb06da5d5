"""Functional attention: a superset of ``torch.nn.functional.scaled_dot_product_attention``.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim of query/key, Dv head dim of value.
"""
from __future__ import annotations

from torch import Tensor

from . import dispatch
from .ops import AttentionCall
from .trace import AttentionTrace

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
    return_trace: bool = False,
    mask_mod=None,
    score_mod=None,
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """``softmax(query @ key^T * scale + mask) @ value``, exact on every edge case.

    Every input that ``torch.nn.functional.scaled_dot_product_attention`` accepts gives the
    same result here. On top of torch:

    * **One mask contract.** A bool ``attn_mask`` means True = may attend; a float mask is
      added to the scores (a float mask that is neither float32 nor the query's dtype is cast
      to the query's dtype). A query row that may attend to nothing outputs exactly 0, its
      gradients are 0, and nothing is NaN, on every backend and dtype, with dropout too.
    * **attn_mask with is_causal=True** is allowed (torch raises): the two are combined, a key
      must pass both. ``is_causal`` is aligned top-left, as in torch: query ``i`` sees keys
      ``j <= i``. For ``T != S`` (x = may attend)::

          T=2, S=4      T=4, S=2
          x . . .       x .
          x x . .       x x
                        x x
                        x x

    * **Structured masks and score changes** (FlexAttention's vocabulary, see ``qkv.masks``):
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)``.
      They combine with ``attn_mask`` and ``is_causal`` (a key must pass all). The ``tiled``
      backend runs them in O(T + S) extra memory, skipping blocks the mask leaves empty;
      ``auto`` sends such calls there.
    * **Traces.** ``return_trace=True`` also returns an :class:`AttentionTrace` with the
      scores, weights (before dropout) and log-sum-exp, from any backend.
    * **Backends.** ``backend="auto"`` picks the fastest that supports the call; naming one
      (``"torch"``, ``"tiled"``, ``"reference"``) that cannot take it raises with the reason.
    * **Checked input.** Bad shapes, dtypes, devices, masks, ``scale`` or ``dropout_p``
      raise ValueError/TypeError naming the numbers and the fix. ``dropout_p`` must be in
      [0, 1) and ``scale`` finite.

    Dropout draws from torch's global generator exactly as torch does, so a call is
    reproducible under ``torch.manual_seed``.

    Args:
        query: Queries.
        key: Keys.
        value: Values.
        attn_mask: Bool (True = may attend) or float (added) mask, broadcastable to the
            scores' shape ``(*batch, T, S)``.
        dropout_p: Probability of dropping an attention weight (kept weights are scaled by
            ``1 / (1 - dropout_p)``). Applied whenever > 0, as in torch: pass 0.0 in eval.
        is_causal: Hide keys after the query position (top-left aligned).
        scale: Factor on ``query @ key^T``; None means ``1 / sqrt(D)``.
        enable_gqa: Share each of G key/value heads across H / G query heads (dim -3).
        backend: ``"auto"`` or a registered backend name.
        return_trace: Also return the AttentionTrace.
        mask_mod: A structured mask, e.g. ``qkv.masks.sliding_window(256)`` (True = may
            attend), or a plain function of the same signature.
        score_mod: A change of the scaled scores before softmax, e.g.
            ``qkv.masks.alibi(slopes)``, ``qkv.masks.softcap(30.0)``, or a plain function.

    Returns:
        The output, or ``(output, trace)`` when ``return_trace`` is True.

    Shape:
        query ``(*batch, H, T, D)``; key ``(*batch, G, S, D)``; value ``(*batch, G, S, Dv)``;
        output ``(*batch, H, T, Dv)``. Inputs may have 2 to any number of dims and leading
        dims broadcast as in torch; G == H unless ``enable_gqa`` (then H % G == 0).

    Example:
        >>> q = torch.tensor([[0.0, 2 ** 0.5]]); k = torch.eye(2); v = torch.eye(2)
        >>> qkv.scaled_dot_product_attention(q, k, v)  # [[1, e]] / (1 + e)
        tensor([[0.2689, 0.7311]])
    """
    call = AttentionCall.build(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_trace,
        mask_mod, score_mod,
    )
    return dispatch.run(call, backend)
