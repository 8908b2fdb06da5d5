"""Where the time of one triton-backend call goes, on a GPU: the public API against the kernels.

For each case (bf16, B*T = 16k tokens, H*D = 2048 as in triton_vs_flash.py) prints the median
time (``triton.testing.do_bench``) of
  * ``api``: ``qkv.scaled_dot_product_attention(..., backend="triton")``;
  * ``direct``: ``qkv.ops.triton.triton_attention`` on a built call (no finiteness check);
  * ``plan``: building the call and its block lists alone (host work and small launches);
and a torch.profiler table of one ``direct`` call (host-side and device-side time per op).

Usage:
    python benchmarks/profile_triton.py [--T 4096] [--D 128] [--cases causal window]
"""

from __future__ import annotations

import argparse
import sys

import torch

import qkv
from qkv.ops import AttentionCall
from qkv.ops.triton import triton_attention
from qkv.ops.triton.backend import _kernel_mask, _Plan, default_blocks

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from triton_vs_flash import TOKENS, WIDTH, qkv_kwargs


def plan_only(call: AttentionCall):
    """The call's block lists, as the forward builds them."""
    B, H = call.BH
    plan = _Plan(
        B,
        H,
        H,
        call.T,
        call.S,
        call.scale,
        _kernel_mask(call),
        None,
        None,
        default_blocks(max(call.D, call.Dv), banded=call.is_causal),
        False,
        call.device,
    )
    return plan.lists(plan.blocks.m, plan.blocks.n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--cases", nargs="+", default=["none", "causal", "window", "document"])
    args = p.parse_args(argv)
    from triton.testing import do_bench

    dev = torch.device("cuda")
    T, D = args.T, args.D
    B, H = max(1, TOKENS // T), WIDTH // D
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for case in args.cases:
        kw = qkv_kwargs(case, T, dev)
        api = do_bench(
            lambda kw=kw: qkv.scaled_dot_product_attention(q, k, v, backend="triton", **kw),
            return_mode="median",
        )
        direct = do_bench(
            lambda kw=kw: triton_attention(AttentionCall.build(q, k, v, **kw)), return_mode="median"
        )
        plan = do_bench(
            lambda kw=kw: plan_only(AttentionCall.build(q, k, v, **kw)), return_mode="median"
        )
        print(
            f"{case:8s} T={T} D={D} B={B} H={H}: api {api:.3f} ms, direct {direct:.3f} ms, "
            f"plan {plan:.3f} ms"
        )
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(3):
                triton_attention(AttentionCall.build(q, k, v, **kw))
            torch.cuda.synchronize()
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=50
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
