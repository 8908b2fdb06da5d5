"""What the GPU benchmarks share (``gpu_api.py``, ``gpu_deformable.py``; run by ``gpu_check.sh``):
the timer, the device-sync probe, the environment a result file names, and its atomic write.

Each runs on a GPU (``triton.testing.do_bench``) or, with ``--dry-run``, on the CPU under
triton's interpreter at tiny sizes, where a time means nothing and only that every row runs is
checked.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import qkv


def timer(dry: bool, warmup: int, rep: int, rounds: int = 3):
    """fn -> median ms: triton's do_bench on a GPU; in a dry run, the median of ``rounds``
    plain calls after one (the interpreter takes seconds a call: keep ``rounds`` small)."""
    if not dry:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup, rep=rep)

    def plain(fn):
        if rounds > 1:
            fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return plain


def sync_free(fn, device) -> bool | None:
    """Whether one call ran without synchronising the device (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return False
    finally:
        torch.cuda.set_sync_debug_mode(before)
        torch.cuda.synchronize()


def environment(benchmark: str, device, dry: bool, **fields) -> dict:
    """What a result file says of where and how it was made: the versions, the device (its
    name, capability, CUDA, cuDNN and triton on a GPU), the command, and ``fields``."""
    env = dict(
        benchmark=benchmark,
        dry_run=dry,
        torch=torch.__version__,
        qkv=getattr(qkv, "__version__", "unknown"),
        python=platform.python_version(),
        **fields,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        command=" ".join([sys.executable] + sys.argv),
    )
    if device.type == "cuda":
        import triton

        env.update(
            device=torch.cuda.get_device_name(),
            capability=".".join(map(str, torch.cuda.get_device_capability())),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            triton=triton.__version__,
            timer="triton.testing.do_bench median (ms)",
        )
    else:
        env.update(device=f"cpu ({platform.processor() or platform.machine()}), dry run")
    return env


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, written whole or not at all (a stopped run leaves the
    last complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
