"""Run a function on R local processes joined in a gloo process group (tests, examples).

:func:`run_local` spawns R fresh Python processes on this machine, joins them in a process
group through a file in a temporary directory (no port to pick, nothing leaves the machine),
runs ``fn(rank, world_size, *args)`` on each and returns their results in rank order. It is
bounded: a process that raises makes the call raise with that process's traceback; ranks still
running are stopped after ``grace`` seconds; nothing runs past ``timeout``.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing.queues
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "run_local"]


class RankFailed(RuntimeError):
    """A rank of :func:`run_local` raised, died or ran out of time."""


def run_local(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    grace: float = 20.0,
    threads: int = 1,
    backend: str = "gloo",
    group_timeout: float = 60.0,
) -> list:
    """``[fn(0, R, *args), ..., fn(R-1, R, *args)]``, each on its own process in one group.

    ``fn`` must be importable by name (a module-level function) and its arguments and result
    picklable (tensors are fine). Each process uses ``threads`` torch threads and a process
    group with ``group_timeout`` seconds for every collective.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), died, or the ranks did not
            all finish within ``timeout`` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results: multiprocessing.queues.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="qkv-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, args, store, results, threads, backend, group_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, grace)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)


def _collect(procs, results, R: int, timeout: float, grace: float) -> list:
    out: dict[int, object] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    while len(out) + len(failures) < R:
        if failures:  # the others may be waiting for the rank that failed
            deadline = min(deadline, time.monotonic() + grace)
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive()
                and p.exitcode != 0
                and r not in out
                and not any(f.startswith(f"rank {r}:") for f in failures)
            ]
            for r in dead:
                failures.append(f"rank {r}: died with exit code {procs[r].exitcode}")
            if time.monotonic() > deadline:
                missing = [r for r in range(R) if r not in out]
                failures.append(
                    f"ranks {missing} did not finish within the time limit "
                    f"({timeout:g} s, or {grace:g} s after a failure)"
                )
                break
            continue
        if kind == "ok":
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            failures.append(f"rank {rank}: {payload}")
    if failures:
        raise RankFailed("run_local: " + "\n".join(failures))
    return [out[r] for r in range(R)]


def _entry(
    fn,
    rank: int,
    R: int,
    args: tuple,
    store: str,
    results,
    threads: int,
    backend: str,
    group_timeout: float,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=R,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        try:
            value = fn(rank, R, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put(("ok", rank, buf.getvalue()))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
