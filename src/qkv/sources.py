"""What ``qkv view`` shows, captured: a saved capture, a ``qkv train`` run, a Hugging Face model.

Each ``*_capture`` function returns ``(captured, tokens, title)``: the :class:`qkv.Captured` to
show, the tokens that label it (None: numbered positions) and a title that says what it is.

* :func:`saved_capture`: a file written by ``Captured.save`` (read by :func:`qkv.load_capture`);
* :func:`run_capture`: a ``qkv train`` run folder (it holds ``checkpoint.pt``; the model is
  :func:`load_run`'s) reads a text of tokens separated by spaces, tokenised by the task's
  vocabulary (a sequence-to-sequence model first decodes it greedily, then the teacher-forced
  forward is captured, as ``qkv train``'s picture);
* :func:`hugging_face_capture`: a Hugging Face model folder (it holds :data:`HF_CONFIG`; needs
  ``qkv[hf]``) reads a text through ``AutoTokenizer``/``AutoModel.from_pretrained(folder,
  local_files_only=True)`` (nothing is downloaded), run with ``attn_implementation="qkv"``.

``bounds`` is :func:`qkv.capture`'s ``layers=``, ``heads=`` and ``rows=`` as a dict. Errors are
``ValueError``s of one line; they name ``qkv view``'s flags (``--input``, ``--text``,
``--layers``), the command these sources serve.

Above ``capture`` and ``training`` (it rebuilds a run's recipe), below the CLI: ``qkv.viz``
reads traces only (STYLE.md 17), so this is not part of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .capture import Captured, capture, load_capture
from .training import CHECKPOINT
from .training.recipes import ClassifierRecipe, Seq2SeqRecipe, make_recipe

__all__ = ["HF_CONFIG", "hugging_face_capture", "load_run", "run_capture", "saved_capture"]

HF_CONFIG = "config.json"


def saved_capture(path: Path) -> tuple[Captured, None, str]:
    """A capture saved with ``Captured.save``, its tokens (None) and title ``"NAME: model"``."""
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


def run_capture(folder: Path, text: str, bounds: dict, cache_dir: str | None = None):
    """The capture of a ``qkv train`` run's model reading ``text`` (tokens separated by
    spaces), its tokens and title; ``cache_dir`` is where the task's data is cached."""
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


def hugging_face_capture(folder: Path, text: str, bounds: dict):
    """The capture of a Hugging Face model folder's model reading ``text`` (local files only),
    its tokenizer's tokens and title ``"FOLDER: text"``."""
    from .integrations import transformers as qkv_hf  # transformers is optional

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
