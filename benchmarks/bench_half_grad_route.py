"""bfloat16 attention wanting a gradient on this CPU: each route, per length and ISA class
(issue 38, item 2).

A bfloat16 CPU call that wants a gradient computes in bfloat16 by torch's kernels
(``native``) or in float32, rounded once (``float32``), per size class as
``qkv.ops.cpu_isa.half_grad_route`` measured on the machine. In a fresh process per ISA class
(``native``: what the CPU has; ``avx2``: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``)
with a throwaway cache folder, this times, on one thread (CPU time, medians of interleaved
rounds):

* ``qkv.scaled_dot_product_attention`` forward and backward (causal, D=64) at T = S from 32
  to 2048, forced to each route, and as measured (the route each size class took is shown);
* a ``MultiHeadAttention`` training step (B=8, T=128, E=512, 8 heads, causal) on each route,
  against ``torch.nn.MultiheadAttention``'s with the same weights;
* a transformers Llama training step (4 layers, B=4, T=256) with ``attn_implementation="qkv"``
  on each route, against ``"sdpa"`` (where transformers is installed).

The CPU is named (``lscpu`` model, ``torch.backends.cpu.get_cpu_capability()``).

Usage:
    python benchmarks/bench_half_grad_route.py [--rounds 7] [--isa native avx2]
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

from bench_cpu_isa import ISA_ENV, cpu_model

LENGTHS = {32: 8, 128: 8, 256: 4, 512: 2, 1024: 1, 2048: 1}  # T = S -> heads
ROUTES = ("native", "float32", "measured")


def _median_times(fns: dict, rounds: int) -> dict:
    for f in fns.values():
        f()
    times: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.thread_time()
            f()
            times[n].append(time.thread_time() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def _with_route(route: str, fn):
    def run():
        if route == "measured":
            os.environ.pop("QKV_CPU_HALF_GRAD", None)
        else:
            os.environ["QKV_CPU_HALF_GRAD"] = route
        return fn()

    return run


def worker(rounds: int) -> dict:
    import torch
    from torch import nn

    import qkv
    from qkv.ops import cpu_isa

    torch.set_num_threads(1)
    rows: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "sdpa": {}}
    g = torch.Generator().manual_seed(0)
    for T, H in LENGTHS.items():
        q, k, v, grad = (torch.randn(1, H, T, 64, generator=g).bfloat16() for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step(leaves=leaves, grad=grad):
            out = qkv.scaled_dot_product_attention(*leaves, is_causal=True)
            return torch.autograd.grad(out, leaves, grad)

        ms = _median_times({r: _with_route(r, step) for r in ROUTES}, rounds)
        bucket = cpu_isa.half_grad_bucket(T)
        rows["sdpa"][T] = {"ms": ms, "took": cpu_isa.HALF_GRAD.choice(bucket).route}
    torch.manual_seed(0)
    tm = nn.MultiheadAttention(512, 8, batch_first=True, dtype=torch.bfloat16)
    ours = qkv.MultiHeadAttention.from_torch(tm)
    x = torch.randn(8, 128, 512, dtype=torch.bfloat16)
    mask = nn.Transformer.generate_square_subsequent_mask(128, dtype=torch.bfloat16)

    def ours_step():
        ours(x, is_causal=True).square().sum().backward()

    def torch_step():
        tm(x, x, x, attn_mask=mask, need_weights=False)[0].square().sum().backward()

    fns = {f"qkv {r}": _with_route(r, ours_step) for r in ROUTES} | {"torch": torch_step}
    rows["mha"] = _median_times(fns, rounds)
    rows["llama"] = _llama_step(rounds)
    return rows


def _llama_step(rounds: int) -> dict:
    """A transformers Llama training step (4 layers, hidden 256, 8 heads, 2 key/value heads,
    B=4, T=256, bfloat16: forward and backward of the last hidden state's squares) with
    ``attn_implementation="qkv"`` on each route against ``"sdpa"``; {} without transformers."""
    try:
        from hf_models import _model  # (transformers)
    except ImportError:
        return {}
    import torch

    import qkv.integrations.transformers as qkv_hf

    qkv_hf.register()
    model = _model("llama-causal", 256).to(torch.bfloat16)  # hf_models' Llama: 4 layers, C=256
    ids = torch.randint(0, 1000, (4, 256), generator=torch.Generator().manual_seed(1))

    def step(impl: str):
        def run():
            model.set_attn_implementation(impl)
            model.zero_grad(set_to_none=True)
            model(ids).last_hidden_state.float().square().sum().backward()

        return run

    fns = {f"qkv {r}": _with_route(r, step("qkv")) for r in ROUTES} | {"sdpa": step("sdpa")}
    return _median_times(fns, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds)))
        return
    print(f"CPU: {cpu_model()}")
    for isa in args.isa:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, **ISA_ENV[isa], "QKV_CACHE_DIR": cache, "QKV_AUTOTUNE": "on"}
            env.pop("QKV_CPU_HALF_GRAD", None)
            cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{isa}: capability {r['capability']}, one thread, ms (forward and backward)")
        print("| T = S | native | float32 | float32 / native | measured (route) |")
        print("|---|---|---|---|---|")
        for T, row in r["sdpa"].items():
            ms = row["ms"]
            print(
                f"| {T} | {ms['native']:.3f} | {ms['float32']:.3f} | "
                f"{ms['float32'] / ms['native']:.2f} | {ms['measured']:.3f} ({row['took']}) |"
            )
        ms = r["mha"]
        shown = ", ".join(
            f"{n} {t:.2f} ms ({t / ms['torch']:.2f}x)" for n, t in ms.items() if n != "torch"
        )
        print(f"MHA training step: torch {ms['torch']:.2f} ms; {shown}")
        ms = r["llama"]
        if ms:
            shown = ", ".join(
                f"{n} {t:.1f} ms ({t / ms['sdpa']:.2f}x)" for n, t in ms.items() if n != "sdpa"
            )
            print(f"transformers Llama training step: sdpa {ms['sdpa']:.1f} ms; {shown}")


if __name__ == "__main__":
    main()
