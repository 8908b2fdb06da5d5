"""float32 sliding windows through ``auto`` against compiled FlexAttention, one thread, CPU time
(issue 38's goal: window forward <= 1.0x Flex on every CPU class).

B=1, H=8, D=64, ``qkv.masks.sliding_window(256)`` against ``create_block_mask`` of the same
mask (built once, untimed) and ``torch.compile(flex_attention, dynamic=False)``; no gradient.
Each of 11 rounds times both in turn (the order alternating), by ``time.thread_time``: on a
shared machine CPU time leaves other processes out. The ratio is the median over rounds of
qkv's time over Flex's. Run it as is for this CPU's own ISA level, and with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` for the AVX2 class.

Usage:
    PYTHONPATH=src QKV_AUTOTUNE=off python benchmarks/bench_window_fp32.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import qkv

B, H, D, W = 1, 8, 64, 256


def main() -> None:
    torch.set_num_threads(1)
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    flex = torch.compile(flex_attention, dynamic=False)
    for T in (1024, 4096):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))

        def win(b, h, qi, ki):
            return (ki <= qi) & (ki >= qi - W)

        block_mask = create_block_mask(win, None, None, T, T, device="cpu")
        window = qkv.masks.sliding_window(W)
        runs = {
            "flex": lambda q=q, k=k, v=v, bm=block_mask: flex(q, k, v, block_mask=bm),
            "qkv": lambda q=q, k=k, v=v, w=window: qkv.scaled_dot_product_attention(
                q, k, v, mask_mod=w
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        with torch.no_grad():
            for run in runs.values():
                run(), run()  # compiles, plans
            for r in range(11):
                for name in list(runs) if r % 2 else list(runs)[::-1]:
                    t0 = time.thread_time()
                    runs[name]()
                    times[name].append(time.thread_time() - t0)
        ratio = statistics.median(a / b for a, b in zip(times["qkv"], times["flex"]))
        print(
            f"T={T} float32 window {W}: qkv/flex {ratio:.2f} "
            f"(flex {statistics.median(times['flex']) * 1e3:.1f} ms, "
            f"qkv {statistics.median(times['qkv']) * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main()
