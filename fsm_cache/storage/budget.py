"""Byte accounting for a bounded store: reserve before a write, then commit or abort.

A write reserves its bytes before it starts, so two writes in flight can never
together overrun the limit, and settles the reservation exactly once: committed
when the page is in place, aborted when the write failed. SGLang's
``LRUFileEvictor`` does the same; here a second settlement is a
:class:`~fsm_cache.errors.ReservationError` instead of a silent double count.
Torch-free and not thread-safe: the store that owns a budget serialises it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from fsm_cache.errors import BadArgument, ReservationError, StorageFull
from fsm_cache.storage.base import check_count


@dataclass
class Reservation:
    """Bytes set aside for one write in progress.

    Attributes:
        ident: A number unique within its budget, for messages.
        nbytes: The bytes reserved.
        settled: ``""`` while open, then ``committed`` or ``aborted``.
        budget: The budget that made it, which alone may settle it.
    """

    ident: int
    nbytes: int
    settled: str = field(default="")
    budget: Budget | None = field(default=None, repr=False, compare=False)


class Budget:
    """Committed and reserved bytes of one store, under an optional limit.

    Every count of bytes it is given is an int >= 0 (:func:`check_count`): a
    NaN limit would refuse every reservation, a bool count one byte.

    Args:
        where: The store, for messages.
        limit_bytes: The most the store may hold, or None when unbounded.

    Raises:
        BadArgument: ``limit_bytes`` is neither None nor an int >= 0.
    """

    def __init__(self, where: str, limit_bytes: int | None) -> None:
        if limit_bytes is not None:
            check_count("limit_bytes", limit_bytes)
        self.where = where
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.reserved_bytes = 0
        self._idents = itertools.count(1)

    def free(self) -> int | None:
        """Return the bytes neither used nor reserved, or None when unbounded."""
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.used_bytes - self.reserved_bytes)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more could be reserved now."""
        free = self.free()
        return free is None or nbytes <= free

    def shortfall(self, nbytes: int) -> int:
        """Return the bytes to free before ``nbytes`` more fit (0 when they fit, or unbounded).

        Unlike :meth:`free`, not floored at 0: pages found on disk may already
        hold more than the limit, and making room must free that excess too.
        """
        if self.limit_bytes is None:
            return 0
        return max(0, self.used_bytes + self.reserved_bytes + nbytes - self.limit_bytes)

    def reserve(self, nbytes: int) -> Reservation:
        """Set ``nbytes`` aside for a write.

        Raises:
            BadArgument: ``nbytes`` is not an int >= 0; nothing was reserved.
            StorageFull: Fewer bytes are free; nothing was reserved.
        """
        check_count("nbytes", nbytes)
        free = self.free()
        if free is not None and nbytes > free:
            raise StorageFull(self.where, nbytes, free)
        self.reserved_bytes += nbytes
        return Reservation(next(self._idents), nbytes, budget=self)

    def commit(self, reservation: Reservation) -> None:
        """Count a finished write's bytes as used.

        Raises:
            BadArgument: ``reservation`` is not a :class:`Reservation`; nothing changed.
            ReservationError: The reservation was already settled, or another
                budget made it; nothing changed.
        """
        self._settle(reservation, "committed")
        self.used_bytes += reservation.nbytes

    def abort(self, reservation: Reservation) -> None:
        """Give back a failed write's bytes.

        Raises:
            BadArgument: ``reservation`` is not a :class:`Reservation`; nothing changed.
            ReservationError: The reservation was already settled, or another
                budget made it; nothing changed.
        """
        self._settle(reservation, "aborted")

    def add(self, nbytes: int) -> None:
        """Count bytes stored without a reservation (found on disk, written by another process)."""
        self.used_bytes += check_count("nbytes", nbytes)

    def remove(self, nbytes: int) -> None:
        """Stop counting a deleted page's bytes."""
        self.used_bytes = max(0, self.used_bytes - check_count("nbytes", nbytes))

    def _settle(self, reservation: Reservation, how: str) -> None:
        if not isinstance(reservation, Reservation):
            raise BadArgument(
                f"reservation must be a Reservation, not {type(reservation).__name__}"
            )
        if reservation.budget is not self:  # its bytes were never reserved here
            raise ReservationError(
                f"{self.where}: reservation {reservation.ident} ({reservation.nbytes} bytes) "
                f"cannot be {how}: another budget made it"
            )
        if reservation.settled:
            raise ReservationError(
                f"{self.where}: reservation {reservation.ident} ({reservation.nbytes} bytes) "
                f"cannot be {how}: already {reservation.settled}"
            )
        reservation.settled = how
        self.reserved_bytes -= reservation.nbytes
