"""Validation at the public boundary of ``qkv.tasks``."""

from __future__ import annotations

from ._types import SPLITS


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")


def check_int(name: str, value: object, *, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
