"""Ours against vLLM's own CPU offloading manager, on identical random call sequences.

A driver plays the scheduler's side of the contract (what vLLM's connector
does): ``complete_store`` only for a prepared store job, with the context of
the request that prepared it, finished or not (and again, late, for one
already completed, as a preempted request's blocks are, or for keys never
offered: a stray acknowledgement both ignore); ``prepare_load`` only of keys
that look up as ``HIT``; one ``complete_load`` per load job; ``reset_cache``
with the jobs in flight either completed first or never completed (vLLM's
scheduler fences them); no call but completions for a finished request. Offers
are runs of one KV group or one block in every group (the partial-tail path),
sometimes empty; a load may name a key twice and a completion repeat a key;
a request records token positions for all, none or some of its keys. Every
call goes to both managers and every answer must be equal: lookup results,
``None`` or the keys to store with their chunk ids and the evicted keys,
loaded chunk ids, the statistics and the event stream (with the request a
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
class Request:
    """A request's context, which of its keys get token positions, its offers.

    Attributes:
        ctx: vLLM's request context.
        positions: ``all``, ``none`` or ``some`` (each key by a coin toss, as a
            scheduler that has not recorded every position yet).
        offers: The runs of keys it offered.
        current: The managers hold its state: a call that records accesses made it
            since the last reset (lookups, touches and completions record none).
    """

    ctx: Any
    positions: str
    offers: list[list[bytes]] = field(default_factory=list)
    current: bool = True


@dataclass
class Job:
    """A store or load job in flight: its keys and the request that prepared it."""

    keys: list[bytes]
    request: Request


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
    requests: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    stores: list[Job] = field(default_factory=list)
    stored: list[Job] = field(default_factory=list)
    loads: list[Job] = field(default_factory=list)
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

    def note(self, name: str) -> None:
        self.seen[name] = self.seen.get(name, 0) + 1

    def keys(self, request: Request, n: int) -> list[bytes]:
        """A run of ``n`` consecutive keys of one group, as a request's blocks are.

        Now and then instead: no key, or one block in every group (the keys a
        partial tail is offered with).
        """
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            self.note("empty")
            return []
        if roll < 0.08 and self.groups > 1:
            self.note("across_groups")
            block = rng.randrange(self.num_blocks)
            keys = [self.vl.key(block, group) for group in range(self.groups)]
            blocks = [block] * self.groups
        else:
            group, n = rng.randrange(self.groups), min(n, self.num_blocks)
            start = rng.randrange(self.num_blocks - n + 1)
            blocks = list(range(start, start + n))
            keys = [self.vl.key(b, group) for b in blocks]
        for key, block in zip(keys, blocks, strict=True):
            if request.positions == "all" or (request.positions == "some" and rng.random() < 0.5):
                request.ctx.set_offload_key_position(key, 16 * (block + 1))
        return keys

    def new_request(self) -> None:
        self.counter += 1
        ctx = self.vl.context(f"req-{self.counter}")
        request = Request(ctx, self.rng.choices(("all", "none", "some"), (6, 2, 2))[0])
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

    def lookups(self, request: Request) -> None:
        for key in self.keys(request, self.rng.randint(1, 6)):
            a, b = self.both("lookup", key, request.ctx)
            assert a == b, key

    def touch(self, request: Request) -> None:
        self.both("touch", self.keys(request, self.rng.randint(1, 6)), request.ctx)

    def prepare_store(self, request: Request) -> None:
        keys = self.keys(request, self.rng.randint(1, 8))
        request.offers.append(keys)
        self.offer(request, keys)

    def reoffer(self, request: Request) -> None:
        """The request offers again what it offered before: a retry, or after a preemption."""
        if request.offers:
            self.note("reoffer")
            self.offer(request, self.rng.choice(request.offers))

    def offer(self, request: Request, keys: list[bytes]) -> None:
        a, b = self.both("prepare_store", keys, request.ctx)
        request.current = True
        assert _store(a) == _store(b), keys
        if a is not None and a.keys_to_store:
            self.stores.append(Job(list(a.keys_to_store), request))

    def complete_store(self, request: Request) -> None:
        """Complete a store job, as its request's (which may have finished since)."""
        del request
        if not self.stores:
            return
        job = self.stores.pop(self.rng.randrange(len(self.stores)))
        success = self.rng.random() < 0.85
        keys = job.keys
        if self.rng.random() < 0.05:
            self.note("repeated_ack")
            keys = [*keys, keys[0]]
        self.both("complete_store", keys, job.request.ctx, success)
        if success:
            self.stored.append(job)

    def duplicate_store(self, request: Request) -> None:
        """A late duplicate, as for a preempted request's blocks, or a stray one: both ignore it.

        Keys another request is storing are left out: vLLM would complete that
        store for it, ours ignores them (``misuse`` sends those to ours alone).
        """
        if self.stored and self.rng.random() < 0.7:
            job = self.rng.choice(self.stored)
            keys, ack = self.own(job.keys, job.request), job.request
            self.both("complete_store", keys, ack.ctx)
        else:
            self.note("stray_ack")
            keys = self.own(self.keys(request, self.rng.randint(1, 3)), request)
            self.both("complete_store", keys, request.ctx, self.rng.random() < 0.5)

    def own(self, keys: list[bytes], request: Request) -> list[bytes]:
        """``keys`` less those a store job of another request is writing."""
        foreign = {k for job in self.stores if job.request is not request for k in job.keys}
        return [key for key in keys if key not in foreign]

    def complete_load(self, request: Request) -> None:
        del request
        if self.loads:
            job = self.loads.pop(self.rng.randrange(len(self.loads)))
            self.both("complete_load", job.keys, job.request.ctx)

    def finish_request(self, request: Request) -> None:
        """Finish a request: from now on only its jobs' completions name it.

        The managers mark it finished only if they hold its state: a request
        untouched since a reset finishes as one they never saw.
        """
        self.both("on_request_finished", request.ctx)
        self.requests.remove(request)
        if request.current:
            self.finished = [*self.finished[-7:], request]

    def take_events(self, request: Request) -> None:
        del request
        a, b = self.both("take_events")
        assert _events(a) == _events(b)
        a, b = self.both("get_stats")
        assert _stats(a) == _stats(b)

    def reset(self, request: Request) -> None:
        """Reset, the jobs in flight completed first or, as vLLM's scheduler fences them, never."""
        if self.rng.random() < 0.5:
            self.drain()
        else:
            self.note("abandoned")
            self.stores.clear()
            self.loads.clear()
        self.both("reset_cache")
        self.stored.clear()
        # The managers forget every request's state (vLLM's scheduler drops finished ones).
        self.finished.clear()
        for live in self.requests:
            live.current = False
        del request

    def load(self, request: Request) -> None:
        """Load the longest prefix of a run that looks up as ``HIT`` (the connector's rule).

        Now and then the load names a key twice (vLLM pins it twice; the job's
        completion unpins it twice), or no key at all.
        """
        hits = []
        for key in self.keys(request, self.rng.randint(1, 6)):
            a, b = self.both("lookup", key, request.ctx)
            assert a == b
            if a != self.vl.base.LookupResult.HIT:
                break
            hits.append(key)
        if hits and self.rng.random() < 0.2:
            self.note("repeated_load")
            hits.append(self.rng.choice(hits))
        if hits or self.rng.random() < 0.05:
            a, b = self.both("prepare_load", hits, request.ctx)
            assert _spec_ids(a) == _spec_ids(b)
            request.current = True
            self.loads.append(Job(hits, request))

    def misuse(self, request: Request) -> None:
        """A call vLLM would assert on or be corrupted by, to ours only: refused, nothing changed.

        A ``complete_load`` of a block with no load in flight, the same block
        twice in one ``complete_load`` when it has one load in flight, a
        ``prepare_load`` of a block never stored, a key offered twice in one
        ``prepare_store``, or a finished request offering a key it never saw.
        Trails are part of what must not change: a refusal checked on scratch
        copies leaves no note.
        """
        ours, rng = self.ours, self.rng
        key = self.keys(request, 1)[:1] or [self.vl.key(0)]
        rec = ours.records.get(key[0])
        roll = rng.random()
        if roll < 0.15:
            name, args, kind = "prepare_store", ([*key, *key], request.ctx), "offer_twice"
        elif roll < 0.3 and self.finished and ours.store_threshold < 2:
            # A block no request ever sees: new to the finished request, so vLLM would record it.
            fresh = [self.vl.key(self.num_blocks + 1)]
            finished = rng.choice(self.finished).ctx
            name, args, kind = "prepare_store", (fresh, finished), "finished_new_key"
        elif rec is not None and rec.host == "pinned" and rec.pins == 1 and rng.random() < 0.5:
            name, args, kind = "complete_load", ([*key, *key], request.ctx), "misuse"
        elif rec is None:
            name, args, kind = "prepare_load", (key, request.ctx), "misuse"
        elif rec.host != "pinned":
            name, args, kind = "complete_load", (key, request.ctx), "misuse"
        else:
            return
        before = _snapshot(ours)
        with pytest.raises(FsmCacheError):
            getattr(ours, name)(*args)
        assert _snapshot(ours) == before, (name, key)
        self.note(kind)

    def drain(self) -> None:
        """Complete every job in flight, each as its request's."""
        while self.stores:
            job = self.stores.pop()
            self.both("complete_store", job.keys, job.request.ctx)
        while self.loads:
            job = self.loads.pop()
            self.both("complete_load", job.keys, job.request.ctx)

    def finish(self) -> None:
        """Drain the jobs, compare the events, the statistics and every key's lookup."""
        ctx = self.vl.context("final")
        self.drain()
        a, b = self.both("take_events")
        assert _events(a) == _events(b)
        a, b = self.both("get_stats")
        assert _stats(a) == _stats(b)
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


def run(vl: Vllm, case: tuple[int, ...], calls: int, *, trail: bool = False) -> Driver:
    """Drive both managers through one sequence of ``calls`` calls; return the driver."""
    seed, num_chunks, num_blocks, groups, threshold, tracker = case
    options = {"store_threshold": threshold, "max_tracker_size": tracker}
    theirs = vl.theirs(num_chunks, **options)
    ours = vl.ours(num_chunks, trail=trail, **options)
    driver = Driver(vl, theirs, ours, random.Random(seed), num_blocks, groups)
    while driver.calls < calls:
        driver.step()
    driver.finish()
    return driver


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
    *sizes, trail = case
    driver = run(vl, (*sizes, 64_000), CALLS, trail=trail)
    assert driver.calls >= 10_000
    # The sequence exercised every call, evictions and refusals to store included.
    recency = "touch" if hasattr(driver.theirs, "touch") else "reoffer"
    names = [
        "lookup",
        recency,
        "prepare_store",
        "complete_store",
        "prepare_load",
        "complete_load",
        "on_request_finished",
        "take_events",
        "reset_cache",
        "abandoned",
        "empty",
        "repeated_ack",
        "stray_ack",
        "repeated_load",
        "misuse",
        "offer_twice",
    ]
    if driver.groups > 1:
        names.append("across_groups")
    if driver.ours.store_threshold < 2:
        names.append("finished_new_key")
    for name in names:
        assert driver.seen.get(name, 0) > 0, name
    assert driver.ours.duplicate_acks > 0


@pytest.mark.parametrize(
    "case",
    [
        (6, 0, 8, 1, 0, 64_000),
        (7, 1, 12, 2, 0, 64_000),
        (8, 1, 12, 1, 3, 64_000),
        (9, 4, 24, 2, 2, 3),
        (10, 2, 6, 1, 2, 1),
        (11, 3, 16, 2, 3, 6),
    ],
    ids=lambda c: "seed{}-chunks{}-blocks{}-groups{}-threshold{}-tracker{}".format(*c),
)
def test_same_answers_as_vllm_at_the_edges(vl: Vllm, case: tuple[int, ...]) -> None:
    """No chunk, one chunk, a higher threshold, offer counts that outgrow a tiny tracker."""
    driver = run(vl, case, 4_000)
    assert driver.seen.get("prepare_store", 0) > 100
    if case[1] > 0:
        assert driver.seen.get("prepare_load", 0) > 0


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
