"""Ours against vLLM's own CPU offloading manager, on identical random call sequences.

A driver plays the scheduler's side of the contract (what vLLM's connector
does): ``complete_store`` only for a prepared store job (and again, late, for
one already completed, as a preempted request's blocks are); ``prepare_load``
only of keys that look up as ``HIT``; one ``complete_load`` per load job;
``reset_cache`` only with no job in flight; new keys only for requests not yet
finished. Every call goes to both managers and every answer must be equal:
lookup results, ``None`` or the keys to store with their chunk ids and the
evicted keys, loaded chunk ids, and the event stream (with the request a
store event names, from vLLM 0.34). The calls are the installed vLLM's:
``touch`` up to 0.33; from 0.34, which has none, a request's re-offers of
keys it offered before instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from fsm_cache.errors import FsmCacheError

from .conftest import Vllm


CALLS = 12_000
"""Calls per sequence; each test's sequences add up to well over 10,000."""


def _spec_ids(spec: Any) -> list[int]:
    return [int(i) for i in spec.block_ids]


def _store(out: Any) -> Any:
    if out is None:
        return None
    return (list(out.keys_to_store), _spec_ids(out.store_spec), list(out.evicted_keys))


def _events(events: Any) -> list[tuple[Any, ...]]:
    """Each event's fields, its request's id for the request context of vLLM 0.34's stores."""
    return [
        (
            list(e.keys),
            e.medium,
            e.removed,
            getattr(e, "metadata_only", False),
            getattr(e, "removal_expected", False),
            getattr(getattr(e, "req_context", None), "req_id", None),
        )
        for e in events
    ]


def _stats(stats: Any) -> dict[str, Any]:
    return dict(stats.data)


def _snapshot(ours: Any) -> tuple[Any, ...]:
    """Everything of ours a refused call must leave as it was, trails included."""
    records = {k: (r.host, r.pins, r.chunk, tuple(r.trail or ())) for k, r in ours.records.items()}
    recency = (dict(ours.recency.ranks), set(ours.recency.evictable))
    events = list(ours.events) if ours.events is not None else None
    counts = dict(ours.counts) if ours.counts is not None else None
    return records, recency, list(ours.free), ours.allocated, events, counts, ours.writing


@dataclass
class Driver:
    """Feeds one random, contract-respecting call sequence to both managers."""

    vl: Vllm
    theirs: Any
    ours: Any
    rng: random.Random
    num_blocks: int
    groups: int = 1
    calls: int = 0
    requests: list[Any] = field(default_factory=list)
    stores: list[list[bytes]] = field(default_factory=list)
    stored: list[list[bytes]] = field(default_factory=list)
    loads: list[list[bytes]] = field(default_factory=list)
    counter: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    steps: tuple[tuple[float, Callable[[Driver, Request], None]], ...] = field(init=False)

    def __post_init__(self) -> None:
        self.steps = steps(self.vl)

    def both(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Call ``name`` on both managers; return both answers."""
        self.calls += 1
        self.seen[name] = self.seen.get(name, 0) + 1
        return getattr(self.theirs, name)(*args, **kwargs), getattr(self.ours, name)(
            *args, **kwargs
        )

    def keys(self, request: Any, n: int) -> list[bytes]:
        """A run of ``n`` consecutive keys of one group, as a request's blocks are."""
        group = self.rng.randrange(self.groups)
        start = self.rng.randrange(self.num_blocks - n + 1)
        keys = [self.vl.key(b, group) for b in range(start, start + n)]
        if request.positioned:
            for key, block in zip(keys, range(start, start + n), strict=True):
                request.ctx.set_offload_key_position(key, 16 * (block + 1))
        return keys

    def new_request(self) -> None:
        self.counter += 1
        ctx = self.vl.context(f"req-{self.counter}")
        request = Request(ctx, positioned=self.rng.random() < 0.7)
        a, b = self.both("on_new_request", ctx)
        assert a == b
        self.requests.append(request)

    def step(self) -> None:
        """One random call (a few for a multi-key lookup or load), compared."""
        if len(self.requests) < 2 or self.rng.random() < 0.03:
            self.new_request()
            return
        request = self.rng.choice(self.requests)
        roll = self.rng.random()
        for bound, action in self.steps:
            if roll < bound:
                action(self, request)
                return

    def lookups(self, request: Any) -> None:
        for key in self.keys(request, self.rng.randint(1, 6)):
            a, b = self.both("lookup", key, request.ctx)
            assert a == b, key

    def touch(self, request: Any) -> None:
        self.both("touch", self.keys(request, self.rng.randint(1, 6)), request.ctx)

    def prepare_store(self, request: Any) -> None:
        keys = self.keys(request, self.rng.randint(1, 8))
        request.offers.append(keys)
        self.offer(request, keys)

    def reoffer(self, request: Any) -> None:
        """The request offers again what it offered before: a retry, or after a preemption."""
        if request.offers:
            self.seen["reoffer"] = self.seen.get("reoffer", 0) + 1
            self.offer(request, self.rng.choice(request.offers))

    def offer(self, request: Any, keys: list[bytes]) -> None:
        a, b = self.both("prepare_store", keys, request.ctx)
        assert _store(a) == _store(b), keys
        if a is not None and a.keys_to_store:
            self.stores.append(list(a.keys_to_store))

    def complete_store(self, request: Any) -> None:
        if not self.stores:
            return
        job = self.stores.pop(self.rng.randrange(len(self.stores)))
        success = self.rng.random() < 0.85
        self.both("complete_store", job, request.ctx, success)
        if success:
            self.stored.append(job)

    def duplicate_store(self, request: Any) -> None:
        """A late duplicate, as for a preempted request's blocks: tolerated by both."""
        if self.stored:
            self.both("complete_store", self.rng.choice(self.stored), request.ctx)

    def complete_load(self, request: Any) -> None:
        if self.loads:
            job = self.loads.pop(self.rng.randrange(len(self.loads)))
            self.both("complete_load", job, request.ctx)

    def finish_request(self, request: Any) -> None:
        self.both("on_request_finished", request.ctx)
        self.requests.remove(request)

    def take_events(self, request: Any) -> None:
        del request
        a, b = self.both("take_events")
        assert _events(a) == _events(b)
        a, b = self.both("get_stats")
        assert _stats(a) == _stats(b)

    def reset(self, request: Any) -> None:
        self.drain(request.ctx)
        self.both("reset_cache")
        self.stored.clear()

    def load(self, request: Any) -> None:
        """Load the longest prefix of a run that looks up as ``HIT`` (the connector's rule)."""
        hits = []
        for key in self.keys(request, self.rng.randint(1, 6)):
            a, b = self.both("lookup", key, request.ctx)
            assert a == b
            if a != self.vl.base.LookupResult.HIT:
                break
            hits.append(key)
        if hits:
            a, b = self.both("prepare_load", hits, request.ctx)
            assert _spec_ids(a) == _spec_ids(b)
            self.loads.append(hits)

    def misuse(self, request: Any) -> None:
        """A call vLLM would assert on, to ours only: refused, typed, and nothing changed.

        A ``complete_load`` of a block with no load in flight, the same block
        twice in one ``complete_load`` when it has one load in flight, or a
        ``prepare_load`` of a block never stored. Trails are part of what must
        not change: a refusal checked on scratch copies leaves no note.
        """
        ours, rng = self.ours, self.rng
        key = self.keys(request, 1)[0]
        rec = ours.records.get(key)
        if rec is not None and rec.host == "pinned" and rec.pins == 1 and rng.random() < 0.5:
            name, args = "complete_load", ([key, key], request.ctx)
        elif rec is None:
            name, args = "prepare_load", ([key], request.ctx)
        elif rec.host != "pinned":
            name, args = "complete_load", ([key], request.ctx)
        else:
            return
        before = _snapshot(ours)
        with pytest.raises(FsmCacheError):
            getattr(ours, name)(*args)
        assert _snapshot(ours) == before, (name, key)
        self.seen["misuse"] = self.seen.get("misuse", 0) + 1

    def drain(self, ctx: Any) -> None:
        """Complete every job in flight (before a reset: the scheduler fences them)."""
        while self.stores:
            self.both("complete_store", self.stores.pop(), ctx)
        while self.loads:
            self.both("complete_load", self.loads.pop(), ctx)

    def finish(self) -> None:
        """Drain the jobs, compare the events and every key's lookup."""
        ctx = self.vl.context("final")
        self.drain(ctx)
        a, b = self.both("take_events")
        assert _events(a) == _events(b)
        for group in range(self.groups):
            for block in range(self.num_blocks):
                key = self.vl.key(block, group)
                a, b = self.both("lookup", key, ctx)
                assert a == b, key


def steps(vl: Vllm) -> tuple[tuple[float, Callable[[Driver, Request], None]], ...]:
    """Each step's cumulative probability bound, for the installed vLLM.

    Up to 0.33 the manager has ``touch``; 0.34's has none (a request's loads and
    stores are its accesses, committed to the LRU order when it finishes), and
    the share goes to re-offers, which 0.34 no longer counts again toward
    ``store_threshold``.
    """
    recency = Driver.touch if hasattr(vl.base.OffloadingManager, "touch") else Driver.reoffer
    return (
        (0.30, Driver.lookups),
        (0.45, recency),
        (0.62, Driver.prepare_store),
        (0.74, Driver.complete_store),
        (0.76, Driver.duplicate_store),
        (0.86, Driver.load),
        (0.92, Driver.complete_load),
        (0.95, Driver.misuse),
        (0.97, Driver.finish_request),
        (0.995, Driver.take_events),
        (1.0, Driver.reset),
    )


@dataclass
class Request:
    """A request's context, whether the scheduler recorded token positions, its offers."""

    ctx: Any
    positioned: bool
    offers: list[list[bytes]] = field(default_factory=list)


@pytest.mark.parametrize(
    "case",
    [
        (1, 16, 48, 1, 0, False),
        (2, 8, 40, 2, 0, False),
        (3, 32, 64, 1, 0, False),
        (4, 12, 40, 1, 2, False),
        (5, 12, 48, 2, 0, True),
    ],
    ids=lambda c: "seed{}-chunks{}-blocks{}-groups{}-threshold{}-trail{}".format(*c),
)
def test_same_answers_as_vllm(vl: Vllm, case: tuple[int, int, int, int, int, bool]) -> None:
    seed, num_chunks, num_blocks, groups, threshold, trail = case
    theirs = vl.theirs(num_chunks, store_threshold=threshold)
    ours = vl.ours(num_chunks, store_threshold=threshold, trail=trail)
    driver = Driver(vl, theirs, ours, random.Random(seed), num_blocks, groups)
    while driver.calls < CALLS:
        driver.step()
    driver.finish()
    assert driver.calls >= 10_000
    # The sequence exercised every call, evictions and refusals to store included.
    recency = "touch" if hasattr(theirs, "touch") else "reoffer"
    for name in (
        "lookup",
        recency,
        "prepare_store",
        "complete_store",
        "prepare_load",
        "complete_load",
        "on_request_finished",
        "take_events",
        "reset_cache",
        "misuse",
    ):
        assert driver.seen.get(name, 0) > 0, name
    assert ours.duplicate_acks > 0


def test_the_differential_driver_sees_evictions_and_full_caches(vl: Vllm) -> None:
    """The sizes above make vLLM evict and refuse stores, so those paths are compared too."""
    theirs, ours = vl.theirs(8), vl.ours(8)
    driver = Driver(vl, theirs, ours, random.Random(2), 40, 2)
    evicted = refused = 0
    original = driver.both

    def counting(name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        nonlocal evicted, refused
        a, b = original(name, *args, **kwargs)
        if name == "prepare_store":
            refused += a is None
            evicted += bool(a is not None and a.evicted_keys)
        return a, b

    driver.both = counting  # type: ignore[method-assign]
    while driver.calls < 3000:
        driver.step()
    assert evicted > 10
    assert refused > 10


def test_ours_has_the_calls_vllms_manager_has(vl: Vllm) -> None:
    """A drop-in answers to the same names: vLLM 0.34's manager has no ``touch``, nor has ours."""
    theirs, ours = vl.theirs(4), vl.ours(4)
    names = {n for n in dir(vl.base.OffloadingManager) if not n.startswith("_")} | {"touch"}
    assert {n for n in names if hasattr(ours, n)} == {n for n in names if hasattr(theirs, n)}


def test_touch_is_gone_from_vllm_0_34_and_says_what_replaced_it(vl: Vllm) -> None:
    ours, ctx = vl.ours(4), vl.context("r")
    if hasattr(vl.base.OffloadingManager, "touch"):
        pytest.skip(f"vLLM {vl.version}'s OffloadingManager still has touch")
    with pytest.raises(AttributeError) as missing:
        ours.touch([vl.key(1)], ctx)
    assert str(missing.value) == (
        "'FsmOffloadingManager' object has no attribute 'touch': vLLM 0.34 removed "
        "OffloadingManager.touch; a request's loads and stores are its accesses, "
        "committed to the LRU order by on_request_finished"
    )
