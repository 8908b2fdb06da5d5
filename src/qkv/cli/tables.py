"""Aligned plain-text tables of small matrices, for the CLI."""

from __future__ import annotations

from torch import Tensor

__all__ = ["format_matrix"]


def format_matrix(
    title: str,
    m: Tensor,
    row_labels: list[str] | None = None,
    col_labels: list[str] | None = None,
    digits: int = 6,
) -> str:
    """A titled, right-aligned table of a 2-D tensor, one row per line.

    Shape:
        m ``(R, C)``.
    """
    rows = m.detach().double().tolist()
    row_labels = row_labels or [str(i) for i in range(len(rows))]
    cells = [[_fmt(x, digits) for x in r] for r in rows]
    header = col_labels or [str(j) for j in range(m.shape[1])]
    width = max([len(c) for r in cells for c in r] + [len(h) for h in header] + [1])
    lead = max(len(r) for r in row_labels + [""])
    lines = [title, " " * lead + "  " + "  ".join(h.rjust(width) for h in header)]
    for label, r in zip(row_labels, cells):
        lines.append(label.ljust(lead) + "  " + "  ".join(c.rjust(width) for c in r))
    return "\n".join(lines)


def _fmt(x: float, digits: int) -> str:
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if x == int(x) and abs(x) < 1e9:
        return str(int(x))
    return f"{x:.{digits}g}"
