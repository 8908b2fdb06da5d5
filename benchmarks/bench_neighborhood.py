"""Neighborhood attention on CPU: qkv's tiled backend against dense SDPA and compiled Flex with
the same mask (issue 40, item 4). Forward, inference.

Grids (B=1, H=8, D=64): ``img64`` a 64x64 image with a 7x7 kernel, ``img128`` 128x128 with
13x13, ``video`` 16x32x32 with 7x7x7; fp32 and bf16. Every implementation of a row is timed
round-robin in the same rounds (median of at least 3), so ratios are taken under the same load:

* ``tiled-rows``: ``qkv.scaled_dot_product_attention(backend="tiled")`` with
  ``qkv.masks.neighborhood(kernel, shape)``, tokens row-major;
* ``tiled-tiles``: the same with the tokens laid out tile by tile
  (``qkv.masks.tile_layout``: 8x8 tiles, 4x4x4 in 3D, one 64-block each), the inputs
  permuted once outside the timing (a network keeps the layout between layers); the
  permutation's own cost (q, k, v in, the output back) is its own column;
* ``sdpa-dense``: torch's SDPA with the mask as a dense bool ``attn_mask`` (up to
  ``--dense-max`` tokens: a T^2 mask beyond);
* ``flex-rows``/``flex-tiles``: ``torch.compile(flex_attention)`` with a compiled
  ``create_block_mask`` of the same mask object (it is a FlexAttention mask_mod), built once
  outside the timing, in each token order;
* ``sdpa-plain``: torch's SDPA with no mask (up to ``--dense-max``), the machine's full
  attention speed, the yardstick of useful GFLOP/s.

Useful GFLOP/s = 4*B*H*D x (allowed pairs: N x prod(kernel)) / time (STYLE.md 15). The tiled
backend's first call (planning, then cached) is reported apart. Threads: ``--threads``
(default 1: on the shared 2-core box a second OpenMP thread waits for a descheduled peer at
every barrier, ~8 ms per parallel region under load, which swamps small kernels).

Writes ``OUT/neighborhood.json`` after every row and prints a Markdown table.

Usage:
    python benchmarks/bench_neighborhood.py [--grids img64 img128 video] [--dtypes fp32 bf16]
        [--threads 1] [--min-time 0.5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_cpu_isa import cpu_model  # the CPU named as every CPU benchmark names it
from bench_structured import interleaved  # median per call, timed round-robin

import qkv
from qkv import masks as M

B, H, D = 1, 8, 64
GRIDS = {
    "img64": ((64, 64), (7, 7), (8, 8)),
    "img128": ((128, 128), (13, 13), (8, 8)),
    "video": ((16, 32, 32), (7, 7, 7), (4, 4, 4)),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("tiled-rows", "tiled-tiles", "sdpa-dense", "flex-rows", "flex-tiles", "sdpa-plain")


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def flex_attend(mask, N: int):
    """Compiled Flex with a compiled block mask of ``mask`` (built here, once)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # each row compiles anew: past the recompile limit Flex runs eagerly
    block_mask = torch.compile(create_block_mask)(mask, None, None, N, N, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def implementations(grid: str, N: int, dense_max: int, flex: bool):
    """(name -> attend(q, k, v, qt, kt, vt), name -> reason skipped, masks); ``qt, kt, vt``
    are the inputs in the tiled order."""
    import torch.nn.functional as F

    shape, kernel, tile = GRIDS[grid]
    layout = M.tile_layout(shape, tile)
    rows = M.neighborhood(kernel, shape)
    tiles = M.neighborhood(kernel, shape, layout=layout)
    impls = {
        "tiled-rows": lambda q, k, v, *t: qkv.scaled_dot_product_attention(
            q, k, v, mask_mod=rows, backend="tiled"
        ),
        "tiled-tiles": lambda q, k, v, qt, kt, vt: qkv.scaled_dot_product_attention(
            qt, kt, vt, mask_mod=tiles, backend="tiled"
        ),
    }
    skipped = {}
    if dense_max >= N:
        dense = M.to_dense(rows, 1, 1, N, N)  # (1, 1, N, N) bool
        impls["sdpa-dense"] = lambda q, k, v, *t: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense
        )
        impls["sdpa-plain"] = lambda q, k, v, *t: F.scaled_dot_product_attention(q, k, v)
    else:
        why = f"a dense N^2 mask (and N^2 work) beyond --dense-max {dense_max}"
        skipped["sdpa-dense"] = skipped["sdpa-plain"] = why
    for name, mask, order in (("flex-rows", rows, 0), ("flex-tiles", tiles, 1)):
        if not flex:
            skipped[name] = "--no-flex"
            continue
        try:
            attend = flex_attend(mask, N)
            impls[name] = (
                (lambda q, k, v, *t, f=attend: f(q, k, v))
                if order == 0
                else (lambda q, k, v, qt, kt, vt, f=attend: f(qt, kt, vt))
            )
        except Exception as e:  # no compiler, no inductor CPU backend: say why
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return impls, skipped, (rows, tiles, layout)


def first_call(attend, args) -> float:
    """Seconds of the tiled backend's first call with an empty plan cache (planning included)."""
    qkv.ops.tiled.clear_plan_cache()
    t0 = time.perf_counter()
    with torch.no_grad():
        attend(*args)
    return time.perf_counter() - t0


def measure_row(grid: str, dt: str, args) -> list[dict]:
    """The records of one grid and dtype: every implementation timed interleaved."""
    shape, kernel, tile = GRIDS[grid]
    N = math.prod(shape)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(DTYPES[dt]) for _ in range(3))
    impls, skipped, (rows_mask, tiles_mask, layout) = implementations(
        grid, N, args.dense_max, not args.no_flex
    )
    inputs = (q, k, v, *(layout.to_tiles(t) for t in (q, k, v)))  # row-major, then tiled

    def step(fn):
        def call():
            with torch.no_grad():
                fn(*inputs)

        return call

    def permute():  # q, k, v into the tiled order, an output back
        layout.from_tiles(torch.cat([layout.to_tiles(t) for t in (q, k, v)]))

    firsts = {n: first_call(impls[n], inputs) for n in ("tiled-rows", "tiled-tiles")}
    permute_s = interleaved({"permute": permute}, 0.1)[0]["permute"]
    secs, failed = interleaved({n: step(f) for n, f in impls.items()}, args.min_time)
    skipped.update(failed)
    useful = 4.0 * B * H * D * N * math.prod(kernel)
    density = {
        name: M.block_summary(m, 1, 1, N, N, block=64).density
        for name, m in (("rows", rows_mask), ("tiles", tiles_mask))
    }
    records = []
    for impl in IMPLS:
        rec = dict(grid=grid, shape=shape, kernel=kernel, tile=tile, N=N, dtype=dt, impl=impl)
        if impl in secs:
            flops = 4.0 * B * H * D * N * N if impl == "sdpa-plain" else useful
            rec.update(status="ok", time_s=secs[impl], gflops=flops / secs[impl] / 1e9)
        else:
            rec.update(status="skipped", reason=skipped.get(impl, "not run"))
        if impl.startswith("tiled"):
            rec.update(first_call_s=firsts[impl], block_density=density[impl[6:]])
        if impl == "tiled-tiles":
            rec.update(permute_s=permute_s)
        records.append(rec)
    return records


def run(args) -> list[dict]:
    records: list[dict] = []
    env = dict(
        benchmark="bench_neighborhood",
        cpu=cpu_model(),
        capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
        qkv_commit=commit(),
        threads=torch.get_num_threads(),
        B=B,
        H=H,
        D=D,
        command=" ".join(["python", *sys.argv]),
        flops="4*B*H*D*N*prod(kernel) forward (useful pairs only)",
    )
    out_json = args.out / "neighborhood.json"
    rows = [(g, dt) for g in args.grids for dt in args.dtypes]
    for i, (grid, dt) in enumerate(rows, 1):
        shape, kernel, _ = GRIDS[grid]
        print(f"[{i}/{len(rows)}] {grid} {shape} k={kernel} {dt} ...", file=sys.stderr, flush=True)
        row = measure_row(grid, dt, args)
        records += row
        args.out.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(dict(environment=env, records=records), indent=2))
        done = "  ".join(f"{r['impl']} {r['time_s'] * 1e3:.1f} ms" for r in row if "time_s" in r)
        print("   " + done, file=sys.stderr, flush=True)
    return records


def ratio(times: list, best: float | None) -> float | None:
    """The fastest of ``times`` over ``best``; None where either is missing (skipped)."""
    times = [t for t in times if t is not None]
    return min(times) / best if times and best else None


def table(records: list[dict]) -> str:
    by = {(r["grid"], r["dtype"], r["impl"]): r for r in records}
    head = (
        "| grid | kernel | dtype | tiled-rows ms | tiled-tiles ms | best tiled GFLOP/s | "
        "sdpa-dense ms | flex-rows ms | flex-tiles ms | dense / best tiled | "
        "best flex / best tiled | sdpa-plain GFLOP/s |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for grid, dt in dict.fromkeys((r["grid"], r["dtype"]) for r in records):

        def ms(impl, g=grid, d=dt):
            r = by.get((g, d, impl))
            return r["time_s"] * 1e3 if r and r["status"] == "ok" else None

        def cell(x, fmt="{:.1f}"):
            return "skipped" if x is None else fmt.format(x)

        tiled = [x for x in (ms("tiled-rows"), ms("tiled-tiles")) if x is not None]
        flex = [x for x in (ms("flex-rows"), ms("flex-tiles")) if x is not None]
        best = min(tiled) if tiled else None
        r0 = by[(grid, dt, "tiled-rows")]
        gflops = None if best is None else r0["gflops"] * r0["time_s"] * 1e3 / best
        plain = by.get((grid, dt, "sdpa-plain"))
        lines.append(
            f"| {grid} {'x'.join(map(str, r0['shape']))} | {'x'.join(map(str, r0['kernel']))} "
            f"| {dt} | {cell(ms('tiled-rows'))} | {cell(ms('tiled-tiles'))} | {cell(gflops)} | "
            f"{cell(ms('sdpa-dense'))} | {cell(ms('flex-rows'))} | {cell(ms('flex-tiles'))} | "
            f"{cell(ratio([ms('sdpa-dense')], best), '{:.2f}')} | "
            f"{cell(ratio(flex, best), '{:.2f}')} | "
            f"{cell(plain['gflops'] if plain and plain['status'] == 'ok' else None)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--dense-max", type=int, default=4096)
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("QKV_AUTOTUNE", "off")
    records = run(args)
    env = json.loads((args.out / "neighborhood.json").read_text())["environment"]
    print(
        f"CPU: {env['cpu']} ({env['capability']}), torch {env['torch']}, "
        f"{env['threads']} thread(s), qkv {env['qkv_commit']}"
    )
    print(table(records))
    extra = [r for r in records if r["impl"].startswith("tiled") and r["status"] == "ok"]
    print("\n| grid | dtype | order | block density | first call ms | permute ms |")
    print("|---|---|---|---:|---:|---:|")
    for r in extra:
        perm = f"{r['permute_s'] * 1e3:.1f}" if "permute_s" in r else ""
        print(
            f"| {r['grid']} | {r['dtype']} | {r['impl'][6:]} | {r['block_density']:.3f} | "
            f"{r['first_call_s'] * 1e3:.0f} | {perm} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
