"""MultiHeadAttention bf16 T=1024 with weights: the one-pass weights' scores by the bf16 score
kernel (qkv.ops.bf16_scores) against the widened float32 GEMM, and nn.MultiheadAttention
(need_weights=True, average_attn_weights=False), interleaved in one process, median of --reps.

    PYTHONPATH=src python benchmarks/bench_bf16_scores.py [--threads N] [--reps 21]
"""

import argparse
import statistics
import time

import torch
from torch import nn

import qkv
from qkv.ops import bf16_scores

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
p.add_argument("--reps", type=int, default=21)
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
B, T, E, H = 1, 1024, 512, 8
torch.manual_seed(0)
tm = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16).eval()
ours = qkv.MultiHeadAttention.from_torch(tm).eval()
x = torch.randn(B, T, E, dtype=torch.bfloat16)
real = bf16_scores.available


def run_qkv(kernel: bool) -> None:
    bf16_scores.available = real if kernel else (lambda: False)  # the module's own switch
    _ = ours(x, return_trace=True)[1].probs  # the weights, as a reader of them asks


impls = {
    "qkv-kernel": lambda: run_qkv(True),
    "qkv-widened": lambda: run_qkv(False),
    "torch": lambda: tm(x, x, x, need_weights=True, average_attn_weights=False),
}
times: dict[str, list[float]] = {n: [] for n in impls}
with torch.no_grad():
    for f in impls.values():
        f(), f()
    for _ in range(args.reps):
        for n, f in impls.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
bf16_scores.available = real
print(
    f"threads {torch.get_num_threads()}, kernel here: {real()} {bf16_scores.unavailable_reason()}"
)
print({n: f"{statistics.median(v) * 1e3:.2f} ms" for n, v in times.items()})


def paired(a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


print(
    f"paired medians: kernel/widened {paired('qkv-kernel', 'qkv-widened'):.3f}, "
    f"kernel/torch {paired('qkv-kernel', 'torch'):.2f}, "
    f"widened/torch {paired('qkv-widened', 'torch'):.2f}"
)
