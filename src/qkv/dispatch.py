"""The one dispatcher: a registry of backends and the choice among them.

``backend="auto"`` takes the backend of lowest ``priority`` (the fastest) whose
``supports(call)`` is None. A backend named by the caller that cannot take the call raises
``BackendUnsupportedError`` with its reason; nothing falls back silently.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""
from __future__ import annotations

import dataclasses

import torch

from .ops import (AttentionCall, Backend, BackendUnsupportedError, ReferenceBackend, TiledBackend,
                  TorchBackend)
from .ops.reference import attention_scores, attention_scores_at
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
    """The trace of a backend that gives no weights: ``exp(scores - lse)``, recomputed.

    With the backend's log-sum-exp the trace is lazy: the weights are computed when first
    read, in one ``(*batch, T, S)`` buffer in the inputs' dtype, and ``trace.select`` computes
    only the rows asked for. Reading after the inputs were modified in place raises. Without
    it, the lse comes from the scores (in at least float32) and the weights are computed now.
    A backend's lse must be -inf on rows with no key.
    """
    call = dataclasses.replace(call, query=call.query.detach(), key=call.key.detach(),
                               value=call.value.detach())
    if lse is None:
        probs = attention_scores(call)  # (*batch, T, S), scores for now
        wide = probs if probs.dtype == torch.float64 else probs.float()
        lse = torch.logsumexp(wide, dim=-1)  # (*batch, T); -inf for a row with no key
        return AttentionTrace(_recompute(call, lambda: attention_scores(call)), probs_from_lse_(probs, lse), lse,
                              backend)
    lse = lse.detach()

    def probs() -> Tensor:
        return probs_from_lse_(attention_scores(call), lse)  # (*batch, T, S)

    def subset(b, h, rows):
        scores = attention_scores_at(call, b, h, rows)  # (nb, nh, nr, S)
        picked = lse.reshape(call.BH + (call.T,))[b][:, h][:, :, rows]  # (nb, nh, nr)
        return scores, probs_from_lse_(scores.clone(), picked)

    return AttentionTrace(_recompute(call, lambda: attention_scores(call)), _recompute(call, probs), lse,
                          backend, subset=_recompute(call, subset))


def _recompute(call: AttentionCall, fn):
    """``fn`` run without grad, refusing when the call's inputs changed in place since."""
    versions = _versions(call)

    def run(*args):
        if _versions(call) != versions:
            raise RuntimeError(
                "the inputs of this attention call (query, key, value, attn_mask or a tensor "
                "its mask_mod/score_mod reads) were modified in place after it ran, so its "
                "weights can no longer be recomputed; read trace.probs (or trace.select(...)) "
                "before changing them, or pass copies"
            )
        with torch.no_grad():
            return fn(*args)
    return run


def _versions(call: AttentionCall) -> tuple[int, ...]:
    """Version counters of the call's inputs, to notice changes in place: query, key,
    value, attn_mask, and the tensors its mask_mod and score_mod read (ALiBi slopes, lengths,
    document ids, tensors a plain function captured).

    Inference tensors (made under ``torch.inference_mode()``) have no counter, so they are
    skipped: outside inference mode they cannot be changed in place at all; a change inside
    it goes unnoticed (torch keeps no record of it to check).
    """
    tensors = [call.query, call.key, call.value, call.attn_mask]
    for mod in (call.mask_mod, call.score_mod):
        if mod is not None:
            tensors.extend(mod.tensors())
    return tuple(t._version for t in tensors if t is not None and not t.is_inference())


register_backend(TorchBackend())
register_backend(TiledBackend())
register_backend(ReferenceBackend())
