"""fsm_cache: typed, formally checked state machines for KV-cache residency.

The spec language, the engine, the residency machines and the errors import
without torch. The cache and the memory layer load torch, so their names are
resolved on first use (``fsm_cache.HiCache``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fsm_cache import native


if native.wanted_pure():  # before any module that may be compiled is imported
    native.prefer_sources()

from fsm_cache.engine.core import Engine
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import (
    FsmCacheError,
    IllegalTransition,
    LeaseError,
    PoolExhausted,
    ReleaseAtZero,
    SpecError,
    UnlockAtZero,
)
from fsm_cache.residency import Node, Residency, ResidencyRecord
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, System


if TYPE_CHECKING:
    from fsm_cache.cache.arguments import TokenKey
    from fsm_cache.cache.hicache import HiCache, MatchResult
    from fsm_cache.memory.tiers import CacheConfig

__version__ = "0.1.0"
__all__ = [
    "CacheConfig",
    "Engine",
    "FsmCacheError",
    "HiCache",
    "IllegalTransition",
    "Lease",
    "LeaseError",
    "MachineSpec",
    "MatchResult",
    "Node",
    "PoolExhausted",
    "ReleaseAtZero",
    "Residency",
    "ResidencyRecord",
    "SpecError",
    "System",
    "TokenKey",
    "UnlockAtZero",
    "__version__",
    "load_spec",
]
_LAZY = {
    "HiCache": "fsm_cache.cache.hicache",
    "MatchResult": "fsm_cache.cache.hicache",
    "CacheConfig": "fsm_cache.memory.tiers",
    "TokenKey": "fsm_cache.cache.arguments",
}


def __getattr__(name: str) -> Any:
    """Resolve the torch-backed names on first use, so ``import fsm_cache`` stays light."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_cache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
