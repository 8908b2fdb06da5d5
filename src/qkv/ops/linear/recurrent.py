"""Recurrent linear attention: a constant-size state and an O(1) step per token.

Causal linear attention is an RNN (Katharopoulos et al. 2020, sec. 3.4): after position i the
state is ``kv = sum_{j<=i} phi(k_j) v_j^T`` and ``z = sum_{j<=i} phi(k_j)``, and position i's
output is ``phi(q_i) kv / (phi(q_i) . z + eps)``. :class:`LinearAttentionState` holds it;
``step`` adds one token in O(M x Dv), whatever the position; ``extend`` adds many with the
chunk-wise kernel. Both equal ``linear_attention(..., is_causal=True)`` on the whole sequence.

The slow twin of ``step`` is ``naive.linear_attention_loop``.

Shape alphabet: B batch, H heads, T new positions, D head dim, Dv value dim, M features,
N = B x H flattened.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunk import (
    LinearState,
    _finite,
    _key_scale,
    _normalize,
    _query_units,
    linear_attention_chunked,
)
from .feature_maps import resolve_feature_map
from .inputs import check_eps, prepare

__all__ = ["LinearAttentionState"]


class LinearAttentionState:
    """The state of causal linear attention, for generation one token at a time.

    Example:
        >>> state = qkv.LinearAttentionState("elu")
        >>> y = state.extend(q_prompt, k_prompt, v_prompt)     # (B, H, T, Dv), chunk-wise
        >>> y_t = state.step(q_t, k_t, v_t)                     # (B, H, Dv), O(1)

    Args:
        feature_map: As in :func:`qkv.linear_attention` (a name, a FeatureMap such as
            :class:`qkv.Favor`, or a function). A Favor map should be in eval mode (no redraw).
        eps: Added to the normaliser, as in :func:`qkv.linear_attention`.

    Attributes:
        position: Tokens seen so far.
        kv, z: The running sums (in units ``exp(-m)`` for FAVOR+), None before the first token.
            Without autograd, ``step`` updates them in place (clone them to keep a snapshot;
            ``copy.deepcopy`` copies a whole state).

    Shape:
        step: query, key ``(*batch, H, D)``, value ``(*batch, G, Dv)`` -> ``(*batch, H, Dv)``;
        key_mask ``(*batch,)``. extend: the same with a T dim before D, key_mask
        ``(*batch, T)``. G key/value heads, H a multiple of G. The batch and head dims are
        fixed by the first call.
    """

    def __init__(self, feature_map="elu", *, eps: float = 1e-6) -> None:
        self.feature_map, self.eps = feature_map, check_eps(eps)
        self.position = 0
        self._state: LinearState | None = None
        self._shape: tuple[int, ...] | None = None  # (*batch, H) of the first call
        self._phi = None

    @property
    def kv(self) -> Tensor | None:
        return None if self._state is None else self._state.kv

    @property
    def z(self) -> Tensor | None:
        return None if self._state is None else self._state.z

    def reset(self) -> LinearAttentionState:
        """Forget every token (the batch and head layout too)."""
        self.position, self._state, self._shape = 0, None, None
        return self

    def extend(
        self, query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None = None
    ) -> Tensor:
        """Add T tokens (a prompt) with the chunk-wise kernel; returns their outputs.

        Shape:
            query ``(*batch, H, T, D)``; key ``(*batch, G, T, D)``; value ``(*batch, G, T, Dv)``
            -> ``(*batch, H, T, Dv)``; key_mask ``(*batch, T)``.
        """
        if query.dim() < 3:
            raise ValueError(
                f"LinearAttentionState.extend takes (*batch, H, T, D) inputs, got "
                f"query {tuple(query.shape)}"
            )
        inp = prepare(
            query, key, value, key_mask, is_causal=True, what="LinearAttentionState.extend"
        )
        phi = self._begin(query.shape[:-2], query.shape[-1])
        state = self._state_for(inp.q, phi, inp.v.shape[-1])
        out, self._state = linear_attention_chunked(
            phi, inp.q, inp.k, inp.v, inp.key_mask, self.eps, state=state
        )
        self.position += query.shape[-2]
        return inp.restore(out)

    def step(
        self, query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None = None
    ) -> Tensor:
        """Add one token; O(M x Dv) whatever the position.

        Shape:
            query ``(*batch, H, D)``; key ``(*batch, G, D)``; value ``(*batch, G, Dv)`` ->
            ``(*batch, H, Dv)``; key_mask ``(*batch,)`` (False: this token is padding).
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor) or t.dim() < 2:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"LinearAttentionState.step takes one token, (*batch, H, D); {name} is {got}"
                )
        km = (
            None
            if key_mask is None
            else torch.as_tensor(key_mask, device=query.device).unsqueeze(-1)
        )
        inp = prepare(
            query.unsqueeze(-2),
            key.unsqueeze(-2),
            value.unsqueeze(-2),
            km,
            is_causal=True,
            what="LinearAttentionState.step",
        )
        phi = self._begin(query.shape[:-1], query.shape[-1])
        state = self._state_for(inp.q, phi, inp.v.shape[-1])
        out, self._state = _step(phi(inp.q), phi(inp.k), inp.v, inp.key_mask, self.eps, state)
        self.position += 1
        return inp.restore(out).squeeze(-2)  # (*batch, H, Dv)

    def _begin(self, shape: tuple[int, ...], D: int):
        """Fix (or check) the batch and head layout; the feature map for head dim D."""
        shape = tuple(shape)
        if self._shape is None:
            self._shape, self._phi = shape, resolve_feature_map(self.feature_map, D)
        elif shape != self._shape:
            raise ValueError(
                f"this state holds (*batch, H) = {self._shape}, got inputs with "
                f"{shape}; use one state per sequence batch (or reset() it)"
            )
        return self._phi

    def _state_for(self, q: Tensor, phi, Dv: int) -> LinearState:
        if self._state is None:
            M = phi(q[:1, :1]).values.shape[-1]  # (a FAVOR+ map's M; D for elu)
            self._state = LinearState.zeros(q.shape[0], M, Dv, device=q.device, dtype=q.dtype)
        return self._state

    def __repr__(self) -> str:
        return (
            f"LinearAttentionState(feature_map={self.feature_map!r}, eps={self.eps}, "
            f"position={self.position})"
        )


def _step(
    fq, fk, v: Tensor, key_mask: Tensor | None, eps: float, state: LinearState
) -> tuple[Tensor, LinearState]:
    """One position of causal linear attention from ``state``.

    Shape:
        fq, fk ``(N, 1, M)``; v ``(N, 1, Dv)``; key_mask ``(N, 1)`` or None -> ``(N, 1, Dv)``.
    """
    phi_q, b = _query_units(fq)  # (N, 1, M)
    phi_k, vt = fk.values[:, 0], v[:, 0]  # (N, M), (N, Dv)
    kv, z, m = state.kv, state.z, state.m
    # Without autograd, update the state's buffers in place: no (N, M, Dv) allocation a token.
    inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (phi_k, vt, kv, z)))
    if fk.log_scale is not None:  # keep the state in units of the largest key so far
        a = fk.log_scale[:, 0]  # (N,)
        seen = (
            a.detach()
            if key_mask is None
            else a.detach().masked_fill(~key_mask[:, 0], float("-inf"))
        )
        m_new = torch.maximum(m, seen)
        r = torch.where(torch.isfinite(m_new), (m - _finite(m_new)).exp(), torch.zeros_like(m))
        if inplace:
            kv.mul_(r[:, None, None]), z.mul_(r[:, None])
        else:
            kv, z = kv * r[:, None, None], z * r[:, None]
        m = m_new
        phi_k = phi_k * (
            _key_scale(a, None if key_mask is None else key_mask[:, 0]) - _finite(m)
        ).exp().unsqueeze(-1)
    if key_mask is not None:
        keep = key_mask[:, :1]  # (N, 1)
        phi_k = torch.where(keep, phi_k, torch.zeros((), dtype=phi_k.dtype, device=phi_k.device))
        vt = torch.where(keep, vt, torch.zeros((), dtype=vt.dtype, device=vt.device))
    if inplace:
        kv.baddbmm_(phi_k.unsqueeze(-1), vt.unsqueeze(-2)), z.add_(phi_k)
    else:
        kv = torch.baddbmm(kv, phi_k.unsqueeze(-1), vt.unsqueeze(-2))  # (N, M, Dv)
        z = z + phi_k  # (N, M)
    num = phi_q @ kv  # (N, 1, Dv)
    den = (phi_q @ z.unsqueeze(-1)).squeeze(-1)  # (N, 1)
    units = b
    if fk.log_scale is not None:
        m_units = _finite(m).unsqueeze(-1)
        units = m_units if units is None else units + m_units
    return _normalize(num, den, eps, units), LinearState(kv, z, m)
