"""Attention rollout and attention flow (Abnar & Zuidema 2020), over a capture or plain maps.

Both read the self-attention weights of L layers as a layered graph: node ``(l, t)`` is token
``t`` after layer ``l`` (``l = 0`` the inputs), and the edge ``(l-1, i) -> (l, j)`` carries
``Â_l[j, i]``, layer ``l``'s weights with the residual connection mixed in:

    Â_l = renorm((1 - residual) * A_l + residual * I)          # the paper: residual = 0.5

``renorm`` divides each row by its sum (a no-op for rows that already sum to 1; the paper
does it too). ``A_l`` is the mean over heads, or each head alone (``heads="per_head"``: head
``h`` of every layer forms one chain, so every layer must have the same number of heads).

* **rollout**: ``R = Â_L @ ... @ Â_1``; ``R[j, i]`` is the share of output ``j`` that comes
  from input ``i`` summed over every path. Rows sum to 1.
* **flow**: ``F[j, i]`` is the maximum flow from node ``(0, i)`` to node ``(L, j)`` with the
  ``Â`` as capacities: the paths may not use an edge beyond its weight in total.

Encoders and decoders alike: a causal layer's weights are 0 above the diagonal, so are its
rollout and flow; nothing needs to be told. GQA: a capture holds weights per query head, so a
GQA layer is read like any other.

Padding (``key_mask`` ``(B, T)``, True = a real token, as the modules take it): each layer's
weights on padded keys are set to 0 and each real row renormalised over the real keys (a no-op
when the model masked the padding itself); a padded query row becomes the identity row, so
nothing flows through a padded position. In the result, padded rows and columns are 0 and
each real row sums to 1 over the real tokens.

Shape alphabet: B batch, H heads, T tokens, L layers, P output positions asked for.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..capture import Captured, CapturedAttention
from ..trace import AttentionTrace

__all__ = ["flow", "rollout"]

_SCIPY_SCALE = 2**24  # scipy's max-flow takes int32 capacities: weights * 2^24, rounded


def rollout(
    source,
    *,
    residual: float = 0.5,
    heads: str = "mean",
    key_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
    call: int = 0,
) -> Tensor:
    """Attention rollout: how much each input token reaches each output position.

    Args:
        source: A :class:`qkv.Captured` (every row of each layer kept: ``rows=None``; heads
            and batch may be bounded, the mean then runs over the kept heads), or a list of
            per-layer weights, bottom layer first: ``(B, H, T, T)`` tensors (``(H, T, T)``
            reads as B = 1) or traces (their ``probs``).
        residual: Weight of the identity mixed into each layer, in [0, 1]; 0.5 as the paper.
            With 0, a row that attends to nothing stays 0.
        heads: ``"mean"`` (the paper) or ``"per_head"``.
        key_mask: ``(B, T)`` bool, True = a real token; for a capture, B is the model's
            batch (the capture's kept batch elements are picked from it).
        layers: For a capture, which layers (its layer numbers), bottom first; default all.
            Leave out cross-attention (S != T), which rollout cannot chain.
        call: For a capture, which call of each layer (0: the first forward; ``generate``
            records one call per step).

    Returns:
        ``R``, float64 for float64 weights, else float32: ``R[b, j, i]`` the share of output
        position ``j`` (top layer) that comes from input token ``i``.

    Shape:
        ``(B, T, T)``; ``(B, H, T, T)`` with ``heads="per_head"``.

    Example:
        >>> with qkv.capture(model) as cap:
        ...     model(x)
        >>> R = qkv.analysis.rollout(cap)   # (B, T, T)
        >>> R[0, -1]                         # saliency of every input for the last position
    """
    maps, dtype = _layer_maps(source, layers, call)
    aug, real = _augmented(maps, residual, heads, key_mask, source)  # (L, B, H', T, T)
    R = aug[0]
    for A in aug[1:]:
        R = A @ R  # (B, H', T, T)
    R = R * (real[:, None, :, None] & real[:, None, None, :])  # padded rows and columns: 0
    return (R[:, 0] if heads == "mean" else R).to(dtype)


def flow(
    source,
    *,
    residual: float = 0.5,
    heads: str = "mean",
    key_mask: Tensor | None = None,
    positions=None,
    normalize: bool = True,
    solver: str = "networkx",
    layers: Sequence[int] | None = None,
    call: int = 0,
) -> Tensor:
    """Attention flow: the maximum flow from each input token to each output position.

    The graph and its capacities are those of :func:`rollout` (see the module docstring);
    ``F[j, i]`` is the max-flow value from input node ``(0, i)`` to output node ``(L, j)``.
    Each value is at most the capacity out of the source, ``sum_j' Â_1[j', i]``, and into the
    sink, 1. With ``normalize`` (the paper's code does it) each output's row is divided by its
    sum, so rows sum to 1 as rollout's do.

    Cost: one max-flow per (batch element, head chain, output position, reachable input), on a
    graph of ``(L + 1) * T`` nodes and up to ``L * T^2`` edges (zero weights, so a causal
    layer's upper triangle, are left out; inputs rollout says cannot reach an output are
    skipped, so a causal model needs about half the flows). networkx's preflow-push is
    O(V^2 sqrt(E)) per flow, scipy's Dinic O(V^2 E). Measured by ``_measure()`` on one busy
    CPU core (a 2-core machine shared with other jobs) for 6 layers x 64 tokens (24,576
    edges), one batch element, head mean, every output (``positions=None``): networkx 307 s
    bidirectional (4,096 flows, ~75 ms each) and 81 s causal (2,080 flows); scipy 7.3 s and
    1.9 s. Ask for the outputs you will look at (``positions=[0]`` for a CLS token, ``[-1]``
    for a decoder's last) to divide that by T.

    Args:
        source, residual, heads, key_mask, layers, call: As :func:`rollout`.
        positions: Output positions (top-layer tokens) to compute: None (all T), an int or a
            list of ints; negative ones count from the end.
        normalize: Divide each output's flows by their sum (a padded output's row stays 0).
        solver: ``"networkx"`` (exact in float64 arithmetic; the paper's reference code uses
            it) or ``"scipy"`` (``scipy.sparse.csgraph.maximum_flow``, Dinic, ~40x faster: its
            capacities are integers, the weights times 2^24 rounded, so a flow may differ from
            the exact one by at most 2^-25 per edge of a minimum cut).

    Returns:
        The flows, float64 for float64 weights, else float32; rows of padded outputs are 0.

    Shape:
        ``(B, P, T)`` (P = T with ``positions=None``); ``(B, H, P, T)`` with
        ``heads="per_head"``.

    Raises:
        ImportError: networkx (or scipy for ``solver="scipy"``) is not installed; both come
            with ``pip install qkv[analysis]``.
    """
    if solver not in ("networkx", "scipy"):
        raise ValueError(f"solver must be 'networkx' or 'scipy', got {solver!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be True or False, got {normalize!r}")
    max_flow = _networkx_solver() if solver == "networkx" else _scipy_solver()
    maps, dtype = _layer_maps(source, layers, call)
    aug, real = _augmented(maps, residual, heads, key_mask, source)  # (L, B, H', T, T)
    L, B, Hc, T, _ = aug.shape
    pos = _positions(positions, T)
    reach = aug[0]
    for A in aug[1:]:
        reach = A @ reach  # (B, H', T, T): > 0 where some path joins input i to output j
    out = torch.zeros(B, Hc, len(pos), T, dtype=torch.float64, device=aug.device)
    for b in range(B):
        for h in range(Hc):
            solve = max_flow(aug[:, b, h])
            for p, j in enumerate(pos):
                if not real[b, j]:
                    continue
                for i in range(T):
                    if real[b, i] and reach[b, h, j, i] > 0:
                        out[b, h, p, i] = solve(i, L * T + j)
    if normalize:
        total = out.sum(-1, keepdim=True)  # (B, H', P, 1)
        out = torch.where(total > 0, out / total.clamp_min(1e-300), out)
    return (out[:, 0] if heads == "mean" else out).to(dtype)


def _networkx_solver():
    try:
        import networkx as nx
        from networkx.algorithms.flow import build_residual_network, preflow_push
    except ImportError:
        raise ImportError(
            "qkv.analysis.flow needs networkx: pip install qkv[analysis] "
            "(or networkx), or pass solver='scipy'"
        ) from None

    def prepare(aug: Tensor):  # (L, T, T) capacities of one chain
        L, T, _ = aug.shape
        G = nx.DiGraph()
        G.add_nodes_from(range((L + 1) * T))
        for layer in range(L):
            j, i = aug[layer].nonzero(as_tuple=True)
            caps = aug[layer][j, i].tolist()
            G.add_edges_from(
                (layer * T + a, (layer + 1) * T + c, {"capacity": w})
                for a, c, w in zip(i.tolist(), j.tolist(), caps)
            )
        R = build_residual_network(G, "capacity")  # built once, reset by each flow

        def solve(s: int, t: int) -> float:
            return preflow_push(G, s, t, residual=R, value_only=True).graph["flow_value"]

        return solve

    return prepare


def _scipy_solver():
    try:
        import numpy as np
        from scipy.sparse import csr_array
        from scipy.sparse.csgraph import maximum_flow
    except ImportError:
        raise ImportError(
            "qkv.analysis.flow(solver='scipy') needs scipy: pip install "
            "qkv[analysis] (or scipy), or use solver='networkx'"
        ) from None

    def prepare(aug: Tensor):  # (L, T, T) capacities of one chain
        L, T, _ = aug.shape
        rows, cols, caps = [], [], []
        for layer in range(L):
            j, i = aug[layer].nonzero(as_tuple=True)
            rows.append(i + layer * T)
            cols.append(j + (layer + 1) * T)
            caps.append(torch.round(aug[layer][j, i] * _SCIPY_SCALE))
        n = (L + 1) * T
        graph = csr_array(
            (
                torch.cat(caps).numpy().astype(np.int32),
                (torch.cat(rows).numpy(), torch.cat(cols).numpy()),
            ),
            shape=(n, n),
        )

        def solve(s: int, t: int) -> float:
            return maximum_flow(graph, s, t, method="dinic").flow_value / _SCIPY_SCALE

        return solve

    return prepare


def _layer_maps(source, layers, call: int) -> tuple[list[Tensor], torch.dtype]:
    """Each layer's weights ``(B, H, T, T)``, bottom first, and the dtype to answer in."""
    if isinstance(source, Captured):
        maps = [rec.probs for rec in _capture_records(source, layers, call)]
    elif isinstance(source, (list, tuple)):
        if layers is not None:
            raise ValueError("layers= picks layers of a capture; slice the list instead")
        maps = [item.probs if isinstance(item, AttentionTrace) else item for item in source]
    else:
        raise TypeError(
            f"rollout/flow take a qkv.Captured or a list of (B, H, T, T) weights, "
            f"got {type(source).__name__}"
        )
    if not maps:
        raise ValueError("rollout/flow need at least one layer of weights, got none")
    out: list[Tensor] = []
    for layer, given in enumerate(maps):
        if not isinstance(given, Tensor):
            raise TypeError(
                f"layer {layer}: expected a Tensor or a trace, got {type(given).__name__}"
            )
        A = given.unsqueeze(0) if given.dim() == 3 else given  # (H, T, T) -> (1, H, T, T)
        if A.dim() != 4 or A.shape[-1] != A.shape[-2]:
            raise ValueError(
                f"layer {layer}: weights must be (B, H, T, T) self-attention, got {tuple(A.shape)}"
            )
        if out and A.shape[0] != out[0].shape[0]:
            raise ValueError(f"layer {layer} has B={A.shape[0]}, layer 0 B={out[0].shape[0]}")
        if out and A.shape[-1] != out[0].shape[-1]:
            raise ValueError(
                f"layer {layer} has T={A.shape[-1]}, layer 0 T={out[0].shape[-1]}; "
                f"rollout chains layers over one sequence"
            )
        out.append(A.detach().cpu())
    dtype = torch.float64 if out[0].dtype == torch.float64 else torch.float32
    return out, dtype


def _capture_records(cap: Captured, layers, call: int) -> list[CapturedAttention]:
    """The records of ``layers`` (default all recorded), call ``call``, checked for rollout."""
    by_layer: dict[int, CapturedAttention] = {}
    for rec in cap.records:
        if rec.call == call:
            by_layer.setdefault(rec.layer, rec)
    if not by_layer:
        raise ValueError(
            f"the capture holds no call {call} of any layer ({len(cap.records)} records)"
        )
    chosen = sorted(by_layer) if layers is None else list(layers)
    recs: list[CapturedAttention] = []
    for layer in chosen:
        if layer not in by_layer:
            raise ValueError(
                f"layer {layer} (call {call}) is not in the capture; recorded "
                f"layers: {sorted(by_layer)}"
            )
        rec = by_layer[layer]
        _, _, T, S = rec.shape
        if T != S:
            raise ValueError(
                f"layer {layer} ({rec.name!r}) has T={T} queries and S={S} keys: "
                f"rollout chains self-attention over one sequence; leave it out "
                f"with layers=[...]"
            )
        if len(rec.rows) != T or not torch.equal(rec.rows, torch.arange(T, device=rec.rows.device)):
            raise ValueError(
                f"layer {layer} kept {len(rec.rows)} of its {T} query rows: rollout "
                f"needs every row of every layer; capture with rows=None (heads= "
                f"and batch= may stay bounded)"
            )
        if recs and not torch.equal(rec.batch, recs[0].batch):
            raise ValueError(
                f"layer {layer} kept batch {rec.batch.tolist()}, layer {chosen[0]} "
                f"{recs[0].batch.tolist()}"
            )
        recs.append(rec)
    return recs


def _augmented(
    maps: list[Tensor], residual: float, heads: str, key_mask: Tensor | None, source
) -> tuple[Tensor, Tensor]:
    """``(Â, real)``: each layer's weights with padding removed and the residual mixed in
    (float64), and which tokens are real.

    Shape:
        -> ``(L, B, H', T, T)`` (H' = 1 for the head mean), ``(B, T)`` bool.
    """
    if (
        isinstance(residual, bool)
        or not isinstance(residual, (int, float))
        or not 0 <= residual <= 1
    ):
        raise ValueError(f"residual is the weight of the identity, in [0, 1]; got {residual!r}")
    if heads not in ("mean", "per_head"):
        raise ValueError(f"heads must be 'mean' or 'per_head', got {heads!r}")
    B, T = maps[0].shape[0], maps[0].shape[-1]
    if heads == "per_head" and len({A.shape[1] for A in maps}) > 1:
        raise ValueError(
            f"heads='per_head' chains head h of every layer, but the layers have "
            f"{[A.shape[1] for A in maps]} heads; use heads='mean'"
        )
    real = _real(key_mask, B, T, source, maps[0].device)  # (B, T)
    eye = torch.eye(T, dtype=torch.float64, device=maps[0].device)  # (T, T)
    out = []
    for weights in maps:
        A = weights.double()  # (B, H, T, T)
        A = A.mean(1, keepdim=True) if heads == "mean" else A  # (B, H', T, T)
        A = A * real[:, None, None, :]  # no weight on a padded key
        A = A * real[:, None, :, None]  # a padded query: an empty row, then the identity
        total = A.sum(-1, keepdim=True)
        A = torch.where(total > 0, A / total.clamp_min(1e-300), A)  # renormalise over real keys
        A = (1 - residual) * A + residual * eye  # (B, H', T, T)
        A = torch.where(A.sum(-1, keepdim=True) > 0, A, eye)  # residual 0: padded row = I
        out.append(A / A.sum(-1, keepdim=True))  # the paper's renormalisation
    return torch.stack(out), real


def _real(key_mask: Tensor | None, B: int, T: int, source, device) -> Tensor:
    if key_mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        raise TypeError(
            f"key_mask must be a bool tensor (B, T), True = a real token; got "
            f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}"
        )
    key_mask = key_mask.cpu()
    if isinstance(source, Captured) and key_mask.dim() == 2:
        rec = next(r for r in source.records)
        if key_mask.shape[0] == rec.shape[0]:
            key_mask = key_mask[rec.batch]  # the model's batch -> the kept elements
    if tuple(key_mask.shape) != (B, T):
        raise ValueError(f"key_mask must be (B, T) = ({B}, {T}), got {tuple(key_mask.shape)}")
    return key_mask


def _positions(positions, T: int) -> list[int]:
    if positions is None:
        return list(range(T))
    items = [positions] if isinstance(positions, int) else list(positions)
    bad = [p for p in items if isinstance(p, bool) or not isinstance(p, int) or not -T <= p < T]
    if bad or not items:
        raise ValueError(f"positions must be ints in -{T}..{T - 1} (T={T}), got {positions!r}")
    return [p % T for p in items]


def _measure(L: int = 6, T: int = 64, causal: bool = False, solver: str = "networkx") -> float:
    """Seconds for ``flow`` over every output of one random ``(1, 1, T, T)`` x L stack: the
    numbers in :func:`flow`'s docstring."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(L, 1, 1, T, T, generator=g, dtype=torch.float64)
    if causal:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    start = time.perf_counter()
    flow(list(scores.softmax(-1)), solver=solver)
    return time.perf_counter() - start
