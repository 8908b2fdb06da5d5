"""Which positions of a sequence each rank holds, and moving whole sequences in and out of shards.

Two layouts, for R ranks and a sequence of length L:

* ``"contiguous"``: rank r holds one run of positions. ``shard`` cuts as ``torch.tensor_split``
  does (the first ``L % R`` ranks hold one position more); ``ring_attention`` takes any
  contiguous cut, the runs in rank order, whatever their lengths.
* ``"balanced"``: the sequence is cut into 2R chunks (as ``tensor_split``) and rank r holds
  chunks ``r`` and ``2R - 1 - r``, one from the front and one from the back (torch's head-tail
  scheme). Under a causal mask the front chunk has little to attend to and the back chunk much,
  so every rank gets about the same work; with the contiguous layout the last rank does
  R times the work of the first.

Example (L = 8, R = 2)::

    contiguous   rank 0: 0 1 2 3      rank 1: 4 5 6 7
    balanced     rank 0: 0 1 6 7      rank 1: 2 3 4 5
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.base import refuse_second_derivative
from .comm import wait as _wait

__all__ = ["LAYOUTS", "assemble", "group_info", "segments", "shard", "unshard"]

LAYOUTS = ("contiguous", "balanced")

Segment = tuple[int, int]  # positions [start, end)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def group_info(group) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (None = the default group); a clear error when
    torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "qkv.distributed needs torch.distributed set up: run under torchrun (or call "
            "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU)) first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _splits(L: int, n: int) -> list[Segment]:
    """``n`` runs covering ``[0, L)`` as ``torch.tensor_split`` cuts them."""
    q, extra = divmod(L, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + q + (1 if i < extra else 0))
    return list(itertools.pairwise(bounds))


def segments(L: int, R: int, layout: str = "contiguous") -> list[list[Segment]]:
    """The positions each rank holds under ``layout``, as lists of ``[start, end)`` runs in the
    order they sit in the rank's local tensor.

    Example:
        >>> segments(10, 2, "balanced")
        [[(0, 3), (8, 10)], [(3, 5), (5, 8)]]
    """
    check_layout(layout)
    if layout == "contiguous":
        return [[s] for s in _splits(L, R)]
    chunks = _splits(L, 2 * R)
    return [[chunks[r], chunks[2 * R - 1 - r]] for r in range(R)]


def segments_from_lengths(
    lengths: list[int], layout: str, what: str, caller: str = "ring_attention"
) -> list[list[Segment]]:
    """Each rank's runs, from the local lengths every rank holds (contiguous: any lengths, in
    rank order; balanced: the lengths :func:`shard` gives, else a ValueError naming them and
    ``caller``)."""
    if layout == "contiguous":
        starts = [sum(lengths[:r]) for r in range(len(lengths))]
        return [[(a, a + n)] for a, n in zip(starts, lengths)]
    segs = segments(sum(lengths), len(lengths), "balanced")
    want = [sum(b - a for a, b in s) for s in segs]
    if want != list(lengths):
        raise ValueError(
            f"{caller}(layout='balanced'): the ranks hold {what} shards of lengths "
            f"{list(lengths)}, but a balanced layout of {sum(lengths)} positions on "
            f"{len(lengths)} ranks has lengths {want}; cut the sequence with "
            f"qkv.distributed.shard(x, group, layout='balanced')"
        )
    return segs


def assemble(parts: list[Tensor], segs: list[list[Segment]], dim: int = -2) -> Tensor:
    """The whole sequence from every rank's shard: ``parts[r]`` holds the runs ``segs[r]``
    in order (a shard may be longer, as when padded for an all-gather; the rest is ignored).

    Shape:
        parts ``(..., >= L_r, ...)`` -> ``(..., L, ...)`` with L the positions of all runs.
    """
    dim = dim % parts[0].dim()
    shape = list(parts[0].shape)
    shape[dim] = sum(b - a for runs in segs for a, b in runs)
    out = parts[0].new_empty(shape)
    for part, runs in zip(parts, segs):
        at = 0
        for a, b in runs:
            out.narrow(dim, a, b - a).copy_(part.narrow(dim, at, b - a))
            at += b - a
    return out


def _take(x: Tensor, dim: int, segs: list[Segment]) -> Tensor:
    parts = [x.narrow(dim, a, b - a) for a, b in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def shard(x: Tensor, group=None, *, dim: int = -2, layout: str = "contiguous") -> Tensor:
    """This rank's shard of ``x`` along the sequence dim ``dim`` (every rank passes the whole
    ``x``, e.g. the same seeded batch). A view for ``"contiguous"``, a copy for ``"balanced"``.
    Gradients flow back into this rank's positions of ``x``.

    Shape:
        ``x`` ``(..., L, ...)`` -> ``(..., L_r, ...)`` with L_r this rank's share (about L / R).

    Example:
        >>> q = qkv.distributed.shard(q, layout="balanced")       # (B, H, T, D) -> (B, H, T_r, D)
        >>> ids = qkv.distributed.shard(ids, dim=-1, layout="balanced")  # (B, T) -> (B, T_r)
    """
    rank, R = group_info(group)
    return _take(x, dim, segments(x.shape[dim], R, layout)[rank])


class _Unshard(torch.autograd.Function):
    """All-gather along ``dim`` and put the positions in order; backward sums the incoming
    gradients over the ranks (each used the whole tensor) and keeps this rank's positions."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int, layout: str, timeout):
        rank, R = group_info(group)
        dim = dim % x.dim()
        lengths = _gather_lengths(x.shape[dim], group, R, x.device, timeout)
        segs = segments_from_lengths(lengths, layout, "input", "unshard")
        longest = max(lengths)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim=dim) if pad[dim] else x.contiguous()
        parts = [torch.empty_like(padded) for _ in range(R)]
        _wait(
            lambda: dist.all_gather(parts, padded, group=group, async_op=True), timeout, "unshard"
        )
        out = assemble(parts, segs, dim)
        ctx.group, ctx.dim, ctx.segs, ctx.timeout = group, dim, segs[rank], timeout
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        refuse_second_derivative("unshard", "its all-reduce builds no graph")
        grad = grad.contiguous()
        _wait(
            lambda: dist.all_reduce(grad, group=ctx.group, async_op=True),
            ctx.timeout,
            "unshard backward",
        )
        return _take(grad, ctx.dim, ctx.segs), None, None, None, None


def unshard(
    x: Tensor,
    group=None,
    *,
    dim: int = -2,
    layout: str = "contiguous",
    timeout: float | None = None,
) -> Tensor:
    """The whole sequence from every rank's shard (an all-gather; every rank of ``group`` must
    call it). The inverse of :func:`shard`; shards may have any lengths for ``"contiguous"``.

    Gradients: every rank gets the whole tensor, so the gradient reaching this rank's shard is
    the sum over ranks of the gradients of their copies (an all-reduce in backward, which
    every rank must run too).

    Shape:
        ``(..., L_r, ...)`` -> ``(..., L, ...)``.
    """
    return _Unshard.apply(x, group, dim, check_layout(layout), timeout)


def _gather_lengths(n: int, group, R: int, device, timeout) -> list[int]:
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(R)]
    _wait(lambda: dist.all_gather(every, mine, group=group, async_op=True), timeout, "unshard")
    return [int(t) for t in every]
