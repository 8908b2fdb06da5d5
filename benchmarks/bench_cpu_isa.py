"""qkv.MultiHeadAttention against torch.nn.MultiheadAttention on this CPU, per ISA class.

Issue 25: speed choices made on one CPU lost to torch on another. This runs the same grid
under each ISA class this machine can present, each in a fresh process: ``native`` (what the
CPU has) and ``avx2`` (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, which hold torch's
and oneDNN's kernels to AVX2 on an AVX-512 machine). Within a process qkv and torch are timed
interleaved (each of ``--reps`` rounds runs both, which one first alternating), inference
(eval, no_grad), E=512, 8 heads, B=1, fp32 and bf16, without and with the weights (torch:
``need_weights=True, average_attn_weights=False``; qkv: ``return_trace=True`` and
``trace.probs`` read). Ratio = the median over rounds of qkv time / torch time in that round
(below 1: qkv faster).

The CPU is named in the output (``lscpu`` model, ``torch.backends.cpu.get_cpu_capability()``,
and whether it has AVX-512-BF16 or AMX). Writes ``--out`` (JSON) and prints a Markdown table.

Usage:
    python benchmarks/bench_cpu_isa.py [--lengths 256 1024 4096] [--isa native avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

E, HEADS, B = 512, 8, 1
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def worker(lengths: list[int], reps: int) -> list[dict]:
    """The grid in this process: interleaved qkv/torch medians (seconds per call)."""
    import torch
    from torch import nn

    import qkv
    from qkv.ops.cpu_isa import half_gemm_route

    records = []
    for dtype in ("float32", "bfloat16"):
        dt = getattr(torch, dtype)
        for T in lengths:
            torch.manual_seed(0)
            tm = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=dt).eval()
            ours = qkv.MultiHeadAttention.from_torch(tm).eval()
            x = torch.randn(B, T, E, dtype=dt)
            for weights in (False, True):

                def run_torch(tm=tm, x=x, weights=weights):
                    return tm(x, x, x, need_weights=weights, average_attn_weights=False)

                def run_qkv(ours=ours, x=x, weights=weights):
                    if weights:
                        out, trace = ours(x, return_trace=True)
                        return out, trace.probs
                    return ours(x)

                times: dict[str, list[float]] = {"qkv": [], "torch": []}
                pair = (("qkv", run_qkv), ("torch", run_torch))
                with torch.no_grad():
                    run_qkv(), run_torch()  # warm up
                    for i in range(reps):  # each round both, the first one alternating
                        for name, fn in pair if i % 2 == 0 else pair[::-1]:
                            t0 = time.perf_counter()
                            fn()
                            times[name].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) for k, v in times.items()}
                # the ratio of each round's two calls, made back to back: a shared machine's
                # slow spells then slow both sides of a ratio instead of one side's median
                ratios = [a / b for a, b in zip(times["qkv"], times["torch"])]
                records.append(
                    dict(
                        dtype=dtype,
                        T=T,
                        weights=weights,
                        qkv_s=med["qkv"],
                        torch_s=med["torch"],
                        ratio=statistics.median(ratios),
                        half_route=half_gemm_route() if dt != torch.float32 else None,
                    )
                )
                print(
                    f"  {dtype} T={T} weights={weights}: qkv/torch {records[-1]['ratio']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_isa.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import torch

        from qkv.ops.cpu_isa import cpu_features

        print(
            json.dumps(
                dict(
                    capability=torch.backends.cpu.get_cpu_capability(),
                    features=sorted(cpu_features()),
                    torch=torch.__version__,
                    threads=torch.get_num_threads(),
                    records=worker(args.lengths, args.reps),
                )
            )
        )
        return 0
    data = dict(
        benchmark="bench_cpu_isa",
        cpu=cpu_model(),
        command=" ".join(sys.argv),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        runs={},
    )
    for isa in args.isa:
        print(f"{isa}:", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--reps",
            str(args.reps),
            "--lengths",
            *map(str, args.lengths),
        ]
        done = subprocess.run(
            cmd, env={**os.environ, **ISA_ENV[isa]}, stdout=subprocess.PIPE, text=True, check=True
        )
        data["runs"][isa] = json.loads(done.stdout)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2))
    print(markdown(data))
    return 0


def markdown(data: dict) -> str:
    lines = [
        f"CPU: {data['cpu']}",
        "",
        (
            "| ISA run | capability | dtype | T | torch, no weights | qkv/torch | "
            "torch, weights | qkv/torch |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for isa, run in data["runs"].items():
        rows: dict = {}
        for r in run["records"]:
            rows.setdefault((r["dtype"], r["T"]), {})[r["weights"]] = r
        for (dtype, T), w in rows.items():
            cells = [f"{w[x]['torch_s'] * 1e3:.1f} ms | {w[x]['ratio']:.2f}" for x in (False, True)]
            lines.append(f"| {isa} | {run['capability']} | {dtype} | {T} | {' | '.join(cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
