"""Comparing two captures of one architecture: which heads changed, and where.

``compare(a, b)`` takes two captures of the same model shape (two inputs of one length, or
one input before and after fine-tuning) and gives, for every recorded head, the signed
difference ``d = a - b`` of its weights and two numbers of how much it changed:

* ``mean``: the mean of ``|d|`` over the kept batch elements, query rows and keys;
* ``max``: the largest ``|d|``.

:meth:`Comparison.ranked` orders the heads by either, most changed first. This is the ranking
the viewer's Changes tab shows (``qkv view A.pt --against B.pt``).

The differences are float64 when both captures are, else float32 (the weights of either cast
to float32 first); ``mean`` is accumulated in float64.

Shape alphabet: B batch, H heads, T query length, S key length; nb, nh, nr kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..capture import Captured

__all__ = ["Comparison", "Difference", "compare"]

MEASURES = ("mean", "max")


@dataclass(frozen=True, repr=False)
class Difference:
    """The signed difference of one recorded call: ``a.probs - b.probs``.

    Attributes:
        name: The site (module name), as in both captures.
        layer, call: The capture's layer number and call number.
        diff: ``a - b`` of the kept batch elements, heads and rows.
        batch, heads, rows: What both captures kept (int64).
        shape: The call's ``(B, H, T, S)``.

    Shape:
        diff ``(nb, nh, nr, S)``.
    """

    name: str
    layer: int
    call: int
    diff: Tensor
    batch: Tensor
    heads: Tensor
    rows: Tensor
    shape: tuple[int, int, int, int]

    def __repr__(self) -> str:
        return (
            f"Difference({self.name!r}, layer={self.layer}, call={self.call}, "
            f"diff{tuple(self.diff.shape)})"
        )


@dataclass(frozen=True, repr=False)
class Comparison:
    """How much each recorded head changed between two captures (``a - b``).

    Attributes:
        keys: ``(layer, head)`` of each head, by layer then head.
        sites: The site of each head.
        mean: ``mean[n]``: mean ``|d|`` of head ``keys[n]`` (float64).
        max: ``max[n]``: largest ``|d|`` of head ``keys[n]`` (float64).
        differences: One :class:`Difference` per compared call, by layer.

    Shape:
        mean, max ``(N,)``: N heads.
    """

    keys: tuple[tuple[int, int], ...]
    sites: tuple[str, ...]
    mean: Tensor
    max: Tensor
    differences: tuple[Difference, ...]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, float]:
        """``cmp[layer, head]`` -> ``{"mean": ..., "max": ...}``."""
        n = self._index(key)
        return {"mean": float(self.mean[n]), "max": float(self.max[n])}

    def measure(self, by: str) -> Tensor:
        """``mean`` or ``max`` of every head, in table order. Shape: ``(N,)``."""
        if by not in MEASURES:
            raise ValueError(f"by must be 'mean' or 'max' (of |a - b|), got {by!r}")
        return self.mean if by == "mean" else self.max

    def ranked(self, by: str = "mean") -> list[tuple[int, int]]:
        """Every head ``(layer, head)``, most changed first by ``by`` (ties in table order)."""
        order = torch.argsort(-self.measure(by), stable=True).tolist()
        return [self.keys[i] for i in order]

    def top(self, k: int = 1, by: str = "mean") -> list[tuple[int, int]]:
        """The ``k`` most changed heads."""
        return self.ranked(by)[:k]

    def diff(self, layer: int, head: int) -> Tensor:
        """The signed difference ``a - b`` of one head. Shape: ``(nb, nr, S)``."""
        self._index((layer, head))
        d = next(d for d in self.differences if d.layer == layer)
        return d.diff[:, d.heads.tolist().index(head)]

    def to_rows(self, by: str = "mean") -> list[dict]:
        """One dict per head, most changed first: ``layer``, ``head``, ``site``, ``mean``,
        ``max``."""
        return [
            {"layer": k[0], "head": k[1], "site": self.sites[self.keys.index(k)], **self[k]}
            for k in self.ranked(by)
        ]

    def _index(self, key) -> int:
        if key not in self.keys:
            raise KeyError(
                f"no head {key!r} in this comparison; it has {len(self.keys)} "
                f"heads, e.g. {list(self.keys[:4])}"
            )
        return self.keys.index(key)

    def __repr__(self) -> str:
        return f"Comparison({len(self.keys)} heads, ranked by mean |a - b|)\n{self}"

    def __str__(self) -> str:
        lines = [f"{'layer':>5} {'head':>4}  {'mean |d|':>10} {'max |d|':>10}"]
        for row in self.to_rows():
            lines.append(
                f"{row['layer']:>5} {row['head']:>4}  {row['mean']:>10.4f} {row['max']:>10.4f}"
            )
        return "\n".join(lines)


def compare(a: Captured, b: Captured, *, call: int = 0, batch: int | None = None) -> Comparison:
    """Per-head differences ``a - b`` of two captures, and the heads ranked by change.

    Args:
        a, b: Captures of the same architecture and input length, with the same bounds
            (``layers=``, ``heads=``, ``rows=``, ``batch=``): the same sites, calls, shapes
            and kept heads, rows and batch elements.
        call: Which call of each site (0: the first forward).
        batch: One batch element (its index in the model's batch) to compare, or None for
            every kept one.

    Returns:
        A :class:`Comparison`: every head's ``mean`` and ``max`` of ``|a - b|`` and the
        signed differences.

    Raises:
        TypeError: ``a`` or ``b`` is not a :class:`qkv.Captured`.
        ValueError: The captures record different sites or layers, or a call differs in
            shape ``(B, H, T, S)``, kept heads, rows or batch elements; ``call`` or ``batch``
            was not recorded.

    Shape:
        Each record's probs ``(nb, nh, nr, S)``; ``Comparison.mean``/``max`` ``(N,)``.

    Example:
        >>> cmp = qkv.analysis.compare(cap_after, cap_before)
        >>> cmp.ranked("mean")[:3]       # the three heads that changed most
        >>> cmp.diff(*cmp.top()[0])      # (nb, nr, S): where the most changed head moved
    """
    for name, cap in (("a", a), ("b", b)):
        if not isinstance(cap, Captured):
            raise TypeError(f"compare takes two qkv.Captured, got {type(cap).__name__} for {name}")
    ra, rb = _records(a, call, "a"), _records(b, call, "b")
    sites = lambda rs: [(r.layer, r.name) for r in rs]  # noqa: E731
    if sites(ra) != sites(rb):
        raise ValueError(
            f"the captures record different layers (call {call}): a has "
            f"{len(ra)} ({_show(ra)}), b has {len(rb)} ({_show(rb)}); compare "
            f"captures of the same architecture and the same layers="
        )
    keys, names, means, maxes, diffs = [], [], [], [], []
    for x, y in zip(ra, rb):
        _same_record(x, y)
        pick = _batch_positions(x, batch)  # (nb',)
        dtype = torch.float64 if x.probs.dtype == y.probs.dtype == torch.float64 else torch.float32
        d = x.probs[pick].to("cpu", dtype) - y.probs[pick].to("cpu", dtype)  # (nb', nh, nr, S)
        for hi, h in enumerate(x.heads.tolist()):
            mag = d[:, hi].abs()  # (nb', nr, S)
            keys.append((x.layer, h))
            names.append(x.name)
            means.append(float(mag.double().mean()))
            maxes.append(float(mag.max()))
        diffs.append(
            Difference(x.name, x.layer, x.call, d, x.batch[pick], x.heads, x.rows, tuple(x.shape))
        )
    return Comparison(
        tuple(keys),
        tuple(names),
        torch.tensor(means, dtype=torch.float64),
        torch.tensor(maxes, dtype=torch.float64),
        tuple(diffs),
    )


def _records(cap: Captured, call: int, which: str) -> list:
    """The records of call ``call``, by layer (one per site)."""
    if isinstance(call, bool) or not isinstance(call, int):
        raise TypeError(f"call must be an int, got {call!r}")
    recs = sorted((r for r in cap.records if r.call == call), key=lambda r: r.layer)
    if not recs:
        calls = sorted({int(r.call) for r in cap.records})
        raise ValueError(
            f"capture {which} holds no call {call} (its calls: {calls}); pass call= one of them"
        )
    return recs


def _show(recs: list) -> str:
    shown = ", ".join(f"layer {r.layer} {r.name or '(model)'}" for r in recs[:4])
    return shown + (" ..." if len(recs) > 4 else "")


def _same_record(x, y) -> None:
    where = f"layer {x.layer} ({x.name!r})"
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(
            f"{where}: a's call is (B, H, T, S) {tuple(x.shape)} and b's "
            f"{tuple(y.shape)}; compare captures of the same architecture and "
            f"input length"
        )
    for what in ("heads", "rows", "batch"):
        u, v = getattr(x, what), getattr(y, what)
        if not torch.equal(u, v):
            raise ValueError(
                f"{where}: a kept {what} {_few(u)} and b {_few(v)}; capture both "
                f"with the same {what}="
            )


def _few(t: Tensor) -> str:
    items = t.tolist()
    if len(items) <= 8:
        return str(items)
    return f"[{', '.join(map(str, items[:8]))}, ...] ({len(items)})"


def _batch_positions(rec, batch: int | None) -> Tensor:
    """Positions in the record's kept batch of the element(s) to compare. Shape: ``(nb',)``."""
    if batch is None:
        return torch.arange(len(rec.batch))
    kept = rec.batch.tolist()
    if isinstance(batch, bool) or not isinstance(batch, int) or batch not in kept:
        raise ValueError(
            f"batch={batch!r} was not kept by the captures (kept batch elements "
            f"{kept}); pass one of them, or None for all"
        )
    return torch.tensor([kept.index(batch)])
