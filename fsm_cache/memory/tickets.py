"""Copy tickets and what the cache needs of a copy engine, without torch.

A ticket names one batched copy between device pages and host pages; a
completion reports its outcome once. :class:`Copier` is the interface the
cache drives, met by :class:`~fsm_cache.memory.copies.CopyEngine` (real memory) and
:class:`~fsm_cache.testing.faults.FaultyCopyEngine` (injected faults). The busy-page
bookkeeping lives here too, so the rule that a page in flight must not be
overwritten is stated once for both.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fsm_cache.errors import CopyFailed


class Direction(enum.Enum):
    """Which way a copy runs."""

    D2H = "d2h"
    H2D = "h2d"


@dataclass(frozen=True)
class Ticket:
    """One started copy; ``src_pages[i]`` is copied to ``dst_pages[i]``."""

    id: int
    direction: Direction
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]

    @property
    def device_pages(self) -> tuple[int, ...]:
        """The device-side pages (read by D2H, written by H2D)."""
        return self.src_pages if self.direction is Direction.D2H else self.dst_pages

    @property
    def host_pages(self) -> tuple[int, ...]:
        """The host-side pages (written by D2H, read by H2D)."""
        return self.dst_pages if self.direction is Direction.D2H else self.src_pages


@dataclass(frozen=True)
class Completion:
    """A ticket's outcome, reported once by ``poll``; ``error`` is ``None`` on success."""

    ticket: Ticket
    error: CopyFailed | None = None

    @property
    def ok(self) -> bool:
        """Whether the copy succeeded and its destination holds the source's bytes."""
        return self.error is None


@dataclass
class CopyStats:
    """Counts per direction since the engine started (bytes of reported successes)."""

    copies: Counter[Direction] = field(default_factory=Counter)
    bytes: Counter[Direction] = field(default_factory=Counter)
    failures: Counter[Direction] = field(default_factory=Counter)


class Copier(Protocol):
    """What the cache needs from a copy engine; :class:`CopyEngine` and the fault injector."""

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Start copying device pages to host pages (a write-through or backup)."""
        ...

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Start copying host pages to device pages (a load-back)."""
        ...

    def poll(self) -> list[Completion]:
        """Report tickets finished since the last poll, without blocking."""
        ...

    def drain(self) -> list[Completion]:
        """Block until every ticket finishes and report them (shutdown, tests)."""
        ...

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> None:
        """Make ``stream`` (None: the device's current stream) wait for these copies.

        Never blocks the host: on CUDA the stream waits on each unreported
        ticket's event, so compute queued after it reads the loaded pages.
        Reported tickets need nothing; a CPU engine's copies are synchronous.
        An id no copy was started with raises ValueError.
        """
        ...

    def close(self) -> None:
        """Drain every copy (dropping the completions) and refuse copies from now on.

        Idempotent. Called by ``Tiers.close`` before the pools' memory goes.
        """
        ...

    def in_flight(self) -> list[Ticket]:
        """Tickets started and not yet reported."""
        ...

    def device_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these device pages."""
        ...

    def host_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these host pages."""
        ...

    def busy_device_pages(self) -> frozenset[int]:
        """Every device page an unreported copy reads or writes."""
        ...

    def busy_host_pages(self) -> frozenset[int]:
        """Every host page an unreported copy reads or writes."""
        ...


class BusyPages:
    """A multiset of the pages in-flight tickets touch, per tier."""

    def __init__(self) -> None:
        self.device: Counter[int] = Counter()
        self.host: Counter[int] = Counter()

    def add(self, ticket: Ticket) -> None:
        """Mark the ticket's pages busy."""
        self.device.update(ticket.device_pages)
        self.host.update(ticket.host_pages)

    def remove(self, ticket: Ticket) -> None:
        """Unmark the ticket's pages (once per earlier :meth:`add`)."""
        self.device.subtract(ticket.device_pages)
        self.host.subtract(ticket.host_pages)
        _drop_zeros(self.device, ticket.device_pages)
        _drop_zeros(self.host, ticket.host_pages)


def _drop_zeros(counts: Counter[int], pages: Iterable[int]) -> None:
    for p in pages:
        if counts.get(p) == 0:
            del counts[p]


def host_runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Yield ``(first_page, offset, length)`` for each run of consecutive ascending pages."""
    off = 0
    while off < len(pages):
        end = off + 1
        while end < len(pages) and pages[end] == pages[end - 1] + 1:
            end += 1
        yield pages[off], off, end - off
        off = end


def refuse_busy_destination(direction: Direction, dst: Iterable[int], busy: Container[int]) -> None:
    """Refuse to write pages an unreported copy still reads or writes (WAR and WAW hazards).

    Raises:
        ValueError: naming the first busy destination page.
    """
    hit = next((p for p in dst if p in busy), None)
    if hit is not None:
        tier = "host" if direction is Direction.D2H else "device"
        raise ValueError(f"copy: {tier} page {hit} is still in use by an unreported copy")
