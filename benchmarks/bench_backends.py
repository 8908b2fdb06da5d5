"""Every qkv backend and every peer side by side on this machine's CPU (issue 38, item 6).

Cases: none, causal, window (``sliding_window(256)``: the last 256 keys and the query's own),
document (packed documents of 512-2048 tokens) at B=1, H=8, D=64; and multi-head attention
(E=512, 8 heads) with and without the weights. fp32 and bf16; inference (no gradient). Each
ISA class this CPU can present runs in a fresh process: ``native``, and ``avx2``
(``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``).

Implementations of the attention cases:
  * ``qkv``: ``qkv.scaled_dot_product_attention(..., backend="auto")``, and each registered
    backend named (``qkv-torch``, ``qkv-flex``, ``qkv-tiled``; the reference is left out:
    it is the slow twin and holds every (T, S) score);
  * ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (window and document as a
    dense bool mask, built once, untimed);
  * ``flex``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same mask
    (built once, untimed; none: no block mask).
For MHA: ``qkv.MultiHeadAttention.from_torch(m)`` against ``m = torch.nn.MultiheadAttention``
(``need_weights=True, average_attn_weights=False`` against ``return_trace=True`` with
``trace.probs`` read).

Timing: ``--reps`` rounds, each running every implementation once in an order that rotates
by round, after one untimed call each (the compile of the flex ones). A ratio is the median
over rounds of qkv's time / the peer's in the same round (below 1: qkv faster), which keeps a
shared machine's slow spells out of it. Goals (issue 38): window and document <= 1.0x
compiled Flex; MHA <= 1.0x torch's module; plain and causal <= 1.05x SDPA.

The CPU is named (``lscpu`` model, ``torch.backends.cpu.get_cpu_capability()``, its
AVX-512/BF16/AMX flags). Writes ``--out`` (JSON) and prints a Markdown table. On a GPU the
same comparison is ``benchmarks/gpu_api.py`` (``make gpu-check``).

Usage:
    python benchmarks/bench_backends.py [--lengths 1024 4096] [--isa native avx2] [--reps 7]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_cpu_isa import ISA_ENV, cpu_model

CASES = ("none", "causal", "window", "document")
B, H, D, E, WINDOW = 1, 8, 64, 512, 256
GOALS = {"window": ("flex", 1.0), "document": ("flex", 1.0), "none": ("sdpa", 1.05)}
GOALS.update(causal=("sdpa", 1.05), mha=("torch", 1.0), mha_weights=("torch", 1.0))


def _attention_impls(case: str, T: int, dtype):
    """name -> fn() for the attention implementations of one configuration."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import qkv
    from qkv.bench import document_ids

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
    ids = document_ids(T)[0]  # (T,)
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None]
    if case == "none":
        kw, dense, fmask = {}, None, None
    elif case == "causal":
        kw, dense = dict(is_causal=True), None

        def fmask(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    elif case == "window":
        kw, dense = (
            dict(mask_mod=qkv.masks.sliding_window(WINDOW)),
            (ki <= qi) & (ki >= qi - WINDOW),
        )

        def fmask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - WINDOW)
    else:
        kw, dense = dict(mask_mod=qkv.masks.document(ids[None])), ids[:, None] == ids[None]

        def fmask(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]

    impls = {}
    for name in ["auto"] + [n for n in qkv.backend_names() if n not in ("reference", "triton")]:
        label = "qkv" if name == "auto" else f"qkv-{name}"
        impls[label] = lambda name=name: qkv.scaled_dot_product_attention(
            q, k, v, backend=name, **kw
        )
    causal_flag = case == "causal"
    impls["sdpa"] = lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, is_causal=causal_flag
    )
    block_mask = None if fmask is None else create_block_mask(fmask, None, None, T, T, "cpu")
    compiled = torch.compile(flex_attention)
    impls["flex"] = lambda: compiled(q, k, v, block_mask=block_mask)
    return impls


def _mha_impls(T: int, dtype, weights: bool):
    import torch
    from torch import nn

    import qkv

    torch.manual_seed(0)
    tm = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    ours = qkv.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(B, T, E, dtype=dtype)
    if weights:

        def run_qkv():
            out, trace = ours(x, return_trace=True)
            return out, trace.probs

        return {
            "qkv": run_qkv,
            "torch": lambda: tm(x, x, x, need_weights=True, average_attn_weights=False),
        }
    return {"qkv": lambda: ours(x), "torch": lambda: tm(x, x, x, need_weights=False)}


def _time(impls: dict, reps: int) -> tuple[dict, dict]:
    """Median seconds per implementation, and per-round ratios of qkv's time to each other's.
    At one thread the seconds are the thread's CPU time (``time.thread_time``): on a shared
    machine wall time also counts the other processes' turns."""
    import torch

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    refused: dict[str, str] = {}
    with torch.no_grad():
        for n in names:
            try:
                impls[n]()  # warm up: compile, plan, caches
            except Exception as e:  # a backend that declines, a peer that cannot: say why
                refused[n] = f"{type(e).__name__}: {e}"[:200]
        live = [n for n in names if n not in refused]
        for i in range(reps):
            order = live[i % len(live) :] + live[: i % len(live)]
            for n in order:
                t0 = clock()
                impls[n]()
                times[n].append(clock() - t0)
    med = {n: statistics.median(t) for n, t in times.items() if t}
    ratios = {}
    if "qkv" in med:
        for n in live:
            if n != "qkv":
                ratios[n] = statistics.median(a / b for a, b in zip(times["qkv"], times[n]))
    return dict(ms={n: s * 1e3 for n, s in med.items()}, ratio_vs=ratios), refused


def worker(lengths: list[int], reps: int, cases: list[str]) -> list[dict]:
    import torch

    records = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for T in lengths:
            for case in [*cases, "mha", "mha_weights"]:
                if case.startswith("mha"):
                    impls = _mha_impls(T, dtype, case == "mha_weights")
                else:
                    torch._dynamo.reset()  # a fresh compile budget per configuration
                    impls = _attention_impls(case, T, dtype)
                timing, refused = _time(impls, reps)
                peer, goal = GOALS[case]
                ratio = timing["ratio_vs"].get(peer)
                records.append(
                    dict(
                        case=case,
                        dtype=dtype_name,
                        T=T,
                        **timing,
                        refused=refused,
                        goal_peer=peer,
                        goal=goal,
                        met=None if ratio is None else ratio <= goal,
                    )
                )
                print(_line(records[-1]), file=sys.stderr, flush=True)
    return records


def _line(r: dict) -> str:
    ms = ", ".join(f"{n} {t:.2f}" for n, t in r["ms"].items())
    ratio = r["ratio_vs"].get(r["goal_peer"])
    rat = "-" if ratio is None else f"{ratio:.2f}x {r['goal_peer']}"
    return f"  {r['dtype']:8s} T={r['T']:5d} {r['case']:11s} ms: {ms} | {rat}"


def _clock(data: dict) -> str:
    threads = {run.get("threads") for run in data["runs"].values()}
    if threads == {1}:
        return "one thread, its CPU time"
    return f"torch's threads ({', '.join(map(str, sorted(threads, key=str)))}), wall time"


def markdown(data: dict) -> str:
    lines = [
        (
            f"CPU: {data['cpu']}; torch {data.get('torch', '?')}; {_clock(data)}; ms are "
            "medians, ratios the median over rounds of qkv (auto) / the peer (below 1: qkv "
            "faster)."
        ),
        "",
        (
            "| ISA run | capability | dtype | T | case | qkv (auto) | qkv-torch | qkv-flex "
            "| qkv-tiled | peer | peer ms | qkv/peer | goal |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for isa, run in data["runs"].items():
        for r in run["records"]:
            ms = r["ms"]
            peer = r["goal_peer"]
            ratio = r["ratio_vs"].get(peer)

            def cell(n, ms=ms):
                return f"{ms[n]:.2f}" if n in ms else "-"

            met = "-" if r["met"] is None else ("met" if r["met"] else "missed")
            lines.append(
                f"| {isa} | {run['capability']} | {r['dtype']} | {r['T']} | {r['case']} | "
                f"{cell('qkv')} | {cell('qkv-torch')} | {cell('qkv-flex')} | "
                f"{cell('qkv-tiled')} | {peer} | {cell(peer)} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | {met} (<= {r['goal']}) |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/backends_cpu.json"))
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch's threads (0: its own); 1 times the thread's CPU time",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from qkv.ops.cpu_isa import cpu_features

        print(
            json.dumps(
                dict(
                    capability=torch.backends.cpu.get_cpu_capability(),
                    features=sorted(cpu_features()),
                    torch=torch.__version__,
                    threads=torch.get_num_threads(),
                    records=worker(args.lengths, args.reps, args.cases),
                )
            )
        )
        return 0
    data = dict(
        benchmark="bench_backends",
        cpu=cpu_model(),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        runs={},
    )
    for isa in args.isa:
        print(f"{isa}:", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--worker", "--reps", str(args.reps)]
        cmd += ["--threads", str(args.threads), "--lengths"]
        cmd += [*map(str, args.lengths), "--cases", *args.cases]
        done = subprocess.run(
            cmd, env={**os.environ, **ISA_ENV[isa]}, stdout=subprocess.PIPE, text=True, check=True
        )
        data["runs"][isa] = json.loads(done.stdout)
        data["torch"] = data["runs"][isa]["torch"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
