"""Every python block of the documentation site runs, and the site builds (issue 26).

Each page under ``docs/`` runs its python blocks in order, as written, in one namespace of its
own, as ``tests/test_readme.py`` runs README's: ``<!-- readme-test: skip (reason) -->`` before a
block leaves it out with its reason. A block may be followed by its printed output, marked::

    <!-- output -->
    ```text
    ...
    ```

and that text must be what the block prints, so the numbers a page shows are the numbers its
code computes. ``python tests/test_docs.py docs/PAGE.md`` rewrites a page's output blocks from
a run of its code (how they were made: never type them in).

``test_mkdocs_build_strict`` builds the site as ``make docs`` does (``mkdocs build --strict``:
broken links, missing pages and unresolved references fail); it skips, naming the reason, where
the ``docs`` extra is not installed.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md"))
_BLOCK = re.compile(
    r"(?:<!-- readme-test: skip \((?P<why>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```\n"
    r"(?:\n?<!-- output -->\n```text\n(?P<out>.*?)```\n)?",
    re.S,
)
# pages whose code needs an optional library of the test extras
_NEEDS = {"integrations.md": "transformers"}


def blocks(page: Path) -> list[dict]:
    """line, code, why (reason to skip or None), out (the printed output shown, or None) and
    the span of the output text, of each python block of ``page``, in order."""
    text = page.read_text()
    return [
        dict(
            line=text.count("\n", 0, m.start("code")) + 1,
            code=m.group("code"),
            why=m.group("why"),
            out=m.group("out"),
            out_span=m.span("out"),
        )
        for m in _BLOCK.finditer(text)
    ]


def run_page(page: Path) -> list[tuple[dict, str]]:
    """Run the page's blocks in one namespace; (block, what it printed) for each block run."""
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    printed = []
    for b in blocks(page):
        if b["why"] is not None:
            continue
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(b["code"], f"{page.name}:{b['line']}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(
                f"docs/{page.name} block at line {b['line']} fails as written: "
                f"{type(e).__name__}: {e}"
            ) from e
        printed.append((b, buf.getvalue()))
    return printed


def _same(shown: str, printed: str) -> bool:
    def lines(s):
        return [line.rstrip() for line in s.rstrip().splitlines()]

    return lines(shown) == lines(printed)


def test_every_page_is_tested_and_has_code():
    assert {p.name for p in PAGES} >= {"tutorials.md", "masks.md", "getting-started.md"}
    for name in ("tutorials.md", "masks.md", "getting-started.md", "models.md"):
        assert any(b["why"] is None for b in blocks(DOCS / name)), name


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_python_blocks_run_in_order(page, tmp_path, monkeypatch):
    if page.name in _NEEDS:
        pytest.importorskip(_NEEDS[page.name], reason=f"docs/{page.name} needs {_NEEDS[page.name]}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    for b, printed in run_page(page):
        if b["out"] is not None:
            assert _same(b["out"], printed), (
                f"docs/{page.name} block at line {b['line']} prints other numbers than the page "
                f"shows; rerun `python tests/test_docs.py docs/{page.name}`.\n"
                f"shown:\n{b['out']}\nprinted:\n{printed}"
            )


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')"
    )
    pytest.importorskip(
        "mkdocstrings_handlers.python",
        reason="mkdocstrings-python is not installed (pip install -e '.[docs]')",
    )
    pytest.importorskip(
        "material", reason="mkdocs-material is not installed (pip install -e '.[docs]')"
    )
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "tutorials" / "index.html").stat().st_size > 0
    assert (tmp_path / "site" / "api" / "masks" / "index.html").stat().st_size > 0


def _update(page: Path) -> None:
    """Rewrite the output blocks of ``page`` with what its code prints."""
    import tempfile

    text = page.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("QKV_CACHE", str(Path(tmp) / "cache"))
        os.chdir(tmp)
        runs = run_page(page)
    for b, printed in reversed(runs):
        if b["out"] is not None:
            start, end = b["out_span"]
            shown = "\n".join(line.rstrip() for line in printed.rstrip().splitlines())
            text = text[:start] + shown + "\n" + text[end:]
    page.write_text(text)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        _update(Path(arg).resolve())
