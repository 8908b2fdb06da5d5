"""``qkv train``: a short run writes its checkpoint, metrics and cross-attention picture;
an existing run is refused without --resume; bad options fail with one clear line."""
import json

import pytest

from qkv.cli.main import main


def test_short_reverse_run_writes_metrics_checkpoint_and_picture(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "reverse", "--steps", "30", "--batch-size", "16", "--quiet",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
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


@pytest.mark.parametrize("extra, message", [
    (["--window", "4"], "--window is for --attention local"),
    (["--preset", "lra"], "--preset lra is for listops"),
    (["--variant", "full"], "--variant is a ListOps option"),
    (["--steps", "0"], "steps must be a positive int"),
])
def test_bad_options(tmp_path, capsys, extra, message):
    assert main(["train", "reverse", "--out", str(tmp_path / "x"), *extra]) == 2
    assert message in capsys.readouterr().err
