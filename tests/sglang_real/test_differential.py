"""SGLang's real caches, stock and patched, on the same random request streams.

Each seed drives a scheduler's life (requests that match, lock, load back what
the host holds, finish and insert; evictions of both tiers; copies that land
late or in bulk) through SGLang's own ``RadixCache`` and, on 0.5.6,
``HiRadixCache``, once stock and once under :func:`fsm_cache.compat.sglang.patch`.
After every step the two runs must agree on everything SGLang's callers can
see: what the step returned or raised, every node's key, slots and counters,
the sizes the cache reports, both free lists and the copies in flight. A drop-in
that refused what stock SGLang does correctly, or did it differently, shows
here as the first step where the runs part.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsm_cache.compat.sglang import patch

from .conftest import Api, Clock, build_hiradix
from .fakes import FakeAllocator


Trace = list[list[Any]]
Step = Callable[[], Any]
Running = tuple[list[int], Any, Any]
"""A request in flight: its tokens, the slots of its matched prefix, its last matched node."""


def ints(tensor: Any) -> list[int] | None:
    """A slot tensor as a list (None stays None)."""
    return None if tensor is None else [int(x) for x in tensor]


def snapshot(cache: Any) -> list[tuple[Any, ...]]:
    """Every node's token path, slots and counters, in path order."""
    out = []
    stack: list[tuple[Any, tuple[int, ...]]] = [(cache.root_node, ())]
    while stack:
        node, above = stack.pop()
        path = above + (tuple(node.key) if node.key is not None else ())
        host = getattr(node, "host_value", None)
        out.append(
            (
                path,
                ints(node.value),
                ints(host),
                int(node.lock_ref),
                int(getattr(node, "host_ref_counter", 0)),
            )
        )
        stack.extend((child, path) for child in node.children.values())
    return sorted(out, key=lambda entry: entry[0])


class Stream:
    """One seed's random requests, the same for the stock and the patched run."""

    def __init__(self, seed: int, page_size: int) -> None:
        self.rnd = random.Random(seed)
        self.page_size = page_size
        self.prefixes = [
            [self.rnd.randint(1, 3) for _ in range(self.rnd.randint(1, 8))] for _ in range(4)
        ]

    def key(self) -> list[int]:
        """Tokens sharing a prefix with earlier requests often, page-aligned usually."""
        rnd, page = self.rnd, self.page_size
        prefix = rnd.choice(self.prefixes)
        tokens = prefix[: rnd.randint(0, len(prefix))] + [
            rnd.randint(1, 4) for _ in range(rnd.randint(0, 10))
        ]
        tokens = tokens or [1]
        if page > 1 and rnd.random() < 0.7:
            whole = (len(tokens) // page) * page or page
            tokens = (tokens + [1] * page)[:whole]
        return tokens


def finish_request(sg: Api, cache: Any, allocator: FakeAllocator, request: Running) -> Any:
    """End a request as SGLang's scheduler does: slots for its tail, insert, free, unlock.

    The tail's slots are allocated (evicting first if the pool is short), the
    page-aligned sequence inserted, the slots the tree already held freed, and
    the request's lock on its matched prefix dropped.
    """
    tokens, prefix, last = request
    page = cache.page_size
    whole = len(tokens) // page * page
    need = max(whole - len(prefix), 0)
    new = allocator.alloc(need)
    if new is None:
        sg.evict(cache, need)
        new = allocator.alloc(need)
    inserted = None
    if new is not None and whole > len(prefix):
        value = torch.cat([prefix, new])[:whole]
        inserted = sg.insert(cache, tokens[:whole], value)
        if inserted > len(prefix):  # the caller frees what the tree already held
            allocator.free(value[len(prefix) : inserted])
    elif new is not None:
        allocator.free(new)
    cache.dec_lock_ref(last)
    return ints(new), inserted


def attempt(rec: list[Any], step: Step) -> None:
    """Run ``step``, recording its result or the exception it raised (a refusal parts the runs)."""
    try:
        rec.append(step())
    except Exception as exc:  # any exception is an observable difference
        rec.append(("raised", type(exc).__name__, str(exc)))


def hiradix_run(
    sg: Api, clock: Clock, monkeypatch: pytest.MonkeyPatch, seed: int, *, page: int, policy: str
) -> Trace:
    """One seed through a ``HiRadixCache`` of 48 device and 64 host slots."""
    clock.now = 0.0
    stream, rnd = Stream(seed, page), random.Random(seed + 1)
    allocator = FakeAllocator(48)
    cache = build_hiradix(sg, allocator, monkeypatch, policy, page)
    cache.load_back_threshold = rnd.choice([1, 2, 10])
    ctl = cache.cache_controller
    running: list[Running] = []

    def request() -> Any:
        tokens = stream.key()
        found = cache.match_prefix(sg.key(tokens))
        loaded, last = torch.empty((0,), dtype=torch.int64), found.last_device_node
        if found.host_hit_length > 0:
            loaded, last = cache.init_load_back(found.last_host_node, found.host_hit_length)
        prefix = torch.cat([found.device_indices, loaded])
        cache.inc_lock_ref(last)
        running.append((tokens, prefix, last))
        return tokens, ints(found.device_indices), found.host_hit_length, ints(loaded)

    def finish() -> Any:
        return finish_request(sg, cache, allocator, running.pop(rnd.randrange(len(running))))

    def settle() -> None:
        if rnd.random() < 0.7:
            ctl.finish_writes()
        if rnd.random() < 0.7:
            ctl.finish_loads()
        cache.check_hicache_events()

    steps: dict[str, Step] = {
        "request": request,
        "finish": finish,
        "match": lambda: ints(cache.match_prefix(sg.key(stream.key())).device_indices),
        "evict": lambda: cache.evict(rnd.randint(1, 24)),
        "evict_host": lambda: cache.evict_host(rnd.randint(1, 24)),
        "settle": settle,
        "start": cache.ready_to_load_host_cache,
    }
    trace: Trace = []
    for _ in range(60):
        name = rnd.choices(list(steps), [5, 4, 2, 2, 1, 3, 2])[0]
        rec: list[Any] = [name]
        if name != "finish" or running:
            attempt(rec, steps[name])
        rec.append(snapshot(cache))
        rec.append(
            (
                cache.evictable_size(),
                cache.protected_size(),
                list(allocator.free_slots),
                list(ctl.mem_pool_host.free_slots),
                sorted(cache.ongoing_write_through),
                sorted(cache.ongoing_load_back),
            )
        )
        trace.append(rec)
    return trace


def radix_run(sg: Api, clock: Clock, seed: int, page: int) -> Trace:
    """One seed through a ``RadixCache`` of 48 slots."""
    clock.now = 0.0
    stream, rnd = Stream(seed, 1), random.Random(seed + 1)
    allocator = FakeAllocator(48)
    cache = sg.rc.RadixCache(sg.cache_params(allocator, page_size=page))
    running: list[Running] = []

    def request() -> Any:
        tokens = stream.key()
        matched, last = sg.match(cache, tokens)
        slots = cache_slots(last)[:matched]
        cache.inc_lock_ref(last)
        running.append((tokens, torch.tensor(slots, dtype=torch.int64), last))
        return tokens, slots

    def cache_slots(node: Any) -> list[int]:
        parts = []
        while node is not cache.root_node:
            parts.append(ints(node.value) or [])
            node = node.parent
        return [slot for part in reversed(parts) for slot in part]

    def finish() -> Any:
        return finish_request(sg, cache, allocator, running.pop(rnd.randrange(len(running))))

    def second_holder() -> None:
        _, _, last = rnd.choice(running)
        cache.inc_lock_ref(last)
        cache.dec_lock_ref(last)

    steps: dict[str, Step] = {
        "request": request,
        "finish": finish,
        "match": lambda: sg.match(cache, stream.key())[0],
        "evict": lambda: sg.evict(cache, rnd.randint(1, 24)),
        "second holder": second_holder,
    }
    trace: Trace = []
    for _ in range(100):
        name = rnd.choices(list(steps), [5, 4, 2, 2, 1])[0]
        rec: list[Any] = [name]
        if name not in ("finish", "second holder") or running:
            attempt(rec, steps[name])
        rec.append(snapshot(cache))
        rec.append((cache.evictable_size(), cache.protected_size(), list(allocator.free_slots)))
        trace.append(rec)
    return trace


def first_parting(stock: Trace, patched: Trace) -> str | None:
    """Where two runs of one seed first differ, readably; None if they never do."""
    for step, (a, b) in enumerate(zip(stock, patched, strict=True)):
        for part, mine, theirs in (
            ("result", a[1:-2], b[1:-2]),
            ("tree", a[-2], b[-2]),
            ("sizes and free lists", a[-1], b[-1]),
        ):
            if mine != theirs:
                return f"step {step} ({a[0]}), {part}: stock {mine!r}, patched {theirs!r}"
    return None


def both(run: Callable[[], Trace]) -> tuple[Trace, Trace]:
    """``run`` stock, then under the patch."""
    stock = run()
    with patch():
        patched = run()
    return stock, patched


@pytest.mark.parametrize(
    ("policy", "page"),
    [
        ("write_through", 1),
        ("write_through_selective", 1),
        ("write_back", 1),
        ("write_through", 4),
        ("write_back", 4),
    ],
)
def test_hiradix_agrees_with_stock_on_random_streams(
    sg: Api, clock: Clock, monkeypatch: pytest.MonkeyPatch, policy: str, page: int
) -> None:
    parted, loads = {}, 0
    for seed in range(24):
        stock, patched = both(
            functools.partial(hiradix_run, sg, clock, monkeypatch, seed, page=page, policy=policy)
        )
        parted[seed] = first_parting(stock, patched)
        loads += sum(1 for rec in stock if rec[0] == "request" and rec[1][3])
    assert {seed: where for seed, where in parted.items() if where} == {}
    assert loads >= 2  # the streams reach loads back from the host, not only the device tier


@pytest.mark.parametrize("page", [1, 4])
def test_radix_agrees_with_stock_on_random_streams(sg: Api, clock: Clock, page: int) -> None:
    parted = {}
    for seed in range(16):
        stock, patched = both(functools.partial(radix_run, sg, clock, seed, page))
        parted[seed] = first_parting(stock, patched)
    assert {seed: where for seed, where in parted.items() if where} == {}
