"""What one small call costs: qkv's per-call overhead at decode sizes (issue 38, item 4).

Two measurements, one thread (``torch.set_num_threads(1)``), float32, no_grad, inference:

  * ``sdpa``: ``qkv.scaled_dot_product_attention`` against
    ``torch.nn.functional.scaled_dot_product_attention`` at T=1, S=128, B=1, H=8, D=64
    (plain, causal, and a bool key mask (B, 1, 1, S));
  * ``decode``: one KV-cache decode step of ``qkv.MultiHeadAttention`` (C=512, 8 heads, a
    cache of 256 positions, the step at position 128) against the same step written by hand in
    torch: one in-projection, the new key and value written into preallocated cache tensors,
    ``F.scaled_dot_product_attention`` over the positions so far, the out-projection. The cache
    is rewound to position 128 before each step, outside the clock.

With ``--long``, also the call at T=1024 (B=1, H=8, D=64, plain and causal, float32 and
bfloat16, no_grad): there the check around torch's kernel is passes over q, k, v and the
output, not Python (goal: at most 1.05x SDPA); ``--threads`` sets torch's threads (1 by
default; 0 keeps torch's own count).

Timing: ``--rounds`` rounds, each timing ``--calls`` calls of qkv then of torch (the order
alternating by round; at T=1024 a tenth of the calls); the ratio is the median over rounds of
qkv's time / torch's (below 1: qkv faster). Goals (issue 38): sdpa at most 1.5x, the decode
step at most 1.1x. Prints a table and writes ``--out`` (JSON, the CPU named). Run it with
``QKV_CPU_HOST_READS=1`` too: the contract kept by two sums read after the kernel instead of
tensor ops (off by default).

Usage:
    python benchmarks/bench_call_cost.py [--rounds 15] [--calls 200] [--long] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_cpu_isa import cpu_model

import qkv
from qkv.ops import nonfinite

B, H, D, C, S, CAP, POS = 1, 8, 64, 512, 128, 256, 128


def sdpa_pairs() -> dict:
    """case -> (qkv call, torch call)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(2))
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keep[..., -7:] = False
    cases = {"plain": {}, "causal": dict(is_causal=True), "key-mask": dict(attn_mask=keep)}
    return {
        name: (
            lambda kw=kw: qkv.scaled_dot_product_attention(q, k, v, **kw),
            lambda kw=kw: F.scaled_dot_product_attention(q, k, v, **kw),
        )
        for name, kw in cases.items()
    }


def long_pairs() -> dict:
    """case -> (qkv call, torch call) at T=1024: plain and causal, float32 and bfloat16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, 1024, D, generator=g) for _ in range(3))
    pairs = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        for case, kw in (("plain", {}), ("causal", dict(is_causal=True))):
            pairs[f"T=1024 {case} {name}"] = (
                lambda kw=kw, t=(qd, kd, vd): qkv.scaled_dot_product_attention(*t, **kw),
                lambda kw=kw, t=(qd, kd, vd): F.scaled_dot_product_attention(*t, **kw),
            )
    return pairs


def decode_pair() -> tuple:
    """(qkv step, torch step, rewind): one token at position POS."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(C, H).eval()
    cache = mha.new_cache(B, CAP)
    x = torch.randn(B, 1, C)
    prompt = torch.randn(B, POS, C)
    mha(prompt, cache=cache)  # prefill, untimed
    w_in, b_in = mha.in_proj_weight, mha.in_proj_bias  # (3C, C), (3C,)
    w_out, b_out = mha.out_proj.weight, mha.out_proj.bias
    keys = torch.zeros(B, H, CAP, D)
    values = torch.zeros(B, H, CAP, D)
    state = {"pos": POS}

    def by_hand():
        p = state["pos"]
        qkv_ = F.linear(x, w_in, b_in).view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)  # (3, B, H, 1, D)
        keys[:, :, p : p + 1] = qkv_[1]
        values[:, :, p : p + 1] = qkv_[2]
        out = F.scaled_dot_product_attention(qkv_[0], keys[:, :, : p + 1], values[:, :, : p + 1])
        return F.linear(out.transpose(1, 2).reshape(B, 1, C), w_out, b_out)  # (B, 1, C)

    def ours():
        return mha(x, cache=cache)

    def rewind():
        cache.position = POS

    return ours, by_hand, rewind


def paired(ours, theirs, rounds: int, calls: int, rewind=None) -> dict:
    """Median µs per call of each, and the median over rounds of the ratio."""
    times = {"qkv": [], "torch": []}
    for fn in (ours, theirs):  # warm up: plans, caches
        for _ in range(20):
            if rewind:
                rewind()
            fn()
    for r in range(rounds):
        pair = (("qkv", ours), ("torch", theirs))
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            total = 0.0
            for _ in range(calls):
                if rewind:
                    rewind()
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            times[name].append(total / calls * 1e6)
    ratios = [a / b for a, b in zip(times["qkv"], times["torch"])]
    return dict(
        qkv_us=statistics.median(times["qkv"]),
        torch_us=statistics.median(times["torch"]),
        ratio=statistics.median(ratios),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/call_cost.json"))
    p.add_argument("--long", action="store_true", help="also plain and causal at T=1024")
    p.add_argument("--threads", type=int, default=1, help="torch's threads (0: its own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        if args.long:
            for name, (ours, theirs) in long_pairs().items():
                calls = max(1, args.calls // 10)
                rows.append(dict(case=name, goal=1.05, **paired(ours, theirs, args.rounds, calls)))
                print(rows[-1], file=sys.stderr, flush=True)
        for name, (ours, theirs) in sdpa_pairs().items():
            rows.append(
                dict(case=f"sdpa {name}", goal=1.5, **paired(ours, theirs, args.rounds, args.calls))
            )
            print(rows[-1], file=sys.stderr, flush=True)
        ours, theirs, rewind = decode_pair()
        rows.append(
            dict(
                case="decode step",
                goal=1.1,
                **paired(ours, theirs, args.rounds, args.calls, rewind),
            )
        )
    data = dict(
        benchmark="bench_call_cost",
        cpu=cpu_model(),
        capability=torch.backends.cpu.get_cpu_capability(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        autotune=qkv.autotune.enabled(),
        host_reads=nonfinite.host_reads_free(torch.device("cpu")),  # QKV_CPU_HOST_READS
        command=" ".join(["python", *sys.argv]),
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2))
    reads = "host reads on" if data["host_reads"] else "no host reads"
    threads = f"{data['threads']} thread" + ("s" if data["threads"] > 1 else "")
    print(f"CPU: {data['cpu']} ({data['capability']}), torch {data['torch']}, {threads}, {reads}")
    print("| case | qkv µs | torch µs | qkv/torch | goal |\n|---|---|---|---|---|")
    for r in rows:
        met = "met" if r["ratio"] <= r["goal"] else "missed"
        cells = f"{r['qkv_us']:.1f} | {r['torch_us']:.1f} | {r['ratio']:.2f}"
        print(f"| {r['case']} | {cells} | {met} (<= {r['goal']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
