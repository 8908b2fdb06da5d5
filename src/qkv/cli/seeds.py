"""``qkv seeds``: the seeds' worked examples through every backend, checked to the digit."""

from __future__ import annotations

import argparse

import torch

from ..dispatch import backend_names, get_backend
from ..examples import EXAMPLES, SeedExample
from ..functional import scaled_dot_product_attention
from ..ops import AttentionCall
from .tables import format_matrix

__all__ = ["add_parser", "run_seeds"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "seeds",
        help="run the seeds' worked examples through every backend",
        description="Compute the worked examples of the seed documents (SEEDS.md 5a, 5b) "
        "with qkv.scaled_dot_product_attention on each backend, print the numbers and check "
        "them against the exact values. Exit 1 if any backend is off by more than 5e-7.",
    )
    p.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        action="append",
        help="example to run (repeatable; default: all)",
    )
    p.add_argument("--backend", action="append", help="backend to use (repeatable; default: all)")
    p.set_defaults(func=lambda a: run_seeds(a.example or list(EXAMPLES), a.backend))


def run_seeds(examples: list[str], backends: list[str] | None = None, tol: float = 5e-7) -> int:
    """Print each example's steps and each backend's error; 0 if all are within ``tol``."""
    named = bool(backends)  # a backend asked for by name must run; of all, those that can
    backends = backends or backend_names()
    worst = 0.0
    for name in examples:
        worst = max(worst, _run_one(EXAMPLES[name], backends, named))
    verdict = "OK" if worst <= tol else "MISMATCH"
    print(f"{verdict}: largest difference from the exact values {worst:.2e} (tolerance {tol:g})")
    return 0 if worst <= tol else 1


def _run_one(ex: SeedExample, backends: list[str], named: bool = True) -> float:
    t = ex.tensors(torch.float64)
    q, k, v = t["x"] @ t["w_q"], t["x"] @ t["w_k"], t["x"] @ t["w_v"]  # (T, D), (T, D), (T, Dv)
    tokens = [f"x{i + 1}" for i in range(q.shape[0])]
    print(f"== {ex.title} (scale {ex.resolved_scale():.6g})")
    for title, m in (("Q = x W_Q", q), ("K = x W_K", k), ("V = x W_V", v)):
        print(format_matrix(title, m, tokens), end="\n\n")
    worst = 0.0
    if not named:  # all backends: those that cannot take this call say why and are left out
        call = AttentionCall.build(q, k, v, scale=ex.resolved_scale(), return_trace=True)
        reasons = {b: get_backend(b).supports(call) for b in backends}
        for b, why in reasons.items():
            if why is not None:
                print(f"backend {b:<10} not run here: {why}")
        backends = [b for b in backends if reasons[b] is None]
    for b in backends:
        out, trace = scaled_dot_product_attention(
            q, k, v, scale=ex.resolved_scale(), backend=b, return_trace=True
        )
        got = {"scores": trace.scores, "probs": trace.probs, "outputs": out}
        errors = {
            key: float((got[key] - torch.tensor(want, dtype=torch.float64)).abs().max())
            for key, want in ex.expected.items()
        }
        worst = max([worst, *errors.values()])
        if b == backends[0]:
            print(format_matrix("scores (scaled, before softmax)", trace.scores, tokens, tokens))
            print()
            print(format_matrix("weights = softmax(scores)", trace.probs, tokens, tokens))
            print()
            print(format_matrix("outputs = weights V", out, tokens))
            print()
        diffs = ", ".join(f"{key} {e:.1e}" for key, e in errors.items())
        print(f"backend {b:<10} max |qkv - exact|: {diffs}")
    if ex.note:
        print(f"note: {ex.note}")
    print()
    return worst
