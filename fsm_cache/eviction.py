"""How HiCache frees memory and brings it back: eviction, load-back and copy batches.

These are the cache's decisions under pressure, kept apart from its public
face in :mod:`fsm_cache.cache`. Every residency change still goes through the
machines (``cache._fire``): this module only chooses which nodes and in what
order.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

from fsm_cache.copies import Direction
from fsm_cache.errors import CopyFailed, InvariantViolation, PoolExhausted
from fsm_cache.policy import deletes_unbacked, worth_loading
from fsm_cache.residency import DEVICE_HELD, HOST_HELD, HOST_VALID, Event


if TYPE_CHECKING:
    from fsm_cache.cache import HiCache
    from fsm_cache.tree import TreeNode


def _device_leaf(node: TreeNode) -> bool:
    return (
        node.parent is not None
        and node.device == "resident"
        and node.locks == 0
        and node.host != "writing"
        and not any(c.device in DEVICE_HELD for c in node.children.values())
    )


def _structural_leaf(cache: HiCache, node: TreeNode) -> bool:
    """Whether ``node`` is still in the tree, on the device, with no child on the device."""
    return (
        cache.tree.nodes.get(node.id) is node
        and node.device == "resident"
        and not any(c.device in DEVICE_HELD for c in node.children.values())
    )


def evict_device(cache: HiCache, num_tokens: int) -> int:
    """Evict least recently used unlocked device leaves until ``num_tokens`` are freed.

    Candidates come from ``cache.leaf_hints``, the nodes that may have become
    device leaves since the last eviction (new leaves, parents of evicted or
    deleted nodes, loaded nodes), so eviction costs the leaves, not the tree.
    """
    hints = cache.leaf_hints
    hints.difference_update([n for n in hints if not _structural_leaf(cache, n)])
    heap = [(n.last_access, n.id, n) for n in hints if _device_leaf(n)]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not _device_leaf(node) or node.id in cache._evict_after_ack:
            continue
        parent = node.parent
        freed += _evict_one(cache, node)
        if parent is not None and parent.parent is not None:
            hints.add(parent)
            if _device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return freed


def _evict_one(cache: HiCache, node: TreeNode) -> int:
    """Evict one device leaf per the write policy; return the device tokens freed now."""
    tokens = len(node.key)
    if node.host in HOST_VALID:
        cache._fire(node, "evict_device")
        return tokens
    if deletes_unbacked(cache.policy):
        _delete(cache, node)
        return tokens
    cache._fire(node, "write")  # write-back: back it up, evict once acknowledged
    cache._evict_after_ack.add(node.id)
    return 0


def _delete(cache: HiCache, node: TreeNode) -> None:
    """Drop an unbacked, unlocked device leaf with no host copy: its only copy goes."""
    if node.children or node.locks or node.pins or node.host in HOST_HELD:
        raise InvariantViolation(f"node {node.id}: delete refused in {node.residency()}")
    if node.device_pages:
        cache.tiers.free_device(node.device_pages, node.id)
        node.device_pages = ()
    cache.tree.remove_leaf(node)
    cache.counters.deleted_nodes += 1
    cache.log.transition(node.id, "delete")
    cache.leaf_hints.discard(node)


def _host_leaf(node: TreeNode) -> bool:
    return (
        node.parent is not None
        and node.host == "backed"
        and node.device == "absent"
        and not any(c.host in HOST_HELD for c in node.children.values())
    )


def evict_host(cache: HiCache, num_tokens: int) -> int:
    """Evict least recently used unpinned host-only leaves, deleting each; return tokens freed."""
    heap = [(n.last_access, n.id, n) for n in cache.tree if _host_leaf(n)]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not _host_leaf(node):
            continue
        parent = node.parent
        cache._fire(node, "evict_host")
        freed += len(node.key)
        if not node.children:
            cache.tree.remove_leaf(node)
            cache.counters.deleted_nodes += 1
            cache.log.transition(node.id, "delete")
        if parent is not None and _host_leaf(parent):
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return freed


def load_chain(cache: HiCache, node: TreeNode) -> list[TreeNode] | None:
    """Start loading every device-absent node from the first one above ``node`` down to it."""
    chain: list[TreeNode] = []
    walk: TreeNode | None = node
    while walk is not None and walk.parent is not None and walk.device == "absent":
        chain.append(walk)
        walk = walk.parent
    chain.reverse()
    tokens = sum(len(n.key) for n in chain)
    if not chain or not worth_loading(tokens, cache.config.load_back_threshold):
        return None
    for n in chain:
        if n.host not in HOST_VALID:
            cache._fire(n, "load")  # refused by the spec (no valid host copy): raises
    pages = sum(len(n.key) for n in chain) // cache.config.page_size
    try:
        run = cache._alloc_device(pages, keep=chain[0].parent)
    except PoolExhausted:
        return None
    at = 0
    for n in chain:
        count = len(n.key) // cache.config.page_size
        cache._incoming[n.id] = run[at : at + count]
        at += count
    for n in chain:
        cache._fire(n, "load")
    return chain


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
    from fsm_cache.cache import _Ticket

    cache._tickets[ticket.id] = _Ticket(list(nodes), time.perf_counter())


def after_ack(cache: HiCache, nodes: list[TreeNode], event: Event) -> None:
    """Follow-ups once acknowledgements are applied: write-back evictions, deferred backups."""
    for node in nodes:
        if node.id not in cache._evict_after_ack:
            continue
        if event == "write_done":
            cache._evict_after_ack.discard(node.id)
            if node.locks == 0 and not any(c.device in DEVICE_HELD for c in node.children.values()):
                cache._fire(node, "evict_device")
        elif event == "write_failed":
            cache._evict_after_ack.discard(node.id)
    if event == "write_done":
        for node in nodes:
            for child in node.children.values():
                cache._maybe_backup(child)
