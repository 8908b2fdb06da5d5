"""``auto`` chooses by measurement: the backends that can take a call, timed on this machine.

Flags guess; timings know. The first time ``backend="auto"`` meets a kind of call (device,
dtype, mask kind, score change, whether a gradient is wanted, and the sizes in power-of-two
buckets), it runs each backend that can take the call a few times on the call's own inputs
(forward, or forward and backward when a gradient is wanted; no more than a few calls' time
each; a wanted trace does not count: its weights come after any kernel alike), as a whole
call of ``qkv.scaled_dot_product_attention`` with that backend named: what a caller pays,
the checks, the NaN/inf contract's steps and a decoding step's lane included (timing a
backend's ``run`` alone chose tiled's bfloat16 kernel for a decoding step with a key mask,
T=1, S=128, 4 heads of 32, at 69 us against torch's 90, where the whole calls took 137 us
and 47: torch's call runs its lane, tiled's steps around its kernel cost more), picks the
fastest, and keeps the choice: in memory for the process (the choice never changes within
it), and on disk for the next process on the same machine (``$QKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``; one JSON file per machine: CPU model, flags
and the ISA torch may use, or GPU name, torch and qkv versions). The file, the machine's name,
the switch and the timer are ``qkv._measured``'s, shared with the CPU routes' choices
(``qkv.ops.cpu_isa``: native or float32 half GEMMs), which live below ``auto``.

What is not measured:
  * a call only one backend can take, and the reference backend (the slow twin, which holds
    every (T, S) score: the ground truth, not a speed path);
  * backends whose first call compiles (``flex`` off CUDA, ``auto_prefers``) unless a
    ``qkv tune`` run measured them and left its verdict on disk;
  * calls under tracing (torch.compile, export, vmap: nothing may run twice there) and calls
    on meta tensors: the static order (``priority``) decides them.

``QKV_AUTOTUNE=off`` turns measuring off (the static order, as before; the CPU routes' flag
rules too); ``=on`` (the default) measures. Whatever wins, every backend meets the tolerance
policy, so the choice changes speed and never the result beyond it.
``qkv.dispatch.explain(call)`` says which backend a call would take and why; ``qkv tune``
(``qkv.dispatch.tune``) measures ahead of time, compiling backends included.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _measured
from ._measured import cache_path, enabled, machine_key
from ._measured import clock as _clock
from .ops import cpu_isa
from .ops.base import Backend, tracing
from .ops.call import AttentionCall
from .ops.kinds import bucket, call_kind
from .ops.kinds import kind_key as _key
from .ops.kinds import kind_string as _kind_string
from .ops.tiled import route as tiled_route

__all__ = [
    "Choice",
    "bucket",
    "cache_path",
    "call_kind",
    "enabled",
    "forget",
    "generation",
    "known",
    "machine_key",
    "measured_choice",
    "stored_choice",
    "time_whole_calls",
]

# Timed runs per candidate, the candidates in turn run by run (a burst of load on a shared
# machine then falls on all of them): 3 to 15, within about 20 ms a candidate. A decoding
# step's call (40-140 us) gets all 15; with 3, two backends 10% apart at T=1, S=128 were
# taken the wrong way round now and then (bfloat16, 8 heads of 64: tiled's 95 us kernel lost
# to torch's 115 in one run of benchmarks/bench_call_cost_ab.py). A long call gets 3: with 2,
# float32 at T=1024 held to AVX2 on the AMX Xeon once took the tiled loop (15.0 ms in the
# benchmark) over torch's kernel (13.2), which five fresh processes all measured faster.
_RUNS, _MIN_RUNS, _BUDGET_S = 15, 3, 0.02
# A backend after another in the static order is taken only when it beats it by more than
# this: a few runs on a shared machine scatter by about as much, and the static order holds
# what is known (at T=1024, fp32, torch's kernel and the tiled loop were timed 28.1 and 27.7
# ms and the tiled loop taken, then ran 24.3 ms against torch's 22.2 in the benchmark).
_MARGIN = 0.05
# A choice against the static order is timed again (the two backends, a second round, each
# backend's fastest run of both kept) before it is taken and kept on disk: at T=1024, fp32,
# plain, on the loaded AMX Xeon, one round took the tiled loop over torch's kernel, which
# then ran 12.64 ms against the loop's 13.23 in the benchmark's rounds (nineteenth session).


@dataclass(frozen=True)
class Choice:
    """The backend ``auto`` takes for a kind of call, and why.

    ``times``: seconds per call of each candidate measured (empty for the static order);
    ``source``: ``"measured"`` (this process), ``"disk"`` (an earlier process or
    ``qkv tune``), ``"static"`` (measuring off, or nothing to compare).
    """

    backend: str
    source: str
    times: dict[str, float]

    def reason(self) -> str:
        if not self.times:
            return f"{self.backend}: the static order ({self.source})"
        ranked = sorted(self.times.items(), key=lambda kv: kv[1])
        shown = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in ranked)
        if self.times.get(self.backend) == ranked[0][1]:
            return f"{self.backend}: fastest measured on this machine ({shown}; {self.source})"
        return (
            f"{self.backend}: first in the static order of those measured within "
            f"{_MARGIN:.0%} of the fastest on this machine ({shown}; {self.source})"
        )


# --- the choice --------------------------------------------------------------------------------

_lock = threading.Lock()
_chosen: dict[tuple, Choice] = {}  # _key(call) -> choice, for this process (never changes)


def measured_choice(
    call: AttentionCall,
    candidates: list[Backend],
    compiles: Callable[[Backend], bool],
    *,
    fresh: bool = False,
) -> Choice | None:
    """The backend ``auto`` takes for ``call`` among ``candidates`` (those that can take it,
    fastest first by the static order), or None for the static order's first.

    ``compiles(backend)``: whether the backend's first call compiles (it is then measured only
    by ``qkv tune``, whose verdict on disk counts). ``fresh``: measure every candidate, the
    compiling ones too, whatever is kept (``qkv tune``).
    """
    if tracing() or call.device.type == "meta":
        return None
    if not fresh and not enabled():
        return None
    if len(candidates) < 2:
        _keep_static(_key(call))
        return None
    key = _key(call)
    kind = _kind_string(key)
    with _lock:
        hit = None if fresh else _chosen.get(key)
    if hit is not None:
        return hit if any(b.name == hit.backend for b in candidates) else None
    names = {b.name for b in candidates}
    stored = None if fresh else _measured.stored(kind)
    if stored is not None and stored.get("backend") in names:
        choice = Choice(stored["backend"], "disk", dict(stored.get("times", {})))
    else:
        timed = [b for b in candidates if fresh or not compiles(b)]
        if len(timed) < 2:
            _keep_static(key)
            return None
        times = _time_backends(timed, call)
        if not times:
            return None
        order = [b.name for b in timed]
        best = _within_margin(times, order)
        first = next(n for n in order if n in times)
        if best != first:  # against the static order: confirmed by a second round of both
            again = _time_backends([b for b in timed if b.name in (first, best)], call)
            times.update({n: min(times[n], t) for n, t in again.items()})
            best = _within_margin(times, order)
        choice = Choice(best, "measured", times)
        _measured.store(kind, {"backend": choice.backend, "times": choice.times})
    with _lock:
        if fresh or not _chosen.get(key, _STATIC).backend:
            _chosen[key] = choice
            _generation[0] += 1
        _chosen.setdefault(key, choice)
        return _chosen[key]


def _within_margin(times: dict[str, float], order: list[str]) -> str:
    """The first backend in the static ``order`` whose time is within ``_MARGIN`` of the
    fastest's (the fastest itself when none before it is)."""
    fastest = min(times.values())
    return next(n for n in order if n in times and times[n] <= fastest * (1 + _MARGIN))


_STATIC = Choice("", "static", {})  # kept for kinds that have nothing to measure


def _keep_static(key: tuple) -> None:
    """Remember that calls of this kind take the static order (fewer than two backends to
    time), so later calls skip asking every backend."""
    with _lock:
        _chosen.setdefault(key, _STATIC)


def _time_backends(backends: list[Backend], call: AttentionCall) -> dict[str, float]:
    """Seconds per call of each backend on ``call``: the fastest of its timed runs after one
    untimed run, the backends in turn run by run (see ``_RUNS``). A backend that raises is
    left out (it is then not chosen)."""
    runs: dict[str, Callable[[], None]] = {}
    for backend in backends:
        run = _runner(backend, call)
        try:
            run()  # untimed: plans, caches, kernels loaded
        except Exception:  # a backend that fails here is simply not chosen
            continue
        runs[backend.name] = run
    best = dict.fromkeys(runs, float("inf"))
    start = _clock()
    for i in range(_RUNS):
        for name, run in list(runs.items()):
            t0 = _clock()
            try:
                run()
            except Exception:
                del runs[name], best[name]
                continue
            best[name] = min(best[name], _clock() - t0)
        if i >= _MIN_RUNS - 1 and _clock() - start > _BUDGET_S * max(len(runs), 1):
            break
    return best


# ``qkv.functional``'s whole call of one backend (``whole(call, name)``, the output or
# ``(output, trace)``), set by that module when it loads (it sits above this one): what is
# timed. None (this module alone): a backend's ``run``.
_WHOLE_CALL: list[Callable[[AttentionCall, str], object] | None] = [None]


def time_whole_calls(whole: Callable[[AttentionCall, str], object]) -> None:
    """Time each candidate as ``whole(call, backend_name)`` (see the module's notes)."""
    _WHOLE_CALL[0] = whole


def _runner(backend: Backend, call: AttentionCall) -> Callable[[], None]:
    """One call of ``backend``, whole (:func:`time_whole_calls`; a call with dropout by its
    ``run`` alone, whose draws the whole call's checks would not change): forward, or
    forward and backward on detached copies of the inputs (the caller's tensors get no
    gradient from the measurement)."""
    cuda = call.device.type == "cuda"
    whole = _WHOLE_CALL[0]

    def attend(c: AttentionCall) -> torch.Tensor:
        if whole is None or c.dropout_p != 0.0:
            return backend.run(c).out
        result = whole(c, backend.name)
        return result[0] if isinstance(result, tuple) else result  # type: ignore[return-value]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(call.device)

    if not call.wants_grad:

        def forward() -> None:
            with torch.no_grad():
                attend(call)
            sync()

        return forward

    import dataclasses

    q, k, v = (
        t.detach().requires_grad_(t.requires_grad) for t in (call.query, call.key, call.value)
    )
    copy = dataclasses.replace(call, query=q, key=k, value=v)
    leaves = [t for t in (q, k, v) if t.requires_grad]

    def both() -> None:
        out = attend(copy)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        sync()

    return both


def forget() -> None:
    """Drop this process's choices, the CPU routes' too (``ops.cpu_isa``): as in a new
    process, the next call of each kind is measured again, or read from disk."""
    with _lock:
        _chosen.clear()
        _generation[0] += 1
    cpu_isa.forget()
    tiled_route.RANGES.forget()


_generation = [0]  # bumped whenever a kept choice is dropped or replaced


def generation() -> int:
    """A number that changes whenever this process drops or replaces a kept choice
    (:func:`forget`, ``qkv tune``): plans made from the choices before are stale."""
    return _generation[0]


def stored_choice(call: AttentionCall) -> Choice | None:
    """The choice kept for ``call``'s kind, in this process or on disk (nothing is run)."""
    key = _key(call)
    with _lock:
        hit = _chosen.get(key)
    if hit is not None and hit.backend:
        return hit
    stored = _measured.stored(_kind_string(key))
    if stored is None or "backend" not in stored:
        return None
    return Choice(stored["backend"], "disk", dict(stored.get("times", {})))


def known(call: AttentionCall) -> str | None:
    """What this process keeps for ``call``'s kind (a dict lookup): a backend's name, ``""``
    for the static order, None when the kind is new."""
    if not _chosen:
        return None
    hit = _chosen.get(_key(call))
    return None if hit is None else hit.backend
