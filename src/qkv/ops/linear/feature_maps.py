"""Feature maps for linear attention: phi such that phi(q) . phi(k) stands in for the kernel.

A feature map turns ``(..., L, D)`` into nonnegative features ``(..., L, M)``. Exponential maps
(FAVOR+) would overflow if written out, so every map returns :class:`Features`: the values and
an optional per-position log-scale, ``phi(x) = values * exp(log_scale)``. The linear-attention
kernels choose their own units for the keys (a running maximum of ``log_scale``) and never form
``exp(log_scale)`` on its own.

Built in:
    ``"elu"``  ``elu(x) + 1`` (Katharopoulos et al. 2020, "Transformers are RNNs"), M = D.
    ``"relu"`` ``relu(x)``, M = D.
    ``"favor"`` (alias ``"performer"``) :class:`Favor` with its defaults, seed 0.

Shape alphabet: L positions (T or S), D head dim, M number of features.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FEATURE_MAPS",
    "EluFeatureMap",
    "Favor",
    "FeatureMap",
    "Features",
    "ReluFeatureMap",
    "resolve_feature_map",
]


class Features(NamedTuple):
    """Nonnegative features ``values * exp(log_scale)``.

    Shape:
        values ``(..., L, M)``; log_scale ``(..., L)`` or None (meaning 0).
    """

    values: Tensor
    log_scale: Tensor | None = None

    def dense(self) -> Tensor:
        """The features written out, ``(..., L, M)``; may overflow for exponential maps."""
        if self.log_scale is None:
            return self.values
        return self.values * self.log_scale.exp().unsqueeze(-1)


class FeatureMap(nn.Module):
    """Base class: ``forward(x) -> Features``; ``num_features(D)`` says M for head dim D."""

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if this map cannot take inputs with ``head_dim`` channels."""

    def begin_call(self) -> None:
        """Called once per attention call, before the queries' and keys' features (so that
        both see one projection); FAVOR+ redraws here."""


class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``: positive, and linear for x > 0 (Katharopoulos et al. 2020)."""

    def forward(self, x: Tensor) -> Features:
        return Features(F.elu(x) + 1)

    def extra_repr(self) -> str:
        return "elu(x) + 1"


class ReluFeatureMap(FeatureMap):
    """``phi(x) = relu(x)``. A query whose features all vanish attends to nothing (output 0)."""

    def forward(self, x: Tensor) -> Features:
        return Features(F.relu(x))


class Favor(FeatureMap):
    """FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers"): positive
    orthogonal random features whose dot products estimate the softmax kernel without bias,
    ``E[phi(q) . phi(k)] = exp(scale * q . k)``.

    ``phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(M)`` with ``x' = sqrt(scale) * x``. The M rows of
    W come in blocks of D mutually orthogonal directions (QR of a Gaussian matrix), each row
    given the length of an independent Gaussian vector, so every row is marginally N(0, I).

    The projection is drawn from ``seed`` (a CPU generator, so the same on every device) and
    kept as a buffer, so it is saved in ``state_dict`` and moves with ``.to()``.

    Args:
        head_dim: D, the channels of queries and keys.
        num_features: M; default ``round(D * ln D)`` (the paper's choice).
        seed: Seed of the first projection.
        redraw: False keeps the projection. True draws a new one on every attention call in
            training mode; an int N draws one every N calls in training mode (the first call
            uses the projection drawn at construction). Draw i uses
            seed ``seed + i``, so runs and resumed runs see the same projections. Never
            redrawn in eval mode (a recurrent state must see the projection it started with).
            Under ``torch.compile`` a redrawing map in training mode costs one graph break
            per call (the draw runs on the host); ``fullgraph=True`` refuses it.
        scale: The softmax's factor on ``q . k``; None means ``1 / sqrt(D)``.

    Shape:
        x ``(..., L, D)`` -> values ``(..., L, M)``, log_scale ``(..., L)``.
    """

    projection: Tensor  # buffers, registered in __init__: (M, D)
    draws: Tensor  # () int64
    calls: Tensor  # () int64

    def __init__(
        self,
        head_dim: int,
        num_features: int | None = None,
        *,
        seed: int = 0,
        redraw: bool | int = False,
        scale: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_positive_int("head_dim", head_dim)
        M = default_num_features(head_dim) if num_features is None else num_features
        _check_positive_int("num_features", M)
        if isinstance(redraw, bool):
            interval = 1 if redraw else 0
        elif isinstance(redraw, int) and redraw > 0:
            interval = redraw
        else:
            raise ValueError(
                f"redraw must be True, False or a positive int (calls between "
                f"draws), got {redraw!r}"
            )
        if scale is not None and not (
            isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
        ):
            raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
        self.head_dim, self.M, self.seed, self.interval = head_dim, M, seed, interval
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("projection", orthogonal_gaussian(M, head_dim, seed).to(device, dtype))
        self.register_buffer("draws", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long, device=device))
        if interval:
            _count_call_on_host()  # built now, outside any graph

    def num_features(self, head_dim: int) -> int:
        return self.M

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim != self.head_dim:
            raise ValueError(
                f"this Favor feature map was built for head_dim={self.head_dim}, "
                f"got inputs with D={head_dim}; build Favor({head_dim}, ...)"
            )

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw the next projection (seed ``seed + draws + 1``)."""
        self.draws += 1
        W = orthogonal_gaussian(self.M, self.head_dim, self.seed + int(self.draws))
        self.projection.copy_(W)

    def begin_call(self) -> None:
        if self.training and self.interval:
            _count_call_on_host()(self)

    def _count_call(self) -> None:
        """The call count and the redraw it triggers: outside any graph (one graph break
        under torch.compile, in training mode with ``redraw`` set; none otherwise)."""
        if int(self.calls) % self.interval == 0 and int(self.calls) > 0:
            self.redraw_features()
        self.calls += 1

    def forward(self, x: Tensor) -> Features:
        x = x * math.sqrt(self.scale)
        logits = x @ self.projection.to(x.dtype).T  # (..., L, M)
        top = logits.detach().amax(-1, keepdim=True)  # (..., L, 1): values <= 1, cancels below
        values = torch.exp(logits - top)  # (..., L, M)
        log_scale = top.squeeze(-1) - 0.5 * (x * x).sum(-1) - 0.5 * math.log(self.M)  # (..., L)
        return Features(values, log_scale)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.M}, seed={self.seed}, "
            f"redraw={self.interval or False}, scale={self.scale:.4g}"
        )


_COUNT_CALL: list[Callable[[Favor], None]] = []


def _count_call_on_host():
    """``Favor._count_call`` kept out of graphs (``torch.compiler.disable``), built on first
    use so that ``import qkv`` does not import torch._dynamo."""
    if not _COUNT_CALL:
        _COUNT_CALL.append(
            torch.compiler.disable(
                Favor._count_call,
                reason="FAVOR+ redraws its projection on the host, from a CPU "
                "generator seeded by the call count",
            )
        )
    return _COUNT_CALL[0]


def default_num_features(head_dim: int) -> int:
    """The Performer paper's M = D ln D (at least D)."""
    return max(head_dim, round(head_dim * math.log(head_dim))) if head_dim > 1 else 1


def orthogonal_gaussian(M: int, D: int, seed: int) -> Tensor:
    """``(M, D)`` rows: blocks of D orthogonal directions, each row with a chi(D) length.

    Drawn in float64 on a CPU generator so a seed gives the same matrix everywhere. Under
    ``torch.compile`` the draw runs at trace time and enters the graph as a constant (a
    generator cannot be created inside a graph).
    """
    g = torch.Generator().manual_seed(int(seed))
    blocks = []
    for _ in range(-(-M // D)):
        q, r = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # rows orthonormal, sign fixed
    W = torch.cat(blocks)[:M]  # (M, D)
    lengths = torch.randn(M, D, generator=g, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (W * lengths).float()


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo with qkv
# (tests/test_compile.py compiles the "favor" map, so a change in torch shows there).
vars(orthogonal_gaussian)["_dynamo_marked_constant"] = True


def _check_positive_int(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")


_DEFAULT_FAVORS: dict[int, Favor] = {}


def _default_favor(D: int) -> Favor:
    """The ``"favor"`` map for head dim D, built once (a plain dict, which torch.compile reads
    as a constant; it ignores an ``lru_cache`` and would build the map again in every graph)."""
    if D not in _DEFAULT_FAVORS:
        _DEFAULT_FAVORS[D] = Favor(D, seed=0, dtype=torch.float32).eval()
    return _DEFAULT_FAVORS[D]


FEATURE_MAPS: dict[str, Callable[[int], FeatureMap]] = {
    "elu": lambda D: EluFeatureMap(),
    "relu": lambda D: ReluFeatureMap(),
    "favor": _default_favor,
    "performer": _default_favor,
}


def resolve_feature_map(feature_map, head_dim: int):
    """A name from :data:`FEATURE_MAPS`, a :class:`FeatureMap` or a plain function
    ``x -> features`` (a Tensor) as a callable returning :class:`Features`."""
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"unknown feature_map {feature_map!r}; choose one of {sorted(FEATURE_MAPS)}, "
                f"pass qkv.Favor(head_dim, num_features, seed=...) for Performer with your own "
                f"settings, or a function x -> nonnegative features"
            )
        fm = FEATURE_MAPS[feature_map](head_dim)
    elif callable(feature_map):
        fm = feature_map
    else:
        raise TypeError(
            f"feature_map must be a name, a FeatureMap or a function, got "
            f"{type(feature_map).__name__}"
        )
    if isinstance(fm, FeatureMap):
        fm.check_head_dim(head_dim)
        return fm
    return _PlainFunction(fm)


class _PlainFunction:
    """A user's ``x -> Tensor`` feature function, checked and wrapped as Features."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, x: Tensor) -> Features:
        out = self.fn(x)
        if isinstance(out, Features):
            return out
        if not isinstance(out, Tensor) or out.shape[:-1] != x.shape[:-1]:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"a feature_map function must map (..., L, D) {tuple(x.shape)} to "
                f"(..., L, M) features, got {got}"
            )
        return Features(out)
