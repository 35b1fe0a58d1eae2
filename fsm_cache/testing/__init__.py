"""Test helpers for users of fsm_cache: fault injection, fake CUDA, a reference oracle.

:class:`FaultyCopyEngine` and the fake CUDA streams of
:mod:`~fsm_cache.testing.fakecuda` (:class:`FakeStreams`,
:func:`deferred_copier`) load torch and resolve on first use; the
``transitions``-based :class:`~fsm_cache.testing.reference.Reference` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_cache.lazy import resolver


if TYPE_CHECKING:
    from fsm_cache.testing.fakecuda import FakeStreams, deferred_copier
    from fsm_cache.testing.faults import FaultyCopyEngine
    from fsm_cache.testing.reference import Reference

__all__ = ["FakeStreams", "FaultyCopyEngine", "Reference", "deferred_copier"]
__getattr__ = resolver(
    __name__,
    {
        "FakeStreams": "fsm_cache.testing.fakecuda",
        "FaultyCopyEngine": "fsm_cache.testing.faults",
        "deferred_copier": "fsm_cache.testing.fakecuda",
        "Reference": "fsm_cache.testing.reference",
    },
)
