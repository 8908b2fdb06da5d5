"""The viewer inline in Jupyter: the page of :func:`qkv.viz.html` in one sandboxed iframe.

::

    qkv.viz.show(cap, tokens=words, title="DecoderLM")   # a cell's last line shows it
    cap                                                  # so does a capture, or a trace, alone

``AttentionTrace``, ``MultiHeadTrace`` and ``Captured`` have ``_repr_html_`` (it imports this
module on first use: ``import qkv`` loads no viz); :func:`show` takes :func:`qkv.viz.html`'s
options (``tokens=``, ``title=``, ``batch=``, ``call=``, ``max_cells=``, ``scores=``, ...).

* **One iframe, nothing else.** The output is ``<iframe srcdoc="PAGE" sandbox="allow-scripts">``
  with ``PAGE`` the very text :func:`qkv.viz.html` would write with the same arguments,
  HTML-escaped. No script, style or id sits outside it.
* **Several views do not interfere.** Each iframe is its own document, so its ids and its
  ``window.qkvViewer`` are its own. Without ``allow-same-origin`` the page runs in an opaque
  origin: it cannot reach the notebook's DOM, storage or cookies, nor another view.
* **Offline.** The page loads nothing (no CDN, font or fetch), in Jupyter, in an exported
  HTML file, or with the network off. Front ends that show untrusted outputs without scripts
  (an unexecuted notebook on GitHub) show the frame without its drawing.
* **Size.** The file's budgets and bound (see :mod:`qkv.viz.html`) with ``max_cells``
  defaulting to ``2**22`` here (the file's is ``2**24``), since the page is saved inside the
  ``.ipynb``: its weights take at most ~11 MiB (base64 of 2 bytes a cell) whatever the
  length, for up to 1024 heads (past that, each head keeps the file's 4096-cell floor).
  Escaping adds ~13% to a small page (its script and JSON); the base64 payload needs none.
* **Cost.** Showing a trace computes one batch element's ``(H, T, S)`` weights, as the file
  does. A bare ``_repr_html_`` (a cell ending in ``trace``) refuses past ``2**26`` weights
  and says how to show them (:func:`show`, which always renders, or ``trace.select``).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from ..trace import AttentionTrace
from .html import _page_text

__all__ = ["InlineViewer", "show"]

_INLINE_CELLS = 1 << 22  # default max_cells of an inline page (the file's is 2**24)
_REPR_CELLS = 1 << 26  # a bare _repr_html_ shows at most this many weights (~1 s to encode)
_HEIGHT = 960  # px: the matrix view whole (941 px: header, 640 px matrix, labels, notes)


class InlineViewer:
    """A viewer page ready for a notebook: Jupyter shows it through :meth:`_repr_html_`.

    Attributes:
        page: The page itself, as :func:`qkv.viz.html` writes it (save it with
            ``Path("a.html").write_text(v.page)`` to open it outside the notebook).
        width, height: The iframe's CSS width and height.
    """

    def __init__(
        self, page: str, *, title: str, width: int | str = "100%", height: int = _HEIGHT
    ) -> None:
        self.page, self.title, self.width, self.height = page, title, width, height

    def _repr_html_(self) -> str:
        width = f"{self.width}px" if isinstance(self.width, int) else self.width
        return (
            f'<iframe srcdoc="{escape(self.page, quote=True)}" sandbox="allow-scripts" '
            f'title="{escape(self.title, quote=True)}" referrerpolicy="no-referrer" '
            f'style="width: {escape(width, quote=True)}; height: {self.height}px; '
            f'border: 1px solid #d7dbe3; border-radius: 4px;"></iframe>'
        )

    def __repr__(self) -> str:
        return f"InlineViewer({self.title!r}, {len(self.page.encode())} bytes)"


def show(
    obj: Any,
    tokens: Sequence[str] | None = None,
    *,
    width: int | str = "100%",
    height: int = _HEIGHT,
    max_cells: int = _INLINE_CELLS,
    **html_kwargs: Any,
) -> InlineViewer:
    """The viewer of ``obj`` inline in a notebook (the last line of a cell, or ``display()``).

    Args:
        obj: What :func:`qkv.viz.html` takes: a capture, a trace, a weights tensor, or a
            list/tuple/dict of traces or tensors.
        tokens: Labels of the positions, as in :func:`qkv.viz.html`.
        width: The iframe's width: pixels (int) or a CSS length (``"100%"``, ``"60em"``).
        height: The iframe's height in pixels.
        max_cells: Budget of stored cells over all heads, as in :func:`qkv.viz.html` (a
            quarter of the file's default: the page is saved in the notebook).
        **html_kwargs: Any other option of :func:`qkv.viz.html` (``title``, ``batch``,
            ``call``, ``steps``, ``scores``, ``rollout``, ``flow``, ``against``).

    Returns:
        An :class:`InlineViewer`; its ``page`` is the HTML text.

    Raises:
        TypeError, ValueError: As :func:`qkv.viz.html`; or a width/height that is not a size.

    Shape:
        Weights ``(B, H, T, S)``, ``(H, T, S)`` or ``(T, S)``; a capture record's probs
        ``(nb, nh, nr, S)``.
    """
    if isinstance(height, bool) or not isinstance(height, int) or height < 1:
        raise ValueError(f"height must be a positive int (pixels), got {height!r}")
    if isinstance(width, bool) or not (
        (isinstance(width, int) and width > 0) or (isinstance(width, str) and width.strip())
    ):
        raise ValueError(
            f"width must be a positive int (pixels) or a CSS length such as '100%', got {width!r}"
        )
    if "path" in html_kwargs:
        raise TypeError(
            "show takes no path: it shows the page inline; write a file with "
            "qkv.viz.html(obj, path)"
        )
    page = _page_text(obj, tokens, max_cells=max_cells, **html_kwargs)
    title = html_kwargs.get("title") or "qkv attention"
    return InlineViewer(page, title=f"qkv viewer: {title}", width=width, height=height)


def repr_html(obj: Any) -> str:
    """``obj._repr_html_()`` of a trace or a capture: its viewer, or a short note saying why
    not (too many weights to show unasked, or nothing the viewer can show)."""
    cells = _cells(obj)
    if cells is not None and cells > _REPR_CELLS:
        return _note(
            obj,
            f"not drawn; one batch element holds {cells:,} weights, more than "
            f"{_REPR_CELLS:,} (2**26) to compute unasked. Show a part, e.g. "
            f"qkv.viz.show(trace.select(heads=[0], rows=range(64))), or all of "
            f"it with qkv.viz.show(obj) (stored within max_cells={_INLINE_CELLS:,})",
        )
    try:
        return show(obj)._repr_html_()
    except (TypeError, ValueError) as e:
        return _note(obj, f"cannot show this: {e}")


def _note(obj: Any, text: str) -> str:
    return (
        f'<div class="qkv-note"><pre>{escape(repr(obj))}</pre>'
        f'<p style="color: #5b6475;">qkv viewer: {escape(text)}</p></div>'
    )


def _cells(obj: Any) -> int | None:
    """How many weights showing ``obj`` computes (one batch element); None when unknown."""
    if isinstance(obj, AttentionTrace):
        lead = tuple(obj.lse.shape[:-1])
        if len(lead) > 2 or 0 in obj.lse.shape:
            return None  # the viewer refuses these itself, saying why
        H, T = (lead[-1] if lead else 1), obj.lse.shape[-1]
        for name in ("_probs", "_scores"):
            if not callable(getattr(obj, name)):
                return H * T * getattr(obj, name).shape[-1]
        one = obj.select(
            batch=[0] if len(lead) == 2 else None, heads=[0] if lead else None, rows=[0]
        )  # (.., 1, S): one row only
        return H * T * one.probs.shape[-1]
    records = getattr(obj, "records", None)
    if isinstance(records, list):
        return sum(r.probs[0].numel() for r in records if r.call == 0 and r.probs.shape[0])
    return None
