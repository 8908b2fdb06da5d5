"""qkv.scaled_dot_product_attention against torch's SDPA called directly, CPU.

Two questions, each answered as a time ratio qkv / torch from the same run:
  1. dispatch overhead: auto on plain and causal calls (fp32), where qkv runs torch's kernel;
  2. float16 on CPU: qkv's torch backend (torch's float32 kernel, rounded to float16) against
     torch's own float16 kernel, forward and forward+backward.

Usage: python benchmarks/bench_sdpa.py [--out benchmarks/results/sdpa.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import qkv

B, H, D = 1, 8, 64


def _time(fn, min_run_time: float) -> float:
    """Median seconds per call."""
    # Timer defaults to num_threads=1: time with the threads the process really uses
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def _fwd_bwd(attend, q, k, v):
    def step():
        out = attend(q, k, v)
        out.backward(torch.ones_like(out))

    return step


def _time_pair(fn_a, fn_b, min_run_time: float, rounds: int = 3) -> tuple[float, float]:
    """Best-of-rounds medians of two functions, measured alternately so drift hits both."""
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(fn_a, min_run_time))
        b.append(_time(fn_b, min_run_time))
    return min(a), min(b)


def dispatch_overhead(lengths, min_run_time):
    rows = []
    for T in lengths:
        q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
        for causal in (False, True):
            t_torch, t_qkv = _time_pair(
                lambda c=causal, q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=c
                ),
                lambda c=causal, q=q, k=k, v=v: qkv.scaled_dot_product_attention(
                    q, k, v, is_causal=c
                ),
                min_run_time,
            )
            rows.append(
                dict(T=T, causal=causal, torch_s=t_torch, qkv_auto_s=t_qkv, ratio=t_qkv / t_torch)
            )
            print(
                f"dispatch  T={T:5d} causal={causal!s:5}  torch {t_torch * 1e3:8.3f} ms  "
                f"qkv auto {t_qkv * 1e3:8.3f} ms  ratio {t_qkv / t_torch:.3f}"
            )
    return rows


def float16_cpu(lengths, min_run_time):
    rows = []
    ours = lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    theirs = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for T in lengths:
        q, k, v = (
            torch.randn(B, H, T, D, dtype=torch.float16, requires_grad=True) for _ in range(3)
        )
        with torch.no_grad():
            f_t = _time(lambda q=q, k=k, v=v: theirs(q, k, v), min_run_time)
            f_q = _time(lambda q=q, k=k, v=v: ours(q, k, v), min_run_time)
        b_t = _time(_fwd_bwd(theirs, q, k, v), min_run_time)
        b_q = _time(_fwd_bwd(ours, q, k, v), min_run_time)
        rows.append(
            dict(
                T=T,
                fwd_torch_s=f_t,
                fwd_qkv_s=f_q,
                fwd_ratio=f_q / f_t,
                fwdbwd_torch_s=b_t,
                fwdbwd_qkv_s=b_q,
                fwdbwd_ratio=b_q / b_t,
            )
        )
        print(
            f"float16   T={T:5d} causal  fwd: torch {f_t * 1e3:8.2f} ms qkv {f_q * 1e3:8.2f} ms "
            f"ratio {f_q / f_t:.3f} | fwd+bwd: torch {b_t * 1e3:8.2f} ms qkv {b_q * 1e3:8.2f} ms "
            f"ratio {b_q / b_t:.3f}"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/sdpa.json")
    p.add_argument("--quick", action="store_true", help="short lengths and run times")
    a = p.parse_args()
    run_time = 0.2 if a.quick else 1.0
    result = dict(
        device="cpu",
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        qkv=qkv.__version__,
        shape=dict(B=B, H=H, D=D),
        dispatch_fp32=dispatch_overhead(
            [4, 128, 1024] if a.quick else [4, 128, 1024, 4096], run_time
        ),
        float16=float16_cpu([256] if a.quick else [256, 1024, 2048], run_time),
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
