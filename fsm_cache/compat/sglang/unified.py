"""SGLang 0.5.23's ``UnifiedRadixCache``, checked at its lock boundary: every release has an acquire.

``UnifiedRadixCache`` keeps its counters in a tree core addressed by node id
(a compiled Rust one by default, ``UnifiedTreeCore`` in Python otherwise),
per component, out of fsm_cache's reach. What every caller does go through
is four cache methods, each taking the anchor node's id:
``inc_lock_ref(node_id)`` returns a receipt that ``dec_lock_ref(node_id,
receipt)`` replays, and ``inc_host_lock_ref`` / ``dec_host_lock_ref`` do the
same for the host copy. SGLang's own check is an ``assert`` deep in a
component's walk (``FULL segment release hit lock_ref=0 on node N``), at
the first node the walk finds at zero, which may be far above the anchor
(an ancestor still held by another request's lock is silently released
instead); the Rust core panics there and refuses every later call on the
cache ("mutex poisoned").

:class:`ReceiptBook` keeps, per anchor node id, a residency record of the
receipts given out there: ``locks`` counts the device locks, ``pins`` the
host locks, and the residency spec's own rules move them (``lock``/``unlock``
on a ``resident`` device, ``pin``/``release`` on a ``backed`` host). Its
states are fixed: the node's real residency lives in the tree core and is
not observed, so of the spec only the counter rules apply (an ``unlock``
without a ``lock`` is ``UnlockAtZero``, a ``release`` without a ``pin`` is
``ReleaseAtZero``). A release is checked before SGLang's method runs and
recorded after it returns, so a refusal changes nothing, and a call SGLang
itself raises on is not recorded.

A receipt's contents carry no identity of its own (a FULL-only receipt is
its anchor's id and empty maps, the same for every lock on the node), but
its objects do: every caller in SGLang 0.5.23 keeps the one
``DecLockRefParams`` that ``to_dec_params`` made and passes that same
object back (``TreeLock.receipt``, a flow's or a pending copy's
``lock_params``), and ``to_dec_params`` builds its two uuid maps afresh
(:data:`SHARED`), which a copy (``dataclasses.replace``, ``copy.copy``)
shares with its original. SGLang's one copy of a receipt
(``MambaComponent._alloc_mamba_slot``) releases a part of the same lock,
not another lock, so a lock is the pair of map objects. The book keeps
each lock whose receipt came back (:class:`Spent`, holding the maps so
that their ids stay theirs) and refuses a second release of it, through
the receipt or a copy (:class:`~fsm_cache.errors.LeaseError`), even while
other receipts on its node are out: the release SGLang would take from
another request's lock. An entry goes once the book alone holds one of
its maps (no receipt or copy is left to come back), found by reference
count when the book has doubled (:meth:`ReceiptBook.sweep`), so the memory
is bounded by the receipts SGLang still holds. What SGLang sees is
unchanged: the receipt objects are its own, nothing is added to them. A
deep copy has maps of its own, and is only counted: in a ``FULL``-only
receipt what else it holds (the anchor's id, the skipped components) is the
objects every receipt on the node holds, and SGLang 0.5.23 makes none.

An acquire on a node id the tree does not have (evicted, or from before a
``reset``) is refused (:class:`~fsm_cache.errors.StaleNode`) before SGLang
runs, on both cores (stock, a ``KeyError`` from the tree core's lookup; the
Rust core raises ``TypeError`` or ``OverflowError`` for ids that are not
unsigned integers). The test is the tree core's own ``is_root(node_id)``: one
lookup in its node map, O(1), on both cores. An id another cache built under
the same patch has is refused naming that cache; on the Rust core, whose
ids count per cache, one this tree has too is taken as its own node (an id
is a plain ``int``: nothing SGLang passes names its cache).

What is counted is the lock of SGLang's base component, ``FULL``
(:data:`BASE`): a call whose receipt skips it moves none of the book. SGLang
releases a receipt in parts: with ``enable_mamba_extra_buffer_lazy``,
``MambaComponent._alloc_mamba_slot`` releases a running request's Mamba
lock alone (``dec_lock_ref`` with every other component skipped) and its
``unlock`` later releases the rest; counting that first call would refuse
the second, on a correct server.

A receipt released on another node than the one it was taken on is refused
(:class:`~fsm_cache.errors.BadArgument`) before SGLang runs: the ``assert``
in its Python core refuses it (under ``python -O`` it releases the given
node's locks instead), and its Rust core panics and refuses every later
call on the cache.

The books are not locked: SGLang 0.5.23 calls the four methods on the
scheduler's thread only (its storage threads hand acknowledgements over
queues that ``check_hicache_events`` drains there, and
``StorageAttachment.detach`` releases backups after stopping them), and a
book is swept inside a release.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fsm_cache.compat.sglang.scope import BuiltBeforePatch
from fsm_cache.engine import trail
from fsm_cache.errors import BadArgument, LeaseError, StaleNode
from fsm_cache.residency import Event, Residency, ResidencyRecord


trail.internal(__file__)

BOUNDARY: dict[str, Event] = {
    "inc_lock_ref": "lock",
    "dec_lock_ref": "unlock",
    "inc_host_lock_ref": "pin",
    "dec_host_lock_ref": "release",
}
"""``UnifiedRadixCache``'s lock methods and the residency event each one is."""

BASE = "FULL"
"""The component whose locks the book counts: SGLang's ``BASE_COMPONENT_TYPE``, by name."""

KEPT = 1024
"""How many released anchors' records trail mode keeps (most recent), for their call sites."""

Method = Callable[..., Any]


SHARED = ("component_lock_uuids", "component_host_lock_uuids")
"""The receipt fields whose objects identify its lock: made anew per receipt, kept by its copies.

``to_dec_params`` builds both maps afresh for every receipt (and a hand-made
``DecLockRefParams`` gets new ones from its field defaults), while
``dataclasses.replace`` and ``copy.copy`` hand the copy the same two objects.
"""

SWEEP = 256
"""How many released locks a book holds before it first drops those nothing else holds."""


class Spent:
    """A lock whose receipt came back: the objects its copies share, held until no one else does.

    Attributes:
        parts: What the receipt's copies share with it (its :data:`SHARED`
            maps; the receipt itself if it has none), held strongly so that
            their ``id`` is not reused while the entry lasts.
        receipt: A weak reference to the receipt that came back (None if it
            cannot be weakly referenced), to tell it from a copy.
        spot: In trail mode, where it came back; else None.
    """

    __slots__ = ("parts", "receipt", "spot")

    def __init__(self, parts: tuple[Any, ...], receipt: Any, spot: trail.Spot | None) -> None:
        self.parts = parts
        try:
            self.receipt: weakref.ref[Any] | None = weakref.ref(receipt)
        except TypeError:
            self.receipt = None
        self.spot = spot


Told = tuple[tuple[int, ...], tuple[Any, ...]]
"""A receipt's lock, as a book keys it: the ``id`` of each part, and the parts (:func:`lock_of`)."""


def lock_of(receipt: Any) -> Told:
    """The lock ``receipt`` tells: what its copies share with it (its :data:`SHARED` maps, else the receipt itself).

    Each object once (a hand-made receipt may give both fields one map), so
    that :func:`_refs` counts the book's hold on it once. Computed once per
    release and handed to each step of it (:meth:`SpentLocks.refuse_spent`,
    :meth:`SpentLocks.spend`).
    """
    return _told(receipt, getattr(receipt, SHARED[0], None), getattr(receipt, SHARED[1], None))


def told_by_maps(receipt: Any) -> Told | None:
    """:func:`lock_of` a receipt whose :data:`SHARED` fields are both dicts (``DecLockRefParams``'s); else None.

    ``to_dec_params`` makes the maps afresh per lock, and a copy shares them.
    Anything else given (a fork's sentinel, a shared constant) could stand
    for many locks, and is not remembered.
    """
    first = getattr(receipt, SHARED[0], None)
    second = getattr(receipt, SHARED[1], None)
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    return _told(receipt, first, second)


def _told(receipt: Any, first: Any, second: Any) -> Told:
    """The :data:`Told` of ``receipt`` whose :data:`SHARED` fields hold ``first`` and ``second``."""
    if first is None or second is None:
        return (id(receipt),), (receipt,)
    if first is second:
        return (id(first),), (first,)
    return (id(first), id(second)), (first, second)


def _refs(parts: tuple[Any, ...]) -> list[int]:
    """The reference count of each of ``parts`` (the same code measures :data:`_ALONE`)."""
    return [sys.getrefcount(part) for part in parts]


_ALONE = _refs((object(),))[0]
"""What :func:`_refs` gives for an object held only by its ``parts`` tuple."""


class Taken:
    """A lock taken through ``lock(node)`` whose receipt has not come back: the node it is on.

    Attributes:
        parts: What the receipt's copies share with it (as :attr:`Spent.parts`).
        node: The node the lock was taken on.
        spot: In trail mode, where it was taken; else None.
    """

    __slots__ = ("node", "parts", "spot")

    def __init__(self, parts: tuple[Any, ...], node: Any, spot: trail.Spot | None) -> None:
        self.parts = parts
        self.node = node
        self.spot = spot


class SpentLocks:
    """The locks whose receipts came back, while a receipt or a copy of one may come back again.

    A lock is told by its receipt's objects (:func:`lock_of`), so a second
    release of it, through the same receipt or a copy, either way round, is
    refused while other locks on its node are out: the release SGLang would
    take from another request's lock. :class:`ReceiptBook` keeps one per
    ``UnifiedRadixCache``; the patch keeps a :class:`LockBook` per
    ``RadixCache`` whose ``dec_lock_ref`` takes SGLang 0.5.23's receipt.

    Args:
        machine: The engine whose trail mode says whether call sites are kept.

    Attributes:
        spent: The locks whose receipts came back, keyed by the ``id`` of
            their :class:`Spent` parts; an entry goes once nothing but the
            book holds its parts (no receipt or copy of it can come back).
        sweep_at: The size at which :meth:`spend` next sweeps.
    """

    __slots__ = ("machine", "spent", "sweep_at")

    def __init__(self, machine: Residency) -> None:
        self.machine = machine
        self.spent: dict[tuple[int, ...], Spent] = {}
        self.sweep_at = SWEEP

    def refuse_spent(
        self, node_id: Any, receipt: Any, call: str, held: str, lock: Told | None = None
    ) -> None:
        """Refuse ``receipt`` if its lock came back already, changing nothing.

        Its lock came back if this very object did, or a copy of it
        (``dataclasses.replace``, ``copy.copy``: one that shares its
        :data:`SHARED` maps), or the receipt it is a copy of.

        Args:
            node_id: The node the release is for, as the message names it.
            receipt: The receipt given.
            call: The method called, as the message names it.
            held: What stays held on the node, as the message says it
                (``the node's 1 other receipt(s) out``).
            lock: ``lock_of(receipt)``, if the caller has it already.

        Raises:
            LeaseError: ``receipt``, a copy of it or its original was released already.
        """
        entry = self.spent.get((lock or lock_of(receipt))[0])
        if entry is None:
            return
        what = f"this receipt ({type(receipt).__name__} at {id(receipt):#x})"
        if entry.receipt is None:  # one that cannot be weakly referenced: it or a copy
            what += " was released already (or a copy of it was)"
        elif entry.receipt() is receipt:
            what += " was released already"
        else:
            what += (
                " shares its lock with a receipt released already (a copy: "
                "dataclasses.replace or copy.copy keep its uuid maps)"
            )
        msg = f"node {node_id}: {call} refused: {what}; {held} stay held; nothing changed"
        if entry.spot is not None:
            msg += f"; released at {trail.spot_site(entry.spot)}; refused at {trail.caller_site()}"
        raise LeaseError(msg)

    def spend(self, receipt: Any, lock: Told | None = None) -> None:
        """Remember that ``receipt``'s lock came back, while it or a copy of it may come back again.

        Args:
            receipt: The receipt that came back.
            lock: ``lock_of(receipt)``, if the caller has it already.
        """
        key, parts = lock or lock_of(receipt)
        spot = trail.caller_spot() if self.machine.engine.trail else None
        self.spent[key] = Spent(parts, receipt, spot)
        if len(self.spent) >= self.sweep_at:
            self.sweep()

    def sweep(self) -> None:
        """Drop the released locks nothing but the book holds a part of.

        A copy holds every part of its original, so a lock with a part held
        by the book alone has no receipt left to come back. Run when the book
        doubles (from :data:`SWEEP`), so each release pays O(1) on average,
        and the book holds at most the larger of :data:`SWEEP` and twice the
        locks whose receipts were still held at the last sweep (those freed
        since stay until the next).
        """
        _drop_unheld(self.spent)
        self.sweep_at = max(SWEEP, 2 * len(self.spent))

    def clear(self) -> None:
        """Forget every released lock (the cache's ``reset`` dropped the tree they were on)."""
        self.spent.clear()
        self.sweep_at = SWEEP


Entry = TypeVar("Entry", Spent, Taken)


def _drop_unheld(entries: dict[tuple[int, ...], Entry]) -> None:
    """Drop from ``entries`` each one with a part nothing but the book holds (no receipt left)."""
    for key, entry in list(entries.items()):
        if any(count <= _ALONE for count in _refs(entry.parts)):
            del entries[key]


class LockBook(SpentLocks):
    """The locks of one ``RadixCache`` (SGLang 0.5.23) out and come back, each with its node.

    ``RadixCache``'s receipt names no node (its ``node_id`` is ``None``), and
    its ``dec_lock_ref`` walks up from whatever node it is given: a
    ``TreeLock`` whose receipt is released on another node leaves its own
    node locked forever and takes the other node's lock (another request's,
    whose prefix becomes evictable under it). The patch's ``lock`` notes
    the node each receipt is taken on (:meth:`take`), and a release on
    another is refused (:meth:`refuse_elsewhere`). A receipt made from
    ``inc_lock_ref``'s result by hand (``to_dec_params``, which copies its
    maps) is not taken through ``lock``: it is known only once it came back.

    Attributes:
        out: The locks taken through ``lock`` whose receipts have not come
            back, keyed as :attr:`SpentLocks.spent`; an entry goes when the
            receipt comes back, or once nothing but the book holds its parts
            (the receipt was dropped unreleased).
    """

    __slots__ = ("out",)

    def __init__(self, machine: Residency) -> None:
        super().__init__(machine)
        self.out: dict[tuple[int, ...], Taken] = {}

    def ready(self) -> trail.Spot | None:
        """Ready the book to note a lock about to be taken; return where it is taken (trail mode).

        All that may fail is done here, before SGLang takes the lock (the
        sweep, when due, and the call site): :meth:`take` after it only notes
        the lock, so a book that raised leaves the node unlocked.
        """
        if len(self.out) + len(self.spent) >= self.sweep_at:
            self.sweep()
        return trail.caller_spot() if self.machine.engine.trail else None

    def take(self, node: Any, lock: Told, spot: trail.Spot | None) -> None:
        """Note that the receipt ``lock`` tells was taken on ``node``, at ``spot`` (:meth:`ready`'s)."""
        key, parts = lock
        self.out[key] = Taken(parts, node, spot)

    def refuse_elsewhere(self, node: Any, receipt: Any, lock: Told, call: str) -> None:
        """Refuse ``receipt`` given with ``node`` if its lock was taken on another node, changing nothing.

        Raises:
            BadArgument: The lock ``receipt`` (or a copy of it) releases was
                taken on another node.
        """
        taken = self.out.get(lock[0])
        if taken is None or taken.node is node:
            return
        msg = (
            f"node {node_id(node)}: {call} refused: this receipt ({type(receipt).__name__} at "
            f"{id(receipt):#x}) is of a lock taken on node {node_id(taken.node)}, and a "
            "receipt is released on the node it was taken on; the locks on both nodes stay "
            "held; nothing changed"
        )
        if taken.spot is not None:
            msg += f"; taken at {trail.spot_site(taken.spot)}; refused at {trail.caller_site()}"
        raise BadArgument(msg)

    def spend(self, receipt: Any, lock: Told | None = None) -> None:
        """Remember that ``receipt``'s lock came back (no longer out), as :meth:`SpentLocks.spend`."""
        told = lock or lock_of(receipt)
        self.out.pop(told[0], None)
        super().spend(receipt, told)

    def give_back(self, lock: Told) -> None:
        """Forget a lock on the root come back: it moved no count, and its release is not remembered."""
        self.out.pop(lock[0], None)

    def sweep(self) -> None:
        """Drop the locks out or come back that nothing but the book holds a part of (:meth:`SpentLocks.sweep`)."""
        _drop_unheld(self.out)
        _drop_unheld(self.spent)
        self.sweep_at = max(SWEEP, 2 * (len(self.out) + len(self.spent)))

    def clear(self) -> None:
        """Forget every lock, out or come back: the cache's ``reset`` dropped the tree they were on."""
        super().clear()
        self.out.clear()


def node_id(node: Any) -> Any:
    """A node's id as a message names it (``?`` for an object with none)."""
    return getattr(node, "id", "?")


class ReceiptBook(SpentLocks):
    """The lock receipts one ``UnifiedRadixCache`` gave out, per anchor node id.

    Args:
        machine: The engine the records fire through (the patch's).

    Attributes:
        records: Per anchor node id with receipts out, its record (``locks``:
            device receipts out, ``pins``: host receipts out).
        released: In trail mode, the records of the last :data:`KEPT` anchors
            whose receipts all came back, with the call sites a later refusal
            names; empty outside it. Bounded: a server that never resets
            locks a new node id for most requests.
    """

    __slots__ = ("records", "released")

    def __init__(self, machine: Residency) -> None:
        super().__init__(machine)
        self.records: dict[Any, ResidencyRecord] = {}
        self.released: OrderedDict[Any, ResidencyRecord] = OrderedDict()

    def check(self, node_id: Any, event: Event) -> None:
        """Check ``event`` on ``node_id``'s receipts, changing nothing.

        Raises:
            UnlockAtZero: ``unlock`` with no device receipt out on the node.
            ReleaseAtZero: ``release`` with no host receipt out on the node.
        """
        self.machine.engine.plan(self._record(node_id), event)

    def fire(self, node_id: Any, event: Event) -> None:
        """Record ``event`` on ``node_id``'s receipts (checked as :meth:`check`)."""
        record = self._record(node_id)
        self.machine.verb(event)(record)
        self.released.pop(node_id, None)
        if record.locks or record.pins:
            self.records[node_id] = record
            return
        self.records.pop(node_id, None)
        if self.machine.engine.trail:
            self.released[node_id] = record
            if len(self.released) > KEPT:
                self.released.popitem(last=False)

    def check_receipt(
        self, node_id: Any, event: Event, receipt: Any, call: str, lock: Told | None = None
    ) -> None:
        """Refuse ``receipt`` for ``event`` (a release) if its lock came back already, changing nothing.

        ``lock`` is ``lock_of(receipt)``, if the caller has it already.

        Raises:
            LeaseError: ``receipt``, a copy of it or its original was released
                already (:meth:`SpentLocks.refuse_spent`).
        """
        record = self._record(node_id)
        out = record.pins if event == "release" else record.locks
        self.refuse_spent(node_id, receipt, call, f"the node's {out} other receipt(s) out", lock)

    def clear(self) -> None:
        """Forget every receipt: the cache's ``reset`` dropped the tree they anchor on."""
        super().clear()
        self.records.clear()
        self.released.clear()

    def _record(self, node_id: Any) -> ResidencyRecord:
        record = self.records.get(node_id)
        if record is None:
            record = self.released.get(node_id)
        if record is None:
            ident = node_id if isinstance(node_id, int) else 0
            record = ResidencyRecord(ident, host="backed")
        return record


class Watch:
    """A subclass override's call under way, and whether a wrapper inside it recorded the call.

    Attributes:
        cache: The cache called.
        name: The method (one of :data:`BOUNDARY`, or ``reset``).
        node_id: The anchor node's id (None for ``reset``).
        reached: Whether a wrapper inside the call recorded what it was given
            for the same cache, method and node: ``UnifiedRadixCache``'s own,
            or an inner override's that recorded itself.
    """

    __slots__ = ("cache", "name", "node_id", "reached")

    def __init__(self, cache: Any, name: str, node_id: Any) -> None:
        self.cache = cache
        self.name = name
        self.node_id = node_id
        self.reached = False


def _same_node(one: Any, other: Any) -> bool:
    """Whether two node ids name one node (ints by value; anything else, SGLang's core refuses, by identity)."""
    return one is other or (isinstance(one, int) and isinstance(other, int) and one == other)


class Receipts:
    """The receipt books of the ``UnifiedRadixCache`` instances built under one patch.

    A book is made by the cache's ``reset`` (its ``__init__`` ends with one)
    and cleared by every later one. A cache with no book here was built
    before this patch (or under another one): its receipts out are not
    known, and its lock methods are refused.

    Args:
        machine: The engine the books fire through.
    """

    def __init__(self, machine: Residency) -> None:
        self.machine = machine
        self.books: weakref.WeakKeyDictionary[Any, ReceiptBook] = weakref.WeakKeyDictionary()
        self.watches: dict[int, list[Watch]] = {}

    def reset(self, cache: Any) -> None:
        """Give ``cache`` an empty book (its tree was just built or dropped)."""
        book = self.books.get(cache)
        if book is None:
            self.books[cache] = ReceiptBook(self.machine)
        else:
            book.clear()

    def book(self, cache: Any, call: str) -> ReceiptBook:
        """Return ``cache``'s book.

        Raises:
            BuiltBeforePatch: ``cache`` was built before this patch; nothing changed.
        """
        book = self.books.get(cache)
        if book is None:
            msg = (
                f"{type(cache).__name__}: {call} in a cache built before patch() (the "
                "receipts it gave out are not known); build the cache after patching; "
                "nothing changed"
            )
            raise BuiltBeforePatch(msg)
        return book

    def wrap(self, name: str, original: Method, *, override: bool = False) -> Method:
        """``original`` (one of :data:`BOUNDARY`, or ``reset``), checked through the books.

        Args:
            name: The method's name.
            original: The method: ``UnifiedRadixCache``'s own, or with
                ``override`` a subclass's override of it.
            override: Whether ``original`` is a subclass's (or a mixin's)
                override. Its call is checked before it runs, as the base's
                is, but recorded only if no wrapper inside it recorded the
                same method on the same cache and node (:class:`Watch`): an
                override that calls ``super()`` is counted once, one that
                moves the tree core itself is counted still, and so is one
                that calls ``super()`` for another node only. A ``reset``
                override clears the book only if the base's ``reset`` did not.
        """
        if name == "reset":
            return self._reset(original, override)
        event = BOUNDARY[name]
        release = name.startswith("dec_")

        @functools.wraps(original)
        def method(cache: Any, node_id: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(cache, "disable", False):  # SGLang's returns an empty receipt
                return original(cache, node_id, *args, **kwargs)
            book = self.book(cache, name)
            receipt = None
            if release:
                receipt = args[0] if args else kwargs.get("params")
                _check_anchor(cache, name, node_id, receipt)
                skipped = getattr(receipt, "skipped_lock_components", ())
            else:
                _check_node(cache, name, node_id, self.books)
                skipped = args[0] if args else kwargs.get("skip_lock_components", ())
            if any(getattr(c, "name", c) == BASE for c in skipped):  # moves no FULL lock
                result = original(cache, node_id, *args, **kwargs)
                if not override and self.watches:  # an override around it records nothing
                    self._reach(cache, name, node_id)
                return result
            book.check(node_id, event)
            told = None
            if release:
                told = lock_of(receipt)  # once: the check and the record share it
                book.check_receipt(node_id, event, receipt, name, told)
            if not override:
                result = original(cache, node_id, *args, **kwargs)
                if self.watches:  # recorded below once SGLang's ran: an override around it need not
                    self._reach(cache, name, node_id)
            else:
                watch = self._watch(cache, name, node_id)
                try:
                    result = original(cache, node_id, *args, **kwargs)
                finally:
                    self._unwatch(watch)
                if watch.reached:  # a wrapper inside recorded it
                    return result
                self._reach(cache, name, node_id)  # an enclosing override's: recorded here
            book.fire(node_id, event)
            if told is not None:
                book.spend(receipt, told)
            return result

        return method

    def _reset(self, original: Method, override: bool) -> Method:
        @functools.wraps(original)
        def reset(cache: Any, *args: Any, **kwargs: Any) -> Any:
            if not override:
                result = original(cache, *args, **kwargs)
            else:
                watch = self._watch(cache, "reset", None)
                try:
                    result = original(cache, *args, **kwargs)
                finally:
                    self._unwatch(watch)
                if watch.reached:  # the base's reset cleared the book, before what followed it
                    return result
            self.reset(cache)
            self._reach(cache, "reset", None)
            return result

        return reset

    def _watch(self, cache: Any, name: str, node_id: Any) -> Watch:
        """Open a :class:`Watch` on an override's call, on this thread's stack.

        Per thread: a call another thread makes meanwhile (SGLang 0.5.23 makes
        none) is no part of this one, and does not stand in for its record.
        """
        watch = Watch(cache, name, node_id)
        self.watches.setdefault(threading.get_ident(), []).append(watch)
        return watch

    def _unwatch(self, watch: Watch) -> None:
        """Close ``watch`` (dropping its thread's stack once empty, so the map stays bounded)."""
        thread = threading.get_ident()
        stack = self.watches[thread]
        stack.remove(watch)
        if not stack:
            del self.watches[thread]

    def _reach(self, cache: Any, name: str, node_id: Any) -> None:
        """Mark the overrides' calls under way on this thread that this call records."""
        for watch in self.watches.get(threading.get_ident(), ()):
            if watch.cache is cache and watch.name == name and _same_node(watch.node_id, node_id):
                watch.reached = True


def _check_node(cache: Any, call: str, node_id: Any, caches: Iterable[Any]) -> None:
    """Refuse an acquire on a node id the tree does not have (SGLang's core raises ``KeyError``).

    An id is a plain ``int`` and carries no cache. On the Python core ids
    are process-wide (one counter for every node), so one the tree lacks is
    looked up in the other ``caches`` (those built under the same patch) on
    the Python core too, on this error path only, to name the cache it came
    from. On the Rust core ids count per cache: a cache's own stale id is
    most often some other cache's live one, so no owner is named there, and
    another cache's id that this tree has too is taken as this tree's node
    (SGLang passes nothing that tells them apart).

    Raises:
        StaleNode: No such node in the tree (evicted, from before a reset, or
            another cache's); nothing changed.
        BadArgument: ``node_id`` is not a node id at all; nothing changed.
    """
    if _has(cache, node_id):
        return
    name = type(cache).__name__
    if not isinstance(node_id, int):
        raise BadArgument(f"{name}: {call} given {node_id!r}, not a node id; nothing changed")
    owner = _owner(cache, node_id, caches) if _ids_process_wide(cache) else None
    if owner is not None:
        raise StaleNode(
            f"{name}: {call} on node {node_id}, which is not in the tree but another cache's "
            f"({type(owner).__name__} at {id(owner):#x}); a node id is its own cache's; "
            "nothing changed"
        )
    raise StaleNode(
        f"{name}: {call} on node {node_id}, which is not in the tree (evicted, or from "
        "before a reset); match the prefix again; nothing changed"
    )


def _ids_process_wide(cache: Any) -> bool:
    """Whether ``cache``'s node ids are unique in the process.

    SGLang's Python core numbers every node from one class counter; the Rust
    core numbers each cache's own.
    """
    return type(getattr(cache, "tree_core", None)).__name__ == _PYTHON_CORE


_PYTHON_CORE = "UnifiedTreeCore"
"""The class name of SGLang's Python tree core (the Rust one is ``RustUnifiedTreeCore``)."""


def _owner(cache: Any, node_id: int, caches: Iterable[Any]) -> Any:
    """The other Python-core cache of ``caches`` whose tree has ``node_id``, or None.

    Another cache's failure (a Rust core poisoned by a panic raises
    ``RuntimeError`` on every call) makes it no owner: it must not take the
    place of this cache's refusal.
    """
    for other in list(caches):
        if other is cache or not _ids_process_wide(other):
            continue
        try:
            if _has(other, node_id):
                return other
        except Exception:  # whatever another cache raises, it is not the owner
            continue
    return None


def _has(cache: Any, node_id: Any) -> bool:
    """Whether ``cache``'s tree has ``node_id``: the core's own O(1) lookup, which raises if not."""
    try:
        cache.tree_core.is_root(node_id)
    except (KeyError, TypeError, OverflowError):
        return False
    return True


def _check_anchor(cache: Any, call: str, node_id: Any, receipt: Any) -> None:
    """Refuse ``receipt`` unless it was taken on ``node_id`` (SGLang's core asserts, or panics).

    Raises:
        BadArgument: The receipt names another anchor, or none; nothing changed.
    """
    anchor = getattr(receipt, "node_id", None)
    if anchor != node_id:
        raise BadArgument(
            f"{type(cache).__name__}: {call} on node {node_id} given a receipt anchored on "
            f"node {anchor}; a receipt is released on the node it was taken on; nothing changed"
        )
