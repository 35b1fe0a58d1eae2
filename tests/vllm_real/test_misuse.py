"""Misuse that vLLM's manager catches with ``assert`` (or not at all), refused by ours.

Each sequence runs on vLLM's own ``CPUOffloadingManager`` and on ours. vLLM
raises a bare ``AssertionError`` (or accepts the call); ours raises the
spec's typed refusal, its message naming the block, its state and, in trail
mode, the call sites of its recent events, and changes nothing: every
record, the LRU order, the free chunks and the events are as before.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsm_cache.compat.vllm import block_label
from fsm_cache.errors import (
    BadArgument,
    CopyInFlight,
    DuplicateAck,
    HostCopyPinned,
    NoHostCopy,
    NotLoading,
)

from .conftest import Vllm


def _snapshot(manager: Any) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    records = {k: (r.host, r.pins, r.chunk) for k, r in manager.records.items()}
    recency = (dict(manager.recency.ranks), set(manager.recency.evictable))
    return records, recency, list(manager.free), manager.allocated, list(manager.events)


def _gauge(manager: Any, name: str) -> float:
    """One of vLLM's CPU cache gauges (``usage``, ``write_usage``) from ``get_stats``."""
    value: float = manager.get_stats().data["data"][f"vllm:kv_offload_cpu_cache_{name}_perc"][()]
    return value


def _stored(manager: Any, keys: list[bytes], ctx: Any) -> None:
    """Store ``keys`` and acknowledge the store."""
    out = manager.prepare_store(keys, ctx)
    assert list(out.keys_to_store) == keys
    manager.complete_store(keys, ctx)


def test_double_complete_load(vl: Vllm) -> None:
    ctx, key = vl.context("r"), vl.key(7)
    theirs = vl.theirs(4)
    _stored(theirs, [key], ctx)
    theirs.prepare_load([key], ctx)
    theirs.complete_load([key], ctx)
    with pytest.raises(AssertionError, match="ref_cnt is already 0"):
        theirs.complete_load([key], ctx)

    ours = vl.ours(4)
    _stored(ours, [key], ctx)
    ours.prepare_load([key], ctx)
    ours.complete_load([key], ctx)
    before = _snapshot(ours)
    with pytest.raises(NotLoading) as refused:
        ours.complete_load([key], ctx)
    assert str(refused.value) == (
        "block 0000000000000007/0: load_done refused in backed (pins=0): "
        "no host-to-device copy in flight"
    )
    assert _snapshot(ours) == before


def test_double_complete_load_in_one_call_changes_nothing(vl: Vllm) -> None:
    """vLLM decrements the first and asserts on the second: half a call applied."""
    ctx, key, other = vl.context("r"), vl.key(7), vl.key(8)
    theirs = vl.theirs(4)
    _stored(theirs, [key, other], ctx)
    theirs.prepare_load([key, other], ctx)
    with pytest.raises(AssertionError):
        theirs.complete_load([other, key, key], ctx)
    assert theirs.lookup(other, ctx) == vl.base.LookupResult.HIT

    ours = vl.ours(4)
    _stored(ours, [key, other], ctx)
    ours.prepare_load([key, other], ctx)
    before = _snapshot(ours)
    with pytest.raises(NotLoading, match="load_done refused in backed"):
        ours.complete_load([other, key, key], ctx)
    assert _snapshot(ours) == before
    assert ours.records[other].pins == 1


def test_load_of_a_pending_key(vl: Vllm) -> None:
    ctx, key = vl.context("r"), vl.key(3)
    theirs = vl.theirs(4)
    theirs.prepare_store([key], ctx)
    assert theirs.lookup(key, ctx) == vl.base.LookupResult.HIT_PENDING
    with pytest.raises(AssertionError, match="is not ready for reading"):
        theirs.prepare_load([key], ctx)

    ours = vl.ours(4, trail=True)
    ours.prepare_store([key], ctx)
    assert ours.lookup(key, ctx) == vl.base.LookupResult.HIT_PENDING
    before = _snapshot(ours)
    with pytest.raises(NoHostCopy) as refused:
        ours.prepare_load([key], ctx)
    message = str(refused.value)
    assert message.startswith(
        "block 0000000000000003/0: load refused in writing (pins=0): "
        "no valid host copy to load from; written at test_misuse.py:"
    )
    assert "; refused at test_misuse.py:" in message
    assert _snapshot(ours) == before


def test_load_of_an_unknown_key_after_a_good_one_changes_nothing(vl: Vllm) -> None:
    ctx, good, missing = vl.context("r"), vl.key(1), vl.key(2)
    theirs = vl.theirs(4)
    _stored(theirs, [good], ctx)
    with pytest.raises(AssertionError, match="not found in cache"):
        theirs.prepare_load([good, missing], ctx)

    ours = vl.ours(4)
    _stored(ours, [good], ctx)
    before = _snapshot(ours)
    with pytest.raises(NoHostCopy) as refused:
        ours.prepare_load([good, missing], ctx)
    assert str(refused.value) == (
        "block 0000000000000002/0: load refused in unbacked (pins=0): "
        "no valid host copy to load from"
    )
    assert _snapshot(ours) == before
    assert ours.records[good].pins == 0


def test_a_key_offered_twice_in_one_store(vl: Vllm) -> None:
    """vLLM stores a new key offered twice into two chunks and never frees the first.

    Its scheduler offers distinct keys, so only a broken caller gets there;
    vLLM's write gauge then counts a store in flight forever. Ours refuses the
    offer, whatever the key's state, and changes nothing.
    """
    ctx, key, other = vl.context("r"), vl.key(1), vl.key(2)
    theirs = vl.theirs(4)
    out = theirs.prepare_store([key, other, key], ctx)
    assert [int(c) for c in out.store_spec.block_ids] == [0, 1, 2]
    theirs.complete_store([key, other, key], ctx)
    assert _gauge(theirs, "write_usage") == 0.25
    assert [int(c) for c in theirs.prepare_load([key], ctx).block_ids] == [2]  # chunk 0 is lost

    ours = vl.ours(4)
    _stored(ours, [other], ctx)
    before = _snapshot(ours)
    with pytest.raises(BadArgument) as refused:
        ours.prepare_store([key, other, key], ctx)
    assert str(refused.value) == (
        "prepare_store offered a key twice: 0000000000000001/0 (in an offer of 3 keys)"
    )
    with pytest.raises(BadArgument, match="offered a key twice"):
        ours.prepare_store([other, other], ctx)  # held: vLLM skips it twice, harmlessly
    assert _snapshot(ours) == before


def test_a_bare_key_where_the_keys_go(vl: Vllm) -> None:
    """One key passed for the keys: vLLM walks its bytes as keys, and ignores them on completion.

    vLLM's ``complete_store(key, ctx)`` finds no block for any byte and leaves
    the store in flight for good; ours refuses every such call, naming it.
    """
    ctx, key = vl.context("r"), vl.key(7)
    theirs = vl.theirs(4)
    theirs.prepare_store([key], ctx)
    theirs.complete_store(key, ctx)
    assert _gauge(theirs, "write_usage") == 0.25

    ours = vl.ours(4, strict=True)
    ours.prepare_store([key], ctx)
    before = _snapshot(ours)
    for call in (ours.prepare_load, ours.complete_load, ours.prepare_store, ours.complete_store):
        with pytest.raises(BadArgument) as refused:
            call(key, ctx)
        assert str(refused.value) == (
            f"{call.__name__}: keys must be an iterable of offload keys (bytes), "
            f"got {key!r} (bytes)"
        )
    assert _snapshot(ours) == before
    ours.complete_store([key], ctx)
    assert ours.records[key].host == "backed"


def test_a_count_that_is_no_int_is_refused_at_construction(vl: Vllm) -> None:
    """vLLM's manager takes 1.5 chunks, and fails on a store after evicting a block."""
    with pytest.raises(BadArgument) as refused:
        vl.ours(1.5)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "FsmOffloadingManager: num_chunks must be an int >= 0, got 1.5 (float)"
    )


def test_the_manager_takes_vllms_own_constructor_keywords(vl: Vllm) -> None:
    """Code that builds vLLM's CPUOffloadingManager by keyword builds the checked one alike."""
    vllms = {
        "num_chunks": 4,
        "cache_policy": "lru",
        "cache_policy_module_path": None,
        "enable_events": True,
        "store_threshold": 0,
        "max_tracker_size": 1000,
    }
    theirs, ours = vl.cpu.CPUOffloadingManager(**vllms), vl.fsm.FsmOffloadingManager(**vllms)
    ctx = vl.context("r", {vl.key(0): 0})
    for manager in (theirs, ours):
        out = manager.prepare_store([vl.key(0)], ctx)
        manager.complete_store(out.keys_to_store, ctx)
    assert [e.removed for e in ours.take_events()] == [e.removed for e in theirs.take_events()]
    assert ours.records[vl.key(0)].host == "backed"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"num_blocks": 4},
            "FsmOffloadingManager: unknown argument num_blocks; it takes num_chunks and events, "
            "strict, trail, store_threshold, max_tracker_size, request_ranks, failure_events, "
            "count_offers_once, info, enable_events, cache_policy, cache_policy_module_path",
        ),
        (
            {"events": True, "enable_events": True},
            "FsmOffloadingManager: give events or vLLM's enable_events, not both",
        ),
        (
            {"cache_policy": "arc"},
            "FsmOffloadingManager supports cache_policy 'lru' only, not 'arc' "
            "(cache_policy_module_path None)",
        ),
    ],
)
def test_arguments_neither_manager_takes_are_named(
    vl: Vllm, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(BadArgument) as refused:
        vl.fsm.FsmOffloadingManager(4, **options)
    assert str(refused.value) == message


def test_new_keys_for_a_finished_request(vl: Vllm) -> None:
    """vLLM asserts after it has pinned the load; ours refuses before anything changes."""
    ctx, key, seen = vl.context("r"), vl.key(1), vl.key(2)
    writer = vl.context("w")
    theirs = vl.theirs(4)
    _stored(theirs, [key], writer)
    theirs.prepare_store([seen], ctx)
    theirs.on_request_finished(ctx)
    with pytest.raises(AssertionError, match="after request finalization"):
        theirs.prepare_load([key], ctx)
    assert _gauge(theirs, "usage") == 0.5  # the pin stays: the block can never be evicted

    ours = vl.ours(4)
    _stored(ours, [key], writer)
    ours.prepare_store([seen], ctx)
    ours.on_request_finished(ctx)
    before = _snapshot(ours)
    for call in (ours.prepare_load, ours.prepare_store):
        with pytest.raises(BadArgument) as refused:
            call([key], ctx)
        assert str(refused.value) == (
            f"{call.__name__}: request finished: new cache keys observed after"
            f" on_request_finished ({block_label(key)})"
        )
    assert _snapshot(ours) == before
    assert ours.prepare_store([seen], ctx).keys_to_store == []  # a key it saw: no refusal


def test_complete_load_of_another_requests_load(vl: Vllm) -> None:
    """B completes the load A is running; vLLM takes A's pin and reuses its chunk under it.

    vLLM's scheduler completes a load with the context of the request that
    prepared it, so a completion naming a block only other requests load is
    misuse: vLLM unpins the block, the next store evicts it and writes into the
    chunk A's copy still reads. Ours refuses it and changes nothing.
    """
    a, b, key, k2, k3 = vl.context("A"), vl.context("B"), vl.key(1), vl.key(2), vl.key(3)
    theirs = vl.theirs(2)
    _stored(theirs, [key], a)
    theirs.prepare_load([key], a)
    theirs.complete_load([key], b)
    out = theirs.prepare_store([k2, k3], b)
    assert list(out.evicted_keys) == [key]  # A's load still reads chunk 0
    assert 0 in [int(c) for c in out.store_spec.block_ids]

    ours = vl.ours(2)
    _stored(ours, [key], a)
    ours.prepare_load([key], a)
    before = _snapshot(ours)
    with pytest.raises(NotLoading) as refused:
        ours.complete_load([key], b)
    assert str(refused.value) == (
        "block 0000000000000001/0: load_done refused in pinned (pins=1): "
        "request 'B' has no load of it in flight (its pins are other requests' loads)"
    )
    assert _snapshot(ours) == before
    assert ours.prepare_store([k2, k3], b) is None  # the pinned block is not evicted
    ours.complete_load([key], a)
    assert list(ours.prepare_store([k2, k3], b).evicted_keys) == [key]


def test_complete_load_beyond_the_requests_own_loads(vl: Vllm) -> None:
    """A and B each load a block; A completing it twice in one call is refused, nothing changed."""
    a, b, key = vl.context("A"), vl.context("B"), vl.key(4)
    ours = vl.ours(2)
    _stored(ours, [key], a)
    ours.prepare_load([key], a)
    ours.prepare_load([key], b)
    before = _snapshot(ours)
    with pytest.raises(
        NotLoading,
        match=(
            r"^block 0000000000000004/0: load_done refused in pinned \(pins=2\): request 'A' "
            r"has 1 load\(s\) of it in flight and completes 2 \(its other pins are other "
            r"requests' loads\)$"
        ),
    ):
        ours.complete_load([key, key], a)
    assert _snapshot(ours) == before
    ours.complete_load([key], b)
    ours.complete_load([key], a)
    assert ours.records[key].host == "backed"


def test_complete_store_of_another_requests_store(vl: Vllm) -> None:
    """A's late duplicate acknowledgement lands on B's store of the same key; vLLM publishes it.

    A's store fails, B offers the key again and stores it; A's duplicate
    completion (earlier vLLM schedulers sent one for a preempted request)
    arrives before B's copy lands. vLLM marks B's block ready, readable
    before its data is; ours ignores it as the duplicate it is (strict mode
    refuses it, nothing changed).
    """
    a, b, key = vl.context("A"), vl.context("B"), vl.key(8)
    theirs = vl.theirs(2)
    theirs.prepare_store([key], a)
    theirs.complete_store([key], a, False)
    assert list(theirs.prepare_store([key], b).keys_to_store) == [key]
    theirs.complete_store([key], a)
    assert theirs.lookup(key, b) == vl.base.LookupResult.HIT  # B's copy has not landed

    ours = vl.ours(2)
    ours.prepare_store([key], a)
    ours.complete_store([key], a, False)
    assert list(ours.prepare_store([key], b).keys_to_store) == [key]
    list(ours.take_events())
    ours.complete_store([key], a)
    assert ours.lookup(key, b) == vl.base.LookupResult.HIT_PENDING
    assert ours.duplicate_acks == 1
    assert list(ours.take_events()) == []
    ours.complete_store([key], b)
    assert ours.lookup(key, b) == vl.base.LookupResult.HIT

    strict = vl.ours(2, strict=True)
    strict.prepare_store([key], b)
    before = _snapshot(strict)
    for success, event in ((True, "write_done"), (False, "write_failed")):
        with pytest.raises(DuplicateAck) as refused:
            strict.complete_store([key], a, success)
        assert str(refused.value) == (
            f"block 0000000000000008/0: {event} refused in writing (pins=0): "
            "request 'A' has no store of it in flight (another request's store is)"
        )
        assert _snapshot(strict) == before
    strict.complete_store([key], b)
    assert strict.lookup(key, b) == vl.base.LookupResult.HIT


def test_eviction_during_a_load(vl: Vllm) -> None:
    """A reset evicts a block a load still reads; vLLM hands its chunk to the next store.

    vLLM's scheduler is meant to fence the load's completion; when it arrives
    anyway vLLM asserts. Ours by default matches vLLM's reuse (the fence is the
    scheduler's) and refuses the late completion with ``NotLoading``; strict
    mode refuses the reset itself while the load is in flight.
    """
    ctx, key, fresh = vl.context("r"), vl.key(5), vl.key(6)
    theirs = vl.theirs(1)
    _stored(theirs, [key], ctx)
    theirs.prepare_load([key], ctx)
    theirs.reset_cache()
    out = theirs.prepare_store([fresh], ctx)
    assert [int(c) for c in out.store_spec.block_ids] == [0]  # the chunk the load reads
    with pytest.raises(AssertionError, match="not found"):
        theirs.complete_load([key], ctx)

    ours = vl.ours(1)
    _stored(ours, [key], ctx)
    ours.prepare_load([key], ctx)
    ours.reset_cache()
    ours.prepare_store([fresh], ctx)
    with pytest.raises(
        NotLoading, match=r"^block 0000000000000005/0: load_done refused in unbacked"
    ):
        ours.complete_load([key], ctx)

    strict = vl.ours(1, strict=True)
    _stored(strict, [key], ctx)
    strict.prepare_load([key], ctx)
    before = _snapshot(strict)
    with pytest.raises(HostCopyPinned) as refused:
        strict.reset_cache()
    assert str(refused.value) == (
        "block 0000000000000005/0: evict_host refused in pinned (pins=1): "
        "the host copy is pinned by a holder"
    )
    assert _snapshot(strict) == before
    strict.complete_load([key], ctx)
    strict.reset_cache()
    assert strict.lookup(key, ctx) == vl.base.LookupResult.MISS


def test_strict_reset_refuses_a_store_in_flight(vl: Vllm) -> None:
    ctx, key = vl.context("r"), vl.key(9)
    strict = vl.ours(2, strict=True)
    strict.prepare_store([key], ctx)
    with pytest.raises(CopyInFlight, match="evict_host refused in writing"):
        strict.reset_cache()
    assert strict.lookup(key, ctx) == vl.base.LookupResult.HIT_PENDING


def test_duplicate_complete_store_tolerated_by_default_refused_in_strict_mode(
    vl: Vllm,
) -> None:
    """vLLM accepts a second ``complete_store``; the preemption path relies on it."""
    ctx, key = vl.context("r"), vl.key(4)
    theirs = vl.theirs(2)
    _stored(theirs, [key], ctx)
    theirs.complete_store([key], ctx)  # silently accepted
    theirs.complete_store([key], ctx, success=False)  # and so is a late failure

    ours = vl.ours(2)
    _stored(ours, [key], ctx)
    ours.complete_store([key], ctx)
    ours.complete_store([key], ctx, success=False)
    assert ours.duplicate_acks == 2
    assert ours.lookup(key, ctx) == vl.base.LookupResult.HIT

    strict = vl.ours(2, strict=True)
    _stored(strict, [key], ctx)
    before = _snapshot(strict)
    with pytest.raises(DuplicateAck) as refused:
        strict.complete_store([key], ctx)
    assert str(refused.value) == (
        "block 0000000000000004/0: write_done refused in backed (pins=0): "
        "no device-to-host copy in flight: a duplicate or stray acknowledgement"
    )
    with pytest.raises(DuplicateAck, match="write_failed refused in backed"):
        strict.complete_store([key], ctx, success=False)
    assert _snapshot(strict) == before


def test_the_spec_selects_the_checked_manager(vl: Vllm) -> None:
    """``spec_name``/``spec_module_path`` resolve to our spec, a vLLM ``CPUOffloadingSpec``."""
    factory: Any = __import__("vllm.v1.kv_offload.factory", fromlist=["OffloadingSpecFactory"])
    cpu_spec: Any = __import__("vllm.v1.kv_offload.cpu.spec", fromlist=["CPUOffloadingSpec"])
    found = factory.OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "FsmCpuOffloadingSpec", "spec_module_path": "fsm_cache.compat.vllm"}
    )
    assert found is vl.fsm.FsmCpuOffloadingSpec
    assert issubclass(found, cpu_spec.CPUOffloadingSpec)
    assert found.get_manager is not cpu_spec.CPUOffloadingSpec.get_manager
    assert found.get_worker is cpu_spec.CPUOffloadingSpec.get_worker
    manager = vl.ours(2)
    assert isinstance(manager, vl.base.OffloadingManager)


def _offloading_config(vl: Vllm, extra: dict[str, Any]) -> Any:
    """vLLM's normalized ``OffloadingConfig`` for one full-attention group, 16-token blocks."""
    config: Any = __import__("vllm.v1.kv_offload.config", fromlist=["OffloadingConfig"])
    return config.OffloadingConfig(
        groups=(config.OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id="engine-0",
        model=config.OffloadingModelConfig("tiny", "float16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=config.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def test_the_spec_sizes_the_checked_manager_as_vllm_sizes_its_own(vl: Vllm) -> None:
    cpu_spec: Any = __import__("vllm.v1.kv_offload.cpu.spec", fromlist=["CPUOffloadingSpec"])
    extra = {"cpu_bytes_to_use": 64 * 4096, "fsm_strict": True, "fsm_trail": True}
    vllms = cpu_spec.CPUOffloadingSpec(_offloading_config(vl, extra))
    spec = vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra))
    ours = spec.get_manager()
    assert ours is spec.get_manager()
    assert isinstance(ours, vl.fsm.FsmOffloadingManager)
    assert ours.num_chunks == spec.num_chunks == vllms.num_chunks == 64
    assert ours.strict
    assert ours.engine.trail
    assert ours.events is not None
    theirs = vllms.get_manager()
    if hasattr(theirs, "config_info"):  # vLLM 0.33+
        assert list(ours.config_info()) == list(theirs.config_info())


def test_the_spec_refuses_eviction_policies_other_than_lru(vl: Vllm) -> None:
    from fsm_cache.errors import BadArgument

    extra = {"cpu_bytes_to_use": 64 * 4096, "eviction_policy": "arc"}
    with pytest.raises(BadArgument, match="supports eviction_policy 'lru' only, not 'arc'"):
        vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()


def test_the_spec_takes_lru_with_a_policy_module_path_as_vllm_does(vl: Vllm) -> None:
    """vLLM resolves a registered name first: ``lru`` is its LRU whatever the module path says."""
    policies: Any = __import__(
        "vllm.v1.kv_offload.cpu.policies.factory", fromlist=["CachePolicyFactory"]
    )
    lru: Any = __import__("vllm.v1.kv_offload.cpu.policies.lru", fromlist=["LRUCachePolicy"])
    extra = {
        "cpu_bytes_to_use": 64 * 4096,
        "eviction_policy": "lru",
        "cache_policy_module_path": "no.such.module",
    }
    found = policies.CachePolicyFactory.get_cache_policy_cls("lru", "no.such.module")
    assert found is lru.LRUCachePolicy
    ours = vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert isinstance(ours, vl.fsm.FsmOffloadingManager)
    assert ours.num_chunks == 64


def test_the_spec_refuses_an_out_of_tree_policy(vl: Vllm) -> None:
    from fsm_cache.errors import BadArgument

    extra = {
        "cpu_bytes_to_use": 64 * 4096,
        "eviction_policy": "MyPolicy",
        "cache_policy_module_path": "my.policies",
    }
    with pytest.raises(BadArgument) as refused:
        vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert str(refused.value) == (
        "FsmCpuOffloadingSpec supports eviction_policy 'lru' only, not 'MyPolicy' "
        "(cache_policy_module_path 'my.policies')"
    )


@pytest.mark.parametrize(
    ("strict", "trail", "expected"),
    [("false", "0", (False, False)), ("True", "on", (True, True)), (None, False, (False, False))],
)
def test_the_spec_reads_on_off_words_as_flags(
    vl: Vllm, strict: object, trail: object, expected: tuple[bool, bool]
) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 64 * 4096, "fsm_trail": trail}
    if strict is not None:
        extra["fsm_strict"] = strict
    ours = vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert (ours.strict, ours.engine.trail) == expected  # "false" is not a true string


def test_the_spec_refuses_a_flag_that_is_no_on_off_word(vl: Vllm) -> None:
    from fsm_cache.errors import BadArgument

    extra = {"cpu_bytes_to_use": 64 * 4096, "fsm_strict": "maybe"}
    with pytest.raises(BadArgument) as refused:
        vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert str(refused.value) == (
        "kv_connector_extra_config['fsm_strict'] must be true or false, got 'maybe'"
    )


@pytest.mark.parametrize(
    ("name", "value", "least"),
    [
        ("store_threshold", "abc", 0),
        ("store_threshold", 2.5, 0),
        ("store_threshold", "-1", 0),
        ("store_threshold", True, 0),
        ("max_tracker_size", "0", 1),
        ("max_tracker_size", None, 1),
    ],
)
def test_the_spec_refuses_a_count_that_is_no_integer(
    vl: Vllm, name: str, value: object, least: int
) -> None:
    """vLLM's spec reads the counts with ``int()``: ``'abc'`` fails there, 2.5 becomes 2."""
    extra = {"cpu_bytes_to_use": 64 * 4096, name: value}
    with pytest.raises(BadArgument) as refused:
        vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert str(refused.value) == (
        f"kv_connector_extra_config[{name!r}] must be an integer >= {least}, got {value!r}"
    )


def test_the_spec_reads_counts_as_vllm_does(vl: Vllm) -> None:
    """Digits in a string (the command line's) and a whole float are counts, as in vLLM."""
    extra = {"cpu_bytes_to_use": 64 * 4096, "store_threshold": " 3", "max_tracker_size": 8.0}
    ours = vl.fsm.FsmCpuOffloadingSpec(_offloading_config(vl, extra)).get_manager()
    assert (ours.store_threshold, ours.max_tracker_size) == (3, 8)


def test_get_load_source_checks_its_key_and_context(vl: Vllm) -> None:
    """``get_load_source(None, False)`` answered ``HOST``: every call taking a context checks it."""
    ours, ctx = vl.ours(4), vl.context("r")
    with pytest.raises(BadArgument) as refused:
        ours.get_load_source(vl.key(1), False)
    assert str(refused.value).startswith("get_load_source: req_context must be a request context")
    with pytest.raises(BadArgument) as refused:
        ours.get_load_source(None, ctx)
    assert str(refused.value) == (
        "get_load_source: key must be an offload key (bytes), got None (NoneType)"
    )
    assert ours.get_load_source(vl.key(1), ctx).name == "HOST"
