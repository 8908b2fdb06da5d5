"""``qkv bench``: the tiled backend against torch's SDPA with dense masks, in time and memory.

The argument parsing and printing only: the benchmark itself (the grid, one measurement in a
fresh process, the ratios, the table, the JSON) is the library :mod:`qkv.bench`, whose
docstring says what is measured and how. The names this module held before the harness moved
there are re-exported here, for callers of ``qkv.cli.bench``.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ..bench import (
    ALL_IMPLS,
    CASES,
    DTYPES,
    IMPLS,
    LINEAR_IMPLS,
    MODES,
    PEER,
    PEERS,
    BenchConfig,
    Crossover,
    Spec,
    add_ratios,
    attention_flops,
    available_bytes,
    bench_config,
    crossover_marks,
    crossovers,
    dense_bytes,
    document_ids,
    document_lengths,
    environment,
    grid,
    linear_attention_flops,
    load_previous,
    markdown_table,
    mask_density,
    mask_mod_for,
    measure,
    num_features,
    ratio_of,
    run_measurement,
    run_name,
    run_specs,
    skip_reason,
    spec_flops,
    worker_main,
    write_json_atomic,
)
from ..bench.specs import DEFAULT_LENGTHS, DENSE_MAX_T, MAX_T, REFERENCE_MAX_T
from ..training import run_directory

__all__ = [
    "ALL_IMPLS",
    "CASES",
    "DTYPES",
    "IMPLS",
    "LINEAR_IMPLS",
    "MODES",
    "PEER",
    "PEERS",
    "BenchConfig",
    "Crossover",
    "Spec",
    "add_parser",
    "add_ratios",
    "attention_flops",
    "available_bytes",
    "bench_config",
    "crossover_marks",
    "crossovers",
    "dense_bytes",
    "document_ids",
    "document_lengths",
    "environment",
    "grid",
    "linear_attention_flops",
    "load_previous",
    "markdown_table",
    "mask_density",
    "mask_mod_for",
    "measure",
    "num_features",
    "out_folder",
    "ratio_of",
    "run_bench_cli",
    "run_measurement",
    "run_name",
    "run_specs",
    "skip_reason",
    "spec_flops",
    "worker_main",
    "write_json_atomic",
]


# ---- the command line ---------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv bench``."""
    p = sub.add_parser(
        "bench",
        help="time the tiled backend against torch's SDPA with dense masks",
        description="Time and peak memory of qkv's tiled backend, auto, torch's SDPA with the "
        "mask passed densely, and the reference backend, on no mask, causal, a 256-key "
        "sliding window and packed documents; with --impls linear performer torch, linear "
        "attention against torch's native SDPA on no mask and causal. Each measurement runs "
        "in a fresh process; a progress line per measurement goes to stderr, a Markdown table "
        "to stdout; --out DIR writes DIR/tiled.json (after every measurement) and "
        "DIR/tiled.png, or DIR/linear.json and DIR/linear.png when a linear impl is asked for.",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=list(CASES),
        metavar="CASE",
        help=f"cases to run (default: all of {', '.join(CASES)})",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        default=[str(t) for t in DEFAULT_LENGTHS],
        metavar="T",
        help=f"sequence lengths, 1 to {MAX_T} (default: 1024 2048 4096)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        metavar="DTYPE",
        help="fp32 and/or bf16 (default: both)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        metavar="MODE",
        help="fwd (no_grad) and/or fwdbwd (default: both)",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        default=list(IMPLS),
        metavar="IMPL",
        help=f"implementations (default: {', '.join(IMPLS)}); also "
        f"{', '.join(LINEAR_IMPLS)}: linear attention (elu), FAVOR+ and torch's "
        "native SDPA, the linear ones' peer (cases none and causal only)",
    )
    p.add_argument(
        "--min-run-time",
        default="0.5",
        metavar="SECONDS",
        help="timing budget of each measurement (default 0.5)",
    )
    p.add_argument(
        "--timeout",
        default="600",
        metavar="SECONDS",
        help="limit on each measurement's process (default 600)",
    )
    p.add_argument(
        "--threads",
        default=None,
        metavar="N",
        help="torch threads per measurement (default: torch's own)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        dest="run_all",
        help=f"also run torch-dense and torch beyond T={DENSE_MAX_T} and reference "
        f"beyond T={REFERENCE_MAX_T} (memory permitting; torch, O(T) memory, takes "
        "tens of seconds a call at T=65536)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write DIR/tiled.json and DIR/tiled.png (linear.json, linear.png with a linear impl)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the measured records of the JSON in --out from an earlier run of "
        "the same machine and torch, and measure only the rest",
    )
    p.set_defaults(func=run_bench_cli)


def run_bench_cli(args: argparse.Namespace) -> int:
    """``qkv bench``: validate, measure, write, print the table; 0 when it ran to the end."""
    config = bench_config(
        cases=args.cases,
        lengths=args.lengths,
        dtypes=args.dtypes,
        modes=args.modes,
        impls=args.impls,
        min_run_time=args.min_run_time,
        timeout=args.timeout,
        threads=args.threads,
        run_all=args.run_all,
    )
    out = Path(args.out) if args.out else None
    if args.resume and out is None:
        raise ValueError("--resume continues the run whose JSON is in --out DIR; give --out")
    name = run_name(config.impls)
    json_path = out / f"{name}.json" if out else None
    try:
        with out_folder(out):
            previous = (
                load_previous(json_path, environment(config))
                if args.resume and json_path is not None  # --resume has --out (checked)
                else None
            )
            records = run_specs(grid(config), config, json_path, previous=previous)
    except KeyboardInterrupt:
        print(
            f"\nqkv bench: interrupted{f'; what was measured is in {json_path}' if out else ''}",
            file=sys.stderr,
        )
        return 130
    print(markdown_table(records))
    if out:
        print(f"\nwrote {json_path}")
        _plot(records, out / f"{name}.png")
    return 0


def out_folder(out: Path | None) -> AbstractContextManager:
    """``with out_folder(out):`` makes ``--out`` and checks it can be written to now, not
    after the first measurement (ValueError saying why not), and removes it again if the run
    fails or is interrupted before writing in it. Does nothing when ``out`` is None."""
    return run_directory(out) if out is not None else nullcontext()


def _plot(records: list[dict], path: Path) -> None:
    from ..viz.benchplot import plot_bench  # matplotlib is optional: import only when plotting

    try:
        print(f"wrote {plot_bench(records, path, marks=crossover_marks(records))}")
    except ImportError:  # the measurements are in the JSON already: say so, do not fail
        print("no plot: matplotlib is not installed (pip install 'qkv[viz]')", file=sys.stderr)
    except OSError as e:
        print(f"no plot: cannot write {path} ({e.strerror or e})", file=sys.stderr)
