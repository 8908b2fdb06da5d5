"""Attention-weight heatmaps: one panel per head, queries down, keys across.

Draws on a bare ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot, so it
works headless and leaves the caller's matplotlib backend and open figures alone.

Shape alphabet: H heads, T query length, S key length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from ..trace import AttentionTrace

if TYPE_CHECKING:  # matplotlib is optional: imported only where a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["heatmap_axes", "heatmap_figure", "plot_attention"]

_MAX_PANEL = 12.0  # inches: a 2,000-token map stays a picture, not a poster
_MAX_COLS = 4  # panels per row before wrapping


def plot_attention(
    probs: Tensor | AttentionTrace,
    path: str | Path,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    annotate_max: int = 12,
    dpi: int = 150,
) -> Path:
    """Write the attention weights as a PNG of heatmaps, one panel per head.

    Args:
        probs: Attention weights, or a trace whose ``probs`` are drawn.
        path: Where to write the image (``.png`` is added to a name without a suffix; the
            suffix picks the format); missing parent folders are created.
        query_labels: Tick labels of the T queries (y axis); default ``1..T``.
        key_labels: Tick labels of the S keys (x axis); default ``1..S``.
        titles: One title per panel; default ``head 1..head H``.
        annotate_max: Write each weight in its cell when T and S are at most this.
        dpi: Resolution of the PNG.

    Returns:
        The path written.

    Shape:
        probs ``(H, T, S)`` or ``(T, S)`` (one panel).
    """
    fig = heatmap_figure(
        probs,
        query_labels=query_labels,
        key_labels=key_labels,
        titles=titles,
        annotate_max=annotate_max,
    )
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")  # what savefig would write; return the real name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def heatmap_figure(
    probs: Tensor | AttentionTrace,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    annotate_max: int = 12,
) -> Figure:
    """The figure :func:`plot_attention` saves: heatmap panels and one shared colorbar.

    Args are those of :func:`plot_attention`. Count the panels with :func:`heatmap_axes`.

    Returns:
        A ``matplotlib.figure.Figure`` on the Agg canvas (no pyplot state is touched).

    Shape:
        probs ``(H, T, S)`` or ``(T, S)``.
    """
    weights = _as_heads(probs)  # (H, T, S)
    H, T, S = weights.shape
    query_labels = _labels(query_labels, T, "query_labels")
    key_labels = _labels(key_labels, S, "key_labels")
    titles = _labels(titles, H, "titles", default=[f"head {h + 1}" for h in range(H)])
    fig, axes = _panels(H, T, S)
    vmax = max(float(weights.max()), 1e-12)
    annotate = max(T, S) <= annotate_max
    for ax, w, title in zip(axes, weights.tolist(), titles, strict=True):
        image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax)
        _label_axes(ax, title, query_labels, key_labels)
        if annotate:
            _annotate(ax, w, vmax)
    fig.colorbar(image, ax=axes, label="attention weight", shrink=0.9)
    return fig


def heatmap_axes(fig: Figure) -> list[Axes]:
    """The heatmap panels of a :func:`heatmap_figure`, without its colorbar."""
    return [ax for ax in fig.axes if ax.images]


def _as_heads(probs: Tensor | AttentionTrace) -> Tensor:
    """Weights as a float64 ``(H, T, S)`` CPU tensor."""
    if isinstance(probs, AttentionTrace):
        probs = probs.probs
    if not isinstance(probs, Tensor):
        raise TypeError(
            f"probs must be a torch.Tensor or an AttentionTrace, got {type(probs).__name__}"
        )
    if probs.dim() not in (2, 3) or probs.numel() == 0:
        raise ValueError(
            f"probs must be (H, T, S) or (T, S) and non-empty, got shape "
            f"{tuple(probs.shape)}; for a batch pass one element, probs[b]"
        )
    if probs.dim() == 2:
        probs = probs.unsqueeze(0)  # (1, T, S)
    return probs.detach().double().cpu()  # (H, T, S)


def _labels(
    labels: Sequence[str] | None, n: int, name: str, default: list[str] | None = None
) -> list[str]:
    if labels is None:
        return default or [str(i + 1) for i in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} entries, need {n}")
    return labels


def _panels(H: int, T: int, S: int) -> tuple[Figure, list[Axes]]:
    """A figure with H panels in rows of at most ``_MAX_COLS``, sized to the cells."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # optional dependency
        raise ImportError("plotting attention needs matplotlib: pip install 'qkv[viz]'") from e
    cols = min(H, _MAX_COLS)
    rows = math.ceil(H / cols)
    n = max(T, S)  # inches per cell: panels grow with the map up to 12 inches a side
    cell = 0.55 if n <= 12 else min(max(0.12, 6.0 / n), _MAX_PANEL / n)
    width, height = max(2.4, cell * S + 1.0), max(2.2, cell * T + 1.0)
    fig = Figure(figsize=(cols * width + 1.2, rows * height), layout="constrained")
    FigureCanvasAgg(fig)  # headless canvas; savefig writes PNG through Agg
    grid = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in grid[H:]:
        fig.delaxes(ax)  # the last row's spare slots
    return fig, grid[:H]


def _label_axes(ax: Axes, title: str, query_labels: list[str], key_labels: list[str]) -> None:
    ax.set_title(title)
    long = max(len(s) for s in key_labels) > 3 or len(key_labels) > 8
    xs, ys = _every(len(key_labels)), _every(len(query_labels))
    ax.set_xticks(xs, labels=[key_labels[i] for i in xs], rotation=90 if long else 0)
    ax.set_yticks(ys, labels=[query_labels[i] for i in ys])
    ax.set_xlabel("key")
    ax.set_ylabel("query")


def _every(n: int, most: int = 40) -> list[int]:
    """Tick positions: all of them, or every k-th when more than ``most`` would crowd."""
    return list(range(0, n, math.ceil(n / most)))


def _annotate(ax: Axes, w: list[list[float]], vmax: float) -> None:
    """Each weight in its cell, light text on the dark (low) end of viridis."""
    size = 9 if max(len(w), len(w[0])) <= 6 else 7
    for i, row in enumerate(w):
        for j, x in enumerate(row):
            ax.text(
                j,
                i,
                f"{x:.2f}",
                ha="center",
                va="center",
                fontsize=size,
                color="white" if x < 0.6 * vmax else "black",
            )
