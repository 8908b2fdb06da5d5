"""Models that keep their own tables of attention classes (:func:`refuse_in_own_tables`,
:func:`withdraw_from_own_tables`), and the import finder that changes transformers' modeling
modules as they load (:func:`watch_imports`)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

# --- models that keep their own tables of attention classes -------------------------------------
#
# A few models (git, sam, sam_hq, unlimited_ocr, data2vec_vision, ...) pick their attention
# class from a module-level dict such as GIT_SELF_ATTENTION_CLASSES by the config's
# attn_implementation, and never call the AttentionInterface: with "qkv" they raised
# KeyError: 'qkv'. register() puts an entry under its name in every such table, in the
# modules imported now and (through a finder on sys.meta_path) in those imported later, that
# raises one clear error naming the model and the way out.

_OWN_TABLE_NAMES: set[str] = set()
_TABLE_SUFFIX = "_ATTENTION_CLASSES"
# what runs on each transformers modeling module as it loads, while the finder is installed
_AFTER_IMPORT: list[Callable[[ModuleType], None]] = []


def refuse_in_own_tables(name: str) -> None:
    _OWN_TABLE_NAMES.add(name)
    for module in modeling_modules():
        _patch_tables(module)
    watch_imports(_patch_tables)


def withdraw_from_own_tables(name: str) -> None:
    """Undo :func:`refuse_in_own_tables` for ``name``; the finder goes with the last name."""
    _OWN_TABLE_NAMES.discard(name)
    for module in modeling_modules():
        for table in _tables(module):
            entry = table.get(name)
            if isinstance(entry, _OwnTableRefusal) and entry.name == name:
                del table[name]
    if not _OWN_TABLE_NAMES:
        unwatch_imports(_patch_tables)


def watch_imports(hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook`` on every transformers modeling module imported from now on (through a
    finder on ``sys.meta_path``, installed with the first hook)."""
    import sys

    if hook not in _AFTER_IMPORT:
        _AFTER_IMPORT.append(hook)
    if not any(isinstance(f, _TablePatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TablePatcher())


def unwatch_imports(hook: Callable[[ModuleType], None]) -> None:
    """Stop running ``hook``; the finder leaves ``sys.meta_path`` with the last hook."""
    import sys

    if hook in _AFTER_IMPORT:
        _AFTER_IMPORT.remove(hook)
    if not _AFTER_IMPORT:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TablePatcher)]


def watching(hook: Callable[[ModuleType], None]) -> bool:
    """Whether ``hook`` runs on the modeling modules imported from now on."""
    return hook in _AFTER_IMPORT


def modeling_modules() -> list[ModuleType]:
    """transformers' modeling modules loaded now (``transformers.models.<x>.modeling_<x>``)."""
    import sys

    return [m for n, m in list(sys.modules.items()) if _is_modeling_module(n) and m is not None]


def _is_modeling_module(name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) == 4
        and parts[:2] == ["transformers", "models"]
        and parts[3].startswith("modeling_")
    )


def _tables(module) -> list[dict]:
    return [
        table
        for attr, table in list(vars(module).items())
        if attr.endswith(_TABLE_SUFFIX) and isinstance(table, dict)
    ]


def _patch_tables(module) -> None:
    for attr, table in list(vars(module).items()):
        if attr.endswith(_TABLE_SUFFIX) and isinstance(table, dict):
            for name in _OWN_TABLE_NAMES:
                table.setdefault(
                    name,
                    _OwnTableRefusal(
                        module.__name__,
                        attr,
                        name,
                        sorted(k for k in table if k not in _OWN_TABLE_NAMES),
                    ),
                )


class _OwnTableRefusal:
    """What a model's own attention table holds under qkv's name: building it raises."""

    def __init__(self, module: str, table: str, name: str, choices: list) -> None:
        self.model = module.split(".")[2]
        self.table, self.name, self.choices = table, name, choices

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.model} picks its attention classes from its own table {self.table} "
            f"({', '.join(map(repr, self.choices))}) instead of transformers' AttentionInterface, "
            f"so attn_implementation={self.name!r} cannot run it. Build it with one of those; in "
            f"a composite model, give {self.name!r} only to the sub-configs whose attention goes "
            f"through the interface, e.g. attn_implementation={{'text_config': {self.name!r}, "
            f"'vision_config': 'eager'}}"
        )


class _TablePatcher:
    """A finder that lets transformers' modeling modules load as usual, then runs the hooks of
    :func:`watch_imports` on them (attention tables, deformable attention classes)."""

    def find_spec(self, fullname, path, target=None):
        import sys

        if not _is_modeling_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            for hook in list(_AFTER_IMPORT):
                hook(module)

        loader.exec_module = exec_module
        return spec
