"""``qkv tune``: measure ``auto``'s choice of backend and the CPU routes' choices (native or
float32 half GEMMs, the bfloat16 kernel's GEMM) on this machine ahead of time."""

from __future__ import annotations

import argparse
import json
import sys

from .. import autotune
from ..bench.tune import TUNE_CASES, tune_grid, tune_routes

__all__ = ["add_parser", "run_tune"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="time the backends on this machine and keep auto's choices",
        description="For each case, dtype and length, time every backend that can take the "
        "call (those that compile on first use too, such as flex) and keep the fastest on "
        "disk, where backend='auto' finds it in later processes on this machine "
        "(QKV_AUTOTUNE=off ignores it); first the CPU's route choices (native or float32 "
        "half GEMMs, per half dtype and for one row; the bfloat16 kernel's GEMM), kept the same "
        "way. Prints one line per choice.",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--cases", nargs="+", default=list(TUNE_CASES), choices=TUNE_CASES)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64, help="head dim D")
    p.add_argument("--grad", action="store_true", help="time forward+backward (training)")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    p.set_defaults(func=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    for name in args.dtypes:
        if name not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"--dtypes: unknown dtype {name!r}; use float32, float16, bfloat16")
    print(f"machine: {autotune.machine_key()}")
    print(f"choices kept in {autotune.cache_path()}")
    for _ in tune_routes(progress=_print_route):  # kept on disk as they are measured
        pass
    rows = list(
        tune_grid(
            device=args.device,
            dtypes=tuple(args.dtypes),
            lengths=tuple(args.lengths),
            cases=tuple(args.cases),
            H=args.heads,
            D=args.dim,
            grad=args.grad,
            progress=_print_row,
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _print_route(row: dict) -> None:
    forced = row.get("forced")
    held = "" if forced is None else f" [{row['switch']}={forced} holds this process]"
    print(f"{row['choice']:28s} -> {row['reason']}{held}", flush=True)


def _print_row(row: dict) -> None:
    head = f"{row['case']:9s} {row['dtype']:9s} T={row['T']:<6d}"
    way = "" if row.get("way") is None else f"; its way: {row['way']}"
    if row["backend"] is None:
        print(f"{head} -> {row['reason']}{way}", flush=True)
        return
    times = ", ".join(
        f"{n} {t * 1e3:.3g} ms" for n, t in sorted(row["times"].items(), key=lambda x: x[1])
    )
    print(f"{head} -> {row['backend']:6s} ({times}){way}", flush=True)
    sys.stdout.flush()
