"""The one dispatcher: a registry of backends and the choice among them.

``backend="auto"`` takes the backend measured fastest on this machine for calls of this kind
among those that can take it (``autotune``: timed once, kept in memory and on disk), or, with
measuring off (``QKV_AUTOTUNE=off``), under tracing, or where one backend alone can take it, the
backend of lowest ``priority`` whose ``supports(call)`` is None, that does not leave auto
(``auto_prefers``) and that the static order may take (``in_static_order``: torch runs a
structured mask dense, so only a measurement takes it there). :func:`explain` says which
and why. A backend named by the caller that cannot take the call raises
``BackendUnsupportedError`` with its reason; nothing falls back silently.

:func:`choose` makes the plan (the backend, and how a wanted trace is made), :func:`run`
carries it out: ``run(call, choose(call, backend))``, or ``run(call, backend)`` in one go.

Read top-down: the plan and its run; how the backend is chosen (named by the caller, measured
by ``autotune``, or the static order); the registry. A trace whose weights are recomputed
after the kernel is made by ``lazy_trace``.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import autotune, lazy_trace
from ._measured import env
from .ops import (
    AttentionCall,
    Backend,
    BackendResult,
    BackendUnsupportedError,
    ReferenceBackend,
    TiledBackend,
    TorchBackend,
    few_rows,
    nonfinite,
)
from .ops.base import BackendFailedError, tracing
from .ops.flex import FlexBackend
from .ops.reference import attention_with_weights
from .ops.reference import keeps_nonfinite_contract as one_pass_keeps_contract
from .ops.triton import TritonBackend
from .trace import AttentionTrace

__all__ = [
    "Plan",
    "backend_names",
    "check_backends",
    "choose",
    "explain",
    "get_backend",
    "keeps_nonfinite_contract",
    "kept_plans_state",
    "register_backend",
    "run",
    "select",
    "tune",
    "unregister_backend",
    "way",
]


# --- the plan and its run ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """How :func:`run` carries out a call; :func:`choose` makes it.

    ``backend``: the backend that runs the call; None when ``auto`` forms the output and the
    weights in one pass of the reference math (``_weights_in_one_pass``).
    ``keeps_nonfinite_contract``: the backend keeps the NaN/inf part of the mask contract
    itself, so ``ops/nonfinite.py`` has nothing to add: the tiled custom ops under
    torch.compile do (on the real tensors, at run time, at the cost of one reduction when
    every input is finite).
    """

    backend: Backend | None
    keeps_nonfinite_contract: bool = False

    @property
    def torch_kernel(self) -> bool:
        """Whether torch's SDPA kernel runs the call (qkv's torch backend): the NaN/inf
        contract's check after it knows how its rows come out (``Guard.restore``)."""
        return type(self.backend) is TorchBackend


def choose(call: AttentionCall, backend: str = "auto") -> Plan:
    """The plan for ``call``: the backend that runs it (:func:`select`), and for a wanted
    trace under ``auto``, how the trace is made."""
    if backend == "auto" and call.has_tangents():
        backend = "reference"  # forward-mode AD: only the plain math has its rules
    if call.return_trace and backend == "auto":
        if tracing():
            backend = "reference"  # the plain math gives the whole trace in the graph (the
            # one-pass and lazy traces branch on values and index on the host)
        elif _weights_in_one_pass(call):
            return Plan(None, one_pass_keeps_contract(call))
    chosen = _kept_select(call, backend)
    if not isinstance(chosen, TiledBackend):
        plan = _PLANS.get(chosen)  # (one plan object per backend: none keeps the contract)
        if plan is None:
            plan = _PLANS[chosen] = Plan(chosen, False)
        return plan
    keeps = (
        chosen.keeps_nonfinite_contract(call)  # eager: the bfloat16 kernel of range masks
        or (
            tracing()
            and not call.return_trace
            and backend in ("auto", "tiled")
            and _traceable(chosen, call)
        )
    )
    return Plan(chosen, keeps)


_PLANS: dict[Backend, Plan] = {}  # backend -> its plan, for backends that never keep the contract


def run(
    call: AttentionCall, backend: str | Plan = "auto"
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """Run ``call`` by ``backend`` (a name, or a :func:`choose` plan); return the output, or
    ``(output, AttentionTrace)`` if it asks for one.

    Shape:
        output ``(*batch, T, Dv)``.
    """
    return run_with_lse(call, backend)[0]


def run_with_lse(
    call: AttentionCall, backend: str | Plan = "auto"
) -> tuple[Tensor | tuple[Tensor, AttentionTrace], Tensor | None]:
    """:func:`run`, and the log-sum-exp ``(*batch, T)`` of each row that torch's kernel gave
    with the output (None from other backends): the NaN/inf contract's check reads it
    (``nonfinite.Guard.restore``)."""
    plan = backend if isinstance(backend, Plan) else choose(call, backend)
    if plan.backend is None:
        out, probs, lse = attention_with_weights(call, lazy_lse=True)
        return (out, lazy_trace.trace_of_weights(call, probs, lse)), None
    try:
        result = plan.backend.run(call)
    except BackendFailedError:
        _selected.clear()  # (it declines calls of this kind now: choose again)
        raise
    kernel_lse = result.lse if type(plan.backend) is TorchBackend else None
    if not isinstance(kernel_lse, Tensor):
        kernel_lse = None  # (a lazy one: not a kernel's)
    if not call.return_trace:
        return result.out, kernel_lse
    return (result.out, _trace_of_result(call, result, plan.backend.name)), kernel_lse


def keeps_nonfinite_contract(call: AttentionCall, backend: str = "auto") -> bool:
    """Whether the backend :func:`choose` picks keeps the NaN/inf contract itself (kept for
    callers from before :class:`Plan`: ``choose(call, backend).keeps_nonfinite_contract``)."""
    return choose(call, backend).keeps_nonfinite_contract


def _trace_of_result(call: AttentionCall, result: BackendResult, name: str) -> AttentionTrace:
    """The trace of a backend's result: its weights where it formed them, else recomputed
    from its lse (or from nothing)."""
    if result.probs is None:
        if tracing():  # a lazy trace reads version counters and indexes rows on the host:
            # the whole trace by the plain math instead, in the graph
            ref = get_backend("reference").run(call)
            assert ref.scores is not None and ref.probs is not None and ref.lse is not None
            return AttentionTrace(ref.scores.detach(), ref.probs.detach(), ref.lse.detach(), name)
        with torch.no_grad():
            return lazy_trace.trace_from_lse(call, result.lse, name)
    assert result.scores is not None and result.lse is not None  # BackendResult: all three
    return AttentionTrace(result.scores.detach(), result.probs.detach(), result.lse.detach(), name)


# Weights of at most this many elements are formed with the output, in one pass, when no
# gradient is wanted (512 MiB in float32: 8 heads at T=S=4096, what torch's module holds for
# need_weights=True too); beyond, they stay lazy, so that a trace of a long sequence computes
# only the rows read (trace.select) instead of holding every weight.
ONE_PASS_MAX_ELEMENTS = 2**27


def _weights_in_one_pass(call: AttentionCall) -> bool:
    """Whether ``auto`` forms the output and the weights together (reference math, one pass,
    :func:`qkv.ops.reference.attention_with_weights`): the weights are wanted, no gradient
    is, no dropout, and the weights are small enough to hold at once (a longer call keeps its
    lazy trace, computed only for the rows read). Faster than a kernel followed by a second
    pass for the weights, and as exact (the tolerance policy holds for both)."""
    if (
        call.dropout_p > 0
        or call.device.type == "meta"
        or call.T == 0
        or call.S == 0
        or call.sinks is not None
    ):
        return False
    B, H = call.BH
    if B * H * call.T * call.S > ONE_PASS_MAX_ELEMENTS:
        return False
    if torch.is_grad_enabled():
        tensors = [call.query, call.key, call.value, call.attn_mask]
        for mod in (call.mask_mod, call.score_mod):
            if mod is not None:
                tensors.extend(mod.tensors())
        if any(t is not None and t.requires_grad for t in tensors):
            return False
    return True


# --- the backend: named, measured (autotune), or the static order -------------------------


def _kept_select(call: AttentionCall, backend: str) -> Backend:
    """:func:`select`, kept per call structure (``AttentionCall.structure``) with the backend
    name, whether a gradient is wanted and the measuring switch: ``auto``'s choice for a kind
    of call never changes within a process, and changing the registry or ``autotune``
    forgetting its choices starts over. (At decode sizes the choice cost a sixth of torch's
    kernel.) Not for traces, whose choice reads sizes a structure does not fix alone."""
    structure = call.structure
    if structure is None or call.return_trace or tracing():
        return select(call, backend)
    key = (structure, backend, call.wants_grad, autotune.enabled(), autotune.generation())
    chosen = _selected.get(key)
    if chosen is None or _selected_from[0] is not _ORDER:
        if _selected_from[0] is not _ORDER or len(_selected) >= _SELECTED_MAX:
            _selected.clear()  # (a model meets a handful of structures)
            _selected_from[0] = _ORDER
        chosen = _selected[key] = select(call, backend)
    return chosen


_selected: dict[tuple, Backend] = {}  # (structure, name, grad, measuring, generation) -> backend
_selected_from: list = [None]  # the registry order list they were chosen from
_SELECTED_MAX = 256


def select(call: AttentionCall, backend: str = "auto") -> Backend:
    """The backend that will run ``call``."""
    if backend == "auto":
        traced = tracing()
        if not traced and autotune.enabled():
            measured = _measured(call)
            if measured is not None:
                return measured
        return _static_choice(call)
    chosen = get_backend(backend)
    reason = chosen.supports(call)
    if reason is not None:
        able = [n for n, r in check_backends(call).items() if r is None]
        raise BackendUnsupportedError(
            f"backend {backend!r} cannot take this call: {reason}. "
            f"Backends that can: {', '.join(able) or 'none'}; or pass backend='auto'"
        )
    return chosen


def _measured(call: AttentionCall) -> Backend | None:
    """The backend measured fastest for calls of this kind on this machine (``autotune``),
    or None to walk the static order."""
    name = autotune.known(call)  # kept earlier in this process: a dict lookup
    if name == "":
        return None  # nothing to measure for calls of this kind: the static order
    if name is not None:
        known = _REGISTRY.get(name)
        if known is not None and known.supports(call) is None:
            return known
    able = _measurable(call)
    choice = autotune.measured_choice(call, able, lambda b: not _auto_prefers(b, call))
    return None if choice is None else _REGISTRY.get(choice.backend)


def _static_choice(call: AttentionCall) -> Backend:
    """The first backend of the static order (``priority``) that takes ``call`` and does not
    leave auto (``auto_prefers``); under tracing, one that traces."""
    traced = tracing()
    for candidate in _ORDER:
        if traced and not _traceable(candidate, call):
            continue  # one graph under torch.compile: torch's SDPA, tiled's custom ops
            # for the masks they carry, or the reference math
        if not _auto_prefers(candidate, call):
            continue  # a backend auto leaves to be named (flex off CUDA)
        if not _in_static_order(candidate, call):
            continue  # one auto takes only when measured fastest (torch's dense structured masks)
        if candidate.supports(call) is None:
            return candidate
    reasons = "; ".join(f"{n}: {r}" for n, r in check_backends(call).items())
    raise BackendUnsupportedError(f"no backend can take this call ({reasons})")


def _auto_prefers(backend: Backend, call: AttentionCall) -> bool:
    """A backend's ``auto_prefers(call)`` where it has one (else True): whether ``auto`` may
    pick it for this call, or only a caller who names it."""
    prefers = getattr(backend, "auto_prefers", None)
    return True if prefers is None else bool(prefers(call))


def _in_static_order(backend: Backend, call: AttentionCall) -> bool:
    """A backend's ``in_static_order(call)`` where it has one (else True): whether the static
    order may take it for this call, or only a measurement that found it fastest."""
    in_order = getattr(backend, "in_static_order", None)
    return True if in_order is None else bool(in_order(call))


def _traceable(backend: Backend, call: AttentionCall) -> bool:
    """A backend's ``traceable``: a bool, or a method telling it call by call."""
    answer = getattr(backend, "traceable", False)
    return answer(call) if callable(answer) else bool(answer)


def explain(
    call: AttentionCall | Tensor, key: Tensor | None = None, value: Tensor | None = None, **kwargs
) -> str:
    """Which backend ``auto`` takes for ``call``, and why: measured on this machine (with the
    times), read from the disk cache, or the static order (measuring off or not done yet);
    and where a measured route of that backend decides how it runs the call, that way and
    why. Runs nothing. Asked of the call its kernel runs (``nonfinite.without_hidden_keys``),
    as ``qkv.scaled_dot_product_attention`` chooses.

    ``call``: an :class:`~qkv.ops.AttentionCall`, or the query, with ``key``, ``value`` and
    the keyword arguments of ``qkv.scaled_dot_product_attention`` (``attn_mask``,
    ``is_causal``, ``mask_mod``, ``scale``, ...) to make one; asked under the caller's grad
    mode, as the call would run."""
    if not isinstance(call, AttentionCall):
        if key is None or value is None:
            raise TypeError("explain: pass an AttentionCall, or query, key and value tensors")
        call = AttentionCall.build(call, key, value, **kwargs)
    elif key is not None or value is not None or kwargs:
        raise TypeError("explain: an AttentionCall takes no further arguments")
    call = nonfinite.without_hidden_keys(call)
    kept = autotune.stored_choice(call) if autotune.enabled() and not tracing() else None
    if kept is not None:
        backend = _REGISTRY.get(kept.backend)
        if backend is not None and backend.supports(call) is None:
            return _with_way(kept.reason(), backend, call)
    static = _static_choice(call)
    why = "measuring is off (QKV_AUTOTUNE=off)" if not autotune.enabled() else "not measured"
    return _with_way(
        f"{static.name}: the first backend of the static order that takes it ({why})",
        static,
        call,
    )


def way(call: AttentionCall, backend: str) -> str | None:
    """How the backend named ``backend`` runs ``call`` where a measured route of its own
    decides it (the tiled backend's bfloat16 ranges: the fused kernel or the plan), and why;
    None where it has one way. Runs nothing."""
    words = getattr(get_backend(backend), "way", None)
    return None if words is None else words(nonfinite.without_hidden_keys(call))


def _with_way(reason: str, backend: Backend, call: AttentionCall) -> str:
    """``reason`` and, where a measured route of the backend decides the call, its way."""
    words = getattr(backend, "way", None)
    how = None if words is None else words(call)
    return reason if how is None else f"{reason}; {backend.name}'s way: {how}"


def tune(call: AttentionCall) -> autotune.Choice | None:
    """Measure every backend that can take ``call`` (those that compile on first use too),
    keep the fastest for calls of its kind (in this process and on disk), and return it; None
    when fewer than two can take it. A backend's own measured ways (``tune_way``: the tiled
    backend's bfloat16 ranges) are measured afresh first. What ``qkv tune`` runs; on the call
    its kernel runs, as :func:`explain`."""
    call = nonfinite.without_hidden_keys(call)
    able = _measurable(call)
    for backend in able:  # first each backend's own ways, so that each is timed at its best
        tune_way = getattr(backend, "tune_way", None)
        if tune_way is not None:
            tune_way(call)
    return autotune.measured_choice(call, able, lambda b: False, fresh=True)


def _measurable(call: AttentionCall) -> list[Backend]:
    """The backends measuring compares for ``call``: every one that takes it but the reference,
    in the static order, those it may not take last (a near tie goes to the first)."""
    able = [b for b in _ORDER if b.name != "reference" and b.supports(call) is None]
    return sorted(able, key=lambda b: not _in_static_order(b, call))  # (a stable sort)


# --- the registry -------------------------------------------------------------------------

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
    _selected.clear()
    _registry_changed()


def unregister_backend(name: str) -> Backend:
    """Remove the backend registered as ``name`` and return it."""
    backend = get_backend(name)
    del _REGISTRY[name]
    _ORDER.remove(backend)
    _selected.clear()
    _registry_changed()
    return backend


def kept_plans_state() -> tuple | None:
    """What a plan kept beyond one call structure depends on besides the call: the measuring
    switch, the generation of ``autotune``'s kept choices, the registry (which one, and its
    generation) and the few-rows kernel's switch (a lane kept while it was off is not the
    kernel's, nor one found to have none then); None while a backend that is not qkv's own is
    registered (its ``supports`` may turn on exact sizes, while ``auto``'s kept choices are per
    power-of-two size bucket). A caller that keeps a plan compares this with the value it kept
    it under."""
    mark = (id(_REGISTRY), id(_ORDER), _REGISTRY_GENERATION[0])
    if _BUILTIN[0] != mark:  # (the registry changed, or a test put another in its place)
        own = (FlexBackend, TritonBackend, TorchBackend, TiledBackend, ReferenceBackend)
        _BUILTIN[:] = [mark, all(type(b) in own for b in _REGISTRY.values())]
    if not _BUILTIN[1]:
        return None
    return (autotune.enabled(), autotune.generation(), mark, env(few_rows.SWITCH))


_REGISTRY_GENERATION = [0]  # bumped on each change of the registry
_BUILTIN: list = [None, True]  # (the registry's mark, whether all its backends are qkv's own)


def _registry_changed() -> None:
    _REGISTRY_GENERATION[0] += 1


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


register_backend(FlexBackend())  # priority 12: CUDA calls torch cannot take, before triton
register_backend(TritonBackend())  # priority 15: after torch; CUDA calls torch cannot take
register_backend(TorchBackend())
register_backend(TiledBackend())
register_backend(ReferenceBackend())
