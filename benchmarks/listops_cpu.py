"""CPU-sized ListOps (lengths 100-500) with exact, linear, Performer and local attention.

Runs ``qkv train listops --attention KIND --out OUT/KIND`` for each kind, one process each,
timed from start to exit (data from the cache, 2,000 steps of 32, evaluation on the 500 test
examples, the picture). A kind whose run already finished (``OUT/KIND/metrics.json`` with
its evaluation and ``OUT/KIND/wall.json``) is read, not run again; an interrupted one is
continued with ``--resume`` (its wall time then covers only the part this call ran, and is
marked so).

Writes ``benchmarks/results/listops_cpu.json`` and ``listops_cpu.png`` (training loss, a
moving average over 50 steps, and test accuracy against the majority class) and prints the
Markdown table of ``benchmarks/RESULTS.md``.

Usage:
    python benchmarks/listops_cpu.py                       # all four kinds, to out/listops_cpu
    python benchmarks/listops_cpu.py --kinds exact local   # some of them
    python benchmarks/listops_cpu.py --report              # only the table, from the JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from qkv.bench import write_json_atomic

KINDS = ("exact", "linear", "performer", "local")
# LRA paper, Table 1 (full 500-2000 lengths, the released 4-layer config): test accuracy, %
LRA_PAPER = {"exact": 36.37, "linear": 16.13, "performer": 18.01, "local": 15.82}
RESULTS = Path("benchmarks/results")
SMOOTH = 50


def run_kind(kind: str, out: Path, qkv: str) -> dict:
    """Train ``kind`` unless done; return its metrics and wall time."""
    run_dir, wall_file = out / kind, out / kind / "wall.json"
    metrics_file = run_dir / "metrics.json"
    done = metrics_file.exists() and "evaluation" in json.loads(metrics_file.read_text())
    if not (done and wall_file.exists()):
        resume = (run_dir / "checkpoint.pt").exists()
        cmd = [qkv, "train", "listops", "--attention", kind, "--out", str(run_dir)]
        print(f"$ {' '.join(cmd)}{' --resume' if resume else ''}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        subprocess.run(
            cmd + (["--resume"] if resume else []), check=True, stdout=subprocess.DEVNULL
        )
        wall = dict(
            wall_s=round(time.perf_counter() - t0, 1), resumed=resume, command=" ".join(cmd)
        )
        write_json_atomic(wall_file, wall)
    metrics = json.loads(metrics_file.read_text())
    return dict(
        kind=kind,
        **json.loads(wall_file.read_text()),
        accuracy=metrics["evaluation"]["accuracy"],
        test_examples=metrics["evaluation"]["test_examples"],
        final_loss=metrics["final_loss"],
        steps=metrics["step"],
        losses=[round(h["loss"], 4) for h in metrics["history"]],
        picture=str(run_dir / "attention_last_layer.png"),
    )


def majority_share() -> float:
    """The share of the test split's most frequent label: what always guessing it scores."""
    import torch

    import qkv

    labels = qkv.tasks.load("listops", split="test", variant="cpu").labels
    return float(torch.bincount(labels).max()) / len(labels)


def plot(results: list[dict], majority: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        loss = torch.tensor(r["losses"])[None, None]  # (1, 1, steps)
        smooth = torch.nn.functional.avg_pool1d(loss, SMOOTH, stride=1)[0, 0]
        left.plot(range(SMOOTH, SMOOTH + len(smooth)), smooth, label=r["kind"])
    left.set(
        xlabel="step",
        ylabel=f"training loss ({SMOOTH}-step mean)",
        title="ListOps (cpu variant, lengths 100-500): training",
    )
    left.legend()
    names = [r["kind"] for r in results]
    bars = right.bar(names, [100 * r["accuracy"] for r in results], color="tab:blue")
    right.bar_label(bars, fmt="%.1f")
    right.axhline(100 * majority, color="gray", ls="--", label=f"majority {100 * majority:.1f}%")
    right.set(
        ylabel="test accuracy, %",
        ylim=(0, 50),
        title=f"test accuracy ({results[0]['test_examples']} examples)",
    )
    right.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report: dict) -> str:
    rows = [
        "| `--attention` | test accuracy | final loss | wall time | LRA paper (full lengths) |",
        "|:---|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        wall = f"{r['wall_s']:.0f} s" + (" (resumed part)" if r["resumed"] else "")
        rows.append(
            f"| {r['kind']} | **{100 * r['accuracy']:.1f}%** | {r['final_loss']:.3f} | "
            f"{wall} | {LRA_PAPER[r['kind']]:.2f}% |"
        )
    return "\n".join(
        rows + ["", f"Majority class of the test split: {100 * report['majority']:.1f}%."]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument(
        "--out",
        type=Path,
        default=Path("out/listops_cpu"),
        help="the runs' folders (default out/listops_cpu)",
    )
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--report", action="store_true", help="print the table from the JSON")
    a = p.parse_args(argv)
    json_path = a.results / "listops_cpu.json"
    if a.report:
        print(markdown(json.loads(json_path.read_text())))
        return 0
    qkv = str(Path(sys.executable).with_name("qkv"))
    results = [run_kind(k, a.out, qkv) for k in a.kinds]
    report = dict(majority=majority_share(), results=results)
    write_json_atomic(json_path, report)
    plot(results, report["majority"], a.results / "listops_cpu.png")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
