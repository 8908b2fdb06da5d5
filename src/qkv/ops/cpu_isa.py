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

A bfloat16 :func:`linear` with a bias, taken natively, adds the bias inside oneDNN's GEMM
(``torch.ops.mkldnn._linear_pointwise``) where that op runs here and gives ``F.linear``'s bits
on a probe made once per process (:func:`fused_bias_here`): ``F.linear`` (``addmm``) first
copies the bias into every row of its output and then accumulates into it, a pass over the
output that cost 6-22% of the projection (8-12% at one row, a decoding step's; 22% at 1024
rows of C=512 to 3C; AMX Xeon, one thread). The op is oneDNN's own, the same products and
sums, so the route changes speed only; ``QKV_CPU_FUSED_BIAS=off`` turns it off (the tests
run both ways). Inputs that want a gradient, CPU autocast, tracing and dispatch modes, other
devices and non-contiguous tensors take ``F.linear``.

The route is a ``qkv._measured.MeasuredRoute``. bfloat16 attention that wants a gradient
has no such choice: it is computed in float32 and rounded once (``AttentionCall.work_dtype``
says why).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _measured
from .._measured import clock as _clock
from .._measured import cpu_features, env

__all__ = [
    "FUSED_BIAS_SWITCH",
    "HALF_GEMM",
    "HALF_GEMM_ROUTES",
    "HALF_GEMM_SWITCH",
    "RouteChoice",
    "cpu_features",
    "explain_half_gemm",
    "forget",
    "fused_bias_here",
    "half_gemm_choice",
    "half_gemm_route",
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


def half_gemm_route(dtype: torch.dtype = torch.bfloat16, one_row: bool = False) -> str:
    """``"native"``: half inputs of ``dtype`` are multiplied by torch in their own dtype;
    ``"float32"``: widened to float32 first (same products, float32 sums). Forced by
    ``QKV_CPU_HALF_GEMM``; else measured once per process and dtype (or read from disk), or
    with ``QKV_AUTOTUNE=off`` from the flags (:func:`native_bf16`). The hot path: after the
    first call, two environment reads and a dict lookup.

    ``one_row``: for a product of one row (a decoding step's projections), measured apart:
    widening then converts the whole weight for one row's products, and torch's half
    matrix-vector product may win where its GEMM loses (held to AVX2 on the AMX Xeon: a
    bfloat16 row times (1536, 512) took 146 us native against 374 us widened, while 8 rows
    took 1024 against 611 and 128 rows 15.9 ms against 2.2)."""
    return HALF_GEMM.route(_ROW_NAMES[dtype] if one_row else _dtype_name(dtype))


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo with qkv:
# under torch.compile the route is looked up once, in Python at trace time (where it reads no
# clock: tracing), and enters the graph as a constant. Traced, it failed: dynamo traces
# through functools.cache into open("/proc/cpuinfo"), and a dict the lookup fills was guarded
# in the frame that filled it. The graph keeps the route it was traced with, as the process
# keeps the route it measured.
vars(half_gemm_route)["_dynamo_marked_constant"] = True


def half_gemm_choice(
    dtype: torch.dtype = torch.bfloat16,
    *,
    measure: bool = True,
    fresh: bool = False,
    one_row: bool = False,
) -> RouteChoice:
    """The route ``dtype``'s half GEMMs take here, and why (see :class:`RouteChoice`);
    ``one_row``: those of one row (see :func:`half_gemm_route`).

    ``measure=False`` runs nothing: a route not yet known is the flag rule's.
    ``fresh=True`` (``qkv tune``) measures whatever is kept, forced or off, and keeps the
    verdict for this process and on disk.
    """
    if dtype not in _HALF:
        raise ValueError(
            f"half_gemm_choice: dtype must be torch.bfloat16 or torch.float16, got {dtype}"
        )
    key = _ROW_NAMES[dtype] if one_row else _dtype_name(dtype)
    choice = HALF_GEMM.choice(key, measure=measure, fresh=fresh)
    assert isinstance(choice, RouteChoice)  # (HALF_GEMM makes them)
    return choice


def explain_half_gemm(dtype: torch.dtype = torch.bfloat16, one_row: bool = False) -> str:
    """Which route ``dtype``'s half GEMMs (``one_row``: of one row) take on this CPU and why,
    in a line; runs nothing (a route not yet measured shows the flag rule's)."""
    name = _ROW_NAMES[dtype] if one_row else str(dtype).removeprefix("torch.")
    choice = half_gemm_choice(dtype, measure=False, one_row=one_row)
    return f"half GEMM {name} -> {choice.reason()}"


def forget() -> None:
    """Drop this process's half GEMM routes (the next call of each dtype is measured again, or
    read from disk; the disk is read again) and its probe of the fused bias."""
    HALF_GEMM.forget()
    _FUSED_BIAS.clear()


def _dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)  # (asked on every half linear: no string made)
    return str(dtype).removeprefix("torch.") if name is None else name


_NAMES = {d: n for n, d in _DTYPES.items()}
_ROW_NAMES = {d: f"{n}/one row" for d, n in _NAMES.items()}  # the one-row products' keys


def _flag_route() -> str:
    return "native" if native_bf16() else "float32"


def _flags_words(route: str) -> str:
    has = "has" if route == "native" else "has no"
    return f"the CPU flags' rule (torch {has} AVX-512-BF16/AMX to use)"


def _gemm_runners(dtype: torch.dtype, one_row: bool = False) -> dict[str, Callable[[], object]]:
    """The representative GEMM by each route, as :func:`linear` forms it (the flag rule's
    route first: it wins a tie); ``one_row``: of one row. Drawn from a generator of its own:
    the global one is left as it was."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 if one_row else _ROWS, _IN, generator=g, device="cpu").to(dtype)  # (T, C)
    w = torch.randn(_OUT, _IN, generator=g, device="cpu").to(dtype)  # (3C, C)
    b = torch.randn(_OUT, generator=g, device="cpu").to(dtype)  # (3C,)
    runners: dict[str, Callable[[], object]] = {
        "native": lambda: F.linear(x, w, b),  # (T, 3C)
        "float32": lambda: F.linear(x.float(), w.float(), b.float()).to(dtype),  # (T, 3C)
    }
    first = _flag_route()
    return {first: runners[first]} | {n: r for n, r in runners.items() if n != first}


def _time_routes(key: str) -> dict[str, float]:
    """Seconds per representative GEMM of each route (:func:`_time_one_thread`), for a key of
    ``_NAMES`` or ``_ROW_NAMES``."""
    name, _, rows = key.partition("/")
    dtype = _DTYPES[name]
    return _time_one_thread(lambda: _gemm_runners(dtype, bool(rows)), _ROUNDS, _BUDGET_S)


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
    _time_routes,
    RouteChoice,
)


def widens_half(x: Tensor) -> bool:
    """Whether ``x``'s products are to be formed in float32: a float16/bfloat16 CPU tensor
    whose dtype's half GEMMs take the float32 route here (:func:`half_gemm_route`; a tensor of
    one row ``(*1, in)`` by the one-row products' route)."""
    return (
        x.dtype in _HALF
        and x.device.type == "cpu"
        and half_gemm_route(x.dtype, x.numel() == x.shape[-1]) == "float32"
    )


FUSED_BIAS_SWITCH = "QKV_CPU_FUSED_BIAS"  # "off": bfloat16 linears add their bias as addmm does
_FUSED_BIAS: list = []  # [the op, or None where it does not run here or gives other bits]


def fused_bias_here() -> bool:
    """Whether bfloat16 linears with a bias take oneDNN's op with the bias fused here (see the
    module's notes): not switched off, and the op ran on the probe with ``F.linear``'s bits."""
    return env(FUSED_BIAS_SWITCH) != "off" and _fused_bias_op() is not None


def _fused_bias_op():
    """``torch.ops.mkldnn._linear_pointwise`` where it runs here and gives ``F.linear``'s bits
    on a probe of a few odd sizes (one row; 2 x 37 rows of 96 to 80), else None; asked once per
    process (the answer kept in ``_FUSED_BIAS``)."""
    if _FUSED_BIAS:
        return _FUSED_BIAS[0]
    op = None
    try:
        candidate = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for rows in ((1,), (2, 37)):
                x = torch.randn(*rows, 96, generator=g).to(torch.bfloat16)
                w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
                b = torch.randn(80, generator=g).to(torch.bfloat16)
                if not torch.equal(candidate(x, w, b, "none", [], ""), F.linear(x, w, b)):
                    raise ValueError("other bits")
        op = candidate
    except Exception:  # (not in this build, no bfloat16 primitive under this ISA, other bits)
        op = None
    _FUSED_BIAS[:] = [op]
    return op


def _fuses_bias(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether this linear takes the fused bias: bfloat16 CPU tensors, contiguous, a bias, no
    gradient wanted, no CPU autocast (``F.linear`` would cast to its dtype, the op would not),
    not traced and under no dispatch mode (fake tensors, op counters: they see ``F.linear``,
    and the probe never runs under one), the route on here."""
    return (
        bias is not None
        and x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and bias.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and bias.is_cpu
        and x.dim() >= 2
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or bias.requires_grad)
        )
        and x.is_contiguous()
        and weight.is_contiguous()
        and bias.is_contiguous()
        and not torch.is_autocast_enabled("cpu")
        and not _measured.cannot_time()
        and fused_bias_here()
    )


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
    if x.dtype is torch.bfloat16 and _fuses_bias(x, weight, bias):
        return _FUSED_BIAS[0](x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
