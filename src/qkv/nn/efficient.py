"""Efficient attention modules, interchangeable with :class:`MultiHeadAttention`.

Same constructor arguments (where they apply), same parameters and ``state_dict`` layout,
same ``forward(query, key=None, value=None, *, key_mask=, is_causal=, return_trace=,
cache=)`` and ``new_cache(batch_size, capacity)``: a Transformer block built around one works
with the others, decoding included.

* :class:`LinearMultiHeadAttention`: linear attention (``qkv.linear_attention``) per head;
  O(T) time and memory, decoding with a constant-size recurrent state.
* :class:`LocalMultiHeadAttention`: exact softmax attention within a sliding window
  (``qkv.masks.sliding_window``), run by the tiled backend, which skips the blocks outside
  the window.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, C model dim.
"""

from __future__ import annotations

from torch import Tensor

from .. import masks
from ..functional import linear_attention
from ..ops.linear import Favor, LinearAttentionState, check_eps, resolve_feature_map
from ._inputs import ModuleInputs
from .attention import MultiHeadAttention
from .cache import KVCache

__all__ = ["LinearMultiHeadAttention", "LocalMultiHeadAttention"]


class LinearMultiHeadAttention(MultiHeadAttention):
    """Multi-head linear attention (Katharopoulos et al. 2020; FAVOR+ with ``"favor"``).

    Projections, head split, concat and W^O exactly as :class:`MultiHeadAttention` (the same
    parameters: a state dict loads into either); each head attends with
    ``qkv.linear_attention``. ``new_cache`` gives a :class:`qkv.LinearAttentionState`: O(1)
    time and memory per generated token, at any position.

    Args:
        embed_dim, num_heads, kdim, vdim, bias, num_kv_heads: As in MultiHeadAttention.
        dropout: Must be 0: linear attention forms no attention weights to drop.
        feature_map: ``"elu"`` (default), ``"relu"``, ``"favor"``/``"performer"`` (this module
            gets its own :class:`qkv.Favor` of head_dim, seed 0, kept in its state dict), a
            FeatureMap module (e.g. ``qkv.Favor(head_dim, 256, seed=1, redraw=1000)``,
            registered as a submodule) or a function.
        eps: Added to each normaliser.

    Shape:
        As MultiHeadAttention; ``attn_mask``, ``mask_mod`` and ``score_mod`` are refused (no
        (T, S) scores exist to mask); padding goes in ``key_mask`` ``(B, S)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        num_kv_heads: int | None = None,
        feature_map="elu",
        eps: float = 1e-6,
        device=None,
        dtype=None,
    ) -> None:
        if dropout:
            raise ValueError(
                f"LinearMultiHeadAttention takes dropout=0.0 only, got {dropout}: "
                f"linear attention forms no attention weights to drop (put dropout "
                f"on the block's residual branch instead)"
            )
        super().__init__(
            embed_dim,
            num_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            num_kv_heads=num_kv_heads,
            device=device,
            dtype=dtype,
        )
        if isinstance(feature_map, str) and feature_map in ("favor", "performer"):
            feature_map = Favor(self.head_dim, device=device)  # its own buffers: saved, moved
        resolve_feature_map(feature_map, self.head_dim)  # bad names and sizes fail here
        self.feature_map, self.eps = feature_map, check_eps(eps)

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
        mask_mod=None,
        score_mod=None,
        # each kind decodes with the cache its own new_cache() gives: a LinearAttentionState
        # here, where MultiHeadAttention takes a KVCache (a KVCache is refused below)
        cache: LinearAttentionState | None = None,  # type: ignore[override]
    ):
        """As :meth:`MultiHeadAttention.forward`; decoding with ``cache=self.new_cache(B)``.

        ``return_trace`` gives the weights of the quadratic form
        (``phi(q_i) . phi(k_j)`` normalised, see ``qkv.linear_attention``), which costs (T, S)
        memory; it is refused while decoding (the state keeps no keys).
        """
        if attn_mask is not None or mask_mod is not None or score_mod is not None:
            raise ValueError(
                "linear attention has no (T, S) scores for attn_mask, mask_mod or "
                "score_mod to act on; pass padding as key_mask (B, S), or use "
                "MultiHeadAttention / LocalMultiHeadAttention for other masks"
            )
        if cache is not None and return_trace:
            raise ValueError(
                "return_trace is not available while decoding with a recurrent "
                "state (it keeps no keys); trace a full forward instead"
            )
        if cache is not None and not isinstance(cache, LinearAttentionState):
            raise TypeError(
                f"cache must come from this module's new_cache(), a "
                f"LinearAttentionState, got {type(cache).__name__}"
            )
        return super().forward(
            query,
            key,
            value,
            key_mask=key_mask,
            is_causal=is_causal,
            return_trace=return_trace,
            # the state goes through the shared forward to this class's _attend, which
            # decodes with it (MultiHeadAttention.forward's KVCache is what its _attend takes)
            cache=cache,  # type: ignore[arg-type]
        )

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        inp: ModuleInputs,
        *,
        is_causal: bool,
        return_trace: bool,
        mask_mod,
        score_mod,
        cache,
    ):
        if cache is not None:
            km = inp.key_mask
            if q.shape[-2] == 1:  # one token: the O(1) step
                heads = cache.step(
                    q[:, :, 0], k[:, :, 0], v[:, :, 0], None if km is None else km[:, 0]
                ).unsqueeze(2)  # (B, H, 1, D)
            else:  # a prompt: chunk-wise
                heads = cache.extend(q, k, v, km)  # (B, H, T, D)
            return heads, None, k, v
        res = linear_attention(
            q,
            k,
            v,
            feature_map=self.feature_map,
            is_causal=is_causal,
            key_mask=inp.key_mask,
            eps=self.eps,
            return_trace=return_trace,
        )
        heads, trace = res if return_trace else (res, None)
        return heads, trace, k, v

    # returns this kind's cache, a LinearAttentionState, where MultiHeadAttention's is a
    # KVCache: the modules are interchangeable through new_cache(), not through its type
    def new_cache(  # type: ignore[override]
        self, batch_size: int, capacity: int | None = None, *, device=None, dtype=None
    ) -> LinearAttentionState:
        """An empty recurrent state; its size does not grow, so ``capacity`` is not needed
        (accepted so that code written for MultiHeadAttention works unchanged)."""
        return LinearAttentionState(self.feature_map, eps=self.eps)

    def extra_repr(self) -> str:
        fm = (
            self.feature_map
            if isinstance(self.feature_map, str)
            else type(self.feature_map).__name__
        )
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, feature_map={fm!r}, eps={self.eps}"
        )


class LocalMultiHeadAttention(MultiHeadAttention):
    """Multi-head softmax attention within a sliding window (local attention).

    Query ``i`` sees keys ``j`` with ``i - left <= j <= i + right``, and with
    ``is_causal=True`` only ``j <= i``: ``qkv.masks.sliding_window(left, right)`` on the
    exact backends, so ``backend="auto"`` runs the tiled backend, which never computes a block
    outside the window: O(T x window) work, O(T) memory. Decoding with a cache aligns the
    window bottom-right (the new positions continue the cached ones).

    Args:
        embed_dim, num_heads: As MultiHeadAttention.
        window: Keys on each side (``left = right = window``), or ``(left, right)``.
        **kwargs: The other MultiHeadAttention arguments (kdim, vdim, bias, dropout,
            num_kv_heads, backend, device, dtype).

    Shape:
        As MultiHeadAttention.
    """

    def __init__(
        self, embed_dim: int, num_heads: int, *, window: int | tuple[int, int], **kwargs
    ) -> None:
        super().__init__(embed_dim, num_heads, **kwargs)
        left, right = window if isinstance(window, tuple) else (window, window)
        masks.sliding_window(left, right)  # the vocabulary checks the numbers
        self.window = (left, right)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        inp: ModuleInputs,
        *,
        is_causal: bool,
        return_trace: bool,
        mask_mod,
        score_mod,
        cache: KVCache | None,
    ):
        align = "top_left" if cache is None else "bottom_right"
        local = masks.sliding_window(*self.window, align=align)
        mask_mod = local if mask_mod is None else masks.and_masks(local, mask_mod)
        return super()._attend(
            q,
            k,
            v,
            inp,
            is_causal=is_causal,
            return_trace=return_trace,
            mask_mod=mask_mod,
            score_mod=score_mod,
            cache=cache,
        )

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, window={self.window}"
        )
