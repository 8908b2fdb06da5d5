"""How many ops a call launches on a device without qkv's fused C++ passes (CUDA's way), counted
on the CPU: the NaN/inf contract's tensor ops, and with ``--triton`` its Triton kernels
(``ops/nonfinite_triton.py``, under triton's interpreter here).

On an H200 each launch cost 10-40 µs of the host's time and the device waited on it
(benchmarks/RESULTS.md, "Eighteenth session"), so the count is what this script reports: the
aten ops of one call (its third: plans and layouts made), views and allocations aside, and
the Triton launches (``nan_rows`` counted as two: its ``cumsum`` and its kernel).
Its first pass by the Triton kernel (``copy_rows``) and, for rows that see ranges of keys,
the rows set after (``nan_rows``).

Usage:
    python benchmarks/count_contract_ops.py [--triton] [--kinds plain causal window]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv.ops import nonfinite, nonfinite_rows, nonfinite_triton, torch_sdpa
from qkv.ops.triton import interpreter

KINDS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(mask_mod=qkv.masks.sliding_window(64)),
}
NOT_LAUNCHES = (
    "view", "t.default", "unsqueeze", "expand", "reshape", "_unsafe_view", "as_strided",
    "transpose", "detach", "alias", "slice", "select", "squeeze", "permute", "empty",
    "_reshape_alias", "split", "unbind",
)  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self, paused):
        super().__init__()
        self.ops: list[str] = []
        self.paused = paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).removeprefix("aten.")
        if not self.paused[0] and not name.startswith(NOT_LAUNCHES):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def count(kind: str, triton: bool) -> tuple[list[str], int]:
    """The aten ops and the Triton launches of one bfloat16 inference call of ``kind``."""
    paused, launches = [False], [0]

    def counted(kernel, n):
        def run(*args, **kwargs):
            launches[0] += n
            paused[0] = True  # (the interpreter's own tensor ops are not launches)
            try:
                return kernel(*args, **kwargs)
            finally:
                paused[0] = False

        return run

    q, k, v = (torch.randn(2, 4, 256, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nonfinite, "host_reads_free", lambda device: False)  # as on CUDA
        mp.setattr(nonfinite_rows, "_build", lambda: (None, "CUDA has none"))
        mp.setattr(torch_sdpa, "flash_cpu_available", lambda: False)
        mp.setattr(nonfinite_triton, "copy_rows", counted(nonfinite_triton.copy_rows, 1))
        # nan_rows: its cumsum and its kernel
        mp.setattr(nonfinite_triton, "nan_rows", counted(nonfinite_triton.nan_rows, 2))
        ctx = interpreter() if triton else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for _ in range(2):
                qkv.scaled_dot_product_attention(q, k, v, backend="torch", **KINDS[kind])
            launches[0] = 0
            mode = _Ops(paused)
            with mode:
                qkv.scaled_dot_product_attention(q, k, v, backend="torch", **KINDS[kind])
    return mode.ops, launches[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton", action="store_true", help="the first pass by the Triton kernel")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = p.parse_args(argv)
    for kind in args.kinds:
        ops, launches = count(kind, args.triton)
        print(f"{kind:7s} {len(ops) + launches:3d} launches: {len(ops)} aten ops + {launches} "
              f"triton: {', '.join(ops)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
