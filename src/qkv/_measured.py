"""Choices measured on this machine, kept on disk: what ``auto`` and the CPU routes share.

qkv makes its speed choices by timing on the machine at hand (issue 38): ``auto``'s backend
(``qkv.autotune``) and the CPU kernels' routes (``qkv.ops.cpu_isa``: native or float32 half
GEMMs: :class:`MeasuredRoute`). Each kind of
choice is measured once, kept in memory for the process, and kept on disk for the next
process on the same machine. This module is the part they share, below
both (``ops`` may not import ``autotune``): the switch, the timer, the machine's name and the
file.

* ``QKV_AUTOTUNE=off`` turns measuring off everywhere (each choice falls back to its fixed
  rule: the static order of backends, the CPU flags for half GEMMs); ``=on`` (the default)
  measures.
* The file: ``$QKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``;
  ``autotune-<digest>.json``, one per machine (CPU model and flags or GPU name, torch and qkv
  versions, a digest of qkv's kernel sources), a JSON object
  ``{"machine": ..., "choices": {name: entry}}``. The names of ``auto``'s choices are call
  kinds (``cpu/float32/causal/...``); a CPU route's name starts with ``route:``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Choice",
    "MeasuredRoute",
    "cache_path",
    "cannot_time",
    "clock",
    "cpu_features",
    "cpu_model",
    "enabled",
    "env",
    "forget",
    "machine_key",
    "store",
    "stored",
    "time_each",
    "tracing",
]

_ENABLED: dict[str | None, bool] = {}  # QKV_AUTOTUNE's raw value -> on/off (read every call)


def env(name: str) -> str | None:
    """``os.environ.get(name)``, read without encoding the name and decoding the value again
    on every call as ``os.environ`` does: for the settings read on every attention call. On a
    decoding step's cold caches (its projections stream megabytes of weights between calls)
    ``os.environ.get`` cost 16 µs, this 2-3 (benchmarks/RESULTS.md, 2026-11-27). Falls back
    to ``os.environ.get`` where ``os.environ`` keeps no mapping of its own."""
    data = _ENVIRON_DATA
    if data is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    raw = data.get(key)
    if raw is None:
        return None
    value = _ENV_VALUES.get(raw)
    if value is None:
        if len(_ENV_VALUES) >= 256:
            _ENV_VALUES.clear()
        value = _ENV_VALUES[raw] = os.environ.decodevalue(raw)
    return value


# os.environ's own mapping of encoded names to encoded values (CPython's ``_Environ``: set and
# deleted with it), the names encoded, and the values decoded
_ENVIRON_DATA: dict | None = (
    getattr(os.environ, "_data", None)
    if hasattr(os.environ, "encodekey") and hasattr(os.environ, "decodevalue")
    else None
)
_ENV_KEYS: dict[str, object] = {}
_ENV_VALUES: dict[object, str] = {}


def enabled() -> bool:
    """Whether qkv measures its speed choices (``QKV_AUTOTUNE``, default on)."""
    raw = env("QKV_AUTOTUNE")
    known = _ENABLED.get(raw)
    if known is not None:
        return known
    value = (raw or "on").strip().lower()
    if value in ("on", "1", "true", "yes", ""):
        _ENABLED[raw] = True
    elif value in ("off", "0", "false", "no"):
        _ENABLED[raw] = False
    else:
        raise ValueError(f"QKV_AUTOTUNE={value!r}: use 'on' or 'off'")
    return _ENABLED[raw]


@dataclass(frozen=True)
class Choice:
    """A route a measured choice took, and why: ``source`` says where the verdict came from
    (each chooser names its own: measured in this process, read from disk, forced, the static
    rule, ...), ``times`` the seconds per representative run of each candidate where measured,
    ``note`` the reason where not."""

    route: str
    source: str
    times: dict[str, float]
    note: str = ""

    def reason(self) -> str:
        if self.times:
            ranked = sorted(self.times.items(), key=lambda kv: kv[1])
            shown = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in ranked)
            return f"{self.route}: faster measured on this machine ({shown}; {self.source})"
        return f"{self.route or 'none'}: {self.note or self.source}"


def tracing() -> bool:
    """Whether the call is being traced or transformed rather than run: ``torch.compile``,
    ``torch.export``, or a ``torch.func`` transform (vmap, grad, jacrev). Then nothing may read
    tensor values on the host (``.item()``, ``bool(tensor)``): the paths that do are passed
    over for ones written in tensor operations."""
    return torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None


def cannot_time() -> bool:
    """Whether nothing may run to be timed here: under torch.compile, export, a torch.func
    transform (:func:`tracing`) or a dispatch mode (fake tensors, op counters), where a run
    would not time the kernels either. The CPU routes' measured choices ask it."""
    return tracing() or torch._C._len_torch_dispatch_stack() > 0


class MeasuredRoute:
    """A route of the CPU kernels chosen per key by timing each candidate once on this
    machine: forced by an environment switch, kept for the process (it never changes there)
    and on disk (``route:<name>/<key>`` in :func:`cache_path`'s file), or, with measuring off
    (``QKV_AUTOTUNE=off``), not yet measured and not to be (``measure=False``), or under
    tracing (:func:`cannot_time`), the static rule's.

    ``measure(key)``: seconds per representative run of each route (its own threads, grad
    mode and autocast). ``static()``: the route without a measurement (the CPU flags' rule,
    asked on every call where measuring is off); ``rule(route)``: its words. A
    :class:`Choice` (of ``choice_type``, a subclass naming the kind) says which route a key
    takes and why, with ``source`` ``"forced"``, ``"measured"`` (in this process),
    ``"disk"`` (an earlier process or ``qkv tune``) or ``"flags"``.
    """

    def __init__(
        self,
        name: str,
        routes: tuple[str, ...],
        switch: str,
        static: Callable[[], str],
        rule: Callable[[str], str],
        measure: Callable[[str], dict[str, float]],
        choice_type: type[Choice] = Choice,
    ) -> None:
        self.name, self.routes, self.switch = name, routes, switch
        self._static, self._rule, self._measure, self._type = static, rule, measure, choice_type
        self._lock = threading.Lock()
        self._chosen: dict[str, Choice] = {}  # key -> this process's route (never changes)

    def route(self, key: str) -> str:
        """The route ``key`` takes: the hot path (after the first call, two environment reads
        and a dict lookup)."""
        forced = self.forced()
        if forced is not None:
            return forced
        if not enabled():
            return self._static()
        hit = self._chosen.get(key)
        if hit is not None:
            return hit.route
        return self.choice(key, measure=not cannot_time()).route

    def choice(self, key: str, *, measure: bool = True, fresh: bool = False) -> Choice:
        """The route ``key`` takes here, and why. ``measure=False`` runs nothing: a route not
        yet known is the static rule's. ``fresh=True`` (``qkv tune``) measures whatever is
        kept, forced or off, and keeps the verdict for this process and on disk."""
        if not fresh:
            forced = self.forced()
            if forced is not None:
                return self._type(forced, "forced", {}, f"forced by {self.switch}={forced}")
            if not enabled():
                return self._static_choice("measuring is off, QKV_AUTOTUNE=off")
            hit = self._chosen.get(key) or self._from_disk(key)
            if hit is not None:
                if measure:
                    with self._lock:
                        hit = self._chosen.setdefault(key, hit)
                return hit
            if not measure:
                return self._static_choice("not measured yet")
        if cannot_time():
            return self._static_choice("not measured under tracing")
        times = self._measure(key)
        choice = self._type(min(times, key=times.__getitem__), "measured", times)
        store(self._disk_name(key), {"route": choice.route, "times": times})
        with self._lock:
            if fresh:
                self._chosen[key] = choice
            return self._chosen.setdefault(key, choice)

    def forced(self) -> str | None:
        """The route the switch forces, or None (ValueError for a value it does not know)."""
        raw = (env(self.switch) or "").strip().lower()
        if raw in self.routes:
            return raw
        if raw:
            allowed = " or ".join(repr(r) for r in self.routes)
            raise ValueError(f"{self.switch} must be {allowed}, got {raw!r}")
        return None

    def forget(self) -> None:
        """Drop this process's routes (the next call of each key measures again, or reads the
        disk; the disk is read again)."""
        with self._lock:
            self._chosen.clear()
        forget()

    def _static_choice(self, why: str) -> Choice:
        route = self._static()
        return self._type(route, "flags", {}, f"{self._rule(route)}; {why}")

    def _disk_name(self, key: str) -> str:
        return f"route:{self.name}/{key}"

    def _from_disk(self, key: str) -> Choice | None:
        entry = stored(self._disk_name(key))
        if entry is None or entry.get("route") not in self.routes:
            return None
        return self._type(entry["route"], "disk", dict(entry.get("times", {})))


def clock() -> float:
    """Seconds, for timing (each user reads it through a module global of its own, which
    tests replace with a fake clock)."""
    return time.perf_counter()


def time_each(
    runners: dict[str, Callable[[], object]],
    *,
    rounds: int,
    budget_s: float,
    clock: Callable[[], float] = clock,
) -> dict[str, float]:
    """Seconds per run of each runner: the fastest of up to ``rounds`` timed runs, after one
    untimed run each (first-use costs: kernels generated, caches filled). The runners take
    turns within a round, so that a burst of load on a shared machine falls on all of them;
    rounds stop once ``budget_s`` has passed (two rounds at least)."""
    for run in runners.values():
        run()
    best = dict.fromkeys(runners, float("inf"))
    start = clock()
    for i in range(rounds):
        for name, run in runners.items():
            t0 = clock()
            run()
            best[name] = min(best[name], clock() - t0)
        if i >= 1 and clock() - start > budget_s:
            break
    return best


# --- the machine -------------------------------------------------------------------------------


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


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def kernels_digest() -> str:
    """A digest of the sources of qkv's kernels (every ``.py``, ``.cpp`` and ``.h`` under
    ``qkv/ops``): a choice measured with other kernels holds no more. qkv's version alone
    missed that where it is run from a source tree: a kernel made 2x faster kept losing to the
    choice its slower self had measured (AMD Zen 4, bfloat16, 2026-11-27)."""
    return sources_digest(Path(__file__).parent / "ops")


def sources_digest(root: Path) -> str:
    """A digest of the names and bytes of the ``.py``, ``.cpp`` and ``.h`` files under
    ``root``, read now."""
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def machine_key() -> str:
    """What a measurement holds for: the processor (GPU name or CPU model and flags), the
    instructions torch and oneDNN may use (``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` hold
    them to AVX2, and half GEMMs slow down 10x), torch's and qkv's versions, and the sources
    of qkv's kernels (:func:`kernels_digest`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        qkv_version = version("qkv")
    except PackageNotFoundError:  # run from a source tree, not installed
        qkv_version = "source"

    parts = [platform.machine(), cpu_model(), " ".join(sorted(cpu_features()))]
    parts.append(f"aten {torch.backends.cpu.get_cpu_capability()}")
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if onednn:
        parts.append(f"onednn {onednn}")
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(), str(torch.cuda.get_device_capability())]
    parts += [f"torch {torch.__version__}", f"qkv {qkv_version} kernels {kernels_digest()}"]
    return " | ".join(parts)


# --- the file ----------------------------------------------------------------------------------


def cache_path() -> Path:
    """The file this machine's choices are kept in."""
    root = os.environ.get("QKV_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "qkv")
    digest = hashlib.blake2b(machine_key().encode(), digest_size=8).hexdigest()
    return Path(root) / f"autotune-{digest}.json"


_lock = threading.Lock()


def _read(path: Path) -> dict:
    """The choices in ``path`` (an unreadable or foreign file counts as empty)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    choices = data.get("choices", {}) if isinstance(data, dict) else {}
    return choices if isinstance(choices, dict) else {}


@functools.cache
def _disk() -> dict:
    """The stored choices, read once per process (later processes' writes are not seen)."""
    return _read(cache_path())


def stored(name: str) -> dict | None:
    """The entry kept on disk under ``name`` (as this process first read the file, plus its
    own writes), or None."""
    entry = _disk().get(name)
    return entry if isinstance(entry, dict) else None


def store(name: str, entry: dict) -> None:
    """Keep ``entry`` on disk under ``name``: merged into the file as it is now (another
    process's choices stay), written atomically. A cache that cannot be written is skipped:
    the choice still holds for this process."""
    with _lock:
        _disk()[name] = entry
        path = cache_path()
        merged = {**_read(path), name: entry}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": machine_key(), "choices": merged}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass


def forget() -> None:
    """Drop this process's copy of the file (the next read reads it again)."""
    _disk.cache_clear()
