"""KVCache: preallocated keys and values of the positions decoded so far.

A softmax decoder that generates one token at a time attends each new query to every past
key; recomputing them would cost O(T) projections per token. The cache keeps them, written in
place into buffers allocated once for ``capacity`` positions (no reallocation per token).

Shape alphabet: B batch, G key/value heads, P capacity (positions), T new positions,
D head dim, Dv value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Keys, values and key mask of past positions, in buffers of fixed ``capacity``.

    Example:
        >>> cache = KVCache(batch_size=2, num_kv_heads=8, head_dim=64, capacity=4096)
        >>> keys, values, key_mask = cache.append(k_t, v_t)   # k_t (2, 8, 1, 64)
        >>> out = qkv.scaled_dot_product_attention(q_t, keys, values)

    Args:
        batch_size: B.
        num_kv_heads: G.
        head_dim: D of the keys.
        capacity: P, the most positions it holds; appending past it raises.
        value_dim: Dv (default D).

    Attributes:
        position: Positions stored so far (the next one is written at this index).

    Shape:
        keys ``(B, G, position, D)``; values ``(B, G, position, Dv)``; key_mask
        ``(B, position)`` (True = a real key) or None when no key_mask was given since the
        last reset (whether a given one marks padding is not read: on GPUs that would be a
        device sync per step).
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        value_dim: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        for name, n in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
            ("value_dim", head_dim if value_dim is None else value_dim),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"KVCache: {name} must be a positive int, got {n!r}")
        Dv = head_dim if value_dim is None else value_dim
        kw = dict(device=device, dtype=dtype)
        self._k = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, **kw)  # (B, G, P, D)
        self._v = torch.zeros(batch_size, num_kv_heads, capacity, Dv, **kw)  # (B, G, P, Dv)
        self._mask = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)  # (B, P)
        self._padded = False  # a key_mask was given since the last reset
        self.capacity, self.position = capacity, 0

    # (views by ``narrow``: a decoding step makes them every step, and indexing by slices
    # costs its Python more)
    @property
    def keys(self) -> Tensor:
        return self._k.narrow(2, 0, self.position)

    @property
    def values(self) -> Tensor:
        return self._v.narrow(2, 0, self.position)

    @property
    def key_mask(self) -> Tensor | None:
        return self._mask.narrow(1, 0, self.position) if self._padded else None

    def reset(self) -> KVCache:
        """Forget every position (the buffers are kept, their autograd history is not).

        Keys and values appended with a gradient (a module decoding without ``no_grad``, or
        trained through its cache) make the buffers part of that sequence's graph, so that
        gradients reach the projections of every position. A reset ends the sequence: the
        buffers are detached from it (the same memory), so that the next sequence's graph does
        not hold the last one's alive, nor run back into it (its backward raised "Trying to
        backward through the graph a second time" after the first sequence's).
        """
        self.position, self._padded = 0, False
        if self._k.requires_grad or self._v.requires_grad:
            self._k, self._v = self._k.detach(), self._v.detach()
        self._mask.fill_(True)
        return self

    def append(
        self, key: Tensor, value: Tensor, key_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store T new positions; returns all stored keys, values and the key mask.

        Shape:
            key ``(B, G, T, D)``; value ``(B, G, T, Dv)``; key_mask ``(B, T)`` ->
            ``(B, G, position, D)``, ``(B, G, position, Dv)``, ``(B, position)`` or None.
        """
        B, G, P, D = self._k.shape
        ks = key.shape
        T = ks[-2] if len(ks) == 4 else -1
        want_k, want_v = (B, G, T, D), (B, G, T, self._v.shape[-1])
        if ks != want_k or value.shape != want_v:
            raise ValueError(
                f"KVCache.append: need key (B, G, T, D) = (B={B}, G={G}, T, D={D}) "
                f"and value (B, G, T, Dv={want_v[-1]}), got key {tuple(key.shape)} "
                f"and value {tuple(value.shape)}"
            )
        if self.position + T > P:
            raise ValueError(
                f"KVCache is full: it holds {self.position} of {P} positions and "
                f"cannot take {T} more; make a cache with a larger capacity "
                f"(new_cache(batch_size, capacity=...)) or reset() it"
            )
        end = self.position + T
        self._k.narrow(2, self.position, T).copy_(key)
        self._v.narrow(2, self.position, T).copy_(value)
        if key_mask is not None:
            if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, T):
                raise ValueError(
                    f"KVCache.append: key_mask must be bool (B, T) = {(B, T)}, got "
                    f"{key_mask.dtype} {tuple(key_mask.shape)}"
                )
            self._mask.narrow(1, self.position, T).copy_(key_mask)
            self._padded = True  # (whether it marks any padding is not asked: that would read
            # it on the host, a device sync per decoding step on GPUs)
        self.position = end  # (the properties' views, made here: a step's Python counts)
        mask = self._mask.narrow(1, 0, end) if self._padded else None
        return self._k.narrow(2, 0, end), self._v.narrow(2, 0, end), mask

    def __repr__(self) -> str:
        B, G, P, D = self._k.shape
        return (
            f"KVCache(batch_size={B}, num_kv_heads={G}, head_dim={D}, capacity={P}, "
            f"position={self.position}, dtype={self._k.dtype})"
        )
