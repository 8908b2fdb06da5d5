"""The NaN/inf contract's passes on a GPU as Triton kernels: the first, before a masked call's
kernel, one launch per tensor (:func:`copy_rows`); and after it, for rows that see ranges of
keys, the rows set NaN in one launch (:func:`nan_rows`).

Before a masked call's kernel, the contract (``ops/nonfinite.py``) needs copies of k and v
with every NaN/inf replaced by 0 (a hidden key's NaN value would reach the rows that may not
see it as ``0 * NaN``), and which rows of q, k and v held one. On the CPU one fused C++ pass
per tensor does this (``nonfinite_rows.copy_rows``); on CUDA the tensor ops took 11 launches
(two matrix-vector products and their ``nan_to_num``, two ``nan_to_num`` copies, ...), and
on an H200 each launch cost 10-40 µs of the host's time, which the device waited on
(benchmarks/RESULTS.md, "Eighteenth session"). Here: one launch per tensor, q's without a
copy, k's and v's flags into one buffer.

:func:`copy_rows` mirrors ``nonfinite_rows.copy_rows``: the same copies (``nan_to_num(t, 0, 0,
0)``'s values, bit for bit) and the same flags (1.0 on a row that held a NaN/inf).

:func:`nan_rows` does what ``nonfinite._restore_eager``'s tensor ops do for causal masks,
windows and key lengths (a running count of bad keys, two gathers and sums, ``sqrt(-hits)``
added: 12 launches) in a ``cumsum`` and one launch.

Without a GPU the kernels run under triton's interpreter inside
``qkv.ops.triton.interpreter()`` (tests/test_nonfinite_triton.py), as the triton backend's do.

Shape alphabet: L rows, E entries a row.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .base import tracing

__all__ = ["copy_rows", "nan_rows", "refuse", "takes", "takes_output"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_E = 1024  # a row's entries the kernel holds at once


def takes(*tensors: Tensor | None) -> bool:
    """Whether :func:`copy_rows` takes these tensors: CUDA (or the CPU under triton's
    interpreter), triton at hand, contiguous, of a float dtype, rows of at most ``MAX_E``
    entries, no gradient wanted, outside tracing."""
    from .triton.backend import interpreting, triton_available

    if tracing() or _REFUSED:
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
            return False  # (asked first: a CPU call never imports triton here)
        if (
            t.dtype not in _DTYPES
            or not t.is_contiguous()
            or t.dim() < 2
            or t.numel() == 0
            or t.shape[-1] > MAX_E
            or (t.requires_grad and torch.is_grad_enabled())
        ):
            return False
    return triton_available() is None


def copy_rows(src: Tensor, flags: Tensor, *, copy: bool = True, accumulate: bool = False):
    """``src`` with each NaN/inf replaced by 0 (a new tensor; ``src`` itself when not
    ``copy``), and ``flags`` set to 1.0 on each row of ``src`` that held one, 0.0 on the
    others (``accumulate``: kept at 1.0 where it was already: k's flags, then v's).

    Shape:
        src ``(*lead, L, E)`` contiguous; flags ``(*lead, L)`` float32 contiguous -> like src.
    """
    from .triton.backend import interpreting

    assert flags.dtype == torch.float32 and flags.is_contiguous()
    assert flags.shape == src.shape[:-1] and flags.device == src.device
    E = src.shape[-1]
    rows = src.numel() // E
    dst = torch.empty_like(src) if copy else src
    block_e = max(16, 1 << (E - 1).bit_length())
    block_r = max(1, min(64, 4096 // block_e))
    grid = (-(-rows // block_r),)
    kernels = _kernels(src.device.type == "cpu" and interpreting())
    kernels.zero_rows[grid](
        src,
        dst,
        flags,
        rows,
        E,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        COPY=copy,
        ACCUM=accumulate,
        WIDE=src.dtype == torch.float64,
    )
    return dst


def takes_output(out: Tensor) -> bool:
    """Whether :func:`nan_rows` writes into ``out``: CUDA (or the interpreter's CPU), its rows
    contiguous, of a float dtype, at most ``MAX_E`` values a row, no gradient wanted."""
    from .triton.backend import interpreting

    on = out.device.type == "cuda" or (out.device.type == "cpu" and interpreting())
    return (
        on
        and not tracing()
        and not _REFUSED
        and not out.requires_grad
        and out.dtype in _DTYPES
        and out.dim() == 4
        and out.stride(-1) == 1
        and 0 < out.shape[-1] <= MAX_E
        and out.numel() > 0
    )


def nan_rows(out: Tensor, keys: Tensor, lo: Tensor, hi: Tensor, rows: Tensor, own: bool):
    """NaN, in place, on each row of ``out`` whose keys ``[lo, hi)`` hold a key flagged in
    ``keys``, or whose query row is flagged in ``rows`` where the row has a key (``own``:
    every row has one): ``nonfinite._restore_eager``'s tensor ops (``key_counts.counts``'
    running count, gathers and sums, ``sqrt(-hits)`` added) in a ``cumsum`` and one launch.

    Shape:
        out ``(B, H, T, Dv)`` rows contiguous; keys ``(B, H, S)`` and rows ``(B, H, T)``
        float32 of 0.0 and 1.0; lo, hi ``(B?, 1, T)`` int64 -> out.
    """
    from .triton.backend import interpreting

    B, H, T, Dv = out.shape
    S = keys.shape[-1]
    cum = keys.cumsum(-1).contiguous()  # (B, H, S): bad keys up to each key, inclusive
    lo, hi = (r.expand(r.shape[0], 1, T) for r in (lo, hi))  # (each its own batch: 1 or B)
    assert lo.shape[0] in (1, B) and hi.shape[0] in (1, B)
    block_d = max(16, 1 << (Dv - 1).bit_length())
    block_t = max(1, min(128, 4096 // block_d))
    grid = (B * H, -(-T // block_t))
    kernels = _kernels(out.device.type == "cpu" and interpreting())
    kernels.nan_rows[grid](
        out,
        cum,
        lo,
        hi,
        rows,
        H,
        T,
        S,
        Dv,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lo.stride(0) if lo.shape[0] > 1 else 0,
        lo.stride(-1),
        hi.stride(0) if hi.shape[0] > 1 else 0,
        hi.stride(-1),
        rows.stride(0),
        rows.stride(1),
        rows.stride(2),
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        OWN=own,
    )
    return out


def refuse(error: Exception) -> None:
    """Stop using the kernel in this process after it failed (``error``), saying so once: the
    tensor ops give the same copies and flags."""
    if not _REFUSED:
        warnings.warn(
            f"qkv: the NaN/inf contract's triton kernel failed ({type(error).__name__}: "
            f"{error}); the tensor ops keep the contract from now on (the same results, more "
            "launches)",
            RuntimeWarning,
            stacklevel=3,
        )
    _REFUSED.append(f"{type(error).__name__}: {error}")


_REFUSED: list[str] = []  # why the kernel failed, once it did


@functools.cache
def _kernels(interpret: bool):
    """The kernel module (``_nonfinite_kernels.py``): compiled for the GPU, or (``interpret``)
    a copy decorated while triton's interpreter was on (as ``ops/triton/launch._kernels``)."""
    path = Path(__file__).with_name("_nonfinite_kernels.py")
    name = f"{__package__}._nonfinite_kernels" + ("_interpreted" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"qkv: cannot load the contract's triton kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    if not interpret:
        spec.loader.exec_module(module)
        return module
    from triton import knobs

    with knobs.runtime.scope():  # restores knobs and the environment variable on exit
        knobs.runtime.interpret = True
        spec.loader.exec_module(module)
    return module
