"""What a training run is given and what it gives back: how to train (:class:`TrainConfig`,
its learning-rate schedule), what to train (the :class:`Recipe` a task supplies), the devices
a run may ask for, and the :class:`TrainResult` it ends with. The loop is in
:mod:`qkv.training.trainer`."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = [
    "SCHEDULES",
    "Recipe",
    "TrainConfig",
    "TrainResult",
    "available_devices",
    "check_device",
]

SCHEDULES = ("constant", "rsqrt", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """How to train (what to train is the :class:`Recipe`).

    Attributes:
        steps: Optimizer steps in all.
        batch_size: Examples a step: the global batch, shared equally by the processes of a
            data-parallel run (which refuses one their number does not divide).
        lr: Peak learning rate (AdamW).
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Linear warm-up from 0 to ``lr``.
        schedule: After warm-up: ``"constant"``, ``"rsqrt"`` (``lr * sqrt(warmup / step)``, LRA's)
            or ``"cosine"`` (to 0 at ``steps``).
        grad_clip: Clip the gradient norm to this (None: no clipping).
        seed: Seeds the model's initialisation, the batch order and dropout.
        device: ``"cpu"``, ``"cuda"``, ...; checked here, so a machine without it fails
            before any data is generated (:func:`check_device`).
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
        check_device(self.device)

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


# Device types a user may mean, for "did you mean" (torch.device's own list is much longer).
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def available_devices() -> list[str]:
    """The devices this machine and this torch build can train on, e.g.
    ``["cpu", "cuda", "cuda:0"]``."""
    found = ["cpu"]
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            found += [kind] + [f"{kind}:{i}" for i in range(module.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def check_device(name: str) -> torch.device:
    """``torch.device(name)``, once it is known that this machine has it.

    Raises:
        ValueError: ``name`` is not a device string (a typo such as ``"cdua"``), or this
            machine or torch build has no such device; the message lists the ones it has.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        near = difflib.get_close_matches(str(name).lower(), _DEVICE_TYPES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"device {name!r} is not a torch device{hint}; this machine has: "
            f"{', '.join(available_devices())}"
        ) from None
    if device.type != "cpu" and str(device) not in available_devices():
        raise ValueError(
            f"device {name!r} is not available on this machine (torch "
            f"{torch.__version__}); it has: {', '.join(available_devices())}; "
            f"pick one of these"
        )
    return device


class Recipe(Protocol):
    """What a task gives the trainer.

    Two methods are optional (not part of the protocol: a data-parallel run uses them when
    the recipe has them):

    * ``loss_count(batch: dict[str, Tensor]) -> int``: how many terms the loss of ``batch``
      averages over (tokens, for a loss over tokens). A data-parallel run weights each rank's
      loss and metrics by it, so that they are means over the global batch; without it, by
      the rank's examples.
    * ``evaluation_counts(model, device, rank: int, size: int) -> dict[str, float]``: rank
      ``rank`` of ``size``'s share of the test set, as sums (correct predictions per metric)
      and ``test_examples``; :meth:`evaluate` is each sum over the test set divided by its
      examples. A data-parallel run sums the ranks' counts; without this method every rank
      evaluates the whole test set.
    """

    name: str

    def describe(self) -> dict:
        """Everything that defines the task and model (saved, and checked on resume)."""

    def build_model(self) -> nn.Module:
        """A fresh model (built under the run's seed)."""

    def train_size(self) -> int:
        """Training examples."""

    def batch(self, indices: Tensor, device: torch.device) -> dict[str, Tensor]:
        """The training batch of these example indices, on ``device``."""

    def loss(
        self, model: nn.Module, batch: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor | float], int]:
        """``(loss, metrics such as {"acc": ...} (numbers or 0-d tensors), tokens in the
        batch)``."""

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
