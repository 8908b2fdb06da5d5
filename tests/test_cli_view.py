"""``qkv view``: a saved capture, a ``qkv train`` run and ``--input``, and a Hugging Face folder
and ``--text`` each become one self-contained page holding the right tokens and weights (read
back from the page's payload: ``qkv-meta`` JSON and float32 blobs, see ``qkv.viz.html``); bad
sources and inputs fail with one line and exit code 2; ``qkv train`` leaves the page of its
test example beside its PNG."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli.main import main
from qkv.cli.view import load_run, parse_index

WORDS = ["<unk>", "the", "cat", "sat", "on", "mat"]
TEXT = "the cat sat on the mat"


# ---- reading a page back --------------------------------------------------------------------


def _read_page(path: Path) -> tuple[dict, list[torch.Tensor]]:
    """The page's metadata and, per entry (layer option), its weights ``(nh, nr, S)``."""
    text = path.read_text(encoding="utf-8")
    _self_contained(text)
    meta = json.loads(
        re.search(
            r'<script type="application/json" id="qkv-meta">(.*?)</script>', text, re.S
        ).group(1)
    )
    blobs = dict(
        re.findall(
            r'<script type="application/octet-stream" id="(qkv-blob-\d+)">'
            r"([A-Za-z0-9+/=]*)</script>",
            text,
        )
    )
    weights = []
    for e in meta["entries"]:
        heads = []
        for h in e["heads"]:
            assert h["mode"] == "f4", h  # small pages keep every weight as float32
            raw = bytearray(base64.b64decode(blobs[h["blob"]]))
            heads.append(torch.frombuffer(raw, dtype=torch.float32).view(e["nr"], e["S"]))
        weights.append(torch.stack(heads))  # (nh, nr, S)
    return meta, weights


def _self_contained(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert not re.search(r"https?://", text)  # no CDN, font, or any address
    assert not re.search(r'\b(src|href)\s*=\s*"(?!data:)', text)  # nothing loaded from outside
    assert "fetch(" not in text and "@import" not in text and "XMLHttpRequest" not in text


def _labels(meta: dict, entry: dict) -> tuple[list[str], list[str]]:
    """The query labels of the entry's kept rows and its key labels."""
    (qlist, offset), klist = entry["qtok"], entry["ktok"]
    rows = [r for first, n in entry["rows"] for r in range(first, first + n)]
    queries = [meta["tokens"][qlist][offset + r] for r in rows]
    return queries, meta["tokens"][klist][: entry["S"]]


def _ok(capsys, out: Path) -> None:
    printed, _ = capsys.readouterr()
    assert printed == f"{out}\n" and out.is_file()


# ---- a saved capture ------------------------------------------------------------------------


def test_a_saved_capture_becomes_a_page_of_its_weights(tmp_path, capsys):
    model = qkv.DecoderLM(20, 16, 2, 2).eval()
    with torch.no_grad(), qkv.capture(model, heads=[1], rows=range(2, 5)) as cap:
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    cap.save(tmp_path / "attn.pt")
    out = tmp_path / "pages" / "attn.html"
    assert main(["view", str(tmp_path / "attn.pt"), "--out", str(out)]) == 0
    _ok(capsys, out)
    meta, weights = _read_page(out)
    assert meta["title"] == "attn.pt: DecoderLM" and meta["tokens"] == []  # numbered positions
    assert [
        (e["T"], e["S"], e["rows"], [h["head"] for h in e["heads"]]) for e in meta["entries"]
    ] == [(6, 6, [[2, 3]], [1])] * 2
    for record, w in zip(cap, weights, strict=True):
        assert torch.equal(w, record.probs[0])  # (1, 3, 6): float32, exactly
    assert (
        main(
            ["view", str(tmp_path / "attn.pt"), "--title", "rows 2-4 of head 1", "--out", str(out)]
        )
        == 0
    )
    _ok(capsys, out)
    assert _read_page(out)[0]["title"] == "rows 2-4 of head 1"


# ---- a qkv train run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reverse_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A 3-step ``qkv train reverse`` run: its folder, its data cache, what it printed."""
    root = tmp_path_factory.mktemp("reverse")
    run, cache = root / "run", root / "cache"
    argv = [
        "train",
        "reverse",
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--quiet",
        "--cache-dir",
        str(cache),
        "--out",
        str(run),
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return run, cache, json.loads(printed.getvalue())


def test_qkv_train_leaves_the_page_of_its_test_example_beside_its_picture(reverse_run):
    run, cache, printed = reverse_run
    png, page = run / "cross_attention.png", run / "cross_attention.html"
    assert printed["pictures"] == [str(png), str(page)]
    assert json.loads((run / "metrics.json").read_text())["pictures"] == printed["pictures"]
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint.pt",
        "cross_attention.html",
        "cross_attention.png",
        "metrics.json",
    ]
    meta, weights = _read_page(page)
    test = qkv.tasks.load("reverse", split="test", size=1, cache_dir=cache)
    S, T = int(test.src_mask[0].sum()), int(test.tgt_mask[0].sum())
    src, tgt = test.vocab.decode(test.src[0, :S]), test.vocab.decode(test.tgt[0, : T - 1])
    assert tgt == ["<bos>", *reversed(src)]
    assert [e["label"] for e in meta["entries"]] == [
        "layer 3 · decoder.layers.0.cross_attn",
        "layer 5 · decoder.layers.1.cross_attn",
    ]
    for e, w in zip(meta["entries"], weights, strict=True):
        assert _labels(meta, e) == (tgt, src)  # every layer, every head, tokens as labels
        assert [h["head"] for h in e["heads"]] == [0, 1, 2, 3] and w.shape == (4, T - 1, S)
    # the last layer's weights are those of the PNG: the model's own trace
    _, model = load_run(run, cache_dir=str(cache))
    with torch.no_grad():
        _, maps = model(test.src[:1, :S], test.tgt[:1, : T - 1], return_attention=True)
    torch.testing.assert_close(weights[-1], maps.cross[-1].probs[0], rtol=0, atol=1e-6)


def test_a_run_and_an_input_give_the_cross_attention_of_the_greedy_decode(
    reverse_run, tmp_path, capsys
):
    run, cache, _ = reverse_run
    out = tmp_path / "page.html"
    assert (
        main(
            ["view", str(run), "--input", "3 1 4 1 5", "--cache-dir", str(cache), "--out", str(out)]
        )
        == 0
    )
    _ok(capsys, out)
    meta, weights = _read_page(out)
    recipe, model = load_run(run, cache_dir=str(cache))
    src = torch.tensor([recipe.train_data.vocab.encode(["3", "1", "4", "1", "5"])])  # (1, 5)
    decoded = recipe.predict(model, src, torch.ones_like(src, dtype=torch.bool), 7)[0]
    stop = next((i for i, t in enumerate(decoded.tolist()) if t in (0, 2)), len(decoded) - 1)
    tgt = decoded[:stop]  # <bos> and the digits before <eos>
    tgt_tokens = recipe.train_data.vocab.decode(tgt)
    assert meta["title"] == (f"reverse: 3 1 4 1 5 -> {' '.join(tgt_tokens[1:])}, cross-attention")
    with torch.no_grad():
        _, maps = model(src, tgt[None], return_attention=True)
    assert len(weights) == len(maps.cross) == 2
    for e, w, trace in zip(meta["entries"], weights, maps.cross, strict=True):
        assert _labels(meta, e) == (tgt_tokens, ["3", "1", "4", "1", "5"])
        torch.testing.assert_close(w, trace.probs[0], rtol=0, atol=1e-6)


def test_layers_heads_and_rows_bound_the_capture_of_a_run(reverse_run, tmp_path, capsys):
    run, cache, _ = reverse_run
    out = tmp_path / "enc.html"
    assert (
        main(
            [
                "view",
                str(run),
                "--input",
                "3 1 4 1 5",
                "--cache-dir",
                str(cache),
                "--layers",
                "encoder",
                "--heads",
                "1,3",
                "--rows",
                "1:3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    _ok(capsys, out)
    meta, weights = _read_page(out)
    recipe, model = load_run(run, cache_dir=str(cache))
    src = torch.tensor([recipe.train_data.vocab.encode(["3", "1", "4", "1", "5"])])  # (1, 5)
    with torch.no_grad():
        _, maps = model(src, torch.tensor([[1]]), return_attention=True)
    assert meta["title"].endswith(", encoder self-attention")
    for e, w, trace in zip(meta["entries"], weights, maps.encoder, strict=True):
        assert [h["head"] for h in e["heads"]] == [1, 3] and e["rows"] == [[1, 2]]
        assert _labels(meta, e) == (["1", "4"], ["3", "1", "4", "1", "5"])
        torch.testing.assert_close(w, trace.probs[0, [1, 3], 1:3], rtol=0, atol=1e-6)


def test_viewing_a_run_leaves_torch_settings_alone(reverse_run, tmp_path, capsys):
    """Rebuilding the model draws from the RNG; in-process, ``qkv view`` gives it back (as
    tests/test_cli_global_state.py checks of the other subcommands)."""
    from qkv.training import preserve_torch_state

    run, cache, _ = reverse_run
    with preserve_torch_state():
        torch.set_num_threads(3)
        torch.manual_seed(20240611)
        before = (torch.get_num_threads(), torch.is_grad_enabled(), torch.get_rng_state())
        assert (
            main(
                [
                    "view",
                    str(run),
                    "--input",
                    "3 1",
                    "--cache-dir",
                    str(cache),
                    "--out",
                    str(tmp_path / "p.html"),
                ]
            )
            == 0
        )
        after = (torch.get_num_threads(), torch.is_grad_enabled(), torch.get_rng_state())
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])


def test_the_loaders_live_in_the_library(reverse_run):
    """STYLE.md 16: ``qkv view`` parses flags; loading a run and capturing it is
    ``qkv.sources``'s, and ``qkv.cli.view.load_run`` is the same function."""
    import qkv.cli.view
    import qkv.sources

    run, cache, _ = reverse_run
    assert qkv.cli.view.load_run is qkv.sources.load_run
    recipe, model = qkv.sources.load_run(run, cache_dir=str(cache))
    assert recipe.task == "reverse" and not model.training
    cap, tokens, title = qkv.sources.run_capture(
        run, "3 1 4", dict(layers=None, heads=None, rows=None), str(cache)
    )
    assert [r.name for r in cap] == ["decoder.layers.0.cross_attn", "decoder.layers.1.cross_attn"]
    assert tokens[1] == ["3", "1", "4"] and title.startswith("reverse: 3 1 4 -> ")


# ---- a Hugging Face model folder ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A 2-layer Llama (4 query heads, 2 kv heads) from a small random config, and a word-level
    fast tokenizer built offline, both saved with ``save_pretrained``."""
    transformers = pytest.importorskip("transformers", reason="the hf source needs qkv[hf]")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaModel(config).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(
        folder
    )
    return folder


def _eager_weights(folder: Path) -> tuple[torch.Tensor, ...]:
    """Transformers' own eager attention weights of TEXT, per layer ``(1, H, T, T)``."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        folder, local_files_only=True, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([[WORDS.index(w) for w in TEXT.split()]])
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions


def test_a_hugging_face_folder_and_a_text(hf_folder, tmp_path, capsys):
    out = tmp_path / "hf.html"
    assert main(["view", str(hf_folder), "--text", TEXT, "--out", str(out)]) == 0
    _ok(capsys, out)
    meta, weights = _read_page(out)
    assert meta["title"] == f"tiny-llama: {TEXT}"
    eager = _eager_weights(hf_folder)
    assert [e["label"] for e in meta["entries"]] == [
        "layer 0 · layers.0.self_attn",
        "layer 1 · layers.1.self_attn",
    ]
    for e, w, want in zip(meta["entries"], weights, eager, strict=True):
        assert _labels(meta, e) == (TEXT.split(), TEXT.split())  # convert_ids_to_tokens
        torch.testing.assert_close(w, want[0], rtol=0, atol=1e-6)


def test_a_hugging_face_capture_bounded_to_a_layer_heads_and_the_last_row(
    hf_folder, tmp_path, capsys
):
    out = tmp_path / "hf.html"
    assert (
        main(
            [
                "view",
                str(hf_folder),
                "--text",
                TEXT,
                "--layers",
                "1",
                "--heads",
                "0,3",
                "--rows",
                "-1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    _ok(capsys, out)
    meta, weights = _read_page(out)
    (e,), (w,) = meta["entries"], weights
    assert e["label"] == "layer 1 · layers.1.self_attn" and e["rows"] == [[5, 1]]
    assert [h["head"] for h in e["heads"]] == [0, 3]
    assert _labels(meta, e) == (["mat"], TEXT.split())
    torch.testing.assert_close(w, _eager_weights(hf_folder)[1][0, [0, 3], 5:], rtol=0, atol=1e-6)


# ---- errors: one line, exit code 2, nothing written --------------------------------------------


def _error(capsys, argv: list[str], out: Path) -> str:
    assert main([*argv, "--out", str(out)]) == 2
    printed, err = capsys.readouterr()
    assert printed == "" and err.count("\n") == 1 and err.startswith("qkv view: error: "), err
    assert not out.parent.exists()
    return err


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "missing",
            (
                "missing.pt does not exist: give a saved capture (.pt), a qkv train run folder "
                "or a Hugging Face model folder"
            ),
        ),
        (
            "empty-folder",
            (
                "is neither a qkv train run (no checkpoint.pt) nor a Hugging Face model "
                "folder (no config.json)"
            ),
        ),
        ("text-file", "notes.txt is not a readable qkv capture (UnpicklingError"),
        ("other-pt", "is not a qkv capture (write one with Captured.save)"),
        (
            "checkpoint-file",
            "run/checkpoint.pt is a qkv train checkpoint: view its run with the folder, qkv view",
        ),
        ("capture-input", "--input and --layers do not apply to"),
        (
            "bad-rows",
            "--rows a:3: 'a' is not a number; write numbers and ranges like 0,3 or 8000:8016",
        ),
        ("open-range-in-list", "--heads 0,2:: a range in a list needs both ends, like 0:4"),
    ],
)
def test_bad_sources(tmp_path, capsys, case, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a capture\n")
    torch.save({"a": torch.ones(2)}, tmp_path / "other.pt")
    (tmp_path / "run").mkdir()
    torch.save({"a": torch.ones(2)}, tmp_path / "run" / "checkpoint.pt")
    model = qkv.DecoderLM(20, 16, 2, 1).eval()
    with torch.no_grad(), qkv.capture(model) as cap:
        model(torch.tensor([[1, 2, 3]]))
    cap.save(tmp_path / "attn.pt")
    argv = {
        "missing": [str(tmp_path / "missing.pt")],
        "empty-folder": [str(tmp_path / "empty")],
        "text-file": [str(tmp_path / "notes.txt")],
        "other-pt": [str(tmp_path / "other.pt")],
        "checkpoint-file": [str(tmp_path / "run" / "checkpoint.pt")],
        "capture-input": [str(tmp_path / "attn.pt"), "--input", "1 2", "--layers", "0"],
        "bad-rows": [str(tmp_path / "attn.pt"), "--rows", "a:3"],
        "open-range-in-list": [str(tmp_path / "attn.pt"), "--heads", "0,2:"],
    }[case]
    assert message in _error(capsys, ["view", *argv], tmp_path / "new" / "page.html")


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], 'is a qkv train run: give its model an input, e.g. --input "3 1 4 1 5"'),
        (
            ["--input", "3 x 4"],
            (
                "--input: token 'x' is not in the reverse task's vocabulary "
                "(0 1 2 3 4 5 6 7 8 9); separate tokens by spaces"
            ),
        ),
        (
            ["--input", "<bos> 3 4"],
            "--input: token '<bos>' is not in the reverse task's vocabulary",
        ),
        (["--input", "314"], "--input: token '314' is not in the reverse task's vocabulary"),
        (["--input", "   "], "--input is empty: give tokens separated by spaces"),
        (
            ["--input", " ".join("12345678901")],
            "--input has 11 tokens; this run's model takes at most 10",
        ),
        (["--input", "3 1", "--text", "hi"], "--text does not apply to"),
        (
            ["--input", "3 1", "--layers", "0,3"],
            "--layers 0,3 takes cross-attention and encoder self-attention; a page labels one kind",
        ),
        (
            ["--input", "3 1", "--layers", "9"],
            "qkv.capture: layers [9] asked for, but attention was called from 6 sites",
        ),
        (["--input", "3 1", "--heads", "4"], "heads [4] asked for"),
    ],
)
def test_bad_inputs_to_a_run(reverse_run, tmp_path, capsys, extra, message):
    run, cache, _ = reverse_run
    err = _error(
        capsys,
        ["view", str(run), "--cache-dir", str(cache), *extra],
        tmp_path / "new" / "page.html",
    )
    assert message in err


def test_an_unreadable_checkpoint(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"cut short")
    err = _error(
        capsys, ["view", str(tmp_path / "run"), "--input", "1"], tmp_path / "new" / "page.html"
    )
    assert "run/checkpoint.pt is not a readable qkv train checkpoint (UnpicklingError" in err


def test_a_run_of_an_image_task_takes_no_input(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the digits task needs scikit-learn")
    from qkv.training.recipes import make_recipe

    recipe = make_recipe("digits", data=dict(train_size=1, test_size=1))
    (tmp_path / "run").mkdir()
    torch.save(
        {"recipe": recipe.describe(), "model": recipe.build_model().state_dict()},
        tmp_path / "run" / "checkpoint.pt",
    )
    err = _error(
        capsys, ["view", str(tmp_path / "run"), "--input", "1 2"], tmp_path / "new" / "page.html"
    )
    assert "is a run of digits, whose inputs are images, not tokens" in err


def test_a_hugging_face_folder_without_transformers(tmp_path, capsys, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    err = _error(
        capsys, ["view", str(tmp_path / "hf"), "--text", TEXT], tmp_path / "new" / "page.html"
    )
    assert "qkv.integrations.transformers needs transformers 5.x: pip install 'qkv[hf]'" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            [],
            'is a Hugging Face model folder: give it a text, e.g. --text "The cat sat on the mat"',
        ),
        (["--text", TEXT, "--input", "1 2"], "--input does not apply to"),
        (["--text", TEXT, "--layers", "2"], "qkv.capture: layers [2] asked for"),
    ],
)
def test_bad_inputs_to_a_hugging_face_folder(hf_folder, tmp_path, capsys, extra, message):
    assert message in _error(
        capsys, ["view", str(hf_folder), *extra], tmp_path / "new" / "page.html"
    )


def test_a_hugging_face_folder_without_its_tokenizer(hf_folder, tmp_path, capsys):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_bytes((hf_folder / "config.json").read_bytes())
    err = _error(
        capsys, ["view", str(tmp_path / "bare"), "--text", TEXT], tmp_path / "new" / "page.html"
    )
    assert (
        f"cannot load the tokenizer of the Hugging Face model folder {tmp_path / 'bare'} "
        f"(local files only): " in err
    )


# ---- the index syntax -----------------------------------------------------------------------


def test_parse_index():
    assert parse_index(None, "--rows") is None
    assert parse_index("8000:8016", "--rows") == slice(8000, 8016)
    assert parse_index("-4:", "--rows") == slice(-4, None)
    assert parse_index("0,3", "--heads") == [0, 3]
    assert parse_index("-1", "--rows") == [-1]
    assert parse_index("0:2,7", "--layers", names=True) == [0, 1, 7]
    assert parse_index("encoder, 5", "--layers", names=True) == ["encoder", 5]
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_index("x", "--heads")
