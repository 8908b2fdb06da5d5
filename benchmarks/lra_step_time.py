"""Seconds per training step of ``qkv train listops --preset lra``, per attention kind.

Before committing a machine to the 5,000 steps of LRA's released ListOps config, measure a few
of them: the same recipe and model as the preset (4 layers, 8 heads, C=512, MLP 1024, the full
500-2000 variant, batches of 32 padded to 1,999 tokens), forward, backward and an AdamW step,
timed one at a time (on CUDA, synchronised). Generates (or reads from the cache) the full
variant's 100,000 examples first: about 90 s on one core, once.

Usage:
    python benchmarks/lra_step_time.py                          # exact and linear, CPU, 3 steps
    python benchmarks/lra_step_time.py --device cuda --kinds exact linear performer local
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from qkv.cli.train import PRESETS
from qkv.models import attention_kinds
from qkv.training.recipes import make_recipe


def step_times(kind: str, steps: int, device: str) -> list[float]:
    """Seconds of each of ``steps`` training steps of the LRA model with ``kind``."""
    preset = PRESETS["lra"]
    recipe = make_recipe("listops", attention=kind, model=preset["model"], data=preset["data"])
    torch.manual_seed(0)
    model = recipe.build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        batch = recipe.batch(torch.randint(0, recipe.train_size(), (32,), generator=g), device)
        _sync(device)
        t0 = time.perf_counter()
        loss, _, _ = recipe.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kinds", nargs="+", choices=list(attention_kinds()), default=["exact", "linear"]
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    steps = PRESETS["lra"]["train"]["steps"]
    print("| `--attention` | seconds per step (each) | 5,000 steps at the median |")
    print("|:---|:---|---:|")
    for kind in a.kinds:
        times = step_times(kind, a.steps, a.device)
        median = sorted(times)[len(times) // 2]
        print(
            f"| {kind} | {', '.join(f'{t:.2f}' for t in times)} | {median * steps / 3600:.1f} h |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
