"""``qkv view --scores / --rollout / --flow / --against``: the page carries the head-scores
table, the rollout and flow entries and the per-head differences exactly as ``qkv.analysis``
and the captures give them (read back from the page's payload, see ``qkv.viz.html``); every bad
use of these flags is one line and exit code 2, nothing written."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli.main import main

T = 10


def _page(path: Path) -> tuple[dict, list[torch.Tensor]]:
    """The page's metadata and each entry's stored float32 values ``(nh, nr, S)``."""
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"https?://", text)  # still offline
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
    out = []
    for e in meta["entries"]:
        heads = []
        for h in e["heads"]:
            assert h["mode"] in ("f4", "s4"), h  # small pages keep every value as float32
            raw = bytearray(base64.b64decode(blobs[h["blob"]]))
            heads.append(torch.frombuffer(raw, dtype=torch.float32).view(e["nr"], e["S"]))
        out.append(torch.stack(heads))
    return meta, out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Saved captures of one 2-layer x 2-head DecoderLM: two inputs of length T, one of T - 2,
    one bounded to a head and three rows."""
    root = tmp_path_factory.mktemp("captures")
    torch.manual_seed(0)
    model = qkv.DecoderLM(20, 16, 2, 2, max_len=16).eval()
    ids = torch.arange(1, T + 1)[None]  # (1, T)
    runs = {
        "a": dict(x=ids),
        "b": dict(x=ids.flip(1)),
        "short": dict(x=ids[:, : T - 2]),
        "bounded": dict(x=ids, heads=[1], rows=range(2, 5)),
        "head1": dict(x=ids, heads=[1]),
    }
    for name, kw in runs.items():
        x = kw.pop("x")
        with torch.no_grad(), qkv.capture(model, **kw) as cap:
            model(x)
        cap.save(root / f"{name}.pt")
    return {name: root / f"{name}.pt" for name in runs}


def _view(capsys, argv: list[str], out: Path) -> tuple[dict, list[torch.Tensor]]:
    assert main(["view", *argv, "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    assert printed == f"{out}\n" and err == ""
    return _page(out)


def test_scores_put_the_head_scores_table_on_the_page(saved, tmp_path, capsys):
    out = tmp_path / "scores.html"
    meta, _ = _view(capsys, [str(saved["a"]), "--scores", "--induction-period", "3"], out)
    table = qkv.analysis.head_scores(qkv.load_capture(saved["a"]), induction=3)
    got = meta["scores"]
    assert got["names"] == list(table.names)
    assert [(h["layer"], h["head"]) for h in got["heads"]] == list(table.keys)
    for h, row in zip(got["heads"], table.values.tolist()):
        assert h["values"] == pytest.approx(row, rel=0, abs=0)  # exact float64 round trip
        e = meta["entries"][h["entry"]]  # where the page finds that head's weights
        assert e["kind"] == "attention" and e["layer"] == h["layer"]
        assert e["heads"][h["hi"]]["head"] == h["head"]
    for (layer, name), rows in table.rows.items():  # the rows each score used, as runs
        flat = [r0 + i for r0, n in got["used"][str(layer)][name] for i in range(n)]
        assert flat == rows.tolist(), (layer, name)
    text = out.read_text()
    assert 'id="tab-scores"' in text and 'id="tab-saliency"' not in text


def test_rollout_and_flow_become_entries_of_the_page(saved, tmp_path, capsys):
    pytest.importorskip("networkx", reason="flow needs networkx or scipy")
    out = tmp_path / "rollout.html"
    meta, values = _view(capsys, [str(saved["a"]), "--rollout", "--flow", "-1"], out)
    cap = qkv.load_capture(saved["a"])
    kinds = [e["kind"] for e in meta["entries"]]
    assert kinds == ["attention", "attention", "rollout", "flow"]
    R = qkv.analysis.rollout(cap)[0]  # (T, T)
    assert torch.equal(values[2][0], R.float())
    assert meta["entries"][3]["rows"] == [[T - 1, 1]]
    F = qkv.analysis.flow(cap, positions=[T - 1])[0]  # (1, T), networkx: exact
    assert torch.allclose(values[3][0].double(), F.double(), atol=2**-20)
    assert math.isclose(float(values[3][0].sum()), 1.0, rel_tol=1e-5)
    assert 'id="tab-saliency"' in out.read_text()


def test_rollout_per_head_of_a_capture_bounded_by_heads_names_its_true_heads(
    saved, tmp_path, capsys
):
    """A capture of head 1 only: its one chain is labelled head 1, not 0 (its position)."""
    meta, values = _view(
        capsys, [str(saved["head1"]), "--rollout", "per-head"], tmp_path / "h.html"
    )
    e = meta["entries"][2]
    assert e["kind"] == "rollout" and [h["head"] for h in e["heads"]] == [1]
    R = qkv.analysis.rollout(qkv.load_capture(saved["head1"]), heads="per_head")[0]  # (1, T, T)
    assert torch.equal(values[2], R.float())


def test_rollout_per_head_is_an_entry_of_every_head_chain(saved, tmp_path, capsys):
    out = tmp_path / "per_head.html"
    meta, values = _view(capsys, [str(saved["a"]), "--rollout", "per-head"], out)
    R = qkv.analysis.rollout(qkv.load_capture(saved["a"]), heads="per_head")[0]  # (H, T, T)
    e = meta["entries"][2]
    assert (e["kind"], e["label"], len(e["heads"])) == (
        "rollout",
        "rollout per head (all layers)",
        2,
    )
    assert torch.equal(values[2], R.float())


def test_against_shows_the_signed_difference_of_every_head(saved, tmp_path, capsys):
    out = tmp_path / "diff.html"
    meta, values = _view(capsys, [str(saved["a"]), "--against", str(saved["b"])], out)
    a, b = qkv.load_capture(saved["a"]), qkv.load_capture(saved["b"])
    assert meta["title"] == "a.pt: DecoderLM - b.pt"
    assert [e["kind"] for e in meta["entries"]] == ["diff", "diff"]
    for ra, rb, d in zip(a, b, values, strict=True):
        assert torch.equal(d, ra.probs[0].float() - rb.probs[0].float())  # (H, T, T), signed
    assert (torch.cat(values) < 0).any() and (torch.cat(values) > 0).any()
    cmp = qkv.analysis.compare(a, b)  # the page's ranking is the library's, to the bit
    shown = [
        (
            meta["entries"][c["entry"]]["layer"],
            meta["entries"][c["entry"]]["heads"][c["hi"]]["head"],
        )
        for c in meta["changes"]
    ]
    assert shown == cmp.ranked("mean") and len(shown) == 4  # 2 layers x 2 heads
    for c, key in zip(meta["changes"], shown):
        assert (c["mean"], c["max"]) == (cmp[key]["mean"], cmp[key]["max"])
        d = values[c["entry"]][c["hi"]].abs()
        assert c["mean"] == float(d.double().mean()) and c["max"] == float(d.max())
    assert 'id="tab-changes"' in out.read_text()


# ---- errors: one line, exit code 2, nothing written --------------------------------------------


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "short",
            (
                "a.pt with {short}: layer 0 ('blocks.layers.0.self_attn'): a's call is (B, H, T, "
                "S) (1, 2, 10, 10) and b's (1, 2, 8, 8); compare captures of the same "
                "architecture and input length"
            ),
        ),
        (
            "bounded",
            (
                "layer 0 ('blocks.layers.0.self_attn'): a kept heads [0, 1] and b [1]; capture "
                "both with the same heads="
            ),
        ),
        (
            "other-records",
            (
                "one_layer.pt: the captures record different layers (call 0): a has 2 "
                "(layer 0 blocks.layers.0.self_attn, layer 1 blocks.layers.1.self_attn), "
                "b has 1"
            ),
        ),
        (
            "missing-against",
            "--against nothing.pt does not exist: give a second saved capture (.pt)",
        ),
        (
            "against-and-scores",
            (
                "--against shows differences; --scores and --rollout are of one "
                "capture: write them on a page of its own"
            ),
        ),
        (
            "against-a-folder",
            "is neither a qkv train run (no checkpoint.pt) nor a Hugging Face model folder",
        ),
        ("flow-not-a-number", "--flow x: 'x' is not a number"),
        (
            "flow-out-of-range",
            "--flow 10: no output position 10 among T=10 tokens; give 0..9, or -1 for the last",
        ),
        (
            "period-without-scores",
            "--induction-period applies to the induction score: add --scores",
        ),
        ("period-zero", "--induction-period 0: the period must be at least 1 token"),
        (
            "rollout-of-bounded-rows",
            "kept 3 of its 10 query rows: rollout needs every row of every layer",
        ),
    ],
)
def test_bad_uses_of_the_analysis_flags(saved, tmp_path, capsys, case, message):
    one_layer = qkv.DecoderLM(20, 16, 2, 1).eval()
    with torch.no_grad(), qkv.capture(one_layer) as cap:
        one_layer(torch.arange(1, T + 1)[None])
    cap.save(tmp_path / "one_layer.pt")
    a = str(saved["a"])
    argv = {
        "short": [a, "--against", str(saved["short"])],
        "bounded": [a, "--against", str(saved["bounded"])],
        "other-records": [a, "--against", str(tmp_path / "one_layer.pt")],
        "missing-against": [a, "--against", "nothing.pt"],
        "against-and-scores": [a, "--against", str(saved["b"]), "--scores", "--rollout"],
        "against-a-folder": [str(tmp_path), "--against", str(saved["b"])],
        "flow-not-a-number": [a, "--flow", "x"],
        "flow-out-of-range": [a, "--flow", "10"],
        "period-without-scores": [a, "--induction-period", "4"],
        "period-zero": [a, "--scores", "--induction-period", "0"],
        "rollout-of-bounded-rows": [str(saved["bounded"]), "--rollout"],
    }[case]
    out = tmp_path / "new" / "page.html"
    assert main(["view", *argv, "--out", str(out)]) == 2
    printed, err = capsys.readouterr()
    assert printed == "" and err.count("\n") == 1 and err.startswith("qkv view: error: "), err
    assert message.format(short=saved["short"]) in err, err
    assert not out.parent.exists()


# ---- the flags on a qkv train run and on a Hugging Face folder ---------------------------------
# The run (3 steps of qkv train reverse) and the Hugging Face folder (a 2-layer Llama from a
# small random config, a word-level tokenizer) are test_cli_view.py's fixtures.

import test_cli_view  # noqa: E402

TEXT = test_cli_view.TEXT
hf_folder, reverse_run = test_cli_view.hf_folder, test_cli_view.reverse_run  # fixtures

from qkv.cli.view import load_run  # noqa: E402

SRC = "3 1 4 1 5"


def _encoder_capture(run: Path, cache: Path, text: str) -> qkv.Captured:
    """The run's encoder self-attention on ``text`` (the decoder's input does not reach it)."""
    recipe, model = load_run(run, cache_dir=str(cache))
    src = torch.tensor([recipe.train_data.vocab.encode(text.split())])  # (1, S)
    with torch.no_grad(), qkv.capture(model, layers=["encoder"]) as cap:
        model(src, torch.tensor([[1]]))
    return cap


def _run_argv(reverse_run, *flags: str) -> list[str]:
    run, cache, _ = reverse_run
    return [str(run), "--input", SRC, "--cache-dir", str(cache), *flags]


def test_scores_and_rollout_of_a_run(reverse_run, tmp_path, capsys):
    run, cache, _ = reverse_run
    out = tmp_path / "run.html"
    meta, values = _view(
        capsys,
        _run_argv(
            reverse_run, "--layers", "encoder", "--scores", "--induction-period", "2", "--rollout"
        ),
        out,
    )
    cap = _encoder_capture(run, cache, SRC)
    table = qkv.analysis.head_scores(cap, induction=2)
    assert [(h["layer"], h["head"]) for h in meta["scores"]["heads"]] == list(table.keys)
    for h, row in zip(meta["scores"]["heads"], table.values.tolist()):
        assert h["values"] == pytest.approx(row, rel=1e-9, abs=1e-12)
    assert [e["kind"] for e in meta["entries"]] == ["attention", "attention", "rollout"]
    R = qkv.analysis.rollout(cap)[0]  # (S, S) over the input tokens
    torch.testing.assert_close(values[2][0], R.float(), rtol=0, atol=1e-6)
    assert meta["tokens"] == [SRC.split()] and meta["title"].endswith(", encoder self-attention")
    text = out.read_text()
    assert 'id="tab-scores"' in text and 'id="tab-saliency"' in text


def test_a_run_against_a_saved_capture(reverse_run, tmp_path, capsys):
    run, cache, _ = reverse_run
    other = "5 1 4 1 3"
    _encoder_capture(run, cache, other).save(tmp_path / "other.pt")
    out = tmp_path / "diff.html"
    meta, values = _view(
        capsys,
        _run_argv(reverse_run, "--layers", "encoder", "--against", str(tmp_path / "other.pt")),
        out,
    )
    cmp = qkv.analysis.compare(
        _encoder_capture(run, cache, SRC), qkv.load_capture(tmp_path / "other.pt")
    )
    assert [e["kind"] for e in meta["entries"]] == ["diff", "diff"]
    for e, d in zip(meta["entries"], values, strict=True):
        want = torch.stack([cmp.diff(e["layer"], h["head"])[0] for h in e["heads"]])
        torch.testing.assert_close(d, want, rtol=0, atol=1e-6)  # (H, S, S)
    shown = [(meta["entries"][c["entry"]]["layer"], c["head"]) for c in meta["changes"]]
    assert sorted(shown) == sorted(cmp.keys) and (values[0] != 0).any()
    assert meta["title"].endswith(" - other.pt")


def test_a_run_default_cross_attention_has_no_scores(reverse_run, tmp_path, capsys):
    out = tmp_path / "new" / "page.html"
    assert main(["view", *_run_argv(reverse_run, "--scores", "--rollout"), "--out", str(out)]) == 2
    printed, err = capsys.readouterr()
    assert printed == "" and err.count("\n") == 1 and not out.parent.exists()
    assert (
        "--scores and --rollout read self-attention (T == S), and this capture holds none "
        "(e.g. 'decoder.layers.0.cross_attn': T="
    ) in err
    assert "add --layers encoder, or decoder self-attention by name" in err


def _hf_capture(folder: Path, text: str) -> qkv.Captured:
    from transformers import AutoModel, AutoTokenizer

    from qkv.integrations import transformers as qkv_hf

    model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    model.set_attn_implementation(qkv_hf.register())
    enc = AutoTokenizer.from_pretrained(folder, local_files_only=True)(text, return_tensors="pt")
    with torch.no_grad(), qkv.capture(model) as cap:
        model(**enc)
    return cap


def test_scores_and_rollout_of_a_hugging_face_folder(hf_folder, tmp_path, capsys):
    text = "the cat sat the cat sat"  # repeats every 3 tokens
    out = tmp_path / "hf.html"
    meta, values = _view(
        capsys,
        [str(hf_folder), "--text", text, "--scores", "--induction-period", "3", "--rollout"],
        out,
    )
    cap = _hf_capture(hf_folder, text)
    table = qkv.analysis.head_scores(cap, induction=3)
    assert [(h["layer"], h["head"]) for h in meta["scores"]["heads"]] == list(table.keys)
    assert len(table.keys) == 8  # 2 layers x 4 query heads (2 key/value heads: GQA)
    for h, row in zip(meta["scores"]["heads"], table.values.tolist()):
        assert h["values"] == pytest.approx(row, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(
        values[2][0], qkv.analysis.rollout(cap)[0].float(), rtol=0, atol=1e-6
    )
    assert meta["tokens"] == [text.split()]


def test_a_hugging_face_folder_against_a_saved_capture(hf_folder, tmp_path, capsys):
    _hf_capture(hf_folder, "the mat sat on the cat").save(tmp_path / "b.pt")
    capsys.readouterr()  # transformers' loading bars
    out = tmp_path / "hf-diff.html"
    meta, values = _view(
        capsys, [str(hf_folder), "--text", TEXT, "--against", str(tmp_path / "b.pt")], out
    )
    cmp = qkv.analysis.compare(_hf_capture(hf_folder, TEXT), qkv.load_capture(tmp_path / "b.pt"))
    shown = [(meta["entries"][c["entry"]]["layer"], c["head"]) for c in meta["changes"]]
    assert sorted(shown) == sorted(cmp.keys) and len(shown) == 8
    for e, d in zip(meta["entries"], values, strict=True):
        want = torch.stack([cmp.diff(e["layer"], h["head"])[0] for h in e["heads"]])
        torch.testing.assert_close(d, want, rtol=0, atol=1e-6)
    short = tmp_path / "short.pt"
    _hf_capture(hf_folder, "the cat").save(short)
    assert (
        main(
            [
                "view",
                str(hf_folder),
                "--text",
                TEXT,
                "--against",
                str(short),
                "--out",
                str(tmp_path / "x" / "p.html"),
            ]
        )
        == 2
    )
    assert "a's call is (B, H, T, S) (1, 4, 6, 6) and b's (1, 4, 2, 2)" in capsys.readouterr()[1]


def test_a_source_after_rollout_is_refused_with_the_fix(saved, capsys):
    """``--rollout`` takes an optional value, so a SOURCE written after it is read as that
    value: argparse's exit 2, with a message that says where SOURCE goes."""
    with pytest.raises(SystemExit) as e:
        main(["view", "--rollout", str(saved["a"])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "is not mean or per-head (SOURCE goes before --rollout" in err
