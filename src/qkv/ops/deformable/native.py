"""The C++ kernel of multi-scale deformable attention (``kernel.cpp``), built at first use.

It is built by ``ops/_native_build.py`` (``torch.utils.cpp_extension.load``, cached, flags
and build name following torch's CPU capability) and called through ``ctypes`` on the tensors'
data pointers: the source includes only ``ATen/Parallel.h`` and c10's half types, so the
first build takes seconds.

When it cannot be built (no C++ compiler, no ninja, a failed build), :func:`library` returns
None with the reason, and ``deformable_attention`` runs the pure-PyTorch path (``gather.py``),
which gives the same results to the tolerance policy, only slower; a warning says so once.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .._memory import empty_large
from .._native_build import build

__all__ = ["backward_cpp", "forward_cpp", "library", "unavailable_reason"]

SOURCE = Path(__file__).with_name("kernel.cpp")
_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build(SOURCE, "qkv_deformable")
    if lib is None:
        return None, why
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in _NAMES.values():
        getattr(lib, f"qkv_deformable_forward_{name}").argtypes = [ptr] * 6 + [i64] * 7
        getattr(lib, f"qkv_deformable_backward_{name}").argtypes = [ptr] * 9 + [i64] * 7
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (then :func:`unavailable_reason` says why; a warning
    says it once per process)."""
    lib, why = _build()
    if lib is None:
        _warn_once(why)
    return lib


def unavailable_reason() -> str:
    """Why the C++ kernel cannot be used here ("" when it can); builds it if not yet tried."""
    return _build()[1]


@functools.cache
def _warn_once(why: str) -> None:
    warnings.warn(
        f"qkv.deformable_attention runs its pure-PyTorch path (same results, slower): {why}",
        RuntimeWarning,
        stacklevel=4,
    )


def _dims(value: Tensor, loc: Tensor) -> list[int]:
    B, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    return [B, S, M, D, Lq, L, P]


def forward_cpp(
    lib: ctypes.CDLL, value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor
) -> Tensor:
    """The output ``(B, Lq, M * D)`` in value's dtype. All inputs on the CPU, contiguous,
    shapes and starts int64, the rest of one dtype."""
    B, S, M, D, Lq, L, P = _dims(value, loc)
    out = value.new_empty(B, Lq, M * D)
    fn = getattr(lib, f"qkv_deformable_forward_{_NAMES[value.dtype]}")
    ptrs = (t.data_ptr() for t in (value, shapes, starts, loc, attn, out))
    fn(*ptrs, B, S, M, D, Lq, L, P)
    return out


def backward_cpp(
    lib: ctypes.CDLL,
    grad_out: Tensor,
    value: Tensor,
    shapes: Tensor,
    starts: Tensor,
    loc: Tensor,
    attn: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for value, loc and attn, as :func:`forward_cpp` takes its inputs; accumulated
    in float32 for half types and rounded once."""
    B, S, M, D, Lq, L, P = _dims(value, loc)
    # huge pages where Linux gives them: its rows are written once each, at the end of a task
    grad_value = empty_large(tuple(value.shape), dtype=value.dtype, device=value.device)
    grad_loc, grad_attn = torch.empty_like(loc), torch.empty_like(attn)
    fn = getattr(lib, f"qkv_deformable_backward_{_NAMES[value.dtype]}")
    tensors = (grad_out, value, shapes, starts, loc, attn, grad_value, grad_loc, grad_attn)
    fn(*(t.data_ptr() for t in tensors), B, S, M, D, Lq, L, P)
    return grad_value, grad_loc, grad_attn
