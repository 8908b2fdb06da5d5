"""The viewer's analysis pages (``qkv.viz.html(..., scores=, rollout=, flow=, against=)``) in a
real browser, with the harness of ``test_viewer_browser.py`` (headless Chromium, a fresh
profile, every request but the file blocked and counted):

* rollout and flow: every value the page holds for the rollout entry, and the saliency it
  shows for an output position, equal ``qkv.analysis.rollout`` / ``flow`` (float32 exactly);
  a per-head rollout likewise, head by head through Saliency's head selector;
* a difference page (``against=``): a positive and a negative difference are drawn in
  different hues (blue and red), on the canvas and by ``colourOf``; the Changes table ranks
  the heads by mean and max |difference| as ``qkv.analysis.compare`` does;
* head scores: choosing a score in ``#score`` reorders the table's heads exactly as
  ``HeadScores.sorted_by``; a click on a row opens that head in the matrix view;
* and on each page: no request besides the file, no console or page error.
"""

from __future__ import annotations

import pytest
import test_viewer_browser as harness
import torch
from test_viewer_browser import Opened, _quiet

import qkv

browser = harness.browser  # fixture: the module's headless Chromium, network off
opened = harness.opened  # fixture: opened(path) -> Opened, loaded; closed after the test

L, H, T = 2, 4, 12
WORDS = ["the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "warm", "and", "soft"]


@pytest.fixture(scope="module")
def captures():
    """A 2-layer x 4-head DecoderLM's captures on two inputs of T tokens (a repeated one)."""
    torch.manual_seed(0)
    model = qkv.DecoderLM(20, 32, H, L, max_len=16).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6] * 2])  # (1, T): period 6
    caps = []
    for x in (ids, torch.arange(1, T + 1)[None]):
        with torch.no_grad(), qkv.capture(model) as cap:
            model(x)
        caps.append(cap)
    return caps


def _matrix_pixel(o: Opened, q: int, k: int) -> list[int]:
    """RGB the matrix canvas shows inside cell (q, k), near its corner (away from its text)."""
    a = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", [q, k])
    b = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", [q + 1, k + 1])
    x, y = a["x"] + 0.4 * (b["x"] - a["x"]), a["y"] + 0.4 * (b["y"] - a["y"])
    return o.js(
        """([x, y]) => {
        const c = document.getElementById('matrix-canvas'), r = c.getBoundingClientRect();
        const copy = document.createElement('canvas'); copy.width = c.width; copy.height = c.height;
        const cx = copy.getContext('2d', { willReadFrequently: true }); cx.drawImage(c, 0, 0);
        const px = Math.floor((x - r.left) * c.width / r.width);
        const py = Math.floor((y - r.top) * c.height / r.height);
        return [...cx.getImageData(px, py, 1, 1).data].slice(0, 3); }""",
        [x, y],
    )


def test_rollout_and_flow_in_the_page_equal_the_python_result(captures, tmp_path, opened):
    pytest.importorskip("networkx", reason="flow needs networkx")
    cap = captures[0]
    R = qkv.analysis.rollout(cap)  # (1, T, T)
    F = qkv.analysis.flow(cap, positions=[T - 1, 0])  # (1, 2, T)
    path = tmp_path / "rollout.html"
    qkv.viz.html(cap, path, WORDS, rollout=R, flow=(F, [T - 1, 0]))
    o = opened(path)
    kinds = o.js(
        "() => JSON.parse(document.getElementById('qkv-meta').textContent).entries.map(e => e.kind)"
    )
    assert kinds == ["attention"] * L + ["rollout", "flow"]
    got = torch.tensor(
        o.js(
            "([li, T]) => { const out = []; for (let q = 0; q < T; q++)"
            " for (let k = 0; k < T; k++) out.push(window.qkvViewer.value(li, 0, q, k));"
            " return out; }",
            [L, T],
        ),
        dtype=torch.float64,
    ).view(T, T)
    assert torch.equal(got, R[0].float().double())  # float32 exactly
    assert torch.allclose(got.sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-6)
    # The saliency view: output position q's row, as numbers and as shaded tokens.
    o.page.click("#tab-saliency")
    o.page.select_option("#saliency-of", str(L))
    for q in (T - 1, 3):
        o.page.select_option("#saliency-pos", str(q))
        shown = o.js(
            "() => [...document.querySelectorAll('#saliency span.tok')]"
            ".map(s => [s.textContent, s.title])"
        )
        assert [w for w, _ in shown] == WORDS
        assert [t for _, t in shown] == [
            f"k={k} " + o.to_precision4(float(R[0, q, k].float())) for k in range(T)
        ]
        assert (
            o.js("q => window.qkvViewer.saliency(" + str(L) + ", q)", q) == R[0, q].float().tolist()
        )
    # Flow: its own entry, rows = the positions asked for (sorted), values as computed.
    for p, q in ((0, T - 1), (1, 0)):
        assert torch.allclose(
            torch.tensor(
                o.js("q => window.qkvViewer.saliency(" + str(L + 1) + ", q)", q),
                dtype=torch.float32,
            ),
            F[0, p].float(),
            rtol=0,
            atol=0,
        )
    o.page.select_option("#saliency-of", str(L + 1))
    assert o.state()["view"] == "saliency"
    _quiet(o)


def test_per_head_rollout_in_the_page_equals_the_python_result(captures, tmp_path, opened):
    """rollout(cap, heads="per_head") ``(1, H, T, T)``: one entry of H heads (chain h: head h of
    every layer); every value through value(), and Saliency's head selector shows chain h's
    row of an output position, equal the Python result (float32 exactly)."""
    cap = captures[0]
    R = qkv.analysis.rollout(cap, heads="per_head")  # (1, H, T, T)
    path = tmp_path / "per_head.html"
    qkv.viz.html(cap, path, WORDS, rollout=R)
    o = opened(path)
    entry = o.js("() => JSON.parse(document.getElementById('qkv-meta').textContent).entries[2]")
    assert entry["kind"] == "rollout" and [h["head"] for h in entry["heads"]] == list(range(H))
    got = torch.tensor(
        o.js(
            "([li, H, T]) => { const out = []; for (let h = 0; h < H; h++)"
            " for (let q = 0; q < T; q++) for (let k = 0; k < T; k++)"
            " out.push(window.qkvViewer.value(li, h, q, k)); return out; }",
            [L, H, T],
        ),
        dtype=torch.float64,
    ).view(H, T, T)
    assert torch.equal(got, R[0].float().double())
    assert not torch.equal(got[0], got[1])  # the chains differ
    o.page.click("#tab-saliency")
    assert o.page.locator("#saliency-head-label").is_visible()
    for h, q in ((0, T - 1), (3, T - 1), (2, 4)):
        o.page.select_option("#saliency-pos", str(q))
        o.page.select_option("#saliency-head", str(h))
        shown = o.js("() => [...document.querySelectorAll('#saliency span.tok')].map(s => s.title)")
        assert shown == [
            f"k={k} " + o.to_precision4(float(R[0, h, q, k].float())) for k in range(T)
        ]
        assert (
            o.js("([q, h]) => window.qkvViewer.saliency(" + str(L) + ", q, h)", [q, h])
            == R[0, h, q].float().tolist()
        )
        assert f"through head {h} of every layer" in o.js(
            "() => document.getElementById('saliency-note').textContent"
        )
    _quiet(o)
    # A head-mean rollout has no head selector.
    qkv.viz.html(cap, tmp_path / "mean.html", WORDS, rollout=qkv.analysis.rollout(cap))
    o2 = opened(tmp_path / "mean.html")
    o2.page.click("#tab-saliency")
    assert not o2.page.locator("#saliency-head-label").is_visible()
    _quiet(o2)


def test_difference_colours_are_signed_and_heads_ranked(captures, tmp_path, opened):
    a, b = captures
    path = tmp_path / "diff.html"
    qkv.viz.html(a, path, against=b)
    d = torch.stack(
        [a.layer(i)[0].probs[0] - b.layer(i)[0].probs[0] for i in range(L)]
    )  # (L, H, T, T)
    o = opened(path)
    assert o.state()["view"] == "matrix"  # a difference page opens on the matrix
    layer, head = 1, 2
    o.js(
        "([l, h]) => { window.qkvViewer.setLayer(l); window.qkvViewer.setHead(h); }", [layer, head]
    )
    dd = d[layer, head]
    big = dd.abs().max()
    pos = (dd == dd.max()).nonzero()[0].tolist()
    neg = (dd == dd.min()).nonzero()[0].tolist()
    assert dd.max() > 0.3 * big and dd.min() < -0.3 * big  # both signs are strong here
    for q, k in (pos, neg):
        assert o.js(
            "([l, h, q, k]) => window.qkvViewer.value(l, h, q, k)", [layer, head, q, k]
        ) == float(dd[q, k])
    p_rgb, n_rgb = _matrix_pixel(o, *pos), _matrix_pixel(o, *neg)
    assert p_rgb[2] > p_rgb[0] + 40, f"a positive difference is drawn blue, got {p_rgb}"
    assert n_rgb[0] > n_rgb[2] + 40, f"a negative difference is drawn red, got {n_rgb}"
    assert (
        o.js("([l, h, q, k]) => window.qkvViewer.colourOf(l, h, q, k)", [layer, head, *pos])
        == p_rgb
    )
    assert (
        o.js("([l, h, q, k]) => window.qkvViewer.colourOf(l, h, q, k)", [layer, head, *neg])
        == n_rgb
    )
    zero = o.js("([l, h]) => window.qkvViewer.colourOf(l, h, 0, 5)", [layer, head])  # causal: 0
    assert zero == [255, 255, 255]
    assert o.hover(*neg).startswith(f"q={neg[0]} k={neg[1]} d=-")
    # Changes: heads by mean |d|, most changed first, as qkv.analysis.compare ranks them (the
    # entry of layer l is l, the head position of head h is h: all are kept).
    cmp = qkv.analysis.compare(a, b)
    o.page.click("#tab-changes")
    assert [tuple(x) for x in o.js("() => window.qkvViewer.changeOrder()")] == cmp.ranked("mean")
    o.page.select_option("#change-by", "max")
    by_max = cmp.ranked("max")
    assert [tuple(x) for x in o.js("() => window.qkvViewer.changeOrder()")] == by_max
    o.page.click("#changes-table tbody tr:first-child")  # opens the most changed head
    assert o.state() == {"layer": by_max[0][0], "head": by_max[0][1], "view": "matrix"}
    o.page.click("#tab-overview")
    _quiet(o)


def test_sorting_by_a_score_reorders_the_heads(captures, tmp_path, opened):
    cap = captures[0]
    table = qkv.analysis.head_scores(cap, induction=6)
    path = tmp_path / "scores.html"
    qkv.viz.html(cap, path, WORDS, scores=table)
    o = opened(path)
    o.page.click("#tab-scores")
    orders = {}
    for name in table.names:
        o.page.select_option("#score", name)
        order = [tuple(x) for x in o.js("() => window.qkvViewer.scoreOrder()")]
        assert order == list(table.sorted_by(name).keys), name
        dom = o.js(
            "() => [...document.querySelectorAll('#scores-table tbody tr')]"
            ".map(tr => [+tr.dataset.layer, +tr.dataset.head])"
        )
        assert [tuple(x) for x in dom] == order
        rows_text = o.js("() => document.getElementById('scores-rows').textContent")
        assert f"Rows “{name}” used" in rows_text and "layer 0: " in rows_text
        orders[name] = order
    assert len(set(map(tuple, orders.values()))) > 1  # the scores order the heads differently
    assert "layer 0: 6..11 (6 rows)" in o.js(
        "() => { window.qkvViewer.setScore('induction');"
        " return document.getElementById('scores-rows')"
        ".textContent; }"
    )
    # The three best heads are highlighted in the table and in the overview.
    assert o.page.locator("#scores-table tr.best").count() == 3
    best = orders["induction"][:3]
    o.page.click("#tab-overview")
    for layer in range(L):
        o.js("l => window.qkvViewer.setLayer(l)", layer)
        outlined = o.js(
            "() => [...document.querySelectorAll('canvas.thumb.best')].map(c => +c.dataset.head)"
        )
        assert outlined == [h for lay, h in best if lay == layer]
    # A click on a row opens that head in the matrix view.
    o.page.click("#tab-scores")
    o.page.click("#scores-table tbody tr:first-child")
    layer, head = best[0]
    assert o.state() == {"layer": layer, "head": head, "view": "matrix"}
    _quiet(o)


def test_model_view_shows_every_layer_and_head_and_opens_a_cell(captures, tmp_path, opened):
    cap = captures[0]
    probs = torch.stack([cap.layer(i)[0].probs[0] for i in range(L)]).double()  # (L, H, T, T)
    path = tmp_path / "model.html"
    qkv.viz.html(cap, path, WORDS)
    o = opened(path)
    o.page.click("#tab-model")
    assert o.active_views() == ["view-model"] and o.state()["view"] == "model"
    cells = o.js(
        "() => [...document.querySelectorAll('#model-grid canvas.mthumb')]"
        ".map(c => [+c.dataset.layer, +c.dataset.head])"
    )
    assert cells == [[li, h] for li in range(L) for h in range(H)]
    # Every cell's values, through value(): the capture's, exactly.
    got = torch.tensor(
        o.js(
            "([L, H, T]) => { const v = window.qkvViewer, out = [];"
            "  for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) for (let q = 0; q < T; q++)"
            "    for (let k = 0; k < T; k++) out.push(v.value(l, h, q, k)); return out; }",
            [L, H, T],
        ),
        dtype=torch.float64,
    ).view(L, H, T, T)
    assert torch.equal(got, probs)
    # Thumbnails differ from each other (each draws its own head), none is blank.
    digests = o.js(
        "() => [...document.querySelectorAll('#model-grid canvas.mthumb')].map((c, i) => {"
        " c.id = 'mthumb-' + i; return window.qkvViewer.digest(c.id); })"
    )
    assert len(set(digests)) == L * H
    o.page.click("#model-grid canvas.mthumb[data-layer='1'][data-head='2']")
    assert o.state() == {"layer": 1, "head": 2, "view": "matrix"}
    _quiet(o)


# ---- the docs walkthrough's pages and pictures ------------------------------------------------


def _run_docs_page(page, cwd) -> dict:
    """Run docs/PAGE's python blocks in ``cwd``, as tests/test_docs.py does; their namespace."""
    import contextlib
    import io
    import os

    from test_docs import blocks

    namespace: dict = {"__name__": "docs." + page.stem}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        for b in blocks(page):
            if b["why"] is None:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(b["code"], f"{page.name}:{b['line']}", "exec"), namespace)
    finally:
        os.chdir(here)
    return namespace


def test_docs_walkthrough_pages(tmp_path, opened):
    """docs/interpretability.md's pages (its code writes them) hold Python's numbers: the Head
    scores order, the per-head rollout's saliency, the Changes ranking. Pictures of each view
    go to tmp_path, and to docs/img/ with QKV_DOCS_SCREENSHOTS=1 (each under 150 KB)."""
    import os
    import shutil

    page = harness.REPO / "docs" / "interpretability.md"
    ns = _run_docs_page(page, tmp_path)
    table, per, cmp, words = ns["table"], ns["per"], ns["cmp"], ns["words"]
    shots = {}

    o = opened(tmp_path / "scores.html")
    o.page.click("#tab-scores")
    o.page.select_option("#score", "induction")
    assert [tuple(x) for x in o.js("() => window.qkvViewer.scoreOrder()")] == list(
        table.sorted_by("induction").keys
    )
    shots["scores"] = o.page.locator("#view-scores").screenshot(type="png")
    _quiet(o)

    o = opened(tmp_path / "rollout.html")
    o.page.click("#tab-saliency")
    T = len(words)
    o.page.select_option("#saliency-pos", str(T - 1))
    o.page.select_option("#saliency-head", "0")
    assert (
        o.js("q => window.qkvViewer.saliency(2, q, 0)", T - 1) == per[0, 0, T - 1].float().tolist()
    )
    shots["rollout"] = o.page.locator("#view-saliency").screenshot(type="png")
    _quiet(o)

    o = opened(tmp_path / "changes.html")
    o.page.click("#tab-changes")
    assert [tuple(x) for x in o.js("() => window.qkvViewer.changeOrder()")] == cmp.ranked()
    o.page.click("#changes-table tbody tr:first-child")  # the most changed head, its matrix
    assert o.state() == {"layer": 0, "head": 0, "view": "matrix"}
    shots["changes"] = _stacked(o)
    _quiet(o)

    for name, png in shots.items():
        assert 2_000 < len(png) < 150_000, (name, len(png))
        (tmp_path / f"interpretability-{name}.png").write_bytes(png)
        if os.environ.get("QKV_DOCS_SCREENSHOTS") == "1":
            out = harness.REPO / "docs" / "img" / f"interpretability-{name}.png"
            shutil.copyfile(tmp_path / f"interpretability-{name}.png", out)


def _stacked(o: Opened) -> bytes:
    """The Changes table above the matrix of the head it opened, as one picture (the table is
    put back, above the matrix, for the shot)."""
    o.js(
        "() => { const t = document.getElementById('view-changes'); t.classList.add('active');"
        " document.getElementById('view-matrix').before(t); }"
    )
    box_t = o.page.locator("#view-changes").bounding_box()
    box_m = o.page.locator("#view-matrix").bounding_box()
    top = min(box_t["y"], box_m["y"])
    bottom = max(box_t["y"] + box_t["height"], box_m["y"] + min(box_m["height"], 560))
    return o.page.screenshot(
        type="png", full_page=True, clip={"x": 0, "y": top, "width": 900, "height": bottom - top}
    )


def _grey_fraction(o: Opened) -> float:
    """The share of the first model-view thumbnail painted UNKNOWN ("not stored") grey."""
    return o.js(
        "() => { const c = document.querySelector('#model-grid canvas.mthumb');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let n = 0; for (let i = 0; i < d.length; i += 4)"
        "   if (d[i] === 224 && d[i + 1] === 224 && d[i + 2] === 224) n++;"
        " return n / (d.length / 4); }"
    )


def test_a_bounded_head_far_wider_than_tall_is_drawn_not_greyed(tmp_path, opened):
    """A head stored as block maxima + each row's top k, with far fewer kept rows than keys
    (a capture of every 16th row at 16k tokens): a thumbnail pixel spans many key blocks but
    under one block of rows. It used to take the sparse top-k path (its level chosen from the
    finer direction) and paint every pixel no row's top k fell in grey, 99% of the thumbnail;
    it is now drawn from the block maxima, as a square head is (found by
    benchmarks/bench_model_view.py)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 128, 2048, generator=g) * 0.1  # (H, rows, S): 16x wider than tall
    w[..., :16] += 6.0  # every row's mass on the first keys: top k there, small elsewhere
    w = w.softmax(-1)
    path = tmp_path / "wide.html"
    qkv.viz.html(w, path, max_cells=2**14)
    o = opened(path)
    o.page.click("#tab-model")
    assert _grey_fraction(o) < 0.01  # 0.52 before
    _quiet(o)


def test_model_view_of_12_layers_x_12_heads_fits_beside_its_scrollbar(tmp_path, opened):
    """A 12 x 12 model view in the harness's 1280 px window: the grid scrolls down, and every
    thumbnail lies inside the grid's client area (not under its vertical scrollbar)."""
    torch.manual_seed(0)
    model = qkv.DecoderLM(20, 24, 12, 12, max_len=16).eval()
    with torch.no_grad(), qkv.capture(model) as cap:
        model(torch.arange(1, 9)[None])
    path = tmp_path / "model12.html"
    qkv.viz.html(cap, path)
    o = opened(path)
    o.page.click("#tab-model")
    box = o.js(
        """() => { const g = document.getElementById('model-grid'), r = g.getBoundingClientRect();
        const right = r.left + g.clientLeft + g.clientWidth;
        const thumbs = [...g.querySelectorAll('canvas.mthumb')];
        return { n: thumbs.length, scrolls: g.scrollHeight > g.clientHeight,
                 bar: g.offsetWidth - g.clientWidth - 2 * g.clientLeft,
                 right, worst: Math.max(...thumbs.map(c => c.getBoundingClientRect().right)) }; }"""
    )
    assert box["n"] == 144 and box["scrolls"], box
    assert box["worst"] <= box["right"] + 0.5, box
    _quiet(o)
