"""HiCache: a hierarchical radix KV cache whose every node is a checked machine.

Behaviour follows SGLang's HiRadixCache (shared/design/residency.md): a radix
tree of token prefixes over a device tier and a pinned host tier, write
policies, LRU device eviction, host eviction of unpinned host leaves, and
load-back of evicted chains. Unlike it, nothing is implicit: every residency
change is an event of ``specs/residency.toml`` fired through the compiled
engine, whose effects move real memory (:mod:`fsm_cache.memory.tiers`), so an
illegal step is refused at the call and changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial

from fsm_cache.cache import slots, transfers
from fsm_cache.cache.eventlog import EventLog
from fsm_cache.cache.eviction import LeafHeap, evict_device, evict_host, load_chain
from fsm_cache.cache.metrics import Counters, Stats, snapshot
from fsm_cache.cache.transfers import Operation
from fsm_cache.cache.tree import Pages, RadixTree, TreeNode
from fsm_cache.engine import trail
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import EffectFailed, IllegalTransition, LeaseError
from fsm_cache.memory.tickets import Completion, Direction
from fsm_cache.memory.tiers import CacheConfig, Tiers
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import Event, Residency


trail.internal(__file__)

Lock = Lease
"""The receipt :meth:`HiCache.lock` returns; releasing it (``unlock``, ``release()``,
the end of a ``with`` block) is the cache's ``unlock``, once."""


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

    Every public operation is logged with its arguments (:attr:`log`), starts
    the copies it queued even when it raises, and in debug mode checks every
    design invariant when it returns.

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
        self.machine = Residency(effects=transfers.effects(self), audit=self.config.audit)
        self._start()

    def _start(self) -> None:
        """Set up an empty tree and fresh bookkeeping (construction and :meth:`reset`)."""
        self.tree = RadixTree(self.config.page_size, on_split=partial(transfers.on_split, self))
        self.counters = Counters()
        self.log = EventLog()
        self._clock = 0
        self._copies = 0  # copies started since construction or reset: their log numbers
        self._tickets: dict[int, transfers.Ticket] = {}
        self._batch: dict[Direction, list[TreeNode]] = {Direction.D2H: [], Direction.H2D: []}
        self._incoming: dict[int, Pages] = {}
        self._evict_after_ack: set[int] = set()
        self._spared: frozenset[int] = frozenset()  # nodes host eviction must keep, for now
        self.leaf_heap = LeafHeap()

    # -- lookups and inserts -------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Return how much of ``tokens`` is cached on each tier; may split a node."""
        with Operation(self, "match_prefix", tuple(tokens), namespace):
            key = self.tree.aligned(tuple(tokens))
            walk = self.tree.walk(key, namespace)
            self._touch(walk.path)
            root = self.tree.root(namespace)
            on_device = [n for n in walk.path if n.device == "resident"]
            device_len = sum(len(n.key) for n in on_device)
            self.counters.lookup_tokens += len(key)
            self.counters.device_hit_tokens += device_len
            self.counters.host_hit_tokens += walk.matched - device_len
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
                (whole pages, at least one slot per token). Slots of the part
                already on the device are the caller's to free; the others must
                be held by the request (:meth:`alloc_slots`), each page once.
                If None, the cache allocates slots and writes KV derived from
                the tokens.
            namespace: Keeps equal prefixes of different namespaces apart.

        Raises:
            ForeignSlot: ``device_slots`` are too few, not whole pages, repeat a
                page, or name a page the request does not hold. Nothing was
                inserted (a node may have been split at a page boundary).
            PoolExhausted: Too little device memory even after eviction (only
                when ``device_slots`` is None). Nothing was inserted; what the
                eviction did stays done: the leaves it evicted are host-only
                (or deleted, under write-through), and the write-backs it
                started were waited for and applied.
        """
        args = None if device_slots is None else tuple(device_slots)
        with Operation(self, "insert", tuple(tokens), namespace, args):
            key = self.tree.aligned(tuple(tokens))
            slots.check_count(device_slots, len(key))
            walk = self.tree.walk(key, namespace)
            fresh = slots.fresh_pages(self, walk.path, key, device_slots)
            added = slots.take_over(self, walk, key, fresh, namespace)
            self._touch((*walk.path, *added))
            for node in (*walk.path, *added):
                transfers.maybe_backup(self, node)
            return walk.matched

    def alloc_slots(self, num_tokens: int) -> list[int]:
        """Allocate device slots for a request to compute KV into (evicting if needed).

        The slots belong to the request until :meth:`insert` adopts them or
        :meth:`free_slots` gives them back.

        Raises:
            PoolExhausted: Not enough device memory even after eviction; as
                for :meth:`insert`, what the eviction did stays done.
        """
        with Operation(self, "alloc_slots", num_tokens):
            return slots.alloc(self, num_tokens)

    def free_slots(self, device_slots: Sequence[int]) -> None:
        """Give back request-held device slots (e.g. the duplicates of a cached prefix)."""
        with Operation(self, "free_slots", tuple(device_slots)):
            slots.free(self, device_slots)

    def backup(self, nodes: Sequence[TreeNode]) -> int:
        """Start backing up ``nodes`` to the host in one batched copy; return how many started.

        For explicit backups (a storage tier, a write-back flush). Nodes the
        machines refuse to write (already backed, writing, off the device) are
        skipped; a full host pool stops the batch where it is.
        """
        with Operation(self, "backup", tuple(n.id for n in nodes)):
            return transfers.start_writes(self, nodes)

    # -- locks ---------------------------------------------------------------

    def pin(self, node: TreeNode) -> Lease:
        """Pin ``node``'s host copy (a storage backup, a prefetch anchor); the lease releases once."""
        return self._take(node, "pin", "release")

    def lock(self, node: TreeNode) -> Lock:
        """Lock ``node`` and its ancestors on the device; the receipt unlocks once.

        Releasing the receipt any way (``unlock(lock)``, ``lock.release()``, the
        end of ``with cache.lock(node):``) runs the cache's unlock: logged,
        counted and checked. A second release raises LeaseError.
        """
        return self._take(node, "lock", "unlock")

    def unlock(self, lock: Lock) -> None:
        """Unlock what ``lock`` locked.

        Raises:
            LeaseError: ``lock`` was released already, or is not a lock receipt.
        """
        if lock.event != "lock":
            raise LeaseError(
                f"node {lock.record.id}: unlock takes a lock receipt, not a {lock.event}"
            )
        lock.release()

    def _take(self, node: TreeNode, event: Event, give_back: Event) -> Lease:
        """Fire ``event`` as one operation; the receipt fires ``give_back`` as another."""
        self._operate(event, node)
        return self.machine.engine.leases.open(
            node, partial(self._operate, give_back), event, "node"
        )

    def _operate(self, event: Event, node: TreeNode) -> None:
        with Operation(self, event, node.id):
            self._fire(node, event)

    # -- memory pressure -----------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; return tokens freed.

        Least recently used unlocked device leaves go first. Backed leaves
        become host-only; unbacked ones are deleted (write-through) or backed
        up and evicted once the copy is acknowledged (write-back; counted when
        the acknowledgement is applied). An allocation that needs the room now
        (:meth:`insert`, :meth:`alloc_slots`, :meth:`load_back`) waits for those
        acknowledgements instead.
        """
        with Operation(self, "evict", num_tokens):
            return evict_device(self, num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from unpinned host-only leaves; return tokens freed."""
        with Operation(self, "evict_host", num_tokens):
            return evict_host(self, num_tokens)

    def load_back(self, node: TreeNode) -> list[TreeNode] | None:
        """Start loading the evicted chain ending at ``node``; the whole chain or nothing.

        Returns:
            The nodes now loading (apply completions with :meth:`poll`), or None
            when the chain is shorter than the load-back threshold or device
            memory cannot be freed for it.
        """
        with Operation(self, "load_back", node.id):
            return load_chain(self, node)

    # -- copies --------------------------------------------------------------

    def poll(self) -> int:
        """Apply every finished copy (in any order); return how many copies were applied."""
        with Operation(self, "poll"):
            return transfers.apply_acks(self, self._collect(wait=False), "poll")

    def apply_completions(self, completions: Sequence[Completion]) -> int:
        """Apply finished copies in the given order, then start any copies they asked for.

        :meth:`poll` applies whatever the copy engine reports; a tensor-parallel
        group applies an agreed prefix of :meth:`issued` instead
        (:mod:`fsm_cache.distributed.agreement`). Either way the log records which copies
        were applied, in order, and whether each succeeded.
        """
        with Operation(self, "apply_completions"):
            return transfers.apply_acks(self, completions, "apply_completions")

    def apply(self, completion: Completion) -> None:
        """Apply one finished copy: :meth:`apply_completions` of one."""
        self.apply_completions([completion])

    def issued(self) -> list[int]:
        """Return the ids of copies started and not yet applied, in issue order."""
        return list(self._tickets)

    def _collect(self, wait: bool) -> list[Completion]:
        """Return the copies the engine reports finished; with ``wait``, all of them, in issue order."""
        copier = self.tiers.copier
        if not wait:
            return copier.poll()
        order = {ident: i for i, ident in enumerate(self._tickets)}
        return sorted(copier.drain(), key=lambda c: order.get(c.ticket.id, len(order)))

    # -- reporting -----------------------------------------------------------

    def stats(self) -> Stats:
        """Return tier occupancy, hit rates, copies, pins, locks and transition counts."""
        return snapshot(self)

    def check_invariants(self) -> None:
        """Raise InvariantViolation naming the first broken design invariant and node."""
        from fsm_cache.cache.invariants import check

        check(self)

    def reset(self) -> None:
        """Drop everything and start empty, keeping the pools and the copy engine.

        Copies in flight are waited for and discarded. The KV tensors and the
        pinned host memory are reused as they are (every page is free again, so
        their old contents are never read). Leases still held are void: a later
        release raises LeaseError naming this reset as the release.
        """
        self.tiers.copier.drain()
        self.tiers.reset()
        site = trail.caller_site()
        for lease in self.machine.engine.leases.outstanding():
            lease.released_at = site
            self.machine.engine.leases.closed(lease)
        self._start()

    # -- internals -----------------------------------------------------------

    def _fire(self, node: TreeNode, event: Event) -> None:
        try:
            self.machine.verb(event)(node)
        except (IllegalTransition, EffectFailed):
            self.counters.refused[event] += 1
            raise
        self.counters.transitions[event] += 1
        self.log.transition(node.id, event)

    def _touch(self, nodes: Sequence[TreeNode]) -> None:
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock
            node.hit_count += 1
