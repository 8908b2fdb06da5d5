"""Data parallelism for :func:`qkv.training.train` on torch.distributed.

Each process (rank) of a run holds the whole model; every step's global batch is split across
the ranks and DistributedDataParallel averages their gradients. This module owns the parts
that are not the training loop:

* :func:`data_parallel`: the process group torchrun asks for (``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment): gloo on CPU, NCCL on
  CUDA with rank r on ``cuda:LOCAL_RANK``; made with a timeout, so a rank that dies or stops
  answering makes the others fail with :class:`ConnectionError` instead of waiting forever;
  destroyed again at the end (a group the caller made is used and left alone).
* :func:`share`: a rank's part of a global batch (every ``N``-th example from ``rank``, as
  ``torch.utils.data.DistributedSampler`` deals them).
* :func:`all_sum`, :func:`all_gather`, :func:`from_rank0`: the few collectives the loop needs.
* :func:`seed_rank`: dropout draws of rank ``r > 0`` from a stream of its own, derived from the
  run's seed (rank 0 keeps the stream a one-process run has).

Shape alphabet: B the global batch, N ranks.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_TIMEOUT",
    "LostPeer",
    "Ranks",
    "all_gather",
    "all_sum",
    "check_batch",
    "data_parallel",
    "env_ranks",
    "from_rank0",
    "lost_peer",
    "on_every_rank",
    "seed_rank",
    "share",
]

DEFAULT_TIMEOUT = 600.0  # seconds a rank waits for the others at a collective
_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_GROUPS = itertools.count()  # the process groups data_parallel has made in this process
T = TypeVar("T")


class LostPeer(ConnectionError):
    """Another rank of the run died or did not answer within the timeout. The process that
    raises it may hold connections to that rank (gloo, the rendezvous store) whose teardown
    can wait on it: the ``qkv`` command exits at once after saying so."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a run: rank 0 of 1 when it trains alone.

    Attributes:
        rank: This process's rank, ``0 <= rank < size``.
        size: Processes in the run (torchrun's ``WORLD_SIZE``).
        local_rank: Its rank on this machine; picks its GPU.
        timeout: Seconds a collective waits for the other ranks.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout: float = DEFAULT_TIMEOUT
    # The tensors of the last collectives, kept alive until the group is gone. gloo's worker
    # thread drops its reference to a finished collective's tensors under a lock that
    # destroying the group waits for; were that the last reference to a tensor Python made,
    # dropping it would need the GIL, which the thread destroying the group holds: a deadlock
    # (seen at the end of a run: the checkpoint's all-gather, then the group destroyed).
    _held: deque = field(default_factory=lambda: deque(maxlen=16), compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.size > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and shows progress."""
        return self.rank == 0

    def hold(self, *tensors: Tensor) -> None:
        """Keep the tensors of a collective alive as long as these ranks (see ``_held``)."""
        self._held.extend(tensors)


def env_ranks(timeout: float = DEFAULT_TIMEOUT) -> Ranks:
    """This process's place in the run, from the environment variables torchrun sets; rank 0
    of 1 when ``WORLD_SIZE`` is not set.

    Raises:
        ValueError: ``WORLD_SIZE`` is set but ``RANK`` or ``LOCAL_RANK`` is missing, or they
            are not integers with ``0 <= RANK < WORLD_SIZE``.
    """
    if "WORLD_SIZE" not in os.environ:
        return Ranks(timeout=timeout)
    got = {}
    for name in _ENV:
        raw = os.environ.get(name)
        try:
            got[name] = int(raw or "")  # unset (None) fails as a non-int does
        except ValueError:
            raise ValueError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is set but {name}={raw!r} is not an "
                f"int: run under torchrun (it sets {', '.join(_ENV)}, MASTER_ADDR and "
                f"MASTER_PORT), or unset WORLD_SIZE to train in one process"
            ) from None
    size, rank, local = got["WORLD_SIZE"], got["RANK"], got["LOCAL_RANK"]
    if size < 1 or not 0 <= rank < size or local < 0:
        raise ValueError(
            f"torchrun's variables do not fit: WORLD_SIZE={size}, RANK={rank}, "
            f"LOCAL_RANK={local} (need WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE, "
            f"LOCAL_RANK >= 0)"
        )
    return Ranks(rank, size, local, timeout)


def check_batch(batch_size: int, size: int) -> None:
    """Refuse a global batch that ``size`` processes cannot share equally.

    Raises:
        ValueError: ``batch_size % size != 0``; the message names the nearest that fit.
    """
    if batch_size % size:
        lower, upper = batch_size // size * size, (batch_size // size + 1) * size
        fits = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"the batch size is the global batch, shared equally by the "
            f"{size} processes: {batch_size} is not a multiple of {size}; "
            f"use {fits}"
        )


@contextmanager
def data_parallel(
    device: torch.device, timeout: float = DEFAULT_TIMEOUT
) -> Iterator[tuple[Ranks, torch.device]]:
    """The run's process group and this rank's device.

    Under torchrun with ``WORLD_SIZE > 1``: initialise the default group (gloo for CPU, NCCL
    for CUDA) with ``timeout``, make ``cuda:LOCAL_RANK`` the current device for NCCL, and
    destroy the group (and restore the current device) on exit. A group already initialised
    by the caller is used as it is and left alone. Otherwise: rank 0 of 1, ``device``.

    Args:
        device: The device asked for; ``cuda`` becomes ``cuda:LOCAL_RANK`` on each rank.
        timeout: Seconds to wait for the other ranks, at the start and at every collective.

    Yields:
        ``(ranks, device)``: this process's :class:`Ranks` and the device it trains on.

    Raises:
        ValueError: The environment or the device does not fit a data-parallel run (a GPU
            index given with several processes, fewer GPUs than local ranks, an MPS device).
        ConnectionError: The other ranks did not join within ``timeout``.
    """
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"the timeout must be a positive number of seconds, got {timeout!r}")
    if dist.is_available() and dist.is_initialized():
        ranks = Ranks(
            dist.get_rank(),
            dist.get_world_size(),
            int(os.environ.get("LOCAL_RANK", dist.get_rank())),
            float(timeout),
        )
        yield ranks, _rank_device(device, ranks)
        return
    ranks = env_ranks(float(timeout))
    if not ranks.distributed:
        yield ranks, device
        return
    if not dist.is_available():
        raise ValueError(
            "WORLD_SIZE > 1 asks for several processes, but this torch build has "
            "no torch.distributed"
        )
    device = _rank_device(device, ranks)
    # torch.optim imports torch._dynamo when the first optimizer is made. Imported after the
    # group's threads started, it left ranks that on Ctrl-C died with "terminate called
    # without an active exception" at exit (about 1 run in 4 of the Ctrl-C test on 2 cores,
    # since import qkv stopped importing it; none in 12 with the import before the group).
    import torch._dynamo  # noqa: F401

    wait = timedelta(seconds=timeout)
    try:
        store, _, _ = next(
            dist.rendezvous("env://", rank=ranks.rank, world_size=ranks.size, timeout=wait)
        )
        # The store outlives the group (torchrun's agent holds it; rank 0's is shared by every
        # group this process makes), and a new group would read the last one's addresses:
        # each group gets keys of its own. (All ranks make their groups in the same order.)
        store = dist.PrefixStore(f"qkv.training/{next(_GROUPS)}", store)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            timeout=wait,
            rank=ranks.rank,
            world_size=ranks.size,
        )
    except (RuntimeError, ValueError) as e:  # DistStoreError (a timeout) is a RuntimeError
        raise ConnectionError(
            f"rank {ranks.rank} of {ranks.size} could not join the others "
            f"({_first_line(e)}); are all {ranks.size} processes running "
            f"(torchrun starts them)?"
        ) from None
    try:
        with _current_device(device):
            yield ranks, device
    finally:
        dist.destroy_process_group()


def _rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """``cuda`` becomes ``cuda:LOCAL_RANK``; anything but CPU and CUDA is refused."""
    if not ranks.distributed:
        return device
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"--device {device} would put all {ranks.size} processes on one "
                f"GPU; give --device cuda: each process then takes "
                f"cuda:LOCAL_RANK"
            )
        if ranks.local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {ranks.local_rank} needs cuda:{ranks.local_rank}, but "
                f"this machine has {torch.cuda.device_count()} GPU(s); start at "
                f"most that many processes a machine"
            )
        return torch.device("cuda", ranks.local_rank)
    if device.type != "cpu":
        raise ValueError(
            f"data-parallel training runs on cpu (gloo) or cuda (NCCL), not on {device.type}"
        )
    return device


@contextmanager
def _current_device(device: torch.device) -> Iterator[None]:
    """NCCL's collectives use the current CUDA device; put the caller's back afterwards."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.current_device()
    torch.cuda.set_device(device)
    try:
        yield
    finally:
        torch.cuda.set_device(before)


def share(indices: Tensor, ranks: Ranks) -> Tensor:
    """This rank's examples of a global batch: every ``N``-th from ``rank`` (the whole batch
    when alone). Shape: ``(B,)`` -> ``(B / N,)`` (one more on the first ranks when ``N`` does
    not divide ``B``)."""
    return indices[ranks.rank :: ranks.size]  # (B / N,)


def all_sum(values: list[float], ranks: Ranks, device: torch.device) -> list[float]:
    """Each value summed over the ranks, in float64 (the values themselves when alone)."""
    if not ranks.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    ranks.hold(t)
    return t.tolist()


def all_gather(t: Tensor, ranks: Ranks, device: torch.device) -> list[Tensor]:
    """Every rank's ``t`` (the same shape and dtype on every rank), in rank order, on the CPU.
    ``device`` is where the collective runs (the rank's GPU for NCCL)."""
    if not ranks.distributed:
        return [t]
    mine = t.to(device)
    out = [torch.empty_like(mine) for _ in range(ranks.size)]
    dist.all_gather(out, mine)
    ranks.hold(mine, *out)
    return [o.cpu() for o in out]


def from_rank0(make: Callable[[], T], ranks: Ranks, device: torch.device) -> T:
    """``make()`` run on rank 0 only, its value given to every rank; when it raises, every
    rank raises the same error (marked :func:`on_every_rank` on the others), so no rank is
    left waiting for one that has given up."""
    if not ranks.distributed:
        return make()
    if ranks.main:
        try:
            value = make()
        except Exception as e:
            _broadcast((False, e), ranks, device)
            raise
        _broadcast((True, value), ranks, device)
        return value
    ok, value = _broadcast(None, ranks, device)
    if not ok:
        raise on_every_rank(value)
    return value


def _broadcast(obj: Any, ranks: Ranks, device: torch.device) -> Any:
    """Rank 0's ``obj`` (anything ``torch.save`` takes) on every rank."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    if ranks.main:
        f = io.BytesIO()
        torch.save(obj, f)
        data = torch.frombuffer(bytearray(f.getbuffer()), dtype=torch.uint8).to(device)
        size += data.numel()
    dist.broadcast(size, src=0)
    if not ranks.main:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    ranks.hold(size, data)
    if ranks.main:
        return obj
    raw = bytearray(int(size))
    torch.frombuffer(raw, dtype=torch.uint8).copy_(data.cpu())
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


def on_every_rank(error: BaseException) -> BaseException:
    """Mark an error that every rank of the run raises alike (the command line prints it on
    rank 0 only)."""
    # a mark on the caller's exception, of any class: no class of ours declares it
    error.qkv_on_every_rank = True  # type: ignore[attr-defined]
    return error


def seed_rank(seed: int, ranks: Ranks) -> None:
    """Give rank ``r > 0`` a dropout stream of its own, drawn from ``(seed, r)`` alone; rank 0
    keeps the global generator as the model's initialisation left it, so a one-process run
    draws exactly as it always has."""
    if ranks.rank:
        digest = hashlib.sha256(f"qkv dropout seed={seed} rank={ranks.rank}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def lost_peer(error: BaseException, ranks: Ranks, where: str) -> LostPeer | None:
    """The :class:`LostPeer` (a ConnectionError) to raise for a collective that failed because
    another rank died or did not answer within the timeout; None for any other error."""
    text = str(error)
    if not ranks.distributed or not (
        isinstance(error, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
    ):
        return None
    return LostPeer(
        f"rank {ranks.rank} of {ranks.size}, {where}: another process of the "
        f"run died or did not answer within {ranks.timeout:g} s "
        f"({_first_line(error)})"
    )


def _first_line(error: BaseException) -> str:
    """The gist of a torch.distributed error: its first sentence, without gloo's source path."""
    text = " ".join(str(error).split())
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ")[0].rstrip(".") or type(error).__name__
