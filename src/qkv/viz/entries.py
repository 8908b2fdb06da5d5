"""What :func:`qkv.viz.html` shows, as entries (one layer option of the page each): read from
a capture, traces or weights tensors, turned into signed differences by ``against=``, and the
analyses passed in (rollout, flow, head scores, a comparison's changes) as viz reads them. viz
computes no analysis: it reads the results of :mod:`qkv.analysis` by their attributes.
Deformable attention (a ``DeformableTrace``, a capture's deformable records) has sampling
points instead of weights: its entries (:class:`_Deform`) feed the Sampling points view.

Shape alphabet: B batch, H heads, T query length, S key length, nr kept query rows, nh kept
heads, P flow output positions (in a deformable entry: points per level); L levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..trace import AttentionTrace, DeformableTrace, MultiHeadTrace
from .encode import _bytes, _runs
from .labels import _trace_steps


@dataclass
class _Entry:
    """One layer option of the page: the kept weights of one attention call."""

    label: str
    probs: Tensor  # (nh, nr, S), any dtype or device
    heads: list[int]
    rows: list[int]
    T: int
    S: int
    steps: list[dict] = field(default_factory=list)
    kind: str = "attention"  # "attention", "rollout", "flow" or "diff" (signed: obj - against)
    layer: int | None = None  # the capture's layer number (head scores find their heads by it)
    batch: int | None = None  # a capture's batch element shown (its true index)
    change: list[dict[str, float]] | None = (
        None  # per head {"mean", "max"} |d| given by a comparison
    )


# ---------------------------------------------------------------- inputs -> entries


def _is_record(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("name", "layer", "call", "probs", "rows", "heads", "batch"))


def _entries(obj: Any, batch: int | None, call: int | str) -> list[_Entry]:
    if isinstance(obj, (Tensor, AttentionTrace)):
        return [_entry(obj, "attention", batch)]
    if hasattr(obj, "records") and not isinstance(obj, (list, tuple, dict)):
        return _capture_entries(list(obj.records), batch, call)
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        if obj and all(_is_record(r) for r in obj):
            return _capture_entries(list(obj), batch, call)
        items = [(f"layer {i}", x) for i, x in enumerate(obj)]
    else:
        raise TypeError(_WANT + f"; got {type(obj).__name__}")
    if not items:
        raise ValueError("html got an empty list: pass at least one trace or tensor")
    for name, x in items:
        if not isinstance(x, (Tensor, AttentionTrace)):
            raise TypeError(_WANT + f"; item {name!r} is a {type(x).__name__}")
    out = [_entry(x, str(name), batch) for name, x in items]
    for i, e in enumerate(out):
        e.layer = i
    return out


_WANT = (
    "html takes a qkv.capture result, an AttentionTrace/MultiHeadTrace, a weights tensor "
    "(B, H, T, S)/(H, T, S)/(T, S), or a list/tuple/dict of traces or tensors (one layer "
    "each)"
)


def _entry(x: Tensor | AttentionTrace, label: str, batch: int | None) -> _Entry:
    """An entry from a trace or a weights tensor: batch element ``batch``, all heads."""
    lead = x.lse.shape[:-1] if isinstance(x, AttentionTrace) else x.shape[:-2]
    if isinstance(x, Tensor) and x.dim() < 2:
        raise ValueError(
            f"{label}: weights must be (B, H, T, S), (H, T, S) or (T, S), got "
            f"shape {tuple(x.shape)}"
        )
    if len(lead) > 2:
        raise ValueError(
            f"{label}: weights must be (B, H, T, S), (H, T, S) or (T, S), got "
            f"{len(lead) + 2} dims {tuple(lead)} + (T, S); fold the extra dims "
            f"into B, e.g. w.flatten(0, {len(lead) - 2})"
        )
    if len(lead) < 2 and batch not in (None, 0):
        raise ValueError(
            f"{label}: batch={batch} asked of weights with no batch dim "
            f"(dims {tuple(lead)} + (T, S)); leave batch out"
        )
    b = 0 if batch is None else batch
    if len(lead) == 2 and not (isinstance(b, int) and 0 <= b < lead[0]):
        raise ValueError(
            f"{label}: batch={batch!r} out of range for batch size {lead[0]}; pass 0..{lead[0] - 1}"
        )
    if isinstance(x, AttentionTrace):
        probs = x.select(batch=[b]).probs[0] if len(lead) == 2 else x.probs  # (H, T, S) or less
    else:
        probs = x[b] if len(lead) == 2 else x  # (H, T, S) or (T, S)
    if probs.dim() == 2:
        probs = probs.unsqueeze(0)  # (1, T, S)
    H, T, S = probs.shape
    if min(H, T, S) == 0:
        raise ValueError(f"{label}: weights are empty, shape {tuple(probs.shape)}")
    steps = (
        _trace_steps(x, b if len(lead) == 2 else None, T, S)
        if isinstance(x, MultiHeadTrace)
        else []
    )
    return _Entry(label, probs.detach(), list(range(H)), list(range(T)), T, S, steps)


def _capture_entries(records: list, batch: int | None, call: int | str) -> list[_Entry]:
    if not records:
        raise ValueError(
            "the capture holds no records (nothing was recorded inside the "
            "`with qkv.capture(...)` block); run the model inside it"
        )
    if call != "all" and (isinstance(call, bool) or not isinstance(call, int)):
        raise TypeError(f"call must be an int or 'all', got {call!r}")
    chosen = [r for r in records if call == "all" or r.call == call]
    if not chosen:
        calls = sorted({int(r.call) for r in records})
        raise ValueError(
            f"no record has call={call}; the calls recorded are {calls} (or pass call='all')"
        )
    chosen.sort(key=lambda r: (int(r.layer), int(r.call)))
    entries = []
    for r in chosen:
        kept = [int(i) for i in r.batch]
        if batch is None:
            pos = 0
        elif batch in kept:
            pos = kept.index(batch)
        else:
            raise ValueError(
                f"batch={batch} was not kept by the capture (site {r.name!r} "
                f"kept batch elements {kept}); pass one of them"
            )
        if r.probs.shape[2] == 0:
            continue  # a decoding step outside the kept rows
        label = f"layer {int(r.layer)} · {r.name or '(model)'}"
        if call == "all":
            label += f" · call {int(r.call)}"
        T, S = (
            (int(r.shape[2]), int(r.shape[3]))
            if hasattr(r, "shape")
            else (int(max(r.rows)) + 1, int(r.probs.shape[-1]))
        )
        entries.append(
            _Entry(
                label,
                r.probs[pos].detach(),
                [int(h) for h in r.heads],
                [int(i) for i in r.rows],
                T,
                S,
                layer=int(r.layer),
                batch=kept[pos],
            )
        )
    if not entries:
        raise ValueError(
            f"every record with call={call} kept 0 query rows (rows outside "
            f"those calls); capture other rows or pass call='all'"
        )
    return entries


# ---------------------------------------------------------------- differences and analyses


def _shape_text(e: _Entry) -> str:
    return f"{e.label!r}: heads {e.heads}, {len(e.rows)} of T={e.T} query rows, S={e.S} keys"


def _diff_entries(mine: list[_Entry], other: list[_Entry]) -> list[_Entry]:
    """Each head's signed difference ``mine - other``; both must have the same layers, heads,
    rows and lengths (one architecture, one input length)."""
    if len(mine) != len(other):
        raise ValueError(
            f"cannot compare: {len(mine)} layer entries against {len(other)}; "
            f"compare two captures of the same architecture"
        )
    out = []
    for a, b in zip(mine, other):
        if (a.label, a.heads, a.rows, a.T, a.S) != (b.label, b.heads, b.rows, b.T, b.S):
            raise ValueError(
                f"cannot compare: {_shape_text(a)} against {_shape_text(b)}; "
                f"compare two captures of the same architecture, heads, rows and "
                f"input length"
            )
        # float64 when both are, else float32: qkv.analysis.compare's arithmetic
        dtype = torch.float64 if a.probs.dtype == b.probs.dtype == torch.float64 else torch.float32
        d = a.probs.to("cpu", dtype) - b.probs.to("cpu", dtype)  # (nh, nr, S)
        out.append(_Entry(a.label, d, a.heads, a.rows, a.T, a.S, kind="diff", layer=a.layer))
    return out


def _is_comparison(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("differences", "keys", "mean", "max", "ranked"))


def _compared_entries(mine: list[_Entry], cmp: Any, call: int | str) -> list[_Entry]:
    """The entries of a comparison (``qkv.analysis.compare(obj, b)``) of the capture shown:
    each difference, and each head's mean and max ``|d|`` as the comparison computed them."""
    layers = [(e.layer, e) for e in mine if e.layer is not None and e.batch is not None]
    if not isinstance(call, int) or not mine or len(layers) != len(mine):  # call is "all"
        raise ValueError(
            "against= a comparison shows it over the capture it compared "
            "(one call): pass that capture as obj, and call= an int"
        )
    diffs = {(int(d.layer), int(d.call)): d for d in cmp.differences}
    if len(diffs) != len(mine):
        raise ValueError(
            f"cannot show this comparison: it holds {len(diffs)} layers and the "
            f"capture shown {len(mine)}; compare that capture (call={call})"
        )
    stats = dict(zip(cmp.keys, zip(cmp.mean.tolist(), cmp.max.tolist())))
    out = []
    for layer, e in layers:
        d = diffs.get((layer, call))
        if d is None or (
            [int(h) for h in d.heads],
            [int(r) for r in d.rows],
            int(d.shape[2]),
            int(d.shape[3]),
        ) != (e.heads, e.rows, e.T, e.S):
            raise ValueError(
                f"cannot show this comparison over {_shape_text(e)}: it compared "
                f"other layers, heads, rows or lengths; compare the capture shown"
            )
        kept = [int(b) for b in d.batch]
        if kept != [e.batch]:
            raise ValueError(
                f"the comparison covers batch elements {kept} and the page shows "
                f"batch element {e.batch}: compare(a, b, batch={e.batch}), or "
                f"pass batch= one it holds"
            )
        change = [dict(zip(("mean", "max"), stats[layer, h])) for h in e.heads]
        out.append(
            _Entry(
                e.label,
                d.diff[0],
                e.heads,
                e.rows,
                e.T,
                e.S,
                kind="diff",
                layer=layer,
                change=change,
            )
        )
    return out


def _first(x: Tensor, dims: int, what: str) -> Tensor:
    """``x`` with ``dims`` dims, or the first element of one more leading dim."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
    if x.dim() == dims + 1:
        x = x[0]
    if x.dim() != dims:
        raise ValueError(
            f"{what} must have {dims} dims (or {dims + 1} with a batch first), "
            f"got shape {tuple(x.shape)}"
        )
    return x.detach()


def _analysis_entries(rollout: Any, flow: Any, entries: list[_Entry]) -> list[_Entry]:
    """The rollout and flow entries (weights of outputs over input tokens, in [0, 1])."""
    out = []
    S = entries[0].S
    if rollout is not None:
        per_head = isinstance(rollout, Tensor) and rollout.dim() == 4
        R = rollout.detach()[0] if per_head else _first(rollout, 2, "rollout")[None]  # (H', T, T)
        if R.shape[1] != R.shape[2] or R.shape[2] != S:
            raise ValueError(
                f"rollout must be (T, T) (or (B, H, T, T) per head) over the "
                f"page's {S} tokens, got shape {tuple(rollout.shape)}"
            )
        label = "rollout per head (all layers)" if per_head else "rollout (all layers)"
        heads = list(range(R.shape[0]))
        if per_head and len(entries[0].heads) == R.shape[0]:
            heads = list(entries[0].heads)  # a capture's kept heads, which rollout chains in order
        out.append(_Entry(label, R, heads, list(range(S)), S, S, kind="rollout"))
    if flow is not None:
        if not (isinstance(flow, (tuple, list)) and len(flow) == 2):
            raise TypeError(
                "flow must be a pair (F, positions): qkv.analysis.flow's (P, T) "
                "result and the P output positions it was computed for"
            )
        F = _first(flow[0], 2, "flow[0]")  # (P, T)
        positions = [int(p) for p in flow[1]]
        if F.shape != (len(positions), S):
            raise ValueError(
                f"flow must be (P, T) = ({len(positions)}, {S}) for "
                f"{len(positions)} positions over {S} tokens, got shape "
                f"{tuple(F.shape)}"
            )
        if any(not 0 <= p < S for p in positions) or len(set(positions)) != len(positions):
            raise ValueError(
                f"flow positions must be distinct, in 0..{S - 1} (count negative "
                f"ones from the end first), got {positions}"
            )
        order = sorted(range(len(positions)), key=positions.__getitem__)
        out.append(
            _Entry(
                f"flow (position{'s' * (len(order) > 1)} "
                f"{', '.join(str(positions[i]) for i in order)})",
                F[order][None],
                [0],
                [positions[i] for i in order],
                S,
                S,
                kind="flow",
            )
        )
    return out


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _scores_meta(table: Any, entries: list[_Entry]) -> dict | None:
    """A head-scores table as the page reads it: each head's scores, where its weights are
    (entry and head position), and the query rows each score used in each layer."""
    if table is None:
        return None
    if not all(hasattr(table, a) for a in ("names", "keys", "values", "rows")):
        raise TypeError(
            f"scores must be a head-scores table (qkv.analysis.head_scores), got "
            f"{type(table).__name__}"
        )
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for i, e in enumerate(entries):
        if e.kind == "attention" and e.layer is not None:
            for hi, h in enumerate(e.heads):
                where.setdefault((e.layer, h), (i, hi))
    heads = []
    for (layer, head), vals in zip(table.keys, table.values.tolist()):
        at = where.get((int(layer), int(head)))
        heads.append(
            {
                "layer": int(layer),
                "head": int(head),
                "entry": at and at[0],
                "hi": at and at[1],
                "values": [_finite(float(v)) for v in vals],
            }
        )
    used: dict[str, dict[str, list]] = {}
    for (layer, name), rows in table.rows.items():
        used.setdefault(str(int(layer)), {})[name] = _runs([int(r) for r in rows])
    return {
        "names": list(table.names),
        "heads": heads,
        "used": used,
        "skipped": {str(k): str(v) for k, v in getattr(table, "skipped", {}).items()},
        "window": getattr(table, "window", None),
    }


def _changes(entries: list[_Entry]) -> list[dict] | None:
    """For a difference page: each head's mean and max ``|difference|``, largest mean first."""
    if not any(e.kind == "diff" for e in entries):
        return None
    out: list[dict[str, Any]] = []
    for i, e in enumerate(entries):
        for hi, h in enumerate(e.heads):
            d = e.probs[hi].abs()  # (nr, S)
            mean, mx = (
                (e.change[hi]["mean"], e.change[hi]["max"])
                if e.change
                else (float(d.double().mean()), float(d.max()))
            )
            out.append({"entry": i, "hi": hi, "label": e.label, "head": h, "mean": mean, "max": mx})
    out.sort(key=lambda c: -c["mean"])  # stable: ties in entry, then head order
    return out


# ---------------------------------------------------------------- deformable attention


@dataclass
class _Deform:
    """One deformable attention call of the page: the sampling points of its kept queries
    (the Sampling points view), in pixels of each level as ``DeformableTrace`` holds them."""

    label: str
    locations: Tensor  # (nr, nh, L, P, 2) pixels (x, y)
    weights: Tensor  # (nr, nh, L, P)
    reference: Tensor | None  # (nr, L, 2) pixels, or None
    shapes: list[tuple[int, int]]  # (H, W) per level
    heads: list[int]
    rows: list[int]
    Lq: int
    layer: int | None = None
    batch: int | None = None


def _is_deformable_record(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("name", "layer", "call", "locations", "weights", "rows"))


def _split_deformable(obj: Any, batch: int | None, call: int | str) -> tuple[Any, list[_Deform]]:
    """``obj`` without its deformable attention (None when nothing else is left), and that
    deformable attention as entries of the Sampling points view."""
    if isinstance(obj, DeformableTrace):
        return None, [_deform_of_trace(obj, "deformable attention", batch)]
    if hasattr(obj, "records") and not isinstance(obj, (list, tuple, dict)):
        found = list(getattr(obj, "deformable", []))
        rest = obj if obj.records or not found else None
        return rest, _deform_of_records(found, batch, call) if found else []
    if isinstance(obj, (list, tuple)) and obj:
        if all(_is_record(r) or _is_deformable_record(r) for r in obj):
            found = [r for r in obj if _is_deformable_record(r)]
            weights = [r for r in obj if not _is_deformable_record(r)]
            return weights or None, _deform_of_records(found, batch, call) if found else []
        if any(isinstance(x, DeformableTrace) for x in obj):
            obj = {f"layer {i}": x for i, x in enumerate(obj)}  # labelled by their place
    if isinstance(obj, dict) and any(isinstance(x, DeformableTrace) for x in obj.values()):
        entries: list[_Deform] = []
        left: dict = {}
        for i, (name, x) in enumerate(obj.items()):
            if isinstance(x, DeformableTrace):
                entries.append(_deform_of_trace(x, str(name), batch))
                entries[-1].layer = i
            else:
                left[name] = x
        return left or None, entries
    return obj, []


def _deform_of_trace(t: DeformableTrace, label: str, batch: int | None) -> _Deform:
    B, Lq, M = t.weights.shape[:3]
    b = 0 if batch is None else batch
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < B:
        raise ValueError(
            f"{label}: batch={batch!r} out of range for batch size {B}; pass 0..{B - 1}"
        )
    if min(t.weights.shape) == 0:
        raise ValueError(f"{label}: the trace is empty, weights of shape {tuple(t.weights.shape)}")
    ref = t.reference_points
    return _Deform(
        label,
        t.locations[b],  # (Lq, M, L, P, 2)
        t.weights[b],  # (Lq, M, L, P)
        None if ref is None else ref[b],  # (Lq, L, 2)
        [(int(h), int(w)) for h, w in t.spatial_shapes.tolist()],
        list(range(M)),
        list(range(Lq)),
        Lq,
        batch=b,
    )


def _deform_of_records(records: list, batch: int | None, call: int | str) -> list[_Deform]:
    """Entries of a capture's deformable records: call ``call`` (or all), batch element
    ``batch`` (a true index; default the first kept), the kept heads and queries."""
    if call != "all" and (isinstance(call, bool) or not isinstance(call, int)):
        raise TypeError(f"call must be an int or 'all', got {call!r}")
    chosen = sorted(
        (r for r in records if call == "all" or r.call == call),
        key=lambda r: (int(r.layer), int(r.call)),
    )
    out = []
    for r in chosen:
        kept = [int(i) for i in r.batch]
        if batch is not None and batch not in kept:
            raise ValueError(
                f"batch={batch} was not kept by the capture (site {r.name!r} kept batch "
                f"elements {kept}); pass one of them"
            )
        if not kept or r.weights.shape[1] == 0:
            continue  # no query of this call was kept
        pos = 0 if batch is None else kept.index(batch)
        label = f"layer {int(r.layer)} · {r.name or '(model)'}"
        if call == "all":
            label += f" · call {int(r.call)}"
        ref = r.reference_points
        out.append(
            _Deform(
                label,
                r.locations[pos],  # (nr, nh, L, P, 2)
                r.weights[pos],  # (nr, nh, L, P)
                None if ref is None else ref[pos],  # (nr, L, 2)
                [(int(h), int(w)) for h, w in r.spatial_shapes.tolist()],
                [int(h) for h in r.heads],
                [int(q) for q in r.rows],
                int(r.shape[1]),
                layer=int(r.layer),
                batch=kept[pos],
            )
        )
    return out


def _deform_payload(d: _Deform) -> tuple[dict, bytes]:
    """One deformable entry's metadata and payload: float32 little-endian ``locations``
    ``(nr, nh, L, P, 2)``, then ``weights`` ``(nr, nh, L, P)``, then ``reference``
    ``(nr, L, 2)`` when there is one."""
    loc = d.locations.detach().to("cpu", torch.float32)
    w = d.weights.detach().to("cpu", torch.float32)
    parts = [loc, w]
    if not bool(torch.isfinite(loc).all()):
        raise ValueError(f"{d.label}: the sampling locations hold NaN or infinity")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(
            f"{d.label}: the weights must be finite and >= 0 (a dot's area is its weight), "
            f"got min {float(w.min()):.4g}"
        )
    if d.reference is not None:
        ref = d.reference.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(ref).all()):
            raise ValueError(f"{d.label}: the reference points hold NaN or infinity")
        parts.append(ref)
    nr, nh, L, P = w.shape
    info = {
        "label": d.label,
        "layer": d.layer,
        "batch": d.batch,
        "Lq": d.Lq,
        "nr": nr,
        "rows": _runs(d.rows),
        "heads": d.heads,
        "shapes": [list(s) for s in d.shapes],
        "P": P,
        "ref": d.reference is not None,
    }
    assert (len(d.shapes), len(d.heads), len(d.rows)) == (L, nh, nr)
    return info, b"".join(_bytes(t) for t in parts)
