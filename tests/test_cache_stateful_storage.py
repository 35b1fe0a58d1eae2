"""Random operation sequences against HiCache with a storage tier, for host eviction's candidates.

Host eviction looks only at the host leaves filed as they arise (a device
copy going, a child's host copy going, a fetch starting). Hypothesis drives
inserts, lookups that prefetch, locks, pins, device, host and storage
evictions, load-backs, backups, resets and polls, with a copy engine that
delays, reorders and fails copies and a store that loses pages, tears them,
refuses reads, answers queries slowly, and gains pages another server stored.
The tiers read a clock the machine moves (each step takes ``STEP`` seconds, and
a rule lets more time pass), never the wall clock: a query backoff ends where
the example says, however slowly a loaded machine runs it, so every example
replays exactly. After every step every
host leaf is filed, ``could_free_host`` answers what a walk of the tree
answers, and every ``evict_host`` takes exactly the victims a full
least-recently-used walk would.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, NamedTuple

import fakeredis
import pytest
import torch
import torch.distributed as dist
from clocks import HandClock
from evictions import (
    expected_host_victims,
    host_evictable,
    host_evicted,
    unfiled_host_leaves,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fsm_cache.cache import storage_tier
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.distributed.agreement import DistributedCache
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import (
    BadArgument,
    CopyFailed,
    EffectFailed,
    IllegalTransition,
    PoolExhausted,
)
from fsm_cache.memory.tiers import CacheConfig, CopierFactory
from fsm_cache.residency import HOST_VALID
from fsm_cache.storage import PutResult, RedisStore
from fsm_cache.storage.base import Capacity
from fsm_cache.testing.faults import FaultyCopyEngine


PAGE = 2
HOST_PAGES = 10
WORDS = [(1, 2), (3, 4), (5, 6), (7, 8)]
BY_HAND = frozenset(
    {"write", "evict_device", "evict_host", "pin", "store", "discover", "vanish", "fetch"}
)
"""Events a tool may fire at a node by hand (acknowledgements are the copies' own)."""
STEP = 0.25
"""Seconds of the tiers' clock each step takes: a 1 s query backoff ends four steps on."""
sequences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(
    lambda ws: [t for w in ws for t in w]
)


class FlakyStore:
    """A store that passes through to ``inner``, but can refuse reads and tear pages.

    Attributes:
        clock: The tiers' clock, which a slow query moves.
        broken: Reads raise while set.
        slow: Key queries answer a second later (by ``clock``) while set: past the budget.
        torn: Keys whose page reads back as a page of the wrong shape (the read drops it).
        lost: Keys the store loses just before they are read (the read finds them missing).
    """

    def __init__(self, inner: RedisStore, clock: HandClock) -> None:
        self.inner = inner
        self.clock = clock
        self.broken = False
        self.slow = False
        self.torn: set[str] = set()
        self.lost: set[str] = set()

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if self.slow:
            self.clock.now += 1.0  # twice the default query_budget
        return self.inner.exists_prefix(keys)

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        if self.broken:
            raise RuntimeError("planted: the read fails")
        gone = self.lost.intersection(keys)
        if gone:
            self.inner.drop(list(gone))
            self.lost -= gone
        pages = self.inner.get(keys)
        bad = torch.zeros(1, dtype=torch.uint8)
        return [bad if k in self.torn else p for k, p in zip(keys, pages, strict=False)]

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        self.torn.difference_update(keys)
        return self.inner.put(keys, pages)

    def drop(self, keys: Sequence[str]) -> int:
        return self.inner.drop(keys)

    def capacity(self) -> Capacity:
        return self.inner.capacity()

    def close(self) -> None:
        self.inner.close()


def config(policy: str, copier: CopierFactory | None = None) -> CacheConfig:
    return CacheConfig(
        device_pages=8,
        host_pages=HOST_PAGES,
        page_size=PAGE,
        layers=1,
        heads=1,
        head_dim=2,
        load_back_threshold=2,
        write_policy=policy,
        selective_threshold=2,
        debug=True,
        copier=copier,
    )


class StorageCacheMachine(RuleBasedStateMachine):
    """A cache with a storage tier under random operations, its host candidates checked."""

    policy = "write_through"
    prefetch = "best_effort"

    def __init__(self) -> None:
        super().__init__()
        shared = RedisStore(fakeredis.FakeRedis(), batch_pages=3)
        self.clock = HandClock()
        self.store = FlakyStore(shared, self.clock)
        storage = StorageConfig(
            self.store,
            model="test",
            threads=0,
            prefetch_threshold=PAGE,
            prefetch_policy=self.prefetch,
            owned=True,
            clock=self.clock.monotonic,
        )
        faulty = FaultyCopyEngine.copier(fail=(3, 7, 11, 19), delay=1, shuffle=True, seed=0)
        self.cache = HiCache(config(self.policy, faulty), storage=storage)
        self.shared_store = shared
        self.others: list[HiCache] = []  # built by the first step that needs it: see elsewhere()
        self.leases: list[Lease] = []

    def elsewhere(self) -> HiCache:
        """Another server storing into the same store: what this cache finds and discovers.

        Built when a step first needs it, not with every example: building a
        cache compiles its engine, a quarter of what an example cost, and a
        third of the examples never store elsewhere. Building it reads and
        writes nothing in the store.
        """
        if not self.others:
            other = StorageConfig(
                self.shared_store,
                model="test",
                threads=0,
                prefetch_threshold=10_000,
                clock=self.clock.monotonic,
            )
            self.others.append(HiCache(config("write_through"), storage=other))
        return self.others[0]

    # -- operations ------------------------------------------------------------

    @initialize(seqs=st.lists(sequences, min_size=1, max_size=4), evicted=st.integers(0, 16))
    def warm(self, seqs: list[list[int]], evicted: int) -> None:
        """Start from backed prefixes, some off the device: host leaves from the first step."""
        for seq in seqs:
            self.insert(seq)
            self.poll()
        self.poll()
        self.evict(evicted)

    @rule(seq=sequences)
    def insert(self, seq: list[int]) -> None:
        try:
            self.cache.insert(seq)
        except (PoolExhausted, CopyFailed):
            return

    @rule(seq=sequences)
    def match(self, seq: list[int]) -> None:
        self.cache.match_prefix(seq)

    @rule(seq=sequences)
    def stored_elsewhere(self, seq: list[int]) -> None:
        other = self.elsewhere()
        other.reset()
        other.insert(seq)
        other.poll()  # write_done: the store of the first node starts
        for _ in range(len(seq) // PAGE):
            other.poll()  # children are stored after their parents

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        nodes = [n for n in self.cache.tree if n.device in ("resident", "loading")]
        if nodes:
            self.leases.append(self.cache.lock(data.draw(st.sampled_from(nodes))))

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        nodes = [n for n in self.cache.tree if n.host in HOST_VALID]
        if nodes:
            self.leases.append(self.cache.pin(data.draw(st.sampled_from(nodes))))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        if lease.event == "lock":
            self.cache.unlock(lease)
        else:
            lease.release()

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule(n=st.integers(1, 2 * HOST_PAGES * PAGE))
    def evict_host(self, n: int) -> None:
        expected = expected_host_victims(self.cache, n)
        before = {node.id: node.host for node in self.cache.tree}
        self.cache.evict_host(n)
        assert host_evicted(self.cache, before) == set(expected)

    @rule(data=st.data())
    def evict_host_by_hand(self, data: st.DataObject) -> None:
        nodes = [n for n in self.cache.tree if self.cache.machine.allowed(n, "evict_host")]
        if nodes:
            self.cache.fire("evict_host", data.draw(st.sampled_from(nodes)))

    @rule(n=st.integers(1, 12))
    def evict_storage(self, n: int) -> None:
        self.cache.evict_storage(n)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        nodes = [n for n in self.cache.tree if n.device == "absent"]
        if nodes:
            try:
                self.cache.load_back(data.draw(st.sampled_from(nodes)))
            except IllegalTransition:  # a node of the chain is still being fetched
                return

    @rule(data=st.data())
    def backup(self, data: st.DataObject) -> None:
        nodes = list(self.cache.tree)
        if nodes:
            self.cache.backup([data.draw(st.sampled_from(nodes))])

    @rule(data=st.data(), event=st.sampled_from(sorted(BY_HAND)))
    def fire(self, data: st.DataObject, event: str) -> None:
        """Any event a tool may fire by hand, at any node; a refusal changes nothing."""
        nodes = list(self.cache.tree)
        if nodes:
            try:
                self.cache.fire(event, data.draw(st.sampled_from(nodes)))  # type: ignore[call-overload]
            except (IllegalTransition, EffectFailed, BadArgument):
                return

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @rule(data=st.data())
    def lose_pages(self, data: st.DataObject) -> None:
        """The store loses a node's pages behind the cache's back (its own eviction)."""
        nodes = [n for n in self.cache.tree if n.store_keys]
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.store.inner.drop(list(node.store_keys or ()))

    @rule(data=st.data())
    def tear_page(self, data: st.DataObject) -> None:
        keys = [k for n in self.cache.tree for k in n.store_keys or ()]
        if keys:
            self.store.torn.add(data.draw(st.sampled_from(keys)))

    @rule(data=st.data())
    def lose_page_when_read(self, data: st.DataObject) -> None:
        keys = [k for n in self.cache.tree for k in n.store_keys or ()]
        if keys:
            self.store.lost.add(data.draw(st.sampled_from(keys)))

    @rule(broken=st.booleans())
    def break_reads(self, broken: bool) -> None:
        self.store.broken = broken

    @rule(slow=st.booleans())
    def slow_queries(self, slow: bool) -> None:
        self.store.slow = slow

    @rule(seconds=st.sampled_from([0.25, 1.0, 4.0, 40.0]))
    def wait(self, seconds: float) -> None:
        """Time passes: a query backoff (1 s, doubled per failure in a row, at most 30 s) may end."""
        self.clock.now += seconds

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.leases = []  # void with the tree they held

    # -- what must hold after every step ----------------------------------------

    @invariant()
    def time_passes(self) -> None:
        """Each step takes ``STEP`` seconds (Hypothesis runs the invariants after every step)."""
        self.clock.now += STEP

    @invariant()
    def every_host_leaf_is_a_candidate(self) -> None:
        assert unfiled_host_leaves(self.cache) == []

    @invariant()
    def could_free_host_answers_what_a_walk_does(self) -> None:
        """With nothing spared, and sparing each node as a fetch spares its anchor."""
        evictor = self.cache.evictor
        free = self.cache.tiers.host.allocator.free_pages
        for spare in [(), *((n,) for n in self.cache.tree)]:
            evictable = host_evictable(self.cache, spare)
            assert evictor.host_evictable(spare) == evictable, spare
            for pages in range(HOST_PAGES + 2):
                answer = evictor.could_free_host(pages, spare)
                assert answer == (free + evictable >= pages), (pages, spare)

    def teardown(self) -> None:
        for lease in self.leases:
            if lease.event == "lock":
                self.cache.unlock(lease)
            else:
                lease.release()
        self.cache.close()
        assert unfiled_host_leaves(self.cache) == []
        for other in self.others:
            other.close()


class AgreedStorageMachine(StorageCacheMachine):
    """The same in a tensor-parallel group of one: copies are applied as the group agrees.

    :class:`DistributedCache` applies acknowledgements through
    ``apply_completions`` and accepted storage copies through ``poll`` at each
    step, and an allocation that waits drains the copy engine itself.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp()
        dist.init_process_group(
            "gloo", init_method=f"file://{Path(self.folder) / 'group'}", rank=0, world_size=1
        )
        super().__init__()
        self.shared = DistributedCache(self.cache)

    @rule()
    def poll(self) -> None:
        self.shared.step()

    def teardown(self) -> None:
        try:
            self.shared.drain()
            super().teardown()
        finally:
            dist.destroy_process_group()
            shutil.rmtree(self.folder, ignore_errors=True)


class WriteBackStorageMachine(StorageCacheMachine):
    """The same under the write-back policy."""

    policy = "write_back"


class SelectiveStorageMachine(StorageCacheMachine):
    """The same under selective write-through."""

    policy = "write_through_selective"


class WaitingStorageMachine(StorageCacheMachine):
    """The same with lookups that wait for their prefetch."""

    prefetch = "wait"


SETTINGS = settings(
    max_examples=60,
    report_multiple_bugs=False,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStorageWriteThrough = StorageCacheMachine.TestCase
TestStorageWriteThrough.settings = SETTINGS
TestStorageAgreed = AgreedStorageMachine.TestCase
TestStorageAgreed.settings = SETTINGS
TestStorageWriteBack = WriteBackStorageMachine.TestCase
TestStorageWriteBack.settings = SETTINGS
TestStorageSelective = SelectiveStorageMachine.TestCase
TestStorageSelective.settings = SETTINGS
TestStorageWaiting = WaitingStorageMachine.TestCase
TestStorageWaiting.settings = SETTINGS


class Decided(NamedTuple):
    """What the query backoff stood at after one step of one example, and what was counted."""

    example: int
    now: float
    closed: bool
    failures: int
    until: float
    prefetch: list[tuple[str, int]]
    storage_failures: list[tuple[str, int]]


class RecordedStorageMachine(WriteBackStorageMachine):
    """The write-back machine, recording what the query backoff decided after every step."""

    trace: ClassVar[list[Decided]] = []
    examples: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1

    @invariant()
    def record(self) -> None:
        tier = self.cache.storage
        assert tier is not None
        backoff, stats = tier.backoff, self.cache.stats()
        self.trace.append(
            Decided(
                self.examples,
                self.clock.now,
                backoff.closed,
                backoff.failures,
                backoff.until,
                sorted(stats.prefetch.items()),
                sorted(stats.storage_failures.items()),
            )
        )


class RacingClock:
    """A ``time`` module whose ``monotonic()`` runs 100 s ahead at each reading (a loaded machine)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        """Return a time 100 s later than the last."""
        self.now += 100.0
        return self.now


def test_an_example_takes_the_same_backoff_decisions_when_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same examples, run twice, back off and end their backoffs at the same steps.

    The second run's wall clock races (the storage tier's module reads a
    ``time`` whose every reading is 100 s on): a tier that read the wall
    clock for a decision would end each backoff at once there, and each
    query would be slow. An example Hypothesis replays (to shrink a failure,
    or from its database) must take the path it took when it failed, or it
    reports ``FlakyStrategyDefinition`` and never the failure.
    """
    again = settings(
        SETTINGS, max_examples=10, stateful_step_count=40, derandomize=True, database=None
    )
    traces = []
    for wall in (None, RacingClock()):
        RecordedStorageMachine.trace, RecordedStorageMachine.examples = [], 0
        with monkeypatch.context() as patch:
            if wall is not None:
                patch.setattr(storage_tier, "time", wall)
            run_state_machine_as_test(RecordedStorageMachine, settings=again)
        traces.append(RecordedStorageMachine.trace)
    first, second = traces
    assert first == second
    assert any(d.closed for d in first)  # not vacuous: some example backed off,
    assert any(d.closed and d.now >= d.until for d in first)  # and its wait passed
