"""Multi-scale deformable attention, slow twin: one ``F.grid_sample`` per level.

This is mmcv's ``multi_scale_deformable_attn_pytorch`` (and Deformable DETR's
``ms_deform_attn_core_pytorch``) written out plainly: each level's map is sampled bilinearly at
``grid = 2 * location - 1`` with ``align_corners=False`` and zeros outside the map, then the
``L * P`` samples of a query are summed with their weights. It materialises the samples,
``L * P`` times the output's size, which is why ``gather.py`` and ``native.py`` exist; they are
tested against it by name, and autograd through it gives the reference gradients.

It reads ``spatial_shapes`` on the host (the per-level slices need sizes). Under
``torch.export`` of a ``spatial_shapes`` that is a graph input those sizes are unbacked symbols;
the ``torch._check`` calls tell the tracer what it needs to slice and reshape with them, so the
same code exports, and it is what ``torch.onnx.export`` writes (one ``GridSample`` per level,
see ``deformable_attention``).

Shape alphabet: B batch, S flattened value length (sum of H_l * W_l), M heads, D head dim,
Lq queries, L levels, P points per level and head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["deformable_attention_naive"]


def deformable_attention_naive(
    value: Tensor, spatial_shapes: Tensor, sampling_locations: Tensor, attention_weights: Tensor
) -> Tensor:
    """The weighted bilinear samples, by ``grid_sample``::

        out[b, q, m] = sum_{l, p} a[b, q, m, l, p] * bilinear(value_l[b, :, m], loc[b, q, m, l, p])

    Differentiable by autograd in value, sampling_locations and attention_weights. Computes in
    the inputs' dtype (float64 inputs give the float64 reference).

    Shape:
        value ``(B, S, M, D)``; spatial_shapes ``(L, 2)`` as (H, W); sampling_locations
        ``(B, Lq, M, L, P, 2)`` as (x, y) in [0, 1]; attention_weights ``(B, Lq, M, L, P)``
        -> ``(B, Lq, M * D)``.
    """
    B, _, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grids = 2 * sampling_locations - 1  # (B, Lq, M, L, P, 2), grid_sample's [-1, 1]
    samples = []
    start = 0
    for lvl, (h, w) in enumerate(spatial_shapes.tolist()):
        torch._check(h >= 1)  # what an export needs to know of unbacked sizes (free in eager)
        torch._check(w >= 1)
        torch._check(start + h * w <= value.shape[1])
        v = value.narrow(1, start, h * w)  # (B, H*W, M, D)
        start = start + h * w
        v = v.flatten(2).transpose(1, 2)  # (B, M*D, H*W)
        v = v.reshape(B * M, D, h, w)  # (B*M, D, H, W), a strided view
        if v.dtype in (torch.float16, torch.bfloat16):
            v = v.contiguous()  # torch 2.13's CPU grid_sample crashes (SIGSEGV) on this strided
            # half-precision view at one thread at BEVFormer's 116 x 200 level; a copy does not
        grid = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)  # (B*M, Lq, P, 2)
        samples.append(
            F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        )  # (B*M, D, Lq, P)
    stacked = torch.stack(samples, dim=-2).flatten(-2)  # (B*M, D, Lq, L*P)
    weights = attention_weights.transpose(1, 2).reshape(B * M, 1, Lq, L * P)
    out = (stacked * weights).sum(-1).view(B, M * D, Lq)  # (B, M*D, Lq)
    return out.transpose(1, 2).contiguous()  # (B, Lq, M*D)
