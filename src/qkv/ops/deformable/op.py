"""``qkv::deformable_attention``: the kernels behind one ``torch.library`` custom op.

The op and its backward op have fake (meta) implementations and a registered autograd rule,
so ``torch.compile(fullgraph=True)`` keeps the call as one node (the kernel's memory, not the
``grid_sample`` decomposition's) and ``torch.export`` holds it as ``qkv.deformable_attention``.
Under ``torch.func`` transforms (vmap, grad, jacrev), which take no custom op here, the call
runs the gather path's forward as plain differentiable torch ops instead (see
``deformable_attention``).

Which kernel runs is decided inside the op, at run time, from a constant string:

* ``"cpp"``: ``native.py``'s C++ loop (CPU tensors; built at first use);
* ``"triton"``: ``triton_launch.py``'s fused kernels (CUDA tensors where triton imports; CPU
  tensors only inside ``qkv.ops.triton.interpreter()``, for tests);
* ``"torch"``: ``gather.py``'s plain PyTorch ops (any device);
* ``"auto"``: ``"cpp"`` for CPU tensors where it builds, ``"triton"`` for CUDA tensors where
  triton imports, else ``"torch"``. Neither is timed against ``"torch"``: each does the same
  gathers with no per-corner tensor and no launch per (level, point, corner), where the torch
  path launches ``4 * L * P`` gathers and adds each into the output, so the fused kernel is
  the faster one (``benchmarks/bench_deformable.py`` records by how much on the CPU,
  ``benchmarks/gpu_deformable.py`` on a GPU).

``QKV_DEFORMABLE_KERNEL`` forces one for every call (tests, benchmarks); ``"cpp"`` or
``"triton"`` forced where it cannot run raises with the reason instead of falling back.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import native, triton_launch
from .gather import deformable_backward_gather, deformable_forward_gather
from .inputs import KERNELS, check_levels_once, levels_on

__all__ = ["ENV", "kernel_from_env", "pick_kernel"]

ENV = "QKV_DEFORMABLE_KERNEL"


def kernel_from_env() -> str:
    """``QKV_DEFORMABLE_KERNEL`` (``auto``, ``cpp``, ``torch`` or ``triton``; ``auto`` when
    unset)."""
    kernel = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"{ENV}={kernel!r}; use one of {', '.join(KERNELS)}")
    return kernel


def pick_kernel(kernel: str, device: torch.device) -> str:
    """The kernel that runs: ``cpp``, ``triton`` or ``torch``."""
    if kernel == "torch":
        return "torch"
    if kernel == "triton" or (kernel == "auto" and device.type == "cuda"):
        why = triton_launch.unavailable_reason(device)
        if not why:
            return "triton"
        if kernel == "triton":
            raise RuntimeError(f"{ENV}=triton (the Triton kernels) cannot run: {why}")
        return "torch"  # auto on CUDA without triton
    if device.type == "cpu" and native.library() is not None:
        return "cpp"
    if kernel == "cpp":
        why = (
            f"value is on {device}, and the C++ kernel runs on the CPU"
            if device.type != "cpu"
            else native.unavailable_reason()
        )
        raise RuntimeError(f"{ENV}=cpp (the C++ kernel) cannot run: {why}")
    return "torch"


def _prepared(value, shapes, starts, loc, attn, kernel):
    """Contiguous tensors, and the level tensors as int64 where the kernel reads them."""
    where = torch.device("cpu") if kernel == "cpp" else value.device
    shapes, starts = levels_on(shapes, where), levels_on(starts, where)
    return value.contiguous(), shapes, starts, loc.contiguous(), attn.contiguous()


@torch.library.custom_op("qkv::deformable_attention", mutates_args=())
def _deformable_attention(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    kernel: str,
) -> Tensor:
    """Output ``(B, Lq, M * D)`` in value's dtype."""
    check_levels_once(spatial_shapes, level_start_index, value.shape[1])
    B, _, M, D = value.shape
    Lq = sampling_locations.shape[1]
    if value.numel() == 0 or attention_weights.numel() == 0:
        return value.new_zeros(B, Lq, M * D)  # no query, no head, or no sample
    kernel = pick_kernel(kernel, value.device)
    args = _prepared(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, kernel
    )
    if kernel == "cpp":
        lib = native.library()
        assert lib is not None  # pick_kernel said cpp
        return native.forward_cpp(lib, *args)
    if kernel == "triton":
        return triton_launch.forward_triton(*args)
    return deformable_forward_gather(*args)


@_deformable_attention.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, kernel):
    B, _, M, D = value.shape
    return value.new_empty(B, sampling_locations.shape[1], M * D)


@torch.library.custom_op("qkv::deformable_attention_backward", mutates_args=())
def _deformable_attention_backward(
    grad_out: Tensor,
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for value, sampling_locations and attention_weights; deterministic from the
    cpp and triton kernels (the same bits on every run: no atomics, a fixed order of
    accumulation), and from torch on the CPU (CUDA's ``index_add_`` adds in any order)."""
    if value.numel() == 0 or attention_weights.numel() == 0:
        return (
            torch.zeros_like(value),
            torch.zeros_like(sampling_locations),
            torch.zeros_like(attention_weights),
        )
    kernel = pick_kernel(kernel, value.device)
    args = _prepared(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, kernel
    )
    grad_out = grad_out.to(value.dtype).contiguous()
    if kernel == "cpp":
        lib = native.library()
        assert lib is not None
        return native.backward_cpp(lib, grad_out, *args)
    if kernel == "triton":
        return triton_launch.backward_triton(grad_out, *args)
    return deformable_backward_gather(grad_out, *args)


@_deformable_attention_backward.register_fake
def _(grad_out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, k):
    return (
        torch.empty_like(value),
        torch.empty_like(sampling_locations),
        torch.empty_like(attention_weights),
    )


def _setup_context(ctx, inputs, output):
    value, shapes, starts, loc, attn, kernel = inputs
    ctx.kernel = kernel
    ctx.save_for_backward(value, shapes, starts, loc, attn)


def _backward_rule(ctx, grad_out):
    value, shapes, starts, loc, attn = ctx.saved_tensors
    grad_value, grad_loc, grad_attn = torch.ops.qkv.deformable_attention_backward(
        grad_out, value, shapes, starts, loc, attn, ctx.kernel
    )
    need = ctx.needs_input_grad
    return (
        grad_value if need[0] else None,
        None,
        None,
        grad_loc if need[3] else None,
        grad_attn if need[4] else None,
        None,
    )


_deformable_attention.register_autograd(_backward_rule, setup_context=_setup_context)
