"""qkv's tiled backend against torch's SDPA with the mask passed densely, CPU: time and memory.

A thin driver over ``qkv.bench`` (the library behind ``qkv bench``; see its docstring for
what is measured and how). Two modes:

* the issue's full grid: cases none, causal, window (256 keys), document (packed, 512-2048
  tokens) x T = 1024 ... 32768 x fp32, bf16 x fwd, fwd+bwd x tiled, auto, torch-dense,
  reference. Writes ``OUT/tiled.json`` (after every measurement) and ``OUT/tiled.png`` and
  prints a Markdown table for ``benchmarks/RESULTS.md``. Hours on a 2-core CPU: dense runs
  beyond T=16384 and reference beyond T=4096 are skipped (``--all`` runs them).
* ``--targets``: only the issue's targets, each printed as met or missed with its ratio;
  writes ``OUT/tiled_targets.json``; exit status 1 if any target is missed.

Usage:
    python benchmarks/bench_tiled.py [--out benchmarks/results] [--lengths 1024 4096]
    python benchmarks/bench_tiled.py --targets
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from qkv.bench import (
    PEER,
    BenchConfig,
    Spec,
    bench_config,
    grid,
    markdown_table,
    run_specs,
    write_json_atomic,
)

FULL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
GIB = 1024  # MiB


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: ``spec`` against ``peer`` (time ratio at most
    ``max_ratio``), or ``spec`` alone (peak extra memory below ``max_peak_gib``)."""

    spec: Spec
    peer: str | None = None
    max_ratio: float | None = None
    max_peak_gib: float | None = None

    def specs(self) -> list[Spec]:
        s = self.spec
        return [s] + ([Spec(s.case, s.T, s.dtype, s.mode, self.peer)] if self.peer else [])

    def __str__(self) -> str:
        s = self.spec
        mode = "fwd+bwd" if s.mode == "fwdbwd" else s.mode
        what = f"vs {self.peer}" if self.peer else "alone"
        return f"{s.case} T={s.T} {s.dtype} {mode}: {s.impl} {what}"


# The targets: window forward >= 10x faster than the dense peer (ratio <= 0.1),
# window forward+backward >= 5x (<= 0.2), document >= 5x (<= 0.2); auto on plain and causal
# calls within 1.05x of calling torch directly.
TARGETS = (
    Target(Spec("window", 16384, "fp32", "fwd", "tiled"), PEER, max_ratio=0.1),
    Target(Spec("window", 16384, "fp32", "fwdbwd", "tiled"), PEER, max_ratio=0.2),
    Target(Spec("document", 16384, "fp32", "fwd", "tiled"), PEER, max_ratio=0.2),
    *(
        Target(Spec(case, T, "fp32", "fwd", "auto"), PEER, max_ratio=1.05)
        for case in ("none", "causal")
        for T in (1024, 4096)
    ),
    Target(Spec("window", 65536, "fp32", "fwdbwd", "tiled"), max_peak_gib=24.0),
)


def check(target: Target, records: list[dict]) -> tuple[bool, str]:
    """Whether ``target`` is met by ``records``, and the line that says so."""
    got = {
        r["impl"]: r
        for r in records
        if (r["case"], r["T"], r["dtype"], r["mode"])
        == (target.spec.case, target.spec.T, target.spec.dtype, target.spec.mode)
    }
    for s in target.specs():
        r = got.get(s.impl)
        if r is None or r["status"] != "ok":
            why = f"{r['status']}: {r['reason']}" if r else "not run"
            return False, f"{target}: {s.impl} not measured ({why})"
    r = got[target.spec.impl]
    if target.peer:
        ratio = r["time_s"] / got[target.peer]["time_s"]
        return ratio <= target.max_ratio, (
            f"{target}: time ratio {ratio:.3f} (target <= {target.max_ratio:g})"
        )
    peak = r["peak_extra_mib"] / GIB
    return peak < target.max_peak_gib, (
        f"{target}: peak {peak:.2f} GiB "
        f"(target < {target.max_peak_gib:g} GiB), "
        f"{r['time_s']:.2f} s a call"
    )


def run_targets(config: BenchConfig, out: Path) -> int:
    """Measure the targets' specs, print each target as met or missed; 1 if any missed."""
    specs = list(dict.fromkeys(s for t in TARGETS for s in t.specs()))
    path = out / "tiled_targets.json"
    records = run_specs(specs, config, path)
    verdicts = [(t, *check(t, records)) for t in TARGETS]
    for _, met, line in verdicts:
        print(f"{'met   ' if met else 'MISSED'} {line}")
    data = json.loads(path.read_text())  # as run_specs left it: environment and records
    data["targets"] = [dict(target=str(t), met=met, detail=line) for t, met, line in verdicts]
    write_json_atomic(path, data)
    print(f"\n{markdown_table(records)}\n\nwrote {path}")
    return 0 if all(met for _, met, _ in verdicts) else 1


def run_grid(config: BenchConfig, out: Path) -> int:
    """Measure the full grid; write JSON and PNG; print the Markdown table."""
    records = run_specs(grid(config), config, out / "tiled.json")
    print(markdown_table(records))
    from qkv.viz.benchplot import plot_bench  # matplotlib only when plotting

    print(f"\nwrote {out / 'tiled.json'} and {plot_bench(records, out / 'tiled.png')}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", action="store_true", help="run only the issue's targets")
    p.add_argument("--lengths", nargs="+", default=[str(t) for t in FULL_LENGTHS])
    p.add_argument("--min-run-time", default="0.5")
    p.add_argument("--timeout", default="600", help="seconds per measurement")
    p.add_argument("--threads", default=None)
    p.add_argument(
        "--all",
        action="store_true",
        dest="run_all",
        help="also run the dense implementations where they are hopeless",
    )
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    try:
        config = bench_config(
            lengths=a.lengths,
            min_run_time=a.min_run_time,
            timeout=a.timeout,
            threads=a.threads,
            run_all=a.run_all,
        )
    except ValueError as e:
        p.error(str(e))
    out = Path(a.out)
    return run_targets(config, out) if a.targets else run_grid(config, out)


if __name__ == "__main__":
    sys.exit(main())
