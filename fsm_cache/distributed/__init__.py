"""Tensor-parallel agreement: every rank applies the same finished copies in the same order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver


if TYPE_CHECKING:
    from fsm_cache.distributed.agreement import DistributedCache
    from fsm_cache.distributed.collectives import Collectives

__all__ = ["Collectives", "DistributedCache"]
__getattr__ = resolver(
    __name__,
    {
        "Collectives": "fsm_cache.distributed.collectives",
        "DistributedCache": "fsm_cache.distributed.agreement",
    },
)
