"""Pictures of attention: heatmaps of the weights in a trace, and a self-contained HTML viewer
(:func:`html`: one offline page with head, matrix, overview and explain views).

viz reads traces only (STYLE.md 17) and imports matplotlib lazily, inside the functions that
draw, so ``import qkv.viz`` works without it (install ``qkv[viz]`` to plot).
"""
from .heatmap import heatmap_axes, heatmap_figure, plot_attention
from .html import html

__all__ = ["heatmap_axes", "heatmap_figure", "html", "plot_attention"]
