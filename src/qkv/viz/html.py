"""``qkv.viz.html``: one self-contained HTML page to explore attention weights offline.

::

    with qkv.capture(model, heads=[0, 1, 2, 3], rows=range(4080, 4096)) as cap:
        model(ids)
    qkv.viz.html(cap, "attn.html", tokens=tokenizer.convert_ids_to_tokens(ids[0]))

The page holds its script, style and data inline: it makes no network request (no CDN, no
font, no fetch), opens by double-click, and needs no notebook. Four views share a layer and a
head selector:

* **Head view**: query tokens on the left, key tokens on the right, one line per weight kept
  (its top-k keys above a threshold), one colour per head. A window of 40 tokens scrolls over
  long sequences; keys outside the key window are summed into the arrows at its edges.
* **Matrix view**: the weights of one head as a heatmap on a canvas. Drag a rectangle or turn
  the wheel to zoom, ``Reset zoom`` to see it whole. Zoomed out, each pixel shows the **max**
  of the cells it covers (a one-cell-wide diagonal stays visible at 16k tokens); zoomed in,
  the cells themselves. Only the visible region is drawn.
* **Layer overview**: every head of the layer as a thumbnail; a click opens it in the matrix.
* **Model view**: every layer entry x head as a grid of thumbnails (bertviz's model view),
  drawn from the weights already stored (it adds nothing to the file); a click opens one.
* **Explain** (when there are steps): the numbers of each step as tables, in the order given.

Analyses (results of :mod:`qkv.analysis`, passed in: viz computes none of them):

* ``scores=`` (a ``HeadScores``): **Head scores**, every head's scores in a table sorted by
  the score chosen in ``#score`` (highest first, heads without it last, as
  ``HeadScores.sorted_by``), the three highest in bold and outlined in the overview and model
  view, and the query rows that score used in each layer.
* ``rollout=`` ``(T, T)`` and ``flow=(F, positions)``: one more layer entry each (kind
  ``"rollout"``, ``"flow"``: one head, rows = the outputs, columns = the input tokens, stored as
  any head's weights) and **Saliency**: one output position's row as shaded tokens. A
  per-head rollout ``(B, H, T, T)`` (``rollout(cap, heads="per_head")``: head ``h`` of every
  layer chained alone) is one entry of H heads, and Saliency gets a head selector.
* ``against=`` (a second input of the same shapes, or ``qkv.analysis.compare(obj, b)``): every
  head becomes the signed difference ``obj - against`` (kind ``"diff"``), drawn on a diverging
  scale (blue positive, white 0, red negative; zoomed out, each pixel shows the covered value
  of largest ``|d|``), and **Changes** ranks the heads by mean (or max) ``|d|``, ties in layer
  then head order: the numbers and order of ``Comparison.ranked`` (given a comparison, its
  very numbers; given a second input, the same arithmetic on the batch element shown). The
  page opens on the matrix view.

Inputs. A capture (:func:`qkv.capture`'s ``Captured``, or a list of its records): one
*layer* entry per site, its call ``call`` (default 0; ``call="all"`` makes one entry per call,
labelled ``call c``), its batch element ``batch`` (default: the first kept), the heads and
query rows it kept, labelled by their true numbers. An ``AttentionTrace``/``MultiHeadTrace``
or a weights tensor ``(B, H, T, S)``, ``(H, T, S)`` or ``(T, S)``: one entry (batch element
``batch``, default 0). A list/tuple (or a dict name -> item) of traces or tensors: one entry
each, in order (``AttentionMaps.decoder`` of a qkv model gives one).

Tokens. ``tokens`` labels positions: a list of ``T`` strings labels the queries (and the keys
when ``S == T``); a list of at least ``S >= T`` strings labels the keys ``tokens[:S]`` and puts
query row ``r`` at position ``S - T + r`` (a decoding step, a KV cache); a pair
``(query_tokens, key_tokens)`` of lengths ``T`` and ``S`` labels both (cross-attention).
Without tokens, positions are numbered.

Storage and precision (per head, ``nr`` kept query rows by ``S`` keys). Each head has a
budget of ``C = min(2**20, max_cells // number_of_heads)`` cells, 2 bytes each:

* ``nr * S <= C // 16``: every weight as **float32** ("f4"): hover shows it to 4 significant
  digits exactly as ``Number.toPrecision(4)`` of the float32 value.
* ``nr * S <= C``: every weight as **float16** ("f2"): ``|stored - w| <= max(|w| * 2**-11,
  2**-25)`` (round to nearest; a weight below ``2**-25`` may read 0). The page states it.
* larger ("top"): not every cell can be kept. Stored are the **max over square blocks** of
  ``b x b`` cells (``b`` the smallest power of two leaving at most ``C / 4`` blocks) and, for
  each query row, its **k largest weights exactly** (float16, with their key index; ``k <=
  128`` fills the rest of the budget: 95 at 4k x 4k, 23 at 16k x 16k). A cell not among its
  row's top k is drawn light grey when zoomed in and hovered as an upper bound (the smaller
  of its block's max and its row's k-th weight), written ``w≤``.

Size bound: with ``H_all`` heads over all entries and ``P`` the stored payload (``<= 2C``
bytes a head), the file has at most ``112 KiB + 400 * H_all + 4/3 * sum(P) + J`` bytes, where
``J`` is the JSON of labels: the token strings (at most 6 bytes per UTF-8 byte), 12 bytes per
run of consecutive kept rows, and the explain steps (at most 4096 numbers a step, about 12
bytes each). With the default ``max_cells = 2**24`` that is at most ~43 MiB plus ``J``;
measured: one 4k x 4k head 2.9 MB, one 16k x 16k head 3.0 MB, two 5.8 MB, a capture of 4
layers x 4 heads x 16 rows x 4k keys (float32) 5.7 MB. Writing takes ~4 s a 16k x 16k head on
one CPU core, ~0.3 s a 4k x 4k head.

Differences are stored per head as float32 ("s4", ``nr * S <= C // 16``), float16 ("s2",
``<= C``), else ("sb") the signed value of largest ``|d|`` of each ``b x b`` block (float16,
``b`` the smallest power of two leaving at most ``C`` blocks; hovered as ``d≈``); the same
``2C`` bytes a head, so the same size bound.

Payload format (what a reader other than the page needs). ``<script type="application/json"
id="qkv-meta">`` holds the JSON metadata (``<`` written ``\\u003c``); ``entries[i]`` is layer
option ``i``, with ``rows`` (runs ``[first, count]`` of true query indices), ``T``, ``S``,
``heads`` (one dict per kept head: ``head`` its true number, ``blob`` the id of a ``<script
type="application/octet-stream">`` holding base64 of little-endian arrays, ``mode``),
``kind`` and ``layer`` (the capture's layer number). Mode
"f4"/"f2": the ``nr x S`` weights row-major as float32/float16. Mode "top": ``idx`` (``nr x k``
uint16, or uint32 when ``ib == 4``: key indices, ascending within a row), then ``val``
(``nr x k`` float16), then ``grid`` (``gr x gc`` float16 block maxima, blocks of ``block``).

DOM/JS contract (browser tests rely on it; kept stable):

* ``document.body.dataset.ready === "1"`` once the first view is drawn.
* ``<select id="layer">`` with option values ``"0".."L-1"`` (the entries, in order) and
  ``<select id="head">`` with values ``"all"`` and ``"0".."H-1"`` (the layer's kept heads in
  order; the option text gives the true head number).
* Tab buttons ``#tab-head``, ``#tab-matrix``, ``#tab-overview`` and ``#tab-explain`` (only
  when there are steps). The active view's container has class ``active``: ``#view-head``,
  ``#view-matrix``, ``#view-overview``, ``#view-explain``. The page opens on layer 0, head
  ``"all"``, the head view.
* Matrix: ``<canvas id="matrix-canvas">``; hovering a cell sets ``#tooltip``'s text to exactly
  ``q=<i> k=<j> w=<value>`` (``i``, ``j`` the true query and key indices, ``value`` formatted by
  ``toPrecision(4)``); for a cell not stored ("top" mode) it is ``q=<i> k=<j> w≤<bound>``.
  ``#zoom-reset`` shows the whole matrix. With head ``"all"`` the matrix shows head 0.
* Head view: ``<canvas id="head-canvas">``. Overview: ``<canvas class="thumb" data-head="h">``
  (``h`` the position of the head in the layer, as in ``#head``). Model view (``#tab-model``,
  ``#view-model``): ``<canvas class="mthumb" data-layer="l" data-head="h">``.
* Analyses, when given: ``#tab-scores``/``#view-scores`` (``<select id="score">``, the table
  ``#scores-table`` whose body rows carry ``data-layer``/``data-head``, ``#scores-rows``);
  ``#tab-saliency``/``#view-saliency`` (``#saliency-of`` the entry, ``#saliency-pos`` the
  output, ``#saliency-head`` the head chain of a per-head rollout, ``#saliency span.tok`` with
  ``title`` ``k=<j> <value>``); ``#tab-changes``/
  ``#view-changes`` (``#change-by``, ``#changes-table``). A difference's hover text is
  ``q=<i> k=<j> d=<value>``.
* ``window.qkvViewer``: ``state`` (``{layer, head, view}``; head is ``"all"`` or a number),
  ``value(layer, head, q, k)`` (the number shown on hover for that cell; ``null`` outside the
  matrix), ``exact(layer, head, q, k)`` (whether that cell is stored), ``cellAt(clientX,
  clientY)`` (``{q, k}`` under that point of the matrix canvas, or ``null``), ``cellCenter(q,
  k)`` (``{x, y}`` client coordinates of that cell's centre in the current matrix view, or
  ``null`` when the cell is not in view), ``digest(canvasId)`` (a short hash of the canvas
  pixels), ``setView(name)``, ``setLayer(i)``, ``setHead(h)`` (each redraws before it returns);
  ``setScore(name)``, ``scoreOrder()`` (``[layer, head]`` of the scores table, top down),
  ``saliency(entry, q, h = 0)`` (output ``q``'s row of a rollout/flow entry, head position
  ``h``), ``setSaliency(entry, q, h = 0)``,
  ``changeOrder()`` (``[entry, head position]``, most changed first), ``setChangeBy("mean" |
  "max")``, ``colourOf(layer, head, q, k)`` (``[r, g, b]`` of that cell on the colour scale).

Shape alphabet: B batch, H heads, T query length, S key length, nr kept query rows.
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..trace import AttentionTrace, MultiHeadTrace

__all__ = ["html"]

_HEAD_CELLS = 1 << 20  # per-head budget: 2 MiB of float16
_GRID_SHARE = 4  # "top" mode: block maxima take at most C / 4 cells (a quarter of the bytes)
_K_MAX = 128
_STEP_CELLS = 4096  # numbers per explain table
_AUTO_STEPS = 32  # a MultiHeadTrace with T, S <= 32 explains itself
_VALUE_SLACK = 1e-3  # weights may exceed 1 by a half-precision rounding
_WEIGHT_NAMES = ("score", "softmax", "prob", "weight", "attn")  # steps whose columns are keys


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


def html(
    obj: Any,
    path: str | os.PathLike,
    tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    steps: dict[str, Any] | None = None,
    batch: int | None = None,
    call: int | str = 0,
    max_cells: int = 1 << 24,
    scores: Any = None,
    rollout: Tensor | None = None,
    flow: Any = None,
    against: Any = None,
) -> Path:
    """Write a self-contained HTML viewer of attention weights (see the module docstring).

    Args:
        obj: A capture (``Captured`` or a list of its records), an ``AttentionTrace`` /
            ``MultiHeadTrace``, a weights tensor, or a list/tuple/dict of traces or tensors
            (one layer each).
        path: Where to write (``.html`` is added to a name without a suffix; missing folders
            are created). Written atomically: a temporary file beside it, renamed over it.
        tokens: Labels of the positions: a list of str, or a pair ``(query_tokens,
            key_tokens)``. See the module docstring for how they align.
        title: The page title; default ``"qkv attention"``.
        steps: Tables for the Explain view: a dict name -> 2-D array, tensor or nested list
            (at most 4096 numbers each), shown in the dict's order. Default: for a
            ``MultiHeadTrace`` with ``T, S <= 32``, its Q, K, V, scores, softmax and output
            per head; ``{}`` shows none.
        batch: The batch element to show (a true index for a capture); default the first.
        call: For a capture, which call of each site (``generate`` makes one per step), or
            ``"all"`` for one entry per call.
        max_cells: Budget of stored cells over all heads (2 bytes each); each head gets
            ``min(2**20, max_cells // heads)``.
        scores: A head-scores table (``qkv.analysis.head_scores(cap)``) of the capture shown:
            the Head scores tab lists its heads sorted by a chosen score, highlights them and
            says which query rows each score used.
        rollout: Attention rollout ``(T, T)`` (or ``(B, T, T)``: its first element), e.g.
            ``qkv.analysis.rollout(cap)``: one more layer entry, ``"rollout"``, and the
            Saliency tab (a chosen output position's share from each input token). A
            per-head rollout ``(B, H, T, T)`` (``heads="per_head"``, its first element)
            makes that entry one of H heads, with a head selector in Saliency.
        flow: ``(F, positions)``: attention flow ``(P, T)`` (or ``(B, P, T)``: its first
            element) of the output positions ``positions`` (P ints, ``qkv.analysis.flow(cap,
            positions=...)``): one more entry, ``"flow"``, also shown as saliency.
        against: A second input of the same kind and shapes (two captures of one
            architecture: two inputs, or before and after fine-tuning), or the comparison
            ``qkv.analysis.compare(obj, b)`` of one batch element (``batch=``, the one the
            page shows). The page then shows the signed difference ``obj - against`` of every
            head (a diverging colour scale) and the Changes tab ranks the heads by mean and
            max ``|difference|`` (a comparison's own numbers).

    Returns:
        The path written.

    Raises:
        TypeError: ``obj``, ``tokens`` or ``steps`` of the wrong type.
        ValueError: Weights outside [0, 1] or NaN, tokens of the wrong length, a batch
            element or call the input does not have, steps too large.

    Shape:
        Weights ``(B, H, T, S)``, ``(H, T, S)`` or ``(T, S)``; a capture record's probs
        ``(nb, nh, nr, S)``.
    """
    return _write_atomic(
        Path(path),
        _page_text(
            obj,
            tokens,
            title=title,
            steps=steps,
            batch=batch,
            call=call,
            max_cells=max_cells,
            scores=scores,
            rollout=rollout,
            flow=flow,
            against=against,
        ),
    )


def _page_text(
    obj: Any,
    tokens: Sequence[str] | None = None,
    *,
    title: str | None = None,
    steps: dict[str, Any] | None = None,
    batch: int | None = None,
    call: int | str = 0,
    max_cells: int = 1 << 24,
    scores: Any = None,
    rollout: Tensor | None = None,
    flow: Any = None,
    against: Any = None,
) -> str:
    """The page :func:`html` writes, as text (arguments as there; ``qkv.viz.show`` puts it in
    a notebook's iframe)."""
    if isinstance(max_cells, bool) or not isinstance(max_cells, int) or max_cells < 1:
        raise ValueError(f"max_cells must be a positive int, got {max_cells!r}")
    entries = _entries(obj, batch, call)
    if against is not None:
        if scores is not None or rollout is not None or flow is not None:
            raise ValueError(
                "against= shows differences; scores=, rollout= and flow= are of "
                "one input: write them on a page of their own"
            )
        entries = (
            _compared_entries(entries, against, call)
            if _is_comparison(against)
            else _diff_entries(entries, _entries(against, batch, call))
        )
    entries += _analysis_entries(rollout, flow, entries)
    token_lists, labels = _tokens(tokens, entries)
    user_steps = _user_steps(steps, entries[0], labels[0], token_lists)
    if steps is not None:
        for e in entries:
            e.steps = []  # the caller chose the steps; {} means none
    n_heads = sum(len(e.heads) for e in entries)
    budget = max(4096, min(_HEAD_CELLS, max_cells // n_heads))
    blobs: list[str] = []
    meta_entries = []
    for e, (qtok, ktok) in zip(entries, labels):
        heads = []
        for i, head in enumerate(e.heads):
            encode = _encode_signed if e.kind == "diff" else _encode_head
            info, payload = encode(e.probs[i], budget, f"{e.label}, head {head}")
            info.update(head=head, blob=f"qkv-blob-{len(blobs)}")
            blobs.append(payload)
            heads.append(info)
        meta_entries.append(
            {
                "label": e.label,
                "T": e.T,
                "S": e.S,
                "nr": len(e.rows),
                "rows": _runs(e.rows),
                "qtok": qtok,
                "ktok": ktok,
                "heads": heads,
                "steps": e.steps,
                "kind": e.kind,
                "layer": e.layer,
            }
        )
    meta = {
        "version": 1,
        "title": title or "qkv attention",
        "tokens": token_lists,
        "entries": meta_entries,
        "steps": user_steps,
        "budget": budget,
        "scores": _scores_meta(scores, entries),
        "changes": _changes(entries),
    }
    return _page(meta, blobs)


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
        out.append(_Entry(label, R, list(range(R.shape[0])), list(range(S)), S, S, kind="rollout"))
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


# ---------------------------------------------------------------- tokens and steps


def _token_list(x: Any, what: str) -> list[str]:
    if isinstance(x, (str, bytes)):
        raise TypeError(
            f"{what} must be a list of str, got a {type(x).__name__}; split it "
            f"first, e.g. text.split() or tokenizer.convert_ids_to_tokens(ids)"
        )
    try:
        return [str(t) for t in x]
    except TypeError:
        raise TypeError(f"{what} must be a list of str, got {type(x).__name__}") from None


def _tokens(tokens: Any, entries: list[_Entry]) -> tuple[list[list[str]], list[tuple]]:
    """The token lists to embed, and per entry ``(qtok, ktok)``: ``[list_id, offset]`` with
    query row r labelled ``list[offset + r]`` and key j ``list[j]``, or None (numbered)."""
    if tokens is None:
        return [], [(None, None) for _ in entries]
    pair = (
        isinstance(tokens, (list, tuple))
        and len(tokens) == 2
        and all(isinstance(t, (list, tuple)) for t in tokens)
    )
    if pair:
        lists = [_token_list(tokens[0], "query_tokens"), _token_list(tokens[1], "key_tokens")]
        for e in entries:
            if len(lists[0]) != e.T or len(lists[1]) != e.S:
                raise ValueError(
                    f"{e.label}: tokens=(query_tokens, key_tokens) have "
                    f"{len(lists[0])} and {len(lists[1])} entries, need T={e.T} "
                    f"and S={e.S}"
                )
        return lists, [([0, 0], 1) for _ in entries]
    lst = _token_list(tokens, "tokens")
    out: list[tuple[list[int], int | None]] = []
    for e in entries:
        if e.S >= e.T and len(lst) >= e.S:
            out.append(([0, e.S - e.T], 0))  # keys tokens[:S]; queries end-aligned
        elif len(lst) == e.T:
            out.append(([0, 0], None))
        else:
            raise ValueError(
                f"{e.label}: {len(lst)} tokens for T={e.T} queries and S={e.S} "
                f"keys; pass T tokens (or at least S when S >= T), or a pair "
                f"(query_tokens, key_tokens)"
            )
    return [lst], out


def _matrix(x: Any, name: str) -> Tensor:
    try:
        t = torch.as_tensor(x.detach() if isinstance(x, Tensor) else x).cpu()
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"steps[{name!r}] must be a 2-D array, tensor or nested list of "
            f"numbers, got {type(x).__name__}"
        ) from None
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() == 1:
        t = t.unsqueeze(0)  # (1, n): one row
    if t.dim() != 2:
        raise ValueError(
            f"steps[{name!r}] must be 2-D, got shape {tuple(t.shape)}; pass one head, e.g. x[0, h]"
        )
    if t.numel() > _STEP_CELLS:
        raise ValueError(
            f"steps[{name!r}] has {t.numel()} numbers {tuple(t.shape)}; explain "
            f"tables are for small inputs (at most {_STEP_CELLS} numbers each): "
            f"pass a slice such as x[:16, :16]"
        )
    if t.dtype == torch.bool or not (t.dtype.is_floating_point or t.dtype.is_complex):
        t = t.double()
    if t.is_complex():
        raise TypeError(f"steps[{name!r}] is complex; pass real numbers")
    return t.double()


def _numbers(t: Tensor) -> list[list]:
    """A 2-D tensor as nested lists, 6 significant digits; non-finite numbers as strings."""

    def one(v: float):
        return float(f"{v:.6g}") if math.isfinite(v) else str(v)

    return [[one(v) for v in row] for row in t.tolist()]


def _table(name: str, t: Tensor, head: int | None, rows: Any = None, cols: Any = None) -> dict:
    return {"name": name, "head": head, "data": _numbers(t), "rows": rows, "cols": cols}


def _user_steps(steps: Any, first: _Entry, labels: tuple, lists: list) -> list[dict]:
    if steps is None:
        return []
    if not isinstance(steps, dict):
        raise TypeError(
            f"steps must be a dict name -> 2-D array (in display order), got {type(steps).__name__}"
        )
    out = []
    for name, x in steps.items():
        t = _matrix(x, str(name))
        n, m = t.shape
        rows = "q" if n == first.T else ("k" if n == first.S else None)
        weights = any(w in str(name).lower() for w in _WEIGHT_NAMES)
        cols = "k" if (weights and m == first.S) else None
        out.append(_table(str(name), t, None, rows, cols))
    return out


def _trace_steps(trace: MultiHeadTrace, b: int | None, T: int, S: int) -> list[dict]:
    """Q, K, V, scores, softmax, output of each head, for a small MultiHeadTrace."""
    if T > _AUTO_STEPS or S > _AUTO_STEPS:
        return []
    pick = (lambda t: t) if b is None else (lambda t: t[b])

    def heads_of(t: Tensor) -> Tensor:
        t = pick(t)
        return t.unsqueeze(0) if t.dim() == 2 else t  # (H or G, n, D)

    try:
        q, k, v, out = (heads_of(t) for t in (trace.q, trace.k, trace.v, trace.heads))
        scores, probs = (heads_of(t) for t in (trace.scores, trace.probs))
    except (AttributeError, IndexError, RuntimeError):
        return []
    H, G = q.shape[0], k.shape[0]
    if H % G or q.shape[-1] > 128 or v.shape[-1] > 128:
        return []
    found = []
    for h in range(H):
        g = h // (H // G)
        for name, t, rows, cols in (
            ("Q", q[h], "q", None),
            ("K", k[g], "k", None),
            ("V", v[g], "k", None),
            ("scores", scores[h], "q", "k"),
            ("softmax", probs[h], "q", "k"),
            ("output", out[h], "q", None),
        ):
            found.append(_table(name, t.detach().double().cpu(), h, rows, cols))
    return found


# ---------------------------------------------------------------- encoding


def _check_weights(w: Tensor, where: str) -> None:
    lo, hi = (float(x) for x in torch.aminmax(w))  # NaN anywhere makes both NaN
    if math.isnan(lo) or math.isnan(hi):
        raise ValueError(
            f"{where}: the weights hold NaN; pass attention probabilities (trace.probs)"
        )
    if lo < 0 or hi > 1 + _VALUE_SLACK:
        raise ValueError(
            f"{where}: weights must lie in [0, 1], got min {lo:.4g} and max "
            f"{hi:.4g}; pass attention probabilities (trace.probs, not scores)"
        )


def _bytes(t: Tensor) -> bytes:
    """The little-endian bytes of a CPU tensor (torch's own storage; numpy is not needed)."""
    t = t.contiguous()
    buf = bytearray(t.numel() * t.element_size())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(t.view(torch.uint8).reshape(-1))
    if sys.byteorder == "big":  # pragma: no cover - torch ships for little-endian hosts
        size = t.element_size()
        for i in range(0, len(buf), size):
            buf[i : i + size] = buf[i : i + size][::-1]
    return bytes(buf)


def _encode_head(w: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """One head's metadata and base64 payload. ``w`` (nr, S)."""
    nr, S = w.shape
    if nr * S <= budget:
        w32 = w.to(device="cpu", dtype=torch.float32)  # (nr, S)
        _check_weights(w32, where)
        mode = "f4" if nr * S <= budget // 16 else "f2"
        data = w32 if mode == "f4" else w32.half()
        return {"mode": mode, "vmax": float(w32.max())}, base64.b64encode(_bytes(data)).decode()
    return _encode_top(w, budget, where)


def _encode_signed(d: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """One head of signed differences ``d`` (nr, S): every cell as float32 ("s4") or float16
    ("s2") within the budget, else the cell of largest ``|d|`` of each ``b x b`` block ("sb",
    float16, ``b`` the smallest power of two leaving at most ``budget`` blocks)."""
    nr, S = d.shape
    d = d.to(device="cpu", dtype=torch.float32)  # (nr, S)
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{where}: the differences hold NaN or infinity")
    vmax = float(d.abs().max())
    if nr * S <= budget:
        mode = "s4" if nr * S <= budget // 16 else "s2"
        data = d if mode == "s4" else d.half()
        return {"mode": mode, "vmax": vmax}, base64.b64encode(_bytes(data)).decode()
    block = 1
    while math.ceil(nr / block) * math.ceil(S / block) > budget:
        block *= 2
    gr, gc = math.ceil(nr / block), math.ceil(S / block)
    grid = torch.empty(gr, gc)  # (gr, gc) the signed cell of largest |d| in each block
    for g0 in range(0, gr, max(1, 2048 // block)):
        rows = d[g0 * block : (g0 + max(1, 2048 // block)) * block]  # (n, S)
        n = math.ceil(rows.shape[0] / block)
        padded = torch.nn.functional.pad(rows, (0, gc * block - S, 0, n * block - rows.shape[0]))
        blocks = padded.view(n, block, gc, block).permute(0, 2, 1, 3).reshape(n, gc, -1)
        pick = blocks.abs().argmax(-1, keepdim=True)  # (n, gc, 1)
        grid[g0 : g0 + n] = blocks.gather(-1, pick)[..., 0]
    info = {"mode": "sb", "vmax": vmax, "block": block, "gr": gr, "gc": gc}
    return info, base64.b64encode(_bytes(grid.half())).decode()


def _encode_top(w: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """A head too large for its budget: block maxima, each row's support and top k."""
    nr, S = w.shape
    block = 1
    while math.ceil(nr / block) * math.ceil(S / block) > budget // _GRID_SHARE:
        block *= 2
    gr, gc = math.ceil(nr / block), math.ceil(S / block)
    ib = 2 if S <= 1 << 16 else 4
    k = min(_K_MAX, S, (2 * budget - 2 * gr * gc - 2 * ib * nr) // (nr * (2 + ib)))
    itype = torch.int32 if ib == 4 else torch.int16  # uint16 bits held in int16
    grid = torch.zeros(gr, gc)  # (gr, gc) block maxima
    idx = torch.zeros(nr, max(k, 0), dtype=itype)  # (nr, k)
    val = torch.zeros(nr, max(k, 0), dtype=torch.float16)  # (nr, k)
    span = torch.zeros(nr, 2, dtype=itype)  # (nr, 2) first and last key of nonzero weight
    full = S // block * block
    step = block * max(1, 2048 // block)  # rows per chunk: a float32 chunk of S columns
    for r0 in range(0, nr, step):
        chunk = w[r0 : r0 + step].to(device="cpu", dtype=torch.float32)  # (n, S)
        _check_weights(chunk, where)
        n = chunk.shape[0]
        maxima = [chunk[:, :full].reshape(n, full // block, block).amax(2)]  # (n, S // block)
        if full < S:
            maxima.append(chunk[:, full:].amax(1, keepdim=True))  # (n, 1)
        by_block = torch.cat(maxima, 1)  # (n, gc): each row's max over each block of keys
        padded = torch.cat([by_block, by_block.new_zeros((-n) % block, gc)])  # (n', gc)
        grid[r0 // block : r0 // block + padded.shape[0] // block] = padded.view(
            -1, block, gc
        ).amax(1)  # (n' / block, gc)
        span[r0 : r0 + n] = _support(chunk, by_block, block).to(itype)
        if k > 0:
            top_v, top_i = chunk.topk(k, dim=1)  # (n, k)
            top_i, order = top_i.sort(dim=1)  # ascending key index, for a binary search
            val[r0 : r0 + n] = top_v.gather(1, order).half()
            idx[r0 : r0 + n] = top_i.to(itype)
    payload = _bytes(idx) + _bytes(span) + _bytes(val) + _bytes(grid.half())
    info = {
        "mode": "top",
        "vmax": float(grid.max()),
        "block": block,
        "gr": gr,
        "gc": gc,
        "k": max(k, 0),
        "ib": ib,
    }
    return info, base64.b64encode(payload).decode()


def _support(chunk: Tensor, by_block: Tensor, block: int) -> Tensor:
    """First and last key of nonzero weight of each row, found from the blocks that hold
    one (a full scan of ``(n, S)`` for them costs ~0.3 s a chunk); ``(1, 0)`` for a row of
    zeros. ``chunk`` (n, S), ``by_block`` (n, gc) -> (n, 2)."""
    _, S = chunk.shape
    nonzero = (by_block > 0).to(torch.uint8)  # (n, gc)
    first_b = nonzero.argmax(1)  # (n,) argmax gives the first of equal maxima
    last_b = nonzero.shape[1] - 1 - nonzero.flip(1).argmax(1)  # (n,)
    offsets = torch.arange(block)

    def inside(b: Tensor, last: bool) -> Tensor:
        cols = b[:, None] * block + offsets  # (n, block)
        hit = ((chunk.gather(1, cols.clamp(max=S - 1)) > 0) & (cols < S)).to(torch.uint8)
        return cols[:, 0] + (block - 1 - hit.flip(1).argmax(1) if last else hit.argmax(1))

    out = torch.stack([inside(first_b, False), inside(last_b, True)], 1)  # (n, 2)
    empty = nonzero.amax(1) == 0
    out[empty] = torch.tensor([1, 0])
    return out


def _runs(rows: list[int]) -> list[list[int]]:
    """Consecutive rows as ``[first, count]`` runs."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return runs


# ---------------------------------------------------------------- page


def _asset(name: str) -> str:
    return resources.files("qkv.viz").joinpath(name).read_text(encoding="utf-8")


def _json_script(obj: Any) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # Inside <script>, "</script>" or "<!--" in a token would end or break the element.
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _page(meta: dict, blobs: list[str]) -> str:
    explain = bool(meta["steps"]) or any(e["steps"] for e in meta["entries"])
    title = escape(meta["title"])
    tab_explain = '<button id="tab-explain" type="button">Explain</button>' if explain else ""
    view_explain = '<section id="view-explain" class="view"></section>' if explain else ""
    kinds = {e["kind"] for e in meta["entries"]}
    if meta["scores"] is not None:
        tab_explain += '<button id="tab-scores" type="button">Head scores</button>'
        view_explain += _VIEW_SCORES
    if kinds & {"rollout", "flow"}:
        tab_explain += '<button id="tab-saliency" type="button">Saliency</button>'
        view_explain += _VIEW_SALIENCY
    if meta["changes"] is not None:
        tab_explain += '<button id="tab-changes" type="button">Changes</button>'
        view_explain += _VIEW_CHANGES
    data = "\n".join(
        f'<script type="application/octet-stream" id="qkv-blob-{i}">{b}</script>'
        for i, b in enumerate(blobs)
    )
    return _TEMPLATE.format(
        title=title,
        css=_asset("viewer.css"),
        js=_asset("viewer.js"),
        tab_explain=tab_explain,
        view_explain=view_explain,
        meta=_json_script(meta),
        data=data,
    )


_VIEW_SCORES = """
<section id="view-scores" class="view">
  <div class="controls">
    <label>sort by <select id="score"></select></label>
    <span class="note">a click on a head opens it in the matrix view</span>
  </div>
  <table id="scores-table" class="num"></table>
  <p id="scores-rows" class="note"></p>
</section>"""

_VIEW_SALIENCY = """
<section id="view-saliency" class="view">
  <div class="controls">
    <label>of <select id="saliency-of"></select></label>
    <label>output position <select id="saliency-pos"></select></label>
    <label id="saliency-head-label" hidden>head <select id="saliency-head"></select></label>
    <span id="saliency-note" class="note"></span>
  </div>
  <div id="saliency"></div>
  <p id="saliency-top" class="note"></p>
</section>"""

_VIEW_CHANGES = """
<section id="view-changes" class="view">
  <div class="controls">
    <label>rank by <select id="change-by">
      <option value="mean">mean |difference|</option>
      <option value="max">max |difference|</option></select></label>
    <span class="note">a click on a head opens its difference in the matrix view</span>
  </div>
  <table id="changes-table" class="num"></table>
</section>"""

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" href="data:,">
<style>
{css}
</style>
</head>
<body>
<header>
  <h1>{title}</h1>
  <div class="controls">
    <label>layer <select id="layer"></select></label>
    <label>head <select id="head"></select></label>
    <span class="tabs">
      <button id="tab-head" type="button">Head view</button>
      <button id="tab-matrix" type="button">Matrix</button>
      <button id="tab-overview" type="button">Layer overview</button>
      <button id="tab-model" type="button">Model view</button>
      {tab_explain}
    </span>
  </div>
  <div id="summary"></div>
</header>
<main>
<section id="view-head" class="view">
  <div class="controls">
    <label>top-k per query <input id="topk" type="number" min="1" max="64" value="6"></label>
    <label>threshold
      <input id="threshold" type="number" min="0" max="1" step="0.01" value="0.02"></label>
    <label>queries from <input id="head-scroll" type="range" min="0" max="0" value="0"></label>
    <label>keys from <input id="key-scroll" type="range" min="0" max="0" value="0"></label>
    <label><input id="follow" type="checkbox" checked> keys follow queries</label>
  </div>
  <div id="legend"></div>
  <canvas id="head-canvas" width="720" height="400"></canvas>
  <p class="note" id="head-note"></p>
</section>
<section id="view-matrix" class="view">
  <div class="controls">
    <label>colour <select id="scale">
      <option value="sqrt">sqrt</option><option value="lin">linear</option>
      <option value="log">log (1e-4 .. max)</option></select></label>
    <span id="scale-legend"></span>
    <button id="zoom-reset" type="button">Reset zoom</button>
    <span id="matrix-note" class="note"></span>
  </div>
  <div id="matrix-grid">
    <div></div><canvas id="matrix-cols" width="640" height="72"></canvas>
    <canvas id="matrix-rows" width="120" height="640"></canvas>
    <div id="matrix-wrap"><canvas id="matrix-canvas" width="640" height="640"></canvas>
      <div id="zoom-box"></div></div>
  </div>
  <div id="axis-info" class="note"></div>
  <p id="cell-info" class="note"></p>
</section>
<section id="view-overview" class="view"><div id="thumbs"></div></section>
<section id="view-model" class="view"><p id="model-note" class="note"></p>
  <div id="model-grid"></div></section>
{view_explain}
</main>
<footer id="precision" class="note"></footer>
<div id="tooltip"></div>
<script type="application/json" id="qkv-meta">{meta}</script>
{data}
<script>
{js}
</script>
</body>
</html>
"""


def _write_atomic(path: Path, text: str) -> Path:
    if not path.suffix:
        path = path.with_suffix(".html")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
