"""A CPU fake of CUDA streams and events, so the copy engine's ordering logic runs anywhere.

On a CPU pool :class:`~fsm_cache.memory.copies.CopyEngine` copies synchronously
and never touches a stream or an event; its CUDA path (side streams that wait
for compute, an event per batch, ``poll`` querying events, ``drain``,
``wait``) only runs on a GPU. :class:`FakeStreams` plugs into the engine's
``streams=`` and makes it take that path on CPU tensors, with one difference
from a GPU that makes ordering bugs visible: nothing queued on a fake stream
happens until something needs it. A copy's effect, source read and
destination write alike, lands only when its event completes, which is after
a seeded random ``0..max_polls`` queries, or at once on ``synchronize``. So:

* reading a copy's destination before its acknowledgement shows stale bytes;
* a source page overwritten (freed and reused) before the acknowledgement is
  what the copy reads, so the destination visibly gets the wrong data;
* a stream made to wait on an event (``wait_stream``, ``wait_event``, the
  engine's :meth:`~fsm_cache.memory.copies.CopyEngine.wait`) runs its later
  work only after that event's work, and work queued on the compute stream
  (:meth:`FakeStreams.current_stream`, :meth:`FakeStream.enqueue`) runs before
  any copy started after it.

Work that raises makes the next event recorded on its stream raise
``RuntimeError`` when queried or synchronised, as an asynchronous CUDA error
does, and so does the next event of every stream made to wait for that work
(on CUDA such an error poisons everything after it); the engine turns that
into a failed completion.

What it cannot show: work queued on two streams runs in the order it was
queued, so a race between a direction's two streams over a staging buffer (a
``wait_stream`` left out) moves every byte right here and corrupts on a GPU;
a stream waits for an event object, not for the point it was recorded at, so
waiting and then recording the event again (which CUDA would not wait for)
looks the same as waiting for the later point; and :meth:`FakeStreams.synchronize`
waits for the engine's streams, not for streams the caller made. Those orders
are tested on a GPU (``tests/test_gpu.py``, ``scripts/gpu_check.sh``).

For a whole cache::

    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.memory.tiers import CacheConfig
    from fsm_cache.testing.fakecuda import deferred_copier

    cache = HiCache(CacheConfig(device="cpu", copier=deferred_copier(seed=3, max_polls=4)))
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsm_cache.memory.copies import CopyEngine, Stream
from fsm_cache.memory.kv import KVPool


__all__ = ["FakeEvent", "FakeStream", "FakeStreams", "deferred_copier"]


class FakeEvent:
    """A stand-in for ``torch.cuda.Event``: completes after a few queries, or when forced.

    Args:
        polls: How many queries a recording stays incomplete for: a number, or
            a function drawn from once per :meth:`record` (seeded randomness).

    Attributes:
        queries: Every :meth:`query` so far, answered or not.
        done: Whether the work before the last recording has run.
    """

    def __init__(self, polls: int | Callable[[], int] = 0) -> None:
        self._polls = polls
        self._stream: FakeStream | None = None
        self._generation = 0
        self._left = 0
        self._error: BaseException | None = None
        self.queries = 0
        self.done = True  # an event never recorded counts as complete, as on CUDA

    def record(self, stream: FakeStream) -> None:
        """Mark the point after the work queued so far on ``stream``."""
        self._generation += 1
        self._stream = stream
        self._left = self._polls() if callable(self._polls) else self._polls
        self._error = None
        self.done = False
        stream.mark(self, self._generation)

    def reached(self, generation: int, error: BaseException | None) -> None:
        """Called by the stream when its work reaches this event's mark (``generation``)."""
        if generation == self._generation:
            self.done = True
            self._error = error

    def query(self) -> bool:
        """Whether the work before the mark has run; counts down first, never blocks.

        Raises:
            RuntimeError: work before the mark raised (an asynchronous error).
        """
        self.queries += 1
        if not self.done and self._left > 0:
            self._left -= 1
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        """Run the work before the mark now.

        Raises:
            RuntimeError: work before the mark raised (an asynchronous error).
        """
        if not self.done and self._stream is not None:
            self._stream.run_through(self)
        if self._error is not None:
            raise RuntimeError(f"fake CUDA error in queued work: {self._error}") from self._error


@dataclass
class _Op:
    work: Callable[[], None] | None = None
    mark: FakeEvent | None = None
    generation: int = 0
    wait: FakeEvent | None = None


class FakeStream:
    """A stand-in for ``torch.cuda.Stream``: a queue of work run only when needed.

    Args:
        device: The device it belongs to (CPU tensors are fine).
        name: For messages and ``repr``.
    """

    def __init__(self, device: torch.device, name: str = "stream") -> None:
        self.device = device
        self.name = name
        self._ops: deque[_Op] = deque()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r} on {self.device}, {len(self._ops)} queued)"

    @property
    def pending(self) -> int:
        """Operations queued and not yet run (work, marks and waits)."""
        return len(self._ops)

    def enqueue(self, work: Callable[[], None]) -> None:
        """Queue ``work`` (a kernel launch); it runs when the stream is driven past it."""
        self._ops.append(_Op(work=work))

    def mark(self, event: FakeEvent, generation: int) -> None:
        """Queue ``event``'s mark (called by :meth:`FakeEvent.record`)."""
        if not self._ops:  # an idle stream reaches the mark at once
            event.reached(generation, self._take_error())
            return
        self._ops.append(_Op(mark=event, generation=generation))

    def wait_event(self, event: FakeEvent) -> None:
        """Make later work here wait for ``event``'s work; never blocks the host."""
        if not event.done:
            self._ops.append(_Op(wait=event))

    def wait_stream(self, stream: FakeStream) -> None:
        """Make later work here wait for the work queued so far on ``stream``."""
        if stream is not self:
            event = FakeEvent()
            event.record(stream)
            self.wait_event(event)

    def query(self) -> bool:
        """Whether nothing is queued."""
        return not self._ops

    def synchronize(self) -> None:
        """Run everything queued."""
        while self._ops:
            self._step()

    def run_through(self, event: FakeEvent) -> None:
        """Run queued operations until ``event``'s mark has been reached."""
        while self._ops and not event.done:
            self._step()

    def _step(self) -> None:
        op = self._ops.popleft()
        if op.wait is not None:
            try:
                op.wait.synchronize()
            except RuntimeError as exc:  # work after failed work fails too, as on CUDA
                self._error = self._error or exc.__cause__ or exc
        elif op.mark is not None:
            op.mark.reached(op.generation, self._take_error())
        elif op.work is not None:
            try:
                op.work()
            except Exception as exc:  # surfaces at the next event, as on CUDA
                self._error = self._error or exc

    def _take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error


class FakeStreams:
    """The fake's :class:`~fsm_cache.memory.copies.Streams`: pass it as ``CopyEngine(streams=)``.

    Args:
        seed: Seed of the polls each event stays incomplete for.
        max_polls: Most queries an event stays incomplete for (each draws
            ``0..max_polls``); 0 completes every event at its first query.

    Attributes:
        streams: Every side stream made, in order (the engine's: ``d2h``, ``h2d``).
        events: Every event made by :meth:`new_event`, in order: one per copy
            started, so ``events[i]`` is ticket ``i + 1``'s.
    """

    def __init__(self, seed: int = 0, max_polls: int = 3) -> None:
        self.max_polls = max_polls
        self._rng = random.Random(seed)
        self._names = itertools.count()
        self._current: dict[str, FakeStream] = {}
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []

    def new_stream(self, device: torch.device) -> FakeStream:
        """Return a new side stream on ``device``."""
        stream = FakeStream(device, f"side {next(self._names)}")
        self.streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        """Return ``device``'s compute stream (one per device, made on first use)."""
        key = str(device)
        if key not in self._current:
            self._current[key] = FakeStream(device, f"compute {key}")
        return self._current[key]

    def new_event(self) -> FakeEvent:
        """Return an event that stays incomplete for a seeded random ``0..max_polls`` queries."""
        event = FakeEvent(lambda: self._rng.randint(0, self.max_polls))
        self.events.append(event)
        return event

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        """Queue ``work`` on ``stream`` (a :class:`FakeStream`) instead of running it.

        Raises:
            TypeError: ``stream`` is not a :class:`FakeStream`.
        """
        if not isinstance(stream, FakeStream):
            raise TypeError(f"fake streams queue work on a FakeStream, got {stream!r}")
        stream.enqueue(work)

    def synchronize(self, device: torch.device) -> None:
        """Run everything queued on ``device``'s streams, compute included."""
        mine = [*self.streams, *self._current.values()]
        for stream in (s for s in mine if s.device == device):
            stream.synchronize()


def deferred_copier(
    seed: int = 0,
    max_polls: int = 3,
    *,
    staging_bytes: int = 256 << 20,
    streams: FakeStreams | None = None,
) -> Callable[[KVPool, KVPool], CopyEngine]:
    """Return a ``CacheConfig(copier=...)`` factory: a copy engine on fake CUDA streams.

    Args:
        seed: Seed of how long each copy stays in flight.
        max_polls: Most polls a copy stays in flight for.
        staging_bytes: The engine's ``staging_bytes``.
        streams: The fake to use (to reach its streams and events from a
            test); a new ``FakeStreams(seed, max_polls)`` per engine when None.
    """

    def make(device: KVPool, host: KVPool) -> CopyEngine:
        fake = streams if streams is not None else FakeStreams(seed, max_polls)
        return CopyEngine(device, host, staging_bytes, streams=fake)

    return make
