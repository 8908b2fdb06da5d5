"""``qkv view``: one self-contained HTML page of a model's attention weights.

Thin: parses the flags, tells the source apart, captures it with :mod:`qkv.sources` and writes
the page with :func:`qkv.viz.html`. Three sources, told apart by what ``SOURCE`` is:

* a file: a capture saved with ``Captured.save`` (read by :func:`qkv.load_capture`);
* a ``qkv train`` run folder (it holds ``checkpoint.pt``) and ``--input "3 1 4 1 5"``: the
  run's model, rebuilt from its recipe and weights, reads the input tokenised by the task's
  vocabulary (a sequence-to-sequence model first decodes it greedily, then the teacher-forced
  forward is captured, as ``qkv train``'s picture);
* a Hugging Face model folder (it holds ``config.json``; needs ``qkv[hf]``) and ``--text``:
  ``AutoTokenizer``/``AutoModel.from_pretrained(folder, local_files_only=True)`` (nothing is
  downloaded), run with ``attn_implementation="qkv"``.

``--layers``, ``--heads`` and ``--rows`` bound a new capture (``0,3``, ``8000:8016``, ``-1``;
layers also by module name): a long text's full weights are ``layers x heads x T x T``.

What the page adds (:mod:`qkv.analysis`, imported only when asked for):

* ``--scores``: the Head scores tab, :func:`qkv.analysis.head_scores` of the capture (every
  head sorted and highlighted by a chosen score, with the rows each score used);
  ``--induction-period N`` scores induction on an input that repeats every N tokens.
* ``--rollout``: :func:`qkv.analysis.rollout` as one more layer entry (its matrix) and the
  Saliency tab (one output position's share from each input token). It needs every query
  row of every self-attention layer (no ``--rows``). ``--rollout per-head`` chains head ``h``
  of every layer alone (``heads="per_head"``): an entry of H heads, a head selector in
  Saliency.
* ``--flow POS``: :func:`qkv.analysis.flow` of one output position (``-1`` the last): one max
  flow per input token (scipy's when installed, else networkx's: seconds at a few hundred
  tokens, minutes beyond), shown beside the rollout.
* ``--against B.pt``: a saved capture of the same architecture, input length and bounds as
  what ``SOURCE`` gives (a saved capture, or a run's or a Hugging Face model's new capture):
  :func:`qkv.analysis.compare` of the two; the page shows ``SOURCE - B`` per head on a signed
  colour scale and ranks the heads by how much they changed (mean or max ``|difference|``),
  the comparison's own numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..capture import Captured
from ..sources import HF_CONFIG, hugging_face_capture, load_run, run_capture, saved_capture
from ..training import CHECKPOINT, run_directory

__all__ = ["DEFAULT_OUT", "add_parser", "load_run", "parse_index", "run_view"]

DEFAULT_OUT = "out/view/attention.html"


def _rollout_kind(value: str) -> str:
    """``--rollout``'s optional value; a SOURCE written after the flag lands here, so say so."""
    if value not in ("mean", "per-head"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not mean or per-head (SOURCE goes before --rollout, or write "
            f"--rollout mean SOURCE)"
        )
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``qkv view``."""
    p = sub.add_parser(
        "view",
        help="write a self-contained HTML page of a model's attention weights",
        description="Write one offline HTML page of attention weights, by layer and head, "
        "with the tokens as labels: from a capture saved with Captured.save, from a qkv train "
        "run folder and --input, or from a Hugging Face model folder and --text (qkv[hf]; "
        "local files only, nothing is downloaded).",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a saved capture (.pt), a qkv train run folder, or a Hugging Face model folder",
    )
    p.add_argument(
        "--input",
        metavar="TOKENS",
        help='for a run folder: the input, tokens separated by spaces ("3 1 4 1 5")',
    )
    p.add_argument("--text", help="for a Hugging Face model folder: the text to tokenise")
    p.add_argument(
        "--layers", metavar="LIST", help="layers to capture: numbers (0,3 or 0:4) or module names"
    )
    p.add_argument("--heads", metavar="LIST", help="query heads to capture (0,3 or 0:4)")
    p.add_argument(
        "--rows", metavar="LIST", help="query rows to capture (8000:8016, or -1 for the last)"
    )
    p.add_argument(
        "--scores",
        action="store_true",
        help="add the Head scores tab: every head scored (previous-token, self, "
        "first-token, local, entropy, induction), sorted by a chosen score",
    )
    p.add_argument(
        "--induction-period",
        metavar="N",
        help="with --scores: the input repeats every N tokens from position 0 "
        "(qkv.analysis.induction_input); scores induction",
    )
    p.add_argument(
        "--rollout",
        nargs="?",
        const="mean",
        type=_rollout_kind,
        metavar="{mean,per-head}",
        help="add attention rollout over all layers (of the head mean, or "
        "'per-head': head h of every layer alone), as a matrix and as token "
        "saliency per output position (needs every query row: no --rows)",
    )
    p.add_argument(
        "--flow",
        metavar="POS",
        help="add attention flow into one output position (-1: the last); one max "
        "flow per input token, slow beyond a few hundred tokens",
    )
    p.add_argument(
        "--against",
        metavar="B.pt",
        help="a saved capture of the same architecture, input length and bounds: "
        "show the difference SOURCE - B.pt per head and rank the heads by how much "
        "they changed",
    )
    p.add_argument("--title", help="the page's title (default: what it shows)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="for a run folder: where its task's data is cached (as qkv train's)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="FILE.html",
        help=f"the page to write (default {DEFAULT_OUT})",
    )
    p.set_defaults(func=run_view)


def run_view(args: argparse.Namespace) -> int:
    """Capture (or load) the weights ``args`` ask for, write the page, print its path."""
    source = Path(args.source)
    bounds = dict(
        layers=parse_index(args.layers, "--layers", names=True),
        heads=parse_index(args.heads, "--heads"),
        rows=parse_index(args.rows, "--rows"),
    )
    extras = _extras_asked(args)
    if args.against is not None and not Path(args.against).is_file():
        raise ValueError(
            f"--against {args.against} does not exist: give a second saved capture (.pt)"
        )
    if source.is_file():
        _refuse(
            args,
            ("--input", "--text", "--layers", "--heads", "--rows", "--cache-dir"),
            "a saved capture is shown as it was saved",
        )
        obj, tokens, title = saved_capture(source)
    elif (source / CHECKPOINT).is_file():
        _refuse(args, ("--text",), "a qkv train run reads --input")
        if args.input is None:
            raise ValueError(
                f'{source} is a qkv train run: give its model an input, e.g. --input "3 1 4 1 5"'
            )
        obj, tokens, title = run_capture(source, args.input, bounds, args.cache_dir)
    elif (source / HF_CONFIG).is_file():
        _refuse(args, ("--input", "--cache-dir"), "a Hugging Face model reads --text")
        if args.text is None:
            raise ValueError(
                f"{source} is a Hugging Face model folder: give it a text, e.g. "
                f'--text "The cat sat on the mat"'
            )
        obj, tokens, title = hugging_face_capture(source, args.text, bounds)
    elif source.is_dir():
        raise ValueError(
            f"{source} is neither a qkv train run (no {CHECKPOINT}) nor a Hugging "
            f"Face model folder (no {HF_CONFIG})"
        )
    else:
        raise ValueError(
            f"{source} does not exist: give a saved capture (.pt), a qkv train "
            f"run folder or a Hugging Face model folder"
        )
    if args.against is not None:
        other, _, _ = saved_capture(Path(args.against))
        extras = dict(against=_compare(obj, other, source, Path(args.against)))
        title = f"{title} - {Path(args.against).name}"
    else:
        extras = _analyses(obj, extras)
    out = Path(args.out)
    with run_directory(out.parent):
        written = _write_html(obj, out, tokens, title=args.title or title, **extras)
    print(written)
    return 0


def _write_html(obj, path: Path, tokens, *, title: str, **extras) -> Path:
    from ..viz.html import html  # imported when a page is written

    return html(obj, path, tokens, title=title, **extras)


# ---- analyses and comparison --------------------------------------------------------------


def _extras_asked(args: argparse.Namespace) -> dict:
    """The analyses the flags ask for, checked before anything is loaded or run."""
    if args.induction_period is not None and not args.scores:
        raise ValueError("--induction-period applies to the induction score: add --scores")
    period = (
        None
        if args.induction_period is None
        else _int(args.induction_period, "--induction-period", args.induction_period)
    )
    if period is not None and period < 1:
        raise ValueError(f"--induction-period {period}: the period must be at least 1 token")
    flow = None if args.flow is None else _int(args.flow, "--flow", args.flow)
    asked = [
        f
        for f, on in (
            ("--scores", args.scores),
            ("--rollout", args.rollout),
            ("--flow", flow is not None),
        )
        if on
    ]
    if args.against is not None and asked:
        raise ValueError(
            f"--against shows differences; {' and '.join(asked)} "
            f"{'is' if len(asked) == 1 else 'are'} of one capture: write "
            f"{'it' if len(asked) == 1 else 'them'} on a page of its own"
        )
    return dict(scores=args.scores, period=period, rollout=args.rollout, flow=flow)


def _analyses(cap: Captured, asked: dict) -> dict:
    """``html``'s ``scores=``, ``rollout=`` and ``flow=`` for what ``asked`` says."""
    if not (asked["scores"] or asked["rollout"] or asked["flow"] is not None):
        return {}
    from .. import analysis  # imported only when a flag asks for it

    _self_attention(cap, asked)
    out: dict = {}
    if asked["scores"]:
        out["scores"] = analysis.head_scores(cap, induction=asked["period"])
    if asked["rollout"]:
        heads = "per_head" if asked["rollout"] == "per-head" else "mean"
        out["rollout"] = analysis.rollout(cap, heads=heads)  # (B[, H], T, T): the first shown
    if asked["flow"] is not None:
        T = _rollout_length(cap)
        if not -T <= asked["flow"] < T:
            raise ValueError(
                f"--flow {asked['flow']}: no output position {asked['flow']} "
                f"among T={T} tokens; give 0..{T - 1}, or -1 for the last"
            )
        pos = asked["flow"] % T
        try:
            import scipy.sparse.csgraph  # noqa: F401  (Dinic: ~40x networkx's preflow-push)

            solver = "scipy"
        except ImportError:
            solver = "networkx"
        out["flow"] = (analysis.flow(cap, positions=[pos], solver=solver), [pos])  # (B, 1, T)
    return out


def _self_attention(cap: Captured, asked: dict) -> None:
    """Refuse, in the CLI's words, a capture with no self-attention call for the analyses."""
    if not cap.records or any(r.call == 0 and r.shape[2] == r.shape[3] for r in cap.records):
        return
    flags = [
        f
        for f, on in (
            ("--scores", asked["scores"]),
            ("--rollout", asked["rollout"]),
            ("--flow", asked["flow"] is not None),
        )
        if on
    ]
    r = cap.records[0]
    raise ValueError(
        f"{' and '.join(flags)} read self-attention (T == S), and this capture "
        f"holds none (e.g. {r.name!r}: T={r.shape[2]} queries, S={r.shape[3]} "
        f"keys): a sequence-to-sequence run shows its cross-attention by default; "
        f"add --layers encoder, or decoder self-attention by name (--layers "
        f"decoder.layers.0.self_attn)"
    )


def _rollout_length(cap: Captured) -> int:
    """T of the capture's first self-attention record (first call), for ``--flow``."""
    for rec in cap.records:
        if rec.call == 0 and rec.shape[2] == rec.shape[3]:
            return int(rec.shape[3])
    raise ValueError("--flow needs self-attention layers (T == S); the capture holds none")


def _compare(a: Captured, b: Captured, pa: Path, pb: Path):
    """:func:`qkv.analysis.compare` of the batch element the page shows (the first kept);
    a mismatch says both paths."""
    from .. import analysis  # imported only when --against asks for it

    first = int(a.records[0].batch[0]) if a.records and len(a.records[0].batch) else None
    try:
        return analysis.compare(a, b, batch=first)
    except ValueError as e:
        raise ValueError(f"cannot compare {pa} with {pb}: {e}") from None


def _refuse(args: argparse.Namespace, options: tuple[str, ...], why: str) -> None:
    given = [o for o in options if getattr(args, o[2:].replace("-", "_")) is not None]
    if given:
        raise ValueError(
            f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not "
            f"apply to {args.source}: {why}"
        )


def parse_index(text: str | None, what: str, *, names: bool = False):
    """A ``--layers``/``--heads``/``--rows`` value as :func:`qkv.capture` takes it.

    ``None`` -> None (all); ``"8000:8016"``, ``"5:"`` or ``":4"`` -> a slice; otherwise a
    comma-separated list of ints and closed ranges (``"0,3"``, ``"0:2,7"`` -> ``[0, 1, 7]``),
    and, with ``names``, module names (``"decoder.layers.1.cross_attn"``).
    """
    if text is None:
        return None
    items = [t.strip() for t in text.split(",")]
    if len(items) == 1 and ":" in items[0] and not names:
        a, b = (_int(p, what, text) if p.strip() else None for p in items[0].split(":", 1))
        return slice(a, b)
    out: list = []
    for item in items:
        if ":" in item:
            lo, _, hi = item.partition(":")
            if not (lo.strip() and hi.strip()):
                raise ValueError(f"{what} {text}: a range in a list needs both ends, like 0:4")
            out.extend(range(_int(lo, what, text), _int(hi, what, text)))
        elif names and item and not _is_int(item):
            out.append(item)
        else:
            out.append(_int(item, what, text))
    return out


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def _int(s: str, what: str, text: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(
            f"{what} {text}: {s.strip()!r} is not a number; write numbers and "
            f"ranges like 0,3 or 8000:8016"
        ) from None
