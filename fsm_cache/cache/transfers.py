"""Where HiCache's residency events meet memory: effects, copy batches, acknowledgements.

The residency spec names four effects (``start_write``, ``free_host``,
``free_device``, ``start_load``) and one more for recomputed KV
(``adopt_device``); :func:`effects` binds them to a cache. The engine runs an
effect after every check passed and before it commits, so a failing effect
(a full host pool, a page still being copied) leaves the node unchanged.

Copies are batched: effects only queue nodes, and :func:`flush` starts one
copy per direction for everything an operation queued; :class:`Operation`
brackets every public cache call so that the flush happens however the call
ends. :func:`apply_acks` logs which copies a batch of acknowledgements covers
and turns each finished copy back into events (``write_done``,
``load_failed``, ...); :func:`settle` waits for every copy in flight, for an
allocation that cannot wait for the next poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fsm_cache.engine import trail
from fsm_cache.errors import CopyFailed, EffectFailed, FsmCacheError, PoolExhausted
from fsm_cache.memory.tickets import Completion, Direction
from fsm_cache.policy import parent_allows_backup, wants_backup
from fsm_cache.residency import DEVICE_HELD, Event


if TYPE_CHECKING:
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.tree import TreeNode


trail.internal(__file__)


def start_writes(cache: HiCache, nodes: Sequence[TreeNode]) -> int:
    """Fire ``write`` on each node the machines and the write policy allow; return how many.

    Under write-through a node whose parent holds no valid host copy yet is
    skipped (design invariant 3). A full host pool stops the batch where it
    is; any other failing effect raises.
    """
    started = 0
    for node in nodes:
        if not cache.machine.allowed(node, "write"):
            continue
        if not parent_allows_backup(cache.policy, node):
            continue
        if not try_write(cache, node):
            break
        started += 1
    return started


def maybe_backup(cache: HiCache, node: TreeNode) -> None:
    """Start a write of ``node`` if the write policy wants one and the host has room."""
    if cache.tiers.host.num_pages == 0:
        return  # a device-only cache: nothing to back up to
    if wants_backup(cache.policy, node, cache.config.selective_threshold):
        try_write(cache, node)


def try_write(cache: HiCache, node: TreeNode) -> bool:
    """Fire ``write`` on ``node``; False when the host pool has no room even after eviction.

    Any other failing effect, and any refusal, raises.
    """
    try:
        cache._fire(node, "write")
    except EffectFailed as exc:
        if isinstance(exc.__cause__, PoolExhausted):
            return False
        raise
    return True


@dataclass
class Ticket:
    """The nodes one started copy serves, when it started, and its number in the log.

    Copies are numbered from 1 in start order since the cache was built or
    reset; the event log names copies by these numbers, which a replay
    reproduces whatever ids its copy engine hands out.
    """

    nodes: list[TreeNode]
    started: float
    number: int


def effects(cache: HiCache) -> dict[str, Callable[[Any], None]]:
    """Return the residency effects bound to ``cache``'s memory."""

    def start_write(node: TreeNode) -> None:
        try:
            pages = cache.tiers.alloc_host(len(node.device_pages), node.id)
        except PoolExhausted:
            from fsm_cache.cache.eviction import evict_host

            evict_host(cache, len(node.key))
            pages = cache.tiers.alloc_host(len(node.device_pages), node.id)
        node.host_pages = pages
        cache._batch[Direction.D2H].append(node)

    def free_host(node: TreeNode) -> None:
        cache.tiers.free_host(node.host_pages, node.id)
        node.host_pages = ()

    def free_device(node: TreeNode) -> None:
        cache.tiers.free_device(node.device_pages, node.id)
        node.device_pages = ()
        parent = node.parent
        if parent is not None and parent.parent is not None:
            cache.leaf_heap.push(parent)  # it may have just become a device leaf

    def start_load(node: TreeNode) -> None:
        node.device_pages = cache._incoming.pop(node.id)
        cache.leaf_heap.push(node)
        cache.tiers.device.allocator.reassign(node.device_pages, 0, node.id)
        cache._batch[Direction.H2D].append(node)

    def adopt_device(node: TreeNode) -> None:
        node.device_pages = cache._incoming.pop(node.id)
        cache.leaf_heap.push(node)
        cache.tiers.device.allocator.reassign(node.device_pages, 0, node.id)

    return {
        "start_write": start_write,
        "free_host": free_host,
        "free_device": free_device,
        "start_load": start_load,
        "adopt_device": adopt_device,
    }


def flush(cache: HiCache) -> None:
    """Start one batched copy per direction for the nodes whose events asked for one."""
    for direction, nodes in cache._batch.items():
        if nodes:
            cache._batch[direction] = []
            start_batch(cache, direction, nodes)


def start_batch(cache: HiCache, direction: Direction, nodes: list[TreeNode]) -> None:
    """Start one copy for ``nodes``; if the engine refuses it, fail their events at once."""
    copier = cache.tiers.copier
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
            cache._fire(n, failed)
        after_ack(cache, nodes, failed)
        return
    cache._copies += 1
    cache._tickets[ticket.id] = Ticket(list(nodes), time.perf_counter(), cache._copies)


def apply_acks(cache: HiCache, completions: Sequence[Completion], origin: str) -> int:
    """Log which copies ``completions`` acknowledge, then apply them in that order.

    The log entry lists ``(copy number, ok)`` per completion, so that a replay
    applies exactly these acknowledgements, at this point, with these outcomes.
    """
    acks = [(cache._tickets[c.ticket.id].number, c.ok) for c in completions]
    cache.log.acks(origin, acks)
    for completion in completions:
        apply_completion(cache, completion)
    return len(completions)


def settle(cache: HiCache) -> int:
    """Start the queued copies, wait for every copy in flight, and apply them all.

    For an allocation that needs what acknowledgements free now (write-back
    eviction); a poll would apply them later. Returns how many were applied.
    """
    flush(cache)
    return apply_acks(cache, cache._collect(wait=True), "wait")


def apply_completion(cache: HiCache, completion: Completion) -> None:
    """Fire the acknowledgement events of one finished copy, and their follow-ups."""
    ticket = cache._tickets.pop(completion.ticket.id)
    write = completion.ticket.direction is Direction.D2H
    _count(cache, completion, ticket, "d2h" if write else "h2d")
    if not write and not completion.ok:
        stuck = [n for n in ticket.nodes if not cache.machine.allowed(n, "load_failed")]
        if stuck:  # locked, or a child was inserted on the device below: copy again
            start_batch(cache, Direction.H2D, ticket.nodes)
            return
    if write:
        event: Event = "write_done" if completion.ok else "write_failed"
    else:
        event = "load_done" if completion.ok else "load_failed"
    for node in ticket.nodes:
        cache._fire(node, event)
    after_ack(cache, ticket.nodes, event)


def _count(cache: HiCache, completion: Completion, ticket: Ticket, name: str) -> None:
    cache.counters.copy_seconds[name] += time.perf_counter() - ticket.started
    if completion.ok:
        page_bytes = cache.tiers.device.layout.page_bytes
        cache.counters.copy_bytes[name] += len(completion.ticket.src_pages) * page_bytes
    else:
        cache.counters.copy_failures[name] += 1


def after_ack(cache: HiCache, nodes: list[TreeNode], event: Event) -> None:
    """Follow-ups once acknowledgements are applied: write-back evictions, deferred backups."""
    for node in nodes:
        if event not in ("write_done", "write_failed") or node.id not in cache._evict_after_ack:
            continue
        cache._evict_after_ack.discard(node.id)
        device_child = any(c.device in DEVICE_HELD for c in node.children.values())
        if event == "write_done" and node.locks == 0 and not device_child:
            cache._fire(node, "evict_device")
        else:
            cache.leaf_heap.push(node)  # locked meanwhile, or the backup failed: evict later
    if event == "write_done":
        for node in nodes:
            for child in node.children.values():
                maybe_backup(cache, child)


def on_split(cache: HiCache, prefix: TreeNode, suffix: TreeNode) -> None:
    """Re-home page ownership and in-flight copies after ``suffix`` was split off ``prefix``."""
    cache.tiers.reassign(prefix.device_pages, prefix.host_pages, suffix.id, prefix.id)
    for ticket in cache._tickets.values():
        if suffix in ticket.nodes:
            ticket.nodes.insert(ticket.nodes.index(suffix), prefix)
    cache.log.transition(prefix.id, f"split:{suffix.id}")


class Operation:
    """One public operation: logged first, its copies started however it ends, checked after."""

    __slots__ = ("cache", "check", "name")

    def __init__(self, cache: HiCache, name: str, *args: Hashable) -> None:
        self.cache, self.name, self.check = cache, name, cache.config.debug
        cache.log.op(name, *args)

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        cache = self.cache
        if isinstance(exc, FsmCacheError):
            cache.log.refusal(self.name, exc)
        flush(cache)  # nothing stays queued without its copy, even on a refusal
        if exc is None and self.check:
            from fsm_cache.cache.invariants import check

            check(cache, after=self.name)
