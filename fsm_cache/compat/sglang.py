"""A drop-in for SGLang-style radix-tree nodes: the same residency API, checked.

SGLang's ``TreeNode`` keeps residency in ``value``/``host_value`` nullity,
``lock_ref`` and ``host_ref_counter``, changed from many code paths, with one
check: ``release_host()`` at zero raises ``RuntimeError("Host reference
counter is already zero.")`` long after the wrong release. Mixing
:class:`ResidencyMixin` into such a node class keeps its method names and
properties but routes every change through the residency machines:

* ``protect_host()`` / ``release_host()`` fire ``pin`` / ``release``; a release
  at zero raises :class:`HostRefCounterZero` (a ``RuntimeError``) whose message
  starts with SGLang's text and then names the node, its state and, in trail
  mode, the call sites of the earlier pins and releases.
* ``host_ref_counter`` and ``lock_ref`` are read-only views of ``pins`` and
  ``locks``; ``backuped`` and ``evicted`` are derived from the host and device
  states.
* ``inc_lock_ref()`` / ``dec_lock_ref()`` lock or unlock the node and every
  ancestor, as SGLang's cache methods of the same names do.
* ``value`` and ``host_value`` (the slot indices) stay plain fields, but an
  assignment must agree with the state the machines hold: host slots only
  while the host copy is held (after ``write``), none after ``evict_host``;
  device slots only while resident or loading, none after ``evict_device``.
  An assignment that disagrees raises :class:`SlotsOutOfStep` naming the
  event to fire first, so a code path that moves memory without telling the
  machines fails at that line instead of drifting silently. Assignments in
  the original ``__init__`` are accepted as they are.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fsm_cache.engine import trail
from fsm_cache.errors import FsmCacheError, ReleaseAtZero
from fsm_cache.residency import DEVICE_HELD, HOST_HELD, Residency, default_residency


trail.internal(__file__)

SGLANG_ZERO = "Host reference counter is already zero."


class HostRefCounterZero(ReleaseAtZero):
    """SGLang's release-at-zero, with the node, its state and the call sites involved."""

    def render(self) -> str:
        """Return SGLang's message followed by fsm_cache's account of the refusal."""
        return f"{SGLANG_ZERO} {super().render()}"


class ReadOnlyCounter(FsmCacheError, AttributeError):
    """A counter the residency machines own was assigned directly."""


class SlotsOutOfStep(FsmCacheError, AttributeError):
    """A slot field was assigned in a way the node's residency state does not allow."""


def _slot_rule(field: str, state: str, present: bool) -> str | None:
    """Return the event to fire before this assignment, or None when it agrees with ``state``."""
    if field == "host_value":
        if present and state not in HOST_HELD:
            return "write"
        if not present and state in HOST_HELD:
            return "evict_host" if state != "writing" else "write_failed"
        return None
    if present and state not in DEVICE_HELD:
        return "load"
    if not present and state in DEVICE_HELD:
        return "evict_device"
    return None


class ResidencyMixin:
    """Mix into an SGLang-style ``TreeNode`` to make its residency checked.

    Put it first among the bases: ``class TreeNode(ResidencyMixin, OldTreeNode)``.
    The node class must have ``parent`` and ``children`` (SGLang's have both);
    the residency fields are set before the original ``__init__`` runs, so its
    ``self.lock_ref = 0`` and ``self.host_ref_counter = 0`` are accepted as
    no-ops.

    Set ``residency`` on the class to a :class:`Residency` of your own (for
    example one built with ``trail=True``); by default the process-wide one is used.
    """

    residency: ClassVar[Residency | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.host = "unbacked"
        self.device = "resident"
        self.pins = 0
        self.locks = 0
        self.trail = None
        self._slots: dict[str, Any] = {"value": None, "host_value": None}
        self._constructing = True
        super().__init__(*args, **kwargs)
        self._constructing = False

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
                site=exc.site,
                sites=exc.sites,
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

    @property
    def value(self) -> Any:
        """Device slot indices (SGLang: ``None`` once evicted from the device)."""
        return self._slots["value"]

    @value.setter
    def value(self, slots: Any) -> None:
        self._assign_slots("value", "device", slots)

    @property
    def host_value(self) -> Any:
        """Host slot indices (SGLang: ``None`` without a host copy)."""
        return self._slots["host_value"]

    @host_value.setter
    def host_value(self, slots: Any) -> None:
        self._assign_slots("host_value", "host", slots)

    def _assign_slots(self, field: str, region: str, slots: Any) -> None:
        state = getattr(self, region)
        event = None if self._constructing else _slot_rule(field, state, slots is not None)
        if event is not None:
            what = "set" if slots is not None else "cleared"
            msg = (
                f"node {getattr(self, 'id', '?')}: {field} {what} while {region} is {state}; "
                f"fire {event} first (machine().{event}(node))"
            )
            raise SlotsOutOfStep(msg)
        self._slots[field] = slots

    def _refuse_assign(self, name: str, field: str, value: int, use: str) -> None:
        if getattr(self, field, 0) != value:
            msg = f"node {getattr(self, 'id', '?')}: {name} is driven by the residency machines; use {use}"
            raise ReadOnlyCounter(msg)
