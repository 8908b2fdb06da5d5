"""Structured masks beyond windows and documents against compiled FlexAttention, one process,
medians of interleaved rounds, forward without gradient: a padded batch under causal and under
a sliding window (key lengths per batch element), a prefix LM, windows within documents, and
packed rows with documents of their own (ids per batch element), without and with causal.

    PYTHONPATH=src python benchmarks/bench_more_masks.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import qkv
from qkv import masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one compile per mask and dtype: 8 here
    B, H, T, D = 4, 8, 2048, 64
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([2048, 1500, 900, 300])
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([600, 500, 448, 500]))
    # packed rows, each with documents of its own: 3, 5, 7 and 4 documents
    bounds = [
        [0, 700, 1300, T],
        [0, 300, 800, 1100, 1700, T],
        [0, 300, 600, 900, 1200, 1500, 1800, T],
        [0, 512, 1024, 1536, T],
    ]
    rows = [
        torch.repeat_interleave(torch.arange(len(b) - 1), torch.tensor(b).diff()) for b in bounds
    ]
    ids_b = torch.stack(rows)  # (B, T)
    flex = torch.compile(flex_attention, dynamic=False)
    cases = {
        "causal + key lengths": (
            lambda b, h, q, k: (k <= q) & (k < lens[b]),
            dict(is_causal=True, mask_mod=masks.key_lengths(lens)),
            B,
        ),
        "prefix_lm(256)": (
            lambda b, h, q, k: (k <= q) | (k < 256),
            dict(mask_mod=masks.prefix_lm(256)),
            None,
        ),
        "window(128) within documents": (
            lambda b, h, q, k: (ids[q] == ids[k]) & (k <= q) & (k >= q - 128),
            dict(mask_mod=masks.and_masks(masks.document(ids), masks.sliding_window(128))),
            None,
        ),
        "documents per element": (
            lambda b, h, q, k: ids_b[b, q] == ids_b[b, k],
            dict(mask_mod=masks.document(ids_b)),
            B,
        ),
        "causal documents per element": (
            lambda b, h, q, k: (ids_b[b, q] == ids_b[b, k]) & (k <= q),
            dict(mask_mod=masks.document(ids_b), is_causal=True),
            B,
        ),
        "window(256) + key lengths": (
            lambda b, h, q, k: (k <= q) & (k >= q - 256) & (k < lens[b]),
            dict(mask_mod=masks.and_masks(masks.sliding_window(256), masks.key_lengths(lens))),
            B,
        ),
    }
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.threads} thread(s); B={B}, H={H}, T={T}, D={D}, key lengths {lens.tolist()}"
    )
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(dt) for _ in range(3))
        for name, (fmask, kw, mask_b) in cases.items():
            block_mask = create_block_mask(fmask, mask_b, None, T, T, device="cpu")
            fns = {
                "qkv": lambda t=(q, k, v), kw=kw: qkv.scaled_dot_product_attention(*t, **kw),
                "flex": lambda t=(q, k, v), bm=block_mask: flex(*t, block_mask=bm),
            }
            times: dict[str, list[float]] = {n: [] for n in fns}
            with torch.no_grad():
                for fn in fns.values():
                    fn()
                    fn()
                for _ in range(args.rounds):
                    for n, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            print(
                f"| {str(dt).removeprefix('torch.')} | {name} | qkv {med['qkv']:.1f} ms | "
                f"Flex {med['flex']:.1f} ms | qkv/Flex {med['qkv'] / med['flex']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
