"""The one-pass weights' softmax: qkv's C++ pass against torch's ops, beside torch's module.

``qkv.MultiHeadAttention.from_torch(m)`` in float32 with ``return_trace=True`` (and ``.probs``
read) forms its weights in one pass (``ops/reference.attention_with_weights``), whose block
softmax runs by ``ops/softmax_rows.py`` (C++) or, where that library is hidden, by ``amax`` and
torch's softmax. Both ways run in one process in rotating order, against
``m(x, x, x, need_weights=True, average_attn_weights=False)``; one thread, each call's CPU time,
median of per-round ratios. Run it once per ISA class (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` for the AVX2 class).

Usage:
    PYTHONPATH=src python benchmarks/bench_weights_softmax.py [--lengths 1024 4096] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import qkv
from qkv.ops import softmax_rows


def compare(T: int, rounds: int) -> str:
    torch.manual_seed(0)
    peer = nn.MultiheadAttention(512, 8, batch_first=True).eval()
    ours = qkv.MultiHeadAttention.from_torch(peer).eval()
    x = torch.randn(1, T, 512)
    built = softmax_rows._build

    def qkv_way(native: bool):
        softmax_rows._build = built if native else (lambda: (None, "hidden by the benchmark"))
        try:
            return ours(x, return_trace=True)[1].probs
        finally:
            softmax_rows._build = built

    fns = {
        "c++": lambda: qkv_way(True),
        "torch-ops": lambda: qkv_way(False),
        "nn.MHA": lambda: peer(x, x, x, need_weights=True, average_attn_weights=False),
    }
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for n in names[r % 3 :] + names[: r % 3]:
            t0 = time.thread_time()
            fns[n]()
            times[n].append(time.thread_time() - t0)
    ratio = {
        n: statistics.median(a / b for a, b in zip(times[n], times["nn.MHA"]))
        for n in ("c++", "torch-ops")
    }
    ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return (
        f"| {torch.backends.cpu.get_cpu_capability()} | {T} | {ms['c++']:.1f} | "
        f"{ms['torch-ops']:.1f} | {ms['nn.MHA']:.1f} | {ratio['c++']:.2f} | "
        f"{ratio['torch-ops']:.2f} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| ISA class | T | C++ ms | torch's ops ms | nn.MHA ms | C++ / nn.MHA | ops / nn.MHA |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for T in args.lengths:
            print(compare(T, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
