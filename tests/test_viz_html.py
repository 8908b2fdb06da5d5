"""qkv.viz.html: one self-contained offline page; its embedded data decodes (here, in Python,
from the format in the module docstring) back to the weights within the stated precision.

What is checked: no network reference of any kind; float32 cells exact, float16 cells within
max(|w| 2^-11, 2^-25); for heads over budget, block maxima, each row's support and its top-k
entries, with every dropped cell below the bound the page hovers; file size under the
docstring's bound at 4k and 16k tokens and for a real capture of 4 layers x 4 heads at 4k;
tokens; errors that name the fix; atomic writes. Browser behaviour is tested elsewhere
(tests/test_viewer_browser.py).
"""

import base64
import importlib
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import qkv
from qkv.viz import html

M = importlib.import_module("qkv.viz.html")  # the module (qkv.viz.html is the function)


# ---------------------------------------------------------------- a reader of the page


def read_page(path):
    """(meta, {blob id: bytes}) of a page written by html()."""
    text = Path(path).read_text(encoding="utf-8")
    meta = json.loads(
        re.search(
            r'<script type="application/json" id="qkv-meta">(.*?)</script>', text, re.S
        ).group(1)
    )
    blobs = {
        m.group(1): base64.b64decode(m.group(2))
        for m in re.finditer(
            r'<script type="application/octet-stream" id="(qkv-blob-\d+)">'
            r"([A-Za-z0-9+/=]*)</script>",
            text,
        )
    }
    return meta, blobs


def arrays(info, raw, nr, S):
    """The arrays of one head's payload, as torch tensors."""

    def take(dtype, n, off):
        size = torch.empty(0, dtype=dtype).element_size()
        t = (
            torch.frombuffer(bytearray(raw[off : off + n * size]), dtype=dtype)
            if n
            else torch.empty(0, dtype=dtype)
        )
        return t, off + n * size

    if info["mode"] in ("f4", "f2"):
        dtype = torch.float32 if info["mode"] == "f4" else torch.float16
        t, end = take(dtype, nr * S, 0)
        assert end == len(raw)
        return {"w": t.reshape(nr, S)}
    k, ib = info["k"], info["ib"]
    itype = torch.int32 if ib == 4 else torch.int16
    idx, off = take(itype, nr * k, 0)
    span, off = take(itype, 2 * nr, off)
    val, off = take(torch.float16, nr * k, off)
    grid, off = take(torch.float16, info["gr"] * info["gc"], off)
    assert off == len(raw)
    unsigned = (lambda t: t.long() & 0xFFFF) if ib == 2 else (lambda t: t.long())
    return {
        "idx": unsigned(idx).reshape(nr, k),
        "span": unsigned(span).reshape(nr, 2),
        "val": val.reshape(nr, k),
        "grid": grid.reshape(info["gr"], info["gc"]),
    }


def rows_of(entry):
    return [first + i for first, count in entry["rows"] for i in range(count)]


def f16_err(w):
    return torch.maximum(w.abs() * 2.0**-11, torch.full_like(w, 2.0**-25))


def check_head(info, raw, w):
    """The payload of one head against its true weights ``w`` (nr, S), float64."""
    nr, S = w.shape
    a = arrays(info, raw, nr, S)
    if info["mode"] == "f4":
        assert torch.equal(a["w"], w.float())
        return a
    if info["mode"] == "f2":
        assert ((a["w"].double() - w).abs() <= f16_err(w)).all()
        return a
    b = info["block"]
    # block maxima
    pad = torch.zeros(info["gr"] * b, info["gc"] * b, dtype=w.dtype)
    pad[:nr, :S] = w
    true_grid = pad.view(info["gr"], b, info["gc"], b).amax(dim=(1, 3))
    assert ((a["grid"].double() - true_grid).abs() <= f16_err(true_grid)).all()
    # each row's support: first and last key of nonzero weight
    for r in range(nr):
        nz = (w[r] > 0).nonzero().flatten()
        want = [int(nz[0]), int(nz[-1])] if len(nz) else [1, 0]
        assert a["span"][r].tolist() == want, r
    # the top k of each row, exact to float16, keys ascending
    k = info["k"]
    assert (a["idx"].diff(dim=1) > 0).all()
    got = w.gather(1, a["idx"])
    assert ((a["val"].double() - got).abs() <= f16_err(got)).all()
    kth = w.topk(k, dim=1).values[:, -1:]
    assert (got >= kth).all()  # they are the top k (ties aside: none with random weights)
    # every dropped cell lies under the bound the page shows: min(block max, row's k-th)
    dropped = torch.ones_like(w, dtype=torch.bool).scatter_(1, a["idx"], False)
    bound = torch.minimum(
        a["grid"].double().repeat_interleave(b, 0).repeat_interleave(b, 1)[:nr, :S],
        a["val"].double().amin(1, keepdim=True),
    )
    assert (w[dropped] <= (bound + f16_err(bound))[dropped]).all()
    return a


def self_contained(text):
    lower = text.lower()
    for bad in (
        "http://",
        "https://",
        "//cdn",
        "fetch(",
        "xmlhttprequest",
        "import(",
        "websocket",
        "eventsource",
        "sendbeacon",
        "@import",
        "url(",
    ):
        assert bad not in lower, bad
    assert not re.search(r"\ssrc\s*=", lower)
    assert all(h.startswith("data:") for h in re.findall(r'\shref\s*=\s*"([^"]*)"', lower))


def causal_probs(H, T, S=None, seed=0, dtype=torch.float64):
    S = S or T
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(H, T, S, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)  # (H, T, S)
    return probs.to(dtype)  # a row with no key: 0, as qkv gives it


# ---------------------------------------------------------------- small pages


def test_small_page_is_self_contained_and_exact(tmp_path):
    w = causal_probs(2, 7)
    path = html(w, tmp_path / "attn", tokens=list("abcdefg"), title="seven <tokens>")
    assert path == tmp_path / "attn.html" and path.exists()
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "<title>seven &lt;tokens&gt;</title>" in text
    self_contained(text)
    for needle in (
        'id="layer"',
        'id="head"',
        'id="tab-head"',
        'id="tab-matrix"',
        'id="tab-overview"',
        'id="view-head"',
        'id="view-matrix"',
        'id="view-overview"',
        'id="matrix-canvas"',
        'id="head-canvas"',
        'id="tooltip"',
        'id="zoom-reset"',
        "window.qkvViewer",
    ):
        assert needle in text, needle
    assert 'id="tab-explain"' not in text  # no steps given, a tensor has none
    meta, blobs = read_page(path)
    (entry,) = meta["entries"]
    assert (entry["T"], entry["S"], entry["nr"], rows_of(entry)) == (7, 7, 7, list(range(7)))
    assert [h["head"] for h in entry["heads"]] == [0, 1]
    assert meta["tokens"] == [list("abcdefg")] and entry["qtok"] == [0, 0] and entry["ktok"] == 0
    for h, info in enumerate(entry["heads"]):
        assert info["mode"] == "f4"
        check_head(info, blobs[info["blob"]], w[h])


@pytest.mark.parametrize("shape", [(5, 9), (3, 5, 9), (2, 3, 5, 9)], ids=["TS", "HTS", "BHTS"])
def test_tensor_dims(tmp_path, shape):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g).softmax(-1)
    meta, blobs = read_page(html(w, tmp_path / "a.html", batch=1 if len(shape) == 4 else None))
    (entry,) = meta["entries"]
    want = w[1] if len(shape) == 4 else w.reshape(-1, 5, 9)
    assert len(entry["heads"]) == want.shape[0]
    for h, info in enumerate(entry["heads"]):
        check_head(info, blobs[info["blob"]], want[h].double())


def test_trace_and_list_of_traces(tmp_path):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_trace=True)
    meta, blobs = read_page(html([trace, trace.probs], tmp_path / "a.html", batch=1))
    first, second = meta["entries"]
    assert first["label"] == "layer 0" and second["label"] == "layer 1"
    for h, info in enumerate(first["heads"]):
        check_head(info, blobs[info["blob"]], trace.probs[1, h].double())
    meta, blobs = read_page(html({"enc": trace}, tmp_path / "b.html"))
    assert meta["entries"][0]["label"] == "enc"


def test_float16_storage_within_stated_error(tmp_path):
    w = causal_probs(1, 96, 200)  # 19,200 cells: over budget // 16 with a small budget
    meta, blobs = read_page(html(w, tmp_path / "a.html", max_cells=32768))
    info = meta["entries"][0]["heads"][0]
    assert meta["budget"] == 32768 and info["mode"] == "f2"
    check_head(info, blobs[info["blob"]], w[0])


@pytest.mark.parametrize(
    "T,S,budget",
    [(97, 1025, 8192), (300, 300, 4096), (1025, 33, 16384)],
    ids=["T97-S1025", "T300-S300", "T1025-S33"],
)
def test_over_budget_keeps_block_maxima_support_and_top_k(tmp_path, T, S, budget):
    w = causal_probs(2, T, S)
    meta, blobs = read_page(html(w, tmp_path / "a.html", max_cells=2 * budget))
    entry = meta["entries"][0]
    for h, info in enumerate(entry["heads"]):
        assert info["mode"] == "top" and info["k"] >= 1
        raw = blobs[info["blob"]]
        assert len(raw) <= 2 * budget
        check_head(info, raw, w[h])


# ---------------------------------------------------------------- captures


class Stack(torch.nn.Module):
    def __init__(self, layers=2, C=16, H=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(qkv.MultiHeadAttention(C, H) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = x + blk(x, is_causal=True)
        return x


def test_capture_rows_heads_batch_are_true_indices(tmp_path):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 10, 16)
    with qkv.capture(model, heads=[1, 3], rows=[2, 3, 4, 8], batch=[0, 2]) as cap:
        model(x)
    tokens = [f"t{i}" for i in range(10)]
    meta, blobs = read_page(html(cap, tmp_path / "a.html", tokens, batch=2))
    assert [e["label"] for e in meta["entries"]] == ["layer 0 · blocks.0", "layer 1 · blocks.1"]
    for e, rec in zip(meta["entries"], cap.records):
        assert rows_of(e) == [2, 3, 4, 8] and e["rows"] == [[2, 3], [8, 1]]
        assert [h["head"] for h in e["heads"]] == [1, 3] and (e["T"], e["S"]) == (10, 10)
        for i, info in enumerate(e["heads"]):
            check_head(info, blobs[info["blob"]], rec.probs[1, i].double())
    with pytest.raises(ValueError, match=r"batch=1 was not kept .* \[0, 2\]"):
        html(cap, tmp_path / "b.html", batch=1)
    meta, _ = read_page(html(cap.layer(1), tmp_path / "c.html"))  # a list of records
    assert [e["label"] for e in meta["entries"]] == ["layer 1 · blocks.1"]


def test_capture_of_generate_steps(tmp_path):
    torch.manual_seed(0)
    model = qkv.DecoderLM(50, 16, 2, 2).eval()
    with qkv.capture(model, rows=[-1]) as cap:
        model.generate(torch.tensor([[1, 2, 3]]), 3)
    calls = sorted({r.call for r in cap.records})
    assert len(calls) > 1
    meta, _ = read_page(html(cap, tmp_path / "a.html"))
    assert len(meta["entries"]) == 2  # call 0 of each layer
    meta, _ = read_page(
        html(cap, tmp_path / "b.html", call="all", tokens=[f"w{i}" for i in range(8)])
    )
    assert len(meta["entries"]) == len(cap.records)
    assert meta["entries"][-1]["label"].endswith(f"call {calls[-1]}")
    for e in meta["entries"]:  # keys tokens[:S], the query row end-aligned
        assert e["ktok"] == 0 and e["qtok"] == [0, e["S"] - e["T"]]
    with pytest.raises(ValueError, match=r"no record has call=9; the calls recorded are"):
        html(cap, tmp_path / "c.html", call=9)


# ---------------------------------------------------------------- tokens


def test_tokens_pair_and_escaping(tmp_path):
    w = causal_probs(1, 3, 4)
    nasty = ["</script><script>alert(1)</script>", "<!--", "\u2028"]
    path = html(w, tmp_path / "a.html", tokens=(nasty, ["k0", "k1", "k2", "k3"]))
    text = path.read_text(encoding="utf-8")
    assert text.count("</script>") == text.count("<script") == 3  # only the page's own
    assert "<!--" not in text
    meta, _ = read_page(path)
    assert meta["tokens"] == [nasty, ["k0", "k1", "k2", "k3"]]
    assert (meta["entries"][0]["qtok"], meta["entries"][0]["ktok"]) == ([0, 0], 1)
    meta, _ = read_page(html(w, tmp_path / "b.html", tokens=["q0", "q1", "q2"]))  # T only
    assert (meta["entries"][0]["qtok"], meta["entries"][0]["ktok"]) == ([0, 0], None)


def test_viewer_script_parses():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    out = subprocess.run(
        [node, "--check", str(M.resources.files("qkv.viz") / "viewer.js")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_inline_assets_cannot_end_their_element():
    for name in ("viewer.js", "viewer.css"):
        text = M._asset(name).lower()
        assert "<script" not in text and "</" not in text and "<!--" not in text, name


def test_token_errors(tmp_path):
    w = causal_probs(1, 3, 3)
    with pytest.raises(ValueError, match=r"2 tokens for T=3 queries and S=3 keys"):
        html(w, tmp_path / "a.html", tokens=["a", "b"])
    with pytest.raises(TypeError, match=r"tokens must be a list of str, got a str; split it"):
        html(w, tmp_path / "a.html", tokens="a b c")
    with pytest.raises(ValueError, match=r"need T=3 and S=3"):
        html(w, tmp_path / "a.html", tokens=(["a", "b", "c"], ["x"]))
    assert not (tmp_path / "a.html").exists()


# ---------------------------------------------------------------- steps


def test_explain_steps_in_order(tmp_path):
    steps = {
        "Q": torch.ones(3, 2),
        "scores": [[0.5, float("-inf")], [1, 2], [3, 4]],
        "softmax": torch.tensor([[1.0, 0.0], [0.25, 0.75], [0.5, 0.5]]),
    }
    path = html(causal_probs(1, 3, 2), tmp_path / "a.html", tokens=["a", "b", "c"], steps=steps)
    assert 'id="tab-explain"' in path.read_text() and 'id="view-explain"' in path.read_text()
    meta, _ = read_page(path)
    assert [s["name"] for s in meta["steps"]] == ["Q", "scores", "softmax"]
    assert meta["steps"][1]["data"] == [[0.5, "-inf"], [1.0, 2.0], [3.0, 4.0]]
    assert (meta["steps"][2]["rows"], meta["steps"][2]["cols"]) == ("q", "k")
    with pytest.raises(ValueError, match=r"at most 4096 numbers each\): pass a slice"):
        html(causal_probs(1, 3, 2), tmp_path / "b.html", steps={"V": torch.ones(100, 100)})
    with pytest.raises(TypeError, match=r"steps must be a dict"):
        html(causal_probs(1, 3, 2), tmp_path / "b.html", steps=[torch.ones(2, 2)])


def test_multihead_trace_explains_itself_when_small(tmp_path):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(8, 2, num_kv_heads=1)
    _, trace = mha(torch.randn(2, 5, 8), is_causal=True, return_trace=True)
    meta, _ = read_page(html(trace, tmp_path / "a.html", batch=1))
    steps = meta["entries"][0]["steps"]
    assert [(s["name"], s["head"]) for s in steps[:6]] == [
        ("Q", 0),
        ("K", 0),
        ("V", 0),
        ("scores", 0),
        ("softmax", 0),
        ("output", 0),
    ]
    soft = torch.tensor(steps[4]["data"])
    assert torch.allclose(soft, trace.probs[1, 0].float(), atol=1e-6)
    assert steps[3]["data"][0][1] == "-inf"  # causal mask
    meta, _ = read_page(html(trace, tmp_path / "b.html", steps={}))
    assert meta["entries"][0]["steps"] == [] and meta["steps"] == []


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "bad,err,match",
    [
        ("weights", TypeError, r"html takes a qkv.capture result.*got str"),
        ([torch.ones(2, 2), 3], TypeError, r"item 'layer 1' is a int"),
        ([], ValueError, r"empty list"),
        (torch.ones(5), ValueError, r"got shape \(5,\)"),
        (torch.ones(1, 1, 1, 2, 2) / 2, ValueError, r"fold the extra dims into B"),
        (torch.randn(2, 3, 3), ValueError, r"\[0, 1\].*not scores"),
        (torch.full((2, 2), float("nan")), ValueError, r"NaN"),
        (torch.ones(0, 3), ValueError, r"empty"),
    ],
    ids=["str", "list-int", "empty-list", "1d", "5d", "scores", "nan", "empty"],
)
def test_bad_input(tmp_path, bad, err, match):
    with pytest.raises(err, match=match):
        html(bad, tmp_path / "a.html")
    assert list(tmp_path.iterdir()) == []


def test_bad_batch_and_call(tmp_path):
    w = causal_probs(2, 3).reshape(1, 2, 3, 3)
    with pytest.raises(ValueError, match=r"batch=1 out of range for batch size 1"):
        html(w, tmp_path / "a.html", batch=1)
    with pytest.raises(ValueError, match=r"no batch dim"):
        html(w[0], tmp_path / "a.html", batch=2)
    with pytest.raises(ValueError, match=r"max_cells must be a positive int"):
        html(w, tmp_path / "a.html", max_cells=0)


# ---------------------------------------------------------------- atomic writes


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "a.html"
    path.write_text("old")

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(M.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        html(causal_probs(1, 4), path)
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]
    monkeypatch.undo()
    html(causal_probs(1, 4), tmp_path / "new" / "dir" / "b.html")
    assert (tmp_path / "new" / "dir" / "b.html").exists()
    assert len(list((tmp_path / "new" / "dir").iterdir())) == 1


# ---------------------------------------------------------------- size at 4k and 16k


def size_bound(meta, blobs):
    """The docstring's bound: 112 KiB + 400 per head + 4/3 payload + J."""
    n_heads = sum(len(e["heads"]) for e in meta["entries"])
    payload = sum(len(b) for b in blobs.values())
    labels = len(json.dumps(meta["tokens"])) + sum(
        12 * len(e["rows"]) + len(json.dumps(e["steps"])) for e in meta["entries"]
    )
    labels += len(json.dumps(meta["steps"]))
    return 112 * 1024 + 400 * n_heads + math.ceil(payload / 3) * 4 + labels


def banded(T, H, seed=0, reach=128):
    """Causal weights with a sink and a local band, (H, T, T) float16, built in row chunks.

    Only the sink (key 0) and the keys from ``reach`` before a chunk's first row on are
    computed: a key d >= 128 positions back scores at most -0.3 d + 5 below the row's own
    (-33), its weight under e^-30 rounds to 0 in float16 as the zeros written there are
    (the whole (T, T) softmax took 8 of 11 s at T = 16384)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(H, T, T, dtype=torch.float16)
    for h in range(H):
        for r0 in range(0, T, 1024):
            r1 = min(T, r0 + 1024)
            c0 = max(1, r0 - reach)  # keys c0 .. r1 - 1, and key 0 (the sink)
            c = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(c0, r1)])[None]
            r = torch.arange(r0, r1)[:, None]
            s = -(r - c).float() * (0.3 + h) + torch.randn(r1 - r0, c.shape[1], generator=g)
            s[:, 0] += 8
            probs = s.masked_fill(c > r, float("-inf")).softmax(-1).half()  # (rows, keys)
            out[h, r0:r1, 0] = probs[:, 0]
            out[h, r0:r1, c0:r1] = probs[:, 1:]
    return out


@pytest.mark.parametrize("T,H", [(4096, 2), (16384, 1)], ids=["T4096-H2", "T16384-H1"])
def test_size_bound_long(tmp_path, T, H):
    w = banded(T, H)
    t0 = time.perf_counter()
    path = html(w, tmp_path / "a.html", tokens=[f"t{i}" for i in range(T)])
    took = time.perf_counter() - t0
    meta, blobs = read_page(path)
    size = path.stat().st_size
    assert size <= size_bound(meta, blobs)
    assert size <= 3.0e6 * H + 0.4e6  # the measured sizes the docstring quotes, with room
    assert took < 30 * H, took
    for info in meta["entries"][0]["heads"]:
        assert info["mode"] == "top" and len(blobs[info["blob"]]) <= 2 * meta["budget"]
    if T == 4096:  # the full check of the stored data on one head
        check_head(meta["entries"][0]["heads"][1], blobs["qkv-blob-1"], w[1].double())


def test_size_of_a_real_capture_4_layers_4_heads_4k(tmp_path):
    torch.manual_seed(0)
    model = Stack(layers=4, C=32, H=4)
    with torch.no_grad(), qkv.capture(model, rows=range(4080, 4096)) as cap:
        model(torch.randn(1, 4096, 32))
    path = html(cap, tmp_path / "a.html", tokens=[f"t{i}" for i in range(4096)])
    meta, blobs = read_page(path)
    assert len(meta["entries"]) == 4 and all(len(e["heads"]) == 4 for e in meta["entries"])
    assert path.stat().st_size <= size_bound(meta, blobs)
    assert path.stat().st_size <= 6.0e6
    e, rec = meta["entries"][3], cap.layer(3)[0]
    assert rows_of(e) == list(range(4080, 4096))
    check_head(e["heads"][2], blobs[e["heads"][2]["blob"]], rec.probs[0, 2].double())
