"""The records of a capture (:class:`Captured`, :class:`CapturedAttention`,
:class:`CapturedDeformable`): looked up by site or layer, printed, saved to one file and read
back (:func:`load_capture`).

Shape alphabet: B batch, H query heads, T query length, S key length; nb, nh, nr the batch
elements, heads and query rows kept. Deformable calls: Lq queries, M heads, L levels, P points.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..trace import DeformableTrace

__all__ = ["Captured", "CapturedAttention", "CapturedDeformable", "load_capture"]

_FORMAT, _VERSION = "qkv.capture", 1


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


@dataclass(frozen=True, repr=False)
class CapturedDeformable:
    """The sampling points of one deformable attention call of a capture (a
    ``qkv.nn.MultiScaleDeformableAttention``, or a ``qkv.deformable_attention`` call).

    A deformable call has no ``(T, S)`` weights: each query and head samples each level at P
    points. Kept are the points of the kept batch elements, queries (``rows``) and heads, in
    pixels of their level as :class:`qkv.DeformableTrace` holds them (``x * W - 0.5``,
    ``y * H - 0.5``: ``grid_sample``'s ``align_corners=False``).

    Attributes:
        name, layer, call: As in :class:`CapturedAttention`.
        locations: Each kept sampling point ``(px, py)`` in pixels of its level.
        weights: Each point's weight (softmaxed over levels x points by the module).
        reference_points: Each kept query's reference point in pixels of each level (a
            box's centre), or None for a bare ``qkv.deformable_attention`` call.
        spatial_shapes: ``(H, W)`` of each level.
        batch, heads, rows: Which batch elements, heads and queries of the call were kept.
        shape: The call's ``(B, Lq, M, L, P)``.

    Shape:
        locations ``(nb, nr, nh, L, P, 2)``; weights ``(nb, nr, nh, L, P)``;
        reference_points ``(nb, nr, L, 2)``; spatial_shapes ``(L, 2)``; batch ``(nb,)``,
        heads ``(nh,)``, rows ``(nr,)`` int64.
    """

    name: str
    layer: int
    call: int
    locations: Tensor
    weights: Tensor
    reference_points: Tensor | None
    spatial_shapes: Tensor
    batch: Tensor
    heads: Tensor
    rows: Tensor
    shape: tuple[int, int, int, int, int]

    @property
    def trace(self) -> DeformableTrace:
        """The kept points as a :class:`qkv.DeformableTrace` of ``(nb, nr, nh, L, P)``."""
        return DeformableTrace(
            self.locations, self.weights, self.spatial_shapes, self.reference_points
        )

    def __repr__(self) -> str:
        B, Lq, M, _, _ = self.shape
        kept = lambda t, n: "all" if len(t) == n else f"{len(t)} of {n}"  # noqa: E731
        return (
            f"CapturedDeformable({self.name!r}, layer={self.layer}, call={self.call}, "
            f"weights{tuple(self.weights.shape)}, levels "
            f"{[tuple(s) for s in self.spatial_shapes.tolist()]}, batch {kept(self.batch, B)}, "
            f"heads {kept(self.heads, M)}, rows {kept(self.rows, Lq)})"
        )

    def _to_dict(self) -> dict:
        ref = self.reference_points
        return {
            "name": self.name,
            "layer": self.layer,
            "call": self.call,
            "locations": _compact(self.locations),
            "weights": _compact(self.weights),
            "reference_points": None if ref is None else _compact(ref),
            "spatial_shapes": self.spatial_shapes,
            "batch": self.batch,
            "heads": self.heads,
            "rows": self.rows,
            "shape": list(self.shape),
        }

    @classmethod
    def _from_dict(cls, d: dict) -> CapturedDeformable:
        B, Lq, M, L, P = (int(n) for n in d["shape"])
        return cls(
            d["name"],
            int(d["layer"]),
            int(d["call"]),
            d["locations"],
            d["weights"],
            d["reference_points"],
            d["spatial_shapes"],
            d["batch"],
            d["heads"],
            d["rows"],
            (B, Lq, M, L, P),
        )


Record = CapturedAttention | CapturedDeformable


class Captured:
    """The records of a capture: iterate them in call order, or look them up by site.

    Iteration and ``len`` go over ``records``, the calls with attention weights; deformable
    attention calls, which have sampling points instead, are in ``deformable``. Looking up a
    site or a layer (``cap[name]``, ``cap.layer(i)``) finds either kind.

    Attributes:
        records: One :class:`CapturedAttention` per recorded call, in call order.
        deformable: One :class:`CapturedDeformable` per recorded deformable attention call
            (``qkv.nn.MultiScaleDeformableAttention``), in call order.
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
        deformable: list[CapturedDeformable] | None = None,
    ) -> None:
        self.records = list(records or [])
        self.sites = list(sites or [])
        self.settings = dict(settings or {})
        self.deformable = list(deformable or [])

    def __setstate__(self, state: dict) -> None:
        state.setdefault("deformable", [])  # pickled before deformable records existed
        self.__dict__.update(state)

    def _all(self) -> list[Record]:
        return [*self.records, *self.deformable]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[CapturedAttention]:
        return iter(self.records)

    def __contains__(self, name: object) -> bool:
        return any(r.name == name for r in self._all())

    def __getitem__(self, name: str) -> list[Record]:
        """The records of the site ``name``, in call order."""
        if not isinstance(name, str):
            raise TypeError(
                f"index a Captured by site name (str), got {type(name).__name__} "
                f"{name!r}; use cap.layer(i) for layer i, or cap.records[i]"
            )
        found = [r for r in self._all() if r.name == name]
        if not found:
            raise KeyError(self._missing(f"site {name!r}", name in self.sites))
        return found

    def layer(self, i: int) -> list[Record]:
        """The records of layer ``i`` (the i-th site to call attention), in call order."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(
                f"layer takes an int, got {type(i).__name__} {i!r}; "
                f"look a site up by name with cap[name]"
            )
        found = [r for r in self._all() if r.layer == i]
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
                f"{sorted({r.layer for r in self._all()})}"
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
        deformable = f" and {len(self.deformable)} deformable" if self.deformable else ""
        head = (
            f"Captured({self.settings.get('model', 'model')}: {len(self.records)} records"
            f"{deformable} from {len({r.layer for r in self._all()})} of {len(self.sites)} "
            f"sites{'; ' + asked if asked else ''})"
        )
        lines = [head] if self.sites else [head, f"  nothing recorded: {_NOTHING}"]
        for layer, name in enumerate(self.sites[:16]):
            recs = [r for r in self._all() if r.layer == layer]
            if not recs:
                lines.append(f"  layer {layer:>2}  {name or '(model)'}: not recorded")
                continue
            att = [r for r in recs if isinstance(r, CapturedAttention)]
            what = "probs" if att else "points"
            shapes = sorted(
                {tuple(r.probs.shape) for r in att}
                or {tuple(r.weights.shape) for r in recs if isinstance(r, CapturedDeformable)}
            )
            shown = str(shapes[0]) + ("" if len(shapes) == 1 else f" .. {shapes[-1]}")
            dtype = att[0].probs.dtype if att else recs[0].weights.dtype  # type: ignore[union-attr]
            lines.append(
                f"  layer {layer:>2}  {name or '(model)'}: {len(recs)} call"
                f"{'s' if len(recs) != 1 else ''}, {what} {shown} "
                f"{dtype}, {att[0].backend if att else 'deformable'}"
            )
        if len(self.sites) > 16:
            lines.append(f"  ... {len(self.sites) - 16} more sites")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Jupyter shows a capture as the viewer, inline (``qkv.viz.show``; one sandboxed
        iframe). viz is imported here, on first display: ``import qkv`` loads none of it."""
        from ..viz.notebook import repr_html

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
            "deformable": [r._to_dict() for r in self.deformable],
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
        [CapturedAttention._from_dict(d) for d in data["records"]],
        data["sites"],
        data["settings"],
        [
            CapturedDeformable._from_dict(d) for d in data.get("deformable", [])
        ],  # files written before deformable records have none
    )


_NOTHING = (
    "no qkv attention call ran inside the model: capture sees calls of "
    "qkv.scaled_dot_product_attention, qkv.linear_attention and deformable attention "
    "(qkv.nn.MultiScaleDeformableAttention) made while a submodule of the model runs. "
    "Run the model inside the with block; for torch modules use qkv.torch_compat.patch, "
    "for Hugging Face models attn_implementation='qkv'"
)


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


def _list(names: list[str], most: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
