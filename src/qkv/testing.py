"""The tolerance policy of qkv, for its own tests and for anyone testing a kernel of theirs.

For a kernel under test in dtype ``dt``:
    golden   = the reference computed in float64 (float32 for half types on a GPU),
    baseline = the reference computed in ``dt``.
Require ``max|out - golden| <= F * max|baseline - golden| + atol`` with F = 2 for outputs and
3 for gradients (FlashAttention's rule), and no NaN where the golden has none. The kernel may
be at most F times as wrong as plain math in the same dtype: the bound follows the dtype,
never a constant picked until a test goes green.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ATOL", "GRAD_FACTOR", "OUTPUT_FACTOR", "assert_tolerance", "golden_dtype", "max_error"]

OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
ATOL = 1e-5


def golden_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype to compute the golden result in: float64, or float32 for GPU half types."""
    half = dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if half and torch.device(device).type != "cpu" else torch.float64


def max_error(actual: Tensor, golden: Tensor) -> float:
    """``max|actual - golden|``, counting equal infinities as 0 and a NaN as infinite error."""
    a, g = actual.detach().double(), golden.detach().double()
    if a.shape != g.shape:
        raise AssertionError(f"shape {tuple(a.shape)} differs from golden {tuple(g.shape)}")
    if a.numel() == 0:
        return 0.0
    diff = torch.where(a == g, 0.0, (a - g).abs())  # inf - inf would be NaN
    diff = torch.where(torch.isnan(a) & torch.isnan(g), 0.0, diff)
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def assert_tolerance(
    actual: Tensor,
    golden: Tensor,
    baseline: Tensor,
    *,
    factor: float = OUTPUT_FACTOR,
    atol: float = ATOL,
    name: str = "output",
) -> None:
    """Raise AssertionError unless ``actual`` is within the tolerance policy.

    Args:
        actual: The kernel's result in dtype ``dt``.
        golden: The reference's result in :func:`golden_dtype`.
        baseline: The reference's result in ``dt``.
        factor: ``OUTPUT_FACTOR`` (2) for outputs, ``GRAD_FACTOR`` (3) for gradients.
        atol: Absolute slack for results the baseline gets exactly right.
        name: What is compared, for the message.
    """
    nan_where_golden_fine = torch.isnan(actual.detach()) & ~torch.isnan(golden.detach())
    if bool(nan_where_golden_fine.any()):
        where = tuple(nan_where_golden_fine.nonzero()[0].tolist())
        raise AssertionError(f"{name}: NaN at {where} where the golden is {golden[where].item()}")
    err, base = max_error(actual, golden), max_error(baseline, golden)
    bound = factor * base + atol
    if not err <= bound:
        raise AssertionError(
            f"{name}: max|out - golden| = {err:.3e} exceeds {factor:g} * max|baseline - golden| "
            f"({base:.3e}) + {atol:g} = {bound:.3e} (dtype {actual.dtype})"
        )
