"""Lint, format and types, checked in CI like any other test (issue 26).

``ruff check`` and ``ruff format --check`` over src/, tests/ and benchmarks/, and ``mypy`` over
src/qkv, each by the configuration in pyproject.toml. The tools are in the test extras, pinned
in constraints.txt (a newer ruff brings new rules); without one, its test is skipped and says so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "benchmarks"]


def _tool(name: str) -> list[str]:
    """The tool beside this interpreter (the venv's), else on PATH; skip without it."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return [str(here)]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [found]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_check_is_clean():
    done = _run([*_tool("ruff"), "check", "--output-format", "concise", *PATHS])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    done = _run([*_tool("ruff"), "format", "--check", *PATHS])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_mypy_finds_no_type_error_in_src():
    done = _run([*_tool("mypy"), "--no-incremental"])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
