"""``qkv train --nproc N``: start N processes of a command on this machine, as ``torchrun
--standalone --nproc_per_node N -m qkv ...`` does, with torchrun's own launcher
(:func:`torch.distributed.launcher.api.elastic_launch`) run in this process.

What this adds to calling torchrun:

* **Loopback only.** The rendezvous store listens on a free port (the OS picks it: no race)
  of 127.0.0.1, and gloo is told to use the loopback interface (``GLOO_SOCKET_IFNAME``, unless
  set), so nothing of the run reaches the network.
* **The exit status of the processes**, not torchrun's 1: 0 when all succeed; else the first
  failure's (2 for an error the process reported on one line, 130 after Ctrl-C, 128 + n for a
  process killed by signal n, with one line saying which rank it was). torchrun stops the
  others as soon as one fails, and its own report is not printed.
* **Ctrl-C** reaches every process once (the launcher forwards SIGINT): each finishes its step,
  rank 0 writes the checkpoint, and the status is 130. After ``grace`` seconds a process still
  running is killed.
* Each process gets ``OMP_NUM_THREADS`` = cores / N (unless set), as torchrun sets it to 1.

Torch's global state in this process (signal handlers, the launcher's log levels, the
environment) is as it was when :func:`launch` returns.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["launch"]

_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


def launch(argv: list[str], nproc: int, *, grace: float = 60.0, prog: str = "qkv") -> int:
    """Run ``python *argv`` (this interpreter) in ``nproc`` processes on this machine under
    torchrun's launcher; each gets torchrun's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``.

    Args:
        argv: Python's arguments for every process: ``["-m", "qkv", "train", ...]``, or a
            script and its arguments.
        nproc: Processes, at least 1.
        grace: Seconds the processes have to stop after Ctrl-C (or after one of them failed)
            before they are killed.
        prog: Names the command in the line that says a process was killed.

    Returns:
        The exit status: 0 when every process succeeded, else the first failure's (see the
        module's docstring).

    Raises:
        ValueError: ``nproc < 1``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"the number of processes must be an int >= 1, got {nproc!r}")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"qkv-{uuid.uuid4()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        shutdown_timeout=max(int(grace), 1),
        signals_to_handle=",".join(_SIGNALS),
    )
    with _signals_restored(), _quiet_launcher(), _environ(_child_env(nproc)):
        try:
            elastic_launch(config, sys.executable)("-u", *argv)
        except ChildFailedError as e:
            return _status(*_cause(e), prog)
        except SignalException as e:
            return 128 + int(e.sigval)
    return 0


def _cause(e) -> tuple[int, int]:
    """``(rank, exit code)`` of the process that made the run fail: one killed by a signal the
    launcher did not send (the others then failed because it was gone), else the first."""
    killed = [
        (f.timestamp, rank, f.exitcode)
        for rank, f in e.failures.items()
        if f.exitcode < 0 and f.exitcode != -signal.SIGTERM
    ]
    if killed:
        return min(killed)[1:]
    rank, failure = e.get_first_failure()
    return rank, failure.exitcode


def _status(rank: int, code: int, prog: str) -> int:
    """The exit status for the first process that failed; a line on stderr when a signal
    killed it (a process that failed by itself has said why)."""
    if code >= 0:
        return code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    print(
        f"{prog}: error: rank {rank} was killed by {name}; the other processes were stopped",
        file=sys.stderr,
    )
    return 128 - code


def _child_env(nproc: int) -> dict[str, str]:
    """What the processes get beside torchrun's variables: threads, and gloo on loopback."""
    env = {}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    loopback = _loopback_interface()
    if "GLOO_SOCKET_IFNAME" not in os.environ and loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """Set ``extra`` in this process's environment (the launcher's children inherit it), then
    put it back."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _signals_restored() -> Iterator[None]:
    """torchrun's launcher installs its own signal handlers and leaves them; put ours back."""
    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(getattr(signal, s)) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, s), handler)


@contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher logs every process it starts and stops, and reports a failure at length;
    the processes say what went wrong themselves, and :func:`_status` the rest."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
