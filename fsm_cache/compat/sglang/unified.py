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
its object does: every caller in SGLang 0.5.23 keeps the one
``DecLockRefParams`` that ``to_dec_params`` made and passes that same
object back (``TreeLock.receipt``, a flow's or a pending copy's
``lock_params``). The book remembers each receipt that came back, by
identity, for as long as anything holds it (a weak reference, whose
callback drops the entry when the receipt is freed, so the memory is
bounded by the receipts SGLang still holds), and refuses a second release
of the same object (:class:`~fsm_cache.errors.LeaseError`) even while other
receipts on its node are out: the release SGLang would take from another
request's lock. What SGLang sees is unchanged: the receipt objects are its
own, nothing is added to them. A copy of a receipt (``dataclasses.replace``
with FULL kept) is another object, and only counted.

An acquire on a node id the tree does not have (evicted, or from before a
``reset``) is refused (:class:`~fsm_cache.errors.StaleNode`) before SGLang
runs, on both cores (stock, a ``KeyError`` from the tree core's lookup; the
Rust core raises ``TypeError`` or ``OverflowError`` for ids that are not
unsigned integers). The test is the tree core's own ``is_root(node_id)``: one
lookup in its node map, O(1), on both cores.

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
``StorageAttachment.detach`` releases backups after stopping them). The one
write from elsewhere is a freed receipt's callback, on whichever thread
drops the receipt's last reference: one dict deletion, atomic under the
GIL, of the entry of a receipt nobody holds, which no call can be checking
(a call holds its receipt).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

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


class Spent(weakref.ref[Any]):
    """A weak reference to a receipt that came back, keyed by the receipt's ``id``.

    Attributes:
        key: ``id`` of the receipt (its entry's key, which the callback drops).
        spot: In trail mode, where it came back; else None.
    """

    __slots__ = ("key", "spot")

    key: int
    spot: trail.Spot | None


class ReceiptBook:
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
        spent: The receipts that came back and are still held somewhere, by
            ``id``: an entry goes when its receipt is freed.
    """

    __slots__ = ("_forget", "machine", "records", "released", "spent")

    def __init__(self, machine: Residency) -> None:
        self.machine = machine
        self.records: dict[Any, ResidencyRecord] = {}
        self.released: OrderedDict[Any, ResidencyRecord] = OrderedDict()
        self.spent: dict[int, Spent] = {}
        spent = self.spent

        def forget(ref: Spent) -> None:  # a closure over the dict: no cycle through the book
            if spent.get(ref.key) is ref:
                del spent[ref.key]

        self._forget = forget

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

    def check_receipt(self, node_id: Any, event: Event, receipt: Any, call: str) -> None:
        """Refuse ``receipt`` for ``event`` (a release) if it came back already, changing nothing.

        Raises:
            LeaseError: ``receipt`` (this very object) was released already.
        """
        ref = self.spent.get(id(receipt))
        if ref is None or ref() is not receipt:
            return
        record = self._record(node_id)
        out = record.pins if event == "release" else record.locks
        msg = (
            f"node {node_id}: {call} refused: this receipt ({type(receipt).__name__} at "
            f"{id(receipt):#x}) was released already; the node's {out} other receipt(s) out "
            "stay held; nothing changed"
        )
        if ref.spot is not None:
            msg += f"; released at {trail.spot_site(ref.spot)}; refused at {trail.caller_site()}"
        raise LeaseError(msg)

    def spend(self, receipt: Any) -> None:
        """Remember that ``receipt`` came back, for as long as it is held."""
        try:
            ref = Spent(receipt, self._forget)
        except TypeError:  # not weakly referable: counted only
            return
        ref.key = id(receipt)
        ref.spot = trail.caller_spot() if self.machine.engine.trail else None
        self.spent[ref.key] = ref

    def clear(self) -> None:
        """Forget every receipt: the cache's ``reset`` dropped the tree they anchor on."""
        self.records.clear()
        self.released.clear()
        self.spent.clear()

    def _record(self, node_id: Any) -> ResidencyRecord:
        record = self.records.get(node_id)
        if record is None:
            record = self.released.get(node_id)
        if record is None:
            ident = node_id if isinstance(node_id, int) else 0
            record = ResidencyRecord(ident, host="backed")
        return record


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

    def wrap(self, name: str, original: Method) -> Method:
        """``original`` (one of :data:`BOUNDARY`, or ``reset``), checked through the books."""
        if name == "reset":
            return self._reset(original)
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
                _check_node(cache, name, node_id)
                skipped = args[0] if args else kwargs.get("skip_lock_components", ())
            if any(getattr(c, "name", c) == BASE for c in skipped):  # moves no FULL lock
                return original(cache, node_id, *args, **kwargs)
            book.check(node_id, event)
            if release:
                book.check_receipt(node_id, event, receipt, name)
            result = original(cache, node_id, *args, **kwargs)
            book.fire(node_id, event)
            if release:
                book.spend(receipt)
            return result

        return method

    def _reset(self, original: Method) -> Method:
        @functools.wraps(original)
        def reset(cache: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(cache, *args, **kwargs)
            self.reset(cache)
            return result

        return reset


def _check_node(cache: Any, call: str, node_id: Any) -> None:
    """Refuse an acquire on a node id the tree does not have (SGLang's core raises ``KeyError``).

    Raises:
        StaleNode: No such node in the tree (evicted, or from before a reset); nothing changed.
        BadArgument: ``node_id`` is not a node id at all; nothing changed.
    """
    try:
        cache.tree_core.is_root(node_id)  # the core's own O(1) lookup; raises if it has none
    except (KeyError, TypeError, OverflowError):
        pass
    else:
        return
    name = type(cache).__name__
    if isinstance(node_id, int):
        raise StaleNode(
            f"{name}: {call} on node {node_id}, which is not in the tree (evicted, or from "
            "before a reset); match the prefix again; nothing changed"
        ) from None
    raise BadArgument(f"{name}: {call} given {node_id!r}, not a node id; nothing changed") from None


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
