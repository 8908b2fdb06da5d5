"""``qkv lra``: a tiny table (both tasks, two attention kinds, a few steps a cell) writes
lra_table.md/json with the right cells; --resume skips finished cells and continues an
interrupted one; bad arguments fail with one clear line; Pathfinder is read as 1,024 pixel
tokens; ``qkv train pathfinder`` is wired like ListOps."""

import json
import os
import signal

import pytest
import torch

from qkv.cli.main import main
from qkv.training import lra
from qkv.training.recipes import ClassifierRecipe, PixelRecipe

TINY = [
    "--variant",
    "tiny",
    "--tasks",
    "listops",
    "pathfinder",
    "--attention",
    "exact",
    "linear",
    "--quiet",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _table(out):
    return json.loads((out / lra.TABLE_JSON).read_text()), (out / lra.TABLE_MD).read_text()


def test_tiny_table_has_every_cell_with_values_in_range_and_resume_skips_them(
    tmp_path, cache, capsys
):
    out = tmp_path / "lra"
    args = ["lra", *TINY, "--cache-dir", cache, "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    data, md = _table(out)
    assert data["variant"] == "tiny" and data["seed"] == 0
    cells = {(c["task"], c["attention"]): c for c in data["cells"]}
    assert list(cells) == [
        ("listops", "exact"),
        ("listops", "linear"),
        ("pathfinder", "exact"),
        ("pathfinder", "linear"),
    ]
    paper = {
        ("listops", "exact"): 36.37,
        ("listops", "linear"): 16.13,
        ("pathfinder", "exact"): 71.40,
        ("pathfinder", "linear"): 75.30,
    }
    for key, c in cells.items():
        assert c["status"] == "done" and c["steps"] == 3 and c["seed"] == 0
        assert 0.0 <= c["accuracy"] <= 1.0 and 0.0 < c["majority"] <= 1.0
        assert c["train_examples"] == 48 and c["test_examples"] == 16
        assert c["wall_s"] > 0 and c["lra_table1"] == paper[key]
        folder = out / key[0] / key[1]
        assert (folder / "checkpoint.pt").exists() and (folder / "metrics.json").exists()
        assert (folder / "attention_last_layer.png").stat().st_size > 0
    assert cells[("pathfinder", "exact")]["majority"] == 0.5  # label-balanced pairs
    assert "| exact (Transformer) |" in md and "71.40" in md and "16.13" in md
    assert md in printed
    # --resume: every cell is finished, so none is trained again
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*/metrics.json")}
    assert main(args + ["--resume"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*/metrics.json")} == stamps
    assert _table(out)[0]["cells"] == data["cells"]
    # without --resume the folder is refused, not overwritten
    assert main(args) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_cells_and_resume_continues_the_interrupted_one(
    tmp_path, cache, monkeypatch, capsys
):
    out = tmp_path / "lra"
    args = [
        "lra",
        "--variant",
        "tiny",
        "--tasks",
        "pathfinder",
        "listops",
        "--attention",
        "local",
        "--steps",
        "4",
        "--quiet",
        "--cache-dir",
        cache,
        "--out",
        str(out),
    ]
    real_train = lra.train

    def ctrl_c_at_step_2_of_listops(recipe, config, out_dir, **kw):
        if recipe.task == "listops":  # SIGINT to this process: the trainer's handler stops
            kw["on_step"] = lambda s: os.kill(os.getpid(), signal.SIGINT) if s == 2 else None
        return real_train(recipe, config, out_dir, **kw)

    # no pictures (3 s; the cells, steps and resume are what this test checks, the pictures
    # of every cell test_tiny_table_has_every_cell_with_values_in_range_and_resume_skips_them's)
    for kind in (ClassifierRecipe, PixelRecipe):
        monkeypatch.setattr(kind, "pictures", lambda self, model, out_dir, device: [])

    monkeypatch.setattr(lra, "train", ctrl_c_at_step_2_of_listops)
    assert main(args) == 130
    assert "--resume" in capsys.readouterr().err
    data, _md = _table(out)
    done, cut = data["cells"]
    assert (done["task"], done["status"], done["steps"]) == ("pathfinder", "done", 4)
    assert (cut["task"], cut["status"], cut["steps"]) == ("listops", "interrupted", 2)
    assert torch.load(out / "listops/local/checkpoint.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(lra, "train", real_train)
    stamp = (out / "pathfinder/local/metrics.json").stat().st_mtime_ns
    assert main(args + ["--resume"]) == 0
    data, _ = _table(out)
    assert [(c["status"], c["steps"]) for c in data["cells"]] == [("done", 4), ("done", 4)]
    assert (out / "pathfinder/local/metrics.json").stat().st_mtime_ns == stamp
    history = json.loads((out / "listops/local/metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert data["cells"][1]["wall_s"] >= cut["wall_s"]
    # other settings on --resume are refused, naming what differs
    assert (
        main([*args[:-4], "--steps", "5", "--cache-dir", cache, "--out", str(out), "--resume"]) == 2
    )
    assert "other settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "text"], "unknown task 'text'; qkv lra knows listops, pathfinder"),
        (
            ["--attention", "exact", "reformer", "sinkhorn"],
            "unknown attention kinds 'reformer', 'sinkhorn'; qkv lra knows exact",
        ),
        (["--variant", "gpu"], "unknown variant 'gpu'; the variants are cpu, lra, tiny"),
        (["--attention", "exact", "exact"], "attention kind 'exact' given twice"),
        (["--steps", "0"], "steps must be a positive int"),
        (["--device", "cdua"], "did you mean 'cuda'"),
    ],
)
def test_bad_arguments_fail_with_one_clear_line(tmp_path, capsys, argv, message):
    out = tmp_path / "x"
    assert main(["lra", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()  # nothing was made


def test_tasks_and_kinds_given_as_iterators_are_kept():
    """The check reads each list once: generators come back as their names (they came back
    empty before, after the check had used them up, and the run had no cell)."""
    tasks, kinds = lra._check_names(iter(["listops"]), (k for k in ("exact", "linear")), "tiny")
    assert (tasks, kinds) == (["listops"], ["exact", "linear"])


def test_pathfinder_model_reads_32x32_as_1024_pixel_tokens(cache):
    from qkv.training.recipes import PixelRecipe, make_recipe, pixel_tokens

    settings = lra.cell_settings("pathfinder", "exact", "tiny")
    recipe = make_recipe(**settings["recipe"], cache_dir=cache)
    assert isinstance(recipe, PixelRecipe)
    batch = recipe.batch(torch.arange(4), "cpu")
    assert batch["tokens"].shape == (4, 1024) and batch["tokens"].dtype == torch.int64
    images = recipe.train_data.images[:4]  # (4, 1, 32, 32)
    assert torch.equal(batch["tokens"], (images.flatten(1) * 255).round().long())
    assert torch.equal(
        pixel_tokens(images)[0, 32 * 5 + 7],
        pixel_tokens(images[:1, :, 5, 7].reshape(1, 1, 1, 1))[0, 0],
    )
    model = recipe.build_model()
    logits, maps = model(batch["tokens"], return_attention=True)
    assert logits.shape == (4, 2)
    assert maps.encoder[-1].probs.shape == (4, 2, 1024, 1024)  # no CLS: mean pooling
    assert model.embed.tokens.num_embeddings == 256 and model.embed.max_len == 1024


def _args(*argv):
    import argparse

    from qkv.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_qkv_train_pathfinder_is_wired_like_listops():
    from qkv.cli.train import DEFAULTS, plan
    from qkv.training.recipes import ClassifierRecipe, PixelRecipe

    recipe, config = plan(_args("pathfinder", "--attention", "linear", "--out", "x"))
    assert recipe["task"] == "pathfinder" and recipe["attention"] == "linear"
    cpu = lra.VARIANTS["cpu"]
    assert config.steps == cpu["pathfinder"]["train"]["steps"]
    assert cpu["pathfinder"]["model"] == PixelRecipe.MODEL  # qkv train = qkv lra's cell
    assert DEFAULTS["listops"] == cpu["listops"]["train"]
    assert cpu["listops"]["model"] == ClassifierRecipe.MODEL
    recipe, config = plan(
        _args("pathfinder", "--preset", "lra", "--difficulty", "easy", "--out", "x")
    )
    assert recipe["model"]["embed_dim"] == 128 and config.batch_size == 512
    assert recipe["data"]["difficulty"] == "easy" and config.grad_clip is None
    with pytest.raises(ValueError, match="--difficulty is a Pathfinder option"):
        plan(_args("listops", "--difficulty", "hard", "--out", "x"))
