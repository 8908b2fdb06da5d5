"""The hook through which ``qkv.capture`` sees attention calls.

``qkv.scaled_dot_product_attention`` (and ``qkv.linear_attention``, ``qkv.deformable_attention``
and ``qkv.nn.MultiScaleDeformableAttention``) ask :func:`wanted` on every call. With no
recorder active that costs one ``ContextVar.get``; a recorder that does not want the call (a
layer nobody asked for) answers None, and the call runs exactly as it would uncaptured,
without forming a trace. When it is wanted, the call runs with
``return_trace=True`` under :func:`paused` (so the inner call is not recorded again), the
trace goes to the function :func:`wanted` returned, and the caller gets what it asked for.

A ``ContextVar`` rather than a global: a recorder sees the calls of its own thread (and of
asyncio tasks started inside it), never another thread's. Recorders nest: while one is
active, a second started inside it is asked too (each answers for the calls it wants).

This module sits at layer 0 (it imports only torch and the trace): the functional API
imports it, and ``qkv.capture`` (layer 5) builds on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar, Token

import torch

from .trace import AttentionTrace, DeformableTrace

__all__ = ["Recorder", "TraceSink", "paused", "start", "stop", "wanted"]

# A deformable attention call (qkv.nn.MultiScaleDeformableAttention, qkv.deformable_attention)
# hands over its DeformableTrace, every other call its AttentionTrace.
TraceSink = Callable[[AttentionTrace | DeformableTrace], None]


class Recorder:
    """Takes the traces of the attention calls it wants (subclassed by ``qkv.capture``)."""

    def want(self) -> TraceSink | None:
        """Called at the start of every attention call while active: None to let the call
        run untraced, or a function that takes its trace (called once, after the call)."""
        raise NotImplementedError


class _Both(Recorder):
    """Two active recorders, the outer one started first; each answers for itself."""

    def __init__(self, outer: Recorder, inner: Recorder) -> None:
        self.outer, self.inner = outer, inner

    def want(self) -> TraceSink | None:
        a, b = self.outer.want(), self.inner.want()
        if a is None or b is None:
            return a if b is None else b

        def both(trace: AttentionTrace | DeformableTrace) -> None:
            a(trace)
            b(trace)

        return both


_ACTIVE: ContextVar[Recorder | None] = ContextVar("qkv_recorder", default=None)
_LOCK = threading.Lock()
_STARTED = [0]  # recorders started and not yet stopped, in all threads together
# What torch.compile reads instead of the ContextVar (which it cannot trace): the recorder
# made active by the last start() or stop() in any thread, and the depth of paused() blocks
# being traced. A compiled call sees the capture of the thread that last entered or left one.
_LATEST: list[Recorder | None] = [None]
_PAUSED_IN_GRAPH = [0]


def wanted() -> TraceSink | None:
    """Where the trace of the attention call now starting should go; None (almost always)
    when no recorder wants it."""
    if not _STARTED[0]:  # no recorder in any thread: no ContextVar to read (torch.compile
        return None  # cannot trace ContextVar.get, and reads this count as a constant)
    if torch.compiler.is_compiling():
        recorder = None if _PAUSED_IN_GRAPH[0] else _LATEST[0]
    else:
        recorder = _ACTIVE.get()
    return None if recorder is None else recorder.want()


def start(recorder: Recorder) -> Token:
    """Make ``recorder`` active in this context (beside any active one); pass the token
    back to :func:`stop`."""
    outer = _ACTIVE.get()
    token = _ACTIVE.set(recorder if outer is None else _Both(outer, recorder))
    with _LOCK:
        _STARTED[0] += 1
        _LATEST[0] = _ACTIVE.get()
    return token


def stop(token: Token) -> None:
    """Undo the :func:`start` that gave ``token``: the recorders active before it are again."""
    _ACTIVE.reset(token)
    with _LOCK:
        _STARTED[0] -= 1
        _LATEST[0] = _ACTIVE.get() if _STARTED[0] else None


class paused:
    """Within it no recorder is asked: the traced inner call of a wanted call runs here."""

    def __enter__(self) -> None:
        if torch.compiler.is_compiling():
            _PAUSED_IN_GRAPH[0] += 1
        else:
            self._token = _ACTIVE.set(None)

    def __exit__(self, *exc) -> None:
        if torch.compiler.is_compiling():
            _PAUSED_IN_GRAPH[0] -= 1
        else:
            _ACTIVE.reset(self._token)
