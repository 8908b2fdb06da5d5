"""``qkv train TASK``: train a model of ``qkv.models`` on a task of ``qkv.tasks``.

Thin: parses arguments into a recipe (:mod:`qkv.training.recipes`) and a
:class:`qkv.training.TrainConfig`, and calls :func:`qkv.training.train`, which shows the
progress bar, writes checkpoints atomically, resumes to the bit, and saves ``metrics.json``,
pictures and, beside each PNG, the viewer page of the same example (``cross_attention.html``
for ``reverse``/``copy``/``sort``, ``attention_last_layer.html`` for ``listops``/``digits``;
``qkv view`` makes more) under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..models import attention_kinds
from ..training import TrainConfig, run_directory, train
from ..training.recipes import RECIPES, make_recipe

__all__ = ["add_parser", "plan", "run_train_cli", "PRESETS", "DEFAULTS"]

# Per task: quick CPU settings (the defaults).
DEFAULTS = {
    "reverse": dict(steps=500, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "copy": dict(steps=500, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "sort": dict(steps=800, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine"),
    "listops": dict(steps=2000, batch_size=32, lr=1e-3, warmup_steps=200, schedule="cosine",
                    weight_decay=0.01),
    "digits": dict(steps=1500, batch_size=64, lr=2e-3, warmup_steps=100, schedule="cosine",
                   weight_decay=0.05),
}

# LRA's released ListOps configuration (TASKS.md): 4 layers, 8 heads, embedding 512, MLP 1024,
# batch 32, 5,000 steps, lr 0.05 with 1,000 warm-up steps then rsqrt decay, weight decay 0.1,
# lengths 500-2000.
PRESETS = {
    "lra": dict(task="listops",
                train=dict(steps=5000, batch_size=32, lr=0.05, warmup_steps=1000,
                           schedule="rsqrt", weight_decay=0.1),
                model=dict(embed_dim=512, num_heads=8, num_layers=4, ffn_dim=1024, dropout=0.1),
                data=dict(variant="full")),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv train``."""
    p = sub.add_parser(
        "train", help="train a model on a locally generated task",
        description="Train a model of qkv.models on a task of qkv.tasks, with a progress bar, "
        "atomic checkpoints every --checkpoint-every steps, --resume to continue an "
        "interrupted run to the identical result, metrics.json and attention pictures in "
        "--out (each with an HTML viewer page of the same example beside its PNG: the "
        "cross-attention for reverse, copy, sort; every layer for listops, digits). Ctrl-C "
        "writes a checkpoint and stops.")
    p.add_argument("task", choices=sorted(RECIPES), help="the task")
    p.add_argument("--attention", default="exact", choices=list(attention_kinds()),
                   help="the attention of every layer (default exact)")
    p.add_argument("--window", type=int, default=None,
                   help="keys each side for --attention local (default 32)")
    p.add_argument("--features", type=int, default=None,
                   help="random features for --attention performer (default D ln D)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="lra: LRA's released ListOps config (full 500-2000 variant)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--variant", choices=("cpu", "full"), default=None,
                   help="ListOps lengths: cpu 100-500 (default) or full 500-2000")
    p.add_argument("--cache-dir", default=None, help="where generated tasks are cached")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="checkpoint.pt, metrics.json, pictures and the viewer page go here")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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
        raise ValueError(f"--preset {args.preset} is for {preset['task']}, not {args.task}")
    settings = dict(DEFAULTS[args.task], **(preset["train"] if preset else {}))
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    config = TrainConfig(seed=args.seed, device=args.device,
                         checkpoint_every=args.checkpoint_every, **settings)
    data = dict(preset["data"]) if preset else {}
    if args.variant:
        if args.task != "listops":
            raise ValueError("--variant is a ListOps option")
        data["variant"] = args.variant
    recipe = dict(task=args.task, attention=args.attention,
                  attention_options=_attention_options(args),
                  model=dict(preset["model"]) if preset else None, data=data,
                  cache_dir=args.cache_dir)
    return recipe, config


def run_train_cli(args: argparse.Namespace) -> int:
    """``qkv train``: build the recipe and config, train, print the evaluation.

    Everything that can be checked without data is checked before any is generated (the LRA
    preset generates 105 MB): the options and the device (by :func:`plan`), then ``--out``,
    made and written to once. A run that fails before writing there removes the folder again.
    """
    recipe_kwargs, config = plan(args)
    with run_directory(args.out) as out:
        recipe = make_recipe(**recipe_kwargs)
        result = train(recipe, config, out, resume=args.resume, progress=not args.quiet)
    if result.interrupted:
        print(f"qkv train: interrupted at step {result.step}; checkpoint in "
              f"{result.checkpoint}; continue with the same command and --resume",
              file=sys.stderr)
        return 130
    print(json.dumps(dict(task=args.task, attention=args.attention, steps=result.step,
                          final_loss=result.final_loss, evaluation=result.evaluation,
                          pictures=result.pictures), indent=2))
    return 0


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
