"""Faults in SGLang's real caches: refused with a typed error naming both call sites, nothing changed.

Each test plants one residency fault (an unlock with no lock left, a lock
released twice through 0.5.23's ``unlock``, a host copy released twice, an
eviction of a locked node, a host copy evicted while a load back reads it, a
cache built before the patch) and checks three things: the error's class, its
message naming the earlier call and the refused one (trail mode), and the
whole state of the cache, its memory and its copies, compared before and after
the refused call (:func:`conftest.whole_state`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_cache.compat.sglang import BuiltBeforePatch, HostRefCounterZero, patch
from fsm_cache.errors import CopyInFlight, error_class

from .conftest import Api, build_hiradix, whole_state
from .fakes import FakeAllocator


HERE = "test_faults.py"


@pytest.fixture
def patched(sg: Api) -> Iterator[Any]:
    """SGLang's caches, patched in trail mode for the test."""
    del sg
    with patch(trail=True) as applied:
        yield applied


def line() -> int:
    """The caller's current line (the call on the next line is ``line() + 1``)."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def site(at: int, function: str) -> str:
    """A call site of this file, as a refusal names it."""
    return f"{HERE}:{at} in {function}"


def sglang_site(function: Any, text: str) -> str:
    """``file.py:N in name`` of the first line of SGLang's ``function`` containing ``text``."""
    function = inspect.unwrap(function)
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, source in enumerate(lines) if text in source)
    name = function.__code__.co_filename.rsplit("/", 1)[-1]
    return f"{name}:{start + offset} in {function.__name__}"


def two_nodes(sg: Api, allocator: FakeAllocator) -> tuple[Any, Any]:
    """A patched ``RadixCache`` holding ``[1..4]`` and ``[1..6]`` (two nodes); the deeper one."""
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, [1, 2, 3, 4], allocator.take(4))
    value = allocator.take(6)
    allocator.free(value[: sg.insert(cache, [1, 2, 3, 4, 5, 6], value)])
    return cache, sg.match(cache, [1, 2, 3, 4, 5, 6])[1]


def test_a_double_dec_lock_ref_names_both_unlocks_and_changes_nothing(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    del patched
    cache, node = two_nodes(sg, allocator)
    test = "test_a_double_dec_lock_ref_names_both_unlocks_and_changes_nothing"
    locked = line() + 1
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)  # the request's release...
    before = whole_state(cache, allocator)
    refused = line() + 2
    with pytest.raises(error_class("UnlockAtZero")) as caught:
        cache.dec_lock_ref(node)  # ...and a second cleanup path releasing it again
    assert str(caught.value) == (
        f"node {node.id}: unlock refused in resident (locks=0): unlock without a matching "
        f"lock; locked at {site(locked, test)}; unlocked at {site(locked + 1, test)}; "
        f"refused at {site(refused, test)}"
    )
    assert whole_state(cache, allocator) == before


def test_a_lock_released_twice_names_the_schedulers_calls(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    """0.5.23's scheduler locks and unlocks through ``lock``/``unlock``: their callers are named."""
    del patched
    if not sg.new:
        pytest.skip(f"sglang {sg.version} has no lock()/unlock()")
    cache, node = two_nodes(sg, allocator)
    test = "test_a_lock_released_twice_names_the_schedulers_calls"
    locked = line() + 1
    held = cache.lock(node)
    cache.unlock(held)
    before = whole_state(cache, allocator)
    refused = line() + 2
    with pytest.raises(error_class("UnlockAtZero")) as caught:
        cache.unlock(held)  # the same TreeLock released a second time
    assert str(caught.value) == (
        f"node {node.id}: unlock refused in resident (locks=0): unlock without a matching "
        f"lock; locked at {site(locked, test)}; unlocked at {site(locked + 1, test)}; "
        f"refused at {site(refused, test)}"
    )
    assert whole_state(cache, allocator) == before


def test_an_unlock_with_no_lock_changes_nothing(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    del patched
    cache, node = two_nodes(sg, allocator)
    before = whole_state(cache, allocator)
    refused = line() + 2
    with pytest.raises(error_class("UnlockAtZero")) as caught:
        cache.dec_lock_ref(node)
    assert str(caught.value) == (
        f"node {node.id}: unlock refused in resident (locks=0): unlock without a matching "
        f"lock; refused at {site(refused, 'test_an_unlock_with_no_lock_changes_nothing')}"
    )
    assert whole_state(cache, allocator) == before


def test_evicting_a_locked_backed_node_names_the_lock_and_changes_nothing(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    del patched
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through")
    sg.insert(cache, [1, 2, 3, 4, 5, 6], allocator.take(6))
    cache.cache_controller.finish_writes()
    cache.writing_check()
    (node,) = cache.root_node.children.values()
    test = "test_evicting_a_locked_backed_node_names_the_lock_and_changes_nothing"
    locked = line() + 1
    cache.inc_lock_ref(node)  # a running request holds it
    before = whole_state(cache, allocator)
    refused = line() + 3
    with pytest.raises(error_class("DeviceLocked")) as caught:
        # SGLang's eviction step, called as a fork's loop that lost the lock check calls it
        cache._evict_backuped(node)  # noqa: SLF001
    hi = type(cache)
    assert str(caught.value) == (
        f"node {node.id}: evict_device refused in resident (locks=1): a running request "
        f"holds the device copy; written at {sglang_site(hi._inc_hit_count, 'self.write_backup(node)')}; "  # noqa: SLF001
        f"locked at {sglang_site(hi.write_backup, 'self.inc_lock_ref(node)')}; "
        f"acknowledged at {sglang_site(hi.writing_check, 'self.ongoing_write_through.pop')}; "
        f"unlocked at {sglang_site(hi.writing_check, 'self.dec_lock_ref(backuped_node)')}; "
        f"locked at {site(locked, test)}; "
        f"refused at {site(refused, test)}"
    )
    assert whole_state(cache, allocator) == before


def test_a_double_release_host_names_both_releases_and_changes_nothing(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    del patched
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through")
    sg.insert(cache, [1, 2, 3, 4, 5, 6], allocator.take(6))
    cache.cache_controller.finish_writes()
    cache.writing_check()
    (node,) = cache.root_node.children.values()
    test = "test_a_double_release_host_names_both_releases_and_changes_nothing"
    pinned = line() + 1
    node.protect_host()  # a backup to storage holds the host copy...
    node.release_host()  # ...its acknowledgement releases it...
    before = whole_state(cache, allocator)
    refused = line() + 2
    with pytest.raises(HostRefCounterZero) as caught:
        node.release_host()  # ...and a revoke releases it again
    assert str(caught.value).endswith(
        f"pinned at {site(pinned, test)}; released at {site(pinned + 1, test)}; "
        f"refused at {site(refused, test)}"
    )
    assert str(caught.value).startswith(
        f"Host reference counter is already zero. node {node.id}: release refused in "
        "backed (pins=0): release without a matching pin; "
    )
    assert whole_state(cache, allocator) == before


def test_a_host_copy_evicted_while_its_load_back_waits_for_memory_is_refused(
    sg: Api, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    """``load_back`` evicts to make room; a write-back there evicts host copies, the loading one too.

    Stock SGLang frees the host slots the load is about to read, drops the
    node from the tree, writes another node's KV into those slots, loads
    them as the request's prefix and locks the detached node. The patch
    refuses the host eviction, naming the load that reads the copy (not
    "a holder": SGLang's ``host_ref_counter`` is 0), and leaves the cache
    as it was before ``init_load_back``, the lock ``load_back`` took on the
    chain's resident ancestor included.
    """
    del patched
    allocator = FakeAllocator(24)
    cache = build_hiradix(sg, allocator, monkeypatch, "write_back")
    cache.load_back_threshold = 1
    prefix, chain, other = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22, 23]
    sg.insert(cache, prefix, allocator.take(4))
    value = allocator.take(len(chain))
    allocator.free(value[: sg.insert(cache, chain, value)])
    cache.evict(6)  # the chain's tail is written back and evicted; its prefix stays
    host = cache.cache_controller.mem_pool_host
    host.take(host.available_size())  # host memory full
    sg.insert(cache, other, allocator.take(4))  # an unbacked leaf, the next victim
    allocator.take(allocator.available_size() - 5)  # too little device memory for the load
    found = cache.match_prefix(sg.key(chain))
    tail, resident = found.last_host_node, found.last_device_node
    assert (found.host_hit_length, tail.parent is resident, len(resident.key)) == (6, True, 4)
    before = whole_state(cache, allocator)
    with pytest.raises(CopyInFlight) as caught:
        cache.init_load_back(tail, found.host_hit_length)
    hi = type(cache)
    assert str(caught.value) == (
        f"node {tail.id}: evict_host refused in pinned (pins=1, device loading): a host-to-device "
        f"copy still reads the host slots; written at {sglang_site(hi.evict, 'self.write_backup(x, write_back=True)')}; "
        f"acknowledged at {sglang_site(hi.writing_check, 'del self.ongoing_write_through')}; "
        f"evicted from device at {sglang_site(hi.evict, 'self._evict_backuped(node)')}; "
        f"loaded at {sglang_site(hi.init_load_back, 'self.load_back(last_node, mem_quota)')}; "
        f"refused at {sglang_site(hi.evict_host, 'self.cache_controller.evict_host')}"
    )
    assert whole_state(cache, allocator) == before


def test_a_cache_built_before_the_patch_is_refused_at_its_first_checked_call(
    sg: Api, allocator: FakeAllocator
) -> None:
    """SGLang's own nodes have nothing to check: the walk and the eviction say so, and change nothing."""
    cache = sg.rc.RadixCache(sg.cache_params(allocator))  # built stock
    sg.insert(cache, [1, 2, 3, 4], allocator.take(4))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    with patch(trail=True):
        before = whole_state(cache, allocator)
        with pytest.raises(BuiltBeforePatch) as caught:
            cache.inc_lock_ref(node)
        assert str(caught.value) == (
            f"node {node.id}: inc_lock_ref of a node built before patch() (SGLang's own "
            "TreeNode, unchecked); build the cache after patching; nothing changed"
        )
        with pytest.raises(BuiltBeforePatch, match=f"^node {node.id}: evict of a node built "):
            sg.evict(cache, 4)
        assert whole_state(cache, allocator) == before


def test_deleting_a_device_leaf_above_a_host_copy_is_refused_before_its_slots_are_freed(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    """0.5.6's ``_evict_regular`` deletes an unbacked device leaf that has a backed child.

    Write-through with 8 host slots: a later request's suffix B is backed up
    under its prefix A, whose own backup did not fit. Once B leaves the
    device, A is a device leaf without a host copy: stock SGLang frees A's
    device slots and deletes A with B under it, and B's host slots are never
    freed again. The patch refuses the deletion (the spec's ``NotAHostLeaf``)
    before A's slots are freed; evicting B's host copy first lets it through,
    every slot coming back.
    """
    del patched
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through")
    controller, host = cache.cache_controller, cache.cache_controller.mem_pool_host
    host.take(host.available_size() - 8)  # 8 host slots left
    a, ab = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    sg.insert(cache, [9, 9, 9, 9], allocator.take(4))  # backed up: 4 host slots left
    controller.finish_writes()
    cache.writing_check()
    sg.insert(cache, a, allocator.take(len(a)))  # its backup needs 8: A stays unbacked
    value = allocator.take(len(ab))
    allocator.free(value[: sg.insert(cache, ab, value)])  # A's backup fails again, B's fits
    controller.finish_writes()
    cache.writing_check()
    cache.evict(6)  # [9, 9, 9, 9] and then B leave the device (both backed)
    node_a = cache.root_node.children[1]
    (node_b,) = node_a.children.values()
    assert (node_a.host, node_a.device, node_b.host, node_b.device) == (
        "unbacked",
        "resident",
        "backed",
        "absent",
    )
    before = whole_state(cache, allocator)
    with pytest.raises(error_class("NotAHostLeaf")) as caught:
        cache.evict(len(a))  # A is the next victim
    hi = type(cache)
    write = sglang_site(hi._inc_hit_count, "self.write_backup(node)")  # noqa: SLF001
    assert str(caught.value) == (
        f"node {node_a.id}: delete refused in unbacked (pins=0, device resident): a child "
        f"still holds a host copy: node {node_b.id} (backed/absent) would leave the tree "
        "with it, its slots never freed; free the copies below it first; nothing changed; "
        f"written at {write}; failed at {write}; written at {write}; failed at {write}; "
        f"locked at {sglang_site(hi.write_backup, 'self.inc_lock_ref(node)')}; "
        f"unlocked at {sglang_site(hi.writing_check, 'self.dec_lock_ref(backuped_node)')}; "
        f"refused at {sglang_site(hi.evict, 'self._evict_regular(x)')}"
    )
    assert whole_state(cache, allocator) == before
    cache.evict_host(4 + len(node_b.key))  # the host copies go first ([9, 9, 9, 9], B)...
    cache.evict(len(a))  # ...then A may
    assert (host.available_size(), allocator.available_size(), cache.root_node.children) == (
        8,
        64,
        {},
    )


def test_deleting_a_device_leaf_above_a_prefetched_copy_is_refused(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    """The same through 0.5.6's storage prefetch: a host-only node lands under an unbacked one.

    A prefetch anchored at the root lands after another request computed
    part of its tokens itself (an unbacked device node): ``_insert_helper_host``
    hangs the rest, host only, under that node. Stock SGLang's ``evict`` then
    deletes the unbacked node with the prefetched one under it, whose host
    slots are never freed again; the patch refuses before anything is freed.
    """
    del patched
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through_selective", storage=True)
    controller = cache.cache_controller
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    found = cache.match_prefix(sg.key(tokens))
    cache.prefetch_from_storage("r1", found.last_host_node, tokens)  # 8 host slots
    sg.insert(cache, tokens[:6], allocator.take(6))  # another request computed [1..6]
    (prefetch,) = controller.prefetches
    prefetch.land(len(tokens))
    cache.check_prefetch_progress("r1")  # [7, 8], host only, under the unbacked [1..6]
    computed = cache.root_node.children[1]
    (fetched,) = computed.children.values()
    assert (computed.host, computed.device, fetched.host, fetched.device) == (
        "unbacked",
        "resident",
        "backed",
        "absent",
    )
    before = whole_state(cache, allocator)
    with pytest.raises(error_class("NotAHostLeaf")) as caught:
        cache.evict(len(tokens))
    hi = type(cache)
    assert str(caught.value) == (
        f"node {computed.id}: delete refused in unbacked (pins=0, device resident): a child "
        f"still holds a host copy: node {fetched.id} (backed/absent) would leave the tree "
        "with it, its slots never freed; free the copies below it first; nothing changed; "
        f"refused at {sglang_site(hi.evict, 'self._evict_regular(x)')}"
    )
    assert whole_state(cache, allocator) == before
