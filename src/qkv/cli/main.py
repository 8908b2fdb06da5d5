"""``qkv`` entry point: argument parsing and dispatch to subcommands."""
from __future__ import annotations

import argparse
import sys

from . import bench, bench_decode, explain, seeds, train

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``qkv`` command line; return its exit code."""
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention and multi-head attention: exact, fast, see-through."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    seeds.add_parser(sub)
    explain.add_parser(sub)
    bench.add_parser(sub)
    bench_decode.add_parser(sub)
    train.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as e:  # bad input: one line
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a training loop (which stops cleanly by itself)
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
