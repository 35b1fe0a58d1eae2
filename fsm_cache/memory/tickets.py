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
from typing import Protocol, cast

from fsm_cache.errors import BadArgument, CopyFailed
from fsm_cache.memory.pages import run_start


class Direction(enum.Enum):
    """Which way a copy runs."""

    D2H = "d2h"
    H2D = "h2d"

    # Members are singletons compared by identity, so the identity hash agrees with equality;
    # it runs in C, where Enum's own hashes the name in Python (copies look directions up often).
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Ticket:
    """One started copy; ``src_pages[i]`` is copied to ``dst_pages[i]``."""

    id: int
    direction: Direction
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    runs: tuple[int | None, int | None] | None = field(default=None, compare=False, repr=False)
    """:func:`run_start` of ``src_pages`` and of ``dst_pages``, as the engine found them
    when it checked the copy (None: not known), so that moving it need not look again."""

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
    """Counts per direction since the engine started (bytes of reported successes).

    ``poison_failures`` counts failed copies whose destination could not be
    poisoned before their report went out (the poison raised): their pages
    were given back unread, holding whatever the copy left.
    """

    copies: Counter[Direction] = field(default_factory=Counter)
    bytes: Counter[Direction] = field(default_factory=Counter)
    failures: Counter[Direction] = field(default_factory=Counter)
    poison_failures: Counter[Direction] = field(default_factory=Counter)


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

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> bool:
        """Make ``stream`` (None: the device's current stream) wait for these copies.

        Never blocks the host: on CUDA the stream waits on each unreported
        ticket's event, so compute queued after it reads the loaded pages.
        Reported tickets need nothing; a CPU engine's copies are synchronous.
        An id no copy was started with raises BadArgument (a ValueError).

        Returns False when one of these copies is already known to have failed
        (its launch did), so its pages will not hold what it copies and compute
        must not read them; a later :meth:`poll` reports the failure. True
        otherwise: the copies land before the compute queued after this call.
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


class PageSet:
    """A multiset of page numbers: runs as ranges, other pages as a set plus the rare extras.

    Each in-flight ticket holds its pages; a page two tickets read stays busy
    until both are reported. A ticket's pages are most often one run (pages
    handed out together), held as one ``range``: adding, removing and testing
    it against another run cost the same for one page or a thousand. Other
    pages live in a plain set (adding and removing them runs in C), and only
    the extra holders of a page are counted. Pages are removed the way they
    were added (the same run, or the same pages), as a ticket is.
    """

    __slots__ = ("_extra", "_pages", "_runs")

    def __init__(self) -> None:
        self._pages: set[int] = set()
        self._extra: Counter[int] = Counter()
        self._runs: list[range] = []

    def __contains__(self, page: object) -> bool:
        return page in self._pages or any(page in run for run in self._runs)

    def __iter__(self) -> Iterator[int]:
        return iter(self._distinct())

    def __len__(self) -> int:
        return len(self._distinct())

    def __bool__(self) -> bool:
        return bool(self._pages or self._runs)

    def _distinct(self) -> set[int]:
        return self._pages.union(*self._runs) if self._runs else self._pages

    def isdisjoint(self, pages: Iterable[int], first: int | None = None) -> bool:
        """Return whether none of ``pages`` is held.

        Args:
            pages: The pages to test.
            first: ``pages[0]`` where ``pages`` is known to be one ascending run
                (``first, first + 1, ...``): tested against each held run at once.
        """
        if not isinstance(pages, (list, tuple, set, frozenset, range)):
            pages = list(pages)  # an iterator is read once, and tested twice below
        # an empty set still looks up every page of a list or tuple: skipped when empty
        if self._pages and not self._pages.isdisjoint(pages):
            return False
        if not self._runs:
            return True
        if first is not None:
            end = first + len(cast("Sequence[int]", pages))
            return all(run.stop <= first or end <= run.start for run in self._runs)
        return not any(map(self._in_runs, pages))

    def _in_runs(self, page: int) -> bool:
        return any(page in run for run in self._runs)

    def add(self, pages: Sequence[int], first: int | None = None) -> None:
        """Hold each of ``pages`` once more (a page listed twice is held twice).

        ``first``: ``pages[0]`` where ``pages`` is one ascending run, held as one range.
        """
        if first is not None:
            self._runs.append(range(first, first + len(pages)))
            return
        held = self._pages
        if not held or held.isdisjoint(pages):
            before = len(held)
            held.update(pages)
            if len(held) - before == len(pages):
                return  # the common case: new pages, each listed once
            repeats = Counter(pages)
        else:
            repeats = Counter(pages)
            for page in repeats.keys() & held:
                repeats[page] += 1  # held already: one more holder than listed
            held.update(pages)
        for page, count in repeats.items():
            if count > 1:
                self._extra[page] += count - 1

    def remove(self, pages: Sequence[int], first: int | None = None) -> None:
        """Drop one hold of each of ``pages``, added as they are removed (the same ``first``)."""
        if first is not None:
            self._runs.remove(range(first, first + len(pages)))
            return
        extra = self._extra
        if not extra or extra.keys().isdisjoint(pages):
            self._pages.difference_update(pages)
            return
        for page in pages:
            if extra.get(page, 0) > 0:
                extra[page] -= 1
                if not extra[page]:
                    del extra[page]
            else:
                self._pages.discard(page)

    def frozen(self) -> frozenset[int]:
        """Return the pages held, as a frozenset."""
        return frozenset(self._distinct())


class BusyPages:
    """The pages in-flight tickets touch, per tier (see :class:`PageSet`).

    Args:
        writes: Also keep the pages they write (:attr:`written`), for an
            engine whose two directions run on streams of their own.
    """

    def __init__(self, *, writes: bool = False) -> None:
        self.device = PageSet()
        self.host = PageSet()
        self.written: dict[Direction, PageSet] | None = (
            {Direction.D2H: PageSet(), Direction.H2D: PageSet()} if writes else None
        )
        """Per direction, the destination pages its in-flight tickets write (None: not kept)."""

    def add(self, ticket: Ticket) -> None:
        """Mark the ticket's pages busy."""
        device, host, device_run, host_run = _sides(ticket)
        self.device.add(device, device_run)
        self.host.add(host, host_run)
        if self.written is not None:
            runs = ticket.runs
            self.written[ticket.direction].add(ticket.dst_pages, runs[1] if runs else None)

    def remove(self, ticket: Ticket) -> None:
        """Unmark the ticket's pages (once per earlier :meth:`add`)."""
        device, host, device_run, host_run = _sides(ticket)
        self.device.remove(device, device_run)
        self.host.remove(host, host_run)
        if self.written is not None:
            runs = ticket.runs
            self.written[ticket.direction].remove(ticket.dst_pages, runs[1] if runs else None)


def _sides(
    ticket: Ticket,
) -> tuple[tuple[int, ...], tuple[int, ...], int | None, int | None]:
    """The ticket's device pages, host pages, and the first page of each that is one run."""
    src_run, dst_run = ticket.runs if ticket.runs is not None else (None, None)
    if ticket.direction is Direction.D2H:
        return ticket.src_pages, ticket.dst_pages, src_run, dst_run
    return ticket.dst_pages, ticket.src_pages, dst_run, src_run


def host_runs(pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Yield ``(first_page, offset, length)`` for each run of consecutive ascending pages."""
    first = run_start(pages)
    if first is not None:  # one run: found in C
        yield first, 0, len(pages)
        return
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
        BadArgument: naming the first busy destination page (also a ValueError).
    """
    disjoint = getattr(busy, "isdisjoint", None)
    if disjoint is not None and disjoint(dst):
        return  # nothing busy: checked in C
    hit = next((p for p in dst if p in busy), None)
    if hit is not None:
        tier = "host" if direction is Direction.D2H else "device"
        raise BadArgument(f"copy: {tier} page {hit} is still in use by an unreported copy")
