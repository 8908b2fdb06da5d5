"""qkv.viz.html of deformable attention (issue 40, item 3): what the page stores for the
Sampling points view, read back in Python from the format in ``qkv.viz.html``'s docstring
(float32 little-endian locations, weights and reference points, per kept query and head), for
a trace, a capture (bounded, several calls, beside ordinary attention) and lists; and the
errors that name the fix. The view itself is tested in a browser
(tests/test_viewer_deformable_browser.py).

Shape alphabet: B batch, Lq queries, M heads, L levels, P points; nr, nh the kept queries and
heads.
"""

from __future__ import annotations

import struct

import pytest
import torch
from test_viz_html import read_page
from torch import nn

import qkv

LEVELS = [(6, 9), (3, 5)]
S = sum(h * w for h, w in LEVELS)


def _trace(B=2, Lq=4, M=3, P=2, *, ref=True, seed=0) -> qkv.DeformableTrace:
    g = torch.Generator().manual_seed(seed)
    loc = torch.rand(B, Lq, M, len(LEVELS), P, 2, generator=g, dtype=torch.float64) * 9 - 1
    w = torch.rand(B, Lq, M, len(LEVELS), P, generator=g, dtype=torch.float64)
    r = torch.rand(B, Lq, len(LEVELS), 2, generator=g, dtype=torch.float64) * 5 if ref else None
    return qkv.DeformableTrace(loc, w, torch.tensor(LEVELS), r)


def _floats(raw: bytes) -> torch.Tensor:
    return torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))


def _stored(info: dict, raw: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(locations (nr, nh, L, P, 2), weights (nr, nh, L, P), reference (nr, L, 2) or None)."""
    nr, nh, L, P = info["nr"], len(info["heads"]), len(info["shapes"]), info["P"]
    n = nr * nh * L * P
    x = _floats(raw)
    assert len(x) == 3 * n + (2 * nr * L if info["ref"] else 0)
    ref = x[3 * n :].view(nr, L, 2) if info["ref"] else None
    return x[: 2 * n].view(nr, nh, L, P, 2), x[2 * n : 3 * n].view(nr, nh, L, P), ref


def test_a_trace_page_stores_its_points_as_float32(tmp_path):
    t = _trace()
    meta, blobs = read_page(qkv.viz.html(t, tmp_path / "t.html", batch=1))
    assert meta["entries"] == [] and len(meta["deformable"]) == 1
    d = meta["deformable"][0]
    assert d["label"] == "deformable attention" and (d["batch"], d["layer"]) == (1, None)
    assert (d["Lq"], d["nr"], d["rows"], d["heads"], d["P"], d["ref"]) == (
        4, 4, [[0, 4]], [0, 1, 2], 2, True,
    )  # fmt: skip
    assert d["shapes"] == [[6, 9], [3, 5]]
    loc, w, ref = _stored(d, blobs[d["blob"]])
    assert torch.equal(loc, t.locations[1].float())
    assert torch.equal(w, t.weights[1].float())
    assert torch.equal(ref, t.reference_points[1].float())
    # a trace without reference points (a bare qkv.deformable_attention call) stores none
    meta, blobs = read_page(qkv.viz.html(_trace(ref=False), tmp_path / "n.html"))
    d = meta["deformable"][0]
    assert d["ref"] is False and _stored(d, blobs[d["blob"]])[2] is None
    html = (tmp_path / "n.html").read_text()
    assert 'id="tab-deformable"' in html and 'id="view-deformable"' in html


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = qkv.MultiHeadAttention(12, 3)
        self.cross_attn = qkv.nn.MultiScaleDeformableAttention(12, 3, len(LEVELS), 2, dropout=0.0)

    def forward(self, query, value, ref):
        query = query + self.self_attn(query)
        return self.cross_attn(
            query.transpose(0, 1),
            value=value.transpose(0, 1),
            reference_points=ref,
            spatial_shapes=torch.tensor(LEVELS),
        )


def test_a_capture_with_both_kinds(tmp_path):
    torch.manual_seed(0)
    model = Decoder().eval()
    query, value, ref = torch.randn(3, 7, 12), torch.randn(3, S, 12), torch.rand(3, 7, 2, 2)
    with torch.no_grad(), qkv.capture(model, batch=[2, 0], heads=[2, 0], rows=[6, 1, 2]) as cap:
        model(query, value, ref)
        model(query, value, ref)
    meta, blobs = read_page(qkv.viz.html(cap, tmp_path / "c.html", batch=0))
    assert [e["label"] for e in meta["entries"]] == ["layer 0 · self_attn"]
    assert len(meta["deformable"]) == 1  # call 0 only, by default
    d = meta["deformable"][0]
    assert (d["label"], d["layer"], d["batch"], d["Lq"]) == ("layer 1 · cross_attn", 1, 0, 7)
    assert d["heads"] == [2, 0] and d["rows"] == [[6, 1], [1, 2]] and d["nr"] == 3
    # its blob follows the attention entry's heads
    assert d["blob"] == f"qkv-blob-{len(meta['entries'][0]['heads'])}"
    rec = cap.deformable[0]
    loc, w, r = _stored(d, blobs[d["blob"]])
    assert torch.equal(loc, rec.locations[1].float()) and torch.equal(w, rec.weights[1].float())
    assert torch.equal(r, rec.reference_points[1].float())

    meta, _ = read_page(qkv.viz.html(cap, tmp_path / "all.html", call="all"))
    assert [d["label"] for d in meta["deformable"]] == [
        "layer 1 · cross_attn · call 0",
        "layer 1 · cross_attn · call 1",
    ]
    assert [d["batch"] for d in meta["deformable"]] == [2, 2]  # the first kept
    # the records alone, as a list, and a list of a trace of each kind
    meta, _ = read_page(qkv.viz.html(cap.deformable, tmp_path / "recs.html"))
    assert meta["entries"] == [] and meta["deformable"][0]["label"] == "layer 1 · cross_attn"
    x = torch.randn(1, 5, 12)
    _, mh = model.self_attn(x, return_trace=True)
    meta, _ = read_page(qkv.viz.html([mh, _trace()], tmp_path / "list.html"))
    assert [e["label"] for e in meta["entries"]] == ["layer 0"]
    assert [(d["label"], d["layer"]) for d in meta["deformable"]] == [("layer 1", 1)]


def test_notebook_shows_a_deformable_trace():
    text = _trace()._repr_html_()
    assert "<iframe" in text and "tab-deformable" in text


BUDGET = (
    r"holds 48 sampling points \(640 bytes as float32\), more than max_cells=64 allows "
    r"\(128 bytes\): capture fewer queries"
)  # 4 queries x 3 heads x 2 levels x 2 points, 3 floats each, and 4 x 2 reference points


@pytest.mark.parametrize(
    "change, kwargs, match",
    [
        ("nan-weight", {}, r"weights must be finite and >= 0 \(a dot's area is its weight\)"),
        ("negative-weight", {}, r"weights must be finite and >= 0 .* got min -0\.5"),
        ("inf-location", {}, r"sampling locations hold NaN or infinity"),
        ("none", {"tokens": ["a"] * 4}, r"tokens describe attention weights, and this page"),
        ("none", {"against": "self"}, r"against= compares attention weights; deformable"),
        ("none", {"max_cells": 64}, BUDGET),
        ("none", {"batch": 2}, r"batch=2 out of range for batch size 2; pass 0\.\.1"),
    ],
    ids=["nan-weight", "negative-weight", "inf-location", "tokens", "against", "budget", "batch"],
)  # fmt: skip
def test_bad_input_says_the_fix(tmp_path, change, kwargs, match):
    t = _trace()
    if change == "nan-weight":
        t.weights[0, 0, 0, 0, 0] = float("nan")
    elif change == "negative-weight":
        t.weights[0, 1, 0, 0, 0] = -0.5
    elif change == "inf-location":
        t.locations[0, 1, 0, 0, 0, 0] = float("inf")
    if kwargs.get("against") == "self":
        kwargs = {"against": t}
    with pytest.raises(ValueError, match=match):
        qkv.viz.html(t, tmp_path / "bad.html", **kwargs)
    assert not (tmp_path / "bad.html").exists()
