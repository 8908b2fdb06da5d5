"""Linear attention, slow twins: the quadratic normalised form and a step-by-step loop.

These write the formula out as plainly as possible; ``chunk.py`` (global and chunk-wise
kernels) and ``recurrent.py`` (the O(1) step) are tested against them by name.

Shape alphabet: N flattened batch x heads, T query length, S key length, M features,
Dv value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .feature_maps import Features

__all__ = ["linear_attention_loop", "linear_attention_quadratic"]


def linear_attention_quadratic(
    fq: Features, fk: Features, v: Tensor, *, is_causal: bool, key_mask: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The (T, S) form: ``A_ij = phi(q_i) . phi(k_j)`` (0 where masked),
    ``out = A V / (A 1 + eps)``.

    Computed in log space so it is also the trace of linear attention: ``scores = log A``,
    ``lse = log(sum_j A_ij + eps)``, ``probs = exp(scores - lse)``, ``out = probs @ V``.
    Every row of probs sums to ``1 - eps / (sum_j A_ij + eps)``.

    Returns:
        ``(out, scores, lse)``.

    Shape:
        fq ``(N, T, M)``; fk ``(N, S, M)``; v ``(N, S, Dv)``; key_mask ``(N, S)`` or None ->
        out ``(N, T, Dv)``, scores ``(N, T, S)``, lse ``(N, T)``.
    """
    A = fq.values @ fk.values.transpose(-1, -2)  # (N, T, S), up to the log-scales
    hidden = A <= 0
    if is_causal:
        T, S = A.shape[-2:]
        hidden = hidden | ~torch.ones(T, S, dtype=torch.bool, device=A.device).tril()
    if key_mask is not None:
        hidden = hidden | ~key_mask.unsqueeze(-2)
    scores = torch.log(torch.where(hidden, torch.ones_like(A), A))  # (N, T, S)
    if fq.log_scale is not None:
        scores = scores + fq.log_scale.unsqueeze(-1)
    if fk.log_scale is not None:
        scores = scores + fk.log_scale.unsqueeze(-2)
    scores = scores.masked_fill(hidden, float("-inf"))
    log_eps = torch.log(torch.tensor(eps, dtype=A.dtype, device=A.device))
    lse = torch.logaddexp(torch.logsumexp(scores, -1), log_eps)  # (N, T)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe.unsqueeze(-1))  # (N, T, S)
    if key_mask is not None:  # a padded value may be inf/NaN; 0 * NaN would leak it
        v = torch.where(key_mask.unsqueeze(-1), v, torch.zeros((), dtype=v.dtype, device=v.device))
    return probs @ v, scores, lse


def linear_attention_loop(
    fq: Features, fk: Features, v: Tensor, *, key_mask: Tensor | None, eps: float
) -> Tensor:
    """Causal linear attention one position at a time, with the features written out:
    ``kv += phi(k_i) v_i^T``, ``z += phi(k_i)``, ``out_i = phi(q_i) kv / (phi(q_i) . z + eps)``.

    Shape:
        fq ``(N, T, M)``; fk ``(N, T, M)``; v ``(N, T, Dv)``; key_mask ``(N, T)`` or None ->
        ``(N, T, Dv)``.
    """
    phi_q, phi_k = fq.dense(), fk.dense()  # (N, T, M)
    N, T, M = phi_q.shape
    kv = torch.zeros(N, M, v.shape[-1], dtype=v.dtype, device=v.device)
    z = torch.zeros(N, M, dtype=v.dtype, device=v.device)
    outs = []
    for i in range(T):
        if key_mask is None or bool(key_mask[:, i].all()):
            kv = kv + phi_k[:, i, :, None] * v[:, i, None, :]
            z = z + phi_k[:, i]
        else:
            keep = key_mask[:, i]
            kv = kv + torch.where(keep[:, None, None], phi_k[:, i, :, None] * v[:, i, None, :], 0.0)
            z = z + torch.where(keep[:, None], phi_k[:, i], 0.0)
        num = (phi_q[:, i, None, :] @ kv).squeeze(-2)  # (N, Dv)
        den = (phi_q[:, i] * z).sum(-1)  # (N,)
        outs.append(num / (den + eps).unsqueeze(-1))
    return torch.stack(outs, 1)  # (N, T, Dv)
