"""The Triton kernels of multi-scale deformable attention (``triton_kernels.py``), launched.

:func:`forward_triton` launches ``deformable_fwd``; :func:`backward_triton` the three steps of
the deterministic backward (``triton_kernels.py``'s docstring says why it is built so):
``deformable_bwd_samples``, then a stable sort of the samples' keys and the value rows' runs
in torch ops (:func:`_runs`), then ``deformable_bwd_value``.

Where they run (:func:`unavailable_reason`): CUDA tensors where triton imports; CPU tensors
only inside ``qkv.ops.triton.interpreter()``, which runs them under triton's interpreter for
tests (a copy of ``triton_kernels.py`` decorated with ``TRITON_INTERPRET=1``, as the attention
kernels do in ``qkv/ops/triton/launch.py``). triton is imported only when a kernel is about
to run, so ``import qkv`` never needs it.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points; N = B * Lq * M, R = B * S * M.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from ..triton.backend import interpreting, triton_available

__all__ = ["backward_triton", "forward_triton", "unavailable_reason"]

_INT32_MAX = 2**31 - 1


def unavailable_reason(device: torch.device) -> str:
    """Why the Triton kernels cannot run on ``device`` ("" when they can)."""
    if device.type == "cpu" and not interpreting():
        return (
            "the Triton kernels run on CUDA tensors (on the CPU only under "
            "qkv.ops.triton.interpreter(), for tests); value is on cpu"
        )
    if device.type not in ("cuda", "cpu"):
        return f"the Triton kernels run on CUDA tensors; value is on {device}"
    return triton_available() or ""


@functools.cache
def _kernels(interpret: bool) -> ModuleType:
    """The kernel module: compiled for the GPU, or (``interpret``) a copy whose kernels were
    decorated while ``TRITON_INTERPRET=1``, loaded under a name of its own."""
    if not interpret:
        from . import triton_kernels

        return triton_kernels
    from triton import knobs

    path = Path(__file__).with_name("triton_kernels.py")
    spec = importlib.util.spec_from_file_location(f"{__package__}._triton_interpreted", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"qkv: cannot load the deformable triton kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    with knobs.runtime.scope():  # restores knobs and the environment variable on exit
        knobs.runtime.interpret = True
        spec.loader.exec_module(module)
    return module


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _blocks(D: int, rows: int) -> tuple[int, int]:
    """(rows per program, BLOCK_D): about 2,048 accumulator elements a program (16 a thread at
    4 warps), at least 16 rows, no more than the rows there are."""
    block_d = _pow2(D)
    return max(1, min(_pow2(rows), max(16, 2048 // block_d))), block_d


def _launch(kernel, grid: tuple[int], interpret: bool, *args, **kwargs) -> None:
    if interpret:
        kernel[grid](*args, **kwargs)
        return
    # no FMA contraction: pixel coordinates round as grid_sample's (kernel.cpp is built with
    # -ffp-contract=off for the same reason), and the value-gradient kernel recomputes each
    # sample's bilinear weights bit for bit as the sample kernel computed them
    kernel[grid](*args, **kwargs, num_warps=4, enable_fp_fusion=False)


def _on(device: torch.device):
    """Launches on ``device`` (triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _dims(value: Tensor, loc: Tensor) -> tuple[int, ...]:
    B, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    return B, S, M, D, Lq, L, P


def forward_triton(value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor):
    """The output ``(B, Lq, M * D)`` in value's dtype. Inputs contiguous, on one device
    (shapes and starts int64), value, loc and attn of one dtype, none empty."""
    B, S, M, D, Lq, L, P = _dims(value, loc)
    out = value.new_empty(B, Lq, M * D)
    interpret = value.device.type == "cpu"
    block_q, block_d = _blocks(D, Lq)
    n_qblocks = -(-Lq // block_q)
    with _on(value.device):
        _launch(
            _kernels(interpret).deformable_fwd,
            (n_qblocks * B * M,),
            interpret,
            value, shapes, starts, loc, attn, out, S, Lq, L, P, n_qblocks,
            M=M, D=D, BLOCK_Q=block_q, BLOCK_D=block_d, F64=value.dtype == torch.float64,
        )  # fmt: skip
    return out


def _runs(keys: Tensor, shapes: Tensor, starts: Tensor, B: int, S: int, M: int) -> tuple:
    """The samples in key order (``order`` (N * L * P,), stable: sample order within a key),
    and per value row ``(b, s, m)`` and corner role (dy, dx) in (0, 0), (0, 1), (1, 0),
    (1, 1) the run ``order[lo:hi]`` of the samples whose top-left corner is (y - dy, x - dx):
    ``runs`` ``(R, 4, 2)`` int64. Tensor ops only (no host read)."""
    L, dev = shapes.shape[0], keys.device
    sorted_keys, order = torch.sort(keys, stable=True)  # deterministic, sentinel -1 first
    s = torch.arange(S, device=dev)
    lvl = torch.searchsorted(starts, s, right=True) - 1  # (S,) each row's level
    W = shapes[lvl, 1]  # (S,)
    y, x = (s - starts[lvl]) // W, (s - starts[lvl]) % W  # (S,)
    dy = torch.tensor([0, 0, 1, 1], device=dev)
    dx = torch.tensor([0, 1, 0, 1], device=dev)
    within = (y[:, None] + 1 - dy) * (W[:, None] + 1) + (x[:, None] + 1 - dx)  # (S, 4)
    bm = torch.arange(B, device=dev)[:, None] * M + torch.arange(M, device=dev)  # (B, M)
    first = (bm[:, None, :] * L + lvl[None, :, None]) * (4 * S)  # (B, S, M): as the kernel's
    row_keys = (first[..., None] + within[None, :, None, :]).to(keys.dtype)  # (B, S, M, 4)
    lo = torch.searchsorted(sorted_keys, row_keys)  # (B, S, M, 4)
    hi = torch.searchsorted(sorted_keys, row_keys, right=True)
    return order, torch.stack((lo, hi), -1).contiguous()  # (N*L*P,), (B, S, M, 4, 2)


def backward_triton(
    grad_out: Tensor, value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for value, loc and attn, as :func:`forward_triton` takes its inputs (grad_out
    ``(B, Lq, M * D)`` contiguous, value's dtype); accumulated in float32 for half types and
    rounded once; the same bits on every run."""
    B, S, M, D, Lq, L, P = _dims(value, loc)
    interpret = value.device.type == "cpu"
    kernels = _kernels(interpret)
    f64 = value.dtype == torch.float64
    grad_loc, grad_attn = torch.empty_like(loc), torch.empty_like(attn)
    fits = B * M * L * 4 * S <= _INT32_MAX  # the largest key: int32 sorts faster
    keys = torch.empty(attn.shape, dtype=torch.int32 if fits else torch.int64, device=value.device)
    block_q, block_d = _blocks(D, Lq)
    n_qblocks = -(-Lq // block_q)
    with _on(value.device):
        _launch(
            kernels.deformable_bwd_samples,
            (n_qblocks * B * M,),
            interpret,
            grad_out, value, shapes, starts, loc, attn, grad_loc, grad_attn, keys,
            S, Lq, L, P, n_qblocks,
            M=M, D=D, BLOCK_Q=block_q, BLOCK_D=block_d, F64=f64,
        )  # fmt: skip
        order, runs = _runs(keys.view(-1), shapes, starts, B, S, M)
        grad_value = torch.empty_like(value)
        R = B * S * M
        block_r, _ = _blocks(D, R)
        _launch(
            kernels.deformable_bwd_value,
            (-(-R // block_r),),
            interpret,
            grad_out, shapes, loc, attn, order, runs, grad_value, R, L, P,
            D=D, BLOCK_R=block_r, BLOCK_D=block_d, F64=f64,
        )  # fmt: skip
    return grad_value, grad_loc, grad_attn
