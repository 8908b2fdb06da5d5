"""Multi-scale deformable attention on a GPU: qkv's Triton kernels against the ``grid_sample``
fallback (issue 40, item 1).

BEVFormer's level set (feature maps 116x200, 58x100, 29x50, 15x25; S = 30,825), 8 heads x 32,
4 points per level and head, batch 1, at 2,500 and 40,000 queries, in float32 and bfloat16;
locations uniform over the maps (every corner a cache miss, the worst case), weights
softmaxed over levels x points (``bench_deformable.make_inputs``, the CPU benchmark's inputs).

Implementations, each timed as forward (inference: inputs that want no gradient) and
forward+backward (``triton.testing.do_bench`` median, ms):

  * ``grid_sample``: mmcv's ``multi_scale_deformable_attn_pytorch`` (one ``F.grid_sample`` per
    level, autograd for the backward; its backward adds with atomics), which is
    ``qkv.ops.deformable.deformable_attention_naive``;
  * ``qkv-triton``: ``qkv.deformable_attention`` on its Triton kernels (``kernel="triton"``;
    what ``auto`` takes on CUDA: ``auto_kernel`` says so);
  * ``qkv-torch``: the same on its plain-PyTorch path (``--impls`` leaves it out).

Per row also: the peak memory a forward+backward allocates beyond its inputs
(``torch.cuda.max_memory_allocated``), the Triton kernels' errors against a float64 reference
(grid_sample in float64 on the same rounded inputs) beside grid_sample's own error in the
dtype (the tolerance policy: ``within_policy`` when at most 2x for the output, 3x for the
gradients, plus 1e-5), whether two backward runs gave the same bits (``bit_identical``), and
whether a call synchronised the device (``sync_free``; spatial_shapes on the GPU, as mmcv keeps
it).

The machine's time is lent in minutes: the configurations run most informative first and no
new one starts after ``--budget-s``; what was skipped is listed. ``--out`` is rewritten after
every row.

``--dry-run`` checks the script without a GPU: CPU tensors, levels a twentieth of
BEVFormer's, 16 queries, every configuration whatever the budget, the Triton kernels under
triton's interpreter, one plain call per timing; its figures mean nothing.

Usage:
    python benchmarks/gpu_deformable.py --out benchmarks/results/gpu_deformable.json
    python benchmarks/gpu_deformable.py --dry-run --out /tmp/gpu_deformable_dry.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import gpu_common
import torch
from bench_deformable import LEVELS, make_inputs  # the CPU benchmark's inputs
from gpu_common import sync_free, timer, write_json

from qkv.ops import deformable
from qkv.ops.deformable import op

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUERIES = (2500, 40000)
IMPLS = ("grid_sample", "qkv-triton", "qkv-torch")
MODES = ("fwd", "fwdbwd")
DRY_LEVELS = [(6, 10), (3, 5), (2, 3), (1, 2)]  # BEVFormer's aspect, a twentieth of its size
DEFAULT_OUT = Path("benchmarks/results/gpu_deformable.json")
NAMES = ("out", "d_value", "d_loc", "d_attn")


def attend_fn(impl: str):
    """(value, spatial_shapes, locations, weights) -> output, for ``impl``."""
    if impl == "grid_sample":
        return deformable.deformable_attention_naive
    kernel = impl.removeprefix("qkv-")
    return lambda *args: deformable.deformable_attention(*args, kernel=kernel)


def step(attend, inputs, mode: str):
    """The timed call: a forward without gradients, or a forward and a backward."""
    value, shapes, loc, weights = inputs
    if mode == "fwd":
        return lambda: attend(value.detach(), shapes, loc.detach(), weights.detach())
    leaves = [value, loc, weights]
    grad_out = torch.ones(1, device=value.device, dtype=value.dtype)

    def fwd_bwd():
        out = attend(value, shapes, loc, weights)  # (1, Lq, M*D)
        torch.autograd.grad(out, leaves, grad_out.expand_as(out))

    return fwd_bwd


def outputs_and_grads(attend, inputs, grad_out) -> list[torch.Tensor]:
    value, shapes, loc, weights = (t.detach() for t in inputs)
    leaves = [t.requires_grad_() for t in (value, loc, weights)]
    out = attend(leaves[0], shapes, leaves[1], leaves[2])
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def peak_mib(fn, device) -> float | None:
    """MiB a call allocates at its peak beyond what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def accuracy(inputs, grad_out) -> dict:
    """The Triton kernels' and grid_sample's errors against the float64 golden, per tensor;
    whether the policy holds; whether two backward runs gave the same bits."""
    golden_in = [t.detach().double() for t in inputs]
    golden_in[1] = inputs[1]
    golden = outputs_and_grads(attend_fn("grid_sample"), golden_in, grad_out.double())
    baseline = outputs_and_grads(attend_fn("grid_sample"), inputs, grad_out)
    first = outputs_and_grads(attend_fn("qkv-triton"), inputs, grad_out)
    second = outputs_and_grads(attend_fn("qkv-triton"), inputs, grad_out)
    errors, base_errors, holds = {}, {}, True
    for i, name in enumerate(NAMES):
        errors[name], base_errors[name] = (
            max_error(first[i], golden[i]),
            max_error(baseline[i], golden[i]),
        )
        factor = 2 if i == 0 else 3
        holds &= errors[name] <= factor * base_errors[name] + 1e-5
    same = all(torch.equal(a, b) for a, b in zip(first, second))
    return dict(
        error_triton=errors, error_grid_sample=base_errors, within_policy=holds, bit_identical=same
    )


def measure_config(dtype: str, queries: int, args, device, bench) -> list[dict]:
    """The rows of one (dtype, queries): one per mode."""
    value, shapes, loc, weights = make_inputs(queries, DTYPES[dtype], "uniform", levels=args.levels)
    inputs = [t.to(device) for t in (value, shapes, loc, weights)]
    for t in (inputs[0], inputs[2], inputs[3]):
        t.requires_grad_()
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(
        *inputs[0].shape[:1], queries, value.shape[2] * value.shape[3], generator=g
    )
    grad_out = grad_out.to(device, DTYPES[dtype])
    checks = accuracy(inputs, grad_out)
    rows = []
    for mode in args.modes:
        times, peaks, failed = {}, {}, {}
        for impl in args.impls:
            fn = step(attend_fn(impl), inputs, mode)
            try:
                times[impl] = bench(fn)
                peaks[impl] = peak_mib(fn, device)
            except Exception as e:  # an implementation that cannot run this size: say why
                failed[impl] = f"{type(e).__name__}: {e}"[:300]
                print(f"{impl} {dtype} {queries} {mode}: {failed[impl]}", file=sys.stderr)
        ours, base = times.get("qkv-triton"), times.get("grid_sample")
        row = dict(
            dtype=dtype,
            queries=queries,
            mode=mode,
            device=args.device_name,
            ms=times,
            peak_mib=peaks,
            failed=failed,
            speedup_vs_grid_sample=base / ours if ours and base else None,
            memory_vs_grid_sample=(
                peaks["qkv-triton"] / peaks["grid_sample"]
                if peaks.get("qkv-triton") is not None and peaks.get("grid_sample")
                else None
            ),
            sync_free=sync_free(step(attend_fn("qkv-triton"), inputs, mode), device),
            auto_kernel=op.pick_kernel("auto", device),
            **checks,
        )
        rows.append(row)
        print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(r: dict) -> str:
    ms = ", ".join(f"{k} {t:.3f}" for k, t in r["ms"].items())
    up = "-" if r["speedup_vs_grid_sample"] is None else f"{r['speedup_vs_grid_sample']:.1f}x"
    return f"{r['dtype']} Lq={r['queries']:6d} {r['mode']:6s} ms: {ms} | triton {up} grid_sample"


def environment(device, dry: bool, levels) -> dict:
    return gpu_common.environment(
        "gpu_deformable",
        device,
        dry,
        levels=levels,
        heads=8,
        head_dim=32,
        points=4,
        batch=1,
        locations="uniform",
    )


def markdown(data: dict) -> str:
    """The table for RESULTS.md: ms per implementation, triton's speed-up and memory ratio
    against grid_sample, its worst error ratio to grid_sample's own, determinism, syncs."""
    impls = sorted({n for r in data["rows"] for n in r["ms"]})
    head = ["dtype", "queries", "mode", *[f"{n} ms" for n in impls]]
    head += ["speed-up", "peak / grid_sample", "policy", "bit-identical", "syncs"]
    lines = [
        f"### Deformable attention: Triton against grid_sample ({data['device']}, ms)",
        "",
        (
            f"torch {data['torch']}, triton {data.get('triton', '-')}, CUDA "
            f"{data.get('cuda', '-')}; levels {data['levels']}, 8 heads x 32, 4 points, batch 1, "
            "uniform locations; speed-up = grid_sample ms / qkv-triton ms; policy: the Triton "
            "kernels' errors against float64 within 2x (output) / 3x (gradients) of "
            "grid_sample's own in the dtype."
        ),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]

    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in data["rows"]:
        cells = [r["dtype"], f"{r['queries']:,}", r["mode"]]
        cells += [cell(r["ms"].get(n), ".3f") for n in impls]
        cells += [
            cell(r["speedup_vs_grid_sample"], ".1f") + ("x" if r["speedup_vs_grid_sample"] else ""),
            cell(r["memory_vs_grid_sample"], ".2f"),
            "holds" if r["within_policy"] else "FAILS",
            "yes" if r["bit_identical"] else "NO",
            {None: "-", True: "none", False: "syncs"}[r["sync_free"]],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if data.get("skipped"):
        lines += ["", f"Not reached within the budget: {', '.join(data['skipped'])}."]
    return "\n".join(lines)


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    bench = timer(args.dry_run, args.warmup, args.rep, rounds=1)  # the interpreter: one call
    data = dict(environment(device, args.dry_run, args.levels), rows=[], skipped=[])
    args.device_name = data["device"]
    t0 = time.monotonic()
    for queries in args.queries:
        for dtype in args.dtypes:
            if time.monotonic() - t0 > args.budget_s:
                data["skipped"].append(f"{dtype} Lq={queries}")
                continue
            data["rows"] += measure_config(dtype, queries, args, device, bench)
            data["elapsed_s"] = round(time.monotonic() - t0, 1)
            write_json(args.out, data)
    write_json(args.out, data)
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--queries", type=int, nargs="+", default=list(QUERIES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions, ms")
    p.add_argument("--budget-s", type=float, default=60.0, help="no new configuration after")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script")
    args = p.parse_args(argv)
    args.levels = [list(hw) for hw in LEVELS]
    if "qkv-triton" not in args.impls:
        args.impls = [*args.impls, "qkv-triton"]  # the subject of the benchmark
    stack = contextlib.ExitStack()
    if args.dry_run:
        from qkv.ops.triton import interpreter

        args.queries, args.levels = [16], [list(hw) for hw in DRY_LEVELS]
        args.budget_s = float("inf")
        stack.enter_context(interpreter())
    elif not torch.cuda.is_available():
        print(
            "gpu_deformable: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--dry-run checks the script on the CPU. Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    with stack:
        data = run(args)
    print(markdown(data))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["within_policy"] and r["bit_identical"] for r in data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
