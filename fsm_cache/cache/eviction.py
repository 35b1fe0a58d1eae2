"""How the cache frees memory: device and host eviction, and allocation under pressure.

:class:`Evictor` owns the candidates for device and for host eviction (a
heap of leaves each, in least recently used order), the write-back evictions
waiting for their backups' acknowledgements, and the nodes host eviction must
spare while an allocation runs. It only chooses which nodes and in what order: every
residency change still goes through the machine (:meth:`CacheCore.fire`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.transfers import Transfers
from fsm_cache.cache.tree import TreeNode
from fsm_cache.errors import InvariantViolation, PoolExhausted
from fsm_cache.memory.tiers import Tiers
from fsm_cache.policy import WritePolicy, deletes_unbacked
from fsm_cache.residency import DEVICE_HELD, FETCHING, HOST_HELD, HOST_VALID, Event


def _device_leaf(node: TreeNode) -> bool:
    return (
        node.parent is not None
        and node.device == "resident"
        and node.locks == 0
        and node.host != "writing"
        and not (node.children and any(c.device in DEVICE_HELD for c in node.children.values()))
    )


def _structural_leaf(nodes: dict[int, TreeNode], node: TreeNode) -> bool:
    """Whether ``node`` is in the tree, holds device pages, and no child is on the device.

    A loading node counts: once its load completes it is a leaf to evict.
    """
    return (
        nodes.get(node.id) is node
        and node.device in DEVICE_HELD
        and not (node.children and any(c.device in DEVICE_HELD for c in node.children.values()))
    )


def _structural_host_leaf(nodes: dict[int, TreeNode], node: TreeNode) -> bool:
    """Whether ``node`` is in the tree, holds host pages but no device ones, and no child host ones.

    A pinned or fetching node counts: once released or landed it is a leaf to evict.
    """
    return (
        nodes.get(node.id) is node
        and node.device == "absent"
        and node.host in HOST_HELD
        and not (node.children and any(c.host in HOST_HELD for c in node.children.values()))
    )


_SLACK = 64
"""Entries a heap may hold beyond twice the tree's nodes before it drops dead and repeated ones."""


class LeafHeap:
    """Leaf candidates of one tier in least-recently-used order, kept across evictions.

    Nodes are pushed when they may have become leaves of the tier. For the
    device: new leaves, parents of evicted or deleted nodes, loaded or adopted
    nodes. For the host: nodes whose device copy went, parents of nodes whose
    host copy went, nodes being fetched. Entries go stale when a node is
    touched, gains a child or leaves the tier; they are checked when popped
    (``structural``), so eviction costs the leaves it looks at, not the tree.
    Only eviction pops, so a tier that is never short (a host pool that holds
    the working set, while the device evicts and loads it back) would keep an
    entry per offer for ever: :meth:`offer` keeps the heap within about twice
    the tree.

    Args:
        structural: Whether a node is still, in the tree, a leaf of the tier
            (whatever keeps it from being evicted right now: locks, pins).
    """

    def __init__(
        self, structural: Callable[[dict[int, TreeNode], TreeNode], bool] = _structural_leaf
    ) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._structural = structural

    def __len__(self) -> int:
        """Return how many entries are filed, stale ones and repeats included."""
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """File ``node`` as a candidate at its current recency."""
        heapq.heappush(self._heap, (node.last_access, node.id, node))

    def offer(self, node: TreeNode, nodes: dict[int, TreeNode]) -> None:
        """File ``node``, first compacting the heap if it outgrew the tree (``nodes``).

        Compacting keeps one entry per node still in the tree, at its current
        recency, where a pop would file it anew: what eviction finds, and in
        what order, is unchanged. It does not ask whether a node is a leaf, so
        it may run inside an effect, before the event changed any state: the
        node offered, the one that may become a leaf, is filed after it.
        Amortised, it costs a constant per offer.
        """
        if len(self._heap) > 2 * len(nodes) + _SLACK:
            kept = {n.id: n for _, _, n in self._heap if nodes.get(n.id) is n}
            self._heap = [(n.last_access, n.id, n) for n in kept.values()]
            heapq.heapify(self._heap)
        self.push(node)

    def pop(self, nodes: dict[int, TreeNode]) -> TreeNode | None:
        """Return the least recently used candidate still a structural leaf of the tier, or None.

        Args:
            nodes: The tree's nodes by id; a candidate no longer among them is dropped.
        """
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._structural(nodes, node):
                continue
            if stamp != node.last_access:  # touched since it was pushed: file it anew
                self.push(node)
                continue
            return node
        return None

    def candidates(self) -> Iterator[TreeNode]:
        """Yield the nodes filed, in no particular order, stale entries and repeats included."""
        for _, _, node in self._heap:
            yield node

    def hold(self, nodes: dict[int, TreeNode], need: int, pages: Callable[[TreeNode], int]) -> bool:
        """Whether the filed nodes still in the tree hold ``need`` pages between them.

        Each counts once, for ``pages(node)`` (0 for one that does not count).
        A quick answer for a check that would otherwise walk the tree: True
        means the tree holds at least that many; False means only that the
        filed nodes do not.
        """
        seen: set[int] = set()
        found = 0
        for _, _, node in self._heap:
            if node.id in seen or nodes.get(node.id) is not node:
                continue
            seen.add(node.id)
            found += pages(node)
            if found >= need:
                return True
        return False


class Evictor:
    """Device and host eviction of one cache, and device allocation that evicts when short.

    Args:
        core: Fires the evictions and owns the tree.
        tiers: The pools.
        transfers: Backs up write-back leaves and waits for their acknowledgements.
        policy: The write policy: whether an unbacked leaf is deleted or backed up first.

    A storage tier below the host registers how to apply its finished copies
    (:meth:`on_short`), which an allocation short of room applies too.
    """

    def __init__(
        self, core: CacheCore, tiers: Tiers, transfers: Transfers, policy: WritePolicy
    ) -> None:
        self._core = core
        self._tiers = tiers
        self._transfers = transfers
        self._policy = policy
        self._leaves = LeafHeap()
        self._host_leaves = LeafHeap(_structural_host_leaf)
        self._waiting: set[int] = set()  # write-back leaves evicted once their backup is acked
        self._spared: frozenset[int] = frozenset()  # nodes host eviction must keep, for now
        # applies a storage tier's finished copies but those of the given node ids; see on_short
        self._storage_finished: Callable[[frozenset[int]], int] | None = None
        transfers.on_ack(self._acknowledged)

    def on_short(self, apply_finished: Callable[[frozenset[int]], int]) -> None:
        """Let an allocation short of room apply a storage tier's finished copies too.

        A store holds its node's host pin until it is applied, so under
        write-back a finished store nobody applied keeps the host room a
        backup needs, and the device room behind it. ``apply_finished`` applies
        the copies that finished, never waiting (under tensor-parallel
        agreement only those the group accepted, so the ranks stay in step),
        except those serving a node whose id it is given: the allocation holds
        those nodes (a path it adopts, a chain it loads), and applying a copy
        may split its nodes or remove them. It returns how many it applied.
        """
        self._storage_finished = apply_finished

    # -- views ---------------------------------------------------------------

    def waiting(self) -> frozenset[int]:
        """Return the ids of write-back leaves to evict once their backup is acknowledged."""
        return frozenset(self._waiting)

    def host_candidates(self) -> frozenset[int]:
        """Return the ids of the nodes filed as host-eviction candidates (tests: every host leaf).

        Host eviction looks only at these: a node that holds host pages but
        no device ones, and no child that holds host pages, must be among them,
        or it would never be evicted.
        """
        return frozenset(node.id for node in self._host_leaves.candidates())

    def filed(self) -> tuple[int, int]:
        """Return the entries the device and the host candidates hold (tests: bounded by the tree)."""
        return len(self._leaves), len(self._host_leaves)

    # -- lifecycle -----------------------------------------------------------

    def offer(self, node: TreeNode) -> None:
        """Make ``node`` a device-eviction candidate (it may have just become a device leaf)."""
        if node.parent is not None:
            self._leaves.offer(node, self._core.tree.nodes)

    def offer_host(self, node: TreeNode) -> None:
        """Make ``node`` a host-eviction candidate (it may have just become a host leaf)."""
        if node.parent is not None:
            self._host_leaves.offer(node, self._core.tree.nodes)

    def reset(self) -> None:
        """Forget every candidate and pending eviction (the tree was emptied)."""
        self._leaves = LeafHeap()
        self._host_leaves = LeafHeap(_structural_host_leaf)
        self._waiting = set()
        self._spared = frozenset()

    # -- device --------------------------------------------------------------

    def evict_device(self, num_tokens: int) -> int:
        """Evict least recently used unlocked device leaves until ``num_tokens`` are freed."""
        return self._evict(num_tokens, device=True)

    def _evict(self, num_tokens: int, *, device: bool) -> int:
        """Evict the least recently used leaves of a tier until ``num_tokens`` are freed.

        Leaves are popped from the tier's candidates; one that cannot go now
        (locked, pinned, loading, being written, spared, or no host room for
        its write-back) is filed again once the loop ends, and so is the leaf
        whose eviction raised: a refusal leaves no candidate unfiled, or it
        would never be evicted.
        """
        leaves = self._leaves if device else self._host_leaves
        freed, held = 0, []
        nodes = self._core.tree.nodes
        try:
            while freed < num_tokens:
                node = leaves.pop(nodes)
                if node is None:
                    break
                held.append(node)  # until it is gone
                tokens = self._evict_device_leaf(node) if device else self._evict_host_leaf(node)
                if tokens is not None:
                    held.pop()
                    freed += tokens
        finally:
            for node in held:
                leaves.push(node)
        return freed

    def _evict_device_leaf(self, node: TreeNode) -> int | None:
        """Evict ``node`` if it is an evictable device leaf; return the device tokens freed now.

        None: it is not one (locked, loading, being written, or its write-back
        eviction waits for its backup), or it cannot go yet (:meth:`_evict_one`).
        """
        if not _device_leaf(node) or node.id in self._waiting:
            return None
        return self._evict_one(node)

    def _evict_one(self, node: TreeNode) -> int | None:
        """Evict one device leaf per the write policy; return the device tokens freed now.

        None: a write-back leaf whose backup finds no host room even after host
        eviction or that the machines refuse to back up yet (its parent's host
        copy is still being fetched), or a leaf whose host copy is still being
        fetched from storage.
        """
        tokens = len(node.key)
        if node.host == FETCHING:
            return None  # its host copy is on its way from storage: evict it once that lands
        if node.host in HOST_VALID:
            # None where a rule of the spec's that the leaf test does not spell out keeps it
            return tokens if self._core.attempt(node, "evict_device") else None
        if deletes_unbacked(self._policy):
            self._delete(node)
            return tokens
        if not self._core.allowed(node, "write") or not self._transfers.try_write(node):
            return None  # write-back: back up, evict once acked (later if refused or no room)
        self._waiting.add(node.id)
        return 0

    def _delete(self, node: TreeNode) -> None:
        """Drop an unbacked, unlocked device leaf with no host copy: its only copy goes."""
        if node.children or node.locks or node.pins or node.host in HOST_HELD:
            raise InvariantViolation(f"node {node.id}: delete refused in {node.residency()}")
        if node.device_pages:
            self._tiers.free_device(node.device_pages, node.id)
            node.device_pages = ()
        parent = node.parent
        self._core.delete(node)
        if parent is not None:
            self.offer(parent)  # it may have just become a device leaf

    def _acknowledged(self, nodes: Sequence[TreeNode], event: Event) -> None:
        """Evict the write-back leaves whose backup was just acknowledged."""
        if event not in ("write_done", "write_failed") or not self._waiting:
            return
        waiting = [n for n in nodes if n.id in self._waiting]
        for at, node in enumerate(waiting):
            self._waiting.discard(node.id)
            if event == "write_done" and self._core.allowed(node, "evict_device"):
                try:
                    self._core.fire(node, "evict_device")
                except BaseException:  # the allocator broke as it freed: evict them later
                    self._refile(waiting[at:])
                    raise
            else:
                self._leaves.push(node)  # locked meanwhile, or the backup failed: evict later

    def _refile(self, nodes: Sequence[TreeNode]) -> None:
        """File ``nodes`` as device leaves again, waiting no more: their eviction broke off."""
        for node in nodes:
            self._waiting.discard(node.id)
            self._leaves.push(node)

    # -- host ----------------------------------------------------------------

    def _host_leaf(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.id not in self._spared
            and node.host == "backed"
            and node.device == "absent"
            and not any(c.host in HOST_HELD for c in node.children.values())
        )

    def host_evictable(self, spare: Sequence[TreeNode] = (), need: int | None = None) -> int:
        """Return the host pages :meth:`evict_host` would free if asked for everything.

        Exactly: a node goes once every child holding a host copy has gone, so
        a node counts when it is a host-only copy, not spared, and every such
        child counts. Lets a caller refuse before evicting anything.

        Every host leaf is filed as a candidate, so the count starts from the
        filed leaves that could go and climbs to a parent once each of its
        children holding a host copy went: it costs the candidates and the
        nodes that could go, never the tree (whose device-resident nodes'
        host copies, under write-through most of the host pool, could not).
        It counts by the shipped rules, without asking the spec (a check per
        candidate would cost about 1% of a write-through step, and a parent
        could not be asked before its children went): a rule a spec adds that
        keeps a node makes this an overestimate, and an allocation it lets
        through evicts what it can and is then refused.

        Args:
            spare: Nodes kept besides those already spared.
            need: Stop counting once this many pages were found (None: count them all).
        """
        spared = self._spared | {n.id for n in spare}
        nodes = self._core.tree.nodes
        left: dict[int, int] = {}  # children holding a host copy not yet gone, per parent reached
        seen: set[int] = set()
        total = 0
        for node in self._host_leaves.candidates():
            if node.id in seen or nodes.get(node.id) is not node:
                continue  # counted, or a stale entry
            if any(c.host in HOST_HELD for c in node.children.values()):
                continue  # not a leaf: counted, if it goes, from its children
            walk: TreeNode | None = node
            while (
                walk is not None
                and walk.id not in spared
                and walk.host == "backed"
                and walk.device == "absent"
            ):
                seen.add(walk.id)
                total += len(walk.host_pages)
                if need is not None and total >= need:
                    return total
                parent = walk.parent
                if parent is None or parent.parent is None:
                    break  # a namespace root holds no host copy to free
                count = left.get(parent.id)
                if count is None:
                    count = sum(1 for c in parent.children.values() if c.host in HOST_HELD)
                left[parent.id] = count - 1
                walk = parent if count == 1 else None  # the last of them went
        return total

    def could_free_host(self, pages: int, spare: Sequence[TreeNode] = ()) -> bool:
        """Whether ``pages`` host pages could be free after :meth:`evict_host`, counting the free.

        An allocation asks before it evicts: one that no eviction can satisfy
        is refused with nothing evicted (check, then act). It counts only
        until enough are found (:meth:`host_evictable`).
        """
        short = pages - self._tiers.host.allocator.free_pages
        return short <= 0 or self.host_evictable(spare, short) >= short

    def evict_host(self, num_tokens: int, spare: Sequence[TreeNode] = ()) -> int:
        """Evict least recently used unpinned host-only leaves, deleting each; return tokens freed.

        The ``spare`` nodes are kept (a prefetch's anchor while its host slots
        are allocated, before the fetching child protects it).
        """
        if not spare:
            return self._evict(num_tokens, device=False)
        kept = self._spared
        self._spared = kept | {n.id for n in spare}
        try:
            return self._evict(num_tokens, device=False)
        finally:
            self._spared = kept

    def _evict_host_leaf(self, node: TreeNode) -> int | None:
        """Evict ``node`` if it is an evictable host leaf; return the host tokens freed.

        None: it is not one (pinned, fetching, or spared). Its host copy's
        going files its parent.
        """
        if not self._host_leaf(node) or not self._core.attempt(node, "evict_host"):
            return None  # the tests above mirror the shipped rules; a spec may add one
        self._drop_if_empty(node)
        return len(node.key)

    def evict_host_node(self, node: TreeNode) -> None:
        """Fire ``evict_host`` on ``node``; delete it when no tier holds it any more.

        A node off the device and without children holds nothing once its host
        copy goes: it leaves the tree, as every host eviction's victim does.

        Raises:
            IllegalTransition: The spec refuses the eviction; nothing changed.
            EffectFailed: A copy still reads or writes its host pages; nothing changed.
        """
        self._core.fire(node, "evict_host")
        self._drop_if_empty(node)

    def _drop_if_empty(self, node: TreeNode) -> None:
        """Delete ``node``, whose host copy just went, if it holds nothing else (no device copy or child)."""
        if node.device == "absent" and not node.children:
            self._core.delete(node)

    # -- allocation under pressure -------------------------------------------

    def alloc_device(
        self, pages: int, keep: TreeNode | None, spare: Sequence[TreeNode] = ()
    ) -> tuple[int, ...]:
        """Take ``pages`` device pages for a request, evicting if the pool is short.

        ``keep`` (or its nearest device-held ancestor) is locked while eviction
        runs, so the path an insert or a load hangs under is never evicted from
        under it; the ``spare`` nodes (host-only nodes about to be adopted or
        loaded) are kept from host eviction meanwhile. An allocation that could
        not fit even if every unlocked device page were evicted is refused
        before anything is evicted.

        Raises:
            PoolExhausted: Too little can be evicted; nothing was allocated, and
                what eviction did stays done (see :meth:`make_room`).
            CopyFailed: A storage fetch :meth:`make_room` applied could not
                write its pages to the host: every copy was applied (that one
                as failed), as a poll applies them; nothing was allocated.
        """
        try:
            return self._tiers.alloc_device(pages, 0)
        except PoolExhausted:
            pass
        while keep is not None and keep.device not in DEVICE_HELD:
            keep = keep.parent
        held = keep if keep is not None and keep.parent is not None else None
        self.refuse_impossible(pages, held)
        if held is not None:
            self._core.fire(held, "lock")
        self._spared = frozenset(n.id for n in spare)
        try:
            self.make_room(pages * self._tiers.page_size)
        finally:
            self._spared = frozenset()
            if held is not None:
                self._core.fire(held, "unlock")
        return self._tiers.alloc_device(pages, 0)

    def refuse_impossible(self, pages: int, keep: TreeNode | None, prefix: int = 0) -> None:
        """Raise PoolExhausted, changing nothing, if eviction could never free ``pages``.

        Operations that would first wait for copies (an insert through a node
        still loading) ask before they wait, and an insert asks before it
        splits a node, so such a refusal changes nothing.

        The bound counts every free page and every page of an unlocked device
        node off ``keep``'s path: no eviction frees more than that. Filed
        device leaves that already reach it answer without walking the tree.

        Args:
            pages: Device pages wanted.
            keep: The node whose path (it and its ancestors) eviction keeps.
            prefix: If not 0, only ``keep``'s first ``prefix`` pages are kept,
                the prefix an insert is about to split off: the rest, the
                suffix, counts as any node off the path, as after the split.
        """
        allocator = self._tiers.device.allocator
        if pages <= allocator.free_pages:
            return
        partial = keep if prefix else None
        if partial is not None:  # the prefix to be is kept with the path above it
            keep = partial.parent
        kept = set()
        while keep is not None:
            kept.add(keep.id)
            keep = keep.parent

        def counted(node: TreeNode) -> int:
            held = node.locks == 0 and node.device in DEVICE_HELD and node.id not in kept
            if not held:
                return 0
            return len(node.device_pages) - (prefix if node is partial else 0)

        need = pages - allocator.free_pages
        if self._leaves.hold(self._core.tree.nodes, need, counted):
            return
        bound = allocator.free_pages + sum(counted(n) for n in self._core.tree)
        if bound < pages:
            size = self._tiers.page_size
            raise PoolExhausted(allocator.name, pages * size, allocator.free_slots)

    def make_room(self, slots: int) -> None:
        """Evict until ``slots`` device slots are free, applying and waiting for copies if needed.

        A leaf still being backed up (write-through) or whose write-back
        eviction waits for its backup frees its device pages only once the
        copy is acknowledged, and a write-back backup needs host room, which a
        store to a storage tier holds (its host pin) until it is applied. An
        allocation cannot wait for a later poll, so while the pool is still
        short this first applies the copies that already finished
        (non-blocking), host copies and storage copies (:meth:`on_short`), and
        evicts again; then, while host copies are in flight or queued, it
        starts the queued copies, waits for every copy in flight, applies the
        acknowledgements (in issue order; the log records them) and the
        storage copies finished meanwhile, and evicts again, as SGLang's
        eviction waits for its backups. It never waits for a storage copy. It
        stops when the pool has room, when no host copy is in flight, or when
        a round changed nothing (the backups failed, or their nodes were
        locked meanwhile); a copy it started is then applied, never left in
        flight.

        Raises:
            CopyFailed: A storage fetch applied here could not write its pages
                to the host (see :meth:`alloc_device`).
        """
        allocator = self._tiers.device.allocator
        self.evict_device(slots - allocator.free_slots)
        if allocator.free_slots >= slots:
            return
        busy = not self._transfers.idle()
        if busy:
            self._transfers.apply_collected(False, "evict")
        if self._apply_storage() or busy:
            self.evict_device(slots - allocator.free_slots)
        rounds = len(self._core.tree.nodes) + 1  # each useful round backs up one more level
        while allocator.free_slots < slots and not self._transfers.idle():
            before = (allocator.free_slots, self._core.counters.transitions.total())
            self._transfers.settle()
            self._apply_storage()
            rounds -= 1
            if rounds <= 0:
                return
            self.evict_device(slots - allocator.free_slots)
            if before == (allocator.free_slots, self._core.counters.transitions.total()):
                return

    def _apply_storage(self) -> int:
        """Apply the storage copies that finished, but those of spared nodes; return how many."""
        if self._storage_finished is None:
            return 0
        return self._storage_finished(self._spared)
