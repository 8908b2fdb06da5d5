"""Time qkv's Triton kernels alone, at the default block sizes or over a grid of them (GPU).

Two jobs, for a lent GPU's short lease:

* ``--defaults``: forward and forward+backward of the kernels (``triton_attention``, no
  dispatcher, no NaN check) at the default blocks, per case and head dim. Run it in two
  processes on two versions of ``ops/triton/kernels.py`` for an A/B of a kernel change.
* ``--tune``: for each head dim, every forward configuration (BLOCK_M, BLOCK_N, warps, stages)
  of a small grid, then the dK/dV kernel's and the dQ kernel's, each timed inside the
  forward+backward with the other kernels at their defaults. Every configuration's output and
  gradients are checked against SDPA's flash kernel first (a wrong one is reported, not timed).

Prints one JSON line per measurement (``--out`` appends them to a file) and a table at the end.
bf16, B*T = 16k tokens, H*D = 2048 (FlashAttention's benchmark shape, as triton_vs_flash.py).
FLOPs: 4*B*H*T*S*D*density forward, x3.5 forward+backward (STYLE.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import qkv
from qkv.ops import AttentionCall
from qkv.ops.triton import Blocks, default_blocks, triton_attention
from qkv.ops.triton.backend import first_blocks

TOKENS, WIDTH = 16384, 2048


def _inputs(T: int, D: int, seed: int = 0):
    B, H = max(1, TOKENS // T), WIDTH // D
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    ]


def _kwargs(case: str, T: int, B: int) -> dict:
    if case == "none":
        return {}
    if case == "causal":
        return dict(is_causal=True)
    ids = (torch.arange(T, device="cuda") // 1024).expand(B, T)  # (B, T): 1k-token documents
    return dict(mask_mod=qkv.masks.document(ids))


def _density(case: str, T: int) -> float:
    if case == "none":
        return 1.0
    if case == "causal":
        return (T + 1) / (2 * T)
    return 1024 / T


def _attend(case: str, q, blocks: Blocks | None):
    kw = _kwargs(case, q.shape[2], q.shape[0])
    return lambda q, k, v: triton_attention(AttentionCall.build(q, k, v, **kw), blocks=blocks)[0]


def _flash(case: str, q, k, v):
    """The answer to check against: SDPA's flash kernel (causal, none) or its dense mask."""
    import torch.nn.functional as F

    if case == "document":
        ids = torch.arange(q.shape[2], device="cuda") // 1024
        mask = ids[:, None] == ids[None, :]  # (T, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")


def _time(fn, mode: str, q, k, v) -> float:
    from triton.testing import do_bench

    if mode == "fwd":

        def step():
            with torch.no_grad():
                fn(q, k, v)
    else:
        dout = torch.randn_like(q)

        def step():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return do_bench(step, warmup=10, rep=40, return_mode="median")


def _error(fn, case: str, q, k, v) -> float:
    """Largest relative error of out, dq, dk, dv against SDPA in bf16 (both vs each other)."""
    dout = torch.randn_like(q)
    out = fn(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref_out = _flash(case, q, k, v)
    ref = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout))
    pairs = [(a.detach().float(), b.detach().float()) for a, b in zip(got, ref)]
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs)


def _record(out, **rec) -> dict:
    line = json.dumps(rec)
    print(line, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(line + "\n")
    return rec


def defaults(args) -> list[dict]:
    recs = []
    for D in args.dims:
        for T in args.lengths:
            q, k, v = _inputs(T, D)
            B, H = q.shape[:2]
            for case in args.cases:
                fn = _attend(case, q, first_blocks(D) if args.baseline else None)
                err = _error(fn, case, q, k, v)
                for mode in ("fwd", "fwdbwd"):
                    ms = _time(fn, mode, q, k, v)
                    flops = (
                        4 * B * H * T * T * D * _density(case, T) * (3.5 if mode == "fwdbwd" else 1)
                    )
                    recs.append(
                        _record(
                            args.out,
                            job="defaults",
                            label=args.label,
                            case=case,
                            T=T,
                            D=D,
                            mode=mode,
                            ms=ms,
                            tflops=flops / ms / 1e9,
                            rel_err_vs_sdpa=err,
                        )
                    )
    return recs


def _grid(which: str) -> list[dict]:
    """Candidate changes to Blocks for one kernel (the others stay at their defaults)."""
    if which == "fwd":
        return [
            dict(m=m, n=n, warps=w, stages=s)
            for m, n, w, s in [
                (128, 64, 8, 3),
                (128, 64, 4, 3),
                (128, 128, 8, 2),
                (128, 128, 8, 3),
                (64, 64, 4, 3),
                (64, 128, 4, 3),
                (128, 32, 4, 4),
                (256, 64, 8, 2),
            ]
        ]
    if which == "dkdv":
        return [
            dict(m1=m, n1=n, warps=w, stages=s)
            for m, n, w, s in [
                (32, 128, 8, 3),
                (32, 128, 4, 3),
                (64, 128, 8, 2),
                (64, 64, 4, 3),
                (32, 64, 4, 3),
                (64, 128, 8, 3),
            ]
        ]
    return [
        dict(m2=m, n2=n, warps=w, stages=s)
        for m, n, w, s in [
            (128, 32, 8, 3),
            (128, 32, 4, 3),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (64, 32, 4, 3),
            (128, 64, 8, 3),
        ]
    ]


def _blocks(D: int, which: str, change: dict) -> Blocks:
    base = default_blocks(D, banded=True)  # --tune times causal calls
    i = {"fwd": 0, "dkdv": 1, "dq": 2}[which]
    warps, stages = list(base.warps), list(base.stages)
    warps[i], stages[i] = change.pop("warps"), change.pop("stages")
    return dataclasses.replace(base, warps=tuple(warps), stages=tuple(stages), **change)


def tune(args) -> list[dict]:
    recs = []
    for D in args.dims:
        T = args.lengths[0]
        q, k, v = _inputs(T, D)
        for case in args.cases:
            for which in ("fwd", "dkdv", "dq"):
                mode = "fwd" if which == "fwd" else "fwdbwd"
                for change in _grid(which):
                    blocks = _blocks(D, which, dict(change))
                    fn = _attend(case, q, blocks)
                    t0 = time.time()
                    try:
                        err = _error(fn, case, q, k, v)
                        ms = _time(fn, mode, q, k, v) if err < 5e-2 else None
                        why = None if ms is not None else "wrong"
                    except Exception as e:  # a configuration that does not fit: say why
                        err, ms, why = None, None, f"{type(e).__name__}: {str(e)[:120]}"
                    recs.append(
                        _record(
                            args.out,
                            job="tune",
                            case=case,
                            T=T,
                            D=D,
                            kernel=which,
                            mode=mode,
                            blocks=change,
                            ms=ms,
                            rel_err_vs_sdpa=err,
                            failed=why,
                            seconds=round(time.time() - t0, 1),
                        )
                    )
    return recs


def _table(recs: list[dict]) -> str:
    lines = []
    for r in recs:
        if r["job"] == "defaults":
            lines.append(
                f"{r['label']:6s} {r['case']:9s} T={r['T']:5d} D={r['D']:3d} "
                f"{r['mode']:6s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s "
                f"err {r['rel_err_vs_sdpa']:.1e}"
            )
        else:
            ms = "-" if r["ms"] is None else f"{r['ms']:8.3f} ms"
            lines.append(
                f"tune {r['case']:9s} D={r['D']:3d} {r['kernel']:5s} {r['blocks']} "
                f"{ms} {r['failed'] or ''}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--defaults", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--label", default="")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="--defaults at the first, untuned blocks (first_blocks)",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument(
        "--cases",
        nargs="+",
        default=["none", "causal", "document"],
        choices=["none", "causal", "document"],
    )
    p.add_argument("--out", type=Path, default=None, help="append JSON lines here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_triton.py needs a CUDA GPU", file=sys.stderr)
        return 2
    recs = (defaults(args) if args.defaults else []) + (tune(args) if args.tune else [])
    print(_table(recs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
