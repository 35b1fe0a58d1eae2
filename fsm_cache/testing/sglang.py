"""Import stand-ins that let SGLang's real cache modules import on a CPU-only machine.

Used by ``make test-sglang`` (tests/sglang_real) and ``fsm-cache bench sglang``,
and by anyone who wants SGLang's radix caches in a CPU test: call
:func:`install` before importing ``sglang.srt.mem_cache``.

SGLang's ``radix_cache.py`` and ``hiradix_cache.py`` need only ``torch`` at run
time, but importing them pulls in half of SGLang: ``memory_pool.py`` imports
the attention layers (GPU kernels), the model configs (``transformers``) and
through them the server arguments and the OpenAI protocol; ``utils/common.py``
imports a web stack. None of that runs in a radix-cache test. Each name below
is answered by a permissive empty module instead; everything else, the cache
code above all, is SGLang's own, from the installed wheel.

* ``sglang`` itself is registered as a bare package, so its ``__init__`` (the
  frontend language: ``tqdm``, ``requests``, ``IPython``...) never runs.
* SGLang's own modules that are not cache code: ``sglang.srt.layers`` (model
  layers, attention kernels), ``sglang.srt.configs`` (model configs, built on
  ``transformers``), ``sglang.srt.server_args``, ``sglang.srt.distributed``.
* Third-party modules, stood in only when not installed: GPU kernels
  (``triton``, ``sgl_kernel``, ``aiter``), the KV-event transport (``msgspec``,
  ``zmq``, ``pydantic``, ``pydantic_core``; events stay disabled) and
  ``utils/common.py``'s module-level imports (``orjson``, ``psutil``,
  ``pybase64``, ``fastapi``, ``starlette``, ``PIL``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any


ALWAYS = (
    "sglang.srt.layers",
    "sglang.srt.configs",
    "sglang.srt.server_args",
    "sglang.srt.distributed",
)
"""SGLang modules outside the cache, replaced even though the wheel has them."""

IF_MISSING = (
    "triton",
    "sgl_kernel",
    "aiter",
    "msgspec",
    "zmq",
    "pydantic",
    "pydantic_core",
    "orjson",
    "psutil",
    "pybase64",
    "fastapi",
    "starlette",
    "PIL",
)
"""Third-party modules SGLang's import chain names, replaced only when absent."""


def _passes_through(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call is a bare decorator application (``@triton.jit`` on a function)."""
    return len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType)


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

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if _passes_through(args, kwargs):
            return args[0]
        return super().__call__(*args, **kwargs)


class StandIn(metaclass=_StandInType):
    """Base of every stand-in: subclassable, callable, a pass-through decorator."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Accept class keywords (``msgspec.Struct`` subclasses pass ``tag=True``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Pass a decorated function through; answer any other call with a new stand-in."""
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
    """A module whose every attribute is a stand-in class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, made)
        return made


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the named modules (and their submodules) with :class:`StandInModule`."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
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
        module.__path__ = []
        self.served.add(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module answers every attribute."""


def sglang_present() -> bool:
    """Whether an SGLang wheel is installed in this interpreter (the side environment)."""
    return importlib.util.find_spec("sglang") is not None


def install() -> StandInFinder:
    """Put the stand-ins in front of the import system, once; return the finder."""
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder):
            return finder
    missing = [n for n in IF_MISSING if importlib.util.find_spec(n) is None]
    finder = StandInFinder([*ALWAYS, *missing])
    sys.meta_path.insert(0, finder)
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        if spec is None or spec.submodule_search_locations is None:
            msg = "sglang is not installed in this interpreter"
            raise ModuleNotFoundError(msg)
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    return finder
