"""The fused bfloat16 kernel on each of its GEMMs, side by side on this CPU (issue 38, item 2).

``qkv.ops.bf16_scores`` runs its GEMMs on AMX tiles (oneDNN's brgemm) or on AVX512-BF16's dot
product (qkv's own micro-kernel, and up to 4 query rows read in place). An AMX CPU runs both;
``auto`` takes the one :func:`qkv.ops.bf16_scores.gemm_choice` timed faster there, on one
representative call. This script times both on a range of calls, so that the verdict can be
checked against the calls users make: a decoding step (T=1 and T=4 over 4096 keys), a block
of rows (T=64 over 1024 keys), a whole sequence (T=S=1024), with and without the weights.

B=1, H=8, D=64, inference, one thread, each call's CPU time (``time.thread_time``), rounds
interleaved (the GEMMs alternate within a round); medians over rounds. A GEMM that does not
run here is named with the reason. The CPU is named (``lscpu`` model, flags,
``torch.backends.cpu.get_cpu_capability()``), and ``gemm_choice``'s own measurement is printed
after the table (kept on disk as ``qkv tune`` keeps it: point ``QKV_CACHE_DIR`` elsewhere to
leave the machine's cache as it was).

    QKV_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/bench_bf16_gemm.py [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from bench_cpu_isa import cpu_model

from qkv.ops import bf16_scores

H, D = 8, 64
CASES = (  # (name, T, S, weights)
    ("decoding step", 1, 4096, False),
    ("4 rows", 4, 4096, False),
    ("a block of rows", 64, 1024, False),
    ("whole sequence", 1024, 1024, False),
    ("whole sequence, weights", 1024, 1024, True),
)


def _flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            words = next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return "?"
    shown = [w for w in words if w.startswith(("amx", "avx512_bf16", "avx512_fp16"))]
    return " ".join(sorted(shown)) or "no AMX / AVX512-BF16 flags"


def _call(T: int, S: int, weights: bool):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, T, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, H, S, D, generator=g).to(torch.bfloat16) for _ in "kv")
    lo, hi = torch.zeros(1, T, dtype=torch.int64), torch.full((1, T), S)
    return lambda: bf16_scores.attend_kernel(q, k, v, D**-0.5, lo, hi, weights=weights)


def _timed(fn, gemm: str, n: int) -> float:
    """CPU seconds per call with ``QKV_BF16_GEMM=gemm`` (set for the calls, then put back)."""
    old = os.environ.get("QKV_BF16_GEMM")
    os.environ["QKV_BF16_GEMM"] = gemm
    try:
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - t0) / n
    finally:
        if old is None:
            del os.environ["QKV_BF16_GEMM"]
        else:
            os.environ["QKV_BF16_GEMM"] = old


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=9, help="rounds (medians over them)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"CPU: {cpu_model()}; {_flags()}; torch {torch.__version__}, capability "
        f"{torch.backends.cpu.get_cpu_capability()}; one thread"
    )
    if not bf16_scores.available():
        print(f"the kernel does not run here: {bf16_scores.unavailable_reason()}")
        return 0
    runs = bf16_scores.gemm_routes()
    for name in bf16_scores.GEMMS:
        if name not in runs:
            os.environ["QKV_BF16_GEMM"] = name
            print(f"{name}: does not run here ({bf16_scores.unavailable_reason()})")
            del os.environ["QKV_BF16_GEMM"]
    print(
        "| call | "
        + " | ".join(f"{g} (ms)" for g in runs)
        + (f" | {runs[0]} / {runs[1]} |" if len(runs) == 2 else " |")
    )
    print("|---" * (len(runs) + 1 + (len(runs) == 2)) + "|")
    with torch.no_grad():
        for label, T, S, weights in CASES:
            fn = _call(T, S, weights)
            n = max(1, int(0.05 / max(T * S * H * D * 4e-11, 1e-6)))  # ~50 ms a timing
            for gemm in runs:
                _timed(fn, gemm, 1)  # packs, first-use costs
            times: dict[str, list[float]] = {g: [] for g in runs}
            for r in range(args.reps):
                for gemm in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    times[gemm].append(_timed(fn, gemm, n))
            cells = [f"{statistics.median(times[g]) * 1e3:.3f}" for g in runs]
            if len(runs) == 2:
                ratio = statistics.median(a / b for a, b in zip(times[runs[0]], times[runs[1]]))
                cells.append(f"{ratio:.2f}")
            print(f"| {label}, T={T}, S={S} | " + " | ".join(cells) + " |", flush=True)
    choice = bf16_scores.gemm_choice(fresh=True)
    print(f"gemm_choice (auto's own measurement): {choice.reason()}")
    bf16_scores.forget_gemm()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
