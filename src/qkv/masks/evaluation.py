"""Evaluation: calling a mask_mod or score_mod on index tensors, and checking what it returns.

``index_grid`` builds the index tensors a mod is called with; ``evaluate_mask`` and
``evaluate_score`` call it and check the result's dtype and shape; ``per_element`` runs a
plain function per element as FlexAttention does (``torch.vmap``); and
``score_mod_gradient_inputs`` finds the tensors a score_mod reads that need a gradient, with
the captured-tensor discovery (closures, defaults, globals, modules, partials) it rests on.

This module sits below the vocabulary: the one back-reference (the mod classes that
``_captured_tensors`` looks through) is imported inside that function.

Shape alphabet: B batch, H heads, T query length, S key length.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .vocabulary import ScoreMod


def index_grid(
    B: int, H: int, T: int, S: int, *, device=None, q_start: int = 0, kv_start: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The index tensors a mask_mod/score_mod is called with, for queries from ``q_start``
    and keys from ``kv_start``.

    Shape:
        b ``(B, 1, 1, 1)``, h ``(1, H, 1, 1)``, q_idx ``(1, 1, T, 1)``, kv_idx ``(1, 1, 1, S)``.
    """

    def ar(n, start=0):
        return torch.arange(start, start + n, device=device)

    return (
        ar(B).view(B, 1, 1, 1),
        ar(H).view(1, H, 1, 1),
        ar(T, q_start).view(1, 1, T, 1),
        ar(S, kv_start).view(1, 1, 1, S),
    )


def evaluate_mask(mask_mod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod(b, h, q_idx, kv_idx)``, checked to be a bool tensor of the right shape.

    Shape:
        -> broadcastable to the broadcast of the four index shapes.
    """
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"mask_mod {mask_mod!r} returned {got}; it must return a bool tensor "
            f"(True = may attend), e.g. `return q_idx >= kv_idx`"
        )
    full = _broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    if out.dim() > 4 or (out.shape[-2:] != full[-2:] and _broadcast_fails(out.shape, full)):
        raise ValueError(
            f"mask_mod {mask_mod!r} returned shape {tuple(out.shape)} for indices of shape "
            f"{tuple(full)}; compute it from the index tensors so it broadcasts like them"
        )
    return out


def _broadcast_shapes(*shapes) -> tuple:
    """``torch.broadcast_shapes`` of a few short shapes of plain ints, in plain Python: torch's
    goes through ``torch._refs`` (~37 us a call, on CPU), and the tiled backend evaluates a
    mask once per masked chunk (736 chunks a call for a 128x128 neighborhood). Symbolic sizes
    (under ``torch.compile``) go to torch's."""
    if not all(type(d) is int for shape in shapes for d in shape):
        return tuple(torch.broadcast_shapes(*shapes))
    n = max(len(shape) for shape in shapes)
    out = [1] * n
    for shape in shapes:
        for i, d in enumerate(shape, n - len(shape)):
            if d != 1:
                if out[i] not in (1, d):
                    raise RuntimeError(f"shapes {shapes} do not broadcast (dim {i - n})")
                out[i] = d
    return tuple(out)


def _broadcast_fails(shape, full) -> bool:
    try:
        return torch.broadcast_shapes(shape, full) != full
    except RuntimeError:
        return True


def evaluate_score(
    score_mod, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> Tensor:
    """``score_mod(score, ...)``, checked to keep the scores' shape.

    Shape:
        score ``(B, H, T, S)`` (or a tile) -> the same.
    """
    out = score_mod(score, b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(
            f"score_mod {score_mod!r} must return a float tensor, got "
            f"{getattr(out, 'dtype', type(out).__name__)}"
        )
    if out.shape != score.shape:
        if _broadcast_fails(out.shape, score.shape):
            raise ValueError(
                f"score_mod {score_mod!r} returned shape {tuple(out.shape)} for scores "
                f"of shape {tuple(score.shape)}"
            )
        out = out.expand(score.shape)
    return out


def per_element(
    fn, score: Tensor | None, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> Tensor:
    """``fn`` evaluated at every (b, h, q_idx, kv_idx) as if on scalars, as FlexAttention does.

    A plain function sees 0-d index tensors (and a 0-d score), so ``bias[b][q_idx]`` or
    ``ids[b, q_idx] == ids[b, kv_idx]`` mean what they say. It runs as one vectorised call
    (``torch.vmap``), one vmap level per index dim when each index varies along its own dim
    only (the index grids qkv builds), else over the flattened broadcast of the indices.

    Shape:
        b, h, q_idx, kv_idx broadcastable to ``(B, H, T, S)``; score that shape or
        broadcastable to it -> ``(B, H, T, S)``.
    """
    idx = (b, h, q_idx, kv_idx)
    args = idx if score is None else (score,) + idx
    shape = torch.broadcast_shapes(*(t.shape for t in args))
    if 0 in shape:  # nothing to evaluate (vmap cannot map over an empty dim)
        return torch.empty(
            shape, dtype=torch.bool if score is None else score.dtype, device=b.device
        )
    if len(shape) == 4 and all(_varies_only_along(t, d) for d, t in enumerate(idx)):
        vecs = [t.reshape(-1) for t in idx]  # (B,), (H,), (T,), (S,) or size 1
        f = fn
        for d in (3, 2, 1, 0):  # innermost vmap maps over kv_idx
            dims = tuple(0 if i == d else None for i in range(4))
            f = torch.vmap(f, in_dims=dims if score is None else (0,) + dims)
        out = f(*vecs) if score is None else f(score.expand(tuple(v.numel() for v in vecs)), *vecs)
        _check_per_element(fn, out, 4)
        if score is None:  # dims the mask does not depend on come back expanded: keep them 1
            return out[tuple(slice(0, 1) if st == 0 else slice(None) for st in out.stride())]
        return out.expand(shape) if out.shape != shape else out
    flat = [t.expand(shape).reshape(-1) for t in args]  # (N,) each
    out = torch.vmap(fn)(*flat)
    _check_per_element(fn, out, 1)
    return out.reshape(shape)


def _check_per_element(fn, out, mapped: int) -> None:
    """A function evaluated per element must give one value per element."""
    if isinstance(out, Tensor) and out.dim() > mapped:
        raise ValueError(
            f"{getattr(fn, '__name__', repr(fn))} returned shape {tuple(out.shape[mapped:])} for a "
            f"single (b, h, q_idx, kv_idx); mask_mod and score_mod are evaluated per element "
            f"(as in FlexAttention) and must return one value, e.g. `return q_idx >= kv_idx`"
        )


def _varies_only_along(t: Tensor, dim: int) -> bool:
    return t.dim() == 4 and all(n == 1 for i, n in enumerate(t.shape) if i != dim)


def score_mod_gradient_inputs(
    score_mod: ScoreMod, *, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` reads, for a backend that computes their
    gradients itself; ValueError when it reads one that cannot be found.

    The tensors come from :meth:`ScoreMod.tensors`. To be sure none is missed, the score_mod
    is run once on a 1 x 1 x 1 x 1 probe and its autograd graph walked: every leaf tensor
    requiring grad that the score depends on must be one of them, or lie behind one.
    """
    found = tuple(t for t in score_mod.tensors() if t.requires_grad)
    if not torch.is_grad_enabled():
        return found
    probe = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device, requires_grad=True)
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    out = evaluate_score(score_mod, probe, zero, zero, zero, zero)
    stops = {id(t.grad_fn) for t in found if t.grad_fn is not None}
    known = {id(t) for t in found if t.grad_fn is None}
    missed = _leaves_needing_grad(out.grad_fn, stops, known | {id(probe)})
    if missed:
        shapes = ", ".join(f"{tuple(t.shape)}" for t in missed)
        raise ValueError(
            f"score_mod {score_mod!r} reads tensors that require grad ({shapes}) where qkv "
            f"cannot find them to give them their gradient (it looks in closures, defaults, "
            f"globals, bound modules, functools.partial arguments and containers). Capture the "
            f"tensor in the function's closure or defaults, or use backend='reference'"
        )
    return found


def _leaves_needing_grad(node, stops: set[int], known: set[int]) -> list[Tensor]:
    """Leaf tensors requiring grad behind autograd ``node``, not behind a node in ``stops``
    and not in ``known`` (ids)."""
    missed, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen or id(n) in stops:
            continue
        seen.add(id(n))
        var = getattr(n, "variable", None)  # AccumulateGrad: a leaf tensor
        if var is not None and id(var) not in known:
            missed.append(var)
        todo.extend(nxt for nxt, _ in n.next_functions)
    return missed


def _captured_tensors(obj, depth: int = 4) -> tuple[Tensor, ...]:
    """Tensors reachable from a function: see :meth:`_ScoreFunction.tensors`."""
    from .vocabulary import MaskMod, ScoreMod, _Function, _ScoreFunction  # the layer above

    if isinstance(obj, Tensor):
        return (obj,)
    if isinstance(obj, (ScoreMod, MaskMod)) and not isinstance(obj, (_ScoreFunction, _Function)):
        return obj.tensors()
    if depth == 0 or isinstance(obj, (type, types.ModuleType, str, bytes)):
        return ()
    found: list[Tensor] = []
    for child in _children(
        getattr(obj, "fn", obj) if isinstance(obj, (_ScoreFunction, _Function)) else obj
    ):
        found += _captured_tensors(child, depth - 1)
    return _unique(found)


def _children(obj) -> list:
    """What a function or object holds that may be or lead to a tensor."""
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _cell_filled(c)]
        named = [obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
        return (
            cells + named + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        )
    if hasattr(obj, "__dict__"):  # another object: its attributes
        return list(vars(obj).values())
    return []


def _names(code: types.CodeType) -> list[str]:
    """Global names a code object (and the functions and lambdas defined in it) reads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return names


def _unique(tensors) -> tuple[Tensor, ...]:
    """Tensors without repeats (by identity), in first-seen order."""
    return tuple({id(t): t for t in tensors}.values())


def _cell_filled(cell) -> bool:
    try:
        _ = cell.cell_contents  # an empty cell raises
    except ValueError:
        return False
    return True
