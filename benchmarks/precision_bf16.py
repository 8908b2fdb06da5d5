"""bfloat16 errors of the tiled and torch backends at realistic sizes, as ratios to the
reference's own error (the tolerance policy's measure: at most 2 for the output, 3 for the
gradients).

The long property profile finds bfloat16 calls of a few rows and keys where torch's CPU flash
kernel (which rounds P before P @ V and its output, and takes the backward's
delta = rowsum(dO * O) from the rounded output) is several times the reference's error
(benchmarks/RESULTS.md). This prints the same ratios on calls of model sizes: B=2, H=4,
causal and three documents, forward and backward against a float64 golden on the same bf16
inputs.

Usage:
    PYTHONPATH=src python benchmarks/precision_bf16.py
"""

from __future__ import annotations

import torch

import qkv

SIZES = ((64, 4, "causal"), (256, 16, "causal"), (256, 64, "causal"), (1024, 64, "causal"))
SIZES += ((1024, 64, "documents"),)


def _error(a: torch.Tensor, golden: torch.Tensor) -> float:
    return float((a.double() - golden).abs().max())


def _run(backend: str, dtype: torch.dtype, inputs, dout, mask_mod) -> list[torch.Tensor]:
    """Output and gradients of q, k and v."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = qkv.scaled_dot_product_attention(*leaves, mask_mod=mask_mod, backend=backend)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]


def main() -> None:
    print("T, D, mask, backend: error / the bf16 reference's error, for out, dq, dk, dv")
    for T, D, name in SIZES:
        g = torch.Generator().manual_seed(T + D)
        q, k, v, dout = (torch.randn(2, 4, T, D, generator=g).bfloat16() for _ in range(4))
        ids = (torch.arange(T) // (T // 3 + 1)).expand(2, T)  # three documents
        mod = qkv.masks.causal() if name == "causal" else qkv.masks.document(ids)
        golden = _run("reference", torch.float64, (q, k, v), dout, mod)
        baseline = _run("reference", torch.bfloat16, (q, k, v), dout, mod)
        for backend in ("tiled", "torch"):
            got = _run(backend, torch.bfloat16, (q, k, v), dout, mod)
            ratios = [
                _error(a, g0) / max(_error(b, g0), 1e-30) for a, b, g0 in zip(got, baseline, golden)
            ]
            print(f"T={T} D={D} {name} {backend}: " + " ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
