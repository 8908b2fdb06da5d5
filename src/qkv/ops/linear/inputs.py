"""Checks and layout for linear attention's public entry points.

Inputs are accepted as ``scaled_dot_product_attention`` accepts them (``(T, D)``,
``(H, T, D)``, ``(B, H, T, D)``, ``(B, X, H, T, D)``), checked with errors that name the
numbers and the fix, then flattened to the kernels' ``(N, L, D)``.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value dim, N = B x H (all leading dims flattened).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class LinearInputs:
    """Flattened, checked inputs; ``out_shape`` restores the caller's layout.

    Shape:
        q ``(N, T, D)``; k ``(N, S, D)``; v ``(N, S, Dv)``; key_mask ``(N, S)`` or None.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    key_mask: Tensor | None
    out_shape: tuple[int, ...]
    dtype: torch.dtype

    def restore(self, out: Tensor) -> Tensor:
        """``(N, T, Dv)`` in compute dtype -> the caller's ``(*batch, T, Dv)`` and dtype."""
        return out.reshape(self.out_shape).to(self.dtype)


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def prepare(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_mask: Tensor | None,
    *,
    is_causal: bool,
    what: str = "linear_attention",
) -> LinearInputs:
    """Check shapes, dtypes and the key mask; expand GQA heads; flatten to ``(N, L, D)``."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{what}: {name} must be a floating tensor (float16, bfloat16, "
                f"float32, float64), got {t.dtype}"
            )
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"{what}: query, key and value must share a dtype, got {query.dtype}, "
            f"{key.dtype} and {value.dtype}"
        )
    if not query.device == key.device == value.device:
        raise ValueError(
            f"{what}: query, key and value must be on one device, got "
            f"{query.device}, {key.device} and {value.device}"
        )
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not query.dim() == key.dim() == value.dim() or query.dim() < 2:
        raise ValueError(
            f"{what}: query, key and value need the same number of dims (2 or "
            f"more: (T, D), (H, T, D), (B, H, T, D), ...), got {shapes}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{what}: query and key need the same head dim D, got {shapes}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"{what}: key and value need the same length S, got {shapes}")
    T, S = query.shape[-2], key.shape[-2]
    if query.dim() >= 3:
        if query.shape[:-3] != key.shape[:-3] or key.shape[:-2] != value.shape[:-2]:
            raise ValueError(
                f"{what}: query, key and value need the same batch dims, and key "
                f"and value the same heads, got {shapes}"
            )
        H, G = query.shape[-3], key.shape[-3]
        if H % G:
            raise ValueError(
                f"{what}: got H={H} query heads and G={G} key/value heads; H must "
                f"be a multiple of G"
            )
        if G != H:  # grouped heads: each key/value head serves H / G query heads
            key, value = (t.repeat_interleave(H // G, dim=-3) for t in (key, value))
    if is_causal and T != S:
        raise ValueError(
            f"{what}: is_causal needs T == S (query i sees keys j <= i of the "
            f"same sequence), got T={T}, S={S}; to continue a sequence, use "
            f"qkv.LinearAttentionState"
        )
    mask = _check_key_mask(key_mask, query, S, what)
    dtype = query.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    N = math.prod(query.shape[:-2])
    q, k, v = (t.reshape(N, t.shape[-2], t.shape[-1]).to(compute) for t in (query, key, value))
    return LinearInputs(q, k, v, mask, tuple(query.shape[:-1]) + (value.shape[-1],), dtype)


def _check_key_mask(key_mask: Tensor | None, query: Tensor, S: int, what: str) -> Tensor | None:
    """``key_mask`` ``(*batch, S)`` (``query``'s dims without heads, T and D) as ``(N, S)``."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
        raise TypeError(
            f"{what}: key_mask must be a bool tensor with True marking a real key, got {got}"
        )
    batch = tuple(query.shape[:-3])
    if tuple(key_mask.shape) != batch + (S,):
        raise ValueError(
            f"{what}: key_mask must have shape (*batch, S) = {batch + (S,)} for "
            f"query {tuple(query.shape)}, got {tuple(key_mask.shape)}"
        )
    if key_mask.device != query.device:
        raise ValueError(f"{what}: key_mask is on {key_mask.device}, query on {query.device}")
    H = query.shape[-3] if query.dim() >= 3 else 1
    N = math.prod(batch) * H
    return key_mask.unsqueeze(-2).expand(*batch, H, S).reshape(N, S)  # (N, S)
