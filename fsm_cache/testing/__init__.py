"""Test helpers for users of fsm_cache: a fault-injecting copy engine and a reference oracle.

:class:`FaultyCopyEngine` loads torch and resolves on first use; the
``transitions``-based :class:`~fsm_cache.testing.reference.Reference` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver


if TYPE_CHECKING:
    from fsm_cache.testing.faults import FaultyCopyEngine
    from fsm_cache.testing.reference import Reference

__all__ = ["FaultyCopyEngine", "Reference"]
__getattr__ = resolver(
    __name__,
    {
        "FaultyCopyEngine": "fsm_cache.testing.faults",
        "Reference": "fsm_cache.testing.reference",
    },
)
