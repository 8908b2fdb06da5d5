"""The benchmark behind ``qkv bench-decode``: time to generate one token at a given position,
for a recurrent linear-attention state and for a KV-cached softmax decoder.

Three decoders, each with B=1, H=8 heads, D=64, float32, no_grad, one new token a step:

* ``recurrent``: ``qkv.LinearAttentionState("elu").step(q_t, k_t, v_t)`` -- O(M x Dv) work
  whatever the position (Katharopoulos et al. 2020, sec. 3.4);
* ``recurrent-performer``: the same with ``qkv.Favor(D, seed=0)`` (M = D ln D features);
* ``kv-cache``: ``qkv.nn.cache.KVCache.append(k_t, v_t)`` then
  ``torch.nn.functional.scaled_dot_product_attention(q_t, keys, values)`` over every stored
  key -- O(position x D) work a token.

How a position P is measured: the state or cache is prefilled with P random tokens
(``LinearAttentionState.extend``, ``KVCache.append`` of the whole prompt; not timed), then
timed in blocks of ``tokens_per_block`` steps (default 16): the tokens at positions P to
P + 15. Before every block the decoder is rewound to P, outside the timed region: the cache by
setting ``cache.position = P`` (its capacity is P + tokens_per_block, so it never overflows),
the recurrent state by a deep copy of the prefilled one. Time a token = the block's time / its
tokens; reported is the median over blocks (at least 5, and as many as fit in
``--min-run-time`` seconds), with the quartiles. The timing loop is ``time.perf_counter`` of
its own rather than ``torch.utils.benchmark``: the rewind must happen between blocks and
outside the clock, and ``Timer.timeit`` runs extra, uncounted warm-up statements that would
move the position. One warm-up block runs first.

The command line (``qkv.cli.bench_decode``) parses its arguments and calls these; each
measurement runs in a fresh process (:func:`measure_in_child`).

Shape alphabet: B batch, H heads (= key/value heads here), P position (tokens before the new
one), D head dim, M features.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch

from ..nn.cache import KVCache
from ..ops.linear import Favor, LinearAttentionState
from ..training import preserve_torch_state
from .report import _cpu_model, _one_line, _qkv_version, write_json_atomic
from .specs import _choose, _positive, bounded_int, num_features

__all__ = [
    "DECODE_IMPLS",
    "DEFAULT_POSITIONS",
    "GROWTH_TARGET",
    "MAX_POSITION",
    "MIN_BLOCKS",
    "DecodeConfig",
    "decode_config",
    "decode_environment",
    "decode_markdown",
    "decode_ratios",
    "measure_decode",
    "measure_in_child",
    "run_decode",
]

B, H, D = 1, 8, 64
DECODE_IMPLS = ("recurrent", "recurrent-performer", "kv-cache")
DEFAULT_POSITIONS = (1024, 16384)
MAX_POSITION = 262144  # a KV cache of 2 x 0.5 GiB at B=1, H=8, D=64, fp32
MIN_BLOCKS = 5
GROWTH_TARGET = 1.2  # the issue's: recurrent per-token time at 16k within 1.2x of that at 1k
_FEATURE_MAPS = {"recurrent": "linear", "recurrent-performer": "performer"}  # for M


@dataclass(frozen=True)
class DecodeConfig:
    """What ``qkv bench-decode`` measures (validated by :func:`decode_config`).

    Attributes:
        positions: Tokens before the timed one.
        tokens_per_block: Steps timed together between rewinds.
        min_run_time: Seconds of timed blocks per measurement (after at least 5 blocks).
        threads: torch threads; None keeps torch's default.
    """

    positions: tuple[int, ...] = DEFAULT_POSITIONS
    impls: tuple[str, ...] = DECODE_IMPLS
    tokens_per_block: int = 16
    min_run_time: float = 0.5
    threads: int | None = None


def decode_config(
    *,
    positions: Iterable[int | str] = DEFAULT_POSITIONS,
    impls: Iterable[str] = DECODE_IMPLS,
    tokens_per_block: int | str = 16,
    min_run_time: float | str = 0.5,
    threads: int | str | None = None,
) -> DecodeConfig:
    """A validated :class:`DecodeConfig`; ValueError naming the bad value and the fix."""
    return DecodeConfig(
        positions=tuple(dict.fromkeys(_position(p) for p in positions)),
        impls=_choose("decoder", impls, DECODE_IMPLS),
        tokens_per_block=_positive("--tokens-per-block", tokens_per_block, int),
        min_run_time=_positive("--min-run-time", min_run_time, float),
        threads=None if threads is None else _positive("--threads", threads, int),
    )


def _position(p: int | str) -> int:
    return bounded_int("--positions", "P", p, MAX_POSITION, "positions like 1024 16384")


# ---- one measurement ------------------------------------------------------------------------


def _decoder(impl: str, P: int, n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(step, rewind)`` for ``impl`` prefilled with P tokens: ``step`` generates one token,
    ``rewind`` puts the decoder back at position P."""
    torch.manual_seed(0)
    return _kv_cache_decoder(P, n) if impl == "kv-cache" else _recurrent_decoder(impl, P)


def _kv_cache_decoder(P: int, n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """:func:`_decoder` of ``kv-cache``: room for the ``n`` tokens of a block after P."""
    cache = KVCache(B, H, D, P + n)
    cache.append(torch.randn(B, H, P, D), torch.randn(B, H, P, D))  # the prompt's keys
    q, k, v = (torch.randn(B, H, 1, D) for _ in range(3))  # (B, H, 1, D) each
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> None:
        keys, values, _ = cache.append(k, v)  # (B, H, position, D) each
        sdpa(q, keys, values)  # (B, H, 1, D)

    def rewind() -> None:
        cache.position = P

    return step, rewind


def _recurrent_decoder(impl: str, P: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """:func:`_decoder` of ``recurrent`` (elu) and ``recurrent-performer`` (FAVOR+)."""
    feature_map = Favor(D, seed=0).eval() if impl == "recurrent-performer" else "elu"
    prefilled = LinearAttentionState(feature_map)
    prefilled.extend(*(torch.randn(B, H, P, D) for _ in range(3)))  # the prompt
    q, k, v = (torch.randn(B, H, D) for _ in range(3))  # (B, H, D) each
    live = [prefilled]

    def step() -> None:
        live[0].step(q, k, v)  # (B, H, D)

    def rewind() -> None:
        live[0] = copy.deepcopy(prefilled)

    return step, rewind


def _time_blocks(
    step: Callable[[], None], rewind: Callable[[], None], n: int, min_run_time: float
) -> list[float]:
    """Seconds a token, one entry per timed block of ``n`` steps, each from a rewind."""
    rewind()
    for _ in range(n):  # warm-up block
        step()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < MIN_BLOCKS or time.perf_counter() - started < min_run_time:
        rewind()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        times.append((time.perf_counter() - t0) / n)
    return times


@preserve_torch_state()
def measure_decode(impl: str, P: int, config: DecodeConfig) -> dict:
    """One record: per-token time of ``impl`` at position ``P`` (or why it failed). Torch's
    random state (the decoder is seeded) is put back afterwards."""
    n = config.tokens_per_block
    rec = dict(
        impl=impl,
        position=P,
        B=B,
        H=H,
        D=D,
        dtype="fp32",
        features=num_features(_FEATURE_MAPS.get(impl, "")),
        positions_timed=[P, P + n - 1],
        tokens_per_block=n,
        status="",
        reason="",
        us_per_token=None,
        us_q1=None,
        us_q3=None,
        blocks=None,
        prefill_s=None,
    )
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            step, rewind = _decoder(impl, P, n)
            rec["prefill_s"] = time.perf_counter() - t0
            times = _time_blocks(step, rewind, n, config.min_run_time)
    except (MemoryError, RuntimeError, ValueError) as e:
        oom = isinstance(e, MemoryError) or "allocate" in str(e)
        rec.update(status="oom" if oom else "error", reason=_one_line(e))
        return rec
    q1, _, q3 = statistics.quantiles(times, n=4)  # (at least MIN_BLOCKS = 5 times)
    rec.update(
        status="ok",
        us_per_token=statistics.median(times) * 1e6,
        us_q1=q1 * 1e6,
        us_q3=q3 * 1e6,
        blocks=len(times),
    )
    return rec


def measure_in_child(impl: str, P: int, config: DecodeConfig) -> dict:
    """:func:`measure_decode` in a fresh Python process, so that no measurement runs on the heap
    an earlier one left behind (a 16k prefill's freed buffers moved the per-token time of a
    later decoder by up to 1.35x when all ran in one process)."""
    code = (
        "import json, sys; from qkv.bench.decode import DecodeConfig, measure_decode; "
        "import torch; c = DecodeConfig(**json.loads(sys.argv[1])); "
        "c.threads and torch.set_num_threads(c.threads); "
        "print(json.dumps(measure_decode(sys.argv[2], int(sys.argv[3]), c)))"
    )
    args = json.dumps(dict(asdict(config), threads=config.threads or torch.get_num_threads()))
    proc = subprocess.run(  # a failed child is a record: its exit code is read below
        [sys.executable, "-c", code, args, impl, str(P)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(
            impl=impl,
            position=P,
            status="error",
            reason=f"child exited {proc.returncode}: {tail}",
            us_per_token=None,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- many, the ratios, the JSON, the table ---------------------------------------------------


def run_decode(
    config: DecodeConfig,
    json_path: Path | None = None,
    *,
    log: TextIO | None = None,
    previous: list[dict] | None = None,
) -> dict:
    """Measure every (position, decoder), a progress line each on ``log`` (stderr); rewrite
    ``json_path`` after each. Returns the JSON's content: the environment, ``records`` and
    ``ratios`` (:func:`decode_ratios`). ``previous``: records of an earlier run to keep."""
    log = log or sys.stderr
    done = {(r["impl"], r["position"]): r for r in previous or () if r.get("status") == "ok"}
    env = decode_environment(config)
    jobs = [(impl, P) for P in config.positions for impl in config.impls]
    # The threads are the children's (measure_in_child): this process keeps its own.
    print(
        f"qkv bench-decode: {len(jobs)} measurements, {env['threads']} threads",
        file=log,
        flush=True,
    )
    records: list[dict] = []
    result = dict(env, records=records, ratios=decode_ratios(records))
    for i, (impl, P) in enumerate(jobs, 1):
        old = done.get((impl, P))
        records.append(dict(old, resumed=True) if old else measure_in_child(impl, P, config))
        result["ratios"] = decode_ratios(records)
        print(
            f"[{i:>{len(str(len(jobs)))}}/{len(jobs)}] {_progress(records[-1])}",
            file=log,
            flush=True,
        )
        if json_path is not None:
            write_json_atomic(json_path, result)
    return result


def _progress(r: dict) -> str:
    head = f"P={r['position']:<6} {r['impl']:<19}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    return (
        f"{head} {r['us_per_token']:9.1f} us/token (quartiles {r['us_q1']:.1f}-"
        f"{r['us_q3']:.1f}, {r['blocks']} blocks; prefill {r['prefill_s']:.2f} s)"
        + (" (earlier run)" if r.get("resumed") else "")
    )


def decode_ratios(records: Iterable[dict]) -> dict:
    """Ratios of the median per-token times.

    Returns:
        ``growth``: per decoder, time at the last position over time at the first (the
        positions in the order given; 1 = flat); ``vs_kv_cache``: per recurrent decoder and
        position, its time over the KV-cached decoder's; ``target``: the issue's, recurrent
        (elu) growth <= 1.2 (``met`` None when not measured).
    """
    t = {(r["impl"], r["position"]): r["us_per_token"] for r in records if r["status"] == "ok"}
    positions = list(dict.fromkeys(r["position"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    growth = []
    if len(positions) > 1:
        lo, hi = positions[0], positions[-1]
        growth = [
            dict(impl=i, **{"from": lo, "to": hi}, ratio=t[i, hi] / t[i, lo])
            for i in impls
            if (i, lo) in t and (i, hi) in t
        ]
    vs = [
        dict(impl=i, position=P, ratio=t[i, P] / t["kv-cache", P])
        for i in impls
        if i != "kv-cache"
        for P in positions
        if (i, P) in t and ("kv-cache", P) in t
    ]
    rec = next((g for g in growth if g["impl"] == "recurrent"), None)
    target = dict(
        what="recurrent (elu) per-token time, last position over first",
        goal=f"<= {GROWTH_TARGET}",
        value=rec["ratio"] if rec else None,
        met=None if rec is None else rec["ratio"] <= GROWTH_TARGET,
        positions=[rec["from"], rec["to"]] if rec else None,
    )
    return dict(growth=growth, vs_kv_cache=vs, target=target)


def decode_environment(config: DecodeConfig) -> dict:
    """Device, versions, CPU, threads and the fixed shapes, for the JSON."""
    return dict(
        benchmark="decode",
        device="cpu",
        cpu=_cpu_model(),
        threads=config.threads or torch.get_num_threads(),
        torch=torch.__version__,
        qkv=_qkv_version(),
        python=platform.python_version(),
        platform=platform.platform(),
        config=dict(
            B=B,
            H=H,
            D=D,
            dtype="fp32",
            positions=list(config.positions),
            impls=list(config.impls),
            tokens_per_block=config.tokens_per_block,
            min_run_time=config.min_run_time,
            min_blocks=MIN_BLOCKS,
            performer_features=num_features("performer"),
            performer_seed=0,
            timing=(
                "median over blocks of tokens_per_block steps from position P, "
                "rewound to P between blocks (not timed); time.perf_counter"
            ),
        ),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def decode_markdown(result: dict) -> str:
    """The run as Markdown: per-token time per position and decoder, the ratios, the
    target."""
    records = result["records"]
    impls = list(dict.fromkeys(r["impl"] for r in records))
    positions = list(dict.fromkeys(r["position"] for r in records))
    t = {(r["impl"], r["position"]): r for r in records}
    recurrent = [i for i in impls if i != "kv-cache"]
    vs = {(v["impl"], v["position"]): v["ratio"] for v in result["ratios"]["vs_kv_cache"]}
    cols = [f"{i} us" for i in impls] + (
        [f"{i} / kv-cache" for i in recurrent] if "kv-cache" in impls else []
    )
    lines = ["| position | " + " | ".join(cols) + " |", "|---:|" + "---:|" * len(cols)]
    for P in positions:
        cells = [_us(t.get((i, P))) for i in impls]
        if "kv-cache" in impls:
            cells += [f"{vs[i, P]:.3f}" if (i, P) in vs else "" for i in recurrent]
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    growth = result["ratios"]["growth"]
    if growth:
        lines += [
            "",
            f"Per-token time at position {growth[0]['to']} over that at {growth[0]['from']}:",
        ]
        lines += [f"- {g['impl']}: x{g['ratio']:.3f}" for g in growth]
    target = result["ratios"]["target"]
    if target["met"] is not None:
        lo, hi = target["positions"]
        lines += [
            "",
            (
                f"Target, recurrent per-token time flat in the position ({hi} vs {lo}, "
                f"{target['goal']}): x{target['value']:.3f}, "
                f"{'met' if target['met'] else 'NOT met'}."
            ),
        ]
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        lines += ["", "Not measured:"]
        lines += [f"- {r['impl']} at {r['position']}: {r['status']}, {r['reason']}" for r in failed]
    return "\n".join(lines)


def _us(r: dict | None) -> str:
    if r is None:
        return ""
    return f"{r['us_per_token']:.1f}" if r["status"] == "ok" else r["status"]
