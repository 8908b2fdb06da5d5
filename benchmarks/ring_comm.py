"""Ring attention against all-gathering K/V (issue 15): communication, memory and time per rank.

Spawns R processes on this machine (``torch.multiprocessing``, gloo over loopback,
``init_method=tcp://127.0.0.1:<free port>``); **each process runs with
``torch.set_num_threads(1)``**, so R processes share the machine's cores. For every R, mask
and sequence length T, every rank holds a shard ``(B, H, T_r, D)`` of one seeded sequence and
runs, forward and forward+backward:

* **ring**: ``qkv.distributed.ring_attention``; its messages come from ``comm_log()``, exact.
* **all-gather** (the peer): every rank ``dist.all_gather``\\ s the whole K and V, then runs
  ``qkv.scaled_dot_product_attention`` of its own queries against every key with the same
  mask over whole-sequence positions (``qkv.masks.offset_mask``); in backward the key/value
  gradients go back to their owners by ``dist.reduce_scatter``. Its bytes: the (R-1) other
  shards a rank receives in each collective (what gloo's ring algorithms move per rank).

The two outputs (and gradients) are compared on every rank and the largest difference printed,
so both sides compute the same thing. Wall times: median of up to ``--repeats`` calls after one
warm-up call per path at ``--warmup-length``, each call between two ``dist.barrier()``; a rank's
time ends when its call returns, the step time at the closing barrier (the slowest rank).
A measurement stops repeating once its calls took ``--max-seconds``.

K/V held (forward, counted from the code of each path, not measured): ring: the rank's own K
and V, their packed copy (``torch.cat([k, v], -1)``, what it sends from) and the received spans
alive at once (the one computed on and the next one in flight; not counted: the copy of a span
it sends when that is less than its whole shard, at most W keys for a window); all-gather: its
own K and V and the whole sequence's K and V (the gathered parts are freed before attention;
during assembly they exist twice).

Shape alphabet: B batch, H heads (G = H, no GQA), T whole sequence length, T_r a rank's shard
length (T / R), D head dim.

Usage:
    python benchmarks/ring_comm.py --ranks 2 4 --lengths 16384 32768 65536 \\
        --json benchmarks/results/ring_comm.json --png benchmarks/results/ring_comm.png
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv.distributed import comm_log, ring_attention, segments, shard

CASES = {  # name -> (mask, layout)
    "window": ("window", "contiguous"),
    "window-balanced": ("window", "balanced"),
    "causal": ("causal", "contiguous"),
    "causal-balanced": ("causal", "balanced"),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
IMPLS = ("ring", "all-gather")
MIB = 2**20


@dataclass(frozen=True)
class Config:
    ranks: tuple[int, ...] = (2, 4)
    lengths: tuple[int, ...] = (16384, 32768, 65536)
    cases: tuple[str, ...] = ("window", "window-balanced", "causal", "causal-balanced")
    modes: tuple[str, ...] = ("fwd", "fwdbwd")
    causal_fwdbwd_max: int = 32768
    dtype: str = "float32"
    B: int = 1
    H: int = 4
    D: int = 64
    window: int = 1024
    repeats: int = 3
    max_seconds: float = 20.0
    warmup_length: int = 8192
    timeout_s: float = 1800.0

    def modes_for(self, case: str, T: int) -> list[str]:
        """Forward+backward of a causal mask costs T²: only up to ``causal_fwdbwd_max``."""
        big = CASES[case][0] == "causal" and self.causal_fwdbwd_max < T
        return [m for m in self.modes if not (m == "fwdbwd" and big)]


# ---- the two paths ----------------------------------------------------------------------------


def whole_mask(case: str, cfg: Config, T: int) -> qkv.masks.MaskMod:
    """The mask over whole-sequence positions, bound to (B, H, T, T)."""
    mask = (
        qkv.masks.sliding_window(cfg.window) if CASES[case][0] == "window" else qkv.masks.causal()
    )
    return mask.bind(cfg.B, cfg.H, T, T)


def run_ring(case: str, cfg: Config, q, k, v, grad: bool):
    """Output (and dq, dk, dv) of ring attention on this rank's shards."""
    kwargs = dict(layout=CASES[case][1])
    if CASES[case][0] == "window":
        kwargs["mask_mod"] = qkv.masks.sliding_window(cfg.window)
    else:
        kwargs["is_causal"] = True
    if not grad:
        with torch.no_grad():
            return ring_attention(q, k, v, **kwargs), None, {}
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, **kwargs)  # (B, H, T_r, D)
    out.backward(_dout(out))
    return out.detach(), (q.grad, k.grad, v.grad), {}


def run_all_gather(case: str, cfg: Config, q, k, v, grad: bool):
    """The peer: all-gather K/V, attend locally, reduce-scatter dK/dV. Returns its output,
    gradients and the bytes it moved per phase (the (R-1) other shards of each collective)."""
    rank, R = dist.get_rank(), dist.get_world_size()
    B, H, T_r, D = q.shape
    T = T_r * R
    segs = segments(T, R, CASES[case][1])
    mine = torch.cat([k, v], dim=-1).contiguous()  # (B, H, T_r, 2D): one message
    parts = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(parts, mine)
    whole = mine.new_empty(B, H, T, 2 * D)  # (B, H, T, 2D) in position order
    for r in range(R):
        at = 0
        for a, b in segs[r]:
            whole[:, :, a:b] = parts[r][:, :, at : at + b - a]
            at += b - a
    moved = {"forward": (R - 1) * mine.numel() * mine.element_size()}
    del parts, mine
    if grad:
        q = q.detach().requires_grad_()
        whole.requires_grad_()
    mask = whole_mask(case, cfg, T)
    outs, at = [], 0
    with torch.set_grad_enabled(grad):
        kk, vv = whole[..., :D], whole[..., D:]  # (B, H, T, D) each
        for a, b in segs[rank]:  # one run of query positions (contiguous), two (balanced)
            outs.append(
                qkv.scaled_dot_product_attention(
                    q[:, :, at : at + b - a], kk, vv, mask_mod=qkv.masks.offset_mask(mask, a, 0)
                )
            )
            at += b - a
        out = torch.cat(outs, dim=2)  # (B, H, T_r, D)
    if not grad:
        return out, None, moved
    out.backward(_dout(out))
    d_parts = [
        torch.cat([whole.grad[:, :, a:b] for a, b in segs[r]], dim=2).contiguous() for r in range(R)
    ]  # R x (B, H, T_r, 2D)
    d_mine = torch.empty_like(d_parts[rank])
    dist.reduce_scatter(d_mine, d_parts)
    moved["gradients"] = (R - 1) * d_mine.numel() * d_mine.element_size()
    return out.detach(), (q.grad, d_mine[..., :D], d_mine[..., D:]), moved


def _dout(out: torch.Tensor) -> torch.Tensor:
    """The same upstream gradient on both paths: fixed by the rank and the shape."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.dtype)


PATHS = {"ring": run_ring, "all-gather": run_all_gather}


# ---- one measurement --------------------------------------------------------------------------


def shards(case: str, cfg: Config, T: int):
    """This rank's shards of one seeded sequence (the same on every rank before sharding)."""
    g = torch.Generator().manual_seed(T)
    dtype = DTYPES[cfg.dtype]
    whole = [torch.randn(cfg.B, cfg.H, T, cfg.D, generator=g).to(dtype) for _ in range(3)]
    return [shard(t, layout=CASES[case][1]).contiguous() for t in whole]  # 3 x (B, H, T_r, D)


def ring_kv_held(log, own_bytes: int) -> int:
    """Forward K/V bytes alive at once on the ring: own K and V, their packed copy and the
    largest two consecutive steps' received spans."""
    by_step: dict[int, int] = {}
    for m in log.messages:
        if m.kind == "recv" and m.phase == "forward":
            by_step[m.step] = by_step.get(m.step, 0) + m.nbytes
    steps = sorted(by_step)
    pair = max([by_step[s] + by_step.get(s + 1, 0) for s in steps], default=0)
    return 2 * own_bytes + pair


def timed(case: str, cfg: Config, impl: str, mode: str, q, k, v) -> dict:
    """Up to ``cfg.repeats`` calls; the first is kept for bytes and the check."""
    grad = mode == "fwdbwd"
    own, steps, first = [], [], None
    for _ in range(cfg.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        with comm_log() as log:
            out, grads, moved = PATHS[impl](case, cfg, q, k, v, grad)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        own.append(t1 - t0)
        steps.append(t2 - t0)
        if first is None:
            first = (out, grads, log, moved)
        done = torch.tensor([float(sum(steps) >= cfg.max_seconds)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops together
        if done.item():
            break
    return dict(own=own, steps=steps, first=first)


def measure(case: str, cfg: Config, T: int, mode: str) -> dict:
    """Both paths on one (case, T, mode): this rank's record."""
    q, k, v = shards(case, cfg, T)
    own_bytes = (k.numel() + v.numel()) * k.element_size()
    res = {impl: timed(case, cfg, impl, mode, q, k, v) for impl in IMPLS}
    (o_r, g_r, log, _), (o_a, g_a, _, moved) = res["ring"]["first"], res["all-gather"]["first"]
    diffs = {"out": _diff(o_r, o_a)}
    if g_r is not None:
        diffs.update({n: _diff(a, b) for n, a, b in zip(("dq", "dk", "dv"), g_r, g_a)})
    ring_phases = ("forward",) if mode == "fwd" else ("forward", "backward", "gradients")
    return dict(
        rank=dist.get_rank(),
        case=case,
        T=T,
        mode=mode,
        shard_kv_bytes=own_bytes,
        ring=dict(
            recv={p: log.bytes("recv", p) for p in ring_phases},
            send={p: log.bytes("send", p) for p in ring_phases},
            recv_from=sorted(log.peers("recv", "forward")),
            kv_held=ring_kv_held(log, own_bytes),
            own_s=res["ring"]["own"],
            step_s=res["ring"]["steps"],
        ),
        all_gather=dict(
            recv=moved,
            send=dict(moved),
            kv_held=own_bytes + dist.get_world_size() * own_bytes,
            own_s=res["all-gather"]["own"],
            step_s=res["all-gather"]["steps"],
        ),
        max_abs_diff=diffs,
    )


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def warm_up(cfg: Config) -> None:
    """One call of every path, case and mode at a small length: first-call costs."""
    for case in cfg.cases:
        q, k, v = shards(case, cfg, cfg.warmup_length)
        for mode in cfg.modes:
            for impl in IMPLS:
                PATHS[impl](case, cfg, q, k, v, mode == "fwdbwd")
        dist.barrier()


# ---- processes --------------------------------------------------------------------------------


def worker(rank: int, R: int, port: int, cfg: Config, out_path: str) -> None:
    torch.set_num_threads(1)  # R processes share the cores: one thread each
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=R,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        warm_up(cfg)
        records = []
        for case in cfg.cases:
            for T in cfg.lengths:
                for mode in cfg.modes_for(case, T):
                    records.append(measure(case, cfg, T, mode))
                    if rank == 0:
                        r = records[-1]
                        print(
                            f"  R={R} {case:15s} T={T:6d} {mode:6s} ring "
                            f"{statistics.median(r['ring']['step_s']):7.2f} s  all-gather "
                            f"{statistics.median(r['all_gather']['step_s']):7.2f} s  "
                            f"(load {os.getloadavg()[0]:.2f})",
                            flush=True,
                        )
        every = [None] * R
        dist.all_gather_object(every, records)
        if rank == 0:
            Path(out_path).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(R: int, cfg: Config) -> dict:
    """Spawn R processes; their records merged rank by rank, with the load around the run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.json")
        load0, t0 = os.getloadavg(), time.time()
        mp.spawn(worker, args=(R, free_port(), cfg, path), nprocs=R, join=True)
        per_rank = json.loads(Path(path).read_text())
    return dict(
        R=R,
        seconds=time.time() - t0,
        load_before=load0,
        load_after=os.getloadavg(),
        records=merge(per_rank),
    )


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One record per (case, T, mode) with per-rank lists."""
    out = []
    for recs in zip(*per_rank):
        first = recs[0]
        m = dict(
            case=first["case"],
            mask=CASES[first["case"]][0],
            layout=CASES[first["case"]][1],
            T=first["T"],
            mode=first["mode"],
            shard_kv_bytes=first["shard_kv_bytes"],
            max_abs_diff={
                k: max(r["max_abs_diff"][k] for r in recs) for k in first["max_abs_diff"]
            },
        )
        for impl in ("ring", "all_gather"):
            m[impl] = {key: [r[impl][key] for r in recs] for key in first[impl]}
            m[impl]["median_step_s"] = max(statistics.median(r[impl]["step_s"]) for r in recs)
            m[impl]["median_own_s"] = [statistics.median(r[impl]["own_s"]) for r in recs]
        out.append(m)
    return out


# ---- reporting --------------------------------------------------------------------------------


def total(recv: dict) -> int:
    return sum(recv.values())


def _mib(n: float) -> str:
    return f"{n / MIB:.0f}" if n >= 10 * MIB or n == 0 else f"{n / MIB:.1f}"


def _per_rank(values: list[int]) -> str:
    return " / ".join(_mib(v) for v in values)


def _ratio(a: float, b: float) -> str:
    return "inf" if b == 0 else f"{a / b:.2f}x"


def comm_table(runs: list[dict]) -> str:
    """Bytes received per rank (MiB, rank 0 / 1 / ...), exact, and K/V held."""
    rows = [
        (
            "| R | mask | layout | T | mode | ring: received per rank (MiB) | all-gather: received "
            "per rank (MiB) | all-gather / ring (all ranks; busiest) | ring recv from (fwd) "
            "| K/V held, ring | K/V held, "
            "all-gather |"
        ),
        "|---:|:---|:---|---:|:---|:---|:---|---:|:---|---:|---:|",
    ]
    for run in runs:
        for m in run["records"]:
            ring = [total(x) for x in m["ring"]["recv"]]
            ag = [total(x) for x in m["all_gather"]["recv"]]
            peers = " ".join("{" + ",".join(map(str, p)) + "}" for p in m["ring"]["recv_from"])
            rows.append(
                f"| {run['R']} | {m['mask']} | {m['layout']} | {m['T']} | {_mode(m['mode'])} | "
                f"{_per_rank(ring)} | {_per_rank(ag)} | **{_ratio(sum(ag), sum(ring))}**; "
                f"{_ratio(max(ag), max(ring))} | "
                f"{peers} | {_mib(max(m['ring']['kv_held']))} | "
                f"{_mib(max(m['all_gather']['kv_held']))} |"
            )
    return "\n".join(rows)


def time_table(runs: list[dict]) -> str:
    """Median step time (slowest rank) of both paths, their ratio, and the check."""
    rows = [
        (
            "| R | mask | layout | T | mode | calls | ring | all-gather | ring / all-gather | "
            "max abs diff (out; dq, dk, dv) | load before / after R's run |"
        ),
        "|---:|:---|:---|---:|:---|---:|---:|---:|---:|:---|:---|",
    ]
    for run in runs:
        load = f"{run['load_before'][0]:.1f} / {run['load_after'][0]:.1f}"
        for m in run["records"]:
            r, a = m["ring"]["median_step_s"], m["all_gather"]["median_step_s"]
            d = m["max_abs_diff"]
            diff = f"{d['out']:.1e}" + (
                f"; {d['dq']:.1e}, {d['dk']:.1e}, {d['dv']:.1e}" if "dq" in d else ""
            )
            calls = f"{len(m['ring']['step_s'][0])}, {len(m['all_gather']['step_s'][0])}"
            rows.append(
                f"| {run['R']} | {m['mask']} | {m['layout']} | {m['T']} | "
                f"{_mode(m['mode'])} | {calls} | {r:.2f} s | {a:.2f} s | "
                f"{r / a:.2f} | {diff} | {load} |"
            )
    return "\n".join(rows)


def _mode(mode: str) -> str:
    return "fwd+bwd" if mode == "fwdbwd" else mode


def plot(runs: list[dict], path: Path) -> None:
    """Forward bytes received by the busiest rank vs T: window and causal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mask in zip(axes, ("window", "causal")):
        for run in runs:
            recs = [m for m in run["records"] if m["mask"] == mask and m["mode"] == "fwd"]
            for layout, style in (("contiguous", "-o"), ("balanced", "--s")):
                pts = [m for m in recs if m["layout"] == layout]
                if pts:
                    ax.plot(
                        [m["T"] for m in pts],
                        [max(x["forward"] for x in m["ring"]["recv"]) / MIB for m in pts],
                        style,
                        label=f"ring, {layout}, R={run['R']}",
                    )
            pts = [m for m in recs if m["layout"] == "contiguous"] or recs
            ax.plot(
                [m["T"] for m in pts],
                [max(x["forward"] for x in m["all_gather"]["recv"]) / MIB for m in pts],
                ":^",
                color="gray" if run["R"] == 2 else "black",
                label=f"all-gather, R={run['R']}",
            )
        title = "sliding window" if mask == "window" else "causal"
        ax.set(title=title, xscale="log", yscale="log", xlabel="T (whole sequence)")
        ax.set_xticks(sorted({m["T"] for run in runs for m in run["records"]}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
    axes[0].set_ylabel("forward: MiB received by the busiest rank")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(cfg: Config) -> dict:
    try:
        version = importlib.metadata.version("qkv")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(
        benchmark="ring_comm",
        device="cpu",
        cpu=cpu,
        cores=os.cpu_count(),
        threads_per_process=1,
        backend="gloo (loopback)",
        dtype=cfg.dtype,
        torch=torch.__version__,
        qkv=version,
        python=platform.python_version(),
        platform=platform.platform(),
        config=asdict(cfg),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


# ---- CLI --------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    p.add_argument("--ranks", type=int, nargs="+", default=list(d.ranks))
    p.add_argument("--lengths", type=int, nargs="+", default=list(d.lengths))
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(d.cases))
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwdbwd"], default=list(d.modes))
    p.add_argument(
        "--causal-fwdbwd-max",
        type=int,
        default=d.causal_fwdbwd_max,
        help="forward+backward of causal cases only for T up to this (T² cost)",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype)
    p.add_argument("--batch", type=int, default=d.B)
    p.add_argument("--heads", type=int, default=d.H)
    p.add_argument("--head-dim", type=int, default=d.D)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=d.max_seconds,
        help="stop repeating a measurement once its calls took this long (>= 1 call)",
    )
    p.add_argument("--warmup-length", type=int, default=d.warmup_length)
    p.add_argument(
        "--timeout", type=float, default=d.timeout_s, help="process-group timeout, seconds"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    a = p.parse_args(argv)
    for R in a.ranks:
        for T in a.lengths + [a.warmup_length]:
            if R < 2 or T % (2 * R):
                p.error(
                    f"got R={R} and T={T}: R must be >= 2 and T a multiple of 2R = {2 * R} "
                    f"(equal shards, as dist.all_gather needs), e.g. T={T - T % (2 * R) or 2 * R}"
                )
    cfg = Config(
        tuple(a.ranks),
        tuple(a.lengths),
        tuple(a.cases),
        tuple(a.modes),
        a.causal_fwdbwd_max,
        a.dtype,
        a.batch,
        a.heads,
        a.head_dim,
        a.window,
        a.repeats,
        a.max_seconds,
        a.warmup_length,
        a.timeout,
    )
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, a = parse(argv)
    env = environment(cfg)
    print(
        f"ring_comm: {env['cpu']}, {env['cores']} cores, 1 thread per process, gloo loopback, "
        f"{cfg.dtype}, B={cfg.B} H={cfg.H} D={cfg.D}, window {cfg.window}",
        flush=True,
    )
    runs = []
    for R in cfg.ranks:
        runs.append(run_ranks(R, cfg))
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(dict(env, runs=runs), indent=1))
    print(
        "\nCommunication per rank (exact, from comm_log; all-gather: (R-1) shards per collective)\n"
    )
    print(comm_table(runs))
    print("\nTime (median step, slowest rank; R processes share the cores)\n")
    print(time_table(runs))
    if a.png:
        plot(runs, a.png)
        print(f"\nwrote {a.png}")
    if a.json:
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
