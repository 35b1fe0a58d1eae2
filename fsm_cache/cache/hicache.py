"""HiCache: a hierarchical radix KV cache whose every node is a checked machine.

Behaviour follows SGLang's HiRadixCache (shared/design/residency.md): a radix
tree of token prefixes over a device tier and a pinned host tier, write
policies, LRU device eviction, host eviction of unpinned host leaves, and
load-back of evicted chains. Unlike it, nothing is implicit: every residency
change is an event of ``specs/residency.toml`` fired through the compiled
engine, whose effects move real memory (:mod:`fsm_cache.memory.tiers`), so an
illegal step is refused at the call and changes nothing. With a storage tier
(a :class:`~fsm_cache.cache.storage_tier.StorageConfig`) the machine is
``specs/residency_storage.toml``'s and the cache also backs nodes up to a store
and prefetches stored prefixes on a match
(:class:`~fsm_cache.cache.storage_tier.StorageTier`).

:class:`HiCache` is the facade and owns no state of its own: the core (tree,
machine, counters, log), :class:`~fsm_cache.cache.transfers.Transfers`
(copies and acknowledgements) and :class:`~fsm_cache.cache.eviction.Evictor`
(eviction) each own theirs, and the spec's effects are bound once to them
(:class:`~fsm_cache.cache.effects.MemoryEffects`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import chain
from types import TracebackType
from typing import SupportsIndex, cast, overload

from fsm_cache.cache import arguments, invariants, slots
from fsm_cache.cache.arguments import Tokens
from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.effects import MemoryEffects
from fsm_cache.cache.eventlog import EventLog
from fsm_cache.cache.eviction import Evictor
from fsm_cache.cache.metrics import Counters, Stats, snapshot
from fsm_cache.cache.storage_tier import (
    STORAGE_ACKNOWLEDGEMENTS,
    StorageConfig,
    StorageTier,
    local_prefix,
)
from fsm_cache.cache.transfers import ACKNOWLEDGEMENTS, AckSourceFactory, Transfers
from fsm_cache.cache.tree import Pages, RadixTree, TreeNode, Walk
from fsm_cache.engine import trail
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import (
    BadArgument,
    CacheClosed,
    ConcurrentUse,
    ConfigError,
    CopyFailed,
    EffectFailed,
    EffectReentered,
    ForeignSlot,
    FsmCacheError,
    LeaseError,
    PoolExhausted,
)
from fsm_cache.memory.pages import REQUEST, slots_of
from fsm_cache.memory.tickets import Completion
from fsm_cache.memory.tiers import CacheConfig, Tiers
from fsm_cache.policy import WritePolicy, parent_allows_backup, worth_loading
from fsm_cache.residency import (
    DEVICE_HELD,
    DEVICE_READABLE,
    HOST_VALID,
    AnyEvent,
    Event,
    Residency,
    StorageEvent,
)
from fsm_cache.spec.shipped import load_shipped


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
        storage_len: Tokens after those whose pages are being fetched from a
            storage tier (a prefetch in flight; usable once a poll applies it).
        page_runs: The matched device nodes' pages, one tuple per node, as
            they were at the lookup (node page tuples are immutable), so
            ``device_pages`` is flattened only for the callers that read it.
    """

    device_len: int
    host_len: int
    last_device_node: TreeNode
    last_host_node: TreeNode
    page_runs: tuple[Pages, ...] = field(repr=False)
    storage_len: int = 0

    def __copy__(self) -> MatchResult:
        """Return the result itself: it is immutable (and, compiled, has no other way to copy)."""
        return self

    @cached_property
    def device_pages(self) -> Pages:
        """The device pages of the device-matched prefix, in order."""
        runs = self.page_runs
        return runs[0] if len(runs) == 1 else tuple(chain.from_iterable(runs))


class HiCache:
    """A prefix KV cache over a device tier and a host tier.

    Every public operation checks its arguments first (a wrong one raises
    :class:`~fsm_cache.errors.BadArgument` or :class:`~fsm_cache.errors.StaleNode`
    and changes nothing), is logged with its arguments (:attr:`log`), starts
    the copies it queued even when it raises, and in debug mode checks every
    design invariant when it returns.

    A cache is single-threaded, like the scheduler loop that drives it: a
    thread that calls an operation while another thread is inside one gets
    :class:`~fsm_cache.errors.ConcurrentUse` and changes nothing, and so does
    a call back into the cache from inside an operation (a copy engine that
    calls ``reset()`` from its poll). Share one cache across threads only
    behind a lock of your own. :meth:`close` (or the
    end of a ``with`` block) waits for every copy in flight before the memory
    goes back.

    Args:
        config: Sizes, KV layout, policy and thresholds; checked first.
        acks: Builds the source of copy acknowledgements from the copy engine
            and the copies in flight; the copy engine's own reports by default
            (:func:`~fsm_cache.cache.replay.replay` passes a scripted one).
        storage: A storage tier below the host, and how to use it; None for
            none (the two-tier cache, ``specs/residency.toml``, unchanged).
        compute_stream: The stream the forward pass reads and writes the
            device pages on, when it is not the current stream at the
            cache's calls (SGLang's overlap scheduler runs it on a forward
            stream): every copy is ordered after the work queued on it when
            the copy starts, and :meth:`wait_loaded` holds it back by
            default. None: the device's current stream at each call. Given
            to the default copy engine (:class:`~fsm_cache.memory.tiers.Tiers`);
            ignored on CPU, where copies are synchronous.

    Raises:
        ConfigError: A configuration value is out of range, the write
            policy cannot work with these tiers (write-back with no host pages
            could never evict a device page; a storage tier with no host pages
            could copy nothing), or ``compute_stream`` is given with a
            ``config.copier`` (which builds its own engine: give it the stream).
        BadArgument: ``compute_stream`` is not a stream, or one of another GPU.
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        acks: AckSourceFactory | None = None,
        storage: StorageConfig | None = None,
        compute_stream: object | None = None,
    ) -> None:
        # first, as __del__ reads it: under mypyc an attribute __init__ always sets is read
        # unchecked (NULL where __init__ raised before it); True once there are tiers to give back
        self._built = False
        self._gate = _Gate()
        if config is not None and not isinstance(config, CacheConfig):
            raise ConfigError(f"config: expected a CacheConfig, got {type(config).__name__}")
        if acks is not None and not callable(acks):
            raise ConfigError(f"config: acks must build an acknowledgement source, got {acks!r}")
        if storage is not None and not isinstance(storage, StorageConfig):
            raise ConfigError(f"storage: expected a StorageConfig, got {type(storage).__name__}")
        self.config = config or CacheConfig()
        self.config.check()
        if storage is not None:
            storage.check()
        self.policy = WritePolicy(self.config.write_policy)
        self._storage: StorageTier | None = None
        self.tiers = Tiers(self.config, compute_stream=compute_stream)
        self._built = True
        if self.policy is WritePolicy.WRITE_BACK and self.tiers.host.num_pages == 0:
            raise ConfigError(
                "config: write_back needs host pages: with none, no device page could be evicted"
            )
        if storage is not None and self.tiers.host.num_pages == 0:
            raise ConfigError(
                "storage: a storage tier needs host pages: copies to and from it pass"
                " through the host"
            )
        self._core = CacheCore(
            self.config.page_size, self.tiers, self.config.trail, self.config.log_limit
        )
        self._transfers = Transfers(
            self._core, self.tiers, self.policy, self.config.selective_threshold, acks
        )
        self._evictor = Evictor(self._core, self.tiers, self._transfers, self.policy)
        effects = MemoryEffects(self._core, self.tiers, self._transfers, self._evictor).bound()
        if storage is not None:
            self._storage = StorageTier(
                storage,
                self._core,
                self.tiers,
                transfers=self._transfers,
                evictor=self._evictor,
                write_policy=self.policy,
            )
            effects.update(self._storage.effects())
        self._core.bind(effects, storage=storage is not None)
        self._events = frozenset(self._core.machine.engine.events)
        # what every operation's exit starts: device-host copies, then storage copies (not a
        # bound method of the cache's own, which would hold it in a cycle and delay __del__)
        self._flush_all: Callable[[], None] = self._transfers.flush
        if self._storage is not None:
            self._flush_all = partial(_flush_both, self._transfers, self._storage)

    # -- the parts, read-only ------------------------------------------------

    @property
    def tree(self) -> RadixTree:
        """The radix tree (owned by the core; replaced by :meth:`reset`)."""
        return self._core.tree

    @property
    def log(self) -> EventLog:
        """The event log of operations, transitions and acknowledgements since the last reset."""
        return self._core.log

    @property
    def counters(self) -> Counters:
        """Running totals since the last reset."""
        return self._core.counters

    @property
    def machine(self) -> Residency:
        """The residency machine, compiled with this cache's memory effects."""
        return self._core.machine

    @property
    def transfers(self) -> Transfers:
        """Copies queued and in flight (read their views; the cache drives them)."""
        return self._transfers

    @property
    def evictor(self) -> Evictor:
        """Eviction candidates and write-back evictions waiting for their backups."""
        return self._evictor

    @property
    def storage(self) -> StorageTier | None:
        """The storage tier (its copies in flight, keys and namespace), or None without one."""
        return self._storage

    @property
    def closed(self) -> bool:
        """Whether the cache was closed (:meth:`close` applied what was left): no operation runs.

        Every later operation raises :class:`~fsm_cache.errors.CacheClosed`. It is
        set before the tiers give their memory back, so it holds where that
        raised, and the tiers' own ``closed`` stayed False (a later
        :meth:`close` gives it back then).
        """
        return self._gate.closed

    # -- lookups and inserts -------------------------------------------------

    def match_prefix(self, tokens: Tokens, namespace: Hashable = None) -> MatchResult:
        """Return how much of ``tokens`` is cached on each tier; may split a node.

        The device prefix is the run of nodes from the root whose KV is on the
        device now: it stops at the first node that is not (a node still
        loading, or host-only), so ``device_pages`` hold exactly the KV of
        ``tokens[:device_len]``. The host part counts every matched token after it.

        With a storage tier, the host part stops at the first node cached on
        neither tier (still being fetched), and a long enough unmatched tail
        is prefetched from the store (see
        :meth:`~fsm_cache.cache.storage_tier.StorageTier.prefetch`): under the
        ``wait`` policy, or the ``timeout`` one within its deadline, the
        fetched pages are host-valid when this returns and counted in
        ``host_len``; otherwise they are counted in ``storage_len`` until a
        :meth:`poll` applies them. Load them to the device with
        :meth:`load_back` as any host-only prefix.

        Raises:
            BadArgument: ``tokens`` is not a sequence of non-negative ints (a 1-d
                tensor or array is fine; a bool is no token id), or ``namespace``
                is unhashable, or with a storage tier cannot key its pages
                (:meth:`StorageTier.check_namespace
                <fsm_cache.cache.storage_tier.StorageTier.check_namespace>`).
            CopyFailed: The prefetch waited for (``wait``, ``timeout``) read
                pages that could not be written to the host; the fetch was
                applied as failed, as in :meth:`poll`.
        """
        key = arguments.ints(tokens, "match_prefix", "tokens")
        namespace = arguments.namespace(namespace, "match_prefix")
        if namespace is not None and self._storage is not None:
            self._storage.check_namespace(namespace, "match_prefix")
        with self._operation("match_prefix", key, namespace):
            tree = self._core.tree
            asked = len(key)  # a hit rate's denominator: the tokens asked for, a partial page too
            key = tree.aligned(key)
            walk = tree.walk(key, namespace)
            if self._storage is not None:
                walk = self._storage.prefetch(walk, key, namespace)
            self._core.touch(walk.path)
            root = tree.root(namespace)
            on_device, device_len = walk.path, walk.matched
            for i, n in enumerate(walk.path):
                if n.device not in DEVICE_READABLE:
                    on_device = walk.path[:i]
                    device_len = sum(len(n.key) for n in on_device)
                    break
            cached: Sequence[TreeNode] = walk.path
            matched, storage_len = walk.matched, 0
            if self._storage is not None:
                cached = local_prefix(walk.path)
                matched = sum(len(n.key) for n in cached)
                storage_len = walk.matched - matched
            self._core.counters.looked_up(asked, device_len, matched - device_len)
            return MatchResult(
                device_len=device_len,
                host_len=matched - device_len,
                last_device_node=on_device[-1] if on_device else root,
                last_host_node=cached[-1] if cached else root,
                page_runs=tuple([n.device_pages for n in on_device]),
                storage_len=storage_len,
            )

    def insert(
        self,
        tokens: Tokens,
        device_slots: Tokens | None = None,
        namespace: Hashable = None,
    ) -> int:
        """Cache ``tokens``; return how many leading tokens were on the device already.

        The slots of those tokens are the caller's to free (SGLang's
        ``free(slots[len(prefix):returned])``); every other slot passed is the
        cache's now, including those of host-only nodes it adopted. An insert
        that runs through a node still loading first applies the finished
        copies, and waits for that load if it is still in flight: nothing is
        put on the device under a node whose load may yet fail.

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
            BadArgument: ``tokens`` or ``device_slots`` is not a sequence of
                non-negative ints (a bool is no token id), or ``namespace`` is
                unhashable, or with a storage tier cannot key its pages; nothing
                changed.
            CopyFailed: A node on the path is still loading after its copy failed
                and was started again (a locked node); or a storage fetch the
                eviction applied could not write its pages to the host (every
                finished copy was applied, as :meth:`poll` applies them).
                Nothing was inserted.
            NotASlot: A slot the insert reads is a bool (no page, though it
                equals 0 or 1), or any slot is and the slots are refused for
                another reason too: a ``BadArgument`` and a ``ForeignSlot``,
                naming the bool. The slots of the prefix already on the device
                are not read. Nothing changed.
            ForeignSlot: ``device_slots`` are too few, not whole pages, repeat a
                page, or name a page the request does not hold. Nothing changed.
            PoolExhausted: Too little device memory even after eviction (only
                when ``device_slots`` is None). Nothing was inserted. An
                allocation no eviction could satisfy is refused before anything
                changes; otherwise what the eviction did stays done: the leaves
                it evicted are host-only (or deleted, under write-through), the
                write-backs it started were waited for and applied, and a node
                the insert runs into part way was split first (eviction may
                take its suffix). Where the eviction changed nothing after
                all, that split is taken back: the tree, the node ids and the
                log (but for the call and its refusal) are as they were.
            EffectFailed: The device allocator broke (an error from outside
                the cache) as a host-only node on the path took its pages: the
                nodes before it keep theirs (logged), and nothing after it was
                inserted. An allocator error as the new leaf takes its pages is
                raised as it came, and the leaf is not added. Either way the
                pages the cache allocated itself went back to the pool, and of
                ``device_slots`` the caller still holds those past
                ``match_prefix(tokens).device_len``, to give back with
                :meth:`free_slots` (the rest are the nodes' now). A node the
                insert split part way is whole again, with the node ids and
                the log as before, where nothing else changed since the split
                (no node above adopted its pages) and the allocator takes the
                pages back; if it is still broken, the split stays, logged,
                and a note on the error says so. Or the
                host allocator broke as a backup the insert started took its
                pages: the insert was done, and its new leaf, unbacked, is logged.

        Every refusal of the insert's own comes before it splits a node it
        runs into part way (check, then act), and so does a KV write that
        torch fails when the pool has room: such a call leaves the tree, the
        node ids, the pools and the log (but for the call and its refusal) as
        they were; but a ``CopyFailed``, which comes after the insert applied
        the copies it waited for, and which stay applied.
        """
        given = arguments.ints(tokens, "insert", "tokens")
        args, logged = (
            (None, None)
            if device_slots is None
            else arguments.packed(device_slots, "insert", "slots")
        )
        namespace = arguments.namespace(namespace, "insert")
        if namespace is not None and self._storage is not None:
            self._storage.check_namespace(namespace, "insert")
        with self._operation("insert", given, namespace, logged, unpacked=args):
            tree = self._core.tree
            key = tree.aligned(given)
            slots.check_count(args, len(key))
            walk = tree.find(key, namespace)  # no split yet: every refusal comes first
            for node in walk.path:
                if node.device == "loading":
                    walk = self._wait_for_loads(walk, key, args, namespace)
                    break
            split: TreeNode | None = None
            if walk.cut:  # the match ends inside a node: check, then split it
                walk, parts, runs = self._split_checked(walk, key, namespace, args)
                split = walk.path[-1]
            else:
                parts = slots.wanted(walk.path, key)
                runs = self._fresh_pages(walk.path, key, parts, args)
            cached = 0
            for node in walk.path:
                if node.device == "absent":
                    break
                cached += len(node.key)
            try:
                added = self._take_over(walk, key, parts, runs, namespace, allocated=args is None)
            except BaseException as error:  # an allocator that broke: the split is taken back too
                if split is not None:
                    self._take_back(split, error)
                raise
            touched = walk.path + added  # walk.path itself where nothing was added
            self._core.touch(touched)
            try:
                self._transfers.maybe_backup_each(touched)
            except BaseException:  # a host allocator that broke, after the insert was done
                if added:  # a new leaf is not logged: say so, or a replay would skip the insert
                    self._core.log.transition(added[0].id, "add")
                raise
            return cached

    def _wait_for_loads(
        self, walk: Walk, key: tuple[int, ...], given: Pages | None, namespace: Hashable
    ) -> Walk:
        """Apply the copies an insert through a node still loading waits for; return the new walk.

        What can be refused now is refused before waiting for anything (which
        applies copies): slots that are not the request's, or memory that no
        eviction could free, for the parts that need device pages now, which
        stay wanted whatever the loads do.

        Raises:
            ForeignSlot: As :meth:`_caller_pages`.
            PoolExhausted: No eviction could free the pages wanted (no ``given`` slots).
            CopyFailed: A load on the path failed and runs again (a locked node).
        """
        parts = slots.wanted(walk.path, key, walk.cut)
        if given is None:  # what can never fit
            self._refuse_unfittable(walk, parts)
        else:
            self._caller_pages(parts, given)
        stuck = self._transfers.finish_loads(walk.path, "insert")
        if stuck:
            raise CopyFailed(
                f"insert: node {stuck[0].id} is still loading: its copy failed and"
                " runs again; insert after a poll"
            )
        return self._core.tree.find(key, namespace)  # what the copies applied may have changed it

    def _fresh_pages(
        self,
        path: Sequence[TreeNode],
        key: tuple[int, ...],
        parts: list[tuple[int, int, int]],
        given: Pages | None,
    ) -> list[Pages]:
        """Device pages for each of ``parts`` (:func:`slots.wanted` of ``path``), in order.

        Only the caller's slots for those parts are read, and checked before
        anything changes; slots of the part already on the device are the
        caller's business. Without caller slots, pages are allocated (evicting
        if needed) and filled with KV derived from the tokens.

        Raises:
            ForeignSlot: As :meth:`_caller_pages`.
            PoolExhausted: Too little device memory even after eviction.
        """
        if given is not None:
            return self._caller_pages(parts, given)
        page = self.config.page_size
        total = slots.pages_in(parts, page)
        run = self._evictor.alloc_device(total, path[-1] if path else None, path)
        out, at = [], 0
        try:
            for _, o, n in parts:
                out.append(run[at : at + n // page])
                self.tiers.write_tokens(out[-1], key[o : o + n])
                at += n // page
        except BaseException:  # torch refused the write (out of memory): the pages go back
            self.tiers.free_device(run, REQUEST)
            raise
        return out

    def _split_checked(
        self, walk: Walk, key: tuple[int, ...], namespace: Hashable, given: Pages | None
    ) -> tuple[Walk, list[tuple[int, int, int]], list[Pages]]:
        """Check an insert whose match ends inside a node, then split it; its walk, parts, pages.

        ``walk`` is a :meth:`~fsm_cache.cache.tree.RadixTree.find`'s, with a
        cut. Everything that can be refused is refused before the split: the
        caller's slots, or (without them) an allocation no eviction could
        satisfy; and when the pool has room the pages are allocated and
        written first too, so that torch failing the write leaves no split
        either. A pool short now is evicted from after the split, which
        decides what eviction may take (the suffix, a leaf of its own).

        The split hands the prefix's pages over first, so an allocator that
        breaks there leaves the tree as it was; the pages allocated for the
        insert go back with it.

        Raises:
            ForeignSlot: As :meth:`_caller_pages`; nothing changed.
            PoolExhausted: Too little device memory even after eviction;
                nothing changed, or (the pool short, eviction not enough) the
                node was split and what eviction did stays done. A split
                whose eviction changed nothing is taken back
                (:meth:`CacheCore.unsplit
                <fsm_cache.cache.core.CacheCore.unsplit>`).
        """
        parts = slots.wanted(walk.path, key, walk.cut)
        runs: list[Pages] | None = None
        if given is not None:
            runs = self._caller_pages(parts, given)
        else:
            total = self._refuse_unfittable(walk, parts)
            if total <= self.tiers.device.allocator.free_pages:  # nothing to evict
                runs = self._fresh_pages(walk.path, key, parts, None)
        cut = walk.path[-1].id
        try:
            walk = self._core.tree.split_cut(walk, key, namespace)
        except BaseException:  # an allocator that broke as the split handed pages over
            if given is None and runs:
                self.tiers.free_device(tuple(chain.from_iterable(runs)), REQUEST)
            raise
        for i, (ident, offset, tokens) in enumerate(parts):  # the same parts, ids aside
            if ident == cut:  # the node split was host-only: its part is the prefix's
                parts[i] = (walk.path[-1].id, offset, tokens)
        if runs is None:
            try:
                runs = self._fresh_pages(walk.path, key, parts, None)
            except BaseException as error:  # taken back if eviction changed nothing
                self._take_back(walk.path[-1], error)  # (its pages are back)
                raise
        return walk, parts, runs

    def _refuse_unfittable(self, walk: Walk, parts: list[tuple[int, int, int]]) -> int:
        """Return the device pages ``parts`` need, refused if no eviction could free them.

        ``walk`` may end inside its last node (a cut): the prefix a split
        would leave counts as kept, the suffix as evictable.

        Raises:
            PoolExhausted: No eviction could free that many pages.
        """
        page = self.config.page_size
        needed = slots.pages_in(parts, page)
        self._evictor.refuse_impossible(needed, walk.path[-1], walk.cut // page)
        return needed

    def _take_back(self, prefix: TreeNode, error: BaseException) -> None:
        """Undo the split an insert made before it failed with ``error``, if nothing happened since.

        :meth:`CacheCore.unsplit`: where the split was the last thing the
        insert did (the steps after it undone, or failed before any change),
        the tree, the node ids and the log are as before the insert.

        An allocator still broken (an error from outside the cache, which
        the page hand-back raises before anything changes) leaves the split
        as it is, logged: ``error`` goes on, with a note (Python 3.11 on)
        saying so and what the allocator raised. An error of the cache's own
        from the unsplit (the pool refusing to take back pages as not the
        prefix's, say) is a fault of the cache, not of what it runs on: it is
        raised instead of ``error``, which Python shows as its ``__context__``.
        """
        try:
            self._core.unsplit(prefix)
        except FsmCacheError:
            raise
        except Exception as broken:  # from outside the cache: an allocator still broken
            add_note = getattr(error, "add_note", None)  # exceptions take notes from Python 3.11
            if add_note is not None:
                add_note(
                    f"node {prefix.id} stays split: taking the split back failed too"
                    f" ({type(broken).__name__}: {broken})"
                )

    def _caller_pages(self, parts: list[tuple[int, int, int]], given: Pages) -> list[Pages]:
        """The caller's pages for each of ``parts`` (:func:`slots.wanted`), checked held, in order.

        Raises:
            NotASlot: a slot is a bool (named first, whatever else is wrong).
            ForeignSlot: a slot is not whole pages, or a page is not the request's, or repeats.
        """
        page = self.config.page_size
        try:
            if page == 1:  # slots are pages
                out = [given[o : o + n] for _, o, n in parts]
            else:
                out = [
                    tuple(slots.request_pages(given[o : o + n], page, "insert"))
                    for _, o, n in parts
                ]
            allocator = self.tiers.device.allocator
            if len(out) == 1:
                return [slots.held(allocator, out[0])]
            own, at = slots.held(allocator, tuple(chain(*out))), 0
        except ForeignSlot:
            slots.refuse_bool(given, "insert")  # a bool among them is what the refusal names
            raise
        for i, pages in enumerate(out):
            out[i], at = own[at : at + len(pages)], at + len(pages)
        return out

    def _take_over(
        self,
        walk: Walk,
        key: tuple[int, ...],
        parts: list[tuple[int, int, int]],
        runs: list[Pages],
        namespace: Hashable,
        *,
        allocated: bool,
    ) -> tuple[TreeNode, ...]:
        """Adopt the host-only path nodes, then hang the new tail under the walk's end.

        ``runs`` holds request-held pages (:meth:`_fresh_pages`) for each of
        ``parts`` (:func:`slots.wanted` of ``walk.path``), so no step here can
        be refused. The path nodes adopt first, top down, so that no
        node is ever on the device under one off it. An allocator that breaks
        as a node takes its pages (an error from outside the cache) stops the
        insert there: the path nodes above it keep what they adopted (logged),
        a new leaf is taken back with its id, and the pages no node took go
        back to the pool where the cache allocated them (``allocated``), or
        stay the caller's. A leaf is never logged, so where the insert logged
        nothing before the failure (no eviction, split or adoption) a replay
        skips it, and under tensor parallelism the rank it broke on is named
        at the next step. Returns the new leaf, if there is one.
        """
        adopted = len(parts)  # the tail, if any, is the last part
        tail: Pages = ()
        if adopted and parts[-1][0] == slots.NEW_TAIL:
            adopted -= 1
            tail = runs[adopted]
        if adopted:  # most inserts adopt nothing: no dict of pages by node for them
            fresh = {ident: run for (ident, _, _), run in zip(parts, runs, strict=True)}
            self._adopt(walk.path, fresh, tail, allocated=allocated)
        path, matched = walk.path, walk.matched
        if matched == len(key):
            return ()
        tree = self._core.tree
        leaf = tree.add_leaf(path[-1] if path else tree.root(namespace), key[matched:], tail)
        try:
            self.tiers.device.allocator.reassign(tail, REQUEST, leaf.id)
        except BaseException:
            tree.retract(leaf)
            if allocated:
                self._free_untaken(tail)
            raise
        self._evictor.offer(leaf)
        return (leaf,)

    def _adopt(
        self, path: Sequence[TreeNode], fresh: dict[int, Pages], tail: Pages, *, allocated: bool
    ) -> None:
        """Adopt the path nodes ``fresh`` has pages for, top down (:meth:`_take_over`'s first step).

        Where a node's adoption fails, the pages no node took (those of the
        nodes from it on, and the ``tail``'s) go back to the pool if the cache
        allocated them (``allocated``).
        """
        adopting = [node for node in path if node.id in fresh]
        for at, node in enumerate(adopting):
            self._core.stage(node, fresh[node.id])
            try:
                self._core.fire(node, "adopt")
            except BaseException:
                self._core.drop_staged([node.id])  # refused before its effect took them
                if allocated:
                    self._free_untaken(
                        [*chain.from_iterable(fresh[n.id] for n in adopting[at:]), *tail]
                    )
                raise

    def _free_untaken(self, pages: Sequence[int]) -> None:
        """Give back those of ``pages`` the request still holds: no node took them before a failure."""
        allocator = self.tiers.device.allocator
        self.tiers.free_device([p for p in pages if allocator.owner_of(p) == REQUEST], REQUEST)

    def alloc_slots(self, num_tokens: SupportsIndex) -> list[int]:
        """Allocate device slots for a request to compute KV into (evicting if needed).

        The slots belong to the request until :meth:`insert` adopts them or
        :meth:`free_slots` gives them back.

        Raises:
            BadArgument: ``num_tokens`` is not an int >= 0.
            PoolExhausted: Not enough device memory even after eviction; as
                for :meth:`insert`, what the eviction did stays done.
            CopyFailed: As for :meth:`insert`: a storage fetch the eviction
                applied could not write its pages; nothing was allocated.
        """
        tokens = arguments.count(num_tokens, "alloc_slots")
        with self._operation("alloc_slots", tokens):
            page = self.config.page_size
            pages = self._evictor.alloc_device(-(-tokens // page), None)
            return list(pages) if page == 1 else slots_of(pages, page)  # slots are pages at 1

    def free_slots(self, device_slots: Sequence[int]) -> None:
        """Give back request-held device slots (e.g. the duplicates of a cached prefix).

        Raises:
            BadArgument: ``device_slots`` is not a sequence of non-negative ints;
                nothing was freed.
            NotASlot: A slot is a bool (no page, though it equals 0 or 1): a
                ``BadArgument`` and a ``ForeignSlot``, naming the bool whatever
                else is wrong; nothing was freed.
            ForeignSlot: A slot is outside the pool, not page-aligned, or not a
                request's; nothing was freed.
        """
        given, logged = arguments.packed(device_slots, "free_slots", "slots")
        with self._operation("free_slots", logged, unpacked=given):
            allocator = self.tiers.device.allocator
            try:
                pages = slots.request_pages(given, self.config.page_size, "free_slots")
                own = slots.held(allocator, pages, "free_slots")
            except ForeignSlot:
                slots.refuse_bool(given, "free_slots")  # a bool among them is what it names
                raise
            self.tiers.free_device(own, REQUEST)

    def backup(self, nodes: Sequence[TreeNode]) -> int:
        """Start backing up ``nodes`` to the host in one batched copy; return how many started.

        For explicit backups (a storage tier, a write-back flush). Nodes the
        machines refuse to write (already backed, writing, off the device) are
        skipped; a full host pool stops the batch where it is.
        """
        given = arguments.nodes(self._core.tree, nodes, "backup")
        with self._operation("backup", tuple(n.id for n in given)):
            return self._transfers.start_writes(given)

    # -- locks ---------------------------------------------------------------

    def pin(self, node: TreeNode) -> Lease:
        """Pin ``node``'s host copy (a storage backup, a prefetch anchor); the lease releases once.

        Raises:
            BadArgument: ``node`` is a namespace root, which holds no host copy.
        """
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
            LeaseError: ``lock`` was released already, is not a lock receipt, or
                is another cache's; nothing changed.
            BadArgument: ``lock`` is not a receipt at all.
        """
        if not isinstance(lock, Lease):
            raise BadArgument(f"unlock: expected a lock receipt, got {type(lock).__name__}")
        if lock.event != "lock":
            raise LeaseError(
                f"node {lock.record.id}: unlock takes a lock receipt, not a {lock.event}"
            )
        if not lock.issued_by(self._core.machine.engine.leases):
            raise LeaseError(
                f"node {lock.record.id}: unlock refused: the receipt is another cache's"
            )
        lock.release()

    def _take(self, node: TreeNode, event: AnyEvent, give_back: AnyEvent) -> Lease:
        """Fire ``event`` as one operation; the receipt fires ``give_back`` as another.

        Both are logged under the event's name (``lock``, ``unlock``, ``pin``,
        ``release``), which a replay pairs up by node.
        """
        self._fire_as(event, event, node)
        return self._core.machine.engine.leases.open(
            node, partial(self._fire_as, give_back, give_back), event, "node", gives=(give_back,)
        )

    @overload
    def fire(self, event: Event, node: TreeNode) -> None: ...

    @overload
    def fire(self, event: StorageEvent, node: TreeNode) -> None: ...

    def fire(self, event: object, node: TreeNode) -> None:
        """Fire one residency event at ``node`` as a public operation: logged, flushed, checked.

        For callers that drive the machines by hand (a test of a refusal, a
        tool); the named operations above are the usual way. The log records
        it as ``("op", "fire", (event, node_id))``, which a replay fires again.

        With a storage tier the storage events (``store``, ``discover``,
        ``vanish``, ``evict_storage``, ...) may be fired too; their effects
        queue copies that start when the call returns, as the cache's own do.

        An ``evict_host`` that leaves the node held by no tier (off the device,
        no children) removes it from the tree, as :meth:`evict_host` does.

        Type checkers see the events (the overloads); the implementation takes
        any object, so that compiled or not a non-str is the same BadArgument.

        Raises:
            BadArgument: ``event`` is not an event of this cache's residency
                machine, or ``node`` not a node.
            StaleNode: ``node`` is not in this cache (deleted, from before a reset, or another cache's).
            IllegalTransition: The spec refuses the event; nothing changed.
            EffectFailed: An effect failed (no host room for a fetch, a page a
                read holds for ``evict_storage``); nothing changed.
        """
        self._fire_as("fire", event, node)

    def _fire_as(self, name: str, event: object, node: TreeNode) -> None:
        """Fire ``event`` at ``node`` as :meth:`fire` does, logged as operation ``name``.

        :meth:`fire` logs ``("fire", (event, node id))``; locks, pins and their
        receipts log the event itself with the node id, or with a
        :class:`~fsm_cache.cache.tree.NamespaceRoot` for a namespace root.
        """
        if not isinstance(event, str):
            raise BadArgument(f"fire: event must be a str, got {type(event).__name__}")
        if event not in self._events:
            storage = (
                self._storage is None and event in load_shipped("residency_storage").event_names
            )
            where = " (this cache has no storage tier)" if storage else ""
            raise BadArgument(f"fire: {event!r} is not a residency event{where}")
        known = cast("AnyEvent", event)  # one of this cache's events, as just checked
        node = arguments.node(self._core.tree, node, known)
        if name == "fire" or known == "pin":  # a lock of a root is a zero-length hit's (SGLang)
            self._check_by_hand(name, known, node)
        # a lock names a root by its namespace: each root counts its own, and all are node 0
        args = (known, node.id) if name == "fire" else (self._core.tree.lease_name(node),)
        with self._operation(name, *args):
            if known == "evict_host":  # a node no tier holds afterwards leaves the tree
                self._evictor.evict_host_node(node)
            else:
                self._core.fire(node, known)

    def _check_by_hand(self, name: str, event: AnyEvent, node: TreeNode) -> None:
        """Refuse what :meth:`fire` and :meth:`pin` may not do that the spec allows.

        A namespace root stands for the empty prefix and is resident for good:
        an event there would leave every node under it unlockable, and a pin
        would hold no host page (and count in no figure). An acknowledgement
        the spec would take means the node's copy is in flight (the spec allows
        it only then), and firing it by hand would part the node from that copy.
        An unlock of a node whose every lock is a child's would leave the child
        holding locks its ancestor no longer counts.
        """
        if node.parent is None:
            raise BadArgument(
                f"{name}: node {node.id} is a namespace root, resident for good; {event}"
                " is for the nodes under it"
            )
        if event == "write" and not parent_allows_backup(self.policy, node):
            parent = node.parent
            assert parent is not None  # a root was refused above
            raise BadArgument(
                f"fire: write would back node {node.id} up before its parent, node {parent.id},"
                f" which holds no host copy ({parent.host}): under {self.policy.value} a parent"
                " is backed up first, and backup() leaves the node until then"
            )
        if event == "unlock" and 0 < node.locks <= invariants.children_locks(node):
            raise BadArgument(
                f"fire: unlock would take a lock of node {node.id}'s children (locks="
                f"{node.locks}, every one held by a node under it): unlock the node a lock"
                " was taken on"
            )
        acknowledgement = event in ACKNOWLEDGEMENTS or event in STORAGE_ACKNOWLEDGEMENTS
        if acknowledgement and self._core.allowed(node, event):
            raise BadArgument(
                f"fire: {event} acknowledges node {node.id}'s copy, which is in flight:"
                " the copy's own acknowledgement fires it (poll or apply_completions)"
            )

    # -- memory pressure -----------------------------------------------------

    def evict(self, num_tokens: SupportsIndex) -> int:
        """Free at least ``num_tokens`` device tokens if possible; return tokens freed.

        Least recently used unlocked device leaves go first. Backed leaves
        become host-only; unbacked ones are deleted (write-through) or backed
        up and evicted once the copy is acknowledged (write-back; counted when
        the acknowledgement is applied). An allocation that needs the room now
        (:meth:`insert`, :meth:`alloc_slots`, :meth:`load_back`) waits for those
        acknowledgements instead.
        """
        tokens = arguments.count(num_tokens, "evict")
        with self._operation("evict", tokens):
            return self._evictor.evict_device(tokens)

    def evict_host(self, num_tokens: SupportsIndex) -> int:
        """Free at least ``num_tokens`` host tokens from unpinned host-only leaves; return tokens freed."""
        tokens = arguments.count(num_tokens, "evict_host")
        with self._operation("evict_host", tokens):
            return self._evictor.evict_host(tokens)

    def evict_storage(self, num_tokens: SupportsIndex) -> int:
        """Delete at least ``num_tokens`` tokens' pages from an owned store; return tokens deleted.

        Least recently used stored leaves go first (no child with pages in
        storage, no copy reading or writing them, no read holding a page of a
        local store); the nodes keep their device and host copies. Under
        tensor-parallel agreement a drop this rank's store fails or refuses
        does not keep its node (every rank evicts the same nodes): it is
        counted as ``evict:failed``, its pages left in the store.

        Raises:
            BadArgument: ``num_tokens`` is not an int >= 0.
            ConfigError: The cache has no storage tier, or its store is shared
                (``StorageConfig.owned`` is False: the store's server evicts).
        """
        tokens = arguments.count(num_tokens, "evict_storage")
        with self._operation("evict_storage", tokens):
            if self._storage is None:
                raise ConfigError("evict_storage: this cache has no storage tier")
            return self._storage.evict(tokens)

    def load_back(self, node: TreeNode) -> list[TreeNode] | None:
        """Start loading the evicted chain ending at ``node``; the whole chain or nothing.

        A chain that would hang under a node still loading first applies the
        finished copies and waits for that load (see :meth:`insert`).

        Returns:
            The nodes now loading (apply completions with :meth:`poll`), or None
            when ``node`` is on the device or loading already (a load in
            flight is not waited for), the chain is shorter than the
            load-back threshold, device memory cannot be freed for it, the
            node left the tree meanwhile, or the copy engine refused to start
            the copy (the chain is then host-only again, its ``load_failed``
            fired). Under tensor-parallel
            agreement a refused start is a copy that failed instead, applied
            at the next step: the chain is returned on every rank, and
            :meth:`wait_loaded` answers False for it. An operation that waits
            for the chain before that step (an insert through it, an
            allocation under pressure) applies each rank's own outcome, so a
            start refused on some ranks only parts the ranks there, named at
            the next step.

        Raises:
            BadArgument: ``node`` is not a tree node.
            StaleNode: ``node`` is not in this cache (deleted, from before a reset, or another cache's).
            IllegalTransition: A node of the chain holds no valid host copy.
            CopyFailed: As for :meth:`insert`: a storage fetch the eviction
                applied could not write its pages; nothing was loaded.
            EffectFailed: The allocator broke (an error from outside the cache)
                as a node of the chain took its pages: the nodes above it load,
                it and those below stay off the device, and their pages go back.
        """
        node = arguments.node(self._core.tree, node, "load_back")
        with self._operation("load_back", node.id):
            chain = self._load_back(node)
        # the copy starts as the operation ends: a refused start has failed the chain already
        loading = [n for n in chain if n.device == "loading"] if chain is not None else []
        return loading or None

    def _load_back(self, node: TreeNode) -> list[TreeNode] | None:
        """:meth:`load_back` inside its operation: the chain staged for loading, or None."""
        chain, above = _chain(node)
        if not chain:  # on the device, or on its way: nothing to start, nothing to wait for
            return None
        if above is not None and above.device == "loading":
            tokens = sum(len(n.key) for n in chain)
            if tokens and worth_loading(tokens, self.config.load_back_threshold):
                try:  # no room could ever be made: say so before waiting for anything
                    self._evictor.refuse_impossible(tokens // self.config.page_size, above)
                except PoolExhausted:
                    return None
            if self._transfers.finish_loads([above], "load_back"):
                return None  # its copy failed and runs again: nothing may load under it yet
            if self._core.tree.nodes.get(node.id) is not node:
                return None  # host eviction took it while the copies were applied
            chain = _chain(node)[0]  # the applied copies may have changed it
        return self._load_chain(chain)

    def _load_chain(self, chain: list[TreeNode]) -> list[TreeNode] | None:
        """Start loading ``chain``, the device-absent nodes ending at the one asked for."""
        tokens = sum(len(n.key) for n in chain)
        if not chain or not worth_loading(tokens, self.config.load_back_threshold):
            return None
        for n in chain:
            if n.host not in HOST_VALID:
                self._core.fire(n, "load")  # refused by the spec (no valid host copy): raises
        page = self.config.page_size
        try:
            run = self._evictor.alloc_device(tokens // page, chain[0].parent, chain)
        except PoolExhausted:
            return None
        starts, at = [], 0
        for n in chain:
            count = len(n.key) // page
            self._core.stage(n, run[at : at + count])
            starts.append(at)
            at += count
        for i, n in enumerate(chain):
            try:
                self._core.fire(n, "load")
            except BaseException:  # an allocator that broke: the nodes above it keep loading
                self._core.drop_staged([m.id for m in chain[i:]])
                self._free_untaken(run[starts[i] :])
                raise
        return chain

    def wait_loaded(self, nodes: Sequence[TreeNode], stream: object | None = None) -> bool:
        """Make ``stream`` wait for the loads of ``nodes``, without blocking the host.

        What SGLang's scheduler does with a load-back: the forward pass reads
        the pages of a chain still loading, and only its stream waits for the
        copy. Call it after :meth:`load_back` with the chain it returned (lock
        it first, so the load can only finish or be copied again), then queue
        the compute. The chain stays ``loading`` until :meth:`poll` (or an
        insert through it) applies the acknowledgement.

        Under tensor-parallel agreement
        (:class:`~fsm_cache.distributed.agreement.DistributedCache`) the answer
        is the group's, so that every rank runs the same forward pass: a
        collective that every rank reaches at the same call, False on every
        rank when it is False on any (a launch that failed on one rank only).

        Args:
            nodes: Nodes whose device pages the compute will read; nodes
                already resident need nothing.
            stream: The stream to hold back; None: the cache's
                ``compute_stream``, else the device's current stream.
                Ignored on CPU, where copies are synchronous.

        Returns:
            False when a node is off the device (its load failed and was
            applied), or its copy failed and is queued to run again, or its
            launch has failed and a poll has yet to say so: its pages do not
            hold its KV (poll, and try again).

        Raises:
            BadArgument: ``nodes`` is not a sequence of nodes.
            StaleNode: A node is not a node of this cache.
            RankDivergence: Under agreement, the ranks applied different
                transitions before this call (every rank raises).
            RankFailure: Under agreement, the collective failed or timed out.
        """
        agree = self._transfers.agree_waits
        if agree is None:
            return self._wait_loaded(nodes, stream)
        return agree(partial(self._wait_loaded, nodes, stream))

    def _wait_loaded(self, nodes: Sequence[TreeNode], stream: object | None) -> bool:
        """:meth:`wait_loaded` on this cache alone: this copy engine's answer."""
        given = arguments.nodes(self._core.tree, nodes, "wait_loaded")
        with self._operation("wait_loaded", tuple(n.id for n in given)):
            if any(n.device not in DEVICE_HELD for n in given):
                return False  # its load failed, applied: its pages went back
            tickets = self._transfers.tickets_of(given)
            if tickets is None:
                return False
            held = self._transfers.held_failures
            if held is not None and held(tickets):
                return False  # reported failed here, held back until the group applies it
            return not tickets or self.tiers.copier.wait(tickets, stream)

    # -- copies --------------------------------------------------------------

    def poll(self) -> int:
        """Apply every finished copy (in any order); return how many copies were applied.

        With a storage tier, also the finished copies to and from the store,
        and those that passed ``io_timeout`` unanswered, as failures.

        Raises:
            CopyFailed: A storage fetch's pages could not be written to the
                host; it was applied as failed (its nodes settled), and so was
                every other copy. Under tensor-parallel agreement the group's
                step raises it instead, after this poll.
            DuplicateAck: The copy engine reported a copy that is not in
                flight (one applied by hand with :meth:`apply_completions`,
                say); nothing was applied, and the copies it reported that are
                in flight are applied by the next poll.
        """
        with self._operation("poll"):
            applied = self._transfers.apply_collected(False, "poll")
            if self._storage is not None:
                applied += self._storage.apply_finished("poll")
            return applied

    def apply_completions(self, completions: Sequence[Completion]) -> int:
        """Apply finished copies in the given order, then start any copies they asked for.

        :meth:`poll` applies whatever the copy engine reports; a tensor-parallel
        group applies an agreed prefix of :meth:`issued` instead
        (:mod:`fsm_cache.distributed.agreement`). Either way the log records which copies
        were applied, in order, and whether each succeeded.

        Raises:
            BadArgument: ``completions`` is not a sequence of completions.
            DuplicateAck: One names a copy not in flight; nothing was applied.
        """
        if isinstance(completions, (str, bytes)) or not isinstance(completions, Sequence):
            name = type(completions).__name__
            raise BadArgument(f"apply_completions: expected a sequence of completions, got {name}")
        with self._operation("apply_completions"):
            return self._transfers.apply(completions, "apply_completions")

    def apply(self, completion: Completion) -> None:
        """Apply one finished copy: :meth:`apply_completions` of one."""
        self.apply_completions([completion])

    def issued(self) -> list[int]:
        """Return the ids of copies started and not yet applied, in issue order."""
        return self._transfers.issued()

    def close(self) -> None:
        """Wait for every copy in flight, apply it, and give the tiers' memory back.

        Pinned host memory is unregistered and both pools' memory given back
        only once no copy can still read or write it, and then at once: it is
        free when this returns (:meth:`Tiers.close <fsm_cache.memory.tiers.Tiers.close>`),
        not when Python's cyclic garbage collector reclaims the cache, whose
        parts refer to each other. A cache dropped unclosed gives it back
        when its last reference goes (``__del__``), waiting for its copies the
        same way, but applies nothing and raises nothing. A copy that fails
        and must run again (a load a request locked) is retried for a bounded number of rounds;
        one still failing then stays queued, unstarted, and its node loading,
        so that no copy is started whose completion would be dropped.
        Idempotent; any later operation raises :class:`~fsm_cache.errors.CacheClosed`.
        Where giving the memory back raised (the copies could not be waited
        for: a CUDA error), the cache is closed and a later ``close()`` tries that again.

        Raises:
            CopyFailed: A copy failed while the copies were settled (a start the
                engine refused, a fetch whose pages could not be written to the
                host): it was applied as failed, as in :meth:`poll`, the other
                copies were settled, and the cache closed all the same; the
                first such error is raised once it is closed.
        """
        if self._gate.closed:  # giving the memory back may have raised: both are idempotent
            self._give_back()
            return
        with self._operation("close"):
            failed = self._settle_tiers(len(self._core.tree.nodes) + 2)
            # a load that keeps failing under a lock is queued again after the last round:
            # started now, its completion would be dropped with the engine
            self._transfers.stop()
        if failed is not None:  # logged as the close's own refusal, as a replay raises it too
            self._core.log.refusal("close", failed)
        self._gate.closed = True
        self._give_back()
        if failed is not None:
            raise failed

    def __del__(self) -> None:
        """Give the tiers' memory back when the cache is dropped unclosed, as :meth:`close` does.

        The cache's parts refer to each other (the engine's effect hooks, the
        tree's split callback, the copy acknowledgements), so without this the
        pools (the whole device pool, on a GPU) stayed allocated until Python's
        cyclic collector ran, at a time of its choosing. As in ``close()``,
        the copies in flight are waited for before the memory goes back, so
        none can still write into it; their completions go with the cache. A
        storage worker still in a store is not waited for (its copy works on
        a snapshot); it ends after it, or is waited for at exit.
        A cache whose ``close()`` could not give the memory back (a CUDA
        error) tries again. Nothing is done while the interpreter exits (torch
        may be gone; a storage tier's workers are ended before, at exit). An
        error giving the memory back reaches :func:`sys.unraisablehook`.
        """
        # a default: an object of the pure sources whose __init__ never ran has no attributes
        if getattr(self, "_built", False) and not sys.is_finalizing():
            self._gate.closed = True
            self._give_back(join=False)  # workers still in a store end after it

    def __copy__(self) -> HiCache:
        """Refuse: a copy would share the cache's pools, tree and copies in flight with it."""
        raise TypeError(_NO_COPY)

    def __deepcopy__(self, memo: object) -> HiCache:
        """Refuse: the pools and the copy engine's work in flight cannot be duplicated."""
        raise TypeError(_NO_COPY)

    def _give_back(self, *, join: bool = True) -> None:
        """End the storage workers and give the tiers' memory back (again, where that raised).

        Without ``join`` the workers are told to end and not waited for (a
        store's copy works on a snapshot of its pages, not on the pool); one
        still running then is waited for as the interpreter exits.
        """
        if self._storage is not None:
            self._storage.close(None if join else 0.0)
        self.tiers.close()

    def _settle_tiers(self, rounds: int) -> CopyFailed | None:
        """Settle the host copies, then the storage copies, until both are quiet.

        Applying a fetch may queue a host backup (a child recomputed under the
        node fetched), and a host backup acknowledged may start a store, so one
        pass of each is not enough: at most ``rounds`` passes. A copy that
        failed was applied before its error was raised, so the settling goes on
        past it; returns the first such error.
        """
        first: CopyFailed | None = None
        for _ in range(rounds):
            try:
                self._transfers.settle_all(rounds)
                if self._storage is None or self._storage.idle():
                    return first
                self._storage.settle(rounds)
            except CopyFailed as exc:
                first = first or exc
        return first

    def __enter__(self) -> HiCache:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- reporting -----------------------------------------------------------

    def stats(self) -> Stats:
        """Return tier occupancy, hit rates, copies, pins, locks and transition counts."""
        in_flight = len(self._storage.in_flight()) if self._storage is not None else 0
        return snapshot(self, in_flight)

    @overload
    def check_invariants(self) -> None: ...

    @overload
    def check_invariants(self, after: str | None) -> None: ...

    def check_invariants(self, after: object = None) -> None:
        """Raise InvariantViolation naming the first broken design invariant and node.

        Args:
            after: The operation just run, named in the message (debug mode
                passes it): a str, or None (or ``""``) for none. Type checkers
                see ``str | None`` (the overloads); the implementation takes
                ``object``, as the compiled call would otherwise check the type
                first, with its own TypeError, where the sources name the
                argument: both refuse another type with the same BadArgument.

        Raises:
            BadArgument: ``after`` is neither a str nor None; nothing is checked.
            InvariantViolation: An invariant is broken.
        """
        if after is not None and not isinstance(after, str):
            raise BadArgument(
                f"check_invariants: after must be a str or None, got {type(after).__name__}"
            )
        invariants.check(self, after=after or "", storage=self._storage)

    def reset(self) -> None:
        """Drop everything and start empty, keeping the pools and the copy engine.

        Copies between the device and the host in flight are waited for and
        discarded. Storage copies are not waited for (a store that hangs would
        hold the reset for its ``io_timeout``): each is abandoned, so one no
        worker has started is never run and its snapshot is let go, and one a
        worker runs finishes to no one (a put may still write its pages to the
        store). The KV tensors and the pinned host memory are reused as they
        are (every page is free again, so their old contents are never read).
        Leases still held are void: a later release raises LeaseError naming
        this reset as the release. Each part is cleared in place, so the
        effects bound to them stay bound.
        """
        self._gate.enter("reset")
        try:
            self.tiers.copier.drain()
            self.tiers.reset()
            self._core.reset()
            self._transfers.reset()
            self._evictor.reset()
            if self._storage is not None:
                self._storage.reset()
        finally:
            self._gate.leave()

    # -- internals -----------------------------------------------------------

    def _operation(
        self, name: str, *args: object, unpacked: tuple[int, ...] | None = None
    ) -> _Operation:
        """Open public operation ``name``, logged with ``args``.

        ``unpacked`` is the slot list as given, where ``args`` end in it packed
        (:func:`~fsm_cache.cache.arguments.packed`): a refused call whose
        slots hold a bool is logged with it instead, so that the bool the pool
        refused replays as a bool.
        """
        check = self.check_invariants if self.config.debug else None
        return _Operation(self._gate, self._core.log, self._flush_all, check, name, args, unpacked)


_NO_COPY = (
    "a HiCache cannot be copied: a copy would share its pools, its tree and its copies in"
    " flight, and closing either (or dropping it) would close both; build another HiCache"
)


def _flush_both(transfers: Transfers, storage: StorageTier) -> None:
    """Start every copy an operation queued: device-host copies, then storage copies."""
    transfers.flush()
    storage.flush()


def _chain(node: TreeNode) -> tuple[list[TreeNode], TreeNode | None]:
    """Return the device-absent chain ending at ``node`` (top first) and the node above it."""
    chain: list[TreeNode] = []
    walk: TreeNode | None = node
    while walk is not None and walk.parent is not None and walk.device == "absent":
        chain.append(walk)
        walk = walk.parent
    chain.reverse()
    return chain, walk


def _from_outside(error: FsmCacheError) -> bool:
    """Whether ``error`` is an effect's failure whose cause came from outside the cache.

    The engine raises an effect's error as EffectFailed from it, and again
    at each effect it passed through (a write that evicted host leaves):
    the cause at the end of the chain is the cache's own refusal (a full
    pool, a page still being copied), which a replay meets again, or an
    allocator or torch that broke, which it does not. EffectReentered is
    the engine's own refusal.
    """
    cause: BaseException | None = error
    while isinstance(cause, EffectFailed) and not isinstance(cause, EffectReentered):
        cause = cause.__cause__
    return cause is not error and cause is not None and not isinstance(cause, FsmCacheError)


class _Gate:
    """Who is inside a cache: one operation at a time, never nested, and none once closed."""

    __slots__ = ("closed", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def check_open(self, name: str) -> None:
        if self.closed:
            raise CacheClosed(f"{name}: the cache was closed")

    def enter(self, name: str) -> None:
        """Let the calling thread in, or raise ConcurrentUse at once (never blocks).

        Not re-entrant: an operation called from inside another (a copy engine
        calling back) would run on the outer one's half-done state.
        """
        if self.closed:
            self.check_open(name)
        if not self.lock.acquire(False):  # not blocking (positional: the keyword costs)
            raise ConcurrentUse(
                f"{name}: another operation of this cache is running (on another thread, or"
                " one that called back into the cache); a cache is single-threaded and its"
                " operations do not nest (serialise calls with a lock of your own)"
            )

    def leave(self) -> None:
        self.lock.release()


class _Operation:
    """One public operation: gated, logged first, its copies started however it ends, checked after.

    Whatever it raises is logged after it: a refusal of the cache's own, or a
    failure from outside the cache (a copy engine, an allocator, torch), so a
    tensor-parallel digest sees an operation that raised on one rank only.
    """

    __slots__ = ("args", "check", "flush", "gate", "given", "log", "name")

    def __init__(  # noqa: PLR0917 (built on every public call: keywords cost)
        self,
        gate: _Gate,
        log: EventLog,
        flush: Callable[[], None],
        check: Callable[[str], None] | None,
        name: str,
        args: tuple[object, ...],
        given: tuple[int, ...] | None = None,
    ) -> None:
        self.gate, self.log, self.flush, self.check = gate, log, flush, check
        self.name, self.args, self.given = name, args, given

    def __enter__(self) -> None:
        self.gate.enter(self.name)
        self.log.op(self.name, *self.args)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None:  # logged either way, so that an agreement sees it on this rank
                if self.given is not None and bool in set(map(type, self.given)):
                    # its slots as given: packed, a bool is page 0 or 1, which a replay takes
                    self.log.as_given(self.name, (*self.args[:-1], self.given))
                if isinstance(exc, FsmCacheError) and not _from_outside(exc):
                    self.log.refusal(self.name, exc)
                else:  # a copy engine, an allocator or torch broke: no refusal of the cache's
                    self.log.failure(self.name, exc)
            try:
                self.flush()  # nothing stays queued without its copy, even on a refusal
            except FsmCacheError as failed:  # what the caller gets instead: logged, to replay
                self.log.refusal(self.name, failed)
                raise
            except BaseException as failed:  # an interrupt as a copy started: no refusal
                self.log.failure(self.name, failed)
                raise
            if exc is None and self.check is not None:
                self.check(self.name)
        finally:
            self.gate.leave()
