"""bfloat16 inference of ranges of keys: the fused kernel or the tiled plan, by measurement.

The tiled backend has two ways to run a bfloat16 call without gradient whose rows attend
ranges of keys (causal, windows, key lengths, documents, prefix LM: ``reference.bf16_fusable``):
the fused kernel (``ops/bf16_scores.py``, one pass per head and block of rows, three bfloat16
GEMMs: the weights' remainder kept) and the plan (``plan.py``: whole blocks by torch's CPU flash
kernel, causal diagonals by its own ``is_causal``, a padded batch cut by element). Which is
faster depends on the machine and the mask. On the AMX Xeon (B=4, H=8, T=2048, D=64, two
threads) the kernel ran a window of 256 in 18 ms against the plan's 36, and a window of 128
within documents in 16 against 22; the plan ran causal with key lengths in 35 ms against 47,
documents per batch element in 28 against 34, and plain causal in 42 against 58.

So each kind of call (``ops/kinds.py``) takes the way measured faster on its first call, as
whole calls of the tiled backend (the NaN/inf contract's passes included: the kernel keeps the
contract itself, the plan is guarded); the verdict is kept for the process and on disk.
``QKV_BF16_RANGES`` (``kernel`` or ``plan``) forces one; with measuring off
(``QKV_AUTOTUNE=off``) or under tracing, the kernel, as before the measurement.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ... import _measured
from ..call import AttentionCall
from ..kinds import call_kind

__all__ = ["RANGES", "SWITCH", "choice", "kernel_runs", "measuring", "time_whole_calls", "tune"]

SWITCH = "QKV_BF16_RANGES"


def kernel_runs(call: AttentionCall, run: Callable[[AttentionCall, str], object]) -> bool:
    """Whether the fused kernel runs ``call`` (a call the kernel can take), else the plan.
    ``run(call, way)``: the tiled backend's run of ``call`` held to ``way`` (timed where no
    whole call is set). The hot path after a kind's first call: an environment read, the
    kind's key and a dict lookup."""
    held = getattr(_HERE, "route", None)
    if held is not None:  # a timed call of this kind's measurement
        return held == "kernel"
    _CALL.now = (call, run)  # (what a measurement times: read only when the kind is new)
    try:
        return RANGES.route(call_kind(call)) == "kernel"
    finally:
        _CALL.now = None


def measuring() -> bool:
    """Whether this thread is timing a way of a kind's first call (:func:`kernel_runs` held to
    one way): the calls made meanwhile are the measurement's, and nothing is kept of them."""
    return getattr(_HERE, "route", None) is not None


def choice(call: AttentionCall) -> _measured.Choice:
    """The way ``call``'s kind takes and why (forced, measured with the times, read from disk,
    or the kernel without a measurement); runs nothing. What ``dispatch.explain`` shows."""
    return RANGES.choice(call_kind(call), measure=False)


def tune(call: AttentionCall, run: Callable[[AttentionCall, str], object]) -> _measured.Choice:
    """Measure both ways on ``call`` afresh, whatever is kept (``qkv tune``), and keep the
    faster for its kind, in this process and on disk (a forcing switch still holds this
    process's calls). ``run`` as in :func:`kernel_runs`."""
    _CALL.now = (call, run)
    try:
        return RANGES.choice(call_kind(call), fresh=True)
    finally:
        _CALL.now = None


# --- the measurement ------------------------------------------------------------------------

_ROUNDS, _BUDGET_S = 5, 0.05  # timed runs of each way: 2 to 5, within about 50 ms
_clock = _measured.clock  # (tests replace it with a fake clock)

_HERE = threading.local()  # .route: the way this thread's timed call is held to
_CALL = threading.local()  # .now: (call, run) of the call being decided (measure's input)

# ``qkv.functional``'s whole call of one backend (``whole(call, name)``), set by that module when
# it loads (it sits above this one): what is timed. None (this module alone): the backend's run.
_WHOLE_CALL: list[Callable[[AttentionCall, str], object] | None] = [None]


def time_whole_calls(whole: Callable[[AttentionCall, str], object]) -> None:
    """Time each way as ``whole(call, "tiled")`` with the way held (see the module's notes)."""
    _WHOLE_CALL[0] = whole


def _measure(key: str) -> dict[str, float]:
    """Seconds per call of each way on the call being decided (:func:`kernel_runs`'s)."""
    call, run = _CALL.now
    whole = _WHOLE_CALL[0]

    def way(name: str) -> Callable[[], object]:
        def timed() -> object:
            _HERE.route = name
            try:
                return whole(call, "tiled") if whole is not None else run(call, name)
            finally:
                _HERE.route = None

        return timed

    runners = {"kernel": way("kernel"), "plan": way("plan")}
    return _measured.time_each(runners, rounds=_ROUNDS, budget_s=_BUDGET_S, clock=_clock)


RANGES = _measured.MeasuredRoute(
    "bf16_ranges",
    ("kernel", "plan"),
    SWITCH,
    static=lambda: "kernel",
    rule=lambda route: "the fused kernel, the way without a measurement",
    measure=_measure,
)
