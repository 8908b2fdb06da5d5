"""Token models: encoder-decoder Transformer, decoder-only language model, encoder classifier.

Every model takes ``attention`` (a kind from :func:`qkv.models.attention_kinds`) and
``attention_options``, and never looks at the kind itself. Padding follows qkv's mask
contract: ``key_mask`` ``(B, T)`` True marks a real token; a padded token never changes the
output at a real position (nor a pooled output). Positions are ``"learned"`` (default, a table
of ``max_len``) or ``"sinusoidal"`` (Vaswani et al., any length), indexed by absolute position.

Decoding (``generate``): each attention module's ``new_cache(batch_size, capacity)`` holds its
layer's past keys/values (KVCache, raising when written past ``capacity``) or its recurrent
state (linear, performer); the prompt is prefilled in one call, then tokens go one at a time
at the positions after the cached ones.

Context parallel (``context_group=``, ``context_layout=``): DecoderLM and Seq2SeqTransformer
run a sequence sharded over the ranks of a process group. Each rank passes its shard of the
tokens (``qkv.distributed.shard(tokens, group, dim=1, layout=...)``) and of the key masks; the
position embeddings take the whole-sequence positions the shard holds, every attention runs
by ring attention, and the logits are this rank's rows of the whole sequence's logits.
Parameter gradients on a rank are its part: their sum over the ranks (an all-reduce with
SUM) is the single-process gradient of a loss summed over the ranks. ``copy.deepcopy`` of
a model shares its group; pickling it (``torch.save(model)``) drops it. Decoding and
``generate`` run on one process only. The classifiers (EncoderClassifier, and ViT) pool
over the sequence and refuse a context_group.

Shape alphabet: B batch, T (target) length, S source length, C model dim, V vocabulary,
K classes, N new tokens; T_r, S_r this rank's shard of T, S.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..nn._inputs import ContextGroupAttribute, shard_segments
from .embeddings import TokenEmbedding
from .generate import TokenChooser, check_generate, decode_loop
from .layers import AttentionMaps, Decoder, DecodingCache, Encoder

__all__ = ["DecoderLM", "EncoderClassifier", "Seq2SeqTransformer"]


class DecoderLM(nn.Module):
    """Decoder-only language model (GPT): token + position embeddings, a stack of
    :class:`EncoderLayer` run with causal self-attention (a decoder without cross-attention),
    and a linear head to the vocabulary.

    Args:
        vocab_size: V.
        embed_dim: C.
        num_heads: H.
        num_layers: Layers.
        ffn_dim: MLP width (default ``4 * C``).
        dropout: On embeddings and residual branches.
        norm_first: Pre-norm (True) or post-norm (False).
        attention: Attention kind; ``attention_options`` its keyword arguments.
        positions: ``"learned"`` or ``"sinusoidal"``.
        max_len: Positions of the learned table (prompt + generated tokens).
        context_group: Run context-parallel over this process group (see the module
            docstring); None (default) runs on one process. The attention kind must be
            ``"exact"`` or ``"local"``, with ``dropout=0`` in its options.
        context_layout: ``"contiguous"`` or ``"balanced"`` (better for causal attention).

    Shape:
        tokens ``(B, T)`` int; key_mask ``(B, T)`` bool -> logits ``(B, T, V)``.
        Context parallel: this rank's shards ``(B, T_r)`` -> ``(B, T_r, V)``.

    Example (context parallel, on every rank of ``group``)::

        >>> lm = DecoderLM(V, 256, 4, 6, context_group=group, context_layout="balanced")
        >>> tok_r = qkv.distributed.shard(tokens, group, dim=1, layout="balanced")  # (B, T_r)
        >>> logits_r = lm(tok_r)                                                      # (B, T_r, V)
    """

    context_group = ContextGroupAttribute()

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        *,
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        positions: str = "learned",
        max_len: int = 512,
        context_group=None,
        context_layout: str = "contiguous",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.vocab_size = vocab_size
        self.context_group, self.context_layout = context_group, context_layout
        self.embed = TokenEmbedding(
            vocab_size, embed_dim, positions=positions, max_len=max_len, dropout=dropout, **kw
        )
        self.blocks = Encoder(
            num_layers,
            embed_dim,
            num_heads,
            ffn_dim=ffn_dim,
            dropout=dropout,
            norm_first=norm_first,
            attention=attention,
            attention_options=attention_options,
            context_group=context_group,
            context_layout=context_layout,
            **kw,
        )  # run causally
        self.head = nn.Linear(embed_dim, vocab_size, bias=False, **kw)

    def forward(
        self,
        tokens: Tensor,
        *,
        key_mask: Tensor | None = None,
        cache: DecodingCache | None = None,
        return_attention: bool = False,
    ):
        """Next-token logits at every position (causal: position t sees tokens 0..t).

        With ``cache`` (from :meth:`new_cache`), ``tokens`` are the next positions of the
        cached sequences (positions ``cache.position ...``).

        Returns logits, or ``(logits, AttentionMaps)`` with ``decoder`` filled.
        """
        _check_tokens("tokens", tokens, key_mask, shard=self.context_group is not None)
        x = _embed_at(
            self.embed, tokens, cache, self.context_group, self.context_layout
        )  # (B, T, C)
        x = self.blocks(
            x, key_mask=key_mask, is_causal=True, cache=cache, return_attention=return_attention
        )  # (B, T, C)
        if not return_attention:
            return self.head(x)  # (B, T, V)
        x, traces = x
        return self.head(x), AttentionMaps(decoder=traces)

    def new_cache(self, batch_size: int, capacity: int) -> DecodingCache:
        """Empty per-layer caches for ``batch_size`` sequences of up to ``capacity`` tokens."""
        return self.blocks.new_cache(batch_size, capacity)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        key_mask: Tensor | None = None,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        eos: int | None = None,
        pad: int = 0,
        capacity: int | None = None,
    ) -> Tensor:
        """Continue ``prompt`` by ``max_new_tokens`` tokens (call ``.eval()`` first).

        The prompt is prefilled into fresh caches (``capacity`` defaults to prompt +
        ``max_new_tokens``), then one token a step. A sequence stops at ``eos`` and emits
        ``pad`` after it. Prompts of unequal length: left-pad them and mark the padding in
        ``key_mask`` (positions count the padding, as in the full forward).

        Args:
            prompt: Token ids.
            max_new_tokens: N.
            key_mask: True marks the prompt's real tokens.
            greedy: Argmax; else sample with ``temperature``, ``top_k`` and ``seed``.
            eos: Token that ends a sequence.
            pad: Token emitted after ``eos``.
            capacity: Positions of each cache; fewer than needed makes the cache raise.

        Returns:
            The prompt followed by the new tokens.

        Shape:
            prompt ``(B, T)``; key_mask ``(B, T)`` -> ``(B, T + N)``.
        """
        _check_one_process(self, "generate")
        _check_tokens("prompt", prompt, key_mask)
        check_generate(max_new_tokens, eos, pad, self.vocab_size)
        choose = TokenChooser(greedy=greedy, temperature=temperature, top_k=top_k, seed=seed)
        B, T = prompt.shape
        _check_max_len(self.embed, T + max_new_tokens - 1)
        cache = self.new_cache(B, T + max_new_tokens if capacity is None else capacity)
        logits = self(prompt, key_mask=key_mask, cache=cache)[:, -1]  # (B, V)
        new = decode_loop(
            lambda t: self(t, cache=cache)[:, -1],
            logits,
            max_new_tokens,
            choose=choose,
            eos=eos,
            pad=pad,
        )  # (B, N)
        return torch.cat([prompt, new], 1)  # (B, T + N)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer (Vaswani et al. 2017), trained teacher-forced.

    Source and target have their own token and position embeddings over one vocabulary.
    The decoder's cross-attention attends to the encoder output, computed once per call (and
    once per :meth:`generate`); it is not cached, so each decoding step projects its keys and
    values again.

    Args:
        vocab_size: V, of source and target.
        embed_dim, num_heads: C, H.
        num_layers: Encoder layers (and decoder layers unless ``num_decoder_layers``).
        num_decoder_layers: Decoder layers.
        ffn_dim, dropout, norm_first, positions, max_len: As :class:`DecoderLM`.
        attention: Kind of the self-attention in both stacks; ``attention_options`` its
            keyword arguments.
        context_group, context_layout: As :class:`DecoderLM`: source and target are both
            sharded over the group with this layout, and the cross-attention of a target
            shard runs over every rank's shard of the memory.
        cross_attention: Kind of the decoder's cross-attention (default ``"exact"``; see
            :class:`qkv.models.DecoderLayer` about ``"local"``); ``cross_attention_options``
            its keyword arguments.

    Shape:
        src ``(B, S)``, tgt ``(B, T)`` int; src_key_mask ``(B, S)``, tgt_key_mask ``(B, T)``
        bool -> logits ``(B, T, V)``. Context parallel: this rank's shards ``(B, S_r)``,
        ``(B, T_r)`` -> ``(B, T_r, V)``.
    """

    context_group = ContextGroupAttribute()

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        *,
        num_decoder_layers: int | None = None,
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        cross_attention: str = "exact",
        cross_attention_options: Mapping[str, Any] | None = None,
        positions: str = "learned",
        max_len: int = 512,
        context_group=None,
        context_layout: str = "contiguous",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.context_group, self.context_layout = context_group, context_layout
        layer = dict(
            ffn_dim=ffn_dim,
            dropout=dropout,
            norm_first=norm_first,
            attention=attention,
            attention_options=attention_options,
            context_group=context_group,
            context_layout=context_layout,
            **kw,
        )
        embed = dict(positions=positions, max_len=max_len, dropout=dropout, **kw)
        self.vocab_size = vocab_size
        self.src_embed = TokenEmbedding(vocab_size, embed_dim, **embed)
        self.tgt_embed = TokenEmbedding(vocab_size, embed_dim, **embed)
        self.encoder = Encoder(num_layers, embed_dim, num_heads, **layer)
        self.decoder = Decoder(
            num_layers if num_decoder_layers is None else num_decoder_layers,
            embed_dim,
            num_heads,
            cross_attention=cross_attention,
            cross_attention_options=cross_attention_options,
            **layer,
        )
        self.head = nn.Linear(embed_dim, vocab_size, bias=False, **kw)

    def encode(
        self, src: Tensor, *, src_key_mask: Tensor | None = None, return_attention: bool = False
    ):
        """The encoder output (the memory), or ``(memory, [trace per layer])``.

        Shape:
            src ``(B, S)`` -> ``(B, S, C)``.
        """
        _check_tokens("src", src, src_key_mask, shard=self.context_group is not None)
        x = _embed_at(
            self.src_embed, src, None, self.context_group, self.context_layout
        )  # (B, S, C)
        return self.encoder(x, key_mask=src_key_mask, return_attention=return_attention)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        tgt_key_mask: Tensor | None = None,
        src_key_mask: Tensor | None = None,
        cache: DecodingCache | None = None,
        return_attention: bool = False,
    ):
        """Logits of the next target token at every target position, given the memory.

        With ``cache`` (from :meth:`new_cache`), ``tgt`` holds the next target positions.
        Returns logits, or ``(logits, [self traces], [cross traces])``.

        Shape:
            tgt ``(B, T)``; memory ``(B, S, C)`` -> ``(B, T, V)``.
        """
        _check_tokens("tgt", tgt, tgt_key_mask, shard=self.context_group is not None)
        x = _embed_at(
            self.tgt_embed, tgt, cache, self.context_group, self.context_layout
        )  # (B, T, C)
        x = self.decoder(
            x,
            memory,
            key_mask=tgt_key_mask,
            memory_mask=src_key_mask,
            cache=cache,
            return_attention=return_attention,
        )  # (B, T, C)
        if not return_attention:
            return self.head(x)  # (B, T, V)
        x, self_traces, cross_traces = x
        return self.head(x), self_traces, cross_traces  # (B, T, V)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_key_mask: Tensor | None = None,
        tgt_key_mask: Tensor | None = None,
        return_attention: bool = False,
    ):
        """Teacher-forced logits: position t of ``tgt`` predicts target token t + 1.

        Returns logits, or ``(logits, AttentionMaps)`` with ``encoder``, ``decoder`` and
        ``cross`` filled.
        """
        memory = self.encode(src, src_key_mask=src_key_mask, return_attention=return_attention)
        if not return_attention:
            return self.decode(tgt, memory, tgt_key_mask=tgt_key_mask, src_key_mask=src_key_mask)
        memory, enc_traces = memory
        logits, self_traces, cross_traces = self.decode(
            tgt, memory, tgt_key_mask=tgt_key_mask, src_key_mask=src_key_mask, return_attention=True
        )  # (B, T, V)
        return logits, AttentionMaps(encoder=enc_traces, decoder=self_traces, cross=cross_traces)

    def new_cache(self, batch_size: int, capacity: int) -> DecodingCache:
        """Empty per-layer caches of the decoder's self-attention."""
        return self.decoder.new_cache(batch_size, capacity)

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int,
        *,
        bos: int,
        src_key_mask: Tensor | None = None,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        eos: int | None = None,
        pad: int = 0,
        capacity: int | None = None,
    ) -> Tensor:
        """Translate ``src``: encode it once, then decode from ``bos`` one token at a time.

        Arguments as :meth:`DecoderLM.generate`; ``capacity`` defaults to
        ``1 + max_new_tokens``.

        Returns:
            ``bos`` followed by the new tokens.

        Shape:
            src ``(B, S)``; src_key_mask ``(B, S)`` -> ``(B, 1 + N)``.
        """
        _check_one_process(self, "generate")
        if bos is None:
            raise ValueError("generate needs bos, the token id the target starts with")
        check_generate(max_new_tokens, eos, pad, self.vocab_size, bos=bos)
        choose = TokenChooser(greedy=greedy, temperature=temperature, top_k=top_k, seed=seed)
        _check_max_len(self.tgt_embed, max_new_tokens)
        memory = self.encode(src, src_key_mask=src_key_mask)  # (B, S, C)
        B = memory.shape[0]
        start = torch.full((B, 1), bos, dtype=torch.long, device=memory.device)  # (B, 1)
        cache = self.new_cache(B, 1 + max_new_tokens if capacity is None else capacity)

        def step(tokens: Tensor) -> Tensor:
            return self.decode(tokens, memory, src_key_mask=src_key_mask, cache=cache)[:, -1]

        new = decode_loop(
            step, step(start), max_new_tokens, choose=choose, eos=eos, pad=pad
        )  # (B, N)
        return torch.cat([start, new], 1)  # (B, 1 + N)


class EncoderClassifier(nn.Module):
    """Sequence classifier: an encoder, pooled, then a linear head.

    ``pooling="cls"`` prepends a learned CLS token (BERT) and classifies its output (the CLS
    token takes no position; the tokens keep positions ``0..T-1``); ``pooling="mean"``
    averages the outputs at real tokens only (``key_mask``).

    Args:
        vocab_size: V.
        num_classes: K.
        embed_dim, num_heads, num_layers: C, H, layers.
        pooling: ``"cls"`` or ``"mean"``.
        ffn_dim, dropout, norm_first, attention, attention_options, positions, max_len:
            As :class:`DecoderLM`.
        context_group: Must be None: the classifier pools the whole sequence into one
            vector (CLS or mean), which no rank holds; refused with a ValueError. To classify
            a sharded sequence, run an :class:`qkv.models.Encoder` with the context_group and
            pool across the ranks yourself (an all-reduce of the masked sum and the count).

    Shape:
        tokens ``(B, T)`` int; key_mask ``(B, T)`` bool -> logits ``(B, K)``.
    """

    POOLINGS = ("cls", "mean")

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        *,
        pooling: str = "cls",
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        positions: str = "learned",
        max_len: int = 512,
        context_group=None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _refuse_pooled_context("EncoderClassifier", context_group)
        if pooling not in self.POOLINGS:
            raise ValueError(
                f"unknown pooling {pooling!r}; choose one of {', '.join(map(repr, self.POOLINGS))}"
            )
        kw = dict(device=device, dtype=dtype)
        self.pooling = pooling
        self.embed = TokenEmbedding(
            vocab_size, embed_dim, positions=positions, max_len=max_len, dropout=dropout, **kw
        )
        if pooling == "cls":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **kw))
            nn.init.normal_(self.cls_token, std=0.02)
        self.encoder = Encoder(
            num_layers,
            embed_dim,
            num_heads,
            ffn_dim=ffn_dim,
            dropout=dropout,
            norm_first=norm_first,
            attention=attention,
            attention_options=attention_options,
            **kw,
        )
        self.head = nn.Linear(embed_dim, num_classes, **kw)

    def forward(
        self, tokens: Tensor, *, key_mask: Tensor | None = None, return_attention: bool = False
    ):
        """Class logits; or ``(logits, AttentionMaps)`` with ``encoder`` filled (with CLS
        pooling the traces have ``T + 1`` positions, the CLS token first)."""
        _check_tokens("tokens", tokens, key_mask)
        x = self.embed(tokens)  # (B, T, C)
        if self.pooling == "cls":
            x, key_mask = _prepend_cls(self.cls_token, x, key_mask)  # (B, 1 + T, C)
        x = self.encoder(x, key_mask=key_mask, return_attention=return_attention)
        x, traces = x if return_attention else (x, [])  # (B, T', C), a trace per layer
        pooled = x[:, 0] if self.pooling == "cls" else _masked_mean(x, key_mask)  # (B, C)
        logits = self.head(pooled)  # (B, K)
        return (logits, AttentionMaps(encoder=traces)) if return_attention else logits


def _prepend_cls(cls_token: Tensor, x: Tensor, key_mask: Tensor | None):
    """CLS first; it is always a real token."""
    B = x.shape[0]
    x = torch.cat([cls_token.expand(B, -1, -1).to(x.dtype), x], 1)  # (B, 1 + T, C)
    if key_mask is not None:
        key_mask = torch.cat([key_mask.new_ones(B, 1), key_mask], 1)  # (B, 1 + T)
    return x, key_mask


def _masked_mean(x: Tensor, key_mask: Tensor | None) -> Tensor:
    """Mean over real positions; 0 for a sequence with none.

    Shape:
        x ``(B, T, C)``; key_mask ``(B, T)`` -> ``(B, C)``.
    """
    if key_mask is None:
        return x.mean(1)  # (B, C)
    w = key_mask.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
    # where, not a product: a padded position's output must not reach the sum even if inf/NaN
    total = torch.where(key_mask.unsqueeze(-1), x, 0).sum(1)  # (B, C)
    return total / w.sum(1).clamp(min=1)  # (B, C)


def _refuse_pooled_context(model: str, context_group) -> None:
    """A model that pools the sequence into one output cannot take a context_group."""
    if context_group is not None:
        raise ValueError(
            f"{model} pools the whole sequence into one vector per example, which no rank of a "
            f"context-parallel group holds, so it takes context_group=None only; to run a "
            f"sharded sequence, use qkv.models.Encoder(..., context_group=group) and pool "
            f"across the ranks yourself (all-reduce the masked sum and count)"
        )


def _embed_at(
    embed: TokenEmbedding, tokens: Tensor, cache: DecodingCache | None, group, layout: str
) -> Tensor:
    """Tokens embedded at their whole-sequence positions: after the cached ones, or, context
    parallel, the runs of positions this rank's shard holds.

    Shape:
        tokens ``(B, T)`` -> ``(B, T, C)``.
    """
    if group is None:
        return embed(tokens, start=0 if cache is None else cache.position)  # (B, T, C)
    if cache is not None:
        raise ValueError(
            "decoding with a cache is not context-parallel (the cache holds the "
            "whole sequence on one process): decode with a model built without "
            "context_group (load this model's state_dict into it)"
        )
    runs = shard_segments(tokens.shape[1], group, layout, tokens.device)
    return embed(tokens, segments=runs)  # (B, T_r, C)


def _check_one_process(model: nn.Module, what: str) -> None:
    if model.context_group is not None:
        raise ValueError(
            f"{what} decodes one token at a time on one process and is not "
            f"context-parallel: call it on a {type(model).__name__} built "
            f"without context_group (load this model's state_dict into it)"
        )


def _check_tokens(
    name: str, tokens: Tensor, key_mask: Tensor | None, *, shard: bool = False
) -> None:
    """Token ids (B, T) with T >= 1 (a context-parallel shard may hold no tokens)."""
    if (
        not isinstance(tokens, Tensor)
        or tokens.dim() != 2
        or tokens.dtype.is_floating_point
        or tokens.dtype == torch.bool
        or (tokens.shape[1] == 0 and not shard)
    ):
        got = (
            f"{tokens.dtype} {tuple(tokens.shape)}"
            if isinstance(tokens, Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"{name} must be integer token ids (B, T) with T >= 1, got {got}")
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        mask_got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
        raise TypeError(
            f"the key mask of {name} must be a bool tensor, True marking a real "
            f"token, got {mask_got}; a padding mask (True = padding) is its inverse: "
            f"pass ~padding_mask"
        )
    if key_mask.shape != tokens.shape:
        raise ValueError(
            f"the key mask of {name} must have the shape of {name} "
            f"{tuple(tokens.shape)}, got {tuple(key_mask.shape)}"
        )


def _check_max_len(embed: TokenEmbedding, positions: int) -> None:
    """Fail before decoding when the learned positions cannot reach the last token fed."""
    if embed.max_len is not None and positions > embed.max_len:
        raise ValueError(
            f"generating needs {positions} positions but the learned position "
            f"embeddings hold max_len={embed.max_len}; ask for fewer tokens or "
            f"build the model with a larger max_len (or positions='sinusoidal')"
        )
