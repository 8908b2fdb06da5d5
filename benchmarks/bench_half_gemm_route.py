"""The half-GEMM route measured on this CPU, per ISA class (issue 38, item 2).

qkv multiplies half inputs on the CPU either natively (torch's bfloat16/float16 GEMM) or
widened to float32, whichever ``qkv.ops.cpu_isa`` measured faster on the machine (once per
process and dtype, kept on disk). This repeats that very measurement (``half_gemm_choice(dtype,
fresh=True)``: the representative in-projection GEMM timed both ways) ``--reps`` times in a
fresh process per ISA class: ``native`` (what the CPU has) and ``avx2``
(``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), with a throwaway cache folder, and
prints per dtype the route each repeat took and the median time of each route (qkv times on
one thread, whatever torch's count: see ``qkv.ops.cpu_isa``). The CPU is named (``lscpu``
model, ``torch.backends.cpu.get_cpu_capability()``, AVX-512-BF16/AMX flags).

Usage:
    python benchmarks/bench_half_gemm_route.py [--reps 7] [--isa native avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter

from bench_cpu_isa import ISA_ENV, cpu_model


def worker(reps: int) -> dict:
    import torch

    from qkv.ops import cpu_isa

    flags = sorted(f for f in cpu_isa.cpu_features() if f in ("avx512_bf16", "amx_bf16"))
    rows: dict = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": flags,
        "flag_rule": "native" if cpu_isa.native_bf16() else "float32",
    }
    for dt in (torch.bfloat16, torch.float16):
        choices = [cpu_isa.half_gemm_choice(dt, fresh=True) for _ in range(reps)]
        rows[str(dt).removeprefix("torch.")] = {
            "routes": dict(Counter(c.route for c in choices)),
            "median_ms": {
                r: statistics.median(c.times[r] for c in choices) * 1e3
                for r in cpu_isa.HALF_GEMM_ROUTES
            },
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return
    print(f"CPU: {cpu_model()}")
    for isa in args.isa:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, **ISA_ENV[isa], "QKV_CACHE_DIR": cache, "QKV_AUTOTUNE": "on"}
            env.pop("QKV_CPU_HALF_GEMM", None)
            cmd = [sys.executable, __file__, "--worker", "--reps", str(args.reps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        head = (
            f"{isa}: capability {r['capability']}, flags "
            f"{' '.join(r['flags']) or 'none'} (flag rule: {r['flag_rule']})"
        )
        print(head)
        for dt in ("bfloat16", "float16"):
            ms = r[dt]["median_ms"]
            ratio = ms["float32"] / ms["native"]
            print(
                f"  {dt:8s} routes taken {r[dt]['routes']}; median native {ms['native']:.3f} ms, "
                f"float32 {ms['float32']:.3f} ms (float32/native {ratio:.2f})"
            )


if __name__ == "__main__":
    main()
