"""What this CPU does well, for the speed choices of the CPU kernels (issue 25).

torch's half-precision (bfloat16/float16) GEMM on a CPU is fast only where the CPU multiplies
bfloat16 natively (AVX-512-BF16, AMX): there oneDNN runs it at float32's rate or better. Without
them (AVX2 machines, AVX-512 machines without the BF16 extension) it ran at ~1.7 GFLOP/s on
the 2-core EPYC (Zen 3) box, and multiplying in float32 was 16x faster. So half inputs on the
CPU are multiplied in float32 unless the CPU has native bfloat16 arithmetic that torch is
allowed to use (``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` can hold it to AVX2).

``QKV_CPU_HALF_GEMM=float32`` or ``=native`` overrides the choice (for benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cpu_features", "half_gemm_route", "linear", "native_bf16", "widens_half"]

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where that cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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


def half_gemm_route() -> str:
    """``"native"``: half inputs are multiplied by torch in their own dtype; ``"float32"``:
    widened to float32 first (same products, float32 sums). From ``QKV_CPU_HALF_GEMM`` when set,
    else from :func:`native_bf16`."""
    forced = os.environ.get("QKV_CPU_HALF_GEMM", "").strip().lower()
    if forced in ("native", "float32"):
        return forced
    if forced:
        raise ValueError(f"QKV_CPU_HALF_GEMM must be 'native' or 'float32', got {forced!r}")
    return "native" if native_bf16() else "float32"


def widens_half(x: Tensor) -> bool:
    """Whether ``x``'s products are to be formed in float32: a float16/bfloat16 CPU tensor on
    a CPU whose half GEMMs are slow (:func:`half_gemm_route` ``"float32"``)."""
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and x.device.type == "cpu"
        and half_gemm_route() == "float32"
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by what this CPU does well: half inputs where
    :func:`widens_half` are multiplied in float32 and rounded once to their dtype (float32
    sums, as torch's half GEMM has; the bfloat16 in-projection of 8 heads, E=512, T=256 took
    2.1 ms this way against 7.5 ms as a bfloat16 GEMM, on the 2-core AVX-512 Xeon without
    AVX-512-BF16).
    Differentiable; a gradient is formed in float32 too.

    Shape:
        x ``(*, in)``, weight ``(out, in)``, bias ``(out,)`` -> ``(*, out)``.
    """
    if weight.dtype == x.dtype and widens_half(x):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
    return F.linear(x, weight, bias)
