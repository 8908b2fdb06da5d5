"""What an install of qkv holds: every file the library reads at run time.

The C++ kernels (``ops/*.cpp``) are built at first use from their sources. The editable install
that ``make test`` makes reads them from the tree, so a wheel that left them out went unseen:
``pyproject.toml`` listed the deformable kernel alone, and on such an install every CPU call
raised FileNotFoundError from the build of the NaN/inf passes. Now the package data names them,
and a source that is missing all the same gives the tensor ops' way (the same math).
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.ops import _native_build, nonfinite_rows

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(qkv.__file__).resolve().parent


def test_every_file_read_at_run_time_is_in_the_package_data():
    """Each file under src/qkv that is not Python (kernel sources, the viewer's script and
    style) matches a pattern of ``[tool.setuptools.package-data]`` for its own package."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib (reading pyproject.toml) is Python 3.11's")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]
    files = [
        p
        for p in SRC.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert any(p.name == "nonfinite_rows.cpp" for p in files)  # (the glob sees the kernels)
    missing = []
    for path in files:
        package = ".".join(("qkv",) + path.parent.relative_to(SRC).parts)
        if not any(fnmatch.fnmatch(path.name, pat) for pat in data.get(package, [])):
            missing.append(f"{package}: {path.name}")
    assert not missing, f"not in pyproject.toml's package-data: {missing}"


def test_a_kernel_source_the_install_left_out_gives_the_tensor_ops_way(monkeypatch, tmp_path):
    """Without its source the library is not built, with the reason; the NaN/inf contract then
    takes its tensor ops, and a call gives the same output as with the library."""
    lib, why = _native_build.build(tmp_path / "absent.cpp", "qkv_absent")
    assert lib is None and "absent.cpp is not installed" in why
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 5, 5))
    k[0, 1, 2, 0] = float("nan")
    with torch.no_grad():
        want = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(nonfinite_rows, "SOURCE", tmp_path / "absent.cpp")
    nonfinite_rows._build.cache_clear()
    monkeypatch.setattr(qkv.functional, "_LANES", {})  # (kept lanes hold the library's calls)
    try:
        assert not nonfinite_rows.available()
        assert "is not installed" in nonfinite_rows._build()[1]
        with torch.no_grad():
            got = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0))
    finally:
        monkeypatch.undo()
        nonfinite_rows._build.cache_clear()  # the library again for the tests after this one


_BUILD_AND_CALL = """
import ctypes, sys
from pathlib import Path
from qkv.ops import _native_build
lib, why = _native_build.build(Path(sys.argv[1]), "qkv_test_stale_lock")
assert lib is not None, why
lib.answer.restype = ctypes.c_int
print(lib.answer())
"""


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path):
    """torch's build directory lock is a file only its maker removes: a build killed midway
    (Ctrl-C, a time limit) left it, and every later process waited on it forever (a fresh
    clone's test run hung). A build over such a lock file goes through, in a subprocess
    bounded in time; a second process loads the cached library."""
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int answer() { return 42; }\n')
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))

    def run():
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_AND_CALL, str(source)],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    assert run() == "42"  # built once
    locks = list((tmp_path / "ext").rglob("qkv-build.lock"))
    assert len(locks) == 1
    stale = locks[0].parent / "lock"  # what a build killed midway leaves
    stale.write_text("")
    assert run() == "42"  # not a wait without end
    assert not stale.exists()
