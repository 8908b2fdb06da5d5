"""What ``qkv tune`` runs: ``auto``'s choice measured ahead of time over a grid of calls, and
the CPU routes' choices (``qkv.ops.cpu_isa``: native or float32 half GEMMs, per half dtype;
``qkv.ops.bf16_scores``: the bfloat16 kernel's GEMM, where two run).

Each configuration (case x dtype x length, on one device) becomes a call on random inputs,
and :func:`qkv.dispatch.tune` times every backend that can take it, those that compile on
first use (``flex``) included, and keeps the fastest on disk for calls of that kind
(``qkv.autotune``). A later process on the same machine then starts with those choices.

Shape alphabet: B batch, H heads, T query length (= S), D head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from .. import dispatch, masks
from ..ops import AttentionCall, bf16_scores, cpu_isa
from .specs import document_ids

__all__ = ["TUNE_CASES", "tune_grid", "tune_routes"]

TUNE_CASES = ("none", "causal", "window", "document")


def _case_kwargs(case: str, T: int, device) -> dict:
    if case == "none":
        return {}
    if case == "causal":
        return dict(is_causal=True)
    if case == "window":
        return dict(mask_mod=masks.sliding_window(256))
    if case == "document":
        return dict(mask_mod=masks.document(document_ids(T).to(device)))
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(TUNE_CASES)}")


def tune_grid(
    *,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    lengths: tuple[int, ...] = (1024, 4096),
    cases: tuple[str, ...] = TUNE_CASES,
    B: int = 1,
    H: int = 8,
    D: int = 64,
    grad: bool = False,
    progress: Callable[[dict], None] | None = None,
) -> Iterator[dict]:
    """Measure each configuration and keep its fastest backend; yield one row per
    configuration: ``{case, dtype, T, backend, times, way}`` (seconds per call; ``way``: how
    the backend runs it where a measured route of its own decides, else None), or with
    ``reason`` when fewer than two backends can take it."""
    dev = torch.device(device)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for T in lengths:
            for case in cases:
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v = (
                    torch.randn(B, H, T, D, generator=g, device=dev, dtype=dtype).requires_grad_(
                        grad
                    )
                    for _ in range(3)
                )
                call = AttentionCall.build(q, k, v, **_case_kwargs(case, T, dev))
                row: dict = dict(case=case, dtype=dtype_name, T=T, device=device)
                with torch.set_grad_enabled(grad):
                    choice = dispatch.tune(call)
                able = [n for n, r in dispatch.check_backends(call).items() if r is None]
                if choice is None:
                    row.update(backend=None, reason=f"only {', '.join(able)} can take it")
                else:
                    row.update(backend=choice.backend, times=choice.times)
                runs = able[0] if choice is None and len(able) == 1 else row["backend"]
                with torch.set_grad_enabled(grad):  # (its way, measured by dispatch.tune)
                    row["way"] = None if runs is None else dispatch.way(call, runs)
                if progress is not None:
                    progress(row)
                yield row


def tune_routes(progress: Callable[[dict], None] | None = None) -> Iterator[dict]:
    """Measure each CPU route choice and keep it (in this process and on disk, where later
    processes read it); yield one row per choice: ``{choice, route, times, reason}``, with
    ``forced`` naming what the switch ``switch`` (``QKV_CPU_HALF_GEMM``, ``QKV_BF16_GEMM``)
    holds this process to, if set."""
    for dtype, one_row in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        choice = cpu_isa.half_gemm_choice(dtype, fresh=True, one_row=one_row)
        name = str(dtype).removeprefix("torch.") + (", one row" if one_row else "")
        row: dict = dict(choice=f"half GEMM {name}", route=choice.route, times=choice.times)
        row["reason"] = choice.reason()
        held = cpu_isa.half_gemm_choice(dtype, measure=False, one_row=one_row)
        if held.source == "forced":
            row.update(forced=held.route, switch=cpu_isa.HALF_GEMM_SWITCH)
        if progress is not None:
            progress(row)
        yield row
    gemm = bf16_scores.gemm_choice(fresh=True)
    row = dict(choice="bfloat16 kernel GEMM", route=gemm.route, times=gemm.times)
    row["reason"] = gemm.reason()
    forced = bf16_scores.forced_gemm()
    if forced is not None:
        row.update(forced=forced, switch=bf16_scores.GEMM_SWITCH)
    if progress is not None:
        progress(row)
    yield row
