"""``qkv train`` failures the user can fix: one line on stderr naming the fix, exit code 2, no
traceback, checked before any data is generated where that is possible, and no empty output
folder left behind."""

import os
import sys

import pytest
import torch

import qkv.tasks
from qkv.cli.main import main
from qkv.training import available_devices


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("qkv train: error: "), err
    return err


@pytest.fixture
def no_data(monkeypatch):
    """Generating (or loading) a task's data fails the test: the error must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("data was generated before the check that fails")

    monkeypatch.setattr(qkv.tasks, "load", refuse)


@pytest.mark.parametrize(
    "device, message",
    [
        (
            "cdua",
            "device 'cdua' is not a torch device (did you mean 'cuda'?); this machine has: cpu",
        ),
        ("cuda", "device 'cuda' is not available on this machine"),
        ("mps", "device 'mps' is not available on this machine"),
        ("cuda:99", "device 'cuda:99' is not available on this machine"),
    ],
)
def test_a_device_this_machine_lacks_fails_before_the_lra_data(
    tmp_path, capsys, no_data, device, message
):
    if device in available_devices():
        pytest.skip(f"this machine has {device}")
    out = tmp_path / "runs" / "lra"
    assert (
        main(
            [
                "train",
                "listops",
                "--preset",
                "lra",
                "--device",
                device,
                "--cache-dir",
                str(tmp_path / "cache"),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert message in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []  # no cache, no output folder


@pytest.fixture(scope="module")
def reverse_cache(tmp_path_factory):
    """A cache of the ``reverse`` task's data, shared by the tests that train."""
    return tmp_path_factory.mktemp("reverse-cache")


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory, reverse_cache) -> bytes:
    """The checkpoint of a finished 2-step ``reverse`` run."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(_reverse(out, reverse_cache)) == 0
    return (out / "checkpoint.pt").read_bytes()


def _reverse(out, cache, *extra) -> list[str]:
    return [
        "train",
        "reverse",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--quiet",
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
        *extra,
    ]


def _not_a_dict(path) -> None:
    torch.save([1, 2, 3], path)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "not-a-dict"])
def test_a_damaged_checkpoint_is_one_line_on_resume(
    tmp_path, capsys, reverse_cache, checkpoint_bytes, damage
):
    out = tmp_path / "run"
    out.mkdir()
    ckpt = out / "checkpoint.pt"
    if damage == "not-a-dict":
        _not_a_dict(ckpt)
    else:
        ckpt.write_bytes(
            {
                "empty": b"",
                "truncated": checkpoint_bytes[: len(checkpoint_bytes) // 2],
                "garbage": b"this is not a checkpoint\n",
            }[damage]
        )
    damaged = ckpt.read_bytes()
    assert main(_reverse(out, reverse_cache, "--resume")) == 2
    err = _error_line(capsys)
    assert f"{ckpt} ({len(damaged)} bytes) is not a readable qkv checkpoint" in err
    assert "move it away (or delete it) to start the run again" in err
    assert main(_reverse(out, reverse_cache)) == 2  # without --resume: refused, and says why
    assert "not a readable checkpoint: move it away to start again" in _error_line(capsys)
    assert ckpt.read_bytes() == damaged and sorted(p.name for p in out.iterdir()) == [ckpt.name]


def test_out_that_is_or_lies_under_a_file(tmp_path, capsys, no_data):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    for out in (notes, notes / "run", notes / "a" / "b"):
        assert main(["train", "reverse", "--out", str(out)]) == 2
        assert (
            f"cannot use {out} as the output folder: {notes} is a file, not a folder; "
            f"choose another output folder"
        ) in _error_line(capsys)
    assert notes.read_text() == "keep me" and list(tmp_path.iterdir()) == [notes]


def test_out_in_a_folder_without_write_permission(tmp_path, capsys, no_data):
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the permission bits say (see the read-only test)")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        for out in (locked, locked / "run"):
            assert main(["train", "reverse", "--out", str(out)]) == 2
            assert f"cannot write in the output folder {out}: Permission denied" in _error_line(
                capsys
            )
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


@pytest.mark.skipif(
    not os.path.isdir("/sys"),
    reason="needs Linux's sysfs, where nobody, not even root, may create files",
)
@pytest.mark.parametrize("out", ["/sys", "/sys/qkv-test-run/a"])
def test_out_where_even_root_cannot_write(capsys, no_data, out):
    assert main(["train", "reverse", "--out", out]) == 2
    assert f"cannot write in the output folder {out}: " in _error_line(capsys)
    assert not os.path.exists("/sys/qkv-test-run")


def test_digits_without_scikit_learn(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.startswith("sklearn.")] + ["sklearn"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import sklearn...` raises ImportError
    out = tmp_path / "new" / "digits"
    assert main(["train", "digits", "--steps", "2", "--out", str(out)]) == 2
    assert (
        "the digits task reads scikit-learn's bundled images; install it with pip install "
        "'qkv[train]' (or pip install scikit-learn)"
    ) in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []  # the folders it made are gone again


def test_resume_of_nothing_leaves_no_folder(tmp_path, capsys, reverse_cache):
    out = tmp_path / "new" / "run"
    assert main(_reverse(out, reverse_cache, "--resume")) == 2
    assert f"nothing to resume: {out / 'checkpoint.pt'} does not exist" in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_anything_is_written_leaves_no_folder(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(qkv.tasks, "load", interrupted)
    assert main(["train", "reverse", "--out", str(tmp_path / "new" / "run")]) == 130
    assert capsys.readouterr().err == "qkv train: interrupted\n"
    assert list(tmp_path.iterdir()) == []
