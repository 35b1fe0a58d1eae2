"""Injected faults on streams: a failed copy's poison in the copy's order, and the copier factory.

A failed load models a half-done copy: on a GPU the poison must land where the
copy's bytes would have, on the copy's stream, so compute made to wait for the
load reads it. These tests run that ordering on fake streams
(:mod:`fsm_cache.testing.fakecuda`), where nothing queued runs until it is
needed, and on a GPU where there is one.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable

import pytest
import torch

from fsm_cache.cache.hicache import HiCache
from fsm_cache.errors import BadArgument, ConfigError, CopyFailed
from fsm_cache.memory.copies import CopyEngine, Stream
from fsm_cache.memory.kv import KVLayout, KVPool, device_pool, host_pool
from fsm_cache.memory.tiers import CacheConfig, Tiers, synthetic_kv
from fsm_cache.testing.fakecuda import FakeStream, FakeStreams, deferred_copier
from fsm_cache.testing.faults import POISON, FaultyCopyEngine


CPU = torch.device("cpu")
LAYOUT = KVLayout(layers=2, heads=2, head_dim=4, dtype=torch.float16, page_size=4)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Recorded(FakeStreams):
    """Fake streams that remember the stream each piece of work was queued on."""

    def __init__(self, max_polls: int = 1000) -> None:
        super().__init__(max_polls=max_polls)
        self.queued: list[Stream] = []

    def run_on(self, stream: Stream, work: Callable[[], None]) -> None:
        self.queued.append(stream)
        super().run_on(stream, work)


def _pools(where: torch.device = CPU) -> tuple[KVPool, KVPool]:
    """A device pool whose page p holds words p + 1, and a host pool whose page p holds 100 + p."""
    dev = device_pool(LAYOUT, 8, where)
    host = host_pool(LAYOUT, 8, pin=where.type == "cuda", device=where)
    for p in range(8):
        dev.words[p].fill_(p + 1)
        host.words[p].fill_(100 + p)
    return dev, host


def _fill(pool: KVPool, page: int, word: int) -> None:
    pool.words[page].fill_(word)


def _poisoned(pool: KVPool, page: int) -> bool:
    return bool((pool.read([page]).view(torch.uint8) == POISON).all())


def test_a_failed_loads_poison_lands_in_the_copys_order_on_its_stream() -> None:
    """Compute waiting for the load reads the poison, which nothing put on the compute stream."""
    fake = _Recorded()
    dev, host = _pools()
    engine = FaultyCopyEngine(CopyEngine(dev, host, streams=fake), fail=[1])
    h2d = fake.streams[1]  # the engine's side streams: d2h, then h2d
    ticket = engine.start_load([3], [6])
    assert not _poisoned(dev, 6)  # nothing ran yet: neither the copy nor its poison
    assert fake.queued
    assert all(s is h2d for s in fake.queued)
    compute = fake.current_stream(CPU)
    assert engine.wait([ticket.id])  # an injected failure is known only when it is reported
    seen: list[bool] = []
    compute.enqueue(lambda: seen.append(_poisoned(dev, 6)))
    compute.synchronize()
    assert seen == [True]
    queued = len(fake.queued)
    (done,) = engine.drain()
    assert (done.ticket, str(done.error)) == (ticket, "injected failure of copy 1")
    assert _poisoned(dev, 6)
    assert len(fake.queued) == queued  # delivering the failure queues nothing more
    assert compute.pending == 0
    assert bool((dev.words[5] == 6).all())  # its neighbours keep their bytes
    assert bool((dev.words[7] == 8).all())


@pytest.mark.parametrize("seed", range(4))
def test_a_failed_load_is_reported_only_after_its_poison_landed(seed: int) -> None:
    fake = FakeStreams(seed=seed, max_polls=3)
    dev, host = _pools()
    engine = FaultyCopyEngine(CopyEngine(dev, host, streams=fake), fail=[2])
    first, second = engine.start_load([1], [4]), engine.start_load([2], [5])
    done = []
    for _ in range(20):
        for completion in engine.poll():
            page = completion.ticket.dst_pages[0]
            done.append((completion.ticket, completion.ok, _poisoned(dev, page)))
    assert done == [(first, True, False), (second, False, True)]
    assert bool((dev.words[4] == 101).all())


def test_a_failed_backup_poisons_its_host_pages_when_its_failure_is_delivered() -> None:
    """A host write cannot be queued behind a copy on CUDA: it waits for the copy's report."""
    fake = _Recorded()
    dev, host = _pools()
    engine = FaultyCopyEngine(CopyEngine(dev, host, streams=fake), fail=[1])
    engine.start_write([2], [5])
    assert engine.poll() == []  # submitted, not landed
    queued = len(fake.queued)
    fake.synchronize(CPU)  # the copy lands
    assert bool((host.words[5] == 3).all())
    (done,) = engine.poll()
    assert str(done.error) == "injected failure of copy 1"
    assert _poisoned(host, 5)
    assert len(fake.queued) == queued


def test_a_failed_load_on_a_cpu_engine_is_poisoned_once_it_has_run() -> None:
    """Without streams a load runs in ``start_load``, and its poison right after it."""
    dev, host = _pools()
    engine = FaultyCopyEngine(CopyEngine(dev, host), fail=[1], delay=2)
    engine.start_load([3], [6])
    assert _poisoned(dev, 6)
    assert engine.poll() == []
    unpoisoned = FaultyCopyEngine(CopyEngine(dev, host), fail=[1], poison=False)
    unpoisoned.start_load([3], [7])
    assert [str(c.error) for c in unpoisoned.drain()] == ["injected failure of copy 1"]
    assert bool((dev.words[7] == 103).all())


def test_copier_builds_its_engine_with_the_factory_it_is_given() -> None:
    """The engine's options (a compute stream, fake streams) reach it through ``engine=``."""
    fake = FakeStreams(max_polls=0)
    forward = FakeStream(CPU, "forward")
    build = FaultyCopyEngine.copier(
        fail=[2], engine=functools.partial(CopyEngine, streams=fake, compute_stream=forward)
    )
    dev, host = _pools()
    engine = build(dev, host)
    assert type(engine.inner) is CopyEngine
    forward.enqueue(functools.partial(_fill, dev, 2, 7))  # the forward pass writes page 2, queued
    write, load = engine.start_write([2], [5]), engine.start_load([0], [1])
    assert [(c.ticket, c.ok) for c in engine.drain()] == [(write, True), (load, False)]
    assert bool((host.words[5] == 7).all())  # the backup waited for the forward pass
    assert _poisoned(dev, 1)
    assert len(fake.events) == 2


def test_a_cache_orders_a_faulty_engines_copies_after_its_forward_stream() -> None:
    """``HiCache(compute_stream=)`` refuses a copier: the copier's engine takes the stream."""
    fake = FakeStreams(max_polls=0)
    forward = FakeStream(CPU, "forward")
    ran: list[str] = []
    engine = functools.partial(CopyEngine, streams=fake, compute_stream=forward)
    config = CacheConfig(
        device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4,
        device="cpu", debug=True, copier=FaultyCopyEngine.copier(delay=1, engine=engine),
    )  # fmt: skip
    cache = HiCache(config)
    forward.enqueue(lambda: ran.append("forward pass"))
    cache.insert(list(range(8)))  # write-through: a backup starts as the insert returns
    while cache.tiers.copier.in_flight():
        cache.poll()
    assert ran == ["forward pass"]
    cache.close()


def test_the_engines_compute_stream_is_read_through_a_faulty_engine() -> None:
    """Tiers read it from the copier, so the cache's own KV writes follow the same stream."""
    forward = FakeStream(CPU, "forward")
    dev, host = _pools()
    plain = CopyEngine(dev, host, streams=FakeStreams(max_polls=0))
    assert plain.compute_stream is None
    engine = functools.partial(CopyEngine, streams=FakeStreams(max_polls=0), compute_stream=forward)
    assert FaultyCopyEngine.copier(engine=engine)(dev, host).compute_stream is forward


def test_a_copier_whose_engine_exposes_no_stream_is_refused_at_construction() -> None:
    """A user's copier with a bad ``compute_stream`` failed only at the first ``write_tokens``."""
    built: list[FaultyCopyEngine] = []

    class Odd(FaultyCopyEngine):
        @property
        def compute_stream(self) -> object | None:
            return "forward"

    def odd(device: KVPool, host: KVPool) -> FaultyCopyEngine:
        built.append(Odd(CopyEngine(device, host)))
        return built[-1]

    config = CacheConfig(
        device_pages=8, host_pages=8, page_size=4, layers=1, heads=1, head_dim=4,
        device="cpu", copier=odd,
    )  # fmt: skip
    with pytest.raises(BadArgument) as refused:
        Tiers(config)
    assert str(refused.value) == (
        "copy engine: the copier's compute_stream must be a stream (torch.cuda.Stream or "
        "the Streams' own), got str"
    )
    with pytest.raises(CopyFailed, match=r"^copy engine closed: d2h copy refused$"):
        built[0].start_write([0], [0])  # closed, as Tiers.close closes it


def _config(copier: Callable[[KVPool, KVPool], object]) -> CacheConfig:
    return CacheConfig(
        device_pages=4, host_pages=4, page_size=2, layers=1, heads=1, head_dim=4,
        device="cpu", load_back_threshold=0, copier=copier,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture
def closed_pools(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the pools closed (their memory given back) from now on, in order."""
    closed: list[str] = []
    close = KVPool.close

    def recording(pool: KVPool) -> None:
        closed.append(pool.name)
        close(pool)

    monkeypatch.setattr(KVPool, "close", recording)
    return closed


def _raw(kv: torch.Tensor) -> torch.Tensor:
    return kv.contiguous().view(torch.uint8)


@pytest.mark.parametrize("wrap", [False, True], ids=["engine", "wrapped"])
def test_a_copier_handing_one_engine_to_two_caches_is_refused_at_the_second(
    wrap: bool, closed_pools: list[str]
) -> None:
    """The second cache's copies ran in the first cache's pools, corrupting its KV.

    Refused as the second cache is built, through a wrapper too (each cache a
    new wrapper over the one engine); the first cache's engine is not closed,
    and the second cache's pools are given back.
    """
    engines: list[CopyEngine] = []

    def once(device: KVPool, host: KVPool) -> object:  # a factory that caches its engine
        if not engines:
            engines.append(CopyEngine(device, host))
        return FaultyCopyEngine(engines[0]) if wrap else engines[0]

    config = _config(once)
    first = HiCache(config)
    with pytest.raises(ConfigError) as refused:
        HiCache(config)
    assert str(refused.value) == (
        "config: copier returned an engine over another device pool and another host pool "
        "than it was called with (another cache's engine?): it must build a new CopyEngine "
        "from the pools it is given"
    )
    assert closed_pools == ["host", "device"]  # the second cache's, as Tiers.close gives them
    assert not engines[0].closed
    tokens = [1, 2, 3, 4]
    first.insert(tokens)
    first.poll()
    assert first.evict(4) == 4
    first.load_back(first.match_prefix(tokens).last_host_node)
    first.poll()
    hit = first.match_prefix(tokens)
    assert hit.device_len == 4
    layout = config.layout()
    assert torch.equal(
        _raw(first.tiers.read_device(hit.device_pages)), _raw(synthetic_kv(layout, tokens))
    )
    first.close()


class _Delegating:
    """A user's wrapper of a copy engine, no FaultyCopyEngine: ``inner``, and its methods."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _Bare:
    """Names an engine ``inner`` but has none of a copy engine's methods."""

    def __init__(self, inner: object) -> None:
        self.inner = inner


def test_a_wrapper_of_the_caches_own_engine_is_taken_by_its_inner() -> None:
    """A wrapper is found by its ``inner``, whatever its class, and through wrappers of wrappers."""
    for build in (
        lambda d, h: _Delegating(CopyEngine(d, h)),
        lambda d, h: _Delegating(FaultyCopyEngine(CopyEngine(d, h))),
        FaultyCopyEngine.copier(engine=lambda d, h: _Delegating(CopyEngine(d, h))),  # type: ignore[arg-type,return-value]
    ):
        cache = HiCache(_config(build))
        cache.insert([1, 2, 3, 4])
        cache.poll()
        assert [n.host for n in cache.tree if n.key] == ["backed"]
        cache.close()


@pytest.mark.parametrize(
    ("made", "message"),
    [
        (lambda d, h: None, "got NoneType"),
        (lambda d, h: (d, h), "got tuple"),
        (lambda d, h: _Bare(None), "got _Bare"),
        (lambda d, h: _Delegating(_Delegating(h)), "got _Delegating"),
    ],
    ids=["None", "the pools", "no inner engine", "a wrapper of no engine"],
)
def test_a_copier_returning_no_copy_engine_is_refused_and_gives_the_pools_back(
    made: Callable[[KVPool, KVPool], object], message: str, closed_pools: list[str]
) -> None:
    """Taken, it failed at the first insert, untyped (EffectFailed: 'NoneType' ... 'host_busy')."""
    with pytest.raises(ConfigError) as refused:
        HiCache(_config(made))
    assert str(refused.value) == (
        "config: copier must return a CopyEngine over the pools it is given, or a wrapper of "
        f"one that names it inner, {message}"
    )
    assert closed_pools == ["host", "device"]


def test_a_wrapper_that_wraps_itself_is_no_engine() -> None:
    looped = _Bare(None)
    looped.inner = _Bare(looped)
    with pytest.raises(ConfigError, match=r"or a wrapper of one that names it inner, got _Bare$"):
        Tiers(_config(lambda d, h: looped))


def test_a_wrapper_without_the_engine_methods_is_refused_and_its_engine_closed(
    closed_pools: list[str],
) -> None:
    built: list[CopyEngine] = []

    def bare(device: KVPool, host: KVPool) -> _Bare:
        built.append(CopyEngine(device, host))
        return _Bare(built[-1])

    with pytest.raises(ConfigError) as refused:
        Tiers(_config(bare))
    assert str(refused.value) == (
        "config: copier returned a _Bare, which lacks the copy engine methods start_write, "
        "start_load, poll, drain, wait, close, in_flight, device_busy, host_busy, "
        "busy_device_pages, busy_host_pages"
    )
    assert built[0].closed  # built over this cache's pools: no one else's
    assert closed_pools == ["host", "device"]


def test_an_engine_over_one_pool_of_the_cache_is_refused_and_closed(
    closed_pools: list[str],
) -> None:
    """An engine over the cache's device pool and a host pool of its own: the cache's to close."""
    built: list[CopyEngine] = []

    def half(device: KVPool, host: KVPool) -> CopyEngine:
        built.append(CopyEngine(device, host_pool(device.layout, 4)))
        return built[-1]

    with pytest.raises(ConfigError) as refused:
        Tiers(_config(half))
    assert str(refused.value) == (
        "config: copier returned an engine over another host pool than it was called with "
        "(another cache's engine?): it must build a new CopyEngine from the pools it is given"
    )
    assert built[0].closed
    assert closed_pools == ["host", "device"]


def test_a_copier_that_raises_gives_the_pools_back(closed_pools: list[str]) -> None:
    def broken(device: KVPool, host: KVPool) -> CopyEngine:
        raise RuntimeError("no engine today")

    with pytest.raises(RuntimeError, match=r"^no engine today$"):
        Tiers(_config(broken))
    assert closed_pools == ["host", "device"]


def test_copier_over_deferred_copies_and_its_options_pickle() -> None:
    fake = FakeStreams(max_polls=0)
    dev, host = _pools()
    engine = FaultyCopyEngine.copier(engine=deferred_copier(streams=fake))(dev, host)
    engine.start_load([0], [1])
    assert [c.ok for c in engine.drain()] == [True]
    assert len(fake.events) == 1
    build = pickle.loads(
        pickle.dumps(FaultyCopyEngine.copier(engine=functools.partial(CopyEngine, batch_polls=2)))
    )
    batched = build(dev, host)
    ticket = batched.start_write([3], [3])
    assert batched.poll() == []  # the batch waits for its second poll
    assert [c.ticket for c in batched.poll()] == [ticket]


def test_copier_refuses_an_engine_that_cannot_be_called_when_called() -> None:
    with pytest.raises(BadArgument) as caught:  # a TypeError too
        FaultyCopyEngine.copier(engine="CopyEngine", fail=[1])  # type: ignore[arg-type]
    assert str(caught.value) == (
        "FaultyCopyEngine.copier: engine must build a CopyEngine from the device and host "
        "pools, got str"
    )


BAD_FAULTS: dict[str, tuple[dict[str, object], str]] = {
    "a lone position": (
        {"fail": 3},
        "fail must be a collection of copy positions (ints >= 1), got 3",
    ),
    "a string of positions": (
        {"refuse": "3"},
        "refuse must be a collection of copy positions (ints >= 1), got '3'",
    ),
    "position 0": ({"fail": [0]}, "fail holds 0; copies are counted from 1 (ints >= 1)"),
    "a bool position": (
        {"refuse": [True]},
        "refuse holds True; copies are counted from 1 (ints >= 1)",
    ),
    "a negative delay": ({"delay": -1}, "delay must be an int >= 0, got -1"),
    "a bool delay": ({"delay": True}, "delay must be an int >= 0, got True"),
    "a string seed": ({"seed": "x"}, "seed must be an int, got 'x'"),
    "a shuffle that is no bool": ({"shuffle": 1}, "shuffle must be a bool, got 1"),
    "a poison that is no bool": ({"poison": None}, "poison must be a bool, got None"),
}


@pytest.mark.parametrize("case", list(BAD_FAULTS))
def test_a_bad_fault_setting_is_refused_by_name_when_given(case: str) -> None:
    """``fail=3`` raised a bare TypeError; a negative delay or a string seed was taken silently."""
    faults, message = BAD_FAULTS[case]
    dev, host = _pools()
    with pytest.raises(BadArgument) as caught:
        FaultyCopyEngine(CopyEngine(dev, host), **faults)  # type: ignore[arg-type]
    assert str(caught.value) == f"FaultyCopyEngine: {message}"
    with pytest.raises(
        BadArgument
    ) as caught:  # when the factory is made, not when a cache calls it
        FaultyCopyEngine.copier(**faults)  # type: ignore[arg-type]
    assert str(caught.value) == f"FaultyCopyEngine: {message}"


def test_copier_refuses_an_unknown_fault_as_a_bad_argument() -> None:
    """docs/errors.md: every error raised on purpose is an FsmCacheError; this was a TypeError."""
    with pytest.raises(BadArgument) as caught:
        FaultyCopyEngine.copier(fial=[3])  # type: ignore[call-arg]
    assert str(caught.value) == "FaultyCopyEngine.copier got unknown faults: fial"


@pytest.mark.gpu
@needs_cuda
def test_a_failed_loads_poison_is_what_a_waiting_cuda_stream_reads() -> None:
    """On a GPU: compute on its own stream, made to wait for the load, reads the poison."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    dev, host = _pools(cuda)
    forward = torch.cuda.Stream(cuda)  # type: ignore[no-untyped-call]
    engine = FaultyCopyEngine(CopyEngine(dev, host, compute_stream=forward), fail=[1])
    ticket = engine.start_load([3], [6])
    assert engine.wait([ticket.id])
    with torch.cuda.stream(forward):
        seen = dev.read([6]).view(torch.uint8).clone()
    forward.synchronize()
    assert bool((seen == POISON).all())
    (done,) = engine.drain()
    assert str(done.error) == "injected failure of copy 1"
    engine.close()
