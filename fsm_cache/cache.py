"""HiCache: a hierarchical radix KV cache whose every node is a checked machine.

Behaviour follows SGLang's HiRadixCache (shared/design/residency.md): a radix
tree of token prefixes over a device tier and a pinned host tier, write
policies, LRU device eviction, host eviction of unpinned host leaves, and
load-back of evicted chains. Unlike it, nothing is implicit: every residency
change is an event of ``specs/residency.toml`` fired through the compiled
engine, whose effects move real memory (:mod:`fsm_cache.tiers`), so an
illegal step is refused at the call and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from fsm_cache import slots, trail, transfers
from fsm_cache.errors import EffectFailed, ForeignSlot, IllegalTransition
from fsm_cache.eventlog import EventLog
from fsm_cache.eviction import LeafHeap
from fsm_cache.lease import Lease
from fsm_cache.metrics import Counters, Stats, snapshot
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import Event, Residency
from fsm_cache.tickets import Completion, Direction
from fsm_cache.tiers import CacheConfig, Tiers
from fsm_cache.tree import Pages, RadixTree, TreeNode


trail.internal(__file__)

Lock = Lease
"""The receipt :meth:`HiCache.lock` returns: a lease of ``lock`` released by ``unlock``."""


@dataclass(frozen=True)
class MatchResult:
    """What a prefix lookup found.

    Attributes:
        device_len: Tokens matched on the device (usable now).
        host_len: Tokens matched after those, held on the host only.
        last_device_node: Deepest matched node on the device (a root if none).
        last_host_node: Deepest matched node at all (a root if none).
        device_pages: The device pages of the device-matched prefix, in order.
    """

    device_len: int
    host_len: int
    last_device_node: TreeNode
    last_host_node: TreeNode
    device_pages: Pages


class HiCache:
    """A prefix KV cache over a device tier and a host tier.

    Args:
        config: Sizes, KV layout, policy and thresholds; checked first.

    Raises:
        ConfigError: A configuration value is out of range.
    """

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.config.check()
        self.policy = WritePolicy(self.config.write_policy)
        self.tiers = Tiers(self.config)
        self.tree = RadixTree(self.config.page_size, on_split=partial(transfers.on_split, self))
        self.machine = Residency(effects=transfers.effects(self), audit=self.config.audit)
        self.counters = Counters()
        self.log = EventLog()
        self._clock = 0
        self._tickets: dict[int, transfers.Ticket] = {}
        self._batch: dict[Direction, list[TreeNode]] = {Direction.D2H: [], Direction.H2D: []}
        self._incoming: dict[int, Pages] = {}
        self._evict_after_ack: set[int] = set()
        self.leaf_heap = LeafHeap()

    # -- lookups and inserts -------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Return how much of ``tokens`` is cached on each tier; may split a node."""
        self.log.op("match_prefix", tuple(tokens), namespace)
        key = self.tree.aligned(tuple(tokens))
        walk = self.tree.walk(key, namespace)
        self._touch(walk.path)
        root = self.tree.root(namespace)
        on_device = [n for n in walk.path if n.device == "resident"]
        device_len = sum(len(n.key) for n in on_device)
        self.counters.lookup_tokens += len(key)
        self.counters.device_hit_tokens += device_len
        self.counters.host_hit_tokens += walk.matched - device_len
        self._after("match_prefix")
        return MatchResult(
            device_len=device_len,
            host_len=walk.matched - device_len,
            last_device_node=on_device[-1] if on_device else root,
            last_host_node=walk.path[-1] if walk.path else root,
            device_pages=tuple(p for n in on_device for p in n.device_pages),
        )

    def insert(
        self,
        tokens: Sequence[int],
        device_slots: Sequence[int] | None = None,
        namespace: Hashable = None,
    ) -> int:
        """Cache ``tokens``; return how many were cached already.

        Args:
            tokens: The token ids; cut down to whole pages.
            device_slots: The device slots the request computed ``tokens`` into
                (a multiple of page_size, page-aligned runs). Slots of the part
                already on the device are the caller's to free. If None, the
                cache allocates slots and writes KV derived from the tokens.
            namespace: Keeps equal prefixes of different namespaces apart.

        Raises:
            PoolExhausted: No device pages left even after eviction (nothing changed).
            ForeignSlot: ``device_slots`` are not whole pages.
        """
        self.log.op(
            "insert",
            tuple(tokens),
            namespace,
            None if device_slots is None else tuple(device_slots),
        )
        key = self.tree.aligned(tuple(tokens))
        if device_slots is not None and len(device_slots) < len(key):
            msg = f"{len(device_slots)} device slots for {len(key)} tokens"
            raise ForeignSlot(msg)
        walk = self.tree.walk(key, namespace)
        fresh = slots.fresh_pages(self, walk.path, key, device_slots)
        leaf = None
        if walk.matched < len(key):
            parent = walk.path[-1] if walk.path else self.tree.root(namespace)
            leaf = self.tree.add_leaf(parent, key[walk.matched :], fresh.pop(-1))
            self.tiers.device.allocator.reassign(leaf.device_pages, 0, leaf.id)
            self.leaf_heap.push(leaf)
        for node in walk.path:
            if node.id in fresh:
                self._incoming[node.id] = fresh[node.id]
                self._fire(node, "adopt")
        self._touch((*walk.path, *([leaf] if leaf else [])))
        for node in (*walk.path, *([leaf] if leaf else [])):
            transfers.maybe_backup(self, node)
        self._flush()
        self._after("insert")
        return walk.matched

    def alloc_slots(self, num_tokens: int) -> list[int]:
        """Allocate device slots for a request to compute KV into (evicting if needed).

        The slots belong to the request until :meth:`insert` adopts them or
        :meth:`free_slots` gives them back.

        Raises:
            PoolExhausted: Not enough device memory even after eviction.
        """
        return slots.alloc(self, num_tokens)

    def free_slots(self, device_slots: Sequence[int]) -> None:
        """Give back request-held device slots (e.g. the duplicates of a cached prefix)."""
        slots.free(self, device_slots)

    def backup(self, nodes: Sequence[TreeNode]) -> int:
        """Start backing up ``nodes`` to the host in one batched copy; return how many started.

        For explicit backups (a storage tier, a write-back flush). Nodes the
        machines refuse to write (already backed, writing, off the device) are
        skipped; a full host pool stops the batch where it is.
        """
        self.log.op("backup", tuple(n.id for n in nodes))
        started = transfers.start_writes(self, nodes)
        self._flush()
        self._after("backup")
        return started

    # -- locks ---------------------------------------------------------------

    def pin(self, node: TreeNode) -> Lease:
        """Pin ``node``'s host copy (a storage backup, a prefetch anchor); the lease releases once."""
        self.log.op("pin", node.id)
        self._fire(node, "pin")
        return self.machine.engine.leases.open(node, self._release, "pin", "node")

    def _release(self, node: TreeNode) -> None:
        self.log.op("release", node.id)
        self._fire(node, "release")

    def lock(self, node: TreeNode) -> Lock:
        """Lock ``node`` and its ancestors on the device; the receipt unlocks once."""
        self.log.op("lock", node.id)
        lease = self.machine.lease(node, "lock")
        self._count(node, "lock")
        return lease

    def unlock(self, lock: Lock) -> None:
        """Unlock what ``lock`` locked (a second unlock raises LeaseError)."""
        self.log.op("unlock", lock.record.id)
        lock.release()
        self._count(lock.record, "unlock")
        self._after("unlock")

    # -- memory pressure -----------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; return tokens freed.

        Least recently used unlocked device leaves go first. Backed leaves
        become host-only; unbacked ones are deleted (write-through) or backed
        up and evicted once the copy is acknowledged (write-back; counted when
        the acknowledgement is applied).
        """
        from fsm_cache.eviction import evict_device

        self.log.op("evict", num_tokens)
        freed = evict_device(self, num_tokens)
        self._flush()
        self._after("evict")
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from unpinned host-only leaves; return tokens freed."""
        from fsm_cache.eviction import evict_host

        self.log.op("evict_host", num_tokens)
        freed = evict_host(self, num_tokens)
        self._after("evict_host")
        return freed

    def load_back(self, node: TreeNode) -> list[TreeNode] | None:
        """Start loading the evicted chain ending at ``node``; the whole chain or nothing.

        Returns:
            The nodes now loading (apply completions with :meth:`poll`), or None
            when the chain is shorter than the load-back threshold or device
            memory cannot be freed for it.
        """
        from fsm_cache.eviction import load_chain

        self.log.op("load_back", node.id)
        chain = load_chain(self, node)
        self._flush()
        self._after("load_back")
        return chain

    # -- copies --------------------------------------------------------------

    def poll(self) -> int:
        """Apply every finished copy (in any order); return how many copies were applied."""
        self.log.op("poll")
        return self.apply_completions(self.tiers.copier.poll())

    def apply_completions(self, completions: Sequence[Completion]) -> int:
        """Apply finished copies in the given order, then start any copies they asked for.

        :meth:`poll` applies whatever the copy engine reports; a tensor-parallel
        group applies an agreed prefix of :meth:`issued` instead
        (:mod:`fsm_cache.distributed`).
        """
        for completion in completions:
            self.apply(completion)
        self._flush()
        self._after("poll")
        return len(completions)

    def issued(self) -> list[int]:
        """Return the ids of copies started and not yet applied, in issue order."""
        return list(self._tickets)

    def apply(self, completion: Completion) -> None:
        """Fire the acknowledgement events of one finished copy."""
        transfers.apply_completion(self, completion)

    # -- reporting -----------------------------------------------------------

    def stats(self) -> Stats:
        """Return tier occupancy, hit rates, copies, pins, locks and transition counts."""
        return snapshot(self)

    def check_invariants(self) -> None:
        """Raise InvariantViolation naming the first broken design invariant and node."""
        from fsm_cache.consistency import check

        check(self)

    def reset(self) -> None:
        """Drop everything (copies in flight are drained first) and start empty."""
        self.tiers.copier.drain()
        self.__init__(self.config)  # type: ignore[misc]

    # -- internals -----------------------------------------------------------

    def _fire(self, node: TreeNode, event: Event) -> None:
        try:
            self.machine.verb(event)(node)
        except (IllegalTransition, EffectFailed):
            self.counters.refused[event] += 1
            raise
        self._count(node, event)

    def _count(self, node: Any, event: str) -> None:
        self.counters.transitions[event] += 1
        self.log.transition(node.id, event)

    def _touch(self, nodes: Sequence[TreeNode]) -> None:
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock
            node.hit_count += 1

    def _after(self, operation: str) -> None:
        if self.config.debug:
            from fsm_cache.consistency import check

            check(self, after=operation)

    def _flush(self) -> None:
        """Start one batched copy per direction for the nodes whose events asked for one."""
        transfers.flush(self)
