"""Leases: an acquire that remembers where it was taken and releases exactly once.

A lease is the receipt of a pin (or a lock). ``release()`` works once; a
second call raises :class:`~fsm_cache.errors.LeaseError` naming where the
first release happened. Used as a context manager it releases on the way
out, exceptions included.

Leaks are found three ways, for a test run to fail on (the pytest plugin does):
:func:`open_leases` lists leases still held and still referenced; a lease
collected while still held emits a ``ResourceWarning`` naming where it was
taken and, while :func:`record_dropped` is on, is kept as a :class:`Dropped`
(:func:`dropped_leases`). :func:`fsm_cache.engine.holds.held_records` finds the live
records whose hold counters (pins, locks) are still up, lease or no lease.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

from fsm_cache.engine import trail
from fsm_cache.errors import BadArgument, LeaseError, ReadOnlyAttribute


if TYPE_CHECKING:
    from types import TracebackType


trail.internal(__file__)


class Lease:
    """One held acquisition of ``acquire`` on a record, released by ``release()``.

    Attributes:
        record: The record the lease holds (read-only, as are the next three).
        event: The acquiring event (``pin``, ``lock``).
        label: How the record is called in messages (``node``).
        serial: The lease's number in its book, in the order they were taken.
        taken_at: Where the lease was taken.
        released_at: Where it was released, or None while held.
        gives: The events ``release(event)`` may fire, its own release first.

    A lease is the receipt of what was taken, so what it says is fixed:
    assigning ``record``, ``event``, ``label`` or ``serial`` raises
    :class:`~fsm_cache.errors.ReadOnlyAttribute`. They used to be plain
    slots, and a lease given another record released that record's pin.
    The slots are private and read directly by :meth:`release`, so a
    release costs no more; other code reads them through properties.
    """

    __slots__ = (
        "__weakref__",
        "_book",
        "_busy",
        "_choose",
        "_event",
        "_gives",
        "_label",
        "_order",
        "_record",
        "_release",
        "_released",
        "_serial",
        "_taken",
    )

    def __init__(
        self,
        record: Any,
        release: Callable[[Any], None],
        event: str,
        label: str,
        book: LeaseBook,
        *,
        serial: int = 0,
        gives: tuple[str, ...] = (),
        choose: Callable[[str], Callable[[Any], None]] | None = None,
    ) -> None:
        self._record = record
        self._release = release
        self._event = event
        self._gives = gives
        """The give-backs ``release(event)`` may name; the first is what ``release()`` fires."""
        self._choose = choose
        """Return the function that fires a named give-back other than the first."""
        self._label = label
        # the sites are kept as code and offset, and rendered only when asked for
        self._taken = trail.caller_spot()
        self._released: trail.Spot | trail.Site | None = None
        self._book = book
        self._busy = False
        """Whether ``release()`` is firing the release now (an effect of it may call it again)."""
        self._serial = serial
        self._order = next(_ORDER)
        """The lease's place among all this process took (:func:`lease_mark`)."""

    @property
    def record(self) -> Any:
        """The record the lease holds."""
        return self._record

    @record.setter
    def record(self, value: NoReturn) -> None:  # NoReturn: mypy refuses the assignment too
        raise _fixed("record", value)

    @property
    def event(self) -> str:
        """The acquiring event (``pin``, ``lock``)."""
        return self._event

    @event.setter
    def event(self, value: NoReturn) -> None:
        raise _fixed("event", value)

    @property
    def label(self) -> str:
        """How the record is called in messages (``node``)."""
        return self._label

    @label.setter
    def label(self, value: NoReturn) -> None:
        raise _fixed("label", value)

    @property
    def serial(self) -> int:
        """The lease's number in its book: leases taken later have larger ones."""
        return self._serial

    @serial.setter
    def serial(self, value: NoReturn) -> None:
        raise _fixed("serial", value)

    @property
    def gives(self) -> tuple[str, ...]:
        """The events ``release(event)`` may fire: its own release first, then the others.

        Each gives back exactly what the acquire took, as the spec says (a
        ``load`` is given back by ``load_done`` or ``load_failed``). Empty for a
        lease opened without names: it is released by ``release()`` alone.
        """
        return self._gives

    @property
    def taken_at(self) -> trail.Site:
        """Where the lease was taken."""
        return trail.spot_site(self._taken)

    @property
    def released_at(self) -> trail.Site | None:
        """Where the lease was released, or None while it is held."""
        released = self._released
        if released is None or isinstance(released, trail.Site):
            return released
        return trail.spot_site(released)

    def voided(self, site: trail.Site) -> None:
        """Mark the lease released at ``site`` without firing anything (its book voids it).

        A method of the book's, not a setter: a setter would let any caller
        write None there and make a released lease held again, to release twice.
        """
        self._released = site

    @property
    def held(self) -> bool:
        """Whether the lease has not been released yet."""
        return self._released is None

    def issued_by(self, book: LeaseBook) -> bool:
        """Whether ``book`` handed out this lease (a cache takes back only its own)."""
        return self._book is book

    def release(self, event: str | None = None) -> None:
        """Fire the releasing event once: the lease's own, or ``event`` if named.

        ``event`` names another give-back of what the acquire took, for an
        acquire the spec lets end more than one way: a lease of ``load``
        taken with ``load_done`` is released by ``release("load_failed")``
        when the copy failed, which gives the same pin back. It must be one
        of :attr:`gives`, the events the spec says give back exactly what the
        acquire takes (the rule :meth:`~fsm_cache.engine.core.Engine.lease`
        pairs them by).

        A release asked for while this one is still firing (by an effect of
        the release event itself) is refused rather than fired again: it
        used to recurse until the interpreter's recursion limit. Like the
        engine, a lease takes no lock: releases of one lease from two threads
        at once are the caller's to serialise.

        Raises:
            LeaseError: The lease was already released (names the first
                release), or is being released now.
            BadArgument: ``event`` is not one of :attr:`gives`; nothing was
                fired, the lease is still held.
            IllegalTransition: The machine refused the release (nothing
                changed; the lease is still held).
            EffectFailed: An effect of the release failed (as for
                :meth:`~fsm_cache.engine.core.Engine.fire`); the lease is still held.
        """
        if self._released is not None or self._busy:
            done = "is being released" if self._busy else self._ended()
            msg = f"{self._label} {self._record.id}: lease ({self._event} taken at {self.taken_at}) {done}"
            raise LeaseError(msg)
        fire = self._release if event is None else self._named(event)
        self._busy = True
        try:
            fire(self._record)
        finally:
            self._busy = False
        self._released = trail.caller_spot()
        self._book.closed(self)

    def _named(self, event: object) -> Callable[[Any], None]:
        """Return the function that fires the give-back ``event``, one of :attr:`gives`.

        Raises:
            BadArgument: ``event`` is not one of them (the message names them).
        """
        gives = self._gives
        if isinstance(event, str) and event in gives:
            if event == gives[0]:
                return self._release
            if self._choose is not None:
                return self._choose(event)
        allowed = " or ".join(gives) if gives else "release() without an event"
        raise BadArgument(
            f"{self._label} {self._record.id}: lease ({self._event} taken at {self.taken_at})"
            f" cannot be released by {event!r}: {allowed} gives back what {self._event} takes"
        )

    def _ended(self) -> str:
        """Say how a lease no longer held ended: released, or voided by its book (a reset)."""
        if isinstance(self._released, trail.Site):
            return f"was voided at {self._released}: what it held was reset"
        return f"already released at {self.released_at}"

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._released is None:
            self.release()

    def __del__(self) -> None:
        # A finalizer runs wherever the collector happens to run: keep it to
        # plain attribute reads, one allocation and a list append (atomic, no
        # lock to deadlock on), and record before warning, which may raise.
        if getattr(self, "_released", True) is not None:
            return
        dropped = Dropped(self._label, self._record.id, self._event, self.taken_at, self._order)
        if _DROPS.recording:
            _DROPS.entries.append(dropped)
        warnings.warn(
            f"{self._label} {dropped.ident}: lease ({self._event} taken at {self.taken_at}) "
            "was never released",
            ResourceWarning,
            stacklevel=1,
        )

    def __copy__(self) -> Lease:
        """Return the lease itself: a receipt of one acquisition, released once.

        A copy (``copy.copy`` of a request that holds the lease) used to be a
        second held receipt of the same pin or lock, outside the book: releasing
        both took another holder's hold, and the cache evicted under it.
        """
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Lease:
        """Return the lease itself, as :meth:`__copy__` does: its record is the live one."""
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """Refuse to be pickled: what a lease holds is held in this process only.

        Raises:
            TypeError: Always (pickle's own error for an object it cannot pickle).
        """
        raise TypeError(
            f"cannot pickle {self!r}: a lease holds a {self._event} in this process only"
        )

    def __repr__(self) -> str:
        state = "held" if self.held else self._ended().removeprefix("already ")
        return f"<Lease {self._event} on {self._label} {self._record.id}, taken at {self.taken_at}, {state}>"


class LeaseBook:
    """The leases an engine has handed out and not yet seen released."""

    def __init__(self) -> None:
        # Weak, so that a lease its holder drops is collected and reported as dropped.
        self._open: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._serial = 0
        _BOOKS.add(self)

    def open(
        self,
        record: Any,
        release: Callable[[Any], None],
        event: str,
        label: str,
        *,
        gives: tuple[str, ...] = (),
        choose: Callable[[str], Callable[[Any], None]] | None = None,
    ) -> Lease:
        """Record and return a new held lease on ``record``.

        Args:
            record: The record the acquire ``event`` was fired on.
            release: Fires the lease's own give-back, ``gives[0]``.
            event: The acquiring event.
            label: How the record is called in messages.
            gives: The give-backs ``Lease.release(event)`` may name, its own first.
            choose: Return the function that fires one of ``gives[1:]``;
                None where there is only the first.
        """
        self._serial += 1
        lease = Lease(
            record, release, event, label, self, serial=self._serial, gives=gives, choose=choose
        )
        self._open.add(lease)
        return lease

    def closed(self, lease: Lease) -> None:
        """Forget a released lease."""
        self._open.discard(lease)

    def oldest(self, record: Any, event: str) -> Lease | None:
        """Return the oldest held lease of ``event`` on ``record``, or None."""
        held = [x for x in self._open if x.record is record and x.event == event]
        return min(held, key=lambda x: x.serial, default=None)

    def outstanding(self) -> list[Lease]:
        """Return the leases still held, oldest site first."""
        return sorted(self._open, key=lambda x: x.serial)

    def holding(self, record: Any) -> bool:
        """Return whether a lease of this book still holds ``record``."""
        return any(lease.record is record for lease in self._open)

    def void(self, site: trail.Site, record: Any = None) -> None:
        """Close every held lease (on ``record`` only, if given) as released at ``site``.

        What a reset that drops what the leases hold does: a cache's ``reset``
        voids them all, :meth:`~fsm_cache.engine.core.Engine.init` those on the
        record it starts afresh. A later release of a voided lease raises
        LeaseError naming ``site``.

        Raises:
            BadArgument: ``site`` is not a :class:`~fsm_cache.engine.trail.Site`
                (None would mark the leases held again); no lease changed.
        """
        if not isinstance(site, trail.Site):
            raise BadArgument(f"LeaseBook.void: site must be a Site, got {site!r}")
        for lease in self.outstanding():
            if record is None or lease.record is record:
                lease.voided(site)
                self._open.discard(lease)


_BOOKS: weakref.WeakSet[LeaseBook] = weakref.WeakSet()


def _fixed(name: str, value: object) -> ReadOnlyAttribute:
    """Return the error for assigning ``value`` to a lease's ``name``, fixed when it was taken."""
    why = "a lease is the receipt of what was taken; take another lease"
    return ReadOnlyAttribute.assigned(f"Lease.{name}", value, why)


def open_leases() -> list[Lease]:
    """Return every lease still held (and still referenced) in this process, across all engines.

    What a test suite checks at the end of a run (the pytest plugin does):
    a lease still held when nothing runs any more is a leaked pin or lock.
    """
    return [lease for book in list(_BOOKS) for lease in book.outstanding()]


@dataclass(frozen=True)
class Dropped:
    """A lease collected while still held: a pin or lock nobody can release any more.

    Attributes:
        label: How the record is called in messages (``node``).
        ident: The record's id.
        event: The acquiring event (``pin``, ``lock``).
        taken_at: Where the lease was taken.
        order: The lease's place among all the leases this process took,
            in the order they were taken: above a :func:`lease_mark`, it
            was taken after that mark was made (0: before any mark).
    """

    label: str
    ident: object
    event: str
    taken_at: trail.Site
    order: int = field(default=0, repr=False)

    def __str__(self) -> str:
        return f"{self.label} {self.ident}: {self.event} taken at {self.taken_at}"


class _DropLog:
    """The dropped leases, kept only while recording is on."""

    __slots__ = ("entries", "recording")

    def __init__(self) -> None:
        self.recording = False
        self.entries: list[Dropped] = []


_DROPS = _DropLog()
_ORDER = itertools.count(1)
"""The places of the leases this process takes, and its marks (:func:`lease_mark`)."""


def lease_mark() -> int:
    """Return a mark between the leases taken so far and those taken later.

    A :class:`Dropped` whose ``order`` is above the mark was taken after
    this call, one whose ``order`` is below it before: the pytest plugin
    tells so a test's own leases from those it was handed (a module or
    session fixture's), which ``fsm_allow_leaks`` does not excuse.
    """
    return next(_ORDER)


def record_dropped(on: bool = True) -> bool:
    """Turn on (or off) keeping leases collected while held; return the previous setting.

    Off by default, so a process that does not ask keeps nothing (a leak
    still warns); the pytest plugin turns it on for the run, and again as
    each phase of each test (setup, call, teardown) starts.
    """
    before = _DROPS.recording
    _DROPS.recording = on
    return before


def dropped_leases() -> list[Dropped]:
    """Return the leases collected while held since recording was turned on, oldest first.

    Under the pytest plugin, only those of the running test (and any dropped
    since the last test ended): it takes each test's out at the test's end.
    """
    return list(_DROPS.entries)


def forget_dropped(dropped: Iterable[Dropped]) -> None:
    """Stop reporting these dropped leases (a test that drops one on purpose forgets it).

    Forget only your own: ``mark = len(dropped_leases())`` before dropping,
    then ``forget_dropped(dropped_leases()[mark:])``; the whole log may hold
    what other code dropped.
    """
    gone = {id(entry) for entry in dropped}
    entries = _DROPS.entries
    # Delete in place, from the end: a finalizer may append meanwhile.
    for index in range(len(entries) - 1, -1, -1):
        if id(entries[index]) in gone:
            del entries[index]
