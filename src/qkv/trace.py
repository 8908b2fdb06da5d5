"""AttentionTrace: the intermediates of one attention call, returned (never stored on self);
DeformableTrace: the sampling points and weights of one deformable attention call.

Shape alphabet: B batch, H query heads, T query length, S key length. ``*batch`` stands for
whatever leading dims the call had (``()``, ``(H,)``, ``(B, H)``, ``(B, X, H)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionTrace", "DeformableTrace", "MultiHeadTrace", "probs_from_lse_"]


class AttentionTrace:
    """What attention computed on the way to its output, for inspection.

    The tensors are detached (no gradient flows through them): computing them beside a fast
    kernel must not make training slower or hold memory for a backward nobody asked for.

    A fast backend keeps only the log-sum-exp. Its trace computes the weights
    ``exp(scores - lse)`` when ``probs`` is first read (one ``(*batch, T, S)`` buffer) and
    the scores when ``scores`` is first read. To look at a long sequence without that buffer,
    :meth:`select` recomputes only the batch elements, heads and query rows asked for.
    A trace made with its weights (inference under ``auto``) may compute ``lse`` when first
    read instead, from the weights.

    Dtypes: ``scores`` and ``probs`` have the inputs' dtype. For float16/bfloat16 inputs a
    fast backend's trace computes them in float32 and rounds once at the end, so its rows sum
    to 1 as closely as that rounding allows; ``lse`` is float32 there.

    Attributes:
        scores: Scaled scores after masking, before softmax; masked entries are ``-inf``.
        probs: Attention weights (before dropout); each row sums to 1, or is all 0 for a
            query row that may attend to nothing. With attention ``sinks`` they are the
            real keys' share only: a row sums to ``1 - exp(sink - lse)``.
        lse: Log-sum-exp of each row of ``scores``; ``-inf`` for a fully masked row. With
            ``sinks`` the sink is one more term, ``logaddexp(lse_of_scores, sink)``: a row
            that may attend to nothing has its sink as lse (``-inf`` only for a ``-inf``
            sink).
        backend: Name of the backend that computed the output.

    Shape:
        scores, probs: ``(*batch, T, S)``; lse: ``(*batch, T)``.
    """

    def __init__(
        self,
        scores: Tensor | Callable[[], Tensor],
        probs: Tensor | Callable[[], Tensor],
        lse: Tensor | Callable[[], Tensor],
        backend: str,
        *,
        subset: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        """``scores``/``probs``/``lse`` may be functions computing them on first read (a lazy
        ``lse`` needs ``probs`` given as a tensor: its shape is the lse's, with S); ``subset(b,
        h, rows)`` returns ``(scores, probs)`` of those indices, shape ``(nb, nh, nr, S)``."""
        if callable(lse) and callable(probs):
            raise ValueError("a lazy lse needs the weights as a tensor (its shape is theirs)")
        self._scores, self._probs, self._subset = scores, probs, subset
        self._lse, self.backend = lse, backend

    @property
    def scores(self) -> Tensor:
        if callable(self._scores):
            self._scores = self._scores()
        return self._scores

    @property
    def probs(self) -> Tensor:
        if callable(self._probs):
            self._probs = self._probs()
        return self._probs

    @property
    def lse(self) -> Tensor:
        if callable(self._lse):
            self._lse = self._lse()
        return self._lse

    @property
    def _lse_shape(self) -> torch.Size:
        """The lse's shape, without computing a lazy lse."""
        if callable(self._lse):
            assert not callable(self._probs)  # __init__: a lazy lse comes with the weights
            return self._probs.shape[:-1]
        return self._lse.shape

    def _deferred(self, name: str, fn: Callable[[Tensor], Tensor]) -> Tensor | Callable[[], Tensor]:
        """``fn(self.<name>)``, deferred while ``name`` (scores, probs or lse) is."""
        value = getattr(self, "_" + name)
        return (lambda: fn(getattr(self, name))) if callable(value) else fn(value)

    def select(self, *, batch=None, heads=None, rows=None) -> AttentionTrace:
        """The trace of some batch elements, heads and query rows only.

        On a fast backend's trace this computes just those weights, from the log-sum-exp:
        ``trace.select(heads=[0], rows=range(4000, 4010))`` of a T=64k call costs
        10 x S, not T x S. Each index may be None (all), an int, a slice, a range, an iterable
        of ints (list, tuple, generator) or an integer tensor, taken in its order (a set,
        having none, is refused); selected dims keep their place (an int keeps a dim of size 1).

        Shape:
            ``(B, H, T, S)`` -> ``(nb, nh, nr, S)``; a trace of ``(H, T, S)`` takes no
            ``batch`` and one of ``(T, S)`` only ``rows``.
        """
        lead = self._lse_shape[:-1]
        if len(lead) > 2:
            raise ValueError(
                "select works on traces of (B, H, T, S) or fewer dims, got lse "
                f"{tuple(self._lse_shape)}"
            )
        if (len(lead) < 2 and batch is not None) or (len(lead) < 1 and heads is not None):
            raise ValueError(
                f"this trace has dims (*{tuple(lead)}, T, S): it has no "
                f"{'batch' if batch is not None else 'heads'} dim to select"
            )
        shape4 = (1,) * (2 - len(lead)) + tuple(self._lse_shape)  # (B, H, T)
        b, h, r = (
            _index(name, i, n)
            for name, i, n in zip(("batch", "heads", "rows"), (batch, heads, rows), shape4)
        )
        if self._subset is not None and (callable(self._probs) or callable(self._scores)):
            scores, probs = self._subset(b, h, r)  # (nb, nh, nr, S)
        else:

            def pick(t: Tensor) -> Tensor:
                t = t.reshape(shape4 + t.shape[-1:])
                return t[b][:, h][:, :, r]  # (nb, nh, nr, S)

            scores, probs = pick(self.scores), pick(self.probs)
        lse = self.lse.reshape(shape4)[b][:, h][:, :, r]  # (nb, nh, nr)
        drop = 2 - len(lead)
        return AttentionTrace(
            scores.flatten(0, drop) if drop else scores,
            probs.flatten(0, drop) if drop else probs,
            lse.flatten(0, drop) if drop else lse,
            self.backend,
        )

    def __getstate__(self) -> dict:
        """What pickling (``torch.save``, ``copy.deepcopy``) keeps: scores and weights are
        computed now, since the functions that would compute them later hold the call's
        inputs and cannot be pickled. Load with ``torch.load(path, weights_only=False)``."""
        state = dict(self.__dict__)
        state.update(_scores=self.scores, _probs=self.probs, _lse=self.lse, _subset=None)
        return state

    def __setstate__(self, state: dict) -> None:
        if "lse" in state:  # pickled before the lse could be lazy
            state["_lse"] = state.pop("lse")
        self.__dict__.update(state)

    def _repr_html_(self) -> str:
        """Jupyter shows a trace as the viewer, inline (``qkv.viz.show``; one sandboxed
        iframe). viz is imported here, on first display: ``import qkv`` loads none of it."""
        from .viz.notebook import repr_html

        return repr_html(self)

    def __repr__(self) -> str:
        shape = tuple(self._lse_shape) + (("S",) if callable(self._probs) else ())
        if not callable(self._probs):
            shape = tuple(self._probs.shape)
        return (
            f"{type(self).__name__}(probs{shape}, lse{tuple(self._lse_shape)}, "
            f"backend={self.backend!r})"
        )


def _index(name: str, index, n: int) -> Tensor:
    """An index along a dim of size ``n`` as a 1-D int64 tensor, checked against ``n``.

    Taken in the order given: None (all), an int, a slice or range (reversed ones too), an
    iterable of ints (list, tuple, generator) or an integer tensor. A str or a set is refused:
    the one is not indices, the other has no order for the rows to come back in.
    """
    if index is None:
        return torch.arange(n, device="cpu")  # indices live on the CPU, whatever the default
    want = (
        f"select: {name} must be an int, a slice, a range, an iterable of ints (list, "
        f"tuple, generator) or an integer tensor"
    )
    if isinstance(index, (set, frozenset)):
        raise TypeError(
            f"{want}; got a set, which has no order for the selection to come "
            f"back in: pass sorted({index!r})"
        )
    if isinstance(index, (str, bytes, dict)):
        raise TypeError(f"{want}, got {type(index).__name__} {index!r}")
    if isinstance(index, slice):
        index = range(n)[index]  # torch slices take no negative step; a range does
    if isinstance(index, int) and not isinstance(index, bool):
        index = [index]
    if not isinstance(index, Tensor):
        index = list(index) if hasattr(index, "__iter__") else index
    try:
        t = torch.as_tensor(
            index,
            dtype=torch.long if isinstance(index, list) and not index else None,
            device=None if isinstance(index, Tensor) else "cpu",
        )
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{want}, got {index!r}") from None
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() > 1:
        raise ValueError(f"{want}, got {index!r}")
    t = t.reshape(-1).long().cpu()
    if torch.compiler.is_compiling():  # a graph cannot read the values to check them: an
        return torch.where(t < 0, t + n, t)  # index out of range fails when indexing instead
    if t.numel() and (int(t.min()) < -n or int(t.max()) >= n):
        raise ValueError(f"select: {name} index out of range for size {n}: {index!r}")
    return t % max(n, 1)


class MultiHeadTrace(AttentionTrace):
    """An AttentionTrace of a multi-head module, with the projections and per-head outputs.

    Attributes:
        q, k, v: The projected queries, keys and values, split into heads (GQA: G heads).
        heads: Each head's output before the heads are concatenated and mixed by W^O.

    Shape:
        scores, probs ``(B, H, T, S)``; lse ``(B, H, T)``; q ``(B, H, T, D)``;
        k ``(B, G, S, D)``; v ``(B, G, S, Dv)``; heads ``(B, H, T, Dv)``.
        (Unbatched module calls drop the B dim.)
    """

    def __init__(
        self,
        trace: AttentionTrace,
        *,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        heads: Tensor,
        index: int | None = None,
    ) -> None:
        """Extend ``trace``; with ``index``, keep only that batch element of everything.

        As lazy as ``trace``: nothing is computed here, and :meth:`select` still computes only
        the rows asked for.
        """
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        super().__init__(
            trace._deferred("scores", pick),
            trace._deferred("probs", pick),
            trace._deferred("lse", pick),
            trace.backend,
            subset=_subset_of_element(trace, index),
        )
        self.q, self.k, self.v, self.heads = (_detach(pick(t)) for t in (q, k, v, heads))


def _detach(t: Tensor) -> Tensor:
    """``t.detach()``; ``t`` itself when it requires no gradient (no op to dispatch)."""
    return t.detach() if t.requires_grad else t


def _subset_of_element(trace: AttentionTrace, index: int | None):
    """``trace``'s ``subset(b, h, rows)`` seen from its batch element ``index``.

    ``index`` drops the first dim of ``trace``: its batch dim, or, for a 3-D trace (a
    single-head module's ``(B, T, S)``), the dim that ``select`` calls heads. That dim has
    size 1 after the pick, so its indices are all 0; they become ``index``.
    """
    subset = trace._subset
    if subset is None or index is None:
        return subset
    if len(trace._lse_shape) == 3:  # (B, H, T): index picks b
        return lambda b, h, rows: subset(torch.full_like(b, index), h, rows)
    return lambda b, h, rows: subset(b, torch.full_like(h, index), rows)  # (B, T): picks "h"


def probs_from_lse_(scores: Tensor, lse: Tensor) -> Tensor:
    """Turn ``scores`` into attention weights ``exp(scores - lse)`` in place.

    This is how a fast backend that keeps only the log-sum-exp gives its weights back; a row
    whose ``lse`` is ``-inf`` (no key to attend) gets weights 0. In place, so that a trace of
    a long sequence costs one ``(T, S)`` buffer.

    Shape:
        scores ``(*batch, T, S)``, lse ``(*batch, T)`` -> ``(*batch, T, S)`` (the same tensor).
    """
    lse = lse.unsqueeze(-1)  # (*batch, T, 1)
    lse = torch.where(torch.isneginf(lse), 0.0, lse)  # a row with no key: exp(-inf - 0) = 0
    if lse.dtype == scores.dtype:
        return scores.sub_(lse).exp_()
    # Half scores with a float32 lse: an in-place mixed-dtype sub_ runs ~30x slower on CPU
    # (579 ms vs 20 ms for 8 x 4096^2 bf16), and rounding lse to half would scale whole rows
    # by up to e^0.02. Subtract it as two half-precision parts: high, then the remainder.
    high = lse.to(scores.dtype)
    low = (lse - high.to(lse.dtype)).to(scores.dtype)
    return scores.sub_(high).sub_(low).exp_()


@dataclass(frozen=True, eq=False, repr=False)
class DeformableTrace:
    """Where each query of a multi-scale deformable attention call sampled, and how much.

    Deformable attention (Deformable DETR, BEVFormer) has no ``(T, S)`` weights: each query
    and head samples each level at P points and sums the samples with its weights. This is
    what it computed on the way: every sampling point, in **pixels of its level**, and its
    weight. Returned by ``qkv.deformable_attention(..., return_trace=True)`` and
    ``qkv.nn.MultiScaleDeformableAttention(..., return_trace=True)``; ``qkv.capture`` records
    it; ``qkv.viz.html`` draws it (one panel per level, a dot per point, area by weight).

    **Pixel convention** (``grid_sample`` with ``align_corners=False``, mmcv's and
    ``qkv.deformable_attention``'s): a location ``(x, y)`` in ``[0, 1]`` over a level of
    ``H x W`` pixels is the pixel coordinate ``(x * W - 0.5, y * H - 0.5)``. Pixel ``(i, j)``
    (column i, row j) has its centre at ``(i, j)``; the map covers ``[-0.5, W - 0.5] x
    [-0.5, H - 0.5]``, so ``(0, 0)`` normalised is the outer corner of the top-left pixel,
    ``(-0.5, -0.5)``. Bilinear sampling at ``(px, py)`` mixes the four pixel centres around
    it; a corner outside the map counts as zero.

    The tensors are detached. ``locations`` and ``reference_points`` are float32 (float64 for
    float64 inputs): half precision cannot hold a pixel position on a 200-pixel-wide map.

    Attributes:
        locations: Each sampling point ``(px, py)`` in pixels of its level.
        weights: Each point's weight, as the sampling used it (the module softmaxes them over
            levels x points, per query and head).
        spatial_shapes: ``(H, W)`` of each level, int64, on the CPU.
        reference_points: Each query's reference point ``(px, py)`` in pixels of each level
            (of a reference box, its centre), or None when the call had none (a bare
            ``qkv.deformable_attention`` call is given only the locations).

    Shape:
        locations ``(B, Lq, M, L, P, 2)``; weights ``(B, Lq, M, L, P)``; spatial_shapes
        ``(L, 2)``; reference_points ``(B, Lq, L, 2)``. (B batch, Lq queries, M heads,
        L levels, P points.)
    """

    locations: Tensor
    weights: Tensor
    spatial_shapes: Tensor
    reference_points: Tensor | None = None

    @classmethod
    def from_normalized(
        cls,
        spatial_shapes: Tensor,
        sampling_locations: Tensor,
        attention_weights: Tensor,
        reference_points: Tensor | None = None,
    ) -> DeformableTrace:
        """The trace of a call given mmcv's normalised ``[0, 1]`` locations (and reference
        points ``(x, y)`` or boxes ``(x, y, w, h)`` per level), turned into pixels.

        Shape:
            spatial_shapes ``(L, 2)``; sampling_locations ``(B, Lq, M, L, P, 2)``;
            attention_weights ``(B, Lq, M, L, P)``; reference_points ``(B, Lq, L, 2 or 4)``.
        """
        shapes = spatial_shapes.detach()
        if shapes.device.type != "cpu" or shapes.dtype != torch.int64:  # (a device's: a read)
            shapes = shapes.to("cpu", torch.int64)
        locations = _to_pixels(sampling_locations.detach(), shapes[:, None, :])
        ref = None
        if reference_points is not None:
            ref = _to_pixels(reference_points.detach()[..., :2], shapes)  # (B, Lq, L, 2)
        return cls(locations, _detach(attention_weights), shapes, ref)

    @property
    def sampling_locations(self) -> Tensor:
        """The locations back in mmcv's normalised ``[0, 1]`` units: ``(px + 0.5) / W``,
        ``(py + 0.5) / H``. Shape ``(B, Lq, M, L, P, 2)``."""
        wh = self.spatial_shapes.flip(-1).to(self.locations)[:, None, :]  # (L, 1, 2) as (W, H)
        return (self.locations + 0.5) / wh

    def select(self, *, batch=None, heads=None, rows=None) -> DeformableTrace:
        """The trace of some batch elements, heads and queries (rows) only; each index as
        :meth:`AttentionTrace.select` takes it (None for all), dims kept.

        Shape:
            ``(B, Lq, M, L, P)`` -> ``(nb, nr, nh, L, P)``; reference_points ``(nb, nr, L, 2)``.
        """
        B, Lq, M = self.weights.shape[:3]
        b, r, h = (
            _index(name, i, n).to(self.weights.device)
            for name, i, n in zip(("batch", "rows", "heads"), (batch, rows, heads), (B, Lq, M))
        )
        ref = self.reference_points
        return DeformableTrace(
            self.locations[b][:, r][:, :, h],  # (nb, nr, nh, L, P, 2)
            self.weights[b][:, r][:, :, h],  # (nb, nr, nh, L, P)
            self.spatial_shapes,
            None if ref is None else ref[b][:, r],  # (nb, nr, L, 2)
        )

    def _repr_html_(self) -> str:
        """Jupyter shows the trace as the viewer's sampling-point view (``qkv.viz.show``)."""
        from .viz.notebook import repr_html

        return repr_html(self)

    def __repr__(self) -> str:
        shapes = [tuple(int(n) for n in s) for s in self.spatial_shapes.tolist()]
        return (
            f"DeformableTrace(weights{tuple(self.weights.shape)}, levels {shapes}, "
            f"reference_points={'None' if self.reference_points is None else 'pixels'})"
        )


def _to_pixels(xy: Tensor, shapes: Tensor) -> Tensor:
    """Normalised ``(x, y)`` in ``[0, 1]`` to pixels ``(x * W - 0.5, y * H - 0.5)``, in float32
    (float64 kept). ``shapes`` ``(..., 2)`` as (H, W) broadcasts against ``xy``'s dims before
    the last."""
    dtype = torch.float64 if xy.dtype == torch.float64 else torch.float32
    wh = shapes.flip(-1).to(xy.device, dtype)  # (..., 2) as (W, H)
    return xy.to(dtype) * wh - 0.5
