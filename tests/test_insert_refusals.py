"""A refused insert whose match ends inside a node leaves everything as it was: no split.

An insert that runs into a node part way splits it at a page boundary. Every
refusal it can meet is checked before that split (check, then act), and a
failure from outside the cache (torch failing a write) comes before it too, so
the tree, the node ids handed out, the pools, the counters and the log (but
for the call and its refusal) are exactly those of a twin cache that never saw
the call. The twin then takes the same next step, so an id taken by a split
and never given back would show there.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.errors import (
    CacheClosed,
    CopyFailed,
    EffectFailed,
    ForeignSlot,
    NotASlot,
    PoolExhausted,
)
from fsm_cache.memory.pages import REQUEST
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.testing.faults import FaultyCopyEngine


INTO = [1, 2, 3, 4, 20, 21]
"""An insert whose match ends inside node [1..8], after its second page."""

LONG = [1, 2, 3, 4, *range(20, 30)]
"""The same with a five-page tail."""


def make(**overrides: object) -> HiCache:
    """A small debug-mode cache of 2-token pages holding node [1..8], backed up."""
    settings: dict[str, object] = {
        "device_pages": 8,
        "host_pages": 16,
        "page_size": 2,
        "layers": 1,
        "heads": 1,
        "head_dim": 4,
        "device": "cpu",
        "load_back_threshold": 0,
        "debug": True,
    }
    settings.update(overrides)
    cache = HiCache(CacheConfig(**settings))  # type: ignore[arg-type]
    cache.insert(list(range(1, 9)))
    cache.poll()
    return cache


def state(cache: HiCache) -> tuple[object, ...]:
    """Everything a refused call must leave as it was (node ids included)."""
    nodes = sorted(
        (
            n.id,
            n.parent.id if n.parent is not None else None,
            n.key,
            n.device_pages,
            n.host_pages,
            n.residency(),
            n.last_access,
            n.hit_count,
            tuple(sorted(n.children)),
        )
        for n in cache.tree
    )
    roots = {repr(ns): tuple(sorted(r.children)) for ns, r in cache.tree.roots.items()}
    pools = [
        (a.owners, a.free_list) for a in (cache.tiers.device.allocator, cache.tiers.host.allocator)
    ]
    timing = {"since", "copy_seconds", "storage_seconds"}
    counters = {
        f.name: copy.copy(getattr(cache.counters, f.name))
        for f in dataclasses.fields(cache.counters)
        if f.name not in timing
    }
    return nodes, roots, pools, counters, cache.issued(), cache.transfers.queued()


def fill(cache: HiCache) -> list[int]:
    """Take every free device page for a request."""
    return cache.alloc_slots(2 * cache.tiers.device.allocator.free_pages)


def the_node(cache: HiCache) -> Any:
    (node,) = (n for n in cache.tree if n.key)
    return node


def loading(cache: HiCache) -> None:
    cache.evict(8)
    cache.poll()
    assert cache.load_back(the_node(cache))


def loading_and_full(cache: HiCache) -> None:
    loading(cache)
    fill(cache)


def closed(cache: HiCache) -> None:
    cache.close()


def breaking_write(cache: HiCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pages: object, tokens: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(cache.tiers, "write_tokens", refuse)


def breaking_hand_over(cache: HiCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise RuntimeError("allocator broke")

    monkeypatch.setattr(cache.tiers.device.allocator, "reassign", refuse)


def breaking_request_hand_over(cache: HiCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device allocator breaks handing a request's pages to a node: adopt or new leaf."""
    allocator = cache.tiers.device.allocator
    works = allocator.reassign

    def reassign(pages: Any, owner: int, new_owner: int) -> None:
        if owner == REQUEST:
            raise RuntimeError("allocator broke")
        works(pages, owner, new_owner)

    monkeypatch.setattr(allocator, "reassign", reassign)


def evicted(cache: HiCache) -> None:
    cache.evict(8)
    cache.poll()


# each: history (on both caches), fault (on the refused one only), the call, what it raises
Setup = Callable[[HiCache], object] | None
Fault = Callable[[HiCache, pytest.MonkeyPatch], None] | None
CASES: dict[str, tuple[Setup, Fault, Callable[[HiCache], object], type[Exception], str]] = {
    "slot of a free page": (
        None,
        None,
        lambda c: c.insert(INTO, [0, 1, 2, 3, 14, 15]),
        ForeignSlot,
        "insert: device page 7 is free; a request's slots come from alloc_slots",
    ),
    "slots not whole pages": (
        None,
        None,
        lambda c: c.insert(INTO, [0, 1, 2, 3, 15, 14]),
        ForeignSlot,
        "insert: slots are not whole pages of size 2",
    ),
    "no room even after eviction": (
        fill,
        None,
        lambda c: c.insert(LONG),  # five pages; evicting the suffix would free two
        PoolExhausted,
        "device pool exhausted: requested 10 slots, 0 free",
    ),
    "loading, slot of a free page": (
        loading,
        None,
        lambda c: c.insert(INTO, [0, 1, 2, 3, 14, 15]),
        ForeignSlot,
        "insert: device page 7 is free; a request's slots come from alloc_slots",
    ),
    "loading, no room even after eviction": (
        loading_and_full,
        None,
        lambda c: c.insert(LONG),
        PoolExhausted,
        "device pool exhausted: requested 10 slots, 0 free",
    ),
    "a KV write torch fails": (
        None,
        breaking_write,
        lambda c: c.insert(INTO),
        RuntimeError,
        "CUDA out of memory",
    ),
    "an allocator breaking at the split": (
        None,
        breaking_hand_over,
        lambda c: c.insert(INTO),
        RuntimeError,
        "allocator broke",
    ),
    "an allocator breaking as the new leaf takes its pages": (
        None,
        breaking_request_hand_over,
        lambda c: c.insert(INTO),
        RuntimeError,
        "allocator broke",
    ),
    "an allocator breaking as the prefix is adopted": (
        evicted,
        breaking_request_hand_over,
        lambda c: c.insert(INTO),
        EffectFailed,
        "node 2: effect adopt_device of adopt failed: allocator broke",
    ),
    "bool slots": (
        None,
        None,
        lambda c: c.insert(INTO, [0, 1, 2, 3, False, True]),  # read where the insert reads
        NotASlot,
        "insert: slots[4] is False, not an int",
    ),
    "a closed cache": (
        closed,
        None,
        lambda c: c.insert(INTO),
        CacheClosed,
        "insert: the cache was closed",
    ),
}


COUNTED = {"an allocator breaking as the prefix is adopted": "adopt"}
"""Cases whose failure is a transition the machine refused, counted as refused (the metric)."""


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_insert_into_a_node_leaves_it_unsplit(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup, fault, call, error, message = CASES[case]
    cache, twin = make(), make()
    for c in (cache, twin):
        if setup is not None:
            setup(c)
    entries = list(cache.log.entries)
    before = state(cache)
    assert before == state(twin)
    with monkeypatch.context() as patch:
        if fault is not None:
            fault(cache, patch)
        with pytest.raises(error) as caught:
            call(cache)
    assert str(caught.value) == message
    if case in COUNTED:
        before[3]["refused"][COUNTED[case]] += 1  # type: ignore[index]
    assert state(cache) == before
    logged = list(cache.log.entries)
    assert logged[: len(entries)] == entries
    assert [kind for kind, _, _ in logged[len(entries) :]] in (
        [],
        ["op", "refused"],
        ["op", "failed"],
    )
    assert not cache.log.transitions()[len(twin.log.transitions()) :]  # no split logged
    if case == "a closed cache":
        return
    cache.check_invariants()
    if case in COUNTED:
        twin.counters.refused[COUNTED[case]] += 1  # the refusal the twin never met
    for c in (cache, twin):  # the same next step: the same node ids
        c.poll()
        c.insert([1, 2, 3, 4, 30, 31])
    assert state(cache) == state(twin)
    assert cache.log.transitions() == twin.log.transitions()


def test_a_refused_insert_while_a_load_fails_again_leaves_it_unsplit() -> None:
    """CopyFailed: the load under the insert failed and runs again (locked): refused, unsplit."""
    cache = make(copier=FaultyCopyEngine.copier(fail=range(2, 40)))
    cache.evict(8)
    cache.poll()
    node = the_node(cache)
    assert cache.load_back(node)
    lock = cache.lock(node)  # a failed load of a locked node runs again
    with pytest.raises(CopyFailed) as caught:
        cache.insert(INTO)
    assert str(caught.value) == (
        f"insert: node {node.id} is still loading: its copy failed and runs again;"
        " insert after a poll"
    )
    assert [n.key for n in cache.tree] == [tuple(range(1, 9))]  # not split
    assert not [t for t in cache.log.transitions() if t[1].startswith("split")]
    cache.check_invariants()
    lock.release()


def test_an_insert_that_needs_the_suffix_evicted_still_splits_and_evicts_it() -> None:
    """With the pool full, the suffix the split leaves is what eviction frees: counted as such."""
    cache = make()
    fill(cache)
    assert cache.insert(INTO) == 4
    by_key = {n.key: n for n in cache.tree}
    assert by_key[(1, 2, 3, 4)].device == "resident"
    assert by_key[(5, 6, 7, 8)].residency() == "backed/absent (pins=0, locks=0)"
    assert by_key[(20, 21)].device == "resident"
    cache.check_invariants()


def test_a_pool_short_of_what_only_the_prefix_holds_is_refused_unsplit() -> None:
    """The prefix the insert runs through is kept: its pages never count as room."""
    cache = make()
    fill(cache)
    before = state(cache)
    with pytest.raises(PoolExhausted) as caught:
        cache.insert([1, 2, 3, 4, *range(20, 26)])  # three pages: the suffix holds two
    assert str(caught.value) == "device pool exhausted: requested 6 slots, 0 free"
    assert state(cache) == before


def test_a_refused_insert_whose_eviction_changed_nothing_leaves_it_unsplit() -> None:
    """The pool short, eviction tried and freed nothing: the split is taken back, log and all.

    Write-back, one host page, held by a backed node whose device child is
    unbacked: no backup can find room, so neither that child nor the suffix
    of the node the insert runs into can leave the device. The eviction only
    locked and unlocked the prefix; that pair goes from the log with the
    split (the counters keep it, and the backups refused: they count what
    ran), so a replay of the log reruns the refused insert to the same refusal.
    """

    def full() -> HiCache:
        cache = HiCache(
            CacheConfig(
                device_pages=4,
                host_pages=1,
                page_size=2,
                layers=1,
                heads=1,
                head_dim=4,
                device="cpu",
                write_policy="write_back",
                debug=True,
            )
        )
        cache.insert([1, 2])
        cache.backup([cache.match_prefix([1, 2]).last_device_node])
        cache.poll()  # the host pool's only page
        cache.insert([1, 2, 3, 4])  # unbacked, under the backed node
        cache.insert([9, 10, 11, 12])  # unbacked; the device pool is full
        return cache

    cache, twin = full(), full()
    entries = list(cache.log.entries)
    before = state(cache)
    with pytest.raises(PoolExhausted) as caught:
        cache.insert([9, 10, 13, 14])  # runs into [9..12] after its first page
    assert str(caught.value) == "device pool exhausted: requested 2 slots, 0 free"
    after = state(cache)
    assert after[:3] == before[:3]
    assert after[4:] == before[4:]
    counted = after[3]["transitions"] - before[3]["transitions"]  # type: ignore[index]
    assert counted == {"lock": 1, "unlock": 1}  # the eviction's hold of the prefix
    refused = after[3]["refused"] - before[3]["refused"]  # type: ignore[index]
    assert refused == {"write": 2}  # the backups no host room was found for
    assert [kind for kind, _, _ in cache.log.entries[len(entries) :]] == ["op", "refused"]
    assert cache.log.transitions() == twin.log.transitions()
    cache.check_invariants()
    replayed = replay(cache.log, cache.config)
    assert state(replayed)[:3] == state(cache)[:3]
    for c in (cache, twin):  # the same next step, a split: the same node ids
        c.insert([9, 10])
    assert state(cache)[:3] == state(twin)[:3]
    assert cache.log.transitions() == twin.log.transitions()
