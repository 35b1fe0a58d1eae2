"""The copy engine: batched device<->host KV copies, tracked by tickets.

A ticket is started at once (checked, its pages marked busy) but its bytes
move when the engine *submits*: a device-to-host copy (a backup) waits in the
open batch until the next :meth:`CopyEngine.poll`, :meth:`~CopyEngine.drain`
or :meth:`~CopyEngine.wait`, or until the open batch fills one staging
buffer, so the backups of many operations move together: one gather and one
copy per submission per direction, with the runs of host pages of all its
tickets coalesced. A host-to-device copy (a load, which compute is about to
read) is submitted at once, after the open backups, so copies run in the
order they were started (on CUDA a copy that reads pages a copy of the other
direction still writes waits for that direction's stream). :class:`~fsm_cache.memory.staging.Mover` moves the
bytes (as 64-bit words where the page size allows, through reused staging
buffers, chunk by chunk).

On CUDA each direction has its own streams. A copy is ordered after compute
when it is *started*, not when it is submitted: ``start_*`` makes the
engine's ordering stream wait for every compute stream the engine knows as
it stands then (the one named by ``stream=``, else the engine's
``compute_stream``, else the current stream; and every stream given to
:meth:`CopyEngine.wait`), and a submission waits for the ordering stream (a
backup must read what compute wrote before it was started, even when it is
submitted later, from another thread or under another current stream; a load
must not overwrite pages compute still reads). An event recorded after the
submission is what :meth:`CopyEngine.poll` queries, so the scheduler never
blocks. On CPU the same code runs synchronously at submission and its
tickets are reported by the poll that submitted them.

Pages named by an in-flight ticket are *busy* until :meth:`CopyEngine.poll`
has reported that ticket; the cache must not free busy pages. A copy whose
launch fails may have written part of its destination, which is then
overwritten with :data:`POISON` (:meth:`CopyEngine.poison_destination`), so
what it left never reads as KV.

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
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import cast

from fsm_cache.errors import BadArgument, CopyFailed
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.staging import CudaStreams, Event, Mover, Stream, Streams
from fsm_cache.memory.tickets import (
    BusyPages,
    Completion,
    Copier,
    CopyStats,
    Direction,
    PageSet,
    Ticket,
    host_runs,
    refuse_busy_destination,
)
from fsm_cache.numeric import whole


__all__ = [
    "POISON",
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
    "check_stream",
    "engine_of",
    "host_runs",
    "poison_in_order",
    "refuse_busy_destination",
]


POISON = 0xFF
"""The byte a failed copy leaves in every byte of its destination pages.

A copy that fails part-way may have written some of its pages, or some
chunks: whatever it left is overwritten (:meth:`CopyEngine.poison_destination`),
so a cache that goes on to read a failed copy's output reads ``0xFF`` bytes
(NaN in every float dtype), never KV that looks right."""


@dataclass(eq=False)  # compared by identity
class _Submission:
    """Tickets of one direction moved together, and the event recorded after them.

    ``failure`` completes the message of each ticket's ``CopyFailed`` (``copy
    <id> <failure>``) when the launch or the device failed; None when it worked.
    """

    tickets: Sequence[Ticket]
    event: Event | None
    failure: str | None = None


class CopyEngine:
    """Batched copies between a device pool and a host pool.

    Args:
        device: The device pool (CUDA or CPU).
        host: The host pool (pinned when the device pool is on CUDA).
        staging_bytes: Bytes of one of the two staging buffers per direction
            (kept and reused; allocated as large as the largest chunk seen, up
            to this). An open batch of backups this large is submitted at
            once; bigger batches are moved chunk by chunk under one event.
        streams: Where streams and events come from. None: :class:`CudaStreams`
            for a CUDA device pool; none at all for a CPU one, whose copies
            run synchronously. A fake (``fsm_cache.testing.fakecuda``) runs the
            CUDA ordering logic on CPU pools.
        batch_polls: The poll that submits an open batch of backups: 1, the
            next one; ``k``, the ``k``-th since the batch opened, so the
            backups of ``k`` scheduler steps move together (fewer, larger
            copies; each backup is acknowledged up to ``k - 1`` polls later).
        compute_stream: The stream that writes and reads the device pool's
            pages (a serving engine's forward stream), which each copy is
            ordered after when it starts. None: the device's current stream
            at each ``start_*``. Ignored without streams (a CPU engine).

    The two pools must share one layout (page shape, dtype and bytes per
    page): the engine moves pages as raw words, so pools of two layouts
    would be copied into each other as garbage. The host pool lives on the
    CPU; on CUDA it should be pinned (see :func:`_check_pools`).

    An engine dropped without :meth:`close` while copies are in flight waits
    for them before its pools and staging buffers can be freed (queued copies
    would otherwise run into freed memory), and warns with a
    ``ResourceWarning`` naming it: :meth:`close` is the contract.

    Raises:
        BadArgument: ``device`` or ``host`` is not a pool of its kind (the
            same pool twice, the host pool off the CPU, a device pool on
            neither the CPU nor CUDA), the two pools' layouts differ,
            ``staging_bytes`` is not an int >= 1, ``batch_polls`` is not
            an int >= 1, or ``compute_stream`` is not a stream (or one of
            another GPU than the device pool's). Nothing is allocated.
    """

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        staging_bytes: int = 64 << 20,
        *,
        streams: Streams | None = None,
        batch_polls: int = 1,
        compute_stream: object | None = None,
    ) -> None:
        _check_pools(device, host)
        if not whole(staging_bytes, 1):
            raise BadArgument(
                f"copy engine: staging_bytes must be an int >= 1, got {staging_bytes!r}"
            )
        if not whole(batch_polls, 1):
            raise BadArgument(f"copy engine: batch_polls must be an int >= 1, got {batch_polls!r}")
        if streams is not None and not isinstance(streams, Streams):
            raise BadArgument(
                "copy engine: streams must provide new_stream, current_stream, new_event, "
                f"run_on and synchronize (a Streams), got {type(streams).__name__}"
            )
        check_stream("compute_stream", compute_stream, device.device)
        self.device = device
        self.host = host
        self.stats = CopyStats()
        self.cuda = device.device.type == "cuda"
        self.closed = False
        self._page_bytes = device.layout.page_bytes
        self._chunk = max(1, staging_bytes // self._page_bytes)
        self._ids = itertools.count(1)
        self._started = 0
        self._pending: dict[int, Ticket] = {}  # started and not reported, in start order
        # Taken from _submitted, returned once the poisons below are done: a poll that a
        # poison interrupts (a KeyboardInterrupt) leaves them to the next one.
        self._unreported: list[Completion] = []
        self._unpoisoned: list[Ticket] = []  # failed backups whose host pages are not poisoned
        self._submitted: list[_Submission] = []  # launched and not reported, in launch order
        self._open: list[Ticket] = []  # started, not yet submitted, in start order
        self._open_pages = 0
        self._batch_polls = batch_polls
        self._open_polls = 0  # polls the open batch has waited
        self._api = streams if streams is not None else CudaStreams() if self.cuda else None
        self._busy = BusyPages(writes=self._api is not None)
        self._compute = cast("Stream | None", compute_stream)
        self._consumers: list[Stream] = []  # streams given to wait(): they read the device pages
        self._mover = Mover(device, host, self._chunk, self._api)
        # Runs nothing: each start makes it wait for the compute streams as they stand then, and
        # each submission waits for it, so a copy follows the compute queued before its start.
        self._after = None if self._api is None else self._api.new_stream(device.device)
        # Holds the mover (the pools' memory, the staging buffers, the streams), not the engine.
        self._finalizer = weakref.finalize(self, _abandoned, repr(self), self._pending, self._mover)

    def __repr__(self) -> str:
        streams = "synchronous" if self._api is None else type(self._api).__name__
        return (
            f"CopyEngine({self.device.num_pages} device pages on {self.device.device}, "
            f"{self.host.num_pages} host pages, {streams})"
        )

    def start_write(
        self,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
        *,
        stream: object | None = None,
    ) -> Ticket:
        """Start copying ``device_pages`` into ``host_pages``; see :class:`Copier`.

        The copy joins the open batch, submitted at the next poll, drain, wait
        or load, or once the batch fills a staging buffer. On streams it reads
        the pages only after the work queued so far on ``stream`` (None: the
        engine's ``compute_stream``, else the current stream) and on every
        stream given to :meth:`wait`, whenever it is submitted.

        Raises:
            BadArgument: the pages are not sequences (an array or a tensor of
                pages is not one: pass a list), the lists differ in
                length, a destination repeats, a destination is busy with
                an unreported copy (also a ValueError, as these were), or
                ``stream`` is not a stream (or one of another GPU).
            NotASlot: a page is not an int (a bool, a float); a numpy
                integer is the page it stands for, as the allocator takes it.
            ForeignSlot: a page is outside its pool.
            CopyFailed: the engine is closed, or the device failed while the
                copy was being ordered after compute (nothing is started).
        """
        ticket = self._start(Direction.D2H, device_pages, host_pages, stream)
        if self._open_pages >= self._chunk:
            self._submit_started(ticket)
        return ticket

    def start_load(
        self,
        host_pages: Sequence[int],
        device_pages: Sequence[int],
        *,
        stream: object | None = None,
    ) -> Ticket:
        """Start copying ``host_pages`` into ``device_pages``; see :class:`Copier`.

        Submitted at once, with the open batch before it. On streams it
        overwrites the pages only after the work queued so far on ``stream``
        (as for :meth:`start_write`) and on every stream given to :meth:`wait`.

        Raises:
            BadArgument: the pages are not sequences (an array or a tensor of
                pages is not one: pass a list), the lists differ in
                length, a destination repeats, a destination is busy with
                an unreported copy (also a ValueError, as these were), or
                ``stream`` is not a stream (or one of another GPU).
            NotASlot: a page is not an int (a bool, a float); a numpy
                integer is the page it stands for, as the allocator takes it.
            ForeignSlot: a page is outside its pool.
            CopyFailed: the engine is closed, or the device failed while the
                copy was being ordered after compute (nothing is started).
        """
        ticket = self._start(Direction.H2D, host_pages, device_pages, stream)
        self._submit_started(ticket)
        return ticket

    def _submit_started(self, ticket: Ticket) -> None:
        """Submit the open batch from a ``start_*`` that started ``ticket``.

        An interrupt (a ``KeyboardInterrupt``) raised while it is submitted
        takes ``ticket`` back before it goes on: a start that raises started
        nothing, so the caller, which never got the ticket, fails its copy
        itself. The other tickets of the batch stay, failed, to be reported.
        """
        try:
            self.submit()
        except BaseException:
            self._withdraw(ticket)
            raise

    def _withdraw(self, ticket: Ticket) -> None:
        """Forget ``ticket`` as if never started, once what its launch queued has run."""
        stream = self._mover.streams.get(ticket.direction)
        if stream is not None:  # its pages go back to the caller, who may hand them out again
            with contextlib.suppress(RuntimeError):  # a broken device runs nothing more
                stream.synchronize()
        del self._pending[ticket.id]
        self._busy.remove(ticket)
        for at, submission in enumerate(self._submitted):
            if ticket in submission.tickets:
                rest = [t for t in submission.tickets if t is not ticket]
                if rest:
                    submission.tickets = rest
                else:
                    del self._submitted[at]
                return

    def _start(
        self, direction: Direction, src: Sequence[int], dst: Sequence[int], stream: object | None
    ) -> Ticket:
        if self.closed:
            raise CopyFailed(f"copy engine closed: {direction.value} copy refused")
        src, dst, runs = self._validate(direction, src, dst)
        check_stream("stream", stream, self.device.device)  # on CPU too: a slip shows here
        if self._api is not None:
            try:
                self._mark(cast("Stream | None", stream))
            except RuntimeError as exc:  # a broken device: nothing is started
                raise CopyFailed(
                    f"copy engine: {direction.value} copy refused: "
                    f"cannot order it after compute: {exc}"
                ) from exc
        ticket = Ticket(next(self._ids), direction, tuple(src), tuple(dst), runs)
        self._started = ticket.id
        self._pending[ticket.id] = ticket
        self._busy.add(ticket)
        self._open.append(ticket)
        self._open_pages += len(src)
        return ticket

    def _validate(
        self, direction: Direction, src: Sequence[int], dst: Sequence[int]
    ) -> tuple[Sequence[int], Sequence[int], tuple[int | None, int | None]]:
        """Refuse a copy that cannot run, in C where nothing is wrong (the common case).

        Returns ``src`` and ``dst`` as ints (:meth:`~fsm_cache.memory.kv.KVPool.check_pages`:
        a numpy integer becomes its int), and the first page of each where it is one run of
        its pool's pages (:meth:`~fsm_cache.memory.pages.PageAllocator.run_of`), for the ticket.
        """
        for pages in (src, dst):
            if type(pages) is not list and type(pages) is not tuple and not _ordered(pages):
                # an iterator or a set has no order to pair pages by, or is read once; an
                # array or a tensor of pages is no sequence of pages (and has no truth value)
                raise BadArgument(
                    f"copy: pages must be a sequence (a list or tuple), got {type(pages).__name__}"
                )
        lengths = len(src), len(dst)
        if lengths[0] != lengths[1]:
            raise BadArgument(f"copy: {lengths[0]} source pages but {lengths[1]} destination pages")
        if direction is Direction.D2H:
            source, target, busy = self.device, self.host, self._busy.host
        else:
            source, target, busy = self.host, self.device, self._busy.device
        # a run of a pool's pages (the common case) is distinct and inside it: nothing more to check
        src_run, dst_run = source.allocator.run_of(src), target.allocator.run_of(dst)
        if src_run is None:
            src = source.check_pages(src)
        if dst_run is None:
            dst = target.check_pages(dst)
            if len(set(dst)) != len(dst):
                raise BadArgument("copy: a destination page is listed twice")
        if not busy.isdisjoint(dst, dst_run):
            refuse_busy_destination(direction, dst, busy)
        return src, dst, (src_run, dst_run)

    def _mark(self, stream: Stream | None) -> None:
        """Make the ordering stream wait for each compute stream's work queued so far.

        The point a copy must follow is taken when it starts: an event
        recorded on each compute stream now, which the ordering stream waits
        on, and a submission waits for the ordering stream. Never blocks the
        host; on CUDA a stream's wait holds the event as it was recorded.
        """
        api, after = self._api, self._after
        assert api is not None  # streams only
        assert after is not None
        compute = self._compute
        producer = stream if stream is not None else compute
        if producer is None:
            producer = api.current_stream(self.device.device)
        after.wait_stream(producer)
        if compute is not None and compute != producer:  # a stream= adds to it, never replaces it
            after.wait_stream(compute)
        for consumer in self._consumers:
            if consumer != producer:
                after.wait_stream(consumer)

    @property
    def compute_stream(self) -> object | None:
        """The stream this engine orders its copies after (``compute_stream``), or None.

        The cache reads it from here (:class:`~fsm_cache.memory.tiers.Tiers`),
        so the KV it writes itself goes on the stream the copies wait for,
        however the engine was built.
        """
        return self._compute

    def submit(self) -> None:
        """Move the open batch now: one submission per direction, in start order.

        Never blocks on CUDA (the copies are queued on the side streams); on a
        CPU engine the copies run here. A submission that fails to queue fails
        every ticket in it. An interrupt (a ``KeyboardInterrupt``) raised
        while one is launched fails it, and every submission after it, which
        is not launched, and then goes on: each ticket is still reported.
        """
        if not self._open:
            return
        tickets, self._open, self._open_pages, self._open_polls = self._open, [], 0, 0
        groups, lo = [], 0
        for hi in range(1, len(tickets) + 1):  # consecutive tickets of one direction together
            if hi == len(tickets) or tickets[hi].direction is not tickets[lo].direction:
                groups.append(tickets[lo:hi])
                lo = hi
        for at, group in enumerate(groups):
            try:
                self._launch(group)
            except BaseException as exc:  # an interrupt: _launch failed its own group
                for rest in groups[at + 1 :]:
                    why = _launch_failure(rest[0].direction, exc)
                    self._submitted.append(_Submission(rest, None, why))
                raise

    def _launch(self, tickets: Sequence[Ticket]) -> None:
        direction, runs = tickets[0].direction, tickets[0].runs
        if len(tickets) == 1:
            src: Sequence[int] = tickets[0].src_pages
            dst: Sequence[int] = tickets[0].dst_pages
        else:
            src = list(chain.from_iterable(t.src_pages for t in tickets))
            dst = list(chain.from_iterable(t.dst_pages for t in tickets))
            runs = None
        stream = self._mover.streams.get(direction)
        why, ordered = None, False
        interrupt: BaseException | None = None  # raised on once the submission is tracked
        try:
            if stream is not None and self._after is not None:
                # D2H: read only what compute had written when the copy started. H2D: overwrite
                # only what compute had read then.
                stream.wait_stream(self._after)
                self._after_writes(direction, stream, src, runs[0] if runs is not None else None)
            ordered = True
            self._mover.move(direction, src, dst, runs)
        except BaseException as exc:  # any failure to launch fails the tickets; none is left busy
            why = _launch_failure(direction, exc)
            interrupt = None if isinstance(exc, Exception) else exc
            if ordered:  # else nothing was queued, and a fill could overtake compute's reads
                self._poison_loads(tickets, stream)
        event = None
        try:
            event = self._record(stream)
        except BaseException as exc:  # what was queued cannot be tracked: wait for it here
            why = why or _launch_failure(direction, exc)
            interrupt = interrupt or (None if isinstance(exc, Exception) else exc)
            if stream is not None:
                with contextlib.suppress(RuntimeError):  # a broken device runs nothing more
                    stream.synchronize()
        self._submitted.append(_Submission(tickets, event, why))
        if interrupt is not None:  # a KeyboardInterrupt: the tickets fail, and it goes on
            raise interrupt

    def _after_writes(
        self, direction: Direction, stream: Stream, src: Sequence[int], first: int | None
    ) -> None:
        """Make ``stream`` wait for the other direction where it reads a page that one writes.

        A load from host pages a backup still writes, or a backup of device
        pages a load still writes, reads them only after that copy (read
        after write): copies run in the order they were started. The other
        direction's stream holds the second stage of each of its batches,
        where its destination pages are written. ``first``: ``src[0]`` where
        ``src`` is one run of its pool (as the ticket found it), else None.
        """
        other = Direction.H2D if direction is Direction.D2H else Direction.D2H
        written = self._busy.written
        if written is not None and not written[other].isdisjoint(src, first):
            stream.wait_stream(self._mover.streams[other])

    def _record(self, stream: Stream | None) -> Event | None:
        if stream is None or self._api is None:
            return None
        event = self._api.new_event()
        event.record(stream)
        return event

    def poll(self) -> list[Completion]:
        """Submit the open batch if due, then report every finished ticket, without blocking.

        The open batch is due at the ``batch_polls``-th poll since it opened
        (the next one by default). On a CPU engine every submitted ticket has
        finished. The tickets one poll reports are in the order they were
        started, and a ticket is never reported before one of its own direction
        started before it (an event queried after an earlier one of the same
        stream may see later work done). On streams, a ticket may be reported at
        an earlier poll than one of the other direction started before it that
        has not finished (the directions overlap, so a load need not wait for
        the backups).
        """
        if self._open:
            self._open_polls += 1
            if self._open_polls >= self._batch_polls:
                self.submit()
        submitted = self._submitted
        if not submitted:
            return self._report([]) if self._unreported else []
        done, behind = [], set()
        for s in submitted:  # one direction's events finish in order: report them in order
            direction = s.tickets[0].direction
            if direction not in behind and _finished(s):
                done.append(s)
            else:
                behind.add(direction)
        if len(done) == len(submitted):  # all of them: always so on a CPU engine
            self._submitted = []
            self._mover.release()  # nothing queued can read an outgrown staging buffer now
        else:
            self._submitted = [s for s in submitted if s not in done]
        if len(done) == 1:
            return self._report(self._complete(done[0]))
        return self._report([c for s in done for c in self._complete(s)])

    def _report(self, completions: list[Completion]) -> list[Completion]:
        """Return what earlier polls left unreported and ``completions``, once every poison is done.

        A failed backup's host pages are poisoned before its report goes out:
        the report gives them back, and a later poison would overwrite the
        KV of whoever takes them next. Should a poison be interrupted (a
        ``KeyboardInterrupt``), the reports wait for the next poll, which
        finishes the poisons first; they are not lost, or their nodes would
        stay copying for good (:meth:`poison_failed`).
        """
        self._unreported += completions
        poison_in_order(self._unpoisoned, self.poison_failed)
        out, self._unreported = self._unreported, []
        return out

    def drain(self) -> list[Completion]:
        """Submit the open batch, wait for every in-flight ticket and report them all."""
        self.submit()
        for s in self._submitted:
            if s.event is not None:
                with contextlib.suppress(RuntimeError):  # reported by _finished
                    s.event.synchronize()
        self._mover.release()  # nothing queued can read an outgrown staging buffer now
        return self.poll()

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> bool:
        """Make ``stream`` wait for these tickets' copies, without blocking the host.

        Compute that reads the pages a load writes must not start before the
        copy has landed: call this after ``start_load`` and before queueing
        that compute, instead of waiting for the acknowledgement. The open
        batch is submitted first. On CUDA the stream waits on each unreported
        ticket's event; tickets already reported are done and need nothing. On
        a CPU engine the submission ran the copies, so nothing more is needed.

        ``stream`` reads the loaded pages, so the engine keeps it among its
        compute streams: every copy started from now on is ordered after the
        work queued on it at that start, so a later load into the same pages
        (freed and handed out again) cannot overwrite them before it has read.

        Args:
            ticket_ids: Ids of tickets this engine started.
            stream: The stream to hold back; None: the engine's
                ``compute_stream``, else the device's current stream.

        Returns:
            False when a launch of one of these copies failed (the submission
            is failed, to be reported by a later :meth:`poll`): its pages will
            not hold the data, so compute must not read them. True otherwise.

        Raises:
            BadArgument: an id is not the int id of a ticket this engine started
                (also a ValueError), or ``stream`` is not a stream, or one of
                another GPU (on streams; a CPU engine only checks the ids).
        """
        ids = list(ticket_ids)
        started = self._started
        for i in ids:
            if not (whole(i, 1) and i <= started):
                raise BadArgument(f"copy: cannot wait for ticket {i!r}: no copy started with it")
        if self._api is not None:  # a CPU engine has no streams to wait: it only checks the ids
            check_stream("stream", stream, self.device.device)
        self.submit()
        wanted = set(ids)
        ours = [s for s in self._submitted if any(t.id in wanted for t in s.tickets)]
        if self._api is not None:
            target = cast("Stream | None", stream) if stream is not None else self._compute
            if target is None:
                target = self._api.current_stream(self.device.device)
            elif target != self._compute and target not in self._consumers:
                self._consumers.append(target)
                del self._consumers[:-MAX_CONSUMERS]
            for submission in ours:
                if submission.event is not None:
                    target.wait_event(submission.event)
        return all(submission.failure is None for submission in ours)

    def queue_after(self, ticket: Ticket, work: Callable[[], None]) -> None:
        """Queue ``work`` after ``ticket``'s copy, in its order: before its acknowledgement.

        ``work`` runs on the stream the copy ends on, with that stream current,
        so what it queues on the device (a fill of the pages the copy wrote,
        say) follows the copy and never goes to a compute stream. The ticket's
        event is recorded again after it: :meth:`poll` reports the ticket only
        once ``work`` has run, and a stream a later :meth:`wait` holds back for
        the ticket waits for it too. The open batch is submitted first where
        ``ticket`` is still in it. Without streams (a CPU engine) the copy has
        run already, and so does ``work``, here. Where ``work`` cannot be
        queued (or, without streams, raises), the copy's tickets fail, as a
        launch that fails does.

        Call it before any :meth:`wait` for ``ticket``: a stream already made
        to wait holds the point it waited for, which ``work`` comes after. On
        CUDA, host memory written by ``work`` is written at once, not in the
        stream's order: give it device operations.

        Args:
            ticket: An unreported ticket of this engine.
            work: What to run, as :meth:`Streams.run_on` runs a copy's stage.

        Raises:
            BadArgument: ``ticket`` is not a ticket, or not one this engine has
                yet to report; nothing is queued.
        """
        if not isinstance(ticket, Ticket):
            raise BadArgument(f"copy: queue_after takes a Ticket, got {type(ticket).__name__}")
        if self._pending.get(ticket.id) != ticket:
            raise BadArgument(
                f"copy: cannot queue work after ticket {ticket.id}: no copy of this engine "
                "with it is in flight"
            )
        if any(t.id == ticket.id for t in self._open):
            self.submit()
        submission = next(s for s in self._submitted if any(t.id == ticket.id for t in s.tickets))
        stream = self._mover.streams.get(ticket.direction)
        try:
            if stream is None or self._api is None:  # synchronous: the copy has run
                work()
                return
            self._api.run_on(stream, work)
            if submission.event is None:  # nothing to record it on: wait here, as _launch does
                stream.synchronize()
            else:
                submission.event.record(stream)
        except BaseException as exc:  # as a launch that fails: the copy's tickets fail
            if submission.failure is None:
                submission.failure = _launch_failure(ticket.direction, exc)
                self._poison_loads(submission.tickets, stream)
            if stream is not None:
                with contextlib.suppress(RuntimeError):  # a broken device runs nothing more
                    stream.synchronize()
            if not isinstance(exc, Exception):  # a KeyboardInterrupt: failed, and it goes on
                raise

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
        self._finalizer.detach()  # nothing is in flight: the memory may go with the engine
        self._mover.close()  # its views and staging buffers would keep the pools' memory

    def _complete(self, submission: _Submission) -> list[Completion]:
        """Report a finished submission's tickets: no longer busy, counted, each completed once."""
        tickets, failure = submission.tickets, submission.failure
        direction = tickets[0].direction
        for ticket in tickets:
            del self._pending[ticket.id]
            self._busy.remove(ticket)
        self.stats.copies[direction] += len(tickets)
        if failure is not None:
            self.stats.failures[direction] += len(tickets)
            if direction is Direction.D2H:  # the copy has finished: its host pages can be written
                self._unpoisoned += tickets  # before the report goes out (_report)
            return [Completion(t, CopyFailed(f"copy {t.id} {failure}")) for t in tickets]
        pages = (
            len(tickets[0].src_pages)
            if len(tickets) == 1
            else sum(len(t.src_pages) for t in tickets)
        )
        self.stats.bytes[direction] += pages * self._page_bytes
        return [Completion(t) for t in tickets]

    def poison_failed(self, ticket: Ticket) -> None:
        """Poison a failed backup's host pages before its report goes out; count a poison that raises.

        The report is what frees the copy's nodes, so it must go out whatever
        the poison does: an ``Exception`` from it is counted
        (``stats.poison_failures``) and given up, and the pages are given back
        unread either way.
        """
        try:
            self.poison_destination(ticket)
        except Exception:
            self.stats.poison_failures[ticket.direction] += 1

    def poison_destination(self, ticket: Ticket) -> None:
        """Overwrite every byte of ``ticket``'s destination pages with :data:`POISON`.

        What the engine does to the destination of a copy that failed, so a
        cache never takes what a half-done copy left for KV: a load's device
        pages when its launch fails (in the copy's order, on its stream), a
        backup's host pages when its failure is reported. A copy that fails on
        the device (an asynchronous CUDA error, found by :meth:`poll`) leaves
        its device pages as they are: a broken device runs nothing more.
        :class:`~fsm_cache.testing.faults.FaultyCopyEngine` poisons the copies
        it fails through here too.

        A load's device pages are filled by device operations queued on the
        current stream: call it on the copy's stream, after the copy
        (:meth:`queue_after`), or once the copy is reported. A backup's host
        pages are written at once, in host memory, not in a stream's order:
        call it once the copy is reported.

        Raises:
            BadArgument: ``ticket`` is not a :class:`Ticket`; nothing is written.
            ForeignSlot: a destination page is outside its pool; nothing is written.
        """
        if not isinstance(ticket, Ticket):
            raise BadArgument(
                f"copy: poison_destination takes a Ticket, got {type(ticket).__name__}"
            )
        pool = self.host if ticket.direction is Direction.D2H else self.device
        pool.fill(ticket.dst_pages, POISON)

    def _poison_loads(self, tickets: Sequence[Ticket], stream: Stream | None) -> None:
        """Poison the device pages of the failed loads ``tickets``, after what their copy queued.

        Queued on ``stream``, the one their batch's event is recorded on, so
        the event covers the fill and a stream made to wait for the loads reads
        the poison. A backup's host pages wait for its report (:meth:`_complete`).
        """
        if tickets[0].direction is not Direction.H2D:
            return
        work = partial(_poison_each, self, tickets)
        with contextlib.suppress(RuntimeError):  # a broken device writes nothing more
            if stream is None or self._api is None:
                work()
            else:
                self._api.run_on(stream, work)

    def in_flight(self) -> list[Ticket]:
        """Tickets started and not yet reported, oldest first."""
        if self._unreported:  # finished, their report held back by an interrupted poll
            held = [c.ticket for c in self._unreported]
            return sorted([*held, *self._pending.values()], key=lambda t: t.id)
        return list(self._pending.values())

    def device_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these device pages."""
        return _busy(self._busy.device, self.device, pages)

    def host_busy(self, pages: Iterable[int]) -> bool:
        """Whether an unreported copy reads or writes any of these host pages."""
        return _busy(self._busy.host, self.host, pages)

    def busy_device_pages(self) -> frozenset[int]:
        """Every device page an unreported copy touches."""
        return self._busy.device.frozen()

    def busy_host_pages(self) -> frozenset[int]:
        """Every host page an unreported copy touches."""
        return self._busy.host.frozen()


def _check_pools(device_pool: object, host_pool: object) -> None:
    """Refuse a pair of pools the engine cannot copy between; see :class:`CopyEngine`.

    A CUDA device pool with a pageable host pool is taken, with a warning:
    each copy then blocks the host, which defeats a non-blocking scheduler
    but moves the right bytes.

    Raises:
        BadArgument: naming what is wrong and, for a layout mismatch, both layouts.
    """
    device, host = _pool_of("device", device_pool), _pool_of("host", host_pool)
    if host.device.type != "cpu":
        raise BadArgument(f"copy engine: the host pool must be on the CPU, got {host.device}")
    if device.device.type not in {"cpu", "cuda"}:
        raise BadArgument(
            f"copy engine: the device pool must be on cpu or cuda, got {device.device}"
        )
    if device.layout != host.layout:
        raise BadArgument(
            f"copy engine: the device pool's layout {device.layout} "
            f"({device.layout.page_bytes} bytes a page) differs from the host pool's "
            f"{host.layout} ({host.layout.page_bytes} bytes a page)"
        )
    if device.device.type == "cuda" and not host.tensor.is_pinned():  # CUDA only
        warnings.warn(
            f"copy engine: the host pool ({host.num_pages} pages) is not pinned, so every copy "
            f"between it and {device.device} blocks the host in submit() and poll(); "
            "allocate it with host_pool(..., pin=True), as Tiers does",
            RuntimeWarning,
            stacklevel=3,
        )


MAX_CONSUMERS = 8
"""The most streams given to :meth:`CopyEngine.wait` that each copy start follows: the latest.

A serving engine reads the pool on one or two streams; a caller handing in a
new stream object each step would otherwise make every start wait for all of
them, for ever."""


def check_stream(name: str, stream: object, device: object = None) -> None:
    """Refuse ``stream`` unless it can be waited on and recorded on, as a stream can.

    None passes (no stream given). Public so that whoever hands a stream on to
    an engine it builds later (:class:`~fsm_cache.memory.tiers.Tiers`) can
    refuse it before taking any memory, with the engine's own message.

    Args:
        name: The argument's name, for the message.
        stream: What was given.
        device: The device pool's ``torch.device``, or None. A CUDA stream
            of another GPU is refused: waiting on it would order nothing on
            this one (its kernels run on this GPU's current stream).

    Raises:
        BadArgument: naming the argument and what was given.
    """
    if stream is None:
        return
    if not (
        callable(getattr(stream, "wait_event", None))
        and callable(getattr(stream, "wait_stream", None))
    ):
        raise BadArgument(
            f"copy engine: {name} must be a stream (torch.cuda.Stream or the Streams' own), "
            f"got {type(stream).__name__}"
        )
    on = getattr(stream, "device", None)
    if (
        getattr(device, "type", None) == "cuda"
        and getattr(on, "type", None) == "cuda"
        and getattr(device, "index", None) is not None
        and getattr(on, "index", None) != getattr(device, "index", None)
    ):
        raise BadArgument(
            f"copy engine: {name} is a stream of {on}, but the device pool is on {device}: "
            "give a stream of the pool's GPU"
        )


def _ordered(pages: object) -> bool:
    """Whether ``pages`` is a sequence a copy can read its pages from, by position, twice.

    A :class:`~collections.abc.Sequence` that is no text: not an iterator
    (read once), a set (no order), a single page, a numpy array or a tensor
    (no ``Sequence``, and no truth value), nor a ``str`` or ``bytes`` (whose
    items are characters or bytes).
    """
    return isinstance(pages, Sequence) and not isinstance(pages, (str, bytes, bytearray))


def engine_of(copier: object) -> CopyEngine | None:
    """Return the :class:`CopyEngine` that ``copier`` is, or wraps; None if it is neither.

    A wrapper (:class:`~fsm_cache.testing.faults.FaultyCopyEngine`, a user's)
    names the engine it wraps ``inner``, which may be a wrapper in turn: the
    chain is followed to the engine that moves the bytes. The cache asks this
    to check a ``CacheConfig(copier=...)`` factory's engine
    (:class:`~fsm_cache.memory.tiers.Tiers`).
    """
    seen: set[int] = set()
    while not isinstance(copier, CopyEngine):
        if id(copier) in seen:  # a wrapper that wraps itself, maybe through others
            return None
        seen.add(id(copier))
        copier = getattr(copier, "inner", None)
        if copier is None:
            return None
    return copier


def _pool_of(name: str, pool: object) -> KVPool:
    """``pool``, if it is a :class:`KVPool` made as the ``name`` pool (its layout depends on it)."""
    if not isinstance(pool, KVPool):
        raise BadArgument(f"copy engine: {name} must be a KVPool, got {type(pool).__name__}")
    if pool.name != name:
        raise BadArgument(f"copy engine: {name} must be the {name} pool, got the {pool.name} pool")
    return pool


def _abandoned(engine: str, pending: dict[int, Ticket], mover: Mover) -> None:
    """The finalizer of an engine dropped unclosed: wait for its copies before memory goes.

    ``mover`` holds the pools' memory and the staging buffers, so none of it
    can be freed before the queued copies that use it have run. A synchronous
    engine (no streams) has nothing running: its unreported copies either ran
    or never will, and it goes quietly.
    """
    if not pending or not mover.streams:
        return
    with contextlib.suppress(RuntimeError):  # a broken device runs nothing more
        mover.synchronize()
    warnings.warn(
        f"unclosed {engine} dropped with {len(pending)} copies in flight: waited for them; "
        "call close() before dropping it",
        ResourceWarning,
        stacklevel=2,
    )


def _busy(busy: PageSet, pool: KVPool, pages: Iterable[int]) -> bool:
    """Whether ``busy`` holds any of ``pages``; a run of the pool's pages is tested as one."""
    if not busy:
        return False
    first = pool.allocator.run_of(pages) if isinstance(pages, (list, tuple)) else None
    return not busy.isdisjoint(pages, first)


def poison_in_order(pending: list[Ticket], poison: Callable[[Ticket], None]) -> None:
    """Poison each of ``pending`` in order, taking a ticket off only once its poison returned.

    A poison interrupted (a ``KeyboardInterrupt``) leaves that ticket and the
    rest in ``pending`` for the next call: an engine reports the copies only
    after this returns, so none is reported before its pages are poisoned.
    """
    while pending:
        poison(pending[0])
        del pending[0]


def _poison_each(engine: CopyEngine, tickets: Sequence[Ticket]) -> None:
    """Poison the destination of each of ``tickets`` (:meth:`CopyEngine.poison_destination`)."""
    for ticket in tickets:
        engine.poison_destination(ticket)


def _launch_failure(direction: Direction, exc: BaseException) -> str:
    """Return why a submission failed to launch, as its tickets' :class:`CopyFailed` says it."""
    kind = "" if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: "
    return f"({direction.value}) failed: {kind}{exc}"


def _finished(submission: _Submission) -> bool:
    """Query the event; an asynchronous CUDA error fails every ticket of the submission."""
    if submission.event is None:
        return True
    try:
        return bool(submission.event.query())
    except RuntimeError as exc:
        submission.failure = f"failed on the device: {exc}"
        return True
