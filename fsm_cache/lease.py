"""Leases: an acquire that remembers where it was taken and releases exactly once.

A lease is the receipt of a pin (or a lock). ``release()`` works once; a
second call raises :class:`~fsm_cache.errors.LeaseError` naming where the
first release happened. Used as a context manager it releases on the way
out, exceptions included. A lease collected while still held emits a
``ResourceWarning`` naming where it was taken, and :class:`LeaseBook` lists
the leases still open, so a test can fail on leaked pins.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fsm_cache import trail
from fsm_cache.errors import LeaseError


trail.internal(__file__)


class Lease:
    """One held acquisition of ``acquire`` on a record, released by ``release()``.

    Attributes:
        record: The record the lease holds.
        event: The acquiring event (``pin``, ``lock``).
        taken_at: Where the lease was taken.
        released_at: Where it was released, or None while held.
    """

    __slots__ = (
        "__weakref__",
        "_book",
        "_release",
        "event",
        "label",
        "record",
        "released_at",
        "serial",
        "taken_at",
    )

    def __init__(
        self, record: Any, release: Callable[[Any], None], event: str, label: str, book: LeaseBook
    ) -> None:
        self.record = record
        self._release = release
        self.event = event
        self.label = label
        self.taken_at = trail.caller_site()
        self.released_at: trail.Site | None = None
        self._book = book
        self.serial = 0

    @property
    def held(self) -> bool:
        """Whether the lease has not been released yet."""
        return self.released_at is None

    def release(self) -> None:
        """Fire the releasing event once.

        Raises:
            LeaseError: The lease was already released; names the first release.
            IllegalTransition: The machine refused the release (nothing changed).
        """
        if self.released_at is not None:
            msg = (
                f"{self.label} {self.record.id}: lease ({self.event} taken at {self.taken_at}) "
                f"already released at {self.released_at}"
            )
            raise LeaseError(msg)
        self._release(self.record)
        self.released_at = trail.caller_site()
        self._book.closed(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.released_at is None:
            self.release()

    def __del__(self) -> None:
        if getattr(self, "released_at", True) is None:
            warnings.warn(
                f"{self.label} {self.record.id}: lease ({self.event} taken at {self.taken_at}) "
                "was never released",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        state = "held" if self.held else f"released at {self.released_at}"
        return f"<Lease {self.event} on {self.label} {self.record.id}, taken at {self.taken_at}, {state}>"


class LeaseBook:
    """The leases an engine has handed out and not yet seen released."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._serial = 0
        _BOOKS.add(self)

    def open(self, record: Any, release: Callable[[Any], None], event: str, label: str) -> Lease:
        """Record and return a new held lease on ``record``."""
        lease = Lease(record, release, event, label, self)
        self._serial += 1
        lease.serial = self._serial
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


_BOOKS: weakref.WeakSet[LeaseBook] = weakref.WeakSet()


def open_leases() -> list[Lease]:
    """Return every lease still held in this process, across all engines.

    What a test suite checks at the end of a run (the pytest plugin does):
    a lease still held when nothing runs any more is a leaked pin or lock.
    """
    return [lease for book in list(_BOOKS) for lease in book.outstanding()]
