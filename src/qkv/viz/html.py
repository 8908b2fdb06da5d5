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
* **Sampling points** (deformable attention: a ``DeformableTrace``, or the deformable records
  of a capture, ``cap.deformable``): for a chosen call, query and head, one panel per level
  (the level's map, ``H x W`` pixels, and a margin for points off it), the query's reference
  point marked ``+``, each sampling point a dot of its head's colour whose **area is
  proportional to its weight** (the largest shown has a radius of 14 px), and a table of the
  numbers; hover a dot for them. Pixel coordinates are ``DeformableTrace``'s (``x * W - 0.5``:
  pixel centres at integers, as ``grid_sample`` with ``align_corners=False``). A page of
  deformable attention alone has this view only.

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

Deformable attention comes in beside: a ``DeformableTrace`` (batch element ``batch``), a
capture's ``deformable`` records (``call`` and ``batch`` as above, their kept queries and
heads), or such a trace in a list or dict, each one entry of the Sampling points view (not a
layer option). ``tokens``, ``steps``, ``scores``, ``rollout`` and ``flow`` describe weights and
are refused on a page of deformable attention alone; ``against=`` is refused beside it.

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

Deformable entries: ``deformable[i]`` (call option ``i`` of the Sampling points view) has
``label``, ``layer``, ``batch``, ``Lq`` (the call's queries), ``nr`` and ``rows`` (the kept
queries, as runs), ``heads`` (true numbers), ``shapes`` (``[H, W]`` per level), ``P``, ``ref``
(whether reference points are stored) and ``blob``: float32 little-endian ``locations`` ``(nr,
nh, L, P, 2)`` in pixels, then ``weights`` ``(nr, nh, L, P)``, then, with ``ref``, the reference
points ``(nr, L, 2)`` in pixels. They take 12 bytes a point: at most ``2 * max_cells`` bytes in
all (more raises, naming ``rows=`` of ``qkv.capture`` as the fix).

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
* Sampling points (``#tab-deformable``, ``#view-deformable``, when there is deformable
  attention; the page opens on it when there is nothing else, with the tabs of the weights'
  views and the layer/head selects hidden): ``<select id="deform-of">`` (values ``"0".."n-1"``,
  the deformable entries), ``#deform-query`` (values the true query indices kept),
  ``#deform-head`` (``"all"`` and head positions), one ``<canvas class="level"
  data-level="l">`` per level inside ``#levels`` with a ``figcaption`` ``level <l> · <H>\u00d7<W>``
  (then `` · reference (<x>, <y>)`` and the count of points outside the panel), ``#deform-table``
  (one body row per point drawn: head, level, point, x, y, weight). Hovering a dot sets
  ``#tooltip`` to ``head <h> level <l> point <p>: x=<x> y=<y> w=<w>`` (``toPrecision(4)``).
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
  "max")``, ``colourOf(layer, head, q, k)`` (``[r, g, b]`` of that cell on the colour scale);
  ``sampling(entry, q)`` (``{points: [{head, hi, level, point, x, y, w}], ref: [[x, y]] per
  level or null}``: the stored points of query ``q``), ``setDeformable(entry, q, head =
  "all")`` (opens the Sampling points view on them), ``points()`` (the dots drawn now: each
  stored point with ``drawn``, ``r`` its radius and ``canvasX``/``canvasY`` its centre in its
  level's canvas, ``cx``/``cy`` in client coordinates).

Code, by job: this module writes the page (:func:`html`, and the text ``qkv.viz.show``
embeds); ``encode`` stores each head's weights (the modes above), ``entries`` reads the inputs
and the analyses into layer entries, ``labels`` aligns the tokens and builds the Explain
tables, ``page`` fills the template with viewer.js and viewer.css.

Shape alphabet: B batch, H heads, T query length, S key length, nr kept query rows.
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Sequence
from importlib import resources as resources  # tests find the assets through it
from pathlib import Path
from typing import Any

from torch import Tensor

from .encode import _HEAD_CELLS, _encode_head, _encode_signed, _runs
from .entries import (
    _analysis_entries,
    _changes,
    _compared_entries,
    _deform_payload,
    _diff_entries,
    _entries,
    _is_comparison,
    _scores_meta,
    _split_deformable,
)
from .labels import _tokens, _user_steps
from .page import _asset as _asset  # tests read the inlined assets through it
from .page import _page

__all__ = ["html"]


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
            (one layer each); deformable attention (a ``DeformableTrace``, a capture's
            deformable records) goes to the Sampling points view.
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
            element or call the input does not have, steps too large; deformable weights
            below 0 or not finite, or more sampling points than ``max_cells`` allows.

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
    rest, deform = _split_deformable(obj, batch, call)
    if rest is None and not deform:
        raise ValueError(
            f"every deformable record with call={call} kept 0 queries (rows outside those "
            f"calls); capture other rows or pass call='all'"
        )
    deform_meta, deform_blobs = _deform_meta(deform, max_cells, against)
    if rest is None:  # only deformable attention: the Sampling points view alone
        _only_points(tokens, steps, scores, rollout, flow)
        meta = _meta(title, [], [], [], 0, None, None)
        meta["deformable"] = deform_meta
        return _page(meta, deform_blobs)
    entries = _entries(rest, batch, call)
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
    meta = _meta(
        title,
        token_lists,
        meta_entries,
        user_steps,
        budget,
        _scores_meta(scores, entries),
        _changes(entries),
    )
    meta["deformable"] = [
        dict(d, blob=f"qkv-blob-{len(blobs) + i}") for i, d in enumerate(deform_meta)
    ]
    return _page(meta, blobs + deform_blobs)


def _meta(title, tokens, entries, steps, budget, scores, changes) -> dict:
    return {
        "version": 1,
        "title": title or "qkv attention",
        "tokens": tokens,
        "entries": entries,
        "steps": steps,
        "budget": budget,
        "scores": scores,
        "changes": changes,
    }


def _deform_meta(deform: list, max_cells: int, against: Any) -> tuple[list[dict], list[str]]:
    """The Sampling points view's entries (metadata, with blob ids counted from 0) and their
    payloads; within the same bytes as ``max_cells`` weights (2 each)."""
    if deform and against is not None:
        raise ValueError(
            "against= compares attention weights; deformable attention's sampling points "
            "are not compared: pass captures or traces without them"
        )
    metas: list[dict] = []
    payloads: list[bytes] = []
    for d in deform:
        info, raw = _deform_payload(d)
        metas.append(dict(info, blob=f"qkv-blob-{len(payloads)}"))
        payloads.append(raw)
    size = sum(len(p) for p in payloads)
    if size > 2 * max_cells:
        points = sum(d.weights.numel() for d in deform)
        raise ValueError(
            f"the deformable attention holds {points:,} sampling points ({size:,} bytes as "
            f"float32), more than max_cells={max_cells:,} allows ({2 * max_cells:,} bytes): "
            f"capture fewer queries (qkv.capture(model, rows=range(0, 4096, 64))) or pass "
            f"a larger max_cells"
        )
    return metas, [base64.b64encode(p).decode() for p in payloads]


def _only_points(tokens: Any, steps: Any, scores: Any, rollout: Any, flow: Any) -> None:
    """A page of deformable attention alone takes none of the arguments about weights."""
    given = [
        name
        for name, v in (("tokens", tokens), ("steps", steps or None), ("scores", scores),
                        ("rollout", rollout), ("flow", flow))
        if v is not None
    ]  # fmt: skip
    if given:
        raise ValueError(
            f"{', '.join(given)} describe attention weights, and this page shows only "
            f"deformable attention (sampling points, no weights over keys): leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


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
