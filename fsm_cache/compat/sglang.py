"""A drop-in for SGLang-style radix-tree nodes: the same residency API, checked.

SGLang's ``TreeNode`` keeps residency in ``value``/``host_value`` nullity,
``lock_ref`` and ``host_ref_counter``, changed from many code paths, with one
check: ``release_host()`` at zero raises ``RuntimeError("Host reference
counter is already zero.")`` long after the wrong release. Mixing
:class:`ResidencyMixin` into such a node class keeps its method names and
properties but routes every change through the residency machines:

* ``protect_host()`` / ``release_host()`` fire ``pin`` / ``release``; a release
  at zero raises :class:`HostRefCounterZero` (a ``RuntimeError``) whose message
  starts with SGLang's text and then names the node, its state and, in audit
  mode, the call sites of the earlier pins and releases.
* ``host_ref_counter`` and ``lock_ref`` are read-only views of ``pins`` and
  ``locks``; ``backuped`` and ``evicted`` are derived from the host and device
  states.
* ``inc_lock_ref()`` / ``dec_lock_ref()`` lock or unlock the node and every
  ancestor, as SGLang's cache methods of the same names do.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fsm_cache import trail
from fsm_cache.errors import FsmCacheError, ReleaseAtZero
from fsm_cache.residency import HOST_HELD, Residency, default_residency


trail.internal(__file__)

SGLANG_ZERO = "Host reference counter is already zero."


class HostRefCounterZero(ReleaseAtZero):
    """SGLang's release-at-zero, with the node, its state and the call sites involved."""

    def render(self) -> str:
        """Return SGLang's message followed by fsm_cache's account of the refusal."""
        return f"{SGLANG_ZERO} {super().render()}"


class ReadOnlyCounter(FsmCacheError, AttributeError):
    """A counter the residency machines own was assigned directly."""


class ResidencyMixin:
    """Mix into an SGLang-style ``TreeNode`` to make its residency checked.

    Put it first among the bases: ``class TreeNode(ResidencyMixin, OldTreeNode)``.
    The node class must have ``parent`` and ``children`` (SGLang's have both);
    the residency fields are set before the original ``__init__`` runs, so its
    ``self.lock_ref = 0`` and ``self.host_ref_counter = 0`` are accepted as
    no-ops.

    Set ``residency`` on the class to a :class:`Residency` of your own (for
    example one built with ``audit=True``); by default the process-wide one is used.
    """

    residency: ClassVar[Residency | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.host = "unbacked"
        self.device = "resident"
        self.pins = 0
        self.locks = 0
        self.trail = None
        super().__init__(*args, **kwargs)

    @classmethod
    def machine(cls) -> Residency:
        """Return the residency engine this node class fires through."""
        return cls.residency or default_residency()

    def protect_host(self) -> None:
        """Pin the host copy (SGLang: ``host_ref_counter += 1``), refused without a valid copy."""
        self.machine().pin(self)

    def release_host(self) -> None:
        """Release one pin; at zero raise :class:`HostRefCounterZero` and change nothing."""
        try:
            self.machine().release(self)
        except ReleaseAtZero as exc:
            raise HostRefCounterZero(
                label=exc.label,
                instance=exc.instance,
                state=exc.state,
                counters=exc.counters,
                event=exc.event,
                reason=exc.reason,
                history=exc.history,
            ) from None

    def inc_lock_ref(self) -> None:
        """Lock this node and every ancestor (SGLang's ``inc_lock_ref``)."""
        self.machine().lock(self)

    def dec_lock_ref(self) -> None:
        """Unlock this node and every ancestor; refused at zero with ``UnlockAtZero``."""
        self.machine().unlock(self)

    @property
    def host_ref_counter(self) -> int:
        """Pins on the host copy (read-only: use protect_host/release_host)."""
        return int(getattr(self, "pins", 0))

    @host_ref_counter.setter
    def host_ref_counter(self, value: int) -> None:
        self._refuse_assign("host_ref_counter", "pins", value, "protect_host()/release_host()")

    @property
    def lock_ref(self) -> int:
        """Locks on the device copy (read-only: use inc_lock_ref/dec_lock_ref)."""
        return int(getattr(self, "locks", 0))

    @lock_ref.setter
    def lock_ref(self, value: int) -> None:
        self._refuse_assign("lock_ref", "locks", value, "inc_lock_ref()/dec_lock_ref()")

    @property
    def backuped(self) -> bool:
        """Whether host slots are held (SGLang: ``host_value is not None``)."""
        return self.host in HOST_HELD

    @property
    def evicted(self) -> bool:
        """Whether the device copy is gone (SGLang: ``value is None``)."""
        return self.device == "absent"

    def _refuse_assign(self, name: str, field: str, value: int, use: str) -> None:
        if getattr(self, field, 0) != value:
            msg = f"node {getattr(self, 'id', '?')}: {name} is driven by the residency machines; use {use}"
            raise ReadOnlyCounter(msg)
