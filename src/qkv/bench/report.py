"""What a benchmark run reports: ratios against each impl's peer, the Markdown table, where
linear attention overtakes its peer, the run's environment and its JSON (see :mod:`qkv.bench`).

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .._measured import cpu_model
from ..ops.linear import BLOCK, CHUNK_SIZE
from .specs import (
    DOC_MAX,
    DOC_MIN,
    DOC_SEED,
    PEER,
    PEERS,
    WINDOW,
    B,
    BenchConfig,
    D,
    H,
    num_features,
    run_name,
)

__all__ = [
    "RESUME_MUST_MATCH",
    "Crossover",
    "add_ratios",
    "crossover_marks",
    "crossovers",
    "environment",
    "load_previous",
    "markdown_table",
    "ratio_of",
    "write_json_atomic",
]


def add_ratios(records: list[dict]) -> None:
    """Set ``ratio_vs_<peer>`` (time) and ``peak_ratio_vs_<peer>`` on the records whose peer
    (:data:`PEERS`: torch-dense for tiled and auto, torch for linear and performer; same
    case, T, dtype, mode) was measured: ``ratio_vs_torch_dense``, ``ratio_vs_torch``."""
    ok = {(r["impl"], *_key(r)): r for r in records if r["status"] == "ok"}
    for r in records:
        peer = ok.get((PEERS.get(r["impl"]), *_key(r)))
        if r["status"] == "ok" and peer:
            tag = _tag(peer["impl"])
            r[f"ratio_vs_{tag}"] = r["time_s"] / peer["time_s"]
            r[f"peak_ratio_vs_{tag}"] = (
                r["peak_extra_mib"] / peer["peak_extra_mib"] if peer["peak_extra_mib"] > 0 else None
            )


def _tag(impl: str) -> str:
    return impl.replace("-", "_")


def ratio_of(r: dict) -> float | None:
    """The record's time ratio against its peer (:data:`PEERS`), if it has one."""
    peer = PEERS.get(r["impl"])
    return r.get(f"ratio_vs_{_tag(peer)}") if peer else None


def _key(r: dict) -> tuple:
    return r["case"], r["T"], r["dtype"], r["mode"]


def _progress(r: dict) -> str:
    head = f"{r['case']:<8} T={r['T']:<5} {r['dtype']} {r['mode']:<6} {r['impl']:<11}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    ratio = ratio_of(r)
    via = f" (via {r['backend']})" if r["impl"] == "auto" else ""
    return (
        f"{head} {_ms(r['time_s'])} ms  {r['peak_extra_mib']:9.1f} MiB  "
        f"{r['gflop_per_s']:7.1f} GFLOP/s"
        + (f"  x{ratio:.3f} vs {PEERS[r['impl']]}" if ratio else "")
        + via
        + (" (earlier run)" if r.get("resumed") else "")
    )


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:10.2f}" if ms >= 1 else f"{ms:10.4f}"


def markdown_table(records: list[dict]) -> str:
    """The records as a Markdown table (for benchmarks/RESULTS.md), then why any were not
    measured, grouped by reason. The ratio column is against each impl's peer
    (:data:`PEERS`), named in its header."""
    peers = list(dict.fromkeys(PEERS[r["impl"]] for r in records if r["impl"] in PEERS))
    header = f"vs {peers[0]}" if len(peers) == 1 else "vs peer" if peers else f"vs {PEER}"
    lines = [
        f"| T | case | dtype | mode | impl | ms | MiB | GFLOP/s | {header} |",
        "|---:|:---|:---:|:---:|:---|---:|---:|---:|---:|",
    ]
    for r in records:
        if r["status"] == "ok":
            ratio = ratio_of(r)
            cells = [
                _ms(r["time_s"]).strip(),
                f"{r['peak_extra_mib']:.1f}",
                f"{r['gflop_per_s']:.1f}",
                f"{ratio:.3f}" if ratio else "",
            ]
        else:
            cells = [r["status"], "", "", ""]
        mode = "fwd+bwd" if r["mode"] == "fwdbwd" else r["mode"]
        lines.append(
            "| " + " | ".join([str(r["T"]), r["case"], r["dtype"], mode, r["impl"], *cells]) + " |"
        )
    if len(peers) > 1:
        lines += [
            "",
            "Peers: "
            + "; ".join(f"{', '.join(i for i in PEERS if PEERS[i] == p)} vs {p}" for p in peers)
            + ".",
        ]
    if any(num_features(r["impl"]) for r in records):
        lines += [
            "",
            (
                "GFLOP/s of linear and performer count the linear form's own work "
                "(not comparable with exact attention's): compare time."
            ),
        ]
    notes: dict[str, list[dict]] = {}
    for r in records:
        if r["status"] != "ok":
            notes.setdefault(f"{r['impl']}: {r['status']}, {r['reason']}", []).append(r)
    if notes:
        lines += ["", "Not measured:"]
        lines += [f"- {why} ({len(rs)}x)" for why, rs in notes.items()]
    return "\n".join(lines)


# ---- where linear attention overtakes its peer ---------------------------------------------


@dataclass(frozen=True)
class Crossover:
    """Where ``impl`` becomes faster than ``peer`` for one case, dtype and mode.

    Attributes:
        T: The smallest measured length from which ``impl`` is faster at every measured
            length (None: not faster at the longest one measured).
        below: The measured length just before ``T``, where the peer was as fast or faster
            (None when ``impl`` is faster at every measured length).
        estimate: The length where the time ratio crosses 1, interpolated linearly in
            log(ratio) vs log(T) between ``below`` and ``T`` (None without both).
        lengths: The lengths where both were measured.
    """

    case: str
    dtype: str
    mode: str
    impl: str
    peer: str
    T: int | None
    below: int | None
    estimate: float | None
    lengths: tuple[int, ...]

    def __str__(self) -> str:
        mode = "forward+backward" if self.mode == "fwdbwd" else "forward"
        head = f"{self.case}, {self.dtype} {mode}: {self.impl}"
        if not self.lengths:
            return f"{head}: not measured against {self.peer} at any T"
        if self.T is None:
            return (
                f"{head} is not faster than {self.peer} at T={self.lengths[-1]}, the "
                f"longest measured: no crossover up to it"
            )
        if self.below is None:
            return (
                f"{head} is faster than {self.peer} at every measured T, from "
                f"T={self.T} (the shortest measured) on"
            )
        return (
            f"{head} is faster than {self.peer} from T={self.T} on ({self.peer} as fast "
            f"or faster at T={self.below}; ratio 1 at T ~ {self.estimate:,.0f})"
        )


def crossovers(
    records: Iterable[dict], impl: str = "linear", peer: str = "torch"
) -> list[Crossover]:
    """Where ``impl`` overtakes ``peer``, per (case, dtype, mode) where ``records`` have
    ``impl``.

    Only lengths where both were measured ("ok") count; the crossover is the smallest of
    them from which ``impl`` is faster at every longer one (a noisy win at a short T below
    a loss does not count).
    """
    times: dict[tuple, dict[str, dict[int, float]]] = {}
    present = set()  # the groups where impl was asked for at all
    for r in records:
        if r["impl"] in (impl, peer):
            group = times.setdefault((r["case"], r["dtype"], r["mode"]), {impl: {}, peer: {}})
            if r["status"] == "ok":
                group[r["impl"]][r["T"]] = r["time_s"]
            if r["impl"] == impl:
                present.add((r["case"], r["dtype"], r["mode"]))
    out = []
    for (case, dtype, mode), group in times.items():
        if (case, dtype, mode) not in present:
            continue
        lengths = sorted(group[impl].keys() & group[peer].keys())
        ratio = {T: group[impl][T] / group[peer][T] for T in lengths}
        i = len(lengths)
        while i > 0 and ratio[lengths[i - 1]] < 1:
            i -= 1
        T = lengths[i] if i < len(lengths) else None
        below = lengths[i - 1] if T is not None and i > 0 else None
        estimate = None
        if T is not None and below is not None:
            lo, hi = math.log(ratio[below]), math.log(ratio[T])  # lo >= 0 > hi
            x0, x1 = math.log(below), math.log(T)
            estimate = math.exp(x0 + (x1 - x0) * lo / (lo - hi))
        out.append(Crossover(case, dtype, mode, impl, peer, T, below, estimate, tuple(lengths)))
    return out


def crossover_marks(records: Iterable[dict]) -> dict[str, list[tuple[float, str]]]:
    """Vertical marks for the plot, per case: where linear (and performer) overtake torch."""
    records = list(records)
    marks: dict[str, list[tuple[float, str]]] = {}
    for impl in ("linear", "performer"):
        for c in crossovers(records, impl, "torch"):
            if c.estimate is not None:  # T and below both measured
                mode = "fwd+bwd" if c.mode == "fwdbwd" else c.mode
                marks.setdefault(c.case, []).append(
                    (c.estimate, f"{impl} {c.dtype} {mode} ~{c.estimate:,.0f}")
                )
    return marks


# ---- the run's environment and the JSON ----------------------------------------------------


def environment(config: BenchConfig) -> dict:
    """Device, versions, CPU, threads and the fixed shapes of a run, for its JSON."""
    linear = run_name(config.impls) == "linear"
    flops = "4*B*H*T*S*D*density forward; x3.5 forward+backward"
    extra = {}
    if linear:
        flops += (
            "; linear, performer: the linear form's matmuls "
            "(qkv.bench.linear_attention_flops), x3 forward+backward"
        )
        extra = dict(
            linear_feature_map="elu",
            linear_features=num_features("linear"),
            performer_features=num_features("performer"),
            performer_seed=0,
            chunk_size=CHUNK_SIZE,
            block=BLOCK,
            peers={i: p for i, p in PEERS.items() if i in config.impls},
        )
    return dict(
        benchmark=run_name(config.impls),
        device="cpu",
        cpu=_cpu_model(),
        dtypes=list(config.dtypes),
        threads=config.threads or torch.get_num_threads(),
        torch=torch.__version__,
        qkv=_qkv_version(),
        python=platform.python_version(),
        platform=platform.platform(),
        config=dict(
            B=B,
            H=H,
            D=D,
            window=WINDOW,
            document_lengths=[DOC_MIN, DOC_MAX],
            document_seed=DOC_SEED,
            min_run_time=config.min_run_time,
            timeout_s=config.timeout,
            run_all=config.run_all,
            flops=flops,
            **extra,
        ),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


RESUME_MUST_MATCH = ("benchmark", "device", "cpu", "threads", "torch")


def load_previous(path: Path, env: dict) -> list[dict]:
    """The records of the JSON at ``path`` from an earlier (perhaps interrupted) run, for
    ``--resume``; [] when there is none. ValueError when it was taken on another machine,
    thread count or torch (:data:`RESUME_MUST_MATCH`): its times would not compare."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        records = data["records"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"--resume: {path} is not a benchmark JSON ({_one_line(e)}); move it "
            f"away or drop --resume"
        ) from None
    for field in RESUME_MUST_MATCH:
        if data.get(field) != env.get(field):
            raise ValueError(
                f"--resume: {path} was measured with {field}="
                f"{data.get(field)!r}, this run has {env.get(field)!r}; its "
                f"times would not compare: give another --out or drop --resume"
            )
    return records


def _qkv_version() -> str:
    try:
        return importlib.metadata.version("qkv")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def _cpu_model() -> str:
    """The CPU a report names (``qkv._measured.cpu_model``, else the machine's type)."""
    return cpu_model() or platform.machine()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` by a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _one_line(e: BaseException) -> str:
    """An exception as one line of at most ~300 characters, for a record's ``reason``."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"
