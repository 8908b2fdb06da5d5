"""Input checks shared by the attention modules: (B, T, C) tensors, key_mask, batching; and
the shard geometry of a context-parallel call (which positions each rank holds).

Shape alphabet: B batch, T query length, S key length, C channels; T_r this rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..masks import merge_key_mask


@dataclass(frozen=True)
class ModuleInputs:
    """query/key/value made batched, with the masks merged into one (True = may attend).

    Shape:
        query ``(B, T, Cq)``; key ``(B, S, Ck)``; value ``(B, S, Cv)``; mask broadcastable to
        ``(B, H, T, S)`` or None; key_mask ``(B, S)`` or None (also inside ``mask``).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    unbatched: bool
    key_mask: Tensor | None = None
    context: ContextCall | None = None

    def single_head_mask(self) -> Tensor | None:
        """The mask for a module without heads: a key_mask's (B, 1, 1, S) becomes (B, 1, S).

        Shape:
            broadcastable to ``(B, T, S)``.
        """
        if self.mask is not None and self.mask.dim() == 4:
            return self.mask.squeeze(1)  # (B, 1|T, S)
        return self.mask


@dataclass
class ContextCall:
    """One context-parallel module call: the group and layout of the shards, and whether the
    ring path ran (a subclass whose attention ignores it is refused instead of computing
    attention within the local shard only)."""

    group: object
    layout: str
    ran: bool = field(default=False)


class _Held:
    """A process group held by a module: deep copies share it (a group is a handle of this
    process), pickling drops it (no other process has it; a module saved whole and loaded
    elsewhere runs on one process until it is given a group again)."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __deepcopy__(self, memo) -> _Held:
        return self

    def __reduce__(self):
        return (_Held, (None,))


class ContextGroupAttribute:
    """The ``context_group`` attribute of a module (a plain attribute to read and set) that
    survives ``copy.deepcopy`` and ``torch.save(module)``, which cannot copy a ProcessGroup."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_held"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        held = obj.__dict__.get(self.slot)
        return None if held is None else held.group

    def __set__(self, obj, group) -> None:
        obj.__dict__[self.slot] = _Held(group)


def shard_lengths(n: int, group, device=None) -> list[int]:
    """Every rank's shard length, in rank order (an all-gather: every rank of ``group`` must
    call it)."""
    import torch.distributed as dist

    from ..distributed.layout import group_info

    _, R = group_info(group)  # a clear error when torch.distributed is not set up
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


def shard_segments(n: int, group, layout: str, device=None) -> list[tuple[int, int]]:
    """This rank's runs ``[start, end)`` of whole-sequence positions, in the order they sit in
    its shard of ``n`` positions (one run for ``"contiguous"``, two for ``"balanced"``).
    An all-gather of the shard lengths: every rank of ``group`` must call it."""
    from ..distributed.layout import check_layout, group_info, segments_from_lengths

    check_layout(layout)
    rank, _ = group_info(group)
    return segments_from_lengths(shard_lengths(n, group, device), layout, "token", "context_group")[
        rank
    ]


def module_inputs(
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    dims: tuple[int, int, int | None],
    dtypes: tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None] = (None, None, None),
    *,
    context: ContextCall | None = None,
) -> ModuleInputs:
    """Check module inputs against the expected channel counts ``dims = (Cq, Ck, Cv)`` and
    the dtypes of the weights that project them, ``dtypes`` (None: any).

    ``key`` defaults to ``query`` and ``value`` to ``key`` (self-attention). Unbatched inputs
    ``(T, C)`` get a batch dim of 1, and ``key_mask (S,)`` with them. ``context`` is carried
    along for a context-parallel call (then S is this rank's shard of the keys).
    """
    key = query if key is None else key
    value = key if value is None else value
    for name, t, c, dtype in zip(("query", "key", "value"), (query, key, value), dims, dtypes):
        if name != "query" and t is query and c == dims[0] and dtype == dtypes[0]:
            continue  # self-attention: the query's checks again
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_dtype(name, t, dtype)  # before the shape: token ids (B, T) would look unbatched
        if t.dim() not in (2, 3) or (c is not None and t.shape[-1] != c):  # (dynamo traces `!=`
            # on a symbolic size, not `in` on a tuple holding one)
            want = "C" if c is None else c
            raise ValueError(
                f"{name} must be (B, L, {want}) or unbatched (L, {want}), got shape "
                f"{tuple(t.shape)}"
            )
    if not query.dim() == key.dim() == value.dim():
        raise ValueError(
            f"query, key and value must all be batched (3 dims) or all unbatched (2 dims), got "
            f"{query.dim()}, {key.dim()} and {value.dim()} dims"
        )
    unbatched = query.dim() == 2
    if unbatched:  # add B = 1, keeping "key is query" so self-attention stays fused
        q1 = query.unsqueeze(0)
        k1 = q1 if key is query else key.unsqueeze(0)
        value = k1 if value is key else q1 if value is query else value.unsqueeze(0)
        query, key = q1, k1
        key_mask = key_mask.unsqueeze(0) if isinstance(key_mask, Tensor) else key_mask
    B, S = query.shape[0], key.shape[1]
    if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must share the batch size, and key and value the length S"
        )
    _check_key_mask(key_mask, B, S)
    return ModuleInputs(
        query, key, value, merge_key_mask(attn_mask, key_mask), unbatched, key_mask, context
    )


def _check_key_mask(key_mask: Tensor | None, B: int, S: int) -> None:
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
        raise TypeError(
            f"key_mask must be a bool tensor with True marking a real key, got {got}; "
            f"torch's key_padding_mask has the opposite polarity: pass ~key_padding_mask"
        )
    if tuple(key_mask.shape) != (B, S):
        raise ValueError(f"key_mask must have shape (B, S) = {(B, S)}, got {tuple(key_mask.shape)}")


def _check_dtype(name: str, t: Tensor, dtype: torch.dtype | None) -> None:
    """The input of a projection must have its weights' dtype: torch's own error ("mat1 and
    mat2 must have the same dtype") names neither the input nor the fix."""
    if dtype is None or t.dtype == dtype:
        return
    if not t.is_floating_point():
        raise TypeError(
            f"{name} has dtype {t.dtype} but the module's weights are {dtype}: attention "
            f"modules take features (B, L, C), not token ids; embed token ids first (e.g. "
            f"nn.Embedding(vocab_size, C)), or cast other data with {name}.to({dtype})"
        )
    if _autocast_matches(t, dtype):
        return
    raise TypeError(
        f"{name} has dtype {t.dtype} but the module's weights are {dtype}: cast the input with "
        f"{name}.to({dtype}), or the module with module.to({t.dtype})"
    )


def _autocast_matches(t: Tensor, dtype: torch.dtype) -> bool:
    """Under torch.autocast the projections cast input and weights to one dtype themselves
    (every floating dtype but float64, which autocast leaves alone)."""
    try:
        enabled = torch.is_autocast_enabled(t.device.type)
    except RuntimeError:  # a device type autocast does not know
        return False
    return enabled and torch.float64 not in (t.dtype, dtype)
