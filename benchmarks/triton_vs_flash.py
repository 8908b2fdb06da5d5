"""qkv's triton backend against torch SDPA's flash kernel and compiled FlexAttention, on a GPU.

The grid (issue 16): T = 1k, 2k, 4k, 8k, 16k x D = 64, 128 x cases none, causal, window
(``sliding_window(1024)``: the last 1024 keys and the query's own) and document (packed
documents of 512-2048 tokens, ``qkv.bench.document_ids``) x forward and forward+backward,
bfloat16. Batch and heads follow FlashAttention's benchmarks: B = 16384 // T sequences (16k
tokens per batch) and H = 2048 // D heads (model width 2048).

Implementations:
  * ``qkv-triton``: ``qkv.scaled_dot_product_attention(..., backend="triton")``, the public
    API, so the time includes validating the call, classifying its blocks and the mask
    contract's finiteness check (one reduction over the output, or over q, k and v when
    gradients are wanted); FlexAttention's block mask, by contrast, is built once outside the
    timing (``flex`` below). The targets are judged on this one.
  * ``qkv-direct``: ``qkv.ops.triton.triton_attention`` on a built call: the kernels plus the
    block classification, without the dispatcher and the finiteness check.
  * ``sdpa-flash``: ``torch.nn.functional.scaled_dot_product_attention`` restricted to
    ``SDPBackend.FLASH_ATTENTION``; cases none and causal only (it takes no other mask).
  * ``sdpa-cudnn``: the same restricted to ``SDPBackend.CUDNN_ATTENTION`` (cuDNN's fused
    attention, the faster of torch's two on Hopper for long sequences).
  * ``flex``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same mask
    (none: no block mask).

FLOPs are counted as STYLE.md 15 says: ``4*B*H*T*S*D`` forward times the share of (query, key)
pairs the mask allows (0.5 for causal by convention; the window and the documents exactly),
x3.5 for forward+backward. Times come from ``triton.testing.do_bench`` (median, ms). Ratios are
peer time / qkv time, so above 1 means qkv is faster. Before timing, each configuration's
qkv output is compared with flex's (max |difference| recorded, and in bfloat16 expected around
1e-2 at most).

Targets (issue 16): forward >= 1.0x sdpa-flash (none, causal) and >= 1.0x flex (window,
document); forward+backward >= 0.9x of the same peers.

Writes ``--out`` (JSON: device, dtype, versions, every record; rewritten after every
measurement) and prints a Markdown table for ``benchmarks/RESULTS.md``. Refuses to run
without CUDA.

Usage:
    python benchmarks/triton_vs_flash.py [--out benchmarks/results/triton_vs_flash.json]
    python benchmarks/triton_vs_flash.py --lengths 1024 4096 --dims 128 --cases none window
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import qkv
from qkv.bench import attention_flops, document_ids, mask_density
from qkv.ops import AttentionCall
from qkv.ops.triton import triton_attention, triton_available

LENGTHS = (1024, 2048, 4096, 8192, 16384)
DIMS = (64, 128)
CASES = ("none", "causal", "window", "document")
MODES = ("fwd", "fwdbwd")
WINDOW = 1024
TOKENS, WIDTH = 16384, 2048  # B * T and H * D, as FlashAttention's benchmarks
TARGETS = {"fwd": 1.0, "fwdbwd": 0.9}  # qkv-triton / peer speed, at least
DEFAULT_OUT = Path("benchmarks/results/triton_vs_flash.json")


def flops(case: str, B: int, H: int, T: int, D: int, mode: str) -> float:
    return attention_flops(
        B, H, T, T, D, density=mask_density(case, T, window=WINDOW), backward=mode == "fwdbwd"
    )


def qkv_kwargs(case: str, T: int, device) -> dict:
    if case == "none":
        return {}
    if case == "causal":
        return dict(is_causal=True)
    if case == "window":
        return dict(mask_mod=qkv.masks.sliding_window(WINDOW))
    return dict(mask_mod=qkv.masks.document(document_ids(T).to(device)))


def flex_mask(case: str, B: int, T: int, device):
    """A FlexAttention block mask of the case (None for none), built once, untimed."""
    from torch.nn.attention.flex_attention import create_block_mask

    if case == "none":
        return None
    if case == "causal":

        def mask(b, h, q, kv):
            return kv <= q
    elif case == "window":

        def mask(b, h, q, kv):
            return (kv <= q) & (kv >= q - WINDOW)
    else:
        ids = document_ids(T).to(device)[0]  # (T,)

        def mask(b, h, q, kv):
            return ids[q] == ids[kv]

    return create_block_mask(mask, None, None, T, T, device=device)


def implementations(case: str, B: int, T: int, device) -> dict:
    """name -> attend(q, k, v) for the implementations that can take the case."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    kw = qkv_kwargs(case, T, device)
    impls = {
        "qkv-triton": lambda q, k, v: qkv.scaled_dot_product_attention(
            q, k, v, backend="triton", **kw
        ),
        "qkv-direct": lambda q, k, v: triton_attention(AttentionCall.build(q, k, v, **kw))[0],
    }
    if case in ("none", "causal"):

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        impls["sdpa-flash"] = flash

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        impls["sdpa-cudnn"] = cudnn
    block_mask = flex_mask(case, B, T, device)
    compiled = torch.compile(flex_attention, dynamic=False)
    impls["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    return impls


def step(attend, q, k, v, mode: str):
    if mode == "fwd":
        return lambda: attend(q, k, v)
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return fwd_bwd


def environment() -> dict:
    import triton

    return dict(
        benchmark="triton_vs_flash",
        device=torch.cuda.get_device_name(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        dtype="bf16",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton.__version__,
        qkv=getattr(qkv, "__version__", "unknown"),
        python=platform.python_version(),
        tokens=TOKENS,
        width=WIDTH,
        window=WINDOW,
        flops="4*B*H*T*S*D*density forward; x3.5 forward+backward",
        timer="triton.testing.do_bench median (ms)",
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        command=" ".join([sys.executable] + sys.argv),
    )


def run(args) -> dict:
    from triton.testing import do_bench

    device = torch.device("cuda")
    data = dict(environment(), records=[])
    for T in args.lengths:
        B = max(1, TOKENS // T)
        for D in args.dims:
            H = WIDTH // D
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (
                torch.randn(
                    B, H, T, D, device=device, dtype=torch.bfloat16, generator=g
                ).requires_grad_()
                for _ in range(3)
            )
            for case in args.cases:
                # a fresh dynamo per configuration: past its recompile limit (8 graphs) the
                # compiled flex silently runs eagerly, materialising (T, S) scores (1-14
                # TFLOP/s and out of memory at T=16384 in the first H100 run)
                torch._dynamo.reset()
                impls = implementations(case, B, T, device)
                with torch.no_grad():
                    ours = impls["qkv-triton"](q, k, v).float()
                    peer = impls["flex"](q, k, v).float()
                max_diff = float((ours - peer).abs().max())
                for mode in args.modes:
                    times = {}
                    for name, attend in impls.items():
                        try:
                            times[name] = do_bench(
                                step(attend, q, k, v, mode), warmup=args.warmup, rep=args.rep
                            )
                        except Exception as e:  # a peer that cannot run this size: say why
                            times[name] = None
                            print(
                                f"{name} {case} T={T} D={D} {mode}: {type(e).__name__}: {e}",
                                file=sys.stderr,
                            )
                    n = flops(case, B, H, T, D, mode)
                    rec = dict(
                        case=case,
                        T=T,
                        B=B,
                        H=H,
                        D=D,
                        mode=mode,
                        max_diff_vs_flex=max_diff,
                        ms=times,
                        tflops={
                            k: n / (t * 1e-3) / 1e12 for k, t in times.items() if t is not None
                        },
                    )
                    base = times.get("qkv-triton")
                    rec["ratio"] = {
                        k: t / base
                        for k, t in times.items()
                        if k != "qkv-triton" and t is not None and base
                    }
                    data["records"].append(rec)
                    print(_line(rec), file=sys.stderr)
                    _write(args.out, data)
    return data


def _line(rec: dict) -> str:
    tf = ", ".join(f"{k} {v:.0f}" for k, v in rec["tflops"].items())
    return f"{rec['case']:8s} T={rec['T']:5d} D={rec['D']:3d} {rec['mode']:6s} TFLOP/s: {tf}"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def markdown(data: dict) -> str:
    """A section for RESULTS.md: TFLOP/s of each implementation, ratios and targets."""
    lines = [
        f"### qkv triton vs SDPA flash and FlexAttention ({data['device']}, bf16)",
        "",
        (
            f"torch {data['torch']}, triton {data['triton']}, CUDA {data['cuda']}; B*T = "
            f"{TOKENS}, H*D = {WIDTH}; ratio = peer time / qkv time (> 1: qkv faster)."
        ),
        "",
        (
            "| case | T | D | mode | qkv-triton | qkv-direct | sdpa-flash | sdpa-cudnn | flex "
            "| vs flash | vs cudnn | vs flex | target |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["records"]:
        peer = "sdpa-flash" if r["case"] in ("none", "causal") else "flex"
        ratio = r["ratio"].get(peer)
        met = "n/a" if ratio is None else ("met" if ratio >= TARGETS[r["mode"]] else "missed")

        def cell(name, r=r):
            v = r["tflops"].get(name)
            return "-" if v is None else f"{v:.0f}"

        def rat(name, r=r):
            v = r["ratio"].get(name)
            return "-" if v is None else f"{v:.2f}x"

        lines.append(
            f"| {r['case']} | {r['T']} | {r['D']} | {r['mode']} | "
            f"{cell('qkv-triton')} | {cell('qkv-direct')} | {cell('sdpa-flash')} | "
            f"{cell('sdpa-cudnn')} | {cell('flex')} | "
            f"{rat('sdpa-flash')} | {rat('sdpa-cudnn')} | {rat('flex')} | "
            f"{met} ({peer} >= {TARGETS[r['mode']]}x) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "triton_vs_flash: needs a CUDA GPU (torch.cuda.is_available() is False); the "
            "triton kernels and both peers run on CUDA only. Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    missing = triton_available()
    if missing is not None:
        print(f"triton_vs_flash: {missing}", file=sys.stderr)
        return 2
    data = run(args)
    print(markdown(data))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
