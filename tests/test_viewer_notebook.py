"""The viewer inline in Jupyter (issue 27, item 1): ``_repr_html_`` of traces and captures, and
``qkv.viz.show``.

* Without a kernel: the iframe's ``srcdoc`` is the very page ``qkv.viz.html`` writes (same
  budgets), nothing sits outside the iframe, a bare display of a huge lazy trace says so
  instead of computing it, and ``import qkv`` still loads no viz.
* With one: a notebook built here runs in a real ipykernel (the venv's Python, through a
  kernelspec written to a temporary folder; the user's Jupyter and IPython folders are
  pointed at temporary ones too) under nbclient. It displays a capture, a MultiHeadTrace and
  a ``qkv.viz.show(trace, tokens=..., title=...)``. Their saved output HTML, put in one page,
  loads in headless Chromium with the harness of ``test_viewer_browser.py`` (every request but
  the file blocked and counted). Checked: no console or page error and no request; each
  iframe's ``window.qkvViewer.value`` equals the kernel's weights; a view changed in one
  iframe leaves the others as they were; nothing (id, global) reaches the notebook's page.

Skips, saying why, without nbclient/nbformat/ipykernel (``qkv[test]``), Playwright or Chromium.
"""

from __future__ import annotations

import html
import json
import re
import sys
import textwrap
import time
from html.parser import HTMLParser
from pathlib import Path

import fresh
import pytest
import torch

import qkv

SRCDOC = re.compile(r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts" [^>]*></iframe>', re.S)


def _page_of(output_html: str) -> str:
    m = SRCDOC.fullmatch(output_html)
    assert m, f"not one sandboxed iframe: {output_html[:200]!r}"
    return html.unescape(m.group(1))


class _Tags(HTMLParser):
    """Every tag of a fragment, as (tag, attrs); srcdoc is an attribute, so its page is not
    parsed: what is found is what sits in the notebook's own document."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _trace(seed: int, H: int = 3, T: int = 4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, 8, generator=g) for _ in range(3))  # (B, H, T, D)
    return qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_trace=True)[1]


# ----------------------------------------------------------------------------- no kernel
def test_iframe_holds_the_file_page_and_nothing_else(tmp_path):
    trace = _trace(0)
    out = trace._repr_html_()
    qkv.viz.html(trace, tmp_path / "a.html", max_cells=1 << 22)  # show's default budget
    assert _page_of(out) == (tmp_path / "a.html").read_text(encoding="utf-8")
    assert [t for t, _ in _Tags(out).tags] == ["iframe"]  # no script, style or id outside
    shown = qkv.viz.show(trace, ["a", "b", "c", "d"], title='a "quoted" <title>', height=500)
    out = shown._repr_html_()
    ((_tag, attrs),) = _Tags(out).tags
    assert attrs["sandbox"] == "allow-scripts" and "height: 500px" in attrs["style"]
    assert attrs["title"] == 'qkv viewer: a "quoted" <title>'
    assert (
        _page_of(out) == shown.page
        and "<title>a &quot;quoted&quot; &lt;title&gt;</title>" in shown.page
    )


def test_bad_sizes_and_a_path_are_refused():
    trace = _trace(0)
    with pytest.raises(ValueError, match="height must be a positive int"):
        qkv.viz.show(trace, height=0)
    with pytest.raises(ValueError, match="width must be"):
        qkv.viz.show(trace, width="")
    with pytest.raises(TypeError, match="show takes no path"):
        qkv.viz.show(trace, path="a.html")


def test_bare_display_of_a_huge_trace_says_so_without_computing_it():
    def never():
        raise AssertionError("the weights were computed")

    T = 8192
    lse = torch.zeros(1, 2, T)  # (B, H, T)
    probs_row = torch.full((1, 1, 1, T), 1 / T)  # (nb, nh, nr, S)
    huge = qkv.AttentionTrace(
        never, never, lse, "tiled", subset=lambda b, h, r: (probs_row, probs_row)
    )
    out = huge._repr_html_()
    assert "iframe" not in out and "not drawn" in out and f"{2 * T * T:,} weights" in out
    empty = qkv.Captured()._repr_html_()  # nothing to show: a note, not a traceback
    assert "iframe" not in empty and "cannot show this" in empty


def test_import_qkv_loads_no_viz():
    code = textwrap.dedent("""
        import sys, qkv
        print("qkv.viz" in sys.modules, hasattr(qkv.AttentionTrace, "_repr_html_"),
              hasattr(qkv.Captured, "_repr_html_"))
    """)
    out = fresh.run(code, timeout=120, check=True).stdout  # this process imported qkv.viz
    assert out.split() == ["False", "True", "True"]


# ----------------------------------------------------------------------------- a real notebook
SETUP = """\
import sys, torch, qkv
torch.manual_seed(0)
lm = qkv.DecoderLM(20, 16, 2, 2, max_len=16).eval()        # 2 layers x 2 heads
with torch.no_grad(), qkv.capture(lm) as cap:
    lm(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))              # T = 7
with torch.no_grad():
    _, mh = qkv.MultiHeadAttention(16, 4).eval()(torch.randn(1, 5, 16), return_trace=True)
q, k, v = (torch.randn(1, 3, 4, 8) for _ in range(3))        # (B, H, T, D)
_, tr = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_trace=True)
torch.save({"cap": torch.stack([cap.layer(i)[0].probs[0] for i in range(2)]),
            "mh": mh.probs[:1], "tr": tr.probs[:1]}, "truth.pt")
print(sys.executable)
print("viz imported:", "qkv.viz" in sys.modules)
"""
CELLS = [SETUP, "cap", "mh", 'qkv.viz.show(tr, tokens=["a", "b", "c", "d"], title="shown")']
KERNEL = "qkv-test-venv"


def _run_notebook(folder: Path, monkeypatch) -> tuple[list[str], str]:
    """Run CELLS in an ipykernel of this Python; the display cells' HTML and the first's print."""
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (in qkv[test])")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (in qkv[test])")
    pytest.importorskip("ipykernel", reason="needs ipykernel (in qkv[test])")

    jupyter = folder / "jupyter"
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ):
        monkeypatch.setenv(var, str(jupyter / sub))  # the user's stay untouched
    spec = jupyter / "data" / "kernels" / KERNEL  # found first: the user data dir is ours
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "qkv tests (this Python)",
                "language": "python",
            }
        )
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = nbclient.NotebookClient(
        nb,
        timeout=60,
        startup_timeout=60,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(folder)}},
    )
    client.execute()  # starts the kernel, runs every cell, shuts the kernel down
    nbformat.write(nb, folder / "run.ipynb")
    printed = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    shown = []
    for cell in nb.cells[1:]:
        (out,) = [o for o in cell.outputs if o.output_type == "execute_result"]
        shown.append(out.data["text/html"])
    return shown, printed


_IN_PROCESS_FRAMES = "--disable-features=IsolateSandboxedIframes"


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A headless Chromium as test_viewer_browser.py launches it (skips as it does), with
    sandboxed iframes kept in the page's process: Chromium otherwise gives each its own
    (IsolateSandboxedIframes), whose requests Playwright neither reports nor routes (seen with
    Chromium 156: an image in a sandboxed srcdoc frame went to the network unseen)."""
    import test_viewer_browser as harness  # skips, saying why, without Playwright or Chromium

    with harness.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=harness.CHROMIUM,
            headless=True,
            args=harness.CHROMIUM_ARGS + [_IN_PROCESS_FRAMES],
            viewport=harness.VIEWPORT,
            device_scale_factor=1,
        )
        try:
            yield harness, context
        finally:
            context.close()


def _notebook_page(path: Path, outputs: list[str]) -> Path:
    cells = "\n".join(f'<div class="output">{o}</div>' for o in outputs)
    path.write_text(
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>outputs</title>'
        f'<link rel="icon" href="data:,"></head><body>{cells}</body></html>',
        encoding="utf-8",
    )
    return path


def _values(frame, L: int, H: int, T: int, S: int) -> torch.Tensor:
    got = frame.evaluate(
        "([L, H, T, S]) => { const v = window.qkvViewer, out = [];"
        "  for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) for (let q = 0; q < T; q++)"
        "    for (let k = 0; k < S; k++) out.push(v.value(l, h, q, k)); return out; }",
        [L, H, T, S],
    )
    return torch.tensor(got, dtype=torch.float64).view(L, H, T, S)


def test_notebook_outputs_show_their_weights_in_chromium(tmp_path, monkeypatch, chromium):
    t0 = time.perf_counter()
    outputs, printed = _run_notebook(tmp_path, monkeypatch)
    t_kernel = time.perf_counter() - t0
    # The kernel ran this Python, and the display hooks (not the setup) imported viz.
    assert printed == f"{sys.executable}\nviz imported: False\n"
    for out in outputs:
        ((tag, attrs),) = _Tags(out).tags  # one iframe, nothing else in the notebook's page
        assert tag == "iframe" and attrs["sandbox"] == "allow-scripts", attrs
    truth = torch.load(tmp_path / "truth.pt")
    want = [truth["cap"].double(), truth["mh"].double(), truth["tr"].double()]  # (L, H, T, S)

    harness, context = chromium
    o = harness.Opened(context, _notebook_page(tmp_path / "outputs.html", outputs))
    try:
        o.page.goto(o.url, wait_until="load", timeout=30_000)
        frames = [
            o.page.locator("iframe").nth(i).element_handle().content_frame()
            for i in range(len(outputs))
        ]
        for f in frames:
            f.wait_for_function(
                "() => document.body && document.body.dataset.ready === '1'", timeout=30_000
            )
        for f, w in zip(frames, want):
            assert torch.equal(_values(f, *w.shape), w)
        assert frames[2].evaluate("() => document.title") == "shown"
        assert frames[2].evaluate(
            "() => JSON.parse(document.getElementById('qkv-meta').textContent).tokens"
        ) == [["a", "b", "c", "d"]]

        # One view changed leaves the others as they were: each iframe has its own state.
        fresh = {"layer": 0, "head": "all", "view": "head"}
        state = "() => ({...window.qkvViewer.state})"
        assert [f.evaluate(state) for f in frames] == [fresh] * 3
        frames[0].evaluate(
            "() => { const v = window.qkvViewer; v.setView('matrix');"
            " v.setLayer(1); v.setHead(1); }"
        )
        assert frames[0].evaluate(state) == {"layer": 1, "head": 1, "view": "matrix"}
        assert [f.evaluate(state) for f in frames[1:]] == [fresh] * 2
        for f, w in zip(frames, want):
            assert torch.equal(_values(f, *w.shape), w)

        # Nothing reaches the notebook's page: no id, script or global of the viewer's, and
        # the sandboxed page cannot reach out of its frame.
        assert o.js(
            "() => [typeof window.qkvViewer, document.querySelectorAll('[id]').length,"
            " document.scripts.length]"
        ) == ["undefined", 0, 0]
        assert (
            frames[0].evaluate(
                "() => { try { return window.parent.document.title; }"
                " catch (e) { return e.name; } }"
            )
            == "SecurityError"
        )
        harness._quiet(o)
    finally:
        o.close()
    print(
        f"kernel and notebook {t_kernel:.1f} s, browser {time.perf_counter() - t0 - t_kernel:.1f} s"
    )


def test_the_harness_sees_what_a_sandboxed_frame_does(tmp_path, chromium):
    """What the test above counts on: the requests and errors of a sandboxed srcdoc iframe
    reach the page's counters, and its requests are blocked."""
    harness, context = chromium
    inner = (
        "<link rel='stylesheet' href='https://example.com/a.css'>"
        "<img src='https://example.com/a.png'><script>console.error('from the frame');"
        "fetch('http://127.0.0.1:9/x').catch(() => {});</script>"
    )
    path = _notebook_page(
        tmp_path / "leaky.html",
        [f'<iframe srcdoc="{html.escape(inner, quote=True)}" sandbox="allow-scripts"></iframe>'],
    )
    o = harness.Opened(context, path)
    try:
        o.page.goto(o.url, wait_until="load")
        wanted = {"https://example.com/a.css", "https://example.com/a.png", "http://127.0.0.1:9/x"}
        deadline = time.monotonic() + 5
        while (
            not (wanted <= set(o.routed) and "from the frame" in o.console_errors)
            and time.monotonic() < deadline
        ):
            o.page.wait_for_timeout(50)
        assert wanted <= set(o.routed) and wanted <= set(o.others()), o.others()
        assert "from the frame" in o.console_errors, o.console_errors
    finally:
        o.close()
