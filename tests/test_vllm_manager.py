"""The checked vLLM offloading manager on its own, without vLLM (``fsm_cache.compat.vllm``).

``tests/vllm_real`` holds it to vLLM's own manager; these tests pin its
contract down where vLLM is not installed: the mapping of vLLM's block
integer onto the host machine, LRU eviction of ready blocks only, refusals
that name the block and change nothing, strict mode, and that importing the
module loads neither vLLM nor torch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from fsm_cache.compat.vllm import (
    CheckedOffloadingManager,
    Lookup,
    OffloadEvent,
    RequestContext,
    StoreOutput,
    block_label,
)
from fsm_cache.errors import (
    BadArgument,
    CopyInFlight,
    DuplicateAck,
    HostCopyPinned,
    NoHostCopy,
    NotLoading,
)


def key(block: int, group: int = 0) -> bytes:
    """vLLM's offload key layout: an 8-byte block hash, then the 4-byte KV group."""
    return block.to_bytes(8, "big") + group.to_bytes(4, "big")


K = [key(i) for i in range(10)]


def snapshot(m: CheckedOffloadingManager) -> tuple[Any, ...]:
    """What a refused call must leave as it was."""
    records = {k: (r.host, r.pins, r.chunk, tuple(r.trail or ())) for k, r in m.records.items()}
    events = list(m.events) if m.events is not None else None
    ranks = (dict(m.recency.ranks), set(m.recency.evictable))
    return records, ranks, list(m.free), m.allocated, events, m.duplicate_acks


def stored(m: CheckedOffloadingManager, keys: list[bytes], ctx: RequestContext) -> None:
    """Store ``keys`` and acknowledge them."""
    out = m.prepare_store(keys, ctx)
    assert out.keys_to_store == keys
    m.complete_store(keys, ctx)


@pytest.fixture
def ctx() -> RequestContext:
    return RequestContext("req-0")


def test_block_label_names_hash_and_group() -> None:
    assert block_label(key(7, 2)) == "0000000000000007/2"
    assert block_label(b"\x01\x02") == "0102"


def test_the_lifecycle_is_the_host_machine(ctx: RequestContext) -> None:
    """vLLM's -1 / 0 / N is writing / backed / pinned(N)."""
    m = CheckedOffloadingManager(4)
    assert m.lookup(K[0], ctx) is Lookup.MISS
    out = m.prepare_store([K[0], K[1]], ctx)
    assert out == StoreOutput([K[0], K[1]], [0, 1], [])
    assert (m.records[K[0]].host, m.records[K[0]].pins) == ("writing", 0)
    assert m.lookup(K[0], ctx) is Lookup.HIT_PENDING
    m.complete_store([K[0], K[1]], ctx)
    assert m.records[K[0]].host == "backed"
    assert m.lookup(K[0], ctx) is Lookup.HIT
    assert m.prepare_load([K[0], K[0]], ctx) == [0, 0]
    assert (m.records[K[0]].host, m.records[K[0]].pins) == ("pinned", 2)
    m.complete_load([K[0]], ctx)
    assert (m.records[K[0]].host, m.records[K[0]].pins) == ("pinned", 1)
    m.complete_load([K[0]], ctx)
    assert (m.records[K[0]].host, m.records[K[0]].pins) == ("backed", 0)


def test_prepare_store_skips_held_keys_and_evicts_lru_ready_blocks(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(3, events=True)
    stored(m, K[0:3], ctx)
    m.touch([K[0]], ctx)  # K[1] is now the least recent, then K[2]
    out = m.prepare_store([K[0], K[3], K[4]], ctx)
    assert out == StoreOutput([K[3], K[4]], [2, 1], [K[1], K[2]])
    assert K[1] not in m.records
    assert list(m.take_events()) == [
        OffloadEvent(K[0:3], removed=False),
        OffloadEvent([K[1], K[2]], removed=True),
    ]
    assert list(m.take_events()) == []


def test_blocks_being_stored_or_loaded_are_never_evicted(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2)
    stored(m, [K[0]], ctx)
    m.prepare_load([K[0]], ctx)  # pinned
    m.prepare_store([K[1]], ctx)  # writing
    before = snapshot(m)
    assert m.prepare_store([K[2]], ctx) is None
    assert snapshot(m) == before
    m.complete_load([K[0]], ctx)
    assert m.prepare_store([K[2]], ctx) == StoreOutput([K[2]], [0], [K[0]])


def test_offered_keys_are_not_evicted_to_make_room_for_each_other(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(1)
    stored(m, [K[0]], ctx)
    assert m.prepare_store([K[0], K[1]], ctx) is None
    assert m.lookup(K[0], ctx) is Lookup.HIT


def test_failed_store_frees_the_chunk_and_is_announced_as_cleanup(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2, events=True)
    m.prepare_store([K[0], K[1]], ctx)
    m.complete_store([K[0]], ctx, success=False)
    assert K[0] not in m.records
    assert m.free == [0]
    m.complete_store([K[1]], ctx)
    assert list(m.take_events()) == [
        OffloadEvent([K[0]], removed=True, metadata_only=True),
        OffloadEvent([K[1]], removed=False),
    ]


def test_cleanup_is_not_announced_for_a_key_stored_again(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2, events=True)
    m.prepare_store([K[0]], ctx)
    m.complete_store([K[0]], ctx, success=False)
    m.prepare_store([K[0]], ctx)
    assert list(m.take_events()) == []


def test_without_failure_events_a_failed_store_is_silent(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2, events=True, failure_events=False)
    m.prepare_store([K[0]], ctx)
    m.complete_store([K[0]], ctx, success=False)
    assert list(m.take_events()) == []


def test_double_complete_load_is_refused_and_changes_nothing(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4)
    stored(m, [K[1], K[2]], ctx)
    m.prepare_load([K[1], K[2]], ctx)
    before = snapshot(m)
    with pytest.raises(NotLoading) as refused:
        m.complete_load([K[2], K[1], K[1]], ctx)
    assert str(refused.value) == (
        "block 0000000000000001/0: load_done refused in backed (pins=0): "
        "no host-to-device copy in flight"
    )
    assert snapshot(m) == before


def test_a_refused_repeated_completion_leaves_the_trails_as_they_were(
    ctx: RequestContext,
) -> None:
    m = CheckedOffloadingManager(4, trail=True)
    stored(m, [K[1], K[2]], ctx)
    m.prepare_load([K[1], K[2]], ctx)
    before = snapshot(m)
    with pytest.raises(NotLoading):
        m.complete_load([K[1], K[2], K[2]], ctx)  # checked on scratch copies first
    assert snapshot(m) == before
    m.prepare_load([K[1], K[1]], ctx)
    notes = len(m.records[K[1]].trail or ())
    m.complete_load([K[1], K[1]], ctx)
    assert len(m.records[K[1]].trail or ()) == notes + 2  # one note per load_done


def test_complete_load_of_a_block_never_loaded(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4)
    stored(m, [K[1]], ctx)
    with pytest.raises(NotLoading, match=r"^block 0000000000000001/0: load_done refused in backed"):
        m.complete_load([K[1]], ctx)
    with pytest.raises(
        NotLoading, match=r"^block 0000000000000009/0: load_done refused in unbacked"
    ):
        m.complete_load([K[9]], ctx)


def test_complete_load_of_a_block_only_another_request_loads(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2)
    other = RequestContext("req-1")
    stored(m, [K[1]], ctx)
    m.prepare_load([K[1]], ctx)
    before = snapshot(m)
    with pytest.raises(NotLoading) as refused:
        m.complete_load([K[1]], other)
    assert str(refused.value) == (
        "block 0000000000000001/0: load_done refused in pinned (pins=1): "
        "request 'req-1' has no load of it in flight (its pins are other requests' loads)"
    )
    assert snapshot(m) == before
    m.reset_cache()
    stored(m, [K[1]], other)
    m.prepare_load([K[1]], other)
    with pytest.raises(NotLoading, match="request 'req-0' has no load"):
        m.complete_load([K[1]], ctx)  # its load was before the reset
    m.complete_load([K[1]], other)
    assert m.records[K[1]].host == "backed"


def test_trail_mode_names_the_call_sites_of_another_requests_load() -> None:
    m = CheckedOffloadingManager(2, trail=True)
    mine, other = RequestContext("req-0"), RequestContext("req-1")
    stored(m, [K[1]], mine)
    m.prepare_load([K[1]], mine)
    with pytest.raises(NotLoading) as refused:
        m.complete_load([K[1]], other)
    assert refused.value.history.startswith("written at test_vllm_manager.py:")
    assert "; loaded at test_vllm_manager.py:" in refused.value.history
    assert refused.value.site is not None
    assert str(refused.value).endswith(f"refused at {refused.value.site}")


def test_complete_store_of_a_block_another_request_stores(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2, events=True)
    other = RequestContext("req-1")
    m.prepare_store([K[1]], other)
    before = snapshot(m)
    m.complete_store([K[1]], ctx)
    m.complete_store([K[1]], ctx, False)
    assert m.records[K[1]].host == "writing"
    assert m.duplicate_acks == before[-1] + 2
    assert snapshot(m)[:-1] == before[:-1]
    m.complete_store([K[1]], other)
    assert m.lookup(K[1], ctx) is Lookup.HIT

    strict = CheckedOffloadingManager(2, strict=True)
    strict.prepare_store([K[1]], other)
    before = snapshot(strict)
    with pytest.raises(DuplicateAck) as refused:
        strict.complete_store([K[1]], ctx)
    assert str(refused.value) == (
        "block 0000000000000001/0: write_done refused in writing (pins=0): "
        "request 'req-0' has no store of it in flight (another request's store is)"
    )
    assert snapshot(strict) == before


def test_load_of_a_pending_or_unknown_key_is_refused_and_changes_nothing(
    ctx: RequestContext,
) -> None:
    m = CheckedOffloadingManager(4)
    stored(m, [K[0]], ctx)
    m.prepare_store([K[1]], ctx)
    before = snapshot(m)
    with pytest.raises(NoHostCopy) as refused:
        m.prepare_load([K[0], K[1]], ctx)
    assert str(refused.value) == (
        "block 0000000000000001/0: load refused in writing (pins=0): "
        "no valid host copy to load from"
    )
    with pytest.raises(NoHostCopy, match=r"^block 0000000000000005/0: load refused in unbacked"):
        m.prepare_load([K[0], K[5]], ctx)
    assert snapshot(m) == before


def test_trail_mode_names_the_call_sites(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4, trail=True)
    stored(m, [K[3]], ctx)
    m.prepare_load([K[3]], ctx)
    m.complete_load([K[3]], ctx)
    with pytest.raises(NotLoading) as refused:
        m.complete_load([K[3]], ctx)
    message = str(refused.value)
    assert message.startswith(
        "block 0000000000000003/0: load_done refused in backed (pins=0): "
        "no host-to-device copy in flight; written at test_vllm_manager.py:"
    )
    for past in ("acknowledged at", "loaded at", "load acknowledged at", "refused at"):
        assert f"; {past} test_vllm_manager.py:" in message
    assert refused.value.site is not None
    assert refused.value.site.function == "test_trail_mode_names_the_call_sites"


def test_duplicate_complete_store_is_tolerated_and_counted(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4, events=True)
    stored(m, [K[0]], ctx)
    list(m.take_events())
    m.complete_store([K[0], K[7]], ctx)
    m.complete_store([K[0]], ctx, success=False)
    assert m.duplicate_acks == 3
    assert m.records[K[0]].host == "backed"
    assert list(m.take_events()) == []


def test_strict_mode_refuses_duplicate_complete_store(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4, strict=True)
    stored(m, [K[0]], ctx)
    m.prepare_store([K[1]], ctx)
    before = snapshot(m)
    with pytest.raises(DuplicateAck) as refused:
        m.complete_store([K[1], K[0]], ctx)
    assert str(refused.value) == (
        "block 0000000000000000/0: write_done refused in backed (pins=0): "
        "no device-to-host copy in flight: a duplicate or stray acknowledgement"
    )
    with pytest.raises(
        DuplicateAck, match=r"^block 0000000000000001/0: write_done refused in backed"
    ):
        m.complete_store([K[1], K[1]], ctx)
    with pytest.raises(
        DuplicateAck, match=r"^block 0000000000000008/0: write_failed refused in unbacked"
    ):
        m.complete_store([K[8]], ctx, success=False)
    assert snapshot(m) == before
    m.complete_store([K[1]], ctx)
    assert m.records[K[1]].host == "backed"


@pytest.mark.parametrize("strict", [False, True])
def test_keys_given_once_through_are_taken_as_a_list(ctx: RequestContext, strict: bool) -> None:
    """vLLM's manager walks a load's keys once; an iterator of them works there, so here too.

    Checking every key before changing anything walks them twice: an iterator
    pinned nothing and loaded no chunk, or failed on ``len``.
    """
    m = CheckedOffloadingManager(4, strict=strict)
    m.prepare_store(iter([K[0], K[1]]), ctx)
    m.complete_store(iter([K[0], K[1]]), ctx)
    assert m.prepare_load(iter([K[1], K[0]]), ctx) == [1, 0]
    assert (m.records[K[0]].pins, m.records[K[1]].pins) == (1, 1)
    m.complete_load(iter([K[0], K[1]]), ctx)
    assert (m.records[K[0]].host, m.records[K[1]].host) == ("backed", "backed")
    m.prepare_store(iter([K[2]]), ctx)
    m.complete_store(iter([K[2]]), ctx, success=False)
    assert K[2] not in m.records


def test_reset_drops_everything_and_restarts_chunks(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(2)
    stored(m, [K[0]], ctx)
    m.prepare_store([K[1]], ctx)
    m.reset_cache()
    assert m.records == {}
    assert m.lookup(K[0], ctx) is Lookup.MISS
    assert m.prepare_store([K[2]], ctx) == StoreOutput([K[2]], [0], [])
    m.complete_store([K[1]], ctx)  # a stale completion: nothing to acknowledge
    assert m.duplicate_acks == 1


def test_strict_reset_refuses_copies_in_flight(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(3, strict=True)
    stored(m, [K[0], K[1]], ctx)
    m.prepare_load([K[0]], ctx)
    before = snapshot(m)
    with pytest.raises(
        HostCopyPinned, match=r"^block 0000000000000000/0: evict_host refused in pinned \(pins=1\)"
    ):
        m.reset_cache()
    assert snapshot(m) == before
    m.complete_load([K[0]], ctx)
    m.prepare_store([K[2]], ctx)
    with pytest.raises(
        CopyInFlight, match=r"^block 0000000000000002/0: evict_host refused in writing"
    ):
        m.reset_cache()
    m.complete_store([K[2]], ctx)
    m.reset_cache()
    assert m.records == {}


def test_store_threshold_stores_a_block_on_its_second_offer(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4, store_threshold=2)
    assert m.prepare_store([K[0]], ctx) == StoreOutput([], [], [])
    assert m.stores_skipped == 1
    assert m.prepare_store([K[0]], RequestContext("other")) == StoreOutput([K[0]], [0], [])


def test_a_request_counts_toward_the_store_threshold_once(ctx: RequestContext) -> None:
    """vLLM 0.34: a retry, or a re-offer after preemption, is not another use of the block."""
    m = CheckedOffloadingManager(4, store_threshold=2)
    assert m.prepare_store([K[0]], ctx) == StoreOutput([], [], [])
    assert m.prepare_store([K[0], K[1]], ctx) == StoreOutput([], [], [])
    assert m.counts == {K[0]: 1, K[1]: 1}
    assert m.stores_skipped == 2  # K[0] once, K[1] once
    assert m.prepare_store([K[0]], RequestContext("other")) == StoreOutput([K[0]], [0], [])


def test_before_vllm_0_34_every_offer_counts(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4, store_threshold=2, count_offers_once=False)
    assert m.prepare_store([K[0]], ctx) == StoreOutput([], [], [])
    assert m.prepare_store([K[0]], ctx) == StoreOutput([K[0]], [0], [])


def test_a_key_offered_twice_in_one_store_is_refused(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4)
    with pytest.raises(BadArgument, match="offered a key twice"):
        m.prepare_store([K[0], K[0]], ctx)
    assert m.records == {}


def test_success_passed_where_the_request_context_goes_is_refused(ctx: RequestContext) -> None:
    """``complete_store(keys, False)`` binds False to req_context: it must not store the block."""
    m = CheckedOffloadingManager(4)
    m.prepare_store([K[0]], ctx)
    with pytest.raises(BadArgument) as refused:
        m.complete_store([K[0]], False)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "complete_store: req_context must be a request context (get_state, set_state, "
        "get_offload_key_position), got False (bool)"
    )
    assert m.records[K[0]].host == "writing"
    assert m.lookup(K[0], ctx) == Lookup.HIT_PENDING


_CALLS = [
    lambda m, c: m.on_new_request(c),
    lambda m, c: m.lookup(K[0], c),
    lambda m, c: m.prepare_load([K[0]], c),
    lambda m, c: m.touch([K[0]], c),
    lambda m, c: m.complete_load([K[0]], c),
    lambda m, c: m.prepare_store([K[1]], c),
    lambda m, c: m.complete_store([K[0]], c),
    lambda m, c: m.on_request_finished(c),
]


class _PositionsOnly:
    """Half a request context: it has the position lookup only."""

    def get_offload_key_position(self, key: bytes) -> int | None:
        return None


@pytest.mark.parametrize("call", _CALLS)
@pytest.mark.parametrize(
    ("bad", "named"), [(_PositionsOnly(), "_PositionsOnly"), (RequestContext, "type")]
)
def test_every_call_refuses_half_a_request_context_or_its_class(
    ctx: RequestContext,
    call: Callable[[CheckedOffloadingManager, object], object],
    bad: object,
    named: str,
) -> None:
    """Each method the manager calls on a context is asked for: a missing one was an AttributeError."""
    m = CheckedOffloadingManager(4)
    stored(m, [K[0]], ctx)
    before = (dict(m.records), m.records[K[0]].host, m.records[K[0]].pins, list(m.free))
    with pytest.raises(
        BadArgument, match=rf"req_context must be a request context .* \({named}\)$"
    ):
        call(m, bad)
    assert (dict(m.records), m.records[K[0]].host, m.records[K[0]].pins, list(m.free)) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.on_new_request(None),
        lambda m: m.lookup(K[0], None),
        lambda m: m.prepare_load([K[0]], None),
        lambda m: m.touch([K[0]], None),
        lambda m: m.complete_load([K[0]], None),
        lambda m: m.prepare_store([K[1]], None),
        lambda m: m.complete_store([K[0]], None),
        lambda m: m.on_request_finished(None),
    ],
)
def test_every_call_refuses_what_is_no_request_context(
    ctx: RequestContext, call: Callable[[CheckedOffloadingManager], object]
) -> None:
    m = CheckedOffloadingManager(4)
    stored(m, [K[0]], ctx)
    before = (dict(m.records), m.records[K[0]].host, m.records[K[0]].pins, list(m.free))
    with pytest.raises(BadArgument, match=r"req_context must be a request context .* got None"):
        call(m)
    assert (dict(m.records), m.records[K[0]].host, m.records[K[0]].pins, list(m.free)) == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda m, c: m.prepare_load(K[0], c),
            f"prepare_load: keys must be an iterable of offload keys (bytes), got {K[0]!r} (bytes)",
        ),
        (
            lambda m, c: m.complete_load(K[0], c),
            "complete_load: keys must be an iterable of offload keys (bytes), "
            f"got {K[0]!r} (bytes)",
        ),
        (
            lambda m, c: m.prepare_store(K[3], c),
            "prepare_store: keys must be an iterable of offload keys (bytes), "
            f"got {K[3]!r} (bytes)",
        ),
        (
            lambda m, c: m.complete_store(K[2], c),
            "complete_store: keys must be an iterable of offload keys (bytes), "
            f"got {K[2]!r} (bytes)",
        ),
        (
            lambda m, c: m.complete_store(K[2], c, success=False),
            "complete_store: keys must be an iterable of offload keys (bytes), "
            f"got {K[2]!r} (bytes)",
        ),
        (
            lambda m, c: m.touch(K[1], c),
            f"touch: keys must be an iterable of offload keys (bytes), got {K[1]!r} (bytes)",
        ),
        (
            lambda m, c: m.prepare_load(bytearray(K[0]), c),
            "prepare_load: keys must be an iterable of offload keys (bytes), "
            f"got {bytearray(K[0])!r} (bytearray)",
        ),
        (
            lambda m, c: m.prepare_store("0000000000000003/0", c),
            "prepare_store: keys must be an iterable of offload keys (bytes), "
            "got '0000000000000003/0' (str)",
        ),
        (
            lambda m, c: m.complete_load(None, c),
            "complete_load: keys must be an iterable of offload keys (bytes), got None (NoneType)",
        ),
        (
            lambda m, c: m.prepare_load([K[1], 7], c),
            "prepare_load: keys must be offload keys (bytes), got 7 (int) at position 1",
        ),
        (
            lambda m, c: m.complete_load(iter([K[0], "k"]), c),
            "complete_load: keys must be offload keys (bytes), got 'k' (str) at position 1",
        ),
        (
            lambda m, c: m.complete_store([K[2], bytearray(K[2])], c),
            "complete_store: keys must be offload keys (bytes), "
            f"got {bytearray(K[2])!r} (bytearray) at position 1",
        ),
        (
            lambda m, c: m.touch([[K[1]]], c),
            f"touch: keys must be offload keys (bytes), got {[K[1]]!r} (list) at position 0",
        ),
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_every_call_refuses_what_is_no_list_of_keys(
    ctx: RequestContext,
    strict: bool,
    call: Callable[[CheckedOffloadingManager, RequestContext], object],
    message: str,
) -> None:
    """A bare key is iterable too: its items are ints, which no call may take for keys.

    vLLM's calls take an iterable of keys; one key passed instead would look
    its bytes up (and fail building its own refusal), or, in a tolerant
    ``complete_store``, count a duplicate acknowledgement per byte.
    """
    m = CheckedOffloadingManager(4, events=True, strict=strict)
    stored(m, [K[0], K[1]], ctx)
    m.prepare_load([K[0]], ctx)
    m.prepare_store([K[2]], ctx)
    before, scratch = snapshot(m), repr(ctx.scratch)
    with pytest.raises(BadArgument) as refused:
        call(m, ctx)
    assert str(refused.value) == message
    assert (snapshot(m), repr(ctx.scratch)) == (before, scratch)


def test_a_refusal_names_what_is_no_key() -> None:
    assert block_label(7) == "7"
    assert block_label([b"ab"]) == "[b'ab']"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_chunks": 1.5}, "num_chunks must be an int >= 0, got 1.5 (float)"),
        ({"num_chunks": "4"}, "num_chunks must be an int >= 0, got '4' (str)"),
        ({"num_chunks": None}, "num_chunks must be an int >= 0, got None (NoneType)"),
        ({"num_chunks": -3}, "num_chunks must be an int >= 0, got -3 (int)"),
        ({"num_chunks": True}, "num_chunks must be an int >= 0, got True (bool)"),
        ({"store_threshold": -1}, "store_threshold must be an int >= 0, got -1 (int)"),
        ({"store_threshold": 2.0}, "store_threshold must be an int >= 0, got 2.0 (float)"),
        ({"max_tracker_size": 0}, "max_tracker_size must be an int >= 1, got 0 (int)"),
        ({"max_tracker_size": "64"}, "max_tracker_size must be an int >= 1, got '64' (str)"),
    ],
)
def test_the_counts_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    """A bad count failed only later: 1.5 chunks evicted a block, then raised a TypeError."""
    options.setdefault("num_chunks", 4)
    with pytest.raises(BadArgument) as refused:
        CheckedOffloadingManager(**options)
    assert str(refused.value) == f"CheckedOffloadingManager: {message}"


def test_the_least_counts_are_taken(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(0, store_threshold=0, max_tracker_size=1)
    assert m.prepare_store([K[0]], ctx) is None
    m = CheckedOffloadingManager(1, store_threshold=2, max_tracker_size=1)
    assert m.prepare_store([K[0]], ctx) == StoreOutput([], [], [])
    assert m.prepare_store([K[0]], RequestContext("req-1")) == StoreOutput([K[0]], [0], [])


def test_a_finished_request_may_not_bring_new_keys(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4)
    m.on_new_request(ctx)
    stored(m, [K[0]], ctx)
    m.on_request_finished(ctx)
    with pytest.raises(BadArgument, match="after on_request_finished"):
        m.prepare_store([K[1]], ctx)
    assert K[1] not in m.records


def test_a_finished_request_may_offer_a_key_another_request_is_storing(
    ctx: RequestContext,
) -> None:
    """vLLM asserts only on keys it would record, and it records no key being stored."""
    m, writer = CheckedOffloadingManager(4), RequestContext("writer")
    m.on_new_request(writer)
    m.on_new_request(ctx)
    m.prepare_store([K[1]], writer)
    m.prepare_store([K[0]], ctx)
    m.on_request_finished(ctx)
    before = snapshot(m)
    assert m.prepare_store([K[1]], ctx) == StoreOutput([], [], [])
    assert snapshot(m) == before
    with pytest.raises(BadArgument, match="after on_request_finished"):
        m.prepare_store([K[1], K[2]], ctx)  # K[2] is new: vLLM would record it
    assert snapshot(m) == before


def test_a_finished_request_may_offer_a_key_below_the_store_threshold(
    ctx: RequestContext,
) -> None:
    m = CheckedOffloadingManager(4, store_threshold=2, count_offers_once=False)
    m.on_new_request(ctx)
    m.prepare_store([K[0]], ctx)
    m.on_request_finished(ctx)
    assert m.prepare_store([K[1]], ctx) == StoreOutput([], [], [])  # its first offer: skipped
    with pytest.raises(BadArgument, match="after on_request_finished"):
        m.prepare_store([K[1]], ctx)  # its second: vLLM would store and record it
    assert K[1] not in m.records


def test_a_finished_requests_reoffer_stays_below_the_store_threshold(
    ctx: RequestContext,
) -> None:
    """vLLM 0.34 does not count it again, so it is neither stored nor recorded: no refusal."""
    m = CheckedOffloadingManager(4, store_threshold=2)
    m.on_new_request(ctx)
    m.prepare_store([K[0]], ctx)
    m.on_request_finished(ctx)
    assert m.prepare_store([K[1]], ctx) == StoreOutput([], [], [])
    assert m.prepare_store([K[1]], ctx) == StoreOutput([], [], [])
    assert (m.counts, m.stores_skipped) == ({K[0]: 1, K[1]: 1}, 2)
    assert K[1] not in m.records


def test_request_ranks_put_a_requests_tail_before_its_head() -> None:
    """vLLM 0.33's LRU: a request's positioned keys share its rank, later positions first."""
    positions = {K[i]: 16 * (i + 1) for i in range(4)}
    m = CheckedOffloadingManager(4)
    ctx = RequestContext("r", positions)
    stored(m, K[0:4], ctx)
    out = m.prepare_store([K[5]], RequestContext("other"))
    assert out.evicted_keys == [K[3]]
    flat = CheckedOffloadingManager(4, request_ranks=False)
    ctx = RequestContext("r", positions)
    stored(flat, K[0:4], ctx)
    assert flat.prepare_store([K[5]], RequestContext("other")).evicted_keys == [K[0]]


def test_finishing_a_request_makes_its_head_most_recent() -> None:
    m = CheckedOffloadingManager(3, request_ranks=False)
    first, second = RequestContext("a"), RequestContext("b")
    stored(m, [K[0], K[1]], first)
    stored(m, [K[2]], second)
    m.on_request_finished(first)  # K[0], K[1] now more recent than K[2]
    assert m.prepare_store([K[3]], second).evicted_keys == [K[2]]


def test_usage_counts_unevictable_chunks_and_stores(ctx: RequestContext) -> None:
    m = CheckedOffloadingManager(4)
    stored(m, [K[0]], ctx)
    m.prepare_store([K[1]], ctx)
    m.prepare_load([K[0]], ctx)
    assert m.usage() == (0.5, 0.25)


def test_importing_the_module_loads_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, fsm_cache.compat.vllm as v\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "try:\n"
        "    v.FsmOffloadingManager\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('missing', exc.name)\n"
        "else:\n"
        "    print('vllm present')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() in ("missing vllm", "vllm present")


def test_other_names_are_not_made_up() -> None:
    import fsm_cache.compat.vllm as module

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = module.Nope


def test_bench_vllm_without_vllm_says_how_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from fsm_cache.cli.main import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; tests/vllm_real runs the benchmark")
    assert main(["bench", "vllm", "--quick"]) == 2
    assert "make bench-vllm" in capsys.readouterr().err


def check_invariants(m: CheckedOffloadingManager, loads: list[list[bytes]]) -> None:
    """What must hold between any two calls, whatever the sequence."""
    chunks = [r.chunk for r in m.records.values()]
    assert len(set(chunks)) == len(chunks)  # no chunk held twice
    assert not set(chunks) & set(m.free)  # no held chunk free
    assert len(chunks) + len(m.free) == m.allocated <= m.num_chunks  # conservation
    backed = {k for k, r in m.records.items() if r.host == "backed"}
    assert m.recency.evictable == backed  # only ready, unloaded blocks are evictable
    assert set(m.recency.ranks) == set(m.records)
    assert m.writing == sum(r.host == "writing" for r in m.records.values())
    outstanding: dict[bytes, int] = {}
    for job in loads:
        for k in job:
            outstanding[k] = outstanding.get(k, 0) + 1
    for k, r in m.records.items():
        assert r.pins == outstanding.get(k, 0)
        assert (r.host == "pinned") == (r.pins > 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_contract_sequences_keep_the_invariants(seed: int) -> None:
    import random

    rng = random.Random(seed)
    m = CheckedOffloadingManager(6, events=True, request_ranks=seed % 2 == 0)
    stores: list[list[bytes]] = []
    loads: list[list[bytes]] = []
    ctx = RequestContext("r", {key(i): 16 * (i + 1) for i in range(20)})
    for _ in range(3000):
        roll = rng.random()
        start = rng.randrange(18)
        keys = [key(i) for i in range(start, start + rng.randint(1, 3))]
        if roll < 0.35:
            out = m.prepare_store(keys, ctx)
            if out is not None and out.keys_to_store:
                stores.append(out.keys_to_store)
        elif roll < 0.55 and stores:
            m.complete_store(stores.pop(rng.randrange(len(stores))), ctx, rng.random() < 0.9)
        elif roll < 0.75:
            hits = [k for k in keys if m.lookup(k, ctx) is Lookup.HIT]
            if hits:
                m.prepare_load(hits, ctx)
                loads.append(hits)
        elif roll < 0.9 and loads:
            m.complete_load(loads.pop(rng.randrange(len(loads))), ctx)
        elif roll < 0.97:
            m.touch(keys, ctx)
        else:
            list(m.take_events())
        check_invariants(m, loads)


@pytest.mark.parametrize("position", ["2", True, 2.5])
def test_a_position_that_is_no_int_is_refused_before_anything_changes(position: object) -> None:
    """A str position failed ``prepare_store`` half-way, as a bare TypeError.

    Its blocks were left ``writing`` with their chunks taken and the request
    not recorded as the store's owner: its ``complete_store`` was ignored, and
    a strict ``reset_cache`` refused for good. ``prepare_load`` and
    ``on_request_finished`` failed the same way after changing state.
    """
    m = CheckedOffloadingManager(4, strict=True)
    good = RequestContext("good", {K[2]: 7})
    stored(m, [K[2]], good)
    bad = RequestContext("bad", {K[0]: 1, K[1]: position, K[2]: position})  # type: ignore[dict-item]
    shown = f"{position!r} ({type(position).__name__})"
    for call, keys in (("prepare_store", [K[0], K[1]]), ("prepare_load", [K[2]])):
        before = snapshot(m)
        with pytest.raises(BadArgument) as refused:
            getattr(m, call)(keys, bad)
        label = block_label(keys[-1])
        assert str(refused.value) == (
            f"{call}: req_context.get_offload_key_position({label}) must be an int token "
            f"position or None, got {shown}"
        )
        assert snapshot(m) == before
    assert m.writing == 0
    m.reset_cache()  # nothing in flight: a strict reset is not refused
    seen = RequestContext("seen", {K[3]: 3})
    stored(m, [K[3]], seen)
    seen.positions[K[3]] = position  # type: ignore[assignment]
    before = snapshot(m)
    with pytest.raises(BadArgument):
        m.on_request_finished(seen)
    assert snapshot(m) == before
    seen.positions[K[3]] = 3
    m.on_request_finished(seen)  # not marked finished by the refused call: it commits now
    assert snapshot(m) != before


def test_lookup_refuses_what_is_no_key(ctx: RequestContext) -> None:
    """A list raised a bare TypeError (unhashable); None, a str or an int read as a MISS."""
    m = CheckedOffloadingManager(4)
    stored(m, [K[0]], ctx)
    for bad in ([1, 2], None, "k", 7, K[0].hex()):
        with pytest.raises(BadArgument) as refused:
            m.lookup(bad, ctx)  # type: ignore[arg-type]
        assert str(refused.value) == (
            f"lookup: key must be an offload key (bytes), got {bad!r} ({type(bad).__name__})"
        )
    assert m.lookup(K[0], ctx) is Lookup.HIT


@pytest.mark.parametrize("success", [None, 0, 1, "False", []])
def test_complete_store_refuses_a_success_that_is_no_bool(
    ctx: RequestContext, success: object
) -> None:
    """None or 0 dropped the store as failed; "False" or 1 published it."""
    m = CheckedOffloadingManager(4)
    m.prepare_store([K[0]], ctx)
    before = snapshot(m)
    with pytest.raises(BadArgument) as refused:
        m.complete_store([K[0]], ctx, success)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"complete_store: success must be a bool, got {success!r} ({type(success).__name__})"
    )
    assert snapshot(m) == before
    m.complete_store([K[0]], ctx, True)
    assert m.records[K[0]].host == "backed"


@pytest.mark.parametrize(
    "flag", ["events", "strict", "request_ranks", "failure_events", "count_offers_once"]
)
def test_a_flag_that_is_no_bool_is_refused(flag: str) -> None:
    """``strict="false"`` is truthy: it turned strict mode on; None was taken too."""
    for value in ("false", None, 1):
        with pytest.raises(BadArgument) as refused:
            CheckedOffloadingManager(4, **{flag: value})  # type: ignore[arg-type]
        assert str(refused.value) == (
            f"CheckedOffloadingManager: {flag} must be a bool, got {value!r} "
            f"({type(value).__name__})"
        )


def test_two_managers_over_one_context_keep_their_own_requests() -> None:
    """The second manager's scratch replaced the first's on the shared context.

    The first manager's own ``complete_store`` was then ignored (its block
    ``writing`` for good), or refused in strict mode as another request's.
    """
    shared = RequestContext("req")
    for strict in (False, True):
        first = CheckedOffloadingManager(4, strict=strict)
        shadow = CheckedOffloadingManager(4, strict=strict)
        first.prepare_store([K[0]], shared)
        shadow.prepare_store([K[1]], shared)
        first.complete_store([K[0]], shared)
        shadow.complete_store([K[1]], shared)
        assert (first.records[K[0]].host, shadow.records[K[1]].host) == ("backed", "backed")
        assert (first.duplicate_acks, shadow.duplicate_acks) == (0, 0)
        first.prepare_load([K[0]], shared)
        first.complete_load([K[0]], shared)
        assert first.records[K[0]].pins == 0
