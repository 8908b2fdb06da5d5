"""Which layers, batch elements, heads and query rows a capture keeps (:class:`_Layers`,
:class:`_Index`), and picking those weights out of one call's trace (:func:`_selected`).

Shape alphabet: B batch, H query heads, T query length, S key length; nb, nh, nr the batch
elements, heads and query rows kept.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..trace import AttentionTrace


class _Layers:
    """Which sites to record: all, or layer numbers and module names."""

    def __init__(self, layers, model: nn.Module) -> None:
        self.all = layers is None
        items = (
            []
            if layers is None
            else ([layers] if isinstance(layers, (int, str)) else _as_list("layers", layers))
        )
        self.text = _text(layers, items)
        self.numbers, self.names = [], []
        for item in items:
            if isinstance(item, str):
                self.names.append(item)
            elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                self.numbers.append(item)
            else:
                raise ValueError(
                    f"layers holds layer numbers (ints >= 0, counted in the order the sites "
                    f"first call attention) and module names (str), got {item!r}"
                )
        if not self.all and not items:
            raise ValueError("layers=[] records nothing; pass None for every layer")
        known = dict(model.named_modules())
        for name in self.names:
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"layers: {type(model).__name__} has no submodule named {name!r}{hint}"
                )

    def wants(self, layer: int, name: str) -> bool:
        return self.all or layer in self.numbers or any(_under(name, n) for n in self.names)

    def missing(self, sites: list[str]) -> list:
        """Asked-for numbers and names that matched no site."""
        return [n for n in self.numbers if n >= len(sites)] + [
            n for n in self.names if not any(_under(s, n) for s in sites)
        ]


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


class _Index:
    """An index along batch, heads or rows, resolved against each call's size.

    Batch elements and heads a call lacks raise; rows it lacks are left out (a decoding step
    has one row). Negative numbers count from the end.
    """

    def __init__(self, name: str, index) -> None:
        self.name, self.all = name, index is None
        self.slice: slice | None = None
        self.items: list[int] | None = None  # None: all of them, or a slice
        self.text = "None"
        if index is None:
            return
        if isinstance(index, slice):
            self.slice = index
        elif isinstance(index, int) and not isinstance(index, bool):
            self.items = [index]
        elif isinstance(index, Tensor):
            if (
                index.dtype.is_floating_point
                or index.dtype.is_complex
                or index.dtype == torch.bool
                or index.dim() > 1
            ):
                raise ValueError(
                    f"{name} must be an integer tensor of at most 1 dim, got "
                    f"{index.dtype} of shape {tuple(index.shape)}"
                )
            self.items = index.reshape(-1).tolist()
        else:
            self.items = _as_list(name, index)
            bad = [i for i in self.items if isinstance(i, bool) or not isinstance(i, int)]
            if bad:
                raise TypeError(f"{name} must hold ints, got {bad[0]!r}")
        if self.items is not None and not self.items:
            raise ValueError(f"{name}=[] keeps nothing; pass None for all")
        self.text = _text(index, self.items)

    def resolve(self, n: int, where: str) -> Tensor:
        """The indices into a dim of size ``n``, as a 1-D int64 tensor."""
        if self.slice is not None:
            return torch.tensor(range(n)[self.slice], dtype=torch.long, device="cpu")
        if self.items is None:  # index=None (self.all)
            return torch.arange(n, device="cpu")  # indices on the CPU, whatever the default
        inside = [i % n for i in self.items if -n <= i < n] if n else []
        if self.name != "rows" and len(inside) != len(self.items):
            outside = [i for i in self.items if not -n <= i < n]
            raise ValueError(
                f"qkv.capture: {self.name} {outside} asked for, but {where} has "
                f"{self.name} 0..{n - 1} ({n} in all)"
            )
        return torch.tensor(inside, dtype=torch.long, device="cpu")


def _as_list(name: str, index) -> list:
    """An ordered iterable as a list; a str, a set or a mapping is refused."""
    if isinstance(index, (set, frozenset)):
        raise TypeError(f"{name} has no order as a set; pass sorted({index!r})")
    if isinstance(index, (str, bytes, dict)) or not isinstance(index, Iterable):
        raise TypeError(
            f"{name} must be None, an int, a slice, a range or a list of ints, "
            f"got {type(index).__name__} {index!r}"
        )
    return list(index)


def _batch_heads(lead: tuple[int, ...]) -> tuple[int, int]:
    """The ``(B, H)`` of a call's dims before ``(T, S)``, as ``trace.select`` reads them;
    dims beyond two are folded into B."""
    if len(lead) == 0:
        return 1, 1
    if len(lead) == 1:
        return 1, lead[0]
    return math.prod(lead[:-1]), lead[-1]


def _selected(
    trace: AttentionTrace, lead: tuple[int, ...], b: Tensor, h: Tensor, r: Tensor, keep_scores: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(probs, lse, scores or None)`` of batch elements ``b``, heads ``h``, rows ``r``.

    Shape:
        -> ``(nb, nh, nr, S)``, ``(nb, nh, nr)``, ``(nb, nh, nr, S)``.
    """
    if len(lead) > 2:  # trace.select takes at most (B, H): pick from the full weights
        B, H = _batch_heads(lead)
        pick = lambda t: t.reshape(B, H, *t.shape[-2:])[b][:, h][:, :, r]  # noqa: E731
        return (
            pick(trace.probs),
            pick(trace.lse.unsqueeze(-1))[..., 0],
            pick(trace.scores) if keep_scores else None,
        )
    kwargs = {"rows": r, "heads": h if lead else None, "batch": b if len(lead) == 2 else None}
    part = trace.select(**{k: v for k, v in kwargs.items() if v is not None})

    def as4(t: Tensor) -> Tensor:  # (*kept lead, nr[, S]) -> (nb, nh, nr[, S])
        t = t.reshape((1,) * (2 - len(lead)) + tuple(t.shape))
        if len(lead) < 2:
            t = t[b]  # b holds only 0: repeats as asked
        if len(lead) < 1:
            t = t[:, h]
        return t

    return as4(part.probs), as4(part.lse), as4(part.scores) if keep_scores else None


def _text(index, items: list | None) -> str:
    """A setting as the capture keeps it: as given when that reads well (a range or slice
    stays a range or slice), else the list it was read as (a generator is read once)."""
    if index is None or isinstance(index, (int, str, slice, range, list, tuple)):
        return repr(index)
    return repr(items)
