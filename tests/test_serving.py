"""Serving a trace: the request loop gives back every slot the cache did not adopt."""

from __future__ import annotations

from fsm_cache.bench.serving import serve
from fsm_cache.bench.workload import Request
from fsm_cache.cache.hicache import HiCache
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.pages import REQUEST
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.testing.faults import FaultyCopyEngine


def slow_acks(device: KVPool, host: KVPool) -> FaultyCopyEngine:
    return FaultyCopyEngine(CopyEngine(device, host), delay=3)


def request_pages(cache: HiCache) -> list[int]:
    alloc = cache.tiers.device.allocator
    return [p for p in range(alloc.num_pages) if alloc.owner_of(p) == REQUEST]


def test_a_prefix_still_loading_does_not_keep_the_requests_slots() -> None:
    cache = HiCache(
        CacheConfig(
            device_pages=8,
            host_pages=32,
            page_size=4,
            layers=1,
            heads=1,
            head_dim=4,
            device="cpu",
            load_back_threshold=4,
            copier=slow_acks,
            debug=True,
        )
    )
    prefix = tuple(range(8))
    cache.insert(prefix)
    while cache.issued():
        cache.poll()
    cache.evict(32)
    (node,) = list(cache.tree)
    assert (node.host, node.device) == ("backed", "absent")
    report = serve(cache, [Request(0, 0, (*prefix, *range(100, 108)))])
    assert report.load_backs == 1
    assert node.device == "loading"  # its acknowledgement is three polls away
    assert request_pages(cache) == []  # the slots computed for the loading part went back
    while cache.issued():
        cache.poll()
    cache.check_invariants()
    assert node.residency() == "backed/resident (pins=0, locks=0)"
