"""Tasks to train attention models on, generated locally and seeded; nothing is downloaded.

``load(name, split=...)`` or the task's own function gives one split as tensors:

* ``reverse``, ``copy``, ``sort``: digits in, the digits reversed, copied or sorted out
  (lengths 4-10 by default); ``Seq2SeqData``.
* ``listops``: LRA's ListOps, ``variant="full"`` (lengths 500-2000) or ``"cpu"`` (100-500);
  ``ClassificationData``.
* ``digits``: scikit-learn's 8x8 handwritten digits (needs scikit-learn); ``ImageData``.
* ``pathfinder``: LRA's Pathfinder (``resolution=32`` or ``64``) and Path-X (``128``), are
  two markers joined by a contour of dashes, ``difficulty="easy"|"intermediate"|"hard"``
  (needs numpy); ``ImageData``. ``pathfinder_connected`` is its independent label check.

Generated tasks are deterministic for a seed and cached on disk (``cache_dir=``, else
``$QKV_CACHE/tasks``, else ``~/.cache/qkv/tasks``); a damaged cache file is regenerated.
Token ids are int64 padded with ``vocab.pad`` (0); masks are bool, True on real tokens.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from ._cache import default_cache_dir
from ._digits import digits
from ._listops import listops, listops_generate_tree, listops_parse_and_eval
from ._pathfinder import pathfinder, pathfinder_connected
from ._seq2seq import copy, reverse, sort
from ._types import ClassificationData, ImageData, Seq2SeqData, Vocab

_FUNCTIONS: dict[str, Callable] = {
    "reverse": reverse,
    "copy": copy,
    "sort": sort,
    "listops": listops,
    "digits": digits,
    "pathfinder": pathfinder,
}
TASKS: tuple[str, ...] = tuple(_FUNCTIONS)
_COMMON = ("split", "seed", "size", "cache_dir")


def load(
    name: str,
    *,
    split: str = "train",
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    **options,
) -> Seq2SeqData | ClassificationData | ImageData:
    """One split of the task ``name``.

    Args:
        name: one of ``TASKS``.
        split: ``"train"``, ``"valid"`` or ``"test"``; the splits are disjoint.
        seed: the same seed gives the same tensors.
        size: take the first ``size`` examples of the split (default: the task's size).
        cache_dir: where generated tasks are cached (``digits`` is read, not cached).
        **options: the task's own, e.g. ``variant="full"`` for ListOps or ``max_len=20``
            for the sequence tasks; see each task's function.

    Raises:
        ValueError: an unknown task, split or option, or a bad value; the message lists the
            valid ones.

    Shape:
        See ``Seq2SeqData``, ``ClassificationData`` and ``ImageData``.
    """
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown task {name!r}; the tasks are {TASKS}")
    fn = _FUNCTIONS[name]
    params = inspect.signature(fn).parameters
    allowed = [p for p in params if p not in _COMMON]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for task {name!r}; its options are {allowed}"
        )
    kwargs = {"seed": seed, "size": size, **options}
    if "cache_dir" in params:
        kwargs["cache_dir"] = cache_dir
    return fn(split, **kwargs)


__all__ = [
    "TASKS",
    "ClassificationData",
    "ImageData",
    "Seq2SeqData",
    "Vocab",
    "copy",
    "default_cache_dir",
    "digits",
    "listops",
    "listops_generate_tree",
    "listops_parse_and_eval",
    "load",
    "pathfinder",
    "pathfinder_connected",
    "reverse",
    "sort",
]
