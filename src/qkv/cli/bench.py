"""``qkv bench``: the tiled backend against torch's SDPA with dense masks, in time and memory.

Four cases -- no mask, causal, a sliding window of 256 keys, packed documents of 512 to 2048
tokens -- at lengths T, in float32 and bfloat16, forward (no_grad) and forward+backward, for
four implementations:

* ``tiled``: ``qkv.scaled_dot_product_attention(backend="tiled")`` with the structured mask as
  ``mask_mod`` (``is_causal=True`` for causal, nothing for none);
* ``auto``: the same call with ``backend="auto"`` (the dispatcher's choice is recorded);
* ``torch-dense``: ``torch.nn.functional.scaled_dot_product_attention`` called directly, with
  the structured mask as a dense bool ``attn_mask`` from ``qkv.masks.to_dense`` -- the peer
  every ratio is taken against;
* ``reference``: ``backend="reference"``, the plain (T, S) twin.

Each measurement runs in a fresh process so that its peak memory is its own: peak extra
memory = peak resident memory over the warm-up call minus the resident memory before the mask
was built (so a dense mask counts; q, k, v do not). Time = median of ``torch.utils.benchmark``
``blocked_autorange`` with all of torch's threads. FLOPs are counted once, the same for every
implementation: ``4*B*H*T*S*D`` forward over the pairs the mask allows (halved when causal), 3.5x
that for forward+backward (STYLE.md 15), so GFLOP/s compares useful work.

Linear attention (``--impls linear performer torch``; cases none and causal only, others are
skipped with the reason recorded):

* ``linear``: ``qkv.linear_attention`` with the elu feature map (``is_causal=True`` for causal);
* ``performer``: the same with ``feature_map=qkv.Favor(D, seed=0)`` (M = D ln D features);
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` called natively, no mask
  (``is_causal=True`` for causal): SDPA's best call, a flash kernel with O(T) memory -- the
  peer the linear ratios are taken against. Like torch-dense it is skipped beyond
  ``DENSE_MAX_T`` unless ``--all`` (its time grows as T^2: tens of seconds a call at 64k).

Linear records count the linear form's own FLOPs (:func:`linear_attention_flops`), so their
GFLOP/s says how well that kernel uses the CPU; it does not compare with the exact rows'
GFLOP/s (another function, far less work): compare time. A run with any linear impl writes
``linear.json``/``linear.png`` instead of ``tiled.json``/``tiled.png``.

Shape alphabet: B batch, H heads, T query length, S key length (= T here), D head dim,
M features, Dv value dim.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ContextManager, TextIO

import torch
from torch import Tensor

from .. import masks
from ..dispatch import backend_names, select
from ..functional import linear_attention, scaled_dot_product_attention
from ..ops import AttentionCall
from ..ops.linear import BLOCK, CHUNK_SIZE, Favor
from ..ops.linear.feature_maps import default_num_features
from ..training import preserve_torch_state, run_directory

__all__ = [
    "add_parser", "run_bench_cli", "BenchConfig", "Spec", "bench_config", "grid",
    "attention_flops", "mask_density", "document_lengths", "document_ids", "skip_reason",
    "mask_mod_for", "spec_flops", "dense_bytes", "available_bytes", "measure",
    "run_measurement", "worker_main", "run_specs", "add_ratios", "markdown_table",
    "environment", "write_json_atomic", "linear_attention_flops", "num_features", "run_name",
    "load_previous", "crossovers", "crossover_marks", "Crossover", "ratio_of", "out_folder",
    "CASES", "IMPLS", "DTYPES", "MODES", "PEER", "LINEAR_IMPLS", "ALL_IMPLS", "PEERS",
]

B, H, D = 1, 8, 64
CASES = ("none", "causal", "window", "document")
IMPLS = ("tiled", "auto", "torch-dense", "reference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("fwd", "fwdbwd")
PEER = "torch-dense"
LINEAR_IMPLS = ("linear", "performer", "torch")  # opt-in: not among the default --impls
ALL_IMPLS = IMPLS + LINEAR_IMPLS
LINEAR_CASES = ("none", "causal")  # the only cases linear attention and native SDPA take
PEERS = {"tiled": PEER, "auto": PEER, "linear": "torch", "performer": "torch"}  # impl -> peer
DEFAULT_LENGTHS = (1024, 2048, 4096)
MAX_T = 65536
WINDOW = 256  # sliding_window(256): the last 256 keys and the query's own
DOC_MIN, DOC_MAX, DOC_SEED = 512, 2048, 0
BACKWARD_FACTOR = 2.5  # backward = 2.5x forward (FlashAttention's count): fwd+bwd = 3.5x fwd
# Beyond these lengths the dense implementations take minutes a call on a CPU (all T*S pairs,
# whatever the mask): skipped unless --all, with the reason recorded.
DENSE_MAX_T = 16384
REFERENCE_MAX_T = 4096
MEMORY_SHARE = 0.8  # skip when the estimate exceeds this share of the available memory


@dataclass(frozen=True)
class Spec:
    """One measurement: a case at length T, in one dtype and mode, by one implementation."""

    case: str
    T: int
    dtype: str
    mode: str
    impl: str


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how (validated by :func:`bench_config`).

    Attributes:
        min_run_time: Seconds ``blocked_autorange`` spends timing each measurement.
        timeout: Seconds one measurement (its whole process) may take.
        threads: torch threads in each measurement; None keeps torch's default.
        run_all: Also run the dense implementations at lengths where they are hopeless.
    """

    cases: tuple[str, ...] = CASES
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    dtypes: tuple[str, ...] = tuple(DTYPES)
    modes: tuple[str, ...] = MODES
    impls: tuple[str, ...] = IMPLS
    min_run_time: float = 0.5
    timeout: float = 600.0
    threads: int | None = None
    run_all: bool = False


# ---- the command line ---------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv bench``."""
    p = sub.add_parser(
        "bench",
        help="time the tiled backend against torch's SDPA with dense masks",
        description="Time and peak memory of qkv's tiled backend, auto, torch's SDPA with the "
        "mask passed densely, and the reference backend, on no mask, causal, a 256-key "
        "sliding window and packed documents; with --impls linear performer torch, linear "
        "attention against torch's native SDPA on no mask and causal. Each measurement runs "
        "in a fresh process; a progress line per measurement goes to stderr, a Markdown table "
        "to stdout; --out DIR writes DIR/tiled.json (after every measurement) and "
        "DIR/tiled.png, or DIR/linear.json and DIR/linear.png when a linear impl is asked for.",
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), metavar="CASE",
                   help=f"cases to run (default: all of {', '.join(CASES)})")
    p.add_argument("--lengths", nargs="+", default=[str(t) for t in DEFAULT_LENGTHS],
                   metavar="T", help=f"sequence lengths, 1 to {MAX_T} (default: 1024 2048 4096)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), metavar="DTYPE",
                   help="fp32 and/or bf16 (default: both)")
    p.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE",
                   help="fwd (no_grad) and/or fwdbwd (default: both)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), metavar="IMPL",
                   help=f"implementations (default: {', '.join(IMPLS)}); also "
                   f"{', '.join(LINEAR_IMPLS)}: linear attention (elu), FAVOR+ and torch's "
                   "native SDPA, the linear ones' peer (cases none and causal only)")
    p.add_argument("--min-run-time", default="0.5", metavar="SECONDS",
                   help="timing budget of each measurement (default 0.5)")
    p.add_argument("--timeout", default="600", metavar="SECONDS",
                   help="limit on each measurement's process (default 600)")
    p.add_argument("--threads", default=None, metavar="N",
                   help="torch threads per measurement (default: torch's own)")
    p.add_argument("--all", action="store_true", dest="run_all",
                   help=f"also run torch-dense and torch beyond T={DENSE_MAX_T} and reference "
                   f"beyond T={REFERENCE_MAX_T} (memory permitting; torch, O(T) memory, takes "
                   "tens of seconds a call at T=65536)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write DIR/tiled.json and DIR/tiled.png (linear.json, linear.png with "
                   "a linear impl)")
    p.add_argument("--resume", action="store_true",
                   help="keep the measured records of the JSON in --out from an earlier run of "
                   "the same machine and torch, and measure only the rest")
    p.set_defaults(func=run_bench_cli)


def run_bench_cli(args: argparse.Namespace) -> int:
    """``qkv bench``: validate, measure, write, print the table; 0 when it ran to the end."""
    config = bench_config(
        cases=args.cases, lengths=args.lengths, dtypes=args.dtypes, modes=args.modes,
        impls=args.impls, min_run_time=args.min_run_time, timeout=args.timeout,
        threads=args.threads, run_all=args.run_all,
    )
    out = Path(args.out) if args.out else None
    if args.resume and out is None:
        raise ValueError("--resume continues the run whose JSON is in --out DIR; give --out")
    name = run_name(config.impls)
    json_path = out / f"{name}.json" if out else None
    try:
        with out_folder(out):
            previous = load_previous(json_path, environment(config)) if args.resume else None
            records = run_specs(grid(config), config, json_path, previous=previous)
    except KeyboardInterrupt:
        print(f"\nqkv bench: interrupted{f'; what was measured is in {json_path}' if out else ''}",
              file=sys.stderr)
        return 130
    print(markdown_table(records))
    if out:
        print(f"\nwrote {json_path}")
        _plot(records, out / f"{name}.png")
    return 0


def out_folder(out: Path | None) -> ContextManager:
    """``with out_folder(out):`` makes ``--out`` and checks it can be written to now, not
    after the first measurement (ValueError saying why not), and removes it again if the run
    fails or is interrupted before writing in it. Does nothing when ``out`` is None."""
    return run_directory(out) if out is not None else nullcontext()


def run_name(impls: Iterable[str]) -> str:
    """``"linear"`` when a linear impl (or its peer ``torch``) is measured, else ``"tiled"``:
    the base name of the run's JSON and PNG."""
    return "linear" if set(impls) & set(LINEAR_IMPLS) else "tiled"


def _plot(records: list[dict], path: Path) -> None:
    from ..viz.benchplot import plot_bench  # matplotlib is optional: import only when plotting

    try:
        print(f"wrote {plot_bench(records, path, marks=crossover_marks(records))}")
    except ImportError:  # the measurements are in the JSON already: say so, do not fail
        print("no plot: matplotlib is not installed (pip install 'qkv[viz]')", file=sys.stderr)
    except OSError as e:
        print(f"no plot: cannot write {path} ({e.strerror or e})", file=sys.stderr)


# ---- configuration ------------------------------------------------------------------------


def bench_config(*, cases: Iterable[str] = CASES, lengths: Iterable[int | str] = DEFAULT_LENGTHS,
                 dtypes: Iterable[str] = tuple(DTYPES), modes: Iterable[str] = MODES,
                 impls: Iterable[str] = IMPLS, min_run_time: float | str = 0.5,
                 timeout: float | str = 600.0, threads: int | str | None = None,
                 run_all: bool = False) -> BenchConfig:
    """A validated :class:`BenchConfig`; ValueError naming the bad value and the choices."""
    return BenchConfig(
        cases=_choose("case", cases, CASES),
        lengths=tuple(dict.fromkeys(_length(t) for t in lengths)),
        dtypes=_choose("dtype", dtypes, tuple(DTYPES)), modes=_choose("mode", modes, MODES),
        impls=_choose("impl", impls, ALL_IMPLS),
        min_run_time=_positive("--min-run-time", min_run_time, float),
        timeout=_positive("--timeout", timeout, float),
        threads=None if threads is None else _positive("--threads", threads, int),
        run_all=bool(run_all),
    )


def _choose(what: str, given: Iterable[str], allowed: tuple[str, ...]) -> tuple[str, ...]:
    given = tuple(dict.fromkeys(given))  # keep the order, drop repeats
    for name in given:
        if name not in allowed:
            raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(allowed)}")
    if not given:
        raise ValueError(f"give at least one {what} ({', '.join(allowed)})")
    return given


def _length(t: int | str) -> int:
    return bounded_int("--lengths", "T", t, MAX_T, "lengths like 1024 4096")


def bounded_int(flag: str, name: str, value: int | str, most: int, example: str) -> int:
    """``value`` as an int in ``[1, most]``, or a ValueError naming ``flag`` and an example."""
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{flag}: {value!r} is not an integer; give {example}") from None
    if not 1 <= n <= most:
        raise ValueError(f"{flag}: {name}={n} is out of range; give 1 <= {name} <= {most}")
    return n


def _positive(name: str, value: float | str, kind: type) -> float | int:
    what = f"{'an' if kind is int else 'a'} {kind.__name__} > 0"
    try:
        x = kind(value)
    except ValueError:
        raise ValueError(f"{name}: expected {what}, got {value!r}") from None
    if not x > 0:
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return x


def grid(config: BenchConfig) -> list[Spec]:
    """Every measurement of ``config``, by T, then case, dtype, mode and implementation."""
    return [Spec(c, T, d, m, i) for T in config.lengths for c in config.cases
            for d in config.dtypes for m in config.modes for i in config.impls]


# ---- the cases: masks, their density, FLOPs ------------------------------------------------


def document_lengths(T: int, seed: int = DOC_SEED) -> list[int]:
    """Lengths of the packed documents: uniform in [512, 2048], seeded, the last cut at T."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < T:
        lengths.append(min(rng.randint(DOC_MIN, DOC_MAX), T - sum(lengths)))
    return lengths


def document_ids(T: int, seed: int = DOC_SEED) -> Tensor:
    """Document id of each token, for ``qkv.masks.document``.

    Shape:
        ``(1, T)``, int64.
    """
    lengths = torch.tensor(document_lengths(T, seed))
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]  # (1, T)


def mask_mod_for(case: str, T: int) -> masks.MaskMod | None:
    """The structured mask of ``case`` (None for "none")."""
    return {"none": lambda: None, "causal": masks.causal,
            "window": lambda: masks.sliding_window(WINDOW),
            "document": lambda: masks.document(document_ids(T))}[case]()


def mask_density(case: str, T: int, *, window: int = WINDOW) -> float:
    """Share of the T x T (query, key) pairs the case lets attend, for counting FLOPs.

    Causal counts 1/2 by convention (STYLE.md 15: halved when causal); the window (of
    ``window`` keys before the query) and the documents count their exact pairs, in closed
    form (no T x T mask is built).
    """
    if case == "none":
        return 1.0
    if case == "causal":
        return 0.5
    if case == "window":  # row i sees min(i, window) + 1 keys
        n = min(T, window + 1)
        return (n * (n + 1) // 2 + (T - n) * (window + 1)) / (T * T)
    if case == "document":
        return sum(n * n for n in document_lengths(T)) / (T * T)
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")


def attention_flops(B: int, H: int, T: int, S: int, D: int, *, density: float = 1.0,
                    backward: bool = False) -> float:
    """FLOPs of attention, counted as STYLE.md 15 does.

    Forward: ``4 * B * H * T * S * D`` (two matmuls of ``2 * T * S * D``) times the share of
    pairs the mask allows (0.5 for causal). Backward adds 2.5x the forward (five matmuls
    against the forward's two), so forward+backward is 3.5x the forward.
    """
    fwd = 4.0 * B * H * T * S * D * density
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd


def linear_attention_flops(B: int, H: int, T: int, S: int, D: int, *, M: int,
                           Dv: int | None = None, causal: bool = False, favor: bool = False,
                           backward: bool = False, chunk_size: int = CHUNK_SIZE,
                           block: int = BLOCK) -> float:
    """FLOPs of ``qkv.linear_attention`` as its kernels compute it: the matmuls, 2 per
    multiply-add, at the sizes they are issued.

    Left out, as the exact count leaves out the softmax: elementwise work (the feature map's
    elu or exp, masking, the normaliser's sums and division).

    * Non-causal (``phi(Q) (phi(K)^T V)``): ``phi(K)^T V`` is ``2*S*M*Dv``; the readout
      ``phi(Q) kv`` and ``phi(Q) z`` are ``2*T*M*Dv + 2*T*M``. About ``4*T*M*Dv`` for T = S.
    * Causal, chunk-wise (T = S; ``ops/linear/chunk.py``): per block of P <= ``block``
      positions in n chunks of L = ``chunk_size`` (padded to n*L): the intra-chunk
      ``(L, L)`` scores and their product with V, computed in full and masked after
      (``2*n*L*L*(M + Dv)``); each chunk's ``phi(K)^T V`` (``2*n*L*M*Dv``); the ``(n, n)``
      carry matrix times the chunks' sums (``2*n*n*(M*Dv + M)``); the readout against the
      incoming state (``2*n*L*(M*Dv + M)``).
      About ``2*T*(L*(M + Dv) + 2*M*Dv)`` plus the carry: 2.1x the non-causal count at
      L = M = Dv = 64 -- the price of matmul speed.
    * FAVOR+ (``favor``): plus the random projections of queries and keys, ``2*(T + S)*D*M``.
    * Backward: 2x the forward (autograd gives each matmul two of its size), so
      forward+backward is 3x -- not the exact count's 3.5x, which includes FlashAttention's
      recomputation.

    The count measures the kernel's own arithmetic: GFLOP/s from it says how well linear
    attention uses the CPU, and is not comparable with exact attention's GFLOP/s (a different
    function doing far less work). Compare the two by time.
    """
    Dv = D if Dv is None else Dv
    if not causal:
        fwd = 2.0 * S * M * Dv + 2.0 * T * (M * Dv + M)
    else:
        block = max(chunk_size, block // chunk_size * chunk_size)  # as the kernel rounds it
        fwd = 0.0
        for start in range(0, T, block):
            P = min(block, T - start)
            L = max(1, min(chunk_size, P))
            n = -(-P // L)
            fwd += (2.0 * n * L * L * (M + Dv) + 2.0 * n * L * M * Dv
                    + 2.0 * n * n * (M * Dv + M) + 2.0 * n * L * (M * Dv + M))
    if favor:
        fwd += 2.0 * (T + S) * D * M
    return B * H * fwd * (3.0 if backward else 1.0)


def num_features(impl: str, D: int = D) -> int | None:
    """M of a linear impl's feature map (D for elu, D ln D for FAVOR+), None for the others."""
    return {"linear": D, "performer": default_num_features(D)}.get(impl)


def spec_flops(spec: Spec) -> float:
    """FLOPs of one measurement: exact attention's count (the same for every exact
    implementation of it), or for linear and performer the linear form's own
    (:func:`linear_attention_flops`)."""
    M = num_features(spec.impl)
    if M is not None:
        return linear_attention_flops(B, H, spec.T, spec.T, D, M=M, causal=spec.case == "causal",
                                      favor=spec.impl == "performer",
                                      backward=spec.mode == "fwdbwd")
    return attention_flops(B, H, spec.T, spec.T, D, density=mask_density(spec.case, spec.T),
                           backward=spec.mode == "fwdbwd")


# ---- skipping what cannot finish -----------------------------------------------------------


def dense_bytes(spec: Spec, backend: str | None) -> int:
    """Rough peak memory of a dense implementation, bytes (0 for tiled/torch on none/causal).

    torch-dense: the bool mask (T*S bytes) plus torch's copy of it in the query's dtype,
    expanded to every head (B*H*T*S elements: 2.1 GiB measured at T=8192 fp32, against 64 MiB
    for the bool mask). reference: its (B, H, T, S) float32 buffers, ~3 forward and ~7 with
    backward (measured: 400 and 820 MiB at T=2048), plus the bool mask.
    """
    T, masked = spec.T, spec.case in ("window", "document")
    pairs = B * H * T * T
    if backend == PEER:
        return T * T + pairs * DTYPES[spec.dtype].itemsize if masked else 0
    if backend == "reference":
        return T * T * masked + pairs * 4 * (7 if spec.mode == "fwdbwd" else 3)
    return 0


def skip_reason(spec: Spec, backend: str | None, *, run_all: bool,
                available: int | None) -> str | None:
    """Why ``spec`` is not worth running with ``backend`` (the qkv backend that runs it, the
    impl's name for torch-dense, torch, linear and performer), or None to run it."""
    if backend in LINEAR_IMPLS and spec.case not in LINEAR_CASES:
        return _case_reason(backend, spec.case)
    limit = {PEER: DENSE_MAX_T, "torch": DENSE_MAX_T, "reference": REFERENCE_MAX_T}.get(backend)
    need = dense_bytes(spec, backend)
    if available is not None and need > MEMORY_SHARE * available:
        return (f"would need ~{need / 2**30:.1f} GiB (dense T x S buffers), "
                f"{available / 2**30:.1f} GiB available")
    if limit is not None and spec.T > limit and not run_all:
        dense = spec_flops(Spec("none", spec.T, spec.dtype, spec.mode, spec.impl))
        memory = f" and needs ~{need / 2**30:.1f} GiB" if need else ""
        return (f"T={spec.T} > {limit}: {backend} computes all T*S pairs ({dense / 1e9:,.0f} "
                f"GFLOP a call){memory}; pass --all to run it")
    return None


def _case_reason(impl: str, case: str) -> str:
    if impl == "torch":
        return (f"torch is SDPA's native call with no mask or is_causal only; the {case} mask "
                f"densely is torch-dense")
    return (f"{impl} takes no {case} mask (linear attention has a kernel form for "
            f"{' and '.join(LINEAR_CASES)} only)")


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- one measurement, in its own process ---------------------------------------------------


def measure(spec: Spec, config: BenchConfig) -> dict:
    """Run ``spec`` in a fresh process; a record with ``status`` ok, skipped, timeout, oom or
    error and, when ok, ``time_s`` and ``peak_extra_mib``."""
    job = dict(asdict(spec), min_run_time=config.min_run_time, threads=config.threads,
               run_all=config.run_all)
    cmd = [sys.executable, "-c", "from qkv.cli.bench import worker_main; worker_main()",
           json.dumps(job)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=config.timeout,
                              env=_child_env())
    except subprocess.TimeoutExpired:
        return dict(status="timeout", reason=f"did not finish in {config.timeout:g} s (--timeout)")
    result = _parse_worker(proc)
    result["wall_s"] = time.perf_counter() - started
    return result


def _child_env() -> dict[str, str]:
    """This environment, with the qkv being run first on the child's path (a source tree
    that is not installed works too)."""
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _parse_worker(proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode < 0:  # killed by a signal: SIGKILL is the kernel's out-of-memory killer
        sig = -proc.returncode
        status = "oom" if sig == 9 else "error"
        return dict(status=status, reason=f"process killed by signal {sig}"
                    + (" (out of memory, most likely)" if sig == 9 else ""))
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(status="error", reason=f"exit code {proc.returncode}: {err}")


def worker_main() -> None:
    """Entry point of the measurement process: one JSON job in argv, one JSON line out."""
    job = json.loads(sys.argv[1])
    spec = Spec(**{k: job[k] for k in ("case", "T", "dtype", "mode", "impl")})
    try:
        result = run_measurement(spec, job["min_run_time"], job["threads"], job["run_all"])
    except (MemoryError, RuntimeError) as e:
        oom = isinstance(e, MemoryError) or "allocate" in str(e)  # torch: "can't allocate memory"
        result = dict(status="oom" if oom else "error", reason=_one_line(e))
    except Exception as e:  # noqa: BLE001  (any failure is a result to record, not a crash)
        result = dict(status="error", reason=_one_line(e))
    print(json.dumps(result))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


@preserve_torch_state()
def run_measurement(spec: Spec, min_run_time: float, threads: int | None = None,
                    run_all: bool = False) -> dict:
    """Measure ``spec`` in this process (see :func:`measure` for a fresh one). Torch's threads
    and random state are put back afterwards."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    grad = spec.mode == "fwdbwd"
    q, k, v = (torch.randn(B, H, spec.T, D, dtype=DTYPES[spec.dtype], requires_grad=grad)
               for _ in range(3))  # (B, H, T, D) each
    backend = _backend_of(spec, q, k, v)
    reason = skip_reason(spec, backend, run_all=run_all, available=available_bytes())
    if reason:  # only auto gets here skipped: the others are checked before their process
        return dict(status="skipped", reason=reason, backend=backend)
    _warm_small(spec, grad)
    before = _reset_peak_and_rss_kib()
    step = _step(_attend(spec), q, k, v, grad)  # builds the mask: it counts in the peak
    t0 = time.perf_counter()
    step()  # warm-up; also sets the memory high-water mark
    warmup_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    m = _time(step, min_run_time, warmup_s)
    return dict(status="ok", reason="", time_s=m.median, runs=m.number_per_run * len(m.times),
                warmup_s=warmup_s, peak_extra_mib=(peak - before) / 1024, backend=backend,
                threads=torch.get_num_threads())


def _time(step: Callable[[], None], min_run_time: float, warmup_s: float):
    """A torch.utils.benchmark Measurement of ``step`` with all of torch's threads (Timer's
    default is one). A call longer than the budget is timed once: blocked_autorange would
    spend one more, uncounted, call on choosing its block size."""
    from torch.utils import benchmark

    timer = benchmark.Timer("step()", globals={"step": step},
                            num_threads=torch.get_num_threads())
    if warmup_s > min_run_time:
        return timer.timeit(1)
    return timer.blocked_autorange(min_run_time=min_run_time)


def _warm_small(spec: Spec, grad: bool, T: int = 64) -> None:
    """One call of the same implementation at a small T: one-time set-up (the autograd
    engine's threads, lazily loaded kernels: ~40 MiB for a first backward) must not count in
    the measurement's peak."""
    small = Spec(spec.case, min(T, spec.T), spec.dtype, spec.mode, spec.impl)
    q, k, v = (torch.randn(B, H, small.T, D, dtype=DTYPES[spec.dtype], requires_grad=grad)
               for _ in range(3))  # (B, H, T, D) each
    _step(_attend(small), q, k, v, grad)()


def _backend_of(spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> str:
    """The qkv backend that runs ``spec`` ("torch-dense" for the peer); for auto, the
    dispatcher's choice for this very call."""
    if spec.impl in (PEER, "tiled", "reference", *LINEAR_IMPLS):
        return spec.impl
    call = AttentionCall.build(q, k, v, **_qkv_kwargs(spec.case, spec.T))
    return select(call, "auto").name


def _qkv_kwargs(case: str, T: int) -> dict:
    """How qkv is told the case's mask: nothing, is_causal, or mask_mod."""
    if case == "none":
        return {}
    if case == "causal":
        return {"is_causal": True}
    return {"mask_mod": mask_mod_for(case, T)}


def _attend(spec: Spec) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``attend(q, k, v) -> out`` for the implementation; masks are built here, once."""
    if spec.impl in (PEER, "torch"):  # torch only gets none and causal: no dense mask
        return _torch_dense(spec.case, spec.T)
    if spec.impl in ("linear", "performer"):
        causal = spec.case == "causal"
        feature_map = Favor(D, seed=0) if spec.impl == "performer" else "elu"
        return lambda q, k, v: linear_attention(q, k, v, feature_map=feature_map,
                                                is_causal=causal)
    kwargs = dict(_qkv_kwargs(spec.case, spec.T), backend=spec.impl)
    return lambda q, k, v: scaled_dot_product_attention(q, k, v, **kwargs)


def _torch_dense(case: str, T: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if case in ("none", "causal"):
        causal = case == "causal"
        return lambda q, k, v: sdpa(q, k, v, is_causal=causal)
    dense = masks.to_dense(mask_mod_for(case, T), B, H, T, T)  # (1, 1, T, S) bool
    return lambda q, k, v: sdpa(q, k, v, attn_mask=dense)


def _step(attend: Callable, q: Tensor, k: Tensor, v: Tensor, grad: bool) -> Callable[[], None]:
    def step() -> None:
        if not grad:
            with torch.no_grad():
                attend(q, k, v)
            return
        out = attend(q, k, v)  # (B, H, T, D)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None  # no accumulation: each call allocates as the first did
    return step


def _reset_peak_and_rss_kib() -> int:
    """Reset the process's peak RSS (so the imports' peak does not count) and return the RSS
    now, KiB, read from the same counter as the peak will be.

    Writing 5 to clear_refs sets the high-water mark to the current RSS (Linux >= 4.0), and
    ``ru_maxrss`` reads it back. Where that is not allowed, the RSS comes from statm and the
    peak is the process's lifetime peak, as ``benchmarks/bench_mha.py`` measures it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    except OSError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024


# ---- running many ---------------------------------------------------------------------------


def run_specs(specs: list[Spec], config: BenchConfig, json_path: Path | None = None,
              *, log: TextIO | None = None, previous: list[dict] | None = None) -> list[dict]:
    """Measure every spec (skipping the hopeless), a progress line each on ``log`` (stderr);
    rewrite ``json_path`` after each measurement, so an interrupted run keeps what it has.

    Args:
        previous: Records of an earlier run (:func:`load_previous`); a spec measured there
            ("ok") is taken from it, marked ``resumed``, and not measured again.
    """
    log = log or sys.stderr
    done = {_spec_key(r): r for r in previous or () if r.get("status") == "ok"}
    records: list[dict] = []
    env = environment(config)
    kept = sum(_spec_key(asdict(s)) in done for s in specs)
    print(f"qkv bench: {len(specs)} measurements"
          + (f" ({kept} kept from the earlier run)" if kept else "")
          + f", each in a fresh process (timeout {config.timeout:g} s)", file=log, flush=True)
    for i, spec in enumerate(specs, 1):
        old = done.get(_spec_key(asdict(spec)))
        records.append(_resumed(old) if old else _record(spec, config))
        add_ratios(records)
        print(f"[{i:>{len(str(len(specs)))}}/{len(specs)}] {_progress(records[-1])}",
              file=log, flush=True)
        if json_path is not None:
            write_json_atomic(json_path, dict(env, records=records))
    return records


def _spec_key(r: dict) -> tuple:
    return r["case"], r["T"], r["dtype"], r["mode"], r["impl"]


def _resumed(old: dict) -> dict:
    """An earlier run's record, without its ratios (recomputed against this run's peers)."""
    rec = {k: v for k, v in old.items() if "ratio_vs_" not in k}
    rec["resumed"] = True
    return rec


def _record(spec: Spec, config: BenchConfig) -> dict:
    """One record: the spec, its FLOPs, and the measurement or why it was not made."""
    flops = spec_flops(spec)
    base = dict(asdict(spec), S=spec.T, B=B, H=H, D=D, density=mask_density(spec.case, spec.T),
                flops=flops)
    if num_features(spec.impl) is not None:
        base["features"] = num_features(spec.impl)
    reason = _skip_before_start(spec, config)
    result = dict(status="skipped", reason=reason) if reason else measure(spec, config)
    rec = dict(base, status="", reason="", time_s=None, peak_extra_mib=None, gflop_per_s=None)
    rec.update(result)
    if rec["status"] == "ok":
        rec["gflop_per_s"] = flops / rec["time_s"] / 1e9
    return rec


def _skip_before_start(spec: Spec, config: BenchConfig) -> str | None:
    if spec.impl == "tiled" and "tiled" not in backend_names():
        return "backend 'tiled' is not registered in this qkv"
    if spec.impl == "auto":  # its backend is known only in its process, which checks there
        return None
    return skip_reason(spec, spec.impl, run_all=config.run_all, available=available_bytes())


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
            r[f"peak_ratio_vs_{tag}"] = (r["peak_extra_mib"] / peer["peak_extra_mib"]
                                         if peer["peak_extra_mib"] > 0 else None)


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
    return (f"{head} {_ms(r['time_s'])} ms  {r['peak_extra_mib']:9.1f} MiB  "
            f"{r['gflop_per_s']:7.1f} GFLOP/s"
            + (f"  x{ratio:.3f} vs {PEERS[r['impl']]}" if ratio else "") + via
            + (" (earlier run)" if r.get("resumed") else ""))


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:10.2f}" if ms >= 1 else f"{ms:10.4f}"


def markdown_table(records: list[dict]) -> str:
    """The records as a Markdown table (for benchmarks/RESULTS.md), then why any were not
    measured, grouped by reason. The ratio column is against each impl's peer
    (:data:`PEERS`), named in its header."""
    peers = list(dict.fromkeys(PEERS[r["impl"]] for r in records if r["impl"] in PEERS))
    header = f"vs {peers[0]}" if len(peers) == 1 else "vs peer" if peers else f"vs {PEER}"
    lines = [f"| T | case | dtype | mode | impl | ms | MiB | GFLOP/s | {header} |",
             "|---:|:---|:---:|:---:|:---|---:|---:|---:|---:|"]
    for r in records:
        if r["status"] == "ok":
            ratio = ratio_of(r)
            cells = [_ms(r["time_s"]).strip(), f"{r['peak_extra_mib']:.1f}",
                     f"{r['gflop_per_s']:.1f}", f"{ratio:.3f}" if ratio else ""]
        else:
            cells = [r["status"], "", "", ""]
        mode = "fwd+bwd" if r["mode"] == "fwdbwd" else r["mode"]
        lines.append("| " + " | ".join([str(r["T"]), r["case"], r["dtype"], mode, r["impl"],
                                        *cells]) + " |")
    if len(peers) > 1:
        lines += ["", "Peers: " + "; ".join(
            f"{', '.join(i for i in PEERS if PEERS[i] == p)} vs {p}" for p in peers) + "."]
    if any(num_features(r["impl"]) for r in records):
        lines += ["", "GFLOP/s of linear and performer count the linear form's own work "
                  "(not comparable with exact attention's): compare time."]
    notes = {}
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
            return (f"{head} is not faster than {self.peer} at T={self.lengths[-1]}, the "
                    f"longest measured: no crossover up to it")
        if self.below is None:
            return (f"{head} is faster than {self.peer} at every measured T, from "
                    f"T={self.T} (the shortest measured) on")
        return (f"{head} is faster than {self.peer} from T={self.T} on ({self.peer} as fast "
                f"or faster at T={self.below}; ratio 1 at T ~ {self.estimate:,.0f})")


def crossovers(records: Iterable[dict], impl: str = "linear", peer: str = "torch"
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
            if c.T is not None and c.below is not None:
                mode = "fwd+bwd" if c.mode == "fwdbwd" else c.mode
                marks.setdefault(c.case, []).append(
                    (c.estimate, f"{impl} {c.dtype} {mode} ~{c.estimate:,.0f}"))
    return marks


# ---- the run's environment and the JSON ----------------------------------------------------


def environment(config: BenchConfig) -> dict:
    """Device, versions, CPU, threads and the fixed shapes of a run, for its JSON."""
    linear = run_name(config.impls) == "linear"
    flops = "4*B*H*T*S*D*density forward; x3.5 forward+backward"
    extra = {}
    if linear:
        flops += ("; linear, performer: the linear form's matmuls "
                  "(qkv.cli.bench.linear_attention_flops), x3 forward+backward")
        extra = dict(linear_feature_map="elu", linear_features=num_features("linear"),
                     performer_features=num_features("performer"), performer_seed=0,
                     chunk_size=CHUNK_SIZE, block=BLOCK,
                     peers={i: p for i, p in PEERS.items() if i in config.impls})
    return dict(
        benchmark=run_name(config.impls), device="cpu", cpu=_cpu_model(),
        dtypes=list(config.dtypes), threads=config.threads or torch.get_num_threads(),
        torch=torch.__version__, qkv=_qkv_version(), python=platform.python_version(),
        platform=platform.platform(),
        config=dict(B=B, H=H, D=D, window=WINDOW, document_lengths=[DOC_MIN, DOC_MAX],
                    document_seed=DOC_SEED, min_run_time=config.min_run_time,
                    timeout_s=config.timeout, run_all=config.run_all, flops=flops, **extra),
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
        raise ValueError(f"--resume: {path} is not a benchmark JSON ({_one_line(e)}); move it "
                         f"away or drop --resume") from None
    for field in RESUME_MUST_MATCH:
        if data.get(field) != env.get(field):
            raise ValueError(f"--resume: {path} was measured with {field}="
                             f"{data.get(field)!r}, this run has {env.get(field)!r}; its "
                             f"times would not compare: give another --out or drop --resume")
    return records


def _qkv_version() -> str:
    try:
        return importlib.metadata.version("qkv")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` by a rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
