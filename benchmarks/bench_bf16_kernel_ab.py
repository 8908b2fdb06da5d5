"""The fused bfloat16 kernel (``ops/bf16_scores.cpp``) as of a git revision against the working
tree's, both built and loaded in one process and called in turn (issue 38): a change to the
kernel's C++ measured before/after on the machine at hand, with the bits of both compared.

Cases (B=1, 8 heads, D=64, ``bf16_scores.attend_kernel`` called directly): ``plain`` (every
key), ``window`` (the 257 keys up to each row: ``sliding_window(256)``) and ``weights``
(every key, the weights returned, as a trace or ``need_weights`` wants them). ``--timer cpu``
(default) times each call by ``time.thread_time`` at one thread, which the other processes of
a shared machine do not inflate; ``--threads 0 --timer wall`` times torch's threads by the
wall clock. The ratio is the median over rounds of new / old, the order alternating each round.
Both builds are called through the working tree's ``attend_kernel``: the revision's C entry
point must take the same arguments (29d468f added the key heads: compare earlier revisions
with the working tree of their time).

    PYTHONPATH=src python benchmarks/bench_bf16_kernel_ab.py --rev f5c886a [--lengths 1024 4096]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_cpu_isa import cpu_model

from qkv.ops import bf16_scores

H, D, WINDOW = 8, 64, 256
CASES = ("plain", "window", "weights")


def _library(source: Path):
    """The kernel built from ``source``, set up for ctypes as ``bf16_scores`` sets up its own."""
    saved = bf16_scores.SOURCE
    bf16_scores.SOURCE = source
    bf16_scores._build.cache_clear()
    try:
        lib, why = bf16_scores._build()
    finally:
        bf16_scores.SOURCE = saved
        bf16_scores._build.cache_clear()
    if lib is None:
        raise SystemExit(f"the kernel of {source} did not build: {why}")
    return lib


def _inputs(case: str, T: int):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, H, T, D, generator=g).bfloat16() for _ in range(3))
    t = torch.arange(T)
    if case == "window":
        lo, hi = (t - WINDOW).clamp(min=0)[None], (t + 1)[None]
    else:
        lo, hi = torch.zeros(1, T, dtype=torch.int64), torch.full((1, T), T)
    return q, k, v, lo, hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", required=True, help="the git revision whose kernel is 'old'")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--timer", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.timer == "cpu" else time.perf_counter
    if not bf16_scores.available():
        raise SystemExit(f"the kernel does not run here: {bf16_scores.unavailable_reason()}")
    gemm = bf16_scores._route()[0]
    path = "src/qkv/ops/bf16_scores.cpp"
    old_text = subprocess.check_output(["git", "show", f"{args.rev}:{path}"], text=True)
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "bf16_scores.cpp"
        old_source.write_text(old_text)
        libs = {"old": _library(old_source), "new": _library(bf16_scores.SOURCE)}
        saved = bf16_scores._lib_and_gemm
        print(
            f"CPU: {cpu_model()}; capability {torch.backends.cpu.get_cpu_capability()}; "
            f"GEMM {bf16_scores.gemm_choice(measure=False).route}; {torch.get_num_threads()} "
            f"thread(s), {args.timer} time; old = {args.rev}, new = the working tree"
        )
        print("| case | T | old ms | new ms | new/old | same bits |")
        print("|---|---|---|---|---|---|")
        try:
            for T in args.lengths:
                for case in args.cases:
                    q, k, v, lo, hi = _inputs(case, T)

                    def call(name: str, q=q, k=k, v=v, lo=lo, hi=hi, case=case):
                        bf16_scores._lib_and_gemm = lambda what, lib=libs[name]: (lib, gemm)
                        return bf16_scores.attend_kernel(
                            q, k, v, D**-0.5, lo, hi, weights=case == "weights"
                        )

                    results = {name: call(name) for name in libs}
                    same = all(
                        torch.equal(a, b)
                        for a, b in zip(results["old"], results["new"])
                        if a is not None
                    )
                    times: dict[str, list[float]] = {name: [] for name in libs}
                    ratios = []
                    for rep in range(args.reps):
                        order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
                        row = {}
                        for name in order:
                            start = clock()
                            call(name)
                            row[name] = clock() - start
                            times[name].append(row[name])
                        ratios.append(row["new"] / row["old"])
                    old, new = (statistics.median(times[n]) * 1e3 for n in ("old", "new"))
                    print(
                        f"| {case} | {T} | {old:.2f} | {new:.2f} | "
                        f"{statistics.median(ratios):.3f} | {same} |"
                    )
        finally:
            bf16_scores._lib_and_gemm = saved


if __name__ == "__main__":
    main()
