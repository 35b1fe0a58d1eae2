"""Copies between the tiers: batches, tickets in flight, and their acknowledgements.

:class:`Transfers` owns every copy the cache starts. Effects only queue nodes
(:meth:`Transfers.queue`); :meth:`Transfers.flush` starts one copy per
direction for everything an operation queued, however the operation ends.
Finished copies come from an :class:`AckSource` (the copy engine by default;
a replay passes a scripted one) and :meth:`Transfers.apply` turns each back
into events (``write_done``, ``load_failed``, ...), logged first as the copy
numbers it applies, so that a replay applies exactly those. Parts that act on
acknowledgements (the evictor's write-back evictions) subscribe with
:meth:`Transfers.on_ack`.

Writes also start here, where the write policy decides: :meth:`maybe_backup`
on insert, :meth:`start_writes` for explicit backups.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.eventlog import refusal_text
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine import trail
from fsm_cache.errors import (
    BadArgument,
    ConfigError,
    CopyFailed,
    DuplicateAck,
    EffectFailed,
    PoolExhausted,
)
from fsm_cache.memory.tickets import Completion, Copier, Direction, Ticket
from fsm_cache.memory.tiers import Tiers
from fsm_cache.policy import WritePolicy, backup_threshold, parent_allows_backup, wants_backup
from fsm_cache.residency import HOST_HELD, Event


trail.internal(__file__)

ACKNOWLEDGEMENTS = frozenset({"write_done", "write_failed", "load_done", "load_failed"})
"""The events a device-host copy's acknowledgement fires (:meth:`Transfers.apply`), and
nothing else may: fired while the copy runs, they would part the node from its copy."""
_LOAD_ROUNDS = 3
"""Waits for a load that failed and was copied again before an operation gives up on it."""

AckListener = Callable[[Sequence[TreeNode], Event], None]
"""Called as ``listener(nodes, event)`` once one copy's acknowledgement events were fired."""


class AckSource(Protocol):
    """Where finished copies come from."""

    def collect(self, wait: bool) -> list[Completion]:
        """Return finished copies; with ``wait``, every copy in flight, in issue order."""
        ...


class IssuedCopies(Protocol):
    """What an acknowledgement source may read of the copies in flight."""

    def issued(self) -> list[int]:
        """Return the ticket ids of copies started and not yet applied, in issue order."""
        ...

    def numbers(self) -> dict[int, int]:
        """Return the ticket id of each copy in flight by its copy number."""
        ...

    def started(self) -> int:
        """Return how many copies started so far; the next one gets the number after it."""
        ...


class CopyStarts(Protocol):
    """What starts the cache's copies: the copy engine, or a replay's script in front of it."""

    def start_write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """Start a device-to-host copy, or raise to refuse it."""
        ...

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> Ticket:
        """Start a host-to-device copy, or raise to refuse it."""
        ...


class ReplayedRefusal(Exception):
    """A start refused as a log recorded it, raised by a replay in place of the engine's error.

    It never leaves :class:`Transfers`, which logs and handles it as the
    recorded error: a refusal (``CopyFailed: ...``) fails the copy, anything
    else is a broken engine and raises :class:`CopyFailed` naming it.

    Args:
        text: The recorded ``"ErrorClass: message"``.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text
        self.broken = not text.startswith(f"{CopyFailed.__name__}: ")


WaitAgreement = Callable[[Callable[[], bool]], bool]
"""Agrees on a load wait's answer across ranks: called with what computes this rank's answer
(:meth:`~fsm_cache.cache.hicache.HiCache.wait_loaded` on this cache alone), it returns the group's."""

HeldFailures = Callable[[Sequence[int]], bool]
"""Says whether the acknowledgement source holds back, unapplied, a failed completion of one of
these copies: the copy engine reported it, so it no longer knows the copy failed."""

AckSourceFactory = Callable[[Copier, IssuedCopies], AckSource]
"""Builds a cache's acknowledgement source from its copy engine and its copies in flight."""


class CopierAcks:
    """Acknowledgements as the copy engine reports them (the default source).

    Args:
        copier: The copy engine.
        copies: The copies in flight, for the issue order of a full wait.
    """

    def __init__(self, copier: Copier, copies: IssuedCopies) -> None:
        self._copier = copier
        self._copies = copies

    def collect(self, wait: bool) -> list[Completion]:
        """Return what the engine reports finished; with ``wait``, all of it, in issue order."""
        if not wait:
            return self._copier.poll()
        order = {ident: i for i, ident in enumerate(self._copies.issued())}
        return sorted(self._copier.drain(), key=lambda c: order.get(c.ticket.id, len(order)))


@dataclass
class CopyBatch:
    """The nodes one started copy serves, when it started, and its number in the log.

    Copies are numbered from 1 in start order since the cache was built or
    reset; the event log names copies by these numbers, which a replay
    reproduces whatever ids its copy engine hands out.
    """

    nodes: list[TreeNode]
    started: float
    number: int
    ticket: Ticket


class Transfers:
    """Copy batches, tickets in flight and acknowledgements of one cache.

    Args:
        core: Fires the acknowledgement events and records them.
        tiers: The pools and the copy engine.
        policy: The write policy, for the writes started here.
        selective_threshold: Hits before a selective write-through backs a node up.
        acks: Builds the acknowledgement source; the copy engine's by default.
    """

    def __init__(
        self,
        core: CacheCore,
        tiers: Tiers,
        policy: WritePolicy,
        selective_threshold: int,
        acks: AckSourceFactory | None = None,
    ) -> None:
        self._core = core
        self._tiers = tiers
        self._policy = policy
        self._selective = selective_threshold
        self._listeners: list[AckListener] = []
        self._batch: dict[Direction, list[TreeNode]] = {Direction.D2H: [], Direction.H2D: []}
        self._tickets: dict[int, CopyBatch] = {}
        # reported and not applied, as an apply that raised left them: collected again first
        self._held: dict[int, Completion] = {}
        # nodes whose copy failed but may not be failed (locked loads, pinned writes): copied again
        self._retry: dict[Direction, list[TreeNode]] = {Direction.D2H: [], Direction.H2D: []}
        self._started = 0  # copies started since construction or reset: their log numbers
        self._dirty = False  # a node was queued or put back for a retry since the last flush
        # hits that start a backup; None: the policy never does, or there is no host tier
        self._threshold = (
            backup_threshold(policy, selective_threshold) if tiers.host.num_pages else None
        )
        self._page_bytes = tiers.device.layout.page_bytes
        self._source = (acks or CopierAcks)(tiers.copier, self)
        self._starts: CopyStarts = tiers.copier
        self.acks_taken = False
        """Whether :meth:`take_acks_from` gave the acknowledgements to another source."""
        self.agree_waits: WaitAgreement | None = None
        """Who answers a load wait for the group (:meth:`take_acks_from`); None: this cache."""
        self.held_failures: HeldFailures | None = None
        """Who knows of failed copies reported and not yet applied; None: none are held back."""
        core.on_split(self._rehome)

    # -- views ---------------------------------------------------------------

    def issued(self) -> list[int]:
        """Return the ticket ids of copies started and not yet applied, in issue order."""
        return list(self._tickets)

    def numbers(self) -> dict[int, int]:
        """Return the ticket id of each copy in flight by its copy number."""
        return {batch.number: ident for ident, batch in self._tickets.items()}

    def started(self) -> int:
        """Return how many copies started since construction or reset (their log numbers)."""
        return self._started

    def in_flight(self) -> Mapping[int, CopyBatch]:
        """The copies started and not yet applied, by ticket id (read-only view)."""
        return self._tickets

    def queued(self) -> int:
        """Return how many nodes wait in a batch for their copy to start (retries included)."""
        waiting = [*self._batch.values(), *self._retry.values()]
        return sum(len(nodes) for nodes in waiting)

    def queued_nodes(self) -> list[tuple[str, list[int]]]:
        """Return, per direction with any, the ids of the nodes waiting for their copy to start.

        Those queued by this operation and those whose copy failed and waits
        to run again (:meth:`queued` counts them): ``[("d2h", [4, 7])]``.
        """
        out = []
        for direction in (Direction.D2H, Direction.H2D):
            nodes = [*self._batch[direction], *self._retry[direction]]
            if nodes:
                out.append((direction.value, [n.id for n in nodes]))
        return out

    def idle(self) -> bool:
        """Return whether no copy is in flight, queued, or waiting to be copied again."""
        return not self._tickets and self.queued() == 0

    def pending(self) -> frozenset[int]:
        """Return the ids of nodes with a copy in flight, queued, or waiting to be copied again."""
        out = {n.id for batch in self._tickets.values() for n in batch.nodes}
        out.update(n.id for nodes in self._batch.values() for n in nodes)
        out.update(n.id for nodes in self._retry.values() for n in nodes)
        return frozenset(out)

    def tickets_of(self, nodes: Sequence[TreeNode]) -> list[int] | None:
        """Return the tickets of the copies in flight that serve ``nodes``' loads.

        None when a node of ``nodes`` is loading with no copy in flight (its
        copy failed and waits to run again): nothing can be waited on for it yet.
        """
        wanted = {n.id for n in nodes if n.device == "loading"}
        out = []
        for ident, batch in self._tickets.items():
            served = wanted.intersection(n.id for n in batch.nodes)
            if served:
                out.append(ident)
                wanted -= served
        return None if wanted else out

    # -- lifecycle -----------------------------------------------------------

    @property
    def ack_source(self) -> AckSource:
        """Where finished copies are read from: the copy engine's reports, or :meth:`take_acks_from`'s."""
        return self._source

    def take_acks_from(
        self,
        source: AckSource,
        waits: WaitAgreement | None = None,
        held: HeldFailures | None = None,
        *,
        replacing: AckSource | None = None,
    ) -> None:
        """Read finished copies from ``source`` from now on, and answer load waits by ``waits``.

        For a tensor-parallel group: every rank must apply the same
        acknowledgements at the same points, so the group's agreement replaces
        the copy engine's own reports (see
        :class:`fsm_cache.distributed.agreement.DistributedCache`); and every
        rank must run the same forward pass, so whether a load can be read
        (:meth:`~fsm_cache.cache.hicache.HiCache.wait_loaded`) is the group's
        answer too. A source that holds completions back until the group
        agrees says, by ``held``, which of them failed: the copy engine
        forgets a copy once it reported it, so only the source can tell a
        load wait that the copy it waits on failed.

        Args:
            source: Where finished copies come from from now on.
            waits: Who answers a load wait; None: this cache.
            held: Who knows of failed copies held back; None: none are.
            replacing: The source that took them before, which this one
                replaces (its group gone; see
                :class:`~fsm_cache.distributed.agreement.DistributedCache`).

        Raises:
            ConfigError: Another source took them already (a cache wrapped
                twice), and ``source`` does not replace it: two would each
                buffer completions the other waits for.
        """
        if self.acks_taken and self._source is not replacing:
            raise ConfigError(
                f"the cache's acknowledgements come from a {type(self._source).__name__} already:"
                " wrap a cache in one DistributedCache"
            )
        self._source = source
        self.acks_taken = True
        self.agree_waits = waits
        self.held_failures = held

    def start_copies_with(self, starts: CopyStarts) -> None:
        """Start copies through ``starts`` from now on (a replay's refused starts, or the engine)."""
        self._starts = starts

    def on_ack(self, listener: AckListener) -> None:
        """Call ``listener(nodes, event)`` after each copy's acknowledgement events."""
        self._listeners.append(listener)

    def reset(self) -> None:
        """Forget every batch and ticket (the copy engine was drained) and renumber from 1."""
        self._batch = {Direction.D2H: [], Direction.H2D: []}
        self._tickets = {}
        self._held = {}
        self._retry = {Direction.D2H: [], Direction.H2D: []}
        self._started = 0
        self._dirty = False

    # -- writes the policy starts --------------------------------------------

    def maybe_backup_each(self, nodes: Iterable[TreeNode]) -> None:
        """:meth:`maybe_backup` each of ``nodes`` (none at all without a host tier)."""
        if self._threshold is not None:
            for node in nodes:
                self.maybe_backup(node)

    def maybe_backup(self, node: TreeNode) -> None:
        """Start a write of ``node`` if the write policy wants one and the host has room."""
        threshold = self._threshold
        if threshold is None or node.hit_count < threshold or node.host in HOST_HELD:
            return  # no host tier, too few hits, or backed already: the common answers, first
        if wants_backup(self._policy, node, self._selective):
            self.try_write(node)

    def start_writes(self, nodes: Iterable[TreeNode]) -> int:
        """Fire ``write`` on each node the machines and the write policy allow; return how many.

        Under write-through a node whose parent holds no valid host copy yet is
        skipped (design invariant 3). A full host pool stops the batch where it
        is; any other failing effect raises.
        """
        started = 0
        for node in nodes:
            if not self._core.allowed(node, "write"):
                continue
            if not parent_allows_backup(self._policy, node):
                continue
            if not self.try_write(node):
                break
            started += 1
        return started

    def try_write(self, node: TreeNode) -> bool:
        """Fire ``write`` on ``node``; False when the host pool has no room even after eviction.

        False too, with nothing changed, where the spec refuses the backup now
        (:meth:`~fsm_cache.cache.core.CacheCore.attempt`): the write policy
        picks its nodes by tests that mirror the shipped rules, and a node a
        spec's added rule keeps is passed by. Any other failing effect raises.
        """
        try:
            if not self._core.attempt(node, "write"):
                return False
        except EffectFailed as exc:
            if isinstance(exc.__cause__, PoolExhausted):
                return False
            raise
        return True

    # -- starting copies -----------------------------------------------------

    def queue(self, direction: Direction, node: TreeNode) -> None:
        """Queue ``node`` for the next copy in ``direction`` (called by the memory effects)."""
        self._batch[direction].append(node)
        self._dirty = True

    def stop(self) -> None:
        """Start nothing at the end of this operation: what is queued stays queued, unstarted.

        For :meth:`~fsm_cache.cache.hicache.HiCache.close` after its last
        settle: a copy started then would be drained by the tiers' close and
        its completion dropped.
        """
        self._dirty = False

    def flush(self) -> None:
        """Start one batched copy per direction for the nodes whose events asked for one.

        Copies to run again (see :meth:`_fail`) join this flush's copy in their direction.
        """
        if not self._dirty:
            return  # most operations queue nothing
        self._dirty = False
        for direction, nodes in self._retry.items():
            if nodes:
                self._batch[direction].extend(nodes)
                self._retry[direction] = []
        broken: CopyFailed | None = None
        for direction, nodes in self._batch.items():
            if nodes:
                self._batch[direction] = []
                try:
                    self._start(direction, nodes)
                except CopyFailed as exc:  # the other direction still starts
                    broken = broken or exc
        if broken is not None:
            raise broken

    def _start(self, direction: Direction, nodes: list[TreeNode]) -> None:
        """Start one copy for ``nodes`` (the batch just taken, now the copy's); fail them if refused.

        A copy engine that refuses with :class:`CopyFailed` fails the copy, as a
        copy that fails later does. Anything else it raises is a broken engine
        or a page it should not have been given: the copy is failed all the
        same, so no node is left waiting for it, and the error is raised as a
        :class:`CopyFailed` naming it; an interrupt (a ``KeyboardInterrupt``)
        fails it too, and is raised as it came. Either way the refused start
        is logged (``copy_refused``) before the nodes fail, so a replay
        refuses it too.

        Raises:
            CopyFailed: The engine raised another Exception than CopyFailed; the
                nodes' copies were failed (or queued to run again).
        """
        starts = self._starts
        if len(nodes) == 1:  # the common case: one operation backed up one node
            dev, host = nodes[0].device_pages, nodes[0].host_pages
        else:
            dev = tuple(chain.from_iterable(n.device_pages for n in nodes))
            host = tuple(chain.from_iterable(n.host_pages for n in nodes))
        try:
            if direction is Direction.D2H:
                ticket = starts.start_write(dev, host)
            else:
                ticket = starts.start_load(host, dev)
        except BaseException as exc:
            self._refused(direction, nodes, exc)
            if not isinstance(exc, Exception):  # a KeyboardInterrupt: the copy failed, go on
                raise
            return
        self._started += 1
        self._tickets[ticket.id] = CopyBatch(nodes, time.perf_counter(), self._started, ticket)

    def _refused(self, direction: Direction, nodes: list[TreeNode], exc: BaseException) -> None:
        """Log a start the engine refused with ``exc`` and fail its copy; raise if it is broken.

        An interrupt is no broken engine: the caller raises it as it came.
        """
        if isinstance(exc, ReplayedRefusal):
            text, broken = exc.text, exc.broken
        else:
            text = refusal_text(exc)
            broken = isinstance(exc, Exception) and not isinstance(exc, CopyFailed)
        ids = tuple(n.id for n in nodes)
        self._core.log.copy_refused(self._started + 1, direction.value, ids, text)
        self._fail(direction, nodes)
        if broken:
            raise CopyFailed(f"{direction.value} copy could not start: {text}") from exc

    # -- acknowledgements ----------------------------------------------------

    def collect(self, wait: bool) -> list[Completion]:
        """Return finished copies from the acknowledgement source (all of them with ``wait``).

        The completions an :meth:`apply` that raised did not apply come too,
        first (with ``wait``, all of them in issue order): the source reported
        them already, and will not again.
        """
        got = self._source.collect(wait)
        if not self._held:
            return got
        out = [c for c in self._held.values() if c.ticket.id in self._tickets]
        self._held = {}
        out.extend(got)
        if wait:
            order = {ident: i for i, ident in enumerate(self._tickets)}
            out.sort(key=lambda c: order.get(c.ticket.id, len(order)))
        return out

    def apply(self, completions: Sequence[Completion], origin: str) -> int:
        """Log which copies ``completions`` acknowledge, then apply them in that order.

        The log entry lists ``(copy number, ok)`` per completion, so that a replay
        applies exactly these acknowledgements, at this point, with these outcomes.
        Every completion is checked before any is applied; the cache's own
        checks never refuse one: a failed load that cannot be failed yet is
        copied again.

        An error from outside the cache while one is applied (an allocator that
        broke as a failed copy gave its pages back, a ``KeyboardInterrupt``)
        stops the batch there and is raised once nothing is left hanging: the
        nodes of that copy that had not moved yet are copied again, those that
        had are acknowledged, the completions after it are held back for the
        next :meth:`collect`, and the log entry is cut to the copies taken, so
        that it never lists a copy as applied that was not.

        Raises:
            BadArgument: An item is not a :class:`Completion`.
            DuplicateAck: A completion names a copy that is not in flight (applied
                already, listed twice, or never started by this cache); nothing
                was applied.
        """
        self._check_acks(completions)
        acks = [(self._tickets[c.ticket.id].number, c.ok) for c in completions]
        log = self._core.log
        at = log.recorded
        log.acks(origin, acks)
        done = 0
        try:
            for completion in completions:
                self._apply_one(completion)
                done += 1
        except BaseException:
            if done < len(completions) and completions[done].ticket.id not in self._tickets:
                done += 1  # taken, and settled part-way (_apply_one): listed as applied
            for completion in completions[done:]:
                self._held[completion.ticket.id] = completion
            log.cut_acks(at, acks[:done])
            raise
        return len(completions)

    def apply_collected(self, wait: bool, origin: str) -> int:
        """Apply what :meth:`collect` returns; on a refusal, keep the copies still in flight.

        The source reported those copies and will not again, so a batch
        refused for one stray acknowledgement (a copy applied by hand with
        ``apply_completions`` that the engine then reports too) would lose
        the others, and their nodes would stay ``writing`` or ``loading``
        for ever. They are held back for the next :meth:`collect`; the stray
        one is dropped. Returns how many were applied.

        Raises:
            DuplicateAck: As :meth:`apply`; nothing was applied.
            BadArgument: The acknowledgement source gave something that is not
                a :class:`Completion`; nothing was applied.
        """
        completions = self.collect(wait)
        try:
            return self.apply(completions, origin)
        except (DuplicateAck, BadArgument):  # refused before any was applied
            flying = self._tickets
            for c in completions:
                batch = flying.get(c.ticket.id) if isinstance(c, Completion) else None
                if batch is not None and batch.ticket is c.ticket:
                    self._held[c.ticket.id] = c
            raise

    def _check_acks(self, completions: Sequence[Completion]) -> None:
        seen: set[int] = set()
        for c in completions:
            if not isinstance(c, Completion):
                raise BadArgument(f"apply_completions: expected a Completion, got {c!r}")
            ident = c.ticket.id
            if ident in seen or ident not in self._tickets:
                state = "listed twice" if ident in seen else "not in flight"
                raise DuplicateAck(
                    label="ticket",
                    instance=ident,
                    state=state,
                    counters={},
                    event="ack",
                    reason="a duplicate or stray acknowledgement; nothing was applied",
                )
            if c.ticket is not self._tickets[ident].ticket:  # engines number from 1 alike
                raise DuplicateAck(
                    label="ticket",
                    instance=ident,
                    state="flight",
                    counters={},
                    event="ack",
                    reason="the completion's ticket is not the copy this cache started under"
                    " that id (another cache's, or one built by hand); nothing was applied",
                )
            seen.add(ident)

    def settle(self) -> int:
        """Start the queued copies, wait for every copy in flight, and apply them all.

        For an allocation that needs what acknowledgements free now (write-back
        eviction); a poll would apply them later. Returns how many were applied.
        """
        self.flush()
        return self.apply_collected(True, "wait")

    def settle_all(self, rounds: int) -> None:
        """Settle until no copy is in flight or queued, for at most ``rounds`` waits.

        Applying an acknowledgement may start more copies (a child's backup
        after its parent's), hence the rounds; a load that keeps failing under
        a lock would otherwise keep it going for ever. It stops early once a
        wait applied nothing and nothing waits to start: every copy in flight
        was waited for and none came back (a caller collected them and never
        applied them), so no later round could apply or start anything.
        """
        for _ in range(rounds):
            if self.idle():
                return
            if self.settle() == 0 and not self._dirty:
                return

    def finish_loads(self, nodes: Sequence[TreeNode], origin: str) -> list[TreeNode]:
        """Apply the loads of ``nodes`` now; return those still loading afterwards.

        Nothing may be put on the device under a node whose load is in flight:
        a failed load must be able to free its pages, and a lookup must never
        hand out a child's KV ahead of its parent's. So an operation about to do
        that first applies the copies that finished (non-blocking) and, if a
        load is still in flight, waits for every copy and applies them (the
        load-back was started earlier and is normally done by now). A node
        still loading after a few rounds is a locked node whose copy keeps
        failing and is queued to run again.
        """
        if not any(n.device == "loading" for n in nodes):
            return []
        self.apply_collected(False, origin)
        for _ in range(_LOAD_ROUNDS):
            if not any(n.device == "loading" for n in nodes):
                break
            self.settle()
        return [n for n in nodes if n.device == "loading"]

    def _apply_one(self, completion: Completion) -> None:
        """Fire the acknowledgement events of one finished copy, and their follow-ups.

        Where an event's effect raises, the nodes not moved yet are copied
        again and those moved are acknowledged before the error goes on.
        """
        if self._held:  # applied by hand (apply_completions) after an apply held it back
            self._held.pop(completion.ticket.id, None)
        batch = self._tickets.pop(completion.ticket.id)
        direction = completion.ticket.direction
        write = direction is Direction.D2H
        seconds = time.perf_counter() - batch.started
        nbytes = len(completion.ticket.src_pages) * self._page_bytes
        self._core.counters.copied("d2h" if write else "h2d", seconds, nbytes, completion.ok)
        if not completion.ok:
            self._fail(direction, batch.nodes)
            return
        event: Event = "write_done" if write else "load_done"
        nodes, moved = batch.nodes, 0
        try:
            for node in nodes:
                self._core.fire(node, event)
                moved += 1
        except BaseException:
            self._stopped(direction, event, nodes[:moved], nodes[moved:])
            raise
        self._acknowledged(nodes, event)

    def _stopped(
        self,
        direction: Direction,
        event: Event,
        moved: Sequence[TreeNode],
        again: Sequence[TreeNode],
    ) -> None:
        """Settle a copy's nodes: ``moved`` took ``event``, ``again`` are copied again.

        ``moved`` are acknowledged; ``again`` are still writing or loading,
        their source still valid, so they join the next copy in ``direction``:
        the nodes a failed copy may not fail yet (:meth:`_fail`), or those an
        acknowledgement that raised part-way did not reach (the one whose
        effect raised first, and those after it).
        """
        if again:
            self._retry[direction].extend(again)
            self._dirty = True
        if moved:
            self._acknowledged(moved, event)

    def _fail(self, direction: Direction, nodes: Sequence[TreeNode]) -> None:
        """Fail the copies of ``nodes``, deepest first; queue the rest to be copied again.

        A node gives up its load (``load_failed``) once nothing below it is on
        the device, so children go first. A node the spec still refuses keeps
        its pages and is copied again with the next flush, its source being
        still valid: a load a request locked while it ran (the host copy stays
        pinned by the load), or a backup a holder pinned while it was written
        (the device copy cannot be evicted while it is read). The ancestors of
        a node copied again are copied again too, whatever the spec allows
        them: a prefix that gave up its backup would leave its suffix's
        backup landing under a node with none (a node split while its pinned
        backup was in flight).
        """
        event: Event = "write_failed" if direction is Direction.D2H else "load_failed"
        failed: list[TreeNode] = []
        again: list[TreeNode] = []
        above: set[int] = set()  # the ancestors of the nodes copied again
        deepest = sorted(nodes, key=_depth, reverse=True)
        for at, node in enumerate(deepest):
            if node.id not in above and self._core.allowed(node, event):
                try:
                    self._core.fire(node, event)
                except BaseException:  # an effect that broke: it and those left copied again
                    again.extend(deepest[at:])
                    self._stopped(direction, event, failed, again[::-1])
                    raise
                failed.append(node)
            else:
                again.append(node)
                walk = node.parent
                while walk is not None and walk.id not in above:
                    above.add(walk.id)
                    walk = walk.parent
        self._stopped(direction, event, failed, again[::-1])  # prefixes first, as copies list them

    def _acknowledged(self, nodes: Sequence[TreeNode], event: Event) -> None:
        """Tell the listeners, then start the backups a finished write allows (children next)."""
        for listener in self._listeners:
            listener(nodes, event)
        if event == "write_done":
            for node in nodes:
                for child in node.children.values():
                    self.maybe_backup(child)

    def _rehome(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """A copy in flight, queued or to retry for ``suffix`` now serves the split-off ``prefix`` too."""
        lists = [batch.nodes for batch in self._tickets.values()]
        lists.extend([*self._batch.values(), *self._retry.values()])
        for nodes in lists:
            if suffix in nodes:
                nodes.insert(nodes.index(suffix), prefix)


def _depth(node: TreeNode) -> int:
    depth, walk = 0, node.parent
    while walk is not None:
        depth, walk = depth + 1, walk.parent
    return depth
