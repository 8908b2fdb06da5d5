"""The picture of docs/bevformer.md (issue 40, item 6): the page's own capture of a BEV
query's spatial cross-attention, drawn by ``qkv.viz.html`` in headless Chromium with the
harness of ``test_viewer_browser.py`` (network off; skipped, saying why, without Playwright
or Chromium).

The page's python blocks run as ``test_docs.py`` runs them (in order, one namespace, in a
temporary folder); the HTML page they write is opened, and the Sampling points view must
show the captured query's points in camera 0 with the capture's weights.
``QKV_WRITE_SCREENSHOT=1`` also saves the view to ``docs/img/bevformer-sca.png`` (CI leaves
it unset so it does not rewrite repo files).
"""

from __future__ import annotations

import contextlib
import io
import os

import test_viewer_browser as harness
from test_docs import DOCS, blocks
from test_viewer_browser import _quiet

browser = harness.browser  # fixture: the module's headless Chromium, network off
opened = harness.opened  # fixture: opened(path) -> Opened, loaded; closed after the test


def _run_page(name: str) -> dict:
    """The namespace after running every python block of ``docs/<name>``, output discarded."""
    namespace: dict = {"__name__": f"docs.{name}"}
    for b in blocks(DOCS / name):
        if b["why"] is None:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(b["code"], f"{name}:{b['line']}", "exec"), namespace)
    return namespace


def test_the_pages_capture_is_drawn(tmp_path, monkeypatch, opened):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    ns = _run_page("bevformer.md")
    rec, M, L, P = ns["rec"], ns["M"], ns["L"], ns["P"]
    o = opened(tmp_path / "bevformer_sca.html")
    _quiet(o)
    shown = {(d["hi"], d["level"], d["point"]): d for d in o.js("() => qkvViewer.points()")}
    assert len(shown) == M * L * P  # camera 0 (the first batch element), every head
    for (hi, level, point), d in shown.items():
        x, y = rec.locations[0, 0, hi, level, point].tolist()  # camera 0, the one query kept
        assert abs(d["x"] - x) < 1e-5 and abs(d["y"] - y) < 1e-5
        assert abs(d["w"] - float(rec.weights[0, 0, hi, level, point])) < 1e-6
    png = o.page.screenshot(type="png", clip={"x": 0, "y": 0, "width": 1000, "height": 420})
    _, _, pixels = harness._png_rgb(png)
    assert len(set(pixels)) >= 100, "the view is nearly one colour"
    if os.environ.get("QKV_WRITE_SCREENSHOT") == "1":
        out = harness.REPO / "docs" / "img" / "bevformer-sca.png"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(png)
    _quiet(o)
