"""Peak memory of a long forward pass with and without ``qkv.capture`` (issue 13: < 1 GiB extra).

The model is a 16-layer ``qkv.DecoderLM`` (C=256, H=4, sinusoidal positions) run on one
sequence of T=8192 tokens, in inference. The capture takes every layer and every head, rows
bounded to the last 16 query positions (``rows=range(T - 16, T)``): what a user looking at
how the last tokens of a long context attend would ask for.

Method: each measurement runs in a fresh Python process (nothing one run allocated or cached
is seen by the other). The process builds the model and the tokens, runs a short warm-up
forward (T=256, under a capture, so both runs have loaded the same kernels and code), then
takes its resident set size (``VmRSS``) as the base, resets the kernel's peak-RSS counter
(``echo 5 > /proc/self/clear_refs`` resets ``VmHWM``), runs the measured forward (alone, or
inside the capture) and reads the peak (``VmHWM``). Peak minus base is the forward's own peak
memory, everything the process touched at once: torch's CPU tensors (freed to the OS when
large, so RSS follows them), the capture's records (still alive when the peak is read) and its
transient buffers. Where ``/proc/self/clear_refs`` cannot be written, the peak is
``ru_maxrss`` of the fresh process and the base the RSS before the forward (the same for
both runs, so their difference still holds).

RSS counts what the C allocator keeps, not only live tensors: glibc's malloc raises its mmap
threshold to the largest block freed, and blocks below it then come from a heap that gives
freed memory back only from its top. Each pair of runs is therefore made twice: with malloc as
it comes (what a user sees) and with ``MALLOC_MMAP_THRESHOLD_=131072`` (every large tensor its
own mapping, unmapped when freed, so RSS follows the live tensors).

Usage:
    python benchmarks/capture_memory.py                      # T=8192, 16 layers: ~2 min, 2 cores
    python benchmarks/capture_memory.py --backend tiled --out benchmarks/results/x.json
    python benchmarks/capture_memory.py --T 2048 --layers 4  # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import qkv

MiB = 2**20
# glibc's malloc as it comes (its mmap threshold rises to the largest block freed, so later
# blocks below it come from the heap and freed ones may stay resident), and with the
# threshold fixed at 128 KiB (every large tensor its own mapping, unmapped when freed: RSS
# then follows the live tensors closely).
MALLOC = {
    "default malloc": {},
    "MALLOC_MMAP_THRESHOLD_=131072": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}


def _status(field: str) -> int | None:
    """A field of /proc/self/status in bytes, or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(mode: str, a: argparse.Namespace) -> dict:
    """Build, warm up and measure one forward (``mode`` "forward" or "capture") here."""
    torch.manual_seed(0)
    model = qkv.DecoderLM(
        256,
        a.embed_dim,
        a.heads,
        a.layers,
        positions="sinusoidal",
        attention_options={"backend": a.backend},
    ).eval()
    tokens = torch.randint(0, 256, (1, a.T))  # (1, T)
    with torch.inference_mode():
        with qkv.capture(model, rows=[-1]):
            model(tokens[:, :256])
        gc.collect()
        base = _status("VmRSS")
        reset = _reset_peak()
        t0 = time.perf_counter()
        if mode == "capture":
            with qkv.capture(model, rows=range(a.T - a.rows, a.T)) as cap:
                logits = model(tokens)  # (1, T, V)
            kept = sum(
                t.numel() * t.element_size()
                for r in cap
                for t in (r.probs, r.lse, r.batch, r.heads, r.rows)
            )
            records, backend = len(cap), cap.records[0].backend
        else:
            logits = model(tokens)  # (1, T, V)
            kept, records, backend = 0, 0, None
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM") if reset else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del logits
    return {
        "mode": mode,
        "base_bytes": base,
        "peak_bytes": peak,
        "forward_peak_bytes": peak - base,
        "kept_bytes": kept,
        "records": records,
        "backend": backend,
        "seconds": seconds,
        "method": "VmHWM reset by /proc/self/clear_refs" if reset else "ru_maxrss",
    }


def _run_child(mode: str, args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *args, "--child", mode],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rows", type=int, default=16, help="last query rows captured")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    p.add_argument("--child", choices=["forward", "capture"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a)))
        return 0
    args = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
    print(
        f"DecoderLM: {a.layers} layers, C={a.embed_dim}, H={a.heads}, T={a.T}, B=1, float32, "
        f"inference, backend {a.backend}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; capture: rows {a.T - a.rows}..{a.T - 1}, "
        f"all layers, all heads"
    )
    results = {}
    for malloc, env in MALLOC.items():
        runs = {mode: _run_child(mode, args, env) for mode in ("forward", "capture")}
        f, c = runs["forward"], runs["capture"]
        extra = c["forward_peak_bytes"] - f["forward_peak_bytes"]
        results[malloc] = {"runs": runs, "extra_bytes": extra}
        print(f"{malloc} ({f['method']}; backend {c['backend']}):")
        print(
            f"  forward alone          peak {f['forward_peak_bytes'] / MiB:7.1f} MiB above "
            f"base {f['base_bytes'] / MiB:.0f} MiB  ({f['seconds']:.1f} s)"
        )
        print(
            f"  forward under capture  peak {c['forward_peak_bytes'] / MiB:7.1f} MiB above "
            f"base {c['base_bytes'] / MiB:.0f} MiB  ({c['seconds']:.1f} s; {c['records']} "
            f"records, {c['kept_bytes'] / MiB:.1f} MiB kept)"
        )
        print(f"  difference             {extra / MiB:7.1f} MiB  (goal < 1024 MiB)")
    full = a.layers * a.heads * a.T * a.T * 4
    print(f"(unbounded, every layer's float32 weights would be {full / 2**30:.1f} GiB)")
    if a.out:
        result = {
            "benchmark": "capture_memory",
            "device": "cpu",
            "dtype": "float32",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "qkv": qkv.__version__,
            "threads": torch.get_num_threads(),
            "config": {
                k: getattr(a, k) for k in ("T", "layers", "embed_dim", "heads", "rows", "backend")
            },
            "results": results,
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
