"""Multi-scale deformable attention (Deformable DETR, BEVFormer) with mmcv's meaning.

* ``naive.py``: the slow twin, one ``F.grid_sample`` per level (mmcv's PyTorch fallback);
* ``gather.py``: plain PyTorch ops, forward and backward written out, nothing of ``L * P`` times
  the output materialised; any device;
* ``native.py`` + ``kernel.cpp``: the CPU kernel, C++ built at first use;
* ``triton_launch.py`` + ``triton_kernels.py``: the CUDA kernels, Triton, with a deterministic
  backward (tested on CPU under triton's interpreter);
* ``op.py``: all three behind the custom op ``qkv::deformable_attention``;
* ``torch.onnx.export`` writes the slow twin instead (ONNX has no such op; ``GridSample`` is
  standard since opset 16);
* ``inputs.py``: validation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from .gather import deformable_forward_gather
from .inputs import KERNELS, as_spatial_shapes, check_inputs, check_levels, level_starts_of
from .naive import deformable_attention_naive
from .op import ENV, kernel_from_env, pick_kernel

__all__ = [
    "ENV",
    "deformable_attention",
    "deformable_attention_naive",
    "kernel_from_env",
    "pick_kernel",
]


def deformable_attention(
    value: Tensor,
    spatial_shapes: Tensor | Sequence[Sequence[int]],
    sampling_locations: Tensor,
    attention_weights: Tensor,
    *,
    level_start_index: Tensor | None = None,
    kernel: str | None = None,
) -> Tensor:
    """:func:`qkv.deformable_attention`, with the kernel named (``auto``, ``cpp``, ``torch``,
    ``triton``; None reads ``QKV_DEFORMABLE_KERNEL``).

    Shape:
        value ``(B, S, M, D)``; spatial_shapes ``(L, 2)``; sampling_locations
        ``(B, Lq, M, L, P, 2)``; attention_weights ``(B, Lq, M, L, P)``; level_start_index
        ``(L,)`` -> ``(B, Lq, M * D)``.
    """
    spatial_shapes = as_spatial_shapes(spatial_shapes)
    check_inputs(value, spatial_shapes, sampling_locations, attention_weights, level_start_index)
    if kernel is None:
        kernel = kernel_from_env()
    elif kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; use one of {', '.join(map(repr, KERNELS))}")
    if torch.onnx.is_in_onnx_export():
        # ONNX has no deformable op: the model gets the slow twin's standard ops, one GridSample
        # (opset 16) per level, with the level sizes read from spatial_shapes at run time where
        # it is a graph input (level_start_index is implied by them, and not read)
        return deformable_attention_naive(
            value, spatial_shapes, sampling_locations, attention_weights
        )
    if level_start_index is None:
        level_start_index = level_starts_of(spatial_shapes)
    if torch._C._are_functorch_transforms_active():
        return _transformed(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights
        )
    return torch.ops.qkv.deformable_attention(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, kernel
    )


def _transformed(value, shapes, starts, loc, attn) -> Tensor:
    """Under a ``torch.func`` transform (vmap, grad, jacrev: they take no custom op here): the
    gather path's forward as differentiable torch ops, its gradients by autograd. The level
    tensors are checked where they are plain tensors (not vmapped over)."""
    plain = not any(is_functorch_wrapped_tensor(t) for t in (shapes, starts))
    if plain and not torch.compiler.is_compiling():
        check_levels(shapes, starts, value.shape[1])
    shapes, starts = shapes.to(value.device, torch.int64), starts.to(value.device, torch.int64)
    return deformable_forward_gather(value, shapes, starts, loc, attn, inplace=False)
