"""Import stand-ins that let vLLM's scheduler-side offloading code import on a CPU machine.

vLLM's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``) and its
scheduler-side connector need only torch and numpy at run time, but importing
them runs vLLM's package ``__init__`` files, which pull in the distributed
runtime, the model configs (``pydantic``, ``transformers``), the platform
probes and a web stack. None of that runs in these tests. So:

* **Hollow packages** (:data:`HOLLOW`): vLLM's own packages whose ``__init__``
  is not run. Their real submodules still import from the wheel; any other
  name asked of them is a stand-in. The offloading code itself, the manager,
  its policies, ``base.py`` and the connector, is vLLM's own, from the wheel.
* **Stand-in modules** (:data:`ALWAYS`, :data:`IF_MISSING`): answered by a
  permissive empty module whose every attribute is a stand-in class. ``ALWAYS``
  are vLLM's modules outside the offloading code (configs, logger, platforms);
  ``IF_MISSING`` are third-party modules, stood in only when not installed.

A stand-in class is subclassable, callable, indexable (``X[int]``), usable as
a pass-through decorator, and answers every attribute with another stand-in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any


HOLLOW = (
    "vllm",
    "vllm.distributed",
    "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1",
    "vllm.v1",
    "vllm.v1.core",
)
"""vLLM packages imported without running their ``__init__``."""

ALWAYS = (
    "vllm.config",
    "vllm.platforms",
    "vllm.logger",
    "vllm._custom_ops",
    "vllm.distributed.parallel_state",
    "vllm.v1.kv_offload.cpu.gpu_worker",
    "vllm.compilation",
    "vllm.model_executor",
    "vllm.v1.metrics.perf",
    "vllm.outputs",
    "vllm.parser",
    "vllm.entrypoints",
    "vllm.renderers",
    "vllm.multimodal",
)
"""vLLM modules outside the scheduler-side offloading code, replaced although the wheel has
them: configs, platform probes, the logger (it asks the distributed runtime for ranks), the
custom ops and the GPU<->CPU worker (GPU kernels)."""

IF_MISSING = (
    "regex",
    "pydantic",
    "pydantic_core",
    "transformers",
    "psutil",
    "zmq",
    "msgspec",
    "cbor2",
    "prometheus_client",
    "cachetools",
    "blake3",
    "openai",
    "fastapi",
    "triton",
    "PIL",
    "pybase64",
    "aiohttp",
    "huggingface_hub",
    "safetensors",
    "cloudpickle",
    "uvloop",
    "cpuinfo",
    "xgrammar",
    "openai_harmony",
    "llguidance",
)
"""Third-party modules vLLM's import chain names, replaced only when absent."""


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


def _logger(name: str = "vllm", *args: Any, **kwargs: Any) -> logging.Logger:
    """``vllm.logger.init_logger``: a plain logger with vLLM's ``*_once`` methods."""
    del args, kwargs
    log = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        if not hasattr(log, f"{level}_once"):
            setattr(log, f"{level}_once", getattr(log, level))
    return log


class StandInModule(types.ModuleType):
    """A module whose every attribute is a stand-in class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "init_logger":
            return _logger
        made = _stand_in(f"{self.__name__}.{name}")
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
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []
        self.served.add(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module answers every attribute."""


def vllm_present() -> bool:
    """Whether a vLLM wheel is installed in this interpreter (the side environment)."""
    return importlib.util.find_spec("vllm") is not None


def _hollow(name: str) -> None:
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


def install() -> StandInFinder:
    """Put the stand-ins in front of the import system, once; return the finder."""
    for finder in sys.meta_path:
        if isinstance(finder, StandInFinder):
            return finder
    missing = [n for n in IF_MISSING if importlib.util.find_spec(n) is None]
    finder = StandInFinder([*ALWAYS, *missing])
    sys.meta_path.insert(0, finder)
    for name in HOLLOW:
        _hollow(name)
    return finder
