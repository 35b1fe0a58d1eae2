"""Import stand-ins: let a server's cache code import on a CPU machine without its runtime.

SGLang's and vLLM's cache modules need little beyond torch at run time, but
importing them runs their packages' ``__init__`` files, which pull in GPU
kernels, model configs and web stacks. :func:`install` puts a finder in front
of the import system that answers chosen modules with permissive empty ones,
and registers chosen packages *hollow* (their ``__init__`` not run; their real
submodules still import from the wheel). The cache code itself stays the
server's own. :mod:`fsm_cache.testing.sglang` and :mod:`fsm_cache.testing.vllm`
name what each server needs.

A stand-in class is subclassable, callable, indexable (``X[int]``), usable as
a pass-through decorator, and answers every attribute with another stand-in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any


def _passes_through(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call is a bare decorator application (``@decorator`` on a function or class)."""
    return len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type))


class _StandInType(type):
    """Metaclass of stand-in classes: any attribute is another stand-in class."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        made = _stand_in(f"{cls.__qualname__}.{name}")
        setattr(cls, name, made)
        return made

    def __getitem__(cls, item: object) -> type:
        return cls

    def __or__(cls, other: object) -> Any:
        return cls

    def __ror__(cls, other: object) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _passes_through(args, kwargs):
            return args[0]
        return super().__call__(*args, **kwargs)


class StandIn(metaclass=_StandInType):
    """Base of every stand-in: subclassable, callable, a pass-through decorator."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Accept class keywords."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pass a decorated function or class through; answer any other call with a stand-in."""
        if _passes_through(args, kwargs):
            return args[0]
        return StandIn()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn()


def _stand_in(qualname: str) -> type:
    name = qualname.rsplit(".", 1)[-1]
    return _StandInType(name, (StandIn,), {"__qualname__": qualname, "__module__": "standin"})


class StandInModule(types.ModuleType):
    """A module whose every attribute is a stand-in class (or one of its finder's presets)."""

    presets: Mapping[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = self.presets.get(name) or _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, made)
        return made


class HollowPackage(StandInModule):
    """A real package whose ``__init__`` did not run.

    A name that is one of its submodules imports that submodule from the wheel
    (so ``from vllm.v1 import outputs`` still works); any other name is a stand-in.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        qualified = f"{self.__name__}.{name}"
        if importlib.util.find_spec(qualified) is not None:
            return importlib.import_module(qualified)
        return super().__getattr__(name)


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the named modules (and their submodules) with :class:`StandInModule`.

    Args:
        names: The modules to stand in, with everything under them.
        presets: Attributes every stand-in module answers with a real object
            instead of a stand-in (vLLM's ``init_logger``).
    """

    def __init__(self, names: Sequence[str], presets: Mapping[str, Any] | None = None) -> None:
        self.names = tuple(names)
        self.presets = dict(presets or {})
        self.served: set[str] = set()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """Claim ``fullname`` if it is (under) a stood-in module."""
        del path, target
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """Build the stand-in module for ``spec``."""
        module = StandInModule(spec.name)
        module.presets = self.presets
        module.__path__ = []
        self.served.add(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module answers every attribute."""


def hollow(name: str) -> None:
    """Register the real package ``name`` without running its ``__init__``."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        msg = f"{name} is not an installed package"
        raise ModuleNotFoundError(msg)
    package = HollowPackage(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)


def install(
    always: Sequence[str],
    if_missing: Sequence[str],
    hollows: Sequence[str] = (),
    presets: Mapping[str, Any] | None = None,
) -> StandInFinder:
    """Put stand-ins in front of the import system, once per set of names; return the finder.

    All or nothing: a package of ``hollows`` that is not installed takes the
    finder and the stand-ins and hollow packages this call registered back
    out before the error goes on, so a second try in the same process meets
    the same error.

    Args:
        always: Modules stood in even when installed.
        if_missing: Modules stood in only when not installed.
        hollows: Installed packages registered without running their ``__init__``.
        presets: See :class:`StandInFinder`.

    Raises:
        ModuleNotFoundError: A package of ``hollows`` is not installed; nothing changed.
    """
    names = (*always, *(n for n in if_missing if importlib.util.find_spec(n) is None))
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder) and set(names) <= set(finder.names):
            return finder
    finder = StandInFinder(names, presets)
    known = set(sys.modules)
    missing = object()
    attributes = []  # (parent module, child name, what it held): hollow() sets them
    for name in hollows:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            attributes.append(
                (sys.modules[parent], child, vars(sys.modules[parent]).get(child, missing))
            )
    sys.meta_path.insert(0, finder)
    try:
        for name in hollows:
            hollow(name)
    except BaseException:
        sys.meta_path.remove(finder)
        for module, child, held in attributes:
            if held is missing:
                module.__dict__.pop(child, None)
            else:
                setattr(module, child, held)
        for name in set(sys.modules) - known:  # what the stand-ins and hollows brought in
            if isinstance(sys.modules[name], StandInModule):
                del sys.modules[name]
        raise
    return finder
