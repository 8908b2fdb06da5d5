"""Validation of ``deformable_attention``'s inputs at the public boundary.

Two halves: :func:`check_inputs` reads only what a graph holds at trace time (ranks, sizes,
dtypes, devices), so it runs under ``torch.compile`` and ``torch.export`` too; :func:`check_levels`
reads the values of ``spatial_shapes`` and ``level_start_index`` (do the levels cover ``S``
exactly?), so it runs inside the custom op, on the real tensors, in eager and compiled calls
alike (on the CPU, where those two small tensors normally live, that read is free).

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "FLOAT_DTYPES",
    "KERNELS",
    "as_spatial_shapes",
    "check_inputs",
    "check_levels",
    "level_starts",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNELS = ("auto", "cpp", "torch", "triton")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def as_spatial_shapes(spatial_shapes: Tensor | Sequence[Sequence[int]]) -> Tensor:
    """A tensor as given, or a list of (H, W) pairs as an int64 CPU tensor."""
    if isinstance(spatial_shapes, Tensor):
        return spatial_shapes
    if isinstance(spatial_shapes, Sequence) and not isinstance(spatial_shapes, str):
        return torch.as_tensor([tuple(pair) for pair in spatial_shapes], dtype=torch.int64).view(
            -1, 2
        )
    raise TypeError(
        f"spatial_shapes must be an int64 tensor (L, 2) of (H, W) per level, or a list of "
        f"(H, W) pairs; got {type(spatial_shapes).__name__}"
    )


def _check_index(name: str, t: Tensor, shape: tuple[int, ...], what: str, value: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must hold integers (int64, as mmcv's), got {t.dtype}")
    if _shape(t) != shape:
        raise ValueError(f"{name} must be {what}, shape {shape}; got shape {_shape(t)}")
    if t.device.type != "cpu" and t.device != value.device:
        raise ValueError(
            f"{name} is on {t.device} but value is on {value.device}; keep it on the CPU or on "
            f"value's device"
        )


def check_inputs(
    value: Tensor,
    spatial_shapes: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    level_start_index: Tensor | None,
) -> None:
    """Raise TypeError/ValueError, naming the numbers and the fix, unless the inputs are
    mmcv's layouts: value ``(B, S, M, D)``, spatial_shapes ``(L, 2)``, sampling_locations
    ``(B, Lq, M, L, P, 2)``, attention_weights ``(B, Lq, M, L, P)``, level_start_index
    ``(L,)``; one floating dtype and one device for the three float tensors."""
    named = {
        "value": value,
        "sampling_locations": sampling_locations,
        "attention_weights": attention_weights,
    }
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"value is {value.dtype}; deformable_attention takes float16, bfloat16, float32 or "
            f"float64"
        )
    for name in ("sampling_locations", "attention_weights"):
        t = named[name]
        if t.dtype != value.dtype:
            raise TypeError(
                f"{name} is {t.dtype} but value is {value.dtype}; give all three one dtype "
                f"(e.g. {name}.to(value.dtype))"
            )
        if t.device != value.device:
            raise ValueError(
                f"{name} is on {t.device} but value is on {value.device}; move it to {value.device}"
            )
    if value.dim() != 4:
        raise ValueError(f"value must be (B, S, M, D), 4 dims; got shape {_shape(value)}")
    loc = sampling_locations
    if loc.dim() != 6 or loc.shape[-1] != 2:
        raise ValueError(
            f"sampling_locations must be (B, Lq, M, L, P, 2), (x, y) last; got shape {_shape(loc)}"
        )
    B, M = value.shape[0], value.shape[2]
    if loc.shape[0] != B or loc.shape[2] != M:
        raise ValueError(
            f"sampling_locations (B, Lq, M, L, P, 2) has B={loc.shape[0]}, M={loc.shape[2]} but "
            f"value (B, S, M, D) has B={B}, M={M}; they must match"
        )
    if _shape(attention_weights) != _shape(loc)[:-1]:
        raise ValueError(
            f"attention_weights must be (B, Lq, M, L, P) = {_shape(loc)[:-1]} (sampling_locations "
            f"without its last dim); got shape {_shape(attention_weights)}"
        )
    L = loc.shape[3]
    _check_index("spatial_shapes", spatial_shapes, (L, 2), "(L, 2) as (H, W) per level", value)
    if level_start_index is not None:
        _check_index("level_start_index", level_start_index, (L,), "(L,)", value)


def level_starts(spatial_shapes: Tensor) -> Tensor:
    """The first row of each level in the flattened value: ``0, H0*W0, H0*W0 + H1*W1, ...``
    (tensor ops only: no host read)."""
    sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]  # (L,)
    return torch.cumsum(sizes, 0) - sizes  # (L,)


def check_levels(spatial_shapes: Tensor, level_start_index: Tensor, S: int) -> None:
    """Raise ValueError unless every level is at least 1x1, the levels' H*W sum to ``S`` and
    ``level_start_index`` is their running sum. Reads both tensors' values."""
    shapes = spatial_shapes.tolist()
    if any(h < 1 or w < 1 for h, w in shapes):
        raise ValueError(f"spatial_shapes must hold (H, W) >= 1 per level; got {shapes}")
    total = sum(h * w for h, w in shapes)
    if total != S:
        raise ValueError(
            f"spatial_shapes {shapes} cover sum(H*W) = {total} rows, but value has S = {S}; "
            f"value must be the levels flattened one after the other"
        )
    starts = level_start_index.tolist()
    expected = level_starts(spatial_shapes.to(torch.int64)).tolist()
    if starts != expected:
        raise ValueError(
            f"level_start_index {starts} disagrees with spatial_shapes {shapes}, whose levels "
            f"start at {expected}; pass level_start_index=None to have it computed"
        )
