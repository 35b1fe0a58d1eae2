"""The checked core imports without torch: CrossHair and users' CI analyse it torch-free.

import-linter checks the imports written in the source (``make lint``, the
``torch-free`` contract in pyproject.toml). These tests check what really
happens at run time, imports made by name included: every package's
``__init__`` and every module the contract names import in a fresh interpreter
and leave torch unloaded. The module list is the contract's, read from
pyproject.toml, so it is kept in one place.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fsm_cache


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
PACKAGE = Path(fsm_cache.__file__).resolve().parent


def contract(ident: str) -> dict[str, Any]:
    """Return the import-linter contract ``ident`` of pyproject.toml."""
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    (found,) = [c for c in config["tool"]["importlinter"]["contracts"] if c.get("id") == ident]
    return dict(found)


def modules_in(name: str) -> list[str]:
    """Return ``name`` and, if it is a package, every module under it (``__main__`` aside)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    if not path.is_dir():
        return [name]
    found = []
    for file in sorted(path.rglob("*.py")):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__main__":
            found.append(".".join(parts))
    return found


TORCH_FREE_CONTRACT = contract("torch-free")
TORCH_FREE = sorted({m for name in TORCH_FREE_CONTRACT["source_modules"] for m in modules_in(name)})
PACKAGES = sorted(
    ".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")
)

# Import each module in turn; print the first whose import loaded torch, or nothing.
PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def first_to_load_torch(modules: list[str]) -> str:
    """Import ``modules`` in turn in a fresh interpreter; return the first that loaded torch."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_contract_keeps_torch_out() -> None:
    """The contract the list is read from is the one that forbids torch."""
    assert TORCH_FREE_CONTRACT["type"] == "forbidden"
    assert "torch" in TORCH_FREE_CONTRACT["forbidden_modules"]
    assert {"fsm_cache.errors", "fsm_cache.spec.loader", "fsm_cache.memory.pages"} <= set(
        TORCH_FREE
    )


def test_every_package_imports_without_torch() -> None:
    """Each package's ``__init__`` resolves its torch-backed names lazily."""
    assert {"fsm_cache", "fsm_cache.cache", "fsm_cache.memory", "fsm_cache.cli"} <= set(PACKAGES)
    assert first_to_load_torch(PACKAGES) == ""


def test_torch_free_modules_import_without_torch() -> None:
    """Every module under the contract's source modules leaves torch unloaded, imported by name."""
    assert first_to_load_torch(TORCH_FREE) == ""


def test_lazy_names_resolve() -> None:
    """The torch-backed public names resolve on first use."""
    assert fsm_cache.HiCache.__name__ == "HiCache"
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _ = fsm_cache.Nope


def imported(module: str) -> list[str]:
    """Return every module ``module``'s source imports, type-checking-only imports included."""
    tree = ast.parse(PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py").read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_the_leaves_import_nothing_of_ours_even_for_type_checking() -> None:
    """The lowest layer imports no module of fsm_cache's, not even under ``TYPE_CHECKING``.

    import-linter leaves type-checking imports out (they never run), so it let
    ``errors`` import ``engine.trail`` for its annotations while ``engine.trail``
    imports ``errors``: a cycle only mypy followed. ``errors`` names what a
    refusal carries with a protocol instead.
    """
    (leaves,) = [layer for layer in contract("layers")["layers"] if "fsm_cache.errors" in layer]
    names = [name.strip() for name in leaves.split("|")]
    assert names == ["fsm_cache.errors", "fsm_cache.numeric", "fsm_cache.lazy", "fsm_cache.native"]
    ours = {
        leaf: [name for name in imported(leaf) if name.startswith((".", "fsm_cache"))]
        for leaf in names
    }
    assert ours == {leaf: [] for leaf in names}
