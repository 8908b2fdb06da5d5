"""Validation of ``deformable_attention``'s inputs at the public boundary.

Two halves: :func:`check_inputs` reads only what a graph holds at trace time (ranks, sizes,
dtypes, devices), so it runs under ``torch.compile`` and ``torch.export`` too; :func:`check_levels`
reads the values of ``spatial_shapes`` and ``level_start_index`` (do the levels cover ``S``
exactly?), so it runs inside the custom op, on the real tensors, in eager and compiled calls
alike. On the CPU, where those two small tensors normally live, that read is free; on CUDA it
is a device sync, and so is copying a CPU tensor to the device for the kernel. Both are done
once per tensor (:func:`check_levels_once`, :func:`levels_on`: remembered by the tensor's
identity and version, ``qkv._identity``), and a list of (H, W) pairs is one tensor per value
(:func:`as_spatial_shapes`): a model that passes the same shapes to every layer and every
step reads nothing on the host after its first call.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..._identity import IdentityCache
from ..._lru import LRU

__all__ = [
    "FLOAT_DTYPES",
    "KERNELS",
    "as_spatial_shapes",
    "check_inputs",
    "check_levels",
    "check_levels_once",
    "level_starts",
    "level_starts_of",
    "levels_on",
    "widths_heights",
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
        pairs = tuple(tuple(pair) for pair in spatial_shapes)
        if torch.compiler.is_compiling() or not all(  # (floats, 0-d tensors)
            type(x) is int for pair in pairs for x in pair
        ):
            return torch.as_tensor(pairs, dtype=torch.int64).view(-1, 2)
        return _pairs.get(pairs, lambda: _pairs_tensor(pairs), valid=_unchanged)[0]
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


# the same pairs, one tensor: what is remembered of it below is found again by the next call
_pairs = LRU(16)


def _pairs_tensor(pairs: tuple) -> tuple[Tensor, int]:
    """The int64 CPU tensor ``(L, 2)`` of ``pairs`` and its version: a normal tensor even
    inside ``torch.inference_mode`` (:func:`_normal`)."""
    t = _normal(lambda: torch.as_tensor(pairs, dtype=torch.int64).view(-1, 2))()
    return t, t._version


def _unchanged(entry: tuple[Tensor, int]) -> bool:
    """Whether the tensor remembered for some pairs still holds them (nobody wrote into it,
    through a trace that holds it, say)."""
    return entry[0]._version == entry[1]


def _normal(make: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """``make`` run outside ``torch.inference_mode``: a tensor remembered while it was on
    must serve later calls with gradients (an inference tensor cannot be saved for backward)
    and be remembered itself by identity (an inference tensor cannot)."""

    def made() -> Tensor:
        with torch.inference_mode(False):
            return make()

    return made


_starts = IdentityCache(16)
_checked = IdentityCache(16)
_copies = IdentityCache(16)


def level_starts_of(spatial_shapes: Tensor) -> Tensor:
    """:func:`level_starts`, one tensor per ``spatial_shapes`` (unchanged since): the next
    call's check of it then finds it remembered."""
    if torch.compiler.is_compiling():  # (a graph holds the ops; nothing is remembered)
        return level_starts(spatial_shapes)
    return _starts.get((spatial_shapes,), None, _normal(lambda: level_starts(spatial_shapes)))


def check_levels_once(spatial_shapes: Tensor, level_start_index: Tensor, S: int) -> None:
    """:func:`check_levels`, read once per pair of tensors (unchanged since) and ``S``: a
    call with the tensors of an earlier call that passed reads nothing on the host."""

    def check() -> bool:
        check_levels(spatial_shapes, level_start_index, S)
        return True  # (a failed check raises, and nothing is remembered)

    _checked.get((spatial_shapes, level_start_index), S, check)


def levels_on(t: Tensor, device: torch.device) -> Tensor:
    """``t`` as a contiguous int64 tensor on ``device``: a copy from another device made once
    per tensor (unchanged since), as a copy from the host's pageable memory waits for the
    device."""
    if (t.device == device and t.dtype == torch.int64) or torch.compiler.is_compiling():
        return t.to(device, torch.int64).contiguous()
    return _copies.get((t,), device, _normal(lambda: t.to(device, torch.int64).contiguous()))


_sizes = IdentityCache(16)


def widths_heights(spatial_shapes: Tensor, like: Tensor) -> Tensor:
    """Each level's ``(W, H)`` ``(L, 2)`` in ``like``'s dtype and device (what normalised
    locations are divided by), made once per tensor (unchanged since) and kind of ``like``."""

    def make() -> Tensor:
        return torch.stack([spatial_shapes[:, 1], spatial_shapes[:, 0]], -1).to(like)

    if torch.compiler.is_compiling():
        return make()
    return _sizes.get((spatial_shapes,), (like.dtype, like.device), _normal(make))


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
