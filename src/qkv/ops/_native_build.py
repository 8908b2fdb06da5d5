"""Build a C++ source of qkv at first use, cached, and load it for ``ctypes`` (the deformable
kernel, the bf16 score GEMM).

It is built through ``torch.utils.cpp_extension.load`` (ninja, torch's headers, cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``; a later process loads the cached
library in milliseconds) and called through ``ctypes`` on the tensors' data pointers: the
sources include only ATen/c10 headers, never ``torch/extension.h`` and pybind11, so a first
build takes seconds, not a minute.

The build's name carries a hash of the source, the flags and torch's version, and the flags
follow torch's CPU capability (AVX2, AVX512): a cache shared by machines of different CPUs
keeps one library per capability, and none runs an instruction its CPU lacks.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

__all__ = ["build", "build_declared"]

# what torch's capability string guarantees (ATen's own CPU_CAPABILITY builds assume the same)
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


def _flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags: torch's ISA level, and OpenMP where ATen's threads are
    OpenMP's (the library then links the libgomp torch has already loaded: one thread pool)."""
    cflags = ["-O3", "-std=c++17", "-ffp-contract=off"]
    cflags += _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return cflags + ["-fopenmp"], ["-fopenmp"]
    return cflags + ["-fopenmp-simd"], []


def build(source: Path, prefix: str) -> tuple[ctypes.CDLL | None, str]:
    """The library built from ``source`` (named ``prefix`` + capability + hash) and ``""``,
    or None and why it could not be built (no C++ compiler, a failed build, a source file the
    install left out). Not cached here: each caller keeps its own result (a
    ``functools.cache``)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler found ({compiler!r}, from $CXX or the default c++)"
    if not source.is_file():  # (an install that left it out: the tensor ops' way, which is the
        return None, f"the kernel's source {source} is not installed"  # same math)
    cflags, ldflags = _flags()
    key = hashlib.sha256(
        source.read_bytes() + " ".join(cflags + ldflags + [torch.__version__]).encode()
    ).hexdigest()[:12]
    capability = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    try:
        from torch.utils import cpp_extension

        path = _load_past_stale_lock(
            cpp_extension,
            name=f"{prefix}_{capability}_{key}",
            sources=[str(source)],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            with_cuda=False,
            is_python_module=False,
        )
        return ctypes.CDLL(str(path)), ""
    except Exception as exc:  # a failed build of any kind: the caller takes its torch path
        return None, f"the C++ kernel did not build: {type(exc).__name__}: {str(exc)[-300:]}"


def _load_past_stale_lock(cpp_extension, name: str, **kwargs):
    """``cpp_extension.load`` under an OS lock of qkv's own, clearing a lock file torch left.

    torch guards a build directory with a lock *file* (``FileBaton``) that only the process
    that made it removes: a build killed midway (Ctrl-C at a first call, a job's time limit,
    the OOM killer) leaves it, and every later process waited on it forever (a fresh clone's
    test run hung on the deformable kernel). Here ``flock`` on a file of qkv's own, which the
    OS releases when its holder dies, serialises qkv's builds of the library; whoever holds it
    knows that no other qkv build of it is running, so torch's lock file, if there, is stale
    and removed. Where ``flock`` or torch's build directory is not to be had, plain ``load``.
    """
    try:
        import fcntl

        directory = cpp_extension._get_build_directory(name, False)
    except Exception:  # (no fcntl: Windows; or torch's private helper changed)
        return cpp_extension.load(name=name, **kwargs)
    with open(os.path.join(directory, "qkv-build.lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits only on a live build; released at exit
        stale = os.path.join(directory, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        return cpp_extension.load(name=name, build_directory=directory, **kwargs)


def build_declared(
    source: Path, prefix: str, signatures: dict[str, list], log: logging.Logger, instead: str
) -> tuple[ctypes.CDLL | None, str]:
    """:func:`build`, then each function named in ``signatures`` given its argument types (its
    result an ``int``, 0 for success); where it cannot be built, one debug line on ``log``
    saying what is used ``instead``, and the reason."""
    lib, why = build(source, prefix)
    if lib is None:
        log.debug("%s: %s", instead, why)
        return None, why
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib, ""
