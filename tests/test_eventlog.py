"""The event log replays what happened, acknowledgements included, into a fresh cache."""

from __future__ import annotations

import copy
import itertools
import pickle
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
import torch

from fsm_cache.cache.eventlog import DEFAULT_LIMIT, EventLog
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.errors import BadArgument, PoolExhausted, ReplayMismatch
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.testing.faults import Faults, FaultyCopyEngine


if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from 3.11; mypy's own stubs, never imported


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


def faulty(**faults: Unpack[Faults]) -> CacheConfig:
    """BASE with a copy engine that delays, reorders or fails acknowledgements."""
    return replace(BASE, copier=FaultyCopyEngine.copier(**faults))


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
    # Eviction first applies what is ready (nothing: copies are 3 polls late), then waits.
    assert cache.log.acknowledgements() == [("evict", ()), ("wait", ((1, True),))]
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
    cache.insert(list(range(16)))  # every device slot is taken
    cache.log.op("alloc_slots", 24)  # as if there had been room
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, config)
    assert str(caught.value) == (
        "alloc_slots raised on replay, not in the recording: "
        "PoolExhausted: device pool exhausted: requested 24 slots, 0 free"
    )


def test_replay_names_a_refusal_it_does_not_reproduce() -> None:
    """An operation refused in the recording but not on replay is a mismatch naming it."""
    config = replace(BASE, device_pages=4)
    cache = HiCache(config)
    with pytest.raises(PoolExhausted):
        cache.alloc_slots(24)  # 16 slots in 4 pages
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, replace(config, device_pages=8))
    assert str(caught.value) == (
        "alloc_slots was refused in the recording, not on replay: "
        "PoolExhausted: device pool exhausted: requested 24 slots, 16 free"
    )


# -- a bounded log ---------------------------------------------------------------


def test_a_log_keeps_its_newest_entries_and_counts_the_rest() -> None:
    """Defect 10: past its limit a log drops its oldest entries, so its size is bounded."""
    log = EventLog(limit=1000)
    for i in range(2500):
        log.op("match_prefix", (i,), None)
    assert (len(log.entries), log.dropped, log.recorded, log.complete) == (1000, 1500, 2500, False)
    assert (log.entries[0], log.entries[-1]) == (
        ("op", "match_prefix", ((1500,), None)),
        ("op", "match_prefix", ((2499,), None)),
    )
    assert log.operations()[0] == ("match_prefix", ((1500,), None))
    whole = EventLog(limit=None)
    for i in range(2500):
        whole.transition(i, "write")
    assert (len(whole.entries), whole.dropped, whole.complete, whole.limit) == (2500, 0, True, None)
    assert EventLog().limit == DEFAULT_LIMIT == 100_000
    assert EventLog(limit=10**30).limit == sys.maxsize  # as good as None


def test_a_full_log_holds_no_more_memory() -> None:
    """What a log holds alive stops growing at its limit: lookups' token tuples are freed."""
    log = EventLog(limit=200)

    def lookups(count: int) -> int:
        tracemalloc.start()
        try:
            for _ in range(count):
                log.op("match_prefix", tuple(range(1000, 1512)), None)
            return tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    full = lookups(200)
    assert full > 200 * 512 * 8  # the token tuples are really held
    assert lookups(2000) < 1.1 * full
    assert (len(log.entries), log.dropped) == (200, 2000)


@pytest.mark.parametrize(
    "limit", [0, -1, True, 2.5, "10", torch.tensor(True), torch.tensor([3, 4])]
)
def test_a_limit_is_none_or_a_positive_int(limit: object) -> None:
    with pytest.raises(BadArgument) as caught:
        EventLog(limit=limit)  # type: ignore[arg-type]
    assert str(caught.value) == f"EventLog: limit must be None or an int >= 1, got {limit!r}"


def test_entries_read_like_the_list_they_were() -> None:
    log = EventLog(limit=10)
    for i in range(25):
        log.transition(i, "write")
    entries, kept = log.entries, [("transition", i, "write") for i in range(15, 25)]
    assert entries == kept
    assert entries != kept[1:]
    assert entries != tuple(kept)
    assert list(reversed(entries)) == kept[::-1]
    for start, stop, step in itertools.product([None, 0, 3, -4, -20, 12], repeat=2 + 1):
        if step != 0:
            window = slice(start, stop, step)
            assert entries[window] == kept[window], window
    assert (entries.index(kept[3]), entries.count(kept[3])) == (3, 1)
    assert kept[0] in entries
    assert ("transition", 14, "write") not in entries
    with pytest.raises(ValueError, match="not in deque"):
        entries.index(("transition", 14, "write"))
    with pytest.raises(IndexError):
        entries[10]
    entries[-1] = ("transition", 99, "write")
    assert log.transitions()[-1] == (99, "write")
    assert repr(EventLog(limit=3)) == "EventLog(limit=3, recorded=0, dropped=0)"
    assert repr(EventLog().entries) == "Entries([])"


def test_since_counts_positions_from_the_first_entry_ever_recorded() -> None:
    log = EventLog(limit=4)
    for i in range(6):
        log.transition(i, "write")
    assert [e[1] for e in log.since(0)] == [2, 3, 4, 5]  # 0 and 1 were dropped
    assert [e[1] for e in log.since(3)] == [3, 4, 5]
    assert [e[1] for e in log.since(3, 5)] == [3, 4]
    assert [e[1] for e in log.since(0, 2)] == []
    assert log.since(6) == log.since(9) == []
    log.transition(6, "write")
    assert [e[1] for e in log.since(6)] == [6]


def _recorded() -> HiCache:
    """A cache that inserted, looked up, polled, evicted and was refused something."""
    cache = HiCache(replace(BASE, device_pages=4))
    cache.insert(list(range(8)))
    cache.match_prefix(list(range(8)))
    cache.poll()
    cache.evict(8)
    cache.insert(list(range(100, 116)))
    with pytest.raises(PoolExhausted):
        cache.alloc_slots(64)
    return cache


def test_a_complete_bounded_log_replays_as_before() -> None:
    cache = _recorded()
    log = EventLog(limit=len(cache.log.entries))
    for entry in cache.log.entries:
        log.append(entry)
    assert log.complete
    # The replaying cache keeps its own log whole, whatever log_limit it is given.
    same(cache, replay(log, replace(BASE, device_pages=4, log_limit=1)))


def test_a_log_that_dropped_entries_does_not_replay() -> None:
    cache = _recorded()
    log = EventLog(limit=5)
    for entry in cache.log.entries:
        log.append(entry)
    before = list(log.entries)
    with pytest.raises(ReplayMismatch) as caught:
        replay(log, replace(BASE, device_pages=4))
    dropped = len(cache.log.entries) - 5
    assert str(caught.value) == (
        f"replay: the log dropped its first {dropped} entries (limit 5);"
        " record with log_limit=None to replay from the start"
    )
    assert (list(log.entries), log.dropped) == (before, dropped)


@pytest.mark.parametrize(
    "how",
    [copy.copy, copy.deepcopy, lambda log: pickle.loads(pickle.dumps(log))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_a_log_copies_and_pickles_with_its_positions(how: Callable[[EventLog], EventLog]) -> None:
    """Compiled or not: a saved log replays and reads from the same positions."""
    log = EventLog(limit=3)
    for i in range(5):
        log.op("evict", i)
    again = how(log)
    assert again is not log
    assert (again.limit, again.recorded, again.dropped) == (3, 5, 2)
    assert again.since(3) == log.since(3) == [("op", "evict", (3,)), ("op", "evict", (4,))]
    assert again.entries == log.entries
    again.op("evict", 5)  # the copy has its own entries
    assert (len(log.entries), log.recorded, again.recorded) == (3, 5, 6)
    view: Any = how(log.entries)  # type: ignore[arg-type]
    assert list(view) == list(log.entries)


def test_retract_takes_back_the_last_entry_only_if_it_is_the_one_named() -> None:
    log = EventLog(2)
    log.op("insert", (1, 2))
    log.transition(1, "add")
    log.transition(2, "split:1")  # drops the op: the limit is 2
    assert not log.retract(("transition", 1, "add"))  # not the last
    assert log.retract(("transition", 2, "split:1"))
    assert list(log.entries) == [("transition", 1, "add")]
    assert (log.recorded, log.dropped) == (2, 1)  # the op dropped for it stays dropped
    assert log.retract(("transition", 1, "add"))
    assert not log.retract(("transition", 1, "add"))  # empty
    assert (log.recorded, log.dropped) == (1, 1)


def test_cut_acks_lists_only_the_copies_taken_where_the_entry_is_kept() -> None:
    log = EventLog(3)
    log.op("poll")
    at = log.recorded
    log.acks("poll", [(1, False), (2, True)])
    log.transition(1, "write_failed")
    log.cut_acks(at, [(1, False)])  # the apply stopped after copy 1: copy 2 comes later
    assert log.acknowledgements() == [("poll", ((1, False),))]
    assert list(log.entries)[-1] == ("transition", 1, "write_failed")  # nothing else moved
    log.transition(2, "write")
    log.transition(3, "write")  # drops the acks entry: the limit is 3
    log.cut_acks(at, [])  # a position the limit dropped: nothing is done
    assert log.acknowledgements() == []
    assert log.recorded == 5
