"""SGLang 0.5.6's real ``HiRadixCache`` on the CPU, with a stand-in cache controller.

Write-through policy: a node is backed up to the host the first time it is
inserted (``write_through_threshold`` 1), locked until the copy's ack. The
controller stand-in (``fakes.CpuController``) finishes copies only when the
test says so. Skipped on versions without ``hiradix_cache.py`` (0.5.23).
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, build_hiradix
from .fakes import FakeAllocator


TOKENS = list(range(1, 13))


@pytest.fixture
def hiradix(sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A write-through ``HiRadixCache`` over 64 device and 64 host slots."""
    del mode  # the node class is rebound first
    return build_hiradix(sg, allocator, monkeypatch, "write_through")


def test_write_evict_match_load(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = request.getfixturevalue("hiradix")
    ctl = cache.cache_controller
    device = allocator.take(len(TOKENS))
    # insert: the new node's first hit starts its write-through and locks it
    assert sg.insert(cache, TOKENS, device) == 0
    (node,) = cache.root_node.children.values()
    assert (node.backuped, node.lock_ref, list(cache.ongoing_write_through)) == (
        True,
        1,
        [node.id],
    )
    assert ctl.writes[0].device == device.tolist()
    host = node.host_value.tolist()
    # evict while the write is in flight: the lock protects the node
    cache.evict(len(TOKENS))
    assert (node.evicted, allocator.freed) == (False, [])
    # the write's ack unlocks it
    ctl.finish_writes()
    cache.writing_check()
    assert (node.lock_ref, cache.ongoing_write_through, cache.evictable_size()) == (0, {}, 12)
    # evict: device slots freed, the host copy stays
    cache.evict(len(TOKENS))
    assert (node.evicted, node.backuped, allocator.freed) == (True, True, [device.tolist()])
    # match: nothing on the device, all of it on the host
    found = cache.match_prefix(sg.key(TOKENS))
    assert (len(found.device_indices), found.host_hit_length) == (0, 12)
    assert (found.last_device_node is cache.root_node, found.last_host_node is node) == (
        True,
        True,
    )
    # load back: device slots for the whole chain, locked until the load's ack
    loaded, last = cache.init_load_back(found.last_host_node, found.host_hit_length)
    assert (len(loaded), last is node, node.evicted, node.lock_ref) == (12, True, False, 1)
    assert cache.ready_to_load_host_cache() >= 0
    assert ctl.loads[0].host == host
    ctl.finish_loads()
    cache.loading_check()
    assert (node.lock_ref, cache.ongoing_load_back) == (0, {})
    assert len(cache.match_prefix(sg.key(TOKENS)).device_indices) == 12
    # evict from both tiers: device, then host; the node leaves the tree
    cache.evict(len(TOKENS))
    cache.evict_host(len(TOKENS))
    assert (cache.root_node.children, ctl.mem_pool_host.freed) == ({}, [host])


def test_split_while_writing(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = request.getfixturevalue("hiradix")
    device = allocator.take(len(TOKENS))
    sg.insert(cache, TOKENS, device)
    (leaf,) = cache.root_node.children.values()
    host = leaf.host_value.tolist()
    # a match ending inside the node splits it while its write is in flight
    found = cache.match_prefix(sg.key(TOKENS[:6]))
    prefix = found.last_device_node
    assert (len(found.device_indices), leaf.parent is prefix) == (6, True)
    assert (prefix.host_value.tolist(), leaf.host_value.tolist()) == (host[:6], host[6:])
    assert (prefix.lock_ref, leaf.lock_ref) == (1, 1)
    # the one ack (for the leaf's id) unlocks both through dec_lock_ref
    cache.cache_controller.finish_writes()
    cache.writing_check()
    assert (prefix.lock_ref, leaf.lock_ref, cache.evictable_size()) == (0, 0, 12)


def test_recompute_of_an_evicted_node(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = request.getfixturevalue("hiradix")
    sg.insert(cache, TOKENS, allocator.take(len(TOKENS)))
    (node,) = cache.root_node.children.values()
    cache.cache_controller.finish_writes()
    cache.writing_check()
    cache.evict(len(TOKENS))
    assert node.evicted
    # the request recomputed the KV: insert takes its new slots, nothing was matched
    again = allocator.take(len(TOKENS))
    assert sg.insert(cache, TOKENS, again) == 0
    assert (node.evicted, node.value.tolist(), cache.evictable_size()) == (
        False,
        again.tolist(),
        12,
    )
