"""HiCache's public API: lookups, inserts, splits, locks, eviction, load-back, policies."""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from collections.abc import Hashable, Sequence, ValuesView
from functools import partial
from typing import Any

import pytest
import torch
from evictions import expected_host_victims, host_evicted, unfiled_host_leaves

from fsm_cache import native
from fsm_cache.cache.eviction import _SLACK
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.cache.tree import TreeNode
from fsm_cache.errors import (
    BadArgument,
    CacheClosed,
    ConfigError,
    CopyFailed,
    EffectFailed,
    ForeignSlot,
    IllegalTransition,
    LeaseError,
    PoolExhausted,
)
from fsm_cache.memory import staging
from fsm_cache.memory import tiers as tiers_module
from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
from fsm_cache.memory.pages import slots_of
from fsm_cache.memory.tickets import Ticket
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.residency import Event
from fsm_cache.testing.faults import FaultyCopyEngine


def make(**overrides: object) -> HiCache:
    """A small debug-mode cache: 4-token pages, every invariant checked after every call."""
    settings: dict[str, object] = {
        "device_pages": 16,
        "host_pages": 32,
        "page_size": 4,
        "layers": 1,
        "heads": 1,
        "head_dim": 4,
        "debug": True,
    }
    settings.update(overrides)
    return HiCache(CacheConfig(**settings))  # type: ignore[arg-type]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def kv_of(cache: HiCache, node: TreeNode) -> torch.Tensor:
    return cache.tiers.read_device(node.device_pages)


def states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


def nothing_queued(cache: HiCache) -> bool:
    """No node waits in a batch without its copy, and no copy is in flight."""
    return cache.transfers.queued() == 0 and cache.issued() == []


class TestInsertAndMatch:
    """Prefix lookups and inserts, page-aligned."""

    def test_insert_then_match_whole_and_partial(self) -> None:
        """A cached prefix matches to the page; the rest of the query is not matched."""
        cache = make()
        assert cache.insert(tokens(0, 12)) == 0
        result = cache.match_prefix([*tokens(0, 12), 99, 98, 97, 96])
        assert (result.device_len, result.host_len) == (12, 0)
        assert result.last_device_node is result.last_host_node
        assert len(result.device_pages) == 3

    def test_keys_are_cut_to_whole_pages(self) -> None:
        """A 10-token insert caches 8 tokens with page size 4."""
        cache = make()
        cache.insert(tokens(0, 10))
        assert [len(n.key) for n in cache.tree] == [8]

    def test_a_match_copies_as_itself(self) -> None:
        """Immutable, compiled or not; its nodes are the tree's own, so never deep-copied."""
        cache = make()
        cache.insert(tokens(0, 4))
        match = cache.match_prefix(tokens(0, 4))
        assert copy.copy(match) is match

    def test_match_inside_a_node_splits_it_at_a_page_boundary(self) -> None:
        """Matching 8 of 12 tokens splits the node into 8 + 4, pages and states carried."""
        cache = make()
        cache.insert(tokens(0, 12))
        cache.poll()
        (node,) = list(cache.tree)
        pages = node.device_pages
        result = cache.match_prefix([*tokens(0, 8), 50, 51, 52, 53])
        prefix = result.last_device_node
        assert (len(prefix.key), len(node.key)) == (8, 4)
        assert node.parent is prefix
        assert prefix.device_pages + node.device_pages == pages
        assert (prefix.host, node.host) == ("backed", "backed")

    def test_second_insert_reports_cached_length(self) -> None:
        """Inserting a longer sequence returns the length already cached and adds one leaf."""
        cache = make()
        cache.insert(tokens(0, 8))
        assert cache.insert(tokens(0, 16)) == 8
        assert sorted(len(n.key) for n in cache.tree) == [8, 8]

    def test_namespaces_keep_equal_prefixes_apart(self) -> None:
        """The same tokens under two namespaces are two nodes; a lookup sees only its own."""
        cache = make()
        cache.insert(tokens(0, 8), namespace="lora-a")
        assert cache.match_prefix(tokens(0, 8), namespace="lora-b").device_len == 0
        cache.insert(tokens(0, 8), namespace="lora-b")
        assert cache.match_prefix(tokens(0, 8), namespace="lora-a").device_len == 8
        assert len(list(cache.tree)) == 2

    def test_caller_slots_are_adopted(self) -> None:
        """Slots the caller allocated and filled become the new node's pages."""
        cache = make()
        slots = cache.alloc_slots(8)
        kv = synthetic_kv(cache.tiers.device.layout, [7] * 8)
        cache.tiers.device.write([s // 4 for s in slots[::4]], kv)
        cache.insert([7] * 8, slots)
        (node,) = list(cache.tree)
        assert list(node.device_pages) == [s // 4 for s in slots[::4]]
        assert torch.equal(kv_of(cache, node), kv)

    def test_slots_the_request_never_allocated_are_refused_first(self) -> None:
        """Free pages passed as a request's slots are refused before the tree changes."""
        cache = make()
        with pytest.raises(ForeignSlot) as caught:
            cache.insert(tokens(0, 8), list(range(8)))
        assert str(caught.value) == (
            "insert: device page 0 is free; a request's slots come from alloc_slots"
        )
        assert list(cache.tree) == []
        assert cache.tiers.device.allocator.free_pages == 16
        cache.check_invariants()

    def test_a_page_given_twice_is_refused_first(self) -> None:
        """The same request page passed for two pages of the key is refused; the request keeps it."""
        cache = make()
        held = cache.alloc_slots(4)
        with pytest.raises(ForeignSlot) as caught:
            cache.insert(tokens(0, 8), held + held)
        assert str(caught.value) == "insert: device page 0 is given twice"
        assert list(cache.tree) == []
        cache.free_slots(held)
        assert cache.tiers.device.allocator.free_pages == 16
        cache.check_invariants()

    def test_pages_of_a_node_are_refused(self) -> None:
        """A node's own pages are not a request's to hand over."""
        cache = make()
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        before = states(cache)
        with pytest.raises(ForeignSlot) as caught:
            cache.insert(tokens(100, 8), slots_of(node.device_pages, 4))
        assert str(caught.value) == "insert: device page 0 belongs to node 1, not to a request"
        assert states(cache) == before
        cache.check_invariants()

    def test_slots_for_a_host_only_prefix_are_checked_too(self) -> None:
        """Recomputed KV for an evicted prefix must come in request pages as well."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.evict(8)
        with pytest.raises(ForeignSlot) as caught:
            cache.insert(tokens(0, 16), [*range(60, 64), *range(56, 60), *cache.alloc_slots(8)])
        assert str(caught.value) == (
            "insert: device page 15 is free; a request's slots come from alloc_slots"
        )
        assert states(cache) == [(1, "backed/absent (pins=0, locks=0)")]

    def test_too_few_slots_are_refused(self) -> None:
        """Every token of the key needs a slot."""
        cache = make()
        with pytest.raises(ForeignSlot) as caught:
            cache.insert(tokens(0, 8), cache.alloc_slots(4))
        assert str(caught.value) == "insert: 4 device slots for 8 tokens"
        assert list(cache.tree) == []

    def test_exhausted_device_pool_raises_and_changes_nothing(self) -> None:
        """With every page locked, an insert that needs more refuses with PoolExhausted."""
        cache = make(device_pages=4)
        cache.insert(tokens(0, 16))
        lock = cache.lock(next(iter(cache.tree)))
        before = [(n.id, n.residency()) for n in cache.tree]
        with pytest.raises(PoolExhausted) as caught:
            cache.insert(tokens(100, 8))
        assert str(caught.value) == "device pool exhausted: requested 8 slots, 0 free"
        assert [(n.id, n.residency()) for n in cache.tree] == before
        cache.unlock(lock)


class TestLocks:
    """Locks are receipts: they propagate to ancestors and unlock exactly once."""

    def test_lock_propagates_and_unlocks_once(self) -> None:
        """A lock on a leaf locks its ancestors; a second unlock of the receipt is refused."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert(tokens(0, 16))
        leaf = max(cache.tree, key=lambda n: n.id)
        lock = cache.lock(leaf)
        assert [n.locks for n in cache.tree] == [1, 1]
        cache.unlock(lock)
        assert [n.locks for n in cache.tree] == [0, 0]
        with pytest.raises(LeaseError, match="already released"):
            cache.unlock(lock)

    def test_releasing_the_receipt_itself_is_the_cache_unlock(self) -> None:
        """lock.release() unlocks through the cache: logged, counted, replayed."""
        cache = make()
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        lock = cache.lock(node)
        lock.release()
        assert node.locks == 0
        assert cache.stats().transitions["unlock"] == 1
        assert cache.log.entries[-2:] == [("op", "unlock", (1,)), ("transition", 1, "unlock")]
        assert replay(cache.log, cache.config).tree.nodes[1].locks == 0
        with pytest.raises(LeaseError, match="already released"):
            cache.unlock(lock)

    def test_a_with_block_unlocks_once(self) -> None:
        """The end of ``with cache.lock(node):`` is one unlock; a later unlock is refused."""
        cache = make()
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        with cache.lock(node) as lock:
            assert node.locks == 1
        assert (node.locks, cache.stats().transitions["unlock"]) == (0, 1)
        with pytest.raises(LeaseError) as caught:
            cache.unlock(lock)
        assert str(caught.value) == (
            f"node 1: lease (lock taken at {lock.taken_at}) already released at {lock.released_at}"
        )
        assert cache.stats().transitions["unlock"] == 1

    def test_unlock_refuses_a_pin_receipt(self) -> None:
        """A pin's lease is not a lock: unlock refuses it and the pin stays."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        (node,) = list(cache.tree)
        pin = cache.pin(node)
        with pytest.raises(LeaseError) as caught:
            cache.unlock(pin)
        assert str(caught.value) == "node 1: unlock takes a lock receipt, not a pin"
        assert node.pins == 1
        pin.release()

    def test_eviction_honours_locks(self) -> None:
        """A locked node is not evicted, however much is asked."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        lock = cache.lock(next(iter(cache.tree)))
        assert cache.evict(100) == 0
        cache.unlock(lock)
        assert cache.evict(100) == 8


class TestEviction:
    """Device eviction per policy, host eviction of unpinned host leaves."""

    def test_backed_leaves_become_host_only_in_lru_order(self) -> None:
        """The least recently used backed leaf is evicted first and stays on the host."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert(tokens(100, 8))
        cache.poll()
        cache.match_prefix(tokens(0, 8))
        assert cache.evict(4) == 8
        states = {n.key[0]: (n.host, n.device) for n in cache.tree}
        assert states == {0: ("backed", "resident"), 100: ("backed", "absent")}

    def test_unbacked_leaf_is_deleted_under_write_through(self) -> None:
        """A leaf whose backup has not started is deleted: the device held its only copy."""
        cache = make(host_pages=0)
        cache.insert(tokens(0, 8))
        assert cache.evict(8) == 8
        assert list(cache.tree) == []
        assert cache.tiers.device.allocator.free_pages == 16

    def test_write_back_backs_up_then_evicts_after_the_ack(self) -> None:
        """Under write-back, eviction starts a backup and frees device pages only at the ack."""
        cache = make(write_policy="write_back")
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        assert node.host == "unbacked"
        assert cache.evict(8) == 0
        assert (node.host, node.device) == ("writing", "resident")
        cache.poll()
        assert (node.host, node.device) == ("backed", "absent")

    def test_write_back_insert_waits_for_the_backup_it_needs(self) -> None:
        """A full device under write-back: the insert backs the LRU leaf up, waits, evicts it."""
        cache = make(device_pages=4, write_policy="write_back")
        cache.insert(tokens(0, 16))
        assert cache.insert(tokens(100, 8)) == 0
        assert states(cache) == [
            (1, "backed/absent (pins=0, locks=0)"),
            (2, "unbacked/resident (pins=0, locks=0)"),
        ]
        assert nothing_queued(cache)
        assert ("acks", "wait", ((1, True),)) in cache.log.entries

    def test_write_back_alloc_slots_waits_too(self) -> None:
        """A request's slots under write-back pressure come from a waited-for backup."""
        cache = make(device_pages=4, write_policy="write_back")
        cache.insert(tokens(0, 16))
        held = cache.alloc_slots(8)
        assert len(held) == 8
        assert states(cache) == [(1, "backed/absent (pins=0, locks=0)")]
        cache.free_slots(held)
        assert cache.tiers.device.allocator.free_pages == 4

    def test_allocation_that_can_never_fit_evicts_nothing(self) -> None:
        """Too little room even if every unlocked leaf went: refused before any eviction."""
        cache = make(device_pages=4, write_policy="write_back")
        cache.insert(tokens(0, 8))
        cache.insert(tokens(100, 8))
        lock = cache.lock(cache.tree.nodes[2])
        before = states(cache)
        with pytest.raises(PoolExhausted) as caught:
            cache.insert(tokens(200, 16))
        assert str(caught.value) == "device pool exhausted: requested 16 slots, 0 free"
        assert (
            states(cache)
            == before
            == [
                (1, "unbacked/resident (pins=0, locks=0)"),
                (2, "unbacked/resident (pins=0, locks=1)"),
            ]
        )
        assert nothing_queued(cache)
        assert cache.log.entries[-1] == (
            "refused",
            "insert",
            "PoolExhausted: device pool exhausted: requested 16 slots, 0 free",
        )
        cache.unlock(lock)

    def test_failed_write_back_is_applied_before_the_refusal(self) -> None:
        """Backups that keep failing free nothing: refused, every failure applied."""
        cache = make(
            device_pages=4,
            write_policy="write_back",
            copier=FaultyCopyEngine.copier(fail=range(1, 9)),
        )
        cache.insert(tokens(0, 16))
        with pytest.raises(PoolExhausted) as caught:
            cache.insert(tokens(100, 8))
        assert str(caught.value) == "device pool exhausted: requested 8 slots, 0 free"
        assert states(cache) == [(1, "unbacked/resident (pins=0, locks=0)")]
        assert cache.tiers.host.allocator.free_pages == 32
        transitions = cache.stats().transitions
        assert transitions["write"] == transitions["write_failed"] >= 1
        assert nothing_queued(cache)

    def test_a_backup_that_failed_once_is_tried_again(self) -> None:
        """One failed write-back does not refuse the allocation: the backup is started again."""
        cache = make(
            device_pages=4, write_policy="write_back", copier=FaultyCopyEngine.copier(fail=[1])
        )
        cache.insert(tokens(0, 16))
        assert cache.insert(tokens(100, 8)) == 0
        assert states(cache) == [
            (1, "backed/absent (pins=0, locks=0)"),
            (2, "unbacked/resident (pins=0, locks=0)"),
        ]
        assert cache.stats().transitions["write_failed"] == 1

    def test_host_only_prefix_survives_a_write_back_that_needs_host_room(self) -> None:
        """The host-only prefix an insert adopts is never the host eviction a backup makes."""
        cache = make(device_pages=4, host_pages=4, write_policy="write_back")
        cache.insert(tokens(0, 8))
        cache.evict(8)
        cache.poll()
        cache.insert(tokens(100, 16))
        with pytest.raises(PoolExhausted) as caught:
            cache.insert(tokens(0, 16))
        assert str(caught.value) == "device pool exhausted: requested 16 slots, 0 free"
        assert states(cache) == [
            (1, "backed/absent (pins=0, locks=0)"),
            (2, "unbacked/resident (pins=0, locks=0)"),
        ]
        assert nothing_queued(cache)

    def test_host_eviction_honours_pins_and_deletes(self) -> None:
        """A pinned host-only leaf stays; once released, host eviction deletes the node."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.evict(8)
        (node,) = list(cache.tree)
        pin = cache.pin(node)
        assert cache.evict_host(8) == 0
        with pytest.raises(BadArgument, match="cannot be released by 'unlock': release gives"):
            pin.release("unlock")  # a receipt names its own give-back only
        assert pin.held
        pin.release("release")
        assert cache.evict_host(8) == 8
        assert list(cache.tree) == []
        assert cache.tiers.host.allocator.free_pages == 32

    def test_a_refused_host_eviction_leaves_every_candidate_filed(self) -> None:
        """A leaf whose host pages a copy still reads refuses; the leaves popped before stay filed.

        The pinned leaf, popped first and passed over, and the busy one were
        both left unfiled by the raise, so host eviction never saw them again.
        """
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert(tokens(100, 8))
        cache.poll()
        older, newer = sorted(cache.tree, key=lambda n: n.last_access)
        assert cache.evict(16) == 16
        pin = cache.pin(older)
        free = cache.tiers.device.allocator.free_list[:2]
        cache.tiers.copier.start_load(newer.host_pages, free)  # a copy the cache did not start
        with pytest.raises(EffectFailed) as caught:
            cache.evict_host(100)
        assert str(caught.value) == (
            f"node {newer.id}: effect free_host of evict_host failed:"
            f" host pages of node {newer.id} are still being copied"
        )
        assert (older.residency(), newer.residency()) == (
            "pinned/absent (pins=1, locks=0)",
            "backed/absent (pins=0, locks=0)",
        )
        assert unfiled_host_leaves(cache) == []
        cache.tiers.copier.drain()
        pin.release()
        assert cache.evict_host(100) == 16
        assert list(cache.tree) == []

    def test_a_refused_device_eviction_leaves_every_candidate_filed(self) -> None:
        """A leaf whose device pages a copy still reads refuses; the leaves popped before stay filed."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert(tokens(100, 8))
        cache.poll()
        older, newer = sorted(cache.tree, key=lambda n: n.last_access)
        lock = cache.lock(older)
        free = cache.tiers.host.allocator.free_list[:2]
        cache.tiers.copier.start_write(newer.device_pages, free)  # a copy the cache did not start
        with pytest.raises(EffectFailed) as caught:
            cache.evict(100)
        assert str(caught.value) == (
            f"node {newer.id}: effect free_device of evict_device failed:"
            f" device pages of node {newer.id} are still being copied"
        )
        assert cache.evictor.filed()[0] == 2
        cache.tiers.copier.drain()
        cache.unlock(lock)
        assert cache.evict(100) == 16
        assert {n.device for n in cache.tree} == {"absent"}

    def test_a_write_the_host_cannot_take_reads_no_more_than_the_candidates(self) -> None:
        """A full host pool of device-resident nodes' backups: a refused write walks no tree.

        Under write-through the host pool fills with copies of nodes still on
        the device, none of which can go; each backup the pool could not take
        counted every node of the tree, on every insert (a review of the
        eviction module). Now it reads the filed candidates only.
        """
        cache = make(device_pages=16, host_pages=4)
        cache.insert(tokens(0, 16))
        cache.poll()
        assert cache.tiers.host.allocator.free_pages == 0
        roots = cache.tree.roots
        walked = []

        class Watched(dict[Hashable, TreeNode]):
            def values(self) -> ValuesView[TreeNode]:  # type: ignore[override]
                walked.append("roots")
                return super().values()

        cache.tree.roots = Watched(roots)
        try:
            assert not cache.evictor.could_free_host(1)
            assert cache.evictor.host_evictable() == 0
        finally:
            cache.tree.roots = roots
        assert walked == []
        assert cache.insert(tokens(100, 4)) == 0  # its backup refused, the insert done
        assert [n.host for n in cache.tree if n.key[0] == 100] == ["unbacked"]

    def test_candidates_stay_within_the_tree_while_the_host_holds_the_working_set(self) -> None:
        """Prompts the device takes turns holding, all of them backed: the host never evicts.

        Only eviction pops candidates, so each device eviction's offer of a
        host leaf stayed filed for ever (a review of f5383dc: 150 entries for
        4 nodes here, growing by one a turn). Compacted, they stay within the
        tree, and host eviction still takes exactly what a full walk would.
        """
        cache = make(device_pages=8, load_back_threshold=0)
        prompts = [tokens(1000 * i, 24) for i in range(1, 5)]  # 6 pages each: one fits at a time
        for turn in range(150):
            prompt = prompts[turn % len(prompts)]
            found = cache.match_prefix(prompt)
            if found.host_len:
                assert cache.load_back(found.last_host_node) is not None
                cache.poll()
            cache.insert(prompt)
            cache.poll()
        assert cache.stats().transitions["evict_device"] >= 149
        assert "evict_host" not in cache.stats().transitions
        nodes = len(cache.tree.nodes)
        device, host = cache.evictor.filed()
        assert (nodes, device <= 2 * nodes + _SLACK, host <= 2 * nodes + _SLACK) == (4, True, True)
        assert unfiled_host_leaves(cache) == []
        expected = expected_host_victims(cache, 48)
        assert len(expected) == 2
        before = {node.id: node.host for node in cache.tree}
        assert cache.evict_host(48) == 48
        assert host_evicted(cache, before) == set(expected)


class TestLoadBack:
    """Load-back brings the whole evicted chain back, or nothing."""

    def test_round_trip_is_bit_exact(self) -> None:
        """KV evicted to the host and loaded back equals what was written."""
        cache = make()
        cache.insert(tokens(0, 12))
        cache.poll()
        (node,) = list(cache.tree)
        before = kv_of(cache, node)
        cache.evict(12)
        chain = cache.load_back(node)
        assert chain == [node]
        assert (node.host, node.device, node.pins) == ("pinned", "loading", 1)
        cache.poll()
        assert (node.host, node.device, node.pins) == ("backed", "resident", 0)
        assert torch.equal(kv_of(cache, node), before)

    def test_below_threshold_is_skipped(self) -> None:
        """A chain shorter than the load-back threshold is recomputed, not loaded."""
        cache = make(load_back_threshold=10)
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.evict(8)
        assert cache.load_back(next(iter(cache.tree))) is None

    def test_whole_chain_from_the_first_absent_ancestor(self) -> None:
        """Loading a leaf under an evicted parent loads the parent too, top-down."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.insert(tokens(0, 16))
        cache.poll()
        cache.evict(16)
        parent, leaf = sorted(cache.tree, key=lambda n: n.id)
        assert cache.load_back(leaf) == [parent, leaf]
        cache.poll()
        assert (parent.device, leaf.device) == ("resident", "resident")


class TestPolicies:
    """When backups start."""

    def test_selective_write_through_waits_for_the_second_hit(self) -> None:
        """With threshold 2, the first insert does not back up; the next hit does."""
        cache = make(write_policy="write_through_selective", selective_threshold=2)
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        assert node.host == "unbacked"
        cache.insert(tokens(0, 8))
        assert states(cache) == [(1, "writing/resident (pins=0, locks=0)")]

    def test_write_through_child_waits_for_its_parent(self) -> None:
        """A child's backup starts only once its parent's host copy is valid."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert(tokens(0, 16))
        parent, child = sorted(cache.tree, key=lambda n: n.id)
        assert (parent.host, child.host) == ("writing", "unbacked")
        cache.poll()
        assert parent.host == "backed"
        assert child.host == "writing"


class TestReporting:
    """Stats, config errors and misuse refused at the call."""

    def test_stats_count_tiers_hits_and_transitions(self) -> None:
        """Stats report tokens per tier, hit rates and applied transitions."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.match_prefix(tokens(0, 16))
        stats = cache.stats()
        assert (stats.device_tokens, stats.host_tokens) == (8, 8)
        assert stats.device_hit_rate == 0.5
        assert stats.transitions == {"write": 1, "write_done": 1}
        assert stats.bytes == {"d2h": 2 * cache.tiers.device.layout.page_bytes}
        assert stats.refused == {}

    def test_bad_config_is_refused_with_its_name(self) -> None:
        """A config value out of range raises ConfigError naming it."""
        with pytest.raises(ConfigError) as caught:
            make(write_policy="write_sometimes")
        assert str(caught.value) == (
            "config: write_policy must be one of write_through, write_through_selective, "
            "write_back, got 'write_sometimes'"
        )

    def test_refused_transition_is_counted_and_changes_nothing(self) -> None:
        """Releasing a pin that was never taken is refused and counted."""
        cache = make()
        cache.insert(tokens(0, 8))
        (node,) = list(cache.tree)
        with pytest.raises(IllegalTransition, match="release refused in writing"):
            cache.fire("release", node)
        assert cache.stats().refused == {"release": 1}
        assert node.host == "writing"


def test_reset_drains_copies_and_starts_empty() -> None:
    """After reset the tree is empty, both pools are whole, and nothing is in flight."""
    cache = make()
    cache.insert(tokens(0, 8))
    assert cache.issued()
    cache.reset()
    assert list(cache.tree) == []
    assert cache.issued() == []
    assert cache.tiers.device.allocator.free_pages == 16
    assert cache.tiers.host.allocator.free_pages == 32
    assert cache.insert(tokens(0, 8)) == 0


def test_reset_keeps_pools_and_copier_and_behaves_as_new() -> None:
    """Reset reuses the KV tensors and the copy engine; the cache then acts as a fresh one."""
    cache, fresh = make(), make()
    device, host, copier = cache.tiers.device.tensor, cache.tiers.host.tensor, cache.tiers.copier
    for c in (cache, fresh):
        c.insert(tokens(0, 8))
    cache.poll()
    cache.evict(8)
    cache.reset()
    assert cache.tiers.device.tensor is device
    assert cache.tiers.host.tensor is host
    assert cache.tiers.copier is copier
    assert cache.log.entries == []
    assert cache.stats() == make().stats()
    fresh.reset()
    for c in (cache, fresh):
        c.insert(tokens(0, 16))
        c.poll()
        c.match_prefix(tokens(0, 8))
    assert cache.log.entries == fresh.log.entries
    assert states(cache) == states(fresh)


def test_reset_voids_receipts_taken_before() -> None:
    """A lock taken before a reset cannot unlock a node of the new tree."""
    cache = make()
    cache.insert(tokens(0, 8))
    lock = cache.lock(next(iter(cache.tree)))
    cache.reset()
    cache.insert(tokens(0, 8))
    with pytest.raises(LeaseError) as caught:
        cache.unlock(lock)
    assert str(caught.value) == (
        f"node 1: lease (lock taken at {lock.taken_at}) was voided at {lock.released_at}:"
        " what it held was reset"
    )
    assert lock.released_at is not None
    assert lock.released_at.function == "test_reset_voids_receipts_taken_before"
    assert repr(lock).endswith(f"was voided at {lock.released_at}: what it held was reset>")
    assert cache.tree.nodes[1].locks == 0


def test_an_explicit_backup_keeps_write_through_prefix_closed() -> None:
    """backup() skips a child whose parent has no valid host copy yet (design invariant 3)."""
    cache = make(write_policy="write_through_selective", selective_threshold=5)
    cache.insert(tokens(0, 8))
    cache.insert(tokens(0, 16))  # two hits below the threshold: nothing backed up
    parent, child = sorted(cache.tree, key=lambda n: n.id)
    assert cache.backup([child]) == 0  # its parent is unbacked
    assert cache.backup([parent, child]) == 1  # the parent starts; the child still waits
    while cache.issued():
        cache.poll()
    assert cache.backup([child]) == 1
    while cache.issued():
        cache.poll()
    assert states(cache) == [
        (parent.id, "backed/resident (pins=0, locks=0)"),
        (child.id, "backed/resident (pins=0, locks=0)"),
    ]


class TestMisuseFoundByReview:
    """Copy engines that raise, public events that need bookkeeping, inputs with no order."""

    @staticmethod
    def raising_at_start(direction: str, error: BaseException) -> object:
        """A copy engine whose next start in ``direction`` raises ``error`` (then works)."""

        class Raising(FaultyCopyEngine):
            armed = True

            def start_write(
                self,
                device_pages: Sequence[int],
                host_pages: Sequence[int],
                *,
                stream: object | None = None,
            ) -> Ticket:
                if direction == "d2h" and Raising.armed:
                    Raising.armed = False
                    raise error
                return super().start_write(device_pages, host_pages, stream=stream)

            def start_load(
                self,
                host_pages: Sequence[int],
                device_pages: Sequence[int],
                *,
                stream: object | None = None,
            ) -> Ticket:
                if direction == "h2d" and Raising.armed:
                    Raising.armed = False
                    raise error
                return super().start_load(host_pages, device_pages, stream=stream)

        return Raising.copier()

    def test_an_engine_raising_at_a_write_start_fails_the_write_and_says_so(self) -> None:
        cache = make(copier=self.raising_at_start("d2h", RuntimeError("out of memory")))
        with pytest.raises(CopyFailed) as raised:
            cache.insert(tokens(0, 4))  # write-through: the backup starts as the insert returns
        assert str(raised.value) == "d2h copy could not start: RuntimeError: out of memory"
        (node,) = (n for n in cache.tree if n.key)
        assert node.residency() == "unbacked/resident (pins=0, locks=0)"  # failed, not stuck
        assert nothing_queued(cache)
        cache.check_invariants()
        cache.insert(tokens(0, 8))  # the engine works again: the next insert backs both up
        cache.poll()  # the parent's backup lands; the child's starts (prefix-closed)
        cache.poll()
        assert all(n.host == "backed" for n in cache.tree if n.key)

    def test_close_finishes_when_a_copy_it_starts_is_refused(self) -> None:
        """A start refused while close() settles is raised after the cache closed.

        close() stopped at the error: the copy engine kept running, the cache
        stayed open, and the memory was never given back.
        """
        cache = make(copier=self.raising_at_start("d2h", RuntimeError("out of memory")))
        copier = type(cache.tiers.copier)
        copier.armed = False  # type: ignore[attr-defined]  # armed for the child's start
        cache.insert(tokens(0, 4))  # the parent's backup starts
        cache.insert(tokens(0, 8))  # the child's waits for it (prefix-closed)
        copier.armed = True  # type: ignore[attr-defined]
        with pytest.raises(CopyFailed) as raised:
            cache.close()  # the parent's backup lands; the child's start is refused
        assert str(raised.value) == "d2h copy could not start: RuntimeError: out of memory"
        assert cache.closed
        assert cache.tiers.closed
        assert nothing_queued(cache)
        assert cache.log.refusals()[-1] == ("close", f"CopyFailed: {raised.value}")
        copier.armed = False  # type: ignore[attr-defined]  # a replay refuses it from the log
        assert replay(cache.log, cache.config).closed  # the replayed close is refused alike
        cache.close()  # closed: nothing to do
        with pytest.raises(CacheClosed):
            cache.insert(tokens(0, 4))

    def test_close_gives_the_memory_back_again_where_that_raised(self) -> None:
        """An engine whose close raises (a CUDA error while draining) is closed by the next close().

        The cache counted as closed, so a second close() did nothing: the copy
        engine was never closed and the pinned memory never given back.
        """

        class Unclosable(FaultyCopyEngine):
            raised = False

            def close(self) -> None:
                if not Unclosable.raised:
                    Unclosable.raised = True
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                super().close()

        cache = make(copier=Unclosable.copier())
        cache.insert(tokens(0, 4))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            cache.close()
        assert (cache.closed, cache.tiers.closed) == (True, False)
        cache.close()
        assert (cache.closed, cache.tiers.closed) == (True, True)

    @pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
    def test_write_back_leaves_stay_evictable_when_their_eviction_breaks(
        self, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
    ) -> None:
        """An allocator that breaks as an acknowledged write-back leaf is evicted spoils nothing.

        The leaf that raised was filed nowhere and the one after it stayed
        waiting for an acknowledgement already applied: neither could be
        evicted again, so a later allocation was refused with both unlocked.
        """
        cache = make(write_policy="write_back", device_pages=4, host_pages=8)
        cache.insert(tokens(0, 4))
        cache.insert(tokens(100, 4))
        assert cache.evict(4) == 0  # one backup of both leaves; evicted once it lands
        allocator = cache.tiers.device.allocator
        works = allocator.free

        def free(pages: Sequence[int], owner: int = -1) -> None:
            monkeypatch.setattr(allocator, "free", works)
            raise error("allocator broke")

        monkeypatch.setattr(allocator, "free", free)
        with pytest.raises((EffectFailed, error)):
            cache.poll()
        cache.check_invariants()
        assert cache.evict(8) == 8
        assert len(cache.alloc_slots(16)) == 16

    def test_an_engine_raising_at_a_load_start_fails_the_load_and_says_so(self) -> None:
        error = ValueError("copy: device page 3 is still in use by an unreported copy")
        cache = make(copier=self.raising_at_start("h2d", error), load_back_threshold=0)
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.evict(8)
        node = cache.match_prefix(tokens(0, 8)).last_host_node
        free = cache.tiers.device.allocator.free_pages
        with pytest.raises(CopyFailed, match="h2d copy could not start: ValueError: copy: device"):
            cache.load_back(node)
        assert (node.device, node.pins, cache.tiers.device.allocator.free_pages) == (
            "absent",
            0,
            free,
        )
        assert nothing_queued(cache)
        cache.check_invariants()

    def test_an_interrupt_at_a_write_start_fails_the_write_and_goes_on(self) -> None:
        """A KeyboardInterrupt from the engine as a backup starts: the node was left writing.

        The batch was taken off the queue before the start, which caught only
        Exception: no copy was in flight or queued for the node, for good.
        """
        cache = make(copier=self.raising_at_start("d2h", KeyboardInterrupt("Ctrl-C")))
        with pytest.raises(KeyboardInterrupt):
            cache.insert(tokens(0, 4))  # write-through: the backup starts as the insert returns
        (node,) = (n for n in cache.tree if n.key)
        assert node.residency() == "unbacked/resident (pins=0, locks=0)"
        assert nothing_queued(cache)
        cache.check_invariants()
        assert cache.log.refused_starts() == [(1, "d2h", (node.id,), "KeyboardInterrupt: Ctrl-C")]
        assert cache.log.failures() == [("insert", "KeyboardInterrupt: Ctrl-C")]
        cache.insert(tokens(0, 8))  # the engine works again: the next insert backs both up
        cache.poll()
        cache.poll()
        assert all(n.host == "backed" for n in cache.tree if n.key)

    def test_an_interrupt_at_a_load_start_fails_the_load_and_goes_on(self) -> None:
        cache = make(
            copier=self.raising_at_start("h2d", KeyboardInterrupt("Ctrl-C")),
            load_back_threshold=0,
        )
        cache.insert(tokens(0, 8))
        cache.poll()
        cache.evict(8)
        node = cache.match_prefix(tokens(0, 8)).last_host_node
        free = cache.tiers.device.allocator.free_pages
        with pytest.raises(KeyboardInterrupt):
            cache.load_back(node)
        assert (node.device, node.pins, cache.tiers.device.allocator.free_pages) == (
            "absent",
            0,
            free,
        )
        assert nothing_queued(cache)
        cache.check_invariants()
        assert cache.load_back(node)  # the engine works again
        assert cache.wait_loaded([node])
        cache.poll()
        assert node.device == "resident"

    @pytest.mark.parametrize("where", ["backup", "load"])
    def test_an_interrupt_inside_a_copy_fails_it_and_goes_on(
        self, monkeypatch: pytest.MonkeyPatch, where: str
    ) -> None:
        """Ctrl-C while the engine moves a copy's bytes: its ticket was never reported.

        The node stayed writing for good, close() returned with it so, and
        reset() raised PageBusy.
        """
        cache = make(load_back_threshold=0)
        cache.insert(tokens(0, 4))
        node = next(n for n in cache.tree if n.key)
        if where == "load":
            cache.poll()
            cache.evict(4)
        real, armed = staging._copy, [True]  # noqa: SLF001

        def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt("Ctrl-C")
            real(dst, src, non_blocking)

        monkeypatch.setattr(staging, "_copy", copy)
        # a load is submitted as it starts; a backup by the engine's poll
        call = partial(cache.load_back, node) if where == "load" else cache.poll
        with pytest.raises(KeyboardInterrupt):
            call()
        cache.check_invariants()
        cache.poll()  # the interrupted copy is reported failed, and applied
        if where == "load":
            assert node.residency() == "backed/absent (pins=0, locks=0)"
        else:
            assert node.residency() == "unbacked/resident (pins=0, locks=0)"
        assert nothing_queued(cache)
        cache.check_invariants()
        cache.reset()  # nothing is left in flight: it no longer raises PageBusy
        cache.insert(tokens(0, 4))
        cache.poll()
        assert all(n.host == "backed" for n in cache.tree if n.key)

    @pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
    def test_an_error_applying_a_copy_holds_the_rest_back(
        self, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
    ) -> None:
        """An effect that breaks while a poll applies copies loses none of them.

        The failing copy's node is copied again, the copies after it in the
        batch are applied by the next poll, and the log lists each copy as
        applied once, where it was: it used to list both as applied, the
        second never was, and both nodes stayed writing for good.
        """
        cache = make(copier=FaultyCopyEngine.copier(fail=(1,), delay=1), log_limit=None)
        cache.insert(tokens(0, 4))  # copy 1: fails
        cache.insert(tokens(100, 4))  # copy 2: lands
        first, second = sorted((n for n in cache.tree if n.key), key=lambda n: n.id)
        allocator = cache.tiers.host.allocator
        works, armed = allocator.free, [True]

        def free(pages: Sequence[int], owner: int = -1) -> None:
            if armed[0]:
                armed[0] = False
                raise error("allocator broke")
            works(pages, owner)

        monkeypatch.setattr(allocator, "free", free)
        cache.poll()  # delayed: nothing reported yet
        with pytest.raises((EffectFailed, error)):
            cache.poll()  # copy 1's failure gives its host pages back: the allocator breaks
        assert (first.host, second.host) == ("writing", "writing")
        cache.check_invariants()  # nothing writing without a copy in flight or queued
        assert cache.log.acknowledgements()[-1] == ("poll", ((1, False),))
        assert cache.issued() == [2, 3]  # copy 2, held back; node 1 copied again as copy 3
        cache.poll()  # copy 2, held back, is applied; copy 3 (node 1's again) is delayed
        cache.poll()
        assert (first.host, second.host) == ("backed", "backed")
        assert nothing_queued(cache)
        applied = [n for _, acks in cache.log.acknowledgements() for n, _ in acks]
        assert applied == [1, 2, 3]

    def test_an_error_failing_one_node_of_a_copy_copies_the_rest_again(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A failed copy of two write-back leaves: the second's failure breaks the allocator.

        The first is failed (and filed for eviction again), the second, still
        writing, is copied again, and its backup then lets it be evicted.
        """
        cache = make(
            write_policy="write_back",
            copier=FaultyCopyEngine.copier(fail=(1,)),
            log_limit=None,
        )
        cache.insert(tokens(0, 4))
        cache.insert(tokens(100, 4))
        assert cache.evict(8) == 0  # one copy backs both up; eviction waits for it
        first, second = sorted((n for n in cache.tree if n.key), key=lambda n: n.id)
        allocator = cache.tiers.host.allocator
        works, calls = allocator.free, [0]

        def free(pages: Sequence[int], owner: int = -1) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("allocator broke")
            works(pages, owner)

        monkeypatch.setattr(allocator, "free", free)
        with pytest.raises(EffectFailed, match="effect free_host of write_failed failed"):
            cache.poll()
        assert (first.host, second.host) == ("unbacked", "writing")
        assert cache.issued() == [2]  # the second's copy again
        cache.check_invariants()
        cache.poll()
        assert states(cache) == [
            (first.id, "unbacked/resident (pins=0, locks=0)"),
            (second.id, "backed/absent (pins=0, locks=0)"),
        ]
        assert cache.log.acknowledgements()[-2:] == [
            ("poll", ((1, False),)),
            ("poll", ((2, True),)),
        ]

    def test_a_fired_host_eviction_removes_the_node_no_tier_holds(self) -> None:
        cache = make()
        cache.insert(tokens(0, 4))
        cache.poll()
        cache.evict(4)
        leaf = cache.match_prefix(tokens(0, 4)).last_host_node
        free = cache.tiers.host.allocator.free_pages
        cache.fire("evict_host", leaf)  # debug mode: the invariants are checked after it
        assert leaf.id not in cache.tree.nodes
        assert cache.tiers.host.allocator.free_pages == free + 1
        assert cache.match_prefix(tokens(0, 4)).host_len == 0

    def test_a_fired_unlock_of_a_lock_only_a_child_holds_is_refused(self) -> None:
        """The spec's guard is locks >= 1; a child's lock counted in its parent passed it."""
        cache = make()
        cache.insert(tokens(0, 8))
        cache.insert([*tokens(0, 4), *tokens(100, 4)])  # splits: the parent holds 4 tokens
        child = cache.match_prefix([*tokens(0, 4), *tokens(100, 4)]).last_device_node
        parent = child.parent
        assert parent is not None
        lease = cache.lock(child)
        log = len(cache.log.entries)
        with pytest.raises(BadArgument) as caught:
            cache.fire("unlock", parent)
        assert str(caught.value) == (
            f"fire: unlock would take a lock of node {parent.id}'s children (locks=1, every "
            "one held by a node under it): unlock the node a lock was taken on"
        )
        assert (parent.locks, child.locks, len(cache.log.entries)) == (
            1,
            1,
            log,
        )  # refused before it was logged
        cache.fire("lock", parent)  # a lock of its own may be fired off again
        cache.fire("unlock", parent)
        cache.unlock(lease)
        assert (parent.locks, child.locks) == (0, 0)
        cache.check_invariants()

    @pytest.mark.parametrize(
        ("call", "message"),
        [
            (
                lambda c: c.wait_loaded(None),
                "wait_loaded: expected a sequence of tree nodes, got NoneType",
            ),
            (
                lambda c: c.insert({1, 2, 3, 4}),
                "insert: tokens must be a sequence of ints, got set",
            ),
            (
                lambda c: c.match_prefix({1: 0}),
                "match_prefix: tokens must be a sequence of ints, got dict",
            ),
            (
                lambda c: c.insert(tokens(0, 4), namespace=float("nan")),
                "insert: namespace must equal itself, got nan",
            ),
            (  # a tensor with no values: torch's own error came through untyped
                lambda c: c.match_prefix(torch.empty(8, dtype=torch.int64, device="meta")),
                "match_prefix: tokens must be a sequence of ints, got a Tensor whose values "
                "cannot be read: Cannot copy out of meta tensor; no data!",
            ),
            (
                lambda c: c.free_slots(torch.arange(8).to_sparse()),
                "free_slots: slots must be a sequence of ints, got a Tensor whose values "
                "cannot be read: Cannot access data pointer of Tensor that doesn't have storage",
            ),
            (  # the same, one value at a time
                lambda c: c.match_prefix([torch.tensor(3, device="meta")]),
                "match_prefix: tokens[0] is tensor(..., device='meta', size=(), "
                "dtype=torch.int64), not an int",
            ),
        ],
    )
    def test_inputs_without_a_meaning_are_refused(self, call: object, message: str) -> None:
        cache = make()
        before = states(cache)
        with pytest.raises(BadArgument) as refused:
            call(cache)  # type: ignore[operator]
        assert str(refused.value) == message
        assert states(cache) == before

    @pytest.mark.parametrize("event", [["pin"], 5, None])
    def test_an_event_that_is_not_a_str_is_refused_before_anything_changes(
        self, event: object
    ) -> None:
        """Compiled or not, the same BadArgument (docs/architecture.md, compiled modules)."""
        cache = make()
        before = states(cache)
        node = cache.match_prefix(tokens(0, 8)).last_device_node
        with pytest.raises(BadArgument) as refused:
            cache.fire(event, node)  # type: ignore[call-overload]
        assert str(refused.value) == f"fire: event must be a str, got {type(event).__name__}"
        assert states(cache) == before

    @pytest.mark.timeout(30)  # before the fix, it waited 10**12 times for nothing
    def test_settling_stops_once_a_wait_brings_nothing_back(self) -> None:
        """Copies collected and never applied never come back: waiting again cannot help."""
        cache = make()
        cache.insert(tokens(0, 8))  # write-through: the backup starts as the insert returns
        (node,) = (n for n in cache.tree if n.key)
        dropped = cache.transfers.collect(wait=True)  # taken away, never applied
        assert [c.ticket.id for c in dropped] == cache.issued()
        logged = len(cache.log.entries)
        cache.transfers.settle_all(10**12)
        assert cache.log.entries[logged:] == [("acks", "wait", ())]  # one wait, not 10**12
        assert (node.host, cache.transfers.idle()) == ("writing", False)

    def test_a_lock_receipt_is_taken_back_only_by_its_own_cache(self) -> None:
        ours, theirs = make(), make()
        theirs.insert(tokens(0, 4))
        node = theirs.match_prefix(tokens(0, 4)).last_device_node
        receipt = theirs.lock(node)
        with pytest.raises(LeaseError) as refused:
            ours.unlock(receipt)
        assert str(refused.value) == (
            f"node {node.id}: unlock refused: the receipt is another cache's"
        )
        assert (node.locks, receipt.held) == (1, True)
        theirs.unlock(receipt)
        assert node.locks == 0

    @pytest.mark.parametrize("event", ["load", "adopt"])
    def test_a_load_fired_by_hand_says_its_pages_are_missing(self, event: Event) -> None:
        cache = make()
        cache.insert(tokens(0, 4))
        cache.poll()
        cache.evict(4)
        node = cache.match_prefix(tokens(0, 4)).last_host_node
        before = states(cache)
        with pytest.raises(EffectFailed) as failed:
            cache.fire(event, node)  # load_back or insert stage the device pages first
        effect = "start_load" if event == "load" else "adopt_device"
        assert str(failed.value) == (
            f"node {node.id}: effect {effect} of {event} failed: no device pages are staged "
            "for it (load_back or insert allocate them; the event alone cannot)"
        )
        assert states(cache) == before


def observed_memory(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[object]]:
    """Make the next cache's pools over numpy buffers; return weak references to the buffers.

    A buffer dies exactly when the last tensor over its memory does (a view
    included), which a weak reference to a pool's tensor object would not say.
    """
    np = pytest.importorskip("numpy")
    buffers: list[weakref.ref[object]] = []

    def over_numpy(make: Any) -> Any:
        def made(layout: KVLayout, pages: int, *args: Any, **kwargs: Any) -> KVPool:
            pool: KVPool = make(layout, pages, *args, **kwargs)
            if not pool.nbytes:  # no memory to watch (and numpy's empty buffer has no view)
                return pool
            raw = np.zeros(pool.tensor.numel() * pool.tensor.element_size(), dtype=np.uint8)
            buffers.append(weakref.ref(raw))
            tensor = torch.from_numpy(raw).view(pool.tensor.dtype).view(pool.tensor.shape)
            return KVPool(pool.name, layout, pages, tensor, pinned=False)

        return made

    monkeypatch.setattr(tiers_module, "device_pool", over_numpy(device_pool))
    monkeypatch.setattr(tiers_module, "host_pool", over_numpy(host_pool))
    return buffers


@pytest.mark.usefixtures("no_cyclic_gc")
@pytest.mark.parametrize("copier", [None, FaultyCopyEngine.copier()], ids=["plain", "wrapped"])
def test_close_gives_both_pools_memory_back_without_the_cyclic_collector(
    copier: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed, a cache kept its pools' memory until Python's cyclic collector ran.

    The cache's parts refer to each other (the engine's effect hooks, the
    tree's split callback, the copy acknowledgements), so nothing but a full
    collection freed them: device memory on a GPU, pinned host memory. The
    copy engine's views of the pools would keep the memory too.
    """
    memory = observed_memory(monkeypatch)
    cache = make(write_policy="write_through", copier=copier)
    assert len(memory) == 2
    cache.insert(tokens(0, 32))
    cache.poll()  # the backups ran
    cache.evict(32)
    chain = cache.load_back(cache.match_prefix(tokens(0, 32)).last_host_node)
    assert chain  # loaded back: the other direction ran too
    cache.close()
    assert [buffer() for buffer in memory] == [None, None]
    with pytest.raises(ForeignSlot) as raised:
        cache.tiers.read_device(chain[-1].device_pages)
    assert str(raised.value) == (
        f"device pool: page {chain[-1].device_pages[0]} refused: the pool was released (its "
        "cache was closed, or dropped unclosed) and gave its memory back, so it has no pages"
    )
    with pytest.raises(CacheClosed):
        cache.match_prefix(tokens(0, 32))


@pytest.mark.usefixtures("no_cyclic_gc")
@pytest.mark.parametrize("copier", [None, FaultyCopyEngine.copier()], ids=["plain", "wrapped"])
def test_a_dropped_cache_gives_both_pools_memory_back_at_once(
    copier: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropped unclosed, a cache kept its pools' memory until Python's cyclic collector ran.

    Its parts refer to each other, so the last reference going freed nothing:
    a server that built a cache again (a test suite, a notebook, a reload)
    held the old device pool beside the new one until a full collection.
    """
    memory = observed_memory(monkeypatch)
    cache = make(write_policy="write_through", copier=copier)
    cache.insert(tokens(0, 32))
    assert cache.issued()  # dropped with its backups in flight: they are waited for
    del cache
    assert [buffer() for buffer in memory] == [None, None]


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_cache_whose_close_could_not_give_the_memory_back_gives_it_when_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close()`` counted the cache closed before the tiers raised, so ``__del__`` skipped it."""

    class Unclosable(FaultyCopyEngine):
        raised = False

        def close(self) -> None:
            if not Unclosable.raised:  # once: the CUDA error passed
                Unclosable.raised = True
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().close()

    memory = observed_memory(monkeypatch)
    cache = make(copier=Unclosable.copier())
    cache.insert(tokens(0, 4))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cache.close()
    assert [buffer() is None for buffer in memory] == [False, False]
    del cache
    assert [buffer() for buffer in memory] == [None, None]


def test_a_cache_cannot_be_copied_and_its_copy_never_closes_it() -> None:
    """A shallow copy shared the pools and the gate: dropping it closed the original."""
    cache = make()
    cache.insert(tokens(0, 8))
    for copier in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError) as refused:
            copier(cache)
        assert str(refused.value) == (
            "a HiCache cannot be copied: a copy would share its pools, its tree and its copies"
            " in flight, and closing either (or dropping it) would close both; build another"
            " HiCache"
        )
    gc.collect()
    assert cache.match_prefix(tokens(0, 8)).device_len == 8
    assert not cache.closed


@pytest.mark.skipif(bool(native.compiled()), reason="compiled, __new__ runs __init__")
def test_a_cache_never_initialised_is_dropped_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the sources, ``__del__`` of an object ``__init__`` never ran on raised AttributeError."""
    reported: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    made = HiCache.__new__(HiCache)
    del made
    gc.collect()
    assert reported == []


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_cache_refused_after_its_tiers_were_built_keeps_no_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache refused half-built is dropped at once: its ``__del__`` must cope, and free the pools.

    The first ``__del__`` read an attribute ``__init__`` had not set yet; mypyc
    reads one that ``__init__`` always sets unchecked, and the process died
    of a segmentation fault.
    """
    memory = observed_memory(monkeypatch)
    with pytest.raises(ConfigError) as refused:
        make(write_policy="write_back", host_pages=0)
    assert str(refused.value) == (
        "config: write_back needs host pages: with none, no device page could be evicted"
    )
    del refused  # its traceback holds the half-built cache
    assert len(memory) == 1  # the device pool's; the host pool has no pages
    assert memory[0]() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_close_returns_the_device_pool_to_torch_at_once() -> None:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = make(device="cuda", device_pages=256, host_pages=256, heads=8, head_dim=128)
    cache.insert(tokens(0, 64))
    cache.poll()
    held = torch.cuda.memory_allocated() - before
    assert held >= cache.tiers.device.nbytes > 0
    cache.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < cache.config.page_size * 1024
