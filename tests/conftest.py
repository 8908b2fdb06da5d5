"""Shared helpers for the qkv test suite."""
from __future__ import annotations

import pytest
import torch

BACKENDS = ["reference", "torch", "tiled", "auto"]
DROPOUT_BACKENDS = [b for b in BACKENDS if b != "tiled"]  # tiled refuses dropout (test_tiled.py)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rand(*shape, dtype=torch.float64, requires_grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(requires_grad)


def make_mask(kind: str, B: int, H: int, T: int, S: int, dtype=torch.float64, p_keep=0.7):
    """A mask of the named kind; None for 'none'/'causal' (causal is a flag, not a mask)."""
    if kind in ("none", "causal"):
        return None
    if kind == "bool-TS":
        return torch.rand(T, S) < p_keep
    if kind == "bool-keypad":  # (B, 1, 1, S): True marks a real key
        lengths = torch.randint(1, S + 1, (B,))
        return (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    if kind == "float-BHTS":
        m = torch.randn(B, H, T, S, dtype=dtype)
        return m.masked_fill(torch.rand(B, H, T, S) > p_keep, float("-inf"))
    raise ValueError(kind)
