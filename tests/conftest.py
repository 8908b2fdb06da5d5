"""Shared helpers for the qkv test suite.

``QKV_TEST_DEVICE=cuda pytest`` runs the whole suite with CUDA as torch's default device (tensors
the tests make land there, and so do generators they make without a device); unset, or ``cpu``,
nothing changes. tests/test_cuda.py holds the CUDA tests that name the device themselves.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from routes import ROUTES, force_route

TEST_DEVICE = os.environ.get("QKV_TEST_DEVICE", "cpu")

# auto's choice by measurement (qkv.autotune) is off for the suite unless asked for: timing
# noise would then pick among backends run to run, and tests that name what auto picks would
# follow the machine's load. tests/test_autotune.py turns it on with a fake clock; every
# backend is held to the float64 reference by name. Choices are kept in a fresh folder, never
# the user's ~/.cache.
os.environ.setdefault("QKV_AUTOTUNE", "off")
os.environ.setdefault("QKV_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-test-cache-"))


class _DefaultDeviceGenerator(torch.Generator):
    """``torch.Generator()`` on the test device, so that ``torch.randn(..., generator=g)``
    draws where the default device puts the tensor (a CPU generator there raises)."""

    def __new__(cls, device=None):  # (not torch.Generator.__new__: that name is this class now)
        return super().__new__(cls, device=TEST_DEVICE if device is None else device)


def pytest_runtest_logreport(report):
    """With ``QKV_TEST_FAILLOG=path``, each failure's id and last lines are appended as it
    happens (a run cut short by a time limit still says why its tests failed)."""
    path = os.environ.get("QKV_TEST_FAILLOG")
    if path and report.failed:
        tail = "\n    ".join(report.longreprtext.strip().splitlines()[-4:])
        with open(path, "a") as f:
            f.write(f"{report.nodeid} [{report.when}]\n    {tail}\n")


def pytest_configure(config):
    if TEST_DEVICE == "cpu":
        return
    if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"QKV_TEST_DEVICE={TEST_DEVICE} but torch.cuda.is_available() is False"
        )
    torch.set_default_device(TEST_DEVICE)
    torch.Generator = _DefaultDeviceGenerator


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


@pytest.fixture(params=list(ROUTES))
def cpu_route(request, monkeypatch):
    """Each route the machine could pick (tests/routes.py), forced: a test that takes this
    fixture runs on every route, whatever this machine would pick."""
    force_route(monkeypatch, request.param)
    return request.param


@pytest.fixture
def ways(monkeypatch):
    """Count the fused bfloat16 kernel's calls (``bf16_scores.attend_kernel``) and the tiled
    plan's (``tiled_attention``) from here on: which way the tiled backend took."""
    from qkv.ops import bf16_scores
    from qkv.ops.tiled import backend as tiled_backend

    seen = {"kernel": 0, "plan": 0}
    kernel, plan = bf16_scores.attend_kernel, tiled_backend.tiled_attention

    def counted_kernel(*args, **kwargs):
        seen["kernel"] += 1
        return kernel(*args, **kwargs)

    def counted_plan(*args, **kwargs):
        seen["plan"] += 1
        return plan(*args, **kwargs)

    monkeypatch.setattr(bf16_scores, "attend_kernel", counted_kernel)
    monkeypatch.setattr(tiled_backend, "tiled_attention", counted_plan)
    return seen


class TimedWays:
    """The fused kernel's calls and the plan's counted (``runs``) and each charged
    ``costs[way]`` seconds on a fake clock (``now``) that the route's measurement reads."""

    def __init__(self) -> None:
        self.now = 0.0
        self.costs = {"kernel": 1.0, "plan": 3.0}
        self.runs = {"kernel": 0, "plan": 0}


@pytest.fixture
def timed_ways(monkeypatch) -> TimedWays:
    """The tiled backend's two ways on a fake clock (:class:`TimedWays`): the measurement of a
    kind's way (``qkv.ops.tiled.route``) takes the way whose ``costs`` are lower."""
    from qkv.ops import bf16_scores
    from qkv.ops.tiled import backend as tiled_backend
    from qkv.ops.tiled import route

    ways = TimedWays()

    def timed(way, fn):
        def run(*args, **kwargs):
            ways.runs[way] += 1
            ways.now += ways.costs[way]
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(route, "_clock", lambda: ways.now)
    monkeypatch.setattr(bf16_scores, "attend_kernel", timed("kernel", bf16_scores.attend_kernel))
    monkeypatch.setattr(
        tiled_backend, "tiled_attention", timed("plan", tiled_backend.tiled_attention)
    )
    return ways
