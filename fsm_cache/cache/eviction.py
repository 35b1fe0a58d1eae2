"""How HiCache frees memory and brings it back: eviction, load-back and copy batches.

These are the cache's decisions under pressure, kept apart from its public
face in :mod:`fsm_cache.cache.hicache`. Every residency change still goes through the
machines (``cache._fire``): this module only chooses which nodes and in what
order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsm_cache.cache import transfers
from fsm_cache.errors import InvariantViolation, PoolExhausted
from fsm_cache.policy import deletes_unbacked, worth_loading
from fsm_cache.residency import DEVICE_HELD, HOST_HELD, HOST_VALID


if TYPE_CHECKING:
    from fsm_cache.cache.hicache import HiCache
    from fsm_cache.cache.tree import TreeNode


def _device_leaf(node: TreeNode) -> bool:
    return (
        node.parent is not None
        and node.device == "resident"
        and node.locks == 0
        and node.host != "writing"
        and not any(c.device in DEVICE_HELD for c in node.children.values())
    )


def _structural_leaf(cache: HiCache, node: TreeNode) -> bool:
    """Whether ``node`` is in the tree, holds device pages, and no child is on the device.

    A loading node counts: once its load completes it is a leaf to evict.
    """
    return (
        cache.tree.nodes.get(node.id) is node
        and node.device in DEVICE_HELD
        and not any(c.device in DEVICE_HELD for c in node.children.values())
    )


class LeafHeap:
    """Device-leaf candidates in least-recently-used order, kept across evictions.

    Nodes are pushed when they may have become device leaves (new leaves,
    parents of evicted or deleted nodes, loaded or adopted nodes). Entries go
    stale when a node is touched, gains a child or leaves the device; they are
    checked when popped, so eviction costs the leaves it looks at, not the tree.
    """

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, TreeNode]] = []

    def push(self, node: TreeNode) -> None:
        """Offer ``node`` as a candidate at its current recency."""
        heapq.heappush(self.heap, (node.last_access, node.id, node))

    def pop(self, cache: HiCache) -> TreeNode | None:
        """Return the least recently used candidate still a structural device leaf, or None."""
        while self.heap:
            stamp, _, node = heapq.heappop(self.heap)
            if not _structural_leaf(cache, node):
                continue
            if stamp != node.last_access:  # touched since it was pushed: file it anew
                self.push(node)
                continue
            return node
        return None


def evict_device(cache: HiCache, num_tokens: int) -> int:
    """Evict least recently used unlocked device leaves until ``num_tokens`` are freed."""
    freed, held = 0, []
    while freed < num_tokens:
        node = cache.leaf_heap.pop(cache)
        if node is None:
            break
        if not _device_leaf(node) or node.id in cache._evict_after_ack:
            held.append(node)  # locked, loading or being written: a candidate again later
            continue
        parent = node.parent
        tokens = _evict_one(cache, node)
        if tokens is None:
            held.append(node)  # no host room for its write-back: a candidate again later
            continue
        freed += tokens
        if parent is not None and parent.parent is not None:
            cache.leaf_heap.push(parent)
    for node in held:
        cache.leaf_heap.push(node)
    return freed


def _evict_one(cache: HiCache, node: TreeNode) -> int | None:
    """Evict one device leaf per the write policy; return the device tokens freed now.

    None: a write-back leaf whose backup finds no host room even after host eviction.
    """
    tokens = len(node.key)
    if node.host in HOST_VALID:
        cache._fire(node, "evict_device")
        return tokens
    if deletes_unbacked(cache.policy):
        _delete(cache, node)
        return tokens
    if not transfers.try_write(cache, node):  # write-back: back it up, evict once acknowledged
        return None
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


def _host_leaf(cache: HiCache, node: TreeNode) -> bool:
    return (
        node.parent is not None
        and node.id not in cache._spared
        and node.host == "backed"
        and node.device == "absent"
        and not any(c.host in HOST_HELD for c in node.children.values())
    )


def evict_host(cache: HiCache, num_tokens: int) -> int:
    """Evict least recently used unpinned host-only leaves, deleting each; return tokens freed."""
    heap = [(n.last_access, n.id, n) for n in cache.tree if _host_leaf(cache, n)]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not _host_leaf(cache, node):
            continue
        parent = node.parent
        cache._fire(node, "evict_host")
        freed += len(node.key)
        if not node.children:
            cache.tree.remove_leaf(node)
            cache.counters.deleted_nodes += 1
            cache.log.transition(node.id, "delete")
        if parent is not None and _host_leaf(cache, parent):
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
        run = alloc_device(cache, pages, chain[0].parent, chain)
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


def alloc_device(
    cache: HiCache, pages: int, keep: TreeNode | None, spare: Sequence[TreeNode] = ()
) -> tuple[int, ...]:
    """Take ``pages`` device pages for a request, evicting if the pool is short.

    ``keep`` (or its nearest device-held ancestor) is locked while eviction
    runs, so the path an insert or a load hangs under is never evicted from
    under it; the ``spare`` nodes (host-only nodes about to be adopted or
    loaded) are kept from host eviction meanwhile.

    Raises:
        PoolExhausted: Too little can be evicted; nothing was allocated, and
            what eviction did stays done (see :func:`make_room`).
    """
    try:
        return cache.tiers.alloc_device(pages, 0)
    except PoolExhausted:
        pass
    while keep is not None and keep.device not in DEVICE_HELD:
        keep = keep.parent
    held = keep if keep is not None and keep.parent is not None else None
    if held is not None:
        cache._fire(held, "lock")
    cache._spared = frozenset(n.id for n in spare)
    try:
        make_room(cache, pages * cache.config.page_size)
    finally:
        cache._spared = frozenset()
        if held is not None:
            cache._fire(held, "unlock")
    return cache.tiers.alloc_device(pages, 0)


def make_room(cache: HiCache, slots: int) -> None:
    """Evict until ``slots`` device slots are free, waiting for write-backs if they are needed.

    Write-back eviction frees device pages only once a backup is
    acknowledged. An allocation cannot wait for a later poll, so while the
    pool is still short and write-backs are pending, this starts their
    copies, waits for every copy in flight, applies the acknowledgements (in
    issue order; the log records them) and evicts again, as SGLang's
    write-back eviction waits for its backups. It stops when the pool has
    room, when no write-back is pending, or when waiting freed nothing (the
    backups failed, or their nodes were locked meanwhile); a write-back it
    started is then applied, never left in flight.
    """
    allocator = cache.tiers.device.allocator
    evict_device(cache, slots - allocator.free_slots)
    while allocator.free_slots < slots and cache._evict_after_ack:
        before = allocator.free_slots
        transfers.settle(cache)
        if allocator.free_slots == before:
            return
        evict_device(cache, slots - allocator.free_slots)
