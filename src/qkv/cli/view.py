"""``qkv view``: one self-contained HTML page of a model's attention weights.

Thin: finds what to show, captures it with :func:`qkv.capture` and writes the page with
:func:`qkv.viz.html`. Three sources, told apart by what ``SOURCE`` is:

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..capture import Captured, capture, load_capture
from ..training import CHECKPOINT, run_directory
from ..training.recipes import ClassifierRecipe, Seq2SeqRecipe, make_recipe

__all__ = ["DEFAULT_OUT", "add_parser", "load_run", "parse_index", "run_view"]

DEFAULT_OUT = "out/view/attention.html"
HF_CONFIG = "config.json"


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
        obj, tokens, title = _saved_capture(source)
    elif (source / CHECKPOINT).is_file():
        _refuse(args, ("--text",), "a qkv train run reads --input")
        if args.input is None:
            raise ValueError(
                f'{source} is a qkv train run: give its model an input, e.g. --input "3 1 4 1 5"'
            )
        obj, tokens, title = _run(source, args.input, bounds, args.cache_dir)
    elif (source / HF_CONFIG).is_file():
        _refuse(args, ("--input", "--cache-dir"), "a Hugging Face model reads --text")
        if args.text is None:
            raise ValueError(
                f"{source} is a Hugging Face model folder: give it a text, e.g. "
                f'--text "The cat sat on the mat"'
            )
        obj, tokens, title = _hugging_face(source, args.text, bounds)
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
        other, _, _ = _saved_capture(Path(args.against))
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


# ---- a saved capture ----------------------------------------------------------------------


def _saved_capture(path: Path) -> tuple[Captured, None, str]:
    if path.name == CHECKPOINT:
        raise ValueError(
            f"{path} is a qkv train checkpoint: view its run with the folder, "
            f'qkv view {path.parent} --input "3 1 4 1 5"'
        )
    try:
        cap = load_capture(path, map_location="cpu")
    except ValueError:
        raise
    except Exception as e:
        first = " ".join(str(e).split()).split(". ")[0]
        raise ValueError(
            f"{path} is not a readable qkv capture ({type(e).__name__}: "
            f"{first}); write one with Captured.save"
        ) from None
    return cap, None, f"{path.name}: {cap.settings.get('model', 'model')}"


# ---- a qkv train run ----------------------------------------------------------------------


def load_run(folder: str | Path, *, cache_dir: str | None = None):
    """The recipe and trained model (eval mode, on the CPU) of a ``qkv train`` run folder.

    The recipe is rebuilt from the checkpoint's description with one example per split (its
    vocabulary and widths are the task's; the model's shape does not depend on the data's
    size) and the weights are loaded into a fresh model.

    Raises:
        ValueError: The checkpoint cannot be read or is not a qkv train checkpoint.
    """
    path = Path(folder) / CHECKPOINT
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        why = (
            ""
            if isinstance(ck, dict) and {"recipe", "model"} <= ck.keys()
            else ("it holds no recipe and model")
        )
    except Exception as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split()).split('. ')[0]}"
    if why:
        raise ValueError(f"{path} is not a readable qkv train checkpoint ({why})")
    desc = ck["recipe"]
    recipe = make_recipe(
        desc["task"],
        attention=desc["attention"],
        attention_options=desc["attention_options"],
        model=desc["model"],
        data={**desc["data"], "train_size": 1, "test_size": 1},
        cache_dir=cache_dir,
    )
    model = recipe.build_model()
    model.load_state_dict(ck["model"])
    return recipe, model.eval()


def _run(folder: Path, text: str, bounds: dict, cache_dir: str | None):
    recipe, model = load_run(folder, cache_dir=cache_dir)
    if isinstance(recipe, Seq2SeqRecipe):
        return _seq2seq(recipe, model, text, bounds)
    if isinstance(recipe, ClassifierRecipe):
        tokens = _tokenise(recipe, text, recipe.train_data.tokens.shape[1])
        x = torch.tensor([recipe.train_data.vocab.encode(tokens)])  # (1, L)
        with torch.no_grad(), capture(model, **bounds) as cap:
            label = int(model(x).argmax(-1))
        return cap, ["CLS", *tokens], f"{recipe.task}: {' '.join(tokens)} (predicted {label})"
    raise ValueError(
        f"{folder} is a run of {recipe.task}, whose inputs are images, not "
        f"tokens: --input reads tokens of reverse, copy, sort or listops"
    )


def _seq2seq(recipe: Seq2SeqRecipe, model, text: str, bounds: dict):
    """The input decoded greedily, then the teacher-forced forward captured: by default the
    cross-attention of every layer (as ``qkv train``'s page), or the ``--layers`` asked for,
    all of one kind (the page labels one kind: cross, encoder or decoder self-attention)."""
    vocab = recipe.train_data.vocab
    src_tokens = _tokenise(recipe, text, recipe.train_data.src.shape[1])
    src = torch.tensor([vocab.encode(src_tokens)])  # (1, S)
    tgt = _greedy(recipe, model, src)  # (1, T): <bos> and the decoded tokens
    tgt_tokens = vocab.decode(tgt[0])
    if bounds["layers"] is None:
        bounds = dict(bounds, layers=[n for n, _ in model.named_modules() if _kind(n) == "cross"])
    with torch.no_grad(), capture(model, **bounds) as cap:
        model(src, tgt)
    labels = {"cross": (tgt_tokens, src_tokens), "encoder": src_tokens, "decoder": tgt_tokens}
    kinds = sorted({_kind(r.name) for r in cap})
    if len(kinds) > 1:
        asked = ",".join(map(str, bounds["layers"]))
        raise ValueError(
            f"--layers {asked} takes {' and '.join(_KINDS[k] for k in kinds)}; a "
            f"page labels one kind: ask for the cross-attention (the default), "
            f"--layers encoder, or decoder self-attention by name, e.g. --layers "
            f"decoder.layers.0.self_attn"
        )
    title = f"{recipe.task}: {' '.join(src_tokens)} -> {' '.join(tgt_tokens[1:])}"
    return cap, labels[kinds[0]], f"{title}, {_KINDS[kinds[0]]}"


_KINDS = {
    "cross": "cross-attention",
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention",
}


def _kind(site: str) -> str:
    """``"cross"``, ``"encoder"`` or ``"decoder"``: the attention of a Seq2SeqTransformer site."""
    if site.rpartition(".")[2] == "cross_attn":
        return "cross"
    return "encoder" if site.startswith("encoder.") else "decoder"


def _tokenise(recipe, text: str, most: int) -> list[str]:
    """``text`` split at spaces, checked against the task's vocabulary and the model's width."""
    vocab, tokens = recipe.train_data.vocab, text.split()
    if not tokens:
        raise ValueError("--input is empty: give tokens separated by spaces")
    ordinary = [t for t in vocab.tokens if not (t.startswith("<") and t.endswith(">"))]
    bad = [t for t in tokens if t not in ordinary]
    if bad:
        raise ValueError(
            f"--input: token {bad[0]!r} is not in the {recipe.task} task's "
            f"vocabulary ({' '.join(ordinary)}); separate tokens by spaces"
        )
    if len(tokens) > most:
        raise ValueError(f"--input has {len(tokens)} tokens; this run's model takes at most {most}")
    return tokens


def _greedy(recipe: Seq2SeqRecipe, model, src) -> torch.Tensor:
    """``<bos>`` and the greedily decoded tokens up to, not including, ``<eos>``.

    Shape: src ``(1, S)`` -> ``(1, T)``, ``T <= S + 2``.
    """
    vocab = recipe.train_data.vocab
    with torch.no_grad():
        pred = recipe.predict(model, src, torch.ones_like(src, dtype=torch.bool), src.shape[1] + 2)[
            0
        ]  # (S + 2,)
    stops = [i for i, t in enumerate(pred.tolist()) if t in (vocab.eos, vocab.pad)]
    return pred[: stops[0] if stops else len(pred) - 1].unsqueeze(0)  # (1, T)


# ---- a Hugging Face model folder ----------------------------------------------------------


def _hugging_face(folder: Path, text: str, bounds: dict):
    from ..integrations import transformers as qkv_hf  # transformers is optional

    name = qkv_hf.register()  # ImportError without transformers 5.x: one line, exit 2
    from transformers import AutoModel, AutoTokenizer

    with _no_progress_bars():  # stderr keeps to the one line of an error
        tokenizer = _load(AutoTokenizer, folder, "tokenizer")
        model = _load(AutoModel, folder, "model").eval()
    model.set_attn_implementation(name)
    enc = tokenizer(text, return_tensors="pt")
    if enc["input_ids"].shape[1] == 0:
        raise ValueError(f"--text {text!r} gives no tokens")
    with torch.no_grad(), capture(model, **bounds) as cap:
        model(**enc)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    return cap, tokens, f"{folder.name}: {text}"


def _load(auto, folder: Path, what: str):
    """``auto.from_pretrained(folder)`` from local files only; its failure as one line."""
    try:
        return auto.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"cannot load the {what} of the Hugging Face model folder {folder} "
            f"(local files only): {type(e).__name__}: {e}"
        ) from None


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Transformers' loading bars off, and back on after if they were on."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
