"""qkv's one progress bar (training steps, generated examples): one stderr line, no
dependency, and quiet when stderr is not a terminal (then a plain line every ``every`` seconds,
so logs stay readable). Layer 0, so tasks and training share it."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total) as bar: bar.update(step, loss=..., acc=...)``."""

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        desc: str = "train",
        stream: TextIO | None = None,
        every: float = 5.0,
        width: int = 24,
        unit: str = "step",
    ) -> None:
        self.total, self.start, self.desc, self.width, self.unit = total, start, desc, width, unit
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every, self._last = (0.1 if self.tty else every), 0.0
        self._t0 = time.perf_counter()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def update(self, step: int, force: bool = False, /, **fields: float | str) -> None:
        """Show ``step`` of ``total`` with ``fields`` (floats printed to 4 significant digits).
        ``force`` (positional: a field may be called anything) draws even between refreshes."""
        now = time.perf_counter()
        if not force and now - self._last < self.every and step < self.total:
            return
        self._last = now
        done = step / max(self.total, 1)
        bar = "#" * int(done * self.width) + "." * (self.width - int(done * self.width))
        elapsed = now - self._t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        shown = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
        )
        line = (
            f"{self.desc} [{bar}] {step}/{self.total} {shown} "
            f"{rate:.2f} {self.unit}/s eta {_duration(eta)}"
        )
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"
