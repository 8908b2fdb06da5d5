"""Nested (jagged) attention: qkv against torch's SDPA on the same nested tensors, and against
torch's SDPA on the batch padded to its longest sequence with a key mask, interleaved in one
process (median of rounds). Forward, no gradient.

    PYTHONPATH=src python benchmarks/bench_nested.py [--rounds 9] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import qkv


def _time(fn, reps: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 2048, (8,), generator=g).tolist()
    H, D = 8, 64
    parts = [torch.randn(L, H, D, generator=g).to(dt) for L in lengths]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)  # (B, H, j, D)
    T = max(lengths)
    padded = torch.zeros(len(lengths), H, T, D, dtype=dt)
    for i, p in enumerate(parts):
        padded[i, :, : p.shape[0]] = p.transpose(0, 1)
    keys = (torch.arange(T) < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, T)
    cases = {"non-causal": False, "causal": True}
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.threads} thread(s), {args.dtype}; lengths {lengths}, H={H}, D={D}"
    )
    with torch.no_grad():
        for name, causal in cases.items():
            runs = {
                "qkv nested": lambda c=causal: qkv.scaled_dot_product_attention(
                    x, x, x, is_causal=c
                ),
                "torch padded + key mask": lambda c=causal: F.scaled_dot_product_attention(
                    padded,
                    padded,
                    padded,
                    attn_mask=keys & torch.ones(T, T, dtype=torch.bool).tril() if c else keys,
                ),
            }
            if not causal:  # (torch's CPU kernels refuse causal nested inputs)
                runs["torch nested"] = lambda: F.scaled_dot_product_attention(x, x, x)
            times: dict[str, list[float]] = {n: [] for n in runs}
            for _ in range(args.rounds):
                for n, fn in runs.items():
                    times[n].append(_time(fn))
            med = {n: statistics.median(t) for n, t in times.items()}
            base = med["qkv nested"]
            shown = " | ".join(  # qkv's time over each peer's: below 1, qkv is faster
                f"{n} {m * 1e3:.1f} ms"
                + ("" if n == "qkv nested" else f" (qkv/peer {base / m:.2f})")
                for n, m in med.items()
            )
            print(f"| {name} | {shown} |")


if __name__ == "__main__":
    main()
