"""Training: the loop behind ``qkv train`` (seeded, checkpointed, resumable to the bit) and the
recipes that tie a task to a model."""
from .progress import Progress
from .trainer import (CHECKPOINT, METRICS, SCHEDULES, Recipe, TrainConfig, TrainResult,
                      batch_indices, save_atomic, train)

__all__ = ["CHECKPOINT", "METRICS", "Progress", "Recipe", "SCHEDULES", "TrainConfig",
           "TrainResult", "batch_indices", "save_atomic", "train"]
