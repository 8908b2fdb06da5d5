"""Every route the machine picks for qkv, and how a test forces it (issue 37).

Some of qkv's choices follow what the machine offers rather than the call, so a suite run on
one machine exercises only the routes that machine picks. Each is listed here with the way a
test forces it, and ``ROUTES`` names the combinations the suite runs (the ``cpu_route``
fixture of conftest.py), so that every route runs on every machine:

* ``QKV_CPU_HALF_GEMM`` (``qkv.ops.cpu_isa.half_gemm_route``, measured once per process and
  half dtype where ``QKV_AUTOTUNE`` is on, kept on disk; with it off, as in the suite, picked
  from the CPU's AVX-512-BF16/AMX flags, ``torch.backends.cpu.get_cpu_capability()`` and
  ``ONEDNN_MAX_CPU_ISA``): ``native`` multiplies half inputs by torch's half GEMMs,
  ``float32`` widens them first. It reaches the modules' projections
  (``ops.cpu_isa.linear``); the measurement itself is tested with a fake clock
  (test_cpu_isa.py).
* ``QKV_CPU_FUSED_BIAS`` (``qkv.ops.cpu_isa.fused_bias_here``: oneDNN's bfloat16 linear with
  its bias fused, where a probe once per process finds it running with ``F.linear``'s bits):
  ``off`` adds the bias as ``F.linear`` does. The same bits either way: test_cpu_isa.py runs
  both, and the probe failing.
* torch's CPU flash kernel (``qkv.ops._aten.flash_cpu_available``, a property of the torch
  build): the tiled backend's ``flash`` inner kernel and the torch backend's lse for traces.
  Hidden, they take their plain twins: the ``matmul`` inner kernel, and the lse derived by
  the dispatcher.

* Host reads (``qkv.ops.nonfinite.host_reads_free``: ``QKV_CPU_HOST_READS=1`` on the CPU;
  off by default and always on CUDA): with reads, a call without gradient runs on its inputs
  as they are and is checked after its kernel by reading three sums (``Guard.holds``);
  without, it runs on zeroed copies checked in tensor ops. ``force_host_reads`` gives either
  way: the NaN/inf contract tests (test_nonfinite_eager.py) run both, test_host_reads.py
  counts both.

* The NaN/inf contract's fused row passes (``qkv.ops.nonfinite_rows``: C++ built at first use,
  for CPU tensors, a call wanting a gradient too, whose zeroed copies and NaN rows they make
  under autograd functions): where they cannot be built, or on another device, the contract
  runs as tensor ops. ``force_native_rows`` gives either way: the contract tests
  (test_nonfinite_eager.py) run both, and test_nonfinite_grad.py holds the two to the same
  bits for gradient calls.

* The one-pass weights' softmax (``qkv.ops.softmax_rows``: C++ built at first use, for CPU
  blocks of float32/float64 scores): where it cannot be built, ``amax`` and torch's softmax.
  ``force_native_softmax`` gives either way: test_weights_one_pass.py runs both.

* The float32 kernel of a few query rows (``qkv.ops.few_rows``: C++ built at first use; the
  tiled backend's way for float32 inference of up to four rows with no mask or a bool key
  mask, ``QKV_FEW_ROWS=off`` turns it off): where it cannot be built, the tiled passes.
  ``force_few_rows`` gives either way: test_few_rows.py runs both.

``MACHINE_PROBES`` lists the rest of what reads the machine, and why each is no route of its
own: ``auto``'s choice by measurement (``qkv.autotune``, on ``qkv._measured``) picks among
backends that the suite runs by name, and the flex backend runs where a compiler is found
and declines elsewhere.

``test_every_machine_choice_is_listed`` (tests/test_cpu_routes.py) fails when the library
reads another ``QKV_`` variable or probes the machine somewhere new, so that a new route is
added here rather than left to the machines that pick it.
"""

from __future__ import annotations

import pytest

from qkv.ops import few_rows, nonfinite, nonfinite_rows, softmax_rows, torch_sdpa
from qkv.ops.tiled import plan as tiled_plan

HALF_GEMM_ROUTES = ("native", "float32")

# name -> (QKV_CPU_HALF_GEMM, torch's CPU flash kernel used where it can be)
ROUTES = {
    "native": ("native", True),
    "float32": ("float32", True),
    "native-noflash": ("native", False),
    "float32-noflash": ("float32", False),
}

# The library's readers of the machine and of the environment, by file (src/qkv/...): what
# test_every_machine_choice_is_listed expects to find, each forced above or no route.
MACHINE_PROBES = {
    "ops/nonfinite.py": "QKV_CPU_HOST_READS: the host-read route, forced both ways "
    "(force_host_reads)",
    "ops/cpu_isa.py": "QKV_CPU_HALF_GEMM, the CPU's flags and capability: the half GEMM route "
    "(forced by force_route); QKV_CPU_FUSED_BIAS (off) and whether oneDNN's bfloat16 linear "
    "with its bias fused runs here with F.linear's bits: test_cpu_isa.py runs it on and off "
    "(same bits) and with the probe failing",
    "ops/_aten.py": "flash_cpu_available: the torch build's CPU flash kernel",
    "ops/tiled/plan.py": "flash_cpu_available: hidden in the -noflash routes",
    "ops/torch_sdpa.py": "flash_cpu_available: hidden in the -noflash routes",
    "ops/flex.py": "flex_available (a C++ compiler on CPU, triton on CUDA): without, flex "
    "declines and says why; auto on CPU takes it only as measured (test_cpu_routes.py)",
    "_measured.py": "QKV_AUTOTUNE, QKV_CACHE_DIR, the machine named in the cache (CPU flags, "
    "capability, ONEDNN_/DNNL_MAX_CPU_ISA, GPU): the measured choices of auto (among backends, "
    "each of which the suite runs by name, test_properties.py) and of the half GEMM route "
    "(forced above); off in the suite (conftest.py), on in test_autotune.py and "
    "test_cpu_isa.py with a fake clock",
    "tasks/_cache.py": "QKV_CACHE: where generated data sets are kept, no route",
    "ops/reference.py": "QKV_BF16_GEMM, QKV_CPU_HALF_GEMM and QKV_AUTOTUNE read only to key "
    "the memo of _fusable (a call's kernel ranges, asked twice per call): no route of its own",
    "ops/bf16_scores.py": "QKV_BF16_GEMM (auto, amx, avx512_bf16): the bf16 score kernel's "
    "GEMM; tests/test_bf16_scores.py runs every kernel test on each GEMM that runs here "
    "(the bf16_gemm fixture) and with the kernel hidden, and auto's measured choice where "
    "two run with a fake clock (two_gemms)",
    "ops/deformable/op.py": "QKV_DEFORMABLE_KERNEL (auto, cpp, torch, triton): "
    "tests/test_deformable.py runs cpp and torch by name, tests/test_deformable_triton.py "
    "triton under the CPU interpreter",
    "ops/tiled/route.py": "QKV_BF16_RANGES (kernel, plan): the tiled backend's way for "
    "bfloat16 inference of ranges of keys, measured per kind where QKV_AUTOTUNE is on; "
    "tests/test_bf16_ranges_route.py runs each way forced, and the measurement with a fake clock",
    "ops/few_rows.py": "QKV_FEW_ROWS (off turns it off) and whether its C++ builds: the "
    "float32 few-row kernel of the tiled backend, forced both ways (force_few_rows)",
    "ops/_native_build.py": "the CPU capability: the C++ kernels' ISA flags and build names "
    "(the deformable kernel, the bf16 score kernel), no route beyond each kernel; the bf16 score "
    "kernel (ops/bf16_scores.py) runs where oneDNN packs bfloat16 for AMX or the CPU has "
    "AVX512-BF16, and tests/test_bf16_scores.py runs the one-pass weights with it forced on "
    "and off",
}


def force_route(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Force the route ``name`` of ``ROUTES`` for the rest of the test (undone after it): the
    half GEMMs' and whether torch's CPU flash kernel is used."""
    half_gemm, flash = ROUTES[name]
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", half_gemm)
    if not flash:
        for module in (tiled_plan, torch_sdpa):
            monkeypatch.setattr(module, "flash_cpu_available", lambda: False)


def force_host_reads(monkeypatch: pytest.MonkeyPatch, free: bool) -> None:
    """Run the NaN/inf contract the way of a device where a read on the host is ``free`` (the
    CPU's) or a sync (CUDA's), whatever the call's device, for the rest of the test."""
    monkeypatch.setattr(nonfinite, "host_reads_free", lambda device: free)


def force_native_rows(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Keep the NaN/inf contract by the fused C++ row passes (``on``, where they build: else
    the test is skipped) or by tensor ops only, as where no compiler is found, for the rest of
    the test."""
    if not on:  # as where the library did not build
        monkeypatch.setattr(nonfinite_rows, "_build", lambda: (None, "hidden by the test"))
    elif not nonfinite_rows.available():
        pytest.skip("the fused row passes of qkv.ops.nonfinite_rows did not build here")


def force_native_softmax(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Form the one-pass weights' softmax by the C++ pass (``on``, where it builds: else the
    test is skipped) or by torch's ops only, as where no compiler is found, for the rest of the
    test."""
    if not on:  # as where the library did not build
        monkeypatch.setattr(softmax_rows, "_build", lambda: (None, "hidden by the test"))
    elif not softmax_rows.available():
        why = softmax_rows._build()[1]
        pytest.skip(f"the softmax rows of qkv.ops.softmax_rows did not build here: {why}")


def force_few_rows(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Run float32 inference of a few query rows on the tiled backend by the C++ kernel of
    ``qkv.ops.few_rows`` (``on``, where it builds: else the test is skipped) or by the tiled
    passes (``QKV_FEW_ROWS=off``), for the rest of the test."""
    if not on:
        monkeypatch.setenv(few_rows.SWITCH, "off")
        return
    monkeypatch.delenv(few_rows.SWITCH, raising=False)
    if not few_rows.available():
        pytest.skip(
            f"the few-rows kernel of qkv.ops.few_rows did not build here: {few_rows._build()[1]}"
        )
