"""A run's state and its checkpoint: what a checkpoint holds (the model, optimizer, schedule,
history and every rank's random number generators), writing it atomically, reading it back,
checking that it is this run's, and putting it into the run again.

A checkpoint is a dict of plain values, state dicts and tensors: no class of qkv's is pickled
(``_RngState`` is a TypedDict, a plain dict at run time), so no module path is stored in it and
checkpoints load whichever module this code lives in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import torch
from torch import Tensor, nn

from .files import write_atomic
from .parallel import Ranks, all_gather

__all__ = ["CHECKPOINT", "save_atomic"]

CHECKPOINT = "checkpoint.pt"
FORMAT = 1


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename over it (the file gets
    the umask's permissions, like any other)."""
    write_atomic(path, lambda f: torch.save(obj, f))


@dataclass
class _Run:
    """A run in progress: the model, its optimizer and where it stands."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    ident: dict
    path: Path
    ranks: Ranks = field(default_factory=Ranks)
    net: nn.Module | None = None  # what the loss calls: the model, or DDP around it
    step: int = 0
    saved: int = 0  # the step of the last checkpoint
    history: list[dict] = field(default_factory=list)

    def save(self) -> None:
        """A checkpoint of every rank's state, written by rank 0 (a collective: all ranks
        call it at the same step)."""
        states = _rng_states(self.ranks, self.device)
        if self.ranks.main:
            save_atomic(
                dict(
                    self.ident,
                    step=self.step,
                    history=self.history,
                    model=self.model.state_dict(),
                    optimizer=self.opt.state_dict(),
                    scheduler=self.sched.state_dict(),
                    rng=states[0]["cpu"],
                    rank_rng=states,
                ),
                self.path,
            )
        self.saved = self.step


def _checkpoint_to_resume(path: Path, resume: bool, ident: dict) -> dict | None:
    """The checkpoint to continue (None for a new run), after checking it is this run's."""
    if path.exists() and not resume:
        raise FileExistsError(
            f"{path} exists ({_what_is(path)}); pass resume=True "
            f"(--resume) to continue it, or choose another output directory"
        )
    if not resume:
        return None
    if not path.exists():
        raise FileNotFoundError(f"nothing to resume: {path} does not exist")
    ck = _read_checkpoint(path)
    for key in ("format", "recipe", "config"):
        if ck.get(key) != ident[key]:
            raise ValueError(
                f"{path} was written by a different run ({key} differs: "
                f"{ck.get(key)!r} vs {ident[key]!r}); resume with the same "
                f"task, options and config, or choose another output directory"
            )
    if ck.get("world_size", 1) != ident["world_size"]:
        raise ValueError(
            f"{path} was written by a run of {ck.get('world_size', 1)} "
            f"process(es), this one has {ident['world_size']}; resume it with "
            f"--nproc {ck.get('world_size', 1)} (each process's dropout draws "
            f"and share of the batch depend on their number)"
        )
    return ck


def _restore(run: _Run, ck: dict) -> tuple[int, list[dict]]:
    """Put a checkpoint's state into the run: the model, optimizer, schedule, and this rank's
    random number generators."""
    run.model.load_state_dict(ck["model"])
    run.opt.load_state_dict(ck["optimizer"])
    run.sched.load_state_dict(ck["scheduler"])
    if "rank_rng" in ck:
        _set_rng_state(ck["rank_rng"][run.ranks.rank], run.device)
    else:  # written before checkpoints held every rank's generators
        torch.set_rng_state(ck["rng"])
    return ck["step"], ck["history"]


class _RngState(TypedDict):
    """One rank's generators in a checkpoint: the CPU's, and the GPU's when it ran on one."""

    cpu: Tensor
    cuda: Tensor | None


def _rng_states(ranks: Ranks, device: torch.device) -> list[_RngState]:
    """Every rank's generators that dropout on ``device`` draws from (a collective)."""
    cpu = all_gather(torch.get_rng_state(), ranks, device)
    if device.type != "cuda":
        return [_RngState(cpu=c, cuda=None) for c in cpu]
    cuda = all_gather(torch.cuda.get_rng_state(device), ranks, device)
    return [_RngState(cpu=c, cuda=g) for c, g in zip(cpu, cuda)]


def _set_rng_state(state: _RngState, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


_CHECKPOINT_KEYS = (
    "format",
    "recipe",
    "config",
    "step",
    "history",
    "model",
    "optimizer",
    "scheduler",
    "rng",
)


def _read_checkpoint(path: Path) -> dict:
    """The checkpoint at ``path``; ValueError when it is empty, truncated or not one of ours
    (a crash of the machine mid-write, a copy cut short, another program's file)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        why = "" if isinstance(ck, dict) else f"it holds a {type(ck).__name__}, not a dict"
    except Exception as e:
        first = " ".join(str(e).split()).split(". ")[0]  # torch adds paragraphs of advice
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
    if not why and not set(_CHECKPOINT_KEYS) <= ck.keys():
        why = f"it lacks {sorted(set(_CHECKPOINT_KEYS) - ck.keys())}"
    if why:
        size = path.stat().st_size
        raise ValueError(
            f"{path} ({size} bytes) is not a readable qkv checkpoint ({why}); "
            f"move it away (or delete it) to start the run again, or choose "
            f"another output directory"
        )
    return ck


def _what_is(path: Path) -> str:
    """What an existing checkpoint holds, for the message that refuses to overwrite it."""
    try:
        return f"a run of {_read_checkpoint(path)['step']} steps"
    except ValueError:
        return "not a readable checkpoint: move it away to start again"
