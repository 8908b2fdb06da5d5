"""Self-attention and multi-head attention modules, in the seeds' terms.

Modules take ``(B, T, C)`` (or unbatched ``(T, C)``) and convert to the kernels' ``(B, H, T, D)``
at their boundary only. Masks follow qkv's contract: bool True = may attend; ``key_mask``
``(B, S)`` True marks a real key.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, C model dim (embed_dim); T_r, S_r this rank's shard of T, S (context parallel).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import masks
from ..functional import KeptLane, scaled_dot_product_attention
from ..ops.cpu_isa import linear
from ..trace import MultiHeadTrace
from ._inputs import ContextCall, ContextGroupAttribute, ModuleInputs, module_inputs, shard_lengths
from ._step import has_hooks as _has_hooks
from ._step import make_plan
from .cache import KVCache

__all__ = ["MultiHeadAttention", "SelfAttention"]


class SelfAttention(nn.Module):
    """Single-head self-attention exactly as the seeds write it: ``Q = X W_Q``, ``K = X W_K``,
    ``V = X W_V``, ``Z = softmax(Q K^T * scale) V``.

    Args:
        d_model: Input channels C.
        d_k: Query/key dim.
        d_v: Value dim (defaults to ``d_k``; the seeds allow it to differ).
        scale: Factor on the scores; None means ``1 / sqrt(d_k)`` (seed 004's example uses 1).

    Shape:
        x ``(B, T, C)`` or ``(T, C)`` -> ``(B, T, d_v)`` or ``(T, d_v)``.
    """

    def __init__(
        self,
        d_model: int,
        d_k: int,
        d_v: int | None = None,
        *,
        scale: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        d_v = d_k if d_v is None else d_v
        self.W_Q = nn.Parameter(torch.empty(d_model, d_k, **kw))
        self.W_K = nn.Parameter(torch.empty(d_model, d_k, **kw))
        self.W_V = nn.Parameter(torch.empty(d_model, d_v, **kw))
        self.scale = scale
        for w in (self.W_Q, self.W_K, self.W_V):
            nn.init.xavier_uniform_(w)

    @classmethod
    def from_weights(
        cls, w_q: Tensor, w_k: Tensor, w_v: Tensor, scale: float | None = None
    ) -> SelfAttention:
        """The module with the given weights, in the seeds' convention ``Q = X @ W_Q``.

        Shape:
            w_q, w_k ``(C, d_k)``; w_v ``(C, d_v)``.
        """
        w_q, w_k, w_v = (torch.as_tensor(w) for w in (w_q, w_k, w_v))
        if (
            w_q.dim() != 2
            or w_q.shape != w_k.shape
            or w_v.dim() != 2
            or w_v.shape[0] != w_q.shape[0]
        ):
            raise ValueError(
                f"need w_q and w_k of one shape (C, d_k) and w_v (C, d_v), got "
                f"{tuple(w_q.shape)}, {tuple(w_k.shape)}, {tuple(w_v.shape)}"
            )
        dtype = w_q.dtype if w_q.is_floating_point() else torch.get_default_dtype()
        m = cls(w_q.shape[0], w_q.shape[1], w_v.shape[1], scale=scale, dtype=dtype)
        with torch.no_grad():
            for p, w in ((m.W_Q, w_q), (m.W_K, w_k), (m.W_V, w_v)):
                p.copy_(w)
        return m

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        return_trace: bool = False,
    ):
        """Attend each position of ``x`` to every (allowed) position of ``x``.

        Returns the output, or ``(output, trace)`` with ``trace.q/k/v`` ``(B, T, d)`` and
        ``trace.probs`` ``(B, T, T)`` (no head dim) when ``return_trace``.
        """
        C = self.W_Q.shape[0]
        dtypes = (self.W_Q.dtype, self.W_K.dtype, self.W_V.dtype)
        inp = module_inputs(x, None, None, attn_mask, key_mask, (C, C, C), dtypes)
        q, k, v = inp.query @ self.W_Q, inp.query @ self.W_K, inp.query @ self.W_V  # (B, T, d)
        res = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=inp.single_head_mask(),
            is_causal=is_causal,
            scale=self.scale,
            return_trace=return_trace,
        )
        if not isinstance(res, tuple):  # no trace asked for
            return res[0] if inp.unbatched else res  # drop the batch dim of 1
        out, trace = res  # (B, T, d_v)
        final = out[0] if inp.unbatched else out
        index = 0 if inp.unbatched else None
        return final, MultiHeadTrace(trace, q=q, k=k, v=v, heads=out, index=index)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: project, split into heads, attend, concat, mix with W^O.

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W^O`` with
    ``head_i = Attention(Q W_Q^i, K W_K^i, V W_V^i)``; head ``i`` takes the ``i``-th
    contiguous chunk of ``head_dim = embed_dim / num_heads`` channels (seed 000's split).

    Parameters follow torch.nn.MultiheadAttention's layout (so :meth:`from_torch` is exact):
    ``in_proj_weight`` ``(C + 2*G*D, C)`` when key and value have ``embed_dim`` channels
    (one fused projection for self-attention), else ``q_proj_weight``, ``k_proj_weight``,
    ``v_proj_weight``; ``in_proj_bias``; ``out_proj``. Read them in the seeds' terms through
    ``W_Q``, ``W_K``, ``W_V`` (``(C_in, heads * D)``, used as ``X @ W``) and ``W_O``.

    Args:
        embed_dim: Model dim C; queries have C channels and so does the output.
        num_heads: Query heads H; C must be a multiple of H.
        kdim, vdim: Channels of key and value inputs (default C).
        bias: Biases on the projections.
        dropout: Dropout on the attention weights, in training mode only.
        num_kv_heads: Key/value heads G (GQA; 1 is MQA); H must be a multiple of G.
        backend: Attention backend for the functional call (``"auto"``).
        context_group: A ``torch.distributed`` process group to run context-parallel over
            (``torch.distributed.group.WORLD`` for all ranks); None (default) runs on this
            process alone. Also a plain attribute: set it to switch. ``copy.deepcopy``
            shares it; pickling (``torch.save(module)``) drops it to None.
        context_layout: How the sequence is cut into the ranks' shards: ``"contiguous"`` or
            ``"balanced"`` (see :func:`qkv.distributed.shard`). Also an attribute.

    Context parallel (``context_group`` set): every rank of the group calls the module
    together, each with its own shard of the sequence, e.g. ``shard(x, group, dim=1,
    layout=...)``: query ``(B, T_r, C)`` and, for cross-attention, key/value ``(B, S_r, .)``,
    this rank's shard of the memory. The projections and W^O run on the shard; attention runs
    through :func:`qkv.distributed.ring_attention`, so the output is this rank's rows of the
    module's output on the whole sequence, forward and backward (the parameter gradients on a
    rank are its part: their sum over the ranks is the single-process gradient). Every rank
    must make the same call (the same flags and masks).

    * ``is_causal``, ``mask_mod`` and ``score_mod`` speak of whole-sequence positions, as on
      one process (a ``sliding_window`` is the window of the whole sequence).
    * ``key_mask`` is this rank's shard ``(B, S_r)``; the module gathers the whole ``(B, S)``
      key mask and applies it as a structured mask, so key shards that hold only padding
      are never sent, and a query with no real key outputs 0 as everywhere in qkv.
    * ``return_trace`` gives this rank's rows against every key (``probs`` ``(B, H, T_r, S)``,
      recomputed lazily); the trace's q/k/v/heads are this rank's shards.
    * Refused with a ValueError: a dense ``attn_mask`` (give a ``mask_mod`` and ``key_mask``),
      decoding with a ``cache`` (decode on one process), ``dropout > 0`` in training mode
      (ring attention has no attention dropout: use ``dropout=0.0`` and dropout on the
      residual branch, or ``.eval()``), a ``backend`` other than ``"auto"``/``"tiled"`` (each
      rank computes with the tiled backend's kernels), and subclasses whose attention has no
      ring path (``LinearMultiHeadAttention``).

    Shape:
        query ``(B, T, C)``; key ``(B, S, kdim)``; value ``(B, S, vdim)`` -> ``(B, T, C)``
        (or all unbatched, without B). attn_mask broadcastable to ``(B, H, T, S)``;
        key_mask ``(B, S)``. Context parallel: ``(B, T_r, C)``, ``(B, S_r, .)`` ->
        ``(B, T_r, C)``; key_mask ``(B, S_r)``.

    Example (context parallel, on every rank)::

        >>> mha = qkv.MultiHeadAttention(512, 8, context_group=group, context_layout="balanced")
        >>> x_r = qkv.distributed.shard(x, group, dim=1, layout="balanced")  # (B, T_r, 512)
        >>> y_r = mha(x_r, is_causal=True)                                    # (B, T_r, 512)
    """

    context_group = ContextGroupAttribute()

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
        backend: str = "auto",
        context_group=None,
        context_layout: str = "contiguous",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        G = num_heads if num_kv_heads is None else num_kv_heads
        _check_config(embed_dim, num_heads, G, dropout)
        kw = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, G
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout, self.backend = dropout, backend
        self.context_group, self.context_layout = context_group, _check_layout(context_layout)
        kv = G * self.head_dim
        self.fused = self.kdim == self.vdim == embed_dim
        if self.fused:
            self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * kv, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(kv, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(kv, self.vdim, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv, **kw)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._kept_lane = KeptLane()  # a decoding step's attention call, kept (_decode_step)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections and zero biases, as torch.nn.MultiheadAttention."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    # The seeds' view of the parameters: X @ W.
    @property
    def W_Q(self) -> Tensor:
        """``(C, H * D)``: ``Q = query @ W_Q``; head ``i`` is columns ``i*D:(i+1)*D``."""
        return self._proj_weights()[0].T

    @property
    def W_K(self) -> Tensor:
        """``(kdim, G * D)``."""
        return self._proj_weights()[1].T

    @property
    def W_V(self) -> Tensor:
        """``(vdim, G * D)``."""
        return self._proj_weights()[2].T

    @property
    def W_O(self) -> Tensor:
        """``(H * D, C)``: ``output = Concat(heads) @ W_O (+ bias)``."""
        return self.out_proj.weight.T

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
        cache: KVCache | None = None,
    ):
        """Attend ``query`` to ``key``/``value`` (self-attention when they are omitted).

        ``mask_mod``/``score_mod`` (``qkv.masks``, e.g. ``sliding_window(256)``) combine with
        the other masks and send the call to the tiled backend under ``backend="auto"``.

        Decoding: with ``cache`` (from :meth:`new_cache`), ``query`` holds the next T positions
        of a sequence (self-attention only); their keys and values are appended to the cache
        and each new position attends to every cached position and to the new ones up to
        itself (causal, bottom-right aligned), whatever ``is_causal`` says. ``key_mask``
        ``(B, T)`` then marks the new positions that are real tokens.

        Returns the output, or ``(output, MultiHeadTrace)`` with per-head weights
        ``(B, H, T, S)`` and per-head outputs before W^O ``(B, H, T, D)``.
        """
        if query.is_nested:  # a batch of sequences of different lengths, jagged
            return self._nested_forward(
                query,
                query if key is None else key,
                query if value is None else value,
                is_causal,
                dict(
                    attn_mask=attn_mask,
                    key_mask=key_mask,
                    return_trace=return_trace or None,
                    mask_mod=mask_mod,
                    score_mod=score_mod,
                    cache=cache,
                ),
            )
        if (  # a decoding step of one batched self-attention input: its own short way
            cache is not None
            and key is None
            and value is None
            and attn_mask is None
            and key_mask is None
            and not return_trace
            and mask_mod is None
            and score_mod is None
        ):
            out = self._decode_step(query, cache)
            if out is not None:
                return out
        context = None if self.context_group is None else self._context_call(attn_mask, cache)
        if cache is not None:
            _check_decoding(query, key, value, attn_mask)
        if self.fused:  # one weight: no split needed for its dtype
            dtypes = (self.in_proj_weight.dtype,) * 3
        else:
            dtypes = (self.q_proj_weight.dtype, self.k_proj_weight.dtype, self.v_proj_weight.dtype)
        inp = module_inputs(
            query,
            key,
            value,
            attn_mask,
            key_mask,
            (self.embed_dim, self.kdim, self.vdim),
            dtypes,
            context=context,
        )
        q, k, v = self._project(inp.query, inp.key, inp.value)  # (B, H, T, D), (B, G, S, D) x2
        heads, trace, k, v = self._attend(
            q,
            k,
            v,
            inp,
            is_causal=is_causal,
            return_trace=return_trace,
            mask_mod=mask_mod,
            score_mod=score_mod,
            cache=cache,
        )  # (B, H, T, D)
        if context is not None and not context.ran:
            raise ValueError(
                f"{type(self).__name__} has no context-parallel path (its "
                f"attention does not run over the ranks' shards); set "
                f"context_group=None, or use MultiHeadAttention / "
                f"LocalMultiHeadAttention"
            )
        B, H, T, D = heads.shape
        out = self._output(heads.transpose(1, 2).reshape(B, T, H * D))  # (B, T, C)
        if inp.unbatched:
            out = out[0]  # (T, C)
        if not return_trace:
            return out
        index = 0 if inp.unbatched else None  # drop the batch dim of 1
        return out, MultiHeadTrace(trace, q=q, k=k, v=v, heads=heads, index=index)

    def _decode_step(self, query: Tensor, cache: KVCache) -> Tensor | None:
        """:meth:`forward` of a decoding step whose only input is a batched ``query`` of the
        fused weights' dtype and width, no context group and this class's own attention (a
        model's generation loop, grouped-query heads too), by the same steps without the
        general checks that such a call passes (:func:`module_inputs`,
        :func:`_check_decoding`), and a step of one token by its attention call's kept lane
        (``functional.KeptLane``): at decode sizes the Python around the step's tensor ops was
        a quarter of its time (C=512, one thread: 354 µs against 267 for torch's ops by hand).
        None for any other call (the general way checks it and runs it).

        Shape:
            query ``(B, T, C)`` -> ``(B, T, C)``.
        """
        kept = self.__dict__.get("_kept_lane")  # (None in a module pickled before it was kept)
        plan = None if kept is None else kept.held  # (a one-token step's plan: nn/_step.py)
        if plan is not None:
            planned = plan.run(self, kept, query, cache)
            if planned is not None:
                return planned
        w = self._parameters.get("in_proj_weight")  # (None unless fused; read as the module's
        if (  # attribute, a parameter costs a call of nn.Module.__getattr__)
            w is None
            or type(query) is not Tensor
            or query.dim() != 3
            or query.shape[-1] != self.embed_dim
            or query.dtype != w.dtype
            or self.context_group is not None
            or type(self)._attend is not MultiHeadAttention._attend  # (local windows, ...)
        ):
            return None
        B, T, C = query.shape
        q, k, v = self._project(query, query, query)  # (B, H, T, D), (B, G, T, D) x2
        keys, values, key_mask = cache.append(k, v)  # (B, G, P, D): all positions so far
        gqa = self.num_kv_heads != self.num_heads
        if T != 1 or (self.training and self.dropout):
            kept = None  # (a kept lane's call is of one token, without dropout)
        padded = key_mask is not None  # (a padded cache: kept for the plan only, see below)
        mark = () if kept is None else (query.shape, query.dtype, keys.dtype, self.backend, padded)
        if kept is not None and not padded:
            fast = kept.run(mark, q, keys, values)  # (B, H, 1, D), or None: the usual way
            if fast is not None:
                return self._output(fast.transpose(1, 2).reshape(B, T, C))
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, P)
        heads: Tensor = scaled_dot_product_attention(  # type: ignore[assignment]
            q,
            keys,
            values,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=gqa,
            backend=self.backend,
            mask_mod=_decoding_mask(None, T, keys.shape[-2]),
        )  # (B, H, T, D)
        if kept is not None:
            kept.keep(mark, q, keys, values, self.backend, gqa, mask)
            kept.held = make_plan(self, query, q, cache, kept)  # (the next steps' plan, or None)
        return self._output(heads.transpose(1, 2).reshape(B, T, C))

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
        """Attention of the projected heads: ``(heads, trace or None, keys, values)``, where
        keys/values are the ones attended to (the whole cache when decoding).

        Shape:
            q ``(B, H, T, D)``; k, v ``(B, G, S, D)`` -> heads ``(B, H, T, D)``.
        """
        if inp.context is not None:
            return self._attend_context(
                q,
                k,
                v,
                inp,
                inp.context,
                is_causal=is_causal,
                return_trace=return_trace,
                mask_mod=mask_mod,
                score_mod=score_mod,
            )
        mask = inp.mask
        if cache is not None:
            k, v, key_mask = cache.append(k, v, inp.key_mask)  # (B, G, P, D): all positions so far
            if return_trace:  # the next append writes the cache in place: a trace of this step
                # keeps its own copy, so it stays readable (B*G*P*(D+Dv) elements, the order of
                # the trace's own q, k, v)
                k, v = k.clone(), v.clone()
                key_mask = None if key_mask is None else key_mask.clone()
            mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, P)
            mask_mod, is_causal = _decoding_mask(mask_mod, q.shape[-2], k.shape[-2]), False
        res = scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=self.num_kv_heads != self.num_heads,
            backend=self.backend,
            return_trace=return_trace,
            mask_mod=mask_mod,
            score_mod=score_mod,
        )
        heads, trace = res if return_trace else (res, None)
        return heads, trace, k, v

    def _attend_context(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        inp: ModuleInputs,
        ctx: ContextCall,
        *,
        is_causal: bool,
        return_trace: bool,
        mask_mod,
        score_mod,
    ):
        """:meth:`_attend` of this rank's shards (``inp.context``, given as ``ctx``), by ring
        attention over ``context_group``.

        Shape:
            q ``(B, H, T_r, D)``; k, v ``(B, G, S_r, D)`` -> heads ``(B, H, T_r, D)``.
        """
        from ..distributed import ring_attention

        ctx.ran = True
        if inp.key_mask is not None:
            real = _real_keys(inp.key_mask, q.shape[-2], inp.query is inp.key, ctx)
            mask_mod = real if mask_mod is None else masks.and_masks(mask_mod, real)
        res = ring_attention(
            q,
            k,
            v,
            group=ctx.group,
            is_causal=is_causal,
            mask_mod=mask_mod,
            score_mod=score_mod,
            enable_gqa=self.num_kv_heads != self.num_heads,
            layout=ctx.layout,
            return_trace=return_trace,
        )
        heads, trace = res if return_trace else (res, None)  # (B, H, T_r, D)
        return heads, trace, k, v

    def _context_call(self, attn_mask: Tensor | None, cache) -> ContextCall:
        """Refuse what ring attention cannot run, with the way around it."""
        if cache is not None:
            raise ValueError(
                "decoding with a cache is not context-parallel (the cache holds "
                "the whole sequence's keys on one process): decode on one "
                "process with context_group=None (set the attribute, or load the "
                "state_dict into a model built without it)"
            )
        if attn_mask is not None:
            raise ValueError(
                "a dense attn_mask cannot run context-parallel (each rank holds "
                "only its shard of the sequence): give the mask as a mask_mod "
                "over whole-sequence positions (qkv.masks.causal, "
                "sliding_window, document, key_lengths, ...) and padding as "
                "key_mask, this rank's shard (B, S_r)"
            )
        if self.dropout and self.training:
            raise ValueError(
                f"ring attention has no attention dropout, and this module has "
                f"dropout={self.dropout} in training mode: build it with "
                f"dropout=0.0 (qkv.models put dropout on the residual branches), "
                f"or call .eval()"
            )
        if self.backend not in ("auto", "tiled"):
            raise ValueError(
                f"context-parallel attention computes each rank's pieces with the "
                f"tiled backend; backend={self.backend!r} cannot run it: use "
                f"backend='auto' or 'tiled'"
            )
        return ContextCall(self.context_group, _check_layout(self.context_layout))

    def new_cache(self, batch_size: int, capacity: int, *, device=None, dtype=None) -> KVCache:
        """An empty :class:`KVCache` for decoding up to ``capacity`` positions with this module
        (device and dtype default to the parameters')."""
        ref = self.out_proj.weight
        return KVCache(
            batch_size,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            device=device or ref.device,
            dtype=dtype or ref.dtype,
        )

    def _nested_forward(
        self, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, others: dict
    ) -> Tensor:
        """:meth:`forward` of nested (jagged) inputs ``(B, j, C)``: the projections on the
        nested tensors, their heads ``(B, H, j, D)`` attended as packed sequences
        (``qkv._nested``), W^O on the merged heads. ``is_causal`` is causal within each
        sequence; the other options (``others``) are refused by name.

        Shape:
            query ``(B, j, C)``, key ``(B, k, kdim)``, value ``(B, k, vdim)`` jagged ->
            ``(B, j, C)`` jagged like ``query``.
        """
        if type(self) is not MultiHeadAttention or self.context_group is not None:
            where = " over a context group" if self.context_group is not None else ""
            raise ValueError(
                f"{type(self).__name__}{where} takes no nested (jagged) inputs: pad the batch "
                f"and pass key_mask"
            )
        given = [name for name, v in others.items() if v is not None]
        if given:
            raise ValueError(
                f"nested (jagged) inputs take is_causal only, not {', '.join(given)}: pad the "
                f"batch (key_mask) or pack it yourself (masks.document) for those"
            )
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        sizes = [H * D, G * D, G * D]
        biases = [None] * 3 if self.in_proj_bias is None else self.in_proj_bias.split(sizes)
        q, k, v = (
            nn.functional.linear(x, w, b).unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, j, D)
            for x, w, b, n in zip((query, key, value), self._proj_weights(), biases, (H, G, G))
        )
        out = scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            enable_gqa=G != H,
            backend=self.backend,
        )  # (B, H, j, D)
        assert isinstance(out, Tensor)  # (no trace asked for)
        return self.out_proj(out.transpose(1, 2).flatten(-2))  # (B, j, C)

    def _proj_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        if self.fused:
            kv = self.num_kv_heads * self.head_dim
            return tuple(self.in_proj_weight.split([self.embed_dim, kv, kv]))
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def _output(self, merged: Tensor) -> Tensor:
        """``out_proj(merged)``; a plain ``nn.Linear`` out_proj without hooks is multiplied by
        ``ops.cpu_isa.linear`` (its own math; for half inputs on a CPU whose half GEMMs are
        slow, in float32), while any other (a LoRA wrapper, a hooked or compiled layer) is
        called as it is.

        Shape:
            ``(B, T, H * D)`` -> ``(B, T, C)``.
        """
        m: nn.Module = self._modules["out_proj"]  # type: ignore[assignment]  # (as in _project)
        if type(m) is nn.Linear and not _has_hooks(m):  # its forward, without the module's call
            p = m._parameters
            return linear(merged, p["weight"], p["bias"])  # type: ignore[arg-type]  # (B, T, C)
        return m(merged)

    def _project(self, query: Tensor, key: Tensor, value: Tensor):
        """Project and split into heads: one fused matmul for self-attention."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused and query is key is value:  # (a decoding step's way first)
            B, T, _ = query.shape
            # (read without nn.Module.__getattr__'s calls; a parametrized weight or bias
            # (weight norm, torch.nn.utils.parametrize) is no parameter: read as attributes)
            p = self._parameters
            w = p.get("in_proj_weight")
            if w is None or "in_proj_bias" not in p:
                w, bias = self.in_proj_weight, self.in_proj_bias
            else:
                bias = p["in_proj_bias"]
            qkv = linear(query, w, bias)  # (B, T, (H + 2G) * D)
            # the three heads' views in three ops rather than seven (Tensor.split's Python
            # wrapper alone cost a grouped decoding step 3% of its time)
            if G == H:
                q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
            else:
                heads = qkv.view(B, T, H + 2 * G, D).transpose(1, 2)  # (B, H + 2G, T, D)
                q, k, v = heads.split_with_sizes([H, G, G], 1)
            return q, k, v  # (B, H, T, D), (B, G, T, D) x2
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        sizes = [H * D, G * D, G * D]
        biases = [None] * 3 if self.in_proj_bias is None else self.in_proj_bias.split(sizes)
        w_q, w_k, w_v = self._proj_weights()
        q, k, v = (
            linear(x, w, b) for x, w, b in zip((query, key, value), (w_q, w_k, w_v), biases)
        )  # (B, L, heads * D)
        return (
            q.reshape(B, T, H, D).transpose(1, 2),  # (B, H, T, D)
            k.reshape(B, S, G, D).transpose(1, 2),  # (B, G, S, D)
            v.reshape(B, S, G, D).transpose(1, 2),  # (B, G, S, D)
        )

    @classmethod
    def from_torch(
        cls, m: nn.MultiheadAttention, *, batch_first: bool | None = None
    ) -> MultiHeadAttention:
        """The same attention as a ``torch.nn.MultiheadAttention``, with copied parameters.

        qkv modules always take ``(B, T, C)``. A torch module built with ``batch_first=False``
        takes ``(T, B, C)``, and the same tensors fed to the converted module would mix the
        positions of different sequences without any error, so such a module is refused
        unless the caller passes ``batch_first=True``, confirming that they will feed
        ``(B, T, C)`` (``x.transpose(0, 1)`` of torch's input). To keep torch's layout and mask
        polarity instead, use ``qkv.torch_compat.MultiheadAttention`` or
        ``qkv.torch_compat.patch(model)``.

        torch's ``key_padding_mask`` (True = padding) becomes ``key_mask=~key_padding_mask``;
        its bool ``attn_mask`` (True = hidden) becomes ``~attn_mask``, and a 3-D
        ``(B*H, T, S)`` one is reshaped to ``(B, H, T, S)``. ``add_bias_kv`` and
        ``add_zero_attn`` are refused with a ValueError (``qkv.torch_compat`` runs them).

        Args:
            m: The torch module.
            batch_first: True confirms that the caller feeds ``(B, T, C)`` whatever
                ``m.batch_first`` says; None (default) accepts only ``m.batch_first=True``.
                False is refused: qkv modules take no ``(T, B, C)``.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(
                f"from_torch needs a torch.nn.MultiheadAttention, got {type(m).__name__}"
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "qkv.MultiHeadAttention does not take add_bias_kv=True or add_zero_attn=True "
                "(an extra learned or zero key/value position that every query sees); build "
                "the torch module without them, or use qkv.torch_compat.MultiheadAttention "
                "(or qkv.torch_compat.patch(model)), which runs them"
            )
        if batch_first is not True and not (batch_first is None and m.batch_first):
            C = m.embed_dim
            why = (
                f"from_torch(m, batch_first={batch_first!r}): qkv.MultiHeadAttention takes "
                f"(B, T, {C}) only, never (T, B, {C})"
                if batch_first is not None
                else f"this torch.nn.MultiheadAttention(embed_dim={C}, num_heads={m.num_heads}) "
                f"has batch_first=False and takes (T, B, {C}), but qkv.MultiHeadAttention takes "
                f"(B, T, {C}): fed the same tensors it would silently mix the positions of "
                f"different sequences"
            )
            raise ValueError(
                f"{why}. Either keep torch's layout with qkv.torch_compat.MultiheadAttention "
                f"(or qkv.torch_compat.patch(model)), or call from_torch(m, batch_first=True) "
                f"to confirm you will feed (B, T, {C}), e.g. x.transpose(0, 1)"
            )
        ref = m.out_proj.weight
        new = cls(
            m.embed_dim,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=m.in_proj_bias is not None,
            dropout=m.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        new.load_state_dict(m.state_dict())
        return new.train(m.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` computing the same; refused for GQA (torch has
        none)."""
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"torch.nn.MultiheadAttention has no grouped key/value heads (this module has "
                f"num_kv_heads={self.num_kv_heads} for num_heads={self.num_heads}); it cannot "
                f"be converted"
            )
        ref = self.out_proj.weight
        m = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.in_proj_bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=batch_first,
            device=ref.device,
            dtype=ref.dtype,
        )
        m.load_state_dict(self.state_dict())
        return m.train(self.training)


def _check_config(embed_dim: int, num_heads: int, G: int, dropout: float) -> None:
    for name, n in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", G)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if embed_dim % num_heads:
        raise ValueError(
            f"embed_dim={embed_dim} is not a multiple of num_heads={num_heads}; each head takes "
            f"embed_dim / num_heads channels: try num_heads in "
            f"{[h for h in range(1, min(embed_dim, 64) + 1) if embed_dim % h == 0]}"
        )
    if num_heads % G:
        raise ValueError(
            f"got num_heads={num_heads} and num_kv_heads={G}; num_heads must be a multiple of "
            f"num_kv_heads"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


def _check_layout(layout: str) -> str:
    from ..distributed.layout import check_layout

    return check_layout(layout)


def _real_keys(key_mask: Tensor, T_r: int, self_attention: bool, ctx: ContextCall) -> masks.MaskMod:
    """``key_mask`` shards as a structured mask over the whole sequence: document ids 0 for
    every query and for real keys, 1 for padding, so a key shard of padding only is a block
    the ring skips (and never sends).

    Shape:
        key_mask ``(B, S_r)`` -> a mask over ``(B, H, T, S)`` of the whole sequence.
    """
    from ..distributed import unshard

    real = unshard(key_mask.to(torch.uint8), ctx.group, dim=-1, layout=ctx.layout) > 0  # (B, S)
    T = real.shape[-1] if self_attention else sum(shard_lengths(T_r, ctx.group, key_mask.device))
    q_ids = torch.zeros(1, T, dtype=torch.long, device=key_mask.device)  # (1, T)
    return masks.document(q_ids, (~real).long())  # kv ids (B, S)


def _check_decoding(
    query: Tensor, key: Tensor | None, value: Tensor | None, attn_mask: Tensor | None
) -> None:
    """A cache decodes self-attention: refuse separate keys/values and dense masks."""
    if (key is not None and key is not query) or (value is not None and value is not query):
        raise ValueError(
            "a cache decodes self-attention: pass only the new positions as "
            "query (key and value come from them and from the cache)"
        )
    if attn_mask is not None:
        raise ValueError(
            "attn_mask cannot be combined with a cache (its key length would "
            "change every step); use key_mask for padding of the new positions, "
            "or a mask_mod with bottom_right alignment"
        )


def _decoding_mask(mask_mod, T: int, S: int):
    """New positions see the cache and the new positions up to themselves (bottom-right causal)."""
    if T == 1:  # one new position sees everything stored: no mask at all
        return mask_mod
    causal = masks.causal(align="bottom_right")
    return causal if mask_mod is None else masks.and_masks(mask_mod, causal)
