"""transformers' ``MultiScaleDeformableAttention`` on qkv's kernel: :func:`route`, :func:`unroute`.

Deformable DETR, Grounding DINO, RT-DETR, LW-DETR, RF-DETR, OmDet-Turbo, PP-DocLayout and the
models after them each keep a copy of one class, ``MultiScaleDeformableAttention``, whose
forward samples every level with ``grid_sample`` (the path Deformable DETR's authors call
"for debug and test only"; a Hub CUDA kernel replaces it only where the ``kernels`` package is
installed and the model is kernelized). The class is not reached through the
``AttentionInterface``, so ``attn_implementation`` cannot change it. :func:`route` replaces its
forward, in every modeling module imported now and (through ``tables.watch_imports``) later,
with one call of :func:`qkv.deformable_attention`: the same meaning (mmcv's, which those
forwards compute), the same shapes, the C++ kernel on CPU. :func:`unroute` gives every class
its own forward back.

Only a class whose forward takes exactly transformers' arguments is replaced; a model that
changes them keeps its own.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

from torch import Tensor, nn

from ...functional import deformable_attention
from ...ops.deformable.inputs import as_spatial_shapes
from .tables import modeling_modules, unwatch_imports, watch_imports, watching

__all__ = ["CLASS_NAME", "ORIGINAL_FORWARDS", "forward", "route", "routed", "unroute"]

CLASS_NAME = "MultiScaleDeformableAttention"
_PARAMETERS = (
    "self",
    "value",
    "value_spatial_shapes",
    "value_spatial_shapes_list",
    "level_start_index",
    "sampling_locations",
    "attention_weights",
    "im2col_step",
)
# every class whose forward is qkv's, with the forward it had (restored by unroute)
ORIGINAL_FORWARDS: dict[type[nn.Module], Callable] = {}


def forward(
    self: nn.Module,
    value: Tensor,
    value_spatial_shapes: Tensor,
    value_spatial_shapes_list: list[tuple[int, int]] | None,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    im2col_step: int,
) -> Tensor:
    """transformers' ``MultiScaleDeformableAttention.forward``, computed by qkv.

    The level sizes come from ``value_spatial_shapes_list`` (Python ints, as transformers' own
    forward takes them: no read of a device tensor) and ``level_start_index`` is left to follow
    from them, as the ``grid_sample`` forward does; ``im2col_step`` is the CUDA kernel's batch
    step, which qkv's kernels do not need.

    Shape:
        value ``(B, S, M, D)``; value_spatial_shapes ``(L, 2)``; sampling_locations
        ``(B, Lq, M, L, P, 2)``; attention_weights ``(B, Lq, M, L, P)`` -> ``(B, Lq, M * D)``.
    """
    shapes = value_spatial_shapes
    if value_spatial_shapes_list is not None:
        shapes = as_spatial_shapes(value_spatial_shapes_list)  # a CPU tensor: no device read
    out = deformable_attention(value, shapes, sampling_locations, attention_weights)
    assert isinstance(out, Tensor)  # no trace asked: the output alone
    return out


def route() -> None:
    """Replace the forward of transformers' ``MultiScaleDeformableAttention`` classes in the
    modeling modules loaded now; ``patch_module`` does it for those imported later."""
    watch_imports(patch_module)
    for module in modeling_modules():
        patch_module(module)


def unroute() -> None:
    """Give every class :func:`route` changed its own forward back."""
    unwatch_imports(patch_module)
    for cls, original in list(ORIGINAL_FORWARDS.items()):
        cls.forward = original
        del ORIGINAL_FORWARDS[cls]


def routed() -> bool:
    """Whether :func:`route` is in force."""
    return watching(patch_module)


def patch_module(module: ModuleType) -> None:
    """qkv's forward on the module's ``MultiScaleDeformableAttention``, while routed."""
    cls = vars(module).get(CLASS_NAME)
    if not routed() or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        return
    own = vars(cls).get("forward")
    if cls in ORIGINAL_FORWARDS or own is None:
        return
    if tuple(inspect.signature(own).parameters) != _PARAMETERS:
        return  # a model that changed the arguments keeps its own forward
    ORIGINAL_FORWARDS[cls] = own
    cls.forward = forward
