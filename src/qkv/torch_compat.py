"""A drop-in for ``torch.nn.MultiheadAttention`` that runs qkv: weights with fast kernels, no NaN.

    import qkv.torch_compat
    qkv.torch_compat.patch(model)           # every nn.MultiheadAttention in model, in place
    mha = qkv.torch_compat.MultiheadAttention(512, 8, batch_first=True)   # or build one

**This module is the one place in qkv where torch's mask polarity applies**: a bool
``key_padding_mask`` or ``attn_mask`` marks with True what may NOT be attended, exactly as in
torch. Everywhere else in qkv a bool mask means True = may attend (see ``qkv.MultiHeadAttention``).

Shape alphabet: B batch, H heads, T query length, S key length, S' = S plus one key per
``add_bias_kv`` and ``add_zero_attn``, D head dim, C embed_dim, Ck/Cv key/value channels.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functional import scaled_dot_product_attention

__all__ = ["MultiheadAttention", "patch"]


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` computed by qkv: same constructor, parameters, state_dict,
    call and results, with attention weights from a fast kernel and no NaN.

    A subclass of torch's module, so ``isinstance(m, nn.MultiheadAttention)`` holds, torch's
    Transformer layers take it as ``self_attn``, and ``load_state_dict`` works both ways.
    Inputs, outputs and masks follow torch exactly: ``batch_first``, unbatched inputs, bool
    masks True = NOT allowed (torch's polarity), float masks added, ``attn_mask`` ``(T, S)`` or
    ``(B*H, T, S)``, ``need_weights``/``average_attn_weights``, and ``is_causal`` as torch
    treats it: a hint that needs ``attn_mask``; with no ``key_padding_mask`` and
    ``need_weights=False`` the causal mask replaces ``attn_mask``, otherwise ``attn_mask`` is
    used as given. ``add_bias_kv`` and ``add_zero_attn`` are supported: one learned / one
    all-zero key and value position appended after the projection, as torch does.

    What differs from torch, deliberately:

    * A query row with nothing to attend (all keys padded or masked) gets heads of exactly 0,
      so its output is ``out_proj.bias`` (0 with ``bias=False``), its weights are 0 and its
      gradients finite; torch gives NaN in all three.
    * The output always comes from a fast kernel (qkv's ``backend="auto"``), also with
      ``need_weights=True``, where torch falls back to plain math. The weights come from the
      kernel's log-sum-exp (qkv's trace): they are detached (torch's carry gradients) and,
      in training with dropout, taken before dropout (torch returns them after it).
    * Errors are ValueError/TypeError naming the numbers and the fix; where torch raises an
      AssertionError or RuntimeError the error is also one, so ported ``except`` clauses work.
    * Nested tensors (what ``nn.TransformerEncoder`` makes of padded inputs in eval mode) are
      taken in training and with gradients too, not only on torch's inference fast path.
    * Inside ``nn.TransformerEncoderLayer`` this module runs itself: torch's fused encoder
      kernel (which reads ``self_attn``'s weights and skips its forward) is off for a layer
      whose modules carry a forward hook, and this module carries a no-op one.

    Attributes:
        backend: The qkv backend of the attention call (``"auto"``; ``"reference"`` for the
            plain float64-capable math). A class attribute; set it on an instance to change it.

    The arguments (embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
    vdim, batch_first, device, dtype) are ``torch.nn.MultiheadAttention``'s.

    Shape:
        query ``(T, B, C)`` (``(B, T, C)`` with ``batch_first``, ``(T, C)`` unbatched); key
        ``(S, B, Ck)``; value ``(S, B, Cv)``; key_padding_mask ``(B, S)``; attn_mask ``(T, S)``
        or ``(B*H, T, S)`` -> output like query with C channels; weights ``(B, T, S')``
        averaged over heads or ``(B, H, T, S')`` per head (without B when unbatched).
    """

    backend: str = "auto"

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias,
                         add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                         vdim=vdim, batch_first=batch_first, device=device, dtype=dtype)
        _keep_own_forward(self)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention.forward``.

        Returns:
            ``(output, weights)``; weights None when ``need_weights`` is False.
        """
        _check_tensors(query, key, value)
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights,
                                        attn_mask, average_attn_weights, is_causal)
        batched = _check_call(self, query, key, value, key_padding_mask, attn_mask, is_causal)
        q, k, v = self._to_batch_first(query, key, value, batched)  # (B, T, C), (B, S, Ck|Cv)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (1, S)
        replaced = _causal_replaces_mask(is_causal, key_padding_mask, need_weights)
        _check_lengths(self, q, k, v, key_padding_mask,
                       None if replaced else attn_mask)  # as torch: a replaced mask unchecked
        heads, probs = self._attend(q, k, v, key_padding_mask, attn_mask, need_weights,
                                    is_causal)  # (B, H, T, D), (B, H, T, S') or None
        out = self._merge_heads(heads, batched)  # like query, with C channels
        return out, _shape_weights(probs, average_attn_weights, batched)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                attn_mask: Tensor | None, need_weights: bool, is_causal: bool):
        """Project, append the extra key positions, attend; the weights when asked for.

        Shape:
            q ``(B, T, C)``, k ``(B, S, Ck)``, v ``(B, S, Cv)`` -> heads ``(B, H, T, D)``,
            probs ``(B, H, T, S')`` or None.
        """
        (B, T, _), S, dtype = q.shape, k.shape[1], q.dtype  # torch's masks take the input dtype
        q, k, v = self._project(q, k, v)  # (B, H, T, D), (B, H, S', D) x2
        causal = _causal_replaces_mask(is_causal, key_padding_mask, need_weights)
        mask = None if causal else _qkv_mask(
            attn_mask, key_padding_mask, (B, self.num_heads, T, S), k.shape[-2] - S, dtype)
        res = scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal, backend=self.backend, return_trace=need_weights)
        return (res[0], res[1].probs) if need_weights else (res, None)

    def _project(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """In-projections (one matmul for self-attention), torch's extra key/value positions
        (``bias_k``/``bias_v`` before the head split, zeros after it), heads split off.

        Shape:
            ``(B, T, C)``, ``(B, S, Ck)``, ``(B, S, Cv)`` -> ``(B, H, T, D)``,
            ``(B, H, S', D)``, ``(B, H, S', D)``.
        """
        if self._qkv_same_embed_dim and q is k is v:
            q, k, v = F.linear(q, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        else:
            ws = (self.in_proj_weight.chunk(3) if self._qkv_same_embed_dim else
                  (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight))
            bs = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = (F.linear(x, w, b) for x, w, b in zip((q, k, v), ws, bs))  # (B, L, C)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(k.shape[0], 1, -1)], 1)  # (B, S + 1, C)
            v = torch.cat([v, self.bias_v.expand(v.shape[0], 1, -1)], 1)  # (B, S + 1, C)
        q, k, v = (self._split_heads(t) for t in (q, k, v))  # (B, H, L, D)
        if self.add_zero_attn:
            zeros = k.new_zeros(k.shape[:2] + (1, self.head_dim))  # (B, H, 1, D)
            k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)  # (B, H, S', D)
        return q, k, v

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)

    def _merge_heads(self, heads: Tensor, batched: bool) -> Tensor:
        """Concatenate the heads and apply ``out_proj`` (as torch: ``F.linear``, no hooks),
        in the caller's layout.

        Shape:
            ``(B, H, T, D)`` -> ``(T, B, C)``, ``(B, T, C)`` with batch_first, ``(T, C)``
            unbatched.
        """
        B, H, T, D = heads.shape
        if batched and not self.batch_first:
            x = heads.permute(2, 0, 1, 3).reshape(T, B, H * D)  # (T, B, C)
        else:
            x = heads.transpose(1, 2).reshape(B, T, H * D)  # (B, T, C)
        out = F.linear(x, self.out_proj.weight, self.out_proj.bias)
        return out if batched else out[0]

    def _to_batch_first(self, query: Tensor, key: Tensor, value: Tensor, batched: bool):
        """The caller's layout as ``(B, L, C)``, keeping which of the three are one tensor
        (self-attention then projects with one matmul).

        Shape:
            ``(L, B, C)``, ``(B, L, C)`` with batch_first, or ``(L, C)`` -> ``(B, L, C)``.
        """
        if batched and self.batch_first:
            return query, key, value
        move = (lambda t: t.transpose(0, 1)) if batched else (lambda t: t.unsqueeze(0))
        q = move(query)
        k = q if key is query else move(key)
        v = k if value is key else q if value is query else move(value)
        return q, k, v

    def _forward_nested(self, query: Tensor, key: Tensor, value: Tensor,
                        key_padding_mask: Tensor | None, need_weights: bool,
                        attn_mask: Tensor | None, average_attn_weights: bool, is_causal: bool):
        """Nested tensors, as torch's fast path takes them: padded, attended with the padding
        masked, and nested again. Padded query rows get weights 0, as on torch's fast path.

        Shape:
            query ``(B, T_b, C)``, key ``(B, S_b, Ck)``, value ``(B, S_b, Cv)`` nested (ragged
            T_b, S_b) -> output nested like query; weights padded ``(B, [H,] T, S')``.
        """
        _check_nested(self, query, key, value, key_padding_mask, attn_mask, is_causal)
        q_len, s_len = _lengths(query), _lengths(key)  # (B,), (B,)
        q = query.to_padded_tensor(0.0)  # (B, T, C)
        k = q if key is query else key.to_padded_tensor(0.0)  # (B, S, Ck)
        v = k if value is key else q if value is query else value.to_padded_tensor(0.0)
        padding = torch.arange(k.shape[1], device=k.device) >= s_len[:, None]  # (B, S)
        heads, probs = self._attend(q, k, v, padding if padding.any() else None, None,
                                    need_weights, False)  # (B, H, T, D), (B, H, T, S')
        out = self._merge_heads(heads, batched=True)  # (B, T, C)
        out = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_len.tolist())],
                                            layout=query.layout)
        if probs is not None:
            real = torch.arange(q.shape[1], device=q.device) < q_len[:, None]  # (B, T)
            probs = probs * real[:, None, :, None]  # padded query rows: 0
        return out, _shape_weights(probs, average_attn_weights, batched=True)


def patch(model: nn.Module) -> nn.Module:
    """Make every ``torch.nn.MultiheadAttention`` in ``model`` a qkv :class:`MultiheadAttention`,
    in place: the same module objects, parameters, buffers and hooks, now computed by qkv.

    The modules stay where they are and keep their Parameter objects (an optimizer built
    before patching keeps working) and everything torch's module holds; only their class
    changes (as ``torch.nn.utils.parametrize`` changes a module's class). Outputs stay equal
    to torch's (except NaN rows, which become finite), ``need_weights=True`` gives weights
    from a fast kernel, and inside ``nn.TransformerEncoderLayer``/``nn.TransformerEncoder``
    the attention runs in qkv in every mode (torch's fused inference kernel is skipped for
    the patched layers). Patching twice changes nothing.

    Args:
        model: A module containing ``nn.MultiheadAttention`` modules, or one itself.

    Returns:
        ``model`` (when ``model`` is itself an ``nn.MultiheadAttention``, it is the patched
        module).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or holds a subclass of
            ``nn.MultiheadAttention`` whose own code a class change would drop.
        ValueError: ``model`` holds no ``nn.MultiheadAttention``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch needs a torch.nn.Module, got {type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.MultiheadAttention)]
    foreign = [f"{name or '<model>'} ({type(m).__qualname__})" for name, m in found
               if type(m) not in (nn.MultiheadAttention, MultiheadAttention)]
    if foreign:
        raise TypeError(
            f"patch replaces torch.nn.MultiheadAttention itself, but {', '.join(foreign)} "
            f"subclass it with code of their own that patching would drop; build those as "
            f"qkv.torch_compat.MultiheadAttention yourself, or patch a model without them"
        )
    if not found:
        raise ValueError(
            f"patch found no torch.nn.MultiheadAttention in {type(model).__name__}: nothing "
            f"to replace (qkv's own modules, e.g. qkv.MultiHeadAttention, need no patch)"
        )
    for _, m in found:
        m.__class__ = MultiheadAttention
        _keep_own_forward(m)
    return model


# --- Keeping torch's fused encoder kernel from skipping this module ---------------------------

def _forward_runs_here(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing: its presence is the point.

    ``nn.TransformerEncoderLayer.forward`` (torch/nn/modules/transformer.py) runs its fused
    ``torch._transformer_encoder_layer_fwd`` kernel in eval mode without gradients: that kernel
    reads ``self_attn``'s weights and never calls ``self_attn.forward``. It skips the kernel
    when any of its modules has a forward hook ("forward pre-/hooks are attached to the
    module", a case torch tests), since the hook would not run. This hook is that signal for
    one layer at a time, with no global switch (``torch.backends.mha``) touched.
    """
    return None


def _keep_own_forward(m: nn.Module) -> None:
    if _forward_runs_here not in m._forward_pre_hooks.values():
        m.register_forward_pre_hook(_forward_runs_here)


# --- torch's masks as qkv's ---------------------------------------------------------------------

def _causal_replaces_mask(is_causal: bool, key_padding_mask: Tensor | None,
                          need_weights: bool) -> bool:
    """torch's rule (``F.multi_head_attention_forward``): ``is_causal`` is a hint that
    ``attn_mask`` is causal; the causal mask replaces ``attn_mask`` only when there is no
    ``key_padding_mask`` and no weights are asked for; otherwise ``attn_mask`` is used."""
    return bool(is_causal) and key_padding_mask is None and not need_weights


def _qkv_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None,
              sizes: tuple[int, int, int, int], extra: int, dtype: torch.dtype) -> Tensor | None:
    """torch's two masks as one qkv mask: bool True = may attend, or float added.

    Bool masks (True = hidden) are inverted and combined; when either mask is float, each
    becomes torch's additive form (bool -> 0 / -inf in the query dtype) and they are added,
    as torch does. The ``extra`` key positions of ``add_bias_kv``/``add_zero_attn`` are
    visible to every query.

    Shape:
        attn_mask ``(T, S)`` or ``(B*H, T, S)``; key_padding_mask ``(B, S)`` -> broadcastable
        to ``(B, H, T, S + extra)``, with ``sizes = (B, H, T, S)``.
    """
    B, H, T, S = sizes
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(B, H, T, S))
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(B, 1, 1, S))  # (B, 1, 1, S)
    if not masks:
        return None
    if extra:
        masks = [F.pad(m, (0, extra)) for m in masks]  # False / 0.0: the extra keys are seen
    if all(m.dtype == torch.bool for m in masks):
        hidden = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~hidden
    added = [m if m.is_floating_point() else _additive(m, dtype) for m in masks]
    return added[0] if len(added) == 1 else added[0] + added[1]


def _additive(hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """torch's ``_canonical_mask``: a bool mask (True = hidden) as 0 / -inf."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf"))


def _shape_weights(probs: Tensor | None, average: bool, batched: bool) -> Tensor | None:
    """Shape:
        ``(B, H, T, S')`` -> ``(B, T, S')`` averaged, or as is; without B when unbatched."""
    if probs is None:
        return None
    weights = probs.mean(1) if average else probs
    return weights if batched else weights[0]


def _lengths(nested: Tensor) -> Tensor:
    """Shape: a nested ``(B, L_b, C)`` -> ``(B,)`` lengths L_b."""
    return torch.tensor([t.shape[0] for t in nested.unbind()], device=nested.device)


# --- Input checks: torch's, in torch's order, with its exception types ---------------------------

class _InputError(ValueError, AssertionError):
    """A bad input: a ValueError, and the AssertionError torch raises for it."""


class _MaskError(ValueError, RuntimeError):
    """A bad mask or flag: a ValueError, and the RuntimeError torch raises for it."""


def _check_tensors(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_call(m: MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None, attn_mask: Tensor | None,
                is_causal: bool) -> bool:
    """torch's checks of a forward call up to the lengths (:func:`_check_lengths`), in its
    order; returns whether the call is batched."""
    _check_mask_dtypes(key_padding_mask, attn_mask)
    batched = _check_dims(query, key, value, key_padding_mask, attn_mask, m.num_heads)
    if is_causal and attn_mask is None:
        raise _MaskError(
            "Need attn_mask if specifying the is_causal hint. (torch's MultiheadAttention "
            "takes is_causal=True as a hint that attn_mask is causal: pass attn_mask="
            "nn.Transformer.generate_square_subsequent_mask(T) with it; qkv.MultiHeadAttention "
            "takes is_causal=True alone)")
    _check_channels(m, query, key, value)
    return batched


def _check_mask_dtypes(key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise _InputError(
                f"only bool and floating types of {name} are supported, got {mask.dtype}: "
                f"pass a bool mask (True = NOT allowed, torch's polarity) or a float one "
                f"(added to the scores), e.g. {name}.bool()")
    if key_padding_mask is not None and attn_mask is not None and (
            key_padding_mask.dtype != attn_mask.dtype):
        warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. "
                      "Use same type for both instead.", stacklevel=3)


def _check_dims(query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
                attn_mask: Tensor | None, num_heads: int) -> bool:
    """torch's ``_mha_shape_check``: returns whether the call is batched."""
    if query.dim() not in (2, 3):
        raise _InputError(
            f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D "
            f"query tensor (shape {tuple(query.shape)})")
    batched = query.dim() == 3
    kind, want = ("batched (3-D)", 3) if batched else ("unbatched (2-D)", 2)
    if key.dim() != want or value.dim() != want:
        raise _InputError(
            f"For {kind} `query`, expected `key` and `value` to be {want}-D but found "
            f"{key.dim()}-D and {value.dim()}-D tensors respectively; batch all three or none")
    if key_padding_mask is not None and key_padding_mask.dim() != want - 1:
        raise _InputError(
            f"For {kind} `query`, expected `key_padding_mask` to be `None` or {want - 1}-D but "
            f"found {key_padding_mask.dim()}-D tensor instead (shape (B, S), or (S,) unbatched)")
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise _InputError(
            f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
            f"{attn_mask.dim()}-D tensor instead (shape (T, S) or (B*num_heads, T, S))")
    if not batched and attn_mask is not None and attn_mask.dim() == 3:
        expected = (num_heads, query.shape[0], key.shape[0])
        if tuple(attn_mask.shape) != expected:
            raise _InputError(f"Expected `attn_mask` shape to be {expected} but got "
                              f"{tuple(attn_mask.shape)} (num_heads, T, S)")
    return batched


def _check_channels(m: MultiheadAttention, query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, t, c in (("query", query, m.embed_dim), ("key", key, m.kdim),
                       ("value", value, m.vdim)):
        if t.size(-1) != c:  # size(-1), not shape: a nested tensor has no shape
            what = "embed_dim" if name == "query" else name[0] + "dim"
            raise _InputError(
                f"was expecting embedding dimension of {c}, but got {t.size(-1)}: {name} "
                f"must have {what}={c} channels in its last dim")


def _check_lengths(m: MultiheadAttention, q: Tensor, k: Tensor, v: Tensor,
                   key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
    """Batch and lengths of batch-first inputs and masks (torch's messages, then ours).

    Shape:
        q ``(B, T, C)``, k ``(B, S, Ck)``, v ``(B, S, Cv)``.
    """
    (B, T), S = q.shape[:2], k.shape[1]
    if k.shape[:2] != v.shape[:2] or k.shape[0] != B:
        raise _InputError(
            f"key's sequence and batch dims do not match value's or query's batch: got (B, L) "
            f"query {tuple(q.shape[:2])}, key {tuple(k.shape[:2])}, value {tuple(v.shape[:2])} "
            f"in batch-first order; key and value need the same S, all three the same B")
    if attn_mask is not None:
        want = (T, S) if attn_mask.dim() == 2 else (B * m.num_heads, T, S)
        if tuple(attn_mask.shape) != want:
            raise _MaskError(
                f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, "
                f"but should be {want} (T={T} queries, S={S} keys"
                f"{'' if attn_mask.dim() == 2 else f', B*num_heads={B}*{m.num_heads}'})")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, S):
        raise _InputError(f"Expected key_padding_mask of shape (B, S) = {(B, S)}, but got "
                          f"{tuple(key_padding_mask.shape)}")


def _check_nested(m: MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                  key_padding_mask: Tensor | None, attn_mask: Tensor | None,
                  is_causal: bool) -> None:
    if not (query.is_nested and key.is_nested and value.is_nested):
        raise _InputError("nested query, key and value go together: pass all three nested, "
                          "or all three padded with a key_padding_mask")
    if key_padding_mask is not None or attn_mask is not None or is_causal:
        raise _InputError(
            "nested tensors carry their own padding and take no key_padding_mask, attn_mask or "
            "is_causal (as on torch's fast path); pass padded tensors to mask more")
    if not m.batch_first:
        raise _InputError("nested tensors are (B, L_b, C), batch first: build the module with "
                          "batch_first=True, or pass padded (L, B, C) tensors")
    sizes = [t.size(0) for t in (query, key, value)]
    if len(set(sizes)) != 1:
        raise _InputError(f"nested query, key and value must hold the same number of "
                          f"sequences, got {sizes}")
    _check_channels(m, query, key, value)
