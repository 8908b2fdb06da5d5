"""Attention kinds: the one place where a model's ``attention="..."`` becomes a module.

Every model takes ``attention`` (a kind name) and ``attention_options`` (keyword arguments
for that kind) and builds each attention sub-layer with :func:`make_attention`; no model
branches on the kind anywhere else. All kinds are interchangeable (``qkv.nn.efficient``):
the same ``forward(query, key=None, value=None, *, key_mask=, is_causal=, return_trace=,
cache=)`` and ``new_cache(batch_size, capacity)``.

==============  ===========================================  =================================
kind            module                                       attention_options
==============  ===========================================  =================================
``exact``       ``MultiHeadAttention``                       any MultiHeadAttention keyword
                                                             (``dropout``, ``num_kv_heads``,
                                                             ``bias``, ``backend``)
``linear``      ``LinearMultiHeadAttention`` (``elu`` map)   ``feature_map``, ``eps``,
                                                             ``num_kv_heads``, ``bias``
``performer``   ``LinearMultiHeadAttention`` with FAVOR+     ``num_features``, ``seed``,
                                                             ``redraw`` (of ``qkv.Favor``), and
                                                             the ``linear`` ones
``local``       ``LocalMultiHeadAttention``                  ``window`` (required), and the
                                                             ``exact`` ones
==============  ===========================================  =================================

A new kind is one :func:`register_attention` call; no model changes.

Context parallel (``make_attention(..., context_group=group)``): ``exact`` and ``local`` run
over the ranks' shards by ring attention (the local window is the whole sequence's).
``linear`` and ``performer`` refuse it: their causal form is a prefix sum over the whole
sequence, which would take a scan across the ranks, not a ring. A registered factory gets
``context_group``/``context_layout`` only when a group is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..nn import LinearMultiHeadAttention, LocalMultiHeadAttention, MultiHeadAttention
from ..ops.linear import Favor

__all__ = ["attention_kinds", "make_attention", "register_attention"]

AttentionFactory = Callable[..., nn.Module]
"""``factory(embed_dim, num_heads, **options, device=, dtype=) -> module``."""


def _exact(embed_dim: int, num_heads: int, **options) -> nn.Module:
    return MultiHeadAttention(embed_dim, num_heads, **options)


def _no_context(kind: str, context_group) -> None:
    if context_group is not None:
        raise ValueError(
            f"attention={kind!r} does not run context-parallel (its causal form is "
            f"a prefix sum over the whole sequence, which needs a scan across the "
            f"ranks, not ring attention); use attention='exact' or 'local', or "
            f"context_group=None"
        )


def _linear(
    embed_dim: int,
    num_heads: int,
    *,
    context_group=None,
    context_layout: str = "contiguous",
    **options,
) -> nn.Module:
    _no_context("linear", context_group)
    return LinearMultiHeadAttention(embed_dim, num_heads, **{"feature_map": "elu", **options})


def _performer(
    embed_dim: int,
    num_heads: int,
    *,
    num_features: int | None = None,
    seed: int = 0,
    redraw: bool | int = False,
    device=None,
    dtype=None,
    context_group=None,
    context_layout: str = "contiguous",
    **options,
) -> nn.Module:
    _no_context("performer", context_group)
    if "feature_map" in options:
        raise TypeError(
            "attention='performer' builds its own FAVOR+ feature map; give "
            "num_features, seed or redraw instead of feature_map (or use "
            "attention='linear' with feature_map=...)"
        )
    if embed_dim % num_heads:  # let MultiHeadAttention say why, with its list of head counts
        return LinearMultiHeadAttention(embed_dim, num_heads, **options)
    favor = Favor(
        embed_dim // num_heads, num_features, seed=seed, redraw=redraw, device=device, dtype=dtype
    )
    return LinearMultiHeadAttention(
        embed_dim, num_heads, feature_map=favor, device=device, dtype=dtype, **options
    )


def _local(
    embed_dim: int, num_heads: int, *, window: int | tuple[int, int] | None = None, **options
) -> nn.Module:
    if window is None:
        raise ValueError(
            "attention='local' needs a window: pass attention_options="
            "{'window': w} (keys on each side of a query; with causal "
            "self-attention, the w previous keys)"
        )
    return LocalMultiHeadAttention(embed_dim, num_heads, window=window, **options)


_KINDS: dict[str, AttentionFactory] = {
    "exact": _exact,
    "linear": _linear,
    "performer": _performer,
    "local": _local,
}


def attention_kinds() -> tuple[str, ...]:
    """The registered attention kinds, in registration order."""
    return tuple(_KINDS)


def register_attention(name: str, factory: AttentionFactory, *, replace: bool = False) -> None:
    """Make ``attention=name`` available to every model.

    Args:
        name: The kind's name.
        factory: ``factory(embed_dim, num_heads, **options, device=None, dtype=None)`` returning
            a module with MultiHeadAttention's ``forward`` and ``new_cache``.
        replace: Allow replacing a registered kind.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an attention kind needs a non-empty str name, got {name!r}")
    if name in _KINDS and not replace:
        raise ValueError(
            f"attention kind {name!r} is registered already; pass replace=True to replace it"
        )
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _KINDS[name] = factory


def make_attention(
    kind: str,
    embed_dim: int,
    num_heads: int,
    *,
    options: Mapping[str, Any] | None = None,
    context_group=None,
    context_layout: str = "contiguous",
    device=None,
    dtype=None,
) -> nn.Module:
    """The attention module of ``kind`` (see the table above).

    Args:
        kind: A name from :func:`attention_kinds`.
        embed_dim: Model dim C.
        num_heads: Query heads H.
        options: Keyword arguments for that kind (``{"window": 64}`` for ``local``).
        context_group, context_layout: Run context-parallel over this process group (see
            :class:`qkv.MultiHeadAttention`); None (default) runs on one process.

    Raises:
        ValueError: An unknown kind (the message lists the registered ones), bad numbers, or
            a context_group for a kind that cannot run context-parallel.
        TypeError: Options the kind does not take.

    Shape:
        The module maps ``(B, T, C)`` to ``(B, T, C)``.
    """
    if kind not in _KINDS:
        raise ValueError(
            f"unknown attention kind {kind!r}; the kinds are "
            f"{', '.join(map(repr, _KINDS))} (qkv.models.register_attention adds one)"
        )
    options = dict(options or {})
    for reserved in ("device", "dtype", "context_group", "context_layout"):
        if reserved in options:
            raise TypeError(
                f"attention_options must not hold {reserved!r}; pass it to the model's constructor"
            )
    context = (
        {}
        if context_group is None
        else dict(context_group=context_group, context_layout=context_layout)
    )
    try:
        return _KINDS[kind](embed_dim, num_heads, **options, **context, device=device, dtype=dtype)
    except TypeError as err:
        if context and "context_" in str(err):
            raise TypeError(
                f"attention kind {kind!r} takes no context_group (its factory "
                f"cannot run context-parallel): {err}"
            ) from err
        if not options:
            raise
        raise TypeError(
            f"attention_options {options} do not fit attention={kind!r}: {err}"
        ) from err
