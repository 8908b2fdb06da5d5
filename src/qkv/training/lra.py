"""Long Range Arena, locally: ListOps and Pathfinder against the attention kinds, one table.

:func:`run_lra` trains every (task, attention) cell with the machinery of ``qkv train``
(:func:`qkv.training.train`: atomic checkpoints, resume, a progress bar, ``metrics.json``, a
picture of the attention of one test example), one folder per cell, ``OUT/TASK/ATTENTION``,
and writes ``OUT/lra_table.md`` and ``OUT/lra_table.json``: per cell the test accuracy, the
majority class of the test set, steps, batch, wall time, seed, example counts, and LRA's
Table 1 (Tay et al. 2020) beside it. Text, Retrieval and Image need downloads; Path-X failed
for every model in the paper: a local LRA is ListOps plus Pathfinder.

The table files are written again after every cell, atomically, so a Ctrl-C (the cell's
training writes its checkpoint and stops) or a crash loses no finished cell. ``resume=True``
skips the finished cells (``OUT/TASK/ATTENTION/cell.json`` holds the result and what was
run; a cell whose settings differ is refused) and continues the interrupted one from its
checkpoint; its wall time adds the parts.

Variants (:data:`VARIANTS`):

* ``cpu``: the whole table (2 tasks x 4 kinds) in about an hour on 2 cores. ListOps: the
  ``cpu`` lengths 100-500 and ``qkv train listops``'s defaults (5,000 / 500 examples, C=64,
  4 heads, 2 layers, 2,000 steps of 32). Pathfinder-32 ``easy``: 10,000 / 1,000 images,
  1,024 pixel tokens, C=32, 2 heads, 1 layer, MLP 64, 600 steps of 32, lr 2e-3. Measured
  on the 2-core box (shared with another job): the exact cell takes 356 s (training 1.7
  steps/s, evaluation, pictures); a step of linear takes about 1.1x exact's, Performer 1.8x,
  local (window 32) 0.35x; the ListOps cells took 261-483 s (benchmarks/RESULTS.md), so the
  table takes about 50 minutes. In that measurement exact attention stayed at chance on
  Pathfinder (50.0%, the loss flat at 0.693 over 19,200 examples): pixel-sequence models
  learn Pathfinder late (LRA trains 200 epochs of 160,000 images), and 2 cores give a cell
  about 2 epochs of 10,000 images. The CPU table shows where the kinds start, not LRA's ends.
* ``lra``: LRA's released configurations, for a GPU (``device="cuda"``). ListOps: the full
  500-2000 lengths, 96,000 / 2,000 examples, 4 layers, 8 heads, C=512, MLP 1024, 5,000 steps
  of 32, lr 0.05, rsqrt after 1,000 warm-up steps, weight decay 0.1 (``qkv train listops
  --preset lra``). Pathfinder-32 ``hard`` (LRA's ``curv_contour_length_14``): 160,000 /
  20,000 images, ``pathfinder32/transformer_base.py``: 1 layer, 4 heads, embedding 128, MLP
  128, dropout 0.2, mean pooling, 62,400 steps of 512 (200 epochs), lr 1e-3, a warm-up of one
  epoch (312 steps) then cosine decay, no weight decay, no gradient clipping. Differences:
  LRA's queries and keys are 64 wide (``qkv_dim``) where ours are 128, and its positions are
  sinusoidal where ours are learned (as the issue asks).
* ``tiny``: a smoke test, seconds a cell (a few steps of tiny models on 64 examples); what
  CI runs.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import attention_kinds
from .files import run_directory, write_atomic
from .recipes import make_recipe
from .trainer import CHECKPOINT, METRICS, TrainConfig, check_device, train

__all__ = [
    "CELL",
    "LRA_NAMES",
    "LRA_TABLE1",
    "TABLE_JSON",
    "TABLE_MD",
    "TASKS",
    "VARIANTS",
    "LRAResult",
    "cell_settings",
    "run_lra",
]

TASKS = ("listops", "pathfinder")
CELL = "cell.json"
TABLE_JSON = "lra_table.json"
TABLE_MD = "lra_table.md"

# LRA paper (Tay et al. 2020), Table 1: test accuracy, %.
LRA_TABLE1 = {
    "listops": {"exact": 36.37, "local": 15.82, "linear": 16.13, "performer": 18.01},
    "pathfinder": {"exact": 71.40, "local": 66.63, "linear": 75.30, "performer": 77.05},
}
LRA_NAMES = {
    "exact": "Transformer",
    "local": "Local Attention",
    "linear": "Linear Transformer",
    "performer": "Performer",
}

_LISTOPS_CPU = dict(
    train=dict(
        steps=2000, batch_size=32, lr=1e-3, warmup_steps=200, schedule="cosine", weight_decay=0.01
    ),
    model=dict(embed_dim=64, num_heads=4, num_layers=2, ffn_dim=128, dropout=0.1),
    data=dict(variant="cpu"),
)
_PATHFINDER_CPU = dict(
    train=dict(
        steps=600, batch_size=32, lr=2e-3, warmup_steps=50, schedule="cosine", weight_decay=0.01
    ),
    model=dict(embed_dim=32, num_heads=2, num_layers=1, ffn_dim=64, dropout=0.0, pooling="mean"),
    data=dict(resolution=32, difficulty="easy"),
)

VARIANTS: dict[str, dict[str, dict]] = {
    "cpu": {"listops": _LISTOPS_CPU, "pathfinder": _PATHFINDER_CPU},
    "lra": {
        "listops": dict(
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
        "pathfinder": dict(
            train=dict(
                steps=62_400,
                batch_size=512,
                lr=1e-3,
                warmup_steps=312,
                schedule="cosine",
                weight_decay=0.0,
                grad_clip=None,
            ),
            model=dict(
                embed_dim=128, num_heads=4, num_layers=1, ffn_dim=128, dropout=0.2, pooling="mean"
            ),
            data=dict(resolution=32, difficulty="hard", train_size=160_000, test_size=20_000),
        ),
    },
    "tiny": {
        "listops": dict(
            train=dict(steps=3, batch_size=8, lr=1e-3),
            model=dict(embed_dim=16, num_heads=2, num_layers=1, ffn_dim=32, dropout=0.0),
            data=dict(variant="cpu", valid_size=0, test_size=16, train_size=48),
        ),
        "pathfinder": dict(
            train=dict(steps=3, batch_size=8, lr=1e-3),
            model=dict(
                embed_dim=16, num_heads=2, num_layers=1, ffn_dim=32, dropout=0.0, pooling="mean"
            ),
            data=dict(resolution=32, difficulty="easy", valid_size=0, test_size=16, train_size=48),
        ),
    },
}
"""Per variant and task: ``train`` (:class:`TrainConfig`'s fields), ``model`` and ``data``
(the recipe's options)."""

# Options of the attention kinds, as ``qkv train`` gives them by default.
_ATTENTION_OPTIONS = {"local": dict(window=32)}


@dataclass
class LRAResult:
    """What :func:`run_lra` ended with."""

    cells: list[dict] = field(default_factory=list)
    interrupted: bool = False
    table_md: str = ""
    table_json: str = ""


def cell_settings(
    task: str,
    attention: str,
    variant: str,
    *,
    steps: int | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """What a cell runs: the recipe's keyword arguments (without ``cache_dir``) and the
    :class:`TrainConfig`'s fields. Nothing is loaded."""
    v = VARIANTS[variant][task]
    config = dict(v["train"], seed=seed, device=device)
    if steps is not None:
        config["steps"] = steps
        config["warmup_steps"] = min(config.get("warmup_steps", 0), steps // 10)
    config["checkpoint_every"] = max(1, min(200, config["steps"] // 4))
    recipe = dict(
        task=task,
        attention=attention,
        attention_options=dict(_ATTENTION_OPTIONS.get(attention, {})),
        model=dict(v["model"]),
        data=dict(v["data"]),
    )
    return dict(variant=variant, recipe=recipe, config=config)


def run_lra(
    tasks: list[str] | tuple[str, ...] = TASKS,
    attentions: list[str] | tuple[str, ...] = ("exact", "linear", "performer", "local"),
    *,
    variant: str = "cpu",
    out: str | Path = "runs/lra",
    steps: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    resume: bool = False,
    progress: bool = True,
    cache_dir: str | None = None,
) -> LRAResult:
    """Train every (task, attention) cell and write the table.

    Args:
        tasks: Of :data:`TASKS`, in the table's order.
        attentions: Attention kinds (``qkv.models.attention_kinds()``).
        variant: A key of :data:`VARIANTS`: ``"cpu"``, ``"lra"`` (a GPU) or ``"tiny"``.
        out: The folder of the cells and the table files (made if missing).
        steps: Train every cell this many steps instead of the variant's (its warm-up is
            cut to at most a tenth of them).
        device: ``"cpu"``, ``"cuda"``, ...
        seed: Of the model, the batches and dropout (the data's seed is the task's default).
        resume: Skip finished cells and continue an interrupted one; without it, a folder
            that holds cells is refused.
        progress: A progress bar per cell.
        cache_dir: Where the generated tasks are cached.

    Returns:
        The cells (finished, interrupted, not run) and the table files' paths;
        ``interrupted`` is True when Ctrl-C stopped a cell (its checkpoint continues it).

    Raises:
        ValueError: An unknown task, attention kind or variant, an empty or repeated list,
            a bad ``steps`` or ``device``, or a finished cell written with other settings.
        FileExistsError: ``out`` holds cells and ``resume`` is False.
    """
    tasks, attentions = _check_names(tasks, attentions, variant)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    check_device(device)
    plans = [
        cell_settings(t, a, variant, steps=steps, device=device, seed=seed)
        for t in tasks
        for a in attentions
    ]
    for p in plans:  # a bad setting fails here, before any data is generated
        TrainConfig(**p["config"])
    result = LRAResult()
    with run_directory(out) as root:
        if not resume:
            _refuse_existing(root, plans)
        cells = [_pending(p) for p in plans]
        for i, plan in enumerate(plans):
            cells[i] = _run_cell(root, plan, resume, progress, cache_dir)
            result.table_md, result.table_json = _write_table(root, cells, variant, device, seed)
            if cells[i]["status"] == "interrupted":
                result.interrupted = True
                break
    result.cells = cells
    return result


def _check_names(
    tasks: Iterable[str], attentions: Iterable[str], variant: str
) -> tuple[list[str], list[str]]:
    """The tasks and attention kinds as lists, checked (each list read once: an iterator
    gives its names, not an empty list after the check)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; the variants are {', '.join(VARIANTS)}")
    kinds = attention_kinds()
    checked: list[list[str]] = []
    for what, given, known in (("task", tasks, TASKS), ("attention kind", attentions, kinds)):
        names = list(given)
        checked.append(names)
        if not names:
            raise ValueError(f"no {what} given; choose from {', '.join(known)}")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(
                f"unknown {what}{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; qkv lra knows "
                f"{', '.join(known)}"
            )
        repeated = sorted(n for n, c in Counter(names).items() if c > 1)
        if repeated:
            raise ValueError(f"{what} {', '.join(map(repr, repeated))} given twice")
    return checked[0], checked[1]


def _cell_dir(root: Path, plan: dict) -> Path:
    return root / plan["recipe"]["task"] / plan["recipe"]["attention"]


def _refuse_existing(root: Path, plans: list[dict]) -> None:
    for p in plans:
        d = _cell_dir(root, p)
        if (d / CHECKPOINT).exists() or (d / CELL).exists():
            raise FileExistsError(
                f"{d} holds a cell of an earlier run; pass --resume "
                f"(resume=True) to skip finished cells and continue "
                f"interrupted ones, or choose another output folder"
            )


def _pending(plan: dict) -> dict:
    r = plan["recipe"]
    return dict(
        task=r["task"],
        attention=r["attention"],
        status="not run",
        lra_table1=LRA_TABLE1[r["task"]].get(r["attention"]),
        lra_name=LRA_NAMES.get(r["attention"]),
    )


def _run_cell(root: Path, plan: dict, resume: bool, progress: bool, cache_dir: str | None) -> dict:
    """Train one cell unless it is finished; its row of the table."""
    d = _cell_dir(root, plan)
    before = _read_cell(d, plan)
    if before is not None and before["status"] == "done":
        return before
    recipe = make_recipe(**plan["recipe"], cache_dir=cache_dir)
    recipe.name = f"{recipe.task} {recipe.attention}"  # the progress bar's label
    config = TrainConfig(**plan["config"])
    spent = before["wall_s"] if before is not None else 0.0
    t0 = time.perf_counter()
    out = train(recipe, config, d, resume=resume and (d / CHECKPOINT).exists(), progress=progress)
    wall = round(spent + time.perf_counter() - t0, 1)
    cell = dict(
        _pending(plan),
        settings=plan,
        wall_s=wall,
        steps=out.step,
        train_examples=recipe.train_size(),
        test_examples=len(recipe.test_data),
        majority=_majority(recipe.test_data.labels),
        seed=config.seed,
        batch_size=config.batch_size,
        folder=str(d),
    )
    if out.interrupted:
        cell["status"] = "interrupted"
    else:
        cell.update(
            status="done",
            accuracy=out.evaluation["accuracy"],
            final_loss=out.final_loss,
            pictures=out.pictures,
        )
    write_atomic(d / CELL, lambda f: f.write(json.dumps(cell, indent=2).encode()))
    return cell


def _read_cell(d: Path, plan: dict) -> dict | None:
    """The cell's record from an earlier run (None: none), refused if its settings differ."""
    path = d / CELL
    if not path.exists():
        return None
    try:
        cell = json.loads(path.read_text())
        settings = cell["settings"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a readable cell record ({type(e).__name__}: {e}); "
            f"move it away to run the cell again"
        ) from None
    if settings != json.loads(json.dumps(plan)):
        raise ValueError(
            f"{path} was written with other settings ({_difference(settings, plan)}); "
            f"resume with the same --variant, --steps, --device and --seed, or "
            f"choose another output folder"
        )
    if cell.get("status") == "done" and not (d / METRICS).exists():
        return None  # its metrics are gone: run it again
    return cell


def _difference(old: dict, new: dict) -> str:
    new = json.loads(json.dumps(new))
    for part in ("variant", "recipe", "config"):
        if old.get(part) != new.get(part):
            return f"{part}: {old.get(part)!r} then, {new.get(part)!r} now"
    return "unknown"


def _majority(labels: torch.Tensor) -> float:
    """The share of the test set's most common label: what always guessing it scores."""
    return float(torch.bincount(labels).max()) / max(len(labels), 1)


def _write_table(
    root: Path, cells: list[dict], variant: str, device: str, seed: int
) -> tuple[str, str]:
    """``lra_table.json`` and ``lra_table.md`` of the cells so far, atomically."""
    data = dict(
        variant=variant,
        device=device,
        seed=seed,
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        lra_table1=LRA_TABLE1,
        cells=[{k: v for k, v in c.items() if k != "settings"} | _summary(c) for c in cells],
    )
    jpath, mpath = root / TABLE_JSON, root / TABLE_MD
    write_atomic(jpath, lambda f: f.write(json.dumps(data, indent=2).encode()))
    write_atomic(mpath, lambda f: f.write(_markdown(data).encode()))
    return str(mpath), str(jpath)


def _summary(cell: dict) -> dict:
    s = cell.get("settings")
    if not s:
        return {}
    return dict(
        model=s["recipe"]["model"],
        data=s["recipe"]["data"],
        attention_options=s["recipe"]["attention_options"],
        train=s["config"],
    )


def _markdown(data: dict) -> str:
    cells = data["cells"]
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    kinds = list(dict.fromkeys(c["attention"] for c in cells))
    by = {(c["task"], c["attention"]): c for c in cells}
    head = "| attention | " + " | ".join(f"{t} (ours) | {t} (LRA)" for t in tasks) + " |"
    lines = [
        f"# Long Range Arena, locally: variant `{data['variant']}`",
        "",
        (
            f"Test accuracy, %. Ours: device {data['device']}, seed {data['seed']}, torch "
            f"{data['torch']}, {data['threads']} threads. LRA: Tay et al. 2020, Table 1 "
            f"(its own data sizes and models)."
        ),
        "",
        head,
        "|:---|" + "---:|---:|" * len(tasks),
    ]
    for k in kinds:
        row = [f"{k} ({LRA_NAMES[k]})" if k in LRA_NAMES else k]
        for t in tasks:
            c = by[(t, k)]
            row += [
                _percent(c.get("accuracy")) if c["status"] == "done" else c["status"],
                _percent(None if c["lra_table1"] is None else c["lra_table1"] / 100),
            ]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        (
            "| task | attention | accuracy | majority class | steps | batch | "
            "train / test examples | wall time | seed |"
        ),
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        if c["status"] == "not run":
            lines.append(f"| {c['task']} | {c['attention']} | not run | | | | | | |")
            continue
        lines.append(
            f"| {c['task']} | {c['attention']} | "
            f"{_percent(c.get('accuracy')) if c['status'] == 'done' else c['status']}"
            f" | {_percent(c['majority'])} | {c['steps']} | {c['batch_size']} | "
            f"{c['train_examples']:,} / {c['test_examples']:,} | "
            f"{c['wall_s']:.0f} s | {c['seed']} |"
        )
    return "\n".join(lines) + "\n"


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.2f}"
