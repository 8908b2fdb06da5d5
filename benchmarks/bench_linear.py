"""Linear attention against torch's SDPA on CPU (time, memory, crossover), and the time to
generate one token with a recurrent state against a KV-cached softmax decoder.

A thin driver over ``qkv.bench`` and ``qkv.bench.decode``, the libraries behind
``qkv bench`` and ``qkv bench-decode`` (their docstrings say what is measured and how):

* the grid: cases none and causal x T = 256 ... 65536 x fp32 x forward (and forward+backward
  for T <= 16384) x ``linear`` (``qkv.linear_attention``, elu) and ``torch`` (torch's SDPA,
  called natively: ``is_causal=True`` or no mask). Writes ``OUT/linear.json`` after every
  measurement and ``OUT/linear.png`` (time and memory vs T, log-log, the crossovers marked).
  torch beyond T=16384 is skipped unless ``--all`` (its time grows as T^2: ~30 s to a minute
  a call at 64k on 2 cores; memory stays O(T)).
* decode: per-token time at positions 1024 and 16384 for ``LinearAttentionState.step`` (elu
  and FAVOR+) and for ``KVCache.append`` + SDPA. Writes ``OUT/decode.json`` after every
  measurement.

Then prints a Markdown section for ``benchmarks/RESULTS.md`` (:func:`markdown_section`): the
issue's two targets, met or not, the crossover length per case and mode, the tables.

Usage:
    python benchmarks/bench_linear.py                 # everything, to benchmarks/results
    python benchmarks/bench_linear.py --resume        # continue an interrupted run
    python benchmarks/bench_linear.py --resume --all  # then add torch at T = 32k, 64k
    python benchmarks/bench_linear.py --only decode   # one part (grid or decode)
    python benchmarks/bench_linear.py --report        # only the Markdown, from the JSON
    python benchmarks/bench_linear.py --quick         # smoke run: small T, to a temp dir
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from qkv.bench import (
    MODES,
    Spec,
    bench_config,
    crossover_marks,
    crossovers,
    environment,
    load_previous,
    run_specs,
    write_json_atomic,
)
from qkv.bench.decode import (
    DEFAULT_POSITIONS,
    GROWTH_TARGET,
    decode_config,
    decode_environment,
    decode_markdown,
    run_decode,
)

FULL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (256, 512, 1024, 2048)
QUICK_POSITIONS = (256, 2048)
FWDBWD_MAX_T = 16384  # forward+backward only up to here (torch's backward: minutes beyond)
CASES = ("none", "causal")
TARGET_T, TARGET_RATIO = 16384, 0.1  # the issue's: causal linear at 16k >= 10x faster
DEFAULT_OUT = Path("benchmarks/results")


def grid_specs(lengths, impls=("linear", "torch")) -> list[Spec]:
    """The grid, by T first (an interrupted run has whole lengths), fp32."""
    return [
        Spec(case, T, "fp32", mode, impl)
        for T in lengths
        for case in CASES
        for mode in MODES
        if mode == "fwd" or T <= FWDBWD_MAX_T
        for impl in impls
    ]


def run_grid(a: argparse.Namespace, out: Path, command: str) -> dict:
    impls = ("linear", "performer", "torch") if a.performer else ("linear", "torch")
    config = bench_config(
        cases=CASES,
        lengths=a.lengths,
        dtypes=["fp32"],
        impls=impls,
        min_run_time=a.min_run_time,
        timeout=a.timeout,
        threads=a.threads,
        run_all=a.run_all,
    )
    path = out / "linear.json"
    previous = load_previous(path, environment(config)) if a.resume else None
    records = run_specs(grid_specs(config.lengths, impls), config, path, previous=previous)
    data = dict(json.loads(path.read_text()), command=command)
    write_json_atomic(path, data)
    from qkv.viz.benchplot import plot_bench  # matplotlib only when plotting

    png = plot_bench(records, out / "linear.png", marks=crossover_marks(records))
    print(f"wrote {path} and {png}", file=sys.stderr)
    return data


def run_decode_part(a: argparse.Namespace, out: Path, command: str) -> dict:
    config = decode_config(positions=a.positions, min_run_time=a.min_run_time, threads=a.threads)
    path = out / "decode.json"
    previous = load_previous(path, decode_environment(config)) if a.resume else None
    data = dict(run_decode(config, path, previous=previous), command=command)
    write_json_atomic(path, data)
    print(f"wrote {path}", file=sys.stderr)
    return data


# ---- the Markdown for RESULTS.md --------------------------------------------------------------


def causal_target(records: list[dict], T: int = TARGET_T) -> dict:
    """The issue's first target: causal linear attention at T, fp32 forward, at most
    ``TARGET_RATIO`` of causal SDPA's time. ``met`` None when either was not measured."""
    got = {
        r["impl"]: r
        for r in records
        if (r["case"], r["T"], r["dtype"], r["mode"]) == ("causal", T, "fp32", "fwd")
    }
    lin, ref = got.get("linear"), got.get("torch")
    if not (lin and ref and lin["status"] == ref["status"] == "ok"):
        why = ", ".join(
            f"{n} {r['status'] if r else 'not run'}"
            for n, r in (("linear", lin), ("torch", ref))
            if not (r and r["status"] == "ok")
        )
        return dict(T=T, ratio=None, met=None, detail=f"not measured ({why})")
    ratio = lin["time_s"] / ref["time_s"]
    return dict(
        T=T,
        ratio=ratio,
        met=ratio <= TARGET_RATIO,
        detail=f"{ratio:.3f} ({1 / ratio:.1f}x faster): {lin['time_s'] * 1e3:.1f} ms "
        f"vs {ref['time_s'] * 1e3:.1f} ms",
    )


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "**not met**"


def _pairs_table(records: list[dict]) -> list[str]:
    """One row per (T, case, mode): each impl's time and peak, and the ratios to torch."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    others = [i for i in impls if i != "torch"]
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["T"], r["case"], r["mode"]), {})[r["impl"]] = r
    head = (
        [f"{i} ms" for i in impls] + [f"{i} / torch" for i in others] + [f"{i} MiB" for i in impls]
    )
    lines = [
        "| T | case | mode | " + " | ".join(head) + " |",
        "|---:|:---|:---:|" + "---:|" * len(head),
    ]
    for (T, case, mode), by in rows.items():
        ok = {i: r for i, r in by.items() if r["status"] == "ok"}
        ms = [
            f"{ok[i]['time_s'] * 1e3:.2f}" if i in ok else by[i]["status"] if i in by else ""
            for i in impls
        ]
        ratio = [
            f"{ok[i]['time_s'] / ok['torch']['time_s']:.3f}" if i in ok and "torch" in ok else ""
            for i in others
        ]
        mib = [f"{ok[i]['peak_extra_mib']:.1f}" if i in ok else "" for i in impls]
        shown = "fwd+bwd" if mode == "fwdbwd" else mode
        lines.append(f"| {T} | {case} | {shown} | " + " | ".join(ms + ratio + mib) + " |")
    return lines


def markdown_section(linear: dict | None, decode: dict | None) -> str:
    """The section for benchmarks/RESULTS.md from the two JSONs as this script writes them
    (either may be None): commands, targets met or not, crossovers, tables."""
    out = ["## Linear attention vs exact attention, CPU", ""]
    env = linear or decode or {}
    for name, data in (("grid", linear), ("decode", decode)):
        if data:
            out.append(
                f"Command ({name}): `{data.get('command', '?')}` (started "
                f"{data.get('started', '?')})."
            )
    out += [
        "",
        (
            f"Machine: {env.get('cpu', '?')}, torch threads: {env.get('threads', '?')}, "
            f"torch {env.get('torch', '?')}. B=1, H=8, D=64, fp32. "
            "`linear` = `qkv.linear_attention` "
            "(elu feature map; causal: the chunk-wise kernel, chunks of 64); `performer` = the "
            "same with `qkv.Favor(64, seed=0)` (M = 266); `torch` = "
            "`F.scaled_dot_product_attention` called natively (`is_causal=True`, or no mask: "
            "its flash kernel, O(T) memory). Each measurement in a fresh process; time = "
            "median of `torch.utils.benchmark`; peak = extra resident memory of the call. "
            "Ratios = linear / torch from the same run (below 1: linear faster)."
        ),
        "",
    ]
    records = linear["records"] if linear else []
    target = causal_target(records)
    growth = (decode or {}).get("ratios", {}).get("target", {})
    out += [
        "### Targets",
        "",
        "| target | measured | goal | |",
        "|:---|:---|:---|:---|",
        (
            f"| causal linear attention vs causal SDPA, T={target['T']}, fp32 forward | "
            f"{target['detail']} | <= {TARGET_RATIO} (>= 10x faster) | "
            f"{_verdict(target['met'])} |"
        ),
    ]
    if growth.get("met") is not None:
        lo, hi = growth["positions"]
        out.append(
            f"| recurrent (elu) per-token time, position {hi} vs {lo} | "
            f"x{growth['value']:.3f} | <= {GROWTH_TARGET} | {_verdict(growth['met'])} |"
        )
    else:
        out.append(
            f"| recurrent (elu) per-token time, 16384 vs 1024 | | <= {GROWTH_TARGET} | "
            "not measured |"
        )
    if linear:
        out += [
            "",
            "### Crossover",
            "",
            (
                "Smallest measured T from which linear is faster than torch at every longer "
                "measured T (ratio 1 interpolated in log-log between the two lengths around "
                "it):"
            ),
            "",
        ]
        for impl in ("linear", "performer"):
            out += [f"- {c}" for c in crossovers(records, impl, "torch")]
        skipped = sorted(
            {r["T"] for r in records if r["impl"] == "torch" and r["status"] == "skipped"}
        )
        if skipped:
            out += [
                "",
                (
                    f"torch not run at T = {', '.join(map(str, skipped))} (its time grows "
                    "as T^2; `--all` runs it), so linear alone is shown there."
                ),
            ]
        out += ["", "### Time and peak memory", "", *_pairs_table(records)]
        failed = {
            f"{r['impl']} at T={r['T']} {r['case']} {r['mode']}: {r['status']}, {r['reason']}"
            for r in records
            if r["status"] not in ("ok", "skipped")
        }
        if failed:
            out += ["", "Failed:", *sorted(f"- {f}" for f in failed)]
    if decode:
        out += [
            "",
            "### Generating one token: recurrent state vs KV cache",
            "",
            (
                "Per-token time (median, microseconds) at the position: the decoder is "
                "prefilled there and rewound to it between timed blocks of "
                f"{decode['config']['tokens_per_block']} tokens (see `qkv.bench.decode`). "
                "`kv-cache` = `KVCache.append` + `F.scaled_dot_product_attention` over every "
                "stored key; ratios below 1: the recurrent state is faster."
            ),
            "",
            decode_markdown(decode),
        ]
    return "\n".join(out)


# ---- the command line -------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: T = {' '.join(map(str, QUICK_LENGTHS))}, positions "
        f"{' '.join(map(str, QUICK_POSITIONS))}, 0.1 s a measurement, to a temp dir",
    )
    p.add_argument("--only", choices=("grid", "decode"), default=None)
    p.add_argument(
        "--report",
        action="store_true",
        help="measure nothing: print the Markdown from the JSON in --out",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep what the JSON in --out already measured; measure the rest",
    )
    p.add_argument(
        "--all",
        action="store_true",
        dest="run_all",
        help="also run torch at T > 16384 (tens of seconds a call)",
    )
    p.add_argument("--performer", action="store_true", help="also time FAVOR+ in the grid")
    p.add_argument("--lengths", nargs="+", default=None, metavar="T")
    p.add_argument("--positions", nargs="+", default=None, metavar="P")
    p.add_argument("--min-run-time", default=None, metavar="SECONDS")
    p.add_argument(
        "--timeout",
        default="900",
        metavar="SECONDS",
        help="limit on each grid measurement's process (default 900)",
    )
    p.add_argument("--threads", default=None, metavar="N")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help=f"default {DEFAULT_OUT} ({tempfile.gettempdir()}/qkv-bench-linear with --quick)",
    )
    a = p.parse_args()
    a.lengths = a.lengths or [str(t) for t in (QUICK_LENGTHS if a.quick else FULL_LENGTHS)]
    a.positions = a.positions or [
        str(t) for t in (QUICK_POSITIONS if a.quick else DEFAULT_POSITIONS)
    ]
    a.min_run_time = a.min_run_time or ("0.1" if a.quick else "0.5")
    out = (
        Path(a.out)
        if a.out
        else (Path(tempfile.gettempdir()) / "qkv-bench-linear" if a.quick else DEFAULT_OUT)
    )
    if a.report:
        linear, decode = (
            json.loads(f.read_text()) if f.exists() else None
            for f in (out / "linear.json", out / "decode.json")
        )
        print(markdown_section(linear, decode))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else "python"
    command = shlex.join([python, *sys.argv])
    try:
        linear = run_grid(a, out, command) if a.only in (None, "grid") else None
        decode = run_decode_part(a, out, command) if a.only in (None, "decode") else None
    except ValueError as e:
        p.error(str(e))
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: what was measured is in {out}; continue with the same command "
            "and --resume",
            file=sys.stderr,
        )
        return 130
    if a.only:  # show the other part too when its JSON is there
        other = out / ("decode.json" if a.only == "grid" else "linear.json")
        if other.exists():
            loaded = json.loads(other.read_text())
            linear, decode = (linear, loaded) if a.only == "grid" else (loaded, decode)
    print(markdown_section(linear, decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
