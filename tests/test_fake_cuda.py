"""The copy engine's CUDA ordering logic, run on the CPU through fake streams and events.

With :class:`FakeStreams` a copy's effect lands only when its event completes,
after a seeded random number of queries, so these tests see what a GPU would
let happen: early reads of a destination, sources reused too early, compute
queued before or after a copy.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_cache.cache.hicache import HiCache
from fsm_cache.errors import BadArgument, ConfigError, CopyFailed
from fsm_cache.memory import staging
from fsm_cache.memory import tiers as tiers_module
from fsm_cache.memory.copies import Completion, CopyEngine, Direction, check_stream
from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
from fsm_cache.memory.tiers import CacheConfig, Tiers, synthetic_kv
from fsm_cache.testing import FakeStreams as LazyFakeStreams
from fsm_cache.testing import deferred_copier as lazy_deferred_copier
from fsm_cache.testing.fakecuda import FakeEvent, FakeStream, FakeStreams, deferred_copier
from fsm_cache.testing.faults import FaultyCopyEngine


CPU = torch.device("cpu")
LAYOUT = KVLayout(layers=2, heads=2, head_dim=4, dtype=torch.bfloat16, page_size=4)
STALE = 0xAB


def make(seed: int = 0, max_polls: int = 3, pages: int = 16) -> tuple[CopyEngine, FakeStreams]:
    """An engine on fake streams; device page p holds tokens 100p..100p+3, the host is stale."""
    dev = device_pool(LAYOUT, pages, CPU)
    host = host_pool(LAYOUT, pages, pin=False)
    dev.write(list(range(pages)), synthetic_kv(LAYOUT, tokens_of(range(pages))))
    host.tensor.view(torch.uint8).fill_(STALE)
    fake = FakeStreams(seed, max_polls)
    return CopyEngine(dev, host, staging_bytes=2 * LAYOUT.page_bytes, streams=fake), fake


def tokens_of(pages: range | list[int]) -> list[int]:
    return [100 * p + i for p in pages for i in range(LAYOUT.page_size)]


def raw(pool: KVPool, pages: list[int] | tuple[int, ...]) -> torch.Tensor:
    return pool.read(list(pages)).view(torch.uint8)


def twin(pool: KVPool) -> KVPool:
    """The same memory as ``pool`` under a pool of its own, which closing ``pool``'s tiers keeps."""
    return KVPool(pool.name, pool.layout, pool.num_pages, pool.tensor, pinned=False)


def expected(pages: list[int] | tuple[int, ...]) -> torch.Tensor:
    return synthetic_kv(LAYOUT, tokens_of(list(pages))).view(torch.uint8)


def stale(pool: KVPool, pages: list[int] | tuple[int, ...]) -> bool:
    return bool((raw(pool, pages) == STALE).all())


def test_the_lazy_exports_are_the_module_names() -> None:
    assert LazyFakeStreams is FakeStreams
    assert lazy_deferred_copier is deferred_copier


@pytest.mark.parametrize("seed", range(6))
def test_a_copy_is_acknowledged_only_after_its_event_and_its_data_lands_only_then(
    seed: int,
) -> None:
    engine, fake = make(seed, max_polls=4)
    tickets = [engine.start_write([p, p + 8], [p + 8, p]) for p in range(4)]
    events = dict(zip((t.id for t in tickets), fake.events, strict=True))
    acked: set[int] = set()
    for _ in range(50):
        for done in engine.poll():
            ticket = done.ticket
            assert done.ok
            assert events[ticket.id].done  # never before its event completed
            assert torch.equal(raw(engine.host, ticket.dst_pages), expected(ticket.src_pages))
            acked.add(ticket.id)
        for ticket in engine.in_flight():
            if not events[ticket.id].done:  # nothing has forced it yet: still stale
                assert stale(engine.host, ticket.dst_pages)
        if len(acked) == len(tickets):
            break
    assert acked == {t.id for t in tickets}
    assert engine.busy_host_pages() == frozenset()


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_each_event_stays_incomplete_for_its_seeded_number_of_polls(seed: int) -> None:
    engine, fake = make(seed, max_polls=5)
    ticket = engine.start_load([3], [9])
    draw = random.Random(seed).randint(0, 5)
    for _ in range(draw):
        assert engine.poll() == []  # returns at once: never waits for the copy
        assert stale_device(engine, 9)
        # d2h idle; h2d: the wait, the host run into staging, the scatter (the CUDA path)
        assert [s.pending for s in fake.streams[:2]] == [0, 3]
    assert [c.ticket for c in engine.poll()] == [ticket]
    assert fake.events[0].queries == draw + 1
    assert [s.pending for s in fake.streams[:2]] == [0, 0]


def stale_device(engine: CopyEngine, page: int) -> bool:
    return not torch.equal(raw(engine.device, [page]), raw(engine.host, [3]))


def test_poll_never_runs_a_copy_whose_event_is_not_due() -> None:
    engine, fake = make(max_polls=1000)
    engine.start_write([1], [1])
    for _ in range(10):
        assert engine.poll() == []
    assert fake.streams[0].pending > 0
    assert stale(engine.host, [1])
    assert fake.events[0].queries == 10
    engine.close()  # dropped with the copy queued, it would wait for it and warn


def test_drain_completes_everything() -> None:
    engine, fake = make(seed=3, max_polls=1000)
    writes = [engine.start_write([p], [p]) for p in range(0, 8, 2)]
    loads = [engine.start_load([p + 8], [p + 1]) for p in range(0, 8, 2)]
    done = engine.drain()
    assert sorted(c.ticket.id for c in done) == [t.id for t in writes + loads]
    assert all(c.ok for c in done)
    assert engine.in_flight() == []
    assert [s.pending for s in fake.streams[:2]] == [0, 0]
    for ticket in writes:
        assert torch.equal(raw(engine.host, ticket.dst_pages), expected(ticket.src_pages))
    for ticket in loads:  # the host pages were stale: so is what they loaded
        assert stale(engine.device, ticket.dst_pages)
    assert engine.poll() == []


@pytest.mark.parametrize("direction", list(Direction))
def test_the_destination_holds_the_data_after_the_acknowledgement_and_not_before(
    direction: Direction,
) -> None:
    engine, _ = make(seed=2, max_polls=0)  # every event completes at its first query
    if direction is Direction.D2H:
        ticket = engine.start_write([5, 6], [0, 1])
        dst, want = engine.host, expected([5, 6])
    else:
        engine.host.write([2, 3], synthetic_kv(LAYOUT, tokens_of([40, 41])))
        ticket = engine.start_load([2, 3], [5, 6])
        dst, want = engine.device, expected([40, 41])
    assert not torch.equal(raw(dst, ticket.dst_pages), want)
    assert [c.ticket for c in engine.poll()] == [ticket]
    assert torch.equal(raw(dst, ticket.dst_pages), want)


def test_a_source_page_reused_before_the_acknowledgement_corrupts_the_copy() -> None:
    engine, _ = make(max_polls=1000)
    engine.start_write([1], [0])
    engine.device.write([1], synthetic_kv(LAYOUT, tokens_of([77])))  # freed and reused too early
    engine.drain()
    assert torch.equal(raw(engine.host, [0]), expected([77]))  # not page 1's tokens: visible
    assert not torch.equal(raw(engine.host, [0]), expected([1]))


def test_a_copy_waits_for_compute_queued_before_it() -> None:
    engine, fake = make(max_polls=1000)
    compute = fake.current_stream(CPU)
    # D2H: compute writes page 2's KV, then the backup starts: it must copy what compute wrote
    compute.enqueue(lambda: engine.device.write([2], synthetic_kv(LAYOUT, tokens_of([55]))))
    write = engine.start_write([2], [2])
    # H2D: compute still reads (here: overwrites) page 9; the load must land after it
    engine.host.write([4], synthetic_kv(LAYOUT, tokens_of([66])))
    compute.enqueue(lambda: engine.device.write([9], synthetic_kv(LAYOUT, tokens_of([88]))))
    load = engine.start_load([4], [9])
    assert compute.pending > 0  # nothing ran yet
    assert {c.ticket for c in engine.drain()} == {write, load}
    assert torch.equal(raw(engine.host, [2]), expected([55]))
    assert torch.equal(raw(engine.device, [9]), expected([66]))


def test_wait_holds_the_compute_stream_until_the_load_lands() -> None:
    engine, fake = make(max_polls=1000)
    engine.host.write([4], synthetic_kv(LAYOUT, tokens_of([66])))
    load = engine.start_load([4], [9])
    compute = fake.current_stream(CPU)
    seen: list[torch.Tensor] = []
    compute.enqueue(lambda: seen.append(raw(engine.device, [9])))  # queued before the wait
    engine.wait([load.id])  # the device's current stream, by default
    compute.enqueue(lambda: seen.append(raw(engine.device, [9])))
    assert seen == []  # wait never runs anything itself
    assert engine.in_flight() == [load]
    compute.synchronize()
    assert torch.equal(seen[0], expected([9]))  # before the wait: the old page
    assert torch.equal(seen[1], expected([66]))  # after it: the loaded one
    assert fake.events[0].done
    assert [c.ticket for c in engine.poll()] == [load]  # done: acknowledged at the next poll


def test_wait_on_a_given_stream_and_on_reported_tickets() -> None:
    engine, _ = make(max_polls=1000)
    first = engine.start_load([0], [8])
    engine.drain()
    second = engine.start_load([1], [9])
    side = FakeStream(CPU, "attention")
    engine.wait([first.id, second.id], stream=side)  # the reported one needs nothing
    assert side.pending == 1
    side.synchronize()
    assert engine.in_flight() == [second]
    assert [c.ticket for c in engine.poll()] == [second]


def test_wait_refuses_ids_no_copy_was_started_with() -> None:
    engine, _ = make()
    engine.start_write([0], [0])
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match=r"^copy: cannot wait for ticket ") as caught:
            engine.wait([1, bad])
        assert str(caught.value) == f"copy: cannot wait for ticket {bad}: no copy started with it"
    engine.close()


def test_wait_on_a_synchronous_cpu_engine_only_checks_the_ids() -> None:
    dev, host = device_pool(LAYOUT, 4, CPU), host_pool(LAYOUT, 4, pin=False)
    engine = CopyEngine(dev, host)
    ticket = engine.start_write([0], [0])
    engine.wait([ticket.id])
    engine.wait([ticket.id], stream=object())
    with pytest.raises(
        ValueError, match=r"^copy: cannot wait for ticket 5: no copy started with it$"
    ):
        engine.wait([5])


def test_work_that_raises_fails_its_copy_at_the_event(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = make(max_polls=0)

    copy, calls = staging._copy, []  # noqa: SLF001 (the one copy_ a one-page load runs)

    def broken(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        copy(dst, src, non_blocking)

    monkeypatch.setattr(staging, "_copy", broken)  # the first copy fails, later ones run
    ticket = engine.start_load([0], [1])  # queued, not run: the launch cannot fail yet
    (done,) = engine.poll()
    assert done.ticket == ticket
    assert str(done.error) == "copy 1 failed on the device: fake CUDA error in queued work: boom"
    assert engine.stats.failures[Direction.H2D] == 1
    follow = engine.start_write([0], [0])  # the error went with its event
    assert [c.ok for c in engine.drain()] == [True]
    assert torch.equal(raw(engine.host, follow.dst_pages), expected([0]))


def test_work_queued_after_a_load_runs_after_it_on_its_stream_before_its_report() -> None:
    """``queue_after``: in the copy's order, so its report and a stream waiting for it follow."""
    engine, fake = make(max_polls=0)  # every event completes at its first query
    engine.host.write([4], synthetic_kv(LAYOUT, tokens_of([66])))
    load = engine.start_load([4], [9])
    ran: list[torch.Tensor] = []
    engine.queue_after(load, lambda: ran.append(raw(engine.device, [9])))
    assert ran == []  # queued, not run
    # the host run into staging, the scatter, the event's first mark, the work, its mark again
    assert fake.streams[1].pending == 5
    assert [c.ticket for c in engine.poll()] == [load]  # its event was recorded after the work
    assert len(ran) == 1
    assert torch.equal(ran[0], expected([66]))  # after the copy
    with pytest.raises(BadArgument) as caught:
        engine.queue_after(load, lambda: None)  # reported: nothing to follow
    assert str(caught.value) == (
        "copy: cannot queue work after ticket 1: no copy of this engine with it is in flight"
    )
    with pytest.raises(BadArgument) as wrong:
        engine.queue_after(1, lambda: None)  # type: ignore[arg-type]
    assert str(wrong.value) == "copy: queue_after takes a Ticket, got int"


def test_a_stream_waiting_for_a_copy_waits_for_the_work_queued_after_it() -> None:
    engine, fake = make(max_polls=1000)
    load = engine.start_load([4], [9])
    engine.queue_after(load, functools.partial(_fill_words, engine.device, 9, 5))
    side = FakeStream(CPU, "attention")
    engine.wait([load.id], stream=side)
    seen: list[bool] = []
    side.enqueue(lambda: seen.append(bool((engine.device.words[9] == 5).all())))
    side.synchronize()
    assert seen == [True]
    assert fake.events[0].done
    engine.close()


def test_work_queued_after_a_backup_in_the_open_batch_submits_it_first() -> None:
    engine, fake = make(max_polls=0)
    write = engine.start_write([2], [3])
    assert fake.streams[0].pending == 0  # in the open batch, not submitted
    ran: list[torch.Tensor] = []
    engine.queue_after(write, lambda: ran.append(raw(engine.host, [3])))
    assert fake.streams[0].pending > 0
    assert [c.ticket for c in engine.poll()] == [write]
    assert torch.equal(ran[0], expected([2]))


def test_work_that_cannot_be_queued_after_a_copy_fails_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, fake = make(max_polls=1000)
    load = engine.start_load([4], [9])

    def refused(stream: object, work: object) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(fake, "run_on", refused)
    engine.queue_after(load, lambda: None)
    assert fake.streams[1].pending == 0  # what was queued is waited for here
    monkeypatch.undo()
    (done,) = engine.poll()
    assert done.ticket == load
    assert str(done.error) == "copy 1 (h2d) failed: CUDA error: out of memory"


def test_work_queued_after_a_copy_of_a_synchronous_engine_runs_at_once() -> None:
    dev, host = device_pool(LAYOUT, 4, CPU), host_pool(LAYOUT, 4, pin=False)
    engine = CopyEngine(dev, host)
    host.words[1].fill_(9)
    load = engine.start_load([1], [2])
    ran: list[bool] = []
    engine.queue_after(load, lambda: ran.append(bool((dev.words[2] == 9).all())))
    assert ran == [True]

    def broken() -> None:
        raise RuntimeError("no memory")

    write = engine.start_write([0], [3])
    engine.queue_after(write, broken)
    assert [(c.ticket, str(c.error)) for c in engine.poll()] == [
        (load, "None"),
        (write, "copy 2 (d2h) failed: no memory"),
    ]


def _fill_words(pool: KVPool, page: int, word: int) -> None:
    pool.words[page].fill_(word)


def test_events_outside_the_engine() -> None:
    never = FakeEvent()
    assert never.query()  # never recorded: complete, as on CUDA
    idle = FakeStream(CPU)
    at_once = FakeEvent(polls=3)
    at_once.record(idle)
    assert at_once.done  # an idle stream reaches the mark at once
    busy = FakeStream(CPU)
    ran: list[int] = []
    busy.enqueue(lambda: ran.append(1))
    later = FakeEvent(polls=2)
    later.record(busy)
    assert [later.query(), later.query(), ran] == [False, False, []]
    assert later.query()
    assert ran == [1]
    later.record(busy)  # recorded again on an idle stream
    assert later.done


def test_fake_streams_queue_only_on_fake_streams() -> None:
    fake = FakeStreams()
    with pytest.raises(TypeError, match=r"^fake streams queue work on a FakeStream, got 3$"):
        fake.run_on(3, lambda: None)  # type: ignore[arg-type]


def test_tiers_close_lands_every_copy_and_refuses_new_ones() -> None:
    fake = FakeStreams(seed=4, max_polls=1000)
    config = CacheConfig(
        device_pages=8, host_pages=8, page_size=4, layers=2, heads=2, head_dim=4,
        dtype="bfloat16", device="cpu", copier=deferred_copier(streams=fake),
    )  # fmt: skip
    tiers = Tiers(config)
    tiers.write_tokens([0, 1], tokens_of([0, 1]))
    tiers.copier.start_write([0, 1], [3, 4])
    assert tiers.copier.poll() == []  # submitted: queued on its stream, not landed
    assert fake.streams[0].pending > 0
    host = twin(tiers.host)
    tiers.close()
    assert [s.pending for s in fake.streams[:2]] == [0, 0]
    assert torch.equal(raw(host, [3, 4]), expected([0, 1]))
    assert tiers.copier.in_flight() == []
    with pytest.raises(CopyFailed, match=r"^copy engine closed: d2h copy refused$"):
        tiers.copier.start_write([2], [2])
    with pytest.raises(CopyFailed, match=r"^copy engine closed: h2d copy refused$"):
        tiers.copier.start_load([2], [2])
    tiers.close()


def test_tiers_read_device_pages_after_the_compute_stream_wrote_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``write_tokens`` writes on the compute stream; a read on another must wait for it."""
    config = CacheConfig(
        device_pages=8, host_pages=8, page_size=4, layers=2, heads=2, head_dim=4,
        dtype="bfloat16", device="cpu",
    )  # fmt: skip
    tiers = Tiers(config)
    forward, current = FakeStream(CPU, "forward"), FakeStream(CPU, "current")
    tiers._forward = forward  # type: ignore[assignment]  # noqa: SLF001 (set on CUDA only)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    forward.enqueue(lambda: tiers.device.write([1], synthetic_kv(LAYOUT, tokens_of([7]))))
    seen: list[torch.Tensor] = []
    tiers.read_device([1])
    current.enqueue(lambda: seen.append(raw(tiers.device, [1])))  # what the caller queues next
    current.synchronize()
    assert torch.equal(seen[0], expected([7]))
    assert forward.pending == 0
    tiers.close()


def test_tiers_that_cannot_wait_for_their_copies_stay_open_to_close_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = CacheConfig(
        device_pages=8, host_pages=8, page_size=4, layers=2, heads=2, head_dim=4,
        dtype="bfloat16", device="cpu", copier=deferred_copier(seed=4, max_polls=1000),
    )  # fmt: skip
    tiers = Tiers(config)
    closing, released = type(tiers.copier).close, []
    monkeypatch.setattr(type(tiers.host), "close", lambda pool: released.append(pool.name))

    def broken(self: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(type(tiers.copier), "close", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tiers.close()
    assert (tiers.closed, released) == (False, [])
    monkeypatch.setattr(type(tiers.copier), "close", closing)
    tiers.close()
    assert (tiers.closed, released) == (True, ["host", "device"])


def test_tiers_close_waits_for_the_gpu_after_the_copies_and_before_giving_memory_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, ``close`` synchronises the device between the copy engine and the pools.

    No queued kernel may still read a pool when its memory goes back; a device
    that cannot be waited for leaves the tiers open, releasing nothing.
    """
    config = CacheConfig(
        device_pages=8, host_pages=8, page_size=4, layers=2, heads=2, head_dim=4,
        dtype="bfloat16", device="cpu", copier=deferred_copier(seed=4, max_polls=1000),
    )  # fmt: skip
    tiers = Tiers(config)
    gpu, order = torch.device("cuda", 0), []
    pool_type, engine_type = type(tiers.device), type(tiers.copier)
    monkeypatch.setattr(
        pool_type, "device", property(lambda pool: gpu if pool.name == "device" else CPU)
    )
    monkeypatch.setattr(pool_type, "close", lambda pool: order.append(f"close {pool.name}"))
    closing = engine_type.close

    def close_engine(engine: CopyEngine) -> None:
        order.append("close copies")
        closing(engine)

    def broken(device: torch.device) -> None:
        order.append(f"synchronize {device}")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine_type, "close", close_engine)
    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tiers.close()
    assert (tiers.closed, order) == (False, ["close copies", "synchronize cuda:0"])
    order.clear()
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device: order.append(f"synchronize {device}")
    )
    tiers.close()
    tiers.close()
    assert tiers.closed
    assert order == ["close copies", "synchronize cuda:0", "close host", "close device"]


def test_a_faulty_engine_over_fake_streams_closes_and_waits_through_its_inner() -> None:
    inner, fake = make(max_polls=1000)
    engine = FaultyCopyEngine(inner, delay=3)
    ticket = engine.start_load([0], [8])
    side = FakeStream(CPU)
    engine.wait([ticket.id], stream=side)
    assert side.pending == 1
    engine.close()
    engine.close()
    assert engine.in_flight() == []
    assert [s.pending for s in fake.streams[:2]] == [0, 0]
    with pytest.raises(CopyFailed, match=r"^copy engine closed: d2h copy refused$"):
        engine.start_write([0], [0])


def test_a_cache_runs_on_deferred_copies() -> None:
    fake = FakeStreams(seed=5, max_polls=3)
    cache = HiCache(
        CacheConfig(
            device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4,
            device="cpu", debug=True, copier=deferred_copier(streams=fake),
        )
    )  # fmt: skip
    for start in range(0, 96, 8):
        prompt = list(range(start, start + 8))
        cache.insert(prompt)
        cache.match_prefix(prompt)
        cache.insert(prompt)
        cache.poll()
    while cache.tiers.copier.in_flight():
        cache.poll()
    assert len(fake.events) > 0
    assert cache.stats().transitions["write_done"] == len(fake.events)
    for node in cache.tree:
        if node.host_pages:
            want = synthetic_kv(cache.tiers.host.layout, node.key).view(torch.uint8)
            assert torch.equal(cache.tiers.host.read(node.host_pages).view(torch.uint8), want)


def _cache_config(**kwargs: object) -> CacheConfig:
    return CacheConfig(
        device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4,
        device="cpu", debug=True, load_back_threshold=1, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_cache_orders_its_copies_after_the_compute_stream_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache's copies followed whatever stream was current at each call.

    SGLang's overlap scheduler runs the forward pass on a stream of its own
    while the scheduler thread's current stream is the default one.
    """
    fake = FakeStreams(seed=0, max_polls=0)  # the CUDA engine, on CPU pools
    monkeypatch.setattr(tiers_module, "CopyEngine", functools.partial(CopyEngine, streams=fake))
    forward = FakeStream(CPU, "forward")
    cache = HiCache(_cache_config(), compute_stream=forward)
    ran: list[str] = []
    forward.enqueue(lambda: ran.append("forward pass"))  # queued before the insert's backup
    prompt = list(range(8))
    cache.insert(prompt)  # write-through: a backup starts as the insert returns
    while cache.tiers.copier.in_flight():
        cache.poll()
    assert ran == ["forward pass"]  # the backup waited for it
    cache.evict(1000)
    chain = cache.load_back(cache.match_prefix(prompt).last_host_node)
    assert chain
    queued = forward.pending
    assert cache.wait_loaded(chain)  # no stream named: the compute stream waits for the load
    assert forward.pending == queued + 1
    device = twin(cache.tiers.device)
    cache.close()
    assert torch.equal(
        device.read(chain[-1].device_pages).view(torch.uint8),
        synthetic_kv(cache.tiers.device.layout, chain[-1].key).view(torch.uint8),
    )


def test_a_cache_refuses_a_compute_stream_it_cannot_use_before_taking_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allocated: list[str] = []
    monkeypatch.setattr(tiers_module, "_allocate", lambda name, *args: allocated.append(name))
    with pytest.raises(BadArgument) as caught:
        HiCache(_cache_config(), compute_stream="forward")
    assert str(caught.value) == (
        "copy engine: compute_stream must be a stream (torch.cuda.Stream or the Streams' own), "
        "got str"
    )
    with pytest.raises(ConfigError) as refused:
        HiCache(_cache_config(copier=deferred_copier()), compute_stream=FakeStream(CPU))
    assert str(refused.value) == (
        "config: compute_stream is for the default copy engine; a copier builds its own: "
        "give the stream to the engine it builds (CopyEngine(device, host, compute_stream=...))"
    )
    assert allocated == []


def test_a_stream_of_another_gpu_is_refused_as_it_would_order_nothing_here() -> None:
    ours, other = torch.device("cuda", 0), torch.device("cuda", 1)
    with pytest.raises(BadArgument) as caught:
        check_stream("compute_stream", FakeStream(other), ours)
    assert str(caught.value) == (
        "copy engine: compute_stream is a stream of cuda:1, but the device pool is on cuda:0: "
        "give a stream of the pool's GPU"
    )
    check_stream("compute_stream", FakeStream(ours), ours)  # the pool's own GPU
    check_stream("stream", FakeStream(other), CPU)  # a CPU engine ignores streams
    check_stream("stream", FakeStream(CPU), ours)  # a fake's CPU stream orders fake work


# -- random copies on random layouts: every byte lands where and when it should ---------------

EDGE_DTYPES = (torch.float16, torch.float32, torch.float8_e4m3fn, torch.bool, torch.complex64)


class _Model:
    """Random copies, writes, waits and polls on an engine, against what each page should hold.

    ``logical`` is what each page holds once every copy started has landed
    (copies land in the order they were started); a page no unreported copy
    touches must hold it already, and an acknowledged copy's destination
    must hold what its source held when it started.
    """

    def __init__(self, seed: int) -> None:
        r = self.r = random.Random(seed)
        lay = KVLayout(
            r.randint(1, 2),
            r.randint(1, 2),
            r.choice([1, 3, 5]),
            r.choice(EDGE_DTYPES),
            r.choice([1, 2, 3]),
            planes=r.choice([1, 2]),
        )
        self.pools = {
            "device": device_pool(lay, r.randint(1, 6), CPU),
            "host": host_pool(lay, r.randint(1, 6), pin=False),
        }
        fake = FakeStreams(seed, r.randint(0, 4)) if r.random() < 0.8 else None
        staging_bytes = r.choice([1, lay.page_bytes, 2 * lay.page_bytes + 1, 1 << 20])
        self.engine = CopyEngine(
            self.pools["device"],
            self.pools["host"],
            staging_bytes,
            streams=fake,
            batch_polls=r.randint(1, 3),
        )
        self.logical: dict[str, dict[int, int]] = {"device": {}, "host": {}}
        self.expect: dict[int, list[int]] = {}
        self.reported: set[int] = set()
        self.tag = 0
        for side, pool in self.pools.items():
            for page in range(pool.num_pages):
                self.write(side, page)

    def busy(self, side: str, page: int) -> bool:
        if side == "host":
            return self.engine.host_busy([page])
        return self.engine.device_busy([page])

    def write(self, side: str, page: int) -> None:
        self.tag = self.tag % 250 + 1
        self.pools[side].pages[page].fill_(self.tag)
        self.logical[side][page] = self.tag

    def holds(self, side: str, page: int, tag: int) -> bool:
        return bool((self.pools[side].pages[page] == tag).all())

    def start(self) -> None:
        r, d2h = self.r, self.r.random() < 0.5
        src_side, dst_side = ("device", "host") if d2h else ("host", "device")
        k = r.randint(0, 4)
        dst_pages = self.pools[dst_side].num_pages
        if r.random() < 0.9:
            dst = r.sample(range(dst_pages), min(k, dst_pages))
        else:
            dst = [r.randrange(dst_pages) for _ in range(k)]
        src = [r.randrange(self.pools[src_side].num_pages) for _ in dst]
        if r.random() < 0.3:
            src, dst = sorted(src), sorted(dst)
        refused = len(set(dst)) != len(dst) or any(self.busy(dst_side, p) for p in dst)
        try:
            ticket = self.engine.start_write(src, dst) if d2h else self.engine.start_load(src, dst)
        except BadArgument:
            assert refused
            return
        assert not refused
        values = [self.logical[src_side][p] for p in src]
        self.logical[dst_side].update(zip(dst, values, strict=True))
        self.expect[ticket.id] = values

    def report(self, completions: list[Completion]) -> None:
        for c in completions:
            ticket = c.ticket
            assert c.ok
            assert ticket.id not in self.reported  # acknowledged once
            self.reported.add(ticket.id)
            side = "host" if ticket.direction is Direction.D2H else "device"
            values = self.expect.pop(ticket.id)
            assert all(map(functools.partial(self.holds, side), ticket.dst_pages, values))

    def idle_pages_hold_what_they_should(self) -> None:
        for side, pages in self.logical.items():
            for page, tag in pages.items():
                assert self.busy(side, page) or self.holds(side, page, tag), (side, page)

    def step(self) -> None:
        r, choice = self.r, self.r.random()
        if choice < 0.4:
            self.start()
        elif choice < 0.55:
            side = r.choice(["device", "host"])
            page = r.randrange(self.pools[side].num_pages)
            if not self.busy(side, page):
                self.write(side, page)
        elif choice < 0.65 and self.expect:
            assert self.engine.wait(r.sample(sorted(self.expect), 1))
        else:
            self.report(self.engine.poll())
        self.idle_pages_hold_what_they_should()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_copies_land_in_order_and_are_acknowledged_once_after_they_land(
    seed: int,
) -> None:
    """Odd head_dim, page_size 1, bool, float8 and complex pages, chunked or not, deferred."""
    model = _Model(seed)
    for _ in range(30):
        model.step()
    model.report(model.engine.drain())
    assert not model.expect
    model.idle_pages_hold_what_they_should()
    model.engine.close()
