"""The design's invariants, checked on a live cache (debug mode and tests).

Numbers follow shared/design/residency.md. A violation raises
:class:`~fsm_cache.errors.InvariantViolation` naming the invariant, the node
and the operation after which it was found.

One cache checks invariants 1 to 9 (:data:`CHECKED`), and two that callers
rely on beyond the design's list: 11, a node on the device never hangs under
a node still loading (so a lookup's device prefix is contiguous and its pages
hold exactly its tokens' KV), and 12, no node is ``writing`` or ``loading``
without a copy in flight, queued, or about to be copied again (nothing is
stuck). With a storage tier (:data:`CHECKED_WITH_STORAGE`) invariant 2
counts a host copy being fetched as held (the read fills it, or fails and
removes the node), 12 also covers stores and fetches in flight, and 13 says a
lookup cannot reach KV that is not there yet: no node hangs under a node
whose only copy is still being read from storage, and a host copy is being
fetched exactly when its storage pages are being read. Invariant 10 (every rank
of a tensor-parallel group applies the same transitions in the same order)
needs the other ranks' histories, which one cache cannot see:
:meth:`fsm_cache.distributed.agreement.DistributedCache.verify_agreement` checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from fsm_cache.cache.tree import RadixTree, TreeNode
from fsm_cache.errors import InvariantViolation
from fsm_cache.memory.pages import FREE, REQUEST
from fsm_cache.memory.tiers import Tiers
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import DEVICE_HELD, FETCHING, HOST_HELD, HOST_VALID
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import host_machine, load_shipped


Violation = tuple[int, str, str]
"""A broken invariant: its number, where (a node, a page or a pool), and what is wrong."""

CHECKED: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12)
"""The invariants :func:`check` checks on one cache (10 is across ranks)."""
CHECKED_WITH_STORAGE: tuple[int, ...] = (*CHECKED, 13)
"""The invariants :func:`check` checks on one cache with a storage tier."""

COPYING: frozenset[str] = frozenset({"writing", "loading"})
"""States in which a node waits for a copy's acknowledgement."""

HOST_EVICTED: frozenset[str] = frozenset(
    t.dest for t in host_machine().transitions if t.event == "evict_host"
)
"""Host states that ``evict_host`` leaves a node in, read from the spec."""


class Copies(Protocol):
    """What the invariant checks read of a cache's copies."""

    def pending(self) -> frozenset[int]:
        """The ids of nodes with a copy in flight, queued, or to be copied again."""
        ...


class Checked(Protocol):
    """What the invariant checks read of a cache."""

    @property
    def transfers(self) -> Copies:
        """The copies in flight (invariant 12)."""
        ...

    @property
    def tree(self) -> RadixTree:
        """The radix tree."""
        ...

    @property
    def tiers(self) -> Tiers:
        """The pools and the copy engine."""
        ...

    @property
    def policy(self) -> WritePolicy:
        """The write policy (invariants 3 and 4 depend on it)."""
        ...


def check(cache: Checked, after: str = "", storage: Copies | None = None) -> None:
    """Raise on the first broken invariant of ``cache``; return if all hold.

    Checks invariants 1 to 9, node by node (parents first), then the pools.
    Invariant 4 (eviction) is checked on what an eviction leaves: no lock on a
    node off the device, no pin on a node evicted from the host and, in
    write-through policies, no host copy below one. A device eviction of a
    node with a device-resident child shows as invariant 1 at the child, and
    a host eviction that keeps a node the device no longer holds shows as
    invariant 2. Invariant 10 needs every rank:
    :meth:`fsm_cache.distributed.agreement.DistributedCache.verify_agreement` checks it.

    Args:
        cache: The cache to check.
        after: The operation just run, named in the message.
        storage: The cache's storage copies in flight, if it has a storage tier.

    Raises:
        InvariantViolation: ``invariant N broken at <where>[ after <operation>]:
            <what is wrong>``; <where> is ``node I (<residency>)``, a page or a pool.
    """
    for number, where, detail in findings(cache, storage):
        suffix = f" after {after}" if after else ""
        raise InvariantViolation(f"invariant {number} broken at {where}{suffix}: {detail}")


def findings(cache: Checked, storage: Copies | None = None) -> Iterator[Violation]:
    """Yield every broken invariant of ``cache``, node by node, then the pools.

    With ``storage`` (the storage tier's copies) the storage rules are checked too.
    """
    write_through = cache.policy.value != "write_back"
    pending = cache.transfers.pending()
    stored = storage.pending() if storage is not None else frozenset()
    for node in cache.tree:
        where = f"node {node.id} ({node.residency()})"
        for rule in _NODE_RULES:
            found = rule(node, write_through)
            if found:
                yield found[0], where, found[1]
        copying = node.host if node.host in COPYING else node.device
        if copying in COPYING and node.id not in pending:
            yield 12, where, f"{copying} with no copy in flight or queued: it can never finish"
        if storage is not None:
            yield from _storage_rules(node, stored)
        yield from _pages(node, cache.tree.page_size)
    yield from _pools(cache)


STORAGE_COPYING: frozenset[str] = frozenset({"storing", "reading"})
"""Storage states in which a node waits for a storage copy's acknowledgement."""


def _storage_rules(node: TreeNode, pending: frozenset[int]) -> Iterator[Violation]:
    """Invariants 12 and 13 of a node of a cache with a storage tier."""
    where = f"node {node.id} ({node.residency()}, storage {node.storage})"
    if (node.storage in STORAGE_COPYING or node.host == FETCHING) and node.id not in pending:
        state = node.storage if node.storage in STORAGE_COPYING else node.host
        yield 12, where, f"{state} with no storage copy in flight or queued: it can never finish"
    if (node.host == FETCHING) != (node.storage == "reading"):
        yield 13, where, "a host copy is fetched exactly while its storage pages are read"
    if node.host == FETCHING and node.device == "absent":
        child = next((c for c in node.children.values() if c.host != FETCHING), None)
        if child is None:
            return  # no children, or the parts of a fetch split in flight: nothing to reach
        yield (
            13,
            where,
            (
                f"child node {child.id} hangs under a node whose KV is still being read from"
                " storage: a lookup would reach it first"
            ),
        )


def _inner_parent(node: TreeNode) -> TreeNode | None:
    """Return the parent unless it is a root (roots hold nothing and never move)."""
    parent = node.parent
    return parent if parent is not None and parent.parent is not None else None


def _prefix_closed(node: TreeNode, _: bool) -> tuple[int, str] | None:
    parent = _inner_parent(node)
    if parent is not None and node.device in DEVICE_HELD and parent.device not in DEVICE_HELD:
        return 1, f"on the device under node {parent.id}, which is {parent.device}"
    return None


def _usable_prefix(node: TreeNode, _: bool) -> tuple[int, str] | None:
    parent = _inner_parent(node)
    if parent is not None and node.device == "resident" and parent.device == "loading":
        return 11, f"on the device under node {parent.id}, which is still loading"
    return None


def _held_somewhere(node: TreeNode, _: bool) -> tuple[int, str] | None:
    # a host copy being fetched is filled by its read, or the failed read removes the node
    if node.device == "absent" and node.host not in HOST_VALID and node.host != FETCHING:
        return 2, "neither tier holds its KV"
    return None


def _backup_prefix_closed(node: TreeNode, write_through: bool) -> tuple[int, str] | None:
    parent = _inner_parent(node)
    backed = write_through and node.host in HOST_VALID
    if parent is not None and backed and parent.host not in HOST_VALID:
        return 3, f"backed under node {parent.id}, which is {parent.host}"
    return None


def _eviction_honoured(node: TreeNode, write_through: bool) -> tuple[int, str] | None:
    if node.locks > 0 and node.device not in DEVICE_HELD:
        return 4, "off the device while locked: device eviction takes only unlocked nodes"
    if node.host not in HOST_EVICTED:
        return None
    if node.pins > 0:
        return 4, "evicted from the host while pinned: host eviction takes only unpinned nodes"
    # NOTE: under write-back a child may be backed up after its parent's host copy went.
    children = node.children.values() if write_through else ()
    held = next((c for c in children if c.host in HOST_HELD), None)
    if held is not None:
        return 4, (
            f"evicted from the host while child node {held.id} holds a host copy "
            f"({held.host}): host eviction takes only host leaves"
        )
    return None


def children_locks(node: TreeNode) -> int:
    """The locks ``node``'s children hold: ``node`` holds each of them too.

    A lock is taken on a node and every ancestor below the root, so a node's
    locks are at least its children's (invariant 6); those above are its own.
    """
    return sum(child.locks for child in node.children.values())


def _locks_propagate(node: TreeNode, _: bool) -> tuple[int, str] | None:
    below = children_locks(node)
    if node.locks < below:
        return 6, f"{node.locks} locks but its children hold {below}"
    return None


_REGIONS = as_system(load_shipped("residency_storage")).regions
"""The residency regions and their machines: each state's invariant is read from the spec.

The storage composition's: its host machine extends the plain one by ``fetching``
and its storage region reads ``unstored`` on a cache without a storage tier."""


def _counts(node: TreeNode, _: bool) -> tuple[int, str] | None:
    """Invariant 8: no count is negative, and each state's invariant from the spec holds."""
    if node.pins < 0 or node.locks < 0:
        return 8, "a count is negative"
    values = {"pins": node.pins, "locks": node.locks}
    for region, machine in _REGIONS:
        state = machine.state(getattr(node, region))
        if not state.invariant.holds(values):
            return 8, f"{region} {state.name} requires {state.invariant}"
    return None


_NODE_RULES: tuple[Callable[[TreeNode, bool], tuple[int, str] | None], ...] = (
    _prefix_closed,
    _usable_prefix,
    _held_somewhere,
    _backup_prefix_closed,
    _eviction_honoured,
    _locks_propagate,
    _counts,
)


def _pages(node: TreeNode, page: int) -> Iterator[Violation]:
    where = f"node {node.id} ({node.residency()})"
    pages = len(node.key) // page
    if len(node.key) % page:
        yield 9, where, f"key of {len(node.key)} tokens is not whole pages of {page}"
    if len(node.device_pages) != (pages if node.device in DEVICE_HELD else 0):
        yield 9, where, f"{len(node.device_pages)} device pages for {pages} pages of key"
    if len(node.host_pages) != (pages if node.host in HOST_HELD else 0):
        yield 9, where, f"{len(node.host_pages)} host pages for {pages} pages of key"


def _pools(cache: Checked) -> Iterator[Violation]:
    tiers = cache.tiers
    for pool, attr, busy in (
        (tiers.device, "device_pages", tiers.copier.busy_device_pages()),
        (tiers.host, "host_pages", tiers.copier.busy_host_pages()),
    ):
        alloc = pool.allocator
        try:
            alloc.check()
        except InvariantViolation as exc:
            yield 7, f"{pool.name} pool", str(exc)
        owned = 0
        for node in cache.tree:
            for p in getattr(node, attr):
                owned += 1
                if alloc.owner_of(p) != node.id:
                    yield (
                        7,
                        f"{pool.name} page {p}",
                        f"held by node {node.id}, owned by {alloc.owner_of(p)}",
                    )
        # pages a request took with alloc_slots and has not inserted or freed yet
        requested = sum(alloc.owner_of(p) == REQUEST for p in range(alloc.num_pages))
        if owned + requested != alloc.num_pages - alloc.free_pages:
            yield (
                7,
                f"{pool.name} pool",
                f"{alloc.num_pages - alloc.free_pages} pages used, {owned} held by nodes "
                f"and {requested} by requests",
            )
        for p in sorted(busy):
            if alloc.owner_of(p) == FREE:
                yield 5, f"{pool.name} page {p}", "freed while a copy still uses it"
