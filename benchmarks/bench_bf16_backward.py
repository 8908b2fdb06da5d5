"""bfloat16 attention wanting a gradient on this CPU: torch's bfloat16 kernels against qkv,
which computes it in float32 and rounds once ("bfloat16 gradients" in ``qkv.ops.call``).

In a fresh process per ISA class (``native``: what the CPU has; ``avx2``:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) with a throwaway cache folder, this
measures, on one thread (CPU time, medians of interleaved rounds):

* accuracy: causal, D=64, 2 heads, a few draws per length; each of torch's bfloat16 SDPA and
  ``qkv.scaled_dot_product_attention`` against the float64 golden, as a multiple of plain
  bfloat16 math's error (the tolerance policy allows 2x for the output, 3x for gradients);
* time: forward and backward (causal, D=64) at T = S from 32 to 2048, torch's bfloat16 SDPA
  and qkv's call;
* a ``MultiHeadAttention`` training step (B=8, T=128, E=512, 8 heads, causal), against
  ``torch.nn.MultiheadAttention``'s with the same weights;
* a transformers Llama training step (4 layers, B=4, T=256) with ``attn_implementation="qkv"``
  against ``"sdpa"`` (where transformers is installed).

The CPU is named (``lscpu`` model, ``torch.backends.cpu.get_cpu_capability()``).

Usage:
    python benchmarks/bench_bf16_backward.py [--rounds 7] [--draws 4] [--isa native avx2]
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
ACCURACY_LENGTHS = (128, 512, 2048)


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


def _accuracy(draws: int) -> dict:
    """Per length, the largest error of torch's bfloat16 kernels and of qkv over ``draws``
    draws, as a multiple of plain bfloat16 math's, for out, dq, dk, dv."""
    import torch
    import torch.nn.functional as F

    import qkv

    def plain(q, k, v):
        T = q.shape[-2]
        keep = torch.ones(T, T, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~keep, -torch.inf)
        return torch.softmax(scores, -1) @ v

    def grads(fn, inputs, grad):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return [out.detach().double()] + [
            g.double() for g in torch.autograd.grad(out, leaves, grad.to(out.dtype))
        ]

    kernels = {
        "torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "qkv": lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    rows: dict = {}
    for T in ACCURACY_LENGTHS:
        worst = {n: [0.0] * 4 for n in kernels}
        for seed in range(draws):
            g = torch.Generator().manual_seed(seed)
            q, k, v, grad = (torch.randn(1, 2, T, 64, generator=g).bfloat16() for _ in range(4))
            gold = grads(plain, [t.double() for t in (q, k, v)], grad.double())
            base = grads(plain, (q, k, v), grad)
            for name, fn in kernels.items():
                got = grads(fn, (q, k, v), grad)
                for i in range(4):
                    ratio = (got[i] - gold[i]).abs().max() / (base[i] - gold[i]).abs().max()
                    worst[name][i] = max(worst[name][i], ratio.item())
        rows[T] = worst
    return rows


def worker(rounds: int, draws: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import qkv

    torch.set_num_threads(1)
    rows: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "sdpa": {}}
    rows["accuracy"] = _accuracy(draws)
    g = torch.Generator().manual_seed(0)
    for T, H in LENGTHS.items():
        q, k, v, grad = (torch.randn(1, H, T, 64, generator=g).bfloat16() for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step(fn, leaves=leaves, grad=grad):
            return lambda: torch.autograd.grad(fn(*leaves, is_causal=True), leaves, grad)

        fns = {"torch": step(F.scaled_dot_product_attention)}
        fns["qkv"] = step(qkv.scaled_dot_product_attention)
        rows["sdpa"][T] = _median_times(fns, rounds)
    torch.manual_seed(0)
    tm = nn.MultiheadAttention(512, 8, batch_first=True, dtype=torch.bfloat16)
    ours = qkv.MultiHeadAttention.from_torch(tm)
    x = torch.randn(8, 128, 512, dtype=torch.bfloat16)
    mask = nn.Transformer.generate_square_subsequent_mask(128, dtype=torch.bfloat16)

    def ours_step():
        ours(x, is_causal=True).square().sum().backward()

    def torch_step():
        tm(x, x, x, attn_mask=mask, need_weights=False)[0].square().sum().backward()

    rows["mha"] = _median_times({"qkv": ours_step, "torch": torch_step}, rounds)
    rows["llama"] = _llama_step(rounds)
    return rows


def _llama_step(rounds: int) -> dict:
    """A transformers Llama training step (4 layers, hidden 256, 8 heads, 2 key/value heads,
    B=4, T=256, bfloat16: forward and backward of the last hidden state's squares) with
    ``attn_implementation="qkv"`` against ``"sdpa"``; {} without transformers."""
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

    return _median_times({"qkv": step("qkv"), "sdpa": step("sdpa")}, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--isa", nargs="+", default=list(ISA_ENV), choices=list(ISA_ENV))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rounds, args.draws)))
        return
    print(f"CPU: {cpu_model()}")
    for isa in args.isa:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, **ISA_ENV[isa], "QKV_CACHE_DIR": cache, "QKV_AUTOTUNE": "on"}
            cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)]
            cmd += ["--draws", str(args.draws)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{isa}: capability {r['capability']}, one thread")
        print("error / plain bfloat16 math's, the worst draw (out, dq, dk, dv; policy 2, 3, 3, 3):")
        print("| T = S | torch's bfloat16 kernels | qkv |")
        print("|---|---|---|")
        for T, worst in r["accuracy"].items():
            cells = [" / ".join(f"{x:.2f}" for x in worst[n]) for n in ("torch", "qkv")]
            print(f"| {T} | {cells[0]} | {cells[1]} |")
        print("forward and backward, causal, D=64, ms:")
        print("| T = S | torch bfloat16 | qkv | qkv / torch |")
        print("|---|---|---|---|")
        for T, ms in r["sdpa"].items():
            print(f"| {T} | {ms['torch']:.3f} | {ms['qkv']:.3f} | {ms['qkv'] / ms['torch']:.2f} |")
        ms = r["mha"]
        print(
            f"MHA training step: torch {ms['torch']:.2f} ms, qkv {ms['qkv']:.2f} ms "
            f"({ms['qkv'] / ms['torch']:.2f}x)"
        )
        ms = r["llama"]
        if ms:
            print(
                f"transformers Llama training step: sdpa {ms['sdpa']:.1f} ms, qkv "
                f"{ms['qkv']:.1f} ms ({ms['qkv'] / ms['sdpa']:.2f}x)"
            )


if __name__ == "__main__":
    main()
