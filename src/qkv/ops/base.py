"""What a backend is: a name, a priority, ``supports(call) -> None | reason`` and ``run(call)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .._measured import cannot_time, tracing
from .call import AttentionCall

__all__ = [
    "Backend",
    "BackendResult",
    "BackendUnsupportedError",
    "cannot_time",
    "refuse_second_derivative",
    "tracing",
]


def refuse_second_derivative(what: str, instead: str) -> None:
    """Raise in an autograd Function's backward asked for a graph (``create_graph=True``)
    that it cannot build. ``once_differentiable`` is not enough: its gradients hang from a
    node that raises only when reached, and a gradient penalty's sum that reaches the inputs
    another way (``out.sum() + dq.square().sum()``) never reaches it, so the penalty's part
    was silently left out."""
    if torch.is_grad_enabled():  # a backward runs with grad mode on only for create_graph
        raise RuntimeError(
            f"{what} has no second derivative (a backward with create_graph=True): {instead}"
        )


@dataclass(slots=True)  # (not frozen: made on every call, a quarter of the cost)
class BackendResult:
    """What a backend computed. Only ``out`` is required.

    A backend that keeps the log-sum-exp returns ``lse``; one that builds the full matrices
    (the reference) also returns ``scores`` and ``probs``. The dispatcher fills in whatever a
    requested trace still lacks.

    Shape:
        out ``(*batch, T, Dv)``; lse ``(*batch, T)``; scores, probs ``(*batch, T, S)``.
    """

    out: Tensor
    lse: Tensor | None = None
    scores: Tensor | None = None
    probs: Tensor | None = None


class Backend(Protocol):
    """An attention implementation behind the dispatcher.

    ``priority``: lower runs first under ``backend="auto"`` (the faster backend).
    ``traceable``: whether ``torch.compile`` can trace it as one graph (a bool, or a method
    ``traceable(call) -> bool`` that answers call by call); under tracing, ``auto`` passes
    over the backends that cannot (they plan on tensor contents).
    ``supports(call)``: None when the backend can take the call, else why not, in words.
    """

    name: str
    priority: int

    # read-only, so that a class attribute ``traceable = True`` and a method both match
    @property
    def traceable(self) -> bool | Callable[[AttentionCall], bool]: ...

    def supports(self, call: AttentionCall) -> str | None: ...

    def run(self, call: AttentionCall) -> BackendResult: ...


class BackendUnsupportedError(ValueError):
    """A backend named by the caller cannot take the call; the message says why."""


class BackendFailedError(BackendUnsupportedError):
    """A backend that takes the call could not build its kernel for it on this machine (its
    compiler failed); it declines calls of that kind from then on, and ``auto`` runs this one
    by the next backend."""


def compiling_plainly() -> bool:
    """Under torch.compile, not torch.export, and outside torch.func transforms: where custom
    ops and tensor subclasses trace (export's fake tensors and functorch's do not take them)."""
    return (
        torch.compiler.is_compiling()
        and not _exporting()
        and not torch._C._are_functorch_transforms_active()
    )


def _exporting() -> bool:
    """``torch.compiler.is_exporting()``, read from the flag it returns: dynamo in torch 2.11
    answers the call with True in every torch.compile trace (it folds it from a table of
    tracing-state functions, all True there; 2.13 reads the flag), which sent every compiled
    call off the tiled custom op to the dense math (an H100 with torch 2.11 showed it)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)
