"""Training: the loop behind ``qkv train`` (seeded, checkpointed, resumable to the bit) and the
recipes that tie a task to a model; the helpers every command shares (the output folder,
atomic writes, torch's global settings restored)."""

from .._progress import Progress
from .checkpoint import CHECKPOINT, save_atomic
from .config import (
    SCHEDULES,
    Recipe,
    TrainConfig,
    TrainResult,
    available_devices,
    check_device,
)
from .files import run_directory, write_atomic
from .results import METRICS
from .torch_state import TorchState, preserve_torch_state
from .trainer import batch_indices, train

__all__ = [
    "CHECKPOINT",
    "METRICS",
    "SCHEDULES",
    "Progress",
    "Recipe",
    "TorchState",
    "TrainConfig",
    "TrainResult",
    "available_devices",
    "batch_indices",
    "check_device",
    "preserve_torch_state",
    "run_directory",
    "save_atomic",
    "train",
    "write_atomic",
]
