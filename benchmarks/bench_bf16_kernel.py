"""The fused bfloat16 kernel on an AMX CPU (``qkv.ops.bf16_scores.attend_kernel``) against its
peers, interleaved in one process (issues 37, 38):

* ``mha_weights``: ``qkv.MultiHeadAttention`` with ``return_trace=True`` (the weights read)
  against ``nn.MultiheadAttention(need_weights=True, average_attn_weights=False)``, E=512,
  8 heads;
* ``window`` (``sliding_window(256)``) and ``document`` (packed documents of 512-2048
  tokens) through ``backend="tiled"`` against compiled FlexAttention with the same mask;
* ``plain`` through ``backend="tiled"`` against ``F.scaled_dot_product_attention``.

B=1, H=8, D=64, inference. ``--timer cpu`` (default) times each call by ``time.thread_time``
at one thread: the CPU time of the call, which a shared machine's other processes do not
inflate the way they do wall time (with two threads, a parallel region waits for a busy
core: ~8 ms slices on the 2-core box). ``--timer wall`` and ``--threads`` time otherwise.
Ratios are the median over rounds of qkv / peer, the order alternating each round.

    PYTHONPATH=src python benchmarks/bench_bf16_kernel.py [--lengths 1024 4096] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import qkv
from qkv import masks
from qkv.ops import bf16_scores

B, H, D, E, WINDOW = 1, 8, 64, 512, 256


def _doc_ids(T: int) -> torch.Tensor:
    """Packed documents of 512-2048 tokens (seeded), one contiguous run each: (T,)."""
    g = torch.Generator().manual_seed(T)
    lengths = torch.randint(512, 2049, (T // 512 + 1,), generator=g)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:T]


def cases(T: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(3))
    ids = _doc_ids(T)

    def win(b, h, qi, ki):
        return (ki <= qi) & (ki >= qi - WINDOW)

    def doc(b, h, qi, ki):
        return ids[qi] == ids[ki]

    flex = torch.compile(flex_attention, dynamic=False)
    bw = create_block_mask(win, None, None, T, T, device="cpu")
    bd = create_block_mask(doc, None, None, T, T, device="cpu")
    qwin, qdoc = masks.sliding_window(WINDOW), masks.document(ids)
    tm = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16).eval()
    ours = qkv.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(B, T, E, generator=g).bfloat16()
    sdpa = qkv.scaled_dot_product_attention
    return {
        "mha_weights": {
            "qkv": lambda: ours(x, return_trace=True)[1].probs,
            "torch": lambda: tm(x, x, x, need_weights=True, average_attn_weights=False),
        },
        "window": {
            "qkv": lambda: sdpa(q, k, v, mask_mod=qwin, backend="tiled"),
            "flex": lambda: flex(q, k, v, block_mask=bw),
        },
        "document": {
            "qkv": lambda: sdpa(q, k, v, mask_mod=qdoc, backend="tiled"),
            "flex": lambda: flex(q, k, v, block_mask=bd),
        },
        "plain": {
            "qkv": lambda: sdpa(q, k, v, backend="tiled"),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--timer", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.timer == "cpu" else time.perf_counter
    print(
        f"CPU: {platform.processor() or platform.machine()}, capability "
        f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, timer {args.timer}, kernel here: {bf16_scores.available()}"
        f" {bf16_scores.unavailable_reason()}"
    )
    rows = []
    with torch.no_grad():
        for T in args.lengths:
            for case, impls in cases(T).items():
                times: dict[str, list[float]] = {n: [] for n in impls}
                for f in impls.values():
                    f(), f()  # warm: builds, compiles, plans
                for r in range(args.reps):
                    order = list(impls.items())
                    for n, f in order if r % 2 else reversed(order):
                        t0 = clock()
                        f()
                        times[n].append(clock() - t0)
                peer = next(n for n in impls if n != "qkv")
                ratio = statistics.median(a / b for a, b in zip(times["qkv"], times[peer]))
                row = {
                    "case": case,
                    "T": T,
                    "qkv_ms": statistics.median(times["qkv"]) * 1e3,
                    "peer": peer,
                    "peer_ms": statistics.median(times[peer]) * 1e3,
                    "ratio": ratio,
                }
                rows.append(row)
                print(
                    f"| {case} | {T} | {row['qkv_ms']:.2f} | {peer} | {row['peer_ms']:.2f} |"
                    f" {ratio:.2f} |",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
