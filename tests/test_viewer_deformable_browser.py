"""The viewer's Sampling points view (deformable attention, issue 40 item 3) in a real browser,
with the harness of ``test_viewer_browser.py`` (headless Chromium, a fresh profile, every
request but the file blocked and counted; skipped, saying why, without Playwright or Chromium):

* a hand-made ``qkv.DeformableTrace`` (2 heads x 2 levels x 3 points a query, points set apart
  on plain map): choosing a query in ``#deform-query`` draws its 12 points; each dot's centre
  is its trace pixel coordinates on its level's panel, its colour its head's, and its painted
  area (the pixels' coverage, read back from the canvas) is proportional to its weight; the
  hover gives the trace's numbers; choosing a head draws that head's points alone;
* a real capture of a model with self-attention and ``qkv.nn.MultiScaleDeformableAttention``:
  the attention views still work, and the Sampling points view shows the captured query's
  points, as float32 of the record's values.

``QKV_WRITE_SCREENSHOT=1`` also saves the view of docs/vision.md's module to
``docs/img/deformable.png`` (CI leaves it unset so it does not rewrite repo files).
"""

from __future__ import annotations

import math
import os
import re

import pytest
import test_viewer_browser as harness
import torch
from test_viewer_browser import Opened, _quiet
from torch import nn

import qkv

browser = harness.browser  # fixture: the module's headless Chromium, network off
opened = harness.opened  # fixture: opened(path) -> Opened, loaded; closed after the test

LEVELS = [(40, 60), (24, 36)]  # (H, W): panels of under 8 CSS px a pixel draw no pixel grid
RMAX = 14  # radius of the largest dot shown (viewer.js)
MAP_FILL = (0xEE, 0xF1, 0xF5)  # viewer.js MAP_FILL
HEAD_RGB = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)]  # viewer.js PALETTE[0], PALETTE[1]
ALPHA = 0.75  # a dot's opacity
# Query 1's points (pixels), set apart: two rows of three on each map, head 0 above head 1.
SPOTS = {
    0: [(10.0, 10.0), (25.0, 10.0), (40.0, 10.0), (10.0, 28.0), (25.0, 28.0), (40.0, 28.0)],
    1: [(6.0, 6.0), (16.0, 6.0), (26.0, 6.0), (6.0, 17.0), (16.0, 17.0), (26.0, 17.0)],
}
REFERENCE = {0: (52.0, 20.0), 1: (31.5, 12.0)}


def _hand_trace() -> qkv.DeformableTrace:
    """3 queries x 2 heads x 2 levels x 3 points; query 1 at SPOTS with weights in 1..12 / 78."""
    B, Lq, M, L, P = 1, 3, 2, len(LEVELS), 3
    g = torch.Generator().manual_seed(0)
    loc = torch.rand(B, Lq, M, L, P, 2, generator=g) * 20  # (B, Lq, M, L, P, 2) pixels
    for lvl, spots in SPOTS.items():
        for i, (x, y) in enumerate(spots):
            loc[0, 1, i // P, lvl, i % P] = torch.tensor([x, y])
    weights = torch.rand(B, Lq, M, L, P, generator=g)
    order = torch.tensor([3, 7, 1, 12, 5, 9, 2, 11, 6, 10, 4, 8], dtype=torch.float32)
    weights[0, 1] = (order / order.sum()).view(M, L, P)  # distinct weights: radii 5..14 px
    ref = torch.rand(B, Lq, L, 2, generator=g) * 20
    ref[0, 1] = torch.tensor([REFERENCE[0], REFERENCE[1]])
    return qkv.DeformableTrace(loc, weights, torch.tensor(LEVELS), ref)


def _pixels(o: Opened, level: int, x0: int, y0: int, w: int, h: int) -> list[list[int]]:
    """RGB of a rectangle of a level's canvas (a copy is read: the view's own is left alone)."""
    return o.js(
        """([l, x0, y0, w, h]) => {
        const c = document.querySelector(`canvas.level[data-level="${l}"]`);
        const copy = document.createElement('canvas'); copy.width = c.width; copy.height = c.height;
        const cx = copy.getContext('2d', { willReadFrequently: true }); cx.drawImage(c, 0, 0);
        const d = cx.getImageData(x0, y0, w, h).data, out = [];
        for (let i = 0; i < d.length; i += 4) out.push([d[i], d[i + 1], d[i + 2]]);
        return out; }""",
        [level, x0, y0, w, h],
    )


def _painted_area(o: Opened, dot: dict) -> float:
    """The area the dot paints, in canvas pixels: each pixel's share of the dot's colour over
    the map's fill, summed over a square around it (antialiased edges count their coverage)."""
    head = HEAD_RGB[dot["hi"]]
    full = [ALPHA * c + (1 - ALPHA) * f for c, f in zip(head, MAP_FILL)]  # the dot's inside
    span = [a - f for a, f in zip(full, MAP_FILL)]
    norm = sum(s * s for s in span)
    half = math.ceil(dot["r"]) + 3
    x0, y0 = math.floor(dot["canvasX"]) - half, math.floor(dot["canvasY"]) - half
    area = 0.0
    for rgb in _pixels(o, dot["level"], x0, y0, 2 * half + 1, 2 * half + 1):
        area += sum((p - f) * s for p, f, s in zip(rgb, MAP_FILL, span)) / norm
    return area


def test_choosing_a_query_draws_its_points_sized_by_weight(tmp_path, opened):
    trace = _hand_trace()
    path = tmp_path / "deformable.html"
    qkv.viz.html(trace, path, title="deformable")
    o = opened(path)
    _quiet(o)
    # deformable attention alone: the page opens on its view, without the weights' views
    assert o.active_views() == ["view-deformable"] and o.state()["view"] == "deformable"
    assert o.js("() => ['tab-head', 'tab-matrix'].map(id => document.getElementById(id).hidden)")
    assert o.page.locator("#tab-deformable").is_visible()
    assert len(o.js("() => window.qkvViewer.points()")) == 12  # query 0, drawn at load

    o.page.select_option("#deform-query", "1")
    o.page.wait_for_function(
        "() => document.getElementById('deform-note').textContent.startsWith('Query 1:')"
    )
    dots = o.js("() => window.qkvViewer.points()")
    assert len(dots) == 2 * len(LEVELS) * 3 and all(d["drawn"] for d in dots)
    assert o.page.locator("canvas.level").count() == len(LEVELS)
    w = trace.weights[0, 1]  # (M, L, P)
    for d in dots:
        h, lvl, p = d["hi"], d["level"], d["point"]
        assert (d["x"], d["y"]) == tuple(trace.locations[0, 1, h, lvl, p].tolist()), d
        assert d["w"] == float(w[h, lvl, p]), d  # float32, as stored
        assert d["head"] == h
    # sizes follow the weights: area (radius squared) proportional to weight, the largest RMAX
    ratio = [d["r"] ** 2 / d["w"] for d in dots]
    assert max(ratio) - min(ratio) <= 1e-9 * max(ratio), ratio
    assert max(d["r"] for d in dots) == pytest.approx(RMAX, rel=1e-12)
    assert math.sqrt(min(ratio) * float(w.max())) == pytest.approx(RMAX, rel=1e-9)
    # ... and so does what is painted: each dot's coverage is pi r^2 (antialiasing within
    # 4%), so painted area / weight is one number for all twelve
    painted = {(d["hi"], d["level"], d["point"]): _painted_area(o, d) for d in dots}
    for d in dots:
        area = painted[d["hi"], d["level"], d["point"]]
        assert area == pytest.approx(math.pi * d["r"] ** 2, rel=0.04), (d, area)
    per_weight = [painted[d["hi"], d["level"], d["point"]] / d["w"] for d in dots]
    assert max(per_weight) / min(per_weight) < 1.06, per_weight
    # each dot sits at its trace coordinates on its level's panel, in its head's colour
    for d in dots:
        (centre,) = _pixels(o, d["level"], math.floor(d["canvasX"]), math.floor(d["canvasY"]), 1, 1)
        want = [ALPHA * c + (1 - ALPHA) * f for c, f in zip(HEAD_RGB[d["hi"]], MAP_FILL)]
        assert all(abs(a - b) <= 2 for a, b in zip(centre, want)), (d, centre, want)
    left = {lvl: [d for d in dots if d["level"] == lvl] for lvl in SPOTS}
    for lvl in SPOTS:  # canvas x is affine in pixel x, one scale both ways
        a, b = sorted(left[lvl], key=lambda d: (d["x"], d["y"]))[:: len(left[lvl]) - 1]
        s = (b["canvasX"] - a["canvasX"]) / (b["x"] - a["x"])
        for d in left[lvl]:
            assert d["canvasX"] - a["canvasX"] == pytest.approx(s * (d["x"] - a["x"]), abs=1e-9)
            assert d["canvasY"] - a["canvasY"] == pytest.approx(s * (d["y"] - a["y"]), abs=1e-9)

    # the reference point per level, and the captions say it
    refs = o.js("() => window.qkvViewer.sampling(0, 1).ref")
    assert refs == [list(REFERENCE[0]), list(REFERENCE[1])]
    captions = o.js(
        "() => [...document.querySelectorAll('#levels figcaption')].map(c => c.textContent)"
    )
    assert captions == [
        "level 0 · 40\u00d760 · reference (52.00, 20.00)",
        "level 1 · 24\u00d736 · reference (31.50, 12.00)",
    ]

    # hovering a dot gives the trace's numbers
    d = next(d for d in dots if (d["hi"], d["level"], d["point"]) == (1, 0, 2))
    o.page.mouse.move(round(d["cx"]), round(d["cy"]))
    o.page.wait_for_function(
        "() => document.getElementById('tooltip').textContent.startsWith('head 1 level 0 point 2:')"
    )
    text = o.tooltip()
    m = re.fullmatch(r"head 1 level 0 point 2: x=(\S+) y=(\S+) w=(\S+)", text)
    assert m, text
    assert [m[1], m[2], m[3]] == [o.to_precision4(v) for v in (d["x"], d["y"], d["w"])]

    # one head: its points alone, sized against its own largest weight
    o.page.select_option("#deform-head", "1")
    one = o.js("() => window.qkvViewer.points()")
    assert len(one) == len(LEVELS) * 3 and {d["hi"] for d in one} == {1}
    big = max(float(v) for v in w[1].reshape(-1))
    for d in one:
        assert d["r"] == pytest.approx(RMAX * math.sqrt(d["w"] / big), rel=1e-9)
    assert o.js("() => document.querySelectorAll('#deform-table tbody tr').length") == 6
    with pytest.raises(Exception, match="query 7 was not kept"):
        o.js("() => window.qkvViewer.setDeformable(0, 7)")
    _quiet(o)


class Decoder(nn.Module):
    """A Deformable DETR decoder layer's attention: self-attention, then deformable attention."""

    def __init__(self, C=32, levels=((16, 24), (8, 12))):
        super().__init__()
        self.levels = torch.tensor(levels)
        self.self_attn = qkv.MultiHeadAttention(C, 4)
        self.cross_attn = qkv.nn.MultiScaleDeformableAttention(
            C, 4, len(levels), 4, dropout=0.0, batch_first=True
        )
        with torch.no_grad():  # offsets and weights that depend on the query (mmcv's init: none)
            self.cross_attn.sampling_offsets.weight.normal_(0, 0.1)
            self.cross_attn.attention_weights.weight.normal_(0, 0.3)

    def forward(self, query, value, ref):
        query = query + self.self_attn(query)
        return self.cross_attn(query, value=value, reference_points=ref, spatial_shapes=self.levels)


def test_a_capture_with_both_kinds_keeps_every_view(tmp_path, opened):
    torch.manual_seed(0)
    model = Decoder().eval()
    S = int((model.levels[:, 0] * model.levels[:, 1]).sum())
    query, value = torch.randn(2, 6, 32), torch.randn(2, S, 32)
    ref = torch.rand(2, 6, 1, 2).expand(2, 6, 2, 2)
    with torch.no_grad(), qkv.capture(model, rows=[1, 4], batch=[1]) as cap:
        model(query, value, ref)
    path = tmp_path / "both.html"
    qkv.viz.html(cap, path)
    o = opened(path)
    _quiet(o)
    # the attention entry and its views, as before
    assert o.state() == {"layer": 0, "head": "all", "view": "head"}
    assert o.js(
        "() => [...document.querySelectorAll('#layer option')].map(x => x.textContent)"
    ) == ["layer 0 · self_attn"]
    o.page.click("#tab-matrix")
    o.js("() => window.qkvViewer.setHead(2)")
    assert o.js("() => window.qkvViewer.value(0, 2, 4, 3)") == pytest.approx(
        float(cap.records[0].probs[0, 2, 1, 3]), rel=2**-11
    )
    # the deformable entry in its view, the query chosen in #deform-query
    o.page.click("#tab-deformable")
    assert o.active_views() == ["view-deformable"]
    assert o.js(
        "() => [...document.querySelectorAll('#deform-query option')].map(x => x.value)"
    ) == [
        "1",
        "4",
    ]
    o.page.select_option("#deform-query", "4")
    rec = cap.deformable[0]
    dots = o.js("() => window.qkvViewer.points()")
    assert len(dots) == 4 * 2 * 4 and o.js("() => window.qkvViewer.state.view") == "deformable"
    for d in dots:
        loc = rec.locations[0, 1, d["hi"], d["level"], d["point"]]  # batch 1, query 4
        assert (d["x"], d["y"]) == tuple(loc.float().tolist())
        assert d["w"] == float(rec.weights[0, 1, d["hi"], d["level"], d["point"]].float())
    drawn = [d for d in dots if d["drawn"]]
    assert len(drawn) >= len(dots) - 4  # mmcv's rays of 1..4 pixels, a few off small maps
    ratio = [d["r"] ** 2 / d["w"] for d in dots]
    assert max(ratio) - min(ratio) <= 1e-9 * max(ratio)
    assert "layer 1 · cross_attn: 2 of 6 queries kept" in o.js(
        "() => document.getElementById('summary').textContent"
    )
    # back to the weights: the head view draws again
    o.page.click("#tab-head")
    assert o.state()["view"] == "head" and o.active_views() == ["view-head"]
    _quiet(o)


def test_screenshot_of_the_docs_module(tmp_path, opened):
    """The picture in docs/vision.md: its module, its capture, the kept query whose reference
    point is nearest the middle (written to docs/img/deformable.png with
    QKV_WRITE_SCREENSHOT=1)."""
    torch.manual_seed(0)
    shapes = torch.tensor([[32, 48], [16, 24], [8, 12]])
    S = int((shapes[:, 0] * shapes[:, 1]).sum())
    attn = qkv.nn.MultiScaleDeformableAttention(
        256, num_heads=8, num_levels=3, num_points=4, batch_first=True
    )
    with torch.no_grad():
        attn.sampling_offsets.weight.normal_(0, 0.02)
        attn.attention_weights.weight.normal_(0, 0.1)
    queries, feature_maps = torch.randn(2, 100, 256), torch.randn(2, S, 256)
    points = torch.rand(2, 100, 1, 2).expand(2, 100, 3, 2)
    with qkv.capture(attn, rows=range(4)) as cap:
        attn(queries, value=feature_maps, reference_points=points, spatial_shapes=shapes)
    path = tmp_path / "docs.html"
    qkv.viz.html(cap, path, title="qkv: where each query looked")
    o = opened(path)
    _quiet(o)
    assert len(o.js("() => window.qkvViewer.points()")) == 8 * 3 * 4
    q = int((points[0, :4, 0] - 0.5).abs().sum(-1).argmin())  # the most central of the four
    o.page.select_option("#deform-query", str(q))
    shown = {(d["hi"], d["level"], d["point"]): d["w"] for d in o.js("() => qkvViewer.points()")}
    assert shown[0, 0, 0] == float(cap.deformable[0].weights[0, q, 0, 0, 0])
    png = o.page.screenshot(type="png", clip={"x": 0, "y": 0, "width": 1000, "height": 400})
    _, _, pixels = harness._png_rgb(png)
    assert len(set(pixels)) >= 100, "the view is nearly one colour"
    if os.environ.get("QKV_WRITE_SCREENSHOT") == "1":
        out = harness.REPO / "docs" / "img" / "deformable.png"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(png)
    _quiet(o)
