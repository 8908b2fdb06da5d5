"""A run's output folder and the files in it: made up front, written atomically, with the
permissions every other file of the user gets.

* :func:`run_directory` makes the folder (and its missing parents) before any work starts and
  checks that a file can be written there, so a bad ``--out`` fails at once with one line
  instead of after the first hour of training; if the run then fails before it wrote anything,
  the folders it made are removed again (no empty output folder is left behind).
* :func:`write_atomic` writes to a temporary file beside the target, then renames it over the
  target: a reader (or a crash) never sees half a file. ``tempfile.mkstemp`` creates its file
  with mode 0600 whatever the umask, so the file is given ``0666 & ~umask`` before the rename,
  as ``open()`` would have given it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._files import file_mode, write_atomic

__all__ = ["file_mode", "run_directory", "write_atomic"]


@contextmanager
def run_directory(path: str | Path) -> Iterator[Path]:
    """Make ``path`` for a run's files and check it can be written to; if the block raises,
    remove the folders made here that are still empty.

    Args:
        path: The output folder; missing parents are made too.

    Yields:
        ``path`` as a :class:`Path`.

    Raises:
        ValueError: ``path`` or a parent of it is a file, or the folder cannot be made or
            written to; the message says which and what to do.
    """
    path = Path(path)
    made = _missing(path)  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as e:
        _remove_empty(made)
        raise ValueError(_why_unusable(path, e)) from None
    try:
        yield path
    except BaseException:
        _remove_empty(made)
        raise


def _missing(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    p = path.absolute()
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def _probe(folder: Path) -> None:
    """Create and delete a file in ``folder``: permission bits alone do not say whether a
    write will work (root ignores them; a read-only mount refuses root too)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".qkv-write-test.")
    os.close(fd)
    os.unlink(tmp)


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:  # deepest first: a parent is empty only once its child is gone
        try:
            d.rmdir()
        except OSError:  # not empty (someone wrote in it) or already gone: leave it
            return


def _why_unusable(path: Path, e: OSError) -> str:
    file = next((p for p in (path, *path.parents) if p.is_file()), None)
    if file is not None:
        return (
            f"cannot use {path} as the output folder: {file} is a file, not a folder; "
            f"choose another output folder"
        )
    return (
        f"cannot write in the output folder {path}: {e.strerror or e}; choose a folder "
        f"you can write to"
    )
