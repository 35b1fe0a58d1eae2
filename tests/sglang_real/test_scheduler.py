"""SGLang's caches driven the way its scheduler drives them, stock and patched, compared call by call.

Where ``test_differential`` drives the caches' own methods, this drives what
SGLang's scheduler calls: ``match_prefix`` (with the keyword arguments the
scheduler passes), the lock walks (``inc_lock_ref``/``dec_lock_ref``, and on
0.5.23 ``lock``/``unlock``), a request's KV row in a ``req_to_token`` pool,
chunked prefill (0.5.6 ``cache_unfinished_req``, 0.5.23 ``checkpoint``), the
finish (0.5.6 ``cache_finished_req``, with and without insert; 0.5.23
``checkpoint`` then the row freed and the lock released), eviction (and on
0.5.23 ``evict_for_alloc`` when an allocation is short), the read-outs
(``evictable_size``, ``protected_size``, ``total_size``, ``pretty_print``,
``all_values_flatten``) and ``reset`` between requests, over every eviction
policy. Every return value, every exception and every read-out must be the
same stock and patched."""

from __future__ import annotations

import contextlib
import functools
import io
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsm_cache.compat.sglang import patch

from .conftest import Api, Clock, build_hiradix
from .fakes import FakeAllocator, FakeReq, FakeReqToTokenPool
from .test_differential import Trace, attempt, first_parting, ints, snapshot


POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority")
"""SGLang's eviction policies (``--radix-eviction-policy``), each run on one page size."""

STEPS = ("admit", "decode", "chunk", "finish", "evict", "second holder", "reset")
"""What the scheduler does, each a step of :func:`run`."""

HOST_STEPS = ("start", "settle", "evict_host")
"""What it does besides with a host tier: start the loads, poll the copies, evict host copies."""


class Scheduler:
    """One seed's requests through ``cache`` as SGLang's scheduler makes its calls."""

    def __init__(self, sg: Api, cache: Any, allocator: FakeAllocator, seed: int) -> None:
        self.sg, self.cache, self.allocator = sg, cache, allocator
        self.rnd = random.Random(seed)
        self.pool = FakeReqToTokenPool(rows=8, width=40)
        cache.req_to_token_pool = self.pool
        self.running: list[FakeReq] = []
        self.prefixes = [
            [self.rnd.randint(1, 3) for _ in range(self.rnd.randint(2, 8))] for _ in range(4)
        ]
        self.rid = 0

    def tokens(self) -> list[int]:
        rnd = self.rnd
        prefix = rnd.choice(self.prefixes)
        tokens = prefix[: rnd.randint(0, len(prefix))] + [
            rnd.randint(1, 4) for _ in range(rnd.randint(1, 10))
        ]
        return tokens if len(tokens) > 1 else [*tokens, 1]

    # -- SGLang's calls, spelled per version --------------------------------

    def match(self, tokens: list[int], extra_key: str | None) -> tuple[Any, Any, Any, int]:
        """``(prefix slots, last device node, last host node, host hit length)``."""
        sg, cache = self.sg, self.cache
        key = sg.rc.RadixKey(sg.key(tokens).token_ids, extra_key)
        if sg.new:
            found = cache.match_prefix(sg.base.MatchPrefixParams(key=key))
            slots = cache.path_device_indices(found.last_device_node)[: found.device_prefix_len]
        else:  # the scheduler's own spelling (schedule_policy.py)
            found = cache.match_prefix(rid=f"r{self.rid}", key=key)
            slots = found.device_indices
        host_hit = int(getattr(found, "host_hit_length", 0))
        return slots, found.last_device_node, found.last_host_node, host_hit

    def lock(self, req: FakeReq) -> Any:
        if self.sg.new:
            req.lock = self.cache.lock(req.last_node)
            return req.lock.receipt
        return self.cache.inc_lock_ref(req.last_node)

    def unlock(self, req: FakeReq) -> Any:
        if self.sg.new:
            lock, req.lock = req.lock, None
            return self.cache.unlock(lock)
        return self.cache.dec_lock_ref(req.last_node)

    def evict(self, tokens: int) -> Any:
        if self.sg.new:
            return repr(self.cache.evict(self.sg.base.EvictParams(num_tokens=tokens)))
        return self.cache.evict(tokens)

    # -- steps ----------------------------------------------------------------

    def admit(self) -> Any:
        """Match a new request, load back its host hit, lock it and give it a KV row."""
        self.rid += 1
        tokens = self.tokens()
        extra = self.rnd.choice([None, None, None, "lora"])
        slots, last, last_host, host_hit = self.match(tokens[:-1], extra)
        loaded = None
        if host_hit > 0:  # schedule_policy: load back under a lock on the device match
            device_last = last
            self.cache.inc_lock_ref(device_last)
            try:
                new, last = self.cache.init_load_back(last_host, host_hit)
            finally:
                self.cache.dec_lock_ref(device_last)
            loaded = ints(new)
            slots = torch.cat([slots, new])
        req = FakeReq(self.rid, tokens, extra, last, arrays=self.sg.new)
        req.priority = self.rnd.choice([None, 0, 1, 5])
        receipt = self.lock(req)
        need = len(tokens) - len(slots)
        new_slots = self.alloc(need)
        row = self.pool.alloc()
        if new_slots is None or row is None:
            self.unlock(req)
            if new_slots is not None:
                self.allocator.free(new_slots)
            return "no room", tokens, ints(slots), loaded
        req.req_pool_idx = row
        self.pool.req_to_token[row, : len(slots)] = slots.to(torch.int32)
        self.pool.req_to_token[row, len(slots) : len(tokens)] = new_slots.to(torch.int32)
        req.cache_protected_len = len(slots)
        req.prefix_indices = slots
        self.running.append(req)
        return tokens, ints(slots), loaded, repr_receipt(receipt)

    def alloc(self, need: int) -> Any:
        """``need`` device slots, evicting first when too few are free (None: still too few)."""
        slots = self.allocator.alloc(need)
        if slots is None:
            if self.sg.new:  # 0.5.23's allocation path evicts through evict_for_alloc
                self.cache.evict_for_alloc(self.sg.base.EvictParams(num_tokens=need))
            else:
                self.evict(need)
            slots = self.allocator.alloc(need)
        return slots

    def decode(self) -> Any:
        """One more output token, its slot in the request's row."""
        req = self.rnd.choice(self.running)
        if req.length() >= self.pool.width:
            return "row full"
        slot = self.alloc(1)
        if slot is None:
            return "no room"
        self.pool.req_to_token[req.req_pool_idx, req.length()] = int(slot[0])
        req.output_ids.append(self.rnd.randint(1, 4))
        return req.length()

    def chunk(self) -> Any:
        """The request's KV so far goes into the tree; the request keeps going."""
        req = self.rnd.choice(self.running)
        req.refresh()
        if self.sg.new:
            self.cache.checkpoint(req, up_to=req.length())
        else:
            self.cache.cache_unfinished_req(req)
        return req.cache_protected_len, ints(req.prefix_indices), self.row(req)

    def finish(self) -> Any:
        """The request ends: its KV goes into the tree (or not), its row and lock are released."""
        req = self.running.pop(self.rnd.randrange(len(self.running)))
        insert = self.rnd.random() < 0.8
        req.refresh()
        row = self.row(req)
        if self.sg.new:
            if insert:
                self.cache.checkpoint(req, up_to=req.length())
            self.allocator.free(
                self.pool.req_to_token[req.req_pool_idx, req.cache_protected_len : req.length()]
            )
            result = self.unlock(req)
            self.pool.free(req)
        else:
            req.kv_committed_len = req.length()
            result = self.cache.cache_finished_req(req, is_insert=insert)
        return insert, row, repr_receipt(result)

    def second_holder(self) -> Any:
        """A second holder locks and unlocks a running request's node (schedule_policy's ``_lock_node``)."""
        req = self.rnd.choice(self.running)
        return repr_receipt(self.cache.inc_lock_ref(req.last_node)), repr_receipt(
            self.cache.dec_lock_ref(req.last_node)
        )

    def reset(self) -> Any:
        """``flush_cache``: only when no request is running, as SGLang's scheduler checks."""
        if self.running:
            return "busy"
        self.cache.reset()
        self.allocator.clear()
        return "reset"

    def readouts(self) -> tuple[Any, ...]:
        cache = self.cache
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            cache.pretty_print()
        flat: Any
        try:
            flat = ints(cache.all_values_flatten())
        except Exception as exc:  # an empty tree: torch.cat of nothing, stock and patched
            flat = ("raised", type(exc).__name__)
        return (
            cache.evictable_size(),
            cache.protected_size(),
            cache.total_size(),
            printed.getvalue(),
            flat,
            list(self.allocator.free_slots),
            sorted(self.pool.free_rows),
        )

    def row(self, req: FakeReq) -> list[int]:
        return [int(x) for x in self.pool.req_to_token[req.req_pool_idx, : req.length()]]


def repr_receipt(result: Any) -> Any:
    """A lock walk's or a finish's result, comparable across runs (0.5.23 returns dataclasses)."""
    if result is None or isinstance(result, int):
        return result
    return repr(result)


def run(
    sg: Api, clock: Clock, make: Callable[[FakeAllocator], Any], seed: int, steps: int
) -> Trace:
    clock.now = 0.0
    allocator = FakeAllocator(40)
    cache = make(allocator)
    sched = Scheduler(sg, cache, allocator, seed)
    rnd = random.Random(seed + 7)
    names = {
        "admit": sched.admit,
        "decode": sched.decode,
        "chunk": sched.chunk,
        "finish": sched.finish,
        "evict": lambda: sched.evict(rnd.randint(1, 16)),
        "second holder": sched.second_holder,
        "reset": sched.reset,
    }
    needs_running = {"decode", "chunk", "finish", "second holder"}
    extra: dict[str, Callable[[], Any]] = {}
    if getattr(cache, "cache_controller", None) is not None:
        ctl = cache.cache_controller

        def settle() -> None:
            ctl.finish_writes()
            if rnd.random() < 0.7:
                ctl.finish_loads()
            cache.check_hicache_events()

        extra = {"start": cache.ready_to_load_host_cache, "settle": settle}
        extra["evict_host"] = lambda: cache.evict_host(rnd.randint(1, 16))
    steps_by_name = {**names, **extra}
    weights = {
        "admit": 5,
        "decode": 4,
        "chunk": 2,
        "finish": 4,
        "evict": 2,
        "second holder": 1,
        "reset": 1,
    }
    weights |= dict.fromkeys(extra, 2)
    trace: Trace = []
    for _ in range(steps):
        name = rnd.choices(list(steps_by_name), [weights[n] for n in steps_by_name])[0]
        rec: list[Any] = [name]
        if name not in needs_running or sched.running:
            attempt(rec, steps_by_name[name])
        rec.append(snapshot(cache))
        rec.append(sched.readouts())
        trace.append(rec)
    return trace


def both(run_once: Callable[[], Trace]) -> tuple[Trace, Trace]:
    """``run_once`` stock, then under the patch."""
    stock = run_once()
    with patch():
        patched = run_once()
    return stock, patched


def compare(run_once: Callable[[int], Trace], seeds: int) -> Counter[str]:
    """Run each seed stock and patched; assert they never part; count what the stock runs did.

    Stock SGLang must never raise here (the driver makes only calls its
    scheduler makes, in an order it makes them); the counts let each test
    check that the streams reach what they are meant to.
    """
    parted, did = {}, Counter[str]()
    for seed in range(seeds):
        stock, patched = both(functools.partial(run_once, seed))
        parted[seed] = first_parting(stock, patched)
        raised = [rec for rec in stock if type(rec[1]) is tuple and rec[1][:1] == ("raised",)]
        assert raised == [], f"seed {seed}: stock SGLang raised"
        for rec in stock:
            did[rec[0]] += len(rec) == 4  # the step ran (it needs a running request)
            did["inserted"] += rec[0] == "finish" and len(rec) == 4 and rec[1][0]
            did["loaded"] += rec[0] == "admit" and len(rec) == 4 and bool(rec[1][2])
            did["reset"] += rec[0] == "reset" and rec[1:2] == ["reset"]
    assert {seed: where for seed, where in parted.items() if where} == {}
    return did


@pytest.mark.parametrize(
    ("policy", "page", "disable"),
    [*((p, 1 + 3 * (i % 2), False) for i, p in enumerate(POLICIES)), ("lru", 1, True)],
)
def test_radix_agrees_with_stock_under_the_scheduler(
    sg: Api, clock: Clock, policy: str, page: int, disable: bool
) -> None:
    def make(allocator: FakeAllocator) -> Any:
        options = {"eviction_policy": policy, "disable": disable}
        return sg.rc.RadixCache(sg.cache_params(allocator, page, **options))

    did = compare(lambda seed: run(sg, clock, make, seed, 80), seeds=5)
    assert min(did[step] for step in (*STEPS, "inserted", "reset")) >= 3, did


@pytest.mark.parametrize(
    ("policy", "page"), [("write_through", 1), ("write_back", 1), ("write_through_selective", 4)]
)
def test_hiradix_agrees_with_stock_under_the_scheduler(
    sg: Api, clock: Clock, monkeypatch: pytest.MonkeyPatch, policy: str, page: int
) -> None:
    def make(allocator: FakeAllocator) -> Any:
        cache = build_hiradix(sg, allocator, monkeypatch, policy, page)
        cache.load_back_threshold = 2
        return cache

    did = compare(lambda seed: run(sg, clock, make, seed, 80), seeds=5)
    assert min(did[step] for step in (*STEPS, "inserted", "reset", *HOST_STEPS)) >= 3, did
    assert did["loaded"] >= 1, did
