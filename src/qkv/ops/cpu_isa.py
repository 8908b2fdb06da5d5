"""What this CPU does well, for the speed choices of the CPU kernels (issues 25 and 38).

torch's half-precision (bfloat16/float16) GEMM on a CPU is fast only where the CPU multiplies
half natively (AVX-512-BF16, AMX, AVX-512-FP16) and torch may use it: there oneDNN runs it at
float32's rate or better. Without (AVX2 machines, AVX-512 machines without the BF16
extension, or torch held to AVX2 by ``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA``) it ran at
~1.7 GFLOP/s on the 2-core EPYC (Zen 3) box, and multiplying in float32 was 16x faster. Which
holds on the machine at hand is measured, not read from the flags (issue 38; flags guess,
timings know): the first half GEMM of each dtype in a process times a representative one (the
fused in-projection of 128 tokens, C=256 to 3C, as :func:`linear` forms it) both ways, a few
milliseconds on one thread, and takes the faster route for the process. One thread, because
the verdict is the kernels' speed per core and outlasts the moment: with torch's threads as
many as the cores of a loaded machine, each parallel region waits for a descheduled thread
(a small op took 13-29 ms on two threads of the shared 2-core Xeon box at load 2.5, 0.016 ms
on one), which made the five-kernel float32 route lose to AVX2's slow half GEMM, at random. The
verdict is kept on disk beside ``auto``'s (``qkv._measured``: same file, same machine key),
where the next process reads it; ``qkv tune`` measures it ahead of time. Either route meets
the tolerance policy (issue 37: the suite forces both), so the choice changes speed only.

* ``QKV_CPU_HALF_GEMM=float32`` or ``=native`` forces the route (for benchmarks and tests).
* ``QKV_AUTOTUNE=off`` (and tracing: torch.compile, export, vmap, or a dispatch mode, where
  nothing may be timed) gives the flag rule (:func:`native_bf16`), or under tracing a verdict
  already known (this process or the disk).
* :func:`half_gemm_choice` says which route a dtype takes and why (forced, measured with the
  times, from disk, from the flags); :func:`explain_half_gemm` says it in a line and runs
  nothing.

The same holds for bfloat16 attention that wants a gradient (:data:`HALF_GRAD`,
``QKV_CPU_HALF_GRAD``): in bfloat16 by torch's kernels, or widened to float32 and rounded
once, per size class (rows that see up to 256 keys, and longer), read by
``AttentionCall.work_dtype``. Both routes are ``qkv._measured.MeasuredRoute`` objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _measured
from .._measured import clock as _clock
from .._measured import cpu_features

__all__ = [
    "HALF_GEMM",
    "HALF_GEMM_ROUTES",
    "HALF_GEMM_SWITCH",
    "HALF_GRAD",
    "HALF_GRAD_SWITCH",
    "RouteChoice",
    "cpu_features",
    "explain_half_gemm",
    "explain_half_grad",
    "forget",
    "half_gemm_choice",
    "half_gemm_route",
    "half_grad_bucket",
    "half_grad_route",
    "linear",
    "native_bf16",
    "widens_half",
]

HALF_GEMM_ROUTES = ("native", "float32")
_HALF = (torch.bfloat16, torch.float16)
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

# The representative GEMM: the fused in-projection (x @ W.T + b) of 128 tokens of a C=256
# model, (128, 256) x (768, 256)^T: 50 MFLOP, 0.13 ms native with AMX, 0.5 ms in float32, and
# 5 ms native where torch's half GEMM is slow (AVX2); small enough that the slow route's
# runs (one untimed, two timed) stay under 20 ms once per process and dtype.
_ROWS, _IN, _OUT = 128, 256, 768
_ROUNDS, _BUDGET_S = 5, 0.004  # rounds of one timed run each, stopping after ~4 ms (2 at least)


def native_bf16(
    features: frozenset[str] | None = None,
    capability: str | None = None,
    onednn_isa: str | None = None,
) -> bool:
    """Whether torch's CPU kernels may multiply bfloat16 natively here: the CPU has
    AVX-512-BF16 or AMX, and neither torch (``get_cpu_capability``) nor oneDNN
    (``ONEDNN_MAX_CPU_ISA``) is held below AVX-512."""
    features = cpu_features() if features is None else features
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if onednn_isa is None else onednn_isa
    held = capability.upper() in ("AVX2", "DEFAULT", "NO AVX") or onednn_isa.upper().startswith(
        ("AVX2", "SSE", "AVX_")
    )  # AVX512_CORE_BF16 etc. pass
    return not held and any(f in features for f in _NATIVE_BF16_FLAGS)


class RouteChoice(_measured.Choice):
    """The half-GEMM route a dtype takes, and why.

    ``source``: ``"forced"`` (``QKV_CPU_HALF_GEMM``), ``"measured"`` (in this process),
    ``"disk"`` (an earlier process or ``qkv tune``), ``"flags"`` (the flag rule: measuring
    off, under tracing, or not measured yet); ``times``: seconds per representative GEMM of
    each route (empty unless measured).
    """


HALF_GEMM_SWITCH = "QKV_CPU_HALF_GEMM"  # the environment variable that forces the route
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def half_gemm_route(dtype: torch.dtype = torch.bfloat16) -> str:
    """``"native"``: half inputs of ``dtype`` are multiplied by torch in their own dtype;
    ``"float32"``: widened to float32 first (same products, float32 sums). Forced by
    ``QKV_CPU_HALF_GEMM``; else measured once per process and dtype (or read from disk), or
    with ``QKV_AUTOTUNE=off`` from the flags (:func:`native_bf16`). The hot path: after the
    first call, two environment reads and a dict lookup."""
    return HALF_GEMM.route(_dtype_name(dtype))


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo with qkv:
# under torch.compile the route is looked up once, in Python at trace time (where it reads no
# clock: tracing), and enters the graph as a constant. Traced, it failed: dynamo traces
# through functools.cache into open("/proc/cpuinfo"), and a dict the lookup fills was guarded
# in the frame that filled it. The graph keeps the route it was traced with, as the process
# keeps the route it measured.
vars(half_gemm_route)["_dynamo_marked_constant"] = True


def half_gemm_choice(
    dtype: torch.dtype = torch.bfloat16, *, measure: bool = True, fresh: bool = False
) -> RouteChoice:
    """The route ``dtype``'s half GEMMs take here, and why (see :class:`RouteChoice`).

    ``measure=False`` runs nothing: a route not yet known is the flag rule's.
    ``fresh=True`` (``qkv tune``) measures whatever is kept, forced or off, and keeps the
    verdict for this process and on disk.
    """
    if dtype not in _HALF:
        raise ValueError(
            f"half_gemm_choice: dtype must be torch.bfloat16 or torch.float16, got {dtype}"
        )
    choice = HALF_GEMM.choice(_dtype_name(dtype), measure=measure, fresh=fresh)
    assert isinstance(choice, RouteChoice)  # (HALF_GEMM makes them)
    return choice


def explain_half_gemm(dtype: torch.dtype = torch.bfloat16) -> str:
    """Which route ``dtype``'s half GEMMs take on this CPU and why, in a line; runs nothing
    (a route not yet measured shows the flag rule's)."""
    name = str(dtype).removeprefix("torch.")
    return f"half GEMM {name} -> {half_gemm_choice(dtype, measure=False).reason()}"


def forget() -> None:
    """Drop this process's routes, the half GEMMs' and the bfloat16 gradients' (the next call
    of each is measured again, or read from disk; the disk is read again)."""
    HALF_GEMM.forget()
    HALF_GRAD.forget()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flag_route() -> str:
    return "native" if native_bf16() else "float32"


def _flags_words(route: str) -> str:
    has = "has" if route == "native" else "has no"
    return f"the CPU flags' rule (torch {has} AVX-512-BF16/AMX to use)"


def _gemm_runners(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The representative GEMM by each route, as :func:`linear` forms it (the flag rule's
    route first: it wins a tie). Drawn from a generator of its own: the global one is left as
    it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=g, device="cpu").to(dtype)  # (T, C)
    w = torch.randn(_OUT, _IN, generator=g, device="cpu").to(dtype)  # (3C, C)
    b = torch.randn(_OUT, generator=g, device="cpu").to(dtype)  # (3C,)
    runners: dict[str, Callable[[], object]] = {
        "native": lambda: F.linear(x, w, b),  # (T, 3C)
        "float32": lambda: F.linear(x.float(), w.float(), b.float()).to(dtype),  # (T, 3C)
    }
    first = _flag_route()
    return {first: runners[first]} | {n: r for n, r in runners.items() if n != first}


def _time_routes(dtype: torch.dtype) -> dict[str, float]:
    """Seconds per representative GEMM of each route (:func:`_time_one_thread`)."""
    return _time_one_thread(lambda: _gemm_runners(dtype), _ROUNDS, _BUDGET_S)


def _time_one_thread(
    runners: Callable[[], dict[str, Callable[[], object]]], rounds: int, budget_s: float
) -> dict[str, float]:
    """Seconds per run of each of ``runners()`` (made and run under these modes), on one
    thread (torch's count is put back after), without gradient unless a runner enables it and
    without autocast (it would turn a float32 route into a half one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            made = runners()
            return _measured.time_each(made, rounds=rounds, budget_s=budget_s, clock=_clock)
    finally:
        torch.set_num_threads(threads)


HALF_GEMM = _measured.MeasuredRoute(
    "half_gemm",
    HALF_GEMM_ROUTES,
    HALF_GEMM_SWITCH,
    _flag_route,
    _flags_words,
    lambda name: _time_routes(_DTYPES[name]),
    RouteChoice,
)


def widens_half(x: Tensor) -> bool:
    """Whether ``x``'s products are to be formed in float32: a float16/bfloat16 CPU tensor
    whose dtype's half GEMMs take the float32 route here (:func:`half_gemm_route`)."""
    return x.dtype in _HALF and x.device.type == "cpu" and half_gemm_route(x.dtype) == "float32"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by what this CPU does well: half inputs where
    :func:`widens_half` are multiplied in float32 and rounded once to their dtype (float32
    sums, as torch's half GEMM has; the bfloat16 in-projection of 8 heads, E=512, T=256 took
    2.1 ms this way against 7.5 ms as a bfloat16 GEMM, on the 2-core AVX-512 Xeon without
    AVX-512-BF16, and the other way round with AMX: the route is measured).
    Differentiable; a gradient is formed in float32 too.

    Shape:
        x ``(*, in)``, weight ``(out, in)``, bias ``(out,)`` -> ``(*, out)``.
    """
    if x.dtype in _HALF and weight.dtype == x.dtype and widens_half(x):  # (float32: no call)
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)


# --- bfloat16 attention that wants a gradient: in its own dtype or in float32 -------------------

HALF_GRAD_SWITCH = "QKV_CPU_HALF_GRAD"  # forces the route: "native" or "float32"
HALF_GRAD_BUCKETS = ("short", "long")
_SHORT_KEYS = 256  # keys a query row may see, up to which a call is "short"
# the representative call of each bucket: (heads, T = S); D=64, forward and backward
_GRAD_CASES = {"short": (4, 128), "long": (1, 1024)}
_GRAD_ROUNDS, _GRAD_BUDGET_S = 3, 0.02


def half_grad_bucket(keys: int) -> str:
    """The size class of a call whose query rows see up to ``keys`` keys (S, or a sliding
    window's width): ``"short"`` up to 256, ``"long"`` beyond. torch's bfloat16 kernels win
    only on long rows on the CPUs that have them (see :data:`HALF_GRAD`); a window of 128 at
    T=1024 ran 0.82x as fast in bfloat16 as in float32 through the tiled backend (Zen 4)."""
    return "short" if keys <= _SHORT_KEYS else "long"


def half_grad_route(bucket: str) -> str:
    """``"float32"``: a bfloat16 CPU call that wants a gradient computes its attention in
    float32 (q, k and v widened, the output rounded once, the gradients rounded once on the
    way back); ``"native"``: in bfloat16, by torch's kernels. Per size class
    (:func:`half_grad_bucket`), measured once per process or read from disk; forced by
    ``QKV_CPU_HALF_GRAD``; with ``QKV_AUTOTUNE=off`` the flags' rule (native where torch may
    use AVX-512-BF16 or AMX). Read by ``AttentionCall.work_dtype``."""
    return HALF_GRAD.route(bucket)


vars(half_grad_route)["_dynamo_marked_constant"] = True  # (as half_gemm_route: a constant)


def explain_half_grad(bucket: str) -> str:
    """Which route bfloat16 attention wanting a gradient takes in ``bucket`` and why, in a
    line; runs nothing."""
    choice = HALF_GRAD.choice(bucket, measure=False)
    return f"bfloat16 attention gradient ({bucket}) -> {choice.reason()}"


def _grad_runners(bucket: str) -> dict[str, Callable[[], object]]:
    """The bucket's representative call, forward and backward, by each route (the flags'
    route first: it wins a tie). Drawn from a generator of its own."""
    heads, L = _GRAD_CASES[bucket]
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, heads, L, 64, generator=g).to(torch.bfloat16) for _ in range(4)
    )  # (1, heads, L, 64)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def run(wide: bool) -> Callable[[], object]:
        def step():
            with torch.enable_grad():
                inputs = [t.float() for t in leaves] if wide else leaves
                out = F.scaled_dot_product_attention(*inputs)
                return torch.autograd.grad(out.to(torch.bfloat16), leaves, grad)

        return step

    runners = {"native": run(False), "float32": run(True)}
    first = _flag_route()
    return {first: runners[first]} | {n: r for n, r in runners.items() if n != first}


def _time_grad_routes(bucket: str) -> dict[str, float]:
    """Seconds per representative call of each route (:func:`_time_one_thread`)."""
    return _time_one_thread(lambda: _grad_runners(bucket), _GRAD_ROUNDS, _GRAD_BUDGET_S)


# Measured on the 2-core AMD Zen 4 (AVX-512-BF16; torch 2.13, one thread), forward and backward
# of torch's SDPA, float32 route / native: T = S = 32 0.40, 128 0.52, 256 0.84, 512 1.12, 1024
# 1.16, 2048 1.27; held to AVX2 (no bfloat16 instructions) 0.20-0.34 at every length. The float32
# route's output and gradients are float32's rounded once, within the tolerance policy always;
# torch's bfloat16 backward was outside it on 12 of 100 draws at T=1, S=2, D=4.
HALF_GRAD = _measured.MeasuredRoute(
    "half_grad/bfloat16",
    HALF_GEMM_ROUTES,
    HALF_GRAD_SWITCH,
    _flag_route,
    _flags_words,
    _time_grad_routes,
)
