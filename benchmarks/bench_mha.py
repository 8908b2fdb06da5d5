"""qkv.MultiHeadAttention vs torch.nn.MultiheadAttention on CPU: time and peak memory.

Same config on both sides (E=512, 8 heads, B=1, self-attention, dropout 0): forward as
inference (eval mode, no_grad: torch may take its fused native fast path) and
forward+backward in training mode, fp32 and bf16, T from 256 to 4096, with and without attention
weights requested (torch: need_weights=True, average_attn_weights=False, i.e. per head as
qkv's trace; without: need_weights=False; qkv: return_trace=True / False).

Each measurement runs in a fresh subprocess so that its peak memory (ru_maxrss minus the RSS
before the first call) is its own. Time: median of torch.utils.benchmark blocked_autorange.

Usage: python benchmarks/bench_mha.py [--lengths 256 1024 4096] [--out benchmarks/results/mha.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

E, HEADS, B = 512, 8, 1
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def worker(impl: str, T: int, dtype: str, weights: bool, mode: str, min_run_time: float) -> dict:
    """One measurement, in this process: time per call and peak extra memory."""
    import torch
    from torch import nn
    from torch.utils import benchmark

    import qkv

    torch.manual_seed(0)
    dt = getattr(torch, DTYPES[dtype])
    tm = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=dt)
    tm.train(mode == "fwdbwd")  # forward alone is measured as inference: eval + no_grad
    module = tm if impl == "torch" else qkv.MultiHeadAttention.from_torch(tm)
    x = torch.randn(B, T, E, dtype=dt, requires_grad=mode == "fwdbwd")

    def call():
        if impl == "torch":
            out, w = tm(x, x, x, need_weights=weights, average_attn_weights=False)
        else:
            res = module(x, return_trace=weights)
            out, w = res if weights else (res, None)
        assert (w is not None) == weights
        return out

    def step():
        if mode == "fwd":
            with torch.no_grad():
                call()
        else:
            call().sum().backward()

    before = _rss_kib()
    step()  # warm-up; also sets the memory high-water mark
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    # Timer defaults to num_threads=1: time with the threads the process really uses
    timer = benchmark.Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    t = timer.blocked_autorange(min_run_time=min_run_time)
    return dict(time_s=t.median, peak_extra_mib=(peak - before) / 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--out", default="benchmarks/results/mha.json")
    p.add_argument(
        "--worker",
        nargs=5,
        metavar=("IMPL", "T", "DTYPE", "WEIGHTS", "MODE"),
        help=argparse.SUPPRESS,
    )
    a = p.parse_args()
    if a.worker:
        impl, T, dtype, weights, mode = a.worker
        print(json.dumps(worker(impl, int(T), dtype, weights == "1", mode, a.min_run_time)))
        return
    import torch

    rows, configs = (
        [],
        [
            (T, d, w, m)
            for T in a.lengths
            for d in DTYPES
            for w in (0, 1)
            for m in ("fwd", "fwdbwd")
        ],
    )
    for i, (T, dtype, weights, mode) in enumerate(configs, 1):
        res = {}
        for impl in ("torch", "qkv"):
            cmd = [
                sys.executable,
                __file__,
                "--min-run-time",
                str(a.min_run_time),
                "--worker",
                impl,
                str(T),
                dtype,
                str(weights),
                mode,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        row = dict(
            T=T,
            dtype=dtype,
            weights=bool(weights),
            mode=mode,
            torch_s=res["torch"]["time_s"],
            qkv_s=res["qkv"]["time_s"],
            time_ratio=res["qkv"]["time_s"] / res["torch"]["time_s"],
            torch_peak_mib=res["torch"]["peak_extra_mib"],
            qkv_peak_mib=res["qkv"]["peak_extra_mib"],
        )
        rows.append(row)
        print(
            f"[{i}/{len(configs)}] T={T:5d} {dtype} weights={bool(weights)!s:5} {mode:6} "
            f"torch {row['torch_s'] * 1e3:9.2f} ms  qkv {row['qkv_s'] * 1e3:9.2f} ms  "
            f"ratio {row['time_ratio']:.3f}  peak MiB torch {row['torch_peak_mib']:8.1f} "
            f"qkv {row['qkv_peak_mib']:8.1f}",
            flush=True,
        )
    result = dict(
        device="cpu",
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        config=dict(E=E, heads=HEADS, B=B),
        rows=rows,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
