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
from typing import Protocol

from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.tree import TreeNode
from fsm_cache.engine import trail
from fsm_cache.errors import CopyFailed, EffectFailed, PoolExhausted
from fsm_cache.memory.tickets import Completion, Copier, Direction
from fsm_cache.memory.tiers import Tiers
from fsm_cache.policy import WritePolicy, parent_allows_backup, wants_backup
from fsm_cache.residency import Event


trail.internal(__file__)

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
        self._started = 0  # copies started since construction or reset: their log numbers
        self._source = (acks or CopierAcks)(tiers.copier, self)
        core.on_split(self._rehome)

    # -- views ---------------------------------------------------------------

    def issued(self) -> list[int]:
        """Return the ticket ids of copies started and not yet applied, in issue order."""
        return list(self._tickets)

    def numbers(self) -> dict[int, int]:
        """Return the ticket id of each copy in flight by its copy number."""
        return {batch.number: ident for ident, batch in self._tickets.items()}

    def in_flight(self) -> Mapping[int, CopyBatch]:
        """The copies started and not yet applied, by ticket id (read-only view)."""
        return self._tickets

    def queued(self) -> int:
        """Return how many nodes wait in a batch for their copy to start."""
        return sum(len(nodes) for nodes in self._batch.values())

    # -- lifecycle -----------------------------------------------------------

    def on_ack(self, listener: AckListener) -> None:
        """Call ``listener(nodes, event)`` after each copy's acknowledgement events."""
        self._listeners.append(listener)

    def reset(self) -> None:
        """Forget every batch and ticket (the copy engine was drained) and renumber from 1."""
        self._batch = {Direction.D2H: [], Direction.H2D: []}
        self._tickets = {}
        self._started = 0

    # -- writes the policy starts --------------------------------------------

    def maybe_backup(self, node: TreeNode) -> None:
        """Start a write of ``node`` if the write policy wants one and the host has room."""
        if self._tiers.host.num_pages == 0:
            return  # a device-only cache: nothing to back up to
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

        Any other failing effect, and any refusal, raises.
        """
        try:
            self._core.fire(node, "write")
        except EffectFailed as exc:
            if isinstance(exc.__cause__, PoolExhausted):
                return False
            raise
        return True

    # -- starting copies -----------------------------------------------------

    def queue(self, direction: Direction, node: TreeNode) -> None:
        """Queue ``node`` for the next copy in ``direction`` (called by the memory effects)."""
        self._batch[direction].append(node)

    def flush(self) -> None:
        """Start one batched copy per direction for the nodes whose events asked for one."""
        for direction, nodes in self._batch.items():
            if nodes:
                self._batch[direction] = []
                self._start(direction, nodes)

    def _start(self, direction: Direction, nodes: list[TreeNode]) -> None:
        """Start one copy for ``nodes``; if the engine refuses it, fail their events at once."""
        copier = self._tiers.copier
        dev = [p for n in nodes for p in n.device_pages]
        host = [p for n in nodes for p in n.host_pages]
        try:
            if direction is Direction.D2H:
                ticket = copier.start_write(dev, host)
            else:
                ticket = copier.start_load(host, dev)
        except CopyFailed:
            failed: Event = "write_failed" if direction is Direction.D2H else "load_failed"
            for n in nodes:
                self._core.fire(n, failed)
            self._acknowledged(nodes, failed)
            return
        self._started += 1
        self._tickets[ticket.id] = CopyBatch(list(nodes), time.perf_counter(), self._started)

    # -- acknowledgements ----------------------------------------------------

    def collect(self, wait: bool) -> list[Completion]:
        """Return finished copies from the acknowledgement source (all of them with ``wait``)."""
        return self._source.collect(wait)

    def apply(self, completions: Sequence[Completion], origin: str) -> int:
        """Log which copies ``completions`` acknowledge, then apply them in that order.

        The log entry lists ``(copy number, ok)`` per completion, so that a replay
        applies exactly these acknowledgements, at this point, with these outcomes.
        """
        acks = [(self._tickets[c.ticket.id].number, c.ok) for c in completions]
        self._core.log.acks(origin, acks)
        for completion in completions:
            self._apply_one(completion)
        return len(completions)

    def settle(self) -> int:
        """Start the queued copies, wait for every copy in flight, and apply them all.

        For an allocation that needs what acknowledgements free now (write-back
        eviction); a poll would apply them later. Returns how many were applied.
        """
        self.flush()
        return self.apply(self.collect(wait=True), "wait")

    def _apply_one(self, completion: Completion) -> None:
        """Fire the acknowledgement events of one finished copy, and their follow-ups."""
        batch = self._tickets.pop(completion.ticket.id)
        write = completion.ticket.direction is Direction.D2H
        seconds = time.perf_counter() - batch.started
        nbytes = len(completion.ticket.src_pages) * self._tiers.device.layout.page_bytes
        self._core.counters.copied("d2h" if write else "h2d", seconds, nbytes, completion.ok)
        if not write and not completion.ok:
            stuck = [n for n in batch.nodes if not self._core.allowed(n, "load_failed")]
            if stuck:  # locked, or a child was inserted on the device below: copy again
                self._start(Direction.H2D, batch.nodes)
                return
        if write:
            event: Event = "write_done" if completion.ok else "write_failed"
        else:
            event = "load_done" if completion.ok else "load_failed"
        for node in batch.nodes:
            self._core.fire(node, event)
        self._acknowledged(batch.nodes, event)

    def _acknowledged(self, nodes: Sequence[TreeNode], event: Event) -> None:
        """Tell the listeners, then start the backups a finished write allows (children next)."""
        for listener in self._listeners:
            listener(nodes, event)
        if event == "write_done":
            for node in nodes:
                for child in node.children.values():
                    self.maybe_backup(child)

    def _rehome(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """A copy in flight for ``suffix`` now serves the split-off ``prefix`` too."""
        for batch in self._tickets.values():
            if suffix in batch.nodes:
                batch.nodes.insert(batch.nodes.index(suffix), prefix)
