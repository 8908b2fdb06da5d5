"""``qkv bench-decode``: time to generate one token at a given position, for a recurrent
linear-attention state and for a KV-cached softmax decoder.

The argument parsing and printing only: the benchmark itself (the decoders, the timed blocks,
one measurement in a fresh process, the ratios, the table, the JSON) is the library
:mod:`qkv.bench.decode`, whose docstring says what is measured and how. The names this module
held before the harness moved there are re-exported here, for callers of
``qkv.cli.bench_decode``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench.decode import (
    DECODE_IMPLS,
    DEFAULT_POSITIONS,
    GROWTH_TARGET,
    MAX_POSITION,
    DecodeConfig,
    decode_config,
    decode_environment,
    decode_markdown,
    decode_ratios,
    measure_decode,
    measure_in_child,
    run_decode,
)
from ..bench.report import load_previous
from .bench import out_folder

__all__ = [
    "DECODE_IMPLS",
    "DEFAULT_POSITIONS",
    "GROWTH_TARGET",
    "DecodeConfig",
    "add_parser",
    "decode_config",
    "decode_environment",
    "decode_markdown",
    "decode_ratios",
    "measure_decode",
    "measure_in_child",
    "run_decode",
    "run_decode_cli",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv bench-decode``."""
    p = sub.add_parser(
        "bench-decode",
        help="per-token generation time: recurrent linear attention vs a KV-cached decoder",
        description="Median time to generate one token at each position, for "
        "qkv.LinearAttentionState.step (elu, and FAVOR+) and for a KV-cached softmax decoder "
        "(KVCache.append + torch's SDPA), B=1, H=8, D=64, fp32. The decoder is prefilled to "
        "the position and rewound to it between timed blocks. A progress line per measurement "
        "goes to stderr, a Markdown table to stdout; --out DIR writes DIR/decode.json after "
        "every measurement.",
    )
    p.add_argument(
        "--positions",
        nargs="+",
        default=[str(t) for t in DEFAULT_POSITIONS],
        metavar="P",
        help=f"positions, 1 to {MAX_POSITION} (default: 1024 16384)",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        default=list(DECODE_IMPLS),
        metavar="IMPL",
        help=f"decoders (default: all of {', '.join(DECODE_IMPLS)})",
    )
    p.add_argument(
        "--tokens-per-block",
        default="16",
        metavar="N",
        help="steps timed between rewinds to the position (default 16)",
    )
    p.add_argument(
        "--min-run-time",
        default="0.5",
        metavar="SECONDS",
        help="timing budget of each measurement (default 0.5)",
    )
    p.add_argument(
        "--threads", default=None, metavar="N", help="torch threads (default: torch's own)"
    )
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/decode.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the measured records of DIR/decode.json from an earlier run of "
        "the same machine and torch, and measure only the rest",
    )
    p.set_defaults(func=run_decode_cli)


def run_decode_cli(args: argparse.Namespace) -> int:
    """``qkv bench-decode``: validate, measure, write, print the table."""
    config = decode_config(
        positions=args.positions,
        impls=args.impls,
        tokens_per_block=args.tokens_per_block,
        min_run_time=args.min_run_time,
        threads=args.threads,
    )
    out = Path(args.out) if args.out else None
    if args.resume and out is None:
        raise ValueError("--resume continues the run whose JSON is in --out DIR; give --out")
    json_path = out / "decode.json" if out else None
    try:
        with out_folder(out):
            previous = (
                load_previous(json_path, decode_environment(config))
                if args.resume and json_path is not None  # --resume has --out (checked)
                else None
            )
            result = run_decode(config, json_path, previous=previous)
    except KeyboardInterrupt:
        print(
            f"\nqkv bench-decode: interrupted"
            f"{f'; what was measured is in {json_path}' if out else ''}",
            file=sys.stderr,
        )
        return 130
    print(decode_markdown(result))
    if out:
        print(f"\nwrote {json_path}")
    return 0
