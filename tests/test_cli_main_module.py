"""``python -m qkv``: the same command line as the ``qkv`` script, for environments where the
script is not on PATH (a venv that is not activated, a notebook's ``!python -m qkv``)."""

import subprocess
import sys

from qkv.cli.main import make_parser


def _python_m_qkv(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_help_lists_every_subcommand():
    proc = _python_m_qkv("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: qkv ")
    commands = make_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {
        "seeds",
        "explain",
        "bench",
        "bench-decode",
        "train",
        "view",
        "lra",
        "tune",
    }
    for name in commands:
        assert f"    {name} " in proc.stdout, name


def test_a_subcommand_runs_and_its_exit_code_comes_back(tmp_path):
    proc = _python_m_qkv("seeds", "--example", "seed004", "--backend", "reference")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("OK: largest difference from the exact values")
    bad = _python_m_qkv("train", "reverse", "--device", "cdua", "--out", str(tmp_path / "run"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == (
        "qkv train: error: device 'cdua' is not a torch device (did you "
        "mean 'cuda'?); this machine has: " + _devices() + "\n"
    )
    assert not (tmp_path / "run").exists()


def _devices() -> str:
    from qkv.training import available_devices

    return ", ".join(available_devices())
