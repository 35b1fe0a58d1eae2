"""The event log replays what happened, acknowledgements included, into a fresh cache."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.errors import PoolExhausted, ReplayMismatch
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.testing.faults import FaultyCopyEngine


BASE = CacheConfig(
    device_pages=16,
    host_pages=32,
    page_size=4,
    layers=1,
    heads=1,
    head_dim=4,
    load_back_threshold=4,
    debug=True,
)


def faulty(**faults: object) -> CacheConfig:
    """BASE with a copy engine that delays, reorders or fails acknowledgements."""

    def build(device: KVPool, host: KVPool) -> FaultyCopyEngine:
        return FaultyCopyEngine(CopyEngine(device, host), **faults)  # type: ignore[arg-type]

    return replace(BASE, copier=build)


def states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


def same(recorded: HiCache, rebuilt: HiCache) -> None:
    assert states(rebuilt) == states(recorded)
    assert rebuilt.log.transitions() == recorded.log.transitions()
    assert rebuilt.log.acknowledgements() == recorded.log.acknowledgements()


def test_each_poll_logs_the_copies_it_applied() -> None:
    """A poll's entry names the copies it applied, in order, with their outcome."""
    cache = HiCache(faulty(fail=(2,)))
    cache.insert(list(range(8)))
    cache.insert(list(range(100, 108)))
    cache.poll()
    assert cache.log.entries[-4:] == [
        ("op", "poll", ()),
        ("acks", "poll", ((1, True), (2, False))),
        ("transition", 1, "write_done"),
        ("transition", 2, "write_failed"),
    ]
    assert cache.log.acknowledgements() == [("poll", ((1, True), (2, False)))]


def test_late_acknowledgements_replay_as_they_happened() -> None:
    """Copies acknowledged one poll late, recorded, replay on synchronous copies."""
    cache = HiCache(faulty(delay=1))
    cache.insert(list(range(8)))
    cache.poll()
    cache.insert(list(range(8, 16)))
    cache.poll()
    cache.poll()
    assert cache.log.acknowledgements() == [
        ("poll", ()),
        ("poll", ((1, True),)),
        ("poll", ((2, True),)),
    ]
    same(cache, replay(cache.log, BASE))


def test_delayed_shuffled_and_failed_copies_replay() -> None:
    """A busy run with reordered, late and failing copies rebuilds the same tree."""
    cache = HiCache(faulty(delay=2, shuffle=True, seed=3, fail=(2, 5)))
    for start in (0, 100, 200, 300, 0):
        cache.insert(list(range(start, start + 12)))
        cache.poll()
    cache.insert(list(range(100, 116)))
    for _ in range(3):
        cache.poll()
    cache.evict(24)
    evicted = [n for n in cache.tree if n.device == "absent"]
    assert evicted
    cache.load_back(evicted[0])
    for _ in range(4):
        cache.poll()
    failed = [a for _, batch in cache.log.acknowledgements() for a in batch if not a[1]]
    assert failed
    same(cache, replay(cache.log, BASE))


def test_an_allocation_that_waited_replays() -> None:
    """The acknowledgements a write-back insert waited for are logged and replayed."""
    config = faulty(delay=3, shuffle=True, seed=1)
    config = replace(config, device_pages=4, write_policy="write_back")
    cache = HiCache(config)
    cache.insert(list(range(8)))
    cache.insert(list(range(100, 108)))
    cache.insert(list(range(200, 216)))
    assert cache.log.acknowledgements() == [("wait", ((1, True),))]
    same(cache, replay(cache.log, replace(BASE, device_pages=4, write_policy="write_back")))


def test_refused_operations_replay_refused() -> None:
    """An insert refused in the recording is refused again on replay, and the rest goes on."""
    config = replace(BASE, device_pages=4)
    cache = HiCache(config)
    cache.insert(list(range(16)))
    lock = cache.lock(cache.tree.nodes[1])
    with pytest.raises(PoolExhausted):
        cache.insert(list(range(100, 108)))
    cache.unlock(lock)
    cache.poll()
    rebuilt = replay(cache.log, config)
    same(cache, rebuilt)
    assert rebuilt.log.refusals() == [
        ("insert", "PoolExhausted: device pool exhausted: requested 8 slots, 0 free")
    ]


def test_request_slots_replay() -> None:
    """Slots a request allocated and handed to insert are allocated again on replay."""
    cache = HiCache(BASE)
    held = cache.alloc_slots(8)
    cache.insert(list(range(8)), held)
    spare = cache.alloc_slots(4)
    cache.free_slots(spare)
    same(cache, replay(cache.log, BASE))


def test_replay_names_an_acknowledgement_it_cannot_apply() -> None:
    """A recorded acknowledgement of a copy the replay never started is a mismatch."""
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    cache.poll()
    at = cache.log.entries.index(("acks", "poll", ((1, True),)))
    cache.log.entries[at] = ("acks", "poll", ((9, True),))
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, BASE)
    assert str(caught.value) == "recorded acknowledgement of copy 9: not in flight on replay"


def test_replay_names_a_refusal_the_recording_lacks() -> None:
    """An operation that raises only on replay is a mismatch naming it."""
    config = replace(BASE, device_pages=4)
    cache = HiCache(config)
    cache.insert(list(range(16)))  # its backup is in flight: it cannot be evicted yet
    cache.log.op("insert", tuple(range(100, 108)), None, None)  # as if there had been room
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, config)
    assert str(caught.value) == (
        "insert raised on replay, not in the recording: "
        "PoolExhausted: device pool exhausted: requested 8 slots, 0 free"
    )


def test_replay_names_a_refusal_it_does_not_reproduce() -> None:
    """An operation refused in the recording but not on replay is a mismatch naming it."""
    config = replace(BASE, device_pages=4)
    cache = HiCache(config)
    cache.insert(list(range(16)))  # its backup is in flight: it cannot be evicted yet
    with pytest.raises(PoolExhausted):
        cache.insert(list(range(100, 108)))
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, replace(config, device_pages=8))
    assert str(caught.value) == (
        "insert was refused in the recording, not on replay: "
        "PoolExhausted: device pool exhausted: requested 8 slots, 0 free"
    )
