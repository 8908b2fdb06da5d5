"""Where a public-API call's time goes on a GPU: the host's time per call and the kernels it
launches, beside torch's own SDPA (issues 38 and 39).

``gpu_api.py`` on the H200 (2026-11-28) timed ``qkv.scaled_dot_product_attention`` at T = 1024
(bf16, D = 128, B*T = 16k) at 0.84 ms (plain) and 1.07 ms (causal) forward, where SDPA with
cuDNN took 0.23 and 0.16 ms: the device waits on something. This script says on what, for a
few rows of that grid:

  * ``device_ms``: ``triton.testing.do_bench``'s median, as gpu_api.py;
  * ``host_us``: the host's time per call, 50 calls in a row with no sync between them (the
    device queue absorbs the kernels, so this is the Python and launch cost alone);
  * ``kernels``: the CUDA kernels one call launches (``torch.profiler``, 3 calls), with their
    device time per call; ``cpu_ops``: the ops with the most host time.

Implementations: ``qkv`` (auto), ``qkv-torch`` (backend="torch"), ``cudnn`` and ``flash``
(``F.scaled_dot_product_attention`` held to that kernel; plain and causal only).

Usage:
    python benchmarks/gpu_profile.py --out benchmarks/results/gpu_profile.json
    python benchmarks/gpu_profile.py --dry-run --out /tmp/gpu_profile.json   # CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gpu_common
import torch
import torch.nn.functional as F
from gpu_common import timer, write_json

import qkv

ROWS = (  # (case, T, mode)
    ("none", 1024, "fwd"),
    ("causal", 1024, "fwd"),
    ("causal", 4096, "fwd"),
    ("none", 1024, "fwdbwd"),
    ("window", 1024, "fwd"),
)
TOKENS, WIDTH, D = 16384, 2048, 128


def _kwargs(case: str) -> dict:
    if case == "causal":
        return dict(is_causal=True)
    if case == "window":
        return dict(mask_mod=qkv.masks.sliding_window(1024))
    return {}


def implementations(case: str, device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = _kwargs(case)
    impls = {
        "qkv": lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, **kw),
        "qkv-torch": lambda q, k, v: qkv.scaled_dot_product_attention(
            q, k, v, backend="torch", **kw
        ),
    }
    if case in ("none", "causal") and device.type == "cuda":
        for name, kernel in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("flash", SDPBackend.FLASH_ATTENTION),
        ):

            def torch_kernel(q, k, v, kernel=kernel):
                with sdpa_kernel([kernel]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

            impls[name] = torch_kernel
    return impls


def _step(attend, q, k, v, mode: str):
    if mode == "fwd":
        with torch.no_grad():
            return lambda: attend(q, k, v)

    def fwdbwd():
        attend(q, k, v).sum().backward()

    return fwdbwd


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_us(fn, device, n: int = 50) -> float:
    """The host's microseconds per call, ``n`` calls without a sync between them."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    return (t1 - t0) / n * 1e6


def profile(fn, device, calls: int = 3) -> tuple[list, list]:
    """(kernels, cpu_ops) of ``calls`` calls: ``[name, launches per call, device us per
    call]`` for each CUDA kernel, and the 8 ops with the most host time ``[name, us per
    call]``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    _sync(device)
    with torch_profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    kernels, ops = [], []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if device.type == "cuda" and dev_us > 0 and e.self_cpu_time_total == 0:
            kernels.append([e.key[:90], round(e.count / calls, 2), round(dev_us / calls, 1)])
        elif e.self_cpu_time_total > 0:
            ops.append([e.key[:60], round(e.self_cpu_time_total / calls, 1)])
    kernels.sort(key=lambda r: -r[2])
    ops.sort(key=lambda r: -r[1])
    return kernels, ops[:8]


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    bench = timer(args.dry_run, warmup=10, rep=40)
    rows = []
    for case, T_row, mode in ROWS:
        T = 128 if args.dry_run else T_row
        B, H = max(1, TOKENS // T), WIDTH // D
        if args.dry_run:
            B, H = 1, 2
        dtype = torch.bfloat16
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g).requires_grad_(
                mode == "fwdbwd"
            )
            for _ in range(3)
        )
        for name, attend in implementations(case, device).items():
            fn = _step(attend, q, k, v, mode)
            row = dict(case=case, T=T, mode=mode, impl=name)
            try:
                row["device_ms"] = round(bench(fn), 4)
                row["host_us"] = round(host_us(fn, device, 5 if args.dry_run else 50), 1)
                row["kernels"], row["cpu_ops"] = profile(fn, device)
            except Exception as e:  # a row that fails says why, the others still run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if name == "qkv":
                row["explain"] = qkv.dispatch.explain(q, k, v, **_kwargs(case))
            rows.append(row)
            print(_line(row), flush=True)
            write_json(
                args.out, gpu_common.environment("gpu_profile", device, args.dry_run, rows=rows)
            )
    return dict(rows=rows)


def _line(r: dict) -> str:
    head = f"{r['case']:7s} T={r['T']:5d} {r['mode']:6s} {r['impl']:9s}"
    if "error" in r:
        return f"{head} error: {r['error']}"
    ks = r["kernels"]
    n = sum(c for _, c, _ in ks)
    top = "; ".join(f"{name[:40]} x{c} {us}us" for name, c, us in ks[:4])
    return (
        f"{head} device {r['device_ms']:.3f} ms, host {r['host_us']:.0f} us/call, "
        f"{n:g} kernels/call [{top}]"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_profile.json"))
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    data = run(args)
    for r in data["rows"]:
        if r.get("cpu_ops"):
            print(f"\n{r['case']} T={r['T']} {r['mode']} {r['impl']}: host ops (us/call)")
            for name, us in r["cpu_ops"]:
                print(f"  {us:8.1f}  {name}")
        if r.get("kernels") and r["impl"].startswith("qkv"):
            print(f"{r['case']} T={r['T']} {r['mode']} {r['impl']}: kernels (launches, us/call)")
            for name, c, us in r["kernels"][:12]:
                print(f"  {c:5g} {us:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
