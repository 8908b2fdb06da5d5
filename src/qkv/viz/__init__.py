"""Pictures of attention: heatmaps of the weights in a trace, and a self-contained HTML viewer
(:func:`html`: one offline page with head, matrix, overview and explain views; :func:`show`:
the same page inline in a notebook, one sandboxed iframe).

viz reads traces only (STYLE.md 17) and imports matplotlib lazily, inside the functions that
draw, so ``import qkv.viz`` works without it (install ``qkv[viz]`` to plot).
"""

from .heatmap import heatmap_axes, heatmap_figure, plot_attention
from .html import html
from .notebook import InlineViewer, show

__all__ = ["InlineViewer", "heatmap_axes", "heatmap_figure", "html", "plot_attention", "show"]
