"""The memory layer: page allocators, KV tensors, copy tickets and the copy engine.

:mod:`~fsm_cache.memory.pages` and :mod:`~fsm_cache.memory.tickets` are
torch-free (CrossHair checks the allocators); the KV pools, the copy engine and
the tiers load torch, so their names resolve on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver
from fsm_cache.memory.pages import PageAllocator, pages_of, slots_of
from fsm_cache.memory.tickets import Completion, Copier, Direction, Ticket


if TYPE_CHECKING:
    from fsm_cache.memory.copies import CopyEngine
    from fsm_cache.memory.kv import KVLayout, KVPool
    from fsm_cache.memory.tiers import Tiers

__all__ = [
    "Completion",
    "Copier",
    "CopyEngine",
    "Direction",
    "KVLayout",
    "KVPool",
    "PageAllocator",
    "Ticket",
    "Tiers",
    "pages_of",
    "slots_of",
]
__getattr__ = resolver(
    __name__,
    {
        "CopyEngine": "fsm_cache.memory.copies",
        "KVLayout": "fsm_cache.memory.kv",
        "KVPool": "fsm_cache.memory.kv",
        "Tiers": "fsm_cache.memory.tiers",
    },
)
