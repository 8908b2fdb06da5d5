"""Transformer layers and stacks (Vaswani et al. 2017), on any attention kind.

* :class:`EncoderLayer`: self-attention + MLP. Bidirectional for an encoder; run with
  ``is_causal=True`` it is the block of a decoder-only language model (GPT's).
* :class:`DecoderLayer`: causal self-attention + cross-attention to the encoder output + MLP.
* :class:`Encoder`, :class:`Decoder`: stacks of them, with the final LayerNorm a pre-norm stack
  needs.

Each sub-layer is residual with dropout on its branch. ``norm_first=True`` (pre-norm,
GPT-2/ViT): ``x + dropout(f(norm(x)))``, and the stack ends with a norm; ``norm_first=False``
(post-norm, the original Transformer): ``norm(x + dropout(f(x)))``.

Decoding: the self-attention of every layer keeps a cache (:class:`DecodingCache`, one entry
per layer from each attention module's ``new_cache``). Cross-attention keeps none: the
encoder output is computed once and each step attends to it, projecting its keys and values
again (O(S C^2) per layer and step; the attention modules have no API for precomputed keys).

Traces are returned, never stored: ``return_attention=True`` gives each attention module's
``MultiHeadTrace``, self- and cross-attention separately.

Context parallel: with ``context_group`` (and ``context_layout``) every attention module of a
layer runs over the ranks' shards (see :class:`qkv.MultiHeadAttention`); the MLP, norms and
residuals are per position, so a layer fed this rank's shard ``(B, T_r, C)`` (and the memory's
shard ``(B, S_r, C)``) gives this rank's rows of the whole sequence's output.

Shape alphabet: B batch, T (target) length, S source (memory) length, C model dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from torch import Tensor, nn

from ..trace import MultiHeadTrace
from .kinds import make_attention

__all__ = [
    "AttentionMaps",
    "Decoder",
    "DecoderLayer",
    "DecodingCache",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
]


@dataclass(frozen=True)
class AttentionMaps:
    """The attention traces of one model call, one per layer, in layer order.

    Attributes:
        encoder: Self-attention of the encoder stack (encoder models, ViT, seq2seq).
        decoder: Causal self-attention of the decoder stack (DecoderLM, seq2seq).
        cross: Cross-attention of the seq2seq decoder to the encoder output.

    Shape:
        Each trace's ``probs`` is ``(B, H, T, S)``: ``(B, H, T, T)`` for self-attention
        (``(B, H, T, position)`` while decoding with a cache), ``(B, H, T, S)`` for
        cross-attention.
    """

    encoder: list[MultiHeadTrace] = field(default_factory=list)
    decoder: list[MultiHeadTrace] = field(default_factory=list)
    cross: list[MultiHeadTrace] = field(default_factory=list)


class DecodingCache:
    """The self-attention caches of a stack, one per layer, for one batch of sequences.

    Each entry is what that layer's attention module's ``new_cache(batch_size, capacity)``
    gives: a :class:`qkv.KVCache` (exact, local; raises when written past ``capacity``) or a
    :class:`qkv.LinearAttentionState` (linear, performer; constant size).

    Attributes:
        layers: The per-layer caches.
        position: Positions stored so far; the next token has this absolute position.
    """

    def __init__(self, layers: list) -> None:
        self.layers = list(layers)

    @property
    def position(self) -> int:
        return self.layers[0].position

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int):
        return self.layers[i]

    def __repr__(self) -> str:
        return f"DecodingCache({len(self.layers)} layers, position={self.position})"


class FeedForward(nn.Sequential):
    """The position-wise MLP: ``Linear(C, F) -> GELU -> Linear(F, C)``.

    Shape:
        ``(B, T, C)`` -> ``(B, T, C)``.
    """

    def __init__(self, embed_dim: int, ffn_dim: int, *, device=None, dtype=None) -> None:
        kw = dict(device=device, dtype=dtype)
        super().__init__(
            nn.Linear(embed_dim, ffn_dim, **kw), nn.GELU(), nn.Linear(ffn_dim, embed_dim, **kw)
        )


class _Residual(nn.Module):
    """Residual sub-layers in pre- or post-norm order, with dropout on the branch."""

    def __init__(self, dropout: float, norm_first: bool) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.norm_first = bool(norm_first)
        self.dropout = nn.Dropout(dropout)

    def _sublayer(
        self, x: Tensor, norm: nn.LayerNorm, branch: Callable[[Tensor], tuple[Tensor, Any]]
    ) -> tuple[Tensor, Any]:
        """Pre-norm ``x + drop(f(norm(x)))`` or post-norm ``norm(x + drop(f(x)))``; ``branch``
        returns ``(f(x), trace or None)``."""
        y, trace = branch(norm(x) if self.norm_first else x)  # (B, T, C)
        x = x + self.dropout(y)
        return (x if self.norm_first else norm(x)), trace


def _attend(module: nn.Module, return_trace: bool, *args, **kwargs) -> tuple[Tensor, Any]:
    """``(output, trace or None)`` of an attention module."""
    res = module(*args, return_trace=return_trace, **kwargs)
    return res if return_trace else (res, None)


class EncoderLayer(_Residual):
    """Self-attention then MLP, each a residual sub-layer.

    Args:
        embed_dim: C.
        num_heads: H.
        ffn_dim: Hidden width of the MLP (default ``4 * C``).
        dropout: On each residual branch (training only).
        norm_first: Pre-norm (True) or post-norm (False).
        attention: Attention kind (``qkv.models.attention_kinds()``).
        attention_options: Keyword arguments of that kind (``{"window": 64}`` for local).
        context_group: Run context-parallel over this process group (None: one process);
            the kind must support it (``"exact"``, ``"local"``).
        context_layout: ``"contiguous"`` or ``"balanced"`` shards.

    Shape:
        x ``(B, T, C)``; key_mask ``(B, T)`` (True = a real token) -> ``(B, T, C)``.
        Context parallel: this rank's shards ``(B, T_r, C)`` and ``(B, T_r)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        context_group=None,
        context_layout: str = "contiguous",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dropout, norm_first)
        kw = dict(device=device, dtype=dtype)
        self.self_attn = make_attention(
            attention,
            embed_dim,
            num_heads,
            options=attention_options,
            context_group=context_group,
            context_layout=context_layout,
            **kw,
        )
        self.ffn = FeedForward(embed_dim, ffn_dim or 4 * embed_dim, **kw)
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim, **kw), nn.LayerNorm(embed_dim, **kw)

    def forward(
        self,
        x: Tensor,
        *,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        cache=None,
        return_attention: bool = False,
    ):
        """Returns ``x`` or, with ``return_attention``, ``(x, self-attention trace)``.

        With ``cache`` (this layer's entry of a :class:`DecodingCache`), ``x`` holds the next
        positions; they attend causally to the cached ones and are appended.
        """
        x, trace = self._sublayer(
            x,
            self.norm1,
            lambda h: _attend(
                self.self_attn,
                return_attention,
                h,
                key_mask=key_mask,
                is_causal=is_causal,
                cache=cache,
            ),
        )  # (B, T, C)
        x, _ = self._sublayer(x, self.norm2, lambda h: (self.ffn(h), None))  # (B, T, C)
        return (x, trace) if return_attention else x


class DecoderLayer(_Residual):
    """Causal self-attention, cross-attention to the encoder output, then MLP.

    Args:
        embed_dim, num_heads, ffn_dim, dropout, norm_first, attention, attention_options:
            As :class:`EncoderLayer` (``attention`` is the self-attention's kind).
        cross_attention: Kind of the cross-attention (default ``"exact"``). ``"linear"`` and
            ``"performer"`` work too; ``"local"`` windows by index (query i sees memory
            positions near i), which fits only aligned sequences, and decoding one token at a
            time does not give it the token's position, so its cached decoding differs from
            the full forward.
        cross_attention_options: Keyword arguments of that kind.
        context_group, context_layout: As :class:`EncoderLayer`, for both attentions (the
            memory is sharded over the same group and layout).

    Shape:
        x ``(B, T, C)``; memory ``(B, S, C)``; key_mask ``(B, T)``; memory_mask ``(B, S)``
        (True = a real token) -> ``(B, T, C)``. Context parallel: this rank's shards
        ``(B, T_r, C)``, ``(B, S_r, C)``, ``(B, T_r)``, ``(B, S_r)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        cross_attention: str = "exact",
        cross_attention_options: Mapping[str, Any] | None = None,
        context_group=None,
        context_layout: str = "contiguous",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(dropout, norm_first)
        kw = dict(
            device=device, dtype=dtype, context_group=context_group, context_layout=context_layout
        )
        self.self_attn = make_attention(
            attention, embed_dim, num_heads, options=attention_options, **kw
        )
        self.cross_attn = make_attention(
            cross_attention, embed_dim, num_heads, options=cross_attention_options, **kw
        )
        kw = dict(device=device, dtype=dtype)
        self.ffn = FeedForward(embed_dim, ffn_dim or 4 * embed_dim, **kw)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(embed_dim, **kw) for _ in range(3))

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        key_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache=None,
        return_attention: bool = False,
    ):
        """Returns ``x`` or, with ``return_attention``, ``(x, self trace, cross trace)``.

        The self-attention is causal; with ``cache`` ``x`` holds the next positions.
        """
        x, self_trace = self._sublayer(
            x,
            self.norm1,
            lambda h: _attend(
                self.self_attn, return_attention, h, key_mask=key_mask, is_causal=True, cache=cache
            ),
        )  # (B, T, C)
        x, cross_trace = self._sublayer(
            x,
            self.norm2,
            lambda h: _attend(
                self.cross_attn, return_attention, h, memory, memory, key_mask=memory_mask
            ),
        )  # (B, T, C)
        x, _ = self._sublayer(x, self.norm3, lambda h: (self.ffn(h), None))  # (B, T, C)
        return (x, self_trace, cross_trace) if return_attention else x


class _Decodes(Protocol):
    """An attention module's decoding side: every attention kind has it (the contract of
    :func:`qkv.models.register_attention`)."""

    def new_cache(self, batch_size: int, capacity: int) -> Any: ...


class _Stack(nn.Module):
    """Layers, then the final LayerNorm of a pre-norm stack (post-norm ends normalised)."""

    def __init__(
        self, layers: Sequence[_Residual], embed_dim: int, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        if not layers:
            raise ValueError("a stack needs num_layers >= 1")
        self.layers = nn.ModuleList(layers)
        self.norm = (
            nn.LayerNorm(embed_dim, device=device, dtype=dtype)
            if layers[0].norm_first
            else nn.Identity()
        )

    def new_cache(self, batch_size: int, capacity: int) -> DecodingCache:
        """Empty self-attention caches for decoding ``capacity`` positions of ``batch_size``
        sequences (each layer's attention module makes its own)."""
        attns = [cast(_Decodes, layer.self_attn) for layer in self.layers]
        return DecodingCache([a.new_cache(batch_size, capacity) for a in attns])

    def _layer_caches(self, cache: DecodingCache | None) -> list:
        if cache is None:
            return [None] * len(self.layers)
        if not isinstance(cache, DecodingCache) or len(cache) != len(self.layers):
            got = (
                f"{len(cache)} layers" if isinstance(cache, DecodingCache) else type(cache).__name__
            )
            raise ValueError(
                f"cache must be this stack's new_cache() ({len(self.layers)} layers), got {got}"
            )
        return cache.layers


class Encoder(_Stack):
    """A stack of :class:`EncoderLayer`.

    Args:
        num_layers: Layers.
        embed_dim, num_heads: C, H.
        **layer_kwargs: :class:`EncoderLayer`'s keyword arguments (ffn_dim, dropout,
            norm_first, attention, attention_options, context_group, context_layout, device,
            dtype).

    Shape:
        x ``(B, T, C)``; key_mask ``(B, T)`` -> ``(B, T, C)``.
    """

    def __init__(self, num_layers: int, embed_dim: int, num_heads: int, **layer_kwargs) -> None:
        layers = [EncoderLayer(embed_dim, num_heads, **layer_kwargs) for _ in range(num_layers)]
        super().__init__(
            layers, embed_dim, device=layer_kwargs.get("device"), dtype=layer_kwargs.get("dtype")
        )

    def forward(
        self,
        x: Tensor,
        *,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: DecodingCache | None = None,
        return_attention: bool = False,
    ):
        """Returns ``x`` or ``(x, [trace per layer])``; ``is_causal=True`` makes it a decoder
        without cross-attention (DecoderLM); ``cache`` as :meth:`EncoderLayer.forward`."""
        traces = []
        for layer, layer_cache in zip(self.layers, self._layer_caches(cache)):
            x = layer(
                x,
                key_mask=key_mask,
                is_causal=is_causal,
                cache=layer_cache,
                return_attention=return_attention,
            )  # (B, T, C)
            if return_attention:
                x, trace = x
                traces.append(trace)
        x = self.norm(x)  # (B, T, C)
        return (x, traces) if return_attention else x


class Decoder(_Stack):
    """A stack of :class:`DecoderLayer`.

    Args:
        num_layers: Layers.
        embed_dim, num_heads: C, H.
        **layer_kwargs: :class:`DecoderLayer`'s keyword arguments (context_group and
            context_layout included).

    Shape:
        x ``(B, T, C)``; memory ``(B, S, C)``; key_mask ``(B, T)``; memory_mask ``(B, S)``
        -> ``(B, T, C)``.
    """

    def __init__(self, num_layers: int, embed_dim: int, num_heads: int, **layer_kwargs) -> None:
        layers = [DecoderLayer(embed_dim, num_heads, **layer_kwargs) for _ in range(num_layers)]
        super().__init__(
            layers, embed_dim, device=layer_kwargs.get("device"), dtype=layer_kwargs.get("dtype")
        )

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        key_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: DecodingCache | None = None,
        return_attention: bool = False,
    ):
        """Returns ``x`` or ``(x, [self trace per layer], [cross trace per layer])``."""
        self_traces, cross_traces = [], []
        for layer, layer_cache in zip(self.layers, self._layer_caches(cache)):
            x = layer(
                x,
                memory,
                key_mask=key_mask,
                memory_mask=memory_mask,
                cache=layer_cache,
                return_attention=return_attention,
            )  # (B, T, C)
            if return_attention:
                x, self_trace, cross_trace = x
                self_traces.append(self_trace)
                cross_traces.append(cross_trace)
        x = self.norm(x)  # (B, T, C)
        return (x, self_traces, cross_traces) if return_attention else x
