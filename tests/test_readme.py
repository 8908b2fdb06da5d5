"""Every python block of README.md runs, in order, as written, in one namespace (issue 25).

A block preceded by ``<!-- readme-test: skip (reason) -->`` is left out with its reason (it
needs torchrun, a GPU or a network). The blocks run in a temporary working directory (they
write files) with the task cache there too, and stay small enough for CI.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"
_BLOCK = re.compile(
    r"(<!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```", re.S
)


def blocks() -> list[tuple[int, str, str | None]]:
    """(line, code, reason to skip or None) of each python block, in order."""
    text = README.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("why"))
        for m in _BLOCK.finditer(text)
    ]


def test_readme_has_python_blocks_and_runs_most():
    """The front page's three examples (the manual is under docs/, run by test_docs.py)."""
    found = blocks()
    assert len(found) >= 3 and sum(why is None for _, _, why in found) >= 3


def test_readme_links_to_pages_that_exist():
    """README links the site's pages relatively (docs/*.md), so they work on GitHub too."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert sum(link.startswith("docs/") and link.endswith(".md") for link in links) >= 10
    missing = [link for link in links if not (README.parent / link).exists()]
    assert not missing, missing


def test_readme_python_blocks_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    namespace: dict = {"__name__": "readme"}
    for line, code, why in blocks():
        if why is not None:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(
                f"README.md block at line {line} fails as written: {type(e).__name__}: {e}"
            ) from e
    assert (tmp_path / "attention.html").stat().st_size > 0  # the viewer block wrote its page
