"""Serving a trace: the request loop gives back every slot the cache did not adopt."""

from __future__ import annotations

import pytest

from fsm_cache.bench.serving import serve
from fsm_cache.bench.workload import Request
from fsm_cache.cache.hicache import HiCache
from fsm_cache.memory import staging
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.pages import REQUEST
from fsm_cache.memory.tiers import CacheConfig, CopierFactory
from fsm_cache.testing.faults import FaultyCopyEngine


SLOW_ACKS = FaultyCopyEngine.copier(delay=3)


def request_pages(cache: HiCache) -> list[int]:
    alloc = cache.tiers.device.allocator
    return [p for p in range(alloc.num_pages) if alloc.owner_of(p) == REQUEST]


def loading_cache(
    copier: CopierFactory = SLOW_ACKS,
) -> tuple[HiCache, tuple[int, ...]]:
    """A cache (copies acknowledged three polls late) holding 8 tokens on the host only."""
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
            copier=copier,
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
    return cache, prefix


def test_a_loaded_prefix_is_used_while_its_copy_is_in_flight() -> None:
    """The request computes only past the loaded prefix; no slot stays the request's."""
    cache, prefix = loading_cache()
    (node,) = list(cache.tree)
    report = serve(cache, [Request(0, 0, (*prefix, *range(100, 108)))])
    assert report.load_backs == 1
    assert node.residency() == "backed/resident (pins=0, locks=0)"  # the insert applied it
    assert request_pages(cache) == []
    assert cache.stats().transitions["write"] == 2  # the prefix once, the new tail once
    while cache.issued():
        cache.poll()
    cache.check_invariants()
    match = cache.match_prefix((*prefix, *range(100, 108)))
    assert match.device_len == 16


def test_wait_loaded_refuses_a_load_that_must_run_again() -> None:
    """A locked load that failed, and whose new copy was refused, has nothing to wait on."""

    cache, prefix = loading_cache(FaultyCopyEngine.copier(fail={2}, refuse={3}))
    chain = cache.load_back(cache.match_prefix(prefix).last_host_node)
    assert chain
    assert cache.wait_loaded(chain)  # copy 2 is in flight
    lock = cache.lock(chain[-1])
    cache.poll()  # copy 2 failed; the node is locked, so copy 3 starts, and is refused
    assert chain[-1].device == "loading"
    assert not cache.wait_loaded(chain)
    cache.poll()  # copy 4 runs
    assert cache.wait_loaded(chain)
    assert cache.wait_loaded([])  # nothing loading: nothing to wait for
    cache.unlock(lock)
    cache.poll()
    assert chain[-1].residency() == "backed/resident (pins=0, locks=0)"


def test_wait_loaded_says_a_load_that_failed_and_was_applied_holds_nothing() -> None:
    """A chain whose failed load a poll applied is off the device: its pages are gone.

    ``wait_loaded`` counted a node off the device as one that needs nothing, and
    said True: a forward pass queued after it would read pages given back.
    """
    cache, prefix = loading_cache(FaultyCopyEngine.copier(fail={2}))
    chain = cache.load_back(cache.match_prefix(prefix).last_host_node)
    assert chain
    cache.poll()  # copy 2 failed; unlocked, the node goes back to the host only
    assert chain[-1].residency() == "backed/absent (pins=0, locks=0)"
    assert not cache.wait_loaded(chain)


def test_evicted_tokens_count_evictions_inside_allocations() -> None:
    """Evictions an allocation makes (no explicit evict) are counted, per tier, where they happen."""
    cache = HiCache(
        CacheConfig(
            device_pages=4, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
        )
    )
    cache.insert(list(range(8)))
    cache.insert(list(range(100, 108)))
    cache.poll()
    cache.insert(list(range(200, 208)))  # no room: the insert's allocation evicts 8 tokens
    assert cache.counters.evicted_tokens["device"] == 8
    assert cache.counters.transitions["evict_device"] == 1
    cache.evict_host(100)
    assert cache.counters.evicted_tokens["host"] == 8


def test_the_report_counts_every_device_eviction_of_the_run() -> None:
    """``ServeReport.evicted_tokens`` is the cache's count over the run, whatever evicted."""
    cache = HiCache(
        CacheConfig(
            device_pages=8, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
        )
    )
    trace = [
        Request(conversation=i, turn=0, tokens=tuple(range(100 * i, 100 * i + 12)))
        for i in range(6)
    ]
    report = serve(cache, trace)
    assert report.evicted_tokens == cache.counters.evicted_tokens["device"] > 0


def test_write_through_deletions_count_as_device_evictions() -> None:
    """An unbacked leaf write-through drops from the device is evicted tokens too."""
    cache = HiCache(
        CacheConfig(
            device_pages=4, host_pages=0, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
        )
    )
    cache.insert(list(range(8)))
    assert cache.evict(8) == 8
    assert cache.counters.evicted_tokens["device"] == 8
    assert cache.counters.deleted_nodes == 1


def test_wait_loaded_says_a_load_whose_launch_failed_holds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine knows at once that the load's launch failed: compute must not read the pages.

    ``wait_loaded`` said True, so a forward pass queued after it read pages the
    copy never wrote, until a later poll applied the failure.
    """
    cache, prefix = loading_cache(CopyEngine)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: launch failure")

    monkeypatch.setattr(staging, "_copy", broken)
    monkeypatch.setattr(staging, "_scatter", broken)
    monkeypatch.setattr(staging, "_gather", broken)
    chain = cache.load_back(cache.match_prefix(prefix).last_host_node)
    assert chain is not None
    assert [node.device for node in chain] == ["loading"]
    assert not cache.wait_loaded(chain)
    monkeypatch.undo()
    cache.poll()  # the failure applied: unlocked, the node is absent again
    assert chain[-1].residency() == "backed/absent (pins=0, locks=0)"
    again = cache.load_back(cache.match_prefix(prefix).last_host_node)
    assert again is not None
    assert cache.wait_loaded(again)
