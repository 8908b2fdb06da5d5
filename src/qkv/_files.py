"""Files written atomically with the permissions every other file of the user gets (layer 0:
the task cache and the training loop both write through it).

``tempfile.mkstemp`` creates its file with mode 0600 whatever the umask, so the file is given
``0666 & ~umask`` before the rename, as ``open()`` would have given it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["file_mode", "write_atomic"]


def file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask: ``0o666 & ~umask``."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read from /proc where Linux shows it; elsewhere by setting it and
    putting it straight back (the only portable way, though a file another thread creates in
    between would get umask 0)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, sync it, then rename it over
    ``path``. A write killed half-way leaves ``path`` as it was and no temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp's 0600 would ignore the umask
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
