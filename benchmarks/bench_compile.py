"""qkv under torch.compile on this CPU: compiled against eager qkv, and against compiled
FlexAttention; and eager qkv against the commit before the compile work (issue 24).

Part 1 (``compiled``): B=1, 8 heads, D=64, float32, no mask, causal, a 256-key sliding window
and 5 packed documents, forward (no_grad) and forward+backward. Timed interleaved in one
process (eager qkv, compiled qkv, compiled Flex, repeated), medians of ``--reps`` rounds after
warm-up. qkv is compiled with inductor and ``fullgraph=True``; Flex with its block mask built
once outside the timed call (its best case). Flex has no backward on CPU, so the
forward+backward rows compare compiled qkv with eager qkv only.

Part 2 (``eager``): the same eager forward and a KV-cache decode step of
``qkv.MultiHeadAttention`` (C=512, 8 heads, a 2048-token cache), at HEAD and at ``--base``
(default 1cad9c3, the commit before the compile work), each in its own process, alternating
``--rounds`` times. Needs ``git``; the base is checked out in a temporary worktree.

The CPU is named in the output. Writes ``--out`` (JSON) and prints Markdown tables.

Usage:
    python benchmarks/bench_compile.py [--lengths 1024 4096] [--parts compiled eager]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, H, D = 1, 8, 64
CASES = ("none", "causal", "window", "document")


def cpu_model() -> str:
    try:
        for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False
        ).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _qkv_kwargs(case: str, T: int):
    import torch

    from qkv import masks as M

    ids = (torch.arange(T) * 5 // T).expand(B, T)
    return ids, {
        "none": {},
        "causal": {"is_causal": True},
        "window": {"mask_mod": M.sliding_window(256)},
        "document": {"mask_mod": M.document(ids)},
    }[case]


def _flex_mask(case: str, T: int, ids):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = ids[0]
    fn = {
        "none": None,
        "causal": lambda b, h, i, j: j <= i,
        "window": lambda b, h, i, j: (j <= i) & (i - j <= 256),
        "document": lambda b, h, i, j: doc[i] == doc[j],
    }[case]
    return None if fn is None else create_block_mask(fn, None, None, T, T, device="cpu")


def part_compiled(lengths, reps: int) -> list[dict]:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    import qkv

    rows = []
    for T in lengths:
        for case in CASES:
            ids, kw = _qkv_kwargs(case, T)
            block_mask = _flex_mask(case, T, ids)
            for mode in ("fwd", "fwdbwd"):
                grad = mode == "fwdbwd"
                q, k, v = (torch.randn(B, H, T, D, requires_grad=grad) for _ in range(3))

                def eager(q=q, k=k, v=v, kw=kw):
                    return qkv.scaled_dot_product_attention(q, k, v, **kw)

                torch._dynamo.reset()
                compiled = torch.compile(eager, fullgraph=True)
                flex = torch.compile(
                    lambda q=q, k=k, v=v, bm=block_mask: flex_attention(q, k, v, block_mask=bm)
                )

                def step(fn, grad=grad):
                    if grad:
                        return lambda: fn().sum().backward()
                    return fn

                impls = {"eager": step(eager), "compiled": step(compiled)}
                if not grad:
                    impls["flex-compiled"] = step(flex)
                with torch.set_grad_enabled(grad):
                    for fn in impls.values():  # warm-up (and compile)
                        fn(), fn()
                    samples = {name: [] for name in impls}
                    for _ in range(reps):
                        for name, fn in impls.items():
                            samples[name].append(_median_ms(fn, 1))
                med = {name: statistics.median(s) for name, s in samples.items()}
                row = {"T": T, "case": case, "mode": mode, **{f"{n}_ms": m for n, m in med.items()}}
                row["compiled/eager"] = med["compiled"] / med["eager"]
                if "flex-compiled" in med:
                    row["flex/compiled"] = med["flex-compiled"] / med["compiled"]
                print(
                    f"  T={T} {case} {mode}: "
                    + ", ".join(f"{n} {m:.2f} ms" for n, m in med.items()),
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(row)
    return rows


_EAGER_CHILD = r"""
import json, statistics, sys, time, torch, qkv
sys.path.insert(0, sys.argv[1])
from bench_compile import _qkv_kwargs, _median_ms, B, H, D
lengths, reps = json.loads(sys.argv[2]), int(sys.argv[3])
out = {}
with torch.no_grad():
    for T in lengths:
        for case in ("none", "window"):
            _, kw = _qkv_kwargs(case, T)
            q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
            fn = lambda: qkv.scaled_dot_product_attention(q, k, v, **kw)
            fn(); fn()
            out[f"T={T} {case} fwd"] = statistics.median(_median_ms(fn, 1) for _ in range(reps))
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(512, 8).eval()
    cache = mha.new_cache(1, 2100)
    mha(torch.randn(1, 2048, 512), cache=cache, is_causal=True)
    x = torch.randn(1, 1, 512)
    step = lambda: mha(x, cache=cache)
    times = []
    for _ in range(min(reps * 2, 40)):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    out["decode step (cache 2048+)"] = statistics.median(times) * 1e3
print(json.dumps(out))
"""


def part_eager(lengths, reps: int, base: str, rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base],
            check=True,
            capture_output=True,
        )
        try:
            samples: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
            for _ in range(rounds):
                for label, src in (("base", tree / "src"), ("head", ROOT / "src")):
                    env = dict(os.environ, PYTHONPATH=str(src))
                    res = subprocess.run(
                        [
                            sys.executable,
                            "-c",
                            _EAGER_CHILD,
                            str(ROOT / "benchmarks"),
                            json.dumps(list(lengths)),
                            str(reps),
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    for name, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                        samples[label].setdefault(name, []).append(ms)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
                check=False,
            )
    rows = []
    for name in samples["head"]:
        b, h = statistics.median(samples["base"][name]), statistics.median(samples["head"][name])
        rows.append({"row": name, "base_ms": b, "head_ms": h, "head/base": h / b})
        print(f"  {name}: base {b:.3f} ms, head {h:.3f} ms ({h / b:.3f}x)", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument(
        "--parts", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"]
    )
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", default="1cad9c3")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile.json"
    )
    args = parser.parse_args(argv)
    import torch

    machine = {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(f"CPU: {machine}", file=sys.stderr)
    result = {"machine": machine}
    if "compiled" in args.parts:
        result["compiled"] = part_compiled(args.lengths, args.reps)
    if "eager" in args.parts:
        result["eager"] = part_eager(args.lengths, args.reps, args.base, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for row in result.get("compiled", []):
        flex = (
            "- | -"
            if "flex/compiled" not in row
            else f"{row['flex-compiled_ms']:.2f} | {row['flex/compiled']:.2f}"
        )
        print(
            f"| {row['T']} | {row['case']} | {row['mode']} | {row['eager_ms']:.2f} | "
            f"{row['compiled_ms']:.2f} | {row['compiled/eager']:.2f} | {flex} |"
        )
    for row in result.get("eager", []):
        print(
            f"| {row['row']} | {row['base_ms']:.3f} | {row['head_ms']:.3f} | "
            f"{row['head/base']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
