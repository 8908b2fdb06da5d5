"""The training loop behind ``qkv train``: seeded, checkpointed, resumable to the bit.

What a task supplies is a :class:`Recipe` (build the model, make a batch from example indices,
the loss and its metrics, the evaluation, the pictures); this module owns everything else:

* **Determinism.** The model is built after ``torch.manual_seed(seed)``; the batch of step s
  is a slice of a permutation drawn from ``seed`` and the epoch alone, so it does not depend
  on what ran before; torch's global RNG state (dropout) is saved with every checkpoint. A run
  resumed from a checkpoint ends with the same parameters and loss, bit for bit, on CPU.
* **Checkpoints** every ``checkpoint_every`` steps and at the end, written atomically (a
  temporary file in the same directory, then ``os.replace``): a write killed half-way leaves
  the previous checkpoint intact.
* **Ctrl-C** finishes the current step, writes a checkpoint and stops (a second Ctrl-C stops at
  once); ``resume=True`` continues from it.
* A progress bar with loss, accuracy and tokens/s; ``metrics.json`` (atomic) at the end.
"""
from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import Tensor, nn

from .progress import Progress

__all__ = ["TrainConfig", "Recipe", "TrainResult", "train", "batch_indices", "save_atomic",
           "CHECKPOINT", "METRICS", "SCHEDULES"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.json"
SCHEDULES = ("constant", "rsqrt", "cosine")
FORMAT = 1


@dataclass(frozen=True)
class TrainConfig:
    """How to train (what to train is the :class:`Recipe`).

    Attributes:
        steps: Optimizer steps in all.
        batch_size: Examples a step.
        lr: Peak learning rate (AdamW).
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Linear warm-up from 0 to ``lr``.
        schedule: After warm-up: ``"constant"``, ``"rsqrt"`` (``lr * sqrt(warmup / step)``, LRA's)
            or ``"cosine"`` (to 0 at ``steps``).
        grad_clip: Clip the gradient norm to this (None: no clipping).
        seed: Seeds the model's initialisation, the batch order and dropout.
        device: ``"cpu"``, ``"cuda"``, ...
        checkpoint_every: Steps between checkpoints (and one at the end).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    grad_clip: float | None = 1.0
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 200

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")

    def lr_factor(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based) over ``lr``."""
        s = step + 1
        if self.warmup_steps and s <= self.warmup_steps:
            return s / self.warmup_steps
        if self.schedule == "rsqrt":
            return math.sqrt(max(self.warmup_steps, 1) / s)
        if self.schedule == "cosine":
            span = max(self.steps - self.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(s - self.warmup_steps, span) / span))
        return 1.0


class Recipe(Protocol):
    """What a task gives the trainer."""

    name: str

    def describe(self) -> dict:
        """Everything that defines the task and model (saved, and checked on resume)."""

    def build_model(self) -> nn.Module:
        """A fresh model (built under the run's seed)."""

    def train_size(self) -> int:
        """Training examples."""

    def batch(self, indices: Tensor, device: torch.device) -> dict[str, Tensor]:
        """The training batch of these example indices, on ``device``."""

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float], int]:
        """``(loss, metrics such as {"acc": ...}, tokens in the batch)``."""

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Test metrics of the trained model (called in eval mode, under no_grad)."""

    def pictures(self, model: nn.Module, out_dir: Path, device: torch.device) -> list[str]:
        """Save pictures (e.g. attention maps of a test example); returns their paths."""


@dataclass
class TrainResult:
    """What a run ended with."""

    step: int
    final_loss: float | None
    history: list[dict] = field(default_factory=list)
    evaluation: dict[str, float] = field(default_factory=dict)
    pictures: list[str] = field(default_factory=list)
    interrupted: bool = False
    checkpoint: str = ""


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> Tensor:
    """The examples of step ``step``: a slice of the epoch's permutation, drawn from the seed
    and the epoch only (so a resumed run sees the same batches). Shape: ``(min(batch_size, n),)``."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)[i * batch_size:(i + 1) * batch_size]


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json_atomic(data: dict, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


class _StopFlag:
    """SIGINT sets a flag the loop checks after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.set, self._old = False, None

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _handle(self, signum, frame) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True


def train(recipe: Recipe, config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          progress: bool = True, on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train ``recipe``'s model under ``config``, writing checkpoints and metrics to ``out_dir``.

    Args:
        recipe: The task and model.
        config: Steps, batch size, optimizer, seed, device, checkpointing.
        out_dir: Created if missing. Holds ``checkpoint.pt``, ``metrics.json`` and pictures.
        resume: Continue from ``out_dir``'s checkpoint (which must come from the same recipe
            and config). Without it, an existing checkpoint is refused rather than overwritten.
        progress: Show the progress bar on stderr.
        on_step: Called with the number of steps done after each step (tests use it).

    Returns:
        A :class:`TrainResult`; ``interrupted`` when Ctrl-C stopped the run (its checkpoint
        is written; call again with ``resume=True``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    model = recipe.build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    ident = dict(format=FORMAT, recipe=recipe.describe(), config=asdict(config))
    step, history = 0, []
    if ckpt_path.exists():
        if not resume:
            raise FileExistsError(f"{ckpt_path} exists (a run of {_steps_in(ckpt_path)} steps); "
                                  f"pass resume=True (--resume) to continue it, or choose "
                                  f"another output directory")
        step, history = _load(ckpt_path, ident, model, opt, sched)
    elif resume:
        raise FileNotFoundError(f"nothing to resume: {ckpt_path} does not exist")

    def save() -> None:
        save_atomic(dict(ident, step=step, history=history, model=model.state_dict(),
                         optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                         rng=torch.get_rng_state()), ckpt_path)

    model.train()
    n = recipe.train_size()
    interrupted = False
    with _StopFlag() as stop, Progress(config.steps, start=step, desc=recipe.name,
                                       every=5.0 if progress else float("inf")) as bar:
        t0, tokens = time.perf_counter(), 0
        while step < config.steps:
            batch = recipe.batch(batch_indices(n, config.batch_size, config.seed, step), device)
            loss, metrics, ntok = recipe.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            sched.step()
            step += 1
            tokens += ntok
            numbers = {k: _number(v) for k, v in metrics.items()}
            history.append(dict(step=step, loss=_number(loss), lr=opt.param_groups[0]["lr"],
                                **numbers))
            if progress:
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                bar.update(step, loss=history[-1]["loss"], **numbers, **{"tok/s": f"{rate:,.0f}"})
            if on_step is not None:
                on_step(step)
            if step % config.checkpoint_every == 0 or step == config.steps or stop.set:
                save()
            if stop.set:
                interrupted = True
                break
    result = TrainResult(step=step, final_loss=history[-1]["loss"] if history else None,
                         history=history, interrupted=interrupted, checkpoint=str(ckpt_path))
    if interrupted:
        return result
    model.eval()
    with torch.no_grad():
        result.evaluation = recipe.evaluate(model, device)
        result.pictures = recipe.pictures(model, out, device)
    _write_json_atomic(dict(ident, step=step, final_loss=result.final_loss,
                            evaluation=result.evaluation, pictures=result.pictures,
                            history=history), out / METRICS)
    return result


def _load(path: Path, ident: dict, model: nn.Module, opt, sched) -> tuple[int, list[dict]]:
    """Restore a checkpoint into the run, after checking it is this run's."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    for key in ("format", "recipe", "config"):
        if ck.get(key) != ident[key]:
            raise ValueError(f"{path} was written by a different run ({key} differs: "
                             f"{ck.get(key)!r} vs {ident[key]!r}); resume with the same task, "
                             f"options and config, or choose another output directory")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    torch.set_rng_state(ck["rng"])
    return ck["step"], ck["history"]


def _number(v) -> float:
    return float(v.detach()) if isinstance(v, Tensor) else float(v)


def _steps_in(path: Path) -> str:
    try:
        return str(torch.load(path, map_location="cpu", weights_only=False)["step"])
    except Exception:  # an unreadable file: say so rather than fail here
        return "unknown"
