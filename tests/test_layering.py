"""Dependencies run one way (STYLE.md 17): masks/trace -> ops -> autotune, dispatch ->
functional -> nn -> models/tasks/capture -> training/analysis/bench -> cli; viz reads traces
only."""

import ast
from pathlib import Path

import qkv

SRC = Path(qkv.__file__).parent
LAYER = {
    "_files": 0,
    "_identity": 0,
    "_lru": 0,
    "_measured": 0,
    "_progress": 0,
    "_nested": 1,  # nested (jagged) inputs as packed sequences: masks only
    "masks": 0,
    "trace": 0,
    "testing": 0,
    "examples": 0,
    "recording": 0,
    "ops": 1,
    "dispatch": 2,
    "autotune": 2,
    "lazy_trace": 2,
    "functional": 3,
    "nn": 4,
    "models": 5,
    "tasks": 5,
    "viz": 5,
    "distributed": 3,
    "capture": 5,
    "walkthrough": 5,
    "torch_compat": 5,
    "integrations": 5,
    "training": 6,
    "bench": 6,
    "cli": 7,
    "__main__": 8,
    "analysis": 6,
    "sources": 6,
}
VIZ_MAY_IMPORT = {"trace", "viz"}


def _top(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _display_hooks(tree: ast.AST) -> set[int]:
    """id()s of the nodes inside a ``_repr_html_``: Jupyter's display hook of a trace or a
    capture imports viz there, on first display, and nowhere else (the one way up allowed:
    nothing in the object's own module needs viz, and ``import qkv`` loads none of it)."""
    return {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.name == "_repr_html_"
        for n in ast.walk(f)
    }


def _qkv_imports(path: Path) -> set[str]:
    """Top-level qkv modules that ``path`` imports (viz from a display hook aside)."""
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(SRC).parts[:-1]
    found = set()
    hooks = _display_hooks(tree)
    for node in ast.walk(tree):
        if (
            id(node) in hooks
            and isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "viz"
            and node.level == 1
        ):
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "qkv" and len(parts) > 1:
                    found.add(parts[1])
                elif parts[0] == "qkv":
                    found.update(a.name for a in node.names)
                continue
            base = list(pkg[: len(pkg) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            found.update([target[0]] if target else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qkv."))
    return found


def test_imports_point_down():
    wrong = []
    for path in SRC.rglob("*.py"):
        top = _top(path)
        if top == "__init__":
            continue
        assert top in LAYER, f"{path}: give the new module {top!r} a layer in this test"
        for dep in _qkv_imports(path) - {top}:
            if top == "viz" and dep not in VIZ_MAY_IMPORT:
                wrong.append(f"{path.relative_to(SRC)} imports {dep} (viz reads traces only)")
            elif LAYER.get(dep, 99) > LAYER[top]:
                wrong.append(f"{path.relative_to(SRC)} imports {dep}, a layer above it")
    assert not wrong, "\n".join(wrong)


def test_import_scanner_sees_relative_imports():
    assert _qkv_imports(SRC / "dispatch.py") == {
        "_measured",
        "autotune",
        "lazy_trace",
        "ops",
        "trace",
    }
    assert _qkv_imports(SRC / "trace.py") == set()  # its _repr_html_'s viz is a display hook
    assert _qkv_imports(SRC / "ops" / "reference.py") == {"_identity", "masks", "ops"}


def test_packages_count_as_their_top_module():
    """A file inside a package (``masks/blocks.py``) takes the package's layer, and imports
    between the package's own files are no dependency."""
    assert _top(SRC / "masks" / "blocks.py") == "masks"
    assert _qkv_imports(SRC / "masks" / "dense.py") == {"masks"}
    assert _qkv_imports(SRC / "ops" / "call.py") >= {"masks"}


def test_import_qkv_needs_only_torch():
    """``import qkv`` loads no optional library (matplotlib, triton, transformers) beyond what
    torch itself loads: ``torch._dynamo``, which qkv imports, pulls in triton whenever it is
    installed, so the modules torch loads are the baseline."""
    import fresh

    optional = ("matplotlib", "triton", "transformers", "networkx", "scipy")
    code = "import sys, {}; print(sorted(m for m in sys.modules if m.split('.')[0] in {!r}))"

    def loaded(imports):
        out = fresh.run(code.format(imports, optional), check=True)  # torch imported, no more
        return set(eval(out.stdout))  # a printed list of module names

    assert loaded("qkv") - loaded("torch, torch._dynamo") == set()
