"""The softmax of a block of scores in place with each row's largest score, in one pass of C++
(``softmax_rows.cpp``), for the one-pass weights on the CPU (``reference.attention_with_weights``).

torch's ops take two passes over the block: ``amax`` for the row maxima (the log-sum-exp is
formed from them, ``reference._lse_of``) and the fused softmax. At 8 heads x T=S=4096 float32
the two read 512 MiB each, and the ``amax`` was 72 ms of the 860 ms of a
``MultiHeadAttention`` call with its weights (one thread, the AMX Xeon of
benchmarks/RESULTS.md). Here each row is read from memory once.

Where the library cannot be built (no C++ compiler), for other devices, dtypes or layouts,
:func:`softmax_rows_` says so (False) and the caller takes torch's ops: the same weights to
float32's rounding (torch's exp and sum orders differ from these).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from ._native_build import build_declared

__all__ = ["available", "softmax_rows_"]

SOURCE = Path(__file__).with_name("softmax_rows.cpp")
_DTYPES = {torch.float32: 0, torch.float64: 1}
_log = logging.getLogger(__name__)


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signature = [i64, ptr, i64, i64, ptr]  # dtype, scores, rows, S, row maxima
    instead = "the one-pass weights take torch's softmax"
    return build_declared(
        SOURCE, "qkv_softmax_rows", {"qkv_softmax_rows": signature}, _log, instead
    )


def available() -> bool:
    """Whether the library runs here (built at the first ask: seconds once, then cached)."""
    return _build()[0] is not None


def softmax_rows_(scores: Tensor, row_max: Tensor) -> bool:
    """The weights of each row of ``scores`` written over it and its largest score into
    ``row_max``, in one pass: a row whose largest score is ``-inf`` (no key) gets weights 0, one
    whose largest is ``+inf`` or NaN gets NaN. Whether it ran (False: a tensor it does not
    take, or no library; nothing is done then).

    Shape:
        scores ``(..., S)`` contiguous, S >= 1; row_max ``(...)`` contiguous, the same dtype,
        float32 or float64, both plain CPU tensors without gradient.
    """
    code = _DTYPES.get(scores.dtype)
    if (
        code is None
        or type(scores) is not Tensor
        or type(row_max) is not Tensor
        or row_max.dtype != scores.dtype
        or not (scores.is_cpu and row_max.is_cpu)
        or scores.requires_grad
        or row_max.requires_grad
        or scores.dim() < 1
        or scores.shape[-1] < 1
        or row_max.shape != scores.shape[:-1]
        or not (scores.is_contiguous() and row_max.is_contiguous())
    ):
        return False
    lib = _build()[0]
    if lib is None:
        return False
    S = scores.shape[-1]
    failed = lib.qkv_softmax_rows(
        code, scores.data_ptr(), scores.numel() // S, S, row_max.data_ptr()
    )
    assert not failed
    return True
