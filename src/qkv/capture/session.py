"""The capture session: :func:`capture`, the context manager it returns, the forward hooks
that keep the stack of sites, the recorder that keeps each wanted call's weights, and the
checks on exit.

Shape alphabet: B batch, H query heads, T query length, S key length; nb, nh, nr the batch
elements, heads and query rows kept.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .. import recording
from ..trace import AttentionTrace, DeformableTrace
from .captured import _NOTHING, Captured, CapturedAttention, CapturedDeformable, _compact, _list
from .selection import _batch_heads, _Index, _Layers, _selected

__all__ = ["capture"]

_CAPTURED_MODELS: set[int] = set()  # id() of the models inside a capture now


def capture(
    model: nn.Module, layers=None, heads=None, rows=None, *, batch=None, scores: bool = False
) -> _Capture:
    """Record the attention weights of every qkv attention call inside ``model``.

    A context manager: ``with qkv.capture(model, ...) as cap:`` gives a :class:`Captured`
    that fills while the block runs (one forward, several, or ``generate``). Calls made
    outside ``model``'s submodules (another model, a bare functional call) are not recorded.

    Args:
        model: The model whose attention to record.
        layers: Which sites to record: None (all), or a layer number / module name, or a list
            of them. Layer numbers count the sites in the order they first call attention
            (0, 1, ...). A name selects that module and everything under it
            (``"blocks.layers.5"`` takes its ``self_attn``); names are checked on entry.
        heads: Query heads to keep: None (all), an int, a slice, a range, or a list/tuple/
            tensor of ints. A head a call does not have raises, naming the site.
        rows: Query rows to keep, indexing each call's query positions ``0..T-1``;
            negative ones count from the end (``rows=-1``: the last query of every call, the
            new token of each decoding step). A call with fewer rows keeps the rows it has
            (a decoding step of one token keeps none of ``range(8000, 8016)``, and its record
            then holds 0 rows); the kept row numbers are in each record's ``rows``.
        batch: Batch elements to keep, as ``heads``.
        scores: Keep the scores (scaled, masked, before softmax) beside the weights.

    Returns:
        The context manager; entering it gives the :class:`Captured`.

    Raises:
        ValueError: On exit, when the block raised nothing, if a layer number, name or the
            rows asked for matched no call, listing what the model did call (a capture that
            saw no qkv attention call at all warns instead, and its :class:`Captured` says so
            when indexed). On entry, for a capture of a model already being captured.

    Deformable attention (``qkv.nn.MultiScaleDeformableAttention``, ``qkv.deformable_attention``)
    has sampling points instead of weights: each such call is a :class:`CapturedDeformable`
    in ``cap.deformable`` (its points in pixels of each level, their weights and the
    queries' reference points); ``rows`` pick its queries, ``heads`` and ``batch`` as above.

    Shape:
        Each record's ``probs`` is ``(nb, nh, nr, S)`` (all four dims always: the dims before
        ``(T, S)`` of a call are read as ``trace.select`` reads them, ``(B, H)``, ``(H,)`` or
        none; more are folded into B). ``lse`` ``(nb, nh, nr)``. A deformable record's
        ``locations`` ``(nb, nr, nh, L, P, 2)``, ``weights`` ``(nb, nr, nh, L, P)``.

    Example:
        >>> model = qkv.DecoderLM(100, 64, 4, 2).eval()
        >>> with qkv.capture(model, heads=[0], rows=[-1]) as cap:
        ...     model.generate(torch.tensor([[1, 2, 3]]), 4)
        >>> [r.probs.shape for r in cap.layer(0)]   # the prompt's last row, then each step's
    """
    return _Capture(model, layers, heads, rows, batch, scores)


@dataclass
class _Site:
    layer: int
    wanted: bool
    calls: int = 0


class _Capture(recording.Recorder):
    """The context manager :func:`capture` returns; a recorder while entered."""

    def __init__(self, model: nn.Module, layers, heads, rows, batch, scores: bool) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"qkv.capture takes a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(scores, bool):
            raise TypeError(f"scores must be True or False, got {scores!r}")
        self._model, self._keep_scores = model, scores
        self._layers = _Layers(layers, model)
        self._batch, self._heads = _Index("batch", batch), _Index("heads", heads)
        self._rows = _Index("rows", rows)
        self._bounded = not (self._batch.all and self._heads.all and self._rows.all)
        settings = {
            "model": type(model).__name__,
            "layers": self._layers.text,
            "heads": self._heads.text,
            "rows": self._rows.text,
            "batch": self._batch.text,
            "scores": str(scores),
        }
        self._captured = Captured(settings=settings)
        self._sites: dict[str, _Site] = {}
        self._stack: list[str] = []
        self._handles: list = []
        self._outside = 0  # attention calls while no submodule of the model ran
        self._most_rows = 0  # the most query rows a wanted call had
        self._kept_rows = False  # whether any wanted call kept a row
        self._state = "new"

    def __enter__(self) -> Captured:
        if self._state != "new":
            raise RuntimeError(
                "a qkv.capture(...) is entered once; make a new one for another capture"
            )
        if id(self._model) in _CAPTURED_MODELS:
            raise ValueError(
                f"this {type(self._model).__name__} is already inside a "
                f"qkv.capture; nested captures of one model are refused (ask "
                f"the outer capture for the layers, heads and rows you want)"
            )
        self._state, self._thread = "entered", threading.get_ident()
        try:
            for name, module in self._model.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(self._push(name), prepend=True)
                )
                self._handles.append(
                    module.register_forward_hook(self._pop(name), always_call=True)
                )
            _CAPTURED_MODELS.add(id(self._model))
            self._token = recording.start(self)
        except BaseException:
            self._remove_hooks()
            _CAPTURED_MODELS.discard(id(self._model))
            raise
        return self._captured

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            recording.stop(self._token)
        finally:
            self._remove_hooks()
            _CAPTURED_MODELS.discard(id(self._model))
            self._state, self._stack = "exited", []
        if exc_type is None:
            self._check()
        return False

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _mine(self) -> bool:
        """Whether the running module call is in the capturing thread (a compiled call is
        taken to be: dynamo cannot read the thread)."""
        return torch.compiler.is_compiling() or threading.get_ident() == self._thread

    def _push(self, name: str):
        def hook(module, args):
            if self._mine():
                self._stack.append(name)

        return hook

    def _pop(self, name: str):
        def hook(module, args, output):
            if not self._mine():
                return
            stack = self._stack  # pop back to this module's entry, even after an exception
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] == name:
                    del stack[i:]
                    break

        return hook

    # recording.Recorder
    def want(self):
        if not self._stack:
            self._outside += 1
            return None
        name = self._stack[-1]
        site = self._sites.get(name)
        if site is None:
            layer = len(self._sites)
            site = self._sites[name] = _Site(layer, self._layers.wants(layer, name))
            self._captured.sites.append(name)
        call, site.calls = site.calls, site.calls + 1
        if not site.wanted:
            return None
        return lambda trace: self._record(name, site.layer, call, trace)

    def _record(
        self, name: str, layer: int, call: int, trace: AttentionTrace | DeformableTrace
    ) -> None:
        if isinstance(trace, DeformableTrace):
            self._record_deformable(name, layer, call, trace)
            return
        with torch.no_grad():
            lead, T = tuple(trace.lse.shape[:-1]), trace.lse.shape[-1]
            B, H = _batch_heads(lead)
            where = f"the attention call of {name or '(model)'!r} (layer {layer})"
            b = self._batch.resolve(B, where)
            h = self._heads.resolve(H, where)
            r = self._rows.resolve(T, where)
            if self._bounded:
                probs, lse, scores = _selected(trace, lead, b, h, r, self._keep_scores)
            else:
                probs = trace.probs
                probs = probs.reshape(B, H, T, probs.shape[-1])  # (B, H, T, S)
                lse = trace.lse.reshape(B, H, T)  # (B, H, T)
                scores = trace.scores.reshape(probs.shape) if self._keep_scores else None
        self._most_rows = max(self._most_rows, T)
        self._kept_rows = self._kept_rows or len(r) > 0
        record = CapturedAttention(
            name,
            layer,
            call,
            _compact(probs),
            _compact(lse),
            None if scores is None else _compact(scores),
            b,
            h,
            r,
            (B, H, T, probs.shape[-1]),
            trace.backend,
        )
        self._captured.records.append(record)

    def _record_deformable(self, name: str, layer: int, call: int, trace: DeformableTrace) -> None:
        """Keep a deformable call's points: ``batch``, ``heads`` and ``rows`` (its queries)
        pick them as they pick an attention call's weights."""
        B, Lq, M, L, P = trace.weights.shape
        where = f"the deformable attention call of {name or '(model)'!r} (layer {layer})"
        b = self._batch.resolve(B, where)
        h = self._heads.resolve(M, where)
        r = self._rows.resolve(Lq, where)
        kept = trace.select(batch=b, heads=h, rows=r) if self._bounded else trace
        ref = kept.reference_points
        self._most_rows = max(self._most_rows, Lq)
        self._kept_rows = self._kept_rows or len(r) > 0
        record = CapturedDeformable(
            name,
            layer,
            call,
            _compact(kept.locations),  # (nb, nr, nh, L, P, 2)
            _compact(kept.weights),  # (nb, nr, nh, L, P)
            None if ref is None else _compact(ref),  # (nb, nr, L, 2)
            kept.spatial_shapes,
            b,
            h,
            r,
            (B, Lq, M, L, P),
        )
        self._captured.deformable.append(record)

    def _check(self) -> None:
        """After a block that raised nothing: say when what was asked for matched nothing."""
        sites = self._captured.sites
        if not sites:
            outside = (
                f" ({self._outside} qkv attention calls ran outside the model's "
                f"submodules and were not recorded)"
                if self._outside
                else ""
            )
            warnings.warn(
                f"qkv.capture of {type(self._model).__name__}: {_NOTHING}{outside}",
                UserWarning,
                stacklevel=3,
            )
            return
        missing = self._layers.missing(sites)
        if missing:
            raise ValueError(
                f"qkv.capture: layers {missing} asked for, but attention was called from "
                f"{len(sites)} sites (layers 0..{len(sites) - 1}), in layer order: "
                f"{_list(sites)}"
            )
        recorded = self._captured.records or self._captured.deformable
        if not self._rows.all and recorded and not self._kept_rows:
            raise ValueError(
                f"qkv.capture: rows={self._captured.settings['rows']} matched no query row: "
                f"the recorded calls had at most T={self._most_rows} query rows (rows index "
                f"each call's query positions 0..T-1; negative ones count from the end)"
            )
