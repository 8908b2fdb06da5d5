"""``qkv`` entry point: argument parsing and dispatch to subcommands."""

from __future__ import annotations

import argparse
import sys

from ..training import preserve_torch_state
from . import bench, bench_decode, explain, lra, seeds, train, view

__all__ = ["main", "make_parser"]

# What a user can cause and fix: a bad value, a file or folder that is missing, exists, or
# cannot be written (OSError), an optional library that is not installed (ImportError). Each
# is one line and exit code 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def make_parser() -> argparse.ArgumentParser:
    """The ``qkv`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="qkv", description="Self-attention and multi-head attention: exact, fast, see-through."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (seeds, explain, bench, bench_decode, train, lra, view):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``qkv`` command line; return its exit code.

    Torch's global settings (threads, default dtype, grad mode, random number generators) are
    as they were before, so that calling it in-process (tests, notebooks) leaves no trace.
    """
    args = make_parser().parse_args(argv)
    try:
        with preserve_torch_state():
            return args.func(args)
    except USER_ERRORS as e:  # bad input: one line
        print(f"qkv {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a training loop (which stops cleanly by itself)
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
