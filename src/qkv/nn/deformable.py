"""Multi-scale deformable attention as a module, laid out as mmcv's.

:class:`MultiScaleDeformableAttention` takes mmcv's constructor arguments, holds mmcv's four
projections under mmcv's names (``sampling_offsets``, ``attention_weights``, ``value_proj``,
``output_proj``), initialises them as mmcv does, and computes mmcv's forward: a Deformable
DETR, DINO or BEVFormer state dict laid out by mmcv loads unchanged, and gives the same
outputs. The sampling itself is :func:`qkv.deformable_attention` (the C++ kernel on CPU).

Shape alphabet: B batch, Lq queries, S flattened value length (sum of H_l * W_l), C model dim
(mmcv's embed_dims), M heads, D head dim, L levels, P points.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch import Tensor, nn

from .. import recording
from ..functional import deformable_attention
from ..ops.deformable.inputs import as_spatial_shapes, levels_on, widths_heights
from ..trace import DeformableTrace

__all__ = ["MultiScaleDeformableAttention"]


class MultiScaleDeformableAttention(nn.Module):
    """mmcv's ``MultiScaleDeformableAttention`` (Deformable DETR), on qkv's kernel.

    Each query, moved by ``query_pos``, predicts per head, level and point an offset from its
    reference point and a weight (softmaxed over levels x points); the projected value is
    sampled there (:func:`qkv.deformable_attention`), the heads are concatenated and projected,
    dropout is applied and ``identity`` (the query before ``query_pos``, by default) is added.

    * 2-d ``reference_points`` ``(x, y)``: locations are ``reference + offset / (W, H)`` of each
      level (offsets in pixels). 4-d reference boxes ``(x, y, w, h)``: locations are
      ``(x, y) + offset / P * (w, h) / 2``.
    * Padding: ``key_padding_mask`` is mmcv's, **True marks padding** (its values are zeroed
      after ``value_proj``; the weights are not renormalised). qkv's own ``key_mask`` (True
      marks a real value) is taken too; give one or the other.
    * See-through: ``return_trace=True`` also returns a :class:`qkv.DeformableTrace`: every
      sampling point in pixels of its level, its weight, and the query's reference point
      (a box's centre) in pixels; ``qkv.capture`` records the same from a model.
    * mmcv's ``im2col_step``, ``norm_cfg`` and ``init_cfg`` are accepted and unused (the kernel
      needs no batch step; mmcv uses neither in this module), and extra keyword arguments of
      ``forward`` (``key_pos``, ``attn_mask``, ... that mmcv's transformer layers pass to every
      attention) are ignored, as mmcv ignores them.

    Args:
        embed_dims: Model dim C of queries and values.
        num_heads: Heads M; ``int(embed_dims * value_proj_ratio)`` must divide by it.
        num_levels: Levels L of the value.
        num_points: Points P per head and level.
        im2col_step: mmcv's CUDA batch step (unused).
        dropout: Dropout on the output, before ``identity`` is added.
        batch_first: Queries and values as ``(B, Lq, C)``; mmcv's default False takes
            ``(Lq, B, C)``.
        norm_cfg, init_cfg: mmcv's (unused).
        value_proj_ratio: ``value_proj`` maps C to ``int(C * value_proj_ratio)``.
        device, dtype: Of the parameters.

    Shape:
        query ``(B, Lq, C)`` (``(Lq, B, C)`` unless batch_first); value ``(B, S, C)`` likewise
        (the query when None); reference_points ``(B, Lq, L, 2)`` or ``(B, Lq, L, 4)``;
        spatial_shapes ``(L, 2)`` as (H, W); key_padding_mask / key_mask ``(B, S)`` -> the
        query's shape (and, with return_trace, the trace: locations ``(B, Lq, M, L, P, 2)``).
    """

    def __init__(
        self,
        embed_dims: int = 256,
        num_heads: int = 8,
        num_levels: int = 4,
        num_points: int = 4,
        im2col_step: int = 64,
        dropout: float = 0.1,
        batch_first: bool = False,
        norm_cfg: dict | None = None,
        init_cfg: dict | None = None,
        value_proj_ratio: float = 1.0,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        value_dims = int(embed_dims * value_proj_ratio)
        if embed_dims % num_heads != 0 or value_dims % num_heads != 0:
            raise ValueError(
                f"embed_dims={embed_dims} (value_proj to {value_dims}) must be divisible by "
                f"num_heads={num_heads}"
            )
        if (value_dims // num_heads) & (value_dims // num_heads - 1):
            warnings.warn(  # mmcv's warning; qkv's CPU kernel takes any head dim at one speed
                f"MultiScaleDeformableAttention: head dim {value_dims // num_heads} is not a "
                f"power of 2 (mmcv's CUDA kernel is faster with one)",
                stacklevel=2,
            )
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.im2col_step, self.batch_first = im2col_step, batch_first
        self.norm_cfg, self.init_cfg = norm_cfg, init_cfg
        self.dropout = nn.Dropout(dropout)
        kw = dict(device=device, dtype=dtype)
        self.sampling_offsets = _SamplingOffsets(
            embed_dims, num_heads, num_levels, num_points, **kw
        )
        self.attention_weights = _Zeroed(embed_dims, num_heads * num_levels * num_points, **kw)
        self.value_proj = _Xavier(embed_dims, value_dims, **kw)
        self.output_proj = _Xavier(value_dims, embed_dims, **kw)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """mmcv's initialisation: no offset weights, and offset biases that put head m's
        points on a ray at angle ``2 pi m / M`` (scaled so its larger coordinate is 1), point
        p at ``p + 1`` times it, on every level; zero weights (uniform after the softmax);
        Xavier-uniform projections with zero biases.

        Each projection is a ``nn.Linear`` whose own ``reset_parameters`` is its part of this,
        so torch's ways of initialising a module built on the meta device
        (``to_empty`` then ``reset_parameters`` of each module, in any order, as FSDP
        does) give mmcv's initialisation too, not ``nn.Linear``'s."""
        for proj in (
            self.sampling_offsets,
            self.attention_weights,
            self.value_proj,
            self.output_proj,
        ):
            proj.reset_parameters()  # (in mmcv's order: its random draws in the same order)

    reset_parameters = init_weights

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        identity: Tensor | None = None,
        query_pos: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        reference_points: Tensor | None = None,
        spatial_shapes: Tensor | None = None,
        level_start_index: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        return_trace: bool = False,
        **kwargs,
    ) -> Tensor | tuple[Tensor, DeformableTrace]:
        """mmcv's forward (``key`` is unused, as in mmcv). See the class for the shapes."""
        record = recording.wanted()  # None unless a qkv.capture wants this call's points
        if reference_points is None or spatial_shapes is None:
            raise ValueError(
                "MultiScaleDeformableAttention needs reference_points (B, Lq, L, 2 or 4) and "
                "spatial_shapes (L, 2)"
            )
        value = query if value is None else value
        identity = query if identity is None else identity
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.transpose(0, 1), value.transpose(0, 1)  # (B, Lq, C), (B, S, C)
        B, Lq, _ = query.shape
        S = value.shape[1]
        shapes = as_spatial_shapes(spatial_shapes)
        value = self.value_proj(value)  # (B, S, M*D)
        padding = _padding(key_padding_mask, key_mask, B, S)
        if padding is not None:
            value = value.masked_fill(padding[..., None], 0.0)
        value = value.view(B, S, self.num_heads, -1)  # (B, S, M, D)
        M, L, P = self.num_heads, self.num_levels, self.num_points
        offsets = self.sampling_offsets(query).view(B, Lq, M, L, P, 2)
        weights = self.attention_weights(query).view(B, Lq, M, L * P).softmax(-1)
        weights = weights.view(B, Lq, M, L, P)
        loc = self._locations(reference_points, offsets, shapes)  # (B, Lq, M, L, P, 2)
        # A recorded call is recorded here, with its reference points, not again inside
        paused = contextlib.nullcontext() if record is None else recording.paused()
        with paused:
            out = deformable_attention(
                value, shapes, loc, weights, level_start_index=level_start_index
            )  # (B, Lq, M*D)
        out = self.output_proj(out)  # (B, Lq, C)
        if not self.batch_first:
            out = out.transpose(0, 1)  # (Lq, B, C)
        out = self.dropout(out) + identity
        if record is None and not return_trace:
            return out
        host_shapes = levels_on(shapes, torch.device("cpu"))  # (a device's: read once)
        trace = DeformableTrace.from_normalized(host_shapes, loc, weights, reference_points)
        if record is not None:
            record(trace)
        return (out, trace) if return_trace else out

    def _locations(self, reference_points: Tensor, offsets: Tensor, shapes: Tensor) -> Tensor:
        """Sampling locations ``(B, Lq, M, L, P, 2)`` from reference points ``(B, Lq, L, 2)``
        or boxes ``(B, Lq, L, 4)`` and offsets ``(B, Lq, M, L, P, 2)``."""
        last = reference_points.shape[-1]
        if reference_points.dim() != 4 or last not in (2, 4):
            raise ValueError(
                f"reference_points must be (B, Lq, L, 2) points or (B, Lq, L, 4) boxes; got "
                f"shape {tuple(reference_points.shape)}"
            )
        ref = reference_points[:, :, None, :, None, :]  # (B, Lq, 1, L, 1, 2 or 4)
        if last == 2:
            wh = widths_heights(shapes, offsets)  # (L, 2) as (W, H)
            return ref + offsets / wh[None, None, None, :, None, :]
        return ref[..., :2] + offsets / self.num_points * ref[..., 2:] * 0.5


class _MmcvLinear(nn.Linear):
    """A projection whose ``reset_parameters`` is its part of mmcv's initialisation
    (``_initialise``). While it is built, ``nn.Linear``'s own runs instead, drawing from the
    random stream as mmcv's modules do at construction: ``init_weights`` then draws what
    mmcv's draws, so a seed gives mmcv's numbers."""

    def __init__(self, in_features: int, out_features: int, **kw) -> None:
        self.built = False  # (read by reset_parameters, which nn.Linear's __init__ calls)
        super().__init__(in_features, out_features, **kw)
        self.built = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if not self.built:
            return super().reset_parameters()
        self._initialise()

    def _initialise(self) -> None:
        raise NotImplementedError

    def _get_name(self) -> str:
        return "Linear"  # (printed as mmcv's module prints: an nn.Linear)


class _SamplingOffsets(_MmcvLinear):
    """``sampling_offsets`` (C -> M * L * P * 2): no weights, and the biases of head m's points
    on a ray at angle ``2 pi m / M`` (see ``init_weights``)."""

    def __init__(self, embed_dims: int, heads: int, levels: int, points: int, **kw) -> None:
        self.rays = (heads, levels, points)
        super().__init__(embed_dims, heads * levels * points * 2, **kw)

    def _initialise(self) -> None:
        M, L, P = self.rays
        nn.init.zeros_(self.weight)
        b = self.bias  # (M * L * P * 2,)
        thetas = torch.arange(M, dtype=torch.float32, device=b.device) * (2.0 * math.pi / M)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)  # (M, 2)
        grid = grid / grid.abs().max(-1, keepdim=True)[0]
        grid = grid.view(M, 1, 1, 2).repeat(1, L, P, 1)  # (M, L, P, 2)
        grid = grid * torch.arange(1, P + 1, dtype=torch.float32, device=b.device).view(1, 1, P, 1)
        b.copy_(grid.view(-1))


class _Zeroed(_MmcvLinear):
    """``attention_weights``: zero weights and biases (uniform after the softmax)."""

    def _initialise(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)


class _Xavier(_MmcvLinear):
    """``value_proj`` and ``output_proj``: Xavier-uniform weights, zero biases."""

    def _initialise(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        nn.init.zeros_(self.bias)


def _padding(key_padding_mask: Tensor | None, key_mask: Tensor | None, B: int, S: int):
    """The rows to zero, ``(B, S)`` bool (True = padding), from mmcv's or qkv's mask."""
    if key_padding_mask is not None and key_mask is not None:
        raise ValueError(
            "give key_padding_mask (mmcv's: True marks padding) or key_mask (qkv's: True "
            "marks a real value), not both"
        )
    mask, name = (
        (key_padding_mask, "key_padding_mask") if key_mask is None else (key_mask, "key_mask")
    )
    if mask is None:
        return None
    if mask.dtype == torch.uint8 and key_mask is None:
        mask = mask.bool()  # mmcv documents a ByteTensor
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, S):
        raise ValueError(
            f"{name} must be a bool tensor (B, S) = ({B}, {S}); got {mask.dtype} of shape "
            f"{tuple(mask.shape)}"
        )
    return mask if key_mask is None else ~mask
