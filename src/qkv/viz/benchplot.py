"""Pictures of a benchmark run: time and peak memory against sequence length, per case.

Reads the plain records that ``qkv bench`` writes (dicts with case, T, dtype, mode, impl,
status, time_s, peak_extra_mib) and imports nothing else from qkv; matplotlib is imported
inside :func:`plot_bench`, drawing on a bare Figure with the Agg canvas (headless, and the
caller's pyplot state is left alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

__all__ = ["plot_bench"]

# One colour per implementation, one line style per (dtype, mode): 16 lines stay readable
# with two small legends instead of one of 16 entries.
_COLOURS = {
    "tiled": "tab:blue",
    "auto": "tab:green",
    "torch-dense": "tab:orange",
    "reference": "tab:gray",
    "linear": "tab:purple",
    "performer": "tab:brown",
    "torch": "tab:red",
}
_LineStyle = Literal["-", "--", ":", "-."]  # the matplotlib line styles used here
_STYLES: dict[tuple[str, str], _LineStyle] = {
    ("fp32", "fwd"): "-",
    ("fp32", "fwdbwd"): "--",
    ("bf16", "fwd"): ":",
    ("bf16", "fwdbwd"): "-.",
}
_MARKERS = {"fp32": "o", "bf16": "s"}
_PANELS = (
    ("time_s", 1e3, "time per call (ms)", "time"),
    ("peak_extra_mib", 1.0, "peak extra memory (MiB)", "peak memory"),
)


def plot_bench(
    records: Sequence[dict],
    path: str | Path,
    *,
    dpi: int = 120,
    marks: Mapping[str, Sequence[tuple[float, str]]] | None = None,
) -> Path:
    """Write a PNG: per case a row of two log-log panels, time vs T and peak memory vs T,
    one line per implementation, dtype and mode. Records not "ok" are left out.

    Args:
        records: Benchmark records as ``qkv bench`` writes them.
        path: Where to write the PNG (its folder is created).
        dpi: Resolution.
        marks: Per case, lengths to mark on its time panel with a labelled vertical line
            (``qkv bench`` marks where linear attention overtakes torch's SDPA).

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # optional dependency: only when drawing

    ok = [r for r in records if r.get("status") == "ok"]
    cases = list(dict.fromkeys(r["case"] for r in records)) or ["(no records)"]
    fig = Figure(figsize=(11, 3.4 * len(cases) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(cases), 2, squeeze=False)
    for row, case in zip(axes, cases):
        for ax, panel in zip(row, _PANELS):
            _draw_panel(ax, [r for r in ok if r["case"] == case], case, *panel)
        _mark(row[0], (marks or {}).get(case, ()))
    _legends(fig, ok)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return path


def _draw_panel(
    ax, records: list[dict], case: str, field: str, factor: float, ylabel: str, what: str
) -> None:
    """One panel: a line per (impl, dtype, mode) through its points, sorted by T."""
    lines: dict[tuple, list[tuple[int, float]]] = {}
    for r in records:
        if r.get(field) is not None and r[field] > 0:  # log axes take positive values only
            lines.setdefault((r["impl"], r["dtype"], r["mode"]), []).append(
                (r["T"], r[field] * factor)
            )
    for (impl, dtype, mode), points in sorted(lines.items()):
        T, y = zip(*sorted(points))
        ax.plot(
            T,
            y,
            color=_COLOURS.get(impl, "black"),
            linestyle=_STYLES.get((dtype, mode), "-"),
            marker=_MARKERS.get(dtype, "x"),
            markersize=4,
            label=f"{impl} {dtype} {mode}",
        )
    ax.set_title(f"{case}: {what}")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel(ylabel)
    if lines:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({T for points in lines.values() for T, _ in points})
        ax.set_xticks(lengths, [str(T) for T in lengths])  # the measured T, not powers of 2
        ax.grid(True, which="both", alpha=0.3)
    else:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)


def _mark(ax, marks: Sequence[tuple[float, str]]) -> None:
    """Dashed vertical lines at the marked lengths, labelled in the panel's own legend."""
    for i, (T, label) in enumerate(marks):
        ax.axvline(
            T,
            color=("black", "dimgray", "darkgray")[i % 3],
            linestyle=(":", "--", "-.")[i % 3],
            linewidth=1.0,
            label=f"crossover: {label}",
        )
    if marks:
        ax.legend(
            handles=[h for h in ax.get_lines() if h.get_label().startswith("crossover")],
            fontsize="x-small",
            loc="upper left",
            frameon=False,
        )


def _legends(fig, records: list[dict]) -> None:
    """Two figure legends: colour = implementation, line style = dtype and mode."""
    from matplotlib.lines import Line2D

    impls = list(dict.fromkeys(r["impl"] for r in records))
    styles = list(dict.fromkeys((r["dtype"], r["mode"]) for r in records))
    if not impls:
        return
    colour = [Line2D([], [], color=_COLOURS.get(i, "black"), label=i) for i in impls]
    style = [
        Line2D(
            [],
            [],
            color="black",
            linestyle=_STYLES.get(s, "-"),
            marker=_MARKERS.get(s[0], "x"),
            markersize=4,
            label=f"{s[0]} {'fwd+bwd' if s[1] == 'fwdbwd' else s[1]}",
        )
        for s in styles
    ]
    fig.legend(
        handles=colour + style,
        loc="outside lower center",
        ncols=len(colour) + len(style),
        fontsize="small",
        frameon=False,
    )
