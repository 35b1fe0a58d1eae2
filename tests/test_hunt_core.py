"""Defects found by an adversarial hunt through the cache core, one test each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from fsm_cache.cache.arguments import TokenKey
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.errors import BadArgument, EffectFailed, ReplayMismatch
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.testing.faults import FaultyCopyEngine


BASE = CacheConfig(
    device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
)


def states(cache: HiCache) -> list[tuple[int, str]]:
    return sorted((n.id, n.residency()) for n in cache.tree)


class _BreaksOnce:
    """Stands in for an allocator method: the first call raises ``error``, the others call through."""

    def __init__(self, method: Callable[..., Any], error: Exception) -> None:
        self.method, self.error, self.calls = method, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return self.method(*args, **kwargs)


# -- token ids that are bools -------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, 3, True], "tokens[3] is True, not an int"),
        ([False, 1, 2, 3], "tokens[0] is False, not an int"),
        ([0, 1, 256, 512, 7, 1, 0, False], "tokens[7] is False, not an int"),
        (torch.tensor([True, False, True, True]), "tokens[0] is True, not an int"),
        ([0] * 200 + [True] + [0] * 55, "tokens[200] is True, not an int"),  # padding's many zeros
        ([1792] * 255 + [False], "tokens[255] is False, not an int"),  # lowest byte 0, not 0
    ],
)
def test_bool_token_ids_are_refused_and_change_nothing(tokens: object, message: str) -> None:
    """Bools were taken as the ids 0 and 1: ``[True, False, ...]`` matched ``[1, 0, ...]``'s KV."""
    cache = HiCache(BASE)
    cache.insert([1, 0, 1, 1, 5, 6, 7, 8])
    before, logged = states(cache), list(cache.log.entries)
    for op, call in (
        ("insert", lambda: cache.insert(tokens)),  # type: ignore[arg-type]
        ("match_prefix", lambda: cache.match_prefix(tokens)),  # type: ignore[arg-type]
        ("TokenKey", lambda: TokenKey(tokens)),  # type: ignore[arg-type]
    ):
        with pytest.raises(BadArgument) as caught:
            call()
        assert str(caught.value) == f"{op}: {message}"
    assert (states(cache), list(cache.log.entries)) == (before, logged)


def test_ids_that_pack_like_bools_are_ids() -> None:
    """A prompt padded with one id whose lowest byte is 0 or 1 passes, as few such ids do."""
    for tokens in ([0] * 256, [1792] * 200 + [257] * 56, [5, 1, 0, 256]):
        assert TokenKey(tokens) == tuple(tokens)


def test_ids_0_and_1_as_ints_still_match() -> None:
    cache = HiCache(BASE)
    cache.insert([1, 0, 1, 1, 0, 0, 0, 1])
    assert cache.match_prefix(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1])).device_len == 8
    assert cache.match_prefix(TokenKey([1, 0, 1, 1])).device_len == 4


# -- an allocator that breaks inside an effect ----------------------------------


def test_an_allocator_that_breaks_in_an_effect_is_a_failure_and_replays() -> None:
    """The engine raises the allocator's error as EffectFailed, which was logged as a refusal.

    A replay, whose allocator works, then ran the insert and raised
    ReplayMismatch ("refused in the recording, not on replay"): a log that
    met a broken allocator inside an effect never replayed.
    """
    cache = HiCache(replace(BASE, debug=True))
    prompt = list(range(16))
    cache.insert(prompt)
    cache.poll()
    assert cache.evict(16) == 16
    allocator = cache.tiers.device.allocator
    allocator.reassign = _BreaksOnce(allocator.reassign, RuntimeError("allocator broke"))  # type: ignore[method-assign]
    with pytest.raises(EffectFailed) as caught:
        cache.insert(prompt)
    assert isinstance(caught.value.__cause__, RuntimeError)
    text = "EffectFailed: node 1: effect adopt_device of adopt failed: allocator broke"
    assert cache.log.entries[-1] == ("failed", "insert", text)
    assert cache.log.failures() == [("insert", text)]
    cache.insert(prompt)  # the allocator works again
    cache.poll()
    again = replay(cache.log, BASE)
    assert again.log.transitions() == cache.log.transitions()
    assert states(again) == states(cache)


def test_a_refusal_of_the_cache_s_own_inside_an_effect_stays_a_refusal() -> None:
    """An effect that refuses (no pages staged for a load fired by hand) replays as a refusal."""
    config = replace(BASE, load_back_threshold=1)
    cache = HiCache(config)
    cache.insert(list(range(8)))
    cache.poll()
    assert cache.evict(8) == 8
    with pytest.raises(EffectFailed):
        cache.fire("load", cache.tree.nodes[1])
    assert cache.log.entries[-1][:2] == ("refused", "fire")
    assert cache.log.failures() == []
    again = replay(cache.log, config)
    assert states(again) == states(cache)


def test_an_insert_whose_backup_breaks_after_it_added_its_leaf_does_not_replay() -> None:
    """The insert hung its leaf, then the host allocator broke as the leaf's backup began.

    A new leaf is not logged, so the failure looked like one before any
    change: a replay would skip the insert and build a tree without the leaf
    the recording kept. The leaf is logged on that path (``add``), and the
    replay names the insert as one that changed the cache.
    """
    cache = HiCache(replace(BASE, debug=True))
    allocator = cache.tiers.host.allocator
    allocator.alloc = _BreaksOnce(allocator.alloc, RuntimeError("host allocator broke"))  # type: ignore[method-assign]
    prompt = list(range(8))
    with pytest.raises(EffectFailed, match="host allocator broke"):
        cache.insert(prompt)
    assert states(cache) == [(1, "unbacked/resident (pins=0, locks=0)")]  # the insert was done
    cache.check_invariants()
    entries = cache.log.entries
    assert entries[:] == [
        ("op", "insert", (tuple(prompt), None, None)),
        ("transition", 1, "add"),
        (
            "failed",
            "insert",
            "EffectFailed: node 1: effect start_write of write failed: host allocator broke",
        ),
    ]
    with pytest.raises(ReplayMismatch) as caught:
        replay(cache.log, BASE)
    assert str(caught.value) == (
        f"replay: entry 0 {entries[0]!r} failed in the recording (EffectFailed: node 1: effect"
        " start_write of write failed: host allocator broke) after it changed the cache"
        " (entries 1 to 1); a failure from outside the cache replays only where the operation"
        " changed nothing"
    )


# -- a load-back of a node already loading --------------------------------------


def test_a_load_back_of_a_node_already_loading_waits_for_nothing() -> None:
    """Nothing is absent on its path, so nothing hangs under the load: there is nothing to wait for.

    It waited for every copy in flight (an unrelated backup's too), blocking
    the host, and returned None all the same: what a second request whose
    match ended at a prefix the first one was loading back paid on the
    scheduler's loop.
    """
    config = replace(BASE, load_back_threshold=1, copier=FaultyCopyEngine.copier(delay=5))
    cache = HiCache(config)
    cache.insert(list(range(8)))
    while cache.issued():
        cache.poll()
    cache.insert(list(range(100, 108)))  # node 2: its backup is in flight
    assert cache.evict(8) == 8  # node 1, the least recently used
    node = cache.tree.nodes[1]
    assert cache.load_back(node) == [node]
    in_flight, logged = cache.issued(), len(cache.log.entries)
    assert cache.load_back(node) is None
    assert (node.device, cache.issued()) == ("loading", in_flight)  # nothing waited for
    assert cache.log.entries[logged:] == [("op", "load_back", (1,))]
    while cache.issued():
        cache.poll()
    assert node.device == "resident"
    again = replay(cache.log, replace(config, copier=None))
    assert states(again) == states(cache)
