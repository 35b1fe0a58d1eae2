"""The hierarchical radix cache: :class:`HiCache` and the parts that own its state.

The radix tree is torch-free; the cache moves memory, so its names resolve on
first use and ``import fsm_cache.cache.tree`` never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver


if TYPE_CHECKING:
    from fsm_cache.cache.arguments import TokenKey
    from fsm_cache.cache.eventlog import EventLog
    from fsm_cache.cache.hicache import HiCache, Lock, MatchResult
    from fsm_cache.cache.metrics import Stats
    from fsm_cache.cache.replay import replay
    from fsm_cache.cache.storage_tier import StorageConfig
    from fsm_cache.memory.tiers import CacheConfig

__all__ = [
    "CacheConfig",
    "EventLog",
    "HiCache",
    "Lock",
    "MatchResult",
    "Stats",
    "StorageConfig",
    "TokenKey",
    "replay",
]
__getattr__ = resolver(
    __name__,
    {
        "CacheConfig": "fsm_cache.memory.tiers",
        "EventLog": "fsm_cache.cache.eventlog",
        "HiCache": "fsm_cache.cache.hicache",
        "Lock": "fsm_cache.cache.hicache",
        "MatchResult": "fsm_cache.cache.hicache",
        "Stats": "fsm_cache.cache.metrics",
        "StorageConfig": "fsm_cache.cache.storage_tier",
        "TokenKey": "fsm_cache.cache.arguments",
        "replay": "fsm_cache.cache.replay",
    },
)
