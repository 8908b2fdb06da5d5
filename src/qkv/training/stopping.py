"""How a run stops early: Ctrl-C (the loop finishes the step, checkpoints and returns), and a
data-parallel peer that died or hung (a :class:`ConnectionError` that says which checkpoint
continues the run)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from .checkpoint import _Run
from .parallel import LostPeer, lost_peer


class _StopFlag:
    """SIGINT sets a flag the loop checks after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.set = False
        self._old: Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> _StopFlag:
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


def _collective(run: _Run, where: str, work: Callable[[], Any]) -> Any:
    """``work()``; a collective inside it that fails because another rank died or hung
    becomes a :class:`LostPeer` (a ConnectionError) that says so."""
    try:
        return work()
    except RuntimeError as e:
        lost = lost_peer(e, run.ranks, where)
        if lost is None:
            raise
        resume = (
            f"; the checkpoint of step {run.saved} continues the run with resume=True (--resume)"
            if run.saved
            else ""
        )
        raise LostPeer(f"{lost}{resume}") from e
