"""One measurement of the benchmark, in a fresh process of its own, and a run of many
(see :mod:`qkv.bench` for what is measured and how).

The parent (:func:`measure`) starts ``python -c "from qkv.bench.runner import worker_main;
worker_main()" JOB``; the worker runs :func:`run_measurement` and prints one JSON line, so
that each measurement's peak memory is its own.

Shape alphabet: B batch, H heads, T query length, D head dim.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import torch
from torch import Tensor

from .. import masks
from ..dispatch import backend_names, select
from ..functional import linear_attention, scaled_dot_product_attention
from ..ops import AttentionCall
from ..ops.linear import Favor
from ..trace import AttentionTrace
from ..training import preserve_torch_state
from .report import _one_line, _progress, add_ratios, environment, write_json_atomic
from .specs import (
    DTYPES,
    LINEAR_IMPLS,
    PEER,
    B,
    BenchConfig,
    D,
    H,
    Spec,
    available_bytes,
    mask_density,
    mask_mod_for,
    num_features,
    skip_reason,
    spec_flops,
)

__all__ = ["measure", "run_measurement", "run_specs", "worker_main"]

# ---- one measurement, in its own process ---------------------------------------------------


def measure(spec: Spec, config: BenchConfig) -> dict:
    """Run ``spec`` in a fresh process; a record with ``status`` ok, skipped, timeout, oom or
    error and, when ok, ``time_s`` and ``peak_extra_mib``."""
    job = dict(
        asdict(spec),
        min_run_time=config.min_run_time,
        threads=config.threads,
        run_all=config.run_all,
    )
    cmd = [
        sys.executable,
        "-c",
        "from qkv.bench.runner import worker_main; worker_main()",
        json.dumps(job),
    ]
    started = time.perf_counter()
    try:
        proc = subprocess.run(  # a failed worker is a record: _parse_worker reads its exit
            cmd,
            capture_output=True,
            text=True,
            timeout=config.timeout,
            env=_child_env(),
            check=False,
        )
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
        return dict(
            status=status,
            reason=f"process killed by signal {sig}"
            + (" (out of memory, most likely)" if sig == 9 else ""),
        )
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
    except Exception as e:
        result = dict(status="error", reason=_one_line(e))
    print(json.dumps(result))


@preserve_torch_state()
def run_measurement(
    spec: Spec, min_run_time: float, threads: int | None = None, run_all: bool = False
) -> dict:
    """Measure ``spec`` in this process (see :func:`measure` for a fresh one). Torch's threads
    and random state are put back afterwards."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    grad = spec.mode == "fwdbwd"
    q, k, v = (
        torch.randn(B, H, spec.T, D, dtype=DTYPES[spec.dtype], requires_grad=grad) for _ in range(3)
    )  # (B, H, T, D) each
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
    return dict(
        status="ok",
        reason="",
        time_s=m.median,
        runs=m.number_per_run * len(m.times),
        warmup_s=warmup_s,
        peak_extra_mib=(peak - before) / 1024,
        backend=backend,
        threads=torch.get_num_threads(),
    )


def _time(step: Callable[[], None], min_run_time: float, warmup_s: float):
    """A torch.utils.benchmark Measurement of ``step`` with all of torch's threads (Timer's
    default is one). A call longer than the budget is timed once: blocked_autorange would
    spend one more, uncounted, call on choosing its block size."""
    from torch.utils import benchmark

    timer = benchmark.Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    if warmup_s > min_run_time:
        return timer.timeit(1)
    return timer.blocked_autorange(min_run_time=min_run_time)


def _warm_small(spec: Spec, grad: bool, T: int = 64) -> None:
    """One call of the same implementation at a small T: one-time set-up (the autograd
    engine's threads, lazily loaded kernels: ~40 MiB for a first backward) must not count in
    the measurement's peak."""
    small = Spec(spec.case, min(T, spec.T), spec.dtype, spec.mode, spec.impl)
    q, k, v = (
        torch.randn(B, H, small.T, D, dtype=DTYPES[spec.dtype], requires_grad=grad)
        for _ in range(3)
    )  # (B, H, T, D) each
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


def _attend(
    spec: Spec,
) -> Callable[[Tensor, Tensor, Tensor], Tensor | tuple[Tensor, AttentionTrace]]:
    """``attend(q, k, v) -> out`` for the implementation; masks are built here, once. (qkv's
    functions are typed to return a trace too; none is asked for here, so it is ``out``.)"""
    if spec.impl in (PEER, "torch"):  # torch only gets none and causal: no dense mask
        return _torch_dense(spec.case, spec.T)
    if spec.impl in ("linear", "performer"):
        causal = spec.case == "causal"
        feature_map = Favor(D, seed=0) if spec.impl == "performer" else "elu"
        return lambda q, k, v: linear_attention(q, k, v, feature_map=feature_map, is_causal=causal)
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


def run_specs(
    specs: list[Spec],
    config: BenchConfig,
    json_path: Path | None = None,
    *,
    log: TextIO | None = None,
    previous: list[dict] | None = None,
) -> list[dict]:
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
    print(
        f"qkv bench: {len(specs)} measurements"
        + (f" ({kept} kept from the earlier run)" if kept else "")
        + f", each in a fresh process (timeout {config.timeout:g} s)",
        file=log,
        flush=True,
    )
    for i, spec in enumerate(specs, 1):
        old = done.get(_spec_key(asdict(spec)))
        records.append(_resumed(old) if old else _record(spec, config))
        add_ratios(records)
        print(
            f"[{i:>{len(str(len(specs)))}}/{len(specs)}] {_progress(records[-1])}",
            file=log,
            flush=True,
        )
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
    base = dict(
        asdict(spec), S=spec.T, B=B, H=H, D=D, density=mask_density(spec.case, spec.T), flops=flops
    )
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
