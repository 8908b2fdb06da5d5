"""``qkv train TASK``: train a model of ``qkv.models`` on a task of ``qkv.tasks``.

Thin: parses arguments into a recipe (:mod:`qkv.training.recipes`) and a
:class:`qkv.training.TrainConfig`, and calls :func:`qkv.training.train`, which shows the
progress bar, writes checkpoints atomically, resumes to the bit, and saves ``metrics.json``,
pictures and, beside each PNG, the viewer page of the same example (``cross_attention.html``
for ``reverse``/``copy``/``sort``, ``attention_last_layer.html`` for ``listops``/``digits``/
``pathfinder``;
``qkv view`` makes more) under ``--out``.

Data parallel: ``qkv train --nproc N ...`` starts N processes of this machine under torchrun's
launcher (:func:`qkv.training.launch.launch`: loopback only, the processes' exit status, Ctrl-C
to all of them), and ``torchrun --nproc_per_node N -m qkv train ...`` does the same from
outside; each process runs this command, rank 0 alone writes ``--out`` and prints the result.
``--batch-size`` is the global batch. The result equals a one-process run's with the same
global batch up to float rounding (the tolerance is in :mod:`qkv.training.trainer`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..models import attention_kinds
from ..training import TrainConfig, run_directory, train
from ..training.launch import launch
from ..training.lra import VARIANTS
from ..training.parallel import DEFAULT_TIMEOUT, check_batch, env_ranks
from ..training.recipes import RECIPES, make_recipe

__all__ = ["DEFAULTS", "PRESETS", "add_parser", "plan", "run_train_cli", "worker_argv"]

# Per task: quick CPU settings (the defaults).
DEFAULTS = {
    "reverse": dict(steps=500, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "copy": dict(steps=500, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "sort": dict(steps=800, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "listops": dict(
        steps=2000, batch_size=32, lr=1e-3, warmup_steps=200, schedule="cosine", weight_decay=0.01
    ),
    "digits": dict(
        steps=1500, batch_size=64, lr=2e-3, warmup_steps=100, schedule="cosine", weight_decay=0.05
    ),
    "pathfinder": dict(VARIANTS["cpu"]["pathfinder"]["train"]),  # qkv lra's cpu variant
}

# LRA's released ListOps configuration (TASKS.md): 4 layers, 8 heads, embedding 512, MLP 1024,
# batch 32, 5,000 steps, lr 0.05 with 1,000 warm-up steps then rsqrt decay, weight decay 0.1,
# lengths 500-2000. "lra-pathfinder": LRA's Pathfinder-32 configuration (qkv.training.lra's
# docstring); `--preset lra` on pathfinder means it.
PRESETS = {
    "lra": dict(
        task="listops",
        train=dict(
            steps=5000,
            batch_size=32,
            lr=0.05,
            warmup_steps=1000,
            schedule="rsqrt",
            weight_decay=0.1,
        ),
        model=dict(embed_dim=512, num_heads=8, num_layers=4, ffn_dim=1024, dropout=0.1),
        data=dict(variant="full"),
    ),
    "lra-pathfinder": dict(task="pathfinder", **VARIANTS["lra"]["pathfinder"]),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv train``."""
    p = sub.add_parser(
        "train",
        help="train a model on a locally generated task",
        description="Train a model of qkv.models on a task of qkv.tasks, with a progress bar, "
        "atomic checkpoints every --checkpoint-every steps, --resume to continue an "
        "interrupted run to the identical result, metrics.json and attention pictures in "
        "--out (each with an HTML viewer page of the same example beside its PNG: the "
        "cross-attention for reverse, copy, sort; every layer for listops, digits, "
        "pathfinder). Ctrl-C "
        "writes a checkpoint and stops. Data parallel: --nproc N, or torchrun "
        "--nproc_per_node N -m qkv train ...; rank 0 alone writes --out.",
    )
    p.add_argument("task", choices=sorted(RECIPES), help="the task")
    p.add_argument(
        "--attention",
        default="exact",
        choices=list(attention_kinds()),
        help="the attention of every layer (default exact)",
    )
    p.add_argument(
        "--window", type=int, default=None, help="keys each side for --attention local (default 32)"
    )
    p.add_argument(
        "--features",
        type=int,
        default=None,
        help="random features for --attention performer (default D ln D)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="lra: LRA's released ListOps config (full 500-2000 variant), or on "
        "pathfinder its Pathfinder-32 config (hard, 160,000 images; for a GPU)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="the global batch: examples a step over all processes, each of N "
        "processes takes every N-th (a multiple of N; default: the task's)",
    )
    p.add_argument("--lr", type=float, default=None)
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), cuda, ...; with several processes cuda gives process r "
        "cuda:LOCAL_RANK and NCCL (gloo on cpu)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument(
        "--variant",
        choices=("cpu", "full"),
        default=None,
        help="ListOps lengths: cpu 100-500 (default) or full 500-2000",
    )
    p.add_argument(
        "--difficulty",
        choices=("easy", "intermediate", "hard"),
        default=None,
        help="Pathfinder contours of 6, 9 or 14 paddles (default easy)",
    )
    p.add_argument(
        "--resolution",
        type=int,
        choices=(32, 64, 128),
        default=None,
        help="Pathfinder image side: 1,024, 4,096 or 16,384 pixel tokens "
        "(default 32; 128 is Path-X)",
    )
    p.add_argument("--cache-dir", default=None, help="where generated tasks are cached")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="checkpoint.pt, metrics.json, pictures and the viewer page go here",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="train data-parallel on N processes of this machine (torchrun's "
        "launcher, loopback only; DistributedDataParallel, metrics summed over the "
        "processes, rank 0 writes --out); ends where one process ends with the same "
        "--batch-size up to float rounding (without dropout: losses and parameters "
        "within 1e-5 after 20 steps, the same evaluation; qkv.training.trainer "
        "has the measurements). Default: this process alone, or what torchrun set",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="with several processes: how long one waits for the others before "
        "it gives up with an error (a process died or hangs; default "
        f"{DEFAULT_TIMEOUT:g})",
    )
    p.set_defaults(func=run_train_cli)


def plan(args: argparse.Namespace) -> tuple[dict, TrainConfig]:
    """What ``qkv train`` would run: :func:`make_recipe`'s keyword arguments (task included)
    and the :class:`TrainConfig`, from the task's defaults, then ``--preset``, then the
    options given. Nothing is loaded or trained.

    Raises:
        ValueError: An option that does not fit the task, or a ``--device`` this machine does
            not have (checked by :class:`TrainConfig`).
    """
    preset = PRESETS[args.preset] if args.preset else None
    if preset and preset["task"] != args.task:
        preset = PRESETS.get(f"{args.preset}-{args.task}")
        if preset is None:
            tasks = [p["task"] for n, p in PRESETS.items() if n.split("-")[0] == args.preset]
            raise ValueError(
                f"--preset {args.preset} is for {' and '.join(tasks)}, not {args.task}"
            )
    settings = dict(DEFAULTS[args.task], **(preset["train"] if preset else {}))
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    config = TrainConfig(
        seed=args.seed, device=args.device, checkpoint_every=args.checkpoint_every, **settings
    )
    check_batch(config.batch_size, _processes(args))
    data = dict(preset["data"]) if preset else {}
    if args.variant:
        if args.task != "listops":
            raise ValueError("--variant is a ListOps option")
        data["variant"] = args.variant
    for name in ("difficulty", "resolution"):
        if getattr(args, name) is not None:
            if args.task != "pathfinder":
                raise ValueError(f"--{name} is a Pathfinder option")
            data[name] = getattr(args, name)
    recipe = dict(
        task=args.task,
        attention=args.attention,
        attention_options=_attention_options(args),
        model=dict(preset["model"]) if preset else None,
        data=data,
        cache_dir=args.cache_dir,
    )
    return recipe, config


def run_train_cli(args: argparse.Namespace) -> int:
    """``qkv train``: build the recipe and config, train, print the evaluation.

    Everything that can be checked without data is checked before any is generated (the LRA
    preset generates 105 MB): the options and the device (by :func:`plan`), then ``--out``,
    made and written to once. A run that fails before writing there removes the folder again.
    With ``--nproc N`` (N > 1) the same command runs in N processes (:func:`worker_argv`);
    under torchrun, the ranks other than 0 print nothing but errors of their own.
    """
    recipe_kwargs, config = plan(args)
    if args.nproc is not None and args.nproc > 1:
        return launch(["-m", "qkv", *worker_argv(args)], args.nproc, prog="qkv train")
    ranks = env_ranks()
    if not ranks.main:
        return _other_rank(args, recipe_kwargs, config, ranks.rank)
    with run_directory(args.out) as out:
        recipe = make_recipe(**recipe_kwargs)
        result = train(
            recipe,
            config,
            out,
            resume=args.resume,
            progress=not args.quiet,
            timeout=args.dist_timeout,
        )
    if result.interrupted:
        print(
            f"qkv train: interrupted at step {result.step}; checkpoint in "
            f"{result.checkpoint}; continue with the same command and --resume",
            file=sys.stderr,
        )
        return 130
    print(
        json.dumps(
            dict(
                task=args.task,
                attention=args.attention,
                steps=result.step,
                final_loss=result.final_loss,
                evaluation=result.evaluation,
                pictures=result.pictures,
            ),
            indent=2,
        )
    )
    return 0


def _other_rank(
    args: argparse.Namespace, recipe_kwargs: dict, config: TrainConfig, rank: int
) -> int:
    """A rank other than 0: train without output. An error every rank raises alike (rank 0
    reports it) ends it quietly; one of its own is reported with its rank."""
    try:
        result = train(
            make_recipe(**recipe_kwargs),
            config,
            args.out,
            resume=args.resume,
            progress=False,
            timeout=args.dist_timeout,
        )
    except (ValueError, TypeError, OSError, ImportError) as e:
        if getattr(e, "qkv_on_every_rank", False):
            return 2
        text = " ".join(str(e).split()) or type(e).__name__
        where = "" if text.startswith("rank ") else f"rank {rank}: "
        print(f"qkv train: error: {where}{text}", file=sys.stderr)
        return 2
    return 130 if result.interrupted else 0


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``qkv`` command line each process of ``--nproc`` runs: ``args`` as given, every
    option spelled out, without ``--nproc``."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    argv = ["train", args.task]
    for action in sub.choices["train"]._actions:
        if not action.option_strings or action.dest in ("help", "nproc"):
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a flag
            argv += [action.option_strings[-1]] if value else []
        elif value is not None:
            argv += [action.option_strings[-1], str(value)]
    return argv


def _processes(args: argparse.Namespace) -> int:
    """How many processes will train: ``--nproc``, else what torchrun set (1 without it).

    Raises:
        ValueError: ``--nproc`` below 1 or given under torchrun; a ``--dist-timeout`` <= 0.
    """
    if not args.dist_timeout > 0:
        raise ValueError(
            f"--dist-timeout must be a positive number of seconds, got {args.dist_timeout:g}"
        )
    if args.nproc is None:
        return env_ranks().size
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if "WORLD_SIZE" in os.environ and args.nproc > 1:
        raise ValueError(
            f"--nproc {args.nproc} starts torchrun itself, but this process "
            f"already runs under torchrun (WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}): leave --nproc out"
        )
    if args.nproc > 1 and args.device.startswith("cuda"):
        import torch

        if ":" in args.device:
            raise ValueError(
                f"--device {args.device} would put all {args.nproc} processes on "
                f"one GPU; give --device cuda: process r then takes cuda:r"
            )
        if args.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {args.nproc} with --device cuda needs {args.nproc} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
    return args.nproc


def _attention_options(args: argparse.Namespace) -> dict:
    if args.window is not None and args.attention != "local":
        raise ValueError("--window is for --attention local")
    if args.features is not None and args.attention != "performer":
        raise ValueError("--features is for --attention performer")
    if args.attention == "local":
        return dict(window=32 if args.window is None else args.window)
    if args.attention == "performer" and args.features is not None:
        return dict(num_features=args.features)
    return {}
