"""The text of a :func:`qkv.viz.html` page: its template, with viewer.js and viewer.css
inlined, the metadata as JSON and each head's payload as a base64 script element (the DOM
contract is told in :mod:`qkv.viz.html`'s docstring).
"""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any


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
    if meta.get("deformable"):
        tab_explain += '<button id="tab-deformable" type="button">Sampling points</button>'
        view_explain += _VIEW_DEFORMABLE
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

_VIEW_DEFORMABLE = """
<section id="view-deformable" class="view">
  <div class="controls">
    <label>call <select id="deform-of"></select></label>
    <label>query <select id="deform-query"></select></label>
    <label>head <select id="deform-head"></select></label>
  </div>
  <div id="deform-legend"></div>
  <div id="levels"></div>
  <p id="deform-note" class="note"></p>
  <div class="scroll"><table id="deform-table" class="num"></table></div>
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
