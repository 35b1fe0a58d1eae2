"""The typed error tree of fsm_cache.

Every error the library raises on bad input or an illegal step derives from
:class:`FsmCacheError`, so a caller can catch the whole family at once::

    FsmCacheError
    ├── SpecError                 a spec file or spec object is malformed
    │   └── NotCompositional      outside the class check --compositional is sound for
    ├── IllegalTransition         an event refused by a machine; nothing changed
    │   ├── ReleaseAtZero         (also a RuntimeError, as SGLang's check was)
    │   │   └── HostRefCounterZero   SGLang's message first (compat.sglang)
    │   ├── UnlockAtZero, HostCopyPinned, CopyInFlight, NoHostCopy,
    │   │   AlreadyBacked, NotLoading, DuplicateAck, ...
    │   ├── FinalState            an event a final state does not answer
    │   └── <classes a spec names>   created on first use
    ├── EffectFailed              a bound effect raised; the record is unchanged
    │   └── EffectReentered       an effect fired its own event at its record again
    ├── LeaseError                a lease released twice
    ├── PoolError                 slot accounting refused a request
    │   ├── PoolExhausted         more requested than is free
    │   ├── DoubleFree            a slot freed that is already free
    │   ├── ForeignSlot           a slot outside the pool or not owned
    │   │   └── NotASlot          a slot or page that is no int, a bool included
    │   │                         (also a BadArgument)
    │   └── PageBusy              a page still read or written by a copy
    ├── CopyFailed                a copy between tiers failed
    ├── PinnedMemoryError         cudaHostRegister or cudaHostUnregister failed
    ├── BadArgument               an argument of the wrong type or value (also a
    │   │                         TypeError and a ValueError); nothing changed
    │   └── ParentLoop            a record's parent chain loops; nothing changed
    ├── ReadOnlyAttribute         an attribute fixed when its object was built was
    │                             assigned, or one it lacks (also an AttributeError)
    ├── StaleNode                 a node that is not (or no longer) in this cache
    ├── ConcurrentUse             two threads inside one cache at once
    ├── CacheClosed               an operation on a cache after close()
    ├── InvariantViolation        a structural invariant does not hold
    ├── ConfigError               a cache configuration value is out of range
    ├── ReplayMismatch            an event log replays into different transitions
    ├── RankDivergence            tensor-parallel ranks applied different steps
    ├── RankFailure               a rank died or stopped answering a collective
    │   └── NoProcessGroup        no process group to agree over
    └── StorageError              a storage backend (local files, Redis) refused or failed
        ├── StoreFailed           the store failed mid-operation (server gone, disk error)
        ├── CorruptPage           a stored page's header does not match (torn or foreign)
        │   └── LaterFormatPage   a page of a format a newer version writes (left stored)
        ├── PageInUse             a page a read holds may not be dropped
        ├── StorageFull           a capacity reservation larger than what is free
        └── ReservationError      a reservation settled twice, or by another budget

Tools add their own under the root: ``DiagramError`` (diagram), ``AuditError``
(audit), ``OutputError`` (cli: a generated file that cannot be checked or
written; nothing was changed), ``UnequalWork`` (bench: the two sides of a ratio
did different work, so no ratio is given), and compat.sglang's, each also the
builtin error SGLang's own code raised or would meet there: ``ReadOnlyCounter``
(a machine-owned counter assigned; an AttributeError) and its ``PatchUndone``
(a node driven after its patch's ``undo()``), ``SlotsOutOfStep`` (slot fields
assigned as no event allows; an AttributeError), ``RemovedInUse`` (a node left
the tree while in use; a RuntimeError), ``PatchError`` (a module that cannot be
patched; a TypeError) and ``BuiltBeforePatch`` (a node SGLang built before the
patch; a TypeError).

Refusals carry the instance, its state and counters, the event and the reason,
so messages read ``node 17: release refused in backed (pins=0): <reason>``. A
composition's cross-region refusal also names the state of each other region
its rule reads (``door 1: open_door refused in closed (bolt locked): <reason>``). In
trail mode they also carry the call sites of the record's recent events and of
the refused call, and the message ends with that account
(``...; pinned at a.py:10 in f; released at b.py:20 in g; refused at c.py:31 in h``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Protocol


class CallSite(Protocol):
    """Where a call was made, as a refusal carries it: :class:`fsm_cache.engine.trail.Site`.

    A protocol rather than that class, so that this module, below the
    engine, imports nothing of fsm_cache's (even for type checking).
    """

    @property
    def filename(self) -> str:
        """The file of the call."""

    @property
    def line(self) -> int:
        """The line of the call."""

    @property
    def function(self) -> str:
        """The function the call was made in."""


class FsmCacheError(Exception):
    """Root of every error fsm_cache raises on purpose.

    An error pickles as its class, its arguments and its attributes, and
    unpickles without calling ``__init__`` again: an ``__init__`` that takes
    other arguments than the message (``SpecError``'s problems,
    ``IllegalTransition``'s keywords) came back with another message or
    not at all, and a process pool that cannot read a worker's error
    waits for it for ever (``check --jobs``).
    """

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(cls: type[FsmCacheError], args: tuple[object, ...]) -> FsmCacheError:
    """Return an error of ``cls`` with ``args``, its ``__init__`` not called (unpickling)."""
    return cls.__new__(cls, *args)


class SpecError(FsmCacheError):
    """A spec is malformed; ``problems`` lists one line per fault.

    Each problem names the file and the table or key at fault, e.g.
    ``host.toml: transition[3].guard: unknown counter 'pinz'``.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class NotCompositional(SpecError):
    """A spec or option is outside the class ``check --compositional`` is sound for.

    Each problem names the side condition it fails and says to use the
    enumerative check instead (:func:`fsm_cache.modelcheck.views.refusal`).
    """


class IllegalTransition(FsmCacheError):
    """An event was refused; the record it was fired at is exactly as before.

    Attributes:
        label: What the instances are called in messages (``node``).
        instance: The instance id.
        state: The state of the refusing machine.
        counters: That machine's counters at the time of refusal.
        event: The refused event.
        reason: Why the spec refuses it.
        history: The rendered trail, or ``""`` outside trail mode: the
            sites of the record's recent events, then ``refused at`` the site of
            the refused call. It is what the message ends with.
        site: Where the refused call was made (the first frame outside
            fsm_cache's dispatch code), or None outside trail mode.
        sites: ``(event, site)`` of the record's recent accepted events, oldest
            first; empty outside trail mode.
        others: For a composition's cross-region refusal, the state of each
            other region its rule reads (``{"bolt": "locked"}``), shown after
            the counters; empty for any other refusal.
    """

    def __init__(
        self,
        *,
        label: str,
        instance: object,
        state: str,
        counters: Mapping[str, int],
        event: str,
        reason: str,
        history: str = "",
        site: CallSite | None = None,
        sites: tuple[tuple[str, CallSite], ...] = (),
        others: Mapping[str, str] | None = None,
    ) -> None:
        self.label = label
        self.instance = instance
        self.state = state
        self.counters = dict(counters)
        self.event = event
        self.reason = reason
        self.history = history
        self.site = site
        self.sites = sites
        self.others = dict(others or {})
        super().__init__(self.render())

    def render(self) -> str:
        """Return the one-line message: who, what, where, why, and what came before."""
        counts = (f"{k}={v}" for k, v in self.counters.items())
        shown = ", ".join([*counts, *(f"{r} {s}" for r, s in self.others.items())])
        where = f"{self.state} ({shown})" if shown else self.state
        text = f"{self.label} {self.instance}: {self.event} refused in {where}: {self.reason}"
        return f"{text}; {self.history}" if self.history else text

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle a refusal of a class a spec named (:func:`error_class`) by that name.

        Such a class is made at run time, so it is no attribute of this module
        and pickling it by reference failed: a ``check --jobs`` worker that
        raised one sent back a ``PicklingError`` instead. The process reading
        it makes the class from its name, once, as the spec's engine would.
        """
        cls = type(self)
        if _CREATED.get(cls.__name__) is not cls:
            return super().__reduce__()
        return (_named_rebuilt, (cls.__name__, self.args), self.__dict__)


class ReleaseAtZero(IllegalTransition, RuntimeError):
    """A release with no pin outstanding (SGLang: 'Host reference counter is already zero.')."""


class UnlockAtZero(IllegalTransition):
    """An unlock with no lock outstanding."""


class HostCopyPinned(IllegalTransition):
    """The host copy is held by a pin and may not be freed."""


class CopyInFlight(IllegalTransition):
    """A copy still reads or writes the pages this event would free or reuse."""


class NoHostCopy(IllegalTransition):
    """The event needs a valid host copy and there is none."""


class AlreadyBacked(IllegalTransition):
    """A backup was asked for a node whose host copy is already valid."""


class NotLoading(IllegalTransition):
    """A load acknowledgement arrived for a node with no load in flight."""


class DuplicateAck(IllegalTransition):
    """A copy acknowledgement arrived for a node with no such copy in flight."""


class FinalState(IllegalTransition):
    """An event at a record in a final state that declares no answer to it.

    A final state has ended: nothing leaves it but what its spec declares, so
    every other event there is refused with this class
    (``conn 3: acquire refused in closed: closed is final: nothing leaves it``).
    """


_PREDEFINED: dict[str, type[IllegalTransition]] = {
    cls.__name__: cls
    for cls in (
        IllegalTransition,
        ReleaseAtZero,
        UnlockAtZero,
        HostCopyPinned,
        CopyInFlight,
        NoHostCopy,
        AlreadyBacked,
        NotLoading,
        DuplicateAck,
        FinalState,
    )
}
_CREATED: dict[str, type[IllegalTransition]] = {}


def error_class(name: str) -> type[IllegalTransition]:
    """Return the refusal class called ``name``, creating it under IllegalTransition.

    Specs name their errors; names that fsm_cache does not predefine become new
    subclasses of :class:`IllegalTransition`, created once per process so that
    ``except`` clauses and ``isinstance`` checks see one class per name.

    Args:
        name: A Python identifier, conventionally CamelCase.

    Returns:
        The class; the same object for every call with the same name.
    """
    found = _PREDEFINED.get(name) or _CREATED.get(name)
    if found is None:
        # setdefault is atomic: of two threads creating the class, both return the first stored.
        made = type(name, (IllegalTransition,), {"__module__": __name__})
        found = _CREATED.setdefault(name, made)
    return found


def _named_rebuilt(name: str, args: tuple[object, ...]) -> IllegalTransition:
    """Return a refusal of the class :func:`error_class` gives ``name``, with ``args`` (unpickling)."""
    cls = error_class(name)
    return cls.__new__(cls, *args)


class EffectFailed(FsmCacheError):
    """A bound effect raised while an event was being applied; the record is unchanged."""


class EffectReentered(EffectFailed):
    """An effect fired its own event at its record again, directly or through other events.

    The firing that would have run the effect a second time on the record is
    refused before the effect runs, so nothing the events would write is
    written; the effect on the way there did run, up to its firing.
    """


class LeaseError(FsmCacheError):
    """A lease was released again: after its release (named) or while that was still firing."""


class PoolError(FsmCacheError):
    """Slot accounting refused a request and changed nothing."""


class PoolExhausted(PoolError):
    """More slots were requested than are free."""

    def __init__(self, pool: str, requested: int, free: int) -> None:
        self.pool = pool
        self.requested = requested
        self.free = free
        super().__init__(f"{pool} pool exhausted: requested {requested} slots, {free} free")


class DoubleFree(PoolError):
    """A slot was freed that is already free."""


class ForeignSlot(PoolError):
    """A slot outside the pool, unaligned, or not owned by the caller."""


class PageBusy(PoolError):
    """A page cannot be freed: a copy in flight still reads or writes it."""


class CopyFailed(FsmCacheError):
    """A copy between the device and host tiers failed."""


class BadArgument(FsmCacheError, TypeError, ValueError):
    """An argument has the wrong type or an impossible value; nothing changed.

    Also a TypeError and a ValueError, so code written against the builtin
    errors a plain container would raise still catches it.
    """


class ParentLoop(BadArgument):
    """An event walked a record's ancestors and the parent chain came back to a record on it.

    The message names the records of the chain up to the repeated one; no
    record was changed.
    """


class NotASlot(ForeignSlot, BadArgument):
    """A slot or page that is no int: a bool of any kind, a float, a string; nothing changed.

    A :class:`ForeignSlot`, as the pool refuses it, and a :class:`BadArgument`
    (so also a TypeError and a ValueError), as an argument of the wrong type
    is: a bool equals slot 0 or 1 and passes the checks by value, so it is
    named before anything else wrong with the slots it is among.
    """


class ReadOnlyAttribute(FsmCacheError, AttributeError):
    """An attribute fixed when its object was built was assigned, or one it lacks; nothing changed."""

    @classmethod
    def assigned(cls, attribute: str, value: object, why: str) -> ReadOnlyAttribute:
        """Return the error for assigning ``value`` to ``attribute`` (``Engine.trail``).

        Every such message reads ``Engine.trail cannot be set (to True): WHY``;
        the value is shortened as :func:`reprlib.repr` does (a system's repr
        runs to pages).
        """
        return cls(f"{attribute} cannot be set (to {reprlib.repr(value)}): {why}")

    @classmethod
    def deleted(cls, attribute: str, why: str) -> ReadOnlyAttribute:
        """Return the error for deleting ``attribute``: ``Engine.leases cannot be deleted: WHY``."""
        return cls(f"{attribute} cannot be deleted: {why}")


class StaleNode(FsmCacheError):
    """A node handle that is not in this cache's tree: deleted, from before a reset, or another's."""


class ConcurrentUse(FsmCacheError):
    """A second thread entered a cache while another thread was inside it.

    A cache is single-threaded (like the scheduler loop that drives it); callers
    that share one across threads must serialise the calls themselves.
    """


class CacheClosed(FsmCacheError):
    """An operation on a cache after :meth:`~fsm_cache.cache.hicache.HiCache.close`."""


class PinnedMemoryError(FsmCacheError, RuntimeError):
    """Page-locking host memory (``cudaHostRegister``) or releasing it failed.

    The message names the call, the bytes, the device and the ``cudaError``. It
    is also a RuntimeError, which is what the registration raised before.
    """


class InvariantViolation(FsmCacheError):
    """A structural invariant of the cache does not hold; names the invariant and node."""


class RankDivergence(FsmCacheError):
    """Tensor-parallel ranks applied different transitions."""


class ConfigError(FsmCacheError):
    """A cache configuration value is out of range; the message names it."""


class ReplayMismatch(FsmCacheError):
    """A replayed event log applied different transitions than it recorded."""


class RankFailure(FsmCacheError):
    """A collective failed: a rank of the group died or stopped taking part in time."""


class NoProcessGroup(RankFailure):
    """``torch.distributed`` has no process group to agree over."""


class StorageError(FsmCacheError):
    """A storage backend (:mod:`fsm_cache.storage`) refused or failed an operation."""


class StoreFailed(StorageError):
    """The store failed part-way through an operation: its server went away, or a disk error.

    The pages of a put are acknowledged in order, so what survives is a prefix:
    pages ``[0, acknowledged)`` were stored (or already present) before the
    failure; the rest are not known to be (a Redis batch whose answer was lost
    may have landed), and no partial page is left readable.

    Attributes:
        where: The store (``redis 127.0.0.1:6379``, ``local /var/kv``).
        operation: ``put``, ``get``, ``exists``, ``drop``, ``capacity``, or
            ``open`` (a :class:`~fsm_cache.storage.LocalFileStore` root it
            cannot create or read).
        acknowledged: Leading pages the store acknowledged before it failed.
        total: Pages the operation was given (0 for a question about the
            whole store, which the message then leaves out).
        cause: What the backend reported.
    """

    def __init__(
        self, where: str, operation: str, *, acknowledged: int, total: int, cause: str
    ) -> None:
        self.where = where
        self.operation = operation
        self.acknowledged = acknowledged
        self.total = total
        self.cause = cause
        done = f" after {acknowledged} of {total} pages" if total else ""
        super().__init__(f"{where}: {operation} failed{done}: {cause}")


class CorruptPage(StorageError):
    """A stored page does not read back as the page its key names; nothing was returned.

    Raised for a torn page (shorter than its header says, or whose bytes fail
    the header's checksum), a file or value that is not a page at all (a
    directory or pipe at a page path, or a page of the first format, which has
    no checksum), or a page whose header names another key.

    Attributes:
        where: The file path or Redis key read.
        key: The page key asked for.
        problem: What did not match.
    """

    def __init__(self, where: str, key: str, problem: str) -> None:
        self.where = where
        self.key = key
        self.problem = problem
        super().__init__(f"{where}: not a valid page {key[:12]}: {problem}")


class LaterFormatPage(CorruptPage):
    """A stored page is of a later format than this version reads: a newer version wrote it.

    Nothing was returned, as for any :class:`CorruptPage`, but the page is
    not known to be torn: a cache leaves it in the store, where the servers
    of the newer version read it (in a store shared across an upgrade,
    dropping it would throw their pages away).
    """


class PageInUse(StorageError):
    """A page cannot be dropped: a read holds it; nothing was dropped.

    Attributes:
        key: The held page's key.
        readers: Reads holding it.
    """

    def __init__(self, key: str, readers: int) -> None:
        self.key = key
        self.readers = readers
        super().__init__(f"page {key[:12]}: drop refused: held by {readers} read(s)")


class StorageFull(StorageError):
    """A capacity reservation asked for more bytes than are free; nothing was reserved.

    Attributes:
        where: The store.
        requested: Bytes asked for.
        free: Bytes free (the limit less committed and reserved bytes).
    """

    def __init__(self, where: str, requested: int, free: int) -> None:
        self.where = where
        self.requested = requested
        self.free = free
        super().__init__(f"{where}: cannot reserve {requested} bytes, {free} free")


class ReservationError(StorageError):
    """A capacity reservation was settled twice, or by a budget other than the one that made it."""
