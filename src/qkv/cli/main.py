"""``qkv`` entry point: argument parsing and dispatch to subcommands."""

from __future__ import annotations

import argparse
import os
import sys

from ..training import preserve_torch_state
from ..training.parallel import LostPeer
from . import bench, bench_decode, explain, lra, seeds, train, tune, view

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
    for command in (seeds, explain, bench, bench_decode, train, lra, view, tune):
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
        if isinstance(e, LostPeer) and argv is None:  # the command itself, not a caller's
            _exit_now(2)
        return 2
    except KeyboardInterrupt:  # outside a training loop (which stops cleanly by itself)
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: a rank that lost a peer can hang there, on
    connections to the stopped or dead rank (gloo's, the rendezvous store's), after its error
    was said (a rank stopped by SIGSTOP: about 1 run in 3 of the hang test on 2 cores)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
