"""Storage backends: a third tier below host memory, for pages kept across servers and restarts.

Pages are keyed by prefix-chained SHA-256 digests (:mod:`~fsm_cache.storage.keys`),
so how many leading keys a store holds answers how long a prefix it can give
back. Every backend implements the :class:`~fsm_cache.storage.base.Store`
Protocol: :class:`~fsm_cache.storage.local.LocalFileStore` (one file per page,
the embedded default) and :class:`~fsm_cache.storage.redisstore.RedisStore` (a
Redis or Valkey server many servers share). The keys, the Protocol and the byte
budget are torch-free; the backends load torch and resolve on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver
from fsm_cache.storage.base import Capacity, PutResult, Store, stored_prefix
from fsm_cache.storage.budget import Budget, Reservation
from fsm_cache.storage.keys import Namespace, check_keys, page_keys


if TYPE_CHECKING:
    from fsm_cache.storage.local import LocalFileStore
    from fsm_cache.storage.redisstore import RedisStore

__all__ = [
    "Budget",
    "Capacity",
    "LocalFileStore",
    "Namespace",
    "PutResult",
    "RedisStore",
    "Reservation",
    "Store",
    "check_keys",
    "page_keys",
    "stored_prefix",
]
__getattr__ = resolver(
    __name__,
    {
        "LocalFileStore": "fsm_cache.storage.local",
        "RedisStore": "fsm_cache.storage.redisstore",
    },
)
