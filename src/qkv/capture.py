"""``qkv.capture``: the attention weights of a whole model's forward, by module, layer and head.

::

    with qkv.capture(model, layers=[0, 5], heads=[0, 3], rows=range(8000, 8016)) as cap:
        model(x)
    cap.layer(5)[0].probs               # (B, 2, 16, S): heads 0 and 3, query rows 8000..8015
    cap.save("attn.pt"); cap2 = qkv.load_capture("attn.pt")

Every call of ``qkv.scaled_dot_product_attention`` (and ``qkv.linear_attention``) made while
a submodule of ``model`` runs is seen, whatever called it: qkv's own modules and models, torch
modules patched by ``qkv.torch_compat``, Hugging Face models with
``attn_implementation="qkv"``; on every backend.

* **Site**: the innermost submodule of ``model`` whose forward is running when attention is
  called (forward hooks on every submodule keep the stack of names; they are removed on exit,
  error or not). **Layer**: the order in which distinct sites first call attention during the
  capture, so in a stack of blocks layer ``i`` is block ``i``. **Call**: the n-th call of a
  site (``generate`` calls every layer once per step).
* **Cost**: a call nobody asked for (its layer is not in ``layers``) runs exactly as without
  capture, with no trace formed. A wanted call runs with ``return_trace=True``; with
  ``heads``/``rows``/``batch`` given, only those weights are computed (a fast backend's
  trace recomputes just those rows from its log-sum-exp) and kept, so the call's inputs
  are freed as usual. With none of them given, each wanted call's full ``(B, H, T, S)``
  weights are materialised and kept: bound a long sequence's capture.
* Everything kept is detached (no gradient, no autograd graph held) and the forward's
  outputs and gradients are those of an uncaptured run.

Shape alphabet: B batch, H query heads, T query length, S key length; nb, nh, nr the batch
elements, heads and query rows kept.
"""

from __future__ import annotations

import difflib
import math
import os
import secrets
import threading
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from . import recording
from .trace import AttentionTrace

__all__ = ["Captured", "CapturedAttention", "capture", "load_capture"]

_FORMAT, _VERSION = "qkv.capture", 1
_CAPTURED_MODELS: set[int] = set()  # id() of the models inside a capture now


def capture(
    model: nn.Module, layers=None, heads=None, rows=None, *, batch=None, scores: bool = False
) -> _Capture:
    """Record the attention weights of every qkv attention call inside ``model``.

    A context manager: ``with qkv.capture(model, ...) as cap:`` gives a :class:`Captured`
    that fills while the block runs (one forward, several, or ``generate``). Calls made
    outside ``model``'s submodules (another model, a bare functional call) are not recorded.

    Args:
        model: The model whose attention to record.
        layers: Which sites to record: None (all), or a layer number / module name, or a list
            of them. Layer numbers count the sites in the order they first call attention
            (0, 1, ...). A name selects that module and everything under it
            (``"blocks.layers.5"`` takes its ``self_attn``); names are checked on entry.
        heads: Query heads to keep: None (all), an int, a slice, a range, or a list/tuple/
            tensor of ints. A head a call does not have raises, naming the site.
        rows: Query rows to keep, indexing each call's query positions ``0..T-1``;
            negative ones count from the end (``rows=-1``: the last query of every call, the
            new token of each decoding step). A call with fewer rows keeps the rows it has
            (a decoding step of one token keeps none of ``range(8000, 8016)``, and its record
            then holds 0 rows); the kept row numbers are in each record's ``rows``.
        batch: Batch elements to keep, as ``heads``.
        scores: Keep the scores (scaled, masked, before softmax) beside the weights.

    Returns:
        The context manager; entering it gives the :class:`Captured`.

    Raises:
        ValueError: On exit, when the block raised nothing, if a layer number, name or the
            rows asked for matched no call, listing what the model did call (a capture that
            saw no qkv attention call at all warns instead, and its :class:`Captured` says so
            when indexed). On entry, for a capture of a model already being captured.

    Shape:
        Each record's ``probs`` is ``(nb, nh, nr, S)`` (all four dims always: the dims before
        ``(T, S)`` of a call are read as ``trace.select`` reads them, ``(B, H)``, ``(H,)`` or
        none; more are folded into B). ``lse`` ``(nb, nh, nr)``.

    Example:
        >>> model = qkv.DecoderLM(100, 64, 4, 2).eval()
        >>> with qkv.capture(model, heads=[0], rows=[-1]) as cap:
        ...     model.generate(torch.tensor([[1, 2, 3]]), 4)
        >>> [r.probs.shape for r in cap.layer(0)]   # the prompt's last row, then each step's
    """
    return _Capture(model, layers, heads, rows, batch, scores)


@dataclass(frozen=True, repr=False)
class CapturedAttention:
    """The weights of one attention call of a capture.

    Attributes:
        name: Qualified name of the site (``""`` for the model itself).
        layer: The site's layer number in the capture.
        call: This call's number among the site's calls (0, 1, ...).
        probs: Attention weights of the kept batch elements, heads and rows (before dropout).
        lse: Log-sum-exp of each kept row.
        scores: Scaled scores after masking, when the capture asked for them; else None.
        batch, heads, rows: Which batch elements, heads and query rows of the call were kept.
        shape: The call's ``(B, H, T, S)``.
        backend: The backend that ran the call.

    Shape:
        probs, scores ``(nb, nh, nr, S)``; lse ``(nb, nh, nr)``; batch ``(nb,)``,
        heads ``(nh,)``, rows ``(nr,)`` int64.
    """

    name: str
    layer: int
    call: int
    probs: Tensor
    lse: Tensor
    scores: Tensor | None
    batch: Tensor
    heads: Tensor
    rows: Tensor
    shape: tuple[int, int, int, int]
    backend: str

    def __repr__(self) -> str:
        B, H, T, _S = self.shape
        kept = lambda t, n: "all" if len(t) == n else f"{len(t)} of {n}"  # noqa: E731
        return (
            f"CapturedAttention({self.name!r}, layer={self.layer}, call={self.call}, "
            f"probs{tuple(self.probs.shape)}, batch {kept(self.batch, B)}, heads "
            f"{kept(self.heads, H)}, rows {kept(self.rows, T)}, backend={self.backend!r})"
        )

    def _to_dict(self) -> dict:
        return {
            "name": self.name,
            "layer": self.layer,
            "call": self.call,
            "probs": _compact(self.probs),
            "lse": _compact(self.lse),
            "scores": None if self.scores is None else _compact(self.scores),
            "batch": self.batch,
            "heads": self.heads,
            "rows": self.rows,
            "shape": list(self.shape),
            "backend": self.backend,
        }

    @classmethod
    def _from_dict(cls, d: dict) -> CapturedAttention:
        B, H, T, S = (int(n) for n in d["shape"])
        return cls(
            d["name"],
            int(d["layer"]),
            int(d["call"]),
            d["probs"],
            d["lse"],
            d["scores"],
            d["batch"],
            d["heads"],
            d["rows"],
            (B, H, T, S),
            d["backend"],
        )


class Captured:
    """The records of a capture: iterate them in call order, or look them up by site.

    Attributes:
        records: One :class:`CapturedAttention` per recorded call, in call order.
        sites: Names of the sites that called attention, in layer order (``sites[i]`` is
            layer ``i``), including sites that ``layers`` left out.
        settings: What the capture asked for (``layers``, ``heads``, ``rows``, ``batch``,
            ``scores``, ``model``), as text.
    """

    def __init__(
        self,
        records: list[CapturedAttention] | None = None,
        sites: list[str] | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.records = list(records or [])
        self.sites = list(sites or [])
        self.settings = dict(settings or {})

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[CapturedAttention]:
        return iter(self.records)

    def __contains__(self, name: object) -> bool:
        return any(r.name == name for r in self.records)

    def __getitem__(self, name: str) -> list[CapturedAttention]:
        """The records of the site ``name``, in call order."""
        if not isinstance(name, str):
            raise TypeError(
                f"index a Captured by site name (str), got {type(name).__name__} "
                f"{name!r}; use cap.layer(i) for layer i, or cap.records[i]"
            )
        found = [r for r in self.records if r.name == name]
        if not found:
            raise KeyError(self._missing(f"site {name!r}", name in self.sites))
        return found

    def layer(self, i: int) -> list[CapturedAttention]:
        """The records of layer ``i`` (the i-th site to call attention), in call order."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(
                f"layer takes an int, got {type(i).__name__} {i!r}; "
                f"look a site up by name with cap[name]"
            )
        found = [r for r in self.records if r.layer == i]
        if not found:
            raise IndexError(self._missing(f"layer {i}", 0 <= i < len(self.sites)))
        return found

    def _missing(self, what: str, seen: bool) -> str:
        if not self.sites:
            return f"{what}: this capture recorded nothing ({_NOTHING})"
        if seen:
            return (
                f"{what} called attention but was not recorded (layers="
                f"{self.settings.get('layers', 'None')}); recorded layers: "
                f"{sorted({r.layer for r in self.records})}"
            )
        return (
            f"{what} did not call attention during the capture; the "
            f"{len(self.sites)} sites that did, in layer order: {_list(self.sites)}"
        )

    def __repr__(self) -> str:
        asked = ", ".join(
            f"{k}={v}"
            for k, v in self.settings.items()
            if k not in ("model", "scores") and v != "None"
        )
        head = (
            f"Captured({self.settings.get('model', 'model')}: {len(self.records)} records "
            f"from {len({r.layer for r in self.records})} of {len(self.sites)} sites"
            f"{'; ' + asked if asked else ''})"
        )
        lines = [head] if self.sites else [head, f"  nothing recorded: {_NOTHING}"]
        for layer, name in enumerate(self.sites[:16]):
            recs = [r for r in self.records if r.layer == layer]
            if not recs:
                lines.append(f"  layer {layer:>2}  {name or '(model)'}: not recorded")
                continue
            shapes = sorted({tuple(r.probs.shape) for r in recs})
            shown = str(shapes[0]) + ("" if len(shapes) == 1 else f" .. {shapes[-1]}")
            lines.append(
                f"  layer {layer:>2}  {name or '(model)'}: {len(recs)} call"
                f"{'s' if len(recs) != 1 else ''}, probs {shown} "
                f"{recs[0].probs.dtype}, {recs[0].backend}"
            )
        if len(self.sites) > 16:
            lines.append(f"  ... {len(self.sites) - 16} more sites")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Jupyter shows a capture as the viewer, inline (``qkv.viz.show``; one sandboxed
        iframe). viz is imported here, on first display: ``import qkv`` loads none of it."""
        from .viz.notebook import repr_html

        return repr_html(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the capture to one file, atomically (a temporary file beside ``path``,
        renamed over it: an interrupted save leaves ``path`` as it was). Plain tensors,
        lists and dicts only: :func:`load_capture` reads it with ``weights_only=True``."""
        path = Path(path)
        data = {
            "format": _FORMAT,
            "version": _VERSION,
            "sites": list(self.sites),
            "settings": dict(self.settings),
            "records": [r._to_dict() for r in self.records],
        }
        tmp, f = _new_temp_beside(path)
        try:
            with f:
                torch.save(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def load_capture(path: str | os.PathLike, *, map_location=None) -> Captured:
    """Read a capture written by :meth:`Captured.save` (with ``weights_only=True``: no code
    from the file runs). ``map_location`` as in ``torch.load``."""
    data = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"{os.fspath(path)!r} is not a qkv capture (write one with Captured.save)")
    if data.get("version") != _VERSION:
        raise ValueError(
            f"{os.fspath(path)!r} is a qkv capture of format version "
            f"{data.get('version')!r}; this qkv reads version {_VERSION}"
        )
    return Captured(
        [CapturedAttention._from_dict(d) for d in data["records"]], data["sites"], data["settings"]
    )


_NOTHING = (
    "no qkv attention call ran inside the model: capture sees calls of "
    "qkv.scaled_dot_product_attention and qkv.linear_attention made while a "
    "submodule of the model runs. Run the model inside the with block; for torch "
    "modules use qkv.torch_compat.patch, for Hugging Face models "
    "attn_implementation='qkv'"
)


@dataclass
class _Site:
    layer: int
    wanted: bool
    calls: int = 0


class _Capture(recording.Recorder):
    """The context manager :func:`capture` returns; a recorder while entered."""

    def __init__(self, model: nn.Module, layers, heads, rows, batch, scores: bool) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"qkv.capture takes a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(scores, bool):
            raise TypeError(f"scores must be True or False, got {scores!r}")
        self._model, self._keep_scores = model, scores
        self._layers = _Layers(layers, model)
        self._batch, self._heads = _Index("batch", batch), _Index("heads", heads)
        self._rows = _Index("rows", rows)
        self._bounded = not (self._batch.all and self._heads.all and self._rows.all)
        settings = {
            "model": type(model).__name__,
            "layers": self._layers.text,
            "heads": self._heads.text,
            "rows": self._rows.text,
            "batch": self._batch.text,
            "scores": str(scores),
        }
        self._captured = Captured(settings=settings)
        self._sites: dict[str, _Site] = {}
        self._stack: list[str] = []
        self._handles: list = []
        self._outside = 0  # attention calls while no submodule of the model ran
        self._most_rows = 0  # the most query rows a wanted call had
        self._kept_rows = False  # whether any wanted call kept a row
        self._state = "new"

    def __enter__(self) -> Captured:
        if self._state != "new":
            raise RuntimeError(
                "a qkv.capture(...) is entered once; make a new one for another capture"
            )
        if id(self._model) in _CAPTURED_MODELS:
            raise ValueError(
                f"this {type(self._model).__name__} is already inside a "
                f"qkv.capture; nested captures of one model are refused (ask "
                f"the outer capture for the layers, heads and rows you want)"
            )
        self._state, self._thread = "entered", threading.get_ident()
        try:
            for name, module in self._model.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(self._push(name), prepend=True)
                )
                self._handles.append(
                    module.register_forward_hook(self._pop(name), always_call=True)
                )
            _CAPTURED_MODELS.add(id(self._model))
            self._token = recording.start(self)
        except BaseException:
            self._remove_hooks()
            _CAPTURED_MODELS.discard(id(self._model))
            raise
        return self._captured

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            recording.stop(self._token)
        finally:
            self._remove_hooks()
            _CAPTURED_MODELS.discard(id(self._model))
            self._state, self._stack = "exited", []
        if exc_type is None:
            self._check()
        return False

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _mine(self) -> bool:
        """Whether the running module call is in the capturing thread (a compiled call is
        taken to be: dynamo cannot read the thread)."""
        return torch.compiler.is_compiling() or threading.get_ident() == self._thread

    def _push(self, name: str):
        def hook(module, args):
            if self._mine():
                self._stack.append(name)

        return hook

    def _pop(self, name: str):
        def hook(module, args, output):
            if not self._mine():
                return
            stack = self._stack  # pop back to this module's entry, even after an exception
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] == name:
                    del stack[i:]
                    break

        return hook

    # recording.Recorder
    def want(self):
        if not self._stack:
            self._outside += 1
            return None
        name = self._stack[-1]
        site = self._sites.get(name)
        if site is None:
            layer = len(self._sites)
            site = self._sites[name] = _Site(layer, self._layers.wants(layer, name))
            self._captured.sites.append(name)
        call, site.calls = site.calls, site.calls + 1
        if not site.wanted:
            return None
        return lambda trace: self._record(name, site.layer, call, trace)

    def _record(self, name: str, layer: int, call: int, trace: AttentionTrace) -> None:
        with torch.no_grad():
            lead, T = tuple(trace.lse.shape[:-1]), trace.lse.shape[-1]
            B, H = _batch_heads(lead)
            where = f"the attention call of {name or '(model)'!r} (layer {layer})"
            b = self._batch.resolve(B, where)
            h = self._heads.resolve(H, where)
            r = self._rows.resolve(T, where)
            if self._bounded:
                probs, lse, scores = _selected(trace, lead, b, h, r, self._keep_scores)
            else:
                probs = trace.probs
                probs = probs.reshape(B, H, T, probs.shape[-1])  # (B, H, T, S)
                lse = trace.lse.reshape(B, H, T)  # (B, H, T)
                scores = trace.scores.reshape(probs.shape) if self._keep_scores else None
        self._most_rows = max(self._most_rows, T)
        self._kept_rows = self._kept_rows or len(r) > 0
        record = CapturedAttention(
            name,
            layer,
            call,
            _compact(probs),
            _compact(lse),
            None if scores is None else _compact(scores),
            b,
            h,
            r,
            (B, H, T, probs.shape[-1]),
            trace.backend,
        )
        self._captured.records.append(record)

    def _check(self) -> None:
        """After a block that raised nothing: say when what was asked for matched nothing."""
        sites = self._captured.sites
        if not sites:
            outside = (
                f" ({self._outside} qkv attention calls ran outside the model's "
                f"submodules and were not recorded)"
                if self._outside
                else ""
            )
            warnings.warn(
                f"qkv.capture of {type(self._model).__name__}: {_NOTHING}{outside}",
                UserWarning,
                stacklevel=3,
            )
            return
        missing = self._layers.missing(sites)
        if missing:
            raise ValueError(
                f"qkv.capture: layers {missing} asked for, but attention was called from "
                f"{len(sites)} sites (layers 0..{len(sites) - 1}), in layer order: "
                f"{_list(sites)}"
            )
        if not self._rows.all and self._captured.records and not self._kept_rows:
            raise ValueError(
                f"qkv.capture: rows={self._captured.settings['rows']} matched no query row: "
                f"the recorded calls had at most T={self._most_rows} query rows (rows index "
                f"each call's query positions 0..T-1; negative ones count from the end)"
            )


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


def _compact(t: Tensor) -> Tensor:
    """``t`` detached, copied when it is a view of a larger storage (kept or saved, a view
    would hold all of it)."""
    t = t.detach()
    if torch.compiler.is_compiling() or t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone()  # (a graph cannot read a storage's size: there, always a copy)
    return t


def _new_temp_beside(path: Path):
    """A new file beside ``path``, opened for writing, with the mode ``open()`` would give it
    (``os.open``'s 0o666 under the umask, unlike ``mkstemp``'s 0600)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return tmp, os.fdopen(fd, "wb")
    raise FileExistsError(f"could not create a temporary file beside {path}")


def _text(index, items: list | None) -> str:
    """A setting as the capture keeps it: as given when that reads well (a range or slice
    stays a range or slice), else the list it was read as (a generator is read once)."""
    if index is None or isinstance(index, (int, str, slice, range, list, tuple)):
        return repr(index)
    return repr(items)


def _list(names: list[str], most: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
