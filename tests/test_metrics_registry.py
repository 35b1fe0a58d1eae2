"""Prometheus metrics: several caches per registry, and the same figures as ``stats()``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from fsm_cache.cache import metrics
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.metrics import Collector, register
from fsm_cache.cache.replay import replay
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.errors import BadArgument
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.storage import LocalFileStore
from fsm_cache.testing.faults import FaultyCopyEngine


prometheus_client = pytest.importorskip("prometheus_client")

BASE = CacheConfig(
    device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4, device="cpu"
)


def series(registry: object, metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in registry.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            if sample.name == metric:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_two_caches_share_a_registry_each_labelled() -> None:
    """Two caches in one registry: one series each, told apart by their ``cache`` label."""
    registry = prometheus_client.CollectorRegistry()
    a, b = HiCache(BASE), HiCache(BASE)
    a.insert(list(range(8)))
    b.insert(list(range(16)))
    first = register(a, registry, name="a")
    assert register(b, registry, name="b") is first
    assert series(registry, "fsm_cache_tokens") == {
        (("cache", "a"), ("tier", "device")): 8.0,
        (("cache", "a"), ("tier", "host")): 8.0,
        (("cache", "a"), ("tier", "storage")): 0.0,
        (("cache", "b"), ("tier", "device")): 16.0,
        (("cache", "b"), ("tier", "host")): 16.0,
        (("cache", "b"), ("tier", "storage")): 0.0,
    }
    text = prometheus_client.generate_latest(registry).decode()
    assert 'fsm_cache_transitions_total{cache="a",event="write"} 1.0' in text
    with pytest.raises(BadArgument) as caught:
        register(HiCache(BASE), registry, name="a")
    assert str(caught.value) == "register: a cache named 'a' is registered already"
    first.remove("b")
    assert first.names == ("a",)


def test_unnamed_caches_get_unique_names_in_the_default_registry() -> None:
    """The default registry takes two caches; each gets a generated name of its own."""
    a, b = HiCache(BASE), HiCache(BASE)
    collector = register(a)
    try:
        assert register(b) is collector
        assert len(set(collector.names)) == len(collector.names)
        described = [family.name for family in collector.describe()]
        assert "fsm_cache_tokens" in described
        assert all(not family.samples for family in collector.describe())
    finally:
        for name in collector.names:
            collector.remove(name)


def test_storage_copies_in_flight_are_the_stats_figure(tmp_path: Path) -> None:
    """``fsm_cache_storage_copies_in_flight`` reports what ``stats()`` reports."""
    tier = StorageConfig(LocalFileStore(str(tmp_path)), model="m", threads=0)
    with HiCache(BASE, storage=tier) as cache:
        registry = prometheus_client.CollectorRegistry()
        register(cache, registry, name="c")
        cache.insert(list(range(16)))
        cache.poll()
        assert cache.stats().storage_in_flight == 1
        assert series(registry, "fsm_cache_storage_copies_in_flight") == {(("cache", "c"),): 1.0}


def test_copies_in_flight_are_the_copies_issued_and_not_applied() -> None:
    """A replayed cache's copies are in flight until applied, whatever its engine reports."""

    cache = HiCache(replace(BASE, copier=FaultyCopyEngine.copier(delay=3)))
    cache.insert(list(range(8)))
    cache.poll()
    again = replay(cache.log, BASE)
    assert len(again.issued()) == 1
    assert again.stats().copies_in_flight == 1
    cache.close()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda reg, _: register(5, reg, name="b"),  # type: ignore[arg-type]
            "register: cache must have a stats() method (a HiCache), got int",
        ),
        (
            lambda reg, _: register(HiCache(BASE), 7, name="b"),
            "register: registry must be a prometheus_client CollectorRegistry or None, got int",
        ),
        (
            lambda reg, _: register(HiCache(BASE), reg, prefix="fsm cache"),
            "register: prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), "
            "got 'fsm cache'",
        ),
        (
            lambda reg, _: register(HiCache(BASE), reg, prefix=""),
            "register: prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got ''",
        ),
        (
            lambda reg, _: register(HiCache(BASE), reg, prefix=3),  # type: ignore[arg-type]
            "register: prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got 3",
        ),
        (
            lambda _, collector: collector.add(object(), "c"),
            "register: cache must have a stats() method (a HiCache), got object",
        ),
        (  # its gauge fsm_cache_hit_tokens is the default prefix's counter
            lambda reg, _: register(HiCache(BASE), reg, prefix="fsm_cache_hit", name="b"),
            "register: prefix 'fsm_cache_hit' makes series the registry has already: "
            "fsm_cache_hit_tokens",
        ),
    ],
)
def test_what_a_scrape_could_not_read_is_refused_at_register(
    call: Callable[[object, Collector], object], message: str
) -> None:
    """A refused registration leaves the registry scraping the caches it had, and only those."""
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    collector = register(cache, registry, name="a")
    before = prometheus_client.generate_latest(registry)
    with pytest.raises(BadArgument) as caught:
        call(registry, collector)
    assert str(caught.value) == message
    assert prometheus_client.generate_latest(registry) == before
    assert collector.names == ("a",)


def test_a_reset_restarts_the_counters_and_says_when(monkeypatch: pytest.MonkeyPatch) -> None:
    """Totals going down on a reset are a restart (``_created`` moves), never a decrease."""
    clock = iter([1000.0, 2000.0])

    class Clock:
        @staticmethod
        def time() -> float:
            return next(clock)

    monkeypatch.setattr(metrics, "time", Clock)
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(BASE)  # its counters start at 1000
    register(cache, registry, name="a")
    cache.insert(list(range(8)))
    cache.poll()
    cache.insert(list(range(16)))
    write = (("cache", "a"), ("event", "write"))
    assert series(registry, "fsm_cache_transitions_total")[write] == 2.0
    assert series(registry, "fsm_cache_transitions_created")[write] == 1000.0
    cache.reset()  # its counters start again at 2000
    cache.insert(list(range(8)))
    assert series(registry, "fsm_cache_transitions_total")[write] == 1.0
    created = [
        (sample.name, sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.name.endswith("_created")
    ]
    assert {name for name, _ in created} == {  # no copy yet
        "fsm_cache_transitions_created",
        "fsm_cache_lookup_tokens_created",
        "fsm_cache_hit_tokens_created",
    }
    assert {value for _, value in created} == {2000.0}
    text = prometheus_client.generate_latest(registry).decode()
    assert "fsm_cache_tokens_created" not in text  # a gauge counts nothing: it has none


def test_a_failed_copy_is_counted_where_a_scrape_sees_it() -> None:
    """Device-host copies that fail were counted in the cache and shown nowhere."""
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(replace(BASE, copier=FaultyCopyEngine.copier(fail=[1])))
    register(cache, registry, name="a")
    cache.insert(list(range(8)))
    cache.poll()  # the backup's copy fails: the node stays unbacked, its copy to run again
    assert cache.stats().copy_failures == {"d2h": 1}
    assert series(registry, "fsm_cache_copy_failures_total") == {
        (("cache", "a"), ("direction", "d2h")): 1.0
    }
    cache.close()


def test_hit_counters_give_a_window_the_lifetime_gauge_cannot() -> None:
    """The token counters move by what each lookup matched; ``hit_rate`` averages them all.

    A scrape-to-scrape rate (what PromQL's ``rate()`` computes from two
    samples) comes from ``fsm_cache_hit_tokens_total`` over
    ``fsm_cache_lookup_tokens_total``; the gauge stays the average since the
    counters started.
    """
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    register(cache, registry, name="c")
    cache.match_prefix(list(range(8)))  # 8 of 8 on the device
    first = (
        series(registry, "fsm_cache_hit_tokens_total"),
        series(registry, "fsm_cache_lookup_tokens_total"),
    )
    cache.match_prefix(list(range(100, 124)))  # 0 of 24
    hits, looked = (
        series(registry, "fsm_cache_hit_tokens_total"),
        series(registry, "fsm_cache_lookup_tokens_total"),
    )
    device = (("cache", "c"), ("tier", "device"))
    assert first == (
        {device: 8.0, (("cache", "c"), ("tier", "host")): 0.0},
        {(("cache", "c"),): 8.0},
    )
    assert (hits[device] - first[0][device]) / (looked[(("cache", "c"),)] - 8.0) == 0.0
    assert series(registry, "fsm_cache_hit_rate")[device] == 8 / 32
    assert "fsm_cache_lookup_tokens_created" in prometheus_client.generate_latest(registry).decode()


def test_a_scrape_reads_a_cache_its_thread_changes_meanwhile() -> None:
    """A scrape on the HTTP server's thread reads while the scheduler's thread inserts.

    The scrape used to walk a node's children as they were being added and
    raise ``dictionary changed size during iteration``, ending the whole
    scrape. The interleaving is forced, not timed: a trace hook inserts a
    child under one busy node between every two bytecodes the walk of the
    tree runs (up to ``budget``), each a point where the interpreter could
    switch threads.
    """
    config = replace(BASE, page_size=1, device_pages=4096, host_pages=8192)
    cache = HiCache(config)
    for token in range(1, 9):
        cache.insert([0, token])
    registry = prometheus_client.CollectorRegistry()
    register(cache, registry, name="a")
    budget = 3000  # the device holds every node: none is evicted
    inserted: list[int] = []

    def scheduler(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        code = frame.f_code
        if (
            event == "opcode"
            and code.co_filename == metrics.__file__
            and code.co_name in {"snapshot", "<genexpr>"}
            and len(inserted) < budget
        ):
            inserted.append(100 + len(inserted))
            cache.insert([0, inserted[-1]])
        return scheduler

    before = sys.gettrace()
    sys.settrace(scheduler)
    try:
        scraped = list(registry.collect())
    finally:
        sys.settrace(before)
    assert len(inserted) > 8  # the tree changed under the walk, all along it
    figures = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in scraped
        for sample in family.samples
    }
    assert figures["fsm_cache_scrape_errors_total", (("cache", "a"),)] == 0.0
    device = (("cache", "a"), ("tier", "device"))
    assert 1 + 8 < figures["fsm_cache_tokens", device] < 1 + 8 + len(inserted)  # a moment's
    assert series(registry, "fsm_cache_tokens")[device] == 1 + 8 + len(inserted)


class Scraped:
    """What one scrape of a registry read, to look at more than once."""

    def __init__(self, registry: Any) -> None:
        self.families = list(registry.collect())

    def collect(self) -> list[Any]:
        return self.families


class Unreadable:
    """A cache whose stats raise the first ``fails`` times they are read (all, if None)."""

    def __init__(self, fails: int | None) -> None:
        self.cache = HiCache(BASE)
        self.fails = fails

    def stats(self) -> metrics.Stats:
        if self.fails is None or self.fails > 0:
            self.fails = None if self.fails is None else self.fails - 1
            raise RuntimeError("dictionary changed size during iteration")
        return self.cache.stats()


def test_a_cache_that_cannot_be_read_leaves_only_its_own_series_out() -> None:
    """One cache's failing stats used to end the scrape: every cache's series went blank.

    A read that fails is tried again (the cache changed under it); one that
    keeps failing leaves that cache out of the scrape and counts a
    ``scrape_errors``, and the registry's other caches still report.
    """
    registry = prometheus_client.CollectorRegistry()
    good = HiCache(BASE)
    good.insert(list(range(8)))
    collector = register(good, registry, name="good")
    register(Unreadable(fails=None), registry, name="broken")
    register(Unreadable(fails=2), registry, name="flaky")  # read on its third try
    for scrape in (1, 2):
        once = Scraped(registry)
        assert series(once, "fsm_cache_tokens") == {
            (("cache", "good"), ("tier", "device")): 8.0,
            (("cache", "good"), ("tier", "host")): 8.0,
            (("cache", "good"), ("tier", "storage")): 0.0,
            (("cache", "flaky"), ("tier", "device")): 0.0,
            (("cache", "flaky"), ("tier", "host")): 0.0,
            (("cache", "flaky"), ("tier", "storage")): 0.0,
        }
        assert series(once, "fsm_cache_scrape_errors_total") == {
            (("cache", "good"),): 0.0,
            (("cache", "broken"),): float(scrape),
            (("cache", "flaky"),): 0.0,
        }
    collector.remove("broken")
    register(Unreadable(fails=None), registry, name="broken")  # its count starts again
    assert series(registry, "fsm_cache_scrape_errors_total")[(("cache", "broken"),)] == 1.0


def test_a_collector_the_registry_dropped_is_not_used_again() -> None:
    """After the registry's own ``unregister``, a new cache went to the dropped collector.

    It was never scraped. It goes to a new collector, registered in its
    place, which reports it and not the caches of the one dropped.
    """
    registry = prometheus_client.CollectorRegistry()
    old = register(HiCache(BASE), registry, name="old")
    registry.unregister(old)
    new = register(HiCache(BASE), registry, name="new")
    assert new is not old
    assert new.names == ("new",)
    assert register(HiCache(BASE), registry, name="next") is new  # still registered: shared
    assert set(series(registry, "fsm_cache_pins")) == {
        (("cache", "new"),),
        (("cache", "next"),),
    }
    registry.unregister(new)
    prometheus_client.Gauge("fsm_cache_pins", "Someone else's", registry=registry)
    with pytest.raises(BadArgument) as caught:  # not the dropped collector either
        register(HiCache(BASE), registry, name="last")
    assert str(caught.value) == (
        "register: prefix 'fsm_cache' makes series the registry has already: fsm_cache_pins"
    )


def test_a_cache_registered_twice_is_refused() -> None:
    """The same cache registered again (named or not) was reported twice, doubling every sum."""
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(BASE)
    cache.insert(list(range(8)))
    collector = register(cache, registry, name="a")
    before = prometheus_client.generate_latest(registry)
    for name in (None, "b", "a"):
        with pytest.raises(BadArgument) as caught:
            register(cache, registry, name=name)
        assert str(caught.value) == "register: this cache is registered already, as 'a'"
    assert collector.names == ("a",)
    assert prometheus_client.generate_latest(registry) == before
    other = prometheus_client.CollectorRegistry()  # another registry may report it too
    register(cache, other, name="a")
    assert series(other, "fsm_cache_tokens") == series(registry, "fsm_cache_tokens")


def test_a_lock_on_a_namespace_root_is_counted() -> None:
    """A miss's lock is its root's: ``locks`` counts it, so a leaked one shows.

    The sum ran over the tree's nodes, which leave the roots out: a request
    that matched nothing held a lock no figure showed.
    """
    registry = prometheus_client.CollectorRegistry()
    cache = HiCache(BASE)
    register(cache, registry, name="c")
    miss = cache.lock(cache.match_prefix(list(range(6))).last_device_node)
    lora = cache.lock(cache.match_prefix(list(range(6)), namespace="lora").last_device_node)
    assert cache.stats().locks == 2
    assert series(registry, "fsm_cache_locks") == {(("cache", "c"),): 2.0}
    cache.insert(list(range(8)))
    held = cache.lock(cache.match_prefix(list(range(8))).last_device_node)  # under the root
    assert cache.stats().locks == 3
    for lease in (miss, lora, held):
        lease.release()
    assert cache.stats().locks == 0


def test_hit_rates_are_over_the_tokens_looked_up() -> None:
    """A lookup counts every token asked for, a partial last page too, as SGLang's hit rate does.

    It counted the page-aligned part: a 3-token lookup of 4-token pages
    counted none, and the hit rates came out higher than they were.
    """
    cache = HiCache(BASE)
    cache.insert(list(range(4)))
    cache.match_prefix(list(range(7)))  # 4 of 7 on the device
    cache.match_prefix([9, 9, 9])  # 0 of 3
    stats = cache.stats()
    assert stats.lookup_tokens == 10
    assert stats.device_hit_rate == 4 / 10
