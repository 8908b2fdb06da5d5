"""The drop-in module: ``torch.nn.MultiheadAttention``'s constructor, parameters and call,
computed by qkv (see :mod:`qkv.torch_compat`; bool masks here are torch's: True = NOT allowed).

Shape alphabet: B batch, H heads, T query length, S key length, S' = S plus one key per
``add_bias_kv`` and ``add_zero_attn``, D head dim, C embed_dim, Ck/Cv key/value channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional import scaled_dot_product_attention
from ..ops.cpu_isa import linear
from .checks import _check_call, _check_lengths, _check_nested, _check_tensors
from .torch_masks import _causal_replaces_mask, _qkv_mask

__all__ = ["MultiheadAttention"]


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

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )
        _keep_own_forward(self)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention.forward``.

        Returns:
            ``(output, weights)``; weights None when ``need_weights`` is False.
        """
        _check_tensors(query, key, value)
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(
                query,
                key,
                value,
                key_padding_mask,
                need_weights,
                attn_mask,
                average_attn_weights,
                is_causal,
            )
        batched = _check_call(self, query, key, value, key_padding_mask, attn_mask, is_causal)
        q, k, v = self._to_batch_first(query, key, value, batched)  # (B, T, C), (B, S, Ck|Cv)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (1, S)
        replaced = _causal_replaces_mask(is_causal, key_padding_mask, need_weights)
        _check_lengths(
            self, q, k, v, key_padding_mask, None if replaced else attn_mask
        )  # as torch: a replaced mask unchecked
        heads, probs = self._attend(
            q, k, v, key_padding_mask, attn_mask, need_weights, is_causal
        )  # (B, H, T, D), (B, H, T, S') or None
        out = self._merge_heads(heads, batched)  # like query, with C channels
        return out, _shape_weights(probs, average_attn_weights, batched)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        need_weights: bool,
        is_causal: bool,
    ):
        """Project, append the extra key positions, attend; the weights when asked for.

        Shape:
            q ``(B, T, C)``, k ``(B, S, Ck)``, v ``(B, S, Cv)`` -> heads ``(B, H, T, D)``,
            probs ``(B, H, T, S')`` or None.
        """
        (B, T, _), S, dtype = q.shape, k.shape[1], q.dtype  # torch's masks take the input dtype
        q, k, v = self._project(q, k, v)  # (B, H, T, D), (B, H, S', D) x2
        causal = _causal_replaces_mask(is_causal, key_padding_mask, need_weights)
        mask = (
            None
            if causal
            else _qkv_mask(
                attn_mask, key_padding_mask, (B, self.num_heads, T, S), k.shape[-2] - S, dtype
            )
        )
        res = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            backend=self.backend,
            return_trace=need_weights,
        )
        if isinstance(res, tuple):  # need_weights: the trace's weights
            heads, trace = res
            return heads, trace.probs
        return res, None

    def _project(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """In-projections (one matmul for self-attention), torch's extra key/value positions
        (``bias_k``/``bias_v`` before the head split, zeros after it), heads split off.

        Shape:
            ``(B, T, C)``, ``(B, S, Ck)``, ``(B, S, Cv)`` -> ``(B, H, T, D)``,
            ``(B, H, S', D)``, ``(B, H, S', D)``.
        """
        if self._qkv_same_embed_dim and q is k is v:
            q, k, v = linear(q, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
        else:
            ws = (
                self.in_proj_weight.chunk(3)
                if self._qkv_same_embed_dim
                else (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            )
            bs = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = (linear(x, w, b) for x, w, b in zip((q, k, v), ws, bs))  # (B, L, C)
        if self.bias_k is not None and self.bias_v is not None:  # add_bias_kv sets both
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
        """Concatenate the heads and apply ``out_proj`` (as torch: ``F.linear``, no hooks;
        half inputs widened where the CPU's half GEMMs are slow, ``ops.cpu_isa.linear``), in
        the caller's layout.

        Shape:
            ``(B, H, T, D)`` -> ``(T, B, C)``, ``(B, T, C)`` with batch_first, ``(T, C)``
            unbatched.
        """
        B, H, T, D = heads.shape
        if batched and not self.batch_first:
            x = heads.permute(2, 0, 1, 3).reshape(T, B, H * D)  # (T, B, C)
        else:
            x = heads.transpose(1, 2).reshape(B, T, H * D)  # (B, T, C)
        out = linear(x, self.out_proj.weight, self.out_proj.bias)
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

    def _forward_nested(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ):
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
        heads, probs = self._attend(
            q, k, v, padding if padding.any() else None, None, need_weights, False
        )  # (B, H, T, D), (B, H, T, S')
        out = self._merge_heads(heads, batched=True)  # (B, T, C)
        out = torch.nested.as_nested_tensor(
            [o[:n] for o, n in zip(out, q_len.tolist())], layout=query.layout
        )
        if probs is not None:
            real = torch.arange(q.shape[1], device=q.device) < q_len[:, None]  # (B, T)
            probs = probs * real[:, None, :, None]  # padded query rows: 0
        return out, _shape_weights(probs, average_attn_weights, batched=True)


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


# --- The weights and nested lengths in torch's layout ------------------------------------------


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
