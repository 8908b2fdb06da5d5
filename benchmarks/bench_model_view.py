"""The viewer's Model view at 512, 4k and 16k tokens (issue 27): page size, time to write it,
and load time in headless Chromium until the viewer is ready and until the Model view's
thumbnails (every layer x head) are drawn.

The model: ``qkv.DecoderLM(1000, 192, 12 heads, 12 layers, max_len=16384)``, random weights
(``torch.manual_seed(0)``), eval, CPU, one sequence of random token ids (seed 1), labelled
``w<id>`` (the page carries the token strings, as a real one would).

Capture: one forward per layer (``qkv.capture(model, layers=[i], rows=...)``), so that only
one layer's float32 weights exist at a time; each kept record's ``probs`` is then held as
float16 when the capture's float32 weights of all layers would pass ``--f16-above`` bytes (4k
and 16k: 9.7 and 155 GB). The page stores float16 anyway in its "top" mode (every head here
is in it: see below), and rounding is monotonic, so the stored block maxima and top-k values
are the same (ties in the top k may pick another key of equal value).

Bounds applied (printed and written to the JSON):

* **capture**: ``qkv.capture`` has no default bound (with no ``heads``/``rows`` it keeps every
  ``(B, H, T, S)`` weight). 512 and 4096 keep every query row. 16384 keeps every 16th query
  row (``rows=range(0, 16384, 16)``: 1024 rows by 16384 keys a head, spread over the whole
  sequence), because every row of 144 heads is 155 GB in float32 (77 GB in float16). A fourth
  configuration, ``16384 full``, keeps every row of 4 heads of layer 0 (1 x 4 heads, 2 GB in
  float16), to show a 16k x 16k page.
* **page**: ``qkv.viz.html``'s default ``max_cells = 2**24``: each of the 144 heads gets
  ``C = 2**24 // 144 = 116,508`` cells (2 bytes each); a head of more cells is stored as block
  maxima + each row's k largest weights ("top" mode).

Browser: Debian's Chromium under Playwright (as ``tests/test_viewer_browser.py``): headless,
a fresh profile per repetition, every request but the file itself aborted (and counted),
1280 x 960. Measured per repetition:

* ``ready_s``: Python wall time from ``page.goto`` until ``document.body.dataset.ready ===
  "1"`` (the viewer drew its first view, the head view);
* ``load_event_ms``: the page's own ``loadEventEnd`` (navigation timing);
* ``model_ms``: in the page, from clicking ``#tab-model`` until two animation frames later
  (the thumbnails are drawn synchronously by the click: every head's blob decoded, each
  thumbnail painted), with the number of ``canvas.mthumb`` drawn;
* ``total_s``: Python wall time from ``goto`` until the Model view is drawn;
* the size the same weights would take as ``json.dumps(probs.tolist())`` (bertviz's and
  CircuitsVis's way of putting them in the page, with no bound): bytes per cell measured on
  a sample of the first layer's float32 weights (``json_sample``), times ``layers x heads x
  T^2`` (an estimate: it leaves out their scripts and the token strings);
* JS heap used (CDP ``Performance.getMetrics``, after a forced GC) when ready and after the
  Model view; it leaves out typed arrays' buffers and the DOM's text, so the renderer
  process's RSS (psutil) after the Model view is given too.

Medians over ``--reps`` repetitions (the write over ``--write-reps``). Writes
``benchmarks/results/model_view.json`` and prints a Markdown table.

Usage:
    python benchmarks/bench_model_view.py [--configs 512 4096 16384 16384full] [--reps 5]
    python benchmarks/bench_model_view.py --configs 16384 --merge   # redo one row of the JSON

The machine's 1-minute load average before and after each row is in the JSON: on a shared box
the write and load times move with it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import qkv
from qkv.viz import html as viz_html

REPO = Path(__file__).resolve().parents[1]
VOCAB, EMBED, HEADS, LAYERS, MAX_LEN = 1000, 192, 12, 12, 16384
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

# name -> (T, layers, heads, row stride)
CONFIGS = {
    "512": (512, list(range(LAYERS)), None, 1),
    "4096": (4096, list(range(LAYERS)), None, 1),
    "16384": (16384, list(range(LAYERS)), None, 16),
    "16384full": (16384, [0], [0, 1, 2, 3], 1),
}


# ----------------------------------------------------------------------------- machine
def machine() -> dict:
    cpu = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE)
        cpu = m.group(1).strip() if m else cpu
    except (OSError, subprocess.CalledProcessError):
        pass
    chromium = _chromium()
    version = None
    if chromium:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired, IndexError):
            version = (
                subprocess.run(
                    [chromium, "--version"], capture_output=True, text=True, timeout=30, check=False
                )
                .stdout.strip()
                .splitlines()[0]
            )
    try:
        from importlib.metadata import version as pkg_version

        pw = pkg_version("playwright")
    except Exception:  # reported as unknown
        pw = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "chromium": version,
        "chromium_path": chromium,
        "playwright": pw,
        "qkv_commit": _git_head(),
    }


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _chromium() -> str | None:
    for cand in (os.environ.get("QKV_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


# ----------------------------------------------------------------------------- capture
def make_capture(T: int, layers: list[int], heads, stride: int, f16_above: int):
    """The records of ``layers`` (one forward each), and what was kept."""
    torch.manual_seed(0)
    model = qkv.DecoderLM(VOCAB, EMBED, HEADS, LAYERS, max_len=MAX_LEN).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    rows = None if stride == 1 else range(0, T, stride)
    nh = HEADS if heads is None else len(heads)
    nr = T if rows is None else len(rows)
    f32_bytes = len(layers) * nh * nr * T * 4
    half = f32_bytes > f16_above
    records, t0, json_info = [], time.perf_counter(), None
    for li in layers:
        with torch.no_grad(), qkv.capture(model, layers=[li], heads=heads, rows=rows) as cap:
            model(ids)
        for rec in cap:
            if json_info is None:
                json_info = json_bytes_per_cell(rec.probs[0])
            records.append(dataclasses.replace(rec, probs=rec.probs.half()) if half else rec)
        del cap
        gc.collect()
    seconds = time.perf_counter() - t0
    tokens = [f"w{int(i)}" for i in ids[0]]
    info = {
        "T": T,
        "layers": len(layers),
        "heads": nh,
        "rows_kept": nr,
        "row_stride": stride,
        "capture_f32_bytes": f32_bytes,
        "held_as": "float16" if half else "float32",
        "capture_s": round(seconds, 2),
        "json_sample": json_info,
        "backends": sorted({r.backend for r in records}),
        "layer_numbers": sorted({int(r.layer) for r in records}),
    }
    return records, tokens, info


def json_bytes_per_cell(p) -> dict:
    """Bytes per weight of ``json.dumps(tensor.tolist())`` -- how bertviz (``model_view``,
    ``head_view``) and CircuitsVis (``render``) put the weights into their page -- measured on
    the float32 weights of the first captured layer ``p`` (nh, nr, S): every head when it has
    at most 4M cells, else head 0 on at most 256 evenly spaced of its rows."""
    sample = p if p.numel() <= 1 << 22 else p[0, :: max(1, p.shape[1] // 256)]
    text = json.dumps(sample.float().tolist())
    return {
        "cells": sample.numel(),
        "bytes": len(text),
        "bytes_per_cell": round(len(text) / sample.numel(), 3),
    }


# ----------------------------------------------------------------------------- page
def page_cells(path: Path, full_heads: int, T: int) -> dict:
    """Cells the page inlines, read back from its own metadata."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="qkv-meta">(.*?)</script>', text, re.DOTALL)
    meta = json.loads(m.group(1))
    exact = blocks = kept = 0
    modes: dict[str, int] = {}
    ks = set()
    for e in meta["entries"]:
        for h in e["heads"]:
            modes[h["mode"]] = modes.get(h["mode"], 0) + 1
            kept += e["nr"] * e["S"]
            if h["mode"] in ("f4", "f2"):
                exact += e["nr"] * e["S"]
            else:
                exact += e["nr"] * h["k"]
                blocks += h["gr"] * h["gc"]
                ks.add((h["k"], h["block"]))
    return {
        "budget_cells_per_head": meta["budget"],
        "modes": modes,
        "top_k_and_block": sorted(ks),
        "cells_exact": exact,
        "cells_block_max": blocks,
        "cells_inlined": exact + blocks,
        "cells_captured": kept,
        "cells_full_model": full_heads * T * T,
    }


def write_page(records, tokens, path: Path, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        if path.exists():
            path.unlink()
        t0 = time.perf_counter()
        viz_html(records, path, tokens)
        times.append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------- browser
READY = "() => document.body && document.body.dataset.ready === '1'"
MODEL = """() => new Promise((resolve) => {
  const t0 = performance.now();
  document.getElementById('tab-model').click();
  const n = document.querySelectorAll('#model-grid canvas.mthumb').length;
  const t1 = performance.now();
  requestAnimationFrame(() => requestAnimationFrame(() =>
    resolve({sync_ms: t1 - t0, ms: performance.now() - t0, thumbs: n,
             view: window.qkvViewer.state.view})));
})"""


def heap(cdp) -> dict:
    cdp.send("HeapProfiler.collectGarbage")
    got = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {
        "used_mb": round(got.get("JSHeapUsedSize", float("nan")) / 2**20, 1),
        "total_mb": round(got.get("JSHeapTotalSize", float("nan")) / 2**20, 1),
    }


def renderer_rss_mb() -> float | None:
    """The largest RSS among this process tree's Chromium renderer processes (the page's:
    its typed arrays and the DOM's blob text live outside the V8 heap that CDP reports)."""
    try:
        import psutil
    except ImportError:
        return None
    best = 0
    for p in psutil.Process().children(recursive=True):
        try:
            if "--type=renderer" in " ".join(p.cmdline()):
                best = max(best, p.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return round(best / 2**20, 1) if best else None


def browse(path: Path, reps: int, expect_thumbs: int, timeout_s: float, shot: Path | None):
    from playwright.sync_api import sync_playwright

    url = path.resolve().as_uri()
    runs = []
    with sync_playwright() as pw:
        for rep in range(reps):
            profile = tempfile.mkdtemp(prefix="qkv-mv-profile-")
            ctx = pw.chromium.launch_persistent_context(
                profile,
                executable_path=_chromium(),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport=VIEWPORT,
                device_scale_factor=1,
            )
            try:
                page = ctx.new_page()
                others, errors = [], []

                def route(r, others=others):
                    if r.request.url == url:
                        r.continue_()
                    else:
                        others.append(r.request.url)
                        r.abort()

                page.route("**/*", route)
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.on(
                    "console",
                    lambda m, errors=errors: errors.append(m.text) if m.type == "error" else None,
                )
                cdp = ctx.new_cdp_session(page)
                cdp.send("Performance.enable")
                t0 = time.perf_counter()
                page.goto(url, wait_until="load", timeout=timeout_s * 1000)
                page.wait_for_function(READY, timeout=timeout_s * 1000)
                ready_s = time.perf_counter() - t0
                nav = page.evaluate(
                    "() => { const n = performance.getEntriesByType('navigation')[0];"
                    " return {response_end_ms: n.responseEnd,"
                    " dcl_ms: n.domContentLoadedEventEnd, load_event_ms: n.loadEventEnd}; }"
                )
                heap_ready = heap(cdp)
                t1 = time.perf_counter()
                model = page.evaluate(MODEL)
                total_s = ready_s + (time.perf_counter() - t1)
                if model["thumbs"] != expect_thumbs or model["view"] != "model":
                    raise RuntimeError(
                        f"{path.name}: the Model view drew {model['thumbs']} "
                        f"thumbnails (view {model['view']!r}), expected "
                        f"{expect_thumbs}"
                    )
                heap_model = heap(cdp)
                rss_model = renderer_rss_mb()
                grid = page.evaluate(
                    "() => { const g = document.getElementById('model-grid');"
                    " return {scroll: g.scrollWidth, client: g.clientWidth,"
                    " viewport: document.documentElement.clientWidth}; }"
                )
                if shot is not None and rep == 0:
                    page.screenshot(path=str(shot), full_page=False)
                runs.append(
                    {
                        "ready_s": ready_s,
                        **nav,
                        "model_ms": model["ms"],
                        "model_sync_ms": model["sync_ms"],
                        "thumbs": model["thumbs"],
                        "total_s": total_s,
                        "heap_ready_mb": heap_ready["used_mb"],
                        "heap_model_mb": heap_model["used_mb"],
                        "heap_model_total_mb": heap_model["total_mb"],
                        "renderer_rss_mb": rss_model,
                        "model_grid_width": grid,
                        "requests_blocked": len(others),
                        "errors": errors,
                    }
                )
            finally:
                ctx.close()
                shutil.rmtree(profile, ignore_errors=True)
    return runs


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=5, help="browser loads per page")
    ap.add_argument("--write-reps", type=int, default=3, help="page writes per page")
    ap.add_argument(
        "--f16-above",
        type=int,
        default=2 << 30,
        help="hold the capture as float16 above this many float32 bytes",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="browser timeout (s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/model_view.json"))
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of --out for the configs not run now (one row per config)",
    )
    ap.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the pages (and a screenshot of each Model view) in DIR",
    )
    args = ap.parse_args(argv)

    mach = machine()
    print(json.dumps(mach), flush=True)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="qkv-mv-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    if args.merge and Path(args.out).is_file():
        results = [
            r
            for r in json.loads(Path(args.out).read_text())["results"]
            if r["config"] not in args.configs
        ]
    for name in args.configs:
        load_before = os.getloadavg()
        T, layers, heads, stride = CONFIGS[name]
        records, tokens, info = make_capture(T, layers, heads, stride, args.f16_above)
        print(f"[{name}] captured {info}", flush=True)
        path = work / f"model_view_{name}.html"
        writes = write_page(records, tokens, path, args.write_reps)
        size = path.stat().st_size
        n_heads = info["layers"] * info["heads"]
        cells = page_cells(path, n_heads, T)
        del records
        gc.collect()
        print(
            f"[{name}] wrote {size / 2**20:.1f} MiB in {statistics.median(writes):.1f} s; "
            f"cells {cells}",
            flush=True,
        )
        shot = work / f"model_view_{name}.png" if args.keep else None
        runs = browse(path, args.reps, n_heads, args.timeout, shot)
        full_json = info["json_sample"]["bytes_per_cell"] * cells["cells_full_model"]
        row = {
            "config": name,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            **info,
            "page_bytes": size,
            "page_mib": round(size / 2**20, 2),
            "full_json_bytes_est": round(full_json),
            "write_s": writes,
            "write_s_median": round(statistics.median(writes), 2),
            **cells,
            "runs": runs,
            "median": {
                k: round(med(runs, k), 3)
                for k in (
                    "ready_s",
                    "load_event_ms",
                    "model_ms",
                    "total_s",
                    "heap_ready_mb",
                    "heap_model_mb",
                    "renderer_rss_mb",
                )
            },
            "requests_blocked": sum(r["requests_blocked"] for r in runs),
            "errors": sorted({e for r in runs for e in r["errors"]}),
        }
        print(
            f"[{name}] browser medians {row['median']} blocked={row['requests_blocked']} "
            f"errors={row['errors']}",
            flush=True,
        )
        results.append(row)
        results.sort(key=lambda r: list(CONFIGS).index(r["config"]))
        if not args.keep:
            path.unlink()
        out = {
            "machine": mach,
            "model": {
                "class": "qkv.DecoderLM",
                "vocab": VOCAB,
                "embed_dim": EMBED,
                "heads": HEADS,
                "layers": LAYERS,
                "seed": 0,
            },
            "page": {"max_cells": 1 << 24, "tokens": "w<id> strings"},
            "reps": args.reps,
            "write_reps": args.write_reps,
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print()
    print(table(results))
    return 0


def _size(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n / 1e3:.0f} kB"


def table(results: list[dict]) -> str:
    lines = [
        (
            "| T | layers x heads | query rows kept | page | write | ready | model view drawn "
            "| goto -> model view | JS heap (ready / model) | renderer RSS "
            "| cells inlined / H·T² | H·T² as JSON (est.) |"
        ),
        "|---:|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["median"]
        rows = "all" if r["row_stride"] == 1 else f"every {r['row_stride']}th ({r['rows_kept']})"
        lines.append(
            f"| {r['T']:,} | {r['layers']} x {r['heads']} | {rows} | {r['page_mib']:.1f} MiB "
            f"| {r['write_s_median']:.1f} s | {m['ready_s']:.2f} s | {m['model_ms'] / 1000:.2f} s "
            f"| {m['total_s']:.2f} s | {m['heap_ready_mb']:.0f} / {m['heap_model_mb']:.0f} MiB "
            f"| {m['renderer_rss_mb']:.0f} MiB | {r['cells_inlined'] / 1e6:.1f} M "
            f"/ {r['cells_full_model'] / 1e6:,.0f} M "
            f"({100 * r['cells_inlined'] / r['cells_full_model']:.3g}%) "
            f"| {_size(r['full_json_bytes_est'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
