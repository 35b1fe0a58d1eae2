"""SGLang 0.5.6's real ``HiRadixCache``: chains of loads, splits in flight, memory running short.

Each scenario runs stock and patched (``conftest.mode``): SGLang's results must
be the same, and the patched run's residency must say what SGLang's fields
imply at every step. Skipped on versions without ``hiradix_cache.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, build_hiradix, whole_state
from .fakes import FakeAllocator


A = list(range(1, 7))
AB = list(range(1, 13))


@pytest.fixture
def hiradix(sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A write-through ``HiRadixCache`` over 64 device and 64 host slots."""
    del mode
    return build_hiradix(sg, allocator, monkeypatch, "write_through")


def residency(node: Any, mode: str) -> tuple[str, str, int, int] | None:
    """``(host, device, pins, locks)`` of a patched node; None when stock."""
    return (node.host, node.device, node.pins, node.locks) if mode == "patched" else None


def evicted_chain(
    sg: Api, cache: Any, allocator: FakeAllocator, *, leaf_only: bool = False
) -> tuple[Any, Any]:
    """Two nodes A -> B, backed up and evicted from the device (only the leaf B, with ``leaf_only``)."""
    sg.insert(cache, A, allocator.take(len(A)))
    sg.insert(cache, AB, allocator.take(len(AB)))  # its first 6 slots the caller frees
    cache.cache_controller.finish_writes()
    cache.writing_check()
    cache.evict(len(AB) - len(A) if leaf_only else len(AB))
    (a,) = cache.root_node.children.values()
    (b,) = a.children.values()
    assert (a.evicted, b.evicted, a.backuped, b.backuped) == (not leaf_only, True, True, True)
    return a, b


def test_a_chain_loads_and_is_acknowledged_as_one(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    a, b = evicted_chain(sg, cache, allocator)
    found = cache.match_prefix(sg.key(AB))
    assert (len(found.device_indices), found.host_hit_length, found.last_host_node is b) == (
        0,
        12,
        True,
    )
    loaded, last = cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert (len(loaded), last is b, a.lock_ref, b.lock_ref) == (12, True, 1, 1)
    assert residency(a, mode) in (None, ("pinned", "loading", 1, 1))
    assert residency(b, mode) in (None, ("pinned", "loading", 1, 1))
    cache.ready_to_load_host_cache()
    cache.cache_controller.finish_loads()
    cache.loading_check()  # one ack, for B's id: A is loaded by the same copy
    assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back) == (0, 0, {})
    assert residency(a, mode) in (None, ("backed", "resident", 0, 0))
    assert residency(b, mode) in (None, ("backed", "resident", 0, 0))
    assert len(cache.match_prefix(sg.key(AB)).device_indices) == 12


def test_a_node_split_while_loading_is_acknowledged_with_it(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    a, b = evicted_chain(sg, cache, allocator)
    found = cache.match_prefix(sg.key(AB))
    cache.init_load_back(found.last_host_node, found.host_hit_length)
    cache.ready_to_load_host_cache()
    # a match ending inside B splits it while its load is in flight
    middle = cache.match_prefix(sg.key(AB[:9])).last_device_node
    assert (middle.parent is a, b.parent is middle, len(middle.key), middle.lock_ref) == (
        True,
        True,
        3,
        1,
    )
    assert residency(middle, mode) in (None, ("pinned", "loading", 1, 1))
    cache.cache_controller.finish_loads()
    cache.loading_check()
    for node in (a, middle, b):
        assert node.lock_ref == 0
        assert residency(node, mode) in (None, ("backed", "resident", 0, 0))


def test_a_backup_without_host_memory_is_given_up(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    cache.cache_controller.mem_pool_host.take(60)  # the host pool is nearly full
    assert sg.insert(cache, AB, allocator.take(len(AB))) == 0
    (node,) = cache.root_node.children.values()
    assert (node.backuped, node.lock_ref, cache.ongoing_write_through) == (False, 0, {})
    assert residency(node, mode) in (None, ("unbacked", "resident", 0, 0))


def test_a_load_without_device_memory_is_given_up(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    a, b = evicted_chain(sg, cache, allocator)
    allocator.take(allocator.available_size() - 4)  # the device pool is nearly full
    found = cache.match_prefix(sg.key(AB))
    loaded, last = cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert (len(loaded), last is cache.root_node, a.evicted, b.evicted) == (0, True, True, True)
    for node in (a, b):
        assert residency(node, mode) in (None, ("backed", "absent", 0, 0))


class FailingMetrics:
    """A metrics collector whose ``observe_load_back_duration`` raises (its backend is down).

    SGLang 0.5.6's ``load_back`` calls it last, after it registered the load
    in ``ongoing_load_back`` and locked the loaded node and its ancestors.
    """

    def observe_load_back_duration(self, duration: float) -> None:
        """Fail, as a collector whose backend is unreachable does."""
        del duration
        raise RuntimeError("metrics backend down")


def fail_after_registering(sg: Api, cache: Any, ids: list[int]) -> None:
    """``init_load_back`` of ``ids``' host hit, with the metrics call at its end raising."""
    found = cache.match_prefix(sg.key(ids))
    cache.metrics_collector = FailingMetrics()
    with pytest.raises(RuntimeError) as caught:
        cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert str(caught.value) == "metrics backend down"
    cache.metrics_collector = None


def test_a_load_back_failing_after_it_started_stays_in_flight_as_stock_leaves_it(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    """The load is SGLang's once registered: its locks stay, and ``loading_check`` ends it.

    The ancestor's lock now belongs to the load (``inc_lock_ref`` of the
    loaded node locks it too); releasing it as a lock SGLang forgot would
    leave the ancestor unlocked under a locked child, and the load's
    acknowledgement refused.
    """
    cache = hiradix
    cache.load_back_threshold = 1
    a, b = evicted_chain(sg, cache, allocator, leaf_only=True)
    fail_after_registering(sg, cache, AB)
    assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back == {b.id: b}) == (1, 1, True)
    assert residency(a, mode) in (None, ("backed", "resident", 0, 1))
    assert residency(b, mode) in (None, ("pinned", "loading", 1, 1))
    cache.ready_to_load_host_cache()
    cache.cache_controller.finish_loads()
    cache.check_hicache_events()
    assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back) == (0, 0, {})
    assert (cache.evictable_size(), cache.protected_size()) == (len(AB), 0)
    for node in (a, b):
        assert residency(node, mode) in (None, ("backed", "resident", 0, 0))


def test_a_chain_load_failing_after_it_started_is_acknowledged_as_one(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    """Both nodes of the chain are loading: ``loading_check`` acknowledges them, and they may go again."""
    cache = hiradix
    cache.load_back_threshold = 1
    a, b = evicted_chain(sg, cache, allocator)
    fail_after_registering(sg, cache, AB)
    assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back == {b.id: b}) == (1, 1, True)
    for node in (a, b):
        assert residency(node, mode) in (None, ("pinned", "loading", 1, 1))
    cache.ready_to_load_host_cache()
    cache.cache_controller.finish_loads()
    cache.check_hicache_events()
    assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back) == (0, 0, {})
    for node in (a, b):
        assert residency(node, mode) in (None, ("backed", "resident", 0, 0))
    cache.evict(len(AB))
    assert (a.evicted, b.evicted, allocator.available_size()) == (True, True, 64 - len(A))
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)


def test_a_load_back_failing_before_it_started_is_undone(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    """A deliberate difference: an error before SGLang registers the load leaves nothing of it.

    The controller raises as it allocates the device slots, after SGLang
    locked the chain's resident ancestor. Stock SGLang keeps that lock for
    good; patched, the chain's loads fail and the lock is released, so the
    cache is as it was before ``init_load_back``.
    """
    cache = hiradix
    cache.load_back_threshold = 1
    a, b = evicted_chain(sg, cache, allocator, leaf_only=True)
    found = cache.match_prefix(sg.key(AB))
    before = whole_state(cache, allocator)

    def load(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device copy failed")

    cache.cache_controller.load = load
    with pytest.raises(RuntimeError) as caught:
        cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert str(caught.value) == "device copy failed"
    del cache.cache_controller.load
    after = whole_state(cache, allocator)
    if mode == "patched":
        assert after == before
    else:
        assert (a.lock_ref, b.lock_ref, cache.ongoing_load_back) == (1, 0, {})
        assert after.pop("sizes") == (0, len(A))  # A's tokens protected for good
        after["nodes"][tuple(A)][2] = 0  # the ancestor's lock, stock's only other difference
        assert after == {k: v for k, v in before.items() if k != "sizes"}


def test_a_prefetch_anchor_may_pin_a_node_still_being_written(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    sg.insert(cache, AB, allocator.take(len(AB)))
    (node,) = cache.root_node.children.values()
    node.protect_host()  # prefetch_from_storage: the last host-matched node is the anchor
    assert node.host_ref_counter == 1
    assert residency(node, mode) in (None, ("writing", "resident", 1, 1))
    cache.cache_controller.finish_writes()
    cache.writing_check()
    assert residency(node, mode) in (None, ("pinned", "resident", 1, 0))
    cache.evict(len(AB))
    cache.evict_host(len(AB))  # the anchor's host copy stays while the prefetch runs
    assert (node.evicted, node.backuped, cache.root_node.children != {}) == (True, True, True)
    node.release_host()
    cache.evict_host(len(AB))
    assert cache.root_node.children == {}


def test_a_node_recomputed_under_a_parent_still_loading_takes_its_slots(
    sg: Api, allocator: FakeAllocator, hiradix: Any, mode: str
) -> None:
    cache = hiradix
    a, b = evicted_chain(sg, cache, allocator)
    cache.load_back_threshold = 1  # load A's 6 tokens back (SGLang's default asks for 10)
    found = cache.match_prefix(sg.key([*A, 99]))  # one request hits A on the host
    cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert (a.lock_ref, a.evicted) == (1, False)
    assert residency(a, mode) in (None, ("pinned", "loading", 1, 1))
    value = allocator.take(len(AB))  # another request computed A and B itself
    assert sg.insert(cache, AB, value) == len(A)
    assert (b.value.tolist(), b.lock_ref, a.lock_ref) == (value[len(A) :].tolist(), 0, 1)
    # the spec refuses adopt under a loading parent; B's KV lands as a load done at once
    assert residency(b, mode) in (None, ("backed", "resident", 0, 0))
    if mode == "patched":
        assert [entry[0] for entry in b.trail][-2:] == ["load", "load_done"]
    cache.ready_to_load_host_cache()
    cache.cache_controller.finish_loads()
    cache.loading_check()
    assert (a.lock_ref, cache.ongoing_load_back) == (0, {})
    assert residency(a, mode) in (None, ("backed", "resident", 0, 0))
    assert len(cache.match_prefix(sg.key(AB)).device_indices) == len(AB)


def test_a_write_back_eviction_frees_a_parent_after_the_child_it_writes_back(
    sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = build_hiradix(sg, allocator, monkeypatch, "write_back")
    sg.insert(cache, A, allocator.take(len(A)))
    cache.evict(len(A))  # written back to the host, then evicted
    (a,) = cache.root_node.children.values()
    # a request recomputed A and went on: A takes the new slots (its host copy is there)
    assert sg.insert(cache, AB, allocator.take(len(AB))) == 0  # no prefix was on the device
    (b,) = a.children.values()
    assert residency(a, mode) in (None, ("backed", "resident", 0, 0))
    # SGLang starts B's write-back, frees A in the same loop, and B after it
    cache.evict(len(AB))
    assert (a.evicted, b.evicted, a.backuped, b.backuped) == (True, True, True, True)
    assert (allocator.available_size(), cache.ongoing_write_through) == (64, {})
    cache.check_hicache_events()
    for node in (a, b):
        assert (node.lock_ref, getattr(node, "evicting", False)) == (0, False)
        assert residency(node, mode) in (None, ("backed", "absent", 0, 0))


def test_a_write_back_eviction_frees_every_waiting_node_deepest_first(
    sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = build_hiradix(sg, allocator, monkeypatch, "write_back")
    x, xy, xyz, xyzw = [1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]

    def recompute(ids: list[int]) -> None:
        value = allocator.take(len(ids))
        allocator.free(value[: sg.insert(cache, ids, value)])  # the caller frees what was cached

    recompute(x)
    cache.evict(len(x))  # X written back and evicted
    recompute(xy)  # X takes new slots (backed), Y is new (unbacked)
    recompute(xyz)
    y = cache.match_prefix(sg.key(xy)).last_device_node
    cache.inc_lock_ref(y)
    cache.evict(2)  # only Z is free to go: written back and evicted
    recompute(xyz)  # Z takes new slots (backed)
    cache.dec_lock_ref(y)
    recompute(xyzw)  # W is new (unbacked)
    chain, node = [], cache.root_node
    while node.children:
        (node,) = node.children.values()
        chain.append(node)
    assert [n.backuped for n in chain] == [True, False, True, False]
    # W's write-back lets Z wait, Y's write-back lets X wait, and after the loop Y waits
    # for Z: freed in the order the loop put them on hold, X would come before Y
    cache.evict(len(xyzw))
    assert [(n.evicted, n.backuped) for n in chain] == [(True, True)] * 4
    assert (allocator.available_size(), cache.ongoing_write_through) == (64, {})
    for node in chain:
        assert residency(node, mode) in (None, ("backed", "absent", 0, 0))


def test_a_write_back_without_host_memory_keeps_the_waiting_parent_on_the_device(
    sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deliberate difference: SGLang's own assertion fails in both modes, the parent differs.

    B's write-back finds the host full; SGLang's loop goes on and frees A,
    the parent B hangs under, then fails ``assert node.backuped`` for B. Stock,
    A is off the device under a child still on it; patched, A's eviction was
    waiting for B's and never happens.
    """
    cache = build_hiradix(sg, allocator, monkeypatch, "write_back")
    sg.insert(cache, A, allocator.take(len(A)))
    cache.evict(len(A))  # A written back and evicted
    assert sg.insert(cache, AB, allocator.take(len(AB))) == 0  # A recomputed, B new
    (a,) = cache.root_node.children.values()
    (b,) = a.children.values()
    host = cache.cache_controller.mem_pool_host
    host.take(host.available_size())
    free = allocator.available_size()
    with pytest.raises(AssertionError):
        cache.evict(len(AB))
    assert (b.evicted, b.backuped, a.backuped) == (False, False, True)
    if mode == "stock":
        assert (a.evicted, allocator.available_size()) == (True, free + len(A))
    else:
        assert (a.evicted, allocator.available_size()) == (False, free)
        assert residency(a, mode) == ("backed", "resident", 0, 0)
        assert residency(b, mode) == ("unbacked", "resident", 0, 0)
