"""The benchmark's grid: what ``qkv bench`` measures, the cases' masks, their FLOPs, and which
measurements are skipped as hopeless (see :mod:`qkv.bench` for the whole benchmark).

Shape alphabet: B batch, H heads, T query length, S key length (= T here), D head dim,
M features, Dv value dim.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from .. import masks
from ..ops.linear import BLOCK, CHUNK_SIZE
from ..ops.linear.feature_maps import default_num_features

__all__ = [
    "ALL_IMPLS",
    "CASES",
    "DTYPES",
    "IMPLS",
    "LINEAR_IMPLS",
    "MODES",
    "PEER",
    "PEERS",
    "BenchConfig",
    "Spec",
    "attention_flops",
    "available_bytes",
    "bench_config",
    "bounded_int",
    "dense_bytes",
    "document_ids",
    "document_lengths",
    "grid",
    "linear_attention_flops",
    "mask_density",
    "mask_mod_for",
    "num_features",
    "run_name",
    "skip_reason",
    "spec_flops",
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


def run_name(impls: Iterable[str]) -> str:
    """``"linear"`` when a linear impl (or its peer ``torch``) is measured, else ``"tiled"``:
    the base name of the run's JSON and PNG."""
    return "linear" if set(impls) & set(LINEAR_IMPLS) else "tiled"


# ---- configuration ------------------------------------------------------------------------


def bench_config(
    *,
    cases: Iterable[str] = CASES,
    lengths: Iterable[int | str] = DEFAULT_LENGTHS,
    dtypes: Iterable[str] = tuple(DTYPES),
    modes: Iterable[str] = MODES,
    impls: Iterable[str] = IMPLS,
    min_run_time: float | str = 0.5,
    timeout: float | str = 600.0,
    threads: int | str | None = None,
    run_all: bool = False,
) -> BenchConfig:
    """A validated :class:`BenchConfig`; ValueError naming the bad value and the choices."""
    return BenchConfig(
        cases=_choose("case", cases, CASES),
        lengths=tuple(dict.fromkeys(_length(t) for t in lengths)),
        dtypes=_choose("dtype", dtypes, tuple(DTYPES)),
        modes=_choose("mode", modes, MODES),
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


_Number = TypeVar("_Number", int, float)


def _positive(name: str, value: float | str, kind: type[_Number]) -> _Number:
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
    return [
        Spec(c, T, d, m, i)
        for T in config.lengths
        for c in config.cases
        for d in config.dtypes
        for m in config.modes
        for i in config.impls
    ]


# ---- the cases: masks, their density, FLOPs ------------------------------------------------


def document_lengths(T: int, seed: int = DOC_SEED) -> list[int]:
    """Lengths of the packed documents: uniform in [512, 2048], seeded, the last cut at T."""
    rng = random.Random(seed)
    lengths: list[int] = []
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
    make: dict[str, Callable[[], masks.MaskMod | None]] = {
        "none": lambda: None,
        "causal": masks.causal,
        "window": lambda: masks.sliding_window(WINDOW),
        "document": lambda: masks.document(document_ids(T)),
    }
    return make[case]()


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


def attention_flops(
    B: int, H: int, T: int, S: int, D: int, *, density: float = 1.0, backward: bool = False
) -> float:
    """FLOPs of attention, counted as STYLE.md 15 does.

    Forward: ``4 * B * H * T * S * D`` (two matmuls of ``2 * T * S * D``) times the share of
    pairs the mask allows (0.5 for causal). Backward adds 2.5x the forward (five matmuls
    against the forward's two), so forward+backward is 3.5x the forward.
    """
    fwd = 4.0 * B * H * T * S * D * density
    return fwd * (1.0 + BACKWARD_FACTOR) if backward else fwd


def linear_attention_flops(
    B: int,
    H: int,
    T: int,
    S: int,
    D: int,
    *,
    M: int,
    Dv: int | None = None,
    causal: bool = False,
    favor: bool = False,
    backward: bool = False,
    chunk_size: int = CHUNK_SIZE,
    block: int = BLOCK,
) -> float:
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
            fwd += (
                2.0 * n * L * L * (M + Dv)
                + 2.0 * n * L * M * Dv
                + 2.0 * n * n * (M * Dv + M)
                + 2.0 * n * L * (M * Dv + M)
            )
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
        return linear_attention_flops(
            B,
            H,
            spec.T,
            spec.T,
            D,
            M=M,
            causal=spec.case == "causal",
            favor=spec.impl == "performer",
            backward=spec.mode == "fwdbwd",
        )
    return attention_flops(
        B,
        H,
        spec.T,
        spec.T,
        D,
        density=mask_density(spec.case, spec.T),
        backward=spec.mode == "fwdbwd",
    )


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


def skip_reason(
    spec: Spec, backend: str | None, *, run_all: bool, available: int | None
) -> str | None:
    """Why ``spec`` is not worth running with ``backend`` (the qkv backend that runs it, the
    impl's name for torch-dense, torch, linear and performer), or None to run it."""
    if backend in LINEAR_IMPLS and spec.case not in LINEAR_CASES:
        return _case_reason(backend, spec.case)
    limits = {PEER: DENSE_MAX_T, "torch": DENSE_MAX_T, "reference": REFERENCE_MAX_T}
    limit = None if backend is None else limits.get(backend)
    need = dense_bytes(spec, backend)
    if available is not None and need > MEMORY_SHARE * available:
        return (
            f"would need ~{need / 2**30:.1f} GiB (dense T x S buffers), "
            f"{available / 2**30:.1f} GiB available"
        )
    if limit is not None and limit < spec.T and not run_all:
        dense = spec_flops(Spec("none", spec.T, spec.dtype, spec.mode, spec.impl))
        memory = f" and needs ~{need / 2**30:.1f} GiB" if need else ""
        return (
            f"T={spec.T} > {limit}: {backend} computes all T*S pairs ({dense / 1e9:,.0f} "
            f"GFLOP a call){memory}; pass --all to run it"
        )
    return None


def _case_reason(impl: str, case: str) -> str:
    if impl == "torch":
        return (
            f"torch is SDPA's native call with no mask or is_causal only; the {case} mask "
            f"densely is torch-dense"
        )
    return (
        f"{impl} takes no {case} mask (linear attention has a kernel form for "
        f"{' and '.join(LINEAR_CASES)} only)"
    )


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
