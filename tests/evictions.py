"""What host eviction must do, written the plain way: a walk of the whole tree.

The cache files host-eviction candidates as they arise and looks only at
those; these helpers recompute from the tree what it should find, for the
random-operation tests to compare.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.tree import TreeNode
from fsm_cache.residency import HOST_HELD


def unfiled_host_leaves(cache: HiCache) -> list[int]:
    """Ids of nodes holding host pages but no device ones nor a child with host pages, not filed.

    Pinned and fetching ones included: they become evictable with no event
    of their own that could file them then.
    """
    filed = cache.evictor.host_candidates()
    return [
        n.id
        for n in cache.tree
        if n.device == "absent"
        and n.host in HOST_HELD
        and not any(c.host in HOST_HELD for c in n.children.values())
        and n.id not in filed
    ]


def expected_host_victims(cache: HiCache, num_tokens: int) -> list[int]:
    """The nodes ``cache.evict_host(num_tokens)`` takes, by a least-recently-used walk of the tree.

    A backed, host-only node whose host-holding children have all gone is a
    leaf; the least recently used leaf goes first (ties by id), and its parent
    may become one.
    """
    gone: set[int] = set()

    def leaf(node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.host == "backed"
            and node.device == "absent"
            and all(c.id in gone for c in node.children.values() if c.host in HOST_HELD)
        )

    heap = [(n.last_access, n.id, n) for n in cache.tree if leaf(n)]
    heapq.heapify(heap)
    taken, freed = [], 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if node.id in gone or not leaf(node):
            continue
        gone.add(node.id)
        taken.append(node.id)
        freed += len(node.key)
        parent = node.parent
        if parent is not None and leaf(parent):
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return taken


def host_evicted(cache: HiCache, before: Mapping[int, str]) -> set[int]:
    """Ids of nodes whose host state was ``before`` theirs and whose host copy is gone now."""
    nodes = cache.tree.nodes
    return {
        ident
        for ident, host in before.items()
        if host in HOST_HELD and (ident not in nodes or nodes[ident].host not in HOST_HELD)
    }


def host_evictable(cache: HiCache, spare: Collection[TreeNode] = ()) -> int:
    """The host pages ``cache.evict_host`` frees if asked for everything, by a walk of the tree.

    A node goes once every child holding a host copy has gone: it counts
    when it is a backed, host-only copy, not spared, and every such child counts.
    """
    spared = {n.id for n in spare}
    goes: set[int] = set()
    total = 0
    for node in reversed(list(cache.tree)):  # children before parents
        if node.id in spared or node.host != "backed" or node.device != "absent":
            continue
        if all(c.id in goes for c in node.children.values() if c.host in HOST_HELD):
            goes.add(node.id)
            total += len(node.host_pages)
    return total
