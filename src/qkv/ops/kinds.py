"""The kind of a call: what decides which way runs it fastest, sizes in power-of-two buckets.

``auto``'s measured backend choice (``qkv.autotune``) and the routes chosen inside a backend by
measurement (``ops/tiled/route.py``) keep their verdicts per kind, in the process and on
disk under :func:`call_kind`'s string.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import functools

from ..masks import _Combined, _Window
from .call import AttentionCall

__all__ = ["bucket", "call_kind", "kind_key", "kind_string"]


def kind_key(call: AttentionCall) -> tuple:
    """What decides speed, sizes in power-of-two buckets: the key of a kept choice (a tuple:
    built on every call, so it is kept cheap; :func:`call_kind` is its readable form)."""
    q, k, mask_mod, score_mod = call.query, call.key, call.mask_mod, call.score_mod
    B, H = call.BH
    return (
        q.device.type,
        q.dtype,
        call.mask_kind if mask_mod is None else _mask_kind(mask_mod),
        call.is_causal,
        None if score_mod is None else type(score_mod),
        call.wants_grad,
        call.sinks is not None,
        call.enable_gqa and k.shape[-3] != q.shape[-3],
        bucket(B * H),
        bucket(q.shape[-2]),
        bucket(k.shape[-2]),
        q.shape[-1],
        call.value.shape[-1],
        call.dropout_p > 0,
    )


def _mask_kind(mod) -> object:
    """The mask's part of a kind: its type; for ``and_masks``/``or_masks`` the op and each
    part's kind (a prefix LM, an ``or``, sent torch's kernel by measurement, and a window
    within documents, an ``and``, timed 4-8x faster by the tiled loop, once shared one kind
    as two ``_Combined``: the first measured chose for both); for a window its bounds by
    their power-of-two buckets (a narrow band skips most blocks, a wide one few)."""
    kind = type(mod)
    if kind is _Combined:
        return (mod.op, tuple(_mask_kind(m) for m in mod.mods))
    if kind is _Window:
        left, right = mod.left, mod.right
        return (
            kind,
            None if left is None else bucket(left + 1),
            None if right is None else bucket(right + 1),
        )
    return kind


def _mask_name(mask: object) -> str:
    """:func:`_mask_kind`'s readable form, as a kind's string holds it."""
    if isinstance(mask, str):
        return mask
    if isinstance(mask, type):
        return mask.__name__.strip("_")
    assert isinstance(mask, tuple)
    if isinstance(mask[0], str):  # (op, parts)
        return f"{mask[0]}(" + ",".join(_mask_name(m) for m in mask[1]) + ")"
    kind, left, right = mask  # a window
    bounds = ",".join("inf" if b is None else f"{b}" for b in (left, right))
    return f"{_mask_name(kind)}[{bounds}]"


@functools.lru_cache(maxsize=4096)
def kind_string(key: tuple) -> str:
    device, dtype, mask, causal, score, grad, sinks, gqa, bh, T, S, D, Dv, drop = key
    mask = _mask_name(mask)
    if causal:
        mask = "causal" if mask == "none" else f"{mask}+causal"
    parts = [
        device,
        str(dtype).removeprefix("torch."),
        mask,
        "score:" + ("none" if score is None else score.__name__.strip("_")),
        "grad" if grad else "nograd",
        "sinks" if sinks else "",
        "gqa" if gqa else "",
        f"BH{bh}-T{T}-S{S}-D{D}-Dv{Dv}",
        f"drop{drop:d}",
    ]
    return "/".join(p for p in parts if p)


def call_kind(call: AttentionCall) -> str:
    """The kind of a call, as kept on disk: what decides speed, sizes in buckets."""
    return kind_string(kind_key(call))


def bucket(n: int) -> int:
    """n rounded up to a power of two (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
