"""The seeds' worked examples (SEEDS.md section 5), with the exact values qkv must reproduce.

Convention of the seeds: rows are tokens and ``Q = X @ W_Q`` (not ``W_Q @ x``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["EXAMPLES", "SeedExample", "get_example"]


@dataclass(frozen=True)
class SeedExample:
    """Inputs, weights and the exact expected numbers of one worked example.

    Shape:
        x ``(T, C)``; w_q, w_k ``(C, D)``; w_v ``(C, Dv)``; expected and tutorial scores/probs
        ``(T, T)``; expected and tutorial outputs ``(T, Dv)``.
    """

    name: str
    title: str
    x: list
    w_q: list
    w_k: list
    w_v: list
    scale: float | None  # None: 1/sqrt(d_k)
    expected: dict = field(default_factory=dict)  # "scores", "probs", "outputs" as lists
    note: str = ""
    tutorial: dict = field(default_factory=dict)  # what the seed prints, rounded; same keys

    def tensors(self, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
        """x, w_q, w_k, w_v as tensors of ``dtype``."""
        return {n: torch.tensor(getattr(self, n), dtype=dtype) for n in ("x", "w_q", "w_k", "w_v")}

    def resolved_scale(self) -> float:
        return 1.0 / math.sqrt(len(self.w_k[0])) if self.scale is None else self.scale


SEED000 = SeedExample(
    name="seed000",
    title="Seed 000: two tokens, d = 2, scale 1/sqrt(2)",
    x=[[1.0, 1.0], [1.0, 0.0]],
    w_q=[[1.0, 1.0], [0.0, 1.0]],
    # The seed gives k^1 = (1, 0), k^2 = (0, 1) and the same v but not W_K, W_V; the inverse
    # of x, [[0, 1], [1, -1]], is the W_K = W_V that yields them from these inputs.
    w_k=[[0.0, 1.0], [1.0, -1.0]],
    w_v=[[0.0, 1.0], [1.0, -1.0]],
    scale=None,
    expected={
        "scores": [[0.707107, 1.414214], [0.707107, 0.707107]],
        "probs": [[0.330238, 0.669762], [0.5, 0.5]],
        "outputs": [[0.330238, 0.669762], [0.5, 0.5]],
    },
    note=(
        "the seed rounds b_1 to (0.33, 0.67) and prints the input of q^2 as (1, 1) by mistake "
        "(a_2 W_Q = (1, 1))"
    ),
    tutorial={"outputs": [[0.33, 0.67], [0.5, 0.5]]},
)

SEED004 = SeedExample(
    name="seed004",
    title="Seed 004: three inputs, d_model = 4, d_k = d_v = 3, no scaling",
    x=[[1.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]],
    w_q=[[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 1.0]],
    w_k=[[0.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]],
    w_v=[[0.0, 2.0, 0.0], [0.0, 3.0, 0.0], [1.0, 0.0, 3.0], [1.0, 1.0, 0.0]],
    scale=1.0,
    expected={
        "scores": [[2.0, 4.0, 4.0], [4.0, 16.0, 12.0], [4.0, 12.0, 10.0]],
        "probs": [
            [6.337894e-02, 4.683105e-01, 4.683105e-01],
            [6.033665e-06, 9.820079e-01, 1.798610e-02],
            [2.953872e-04, 8.805369e-01, 1.191677e-01],
        ],
        "outputs": [
            [1.936621, 6.683105, 1.595068],
            [1.999994, 7.963992, 0.053976],
            [1.999705, 7.759892, 0.358389],
        ],
    },
    note=(
        "the seed rounds the softmax to [[0,.5,.5],[0,1,0],[0,.9,.1]] and so prints outputs "
        "[[2,7,1.5],[2,8,0],[2,7.8,0.3]]"
    ),
    tutorial={
        "probs": [[0.0, 0.5, 0.5], [0.0, 1.0, 0.0], [0.0, 0.9, 0.1]],
        "outputs": [[2.0, 7.0, 1.5], [2.0, 8.0, 0.0], [2.0, 7.8, 0.3]],
    },
)

SEED004_SCALED = SeedExample(
    name="seed004-scaled",
    title="Seed 004 with the standard 1/sqrt(3) scale",
    x=SEED004.x,
    w_q=SEED004.w_q,
    w_k=SEED004.w_k,
    w_v=SEED004.w_v,
    scale=None,
    expected={
        "outputs": [
            [1.863874, 6.319371, 1.704189],
            [1.999110, 7.814124, 0.273472],
            [1.992555, 7.479636, 0.735877],
        ]
    },
)

EXAMPLES = {e.name: e for e in (SEED000, SEED004, SEED004_SCALED)}


def get_example(name: str) -> SeedExample:
    """The example called ``name``; ValueError listing the names otherwise."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")
    return EXAMPLES[name]
