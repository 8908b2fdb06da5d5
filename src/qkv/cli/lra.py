"""``qkv lra``: Long Range Arena, locally: ListOps and Pathfinder against the attention kinds.

Thin: parses arguments, calls :func:`qkv.training.lra.run_lra` (which trains each cell with
``qkv train``'s machinery and writes ``lra_table.md`` and ``lra_table.json`` under ``--out``)
and prints the table's path and the Markdown table.
"""

from __future__ import annotations

import argparse
import sys

from ..training.lra import TASKS, VARIANTS, run_lra

__all__ = ["add_parser", "run_lra_cli"]

KINDS = ("exact", "linear", "performer", "local")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv lra``."""
    p = sub.add_parser(
        "lra",
        help="train the Long Range Arena table: ListOps and Pathfinder x attention kinds",
        description="Train each (task, attention) cell as qkv train does (progress bar, atomic "
        "checkpoints, a picture of one test example's attention) in OUT/TASK/ATTENTION, then "
        "write OUT/lra_table.md and OUT/lra_table.json: test accuracy, steps, wall time, seed "
        "and example counts per cell beside LRA's Table 1. The table is rewritten after each "
        "cell, so Ctrl-C loses no finished cell; --resume skips finished cells and continues "
        "the interrupted one. --variant cpu: about an hour on 2 cores (ListOps lengths "
        "100-500, Pathfinder-32 easy); lra: LRA's released configurations, for a GPU "
        "(--device cuda); tiny: a smoke test of seconds a cell.",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(TASKS),
        metavar="TASK",
        help=f"of {', '.join(TASKS)} (default both)",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        default=list(KINDS),
        metavar="KIND",
        help=f"attention kinds (default {' '.join(KINDS)})",
    )
    p.add_argument(
        "--variant", default="cpu", metavar="VARIANT", help=f"{' | '.join(VARIANTS)} (default cpu)"
    )
    p.add_argument(
        "--out",
        default="runs/lra",
        metavar="DIR",
        help="cells and table files go here (default runs/lra)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="steps per cell instead of the variant's",
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="where generated tasks are cached")
    p.add_argument(
        "--resume", action="store_true", help="skip finished cells, continue an interrupted one"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_lra_cli)


def run_lra_cli(args: argparse.Namespace) -> int:
    """``qkv lra``: run the table, print where it is and the table itself."""
    result = run_lra(
        args.tasks,
        args.attention,
        variant=args.variant,
        out=args.out,
        steps=args.steps,
        device=args.device,
        seed=args.seed,
        resume=args.resume,
        progress=not args.quiet,
        cache_dir=args.cache_dir,
    )
    with open(result.table_md) as f:
        print(f.read(), end="")
    print(f"\n{result.table_md}\n{result.table_json}")
    if result.interrupted:
        print(
            f"qkv lra: interrupted; the finished cells are in {result.table_md}; continue "
            f"with the same command and --resume",
            file=sys.stderr,
        )
        return 130
    return 0
