"""Structured attention on CPU against the machine's limit, and weights against torch's module
(issue 17). One process, every implementation of a row measured interleaved (round-robin), so
that ratios are taken under the same load.

Part 1, masks: sliding window 256 and packed documents (``qkv.bench``'s cases, B=1, H=8,
D=64) x T x fp32/bf16 x fwd/fwd+bwd, for

* ``tiled``: ``qkv.scaled_dot_product_attention(backend="tiled")`` with the structured mask;
* ``sdpa-plain``: torch's SDPA with no mask at all -- the GFLOP/s the machine reaches on full
  attention, the yardstick of the ">= 70%" target (it computes T^2 pairs, so its GFLOP/s is
  counted on T^2);
* ``sdpa-dense``: torch's SDPA with the mask as a dense bool ``attn_mask`` (skipped above
  ``--dense-max`` with the reason: a T^2 mask);
* ``flex``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same mask,
  built once outside the timing; forward only (torch has no CPU backward for it: fwd+bwd rows
  are skipped with that reason).

Useful GFLOP/s = 4*B*H*D x (pairs the mask allows) / time (x3.5 for fwd+bwd, STYLE.md 15).

Part 2, weights (``--weights``): ``qkv.MultiHeadAttention(return_trace=True)`` reading
``trace.probs`` against ``torch.nn.MultiheadAttention(need_weights=True,
average_attn_weights=False)``, inference (eval, no_grad), E=512, 8 heads, B=1, T = 256..4096,
fp32/bf16: both timed interleaved in a fresh process per row, peak extra memory each in a
fresh process of its own.

Writes ``OUT/structured.json`` after every row and ``OUT/structured.png``; prints Markdown
tables for ``benchmarks/RESULTS.md`` and each target as met or missed.

Usage:
    python benchmarks/bench_structured.py [--lengths 4096 16384] [--out benchmarks/results]
    python benchmarks/bench_structured.py --weights-only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import qkv
from qkv.bench import attention_flops, document_ids, mask_density, mask_mod_for, write_json_atomic

B, H, D, WINDOW = 1, 8, 64, 256
E, HEADS = 512, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("tiled", "sdpa-plain", "sdpa-dense", "flex")


def flex_block_mask(case: str, T: int):
    from torch.nn.attention.flex_attention import create_block_mask

    if case == "window":

        def mask(b, h, q, kv):
            return (kv <= q) & (kv >= q - WINDOW)
    else:
        ids = document_ids(T)[0]  # (T,)

        def mask(b, h, q, kv):
            return ids[q] == ids[kv]

    # compiled: the eager path evaluates the mask on a full (T, T) grid (int64 index grids of
    # T^2: out of memory at T=16384 on a 24 GiB machine)
    return torch.compile(create_block_mask)(mask, None, None, T, T, device="cpu")


def implementations(
    case: str, T: int, mode: str, dense_max: int, plain_max: int
) -> tuple[dict, dict]:
    """(name -> attend(q, k, v), name -> reason skipped)."""
    import torch.nn.functional as F

    mm = mask_mod_for(case, T)
    impls = {
        "tiled": lambda q, k, v: qkv.scaled_dot_product_attention(
            q, k, v, backend="tiled", mask_mod=mm
        )
    }
    skipped = {}
    if plain_max >= T:
        impls["sdpa-plain"] = F.scaled_dot_product_attention
    else:
        skipped["sdpa-plain"] = (
            f"T^2 work beyond --plain-max {plain_max}: the yardstick is its "
            f"GFLOP/s at the longest T measured"
        )
    if dense_max >= T:
        dense = qkv.masks.to_dense(mm, 1, 1, T, T)  # (1, 1, T, T) bool
        impls["sdpa-dense"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense
        )
    else:
        skipped["sdpa-dense"] = f"a dense T^2 mask beyond --dense-max {dense_max}"
    if mode == "fwdbwd":
        skipped["flex"] = "FlexAttention has no CPU backward in torch " + torch.__version__
    else:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            # each row is a new compilation: past dynamo's recompile limit flex would run
            # eagerly, materialising T^2 scores (out of memory at T=16384)
            torch._dynamo.reset()
            block_mask = flex_block_mask(case, T)
            compiled = torch.compile(flex_attention, dynamic=False)
            impls["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
        except Exception as e:  # no compiler, no inductor CPU backend: say why
            skipped["flex"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return impls, skipped


def step(attend, q, k, v, mode: str):
    if mode == "fwd":

        def fwd():
            with torch.no_grad():
                attend(q, k, v)

        return fwd
    dout = torch.randn_like(q)

    def fwd_bwd():
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    return fwd_bwd


def interleaved(steps: dict, min_time: float, rounds_min: int = 3) -> tuple[dict, dict]:
    """Median seconds per call of each step, timed round-robin; failures as reasons."""
    times, failed = {n: [] for n in steps}, {}
    for name, fn in list(steps.items()):  # warm-up (compiles flex), and drop what fails
        try:
            fn()
            fn()
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            steps.pop(name)
            times.pop(name)
    start, rounds = time.perf_counter(), 0
    while steps and (rounds < rounds_min or time.perf_counter() - start < min_time * len(steps)):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {n: statistics.median(t) for n, t in times.items()}, failed


def run_masks(args, records: list, out_json: Path, env: dict) -> None:
    rows = [
        (case, T, dt, mode)
        for T in args.lengths
        for case in args.cases
        for dt in args.dtypes
        for mode in args.modes
    ]
    for i, (case, T, dt, mode) in enumerate(rows, 1):
        print(f"[{i}/{len(rows)}] {case} T={T} {dt} {mode} ...", file=sys.stderr, flush=True)
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(B, H, T, D, generator=g).to(DTYPES[dt]).requires_grad_(mode == "fwdbwd")
            for _ in range(3)
        )
        impls, skipped = implementations(case, T, mode, args.dense_max, args.plain_max)
        secs, failed = interleaved(
            {n: step(f, q, k, v, mode) for n, f in impls.items()}, args.min_time
        )
        skipped.update(failed)
        bwd = mode == "fwdbwd"
        useful = attention_flops(B, H, T, T, D, density=mask_density(case, T), backward=bwd)
        full = attention_flops(B, H, T, T, D, backward=bwd)
        for impl in IMPLS:
            rec = dict(part="masks", case=case, T=T, dtype=dt, mode=mode, impl=impl)
            if impl in secs:
                flops = full if impl == "sdpa-plain" else useful
                rec.update(status="ok", time_s=secs[impl], gflops=flops / secs[impl] / 1e9)
            else:
                rec.update(status="skipped", reason=skipped.get(impl, "not run"))
            records.append(rec)
        write_json_atomic(out_json, dict(environment=env, records=records))
        print(
            "   "
            + "  ".join(
                f"{r['impl']} {r['time_s'] * 1e3:.1f} ms"
                for r in records[-4:]
                if r["status"] == "ok"
            ),
            file=sys.stderr,
            flush=True,
        )


def weights_worker(impl: str, T: int, dt: str, measure: str, min_time: float) -> dict:
    """One weights measurement in this process: ``measure`` "time" gives nothing (the parent
    interleaves), "memory" the peak extra resident memory of the first call (a second call
    would reuse memory the allocator kept from the first)."""
    from torch import nn

    torch.manual_seed(0)
    dtype = DTYPES[dt]
    tm = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=dtype).eval()
    qm = qkv.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(B, T, E, dtype=dtype)

    def call():
        with torch.no_grad():
            if impl == "torch":
                return tm(x, x, x, need_weights=True, average_attn_weights=False)[1]
            return qm(x, return_trace=True)[1].probs

    if measure == "memory":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # high-water mark := RSS now
        before_kib = _status_kib("VmHWM")
        w = call()
        peak_kib = _status_kib("VmHWM")
        return dict(
            peak_mib=(peak_kib - before_kib) / 1024,
            weights_mib=w.numel() * w.element_size() / 2**20,
        )
    return dict(call=call)


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status, KiB (VmHWM: peak RSS since the last reset; not
    ``ru_maxrss``, which also counts the parent's peak: Linux carries it over fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def run_weights(args, records: list, out_json: Path, env: dict) -> None:
    rows = [(T, dt) for T in args.weight_lengths for dt in args.dtypes]
    for i, (T, dt) in enumerate(rows, 1):
        print(f"[weights {i}/{len(rows)}] T={T} {dt} ...", file=sys.stderr, flush=True)
        # timed in a fresh process of their own: after the long calls above, this process's
        # heap made every fresh (T, S) buffer slower to fault in, torch's and qkv's alike
        # (torch's module at T=1024 fp32: 85 ms against 45 in a fresh process)
        timed = subprocess.run(
            [sys.executable, __file__, "--weights-time", str(T), dt, str(args.min_time)],
            capture_output=True,
            text=True,
            check=True,
        )
        secs, failed = json.loads(timed.stdout.splitlines()[-1])
        for impl in ("torch", "qkv"):
            rec = dict(part="weights", T=T, dtype=dt, mode="fwd", impl=impl)
            if impl in secs:
                mem = subprocess.run(
                    [sys.executable, __file__, "--weights-memory", impl, str(T), dt],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rec.update(
                    status="ok", time_s=secs[impl], **json.loads(mem.stdout.splitlines()[-1])
                )
            else:
                rec.update(status="failed", reason=failed[impl])
            records.append(rec)
        write_json_atomic(out_json, dict(environment=env, records=records))


def _get(records, **kw):
    for r in records:
        if all(r.get(k) == v for k, v in kw.items()) and r["status"] == "ok":
            return r
    return None


def report(records: list) -> list[str]:
    """Markdown tables and the targets, met or missed."""
    lines = [
        (
            "| case | T | dtype | mode | tiled ms | useful GFLOP/s | sdpa-plain GFLOP/s | "
            "tiled / plain | sdpa-dense ms | tiled / dense time | flex ms | flex / tiled time |"
        ),
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    targets = []
    keys = sorted(
        {(r["case"], r["T"], r["dtype"], r["mode"]) for r in records if r["part"] == "masks"},
        key=lambda k: (k[0], k[1], k[2], k[3]),
    )
    for case, T, dt, mode in keys:
        kw = dict(part="masks", case=case, T=T, dtype=dt, mode=mode)
        t, p, d, f = (_get(records, impl=i, **kw) for i in IMPLS)
        if p is None:  # plain not run this long: its GFLOP/s at the longest T it ran
            shorter = [
                r
                for r in records
                if r["part"] == "masks"
                and r["impl"] == "sdpa-plain"
                and r["status"] == "ok"
                and (r["dtype"], r["mode"]) == (dt, mode)
                and r["T"] < T
            ]
            p = max(shorter, key=lambda r: r["T"], default=None)

        def ms(r):
            return f"{r['time_s'] * 1e3:.1f}" if r else "skipped"

        share = t["gflops"] / p["gflops"] if t and p else None
        yard = (
            "" if p is None else f"{p['gflops']:.1f}" + ("" if p["T"] == T else f" (at T={p['T']})")
        )
        dense = t["time_s"] / d["time_s"] if t and d else None
        flex = f["time_s"] / t["time_s"] if t and f else None
        lines.append(
            f"| {case} | {T} | {dt} | {'fwd+bwd' if mode == 'fwdbwd' else mode} | {ms(t)} | "
            f"{t['gflops']:.1f} | {yard} | {share:.2f} | {ms(d)} | "
            f"{'' if dense is None else f'{dense:.2f}'} | {ms(f)} | "
            f"{'' if flex is None else f'{flex:.2f}'} |"
            if t and p
            else f"| {case} | {T} | {dt} | {mode} | not measured |||||||||"
        )
        label = f"{case} T={T} {dt} {mode}"
        if share is not None and T >= 4096:
            targets.append(
                (share >= 0.7, f"{label}: useful GFLOP/s {share:.2f} of sdpa-plain's (>= 0.70)")
            )
        if flex is not None and T >= 4096:
            targets.append(
                (flex >= 1.5, f"{label}: {flex:.2f}x faster than compiled flex (>= 1.5)")
            )
        if dense is not None and case == "document" and T == 1024:
            targets.append((dense <= 1.0, f"{label}: time {dense:.2f} of sdpa-dense (<= 1.00)"))
    wl = [r for r in records if r["part"] == "weights"]
    if wl:
        lines += [
            "",
            (
                "| T | dtype | torch ms | qkv ms | qkv / torch | torch peak MiB | qkv peak MiB "
                "| weights MiB |"
            ),
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for T, dt in sorted({(r["T"], r["dtype"]) for r in wl}):
            a, b = _get(wl, T=T, dtype=dt, impl="torch"), _get(wl, T=T, dtype=dt, impl="qkv")
            if not (a and b):
                continue
            ratio = b["time_s"] / a["time_s"]
            lines.append(
                f"| {T} | {dt} | {a['time_s'] * 1e3:.1f} | {b['time_s'] * 1e3:.1f} | {ratio:.2f} | "
                f"{a['peak_mib']:.0f} | {b['peak_mib']:.0f} | {b['weights_mib']:.0f} |"
            )
            targets.append(
                (ratio <= 0.9, f"weights T={T} {dt}: qkv/torch time {ratio:.2f} (<= 0.90)")
            )
            targets.append(
                (
                    b["peak_mib"] < a["peak_mib"],
                    (
                        f"weights T={T} {dt}: peak {b['peak_mib']:.0f} vs torch "
                        f"{a['peak_mib']:.0f} MiB (lower)"
                    ),
                )
            )
    lines += ["", "Targets:"] + [f"- {'met' if ok else 'MISSED'}: {what}" for ok, what in targets]
    return lines


def plot(records: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'qkv[viz]')", file=sys.stderr)
        return
    masks = [r for r in records if r["part"] == "masks" and r["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, case in zip(axes[:2], ("window", "document")):
        for impl, style in (
            ("tiled", "-o"),
            ("sdpa-plain", "--s"),
            ("sdpa-dense", ":^"),
            ("flex", "-.d"),
        ):
            for dt, color in (("fp32", "C0"), ("bf16", "C1")):
                for mode, alpha in (("fwd", 1.0), ("fwdbwd", 0.5)):
                    pts = sorted(
                        (r["T"], r["gflops"])
                        for r in masks
                        if (r["case"], r["impl"], r["dtype"], r["mode"]) == (case, impl, dt, mode)
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts), style, color=color, alpha=alpha, label=f"{impl} {dt} {mode}"
                        )
        ax.set(
            xscale="log",
            title=f"{case}: useful GFLOP/s (plain: full T^2)",
            xlabel="T",
            ylabel="GFLOP/s",
        )
        ax.legend(fontsize=6)
    wl = [r for r in records if r["part"] == "weights" and r["status"] == "ok"]
    for impl, style in (("torch", "--s"), ("qkv", "-o")):
        for dt, color in (("fp32", "C0"), ("bf16", "C1")):
            pts = sorted(
                (r["T"], r["time_s"] * 1e3) for r in wl if (r["impl"], r["dtype"]) == (impl, dt)
            )
            if pts:
                axes[2].plot(*zip(*pts), style, color=color, label=f"{impl} {dt}")
    axes[2].set(
        xscale="log",
        yscale="log",
        title="MHA inference with per-head weights",
        xlabel="T",
        ylabel="ms",
    )
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--weights-memory":
        impl, T, dt = sys.argv[2], int(sys.argv[3]), sys.argv[4]
        print(json.dumps(weights_worker(impl, T, dt, "memory", 0)))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--weights-time":
        T, dt, min_time = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
        steps = {impl: weights_worker(impl, T, dt, "time", 0)["call"] for impl in ("torch", "qkv")}
        print(json.dumps(interleaved(steps, min_time)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument(
        "--cases", nargs="+", default=["window", "document"], choices=["window", "document"]
    )
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--weight-lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--weights-only", action="store_true")
    ap.add_argument("--no-weights", action="store_true")
    ap.add_argument("--dense-max", type=int, default=4096, help="longest T for sdpa-dense")
    ap.add_argument("--plain-max", type=int, default=4096, help="longest T for sdpa-plain")
    ap.add_argument(
        "--min-time", type=float, default=1.0, help="seconds per implementation and row"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "structured.json"
    env = dict(
        torch=torch.__version__,
        qkv=qkv.__version__,
        threads=torch.get_num_threads(),
        machine=platform.machine(),
        processor=platform.processor() or platform.platform(),
        command=" ".join(sys.argv),
    )
    records: list = []
    if not args.weights_only:
        run_masks(args, records, out_json, env)
    if not args.no_weights:
        run_weights(args, records, out_json, env)
    print("\n".join(report(records)))
    plot(records, args.out / "structured.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
