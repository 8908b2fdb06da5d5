"""Every ``qkv`` subcommand, run in-process, and the library functions that set torch's global
settings leave them as they found them: threads, default dtype, grad mode, the deterministic
flag and the random number generator. (``bench-decode --threads 1`` once left the whole test
session on one thread, and a later training test saw another loss.)"""

import pytest
import torch

import qkv
from qkv.bench import DecodeConfig, Spec, measure_decode, run_measurement
from qkv.cli.main import main, make_parser
from qkv.training import TorchState, preserve_torch_state

THREADS = 3  # the session's setting here; the commands ask for 1


def _argv(command: str, tmp_path) -> list[str]:
    fast = ["--min-run-time", "0.01", "--threads", "1"]
    return {
        "seeds": ["seeds", "--example", "seed004"],
        # D=24: flex declines it (no compile here); torch and tiled are timed
        "tune": [
            "tune",
            "--lengths",
            "16",
            "--dtypes",
            "float32",
            "--cases",
            "none",
            "--dim",
            "24",
        ],
        "explain": ["explain", "--example", "seed004", "--heads", "3"],
        "bench": [
            "bench",
            "--cases",
            "none",
            "--lengths",
            "16",
            "--dtypes",
            "fp32",
            "--modes",
            "fwd",
            "--impls",
            "tiled",
            *fast,
        ],
        "bench-decode": [
            "bench-decode",
            "--positions",
            "8",
            "--impls",
            "recurrent",
            "--tokens-per-block",
            "2",
            *fast,
        ],
        "train": [
            "train",
            "reverse",
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--quiet",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "run"),
        ],
        "lra": [
            "lra",
            "--variant",
            "tiny",
            "--tasks",
            "pathfinder",
            "--attention",
            "local",
            "--steps",
            "2",
            "--quiet",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "lra"),
        ],
        "view": [
            "view",
            str(_saved_capture(tmp_path / "capture.pt")),
            "--out",
            str(tmp_path / "page.html"),
        ],
    }[command]


class _Attend(torch.nn.Module):
    def forward(self, x):
        return qkv.scaled_dot_product_attention(x, x, x, is_causal=True)


def _saved_capture(path):
    """A capture file, made without touching torch's global generator."""
    x = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(_Attend())
    with qkv.capture(model) as cap:
        model(x)
    cap.save(path)
    return path


COMMANDS = ["seeds", "explain", "bench", "bench-decode", "train", "lra", "view", "tune"]


@pytest.fixture
def settings():
    """A session state no command would choose: 3 threads, a drawn-from generator."""
    with preserve_torch_state():
        torch.set_num_threads(THREADS)
        torch.manual_seed(20240611)
        torch.rand(5)
        yield _snapshot()


def _snapshot() -> dict:
    return dict(
        threads=torch.get_num_threads(),
        dtype=torch.get_default_dtype(),
        grad=torch.is_grad_enabled(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        rng=torch.get_rng_state(),
    )


def _assert_unchanged(before: dict) -> None:
    after = _snapshot()
    assert after["threads"] == before["threads"] == THREADS
    assert after["dtype"] == before["dtype"] and after["grad"] == before["grad"]
    assert after["deterministic"] == before["deterministic"]
    assert torch.equal(after["rng"], before["rng"])


def test_every_subcommand_is_covered():
    assert set(make_parser()._subparsers._group_actions[0].choices) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_subcommand_leaves_torch_settings_alone(command, settings, tmp_path, capsys):
    assert main(_argv(command, tmp_path)) == 0, capsys.readouterr().err
    _assert_unchanged(settings)


def test_a_failing_subcommand_leaves_them_too(settings, tmp_path, capsys):
    (tmp_path / "cache").mkdir()
    (tmp_path / "run").write_text("a file where the output folder should go")
    assert main(_argv("train", tmp_path)) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    _assert_unchanged(settings)


def test_measurements_in_this_process_restore_threads_and_seed(settings):
    rec = run_measurement(Spec("none", 16, "fp32", "fwd", "tiled"), 0.01, threads=1)
    assert rec["status"] == "ok" and rec["threads"] == 1  # it ran on the one thread asked for
    _assert_unchanged(settings)
    rec = measure_decode("recurrent", 8, DecodeConfig(tokens_per_block=2, min_run_time=0.01))
    assert rec["status"] == "ok"
    _assert_unchanged(settings)


def test_preserve_torch_state_restores_everything_even_on_error(settings):
    with pytest.raises(KeyError), preserve_torch_state() as before:
        assert before.same_as(TorchState.capture())
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(0)
        assert not before.same_as(TorchState.capture())
        raise KeyError("the block fails")
    _assert_unchanged(settings)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
