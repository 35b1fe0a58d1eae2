"""Random operation sequences against HiCache with delayed, shuffled and failing copies.

Hypothesis drives inserts, matches, locks, unlocks, pins, evictions, host
evictions, load-backs and polls, with the copy engine delaying, reordering and
failing acknowledgements. After every step: the design invariants hold (debug
mode checks them inside every call), lookups never claim more than a small
reference model of what was inserted, and the KV of every node in each tier
equals what was written for its tokens, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from evictions import (
    expected_host_victims,
    host_evictable,
    host_evicted,
    unfiled_host_leaves,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fsm_cache.cache.eviction import _device_leaf
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.engine.lease import Lease
from fsm_cache.errors import PoolExhausted
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.residency import HOST_VALID
from fsm_cache.testing.faults import FaultyCopyEngine


PAGE = 2
# Sequences are built from a few page-sized words so that prefixes are shared often.
WORDS = [(1, 2), (3, 4), (5, 6), (7, 8)]
sequences = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(
    lambda ws: [t for w in ws for t in w]
)


class CacheMachine(RuleBasedStateMachine):
    """HiCache under random operations, checked against a reference of inserted keys."""

    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        config = CacheConfig(
            device_pages=8,
            host_pages=12,
            page_size=PAGE,
            layers=1,
            heads=1,
            head_dim=2,
            load_back_threshold=2,
            write_policy=self.policy,
            selective_threshold=2,
            debug=True,
            copier=FaultyCopyEngine.copier(fail=(3, 7, 11), delay=1, shuffle=True, seed=0),
        )
        self.cache = HiCache(config)
        self.inserted: list[tuple[int, ...]] = []
        self.leases: list[Lease] = []

    @rule(seq=sequences)
    def insert(self, seq: list[int]) -> None:
        free = self.cache.tiers.device.allocator.free_slots
        waiting = self.cache.evictor.waiting()
        try:
            self.cache.insert(seq)
        except PoolExhausted:
            # only a full device tier may refuse; that is possible only when too little is free
            assert free < len(seq)
            # and the refused allocation left no write-back of its own pending (one refused up
            # front, as never able to fit, waited for nothing and started nothing)
            assert self.cache.evictor.waiting() <= waiting
            return
        self.inserted.append(tuple(seq))

    @rule(seq=sequences)
    def match(self, seq: list[int]) -> None:
        result = self.cache.match_prefix(seq)
        longest = max((_common(seq, key) for key in self.inserted), default=0)
        assert result.device_len + result.host_len <= longest
        # what a caller reads: the matched pages hold exactly those tokens' KV
        layout = self.cache.tiers.device.layout
        matched = self.cache.tiers.read_device(result.device_pages)
        assert torch.equal(matched, synthetic_kv(layout, seq[: result.device_len]))

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
        refused = self.cache.stats().refused.get("write", 0)
        freed = self.cache.evict(n)
        if freed < n:  # then nothing evictable may be left behind (eviction saw every leaf)
            waiting = self.cache.evictor.waiting()
            left = [x for x in self.cache.tree if _device_leaf(x) and x.id not in waiting]
            # except write-back leaves whose backups a full host pool refused
            unbacked = [x for x in left if x.host in ("unbacked", "evicted")]
            full = self.cache.stats().refused.get("write", 0) > refused
            assert not left or (full and unbacked == left), left

    @rule(n=st.integers(1, 12))
    def evict_host(self, n: int) -> None:
        expected = expected_host_victims(self.cache, n)
        before = {node.id: node.host for node in self.cache.tree}
        self.cache.evict_host(n)
        assert host_evicted(self.cache, before) == set(expected)

    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        nodes = [n for n in self.cache.tree if n.device == "absent"]
        if nodes:
            self.cache.load_back(data.draw(st.sampled_from(nodes)))

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @invariant()
    def every_host_leaf_is_a_candidate(self) -> None:
        assert unfiled_host_leaves(self.cache) == []

    @invariant()
    def could_free_host_answers_what_a_walk_does(self) -> None:
        evictor = self.cache.evictor
        free = self.cache.tiers.host.allocator.free_pages
        evictable = host_evictable(self.cache)
        assert evictor.host_evictable() == evictable
        for pages in range(14):
            assert evictor.could_free_host(pages) == (free + evictable >= pages), pages

    @invariant()
    def nothing_waits_without_its_copy(self) -> None:
        assert self.cache.transfers.queued() == 0

    @invariant()
    def kv_is_what_was_written(self) -> None:
        layout = self.cache.tiers.device.layout
        for node in self.cache.tree:
            expected = synthetic_kv(layout, node.key)
            if node.device == "resident":
                assert torch.equal(self.cache.tiers.read_device(node.device_pages), expected), node
            if node.host in HOST_VALID:
                assert torch.equal(self.cache.tiers.host.read(node.host_pages), expected), node

    def teardown(self) -> None:
        for lease in self.leases:
            if lease.event == "lock":
                self.cache.unlock(lease)
            else:
                lease.release()
        # the log rebuilds the same tree on copies that finish at once, in order, and never fail
        rebuilt = replay(self.cache.log, replace(self.cache.config, copier=None))
        assert _states(rebuilt) == _states(self.cache)
        # every lease given back and every copy applied: nothing holds a node, nothing is stuck
        self.cache.close()
        held = [n for n in self.cache.tree if n.locks or n.pins]
        stuck = [n for n in self.cache.tree if n.host == "writing" or n.device == "loading"]
        assert (held, stuck, self.cache.evictor.waiting()) == ([], [], frozenset())


def _states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


def _common(a: list[int], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n - n % PAGE


class WriteBackMachine(CacheMachine):
    """The same operations under the write-back policy."""

    policy = "write_back"


class SelectiveMachine(CacheMachine):
    """The same operations under selective write-through."""

    policy = "write_through_selective"


SETTINGS = settings(
    max_examples=40,
    report_multiple_bugs=False,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWriteThrough = CacheMachine.TestCase
TestWriteThrough.settings = SETTINGS
TestWriteBack = WriteBackMachine.TestCase
TestWriteBack.settings = SETTINGS
TestSelective = SelectiveMachine.TestCase
TestSelective.settings = SETTINGS
