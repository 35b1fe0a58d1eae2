"""Names a package re-exports from modules that load torch, resolved on first use.

Subpackages that sit above the memory layer (``cache``, ``memory``,
``distributed``, ``testing``, ``bench``) must not import torch when only a
torch-free module of theirs is wanted (``import fsm_cache.cache.tree``); their
``__init__`` declares the torch-backed names here and imports them for type
checkers only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def resolver(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` that imports ``names[name]`` (a module) on first use.

    Args:
        package: The package's ``__name__``, for the error message.
        names: Each public name mapped to the module that defines it.
    """

    def lazy_attribute(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return lazy_attribute
