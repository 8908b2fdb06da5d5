"""The offline attention viewer (``qkv.viz.html``) in a real browser.

Playwright's Python package drives Debian's Chromium (headless, a fresh profile, every
network request blocked) over pages written by ``qkv.viz.html``:

* a small real capture (a 2-layer, 4-head ``qkv.DecoderLM``, T=12, with tokens): it loads from
  ``file://`` without asking the network for anything, with no console or page error; the
  layer/head selects redraw and ``qkvViewer.state`` follows; hovering a matrix cell shows its
  true weight; a screenshot is not blank; the overview's thumbnails open their head;
* a 4096-token page (1 layer x 2 heads, causal + sliding band): ready, first matrix view and
  hover within the time bounds below (READY_LIMIT_S, HOVER_LIMIT_S), and exact after a zoom;
* a MultiHeadTrace with explain steps: the explain tab shows its numbers;
* and the harness itself: a page that does reach out is seen doing so, and blocked.

The module skips, saying why, when Playwright or a Chromium executable is missing
(``$QKV_CHROMIUM``, ``chromium`` on PATH, ``/usr/bin/chromium``; ``.ci/run`` installs Debian's
``chromium``). ``playwright install`` is never needed.

``QKV_WRITE_SCREENSHOT=1`` also saves the small page's screenshot to ``docs/viewer.png``
(the README's picture); CI leaves it unset so it does not rewrite repo files.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest
import torch

import qkv

pytest.importorskip(
    "playwright.sync_api",
    reason="the viewer's browser tests need Playwright's Python package "
    "(pip install playwright; it is in qkv[test])",
)
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright


def _find_chromium() -> str | None:
    for cand in (os.environ.get("QKV_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


CHROMIUM = _find_chromium()
if CHROMIUM is None:
    pytest.skip(
        "the viewer's browser tests need a Chromium executable: none at $QKV_CHROMIUM "
        f"({os.environ.get('QKV_CHROMIUM')!r}), `chromium` on PATH or /usr/bin/chromium "
        "(Debian: apt-get install chromium; .ci/run does this)",
        allow_module_level=True,
    )

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 960}
REPO = Path(__file__).resolve().parents[1]

# The 4096-token page (1 layer x 2 heads x 4096 x 4096 weights, 5.4 MiB) on the 2-core box
# this was written on: ready 0.4-0.9 s after goto (0.5-0.8 s with both cores kept busy by two
# other processes), first matrix view drawn in 0.3-0.5 s, a hover answered in 20-55 ms. The
# limits leave 5x (and 20x) room for a slower CI machine.
READY_LIMIT_S = 5.0  # page ready; and, separately, the first matrix view drawn
HOVER_LIMIT_S = 1.0  # mouse move -> tooltip text

L, H, T = 2, 4, 12
WORDS = ["the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "warm", "and", "soft"]
assert len(WORDS) == T


# ----------------------------------------------------------------------------- browser
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module: a fresh user-data dir, the network off."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        try:
            context = pw.chromium.launch_persistent_context(
                str(profile),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport=VIEWPORT,
                device_scale_factor=1,
            )
        except PlaywrightError as e:
            pytest.fail(f"{CHROMIUM} found but it did not start under Playwright: {e}")
        try:
            yield context
        finally:
            context.close()


class Opened:
    """A page opened on one viewer file, and everything it tried or said while open."""

    def __init__(self, context, path: Path):
        self.url = path.resolve().as_uri()
        self.page = page = context.new_page()
        self.requests: list[str] = []  # every request the page made (before routing)
        self.routed: list[str] = []  # every request that reached the route (http, file...)
        self.websockets: list[str] = []
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        page.on("request", lambda r: self.requests.append(r.url))
        # Requests the page does not report (a service worker's, another page's) reach the
        # browser context: those are counted too while this page is open.
        self.context, self._ctx_request = context, lambda r: self.ctx_requests.append(r.url)
        self.ctx_requests: list[str] = []
        context.on("request", self._ctx_request)
        page.on(
            "console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None
        )
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))

        def only_the_file(route):
            self.routed.append(route.request.url)
            if route.request.url == self.url:
                route.continue_()
            else:
                route.abort()

        page.route("**/*", only_the_file)
        if hasattr(page, "route_web_socket"):  # Playwright >= 1.48

            def no_socket(ws):
                self.websockets.append(ws.url)
                ws.close()

            page.route_web_socket("**/*", no_socket)
        page.on("websocket", lambda ws: self.websockets.append(ws.url))

    def load(self, timeout_s: float = 30.0) -> float:
        """Go to the file and wait until the viewer says it drew; seconds that took."""
        t0 = time.perf_counter()
        self.page.goto(self.url, wait_until="load", timeout=timeout_s * 1000)
        self.page.wait_for_function(
            "() => document.body && document.body.dataset.ready === '1'", timeout=timeout_s * 1000
        )
        return time.perf_counter() - t0

    def others(self) -> list[str]:
        """Requests for anything but the file itself (all blocked, none should be tried)."""
        return [
            u for u in self.requests + self.routed + self.ctx_requests if u != self.url
        ] + self.websockets

    def close(self):
        self.context.remove_listener("request", self._ctx_request)
        self.page.close()

    # -- the viewer's API
    def js(self, expr: str, arg=None):
        return self.page.evaluate(expr, arg)

    def state(self) -> dict:
        return self.js("() => ({...window.qkvViewer.state})")

    def digest(self, canvas_id: str):
        return self.js("id => window.qkvViewer.digest(id)", canvas_id)

    def wait_digest_change(self, canvas_id: str, old, timeout_s: float = 5.0):
        self.page.wait_for_function(
            "([id, old]) => window.qkvViewer.digest(id) !== old",
            arg=[canvas_id, old],
            timeout=timeout_s * 1000,
        )
        return self.digest(canvas_id)

    def active_views(self) -> list[str]:
        return self.js("() => [...document.querySelectorAll('[id^=view-].active')].map(e => e.id)")

    def tooltip(self) -> str:
        return self.js("() => document.getElementById('tooltip').textContent.trim()")

    def hover(self, q: int, k: int, timeout_s: float = 5.0) -> str:
        """Move the mouse onto matrix cell (q, k); the tooltip text it brings up."""
        c = self.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", [q, k])
        assert c is not None, f"cell ({q}, {k}) is not in the matrix view"
        x, y = round(c["x"]), round(c["y"])  # a mouse event's clientX/Y are whole pixels
        assert self.js("([x, y]) => window.qkvViewer.cellAt(x, y)", [x, y]) == {"q": q, "k": k}, (
            f"cellAt(cellCenter({q}, {k})) = cellAt({x}, {y}) is another cell"
        )
        self.page.mouse.move(x, y)
        self.page.wait_for_function(
            "p => document.getElementById('tooltip').textContent.trim().startsWith(p)",
            arg=f"q={q} k={k} ",
            timeout=timeout_s * 1000,
        )
        return self.tooltip()

    def meta(self) -> dict:
        """The page's own metadata (its ``<script id="qkv-meta">``)."""
        return self.js("() => JSON.parse(document.getElementById('qkv-meta').textContent)")

    def mode(self, layer: int, head: int) -> str:
        """How the page stores that head: "f4", "f2" (float16) or "top" (see qkv.viz.html)."""
        return self.meta()["entries"][layer]["heads"][head]["mode"]

    def to_precision4(self, v: float) -> str:
        return self.js("v => Number(v).toPrecision(4)", float(v))


@pytest.fixture
def opened(browser):
    """opened(path) -> Opened with the page loaded; every page is closed after the test."""
    pages: list[Opened] = []

    def open_(path: Path, *, load: bool = True) -> Opened:
        o = Opened(browser, path)
        pages.append(o)
        if load:
            o.load()
        return o

    yield open_
    for o in pages:
        o.close()


def _write(obj, path: Path, **kw) -> Path:
    from qkv.viz import html

    html(obj, path, **kw)
    assert path.is_file() and path.stat().st_size > 0
    return path


# ----------------------------------------------------------------------------- pages
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-layer x 4-head DecoderLM's capture on 12 tokens, its page and its true weights."""
    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    model = qkv.DecoderLM(len(vocab), 32, H, L, max_len=16).eval()
    ids = torch.tensor([[vocab[w] for w in WORDS]])
    with torch.no_grad(), qkv.capture(model) as cap:
        model(ids)
    probs = torch.stack([cap.layer(i)[0].probs[0] for i in range(L)])  # (L, H, T, T)
    assert probs.shape == (L, H, T, T)
    path = _write(
        cap,
        tmp_path_factory.mktemp("small") / "viewer.html",
        tokens=WORDS,
        title="DecoderLM, 2 layers x 4 heads",
    )
    return path, probs.double()


def _banded(H_: int, T_: int, windows=(64, 512), seed=0) -> torch.Tensor:
    """(H, T, T) weights: causal, each head a sliding band of its window, random inside."""
    g = torch.Generator().manual_seed(seed)
    q = torch.arange(T_)[:, None]
    k = torch.arange(T_)[None, :]
    out = torch.empty(H_, T_, T_)
    for h in range(H_):
        allowed = (k <= q) & (q - k < windows[h % len(windows)])
        scores = torch.randn(T_, T_, generator=g) * 2.0
        out[h] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 4096-token page: 1 layer x 2 heads of banded causal weights."""
    w = _banded(2, 4096)
    t0 = time.perf_counter()
    path = _write(w, tmp_path_factory.mktemp("big") / "viewer4k.html", title="T=4096")
    written_s = time.perf_counter() - t0
    return path, w, written_s


# ----------------------------------------------------------------------------- values
TOOLTIP = re.compile(r"q=(\d+) k=(\d+) w(=|≤)(\S+)")


def _half(v: float) -> float:
    """``v`` (a float32 weight) rounded to float16 as the page stores it (round to nearest)."""
    return float(torch.tensor(v, dtype=torch.float32).half())


def _check_tooltip(
    o: Opened, text: str, q: int, k: int, true: float, *, layer: int, head: int, where: str
) -> str:
    """The tooltip ``text`` of cell (q, k) against its true weight ``true``, under the storage
    the page states for that head (qkv.viz.html's docstring; its ``qkv-meta``):

    * "f4": float32, the capture's own dtype: ``w=`` is ``toPrecision(4)`` of the true weight.
    * "f2", or a "top" cell that is stored (among its row's k largest): float16 rounded to
      nearest, ``|stored - w| <= max(|w| 2**-11, 2**-25)``; ``w=`` is ``toPrecision(4)`` of
      exactly that float16.
    * a "top" cell not stored: ``w≤bound`` with ``w <= bound`` (the bound is a float16 of a
      block max or of the row's k-th weight, so up to that rounding).

    Returns which of "=" / "≤" the tooltip showed."""
    m = TOOLTIP.fullmatch(text)
    assert m, f"{where}: tooltip {text!r} is not 'q=<i> k=<j> w=<value>'"
    assert (int(m[1]), int(m[2])) == (q, k), f"{where}: tooltip {text!r} for cell ({q}, {k})"
    mode = o.mode(layer, head)
    shown = o.js("([l, h, q, k]) => window.qkvViewer.value(l, h, q, k)", [layer, head, q, k])
    exact = o.js("([l, h, q, k]) => window.qkvViewer.exact(l, h, q, k)", [layer, head, q, k])
    assert m[4] == o.to_precision4(shown), f"{where}: tooltip {text!r}, value() = {shown!r}"
    if m[3] == "≤":
        assert mode == "top" and not exact, f"{where}: a bound shown for a stored cell ({mode})"
        assert true <= shown * (1 + 2**-11) + 2**-25, (
            f"{where}: the true weight {true!r} is above the bound shown, {shown!r}"
        )
        return "≤"
    assert exact, f"{where}: w= shown for a cell exact() says is not stored"
    stored = true if mode == "f4" else _half(true)
    assert abs(stored - true) <= max(abs(true) * 2**-11, 2**-25)
    assert shown == stored, f"{where}: value() {shown!r}, stored weight {stored!r} ({mode})"
    assert m[4] == o.to_precision4(stored), (
        f"{where}: tooltip says w={m[4]}, the true weight is {true!r} ({mode}: "
        f"toPrecision(4) of {stored!r} is {o.to_precision4(stored)})"
    )
    return "="


def drag_zoom(o: Opened, corner0: tuple[int, int], corner1: tuple[int, int]) -> None:
    """Zoom the matrix by dragging a rectangle from cell ``corner0`` to cell ``corner1``
    (``(q, k)`` each), as a user does."""
    a = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", list(corner0))
    b = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", list(corner1))
    assert a is not None and b is not None, "the zoom corners are not in the matrix view"
    before = o.digest("matrix-canvas")
    o.page.mouse.move(round(a["x"]), round(a["y"]))
    o.page.mouse.down()
    o.page.mouse.move(round((a["x"] + b["x"]) / 2), round((a["y"] + b["y"]) / 2), steps=3)
    o.page.mouse.move(round(b["x"]), round(b["y"]), steps=3)
    o.page.mouse.up()
    o.wait_digest_change("matrix-canvas", before)


def cell_px(o: Opened, q: int, k: int) -> float:
    """Width in client pixels of cell (q, k) in the current matrix view."""
    a = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", [q, k])
    b = o.js("([q, k]) => window.qkvViewer.cellCenter(q, k)", [q, k + 1])
    return b["x"] - a["x"]


# ----------------------------------------------------------------------------- PNG
def _png_rgb(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(width, height, RGB pixels) of an 8-bit non-interlaced PNG (what Chromium writes).

    Pillow when it is there (matplotlib brings it), else this small decoder."""
    try:
        from PIL import Image
    except ImportError:
        return _png_rgb_zlib(data)
    import io

    im = Image.open(io.BytesIO(data)).convert("RGB")
    b = im.tobytes()
    return im.width, im.height, list(zip(b[0::3], b[1::3], b[2::3]))


def _png_rgb_zlib(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    w, h, depth, color, _, _, interlace = hdr
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {hdr}"
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    prev, pixels, i = bytearray(stride), [], 0
    for _ in range(h):
        ftype, line = raw[i], bytearray(raw[i + 1 : i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if ftype == 1:
                line[x] = (line[x] + a) & 255
            elif ftype == 2:
                line[x] = (line[x] + b) & 255
            elif ftype == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        pixels += [tuple(line[x : x + 3]) for x in range(0, stride, bpp)]
        prev = line
    return w, h, pixels


# ----------------------------------------------------------------------------- tests
def _quiet(o: Opened) -> None:
    """Nothing but the file was asked for, and nothing went wrong in the page."""
    assert o.others() == [], f"requests besides the file (all blocked): {o.others()}"
    assert o.console_errors == [], f"console errors: {o.console_errors}"
    assert o.page_errors == [], f"page errors: {o.page_errors}"


def test_the_harness_sees_and_blocks_requests(tmp_path, opened):
    """What the viewer tests count on: a page that reaches out is seen doing so, and blocked."""
    page = tmp_path / "leaky.html"
    page.write_text(
        "<!doctype html><html><head><link rel='stylesheet' href='https://example.com"
        "/a.css'></head><body><img src='other.png'><script>fetch('http://127.0.0.1:9"
        "/x').then(() => { document.title = 'reached'; }, () => {});"
        "document.body.dataset.ready = '1';</script></body></html>"
    )
    o = opened(page)
    wanted = {
        "https://example.com/a.css",
        (tmp_path / "other.png").as_uri(),
        "http://127.0.0.1:9/x",
    }
    deadline = time.monotonic() + 5
    while not wanted <= set(o.others()) and time.monotonic() < deadline:
        o.page.wait_for_timeout(50)
    assert wanted <= set(o.others()), o.others()
    assert o.page.title() != "reached"
    assert o.console_errors  # each blocked load says so on the console


def test_small_page_loads_offline_with_no_error(small, opened):
    path, probs = small
    o = opened(path)
    assert o.requests == [o.url] and o.ctx_requests == [o.url]
    assert o.routed == [o.url]  # the route saw the file, and nothing else to block
    _quiet(o)

    layers = o.js("() => [...document.querySelectorAll('#layer option')].map(e => e.value)")
    heads = o.js("() => [...document.querySelectorAll('#head option')].map(e => e.value)")
    assert layers == [str(i) for i in range(L)]
    assert heads == ["all"] + [str(h) for h in range(H)]
    for tab in ("#tab-head", "#tab-matrix", "#tab-overview"):
        assert o.page.locator(tab).count() == 1, tab
    assert o.page.locator("#tab-explain").count() == 0  # no steps for a capture
    assert o.active_views() == ["view-head"] and o.state()["view"] == "head"
    assert o.page.title() == "DecoderLM, 2 layers x 4 heads"
    # 144 cells a head: stored as float32, the capture's dtype (qkv.viz.html: "f4").
    assert [[hd["mode"] for hd in e["heads"]] for e in o.meta()["entries"]] == [["f4"] * H] * L

    # Every weight the page holds is exactly the capture's.
    got = torch.tensor(
        o.js(
            "([L, H, T]) => { const v = window.qkvViewer, out = [];"
            "  for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) for (let q = 0; q < T; q++)"
            "    for (let k = 0; k < T; k++) out.push(v.value(l, h, q, k)); return out; }",
            [L, H, T],
        ),
        dtype=torch.float64,
    ).view(L, H, T, T)
    assert torch.equal(got, probs), (got - probs).abs().max()
    assert o.meta()["tokens"] == [WORDS]  # the head view's labels
    _quiet(o)


def test_layer_and_head_selects_redraw_and_state_follows(small, opened):
    path, _probs = small
    o = opened(path)
    o.page.click("#tab-matrix")
    assert o.active_views() == ["view-matrix"] and o.state()["view"] == "matrix"
    o.page.select_option("#layer", "0")
    o.page.select_option("#head", "0")
    assert (o.state()["layer"], o.state()["head"]) == (0, 0)
    d00 = o.digest("matrix-canvas")

    o.page.select_option("#layer", "1")
    d10 = o.wait_digest_change("matrix-canvas", d00)
    assert (o.state()["layer"], o.state()["head"]) == (1, 0)
    o.page.select_option("#head", "3")
    d13 = o.wait_digest_change("matrix-canvas", d10)
    assert (o.state()["layer"], o.state()["head"]) == (1, 3)
    assert len({d00, d10, d13}) == 3
    # "all" in the matrix view shows head 0 (qkv.viz.html): layer 1 head 0's pixels again.
    o.page.select_option("#head", "all")
    assert o.state()["head"] == "all"
    assert o.wait_digest_change("matrix-canvas", d13) == d10
    # Drawing is a function of the state: back to layer 0 head 0 draws the same pixels.
    o.page.select_option("#layer", "0")
    o.page.select_option("#head", "0")
    assert (o.state()["layer"], o.state()["head"]) == (0, 0)
    assert o.wait_digest_change("matrix-canvas", d10) == d00
    # The API moves the selects too.
    o.js("() => { window.qkvViewer.setLayer(1); window.qkvViewer.setHead(2); }")
    assert (o.state()["layer"], o.state()["head"]) == (1, 2)
    assert o.page.input_value("#layer") == "1" and o.page.input_value("#head") == "2"
    assert o.digest("matrix-canvas") not in (d00, d10, d13)

    o.page.click("#tab-head")
    assert o.active_views() == ["view-head"] and o.state()["view"] == "head"
    h12 = o.digest("head-canvas")
    o.page.select_option("#layer", "0")
    h02 = o.wait_digest_change("head-canvas", h12)
    o.page.select_option("#head", "1")
    h01 = o.wait_digest_change("head-canvas", h02)
    o.page.select_option("#head", "all")
    hall = o.wait_digest_change("head-canvas", h01)
    assert (o.state()["layer"], o.state()["head"], o.state()["view"]) == (0, "all", "head")
    assert len({h12, h02, h01, hall}) == 4
    _quiet(o)


@pytest.mark.parametrize("layer, head", [(0, 0), (1, 2)])
def test_hovering_a_matrix_cell_shows_its_true_weight(small, opened, layer, head):
    path, probs = small
    o = opened(path)
    o.page.click("#tab-matrix")
    o.js(
        "([l, h]) => { window.qkvViewer.setLayer(l); window.qkvViewer.setHead(h); }", [layer, head]
    )
    cells = [(0, 0), (1, 0), (5, 3), (7, 2), (11, 0), (11, 6), (11, 11), (3, 9)]
    assert probs[layer, head, 3, 9] == 0  # causal: a masked cell
    for q, k in cells:
        text = o.hover(q, k)
        assert text.startswith(f"q={q} k={k} w=")
        _check_tooltip(
            o,
            text,
            q,
            k,
            float(probs[layer, head, q, k]),
            layer=layer,
            head=head,
            where=f"layer {layer} head {head}",
        )
    # Off the matrix: no cell.
    box = o.page.locator("#matrix-canvas").bounding_box()
    assert (
        o.js(
            "([x, y]) => window.qkvViewer.cellAt(x, y)",
            [box["x"] + box["width"] + 40, box["y"] + box["height"] / 2],
        )
        is None
    )
    _quiet(o)


def test_screenshot_is_not_blank(small, opened):
    path, probs = small
    o = opened(path)
    o.page.click("#tab-matrix")
    o.js("() => { window.qkvViewer.setLayer(1); window.qkvViewer.setHead(2); }")
    _check_tooltip(
        o, o.hover(9, 4), 9, 4, float(probs[1, 2, 9, 4]), layer=1, head=2, where="screenshot"
    )  # the picture shows a tooltip
    png = o.page.screenshot(type="png")
    w, h, pixels = _png_rgb(png)
    assert (w, h) == (VIEWPORT["width"], VIEWPORT["height"])
    counts: dict = {}
    for p in pixels:
        counts[p] = counts.get(p, 0) + 1
    background = max(counts.values())
    assert len(counts) >= 100, f"only {len(counts)} distinct colours in the screenshot"
    assert w * h - background >= 0.05 * w * h, "95% of the screenshot is one colour"

    # The matrix canvas alone: a colour scale over 12 x 12 cells, not one flat fill.
    canvas = o.page.locator("#matrix-canvas")
    box = canvas.bounding_box()
    assert box["width"] >= 100 and box["height"] >= 100, box
    _, _, cells = _png_rgb(canvas.screenshot(type="png"))
    assert len(set(cells)) >= 20, f"the matrix canvas has {len(set(cells))} colours"

    # The fallback decoder (no Pillow) reads Chromium's PNGs as Pillow does.
    clip = {"x": box["x"], "y": box["y"], "width": 96, "height": 64}
    piece = o.page.screenshot(type="png", clip=clip)
    try:
        import PIL  # noqa: F401
    except ImportError:
        pass
    else:
        assert _png_rgb_zlib(piece) == _png_rgb(piece)

    if os.environ.get("QKV_WRITE_SCREENSHOT") == "1":
        out = REPO / "docs" / "viewer.png"
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(png)
    _quiet(o)


def test_4k_page_is_interactive_in_time(big, opened):
    path, w, written_s = big
    o = opened(path, load=False)
    ready_s = o.load(timeout_s=60)
    _quiet(o)
    print(
        f"\n4k page: {path.stat().st_size / 2**20:.1f} MiB written in {written_s:.1f} s, "
        f"ready in {ready_s:.2f} s"
    )
    assert ready_s < READY_LIMIT_S, f"4096-token page ready in {ready_s:.1f} s"
    # 2 x 4096 x 4096 cells: stored as block maxima + each row's top k (qkv.viz.html "top").
    assert [hd["mode"] for hd in o.meta()["entries"][0]["heads"]] == ["top", "top"]

    # The first matrix view decodes the head and draws 4096 x 4096 cells.
    t0 = time.perf_counter()
    o.page.click("#tab-matrix")
    o.page.wait_for_function("() => window.qkvViewer.state.view === 'matrix'")
    o.js("() => window.qkvViewer.setHead(0)")  # redraws before it returns
    matrix_s = time.perf_counter() - t0
    print(f"4k page: matrix view drawn in {matrix_s:.2f} s")
    assert matrix_s < READY_LIMIT_S, f"4096-token matrix view drawn in {matrix_s:.1f} s"
    assert o.state() == {"layer": 0, "head": 0, "view": "matrix"}
    assert cell_px(o, 2000, 2000) < 1  # unzoomed, many cells a pixel
    # Unzoomed, the hover answers for whichever cell is under the pointer, in time.
    box = o.page.locator("#matrix-canvas").bounding_box()
    x, y = round(box["x"] + box["width"] * 0.6), round(box["y"] + box["height"] * 0.7)
    t0 = time.perf_counter()
    o.page.mouse.move(x, y)
    o.page.wait_for_function(
        "() => /^q=\\d+ k=\\d+ w/.test(document.getElementById('tooltip').textContent.trim())",
        timeout=10_000,
    )
    hover_s = time.perf_counter() - t0
    cell = o.js("([x, y]) => window.qkvViewer.cellAt(x, y)", [x, y])
    _check_tooltip(
        o,
        o.tooltip(),
        cell["q"],
        cell["k"],
        float(w[0, cell["q"], cell["k"]]),
        layer=0,
        head=0,
        where=f"unzoomed {cell}",
    )
    print(f"4k page: first hover answered in {hover_s * 1000:.0f} ms")
    assert hover_s < HOVER_LIMIT_S, f"hover answered in {hover_s:.2f} s"
    whole = o.digest("matrix-canvas")

    # Zoom in by dragging a rectangle: cells become big enough to aim at.
    drag_zoom(o, (2925, 2925), (3005, 3005))
    assert cell_px(o, 3000, 2950) >= 4, cell_px(o, 3000, 2950)
    # Head 0's band is 64 keys wide: every weight of a row is among its 64 largest, stored
    # exactly (float16); outside the band, outside the row's support, exact zeros.
    for q, k, how in [
        (3000, 3000, "="),
        (3000, 2950, "="),
        (3000, 2937, "="),
        (2990, 2960, "="),
        (3000, 2936, "="),
        (2997, 2999, "="),
    ]:
        t0 = time.perf_counter()
        text = o.hover(q, k)
        hover_s = time.perf_counter() - t0
        assert (
            _check_tooltip(o, text, q, k, float(w[0, q, k]), layer=0, head=0, where="head 0 zoomed")
            == how
        ), text
        assert hover_s < HOVER_LIMIT_S, f"zoomed hover on ({q}, {k}) took {hover_s:.2f} s"
    assert w[0, 3000, 2936] == 0 and w[0, 2997, 2999] == 0  # outside the band; causal
    # Head 1's band is 512 wide: its 64 largest weights a row are exact, the rest bounded.
    o.js("() => window.qkvViewer.setHead(1)")
    if o.js("() => window.qkvViewer.cellCenter(3000, 2950)") is None:  # the zoom was reset
        drag_zoom(o, (2925, 2925), (3005, 3005))
    shown = [
        _check_tooltip(
            o,
            o.hover(3000, k),
            3000,
            k,
            float(w[1, 3000, k]),
            layer=0,
            head=1,
            where="head 1 zoomed",
        )
        for k in range(2940, 3001, 3)
    ]
    assert "=" in shown and "≤" in shown, shown
    assert (
        _check_tooltip(
            o, o.hover(2997, 2999), 2997, 2999, 0.0, layer=0, head=1, where="head 1 zoomed, causal"
        )
        == "="
    )
    zoomed = o.digest("matrix-canvas")
    o.page.click("#zoom-reset")
    o.wait_digest_change("matrix-canvas", zoomed)
    assert cell_px(o, 2000, 2000) < 1
    o.js("() => window.qkvViewer.setHead(0)")
    assert o.digest("matrix-canvas") == whole
    _quiet(o)


def test_overview_thumbnail_opens_its_head_in_the_matrix(small, opened):
    path, probs = small
    o = opened(path)
    o.js("() => window.qkvViewer.setLayer(1)")
    o.page.click("#tab-overview")
    assert o.active_views() == ["view-overview"] and o.state()["view"] == "overview"
    thumbs = o.page.locator("canvas.thumb")
    assert thumbs.count() == H
    assert [thumbs.nth(i).get_attribute("data-head") for i in range(H)] == [
        str(h) for h in range(H)
    ]
    o.page.click("canvas.thumb[data-head='2']")
    o.page.wait_for_function("() => window.qkvViewer.state.view === 'matrix'", timeout=5000)
    assert o.active_views() == ["view-matrix"]
    assert (o.state()["layer"], o.state()["head"]) == (1, 2)
    assert o.page.input_value("#head") == "2"
    _check_tooltip(
        o,
        o.hover(6, 2),
        6,
        2,
        float(probs[1, 2, 6, 2]),
        layer=1,
        head=2,
        where="after the thumbnail",
    )
    _quiet(o)


def _close_to_4(text: str, true: float, where: str) -> None:
    """``text`` is ``true`` to 4 significant digits (half a unit of the 4th digit, and a
    millionth more: the page keeps explain numbers to 6 digits before it writes 4)."""
    shown = float(text)
    unit = 10.0 ** (math.floor(math.log10(abs(true))) - 3) if true else 0.0
    assert abs(shown - true) <= 0.5 * unit + 1e-6 * abs(true) + 1e-300, (
        f"{where}: shown {text}, true {true!r}"
    )
    assert re.fullmatch(r"-?\d\.\d{3}(e[+-]\d+)?|-?0\.0*\d{4}|-?\d+\.\d+|0\.000", text), text


def _explain_tables(o: Opened) -> dict[str, list[list[str]]]:
    """Explain view: step name (the h3's first word) -> its table's cell texts, row by row."""
    return o.js("""() => Object.fromEntries([...document.querySelectorAll('#view-explain .step')]
        .map(s => [s.querySelector('h3').textContent.trim().split(/\\s+/)[0],
                   [...s.querySelectorAll('table tr')].slice(1)
                     .map(tr => [...tr.querySelectorAll('td')].map(td => td.textContent))]))""")


def test_explain_tab_shows_the_steps_numbers(tmp_path, opened):
    torch.manual_seed(0)
    words = ["I", "love", "attention", "a", "lot"]
    mha = qkv.MultiHeadAttention(8, 2).double().eval()
    with torch.no_grad():
        _, trace = mha(torch.randn(1, 5, 8, dtype=torch.float64), is_causal=True, return_trace=True)
    assert isinstance(trace, qkv.trace.MultiHeadTrace) and trace.probs.shape == (1, 2, 5, 5)

    # A small MultiHeadTrace explains itself: Q, K, V, scores, softmax, output per head.
    o = opened(_write(trace, tmp_path / "explain.html", tokens=words))
    _quiet(o)
    assert o.page.locator("#tab-explain").count() == 1
    o.page.click("#tab-explain")
    assert o.active_views() == ["view-explain"] and o.state()["view"] == "explain"
    for head in (0, 1):
        o.js("h => window.qkvViewer.setHead(h)", head)
        tables = _explain_tables(o)
        assert list(tables) == ["Q", "K", "V", "scores", "softmax", "output"], list(tables)
        truth = {
            "Q": trace.q[0, head],
            "K": trace.k[0, head],
            "V": trace.v[0, head],
            "scores": trace.scores[0, head],
            "softmax": trace.probs[0, head],
            "output": trace.heads[0, head],
        }
        for name, t in truth.items():
            assert [len(r) for r in tables[name]] == [t.shape[1]] * t.shape[0], name
            for i, row in enumerate(tables[name]):
                for j, text in enumerate(row):
                    v = float(t[i, j])
                    if v == float("-inf"):
                        assert text == "\u2212\u221e", (name, i, j, text)  # causal: masked scores
                    else:
                        _close_to_4(text, v, f"head {head} {name}[{i}, {j}]")
        assert tables["scores"][0][1] == "\u2212\u221e" and tables["softmax"][0][1] == "0.000"
    # The row labels are the tokens.
    assert (
        o.js(
            "() => [...document.querySelectorAll('#view-explain .step')][4]"
            ".querySelectorAll('tr')[2].querySelector('th').textContent"
        )
        == "love"
    )
    _quiet(o)

    # Steps given by the caller: their tables, in the order given; {} shows none.
    w = trace.probs[0]  # (2, 5, 5)
    given = {"weights of head 1": w[1], "scores of head 1": trace.scores[0, 1].clamp(min=-99)}
    o2 = opened(_write(w, tmp_path / "given.html", steps=given))
    o2.page.click("#tab-explain")
    titles = o2.js(
        "() => [...document.querySelectorAll('#view-explain .step h3')].map(h => h.textContent)"
    )
    assert [t.split("  (")[0] for t in titles] == list(given), titles
    cells = o2.js(
        "() => [...document.querySelector('#view-explain .step')"
        ".querySelectorAll('td')].map(td => td.textContent)"
    )
    assert len(cells) == 25
    for text, v in zip(cells, w[1].reshape(-1).tolist()):
        _close_to_4(text, v, "given weights")
    _quiet(o2)
    o3 = opened(_write(trace, tmp_path / "none.html", steps={}))
    assert o3.page.locator("#tab-explain").count() == 0
    _quiet(o3)
