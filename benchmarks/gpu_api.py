"""qkv's public API on a GPU against the best kernels torch has: compiled FlexAttention,
SDPA with cuDNN, SDPA with flash (issue 39).

The grid: cases none, causal, window (``sliding_window(1024)``: the last 1024 keys and the
query's own) and document (packed documents of 512-2048 tokens, ``qkv.bench.document_ids``)
x T = 1k, 4k, 16k x D = 64, 128 x forward and forward+backward, bfloat16. Batch and heads as
FlashAttention's benchmarks: B = 16384 // T (16k tokens a batch), H = 2048 // D.

What is timed (``triton.testing.do_bench`` median, ms):
Forward is timed as inference (inputs that want no gradient); forward+backward as training.

  * ``qkv_ms``: ``qkv.scaled_dot_product_attention(..., backend="auto")``, the public API
    with everything a user's call pays (validation, planning, the mask contract);
  * ``backends``: the same call with each registered backend named but those in ``--skip``
    (the reference, the slow twin that holds every (T, S) score, and tiled, PyTorch ops per
    block, by default); a backend that refuses the call records its reason instead of a time;
  * ``auto``: which backend auto took and why (``qkv.dispatch.explain``: measured on this
    machine with the times, or the static order);
  * ``flex_ms``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same
    mask, the block mask built once outside the timing (none: no block mask);
  * ``cudnn_ms`` / ``flash_ms``: ``F.scaled_dot_product_attention`` held to
    ``SDPBackend.CUDNN_ATTENTION`` / ``FLASH_ATTENTION``; none and causal only (they take no
    other mask).

Before timing, auto's output is compared with flex's (``max_diff_vs_flex``). Each qkv
implementation is then called once more under ``torch.cuda.set_sync_debug_mode("error")``,
forward and forward+backward: ``syncs`` records the ones that synchronised the device.

Goals (issue 39): window and document at most 1.0x flex's time; none and causal at most
1.05x the best of cuDNN and flash. ``ratio`` = qkv_ms / that peer's ms (below 1: qkv faster).

The machine's time is lent in minutes, so the grid runs most informative first (D = 128,
T = 4k, 1k, 16k; then D = 64) and stops taking new configurations after ``--budget-s``
seconds; what it skipped is listed in the JSON. ``--out`` is rewritten after every row.

``--dry-run`` checks the script without a GPU: CPU tensors, T = 256, D = 64, the triton
backend under its interpreter, plain timers; its figures mean nothing.

Usage:
    python benchmarks/gpu_api.py --out benchmarks/results/gpu_api.json [--budget-s 300]
    python benchmarks/gpu_api.py --dry-run --out /tmp/gpu_api_dry.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import gpu_common
import torch
from gpu_common import sync_free, timer, write_json
from triton_vs_flash import WINDOW, flex_mask, qkv_kwargs  # the same cases as the kernel runs

import qkv
from qkv import dispatch
from qkv.bench import attention_flops, mask_density
from qkv.dispatch import backend_names
from qkv.ops import AttentionCall, BackendUnsupportedError

CASES = ("none", "causal", "window", "document")
MODES = ("fwd", "fwdbwd")
LENGTHS = (4096, 1024, 16384)  # most informative first: the budget may stop the grid
DIMS = (128, 64)
TOKENS, WIDTH = 16384, 2048  # B * T and H * D, as FlashAttention's benchmarks
STRUCTURED_GOAL, PLAIN_GOAL = 1.0, 1.05  # qkv time / peer time, at most
DEFAULT_OUT = Path("benchmarks/results/gpu_api.json")


def implementations(case: str, T: int, device, flex, skip=("reference",)) -> dict:
    """name -> attend(q, k, v) for every implementation of the case (qkv's first)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = qkv_kwargs(case, T, device)

    def named(backend: str):
        return lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)

    impls = {"qkv": named("auto")}
    for name in backend_names():
        if name not in skip:
            impls[f"qkv-{name}"] = named(name)
    block_mask = flex_mask(case, 1, T, device)
    impls["flex"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    if case in ("none", "causal") and device.type == "cuda":
        kernels = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
        for peer, kernel in kernels:

            def sdpa(q, k, v, kernel=kernel):
                with sdpa_kernel(kernel):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

            impls[peer] = sdpa
    return impls


def step(attend, q, k, v, mode: str):
    if mode == "fwd":  # inference: no gradient wanted, as a model's forward under no_grad
        q0, k0, v0 = (t.detach() for t in (q, k, v))
        return lambda: attend(q0, k0, v0)
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return fwd_bwd


def goal(case: str, times: dict) -> tuple[str | None, float | None, float]:
    """(the peer the goal names, its ms, the largest qkv/peer ratio allowed)."""
    if case in ("window", "document"):
        return "flex", times.get("flex"), STRUCTURED_GOAL
    best = [(t, n) for n in ("cudnn", "flash") if (t := times.get(n)) is not None]
    if not best:
        return None, None, PLAIN_GOAL
    t, n = min(best)
    return n, t, PLAIN_GOAL


def environment(device, dry: bool) -> dict:
    return gpu_common.environment(
        "gpu_api",
        device,
        dry,
        dtype="bf16",
        window=WINDOW,
        backends=backend_names(),
        flops="4*B*H*T*S*D*density forward; x3.5 forward+backward",
    )


def measure_config(case, T, D, args, device, flex, bench) -> list[dict]:
    """The rows of one (case, T, D): one per mode."""
    B, H = max(1, args.tokens // T), max(1, args.width // D)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    impls = implementations(case, T, device, flex, args.skip)
    kws = qkv_kwargs(case, T, device)
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    with torch.no_grad():
        ours = impls["qkv"](q0, k0, v0).float()
        try:
            max_diff = float((ours - impls["flex"](q0, k0, v0).float()).abs().max())
        except Exception as e:
            max_diff = f"{type(e).__name__}: {e}"[:300]
    rows = []
    for mode in args.modes:
        times, refused, syncs = {}, {}, {}
        for name, attend in impls.items():
            fn = step(attend, q, k, v, mode)
            try:
                times[name] = bench(fn)
            except BackendUnsupportedError as e:
                refused[name] = str(e)[:300]
                continue
            except Exception as e:  # a peer that cannot run this size: say why, go on
                refused[name] = f"{type(e).__name__}: {e}"[:300]
                print(f"{name} {case} T={T} D={D} {mode}: {refused[name]}", file=sys.stderr)
                continue
            if name.startswith("qkv"):
                syncs[name] = sync_free(fn, device)
        peer, peer_ms, allowed = goal(case, times)
        call = AttentionCall.build(q if mode == "fwdbwd" else q.detach(), k, v, **kws)
        with torch.set_grad_enabled(mode == "fwdbwd"):
            auto_took = dispatch.explain(call)  # which backend auto took, and why
        qkv_ms = times.get("qkv")
        ratio = qkv_ms / peer_ms if qkv_ms and peer_ms else None
        n = attention_flops(
            B, H, T, T, D, density=mask_density(case, T, window=WINDOW), backward=mode == "fwdbwd"
        )
        rows.append(
            dict(
                case=case,
                T=T,
                D=D,
                mode=mode,
                B=B,
                H=H,
                qkv_ms=qkv_ms,
                flex_ms=times.get("flex"),
                cudnn_ms=times.get("cudnn"),
                flash_ms=times.get("flash"),
                device=args.device_name,
                backends={n_: t for n_, t in times.items() if n_.startswith("qkv-")},
                refused=refused,
                sync_free=syncs,
                tflops={n_: n / (t * 1e-3) / 1e12 for n_, t in times.items()},
                max_diff_vs_flex=max_diff,
                auto=auto_took,
                goal_peer=peer,
                ratio=ratio,
                goal=allowed,
                met=None if ratio is None else ratio <= allowed,
            )
        )
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _line(r: dict) -> str:
    ms = ", ".join(
        f"{k} {r[k + '_ms']:.3f}" for k in ("qkv", "flex", "cudnn", "flash") if r[k + "_ms"]
    )
    own = ", ".join(f"{k} {t:.3f}" for k, t in r["backends"].items())
    rat = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x {r['goal_peer']}"
    return f"{r['case']:8s} T={r['T']:5d} D={r['D']:3d} {r['mode']:6s} ms: {ms} | {own} | {rat}"


def markdown(data: dict) -> str:
    """The table for RESULTS.md: ms per implementation, the goal's ratio, syncs."""
    own = sorted({n for r in data["rows"] for n in r["backends"]})
    head = ["case", "T", "D", "mode", "qkv (auto)", *own, "flex", "cuDNN", "flash"]
    lines = [
        f"### qkv's API against Flex, cuDNN and flash ({data['device']}, bf16, ms)",
        "",
        (
            f"torch {data['torch']}, triton {data.get('triton', '-')}, "
            f"CUDA {data.get('cuda', '-')}, cuDNN {data.get('cudnn', '-')}; "
            f"B*T = {data['tokens']}, H*D = {data['width']}; ratio = qkv (auto) / the goal's "
            "peer (below 1: qkv faster); goal: window, document <= 1.0x flex; none, causal "
            "<= 1.05x the best of cuDNN and flash."
        ),
        "",
        "| " + " | ".join(head + ["ratio", "goal", "syncs"]) + " |",
        "|" + "---|" * (len(head) + 3),
    ]

    def ms(t):
        return "-" if t is None else f"{t:.3f}"

    for r in data["rows"]:
        cells = [r["case"], str(r["T"]), str(r["D"]), r["mode"], ms(r["qkv_ms"])]
        cells += [ms(r["backends"].get(n)) for n in own]
        cells += [ms(r["flex_ms"]), ms(r["cudnn_ms"]), ms(r["flash_ms"])]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x {r['goal_peer']}"
        met = "-" if r["met"] is None else ("met" if r["met"] else "missed")
        syncing = [n for n, ok in r["sync_free"].items() if ok is False]
        cells += [ratio, met, ", ".join(syncing) if syncing else "none"]
        lines.append("| " + " | ".join(cells) + " |")
    if data.get("skipped"):
        lines += ["", f"Not reached within the budget: {', '.join(data['skipped'])}."]
    return "\n".join(lines)


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled flex for the whole grid: each configuration is a new shape or mask_mod,
    # and past dynamo's recompile limit (8) flex silently runs eagerly, materialising every
    # (T, S) score (1-14 TFLOP/s in the first H100 run); a limit this grid cannot reach
    # instead of resetting dynamo, which would recompile from scratch each time
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    stack = contextlib.ExitStack()
    stack.enter_context(dynamo_config.patch({limit: 256, "accumulated_" + limit: 4096}))
    flex = torch.compile(flex_attention)
    bench = timer(args.dry_run, args.warmup, args.rep)
    data = dict(environment(device, args.dry_run), tokens=args.tokens, width=args.width)
    data.update(rows=[], skipped=[])
    args.device_name = data["device"]
    t0 = time.monotonic()
    with stack:
        for D in args.dims:
            for T in args.lengths:
                for case in args.cases:
                    if time.monotonic() - t0 > args.budget_s:
                        data["skipped"].append(f"{case} T={T} D={D}")
                        continue
                    data["rows"] += measure_config(case, T, D, args, device, flex, bench)
                    data["elapsed_s"] = round(time.monotonic() - t0, 1)
                    write_json(args.out, data)
    write_json(args.out, data)
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions, ms")
    p.add_argument("--budget-s", type=float, default=300.0, help="no new configuration after")
    p.add_argument("--tokens", type=int, default=TOKENS, help="B * T")
    p.add_argument("--width", type=int, default=WIDTH, help="H * D")
    p.add_argument(
        "--skip",
        nargs="*",
        default=["reference", "tiled"],
        help="qkv backends not timed by name (default: the reference, the slow twin, and tiled, "
        "PyTorch ops per block: 20-1,100 ms a call on an H100, never a GPU choice)",
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script")
    args = p.parse_args(argv)
    if args.dry_run:
        args.lengths, args.dims, args.tokens, args.width = [256], [64], 256, 128
        from qkv.ops.triton import interpreter

        with interpreter():
            data = run(args)
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_api: needs a CUDA GPU (torch.cuda.is_available() is False); "
                "--dry-run checks the script on the CPU. Nothing was measured.",
                file=sys.stderr,
            )
            return 2
        data = run(args)
    print(markdown(data))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
