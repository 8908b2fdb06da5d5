"""Multi-scale deformable attention on CPU: qkv's kernels against the ``grid_sample`` fallback.

BEVFormer's level set (feature maps 116x200, 58x100, 29x50, 15x25; S = 30,825), 8 heads x 32,
4 points per level and head, batch 1, at 2,500 and 10,000 queries (and 40,000 with ``--all``),
in float32 and bfloat16. Three implementations:

* ``grid_sample``: mmcv's ``multi_scale_deformable_attn_pytorch`` (one ``F.grid_sample`` per
  level; autograd for the backward), which is ``qkv.ops.deformable.deformable_attention_naive``;
* ``qkv-cpp``: ``qkv.deformable_attention`` on its C++ kernel (``QKV_DEFORMABLE_KERNEL=cpp``);
* ``qkv-torch``: the same on its plain-PyTorch path, what runs where no compiler is found.

Each (implementation, dtype, queries) is measured in a fresh process: the median time of a
forward and of a forward+backward (``torch.utils.benchmark``; all of torch's threads, or
``--threads N``: on a machine others share, one thread is the figure that holds still), and the
peak resident memory a forward+backward adds to what its inputs hold (Linux's high-water mark,
reset before the step; the gradients of the inputs count, for every implementation alike).
Locations are uniform over the maps (``--locations uniform``: every corner a cache miss, the
worst case) or BEVFormer-like (``local``: each query's points within a few pixels of a
reference point on a square grid); the weights are softmaxed over levels x points.

Writes ``OUT/deformable.json`` (records, CPU model, torch's CPU capability, threads, versions)
and prints a Markdown table with each qkv kernel's speed-up and memory ratio against
``grid_sample`` from the same run.

Usage:
    python benchmarks/bench_deformable.py                    # 2,500 and 10,000 queries
    python benchmarks/bench_deformable.py --all              # and 40,000
    python benchmarks/bench_deformable.py --locations local
    python benchmarks/bench_deformable.py --threads 1
    python benchmarks/bench_deformable.py --quick            # smoke run: small, to a temp dir
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LEVELS = [(116, 200), (58, 100), (29, 50), (15, 25)]
HEADS, HEAD_DIM, POINTS = 8, 32, 4
IMPLS = ("grid_sample", "qkv-cpp", "qkv-torch")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROOT = Path(__file__).resolve().parents[1]


def make_inputs(queries: int, dtype: torch.dtype, locations: str, levels=LEVELS, seed: int = 0):
    """value (1, S, M, D), spatial_shapes (L, 2), locations (1, Lq, M, L, P, 2), weights."""
    g = torch.Generator().manual_seed(seed)
    S, L = sum(h * w for h, w in levels), len(levels)
    value = torch.randn(1, S, HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (1, queries, HEADS, L, POINTS)
    if locations == "uniform":
        loc = torch.rand(*shape, 2, generator=g)
    else:  # reference points on a square grid, offsets of a few pixels of the finest map
        side = int(queries**0.5) + 1
        ref = (
            (torch.arange(queries) % side + 0.5) / side,
            (torch.arange(queries) // side + 0.5) / side,
        )
        ref = torch.stack(ref, -1).view(1, queries, 1, 1, 1, 2)
        pixel = torch.tensor([1 / levels[0][1], 1 / levels[0][0]])
        loc = (ref + 2 * pixel * torch.randn(*shape, 2, generator=g)).clamp(0, 1)
    weights = torch.randn(1, queries, HEADS, L * POINTS, generator=g).softmax(-1).view(shape)
    return value, torch.tensor(levels), loc.to(dtype), weights.to(dtype)


def attend_fn(impl: str):
    from qkv.ops import deformable

    if impl == "grid_sample":
        return deformable.deformable_attention_naive
    kernel = impl.removeprefix("qkv-")
    if kernel == "cpp" and deformable.native.library() is None:
        raise RuntimeError(deformable.native.unavailable_reason())
    return lambda *args: deformable.deformable_attention(*args, kernel=kernel)


def _reset_peak_kib() -> int:
    """Reset the high-water mark of resident memory to now (Linux >= 4.0) and return it, KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def measure(
    impl: str, dtype: str, queries: int, locations: str, min_run_time: float, threads: int
) -> dict:
    """One record, measured in this process (with ``threads`` of torch's threads, 0: as set)."""
    from torch.utils import benchmark

    if threads:
        torch.set_num_threads(threads)

    attend = attend_fn(impl)
    value, shapes, loc, weights = make_inputs(queries, DTYPES[dtype], locations)
    leaves = [t.requires_grad_() for t in (value, loc, weights)]

    def forward():
        with torch.no_grad():
            attend(value, shapes, loc, weights)

    def step():
        out = attend(value, shapes, loc, weights)  # (1, Lq, M*D)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None

    small = make_inputs(16, DTYPES[dtype], locations, levels=[(4, 5), (2, 3)])
    small_leaves = [t.requires_grad_() for t in (small[0], small[2], small[3])]
    out = attend(small[0], small[1], small[2], small[3])  # the autograd engine's first-use costs
    out.backward(torch.ones_like(out))
    del small_leaves, out
    before = _reset_peak_kib()
    step()  # also the warm-up
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = {}
    for name, fn in (("fwd", forward), ("fwdbwd", step)):
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        m = timer.blocked_autorange(min_run_time=min_run_time)
        times[name], times[f"{name}_min"] = m.median, min(m.times)
    return dict(
        impl=impl,
        dtype=dtype,
        queries=queries,
        locations=locations,
        status="ok",
        fwd_s=times["fwd"],
        fwdbwd_s=times["fwdbwd"],
        fwd_min_s=times["fwd_min"],
        fwdbwd_min_s=times["fwdbwd_min"],
        peak_extra_mib=(peak - before) / 1024,
        threads=torch.get_num_threads(),
    )


def measure_in_child(job: dict, timeout: float) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return dict(job, status="timeout", reason=f"over {timeout:g} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return dict(job, status="error", reason=reason)
    return dict(json.loads(lines[-1]), wall_s=time.perf_counter() - started)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int = 0) -> dict:
    from qkv.ops.deformable import native

    return dict(
        benchmark="deformable",
        device="cpu",
        cpu=cpu_model(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=threads or torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        cpp_kernel=native.unavailable_reason() or "built",
        load_average=os.getloadavg(),
        levels=LEVELS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        points=POINTS,
        batch=1,
    )


def markdown(records: list[dict], env: dict) -> str:
    """A table per location mode: time and peak per implementation, and each qkv kernel's
    speed-up (grid_sample's time / its time) and memory ratio (its peak / grid_sample's)."""
    title = (
        f"CPU: {env['cpu']} ({env['cpu_capability']}, {env['threads']} threads), torch "
        f"{env['torch']}; BEVFormer's levels, {env['heads']} heads x {env['head_dim']}, "
        f"{env['points']} points, batch 1."
    )
    columns = (
        "| locations | dtype | queries | impl | fwd ms | fwd+bwd ms | peak MiB | speed-up fwd+bwd "
        "| speed-up fwd | peak / grid_sample |"
    )
    lines = [title, "", columns, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    base = {
        (r["locations"], r["dtype"], r["queries"]): r
        for r in records
        if r["impl"] == "grid_sample" and r["status"] == "ok"
    }
    for r in records:
        key = (r["locations"], r["dtype"], r["queries"])
        head = f"| {r['locations']} | {r['dtype']} | {r['queries']:,} | {r['impl']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']}: {r.get('reason', '')} | | | | | |")
            continue
        b = base.get(key)
        ratios = " | | |"
        if b is not None and r["impl"] != "grid_sample":
            ratios = (
                f" {b['fwdbwd_s'] / r['fwdbwd_s']:.1f}x | {b['fwd_s'] / r['fwd_s']:.1f}x"
                f" | {r['peak_extra_mib'] / max(b['peak_extra_mib'], 1e-9):.2f} |"
            )
        lines.append(
            f"{head} {1e3 * r['fwd_s']:.1f} | {1e3 * r['fwdbwd_s']:.1f} | "
            f"{r['peak_extra_mib']:.0f} |{ratios}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--queries", type=int, nargs="+", default=[2500, 10000])
    parser.add_argument("--all", action="store_true", help="add 40,000 queries")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--locations", nargs="+", default=["uniform"], choices=["uniform", "local"])
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per measurement (0: torch's own)"
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="250 queries, short runs, temp dir")
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(measure(**job)))
        return
    if args.quick:
        args.queries, args.min_run_time = [250], 0.1
        args.out = Path(tempfile.mkdtemp(prefix="qkv-bench-deformable-"))
    queries = args.queries + ([40000] if args.all else [])
    env = environment(args.threads)
    records = []
    for locations in args.locations:
        for dtype in args.dtypes:
            for q in queries:
                for impl in args.impls:
                    job = dict(
                        impl=impl,
                        dtype=dtype,
                        queries=q,
                        locations=locations,
                        min_run_time=args.min_run_time,
                        threads=args.threads,
                    )
                    record = measure_in_child(job, args.timeout)
                    records.append(record)
                    print(
                        f"{locations} {dtype} {q} {impl}: {record['status']} "
                        f"{1e3 * record.get('fwdbwd_s', float('nan')):.1f} ms fwd+bwd",
                        file=sys.stderr,
                    )
                    path = args.out / "deformable.json"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(dict(environment=env, records=records), indent=2))
    env["load_average_after"] = os.getloadavg()
    (args.out / "deformable.json").write_text(
        json.dumps(dict(environment=env, records=records), indent=2)
    )
    print(markdown(records, env))


if __name__ == "__main__":
    main()
