"""transformers' attention function computed by qkv (:func:`attention_forward`), and what it
does with every keyword transformers passes.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import masks
from ...functional import scaled_dot_product_attention
from ...ops.base import compiling_plainly, tracing
from .masks import HFMask, _mask_args

__all__ = ["KEYWORDS_IGNORED_AS_EAGER", "KEYWORDS_IMPLEMENTED", "attention_forward"]

# Arguments some models pass that change the result and that qkv does not implement yet:
# refused with their names, never dropped (dropping block_indices once gave dense attention).
_REFUSED: dict[str, str] = {}
# Every keyword a modeling file of transformers passes to its attention function, by what qkv
# does with it (tests/test_hf_integration.py scans the installed transformers against this,
# so a new keyword fails there until it is classified).
KEYWORDS_IMPLEMENTED = frozenset(
    {
        "attention_mask",
        "dropout",
        "scaling",
        "is_causal",
        "sliding_window",
        "softcap",
        "position_bias",
        "s_aux",
        "sinks",
        "output_attentions",
        "query",
        "key",
        "value",
        "indices",
        "block_indices",
    }
)
# Passed for FlashAttention's variable-length kernels or its options; transformers' eager
# attention ignores them too (the attention_mask carries the same segments).
KEYWORDS_IGNORED_AS_EAGER = frozenset(
    {
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_ids",
        "deterministic",
    }
)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function signature, computed by qkv.

    Args:
        module: The model's attention module (``is_causal`` is read from it).
        query, key, value: Projected heads.
        attention_mask: An :class:`HFMask` from :func:`build_mask`, a prepared 4-D mask
            (bool True = may attend, or float added), or None.
        dropout: Dropout on the weights (transformers passes 0 in eval).
        scaling: Factor on the scores (None: ``1 / sqrt(D)``).
        is_causal: Overrides ``module.is_causal`` when there is no mask.
        backend: The qkv backend.
        **kwargs: ``sliding_window``, ``position_bias`` (T5), ``softcap``, ``s_aux``
            (attention sinks, gpt-oss), ``output_attentions``, ``indices`` (DeepSeek sparse
            attention's top-k keys per query) and ``block_indices`` (MiniMax-M3's top-k key
            blocks per query and indexer head), and what transformers passes along (ignored).

    Returns:
        ``(output, weights)``: weights only when the caller asked for attentions.

    Shape:
        query ``(B, H, T, D)``; key, value ``(B, G, S, D)`` -> output ``(B, T, H, D)``,
        weights ``(B, H, T, S)``.
    """
    for arg, what in _REFUSED.items():
        if kwargs.get(arg) is not None:
            raise NotImplementedError(
                f"qkv's attention does not implement {what} yet; run this "
                f"model with attn_implementation='eager' or 'sdpa'"
            )
    T, S = query.shape[-2], key.shape[-2]
    attn_mask, mask_mod, causal = _mask_args(
        module, attention_mask, T, S, is_causal, kwargs.get("sliding_window"), query.device
    )
    attn_mask = _with_bias(attn_mask, kwargs.get("position_bias"))
    attn_mask = _with_selection(attn_mask, _selected_keys(module, query, S, kwargs))
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: per head (H,); inkling2:
    if sinks is not None and sinks.dim() == 4:  # per query row (B, H, T, 1)
        sinks = sinks.squeeze(-1)
    want = _weights_wanted(kwargs)
    res = scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[-3] != key.shape[-3],
        backend=backend,
        return_trace=want,
        mask_mod=mask_mod,
        score_mod=masks.softcap(softcap) if softcap else None,
        sinks=None if sinks is None else sinks.to(query.device),
    )
    weights = None
    if isinstance(res, tuple):  # return_trace=want
        out, trace = res  # (B, H, T, D)
        weights = trace.probs.to(query.dtype)  # (B, H, T, S)
    else:
        out = res  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), weights  # (B, T, H, D)


def _with_bias(attn_mask: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """A float ``position_bias`` (T5) added to the scores, with a bool mask folded in as -inf.

    Shape:
        attn_mask ``(B, 1, 1, S)`` bool or None; bias ``(1 | B, H, T, S)``.
    """
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return bias + attn_mask


def _selected_keys(module, query: Tensor, S: int, kwargs: dict) -> Tensor | None:
    """The keys a sparse-attention indexer kept, as a bool mask (True = kept), or None.

    ``indices`` (DeepSeek-V3.2's DSA and its kin): the top-k key positions per query, the
    same for every head. ``block_indices`` (MiniMax-M3): the top-k key blocks of
    ``module.indexer.block_size`` keys per query and indexer head, -1 for an empty slot;
    each indexer head serves ``H // H_idx`` consecutive query heads. Formed densely, as
    transformers' eager attention forms it (block skipping on it is left to a later change).

    Shape:
        indices ``(B, T, k)`` -> ``(B, 1, T, S)``; block_indices ``(B, H_idx, T, k)`` ->
        ``(B, H, T, S)``.
    """
    idx, blocks = kwargs.get("indices"), kwargs.get("block_indices")
    if idx is not None and blocks is not None:
        raise ValueError("got both indices= and block_indices=; a model passes one")
    if idx is not None:
        if idx.dim() != 3 or idx.shape[1] != query.shape[-2]:
            raise ValueError(
                f"indices= must be (B, T, k) with T={query.shape[-2]}, got {tuple(idx.shape)}"
            )
        keep = torch.zeros(idx.shape[0], idx.shape[1], S + 1, dtype=torch.bool, device=idx.device)
        keep.scatter_(-1, _slots(idx, S, S, 0), True)  # (B, T, S + 1)
        return keep[..., :S].unsqueeze(1)  # (B, 1, T, S)
    if blocks is None:
        return None
    size = _block_size(module)
    H, H_idx = query.shape[-3], blocks.shape[1]
    if blocks.dim() != 4 or H % H_idx:
        raise ValueError(
            f"block_indices= must be (B, H_idx, T, k) with H_idx dividing "
            f"H={H}, got {tuple(blocks.shape)}"
        )
    n = -(-S // size)
    keep = torch.zeros(*blocks.shape[:3], n + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, _slots(blocks, n, S, size), True)  # (B, H_idx, T, n + 1)
    keep = keep[..., :n].repeat_interleave(size, dim=-1)[..., :S]  # (B, H_idx, T, S)
    return keep.repeat_interleave(H // H_idx, dim=1)  # (B, H, T, S)


def _block_size(module) -> int:
    """MiniMax-M3's key block size: ``module.indexer.block_size``, else
    ``module.config.index_block_size``; a positive int."""
    for owner, name in (("indexer", "block_size"), ("config", "index_block_size")):
        size = getattr(getattr(module, owner, None), name, None)
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"block_indices= needs a positive key block size, and "
                f"module.{owner}.{name} is {size!r}"
            )
        return size
    raise ValueError(
        "block_indices= needs the key block size: qkv reads it from "
        "module.indexer.block_size or module.config.index_block_size, and "
        f"{type(module).__name__} has neither"
    )


def _slots(sel: Tensor, n: int, S: int, size: int) -> Tensor:
    """A selection, ``indices=`` (``size`` 0: key positions, ``n = S``) or ``block_indices=``
    (blocks of ``size`` keys, ``n`` of them), -1 for an empty slot, as scatter positions into
    ``n + 1`` columns, the empty slots in the spare column ``n``; a position outside
    ``[-1, n)`` raises ValueError instead of being dropped.

    The check reads the selection's extremes on the host: one read per call (a device sync
    on a GPU), which no check that names the bad value avoids; an indexer makes new
    selections in every layer, so there is nothing to check once for several calls. Under
    ``torch.compile`` it runs inside the ``qkv::selection_slots`` op, at run time; under
    ``torch.export`` and ``torch.func`` transforms, which keep standard operators, an
    asynchronous assert raises (RuntimeError, without the value), and a bad position is sent
    past the last column, where the scatter raises too.

    Shape:
        sel ``(..., k)`` integer -> ``(..., k)`` int64.
    """
    if compiling_plainly():
        return torch.ops.qkv.selection_slots(sel, n, S, size)
    if tracing():
        ok = (sel >= -1) & (sel < n)
        torch._assert_async(ok.all(), _out_of_range(None, n, S, size))  # no host read
        return torch.where(ok, sel.long().masked_fill(sel < 0, n), n + 1)
    return _checked_slots(sel, n, S, size)


def _checked_slots(sel: Tensor, n: int, S: int, size: int) -> Tensor:
    if sel.numel():
        lo, hi = torch.aminmax(sel)
        lo_, hi_ = torch.stack([lo, hi]).tolist()  # the one host read
        if lo_ < -1 or hi_ >= n:
            raise ValueError(_out_of_range(lo_ if lo_ < -1 else hi_, n, S, size))
    return sel.long().masked_fill(sel < 0, n)


def _out_of_range(bad: int | None, n: int, S: int, size: int) -> str:
    what = "block" if size else "key"
    which = f"a {what}" if bad is None else f"{what} {bad}"
    if not size:
        return (
            f"indices= holds {which}, outside [-1, {S}): the call has S={S} keys; an "
            f"indexer's positions must be among them (-1 marks an empty slot)"
        )
    return (
        f"block_indices= holds {which}, outside [-1, {n}): S={S} keys in blocks of {size} "
        f"make {n} blocks; an indexer's blocks must be among them (-1 marks an empty slot)"
    )


@torch.library.custom_op("qkv::selection_slots", mutates_args=())
def _selection_slots(sel: Tensor, n: int, S: int, size: int) -> Tensor:
    """:func:`_checked_slots` as an op, so that a compiled graph checks at run time."""
    return _checked_slots(sel, n, S, size)


@_selection_slots.register_fake
def _(sel, n, S, size):
    return torch.empty(sel.shape, dtype=torch.long, device=sel.device)


def _with_selection(attn_mask: Tensor | None, keep: Tensor | None) -> Tensor | None:
    """``attn_mask`` with the keys an indexer dropped masked out (bool: False; float: -inf)."""
    if keep is None:
        return attn_mask
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def _weights_wanted(kwargs: dict) -> bool:
    """Did the caller ask for attention weights? ``output_attentions=True`` in the call, or
    transformers' output recorder collecting attentions (``output_attentions`` given to the
    model, which transformers does not pass down to every attention function)."""
    if kwargs.get("output_attentions"):
        return True
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get() or {}
    return any(k in collected for k in ("attentions", "cross_attentions"))
