"""Attention scores of bfloat16 inputs in float32, on this CPU's bfloat16 units (issues 37, 38).

Issue 37 keeps the scores of half inputs in float32 before the softmax. torch 2.13 has no CPU
GEMM of bfloat16 inputs with a float32 output (``bmm(out_dtype=)`` is CUDA only), so they were
formed as a float32 GEMM of the widened inputs, ~9x slower than the bfloat16 GEMM on an AMX
CPU (8 heads, T=S=1024, D=64: 20.6 ms against 2.3 ms, which rounds the scores to bfloat16 and
is refused). ``bf16_scores.cpp`` forms them on one of two GEMMs (:data:`GEMMS`): oneDNN's
batch-reduce micro-kernel as libtorch_cpu exports it (``at::native::cpublas::brgemm``, bf16 x
bf16 -> f32 on AMX, the kernel of torch's own CPU flash attention), or, on a CPU without AMX
that has AVX512-BF16 (AMD Zen 4), qkv's own micro-kernel on that dot product instruction. Each
product of two bfloat16 is exact in float32 and the sums are float32's, as in the widened
GEMM. ``QKV_BF16_GEMM`` (``auto``, ``amx``, ``avx512_bf16``) forces one, so that the tests run
each where it runs; ``auto`` takes the one that runs here, and where both run (an AMX CPU has
AVX512-BF16 too) the faster as timed on this machine once (:func:`gemm_choice`: in this
process and on disk, ``qkv tune`` fills it; with ``QKV_AUTOTUNE=off`` the static order, AMX
first).

* :func:`scores_` forms ``scale * q @ k^T`` into a float32 buffer, by the kernel where
  :func:`available`, else by its slow twin :func:`scores_widened_` (the widened GEMM).
* :func:`weights_kernel` runs the whole one-pass weights of a plain or causal bfloat16 call
  fused (``qkv_bf16_weights``): scores into a float32 tile per block of query rows, the
  softmax and lse in float32, the weights rounded once, and the output as the float32
  weights times the values, by two bf16 GEMMs of the weights split into a rounded part and
  its remainder (``hi + lo`` is the float32 weight to 2^-16 of it), summed in float32 and
  rounded once. The rounding to bfloat16 takes AVX512-BF16's instruction where the CPU has
  it, else integer arithmetic that gives the same bits; ``QKV_BF16_GENERIC_CVT=1`` forces the
  latter (read once per process, for the test that compares them).
* The kernel is built at first use (``ops/_native_build.py``); where it cannot run (no C++
  compiler, a failed build, a CPU with neither AMX that oneDNN packs bfloat16 for nor
  AVX512-BF16 in an AVX-512 build), it is not used, and one debug-level log line says why.

Shape alphabet: N batch x heads (flattened), T query length, S key length, D head dim.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _measured
from .._measured import clock as _clock
from ._memory import empty_large
from ._native_build import build
from .base import cannot_time

__all__ = [
    "GEMMS",
    "GEMM_SWITCH",
    "GemmChoice",
    "attend_kernel",
    "available",
    "forced_gemm",
    "forget_gemm",
    "gemm_choice",
    "gemm_routes",
    "scores_",
    "scores_kernel_",
    "scores_widened_",
    "unavailable_reason",
    "weights_kernel",
]

SOURCE = Path(__file__).with_name("bf16_scores.cpp")
_log = logging.getLogger(__name__)


# The kernel's GEMMs (bf16_scores.cpp's ``Gemm``), fastest first where both run (an AMX CPU has
# AVX512-BF16 too): oneDNN's batch-reduce micro-kernel on AMX tiles, and qkv's own micro-kernel on
# AVX512-BF16's dot product instruction (AMD Zen 4, where oneDNN's pack refuses bfloat16).
GEMMS = {"amx": 1, "avx512_bf16": 2}
GEMM_SWITCH = "QKV_BF16_GEMM"  # the environment variable that forces one (auto: the default)
_WHY_NOT = {
    "amx": "at::native::cpublas::could_pack(BFloat16) is false (no AMX)",
    "avx512_bf16": "no AVX512-BF16 in this CPU or in this build (torch's capability {cap})",
}


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str]:
    lib, why = build(SOURCE, "qkv_bf16_scores")
    if lib is None:
        return None, why
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.qkv_bf16_scores.argtypes = [ptr] * 3 + [i64] * 6 + [ctypes.c_float, i64]
    lib.qkv_bf16_scores.restype = ctypes.c_int
    args: list[type] = []
    for kind, n in ((ptr, 8), (i64, 2), (ptr, 4), (i64, 8), (ctypes.c_float, 1), (i64, 2)):
        args += [kind] * n
    lib.qkv_bf16_attend.argtypes = args
    lib.qkv_bf16_attend.restype = ctypes.c_int
    lib.qkv_bf16_gemm_usable.argtypes = [i64]
    lib.qkv_bf16_gemm_usable.restype = ctypes.c_int
    lib.qkv_bf16_scores_error.restype = ctypes.c_char_p
    return lib, ""


@functools.cache
def _runs(lib: ctypes.CDLL) -> tuple[tuple[str, ...], str]:
    """The GEMMs of :data:`GEMMS` that run here with this build, and why the others do not."""
    runs = tuple(name for name, code in GEMMS.items() if lib.qkv_bf16_gemm_usable(code))
    cap = torch.backends.cpu.get_cpu_capability()
    why = "; ".join(_WHY_NOT[name].format(cap=cap) for name in GEMMS if name not in runs)
    return runs, why


def gemm_routes() -> tuple[str, ...]:
    """The kernel's GEMMs that run on this machine (names of :data:`GEMMS`), fastest first;
    empty where the kernel does not run at all (builds it at the first ask)."""
    lib, _ = _build()
    return () if lib is None else _runs(lib)[0]


def _route() -> tuple[int, str]:
    """The GEMM code this call runs on (0: none), and why none. ``QKV_BF16_GEMM`` forces one
    (``amx`` or ``avx512_bf16``; read per call, so tests run each where it runs); unset or
    ``auto``, the one that runs here, or where both do the faster measured (:func:`gemm_choice`).
    A forced GEMM that does not run here leaves the kernel unused (the widened GEMM, the same
    float32 sums), with the reason."""
    timing = getattr(_TIMING, "gemm", 0)
    if timing:  # (gemm_choice's runners, in this thread only)
        return timing, ""
    lib, why = _build()
    if lib is None:
        return 0, why
    runs, why = _runs(lib)
    forced = _measured.env(GEMM_SWITCH) or "auto"
    if forced == "auto":
        if len(runs) > 1:
            return GEMMS[_auto_gemm(runs)], ""
        return (GEMMS[runs[0]], "") if runs else (0, why)
    if forced not in GEMMS:
        raise ValueError(f"QKV_BF16_GEMM must be one of auto, {', '.join(GEMMS)}; got {forced!r}")
    if forced not in runs:
        return 0, f"QKV_BF16_GEMM={forced} does not run here: {why}"
    return GEMMS[forced], ""


# --- auto's GEMM where both run: measured once ------------------------------------------------


class GemmChoice(_measured.Choice):
    """The GEMM ``auto`` takes here (``route``), and why.

    ``source``: ``"measured"`` (in this process), ``"disk"`` (measured by an earlier process on
    this machine and kernel sources), ``"static"`` (the order of :data:`GEMMS`: measuring off,
    not measured yet, or under tracing), ``"only"`` (the one GEMM that runs here) or
    ``"none"`` (the kernel does not run here, ``route`` empty). ``times``: seconds per
    representative call of each, where measured.
    """


_TIMING = threading.local()  # .gemm: the code gemm_choice's runner holds its thread's calls to
_gemm_lock = threading.Lock()
_gemm_chosen: dict[str, GemmChoice] = {}  # "auto" -> this process's choice (never changes)
_GEMM_DISK = "route:bf16_gemm"
_GEMM_ROUNDS, _GEMM_BUDGET_S = 5, 0.01  # rounds of one timed call each, stopping after ~10 ms


def forced_gemm() -> str | None:
    """The GEMM ``QKV_BF16_GEMM`` holds this process to (``amx``, ``avx512_bf16``), or None
    where it is unset or ``auto``."""
    forced = _measured.env(GEMM_SWITCH) or "auto"
    return None if forced == "auto" else forced


def _auto_gemm(runs: tuple[str, ...]) -> str:
    """``auto``'s GEMM among ``runs`` (two or more): this process's choice, else the disk's, else
    measured now (the static order where measuring is off or cannot run). The hot path: an
    environment read and a dict lookup."""
    if not _measured.enabled():
        return runs[0]
    hit = _gemm_chosen.get("auto")
    if hit is not None:
        return hit.route
    return gemm_choice(measure=not cannot_time()).route


def gemm_choice(*, measure: bool = True, fresh: bool = False) -> GemmChoice:
    """The GEMM the kernel takes here under ``auto`` (unforced), and why (see
    :class:`GemmChoice`). ``measure=False`` runs nothing: a choice not yet known is the static
    order's. ``fresh=True`` (``qkv tune``) measures where two run, whatever is kept or off,
    and keeps the verdict for this process and on disk."""
    runs = gemm_routes()
    if not runs:
        return GemmChoice("", "none", {}, unavailable_reason() or "the kernel does not run here")
    if len(runs) == 1:
        return GemmChoice(runs[0], "only", {}, "the only GEMM of the kernel that runs here")
    if not fresh:
        if not _measured.enabled():
            return GemmChoice(
                runs[0], "static", {}, "static order (measuring off, QKV_AUTOTUNE=off)"
            )
        hit = _gemm_chosen.get("auto") or _gemm_from_disk(runs)
        if hit is not None:
            if measure:
                with _gemm_lock:
                    hit = _gemm_chosen.setdefault("auto", hit)
            return hit
        if not measure:
            return GemmChoice(runs[0], "static", {}, "static order (not measured yet)")
    if cannot_time():
        return GemmChoice(runs[0], "static", {}, "static order (not measured under tracing)")
    times = _time_gemms(runs)
    choice = GemmChoice(min(times, key=times.__getitem__), "measured", times)
    _measured.store(_GEMM_DISK, {"gemm": choice.route, "times": times})
    with _gemm_lock:
        if fresh:
            _gemm_chosen["auto"] = choice
        return _gemm_chosen.setdefault("auto", choice)


def _gemm_from_disk(runs: tuple[str, ...]) -> GemmChoice | None:
    entry = _measured.stored(_GEMM_DISK)
    if entry is None or entry.get("gemm") not in runs:
        return None
    return GemmChoice(entry["gemm"], "disk", dict(entry.get("times", {})))


def _gemm_runners(runs: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    """A representative call of the kernel on each GEMM of ``runs``: 4 heads of 256 query rows
    over 256 keys, D=64, without weights (the tiles' way, where the GEMMs are the work). Drawn
    from a generator of its own: the global one is left as it was."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, generator=g).to(torch.bfloat16) for _ in "qkv")
    lo, hi = torch.zeros(1, 256, dtype=torch.int64), torch.full((1, 256), 256)

    def runner(code: int) -> Callable[[], object]:
        def run():
            _TIMING.gemm = code
            try:
                return attend_kernel(q, k, v, 0.125, lo, hi, weights=False)
            finally:
                _TIMING.gemm = 0

        return run

    return {name: runner(GEMMS[name]) for name in runs}


def _time_gemms(runs: tuple[str, ...]) -> dict[str, float]:
    """Seconds per representative call on each GEMM, at torch's threads, without autocast."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        runners = _gemm_runners(runs)
        return _measured.time_each(
            runners, rounds=_GEMM_ROUNDS, budget_s=_GEMM_BUDGET_S, clock=_clock
        )


def forget_gemm() -> None:
    """Drop this process's GEMM choice (the next is measured again, or read from disk)."""
    with _gemm_lock:
        _gemm_chosen.clear()
    _measured.forget()


@functools.cache
def _note_once(why: str) -> None:
    _log.debug("bfloat16 scores take the widened float32 GEMM: %s", why)


def available() -> bool:
    """Whether the kernel runs here (built, and a GEMM of :data:`GEMMS` runs: AMX that oneDNN
    packs bfloat16 for, or AVX512-BF16); builds it at the first ask (seconds once, a cached
    load later)."""
    gemm, why = _route()
    if not gemm:
        _note_once(why)
    return gemm != 0


def unavailable_reason() -> str:
    """Why the kernel is not used here (``""`` when it is)."""
    return _route()[1]


def _lib_and_gemm(what: str) -> tuple[ctypes.CDLL, int]:
    """The built library and the GEMM code a kernel call passes it; RuntimeError naming the
    reason where none runs."""
    gemm, why = _route()
    if not gemm:
        raise RuntimeError(f"the bfloat16 {what} kernel cannot run here: {why}")
    return _build()[0], gemm  # type: ignore[return-value]


def scores_(out: Tensor, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``out = scale * q @ k^T`` in float32 for bfloat16 ``q`` and ``k`` on the CPU: by the
    kernel where :func:`available`, else by :func:`scores_widened_`. Returns ``out``.

    Shape:
        out ``(N, T, S)`` float32, q ``(N, T, D)``, k ``(N, S, D)`` -> out.
    """
    if available() and out.stride(-1) == 1 and q.shape[-1] > 0:
        return scores_kernel_(out, q, k, scale)
    return scores_widened_(out, q, k, scale)


def scores_widened_(out: Tensor, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """The slow twin of the kernel: the float32 GEMM of the widened inputs (one rounding per
    float32 sum, as the kernel's).

    Shape:
        out ``(N, T, S)`` float32, q ``(N, T, D)``, k ``(N, S, D)`` -> out.
    """
    kt = k.float().transpose(-2, -1)  # (N, D, S)
    return torch.baddbmm(out, q.float(), kt, beta=0, alpha=scale, out=out)


def scores_kernel_(out: Tensor, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``out = scale * q @ k^T`` by the C++ kernel (:func:`available` must be true): q and k
    are made contiguous (their copies cost T*D and S*D, beside the T*S*D of the product), an
    odd D is padded with a zero column (the kernel reads pairs), and ``out`` is written in
    place through its strides (its last one must be 1).

    Shape:
        out ``(N, T, S)`` float32, q ``(N, T, D)``, k ``(N, S, D)`` bfloat16 -> out.
    """
    lib, gemm = _lib_and_gemm("score")
    N, T, D = q.shape
    S = k.shape[-2]
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or out.dtype != torch.float32:
        raise TypeError(
            f"scores_kernel_: q and k must be bfloat16 and out float32, got {q.dtype}, "
            f"{k.dtype} and {out.dtype}"
        )
    if out.shape != (N, T, S) or k.shape != (N, S, D) or out.stride(-1) != 1:
        raise ValueError(
            f"scores_kernel_: want out (N, T, S) with unit last stride, q (N, T, D), k (N, S, D);"
            f" got out {tuple(out.shape)} strides {out.stride()}, q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if N * T * S == 0:
        return out
    if D % 2:  # VNNI reads D in pairs: a zero column adds nothing to any sum
        q, k = F.pad(q, (0, 1)), F.pad(k, (0, 1))  # (N, T, D+1), (N, S, D+1)
    q, k = q.contiguous(), k.contiguous()
    rc = lib.qkv_bf16_scores(
        q.data_ptr(),
        k.data_ptr(),
        out.data_ptr(),
        N,
        T,
        S,
        q.shape[-1],
        out.stride(0),
        out.stride(1),
        float(scale),
        gemm,
    )
    if rc != 0:
        raise RuntimeError(
            f"the bfloat16 score kernel failed: {lib.qkv_bf16_scores_error().decode()}"
        )
    return out


def weights_kernel(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, causal: bool, rows: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Output, weights and lse of plain or causal (top-left) bfloat16 attention in one fused
    pass of the C++ kernel: :func:`attend_kernel` with every row's keys ``[0, S)``, or
    ``[0, t + 1)`` for causal row ``t``.

    Shape:
        as :func:`attend_kernel`; the weights ``(B, H, T, S)``.
    """
    T, S = q.shape[-2], k.shape[-2]
    lo = torch.zeros(1, T, dtype=torch.int64)
    hi = torch.arange(1, T + 1).clamp_(max=S).view(1, T) if causal else torch.full((1, T), S)
    out, probs, lse = attend_kernel(q, k, v, scale, lo, hi, weights=True, rows=rows)
    assert probs is not None
    return out, probs, lse


def attend_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lo: Tensor,
    hi: Tensor,
    *,
    weights: bool,
    ids: tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor] | None = None,
    rows: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """bfloat16 attention whose query row ``t`` attends the keys ``[lo_t, hi_t)``, in one
    fused pass of the C++ kernel (:func:`available` must be true): float32 scores, softmax and
    lse; the weights rounded once (with ``weights``); the output the float32 weights times the
    values (without ``weights``: the float32 exps times the values over their sum), rounded
    once. Only the key blocks some row of a block of rows sees are computed
    (windows cost their width, not S). With ``ids`` (document ids of the queries and the
    keys, and optionally which rows' ranges hold other ids: only those are compared), a row
    attends only the keys of its own id within its range. A row with no key
    outputs 0, weights 0 and lse -inf.
    NaN/inf entries of q, k and v count as 0, and a query row holding one and every row that
    may attend a key whose key or value holds one output NaN (if it has a key: the contract
    of ``ops/nonfinite.py``, kept here without copies of the inputs).

    q, k and v are read through their strides (a module's heads need no copy; only a last
    dim that is not contiguous is copied, and an odd D is padded with a zero column). The
    output of 4-d inputs is a (B, H, T, Dv) view of (B, T, H, Dv) memory: a module's merge of
    the heads is then a view. k and v may have fewer heads Hk than q, Hk dividing H (GQA:
    query head h attends key and value head ``h // (H // Hk)``, read and packed once, not
    repeated). ``rows``: query rows per task (0: the kernel's choice, a float32 score tile of
    about 1 MiB, 16-64 rows; benchmarks try others).

    Shape:
        q ``(B, H, T, D)`` (or ``(N, T, D)``), k ``(B, Hk, S, D)``, v ``(B, Hk, S, Dv)``
        bfloat16, S >= 1; lo, hi ``(B or 1, T)`` int64 in ``[0, S]`` -> out ``(B, H, T, Dv)``,
        probs ``(B, H, T, S)`` bfloat16 or None, lse ``(B, H, T)`` float32 (without B for 3-d
        inputs); ids ``(B or 1, T)`` and ``(B or 1, S)`` integers, and ``(B or 1, T)`` bool.
    """
    lib, gemm = _lib_and_gemm("attention")
    if q.dim() == 3:  # (N, T, D): one batch element of N heads
        out, probs, lse = attend_kernel(
            q[None], k[None], v[None], scale, lo, hi, weights=weights, ids=ids, rows=rows
        )
        return out[0], None if probs is None else probs[0], lse[0]
    B, H, T, D = q.shape
    S, Dv = v.shape[-2:]
    if {q.dtype, k.dtype, v.dtype} != {torch.bfloat16}:
        raise TypeError(
            f"attend_kernel: q, k and v must be bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    Hk = k.shape[1] if k.dim() == 4 else 0
    if k.shape != (B, Hk, S, D) or v.shape != (B, Hk, S, Dv) or S == 0 or (H % Hk if Hk else H):
        raise ValueError(
            f"attend_kernel: want q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, Dv) with S >= 1"
            f" and Hk dividing H; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if lo.shape != hi.shape or lo.dim() != 2 or lo.shape[1] != T or lo.shape[0] not in (1, B):
        raise ValueError(
            f"attend_kernel: want lo and hi (B or 1, T) = ({B} or 1, {T}), got "
            f"{tuple(lo.shape)} and {tuple(hi.shape)}"
        )
    out = torch.empty(B, T, H, Dv, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, T, Dv)
    probs = empty_large((B, H, T, S), dtype=torch.bfloat16, device=q.device) if weights else None
    lse = torch.empty(B, H, T, dtype=torch.float32)
    if B * H * T == 0:
        return out, probs, lse
    if D % 2:  # VNNI reads D in pairs: a zero column adds nothing to any score
        q, k = F.pad(q, (0, 1)), F.pad(k, (0, 1))  # (B, H, T, D+1), (B, H, S, D+1)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    lo, hi = (r.to(torch.int64).clamp(0, S).contiguous() for r in (lo, hi))  # (B?, T)
    q_ids = kv_ids = mixed = None
    if ids is not None:
        q_ids, kv_ids = (i.to(torch.int64).contiguous() for i in ids[:2])  # (B?, T), (B?, S)
        if len(ids) == 3:  # rows whose range holds other ids: the others need no comparing
            flags = ids[2].to(torch.uint8)  # (B?, T)
            if flags.dim() == 2 and flags.shape[0] > q_ids.shape[0]:  # (per-batch key ranges)
                q_ids = q_ids.expand(flags.shape[0], T).contiguous()  # (B, T): one row stride
            mixed = flags.expand(q_ids.shape).contiguous()  # (B?, T)
        if q_ids.dim() != 2 or kv_ids.dim() != 2 or q_ids.shape[1] != T or kv_ids.shape[1] != S:
            raise ValueError(
                f"attend_kernel: want ids (B or 1, {T}) and (B or 1, {S}), got "
                f"{tuple(q_ids.shape)} and {tuple(kv_ids.shape)}"
            )
    strides = [x for t in (q, k, v, out) for x in t.stride()[:3]]  # (batch, head, row) each
    rc = lib.qkv_bf16_attend(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        lo.data_ptr(),
        hi.data_ptr(),
        None if q_ids is None else q_ids.data_ptr(),
        None if kv_ids is None else kv_ids.data_ptr(),
        None if mixed is None else mixed.data_ptr(),
        T if q_ids is not None and q_ids.shape[0] > 1 else 0,
        S if kv_ids is not None and kv_ids.shape[0] > 1 else 0,
        None if probs is None else probs.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        (ctypes.c_int64 * 12)(*strides),
        T if lo.shape[0] > 1 else 0,
        H,
        Hk,
        B * H,
        T,
        S,
        q.shape[-1],
        Dv,
        float(scale),
        rows,
        gemm,
    )
    if rc != 0:
        raise RuntimeError(
            f"the bfloat16 attention kernel failed: {lib.qkv_bf16_scores_error().decode()}"
        )
    return out, probs, lse
