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

Compute that reads a load's pages need not wait for its acknowledgement:
:meth:`CopyEngine.wait` makes a stream wait on the load's event without
blocking the host. :meth:`CopyEngine.close` drains every copy and lets the
device go idle before the pools' memory can be released.

Streams and events come from a :class:`Streams` (:class:`CudaStreams` on a
GPU); ``fsm_cache.testing.fakecuda`` supplies a CPU fake that defers each
copy until its event completes, so this CUDA path is tested on every machine.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

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
    "CudaStreams",
    "Direction",
    "Event",
    "Stream",
    "Streams",
    "Ticket",
    "host_runs",
    "refuse_busy_destination",
]


class Event(Protocol):
    """What the engine needs of an event: ``torch.cuda.Event`` or a fake."""

    def record(self, stream: Any) -> Any:
        """Mark the point after the work queued so far on ``stream`` (a :class:`Stream`)."""
        ...

    def query(self) -> bool:
        """Whether the work before the mark has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work before the mark has finished."""
        ...


class Stream(Protocol):
    """What the engine needs of a stream: ``torch.cuda.Stream`` or a fake."""

    def wait_stream(self, stream: Any) -> None:
        """Make later work here wait for the work queued so far on ``stream`` (a :class:`Stream`)."""
        ...

    def wait_event(self, event: Any) -> None:
        """Make later work here wait for ``event`` (an :class:`Event`) without blocking the host."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work queued here has finished."""
        ...


class Streams(Protocol):
    """Where the engine gets its streams and events, and how it queues work on them.

    :class:`CudaStreams` is the real one; ``fsm_cache.testing.fakecuda``
    provides a CPU fake that defers each copy until its event completes, so
    the ordering logic runs on machines without a GPU.
    """

    def new_stream(self, device: torch.device) -> Stream:
        """Return a new side stream on ``device``."""
        ...

    def current_stream(self, device: torch.device) -> Stream:
        """Return the stream compute runs on (``torch.cuda.current_stream``)."""
        ...

    def new_event(self) -> Event:
        """Return a new, unrecorded event."""
        ...

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        """Queue ``work``'s device operations on ``stream``."""
        ...

    def synchronize(self, device: torch.device) -> None:
        """Block the host until every stream of ``device`` is idle."""
        ...


class CudaStreams:
    """The real :class:`Streams`: ``torch.cuda`` streams and events."""

    def new_stream(self, device: torch.device) -> Stream:
        """Return ``torch.cuda.Stream(device)``."""
        stream: Stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def current_stream(self, device: torch.device) -> Stream:
        """Return ``torch.cuda.current_stream(device)``."""
        stream: Stream = torch.cuda.current_stream(device)
        return stream

    def new_event(self) -> Event:
        """Return ``torch.cuda.Event()`` (timing off: the cheapest kind)."""
        event: Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return event

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        """Run ``work`` now with ``stream`` and its device current: its kernels queue there.

        The device is made current too, so nothing ``work`` does (pinning an
        index tensor, say) touches another GPU's context.
        """
        cuda_stream = cast("torch.cuda.Stream", stream)
        with torch.cuda.device(cuda_stream.device), torch.cuda.stream(cuda_stream):
            work()

    def synchronize(self, device: torch.device) -> None:
        """``torch.cuda.synchronize(device)``."""
        torch.cuda.synchronize(device)


@dataclass
class _Pending:
    ticket: Ticket
    event: Event | None
    error: CopyFailed | None


class CopyEngine:
    """Batched copies between a device pool and a host pool.

    Args:
        device: The device pool (CUDA or CPU).
        host: The host pool (pinned when the device pool is on CUDA).
        staging_bytes: Largest staging buffer per chunk; bigger batches are
            copied chunk by chunk on the same stream under the same event.
        streams: Where streams and events come from. None: :class:`CudaStreams`
            for a CUDA device pool; none at all for a CPU one, whose copies
            run synchronously. A fake (``fsm_cache.testing.fakecuda``) runs the
            CUDA ordering logic on CPU pools.
    """

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        staging_bytes: int = 256 << 20,
        *,
        streams: Streams | None = None,
    ) -> None:
        self.device = device
        self.host = host
        self.stats = CopyStats()
        self.cuda = device.device.type == "cuda"
        self.closed = False
        self._chunk = max(1, staging_bytes // device.layout.page_bytes)
        self._ids = itertools.count(1)
        self._started = 0
        self._pending: dict[int, _Pending] = {}
        self._busy = BusyPages()
        self._api = streams if streams is not None else CudaStreams() if self.cuda else None
        api = self._api
        self._streams = {d: api.new_stream(device.device) for d in Direction} if api else {}

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Start copying ``device_pages`` into ``host_pages``; see :class:`Copier`.

        Raises:
            ValueError: the page lists differ in length, a destination repeats,
                or a destination is busy with an unreported copy.
            ForeignSlot: a page is outside its pool.
            CopyFailed: the engine is closed.
        """
        return self._start(Direction.D2H, device_pages, host_pages)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Start copying ``host_pages`` into ``device_pages``; see :class:`Copier`.

        Raises:
            ValueError: the page lists differ in length, a destination repeats,
                or a destination is busy with an unreported copy.
            ForeignSlot: a page is outside its pool.
            CopyFailed: the engine is closed.
        """
        return self._start(Direction.H2D, host_pages, device_pages)

    def _start(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> Ticket:
        if self.closed:
            raise CopyFailed(f"copy engine closed: {direction.value} copy refused")
        self._validate(direction, src, dst)
        ticket = Ticket(next(self._ids), direction, tuple(src), tuple(dst))
        self._started = ticket.id
        error: CopyFailed | None = None
        stream = self._on_stream(direction)
        try:
            self._submit(stream, lambda: self._launch(ticket))
        except RuntimeError as exc:  # a launch that fails is reported like any failure
            error = CopyFailed(f"copy {ticket.id} ({direction.value}) failed: {exc}")
        event = self._record(stream)
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

    def _on_stream(self, direction: Direction) -> Stream | None:
        """The direction's side stream, made to wait for compute; None on a CPU engine."""
        if self._api is None:
            return None
        stream = self._streams[direction]
        # D2H: read only what compute has written. H2D: overwrite only what compute has read.
        stream.wait_stream(self._api.current_stream(self.device.device))
        return stream

    def _submit(self, stream: Stream | None, work: Callable[[], None]) -> None:
        if stream is None or self._api is None:
            work()
        else:
            self._api.run_on(stream, work)

    def _record(self, stream: Stream | None) -> Event | None:
        if stream is None or self._api is None:
            return None
        event = self._api.new_event()
        event.record(stream)
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

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> None:
        """Make ``stream`` wait for these tickets' copies, without blocking the host.

        Compute that reads the pages a load writes must not start before the
        copy has landed: call this after ``start_load`` and before queueing
        that compute, instead of waiting for the acknowledgement. On CUDA the
        stream waits on each unreported ticket's event; tickets already
        reported are done and need nothing. On a CPU engine copies are
        synchronous, so this only checks the ids.

        Args:
            ticket_ids: Ids of tickets this engine started.
            stream: The stream to hold back; None: the device's current stream.

        Raises:
            ValueError: an id names no ticket this engine started.
        """
        ids = list(ticket_ids)
        unknown = next((i for i in ids if not 1 <= i <= self._started), None)
        if unknown is not None:
            raise ValueError(f"copy: cannot wait for ticket {unknown}: no copy started with it")
        if self._api is None:
            return
        here = self.device.device
        target = self._api.current_stream(here) if stream is None else cast("Stream", stream)
        for i in ids:
            pending = self._pending.get(i)
            if pending is not None and pending.event is not None:
                target.wait_event(pending.event)

    def close(self) -> None:
        """Drain every copy, let the device go idle, and refuse copies from now on.

        The completions are dropped (drain and apply them first where they
        matter). Idempotent: a closed engine has nothing in flight.
        """
        if self.closed:
            return
        self.drain()
        if self._api is not None:  # the side streams and whatever compute still reads
            self._api.synchronize(self.device.device)
        self.closed = True

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
        return bool(pending.event.query())
    except RuntimeError as exc:
        pending.error = CopyFailed(f"copy {pending.ticket.id} failed on the device: {exc}")
        return True
