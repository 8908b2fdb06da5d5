"""The one dispatcher: a registry of backends and the choice among them.

``backend="auto"`` takes the backend of lowest ``priority`` (the fastest) whose
``supports(call)`` is None. A backend named by the caller that cannot take the call raises
``BackendUnsupportedError`` with its reason; nothing falls back silently.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""
from __future__ import annotations

import torch

from .ops import (AttentionCall, Backend, BackendUnsupportedError, ReferenceBackend, TiledBackend,
                  TorchBackend)
from .ops.reference import attention_scores
from .trace import AttentionTrace, probs_from_lse_

__all__ = ["register_backend", "unregister_backend", "backend_names", "get_backend", "check_backends", "select", "run"]

_REGISTRY: dict[str, Backend] = {}
_ORDER: list[Backend] = []  # fastest first; rebuilt on registration (auto walks it every call)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend to the registry under ``backend.name``."""
    if backend.name == "auto":
        raise ValueError("'auto' is the dispatcher's own choice; name the backend otherwise")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    _ORDER[:] = sorted(_REGISTRY.values(), key=lambda b: b.priority)


def unregister_backend(name: str) -> Backend:
    """Remove the backend registered as ``name`` and return it."""
    backend = get_backend(name)
    del _REGISTRY[name]
    _ORDER.remove(backend)
    return backend


def backend_names() -> list[str]:
    """Registered backends, fastest first (the order ``auto`` tries them in)."""
    return [b.name for b in _ORDER]


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ValueError listing the names otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"unknown backend {name!r}; choose 'auto' or one of {', '.join(backend_names())}"
        )
    return _REGISTRY[name]


def check_backends(call: AttentionCall) -> dict[str, str | None]:
    """Each backend's answer to ``supports(call)``, fastest first: None means it can."""
    return {name: _REGISTRY[name].supports(call) for name in backend_names()}


def select(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that will run ``call``."""
    if backend == "auto":
        for candidate in _ORDER:
            if candidate.supports(call) is None:
                return candidate
        reasons = "; ".join(f"{n}: {r}" for n, r in check_backends(call).items())
        raise BackendUnsupportedError(f"no backend can take this call ({reasons})")
    chosen = get_backend(backend)
    reason = chosen.supports(call)
    if reason is not None:
        able = [n for n, r in check_backends(call).items() if r is None]
        raise BackendUnsupportedError(
            f"backend {backend!r} cannot take this call: {reason}. "
            f"Backends that can: {', '.join(able) or 'none'}; or pass backend='auto'"
        )
    return chosen


def run(call: AttentionCall, backend: str = "auto"):
    """Run ``call``; return the output, or ``(output, AttentionTrace)`` if it asks for one.

    Shape:
        output ``(*batch, T, Dv)``.
    """
    chosen = select(call, backend)
    result = chosen.run(call)
    if not call.return_trace:
        return result.out
    if result.probs is not None:
        parts = (result.scores.detach(), result.probs.detach(), result.lse.detach())
        trace = AttentionTrace(*parts, chosen.name)
    else:
        with torch.no_grad():
            trace = _trace_from_lse(call, result.lse, chosen.name)
    return result.out, trace


def _trace_from_lse(call: AttentionCall, lse, backend: str) -> AttentionTrace:
    """Weights recomputed as ``exp(scores - lse)`` for a backend that gives no weights.

    Builds one ``(*batch, T, S)`` buffer, in the inputs' dtype: the scores are computed into it
    and turned into the weights in place; ``trace.scores`` recomputes them when first read.
    When the backend gave no log-sum-exp, it is taken from the scores (in at least float32).
    A backend's lse must be -inf on rows with no key.
    """
    probs = attention_scores(call)  # (*batch, T, S), scores for now
    if lse is None:
        wide = probs if probs.dtype == torch.float64 else probs.float()
        lse = torch.logsumexp(wide, dim=-1)  # (*batch, T); -inf for a row with no key
    probs = probs_from_lse_(probs, lse)  # (*batch, T, S)

    def scores():
        with torch.no_grad():
            return attention_scores(call)

    return AttentionTrace(scores, probs, lse, backend)


register_backend(TorchBackend())
register_backend(TiledBackend())
register_backend(ReferenceBackend())
