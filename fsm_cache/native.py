"""Which of fsm_cache's modules run compiled, and the switch back to their sources.

``make compile`` (scripts/compile.py) compiles the cache's hot modules with
mypyc, in place: an extension module beside each source, which Python imports
in its stead. The sources stay the reference. Set ``FSM_CACHE_PURE=1`` before
fsm_cache is first imported to run them instead (a debugger, a profiler,
coverage), or call :func:`prefer_sources` first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


ENVIRONMENT = "FSM_CACHE_PURE"
"""The environment variable that, set to anything but ``""`` or ``0``, runs the sources."""

_PACKAGE = "fsm_cache."


class _Sources(importlib.abc.MetaPathFinder):
    """Finds fsm_cache's compiled modules as the sources beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        del target
        if not fullname.startswith(_PACKAGE):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or not _is_extension(spec):
            return None
        source = _source_of(Path(spec.origin))
        if not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def _is_extension(spec: importlib.machinery.ModuleSpec) -> bool:
    return isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)


def _source_of(extension: Path) -> Path:
    """``hicache.py`` for ``hicache.cpython-311-x86_64-linux-gnu.so``."""
    return extension.with_name(extension.name.split(".", 1)[0] + ".py")


def prefer_sources() -> None:
    """Import fsm_cache's modules from their sources from now on, where both are present.

    Modules already imported stay as they are, so call it before importing
    fsm_cache's submodules; the ``FSM_CACHE_PURE`` variable does it at the
    package's import.
    """
    if not any(isinstance(finder, _Sources) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Sources())


def wanted_pure() -> bool:
    """Whether the environment asks for the sources (``FSM_CACHE_PURE``)."""
    return os.environ.get(ENVIRONMENT, "") not in ("", "0")


def compiled() -> tuple[str, ...]:
    """The imported fsm_cache modules that run compiled, by name, sorted."""
    return tuple(
        sorted(
            name
            for name, module in list(sys.modules.items())
            if name.startswith(_PACKAGE) and _is_compiled(module)
        )
    )


def _is_compiled(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return spec is not None and _is_extension(spec)


def built(package: Path | None = None) -> tuple[str, ...]:
    """The modules under ``package`` (fsm_cache's folder) with a compiled build beside the source.

    Whether or not Python imports them: :func:`compiled` says which did.
    """
    root = Path(__file__).parent if package is None else package
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    names = []
    for extension in root.rglob("*.so"):
        source = _source_of(extension)
        if extension.name.endswith(suffixes) and source.is_file():
            parts = source.relative_to(root).with_suffix("").parts
            names.append(".".join((root.name, *parts)))
    return tuple(sorted(names))


def summary() -> str:
    """Say which imported modules run compiled, or why none does (a benchmark's last line)."""
    ran = compiled()
    if ran:
        return ", ".join(name.removeprefix(_PACKAGE) for name in ran)
    available = built()
    if not available:
        return "none (the sources ran; make compile)"
    if any(name in sys.modules for name in available):
        return f"none (the sources ran, as asked: {ENVIRONMENT} or prefer_sources())"
    return "none (this benchmark imports none of the compiled modules)"


def stale(package: Path | None = None) -> tuple[Path, ...]:
    """The compiled modules under ``package`` (fsm_cache's folder) older than their sources.

    Python would import such a module in place of the newer source: rebuild
    them (``make compile``) or remove them (``python scripts/compile.py --clean``).
    """
    root = Path(__file__).parent if package is None else package
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for extension in sorted(root.rglob("*.so")):
        source = _source_of(extension)
        if (
            extension.name.endswith(suffixes)
            and source.is_file()
            and source.stat().st_mtime > extension.stat().st_mtime
        ):
            found.append(extension)
    return tuple(found)
