"""``qkv train``: a short run writes its checkpoint, metrics and cross-attention picture;
an existing run is refused without --resume; bad options fail with one clear line."""

import json

import pytest

from qkv.cli.main import main


def test_short_reverse_run_writes_metrics_checkpoint_and_picture(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "reverse",
        "--steps",
        "30",
        "--batch-size",
        "16",
        "--quiet",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert printed["steps"] == metrics["step"] == 30
    assert metrics["config"]["batch_size"] == 16 and metrics["recipe"]["task"] == "reverse"
    assert 0.0 <= metrics["evaluation"]["exact_match"] <= 1.0
    assert (out / "checkpoint.pt").exists() and (out / "cross_attention.png").stat().st_size > 0
    first, last = metrics["history"][0]["loss"], metrics["history"][-1]["loss"]
    assert last < first  # 30 steps already lower the loss
    assert main(args) == 2  # the run exists: refused, not overwritten
    assert "pass resume=True" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0  # nothing left to train: evaluates again


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--window", "4"], "--window is for --attention local"),
        (["--preset", "lra"], "--preset lra is for listops"),
        (["--variant", "full"], "--variant is a ListOps option"),
        (["--steps", "0"], "steps must be a positive int"),
    ],
)
def test_bad_options(tmp_path, capsys, extra, message):
    assert main(["train", "reverse", "--out", str(tmp_path / "x"), *extra]) == 2
    assert message in capsys.readouterr().err


def _args(*argv):
    import argparse

    from qkv.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_lra_preset_is_lras_released_listops_config():
    from qkv.cli.train import plan

    recipe, config = plan(_args("listops", "--preset", "lra", "--out", "x"))
    assert recipe["task"] == "listops" and recipe["data"] == {"variant": "full"}
    assert recipe["model"] == dict(
        embed_dim=512, num_heads=8, num_layers=4, ffn_dim=1024, dropout=0.1
    )
    assert (config.steps, config.batch_size, config.lr) == (5000, 32, 0.05)
    assert (config.warmup_steps, config.schedule, config.weight_decay) == (1000, "rsqrt", 0.1)
    # options given on the command line win over the preset; the preset is not changed
    recipe, config = plan(
        _args(
            "listops",
            "--preset",
            "lra",
            "--steps",
            "7",
            "--attention",
            "local",
            "--window",
            "16",
            "--variant",
            "cpu",
            "--out",
            "x",
        )
    )
    assert config.steps == 7 and config.lr == 0.05 and recipe["data"] == {"variant": "cpu"}
    assert recipe["attention"] == "local" and recipe["attention_options"] == {"window": 16}
    assert plan(_args("listops", "--preset", "lra", "--out", "x"))[0]["data"] == {"variant": "full"}


def test_ctrl_c_on_the_command_leaves_a_checkpoint_that_resumes_to_the_same_result(
    tmp_path, monkeypatch
):
    """SIGINT to a running ``qkv train``: exit 130 with a checkpoint; ``--resume`` then ends
    with the uninterrupted run's final loss, to the bit."""
    import signal
    import subprocess
    import sys
    import time

    import torch

    from qkv.training.recipes import Seq2SeqRecipe

    # the two runs in this process draw no pictures (1-2 s each; the results compared here
    # come before them, and test_short_reverse_run_writes_metrics_checkpoint_and_picture
    # checks the picture of a run of the command)
    monkeypatch.setattr(Seq2SeqRecipe, "pictures", lambda self, model, out_dir, device: [])

    common = [
        "reverse",
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "5",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    cut = tmp_path / "cut"
    code = "import sys; from qkv.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "train", *common, "--quiet", "--out", str(cut)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (cut / "checkpoint.pt").exists():  # training has started: the handler is set
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "--resume" in err and out == ""
    step = torch.load(cut / "checkpoint.pt", weights_only=False)["step"]
    assert 5 <= step < 60
    assert main(["train", *common, "--quiet", "--out", str(cut), "--resume"]) == 0
    full = tmp_path / "full"
    assert main(["train", *common, "--quiet", "--out", str(full)]) == 0
    resumed = json.loads((cut / "metrics.json").read_text())
    straight = json.loads((full / "metrics.json").read_text())
    assert resumed["step"] == straight["step"] == 60
    assert resumed["final_loss"] == straight["final_loss"]
    assert resumed["evaluation"] == straight["evaluation"]


def test_without_matplotlib_the_results_are_written_and_one_warning_line_says_why(
    tmp_path, capsys, monkeypatch
):
    import sys

    for name in [m for m in sys.modules if m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` raises ImportError
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "reverse",
                "--steps",
                "3",
                "--batch-size",
                "8",
                "--quiet",
                "--cache-dir",
                str(tmp_path / "cache"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed, err = capsys.readouterr()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == json.loads(printed)["steps"] == 3
    assert 0.0 <= metrics["evaluation"]["exact_match"] <= 1.0
    assert metrics["pictures"] == json.loads(printed)["pictures"] == []
    assert err == (
        f"reverse: warning: no pictures (plotting attention needs matplotlib: pip "
        f"install 'qkv[viz]'); the results are in {out / 'metrics.json'}\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "metrics.json"]
