"""The copy engine: batched device<->host KV copies, tracked by tickets.

A copy gathers its source pages into one contiguous staging buffer, moves it
in one transfer per run of consecutive host pages, and scatters on the device.
On CUDA each direction has its own stream; a device-to-host copy first waits
for the compute stream (the KV must be written before it is read), a
host-to-device copy waits for it too (compute may still read the recycled
pages), and an event recorded after the batch is what :meth:`CopyEngine.poll`
queries, so the scheduler never blocks. On CPU the same code runs
synchronously and the ticket is reported done at the next poll.

Pages named by an in-flight ticket are *busy* until :meth:`CopyEngine.poll`
has reported that ticket; the cache must not free busy pages.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fsm_cache.errors import CopyFailed, ForeignSlot
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.tickets import (
    BusyPages,
    Completion,
    Copier,
    CopyStats,
    Direction,
    Ticket,
    host_runs,
    refuse_busy_destination,
)


__all__ = [
    "BusyPages",
    "Completion",
    "Copier",
    "CopyEngine",
    "CopyStats",
    "Direction",
    "Ticket",
    "host_runs",
    "refuse_busy_destination",
]


@dataclass
class _Pending:
    ticket: Ticket
    event: torch.cuda.Event | None
    error: CopyFailed | None


class CopyEngine:
    """Batched copies between a device pool and a host pool.

    Args:
        device: The device pool (CUDA or CPU).
        host: The host pool (pinned when the device pool is on CUDA).
        staging_bytes: Largest staging buffer per chunk; bigger batches are
            copied chunk by chunk on the same stream under the same event.
    """

    def __init__(self, device: KVPool, host: KVPool, staging_bytes: int = 256 << 20) -> None:
        self.device = device
        self.host = host
        self.stats = CopyStats()
        self.cuda = device.device.type == "cuda"
        self._chunk = max(1, staging_bytes // device.layout.page_bytes)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._busy = BusyPages()
        self._streams = {d: _stream(device.device) for d in Direction} if self.cuda else {}

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Start copying ``device_pages`` into ``host_pages``; see :class:`Copier`.

        Raises:
            ValueError: the page lists differ in length, a destination repeats,
                or a destination is busy with an unreported copy.
            ForeignSlot: a page is outside its pool.
        """
        return self._start(Direction.D2H, device_pages, host_pages)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Start copying ``host_pages`` into ``device_pages``; see :class:`Copier`.

        Raises:
            ValueError: the page lists differ in length, a destination repeats,
                or a destination is busy with an unreported copy.
            ForeignSlot: a page is outside its pool.
        """
        return self._start(Direction.H2D, host_pages, device_pages)

    def _start(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> Ticket:
        self._validate(direction, src, dst)
        ticket = Ticket(next(self._ids), direction, tuple(src), tuple(dst))
        error: CopyFailed | None = None
        with self._on_stream(direction):
            try:
                self._launch(ticket)
            except RuntimeError as exc:  # a launch that fails is reported like any failure
                error = CopyFailed(f"copy {ticket.id} ({direction.value}) failed: {exc}")
            event = self._record(direction)
        self._pending[ticket.id] = _Pending(ticket, event, error)
        self._busy.add(ticket)
        return ticket

    def _validate(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"copy: {len(src)} source pages but {len(dst)} destination pages")
        if len(set(dst)) != len(dst):
            raise ValueError("copy: a destination page is listed twice")
        to_host = direction is Direction.D2H
        pools = (self.device, self.host) if to_host else (self.host, self.device)
        for pool, pages in zip(pools, (src, dst), strict=True):
            bad = [p for p in pages if not 0 <= p < pool.num_pages]
            if bad:
                raise ForeignSlot(
                    f"{pool.name} pool: page {bad[0]} outside 0..{pool.num_pages - 1}"
                )
        refuse_busy_destination(direction, dst, self._busy.host if to_host else self._busy.device)

    def _on_stream(self, direction: Direction) -> contextlib.AbstractContextManager[object]:
        if not self.cuda:
            return contextlib.nullcontext()
        stream = self._streams[direction]
        # D2H: read only what compute has written. H2D: overwrite only what compute has read.
        stream.wait_stream(torch.cuda.current_stream(self.device.device))
        return torch.cuda.stream(stream)

    def _record(self, direction: Direction) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._streams[direction])
        return event

    def _launch(self, ticket: Ticket) -> None:
        step = self._chunk
        src, dst = ticket.src_pages, ticket.dst_pages
        for lo in range(0, len(src), step):
            if ticket.direction is Direction.D2H:
                self._d2h(src[lo : lo + step], dst[lo : lo + step])
            else:
                self._h2d(src[lo : lo + step], dst[lo : lo + step])

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(pages, dtype=torch.long)
        if self.cuda:  # a pageable source would make this copy block the host
            idx = idx.pin_memory().to(self.device.device, non_blocking=True)
        return idx

    def _d2h(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        staged = self.device.pages.index_select(0, self._index(device_pages))
        for first, off, n in host_runs(host_pages):
            dst = self.host.pages[first : first + n]
            dst.copy_(staged[off : off + n], non_blocking=self.cuda)

    def _h2d(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        shape = (len(device_pages), *self.host.pages.shape[1:])
        staged = torch.empty(shape, dtype=torch.uint8, device=self.device.device)
        for first, off, n in host_runs(host_pages):
            staged[off : off + n].copy_(self.host.pages[first : first + n], non_blocking=self.cuda)
        self.device.pages.index_copy_(0, self._index(device_pages), staged)

    def poll(self) -> list[Completion]:
        """Report every ticket whose event has completed, without blocking."""
        done = [p for p in self._pending.values() if _finished(p)]
        return [self._complete(p) for p in done]

    def drain(self) -> list[Completion]:
        """Wait for every in-flight ticket and report them all."""
        for p in self._pending.values():
            if p.event is not None:
                with contextlib.suppress(RuntimeError):  # reported by _finished
                    p.event.synchronize()
        return self.poll()

    def _complete(self, pending: _Pending) -> Completion:
        ticket = pending.ticket
        del self._pending[ticket.id]
        self._busy.remove(ticket)
        self.stats.copies[ticket.direction] += 1
        if pending.error is not None:
            self.stats.failures[ticket.direction] += 1
        else:
            page_bytes = self.device.layout.page_bytes
            self.stats.bytes[ticket.direction] += len(ticket.src_pages) * page_bytes
        return Completion(ticket, pending.error)

    def in_flight(self) -> list[Ticket]:
        """Tickets started and not yet reported, oldest first."""
        return [p.ticket for p in self._pending.values()]

    def device_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these device pages."""
        return any(p in self._busy.device for p in pages)

    def host_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these host pages."""
        return any(p in self._busy.host for p in pages)

    def busy_device_pages(self) -> frozenset[int]:
        """Every device page an unreported copy touches."""
        return frozenset(self._busy.device)

    def busy_host_pages(self) -> frozenset[int]:
        """Every host page an unreported copy touches."""
        return frozenset(self._busy.host)


def _finished(pending: _Pending) -> bool:
    """Query the event; an asynchronous CUDA error turns into a failed completion."""
    if pending.event is None:
        return True
    try:
        return bool(pending.event.query())  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        pending.error = CopyFailed(f"copy {pending.ticket.id} failed on the device: {exc}")
        return True


def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
