"""Test helpers for users of fsm_cache: a fault-injecting copy engine.

:class:`FaultyCopyEngine` wraps a :class:`~fsm_cache.memory.copies.CopyEngine` and
keeps its interface (:class:`~fsm_cache.memory.copies.Copier`), so a cache under test
cannot tell it apart, except that it can:

* fail chosen copies (counted from 1 in start order): the copy runs, its
  completion carries a :class:`~fsm_cache.errors.CopyFailed`, and its
  destination pages are poisoned with ``0xFF`` bytes as a half-done copy would
  leave them (:meth:`~fsm_cache.memory.copies.CopyEngine.poison_destination`,
  as the plain engine poisons a copy whose launch failed): a
  load's device pages in the copy's own order, on its stream
  (:meth:`~fsm_cache.memory.copies.CopyEngine.queue_after`), so compute made to
  wait for the load reads the poison; a backup's host pages when its failure
  is delivered (on CUDA a write to host memory cannot be queued behind a copy);
* refuse chosen copies at start, raising :class:`CopyFailed` with nothing started;
* hold every acknowledgement back for ``delay`` extra polls;
* deliver the acknowledgements of one poll in a seeded random order.

Pages stay busy until their ticket is delivered, so early frees stay visible.
:meth:`FaultyCopyEngine.copier` builds the ``CacheConfig(copier=...)`` factory
that wraps each new cache's engine, built by the engine factory it is given
(``engine=``: ``CopyEngine`` by default; a ``functools.partial`` of it with
its options, or :func:`~fsm_cache.testing.fakecuda.deferred_copier`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from fsm_cache.errors import BadArgument, CopyFailed
from fsm_cache.memory.copies import POISON, CopyEngine, poison_in_order
from fsm_cache.memory.tickets import Completion, Direction, Ticket, refuse_busy_destination
from fsm_cache.numeric import whole


if TYPE_CHECKING:  # Self and Unpack are Python 3.11's; annotations only, so 3.10 imports this
    from typing_extensions import Self, Unpack

    from fsm_cache.memory.kv import KVPool


__all__ = ["POISON", "Faults", "FaultyCopyEngine"]  # POISON: the engine's, named here as before


class Faults(TypedDict, total=False):
    """The keyword arguments of :class:`FaultyCopyEngine` after ``inner``, all optional.

    They type :meth:`FaultyCopyEngine.copier`'s ``**faults``; what each means,
    and its default, is the engine's to say.
    """

    fail: Collection[int]
    refuse: Collection[int]
    delay: int
    shuffle: bool
    seed: int
    poison: bool


def _positions(name: str, value: object) -> frozenset[int]:
    """Return ``value``, copy positions counted from 1, as a frozenset.

    Raises:
        BadArgument: ``value`` is not a collection (a lone int, a string), or
            holds something other than an int >= 1 (a bool, 0: no copy has it).
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise BadArgument(
            f"FaultyCopyEngine: {name} must be a collection of copy positions (ints >= 1), "
            f"got {value!r}"
        )
    for item in value:
        if not whole(item, 1):
            raise BadArgument(
                f"FaultyCopyEngine: {name} holds {item!r}; copies are counted from 1 (ints >= 1)"
            )
    return frozenset(value)


def _checked(faults: Mapping[str, object]) -> None:
    """Refuse fault settings (:class:`Faults`) of the wrong type or value, naming setting and value.

    Raises:
        BadArgument: A setting outside what :class:`FaultyCopyEngine` documents.
    """
    for name, value in faults.items():
        if name in ("fail", "refuse"):
            _positions(name, value)
        elif name == "delay" and not whole(value):
            raise BadArgument(f"FaultyCopyEngine: delay must be an int >= 0, got {value!r}")
        elif name == "seed" and not whole(value, None):
            raise BadArgument(f"FaultyCopyEngine: seed must be an int, got {value!r}")
        elif name in ("shuffle", "poison") and not isinstance(value, bool):
            raise BadArgument(f"FaultyCopyEngine: {name} must be a bool, got {value!r}")


@dataclass
class _Held:
    completion: Completion
    polls_left: int


class FaultyCopyEngine:
    """A :class:`CopyEngine` with injected failures, delays and reordering.

    Args:
        inner: The engine that really copies.
        fail: 1-based positions of copies whose completion reports failure.
        refuse: 1-based positions of copies whose start raises ``CopyFailed``.
        delay: Polls each acknowledgement is held back after the copy finished.
        shuffle: Deliver each poll's acknowledgements in a random order.
        seed: Seed of that order, for reproducible tests.
        poison: Overwrite the destination of the copies it fails with ``POISON``
            (those the inner engine fails itself are poisoned whatever this says).

    Raises:
        BadArgument: A setting of the wrong type or value (``fail=3``, a
            negative ``delay``, a ``seed`` that is no int), naming it.
    """

    def __init__(
        self,
        inner: CopyEngine,
        *,
        fail: Collection[int] = (),
        refuse: Collection[int] = (),
        delay: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        poison: bool = True,
    ) -> None:
        _checked(
            {
                "fail": fail,
                "refuse": refuse,
                "delay": delay,
                "shuffle": shuffle,
                "seed": seed,
                "poison": poison,
            }
        )
        self.inner = inner
        self.fail = frozenset(fail)
        self.refuse = frozenset(refuse)
        self.delay = delay
        self.shuffle = shuffle
        self.poison = poison
        self.started = 0
        self._rng = random.Random(seed)
        self._doomed: dict[int, int] = {}
        self._held: list[_Held] = []
        self._unpoisoned: list[Ticket] = []  # failed backups to poison before their delivery

    @classmethod
    def copier(
        cls,
        *,
        engine: Callable[[KVPool, KVPool], CopyEngine] = CopyEngine,
        **faults: Unpack[Faults],
    ) -> Callable[[KVPool, KVPool], Self]:
        """Return a ``CacheConfig(copier=...)`` factory: this engine over a new inner engine.

        A cache calls its copier with its two pools; each call builds a new
        engine over them with ``engine`` and wraps it with these faults, so
        caches built from one config never share an engine or its count of
        starts. ``engine`` takes whatever options the plain engine would: a
        cache's ``compute_stream``, which a copier must give its engine itself
        (``engine=functools.partial(CopyEngine, compute_stream=forward)``), or
        fake CUDA streams (``engine=deferred_copier(seed=3)``). Called on a
        subclass, it builds that subclass (whose initialiser must take the
        same arguments). The factory pickles where ``cls`` and ``engine`` do.

        Args:
            engine: Builds the engine that really copies from the device and
                host pools: any ``CacheConfig(copier=...)`` factory of a
                :class:`CopyEngine`.
            **faults: The keyword arguments of :class:`FaultyCopyEngine`
                (``fail``, ``refuse``, ``delay``, ``shuffle``, ``seed``, ``poison``).

        Raises:
            BadArgument: A keyword that is none of those, a fault setting of
                the wrong type or value, or an ``engine`` that is not
                callable, here rather than when a cache first builds its
                engine (also a TypeError, as Python's refusal of an unknown
                keyword is).
        """
        unknown = sorted(faults.keys() - Faults.__optional_keys__)
        if unknown:
            raise BadArgument(f"{cls.__name__}.copier got unknown faults: {', '.join(unknown)}")
        _checked(faults)
        if not callable(engine):
            raise BadArgument(
                f"{cls.__name__}.copier: engine must build a CopyEngine from the device and "
                f"host pools, got {type(engine).__name__}"
            )
        return functools.partial(cls._over, engine, **faults)

    @classmethod
    def _over(
        cls,
        engine: Callable[[KVPool, KVPool], CopyEngine],
        device: KVPool,
        host: KVPool,
        **faults: Unpack[Faults],
    ) -> Self:
        return cls(engine(device, host), **faults)

    def start_write(
        self,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
        *,
        stream: object | None = None,
    ) -> Ticket:
        """Start a device-to-host copy, or refuse it if its position is in ``refuse``.

        ``stream`` goes to the inner engine, which orders the copy after it
        (:meth:`CopyEngine.start_write`): a faulted run keeps the ordering of
        a plain one. A start the inner engine refuses is not counted.
        """
        return self._start(
            Direction.D2H,
            host_pages,
            lambda: self.inner.start_write(device_pages, host_pages, stream=stream),
        )

    def start_load(
        self,
        host_pages: Sequence[int],
        device_pages: Sequence[int],
        *,
        stream: object | None = None,
    ) -> Ticket:
        """Start a host-to-device copy, or refuse it if its position is in ``refuse``.

        ``stream`` goes to the inner engine, as for :meth:`start_write`.
        """
        return self._start(
            Direction.H2D,
            device_pages,
            lambda: self.inner.start_load(host_pages, device_pages, stream=stream),
        )

    def _start(
        self, direction: Direction, dst: Sequence[int], begin: Callable[[], Ticket]
    ) -> Ticket:
        """Count a start (refusing it where ``refuse`` says), ``begin`` it, and watch its ticket.

        A start the inner engine refuses is not counted: the positions of
        later copies stay as they were.
        """
        self._refuse_held(direction, dst)
        self._count_start()
        try:
            ticket = begin()
        except BaseException:
            self.started -= 1
            raise
        return self._watch(ticket)

    def _refuse_held(self, direction: Direction, dst: Sequence[int]) -> None:
        tickets = [h.completion.ticket for h in self._held]
        to_host = direction is Direction.D2H
        held = {p for t in tickets for p in (t.host_pages if to_host else t.device_pages)}
        refuse_busy_destination(direction, dst, held)

    def _count_start(self) -> None:
        self.started += 1
        if self.started in self.refuse:
            raise CopyFailed(f"injected refusal of copy {self.started}")

    def _watch(self, ticket: Ticket) -> Ticket:
        if self.started in self.fail:
            self._doomed[ticket.id] = self.started
            if self.poison and ticket.direction is Direction.H2D:  # ordered with the copy
                self.inner.queue_after(
                    ticket, functools.partial(self.inner.poison_destination, ticket)
                )
        return ticket

    @property
    def compute_stream(self) -> object | None:
        """The inner engine's compute stream (:attr:`CopyEngine.compute_stream`)."""
        return self.inner.compute_stream

    def submit(self) -> None:
        """Move the inner engine's open batch now (:meth:`CopyEngine.submit`)."""
        self.inner.submit()

    def poll(self) -> list[Completion]:
        """Report the acknowledgements whose delay has run out."""
        return self._deliver(self.inner.poll(), flush=False)

    def drain(self) -> list[Completion]:
        """Finish every copy and deliver every acknowledgement, held ones included."""
        return self._deliver(self.inner.drain(), flush=True)

    def wait(self, ticket_ids: Iterable[int], stream: object | None = None) -> bool:
        """Make ``stream`` wait for these copies (the inner engine's; held ones are done).

        False where the inner engine knows a launch failed; a failure this
        engine injects is known only when it is reported, as a copy that
        fails on the device would be.
        """
        return self.inner.wait(ticket_ids, stream)

    def queue_after(self, ticket: Ticket, work: Callable[[], None]) -> None:
        """Queue ``work`` after ``ticket``'s copy (the inner engine's :meth:`CopyEngine.queue_after`).

        A ticket whose acknowledgement is held back here has been reported by
        the inner engine, which refuses it: its copy has finished.
        """
        self.inner.queue_after(ticket, work)

    def poison_destination(self, ticket: Ticket) -> None:
        """Poison ``ticket``'s destination pages (the inner engine's :meth:`CopyEngine.poison_destination`)."""
        self.inner.poison_destination(ticket)

    def poison_failed(self, ticket: Ticket) -> None:
        """Poison a failed backup's pages, counting a poison that raises (:meth:`CopyEngine.poison_failed`)."""
        self.inner.poison_failed(ticket)

    def close(self) -> None:
        """Close the inner engine and drop held acknowledgements; idempotent."""
        self.inner.close()
        self._held = []

    def _deliver(self, finished: list[Completion], flush: bool) -> list[Completion]:
        for c in finished:
            self._held.append(_Held(self._inject(c), self.delay))
        # held first, poisoned next, delivered last: a poison interrupted (a KeyboardInterrupt)
        # loses no completion taken from the inner engine, and the next poll finishes it first
        poison_in_order(self._unpoisoned, self.poison_failed)  # one that raises: counted
        due: list[_Held] = []
        kept: list[_Held] = []
        for h in self._held:
            (due if flush or h.polls_left <= 0 else kept).append(h)
            h.polls_left -= 1
        self._held = kept
        out = [h.completion for h in due]
        if self.shuffle:
            self._rng.shuffle(out)
        return out

    def _inject(self, completion: Completion) -> Completion:
        position = self._doomed.pop(completion.ticket.id, None)
        if position is None:
            return completion
        ticket = completion.ticket
        if self.poison and ticket.direction is Direction.D2H:  # the copy has finished
            self._unpoisoned.append(ticket)  # before its failure is delivered (_deliver)
        return Completion(ticket, CopyFailed(f"injected failure of copy {position}"))

    def in_flight(self) -> list[Ticket]:
        """Tickets started and not yet delivered, oldest first."""
        held = [h.completion.ticket for h in self._held]
        return sorted(self.inner.in_flight() + held, key=lambda t: t.id)

    def device_busy(self, pages: Iterable[int]) -> bool:
        """Whether an undelivered copy reads or writes any of these device pages."""
        wanted = set(pages)
        return self.inner.device_busy(wanted) or any(
            wanted.intersection(h.completion.ticket.device_pages) for h in self._held
        )

    def host_busy(self, pages: Iterable[int]) -> bool:
        """Whether an undelivered copy reads or writes any of these host pages."""
        wanted = set(pages)
        return self.inner.host_busy(wanted) or any(
            wanted.intersection(h.completion.ticket.host_pages) for h in self._held
        )

    def busy_device_pages(self) -> frozenset[int]:
        """Every device page an undelivered copy touches."""
        held = (p for h in self._held for p in h.completion.ticket.device_pages)
        return self.inner.busy_device_pages() | frozenset(held)

    def busy_host_pages(self) -> frozenset[int]:
        """Every host page an undelivered copy touches."""
        held = (p for h in self._held for p in h.completion.ticket.host_pages)
        return self.inner.busy_host_pages() | frozenset(held)
