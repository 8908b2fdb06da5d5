"""The end of a run: the evaluation (shared by the ranks of a data-parallel run),
``metrics.json`` written atomically, then the recipe's pictures (none without matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from .checkpoint import _Run
from .config import Recipe, TrainResult
from .files import write_atomic
from .parallel import all_sum
from .stopping import _collective

__all__ = ["METRICS"]

METRICS = "metrics.json"


def _write_json_atomic(data: dict, path: Path) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(data, indent=2).encode()))


def _finish(run: _Run, recipe: Recipe, result: TrainResult, out: Path) -> None:
    """Evaluate, then rank 0 writes ``metrics.json`` and draws the pictures. The results are
    written first: a picture that cannot be drawn (matplotlib missing) must not lose them."""
    run.model.eval()
    with torch.no_grad():
        result.evaluation = _collective(run, "evaluation", lambda: _evaluate(run, recipe))
    if not run.ranks.main:
        return
    _write_metrics(run, result, out)
    with torch.no_grad():
        result.pictures = _pictures(recipe, run.model, out, run.device)
    if result.pictures:
        _write_metrics(run, result, out)


def _evaluate(run: _Run, recipe: Recipe) -> dict[str, float]:
    """The recipe's evaluation. With several ranks, each evaluates its share of the test
    batches and their counts are summed (``Recipe.evaluation_counts``), or, for a recipe
    without it, each evaluates the whole test set."""
    counts = getattr(recipe, "evaluation_counts", None)
    if not run.ranks.distributed or counts is None:
        return recipe.evaluate(run.model, run.device)
    mine = counts(run.model, run.device, run.ranks.rank, run.ranks.size)
    names = sorted(mine)  # the same order on every rank
    sums = dict(zip(names, all_sum([mine[k] for k in names], run.ranks, run.device)))
    n = sums.pop("test_examples")
    return {**{k: v / n for k, v in sums.items()}, "test_examples": int(n)}


def _write_metrics(run: _Run, result: TrainResult, out: Path) -> None:
    _write_json_atomic(
        dict(
            run.ident,
            step=run.step,
            final_loss=result.final_loss,
            evaluation=result.evaluation,
            pictures=result.pictures,
            history=run.history,
        ),
        out / METRICS,
    )


def _pictures(recipe: Recipe, model: nn.Module, out: Path, device: torch.device) -> list[str]:
    """The recipe's pictures; none, and one warning line on stderr, when an optional library
    they need (matplotlib) is missing."""
    try:
        return recipe.pictures(model, out, device)
    except ImportError as e:
        print(
            f"{recipe.name}: warning: no pictures ({e}); the results are in {out / METRICS}",
            file=sys.stderr,
        )
        return []
