"""The storage tier of a cache: copies between host memory and a store, and prefetch on a match.

With a :class:`StorageConfig`, a :class:`~fsm_cache.cache.hicache.HiCache`
runs ``specs/residency_storage.toml`` (host, device and storage regions) and a
:class:`StorageTier` owns everything the storage region needs beyond the
machine:

* **Keys.** Each node's page keys chain from its parent's last key
  (:func:`~fsm_cache.storage.keys.page_keys`), in a namespace of the model, the
  KV layout, the page size and the tensor-parallel rank (and the tree's
  namespace, when it is not None); computed once per node, sliced by a split.
* **Copies and their tickets.** The spec's effects only queue a copy
  (``start_store``, ``start_fetch``); :meth:`StorageTier.flush` starts them
  when the operation ends, on worker threads (or inline with ``threads=0``).
  A store copies a snapshot of the host pages taken when it starts, and a
  fetch reads into tensors of its own that the cache thread copies into the
  host slots when it applies the acknowledgement, so a worker never touches
  the pools and a copy failed by its timeout can leave nothing behind in them.
  Every copy is numbered and stays in :meth:`StorageTier.in_flight` until it
  is applied; :meth:`StorageTier.collect` fails copies older than
  ``io_timeout`` (a backend thread that hangs or dies must not keep its host
  pin for ever: SGLang #38427), and abandon them: a store's snapshot that no
  worker claimed is let go then, so workers that hang keep no more host
  memory than the copies they run.
* **Acknowledgements per page.** A store or a read lands a prefix of its
  pages; the node is split at the first page that did not land, the prefix
  acknowledged (``store_done``, ``fetch_done``) and the rest failed
  (``store_failed``; ``fetch_failed`` then ``vanish`` when the store no longer
  held the page). A node left with no local copy is removed from the tree: its
  pages, if the store still holds them, are found again by key.
* **Backup after a host backup** (``policy="write_through"``): a node is stored
  once its host copy is acknowledged and its parent's pages are stored, so
  what this cache stores is prefix-closed.
* **Prefetch on a match** (:meth:`StorageTier.prefetch`): past a threshold and
  under a rate limit, the stored pages after the locally cached prefix become
  a ``discovered`` node that is fetched, and the termination policy decides
  whether the lookup waits for it.
* **Backoff after a failed query** (:class:`QueryBackoff`): the key query runs
  on the lookup's thread, so a store that stops answering would hold every
  lookup for its client's timeout; after one fails, answers only after
  ``query_budget``, or a copy fails as a store that is down fails one (it
  raised, or did not answer within ``io_timeout``), lookups ask nothing for a
  while, twice as long after each failure in a row; the copies in flight
  when lookups back off fail by that outage, and back them off no more.
  Those waits, a query's budget and a copy's timeout are read off one clock,
  ``StorageConfig.clock``, which a test moves by hand.
* **Tensor-parallel agreement** (:meth:`StorageTier.agree_by`): under a
  :class:`~fsm_cache.distributed.agreement.DistributedCache` each rank's store
  holds its own shard, so the ranks' stores may answer differently; the hit
  count of a query is the MIN over the ranks before any rank fetches, and a
  copy is applied only as every rank finished it (:meth:`StorageTier.report`,
  :meth:`StorageTier.accept`), so every rank fires the same storage events.
  A query that failed or was slow on any rank, and a copy that failed on any
  rank as a store that is down fails one, back every rank off, and the
  backoff ends only where the group agrees it has
  (:meth:`StorageTier.resume_queries`), so every rank asks its store at the
  same lookups; a copy ends the row of failures on every rank or on none.
"""

from __future__ import annotations

import atexit
import heapq
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from fsm_cache.cache.core import CacheCore
from fsm_cache.cache.eviction import Evictor
from fsm_cache.cache.transfers import Transfers
from fsm_cache.cache.tree import Key, TreeNode, Walk
from fsm_cache.engine import trail
from fsm_cache.engine.core import Effect
from fsm_cache.errors import (
    BadArgument,
    ConfigError,
    CopyFailed,
    CorruptPage,
    EffectFailed,
    IllegalTransition,
    InvariantViolation,
    LaterFormatPage,
    PageInUse,
    PoolExhausted,
    StoreFailed,
)
from fsm_cache.memory.tiers import Tiers
from fsm_cache.numeric import as_index, finite, shown, whole
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import FETCHING, HOST_HELD, HOST_VALID, STORAGE_HELD, Event
from fsm_cache.storage.base import Store, stored_prefix
from fsm_cache.storage.keys import Namespace, page_keys


trail.internal(__file__)

STORAGE_POLICIES = ("write_through", "off")
"""When a node is backed up to storage: after its host backup, or only when told (``fire``)."""
PREFETCH_POLICIES = ("best_effort", "wait", "timeout")
"""When a lookup that started a prefetch returns: at once, once it is read, or by a deadline."""
STORAGE_ACKNOWLEDGEMENTS = frozenset({"store_done", "store_failed", "fetch_done", "fetch_failed"})
"""The events a storage copy's outcome fires (:meth:`StorageTier.apply`), and nothing else may."""
_STORE_METHODS = ("exists_prefix", "get", "put", "drop", "capacity", "close")
_DOWN = frozenset({"failed", "timeout"})
"""Outcomes of a copy that a store which is down (or hangs) gives, as it fails a key query: the
store raised, or did not answer within ``io_timeout``. They back lookups off (:class:`QueryBackoff`);
a full store or a page gone or torn is the store answering, and does not."""
_GONE = frozenset({"missing", "corrupt", "later_format", "peer_missing"})
"""Outcomes of a read whose first failed page the store no longer holds, or holds in a form this
version cannot read (as good as gone, to this cache): the rest vanish."""

HitAgreement = Callable[[Sequence[int], Sequence[int]], list[int]]
"""Agrees on a prefetch query's hit counts: ``(found, asked)`` -> the agreed ``found``.

``found`` are the stored pages this rank's store reported (of the cached run
being discovered, then of the tail), then 1 where the store answered and 0
where it raised, then 1 where it answered within ``query_budget`` and 0
where it did not; ``asked`` how many pages were asked about, then 1 and 1,
which every rank must share. A tensor-parallel group returns the MIN over its
ranks (:class:`~fsm_cache.distributed.agreement.DistributedCache`), so a
query that failed (or was slow) on any rank failed (or was slow) for all; a
cache on its own keeps what its store said."""


def _alone(found: Sequence[int], asked: Sequence[int]) -> list[int]:  # noqa: ARG001
    """A cache on its own: its store's answer is the answer (nothing to share)."""
    return list(found)


@dataclass(frozen=True)
class StorageConfig:
    """A storage tier below a cache's host memory, and how the cache uses it.

    Attributes:
        store: The backend (:class:`~fsm_cache.storage.local.LocalFileStore`,
            :class:`~fsm_cache.storage.redisstore.RedisStore`, or any
            :class:`~fsm_cache.storage.base.Store`). The cache never closes it.
        model: The model's id (name and revision): caches share pages only
            under the same model, KV layout, page size and rank. Required:
            two models with one KV layout (fine-tunes of one base) would read
            each other's pages under a shared default.
        rank: This cache's rank in its tensor-parallel group.
        ranks: The group's size where each rank holds its own KV heads, or 1
            where every rank holds the same KV (an MLA latent) and the ranks
            share one namespace. None (not said) is 1 for a cache alone; a
            :class:`~fsm_cache.distributed.agreement.DistributedCache` of
            more than one rank refuses it, since each rank would read the
            shards of the others under one namespace.
        policy: ``write_through`` stores every node once its host backup is
            acknowledged (parents first); ``off`` stores only what is fired by
            hand (``cache.fire("store", node)``).
        prefetch_threshold: Fewest tokens past the locally cached prefix worth
            a key query, and fewest stored tokens worth a fetch (SGLang: 256).
        prefetch_policy: ``best_effort`` (the lookup returns at once; a later
            :meth:`~fsm_cache.cache.hicache.HiCache.poll` applies the read),
            ``wait`` (the lookup waits for the read, up to ``io_timeout``) or
            ``timeout`` (it waits up to ``prefetch_timeout`` seconds, then
            continues best-effort).
        prefetch_timeout: The ``timeout`` policy's wait, in seconds.
        prefetch_capacity: Most tokens being fetched at once; a lookup while
            that many are in flight does not prefetch. None: half the host pool.
        io_timeout: Seconds after which a copy to or from the store that has
            not finished is failed (its pin given back, its slots freed).
        query_backoff: Seconds lookups ask the store nothing after a key
            query failed (the store raised, its client timed out, or it
            answered after ``query_budget``) or a copy failed as a store that
            is down fails one (it raised, or did not answer within
            ``io_timeout``): the query runs on the lookup's thread, so without
            it every lookup would wait out the client's timeout while the
            store is down. Doubled after each failure in a row, up to
            ``query_backoff_max``; the first query that answers within its
            budget ends it, and a poll outside a backoff whose copies the
            store all answered ends the row. 0: every lookup asks.
        query_backoff_max: The longest backoff, in seconds.
        threads: Worker threads doing the store's I/O, at most
            :data:`MOST_THREADS`; 0 runs each copy inline when it starts
            (deterministic, for tests and tools).
        owned: The cache owns the store's contents and may delete pages
            (:meth:`~fsm_cache.cache.hicache.HiCache.evict_storage`). Leave it
            False for a store other servers share: its server evicts.
        query_budget: Seconds a key query may take: one that answers later
            is used, but counts as failed for the query backoff (a store that
            answers every query after seconds holds every lookup as long as
            one that is down, only without failing).
        clock: Where the tier reads the time, in seconds: every decision
            that depends on it (a backoff's wait, a query past its budget, a
            copy past ``io_timeout``) reads this clock, and a wait for a copy
            lasts the seconds this clock says are left. A test passes one it
            moves by hand, so that a run takes the same decisions however
            slowly a loaded machine runs it, and replays exactly with
            ``threads=0``: with store threads, whether a copy started late
            also depends on when its thread ran. The store threads call it
            too (whether a copy they start is already past its timeout), so
            it must be safe to call from several threads at once, as
            ``time.monotonic`` is. :meth:`check` reads it once: it must
            answer a finite number of seconds.
    """

    store: Store
    model: str
    rank: int = 0
    ranks: int | None = None
    policy: str = "write_through"
    prefetch_threshold: int = 256
    prefetch_policy: str = "best_effort"
    prefetch_timeout: float = 2.0
    prefetch_capacity: int | None = None
    io_timeout: float = 30.0
    query_backoff: float = 1.0
    query_backoff_max: float = 30.0
    threads: int = 1
    owned: bool = False
    query_budget: float = 0.5
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first value of the wrong type or out of range."""
        missing = [m for m in _STORE_METHODS if not callable(_method(self.store, m))]
        if missing:
            raise ConfigError(
                f"storage: store must be a Store ({', '.join(_STORE_METHODS)}), "
                f"got {type(self.store).__name__} without {', '.join(missing)}"
            )
        if isinstance(self.store, type):  # its methods are there, unbound: every call would fail
            raise ConfigError(
                f"storage: store must be a Store, got the class {self.store.__name__}"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"storage: model must be a non-empty str, got {self.model!r}")
        for name, allowed in (("policy", STORAGE_POLICIES), ("prefetch_policy", PREFETCH_POLICIES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(
                    f"storage: {name} must be one of {', '.join(allowed)}, got {value!r}"
                )
        _need_int(self, "prefetch_threshold", 0)
        if not whole(self.threads, 0) or self.threads > MOST_THREADS:
            raise ConfigError(
                f"storage: threads must be an int from 0 to {MOST_THREADS}, got {self.threads!r}"
            )
        if self.ranks is not None:
            _need_int(self, "ranks", 1)
        if not whole(self.rank) or self.rank >= self.shards:
            raise ConfigError(
                f"storage: rank must be an int in 0..{self.shards - 1}, got {self.rank!r}"
            )
        if self.prefetch_capacity is not None:
            _need_int(self, "prefetch_capacity", 0)
        _check_seconds(self)
        if not isinstance(self.owned, bool):
            raise ConfigError(f"storage: owned must be a bool, got {self.owned!r}")
        if not callable(self.clock):
            raise ConfigError(
                f"storage: clock must be a callable returning seconds, got {self.clock!r}"
            )
        _check_clock(self.clock)

    @property
    def shards(self) -> int:
        """The group size the pages are keyed under: ``ranks``, or 1 where it is not said."""
        return 1 if self.ranks is None else self.ranks


def _portable(tree_namespace: object) -> bool:
    """Whether ``tree_namespace`` is None, a str, an int, bytes, or a tuple of them (at any depth).

    Exact types: a bool equals an int of another repr, and a subclass may
    write its own.
    """
    if type(tree_namespace) is tuple:
        return all(_portable(item) for item in tree_namespace)
    return tree_namespace is None or type(tree_namespace) in (str, int, bytes)


def _check_seconds(config: StorageConfig) -> None:
    """Raise :class:`ConfigError` naming the first duration that is not a finite number of seconds.

    The timeouts must be above 0; a backoff may be 0 (none), and its longest
    wait no shorter than its first.
    """
    for name, zero in (
        ("prefetch_timeout", False),
        ("io_timeout", False),
        ("query_budget", False),
        ("query_backoff", True),
        ("query_backoff_max", True),
    ):
        value = getattr(config, name)
        if type(value) is int and not finite(value):
            raise ConfigError(
                f"storage: {name} must be seconds a float can hold, got {shown(value)}"
            )
        if not finite(value) or not (value >= 0 if zero else value > 0):
            raise ConfigError(
                f"storage: {name} must be seconds {'>=' if zero else '>'} 0, got {value!r}"
            )
    if config.query_backoff_max < config.query_backoff:
        raise ConfigError(
            f"storage: query_backoff_max must be at least query_backoff "
            f"({config.query_backoff!r}), got {config.query_backoff_max!r}"
        )


def _method(store: object, name: str) -> object:
    """Return ``store``'s attribute ``name``, or None where it has none.

    Raises:
        ConfigError: Looking it up raised (a client that connects on first
            use, and is down): no store this check can accept, and its error
            is not the cache's to let out untyped.
    """
    try:
        return getattr(store, name, None)
    except Exception as exc:  # the caller's object: whatever its lookup raises
        raise ConfigError(
            f"storage: store must be a Store, and looking up its {name} raised "
            f"{type(exc).__name__}: {exc}"
        ) from None


def _check_clock(clock: Callable[[], float]) -> None:
    """Raise :class:`ConfigError` unless one reading of ``clock`` is a finite number of seconds.

    Every deadline of the tier is read off it: a clock that answered
    anything else failed every later poll (or, answering None, let no
    copy ever time out), with copies in flight and their pins held.
    """
    try:
        now = clock()
    except Exception as exc:  # the user's clock: whatever it raises
        raise ConfigError(f"storage: clock raised {type(exc).__name__} when read: {exc}") from None
    if not finite(now):
        raise ConfigError(
            f"storage: clock must return a finite number of seconds, returned {shown(now)}"
        )


MOST_THREADS = 256
"""The most storage worker threads a tier takes: a store's I/O gains nothing from more, and a
count the process cannot start failed only at the first store ("can't start new thread")."""


def _need_int(config: StorageConfig, name: str, least: int) -> None:
    value = getattr(config, name)
    if not whole(value, least):
        raise ConfigError(f"storage: {name} must be an int >= {least}, got {value!r}")


class QueryBackoff:
    """Whether lookups may ask the store now: after a failed key query, not for a while.

    A key query runs on the lookup's thread, so a store that stops answering
    (Redis paused, or cut off by the network) holds every lookup for its
    client's timeout. After a query fails (or answers only after the tier's
    ``query_budget``), or a copy fails as a store that is down fails one,
    lookups ask nothing (``closed``) for ``first`` seconds, twice as long
    after each failure in a row, at most ``longest``; the first query after
    the wait is a trial, and one that answers within its budget ends the
    backoff. Copies the store answered outside a backoff end the row too
    (:meth:`answered`): a cache whose lookups all hit locally asks nothing,
    and its stores are its only trials.

    The wait is read off the tier's clock (``StorageConfig.clock``), but only
    the tier decides when (:meth:`StorageTier.resume_queries`): under
    tensor-parallel agreement every rank must ask its store at the same
    lookups, or the ranks would reach different collectives.

    Attributes:
        first: The first wait, in seconds (0: never back off).
        longest: The longest wait, in seconds.
        failures: Queries (or outages a copy failed in) failed in a row.
        until: When (the tier's clock) the wait has passed.
        closed: Lookups ask the store nothing.
    """

    __slots__ = ("closed", "failures", "first", "longest", "until")

    def __init__(self, first: float, longest: float) -> None:
        self.first = first
        self.longest = longest
        self.failures = 0
        self.until = 0.0
        self.closed = False

    def failed(self, now: float) -> None:
        """A query failed at ``now``: close for the next wait (none when ``first`` is 0)."""
        self.failures += 1
        if not self.first:
            return
        wait = self.first * 2.0 ** min(self.failures - 1, 64)  # capped: 2**1024 overflows
        self.until = now + min(wait, self.longest)
        self.closed = True

    def reopen(self) -> None:
        """Let the next lookup ask: a trial, which backs off twice as long if it fails too."""
        self.closed = False

    def answered(self) -> None:
        """A query answered: the store is back, the next failure waits ``first`` again."""
        self.failures = 0

    def passed(self, now: float) -> bool:
        """Return whether the clock, reading ``now``, says the wait has passed (or none runs)."""
        return not self.closed or now >= self.until


@dataclass
class StoreResult:
    """What a worker reports of one copy: the leading pages that landed, and why it stopped.

    Attributes:
        held: Leading pages stored (a store) or read (a fetch).
        pages: The pages a fetch read, in order (``held`` of them).
        outcome: ``ok``, ``full`` (the store had no room), ``missing`` (the store
            no longer held a page), ``corrupt`` (a page read back torn or
            foreign; the worker dropped it), ``later_format`` (a page a newer
            version wrote; left stored), ``failed`` (the store raised, the
            copy could not be started, or a fetch's pages could not be
            written to the host) or
            ``timeout`` (no answer within ``io_timeout``); under tensor-parallel
            agreement also ``peer_failed`` or ``peer_missing``: this rank
            landed more pages, another rank's copy stopped first (``missing``:
            its store no longer held the page).
        error: What the store raised, if it did.
    """

    held: int
    pages: list[torch.Tensor]
    outcome: str
    error: str | None = None


class StorageCopy:
    """One copy to or from the store: its ticket, the nodes it serves, and its result.

    A store's snapshot of its host pages is held here, not by the job queued
    for a worker, so that the cache thread can let it go when the copy is
    abandoned (:meth:`abandon`) while the job still waits behind a worker that
    hangs. Whichever of the worker (:meth:`claim`) and the cache thread comes
    first decides, under a lock: a worker that claimed the snapshot writes it
    (the memory comes back when its put returns), and one that comes after an
    abandon finds nothing to write and does not run the copy.

    Attributes:
        number: The copy's number in the log (from 1 since construction or reset).
        kind: ``store`` or ``fetch``.
        nodes: The nodes it serves, in key order (a split inserts the prefix).
        keys: The page keys of those nodes, in order.
        started: When it was started (the tier's clock); None while queued.
        done: Set by the worker once :attr:`result` is there.
        result: The worker's report, or None.
        snapshot: The host pages a store writes, until a worker claims them or
            the copy is abandoned (then empty); empty for a fetch.
    """

    __slots__ = (
        "_claims",
        "_end",
        "_fate",
        "done",
        "keys",
        "kind",
        "nodes",
        "number",
        "result",
        "snapshot",
        "started",
    )

    def __init__(self, number: int, kind: str, node: TreeNode, keys: Sequence[str]) -> None:
        self.number = number
        self.kind = kind
        self.nodes = [node]
        self.keys = tuple(keys)
        self.started: float | None = None
        self.done = threading.Event()
        self.result: StoreResult | None = None
        self.snapshot: list[torch.Tensor] = []
        self._claims = threading.Lock()
        self._fate = ""  # "running" once a worker claimed it, "abandoned" once the cache did
        self._end: StoreResult | None = None  # how the cache found it ended, once it looked

    def tokens(self) -> int:
        """Return the tokens this copy moves."""
        return sum(len(n.key) for n in self.nodes)

    def claim(self) -> list[torch.Tensor] | None:
        """Take the snapshot to run the copy (a worker); None where it was abandoned first."""
        with self._claims:
            if self._fate == "abandoned":
                return None
            self._fate = "running"
            pages, self.snapshot = self.snapshot, []
            return pages

    def end(self, timeout: StoreResult) -> StoreResult:
        """Return how the copy ended, to the cache: decided at the first call, the same after.

        The worker's result where it has answered, else ``timeout`` (and the
        copy is abandoned). A worker that answers later answers no one: under
        tensor-parallel agreement a rank reads a copy's ending more than once
        before the group applies it (each step's report, and whether a store
        failed here), and every read must find the ending the first reported.
        The cache thread calls it once the copy finished or passed its timeout.
        """
        with self._claims:
            if self._end is None:
                answered = self.result if self.done.is_set() else None
                if answered is None:
                    self._let_go()
                self._end = timeout if answered is None else answered
            return self._end

    def fail(self, now: float, error: str) -> None:
        """End a copy no worker was given as ``failed`` with ``error``, started at ``now``.

        Or one whose inline worker (``threads=0``) a BaseException interrupted
        before it answered. Its snapshot is let go; the next :meth:`StorageTier.collect` returns it.
        """
        self.abandon()
        if self.started is None:
            self.started = now
        self.result = StoreResult(0, [], "failed", error)
        self.done.set()

    def abandon(self) -> None:
        """Let the snapshot go, and no worker run the copy, unless a worker runs it already.

        The cache thread calls it once nobody waits for the copy (its timeout
        was applied, or the tier was reset); a worker that claimed it first
        holds its pages until its put returns, and no longer.
        """
        with self._claims:
            self._let_go()

    def _let_go(self) -> None:
        """Abandon the copy unless a worker claimed it; the caller holds the claims lock."""
        if self._fate != "running":
            self._fate = "abandoned"
            self.snapshot = []


class _Workers:
    """Threads that run the store's I/O, or none (``threads=0``: each job runs when submitted).

    Threads the process cannot start (its thread limit, ``ulimit -u`` or a
    cgroup's ``pids.max``) are done without: the jobs go to those that
    started. If none did, the copy fails at once, and the next one tries again.

    A job records its copy's result whatever its store raises, so a thread
    lives as long as the cache: a BaseException a store raises on a thread
    (``asyncio.CancelledError``, ``SystemExit``, a green thread's timeout) fails
    that copy and the thread goes on to the next (SGLang #38427: one exception
    ended the backup thread, and every later backup waited for its timeout). A
    job that hangs holds its thread, and the copies behind it are failed by
    their timeout (and not run once a thread gets to them); their snapshots
    are let go then (:meth:`StorageCopy.abandon`), though the jobs stay queued.
    """

    def __init__(self, threads: int, wait: float) -> None:
        self._count = threads
        self._wait = wait  # what close() waits at the interpreter's exit (_end_at_exit)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._ending: list[threading.Thread] = []  # told to end, not seen to yet

    def submit(self, job: Callable[[], None]) -> None:
        if not self._count:
            job()
            return
        if not self._threads:
            _RUNNING.add(self)
            for i in range(self._count):
                thread = threading.Thread(target=self._loop, name=f"fsm-storage-{i}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # past the process's thread limit
                    if not self._threads:  # none started: the copy fails, and the next tries again
                        raise
                    break  # go on with those that started
                self._threads.append(thread)
        self._jobs.put(job)

    def end_at_exit(self) -> None:
        """:meth:`close`, waiting as long as the cache's ``close()`` would (its ``io_timeout``)."""
        self.close(self._wait)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # the job failed its copy with it (_run); the thread goes on
                continue

    def close(self, wait: float) -> None:
        """Let each thread end once the jobs before it ran, and wait up to ``wait`` seconds for it.

        A thread still in the store's code when the interpreter exits can abort
        the process (a C++ runtime that is torn down under it): a cache closed
        by a server that then exits must leave none running. A thread whose
        store hangs past ``wait`` is left (a daemon thread); its copy was
        failed by its timeout already. Called on a worker (a dropped cache's
        ``__del__`` run by the cyclic collector there), that worker is not
        waited for: it ends after its job.
        """
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        self._ending += threads
        deadline = time.monotonic() + _waitable(wait)
        here = threading.current_thread()
        for thread in self._ending:
            if thread is not here:  # joining itself would raise
                thread.join(_waitable(deadline - time.monotonic()))
        self._ending = [thread for thread in self._ending if thread.is_alive()]
        if not self._ending:  # else the exit waits for them (_end_at_exit)
            _RUNNING.discard(self)


_RUNNING: weakref.WeakSet[_Workers] = weakref.WeakSet()
"""The workers whose threads run, of caches not closed yet (a thread holds its workers)."""


@atexit.register
def _end_at_exit() -> None:
    """End the worker threads of every cache left unclosed, as the interpreter exits.

    A thread still in a store's code when the interpreter is torn down can
    abort the process ("terminate called without an active exception"), and
    a cache a module global holds is dropped only then, too late for its
    ``__del__``. This runs before that, as ``close()`` would: each thread
    ends once the jobs queued before it ran (copies past their timeout are
    not run), waited for up to its cache's ``io_timeout``.
    """
    for workers in list(_RUNNING):
        workers.end_at_exit()


def _run(
    store: Store,
    copy: StorageCopy,
    shape: tuple[int, ...],
    timeout: float,
    clock: Callable[[], float],
) -> None:
    """Run one copy on a worker: record its result, whatever the store does.

    A fetch's pages must be uint8 pages of ``shape`` (a host page's). A copy
    that waited in the queue past its ``timeout`` (by the tier's ``clock``) is
    failed by it already (or will be, at the next poll), so it is not run:
    behind a slow store, running every such copy would keep the workers busy
    with copies nobody waits for, and every later copy would time out in the
    queue too. Nor is one the cache abandoned (:meth:`StorageCopy.abandon`)
    before this worker claimed it.
    """
    late = copy.started is not None and clock() >= copy.started + timeout
    pages = None if late else copy.claim()
    if pages is None:
        copy.abandon()  # a copy nobody runs needs no snapshot
        copy.result = StoreResult(0, [], "timeout", f"not started within {timeout} s")
        copy.done.set()
        return
    try:
        if copy.kind == "store":
            result = _put(store, copy.keys, pages)
        else:
            result = _get(store, copy.keys, shape)
    except Exception as exc:  # the copy fails; the thread must live on (SGLang #38427)
        result = StoreResult(0, [], "failed", f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # failed all the same; a thread goes on, inline it is raised
        copy.result = StoreResult(0, [], "failed", f"{type(exc).__name__}: {exc}")
        copy.done.set()
        raise
    copy.result = result
    copy.done.set()


def _put(store: Store, keys: Sequence[str], pages: list[torch.Tensor]) -> StoreResult:
    """Write ``keys``' pages; a store that answers for other pages than it was given failed.

    Results beyond the pages given were counted as stored pages: a node
    whose put answered five results for two pages was ``stored`` and the
    put counted ``full`` at once. Fewer results than pages store the
    answered prefix, as a put that filled the store does.
    """
    try:
        results = store.put(keys, pages)
    except StoreFailed as exc:
        return StoreResult(_counted(exc.acknowledged, len(keys)), [], "failed", str(exc))
    if len(results) > len(keys):
        cause = f"the store answered {len(results)} results for {len(keys)} pages"
        return StoreResult(0, [], "failed", cause)
    held = stored_prefix(results)
    return StoreResult(held, [], "ok" if held == len(keys) else "full")


def _counted(value: object, total: int) -> int:
    """A store's count of ``total`` pages (a failed put's stored, a drop's dropped), in ``0..total``.

    A store's count may be a numpy integer, which is the int it stands for.
    One that is not a count of those pages (None, a bool, a negative number,
    more pages than were given, not an integer) counts as none: a failed
    put's pages are not taken as stored (a later lookup may still find them),
    and a drop's are not counted as evicted.
    """
    held = as_index(value)
    return held if held is not None and 0 <= held <= total else 0


def _get(store: Store, keys: Sequence[str], shape: tuple[int, ...]) -> StoreResult:
    """Read ``keys``' pages; a page that is not a host page's KV is dropped and ends the prefix.

    Wrong KV is never used, and a page left in the store would be found, read
    and refused again at every lookup: a torn or foreign page and one of
    another shape or dtype are dropped alike, keeping the pages before it.
    The pages read again before a torn one are checked as a whole read's are:
    the first of another shape or dtype ends the prefix there.
    """
    error = None
    try:
        pages = store.get(keys)
        if len(pages) > len(keys):  # its fault, not the host's: the pages fit no slots
            cause = f"the store answered {len(pages)} pages for {len(keys)} keys"
            return StoreResult(0, [], "failed", cause)
        outcome = "ok" if len(pages) == len(keys) else "missing"
    except CorruptPage as exc:
        at = keys.index(exc.key) if exc.key in keys else 0
        later = isinstance(exc, LaterFormatPage)
        if not later:  # a newer version's page is whole: it stays for the servers that read it
            _drop_bad(store, exc.key)
        pages = store.get(keys[:at]) if at else []
        if len(pages) > at:  # read again, it is checked as the first read is
            return StoreResult(
                0, [], "failed", f"the store answered {len(pages)} pages for {at} keys"
            )
        outcome, error = "later_format" if later else "corrupt", str(exc)
    foreign = _foreign(pages, shape)
    if foreign is not None:
        at, problem = foreign
        _drop_bad(store, keys[at])
        return StoreResult(at, pages[:at], "corrupt", problem)
    return StoreResult(len(pages), pages, outcome, error)


def _foreign(pages: Sequence[torch.Tensor], shape: tuple[int, ...]) -> tuple[int, str] | None:
    """Return the first page not of a host page's ``shape`` and dtype (uint8) and why, or None.

    ``copy_`` into a host page would broadcast one of a smaller shape (a page
    of another layout, written whole into every slot of it) instead of
    refusing it: only an exact match is a host page's KV.
    """
    for i, page in enumerate(pages):
        if tuple(page.shape) != shape or page.dtype != torch.uint8:
            return i, f"page {i} is {page.dtype} {tuple(page.shape)}, not uint8 {shape}"
    return None


def _drop_bad(store: Store, key: str) -> None:
    """Drop a page that is not a host page's KV; one the store will not drop now is left.

    A read may hold it (``PageInUse``), or the store may refuse to delete (a
    read-only folder, a Redis user without ``DEL``: ``StoreFailed``, or
    whatever a store of another make raises). The pages before it are intact
    and still used either way: failing the whole read would throw them away at
    every lookup that meets the page, and the next read that meets it tries
    the drop again.
    """
    try:
        store.drop([key])
    except Exception:  # the drop is a courtesy to the next reader; the read stands
        return


class StorageTier:
    """The copies to and from one cache's store, their tickets, and prefetch.

    Args:
        config: The store and the policies; checked by the caller.
        core: Fires the storage events and owns the tree.
        tiers: The host pool the copies read and fill.
        transfers: Tells of host backups acknowledged (a store may start), and
            backs up what a fetch acknowledged lets it (a child recomputed under
            a node that was still being fetched).
        evictor: Frees host room for a fetch.
        write_policy: The host write policy (a write-through host copy below a
            node without one would break design invariant 3).
    """

    def __init__(
        self,
        config: StorageConfig,
        core: CacheCore,
        tiers: Tiers,
        *,
        transfers: Transfers,
        evictor: Evictor,
        write_policy: WritePolicy,
    ) -> None:
        self.config = config
        self._store = config.store
        self._core = core
        self._tiers = tiers
        self._transfers = transfers
        self._evictor = evictor
        self._write_through = write_policy is not WritePolicy.WRITE_BACK
        self._base = Namespace.for_layout(
            config.model, tiers.host.layout, rank=config.rank, ranks=config.shards
        )
        pool_tokens = tiers.host.num_pages * tiers.page_size
        self.capacity = (
            pool_tokens // 2 if config.prefetch_capacity is None else config.prefetch_capacity
        )
        self._copies: dict[int, StorageCopy] = {}  # queued or started, not applied, by number
        self._queued: list[StorageCopy] = []
        self._numbers = 0
        self._agree_hits: HitAgreement = _alone
        self._agreed_only = False  # a group agrees on what collect() returns
        self._reported: dict[int, StoreResult | None] = {}  # the window of the last report
        self._agreed: dict[int, StoreResult] = {}  # accepted, not yet applied, by number
        # fetches report() wrote to the host, not yet applied: the result, the write's error
        self._landed: dict[int, tuple[StoreResult, Exception | None]] = {}
        self._unwritten: CopyFailed | None = None  # the first such write failed, applied, unraised
        # copies whose failure backs nothing off (again): a step carried it already, or
        # lookups backed off while the copy was in flight (:meth:`_back_off`)
        self._told: set[int] = set()
        self._workers = _Workers(config.threads, config.io_timeout)
        self._clock = config.clock  # the config's: read for every timed decision
        self.backoff = QueryBackoff(config.query_backoff, config.query_backoff_max)
        transfers.on_ack(self._host_acknowledged)
        evictor.on_short(partial(self.apply_finished, "evict"))
        core.on_split(self._rehome)

    # -- views ---------------------------------------------------------------

    def in_flight(self) -> Mapping[int, StorageCopy]:
        """The copies queued or started and not yet applied, by number (read-only view)."""
        return self._copies

    def pending(self) -> frozenset[int]:
        """Return the ids of nodes a storage copy in flight or queued serves."""
        return frozenset(n.id for c in self._copies.values() for n in c.nodes)

    def fetching_tokens(self) -> int:
        """Return the tokens being fetched now: what the prefetch rate limit counts."""
        return sum(c.tokens() for c in self._copies.values() if c.kind == "fetch")

    def namespace(self, tree_namespace: Hashable = None) -> Namespace:
        """Return the key namespace of the tree's ``tree_namespace`` (None: the model's own).

        A tree namespace other than None (a LoRA adapter, say) keys its pages
        apart by its ``repr``, which must therefore be the same on every server:
        :meth:`check_namespace` refuses the others.
        """
        if tree_namespace is None:
            return self._base
        return replace(self._base, tree=repr(tree_namespace))

    @staticmethod
    def check_namespace(tree_namespace: Hashable, op: str) -> None:
        """Refuse a tree namespace whose pages would not get the same keys on every server.

        Its ``repr`` keys its pages (:meth:`namespace`). None, a str, an int,
        bytes and tuples of them have one that every process writes alike, and
        equal ones exactly when they are equal. An ``object()`` (its repr holds
        its address) would key pages no other server finds; ``1.0`` or ``True``
        would share the tree of ``1`` but not its stored pages.

        Raises:
            BadArgument: Naming ``op`` and the namespace.
        """
        if not _portable(tree_namespace):
            raise BadArgument(
                f"{op}: namespace {tree_namespace!r} cannot key stored pages: a storage "
                "tier needs None, a str, an int, bytes or a tuple of them, "
                "whose repr is the same on every server"
            )

    def keys_of(self, node: TreeNode) -> tuple[str, ...]:
        """Return ``node``'s page keys, computing them (and its ancestors') once.

        Raises:
            BadArgument: A token does not fit the keys' 32 bits; nothing is kept.
        """
        chain: list[TreeNode] = []
        walk = node
        while walk.parent is not None and walk.store_keys is None:
            chain.append(walk)
            walk = walk.parent
        if not chain:
            return node.store_keys or ()
        prior = walk.store_keys[-1] if walk.parent is not None and walk.store_keys else None
        root = walk
        while root.parent is not None:
            root = root.parent
        namespace = self.namespace(self._core.tree.namespace_of(root))
        computed = []
        for n in reversed(chain):
            keys = tuple(page_keys(namespace, n.key, parent=prior))
            computed.append((n, keys))
            prior = keys[-1] if keys else prior
        for n, keys in computed:
            n.store_keys = keys
        return node.store_keys or ()

    # -- the spec's effects ----------------------------------------------------

    def effects(self) -> dict[str, Effect]:
        """Return the storage region's effects by the names the spec gives them."""
        return {
            "start_store": self.start_store,
            "start_fetch": self.start_fetch,
            "delete_storage": self.delete_storage,
        }

    def start_store(self, node: TreeNode) -> None:
        """Queue the host-to-storage copy of ``node`` (the host side took its pin)."""
        self._queue("store", node, self.keys_of(node))

    def start_fetch(self, node: TreeNode) -> None:
        """Take host slots for ``node`` (evicting host leaves, never its parent) and queue the read.

        Only the shortfall is evicted, and nothing at all when eviction could
        not make room (the fetch is then refused with PoolExhausted).
        """
        keys = self.keys_of(node)
        size = len(node.key) // self._tiers.page_size
        try:
            pages = self._tiers.alloc_host(size, node.id)
        except PoolExhausted:
            spare = (node.parent,) if node.parent is not None else ()
            if not self._evictor.could_free_host(size, spare):
                raise  # no eviction could make room: refused before anything is evicted
            short = size - self._tiers.host.allocator.free_pages
            self._evictor.evict_host(short * self._tiers.page_size, spare=spare)
            pages = self._tiers.alloc_host(size, node.id)
        node.host_pages = pages
        self._evictor.offer_host(node)  # a host leaf to evict once its pages land
        self._queue("fetch", node, keys)

    def delete_storage(self, node: TreeNode) -> None:
        """Delete ``node``'s pages from a store this cache owns.

        Under tensor-parallel agreement a drop this rank's store refuses or
        fails (a read of a fetch that timed out still holds a page, a Redis
        blip) is this rank's alone: failing the event here would leave the node
        stored on this rank and evicted on the others, so ``evict_storage``
        goes on, counted as ``evict:failed``. The pages left behind in this
        rank's store are unknown to the tree, as pages a rank's store landed
        past the prefix the group agreed on: found again by key, or evicted by
        the store's own limit.

        Raises:
            ConfigError: The store is shared (``owned=False``).
            PageInUse: A read holds a page (local store); nothing was deleted
                (not under agreement).
        """
        if not self.config.owned:
            raise ConfigError(
                "storage: the store is shared (owned=False): its own eviction deletes pages"
            )
        keys = list(self.keys_of(node))
        try:
            dropped = self._store.drop(keys)
        except Exception as exc:
            if not self._agreed_only:
                raise
            self._evict_failed(exc)  # whatever this rank's store raised: the group evicts
            return
        # what was still stored; a store that answers no count (None) has dropped them all the same
        self._core.counters.storage_pages["evicted"] += _counted(dropped, len(keys))

    def _evict_failed(self, error: BaseException) -> None:
        """Count a drop the store would not do as ``evict:failed``, with what it said."""
        self._core.counters.storage_failures["evict:failed"] += 1
        self._core.counters.storage_errors["evict:failed"] = str(error)

    def _queue(self, kind: str, node: TreeNode, keys: Sequence[str]) -> None:
        self._numbers += 1
        copy = StorageCopy(self._numbers, kind, node, keys)
        self._queued.append(copy)
        self._copies[copy.number] = copy

    # -- starting copies -------------------------------------------------------

    def flush(self) -> None:
        """Start every queued copy (a store first snapshots the host pages it reads).

        A copy that cannot be started (its snapshot's memory cannot be had, or
        no worker thread can be) is failed at once, as a copy whose store
        raised: the next poll applies it, and the copies after it start. Raised
        out of the flush, it would leave every copy queued behind it started
        by no one and applied never, its nodes in a copying state for ever.

        A BaseException (KeyboardInterrupt from a store's put or get run
        inline, ``threads=0``) fails the copy it interrupted, as a store that
        raised fails it, and puts the copies not yet started back on the
        queue, for the next flush; then it goes on.
        """
        queued, self._queued = self._queued, []
        taken = 0
        try:
            shape = tuple(self._tiers.host.pages.shape[1:])
            for copy in queued:
                taken += 1
                try:
                    self._start_copy(copy, shape)
                except Exception as exc:  # torch's allocator, the threading module: not the store's
                    copy.fail(self._clock(), f"not started: {type(exc).__name__}: {exc}")
                except BaseException as exc:
                    if not copy.done.is_set():  # interrupted before its worker answered
                        copy.fail(self._clock(), f"{type(exc).__name__}: {exc}")
                    raise
        finally:
            self._queued[:0] = queued[taken:]

    def _start_copy(self, copy: StorageCopy, shape: tuple[int, ...]) -> None:
        """Snapshot a store's host pages, stamp the copy started, and give it to a worker."""
        if copy.kind == "store":
            host = [p for n in copy.nodes for p in n.host_pages]
            index = torch.tensor(host, dtype=torch.long)
            copy.snapshot = list(self._tiers.host.pages.index_select(0, index).unbind(0))
        copy.started = self._clock()
        job = partial(_run, self._store, copy, shape, self.config.io_timeout, self._clock)
        self._workers.submit(job)

    def idle(self) -> bool:
        """Return whether no storage copy is queued or in flight."""
        return not self._copies

    # -- acknowledgements ------------------------------------------------------

    def collect(self, wait_until: float | None = None) -> list[StorageCopy]:
        """Return the started copies that finished or timed out, in number order.

        Under tensor-parallel agreement (:meth:`agree_by`), only the copies the
        group accepted (:meth:`accept`) and not yet applied, whatever finished
        here: a copy that finished on this rank alone must wait for the others.

        Args:
            wait_until: Wait for every started copy until this instant of
                the tier's clock (each at most until its own timeout); None waits for none.
                Given, it returns what finished here even under agreement
                (:meth:`settle`, when the cache closes).
        """
        if self._agreed_only and wait_until is None:
            return [self._copies[number] for number in self._agreed]
        timeout = self.config.io_timeout
        out = []
        for copy in list(self._copies.values()):
            if copy.started is None:
                continue
            deadline = copy.started + timeout
            if wait_until is not None:
                _wait(copy, min(wait_until, deadline) - self._clock())
            if copy.done.is_set() or self._clock() >= deadline:
                out.append(copy)
        return out

    def apply_finished(self, origin: str, keep: frozenset[int] = frozenset()) -> int:
        """Apply the copies :meth:`collect` returns, never waiting; return how many were applied.

        Args:
            origin: Who applies them, as the log records it (``poll``, ``evict``).
            keep: Ids of nodes whose copies are left for a later poll: an
                allocation short of room holds them, and applying a copy may
                split its nodes or remove them (:meth:`Evictor.on_short`).

        Raises:
            CopyFailed: As :meth:`apply`.
        """
        copies = self.collect()
        if keep:
            copies = [c for c in copies if not any(n.id in keep for n in c.nodes)]
        return self.apply(copies, origin)

    def apply(self, copies: Sequence[StorageCopy], origin: str) -> int:
        """Apply finished (or timed-out) copies in order: log them, then fire their events.

        A copy the worker has not answered by now is failed as ``timeout``; an
        answer that comes later is ignored. A fetch's pages are written to its
        host slots before anything is applied (:meth:`_land`); one whose pages
        could not be is applied as ``failed``, so its nodes settle, and the
        error is raised once every copy was applied. Returns how many were applied.

        Under agreement the copies the group accepted were written by
        :meth:`report`, and the error is kept for :meth:`raise_unwritten`
        instead (the group's step raises it), except when the cache closes
        (``wait``).

        Raises:
            CopyFailed: A fetch's pages could not be written to the host; its
                nodes failed as after a store that raised, and the other copies
                were applied.
        """
        if not copies:
            return 0
        answered = [(copy, self._result(copy)) for copy in copies]
        down = self._down(answered)  # the store's answers: a page not written is not its fault
        unwritten: list[tuple[StorageCopy, Exception]] = []
        outcomes = [(copy, self._land(copy, result, unwritten)) for copy, result in answered]
        self._core.log.storage(origin, [(c.number, c.kind, r.held, r.outcome) for c, r in outcomes])
        if not down:
            if not self.backoff.closed:  # a trial, or none needed: a later failure is a new row
                self.backoff.answered()  # (while closed, a slow query's fetch still lands)
        elif not self._agreed_only and not self._told.issuperset(down):
            self._back_off()  # once per outage: copies then in flight back off no more
        for copy, result in outcomes:
            del self._copies[copy.number]
            self._told.discard(copy.number)
            seconds = self._clock() - (copy.started or self._clock())
            nbytes = result.held * self._tiers.host.layout.page_bytes
            self._core.counters.storage_copied(
                copy.kind, seconds, result.held, nbytes, result.outcome, error=result.error
            )
            if copy.kind == "store":
                self._apply_store(copy, result)
            else:
                self._apply_fetch(copy, result)
        if unwritten:
            copy, exc = unwritten[0]
            error = CopyFailed(
                f"storage: fetch {copy.number}: its pages could not be written to the host: "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            if not self._agreed_only or origin == "wait":
                raise error
            # the group's failure, applied inside an operation of every rank: raised there on
            # this rank alone, it would be a refusal the others' logs lack (raise_unwritten)
            self._unwritten = self._unwritten or error
        return len(outcomes)

    def _land(
        self,
        copy: StorageCopy,
        result: StoreResult,
        unwritten: list[tuple[StorageCopy, Exception]],
    ) -> StoreResult:
        """Write a fetch's pages into its nodes' host slots; return the result to apply.

        Written before the copy leaves :attr:`_copies` and before any event
        fires (check, then act): a fetch whose pages cannot be written (a page
        the worker should have refused, an error of torch's) lands no page,
        and is applied as ``failed`` so that its nodes settle instead of
        staying ``reading`` with no copy in flight; the error is added to
        ``unwritten`` for :meth:`apply` to raise. A fetch :meth:`report` wrote
        already (under agreement) is not written again: ``result`` is the
        group's outcome of what it wrote, and the error of a write that
        failed here is raised as after a write here.
        """
        landed = self._landed.pop(copy.number, None)
        if landed is None:
            landed = self._write_fetch(copy, result)
            result = landed[0]
        if landed[1] is not None:
            unwritten.append((copy, landed[1]))
        return result

    def _write_fetch(
        self, copy: StorageCopy, result: StoreResult
    ) -> tuple[StoreResult, Exception | None]:
        """Write a finished fetch's pages into its host slots: the result it leaves, and the error.

        The slots were taken for the fetching nodes when the fetch started
        (:meth:`start_fetch`), and nothing reads them until ``fetch_done``; a
        write that fails leaves ``failed`` with no page landed. Anything but a
        fetch that read pages is left as it is.
        """
        if copy.kind != "fetch" or not result.held:
            return result, None
        slots = [page for node in copy.nodes for page in node.host_pages][: result.held]
        try:
            self._write_host(slots, result.pages)
        except Exception as exc:  # torch's, or a page _get should have refused
            why = f"not written to the host: {type(exc).__name__}: {exc}"
            return StoreResult(0, [], "failed", why), exc
        return result, None

    def _down(self, outcomes: Sequence[tuple[StorageCopy, StoreResult]]) -> list[int]:
        """Return the numbers of the copies applied that failed as a store that is down fails one.

        Alone, those whose outcome says so. Under agreement, a rank's outcome
        is its own (``peer_failed`` where another rank's copy timed out), but
        whether the row of failures ends must be the group's, or the ranks'
        next waits would differ (and the group, which resumes only where every
        rank's wait passed, would wait the longest): the copies told to the
        group that did not land whole everywhere. A copy that failed so on any
        rank is told on every rank by the step that accepts it (the group
        backed off for it, with it in flight, or it was in flight at an earlier
        backoff), and which copies are told is the same on every rank.
        """
        if not self._agreed_only:
            return [c.number for c, r in outcomes if r.outcome in _DOWN]
        return [c.number for c, r in outcomes if c.number in self._told and r.outcome != "ok"]

    def _result(self, copy: StorageCopy) -> StoreResult:
        """The result to apply: the group's, when it accepted the copy; else this rank's.

        This rank's is what :meth:`report` told the group, where it reported
        the copy (a fetch whose pages could not be written to the host failed).
        """
        agreed = self._agreed.pop(copy.number, None)
        if agreed is not None:
            return agreed
        landed = self._landed.get(copy.number)
        return self._outcome(copy) if landed is None else landed[0]

    def _outcome(self, copy: StorageCopy) -> StoreResult:
        """The worker's result (which checked a fetch's pages), or a timeout; the same at each call.

        A copy timed out is abandoned here: a worker that never got to it
        (every worker hangs) would otherwise keep its snapshot for ever
        (:meth:`StorageCopy.end`).
        """
        return copy.end(StoreResult(0, [], "timeout", f"no answer in {self.config.io_timeout} s"))

    def _split_at(self, copy: StorageCopy, held: int) -> tuple[list[TreeNode], list[TreeNode]]:
        """Split the copy's nodes at page ``held``: the nodes it landed, and the rest."""
        page = self._tiers.page_size
        done, failed, offset = [], [], 0
        for node in list(copy.nodes):
            count = len(node.key) // page
            if offset + count <= held:
                done.append(node)
            elif offset < held:
                done.append(self._core.tree.split(node, (held - offset) * page))
                failed.append(node)
            else:
                failed.append(node)
            offset += count
        return done, failed

    def _apply_store(self, copy: StorageCopy, result: StoreResult) -> None:
        done, failed = self._split_at(copy, result.held)
        for node in done:
            self._core.fire(node, "store_done")
        for node in failed:
            self._core.fire(node, "store_failed")
        for node in done:  # their children's stores may start; a failed one waits for a lookup
            for child in list(node.children.values()):
                if child not in failed:
                    self.maybe_store(child)

    def _apply_fetch(self, copy: StorageCopy, result: StoreResult) -> None:
        done, failed = self._split_at(copy, result.held)  # the pages landed already (_land)
        for node in done:
            self._core.fire(node, "fetch_done")
            for child in list(node.children.values()):  # recomputed under it meanwhile
                self._transfers.maybe_backup(child)
        gone = result.outcome in _GONE
        for node in reversed(failed):  # deepest first, so each is a leaf when it is removed
            self._core.fire(node, "fetch_failed")
            if gone:
                self._core.fire(node, "vanish")
                self._core.counters.storage_pages["vanished"] += (
                    len(node.key) // self._tiers.page_size
                )
            if node.device == "absent" and node.host not in HOST_HELD and not node.children:
                self._core.delete(node)
        for node in failed:  # one an insert took onto the device is backed up as on success
            if node.parent is not None and node.device != "absent":
                self._transfers.maybe_backup(node)
                for child in list(node.children.values()):
                    self._transfers.maybe_backup(child)

    def _write_host(self, pages: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        """Copy pages read from the store into host slots, one pass each (no staging copy).

        Raises:
            InvariantViolation: Not one page for each slot, or a page not of a
                host page's shape and dtype, which ``copy_`` would broadcast
                (the worker refuses such a page: :func:`_get`); nothing was written.
        """
        host = self._tiers.host.pages
        foreign = _foreign(data, tuple(host.shape[1:]))
        if len(data) != len(pages) or foreign is not None:
            why = f"{len(data)} pages for {len(pages)} slots" if foreign is None else foreign[1]
            raise InvariantViolation(f"storage: a fetch's pages do not fit the host: {why}")
        for page, page_data in zip(pages, data, strict=True):
            host[page].copy_(page_data)

    def settle(self, rounds: int) -> None:
        """Start, wait for and apply every storage copy, for at most ``rounds`` rounds.

        A store acknowledged may start its children's; each copy is waited for
        at most until its timeout.
        """
        for _ in range(rounds):
            if self.idle():
                return
            self.flush()
            self.apply(self.collect(wait_until=float("inf")), "wait")

    def reset(self) -> None:
        """Forget every copy (a copy still running answers no one) and renumber from 1.

        A copy no worker has claimed yet is abandoned: never run, its snapshot let go.
        """
        for copy in self._copies.values():
            copy.abandon()
        self._copies = {}
        self._queued = []
        self._numbers = 0
        self._reported = {}
        self._agreed = {}
        self._landed = {}
        self._unwritten = None
        self._told = set()

    def close(self, wait: float | None = None) -> None:
        """End the worker threads, waiting up to ``wait`` (``io_timeout``); the store stays open.

        The store is the caller's. A thread not seen to end is waited for
        again as the interpreter exits.
        """
        self._workers.close(self.config.io_timeout if wait is None else wait)

    # -- tensor-parallel agreement ---------------------------------------------

    def agree_by(self, hits: HitAgreement) -> None:
        """Let a tensor-parallel group decide what this tier applies, from now on.

        Each rank's store holds its own shard (the key namespace names the
        rank), so the ranks' stores can answer differently: a page one rank's
        store lost, a put that failed on one rank only. Two things are agreed
        so that every rank fires the same storage events (SGLang reduces both
        with MIN over its ranks):

        * the hit counts of a prefetch query are what ``hits`` returns, before
          any rank discovers a node or creates and fetches one;
        * a copy is applied only once the group accepted it (:meth:`report`
          on every rank, a MIN over the ranks, :meth:`accept`), with the
          fewest pages any rank landed; :meth:`collect` returns nothing else,
          so :meth:`~fsm_cache.cache.hicache.HiCache.poll` applies only that.

        Args:
            hits: Returns the agreed hit counts (see :data:`HitAgreement`); it
                runs inside the lookup, so it is a collective every rank
                reaches at the same query.
        """
        self._agree_hits = hits
        self._agreed_only = True

    def decide_alone(self) -> None:
        """Decide alone again, the group that agreed (:meth:`agree_by`) being gone.

        A cache whose DistributedCache was dropped while it serves on: its hit
        counts are its own, and :meth:`collect` returns the copies finished
        here; what the group accepted and this tier did not apply yet is
        applied with the group's result. Without it, no copy was ever
        accepted again, and every store and fetch stayed in flight for good.
        """
        self._agree_hits = _alone
        self._agreed_only = False
        self._reported = {}

    def report(self, slots: int, *, wait: bool = False) -> list[int]:
        """Say how each of the first ``slots`` copies in flight ended here, for a MIN over ranks.

        Slot ``i`` is the ``i``-th copy in flight in number order (the same copy
        on every rank in step): -1 while it runs here (or is not there), else
        ``2 * pages + flag``, with ``pages`` the leading pages that landed
        (0 for a copy past ``io_timeout``) and ``flag`` 0 when the store no
        longer held the first page that did not (``missing``, ``corrupt``),
        else 1. The MIN over the ranks is then -1 if any rank still runs the
        copy, else the fewest pages any rank landed and, where a rank that
        landed that few found the page gone, 0. Pass the MIN to :meth:`accept`.

        A fetch that finished here is written into its host slots first, once
        (:meth:`apply` does not write it again): a write that fails is local
        (torch's, a page the store handed back with no data), so it is
        reported as 0 pages, ``failed``, and the MIN fails the fetch on every
        rank; this rank raises its ``CopyFailed`` once that is applied, the
        others apply ``peer_failed`` (or ``peer_missing``).

        Args:
            slots: How many copies the group considers at once (the same on every rank).
            wait: First wait for each started copy of those until its timeout
                (the group drains).
        """
        window = list(self._copies.values())[:slots]
        self._reported = {}
        out = []
        for copy in window:
            if wait and copy.started is not None:
                deadline = copy.started + self.config.io_timeout
                _wait(copy, deadline - self._clock())
            result = None if copy.started is None else self._ended(copy)
            if result is not None and copy.kind == "fetch":
                result = self._landed_here(copy, result)
            self._reported[copy.number] = result
            flag = result is not None and result.outcome not in _GONE
            out.append(-1 if result is None else 2 * result.held + flag)
        return out + [-1] * (slots - len(window))

    def _landed_here(self, copy: StorageCopy, result: StoreResult) -> StoreResult:
        """Write a fetch that ended here (``result``) to the host once; return what it left."""
        landed = self._landed.get(copy.number)
        if landed is None:
            landed = self._landed[copy.number] = self._write_fetch(copy, result)
        return landed[0]

    def _ended(self, copy: StorageCopy) -> StoreResult | None:
        """Return how a started copy ended here (a timeout too), or None while it runs."""
        if copy.done.is_set() or self._clock() >= (copy.started or 0) + self.config.io_timeout:
            return self._outcome(copy)
        return None

    def accept(self, agreed: Sequence[int]) -> int:
        """Take the group's MIN of :meth:`report`; :meth:`collect` returns those copies.

        Each copy every rank finished gets the fewest pages any rank landed:
        a read one rank completed and another found a page missing in is
        split (and its tail vanishes) identically on every rank. Returns how
        many copies were accepted.

        Raises:
            InvariantViolation: ``agreed`` accepts a copy this rank did not
                report finished, or more pages than it landed (not a MIN of
                this rank's report); nothing was accepted.
        """
        taken: dict[int, StoreResult] = {}
        for (number, local), value in zip(self._reported.items(), agreed, strict=False):
            if value < 0:
                continue
            if local is None or value // 2 > local.held:
                raise InvariantViolation(
                    f"storage: copy {number}: the group agreed on {value // 2} pages, this rank "
                    f"reported {'none' if local is None else local.held}; not a MIN of its report"
                )
            taken[number] = _agreed_result(self._copies[number], local, value)
        self._agreed.update(taken)
        self._reported = {}
        return len(taken)

    def raise_unwritten(self) -> None:
        """Raise the first fetch this rank could not write to the host since the last call.

        Under agreement such a fetch is reported as 0 pages (:meth:`report`),
        so the group fails it on every rank, inside each rank's ``poll``; the
        error is raised after the group's step instead, outside any operation
        of the cache, so that the ranks' logs (and digests) stay equal.

        Raises:
            CopyFailed: A fetch's pages could not be written to this rank's
                host; the group applied it as failed on every rank.
        """
        error, self._unwritten = self._unwritten, None
        if error is not None:
            raise error

    # -- backup to storage -----------------------------------------------------

    def _host_acknowledged(self, nodes: Sequence[TreeNode], event: Event) -> None:
        if event == "write_done":
            for node in nodes:
                self.maybe_store(node)

    def maybe_store(self, node: TreeNode) -> bool:
        """Fire ``store`` on ``node`` if the policy wants it and its parent's pages are stored.

        Not while lookups back off (:meth:`_backing_off`): the store is known
        to be down, and a backup started now would hold its host pin and its
        snapshot until it failed by its ``io_timeout``. The node stays
        ``unstored`` (counted as ``store:backing_off``), as after a failed
        store: the first lookup after the backoff that matches it stores it
        (:meth:`_store_again`), and its children follow. Under agreement the
        backoff is the group's, so every rank skips the same backups.

        Returns whether a store was started.
        """
        if self.config.policy != "write_through" or node.storage != "unstored":
            return False
        parent = node.parent
        if parent is not None and parent.parent is not None and parent.storage not in _READABLE:
            return False  # parent first: what this cache stores stays prefix-closed
        if node.host not in HOST_VALID or not self._core.allowed(node, "store"):
            return False
        try:
            self.keys_of(node)
        except BadArgument:
            self._core.counters.storage_failures["store:unkeyable"] += 1
            return False
        if self._backing_off():
            self._core.counters.storage_failures["store:backing_off"] += 1
            return False
        self._core.fire(node, "store")
        return True

    def _rehome(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """A copy of ``suffix`` now serves its split-off ``prefix`` too (the same pages, first)."""
        for copy in self._copies.values():
            if suffix in copy.nodes:
                copy.nodes.insert(copy.nodes.index(suffix), prefix)

    # -- prefetch --------------------------------------------------------------

    def prefetch(self, walk: Walk, key: Key, tree_namespace: Hashable) -> Walk:
        """Prefetch the stored pages of ``key`` past its locally cached prefix; return the walk anew.

        Past ``prefetch_threshold`` tokens, under the rate limit and outside
        a backoff after a failed query (:class:`QueryBackoff`), ask the
        store how many pages after the cached prefix it holds, hang them as a
        ``discovered`` node under the last cached node and fetch it; a lookup
        that finds a fetch in flight there waits for it as the policy says.
        A fetch the machines or the host pool refuse changes nothing. What
        each lookup decided is counted (``Stats.prefetch``). Under
        tensor-parallel agreement (:meth:`agree_by`) the hit counts are the
        group's, and the read is applied only at a step, as every rank
        finished it: the termination policy then only bounds how long the
        lookup waits for the read to finish here. Then the match's first
        cached node that is not stored is stored, where the policy would have
        (:meth:`_store_again`).
        """
        walk = self._prefetch(walk, key, tree_namespace)
        self._store_again(walk.path)
        return walk

    def _store_again(self, path: Sequence[TreeNode]) -> None:
        """Store the first cached node of a lookup's ``path`` that is not stored, if the policy would.

        A store that failed is not retried on its own, and a node waits for
        its parent's pages: after one transient failure (a Redis blip) this
        server would never store the node or anything under it, and no other
        server sharing the store would find them while it kept them. A lookup
        that matches such a node starts its store again: at most one store
        per lookup, none while a store or its parent's is in flight, and none
        while queries back off (the store is down); its children follow once
        it is acknowledged. A lookup with no tail to ask about ends a backoff
        here as one with a tail would (:meth:`_backing_off`): a failed store
        backs lookups off too, and a cache whose lookups all hit locally
        would otherwise never store again.
        """
        if self._backing_off():
            return
        for node in local_prefix(path):
            if node.storage == "unstored":
                self.maybe_store(node)
                return

    def _prefetch(self, walk: Walk, key: Key, tree_namespace: Hashable) -> Walk:
        """Prefetch as :meth:`prefetch` says; return the walk anew."""
        usable = local_prefix(walk.path)
        tail = key[sum(len(n.key) for n in usable) :]
        counted = self._core.counters.prefetch
        if len(walk.path) > len(usable):  # a fetch of this prefix is in flight already
            copy = self._copy_serving(walk.path[len(usable)])
            if copy is None:
                return walk
            counted["in_flight"] += 1
            return self._finish(copy, key, tree_namespace)
        anchor = usable[-1] if usable else self._core.tree.root(tree_namespace)
        copy, skipped = None, self._skip(tail, anchor)
        if skipped is None and self._backing_off():
            skipped = "backing_off"
        if skipped is None:
            copy, skipped = self._start(usable, tail, anchor, tree_namespace)
        if copy is None:
            if skipped:
                counted[skipped] += 1
            return walk
        counted["started"] += 1
        return self._finish(copy, key, tree_namespace)

    def _skip(self, tail: Key, anchor: TreeNode) -> str | None:
        """Return why a lookup with unmatched ``tail`` under ``anchor`` asks the store nothing."""
        if not tail:
            return ""
        if len(tail) < self.config.prefetch_threshold:
            return "below_threshold"
        if self.fetching_tokens() >= self.capacity:
            return "rate_limited"
        if anchor.host == FETCHING:  # a device copy adopted it: its read may still fail, and
            return "anchor_fetching"  # a host copy under it would keep that failure out
        if self._write_through and anchor.parent is not None and anchor.host not in HOST_VALID:
            return "anchor_not_backed"  # a host copy under it would break invariant 3
        return None

    def _backing_off(self) -> bool:
        """Return whether lookups ask the store nothing now (:class:`QueryBackoff`).

        A cache alone reads its clock here; under agreement only a step that
        every rank takes ends a backoff (:meth:`resume_queries`), so the ranks
        ask their stores at the same lookups.
        """
        if not self._agreed_only:
            self.resume_queries(self.queries_may_resume())
        return self.backoff.closed

    def queries_may_resume(self) -> bool:
        """Return whether this rank's clock says the query backoff has passed (or none runs).

        What a rank brings to a step's agreement; :meth:`resume_queries` takes
        the group's answer.
        """
        return self.backoff.passed(self._clock())

    def copies_failed_here(self) -> bool:
        """Return whether a copy ended here as a store that is down ends one, since last asked.

        What a rank brings to a step's agreement (each copy once, when it has
        ended here): the copies themselves are applied only once every rank
        finished them, but a store failing on one rank must back every rank
        off at the same step, whatever the others' copies did. A copy in
        flight when the group last backed off is not told (:meth:`_back_off`):
        ranks that see one outage's copies fail at different steps would
        otherwise back off once per such step. Pass the group's answer to
        :meth:`back_off_for_copies`.
        """
        failed = False
        for copy in self._copies.values():
            if copy.started is None or copy.number in self._told:
                continue
            result = self._ended(copy)
            if result is not None and result.outcome in _DOWN:
                self._told.add(copy.number)
                failed = True
        return failed

    def back_off_for_copies(self, failed: bool) -> None:
        """Back lookups off if ``failed`` (the group's :meth:`copies_failed_here`), as after a query.

        A store that raised or hung on a copy would hold the next lookup's
        query as long (the same server, the same client).
        """
        if failed:
            self._back_off()

    def _back_off(self) -> None:
        """Back lookups off now, and count every copy in flight as failed by this outage.

        A store that is down fails every copy in flight, each when it raises
        or passes its ``io_timeout``: one poll (or, under agreement, one step)
        apart or many, on one rank or another. Each is the outage already
        backed off for, not a failure in a row, so none backs off again when
        it fails: one outage doubles the wait once. A copy started later is a
        new trial of the store, and its failure backs off (twice as long): so is
        one queued and not yet started (a store a host backup acknowledged in
        the poll that backs off), which tries the store only when it starts.
        Started, not claimed by a worker: a copy waiting behind a worker that
        hangs on the store fails by that outage, and which copies are started
        is the same on every rank at a step or a lookup.
        """
        self.backoff.failed(self._clock())
        self._told.update(n for n, copy in self._copies.items() if copy.started is not None)

    def resume_queries(self, passed: bool) -> None:
        """End the query backoff if ``passed`` (under agreement, the group's MIN): the next lookup asks.

        That query is a trial: one that fails again backs off twice as long.
        """
        if passed:
            self.backoff.reopen()

    def _start(
        self, usable: Sequence[TreeNode], tail: Key, anchor: TreeNode, tree_namespace: Hashable
    ) -> tuple[StorageCopy | None, str | None]:
        """Ask the store about ``tail`` and fetch what it holds; the copy, or why there is none."""
        try:
            stored, keys, failed, slow = self._query(usable, tail, anchor, tree_namespace)
        except BadArgument:
            return None, "unkeyable"
        if failed:
            self._back_off()
            return None, "query_failed"
        if slow:  # its answer stands, but the next lookups must not wait as long
            self._core.counters.storage_failures["query:slow"] += 1
            self._back_off()
        else:
            self.backoff.answered()
        tokens = stored * self._core.tree.page_size
        if tokens == 0:
            return None, "none_stored"
        if tokens < self.config.prefetch_threshold:
            return None, "below_threshold"
        return self._fetch_new(anchor, tail[:tokens], keys[:stored])

    def _query(
        self, usable: Sequence[TreeNode], tail: Key, anchor: TreeNode, tree_namespace: Hashable
    ) -> tuple[int, list[str], bool, bool]:
        """Count the stored pages of ``tail``; discover the unstored end of the cached path.

        The trailing run of cached nodes this cache has not stored (whose parent
        is stored) is asked about in the same query: those the store holds
        (another server stored them) are ``discover``-ed. Both counts, whether
        the store answered, and whether it answered within ``query_budget``
        are agreed first (:meth:`agree_by`; a store that raised counts 0, so a
        group still agrees). Returns the agreed stored pages of ``tail``, its
        keys, whether a store raised and whether one was slow (this rank's, or
        under agreement any rank's: every rank backs off at the same lookup).

        Raises:
            BadArgument: A token does not fit the keys (the same on every rank:
                nothing was asked).
        """
        prior = self.keys_of(anchor)[-1] if anchor.parent is not None else None
        keys = page_keys(self.namespace(tree_namespace), tail, parent=prior)
        run = _unstored_run(usable)
        run_keys = [k for n in run for k in self.keys_of(n)]
        began = self._clock()
        try:
            found = [*self._ask(run_keys, keys), 1, 1]
        except Exception:  # any store failure counts 0 found, so a group still reaches the MIN
            found = [0, 0, 0, 0]
        else:  # this rank's clock says only whether its own store was slow; the MIN tells all
            found[3] = int(self._clock() - began <= self.config.query_budget)
        in_run, stored, answered, prompt = self._agree_hits(found, [len(run_keys), len(keys), 1, 1])
        self._discover(run, in_run)
        return stored, keys, not answered, not prompt

    def _discover(self, run: Sequence[TreeNode], pages: int) -> None:
        """Fire ``discover`` on the nodes of ``run`` within its first ``pages`` stored pages.

        Their children's stores may start then, as after a ``store_done``: a
        child waits for its parent's pages, whoever stored them.
        """
        offset, found = 0, []
        for node in run:
            count = len(node.store_keys or ())
            if offset + count > pages:
                break
            offset += count
            if self._core.allowed(node, "discover"):
                self._core.fire(node, "discover")
                self._core.counters.storage_pages["discovered"] += count
                found.append(node)
        for node in found:
            for child in list(node.children.values()):
                self.maybe_store(child)

    def _ask(self, run_keys: list[str], keys: list[str]) -> list[int]:
        """Return the leading pages the store holds of the run and of the tail (one or two queries).

        The tail's keys chain from the run's, so one query answers both; a gap
        in the run needs a second query for the tail alone.
        """
        if not run_keys:
            return [0, self._exists(keys)]
        found = self._exists(run_keys + keys)
        if found >= len(run_keys):
            return [len(run_keys), found - len(run_keys)]
        return [found, self._exists(keys)]

    def _exists(self, keys: list[str]) -> int:
        """Return how many leading ``keys`` the store holds, as an int in ``0..len(keys)``.

        A store's count may be a numpy integer, which is the int it stands for.

        Raises:
            StoreFailed: The answer is no such count (None, a bool, a float, a
                negative number, more keys than were asked): the query failed,
                as if the store had raised, instead of the lookup failing later
                on a count it cannot use (or, under agreement, on one rank only).
        """
        answer = self._store.exists_prefix(keys)
        held = as_index(answer)
        if held is None or not 0 <= held <= len(keys):
            raise StoreFailed(
                type(self._store).__name__,
                "exists",
                acknowledged=0,
                total=len(keys),
                cause=f"the answer {answer!r} is not a count of 0 to {len(keys)} keys",
            )
        return held

    def _fetch_new(
        self, anchor: TreeNode, tokens: Key, keys: Sequence[str]
    ) -> tuple[StorageCopy | None, str | None]:
        """Hang a ``discovered`` node for ``tokens`` under ``anchor`` and fetch it.

        A refused fetch (the machines, or no host room even after host eviction)
        removes the node again: the tree is as it was.
        """
        tree = self._core.tree
        node = tree.add_leaf(anchor, tokens, ())
        self._core.born(node, "discovered")
        node.store_keys = tuple(keys)
        try:
            self._core.fire(node, "fetch")
        except (IllegalTransition, EffectFailed) as exc:
            self._core.delete(node)
            pool = isinstance(exc, EffectFailed) and isinstance(exc.__cause__, PoolExhausted)
            return None, "pool_exhausted" if pool else "refused"
        return self._copy_serving(node), None

    def _copy_serving(self, node: TreeNode) -> StorageCopy | None:
        for copy in self._copies.values():
            if node in copy.nodes:
                return copy
        return None

    def _finish(self, copy: StorageCopy, key: Key, tree_namespace: Hashable) -> Walk:
        """Start the read and wait for it as the termination policy says; return the walk anew."""
        self.flush()
        policy = self.config.prefetch_policy
        if policy != "best_effort":
            limit = float("inf") if policy == "wait" else self.config.prefetch_timeout
            now = self._clock()
            started = copy.started or now
            until = min(started + self.config.io_timeout, now + limit)
            _wait(copy, until - now)
            self._core.counters.prefetch["read" if copy.done.is_set() else "still_reading"] += 1
            self.apply(self.collect(), "prefetch")
        return self._core.tree.walk(key, tree_namespace)

    # -- storage eviction ------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Delete least recently used stored leaves from an owned store; return tokens evicted.

        Only nodes whose pages are ``stored`` (no copy reads or writes them) and
        none of whose children has pages in storage; a page a read holds
        (local store) keeps its node, and so does a store that would not
        delete (it went away: counted as ``evict:failed``). Under
        tensor-parallel agreement neither keeps it: what a rank's own store
        does cannot change which nodes the group evicts
        (:meth:`delete_storage`), so every rank returns the same count.

        Raises:
            ConfigError: The store is shared (``owned=False``).
        """
        if not self.config.owned:
            raise ConfigError(
                "evict_storage: the store is shared (owned=False): its own eviction deletes pages"
            )
        heap = [(n.last_access, n.id, n) for n in self._core.tree if _storage_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not _storage_leaf(node) or not self._core.allowed(node, "evict_storage"):
                continue
            try:
                self._core.fire(node, "evict_storage")
            except EffectFailed as exc:  # a read holds a page, or the store would not delete
                if not isinstance(exc.__cause__, PageInUse):
                    self._evict_failed(exc.__cause__ or exc)
                continue  # it stays, and so does what is under it
            freed += len(node.key)
            parent = node.parent
            if parent is not None and parent.parent is not None and _storage_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed


def _wait(copy: StorageCopy, seconds: float) -> None:
    """Wait up to ``seconds`` (none when negative) for ``copy``'s worker to answer."""
    copy.done.wait(_waitable(seconds))


def _waitable(seconds: float) -> float:
    """``seconds`` as a wait a lock takes: none when negative, and cut to the longest.

    An ``io_timeout`` of years (a copy that may take as long as it likes) is
    a valid setting, and ``Event.wait`` and ``Thread.join`` raise
    OverflowError past ``threading.TIMEOUT_MAX``.
    """
    return min(max(0.0, seconds), threading.TIMEOUT_MAX)


def _agreed_result(copy: StorageCopy, local: StoreResult, value: int) -> StoreResult:
    """This rank's result cut to what the group agreed (``2 * pages + flag``, see ``report``)."""
    held, gone = value // 2, value % 2 == 0
    pages = local.pages[:held]
    if held >= len(copy.keys):
        return StoreResult(held, pages, "ok")
    if local.held == held and (local.outcome in _GONE) == gone:
        return StoreResult(held, pages, local.outcome, local.error)
    why = "peer_missing" if gone else "peer_failed"
    error = f"another rank landed {held} of {len(copy.keys)} pages, this one {local.held}"
    return StoreResult(held, pages, why, error)


_READABLE = frozenset({"stored", "reading"})
"""Storage states in which the store holds the node's pages (as far as the cache knows)."""


def local_prefix(path: Sequence[TreeNode]) -> list[TreeNode]:
    """Return the leading nodes of ``path`` cached locally: on the device, or valid on the host.

    A lookup never goes past them: a node still being fetched holds no KV yet.
    """
    out = []
    for node in path:
        if node.device == "absent" and node.host not in HOST_VALID:
            break
        out.append(node)
    return out


def _unstored_run(usable: Sequence[TreeNode]) -> list[TreeNode]:
    """Return the trailing unstored nodes of ``usable`` whose first one's parent is stored."""
    start = len(usable)
    while start > 0 and usable[start - 1].storage == "unstored":
        start -= 1
    run = list(usable[start:])
    if not run:
        return run
    parent = run[0].parent
    if parent is not None and parent.parent is not None and parent.storage not in _READABLE:
        return []
    return run


def _storage_leaf(node: TreeNode) -> bool:
    return node.storage == "stored" and not any(
        c.storage in STORAGE_HELD for c in node.children.values()
    )


def fetching(node: TreeNode) -> bool:
    """Return whether ``node``'s host copy is still being filled from storage."""
    return node.host == FETCHING
