"""The residency of a radix-tree node: a typed record and its verbs.

The rules live in ``specs/residency.toml`` (host and device machines composed,
plus the rules across them and along the tree). This module gives them a
typed face:

* :class:`ResidencyRecord` is the slotted per-node record: ``host`` state,
  ``device`` state, ``pins``, ``locks``, and the ``trail`` of trail mode. Tree nodes
  subclass it and add their own fields.
* :class:`Residency` compiles the spec once, optionally with effects bound to
  real memory, and exposes each event as a checked function of a record.
* :class:`Node` is a standalone record whose methods are the verbs
  (``node.pin()`` returns a lease), for code that wants residency checks
  without fsm_cache's tree.

Host states: ``unbacked`` (device only), ``writing`` (device-to-host copy in
flight), ``backed`` (valid, unpinned), ``pinned`` (valid, held by ``pins``
holders), ``evicted`` (host copy freed). Device states: ``resident``,
``loading`` (host-to-device copy in flight), ``absent``.

With a storage tier (``specs/residency_storage.toml``, ``Residency(storage=True)``)
the host gains ``fetching`` (slots being filled from storage) and a third
region, :data:`StorageState`, says whether a store holds the node's pages;
its events are :data:`StorageEvent`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, get_args, overload

from fsm_cache.engine import trail as trails
from fsm_cache.engine.core import Effect, Engine, Verb
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import BadArgument, ReadOnlyAttribute
from fsm_cache.spec.shipped import load_shipped, residency_system


trails.internal(__file__)

HostState = Literal["unbacked", "writing", "backed", "pinned", "evicted"]
DeviceState = Literal["resident", "loading", "absent"]
Event = Literal[
    "write",
    "write_done",
    "write_failed",
    "pin",
    "release",
    "evict_host",
    "lock",
    "unlock",
    "evict_device",
    "load",
    "load_done",
    "load_failed",
    "adopt",
]
StorageState = Literal["unstored", "storing", "stored", "reading"]
"""States of the storage region of ``residency_storage.toml`` (a cache with a storage tier)."""
StorageEvent = Literal[
    "store",
    "store_done",
    "store_failed",
    "discover",
    "vanish",
    "evict_storage",
    "fetch",
    "fetch_done",
    "fetch_failed",
]
"""The events ``residency_storage.toml`` adds to :data:`Event`."""
AnyEvent = Event | StorageEvent
"""An event of either composition: what a cache with a storage tier may fire."""
FETCHING: Final = "fetching"
"""The host state ``host_storage_residency.toml`` adds: host slots filled from storage."""
AnyHostState = Literal[HostState, "fetching"]
"""A host state of either composition: what ``record.host`` may be with a storage tier."""
HOST_VALID: frozenset[str] = frozenset({"backed", "pinned"})
"""Host states in which the host copy is readable."""
HOST_HELD: frozenset[str] = frozenset({"writing", "backed", "pinned", FETCHING})
"""Host states in which host slots are allocated (``fetching`` exists with a storage tier only)."""
STORAGE_HELD: frozenset[str] = frozenset({"storing", "stored", "reading"})
"""Storage states in which the store holds (or is being given) the node's pages."""
DEVICE_HELD: frozenset[str] = frozenset({"resident", "loading"})
"""Device states in which device slots are allocated."""
DEVICE_READABLE: frozenset[str] = frozenset({"resident"})
"""Device states in which the device slots hold the node's KV: what a lookup may hand out.

The model checker derives the same set from the spec (held, and no copy in
flight); ``tests/test_check.py`` holds the two together."""


@overload
def split_prefix(
    host: HostState, device: DeviceState, locks: int
) -> tuple[HostState, DeviceState, int, int]: ...
@overload
def split_prefix(
    host: AnyHostState, device: DeviceState, locks: int, storage: StorageState
) -> tuple[AnyHostState, DeviceState, int, int]: ...
def split_prefix(
    host: AnyHostState, device: DeviceState, locks: int, storage: StorageState = "unstored"
) -> tuple[AnyHostState, DeviceState, int, int]:
    """Return the residency a radix split gives the new prefix: ``(host, device, pins, locks)``.

    The prefix takes the first pages of the node's slots in both tiers, so it
    has the node's states, but not all its counts. Locks are copied: the
    prefix is an ancestor of every lock holder, and a lock holds its ancestors
    too. Pins stay with their holders on the suffix (as SGLang's
    ``_split_node`` leaves ``host_ref_counter``), so a ``pinned`` host copy
    is only ``backed`` on the prefix; except the pin of a load in flight,
    which the prefix needs too because the same copy fills it, and which the
    same ``load_done`` or ``load_failed`` gives back. The node's own pin count
    plays no part, hence no ``pins`` argument.

    With a storage tier (``residency_storage.toml``) the prefix keeps the
    node's ``storage`` state: its pages are the first pages of the same store
    or read. A store in flight (``storing``) holds a host pin until its
    acknowledgement, and the prefix is acknowledged separately (a partial
    acknowledgement splits the node at its first failed page), so the prefix
    holds a store pin of its own; a host copy being fetched stays
    ``fetching`` on both sides (no pins).

    This is the one rule both the cache (:meth:`fsm_cache.cache.tree.RadixTree.split`)
    and the model checker (:func:`fsm_cache.modelcheck.treeops.split`) apply.
    """
    pins = (device == "loading") + (storage == "storing")
    if pins:
        return "pinned", device, pins, locks
    return ("backed" if host == "pinned" else host), device, 0, locks


class ResidencyRecord:
    """The residency of one node: two machine states and two counters.

    A record starts in any residency some run of ``specs/residency.toml``
    reaches: ``ResidencyRecord(1, host="pinned", pins=2)`` is one, but a
    ``pinned`` host without pins, an unknown state, or a host ``writing``
    beside a device ``absent`` is not
    (:meth:`~fsm_cache.engine.core.Engine.bad_record` says why).

    Args:
        ident: The node's id.
        host: Host residency state.
        device: Device residency state.
        pins: Holders of the host copy (what a ``pinned`` host needs one or more of).
        locks: Running requests holding the device copy.

    Raises:
        BadArgument: The spec allows no record with these states and counts;
            the message names what is wrong (``Node(17): host pinned requires
            pins >= 1, got pins=0``).

    Attributes:
        id: The node's id, used in messages (``node 17: ...``).
        host: Host residency state (:data:`AnyHostState`: ``fetching`` is one
            with a storage tier).
        device: Device residency state.
        pins: Holders of the host copy.
        locks: Running requests holding the device copy (propagated to ancestors).
        trail: Recent events with call sites in trail mode, else None.
    """

    __slots__ = ("device", "host", "id", "locks", "pins", "trail")

    def __init__(
        self,
        ident: int = 0,
        *,
        host: HostState = "unbacked",
        device: DeviceState = "resident",
        pins: int = 0,
        locks: int = 0,
    ) -> None:
        # A fresh record skips the spec (which costs microseconds).
        fresh = host == "unbacked" and device == "resident" and pins == 0 == locks
        if not fresh or type(pins) is not int or type(locks) is not int:
            self._check(ident, {"host": host, "device": device}, {"pins": pins, "locks": locks})
        self._start(ident, host, device, pins, locks)

    def _start(
        self, ident: int, host: HostState, device: DeviceState, pins: int, locks: int
    ) -> None:
        """Set every field, unchecked: for :meth:`__init__` once it checked, and the tree.

        The radix tree builds each node fresh (``unbacked``, ``resident``, no
        pins or locks), so its nodes skip the check and its cost per insert.
        """
        self.id = ident
        self.host: AnyHostState = host
        self.device: DeviceState = device
        self.pins = pins
        self.locks = locks
        self.trail: trails.Trail | None = None

    @classmethod
    def rules(cls) -> Engine:
        """Return the engine whose spec says which records of this class are legal."""
        return default_residency().engine

    def _check(self, ident: int, states: dict[str, object], counters: dict[str, object]) -> None:
        """Raise BadArgument, before anything is set, unless the spec allows the record."""
        problem = type(self).rules().bad_record(states, counters)
        if problem is not None:
            raise BadArgument(f"{type(self).__name__}({ident!r}): {problem}")

    def residency(self) -> str:
        """Return ``backed/resident (pins=0, locks=0)``."""
        return f"{self.host}/{self.device} (pins={self.pins}, locks={self.locks})"


class Residency:
    """The residency spec compiled once, its events exposed as checked functions.

    Args:
        effects: Hooks for the spec's effects (``start_write``, ``free_host``,
            ``free_device``, ``start_load``); None for a pure engine.
        trail: Trail mode: refusals name the call sites of the node's recent
            events; defaults to ``FSM_CACHE_TRAIL``.
        audit: Deprecated spelling of ``trail`` (warns); to be removed.
        storage: Compile ``residency_storage.toml`` instead: the same rules
            plus a storage region (records need a ``storage`` attribute), whose
            effects ``start_store``, ``start_fetch`` and ``delete_storage`` must
            be bound too when ``effects`` is given.

    Raises:
        ConfigError: ``trail`` and ``audit`` both given and different.
        BadArgument: ``trail`` or ``audit`` is neither a bool nor None,
            ``storage`` no bool, or ``effects`` as :class:`Engine` refuses it.

    What a residency is built with is fixed: ``engine`` and the verbs bound
    from it (``pin``, ``release``, ...). Assigning one later, or an attribute
    it has not got (``residency.relase = ...``), raises
    :class:`~fsm_cache.errors.ReadOnlyAttribute`: a rebound ``engine`` used
    to leave the verbs firing the old one's functions, and a typo was
    accepted and read by nothing.
    """

    def __init__(
        self,
        effects: Mapping[str, Effect] | None = None,
        trail: bool | None = None,
        *,
        audit: bool | None = None,
        storage: bool = False,
    ) -> None:
        trails.check_flags("Residency", trail, audit)
        if not isinstance(storage, bool):
            raise BadArgument(f"Residency: storage must be a bool, got {storage!r}")
        chosen = trails.choose(trail, audit, "Residency", stacklevel=2)
        spec = load_shipped("residency_storage") if storage else residency_system()
        self.engine: Final = Engine(spec, effects=effects, trail=chosen)
        verb = self.engine.verb
        self.write: Final = verb("write")
        self.write_done: Final = verb("write_done")
        self.write_failed: Final = verb("write_failed")
        self.pin: Final = verb("pin")
        self.release: Final = verb("release")
        self.evict_host: Final = verb("evict_host")
        self.lock: Final = verb("lock")
        self.unlock: Final = verb("unlock")
        self.evict_device: Final = verb("evict_device")
        self.load: Final = verb("load")
        self.load_done: Final = verb("load_done")
        self.load_failed: Final = verb("load_failed")
        self.adopt: Final = verb("adopt")

    if not TYPE_CHECKING:  # mypy would take any attribute for settable, a typo included

        def __setattr__(self, name: str, value: object) -> None:
            """Bind ``name`` once, as :meth:`__init__` does, if it is one of :data:`_BOUND`.

            Plain attributes rather than properties: ``residency.pin`` (the
            cache reads it per pin) stays an attribute read; only an
            assignment pays.

            Raises:
                ReadOnlyAttribute: ``name`` is bound already, or no attribute
                    a residency is built with (a typo); nothing changed.
            """
            if name in _BOUND and name not in self.__dict__:
                object.__setattr__(self, name, value)
                return
            raise ReadOnlyAttribute.assigned(f"Residency.{name}", value, _unsettable(name))

        def __delattr__(self, name: str) -> None:
            """Delete nothing a residency is built with (deleted, it could be bound again).

            Raises:
                ReadOnlyAttribute: ``name`` is one of :data:`_BOUND`; nothing changed.
                AttributeError: The residency has no attribute ``name`` of its own.
            """
            if name in _BOUND:
                raise ReadOnlyAttribute.deleted(f"Residency.{name}", _unsettable(name))
            object.__delattr__(self, name)

    def verb(self, event: AnyEvent) -> Verb:
        """Return the checked function for ``event``."""
        return self.engine.verb(event)

    def allowed(self, rec: ResidencyRecord, event: AnyEvent) -> bool:
        """Return whether ``event`` would be accepted now, changing nothing."""
        return self.engine.allowed(rec, event)

    def lease(self, rec: ResidencyRecord, kind: Literal["pin", "lock"] = "pin") -> Lease:
        """Pin (or lock) ``rec`` and return the receipt that undoes it exactly once.

        Raises:
            BadArgument: ``kind`` is neither ``"pin"`` nor ``"lock"`` (it used
                to be leased with ``unlock`` as its release, and refused by
                :meth:`~fsm_cache.engine.core.Engine.lease` naming a release
                the caller never wrote); nothing was fired.
            IllegalTransition: As for :meth:`~fsm_cache.engine.core.Engine.lease`.
        """
        if kind == "pin":
            return self.engine.lease(rec, "pin", "release")
        if kind == "lock":
            return self.engine.lease(rec, "lock", "unlock")
        raise BadArgument(
            f"Residency.lease: kind must be 'pin' or 'lock', got {kind!r}; lease another"
            " event with Residency.engine.lease(rec, acquire, release)"
        )


_BOUND: Final = frozenset({"engine", *get_args(Event)})
"""What :class:`Residency` binds when it is built: its engine and a verb per event."""


def _unsettable(name: str) -> str:
    """Return why a residency's ``name`` cannot be set or deleted (:meth:`Residency.__setattr__`)."""
    if name == "engine":
        return "its verbs are this engine's, bound when the residency was built; build another Residency"
    if name in _BOUND:
        return f"it is Residency.engine.verb({name!r}), bound when the residency was built"
    if hasattr(Residency, name):
        return "it is a method of Residency"
    close = difflib.get_close_matches(name, sorted(_BOUND), 1)
    meant = f"; did you mean {close[0]!r}?" if close else ""
    return f"a Residency has no attribute {name!r}, only its engine and a verb per event{meant}"


_default: list[Residency] = []


def default_residency() -> Residency:
    """Return the process-wide pure residency engine used by :class:`Node`."""
    if not _default:
        _default.append(Residency())
    return _default[0]


def configure(*, trail: bool | None = None, audit: bool | None = None) -> Residency:
    """Rebuild the default engine, e.g. to turn trail mode on for a test run.

    Args:
        trail: Trail mode for :class:`Node` verbs; None reads ``FSM_CACHE_TRAIL``.
        audit: Deprecated spelling of ``trail`` (warns); to be removed.

    Raises:
        ConfigError: ``trail`` and ``audit`` both given and different.
        BadArgument: ``trail`` or ``audit`` is neither a bool nor None; the
            default engine is kept.
    """
    trails.check_flags("configure", trail, audit)
    _default[:] = [Residency(trail=trails.choose(trail, audit, "configure", stacklevel=2))]
    return _default[0]


def _verb(event: Event) -> Callable[[Node], None]:
    def method(self: Node) -> None:
        type(self).machine().verb(event)(self)

    method.__name__ = event
    method.__doc__ = f"Fire ``{event}`` (checked; refused atomically as the spec says)."
    return method


class Node(ResidencyRecord):
    """A standalone residency record whose methods are the spec's verbs.

    ``parent`` and ``children`` take part in the tree rules (a load needs a
    device-resident parent; host eviction needs no child holding a host copy).
    The other arguments are :class:`ResidencyRecord`'s, checked against the
    spec of :attr:`machine`.
    """

    __slots__ = ("__weakref__", "children", "parent")

    machine: ClassVar[Callable[[], Residency]] = staticmethod(default_residency)

    def __init__(
        self,
        ident: int = 0,
        *,
        host: HostState = "unbacked",
        device: DeviceState = "resident",
        pins: int = 0,
        locks: int = 0,
        parent: Node | None = None,
    ) -> None:
        super().__init__(ident, host=host, device=device, pins=pins, locks=locks)
        self.parent = parent
        self.children: dict[Any, Node] = {}

    @classmethod
    def rules(cls) -> Engine:
        """Return the engine of :attr:`machine`, whose spec says which nodes are legal."""
        return cls.machine().engine

    write = _verb("write")
    write_done = _verb("write_done")
    write_failed = _verb("write_failed")
    evict_host = _verb("evict_host")
    evict_device = _verb("evict_device")
    load = _verb("load")
    load_done = _verb("load_done")

    def pin(self) -> Lease:
        """Pin the host copy and return the lease that releases it once.

        Keep the lease (or use it in a ``with`` block): a lease collected while
        held warns with the site that took it, which is how leaked pins show up.
        """
        return type(self).machine().lease(self, "pin")

    def release(self) -> None:
        """Give back one pin: the oldest open lease of this node if any, else a bare release."""
        self._undo("pin", "release")

    def lock(self) -> Lease:
        """Lock the device copy (and every ancestor's); return the lease that unlocks."""
        return type(self).machine().lease(self, "lock")

    def unlock(self) -> None:
        """Give back one lock: the oldest open lock lease of this node if any, else a bare unlock."""
        self._undo("lock", "unlock")

    def _undo(self, acquire: Event, event: Event) -> None:
        machine = type(self).machine()
        lease = machine.engine.leases.oldest(self, acquire)
        if lease is not None:
            lease.release()
        else:
            machine.verb(event)(self)
