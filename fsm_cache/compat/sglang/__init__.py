"""A drop-in for SGLang's radix caches: the same code, its residency checked.

Two doors, one implementation:

* :func:`patch` makes an installed SGLang's ``RadixCache`` and
  ``HiRadixCache`` run with checked nodes and checked memory moves, in one
  call (``pytest --fsm-sglang`` does it for a test run);
* a fork mixes :class:`ResidencyMixin` into its node class and adds the lines
  of :mod:`~fsm_cache.compat.sglang.scope` to its cache methods by hand
  (docs/sglang.md lists them, per SGLang function), or decorates its lock
  walks with :func:`walked`.
"""

from __future__ import annotations

from fsm_cache.compat.sglang.node import (
    SGLANG_ZERO,
    Children,
    HostRefCounterZero,
    PatchUndone,
    ReadOnlyCounter,
    RemovedInUse,
    ResidencyMixin,
    SlotsOutOfStep,
)
from fsm_cache.compat.sglang.patch import (
    MODULES,
    SUPPORTED,
    Patch,
    PatchError,
    UncheckedCacheWarning,
    patch,
)
from fsm_cache.compat.sglang.scope import (
    AckBook,
    BuiltBeforePatch,
    absent_chain,
    back_out,
    check,
    deepest_first,
    defer_eviction,
    deleting,
    device_evictions,
    host_eviction,
    host_evictions,
    loading,
    ride,
    walk,
    walked,
)


__all__ = [
    "MODULES",
    "SGLANG_ZERO",
    "SUPPORTED",
    "AckBook",
    "BuiltBeforePatch",
    "Children",
    "HostRefCounterZero",
    "Patch",
    "PatchError",
    "PatchUndone",
    "ReadOnlyCounter",
    "RemovedInUse",
    "ResidencyMixin",
    "SlotsOutOfStep",
    "UncheckedCacheWarning",
    "absent_chain",
    "back_out",
    "check",
    "deepest_first",
    "defer_eviction",
    "deleting",
    "device_evictions",
    "host_eviction",
    "host_evictions",
    "loading",
    "patch",
    "ride",
    "walk",
    "walked",
]
