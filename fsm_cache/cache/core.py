"""The cache's core: the tree, the residency machine, and what every step records.

:class:`CacheCore` owns the radix tree, the compiled residency machine, the
access clock, the running counters and the event log. Every residency change
of the cache goes through :meth:`CacheCore.fire`, so each applied transition
is counted and logged in one place and each refusal is counted before it
propagates. The other parts (:class:`~fsm_cache.cache.transfers.Transfers`,
:class:`~fsm_cache.cache.eviction.Evictor`) are handed the core and never
reach past it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from fsm_cache.cache.eventlog import Entry, EventLog
from fsm_cache.cache.metrics import Counters
from fsm_cache.cache.tree import Pages, RadixTree, TreeNode
from fsm_cache.engine import trail
from fsm_cache.engine.core import Effect
from fsm_cache.errors import BadArgument, EffectFailed, IllegalTransition, InvariantViolation
from fsm_cache.memory.tiers import Tiers
from fsm_cache.residency import AnyEvent, Residency, split_prefix


trail.internal(__file__)

_EVICTED = {"evict_device": "device", "evict_host": "host"}
"""The tier each eviction event frees, for :attr:`Counters.evicted_tokens`."""

SplitListener = Callable[[TreeNode, TreeNode], None]
"""Called as ``listener(prefix, suffix)`` after a node was split, pages re-homed."""


class CacheCore:
    """The tree, the machine, the clock, staged pages, the counters and the log of one cache.

    Args:
        page_size: Tokens per page of the tree's keys.
        tiers: The memory tiers; a split re-homes page ownership in them.
        trail: Keep call sites of recent events per node (None: the environment's default).
        log_limit: Most entries the event log keeps (None: all of them).
    """

    def __init__(
        self, page_size: int, tiers: Tiers, trail: bool | None, log_limit: int | None
    ) -> None:
        self._tiers = tiers
        self._trail = trail
        self._log_limit = log_limit
        self._split_listeners: list[SplitListener] = []
        self.machine: Residency  # compiled by bind(), once the parts its effects use exist
        self.tree = RadixTree(page_size, on_split=self._split, hand_over=tiers.reassign)
        self.counters = Counters()
        self.log = EventLog(self._log_limit)
        self.clock = 0
        self._staged: dict[int, Pages] = {}

    def bind(self, effects: Mapping[str, Effect], *, storage: bool = False) -> None:
        """Compile the residency machine with the cache's memory effects (once, at construction).

        The effects close over the parts that are built around this core, so
        the core exists first and takes its effects afterwards. With
        ``storage`` the machine is ``residency_storage.toml``'s (a storage tier
        below the host), whose effects must be among ``effects`` too.
        """
        self.machine = Residency(effects=effects, trail=self._trail, storage=storage)

    def on_split(self, listener: SplitListener) -> None:
        """Call ``listener`` after every split (a part re-homes what it holds for the suffix)."""
        self._split_listeners.append(listener)

    def reset(self) -> None:
        """Start an empty tree, counters, log and clock; the machine and listeners stay.

        Leases still held on the old tree are void: a later release raises
        LeaseError naming the caller of the reset as the release.
        """
        self.machine.engine.leases.void(trail.caller_site())
        self.tree = RadixTree(
            self.tree.page_size, on_split=self._split, hand_over=self._tiers.reassign
        )
        self.counters = Counters()
        self.log = EventLog(self._log_limit)
        self.clock = 0
        self._staged = {}

    def stage(self, node: TreeNode, pages: Pages) -> None:
        """Hold device ``pages`` for ``node``'s next ``load`` or ``adopt``, whose effect takes them."""
        self._staged[node.id] = pages

    def take_staged(self, node_id: int) -> Pages:
        """Return and forget the pages staged for node ``node_id`` (the effect's side).

        Raises:
            BadArgument: Nothing is staged: ``load`` or ``adopt`` was fired by
                hand, without the operation that allocates its pages.
        """
        try:
            return self._staged.pop(node_id)
        except KeyError:
            raise BadArgument(
                "no device pages are staged for it (load_back or insert allocate them;"
                " the event alone cannot)"
            ) from None

    def drop_staged(self, node_ids: Iterable[int]) -> None:
        """Forget the pages staged for ``node_ids``, if any (an operation that failed midway).

        Without it a ``load`` or ``adopt`` fired later by hand would take pages
        the failed operation gave back, instead of being refused.
        """
        for node_id in node_ids:
            self._staged.pop(node_id, None)

    def fire(self, node: TreeNode, event: AnyEvent) -> None:
        """Fire ``event`` at ``node``: counted and logged if applied, counted if refused.

        Raises:
            IllegalTransition: The spec refuses the event; nothing changed.
            EffectFailed: An effect failed; nothing changed.
        """
        try:
            self.machine.verb(event)(node)
        except (IllegalTransition, EffectFailed):
            self.counters.refused[event] += 1
            raise
        self._applied(node, event)

    def attempt(self, node: TreeNode, event: AnyEvent) -> bool:
        """Fire ``event`` at ``node`` if the spec accepts it now; False, changing nothing, if not.

        For the cache's own choices (a leaf to evict, a backup the write policy
        wants), picked by tests that mirror the shipped rules: where a spec
        adds a rule, the node is passed by instead of failing the operation,
        at no cost beyond the fire (:meth:`allowed` first would check twice).
        A refusal is counted as :meth:`fire` counts one, so that a choice the
        spec keeps refusing shows in ``stats().refused``.

        Raises:
            EffectFailed: An effect failed; nothing changed.
        """
        try:
            self.machine.verb(event)(node)
        except IllegalTransition:
            self.counters.refused[event] += 1
            return False
        except EffectFailed:
            self.counters.refused[event] += 1
            raise
        self._applied(node, event)
        return True

    def _applied(self, node: TreeNode, event: AnyEvent) -> None:
        """Count and log ``event``, just applied at ``node``."""
        self.counters.transitions[event] += 1
        tier = _EVICTED.get(event)
        if tier is not None:  # counted where it happens: eviction has many callers
            self.counters.evicted_tokens[tier] += len(node.key)
        self.log.transition(node.id, event)

    def allowed(self, node: TreeNode, event: AnyEvent) -> bool:
        """Return whether ``event`` would be accepted at ``node`` now, changing nothing."""
        return self.machine.allowed(node, event)

    def born(self, node: TreeNode, birth: str) -> None:
        """Put a new leaf into the states of the spec's ``birth`` (e.g. ``discovered``), logged.

        Raises:
            SpecError: The spec declares no such birth; ``node`` is unchanged.
        """
        self.machine.engine.init(node, node.id, birth)
        self.log.transition(node.id, f"born:{birth}")

    def touch(self, nodes: Iterable[TreeNode]) -> None:
        """Mark ``nodes`` used now (one tick of the clock) and count a hit on each."""
        self.clock += 1
        clock = self.clock
        for node in nodes:
            node.last_access = clock
            node.hit_count += 1

    def delete(self, node: TreeNode) -> None:
        """Remove a leaf that holds no data any more from the tree, counted and logged."""
        self.tree.remove_leaf(node)
        self.counters.deleted_nodes += 1
        if node.device != "absent":  # an unbacked leaf write-through drops from the device
            self.counters.evicted_tokens["device"] += len(node.key)
        self.log.transition(node.id, "delete")

    def unsplit(self, prefix: TreeNode) -> bool:
        """Take back the split that made ``prefix`` if nothing happened since; return whether it did.

        For an operation that split a node and then failed: from outside the
        cache (an allocator that broke), or short of device pages that the
        eviction it ran could not free: the tree, the node ids and the log
        are then as if the split had never been. Only where that is exactly
        so: nothing is logged after the split but, at most, a lock and then
        an unlock of one node (the path an eviction that changed nothing
        held, see :meth:`Evictor.alloc_device
        <fsm_cache.cache.eviction.Evictor.alloc_device>`), which together
        change nothing and are taken back with it; ``prefix`` is the last
        node made and still in the residency the split gave it, and neither
        half has a copy in flight (which the split would have re-homed onto
        the prefix too). The counters keep the lock and the unlock: they
        count what ran, and a counter never goes down. An event log kept
        shorter than those three entries (``log_limit`` under 3) has dropped
        the split's own entry by then, so there the split stays.

        Raises:
            PoolError: The pools refuse the pages handed back as not the
                prefix's: the cache's own fault. The split stays, and so does the log.
            Exception: Whatever else the page hand-over raises (an allocator
                still broken, from outside the cache); the split stays, and so
                does the log.
        """
        if len(prefix.children) != 1:
            return False
        (suffix,) = prefix.children.values()
        entry = ("transition", prefix.id, f"split:{suffix.id}")
        after = self._held_since(entry)
        if after is None:
            return False
        residency = (prefix.host, prefix.device, prefix.pins, prefix.locks, prefix.storage)
        split = split_prefix(suffix.host, suffix.device, suffix.locks, suffix.storage)
        if residency != (*split, suffix.storage) or not _quiet(prefix):
            return False
        try:
            self.tree.unsplit(prefix)
        except InvariantViolation:  # not the last node made: its id may be known elsewhere
            return False
        for taken in (*reversed(after), entry):
            self.log.retract(taken)
        return True

    def _held_since(self, entry: Entry) -> tuple[Entry, ...] | None:
        """The entries logged after ``entry`` if they change nothing together, else None.

        That is none, or a lock and then an unlock of one node: the hold an
        allocation puts on its path while it evicts, when the eviction
        logged nothing else (no eviction, backup, deletion or acknowledgement).
        """
        entries = self.log.entries
        count = len(entries)
        if count and entries[-1] == entry:
            return ()
        if count < 3 or entries[-3] != entry:
            return None
        lock, unlock = entries[-2], entries[-1]
        if lock[0] != "transition" or lock[2] != "lock" or unlock != (*lock[:2], "unlock"):
            return None
        return lock, unlock

    def _split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        # the prefix's pages are its own already: the tree handed them over before it changed
        for listener in self._split_listeners:
            listener(prefix, suffix)
        self.log.transition(prefix.id, f"split:{suffix.id}")


_QUIET = frozenset({"resident", "absent", "unbacked", "backed", "evicted", "unstored", "stored"})
"""States in which no copy is in flight for a node (nor a read of its stored pages)."""


def _quiet(node: TreeNode) -> bool:
    """Whether no copy is in flight for ``node``: none a split could have re-homed onto a prefix."""
    return node.pins == 0 and {node.device, node.host, node.storage} <= _QUIET
