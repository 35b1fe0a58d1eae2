"""Replay of logs the first replay could not take: trail refusals, closes, fires, bad entries."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest

from fsm_cache.cache.eventlog import EventLog
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.cache.tree import NamespaceRoot, Pages
from fsm_cache.engine import lease as leases
from fsm_cache.errors import (
    BadArgument,
    CopyFailed,
    DuplicateAck,
    EffectFailed,
    ForeignSlot,
    NoHostCopy,
    ReleaseAtZero,
    ReplayMismatch,
    UnlockAtZero,
)
from fsm_cache.memory.copies import CopyEngine
from fsm_cache.memory.kv import KVPool
from fsm_cache.memory.pages import FREE, REQUEST
from fsm_cache.memory.tickets import Ticket
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.storage import LocalFileStore
from fsm_cache.testing.faults import FaultyCopyEngine


BASE = CacheConfig(
    device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
)


def late(delay: int) -> CacheConfig:
    """BASE with a copy engine whose acknowledgements come ``delay`` polls late."""
    return replace(BASE, copier=FaultyCopyEngine.copier(delay=delay))


def states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


def rebuilt(log: EventLog, entries: list[tuple[str, object, object]]) -> EventLog:
    """A complete copy of ``log`` with ``entries`` appended, as an edited log unpickles.

    Through the log's own pickling (``__reduce__``): the compiled ``append``
    checks an entry's type, and a log read back from disk is not checked so.
    """
    restore, (limit, kept, recorded) = log.__reduce__()
    return restore(limit, (*kept, *entries), recorded + len(entries))  # type: ignore[no-any-return]


def test_a_trail_mode_refusal_replays() -> None:
    """The log keeps a refusal without its call sites, so a replay from elsewhere matches it."""
    config = replace(BASE, write_policy="write_back", trail=True)
    cache = HiCache(config)
    cache.insert(list(range(8)))
    with pytest.raises(NoHostCopy) as caught:
        cache.pin(cache.tree.nodes[1])
    assert "; refused at test_replay_log.py:" in str(caught.value)
    text = "NoHostCopy: node 1: pin refused in unbacked (pins=0): no valid host copy to pin"
    assert cache.log.refusals() == [("pin", text)]
    assert replay(cache.log, config).log.refusals() == [("pin", text)]


class _Broken(CopyEngine):
    """A copy engine whose first write start raises something else than CopyFailed."""

    def __init__(self, device: KVPool, host: KVPool) -> None:
        super().__init__(device, host)
        self.starts = 0

    def start_write(
        self, device_pages: Sequence[int], host_pages: Sequence[int], *, stream: object = None
    ) -> Ticket:
        self.starts += 1
        if self.starts == 1:
            raise RuntimeError("driver hiccup")
        return super().start_write(device_pages, host_pages, stream=stream)


def test_a_copy_engine_failing_at_flush_logs_the_refusal() -> None:
    """The CopyFailed a broken engine causes at the end of an operation is logged and replays."""
    config = replace(BASE, copier=_Broken)
    cache = HiCache(config)
    with pytest.raises(CopyFailed):
        cache.insert(list(range(8)))
    cache.insert(list(range(100, 108)))
    cache.poll()
    text = "CopyFailed: d2h copy could not start: RuntimeError: driver hiccup"
    assert cache.log.refusals() == [("insert", text)]
    assert cache.log.refused_starts() == [(1, "d2h", (1,), "RuntimeError: driver hiccup")]
    again = replay(cache.log, BASE)  # an engine that never breaks: the start is refused as logged
    assert states(again) == states(cache)
    assert again.log.refusals() == [("insert", text)]


def owners(cache: HiCache) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Who holds each device and each host page."""
    return cache.tiers.device.allocator.owners, cache.tiers.host.allocator.owners


class _Breaking:
    """Stands in for a method: calls through, except the calls numbered in ``breaks`` (from 1)."""

    def __init__(
        self, method: Callable[..., Any], breaks: Collection[int], error: Exception
    ) -> None:
        self.method, self.breaks, self.error, self.calls = method, breaks, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls in self.breaks:
            raise self.error
        return self.method(*args, **kwargs)


def test_an_allocator_that_breaks_in_an_insert_is_logged_and_changes_nothing() -> None:
    """A failure from outside the cache is logged (it was not), and replays as nothing done.

    Unlogged, a replay ran the insert in full, and a tensor-parallel digest could
    not tell the rank it broke on from the others.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(8)))
    cache.poll()
    before = (states(cache), owners(cache), cache.tiers.copier.in_flight())
    allocator = cache.tiers.device.allocator
    allocator.alloc = _Breaking(allocator.alloc, {1}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="allocator broke"):
        cache.insert(list(range(100, 116)))
    assert (states(cache), owners(cache), cache.tiers.copier.in_flight()) == before
    cache.check_invariants()
    assert cache.log.failures() == [("insert", "RuntimeError: allocator broke")]
    assert cache.log.refusals() == []
    cache.insert(list(range(100, 116)))  # the allocator works again
    cache.poll()
    again = replay(cache.log, BASE)  # the failed insert is not run again
    assert again.log.transitions() == cache.log.transitions()
    assert states(again) == states(cache)
    assert again.log.failures() == []


@pytest.mark.parametrize("caller_slots", [False, True])
def test_an_allocator_that_breaks_as_the_new_leaf_takes_its_pages_changes_nothing(
    caller_slots: bool,
) -> None:
    """The leaf was hung in the tree before its pages were handed to it, and stayed.

    Nothing was logged before the failure, so a replay skipped the insert and
    built a cache without the leaf the recording kept (and its later nodes
    under other ids); the recording's own pages were held by a node the
    allocator did not know.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(8)))
    cache.poll()
    prompt = list(range(100, 116))
    given = cache.alloc_slots(len(prompt)) if caller_slots else None
    before = (states(cache), owners(cache), cache.tiers.copier.in_flight())
    allocator = cache.tiers.device.allocator
    allocator.reassign = _Breaking(allocator.reassign, {1}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="allocator broke"):
        cache.insert(prompt, given)
    assert (states(cache), owners(cache), cache.tiers.copier.in_flight()) == before
    cache.check_invariants()
    assert cache.log.failures() == [("insert", "RuntimeError: allocator broke")]
    cache.insert(prompt, given)  # the allocator works again; the slots were still the caller's
    cache.poll()
    assert [n.id for n in cache.tree.nodes.values()] == [1, 2]
    again = replay(cache.log, BASE)
    assert again.log.transitions() == cache.log.transitions()
    assert states(again) == states(cache)


def test_an_allocator_that_breaks_as_a_node_adopts_its_pages_leaves_it_as_it_was() -> None:
    """The effect set the node's device pages before the allocator handed them over.

    The event was refused (``EffectFailed``), so the node stayed off the device
    holding device pages: invariant 9 broke at the next check.
    """
    cache = HiCache(replace(BASE, debug=True))
    prompt = list(range(16))
    cache.insert(prompt)
    cache.poll()
    assert cache.evict(16) == 16
    before = states(cache)
    allocator = cache.tiers.device.allocator
    allocator.reassign = _Breaking(allocator.reassign, {1}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(EffectFailed, match="allocator broke"):
        cache.insert(prompt)
    vars(allocator).pop("reassign")
    assert states(cache) == before
    assert [n.device_pages for n in cache.tree] == [()]
    cache.check_invariants()
    cache.insert(prompt)  # the allocator works again
    assert states(cache) == [(1, "backed/resident (pins=0, locks=0)")]


def test_a_copy_engine_that_breaks_in_an_insert_s_wait_changes_nothing() -> None:
    """An insert through a chain still loading polls the engine first; a broken poll is logged."""
    config = replace(BASE, load_back_threshold=4)
    cache = HiCache(replace(config, debug=True, copier=late(3).copier))
    prompt = list(range(8))
    cache.insert(prompt)
    while cache.issued():
        cache.poll()
    assert cache.evict(8) == 8
    assert cache.load_back(cache.tree.nodes[1])
    before = (states(cache), owners(cache), cache.issued())
    copier = cache.tiers.copier
    copier.poll = _Breaking(copier.poll, {1}, OSError("copy engine broke"))  # type: ignore[method-assign]
    with pytest.raises(OSError, match="copy engine broke"):
        cache.insert([*prompt, *range(100, 108)])
    assert (states(cache), owners(cache), cache.issued()) == before
    assert cache.log.failures() == [("insert", "OSError: copy engine broke")]
    cache.insert([*prompt, *range(100, 108)])  # waits for the load, this time
    while cache.issued():
        cache.poll()
    again = replay(cache.log, config)
    assert again.log.transitions() == cache.log.transitions()
    assert states(again) == states(cache)


def test_a_failure_after_the_operation_changed_the_cache_does_not_replay() -> None:
    """What the insert evicted before its allocator broke stays done, so it cannot be skipped."""
    cache = HiCache(replace(BASE, debug=True))
    for start in range(0, 400, 100):  # 16 pages: the device pool, full
        cache.insert(list(range(start, start + 16)))
    cache.poll()
    allocator = cache.tiers.device.allocator
    # the first allocation finds the pool full, the one after the eviction breaks
    allocator.alloc = _Breaking(allocator.alloc, {2}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="allocator broke"):
        cache.insert(list(range(500, 516)))
    cache.check_invariants()
    assert cache.log.failures() == [("insert", "RuntimeError: allocator broke")]
    at = cache.log.entries.index(("op", "insert", (tuple(range(500, 516)), None, None)))
    assert cache.log.entries[at + 1 : at + 2] == [("transition", 1, "evict_device")]
    failed = cache.log.entries.index(("failed", "insert", "RuntimeError: allocator broke"))
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, BASE)
    assert str(caught.value) == (
        f"replay: entry {at} {cache.log.entries[at]!r} failed in the recording (RuntimeError:"
        f" allocator broke) after it changed the cache (entries {at + 1} to {failed - 1});"
        " a failure from outside the cache replays only where the operation changed nothing"
    )


def shape(cache: HiCache) -> list[tuple[int, int | None, tuple[int, ...], Pages, Pages]]:
    """Each node's id, parent id, key, device pages and host pages."""
    return sorted(
        (n.id, None if n.parent is None else n.parent.id, n.key, n.device_pages, n.host_pages)
        for n in cache.tree
    )


@pytest.mark.parametrize(
    ("pool", "call"),
    [("device", 1), ("host", 1), ("device", 2)],
    ids=["device pages handed over", "host pages handed over", "the new leaf's pages"],
)
def test_an_allocator_that_breaks_after_a_split_changes_nothing_and_replays(
    pool: str, call: int
) -> None:
    """The allocator broke as a split handed the prefix its pages (call 1), or later, as the
    insert's new leaf took its own (call 2).

    As the split handed pages over: the walk had split the node first, and it
    stayed split; the pages stayed the suffix's while the prefix held them
    (invariant 7 broke), nothing was logged, and the prefix's id was spent, so
    a replay, which skips the failed insert, named the later nodes differently.
    At the new leaf: the split stayed, logged, so the log could not replay the
    insert as nothing done. Nothing else had changed since either: the split
    is taken back, node id and log entry included, and the log replays.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(16)))
    cache.poll()
    assert shape(cache) == [(1, 0, tuple(range(16)), (0, 1, 2, 3), (0, 1, 2, 3))]  # both pools
    before = (shape(cache), states(cache), owners(cache))
    allocator = cache.tiers.device.allocator if pool == "device" else cache.tiers.host.allocator
    allocator.reassign = _Breaking(allocator.reassign, {call}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    prompt = (*range(8), *range(100, 104))  # parts inside node 1: the walk splits it
    with pytest.raises(RuntimeError, match="allocator broke"):
        cache.insert(prompt)
    vars(allocator).pop("reassign")
    assert (shape(cache), states(cache), owners(cache)) == before
    cache.check_invariants()
    at = cache.log.entries.index(("op", "insert", (prompt, None, None)))
    assert cache.log.entries[at + 1 :] == [("failed", "insert", "RuntimeError: allocator broke")]
    cache.insert(prompt)  # the allocator works again: the prefix gets the id it would have had
    cache.poll()
    assert sorted((n.id, n.key[0]) for n in cache.tree) == [(1, 8), (2, 0), (3, 100)]
    cache.check_invariants()
    again = replay(cache.log, BASE)
    assert again.log.transitions() == cache.log.transitions()
    assert states(again) == states(cache)


def _broken_after_the_split(cache: HiCache, hand_back: Exception) -> tuple[int, ...]:
    """Break the device allocator at the new leaf's pages, then with ``hand_back`` at the unsplit's.

    Returns the prompt, whose insert runs into node 1 part way: the split's
    hand-over (call 1) works.
    """
    allocator = cache.tiers.device.allocator
    works, calls = allocator.reassign, 0
    errors = {2: RuntimeError("allocator broke"), 3: hand_back}

    def reassign(pages: Sequence[int], owner: int, new_owner: int) -> None:
        nonlocal calls
        calls += 1
        if calls in errors:
            raise errors[calls]
        works(pages, owner, new_owner)

    allocator.reassign = reassign  # type: ignore[method-assign]
    return (*range(8), *range(100, 104))


def test_an_allocator_still_broken_as_a_split_is_taken_back_leaves_it_split_with_a_note() -> None:
    """The split stays, logged, as it is: the insert's error goes on, and says so in a note.

    The hand-back was suppressed whatever it raised, and left no trace.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(16)))
    cache.poll()
    prompt = _broken_after_the_split(cache, RuntimeError("allocator still broken"))
    with pytest.raises(RuntimeError) as caught:
        cache.insert(prompt)
    vars(cache.tiers.device.allocator).pop("reassign")
    assert str(caught.value) == "allocator broke"
    note = "node 2 stays split: taking the split back failed too (RuntimeError: allocator still broken)"
    notes = [note] if sys.version_info >= (3, 11) else None  # exception notes came with 3.11
    assert getattr(caught.value, "__notes__", None) == notes
    assert shape(cache) == [
        (1, 2, tuple(range(8, 16)), (2, 3), (2, 3)),
        (2, 0, tuple(range(8)), (0, 1), (0, 1)),
    ]
    at = cache.log.entries.index(("op", "insert", (prompt, None, None)))
    assert cache.log.entries[at + 1 :] == [
        ("transition", 2, "split:1"),
        ("failed", "insert", "RuntimeError: allocator broke"),
    ]
    cache.check_invariants()


def test_an_error_of_the_cache_s_own_as_a_split_is_taken_back_is_raised() -> None:
    """The pool refusing the pages handed back is a fault of the cache's: raised, not swallowed.

    The insert's own error is its ``__context__``. It was suppressed, and the
    insert raised the allocator's error as if nothing else had gone wrong.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(16)))
    cache.poll()
    refused = ForeignSlot("device page 0 is not node 2's")
    prompt = _broken_after_the_split(cache, refused)
    with pytest.raises(ForeignSlot) as caught:
        cache.insert(prompt)
    vars(cache.tiers.device.allocator).pop("reassign")
    assert caught.value is refused
    assert isinstance(caught.value.__context__, RuntimeError)
    assert str(caught.value.__context__) == "allocator broke"
    assert [n.id for n in cache.tree] == [2, 1]  # the split stays
    cache.check_invariants()


def test_a_split_and_an_adoption_before_an_allocator_broke_are_logged_and_do_not_replay() -> None:
    """The prefix of a host-only node adopted its pages before the allocator broke at the leaf.

    The split cannot be taken back then: the log says what the insert did, and
    a replay names it, as it names an eviction.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(16)))
    cache.poll()
    cache.evict(16)
    cache.poll()
    allocator = cache.tiers.device.allocator
    allocator.reassign = _Breaking(allocator.reassign, {3}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    prompt = (*range(8), *range(100, 104))  # parts inside host-only node 1: split, then adopt
    with pytest.raises(RuntimeError, match="allocator broke"):
        cache.insert(prompt)
    vars(allocator).pop("reassign")
    cache.check_invariants()
    at = cache.log.entries.index(("op", "insert", (prompt, None, None)))
    assert cache.log.entries[at + 1 :] == [
        ("transition", 2, "split:1"),
        ("transition", 2, "adopt"),
        ("failed", "insert", "RuntimeError: allocator broke"),
    ]
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, BASE)
    assert str(caught.value) == (
        f"replay: entry {at} {cache.log.entries[at]!r} failed in the recording (RuntimeError:"
        f" allocator broke) after it changed the cache (entries {at + 1} to {at + 2});"
        " a failure from outside the cache replays only where the operation changed nothing"
    )


def test_an_allocator_that_breaks_as_a_chain_loads_frees_what_it_took() -> None:
    """``load_back`` allocated the whole chain, then the allocator broke at its second node.

    The pages of the nodes that did not load stayed the request's with no
    caller holding them (lost), and the staged pages of the nodes after the
    failing one stayed staged, so a ``load`` fired by hand took them instead
    of being refused.
    """
    config = replace(BASE, load_back_threshold=1)
    cache = HiCache(replace(config, debug=True))
    cache.insert(list(range(8)))
    cache.poll()
    cache.insert(list(range(24)))  # node 2 (8 tokens) under node 1
    cache.poll()
    cache.insert(list(range(16)))  # splits node 2: node 3 (8 tokens) keeps the tail
    cache.poll()
    assert cache.evict(24) == 24
    chain = [cache.tree.nodes[i] for i in (1, 3, 2)]
    assert [n.key[0] for n in chain] == [0, 8, 16]
    allocator = cache.tiers.device.allocator
    allocator.reassign = _Breaking(allocator.reassign, {2}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(EffectFailed, match="allocator broke"):
        cache.load_back(chain[-1])
    vars(allocator).pop("reassign")
    assert [n.device for n in chain] == ["loading", "absent", "absent"]
    assert [n.device_pages for n in chain[1:]] == [(), ()]
    assert REQUEST not in allocator.owners  # the pages of nodes 3 and 2 went back
    assert allocator.owners.count(FREE) == config.device_pages - 2
    cache.check_invariants()
    cache.poll()
    assert cache.load_back(chain[1]) == [chain[1]]
    cache.poll()
    with pytest.raises(EffectFailed) as refused:  # by hand: the spec lets it load now
        cache.fire("load", chain[2])
    assert str(refused.value) == (
        "node 2: effect start_load of load failed: no device pages are staged for it"
        " (load_back or insert allocate them; the event alone cannot)"
    )
    assert cache.load_back(chain[2]) == [chain[2]]
    cache.poll()
    assert [n.device for n in chain] == ["resident"] * 3
    cache.check_invariants()


@pytest.mark.parametrize("caller_slots", [False, True])
def test_an_allocator_that_breaks_as_an_insert_adopts_a_node_frees_what_it_took(
    caller_slots: bool,
) -> None:
    """An insert through two host-only nodes, with a new tail: the second adoption breaks.

    The new leaf was hung, on the device, before the path nodes above it
    adopted their pages, so it stayed on the device under a node off it
    (invariant 1 broke), and the pages of the nodes that did not adopt them
    stayed the request's with no caller holding them.
    """
    cache = HiCache(replace(BASE, debug=True))
    cache.insert(list(range(8)))
    cache.poll()
    cache.insert(list(range(16)))
    cache.poll()
    assert cache.evict(16) == 16
    prompt = [*range(16), *range(50, 54)]
    given = cache.alloc_slots(len(prompt)) if caller_slots else None
    allocator = cache.tiers.device.allocator
    allocator.reassign = _Breaking(allocator.reassign, {2}, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(EffectFailed, match="allocator broke"):
        cache.insert(prompt, given)
    vars(allocator).pop("reassign")
    cache.check_invariants()
    assert states(cache) == [
        (1, "backed/resident (pins=0, locks=0)"),
        (2, "backed/absent (pins=0, locks=0)"),
    ]
    entries = cache.log.entries
    at = max(i for i, entry in enumerate(entries) if entry[:2] == ("op", "insert"))
    assert entries[at + 1 :] == [
        ("transition", 1, "adopt"),
        (  # the allocator's error, not the cache's refusal: logged as a failure
            "failed",
            "insert",
            "EffectFailed: node 2: effect adopt_device of adopt failed: allocator broke",
        ),
    ]
    rest = [] if given is None else given[8:]  # node 1 adopted the first two pages
    held = [page for page, owner in enumerate(allocator.owners) if owner == REQUEST]
    assert held == sorted({slot // BASE.page_size for slot in rest})
    if given is not None:
        cache.free_slots(rest)  # still the caller's
    assert allocator.owners.count(FREE) == BASE.device_pages - 2
    cache.insert(prompt)  # the allocator works again
    cache.poll()
    assert [n.device for n in cache.tree] == ["resident"] * 3


def test_refused_copy_starts_replay_on_an_engine_that_refuses_none() -> None:
    """A start the engine refused is logged with its copy number and refused again on replay."""
    config = replace(BASE, load_back_threshold=4)
    cache = HiCache(replace(config, copier=FaultyCopyEngine.copier(refuse={2, 4})))
    cache.insert(list(range(8)))  # copy 1
    cache.poll()
    cache.insert(list(range(100, 108)))  # start 2 refused: would have been copy 2
    assert cache.evict(8) == 8
    assert cache.load_back(cache.tree.nodes[1]) == [cache.tree.nodes[1]]  # start 3: copy 2
    cache.poll()
    assert cache.evict(8) == 8
    assert cache.load_back(cache.tree.nodes[1]) is None  # start 4 refused: would be copy 3
    assert cache.load_back(cache.tree.nodes[1]) == [cache.tree.nodes[1]]  # start 5: copy 3
    cache.poll()
    assert cache.log.refused_starts() == [
        (2, "d2h", (2,), "CopyFailed: injected refusal of copy 2"),
        (3, "h2d", (1,), "CopyFailed: injected refusal of copy 4"),
    ]
    again = replay(cache.log, config)
    assert again.log.transitions() == cache.log.transitions()
    assert again.log.refused_starts() == cache.log.refused_starts()
    assert states(again) == states(cache)
    again.insert(list(range(200, 208)))  # past the log the replayed cache starts its own copies
    again.poll()
    assert again.tree.nodes[3].host == "backed"


def test_starts_a_closed_engine_refused_replay_on_an_open_one() -> None:
    """Copies refused by an engine closed under the cache replay on an engine left open."""
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    cache.poll()
    cache.tiers.copier.close()
    cache.insert(list(range(100, 108)))
    cache.poll()
    text = "CopyFailed: copy engine closed: d2h copy refused"
    assert cache.log.refused_starts() == [(2, "d2h", (2,), text)]
    assert cache.tree.nodes[2].host == "unbacked"
    again = replay(cache.log, BASE)
    assert states(again) == states(cache)
    assert again.log.refused_starts() == [(2, "d2h", (2,), text)]


def test_a_start_refused_only_on_replay_is_a_mismatch() -> None:
    """The replay's own engine refusing a start the log did not is named as the difference."""
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, replace(BASE, copier=FaultyCopyEngine.copier(refuse={1})))
    assert str(caught.value) == "recorded 0 refused copy starts, replayed 1"


def test_the_replayed_cache_takes_its_acknowledgements_from_its_engine() -> None:
    """After the log, the replayed cache polls, inserts and closes as any cache does."""
    cache = HiCache(late(3))
    cache.insert(list(range(8)))
    cache.poll()
    again = replay(cache.log, BASE)
    assert states(again) == [(1, "writing/resident (pins=0, locks=0)")]
    assert again.poll() == 1  # the completion the replay drained and the log never applied
    assert states(again) == [(1, "backed/resident (pins=0, locks=0)")]
    again.insert(list(range(100, 108)))
    again.close()
    assert again.log.acknowledgements()[-1] == ("wait", ((2, True),))
    cache.close()


def test_the_log_of_a_closed_cache_replays() -> None:
    """A close waits for the copies in flight; its acknowledgements replay as recorded."""
    with HiCache(late(1)) as cache:
        cache.insert(list(range(8)))
        cache.insert(list(range(100, 108)))
    again = replay(cache.log, BASE)
    assert states(again) == states(cache)
    with pytest.raises(Exception, match="the cache was closed"):
        again.poll()


def test_fire_is_logged_as_fire_and_replays() -> None:
    """``fire("evict_host", node)`` is not ``evict_host(num_tokens)``: logged and replayed as a fire."""
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    cache.insert(list(range(100, 116)))
    cache.poll()
    cache.evict(100)
    cache.fire("evict_host", cache.tree.nodes[2])
    assert cache.log.operations()[-1] == ("fire", ("evict_host", 2))
    again = replay(cache.log, BASE)
    assert states(again) == states(cache) == [(1, "backed/absent (pins=0, locks=0)")]


def _lock_the_root(cache: HiCache, namespace: str | None) -> None:
    """A miss, then the request runs under a lock of the node it hands back: the root."""
    hit = cache.match_prefix(list(range(8)), namespace=namespace)
    with cache.lock(hit.last_device_node):
        cache.insert(list(range(8)), namespace=namespace)


def _load_back_the_root(cache: HiCache, namespace: str | None) -> None:
    """SGLang loads back a miss's last host node, the root: nothing to load."""
    hit = cache.match_prefix(list(range(8)), namespace=namespace)
    assert cache.load_back(hit.last_host_node) is None
    cache.insert(list(range(8)), namespace=namespace)


def _back_up_the_root(cache: HiCache, namespace: str | None) -> None:
    """The root holds nothing to back up: no copy starts."""
    hit = cache.match_prefix(list(range(8)), namespace=namespace)
    assert cache.backup([hit.last_device_node]) == 0
    cache.insert(list(range(8)), namespace=namespace)


def _root_locks(cache: HiCache) -> dict[object, int]:
    return {name: root.locks for name, root in cache.tree.roots.items()}


@pytest.mark.parametrize(
    ("run", "namespace"),
    [
        (_lock_the_root, None),
        (_lock_the_root, "lora-1"),
        (_load_back_the_root, None),
        (_load_back_the_root, "lora-1"),
        (_back_up_the_root, None),
    ],
)
def test_an_operation_on_a_namespace_root_replays(
    run: Callable[[HiCache, str | None], None], namespace: str | None
) -> None:
    """A miss hands back the root, which callers lock, load back or back up: the log replays."""
    cache = HiCache(BASE)
    run(cache, namespace)
    cache.poll()
    again = replay(cache.log, BASE)
    assert list(again.log.entries) == list(cache.log.entries)
    assert states(again) == states(cache) == [(1, "backed/resident (pins=0, locks=0)")]
    assert _root_locks(again) == _root_locks(cache) == {namespace: 0}


def test_a_lock_names_the_root_it_took_and_replays_there() -> None:
    """Every root is node 0, but each counts its own locks: the log names the namespace."""
    cache = HiCache(BASE)
    default = cache.lock(cache.match_prefix(list(range(8))).last_device_node)
    lora = cache.lock(cache.match_prefix(list(range(8)), namespace="lora-1").last_device_node)
    again = cache.lock(cache.match_prefix(list(range(8)), namespace="lora-1").last_device_node)
    cache.unlock(lora)
    assert [op for op in cache.log.operations() if op[0] in ("lock", "unlock")] == [
        ("lock", (NamespaceRoot(None),)),
        ("lock", (NamespaceRoot("lora-1"),)),
        ("lock", (NamespaceRoot("lora-1"),)),
        ("unlock", (NamespaceRoot("lora-1"),)),
    ]
    known = {id(d) for d in leases.dropped_leases()}
    # the replay's receipts of the locks still held are dropped, as in any replay
    with pytest.warns(ResourceWarning, match=r"node 0: lease \(lock taken at replay.py"):
        replayed = replay(cache.log, BASE)
    leases.forget_dropped([d for d in leases.dropped_leases() if id(d) not in known])
    assert list(replayed.log.entries) == list(cache.log.entries)
    assert _root_locks(replayed) == _root_locks(cache) == {None: 1, "lora-1": 1}
    default.release()
    again.release()


def test_a_storage_tier_log_is_refused(tmp_path: Path) -> None:
    """A log with storage copies or storage events raises BadArgument saying why."""
    tier = StorageConfig(LocalFileStore(str(tmp_path)), model="m", threads=0)
    with HiCache(BASE, storage=tier) as cache:
        cache.insert(list(range(16)))
        cache.poll()
        cache.poll()
        with pytest.raises(BadArgument) as caught:
            replay(cache.log, BASE)
    assert str(caught.value) == (
        "replay: logs of a cache with a storage tier are not replayable:"
        " entry 5 ('transition', 1, 'store') needs the store, which a replay does not rebuild"
    )


def short_log() -> EventLog:
    """Five entries: an insert, its write, a poll, its acknowledgement and write_done."""
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    cache.poll()
    return cache.log


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        (
            ("op", "lock", (999,)),
            ReplayMismatch,
            "replay: entry 5 ('op', 'lock', (999,)): node 999 is not in the replayed tree",
        ),
        (
            ("op", "release", (1,)),
            ReplayMismatch,
            "replay: entry 5 ('op', 'release', (1,)): no pin of node 1 is held on replay",
        ),
        (
            ("op", "frobnicate", (8,)),
            BadArgument,
            "replay: entry 5 ('op', 'frobnicate', (8,)): unknown operation 'frobnicate'",
        ),
        (
            ("bogus", 1, 2),
            BadArgument,
            "replay: entry 5 ('bogus', 1, 2): unknown entry kind 'bogus'",
        ),
        (
            ("op", "insert", ((1, 2, 3, 4),)),
            BadArgument,
            "replay: entry 5 ('op', 'insert', ((1, 2, 3, 4),)): insert is logged with 3 arguments",
        ),
        (
            ("copy_refused", (2, "up", (1,)), "CopyFailed: no"),
            BadArgument,
            "replay: entry 5 ('copy_refused', (2, 'up', (1,)), 'CopyFailed: no'): a refused"
            " copy start is ((copy, 'd2h' or 'h2d', (node id, ...)), 'ErrorClass: message')",
        ),
        (
            ("failed", "poll", 3),
            BadArgument,
            "replay: entry 5 ('failed', 'poll', 3): a failure of no operation",
        ),
        (
            ("failed", "poll", "RuntimeError: broke"),
            ReplayMismatch,
            "replay: entry 2 ('op', 'poll', ()) failed in the recording (RuntimeError: broke)"
            " after it changed the cache (entries 3 to 4); a failure from outside the cache"
            " replays only where the operation changed nothing",
        ),
        (
            ("op", "backup", (5,)),
            ReplayMismatch,
            "replay: entry 5 ('op', 'backup', (5,)) cannot be applied:"
            " TypeError: 'int' object is not iterable",
        ),
        (
            (["op"], "poll", ()),
            BadArgument,
            "replay: entry 5 (['op'], 'poll', ()): unknown entry kind ['op']",
        ),
        (
            ("op", ["poll"], ()),
            BadArgument,
            "replay: entry 5 ('op', ['poll'], ()): unknown operation ['poll']",
        ),
        (
            ("op", "fire", (["write"], 1)),
            ReplayMismatch,
            "fire raised on replay, not in the recording:"
            " BadArgument: fire: event must be a str, got list",
        ),
        (
            ("acks", "poll", "garbage"),
            BadArgument,
            "replay: entry 5 ('acks', 'poll', 'garbage'): an acknowledgement batch is"
            " (origin, ((copy, True or False), ...))",
        ),
        (
            ("acks", "poll", ((2, "yes"),)),
            BadArgument,
            "replay: entry 5 ('acks', 'poll', ((2, 'yes'),)): an acknowledgement batch is"
            " (origin, ((copy, True or False), ...))",
        ),
        (
            ("acks", None, ()),
            BadArgument,
            "replay: entry 5 ('acks', None, ()): an acknowledgement batch is"
            " (origin, ((copy, True or False), ...))",
        ),
        (
            ("op", "lock", (0,)),
            ReplayMismatch,
            "replay: entry 5 ('op', 'lock', (0,)): node 0 is not in the replayed tree",
        ),
        (
            ("op", "lock", (NamespaceRoot("lora-9"),)),
            ReplayMismatch,
            "replay: entry 5 ('op', 'lock', (NamespaceRoot(namespace='lora-9'),)):"
            " node NamespaceRoot(namespace='lora-9') is not in the replayed tree",
        ),
        (
            ("op", "lock", (NamespaceRoot(["lora"]),)),  # type: ignore[arg-type]  # tampered
            ReplayMismatch,
            "replay: entry 5 ('op', 'lock', (NamespaceRoot(namespace=['lora']),)):"
            " node NamespaceRoot(namespace=['lora']) is not in the replayed tree",
        ),
    ],
)
def test_a_bad_entry_raises_a_typed_error_naming_it(
    extra: tuple[str, object, object], error: type[Exception], message: str
) -> None:
    """Unknown nodes, unmatched releases, unknown names and wrong arguments are typed errors."""
    with pytest.raises(error) as caught:
        replay(rebuilt(short_log(), [extra]), BASE)
    assert type(caught.value) is error
    assert str(caught.value) == message


def test_a_copy_keeps_the_count_of_entries_dropped() -> None:
    """``EventLog.copy`` of a log that dropped entries is not complete, and refuses to replay."""
    cache = HiCache(replace(BASE, log_limit=6))
    cache.insert(list(range(8)))
    cache.poll()
    cache.insert(list(range(100, 108)))
    cache.poll()
    copy = cache.log.copy()
    assert (copy.complete, copy.dropped, copy.limit) == (False, cache.log.dropped, 6)
    assert copy.entries == cache.log.entries
    with pytest.raises(ReplayMismatch, match="the log dropped its first"):
        replay(copy, BASE)


@pytest.mark.parametrize(
    ("log", "config", "message"),
    [
        (None, BASE, "replay: log must be an EventLog, got None"),
        (
            [("op", "poll", ())],
            BASE,
            "replay: log must be an EventLog, got [('op', 'poll', ())]",
        ),
        ("log", BASE, "replay: log must be an EventLog, got 'log'"),
        (EventLog(None), None, "replay: config must be a CacheConfig, got None"),
        (
            EventLog(None),
            {"device_pages": 16},
            "replay: config must be a CacheConfig, got {'device_pages': 16}",
        ),
    ],
)
def test_a_log_or_config_of_the_wrong_type_is_named(
    log: object, config: object, message: str
) -> None:
    """Replay checks both arguments before it builds a cache."""
    with pytest.raises(BadArgument) as caught:
        replay(log, config)  # type: ignore[arg-type]
    assert str(caught.value) == message


def test_a_refused_apply_completions_replays() -> None:
    """A refused ``apply_completions`` logs no batch; a replay takes none for it.

    The replay took the next recorded batch for it, a later poll's, and
    raised ``ReplayMismatch`` on a log every call of which was sound.
    """
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    done = cache.tiers.copier.poll()  # the finished copy, as a tensor-parallel step collects it
    cache.apply_completions(done)
    with pytest.raises(DuplicateAck):
        cache.apply_completions(done)  # the same completion again: nothing applied
    with pytest.raises(BadArgument):
        cache.apply_completions([object()])  # type: ignore[list-item]
    cache.insert(list(range(100, 108)))
    cache.poll()
    assert states(replay(cache.log, BASE)) == states(cache)


@pytest.mark.parametrize(("take", "by_hand"), [("pin", "release"), ("lock", "unlock")])
def test_a_release_refused_and_tried_again_replays(
    take: Literal["pin", "lock"], by_hand: Literal["release", "unlock"]
) -> None:
    """A receipt whose release was refused is still held: releasing it again replays.

    The replay let go of its receipt at the first, refused, release, and the
    second raised ``ReplayMismatch`` (no receipt held).
    """
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    cache.poll()
    node = cache.match_prefix(list(range(8))).last_device_node
    receipt = cache.pin(node) if take == "pin" else cache.lock(node)
    cache.fire(by_hand, node)  # a tool releases it by hand
    for _ in range(2):
        with pytest.raises((ReleaseAtZero, UnlockAtZero)):
            receipt.release()
    known = {id(d) for d in leases.dropped_leases()}
    # the replay's receipt is still held after its refused releases, as the recording's is
    with pytest.warns(ResourceWarning, match=rf"node {node.id}: lease \({take} taken at replay.py"):
        replayed = replay(cache.log, BASE)
    leases.forget_dropped([d for d in leases.dropped_leases() if id(d) not in known])
    assert states(replayed) == states(cache)
    cache.fire(take, node)  # taken again by hand, so the receipt still held can go
    receipt.release()
