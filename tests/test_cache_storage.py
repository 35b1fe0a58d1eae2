"""HiCache with a storage tier: backup after a host backup, prefetch on a match, and their faults.

The stores are a local-file store in a temp dir and a Redis store on
fakeredis (in process); tests/test_storage_redis_caches.py shares a real
``redis-server`` between two caches. Copies run inline (``threads=0``) unless a
test needs a copy in flight across calls (timeouts), so each step is
deterministic: a poll applies what the previous operation started.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch
from clocks import HandClock
from prometheus_client import CollectorRegistry, generate_latest

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.metrics import register
from fsm_cache.cache.storage_tier import QueryBackoff, StorageConfig
from fsm_cache.cache.tree import TreeNode
from fsm_cache.errors import (
    BadArgument,
    ConfigError,
    EffectFailed,
    InvariantViolation,
    PoolExhausted,
    StoreFailed,
    error_class,
)
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.residency import Residency, split_prefix
from fsm_cache.storage import LocalFileStore, PutResult, RedisStore, Store, page_keys


PAGE = 4


def config(**overrides: Any) -> CacheConfig:
    """A small CPU cache of 4-token pages, checked after every operation."""
    settings: dict[str, Any] = {
        "device_pages": 16,
        "host_pages": 32,
        "page_size": PAGE,
        "layers": 1,
        "heads": 1,
        "head_dim": 4,
        "device": "cpu",
        "debug": True,
        "load_back_threshold": 0,
    }
    settings.update(overrides)
    return CacheConfig(**settings)


def tier(store: Store, **overrides: Any) -> StorageConfig:
    """Inline copies, prefetch from one page on.

    A query is slow only past 5 s, so that a busy machine does not back a test
    off that is not about slow queries (those set their own budget).
    """
    settings: dict[str, Any] = {"threads": 0, "prefetch_threshold": PAGE, "query_budget": 5.0}
    settings.update(overrides)
    return StorageConfig(store, **{"model": "test", **settings})


def tokens(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PAGE))


def states(cache: HiCache) -> list[tuple[int, int, str, str, str, int]]:
    """Every node: id, tokens, host, device, storage, pins."""
    return [(n.id, len(n.key), n.host, n.device, n.storage, n.pins) for n in cache.tree]


def stored_cache(store: Store, toks: Sequence[int], **overrides: Any) -> HiCache:
    """A cache that inserted ``toks`` and stored them (two polls: host, then storage)."""
    cache = HiCache(config(), storage=tier(store, **overrides))
    cache.insert(toks)
    cache.poll()  # write_done: the store starts
    cache.poll()  # store_done
    return cache


def torn_store(
    folder: Path, toks: Sequence[int], page: int
) -> tuple[LocalFileStore, list[str], Path]:
    """A local store in ``folder`` holding ``toks``, its page ``page`` torn (8 bytes cut off).

    Returns the store, the keys of ``toks``' pages and the torn page's file.
    """
    store = LocalFileStore(folder)
    writer = stored_cache(store, toks)
    keys = page_keys(writer.storage.namespace(), toks)  # type: ignore[union-attr]
    torn = store.path(keys[page])
    torn.write_bytes(torn.read_bytes()[:-8])
    return store, keys, torn


def device_kv_matches(cache: HiCache, toks: Sequence[int]) -> bool:
    """Load ``toks``' cached prefix to the device and compare its KV with what was written."""
    found = cache.match_prefix(toks)
    if found.host_len:
        assert cache.load_back(found.last_host_node) is not None
        cache.poll()
        found = cache.match_prefix(toks)
    kv = cache.tiers.read_device(list(found.device_pages))
    return found.device_len == len(toks) and torch.equal(
        kv, synthetic_kv(cache.tiers.device.layout, toks[: found.device_len])
    )


@pytest.fixture(params=["local", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each backend, empty: files in a temp dir, or fakeredis."""
    if request.param == "local":
        yield LocalFileStore(tmp_path / "pages")
    else:
        yield RedisStore(fakeredis.FakeRedis(), batch_pages=3)


class FaultyStore:
    """A store that passes through to ``inner`` except where a test plants a fault.

    Attributes:
        put_fails_after: Raise StoreFailed after storing this many pages of a put.
        raises: Method names that raise ``error`` instead.
        error: What they raise (a RuntimeError unless a test says otherwise).
        gate: Puts and gets wait for this event first (a hung backend).
        after_exists: Called after each ``exists_prefix`` (drop a page behind its back).
        calls: Method names called, in order.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.put_fails_after: int | None = None
        self.reports: Callable[[int], object] = int  # the acknowledged count a failure reports
        self.raises: set[str] = set()
        self.error: type[BaseException] = RuntimeError
        self.gate: threading.Event | None = None
        self.after_exists: Callable[[], None] | None = None
        self.calls: list[str] = []

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in ("put", "get") and self.gate is not None:
            self.gate.wait()
        if name in self.raises:
            raise self.error(f"planted fault in {name}")

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._enter("exists_prefix")
        found = self.inner.exists_prefix(keys)
        if self.after_exists is not None:
            self.after_exists()
        return found

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        self._enter("get")
        return self.inner.get(keys)

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        self._enter("put")
        cut = self.put_fails_after
        if cut is not None and cut < len(keys):
            self.inner.put(keys[:cut], pages[:cut])
            said = self.reports(cut)
            raise StoreFailed("faulty", "put", acknowledged=said, total=len(keys), cause="planted")  # type: ignore[arg-type]
        return self.inner.put(keys, pages)

    def drop(self, keys: Sequence[str]) -> int:
        self._enter("drop")
        return self.inner.drop(keys)

    def capacity(self) -> Any:
        return self.inner.capacity()

    def close(self) -> None:
        self.inner.close()


# -- configuration ------------------------------------------------------------


def test_without_a_store_nothing_changes(tmp_path: Path) -> None:
    """No storage tier: the two-tier spec, no storage events, no storage field set."""
    plain = HiCache(config())
    assert plain.machine.engine.system.name == "residency"
    assert plain.storage is None
    with pytest.raises(BadArgument) as info:
        plain.fire("store", plain.tree.root())
    assert (
        str(info.value) == "fire: 'store' is not a residency event (this cache has no storage tier)"
    )
    with pytest.raises(ConfigError, match=r"^evict_storage: this cache has no storage tier$"):
        plain.evict_storage(4)
    tiered = HiCache(config(), storage=tier(LocalFileStore(tmp_path)))
    assert tiered.machine.engine.system.name == "residency_storage"
    assert tiered.storage is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"policy": "always"}, "storage: policy must be one of write_through, off, got 'always'"),
        (
            {"prefetch_policy": "wait_complete"},
            "storage: prefetch_policy must be one of best_effort, wait, timeout, got 'wait_complete'",
        ),
        ({"threads": -1}, "storage: threads must be an int from 0 to 256, got -1"),
        ({"threads": 257}, "storage: threads must be an int from 0 to 256, got 257"),
        ({"threads": 10**9}, "storage: threads must be an int from 0 to 256, got 1000000000"),
        ({"threads": 1.0}, "storage: threads must be an int from 0 to 256, got 1.0"),
        ({"io_timeout": 0}, "storage: io_timeout must be seconds > 0, got 0"),
        ({"query_budget": 0}, "storage: query_budget must be seconds > 0, got 0"),
        ({"query_budget": float("nan")}, "storage: query_budget must be seconds > 0, got nan"),
        ({"query_budget": "1"}, "storage: query_budget must be seconds > 0, got '1'"),
        ({"query_backoff": -1}, "storage: query_backoff must be seconds >= 0, got -1"),
        (
            {"query_backoff_max": float("inf")},
            "storage: query_backoff_max must be seconds >= 0, got inf",
        ),
        (
            {"query_backoff": 5, "query_backoff_max": 2.5},
            "storage: query_backoff_max must be at least query_backoff (5), got 2.5",
        ),
        ({"rank": 2, "ranks": 2}, "storage: rank must be an int in 0..1, got 2"),
        ({"model": ""}, "storage: model must be a non-empty str, got ''"),
        ({"clock": 5.0}, "storage: clock must be a callable returning seconds, got 5.0"),
        # an int too large for a float made every later poll raise OverflowError
        (
            {"io_timeout": 10**400},
            "storage: io_timeout must be seconds a float can hold, got an int of 1329 bits",
        ),
        (  # past 4300 digits, its repr raised ValueError
            {"query_backoff_max": 10**5000},
            "storage: query_backoff_max must be seconds a float can hold, got an int of 16610 bits",
        ),
        (
            {"clock": lambda: 10**5000},
            "storage: clock must return a finite number of seconds, returned an int of 16610 bits",
        ),
        # a clock that answered anything but seconds failed every poll, or timed nothing out
        (
            {"clock": lambda: "x"},
            "storage: clock must return a finite number of seconds, returned 'x'",
        ),
        (
            {"clock": lambda: None},
            "storage: clock must return a finite number of seconds, returned None",
        ),
        (
            {"clock": lambda: float("nan")},
            "storage: clock must return a finite number of seconds, returned nan",
        ),
        (
            {"clock": lambda: 1 / 0},
            "storage: clock raised ZeroDivisionError when read: division by zero",
        ),
    ],
)
def test_a_bad_storage_config_is_refused_by_name(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        HiCache(config(), storage=tier(LocalFileStore(tmp_path), **overrides))
    assert str(info.value) == message


class Unreachable:
    """An object whose every attribute lookup raises, as a client that connects on first use."""

    def __getattr__(self, name: str) -> object:
        raise ConnectionError("server down")


def test_a_store_needs_the_store_methods_and_host_pages(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        HiCache(config(), storage=StorageConfig(object(), model="test"))  # type: ignore[arg-type]
    assert str(info.value) == (
        "storage: store must be a Store (exists_prefix, get, put, drop, capacity, close), "
        "got object without exists_prefix, get, put, drop, capacity, close"
    )
    with pytest.raises(ConfigError) as info:  # its lookups raised ConnectionError untyped
        HiCache(config(), storage=StorageConfig(Unreachable(), model="test"))  # type: ignore[arg-type]
    assert str(info.value) == (
        "storage: store must be a Store, and looking up its exists_prefix raised "
        "ConnectionError: server down"
    )
    with pytest.raises(ConfigError) as info:  # every call would fail, as a store that is down
        HiCache(config(), storage=StorageConfig(LocalFileStore, model="test"))  # type: ignore[arg-type]
    assert str(info.value) == "storage: store must be a Store, got the class LocalFileStore"
    with pytest.raises(ConfigError, match=r"^storage: a storage tier needs host pages"):
        HiCache(config(host_pages=0), storage=tier(LocalFileStore(tmp_path)))


# -- backup to storage ----------------------------------------------------------


def test_a_host_backup_is_stored_holding_a_host_pin_until_acknowledged(store: Store) -> None:
    cache = HiCache(config(), storage=tier(store))
    toks = tokens(3)
    cache.insert(toks)
    (node,) = cache.tree
    assert (node.host, node.storage) == ("writing", "unstored")
    cache.poll()  # write_done: the store starts, with its pin
    assert (node.host, node.storage, node.pins) == ("pinned", "storing", 1)
    with pytest.raises(error_class("StorePinHeld")) as held:
        cache.fire("release", node)
    assert str(held.value) == (
        f"node {node.id}: release refused in pinned (pins=1, storage storing): "
        "the last pin belongs to the store in flight"
    )
    cache.poll()
    assert (node.host, node.storage, node.pins) == ("backed", "stored", 0)
    assert cache.storage is not None
    keys = page_keys(cache.storage.namespace(), toks)
    assert node.store_keys == tuple(keys)
    assert store.exists_prefix(keys) == 3
    assert cache.log.storage_acks() == [("poll", ((1, "store", 3, "ok"),))]
    assert cache.stats().storage_pages == {"stored": 3}


def test_children_are_stored_after_their_parent_and_chain_from_its_keys(store: Store) -> None:
    cache = HiCache(config(), storage=tier(store))
    head, more = tokens(2), tokens(2, start=5000)
    cache.insert(head)
    cache.insert(head + more)
    parent, child = cache.tree.walk(tuple(head + more)).path
    cache.poll()  # both host copies land; only the parent's store may start
    assert (parent.storage, child.storage) == ("storing", "unstored")
    cache.poll()  # the parent is stored: the child's store starts
    assert (parent.storage, child.storage) == ("stored", "storing")
    cache.poll()
    assert (parent.storage, child.storage) == ("stored", "stored")
    assert cache.storage is not None
    assert child.store_keys == tuple(page_keys(cache.storage.namespace(), head + more)[2:])


def test_policy_off_stores_only_what_is_fired(store: Store) -> None:
    cache = HiCache(config(), storage=tier(store, policy="off"))
    cache.insert(tokens(2))
    cache.poll()
    (node,) = cache.tree
    assert (node.host, node.storage) == ("backed", "unstored")
    cache.fire("store", node)
    cache.poll()
    assert node.storage == "stored"


def test_a_split_while_storing_acknowledges_both_halves(store: Store) -> None:
    """A lookup that ends inside a node being stored splits it; one acknowledgement serves both."""
    faulty = FaultyStore(store)
    cache = HiCache(config(), storage=tier(faulty, threads=1))
    toks = tokens(4)
    cache.insert(toks)
    gate = faulty.gate = threading.Event()  # the put waits until the split is done
    cache.poll()
    (node,) = cache.tree
    assert node.storage == "storing"
    cache.match_prefix(toks[: 2 * PAGE])  # splits the node being stored
    prefix, suffix = cache.tree.walk(tuple(toks)).path
    assert [(n.storage, n.pins) for n in (prefix, suffix)] == [("storing", 1), ("storing", 1)]
    gate.set()
    cache.close()
    assert [(n.storage, n.pins) for n in (prefix, suffix)] == [("stored", 0), ("stored", 0)]


def test_a_partial_acknowledgement_splits_the_node_at_the_first_failed_page(
    store: Store,
) -> None:
    faulty = FaultyStore(store)
    faulty.put_fails_after = 2
    cache = HiCache(config(), storage=tier(faulty))
    toks = tokens(5)
    cache.insert(toks)
    cache.poll()
    cache.poll()
    prefix, rest = cache.tree.walk(tuple(toks)).path
    assert [(len(n.key), n.host, n.storage, n.pins) for n in (prefix, rest)] == [
        (2 * PAGE, "backed", "stored", 0),
        (3 * PAGE, "backed", "unstored", 0),
    ]
    assert cache.log.storage_acks()[-1] == ("poll", ((1, "store", 2, "failed"),))
    assert cache.stats().storage_failures == {"store:failed": 1}
    assert cache.stats().storage_errors == {
        "store:failed": "faulty: put failed after 2 of 5 pages: planted"
    }
    assert store.exists_prefix(page_keys(cache.storage.namespace(), toks)) == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("said", "taken"),
    [
        (lambda cut: pytest.importorskip("numpy").int64(cut), 2),  # the int it stands for
        (lambda cut: True, 0),
        (lambda cut: -1, 0),
        (lambda cut: 99, 0),  # more pages than were put
        (lambda cut: "two", 0),
    ],
    ids=["numpy", "bool", "negative", "too many", "text"],
)
def test_a_failed_put_counts_only_what_it_acknowledged_as_a_count_of_its_pages(
    store: Store, said: Callable[[int], object], taken: int
) -> None:
    """The count comes from the store's code: checked where it enters, never trusted as it is.

    Compiled, a numpy count reached the counters and raised there, half applied.
    """
    faulty = FaultyStore(store)
    faulty.put_fails_after, faulty.reports = 2, said
    cache = HiCache(config(debug=True), storage=tier(faulty))
    toks = tokens(5)
    cache.insert(toks)
    cache.poll()
    cache.poll()
    cache.check_invariants()
    assert cache.log.storage_acks()[-1] == ("poll", ((1, "store", taken, "failed"),))
    path = cache.tree.walk(tuple(toks)).path
    assert [(len(n.key), n.storage, n.pins) for n in path] == (
        [(2 * PAGE, "stored", 0), (3 * PAGE, "unstored", 0)]
        if taken
        else [(5 * PAGE, "unstored", 0)]
    )


class Cancelled(BaseException):
    """What an event loop's cancellation or a green thread's timeout raises: no Exception."""


@pytest.mark.parametrize("error", [RuntimeError, Cancelled, SystemExit])
def test_a_store_that_raises_fails_the_store_and_the_worker_lives_on(
    store: Store, error: type[BaseException]
) -> None:
    """Whatever the store raises on a worker thread, that copy fails and the thread goes on.

    A BaseException ended the thread: every later copy waited in the queue
    for its timeout, and the storage tier served nothing until a restart.
    """
    faulty = FaultyStore(store)
    faulty.raises, faulty.error = {"put"}, error
    cache = HiCache(config(), storage=tier(faulty, threads=1, io_timeout=5.0))
    cache.insert(tokens(2))
    cache.poll()
    (node,) = cache.tree
    assert node.storage == "storing"
    cache.storage.in_flight()[1].done.wait(5)  # type: ignore[union-attr]
    cache.poll()
    assert (node.host, node.storage, node.pins) == ("backed", "unstored", 0)
    faulty.raises = set()
    cache.fire("store", node)  # the same worker thread takes the next copy
    cache.storage.in_flight()[2].done.wait(5)  # type: ignore[union-attr]
    cache.poll()
    assert (node.storage, node.pins) == ("stored", 0)
    assert cache.stats().storage_failures == {"store:failed": 1}
    cache.close()


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fsm-storage-")]


def test_threads_the_process_cannot_start_are_done_without(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the process's thread limit after one thread, the first store failed needlessly.

    When none can start, each copy fails at once (the test after this one).
    """
    startable = 1
    assert not _workers()
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def limited(thread: threading.Thread) -> None:
        if thread.name.startswith("fsm-storage-"):
            if len(started) >= startable:
                raise RuntimeError("can't start new thread")
            started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    cache = HiCache(config(), storage=tier(store, threads=4, io_timeout=5.0))
    for first in (1000, 5000):
        cache.insert(tokens(2, start=first))
        cache.poll()
        for copy in list(cache.storage.in_flight().values()):  # type: ignore[union-attr]
            copy.done.wait(5)
        cache.poll()
    assert sorted(n.storage for n in cache.tree) == ["stored", "stored"]
    assert len(_workers()) == startable  # the jobs went to the one that started
    cache.close()
    assert not _workers()


def test_close_waits_for_the_worker_threads_to_end(store: Store, clock: HandClock) -> None:
    """A thread still in the store when the interpreter exits can abort the process.

    close() let the threads go without waiting: one still in a put whose copy
    had timed out ran on past it, and a server that exited then could die of
    SIGABRT ("terminate called without an active exception").
    """
    assert not _workers()
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    cache = HiCache(
        config(), storage=tier(faulty, clock=clock.monotonic, threads=2, io_timeout=30.0)
    )
    cache.insert(tokens(2))
    cache.poll()
    clock.now += 30.0
    assert cache.poll() == 1  # the store timed out; its put still hangs on a thread
    assert len(_workers()) == 2
    threading.Timer(0.2, faulty.gate.set).start()  # the put returns while close waits
    cache.close()
    assert not _workers()


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_dropped_cache_ends_its_worker_threads(store: Store) -> None:
    """Dropped unclosed, a cache left its worker threads waiting on its queue for good.

    Its parts refer to each other, so only the cyclic collector ever reached
    them; the threads then ran until the interpreter exited, where a thread
    still in a store's code can abort the process.
    """
    assert not _workers()
    cache = HiCache(config(), storage=tier(store, threads=2))
    cache.insert(tokens(2))
    cache.poll()  # the backups finished: the stores start on the workers
    assert len(_workers()) == 2
    del cache
    for worker in _workers():  # told to end, not waited for: each ends after its job
        worker.join(30)
    assert not _workers()


_EXITS_UNCLOSED = """
import sys, time
from pathlib import Path

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.storage import LocalFileStore

folder = Path(sys.argv[1])


class SlowStore(LocalFileStore):
    def put(self, keys, pages):
        time.sleep(0.5)  # still in the store's code when the script ends
        done = super().put(keys, pages)
        (folder / "put-ended").write_text("yes")
        return done


CACHE = HiCache(
    CacheConfig(device_pages=16, host_pages=32, page_size=4, layers=1, heads=1, head_dim=4),
    storage=StorageConfig(SlowStore(folder / "store"), model="test", threads=1),
)
CACHE.insert(list(range(8)))
CACHE.poll()  # the host backup lands: the store starts on the worker
"""


def test_an_unclosed_cache_at_exit_lets_its_workers_end_first(tmp_path: Path) -> None:
    """A module global's cache is dropped only as the interpreter is torn down: too late.

    Its worker was still in the store's code then, and the process could
    abort ("terminate called without an active exception", exit 134). The
    workers of every unclosed cache are now ended at exit, as ``close()`` ends them.
    """
    script = tmp_path / "exits.py"
    script.write_text(_EXITS_UNCLOSED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert (tmp_path / "put-ended").read_text() == "yes"


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_dropped_cache_does_not_wait_for_a_worker_in_a_store(store: Store) -> None:
    """``__del__`` waited up to ``io_timeout`` behind a hung store, on whichever thread ran it.

    A store's copy works on a snapshot of its pages, so nothing is gained by
    waiting there: the worker is told to end, and ends after its store.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    cache = HiCache(config(), storage=tier(faulty, threads=1, io_timeout=60.0))
    cache.insert(tokens(2))
    cache.poll()  # the store starts, and hangs on the gate
    (worker,) = _workers()
    release = threading.Timer(2.0, faulty.gate.set)
    release.start()
    del cache
    assert worker.is_alive()  # not waited for: the gate opens two seconds later
    worker.join(30)
    assert not _workers()
    release.cancel()


def test_close_leaves_a_thread_hung_past_the_timeout(store: Store) -> None:
    """close() waits for the threads up to ``io_timeout``, and not for ever."""
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    cache = HiCache(config(), storage=tier(faulty, threads=1, io_timeout=0.2))
    cache.insert(tokens(2))
    cache.poll()
    cache.close()
    (hung,) = _workers()
    faulty.gate.set()
    hung.join(5)
    assert not _workers()


def test_a_copy_that_cannot_be_started_fails_and_the_copies_after_it_start(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No worker thread can start (a pids limit): each copy fails at once, none is stranded.

    A flush that raised at the first copy left the copies queued behind it
    started by no one and never applied: their nodes stayed ``storing`` with
    their host pins for ever, and the operation raised a RuntimeError.
    """
    cache = HiCache(config(), storage=tier(store, threads=1))
    cache.insert(tokens(2))
    cache.insert(tokens(2, start=5000))
    real = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("fsm-storage"):
            raise RuntimeError("can't start new thread")
        real(thread)

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", refuse)
        cache.poll()  # write_done for both: two stores start, or fail to
    assert sorted(n.storage for n in cache.tree) == ["storing", "storing"]
    assert cache.poll() == 2
    assert [(n.storage, n.pins) for n in cache.tree] == [("unstored", 0), ("unstored", 0)]
    assert cache.stats().storage_failures == {"store:failed": 2}
    first = next(n for n in cache.tree if list(n.key) == tokens(2))
    cache.fire("store", first)  # threads start now: the store is made again
    cache.storage.in_flight()[3].done.wait(5)  # type: ignore[union-attr]
    cache.poll()
    assert first.storage == "stored"
    cache.close()


class InterruptedStore(FaultyStore):
    """A store whose next put is interrupted by Ctrl-C (KeyboardInterrupt), once."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.interrupt = False

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt("Ctrl-C in a put")
        return super().put(keys, pages)


def test_an_interrupted_inline_store_fails_and_the_copies_after_it_start(store: Store) -> None:
    """Ctrl-C in a store's put run inline (``threads=0``): it fails, the copies behind it start.

    The flush took the whole queue and caught only Exception: the copy queued
    behind the interrupted one was started by no one and never collected, even
    as a timeout, so its node stayed ``storing`` with its host pin through
    every poll and through close.
    """
    faulty = InterruptedStore(store)
    cache = HiCache(config(), storage=tier(faulty))
    cache.insert(tokens(2))
    cache.insert(tokens(2, start=5000))
    faulty.interrupt = True
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in a put"):
        cache.poll()  # write_done for both: two stores queued, the first put interrupted
    first, second = copies = list(cache.storage.in_flight().values())  # type: ignore[union-attr]
    assert [c.result.outcome if c.result else None for c in copies] == ["failed", None]
    assert first.result.error == "KeyboardInterrupt: Ctrl-C in a put"
    assert second.started is None  # queued again, for the next flush
    cache.check_invariants()
    assert cache.poll() == 1  # the interrupted store fails; the other one starts
    assert cache.poll() == 1
    assert sorted((len(n.key), n.storage, n.pins) for n in cache.tree) == [
        (2 * PAGE, "stored", 0),
        (2 * PAGE, "unstored", 0),
    ]
    assert cache.stats().storage_failures == {"store:failed": 1}
    assert cache.storage.idle()  # type: ignore[union-attr]
    cache.close()


def test_a_copy_waited_for_under_a_timeout_of_years_is_waited_for(store: Store) -> None:
    """An ``io_timeout`` past the longest wait a lock takes: close waits for the copy.

    The wait's seconds went to ``Event.wait`` as they were, which raised
    OverflowError past ``threading.TIMEOUT_MAX``: close raised with a copy in flight.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    years = threading.TIMEOUT_MAX * 10
    cache = HiCache(config(), storage=tier(faulty, threads=1, io_timeout=years))
    cache.insert(tokens(2))
    cache.poll()
    (node,) = cache.tree
    assert node.storage == "storing"
    threading.Timer(0.2, faulty.gate.set).start()  # the backend answers while close waits
    cache.close()
    assert (node.storage, node.pins) == ("stored", 0)


def test_a_store_that_never_answers_is_failed_at_its_timeout(
    store: Store, clock: HandClock
) -> None:
    """SGLang #38427: a hung backup thread must not keep its host pin.

    The tier's clock is moved by hand: on the real one a loaded machine could
    take the whole timeout between the store's start and the poll that must
    find it not yet timed out.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    cache = HiCache(
        config(), storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=0.5)
    )
    cache.insert(tokens(2))
    cache.poll()
    (node,) = cache.tree
    assert (node.storage, node.pins) == ("storing", 1)
    clock.now += 0.25
    assert cache.poll() == 0  # not yet past its timeout
    clock.now += 0.25
    assert cache.poll() == 1
    assert (node.host, node.storage, node.pins) == ("backed", "unstored", 0)
    assert cache.log.storage_acks()[-1] == ("poll", ((1, "store", 0, "timeout"),))
    cache.evict(8)
    cache.evict_host(8)  # the pin is gone: host eviction may take it
    assert list(cache.tree) == []
    faulty.gate.set()  # the late answer comes to no one
    time.sleep(0.05)
    assert cache.poll() == 0
    cache.close()


# -- prefetch -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["best_effort", "wait", "timeout"])
def test_a_second_cache_prefetches_a_stored_prefix_bit_exact(store: Store, policy: str) -> None:
    toks = tokens(5)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, prefetch_policy=policy))
    found = reader.match_prefix([*toks, 7, 7])
    if policy == "best_effort":
        assert (found.host_len, found.storage_len) == (0, 5 * PAGE)
        (node,) = reader.tree
        assert (node.host, node.device, node.storage) == ("fetching", "absent", "reading")
        assert found.last_host_node is reader.tree.root()  # a fetching node is never handed out
        reader.poll()
        found = reader.match_prefix(toks)
    assert (found.device_len, found.host_len, found.storage_len) == (0, 5 * PAGE, 0)
    (node,) = reader.tree
    assert (node.host, node.device, node.storage) == ("backed", "absent", "stored")
    assert device_kv_matches(reader, toks)
    assert reader.stats().prefetch["started"] == 1


def test_a_lookup_past_the_cached_prefix_fetches_only_the_tail(store: Store) -> None:
    toks = tokens(6)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    reader.insert(toks[: 2 * PAGE])
    reader.poll()
    found = reader.match_prefix(toks)
    assert (found.device_len, found.host_len) == (2 * PAGE, 4 * PAGE)
    head, tail = reader.tree.walk(tuple(toks)).path
    assert tail.parent is head
    assert (tail.host, tail.storage) == ("backed", "stored")
    assert device_kv_matches(reader, toks)


def test_a_fetch_in_flight_is_waited_for_not_started_twice(store: Store) -> None:
    toks = tokens(4)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store))
    reader.match_prefix(toks)
    found = reader.match_prefix(toks)  # best effort: the same read, still unapplied
    assert (found.host_len, found.storage_len) == (0, 4 * PAGE)
    assert len(reader.storage.in_flight()) == 1  # type: ignore[union-attr]
    assert reader.stats().prefetch == {"started": 1, "in_flight": 1}


def test_thresholds_and_the_rate_limit_skip_prefetches(store: Store) -> None:
    first, second = tokens(4), tokens(4, start=7000)
    stored_cache(store, first + [1] * PAGE)
    stored_cache(store, second)
    reader = HiCache(config(), storage=tier(store, prefetch_threshold=8, prefetch_capacity=16))
    reader.match_prefix(first[:PAGE])  # one page: below the threshold
    reader.match_prefix(first)  # started: 16 tokens in flight
    reader.match_prefix(second)  # the capacity is taken
    assert reader.stats().prefetch == {"below_threshold": 1, "started": 1, "rate_limited": 1}
    reader.poll()  # the fetch lands: room again
    reader.match_prefix(second)
    assert reader.stats().prefetch["started"] == 2
    reader.poll()
    reader.match_prefix(tokens(4, start=90_000))
    assert reader.stats().prefetch["none_stored"] == 1


def test_a_fetch_past_the_host_pool_is_refused_and_changes_nothing(store: Store) -> None:
    toks = tokens(12)
    big = HiCache(config(device_pages=16, host_pages=32), storage=tier(store))
    big.insert(toks)
    big.poll()
    big.poll()
    small = HiCache(config(host_pages=8), storage=tier(store))
    before = small.log.recorded
    found = small.match_prefix(toks)
    assert (found.host_len, found.storage_len) == (0, 0)
    assert list(small.tree) == []
    assert small.tiers.host.allocator.free_pages == 8
    assert small.stats().prefetch == {"pool_exhausted": 1}
    assert [e[2] for e in small.log.since(before) if e[0] == "transition"] == [
        "born:discovered",
        "delete",
    ]


def test_a_page_that_vanishes_mid_prefix_leaves_the_prefix_before_it(store: Store) -> None:
    """Exists said six pages; by the read page 3 is gone: three are fetched, the rest vanish."""
    toks = tokens(6)
    writer = stored_cache(store, toks)
    keys = page_keys(writer.storage.namespace(), toks)  # type: ignore[union-attr]
    faulty = FaultyStore(store)

    def drop_page_3() -> None:
        store.drop([keys[3]])

    faulty.after_exists = drop_page_3
    reader = HiCache(config(), storage=tier(faulty, prefetch_policy="wait"))
    found = reader.match_prefix(toks)
    assert (found.host_len, found.storage_len) == (3 * PAGE, 0)
    (node,) = reader.tree
    assert (len(node.key), node.host, node.storage) == (3 * PAGE, "backed", "stored")
    assert reader.tiers.host.allocator.free_pages == 32 - 3  # the suffix's slots came back
    events = [e for _, e in reader.log.transitions()]
    assert events[-4:] == ["fetch_done", "fetch_failed", "vanish", "delete"]
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 3, "missing"),))]
    assert reader.stats().storage_pages == {"fetched": 3, "vanished": 3}
    assert device_kv_matches(reader, toks[: 3 * PAGE])


def test_a_query_that_raises_anything_asks_nothing_and_changes_nothing(store: Store) -> None:
    """Any exception of a store's ``exists_prefix`` counts as nothing found (not only StorageError).

    Under tensor-parallel agreement every rank must reach the hit count's
    all-reduce, so the lookup may not leave early on one rank.
    """
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.raises = {"exists_prefix"}  # a RuntimeError, as a raw client error would be
    reader = HiCache(config(), storage=tier(faulty, prefetch_policy="wait", query_backoff=0))
    found = reader.match_prefix(toks)
    assert (found.device_len, found.host_len, found.storage_len) == (0, 0, 0)
    assert list(reader.tree) == []
    assert reader.stats().prefetch == {"query_failed": 1}
    faulty.raises = set()
    assert reader.match_prefix(toks).host_len == 3 * PAGE
    reader.close()


@pytest.fixture
def clock() -> HandClock:
    """A clock moved by hand, for a tier to read (``tier(..., clock=clock.monotonic)``)."""
    return HandClock()


def test_a_query_backoff_doubles_per_failure_in_a_row_up_to_its_longest() -> None:
    backoff = QueryBackoff(1.0, 3.0)
    assert backoff.passed(0.0)  # none runs
    waits = []
    for now in (10.0, 20.0, 30.0, 40.0):
        backoff.failed(now)
        assert backoff.closed
        assert not backoff.passed(backoff.until - 0.001)
        waits.append(backoff.until - now)
        backoff.reopen()  # the tier let a trial query through
    assert waits == [1.0, 2.0, 3.0, 3.0]
    backoff.answered()
    backoff.failed(50.0)
    assert backoff.until == 51.0  # an answer starts the doubling over
    never = QueryBackoff(0.0, 0.0)
    never.failed(10.0)
    assert not never.closed
    assert never.passed(10.0)
    long = QueryBackoff(1.0, 30.0)
    long.failures = 5000
    long.failed(0.0)  # 2**5000 would overflow a float
    assert long.until == 30.0


def test_a_store_that_stops_answering_is_asked_again_only_after_a_backoff(
    store: Store, clock: HandClock
) -> None:
    """While the store is down each lookup would wait out the client's timeout on its thread.

    After a failed key query lookups ask nothing for ``query_backoff`` seconds,
    doubled after each failure in a row; the first query that answers ends it.
    """
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.raises = {"exists_prefix"}
    reader = HiCache(
        config(),
        storage=tier(
            faulty,
            clock=clock.monotonic,
            prefetch_policy="wait",
            query_backoff=1.0,
            query_backoff_max=5.0,
        ),
    )

    def lookup(after: float) -> int:
        clock.now += after
        return reader.match_prefix(toks).host_len

    assert lookup(0) == 0  # fails: back off one second
    assert lookup(0.5) == 0  # asks nothing
    assert faulty.calls == ["exists_prefix"]
    assert lookup(0.5) == 0  # a trial: fails again, back off two seconds
    assert lookup(1.9) == 0
    assert faulty.calls == ["exists_prefix"] * 2
    assert list(reader.tree) == []
    faulty.raises = set()
    assert lookup(0.1) == 3 * PAGE  # the store is back: asked, and fetched
    assert reader.stats().prefetch == {
        "query_failed": 2,
        "backing_off": 2,
        "started": 1,
        "read": 1,
    }
    assert reader.storage is not None
    assert (reader.storage.backoff.failures, reader.storage.backoff.closed) == (0, False)


def test_under_agreement_a_query_backoff_ends_only_where_the_group_says(
    store: Store, clock: HandClock
) -> None:
    """Another rank's store raised: this rank backs off too, and its clock alone ends nothing."""
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    reader = HiCache(config(), storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0))
    storage = reader.storage
    assert storage is not None
    asked: list[tuple[list[int], list[int]]] = []

    def another_rank_raises(found: Sequence[int], pages: Sequence[int]) -> list[int]:
        asked.append((list(found), list(pages)))
        return [0, 0, 0, 0]

    storage.agree_by(another_rank_raises)
    assert reader.match_prefix(toks).storage_len == 0
    assert asked == [([0, 3, 1, 1], [0, 3, 1, 1])]  # this rank's store answered, in time
    clock.now += 10.0
    assert storage.queries_may_resume()  # what this rank brings to the next step
    assert reader.match_prefix(toks).storage_len == 0  # but no step agreed yet
    assert faulty.calls == ["exists_prefix"]
    storage.resume_queries(False)  # another rank's clock says not yet
    assert reader.match_prefix(toks).storage_len == 0
    storage.resume_queries(True)
    storage.agree_by(lambda found, pages: list(found))
    assert reader.match_prefix(toks).storage_len == 3 * PAGE
    assert reader.stats().prefetch == {"query_failed": 1, "backing_off": 2, "started": 1}


@pytest.mark.parametrize("answer", [None, True, -1, 4, 2.0, "3"])
def test_a_query_answered_with_no_count_of_its_keys_fails_and_changes_nothing(
    store: Store, answer: object
) -> None:
    """A store of another make answers garbage: the query failed, the lookup does not raise."""
    toks = tokens(3)
    stored_cache(store, toks)

    class Garbled(FaultyStore):
        def exists_prefix(self, keys: Sequence[str]) -> int:
            self.calls.append("exists_prefix")
            return answer  # type: ignore[return-value]

    reader = HiCache(config(), storage=tier(Garbled(store), prefetch_policy="wait"))
    found = reader.match_prefix(toks)
    assert (found.host_len, found.storage_len) == (0, 0)
    assert list(reader.tree) == []
    assert reader.stats().prefetch == {"query_failed": 1}
    assert reader.tiers.host.allocator.free_pages == 32


def test_a_torn_page_the_store_will_not_drop_keeps_the_pages_before_it(tmp_path: Path) -> None:
    """A drop that raises something of another make leaves the page; the read stands."""
    toks = tokens(4)
    store, _, torn = torn_store(tmp_path, toks, page=2)
    faulty = FaultyStore(store)
    faulty.raises = {"drop"}
    reader = HiCache(config(), storage=tier(faulty, prefetch_policy="wait"))
    assert reader.match_prefix(toks).host_len == 2 * PAGE
    assert torn.exists()
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "corrupt"),))]
    assert device_kv_matches(reader, toks[: 2 * PAGE])


def test_a_store_that_failed_once_is_stored_again_by_a_later_lookup(
    store: Store, clock: HandClock
) -> None:
    """One transient failure kept the node, and every node under it, out of the store for good.

    The failed store backs lookups off, so the lookup that stores it again is
    the first after the backoff, though it has no tail to ask about.
    """
    toks, more = tokens(3), tokens(2, start=9000)
    faulty = FaultyStore(store)
    faulty.raises = {"put"}
    writer = HiCache(config(), storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0))
    writer.insert(toks)
    writer.poll()
    writer.poll()  # the store failed
    writer.insert(toks + more)  # a child, waiting for its parent's pages
    writer.poll()
    assert [n.storage for n in writer.tree] == ["unstored", "unstored"]
    faulty.raises = set()
    assert writer.match_prefix(toks).device_len == 3 * PAGE  # backing off: no store
    assert [n.storage for n in writer.tree] == ["unstored", "unstored"]
    clock.now += 1.0
    assert writer.match_prefix(toks).device_len == 3 * PAGE  # starts the parent's store again
    assert [n.storage for n in writer.tree] == ["storing", "unstored"]
    assert writer.match_prefix(toks).device_len == 3 * PAGE  # in flight: not started twice
    writer.poll()  # the parent is stored; the child's store starts
    writer.poll()
    assert [n.storage for n in writer.tree] == ["stored", "stored"]
    assert faulty.calls == ["put", "put", "put"]
    reader = HiCache(config(), storage=tier(store, clock=clock.monotonic, prefetch_policy="wait"))
    assert reader.match_prefix(toks + more).host_len == 5 * PAGE


def test_a_store_that_lands_after_a_failure_ends_the_row_of_failures(
    tmp_path: Path, clock: HandClock
) -> None:
    """A cache whose lookups all hit locally asks nothing: its stores are its only trials.

    One that lands shows the store answers again, as a query would: a failure
    an hour later is a blip of its own, backed off for the first wait, not
    twice as long (and so on, up to the longest, over a day of blips).
    """
    faulty = FaultyStore(LocalFileStore(tmp_path))
    faulty.raises = {"put"}
    writer = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0, query_backoff_max=60.0),
    )
    storage = writer.storage
    assert storage is not None
    writer.insert(tokens(3))
    writer.poll()
    writer.poll()  # the store failed: back off
    assert (storage.backoff.closed, storage.backoff.failures) == (True, 1)
    faulty.raises = set()
    clock.now += 1.0
    writer.match_prefix(tokens(3))  # no tail to ask about: stores the node again
    writer.poll()  # it landed
    assert [n.storage for n in writer.tree] == ["stored"]
    assert (storage.backoff.closed, storage.backoff.failures) == (False, 0)
    clock.now += 3600.0
    faulty.raises = {"put"}
    writer.insert(tokens(2, start=9000))
    writer.poll()
    writer.poll()  # this store fails
    assert faulty.calls == ["put", "put", "put"]
    assert storage.backoff.closed
    assert storage.backoff.until - clock.now == 1.0


def test_no_store_is_started_again_while_queries_back_off(store: Store, clock: HandClock) -> None:
    toks = tokens(3)
    faulty = FaultyStore(store)
    faulty.raises = {"put", "exists_prefix"}
    writer = HiCache(config(), storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0))
    writer.insert(toks)
    writer.poll()
    writer.poll()  # the store failed: back off
    writer.match_prefix(toks + tokens(2, start=9000))  # asks nothing
    writer.match_prefix(toks)
    assert faulty.calls == ["put"]
    assert [n.storage for n in writer.tree] == ["unstored"]
    clock.now += 1.0
    writer.match_prefix(toks + tokens(2, start=9000))  # the query fails: back off again
    writer.match_prefix(toks)
    assert faulty.calls == ["put", "exists_prefix"]
    assert [n.storage for n in writer.tree] == ["unstored"]
    faulty.raises = set()
    clock.now += 2.0
    writer.match_prefix(toks + tokens(2, start=9000))  # asks (the run, then the tail), stores
    assert faulty.calls == ["put", "exists_prefix", "exists_prefix", "exists_prefix", "put"]


def test_a_read_that_raises_fails_the_fetch_and_removes_the_node(
    store: Store, clock: HandClock
) -> None:
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.raises = {"get"}
    reader = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, prefetch_policy="wait", query_backoff=1.0),
    )
    found = reader.match_prefix(toks)
    assert (found.host_len, found.storage_len) == (0, 0)
    assert list(reader.tree) == []
    assert reader.tiers.host.allocator.free_pages == 32
    assert [e for _, e in reader.log.transitions()][-2:] == ["fetch_failed", "delete"]
    assert reader.stats().storage_failures == {"fetch:failed": 1}
    assert reader.stats().storage_errors == {"fetch:failed": "RuntimeError: planted fault in get"}
    faulty.raises = set()  # a transient failure: the store may still be down, so back off
    assert reader.match_prefix(toks).host_len == 0
    assert faulty.calls == ["exists_prefix", "get"]
    clock.now += 1.0  # then the next lookup finds the pages by key
    assert reader.match_prefix(toks).host_len == 3 * PAGE
    assert reader.stats().prefetch == {"started": 2, "read": 2, "backing_off": 1}


def test_a_read_that_never_answers_is_failed_at_its_timeout(store: Store, clock: HandClock) -> None:
    """The lookup waits its deadline, not the read's; the read fails at its own, and is not kept.

    The tier's clock is moved by hand past the read's timeout, which is long
    (30 s) so that a lookup waiting for the read would stand out. The read
    started again is waited for before its pages are looked at: within the
    lookup's 0.05 s a loaded machine may not have run the worker at all, and
    the lookup then returns before the pages land (the ``timeout`` policy).
    """
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    reader = HiCache(
        config(),
        storage=tier(
            faulty,
            clock=clock.monotonic,
            threads=1,
            prefetch_policy="timeout",
            prefetch_timeout=0.05,
            io_timeout=30.0,
            query_backoff=0,  # the backoff after a timeout is tested on its own
        ),
    )
    storage = reader.storage
    assert storage is not None
    started = time.monotonic()
    found = reader.match_prefix(toks)
    assert time.monotonic() - started < 10.0  # the lookup waited its deadline, not the read's
    assert (found.host_len, found.storage_len) == (0, 3 * PAGE)
    assert reader.stats().prefetch == {"started": 1, "still_reading": 1}
    (late,) = storage.in_flight().values()
    clock.now += 30.0
    reader.poll()
    assert list(reader.tree) == []
    assert reader.tiers.host.allocator.free_pages == 32
    assert reader.log.storage_acks()[-1] == ("poll", ((1, "fetch", 0, "timeout"),))
    faulty.gate.set()
    assert late.done.wait(30)
    reader.poll()  # the late answer comes to no one
    assert list(reader.tree) == []
    reader.match_prefix(toks)  # the pages are found by key, and read again
    for again in storage.in_flight().values():  # the read, where it outlasted the lookup
        assert again.done.wait(30)
    reader.poll()
    prefetch = reader.stats().prefetch
    assert prefetch["started"] == 2
    assert prefetch.get("read", 0) + prefetch["still_reading"] == 2
    assert reader.stats().storage_pages == {"fetched": 3}
    assert reader.match_prefix(toks).host_len == 3 * PAGE
    reader.close()


def test_a_copy_that_timed_out_waiting_for_a_worker_is_never_run(
    store: Store, clock: HandClock
) -> None:
    """Behind a slow store, copies nobody waits for would keep the worker busy for good.

    The tier's clock is moved by hand, once the worker is inside the first put:
    on the real one a worker thread that a loaded machine started late found
    the first copy timed out too, and never ran it.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    writer = HiCache(
        config(), storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=0.3)
    )
    for start in (1000, 2000, 3000):
        writer.insert(tokens(1, start))
    writer.poll()  # the host backups land: three stores queue behind one worker
    storage = writer.storage
    assert storage is not None
    copies = list(storage.in_flight().values())
    assert len(copies) == 3
    deadline = time.monotonic() + 30
    while faulty.calls != ["put"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker takes the first copy, and waits at the gate
    clock.now += 0.5
    writer.poll()  # all three timed out: the first in the store, two in the queue
    assert writer.stats().storage_failures == {"store:timeout": 3}
    faulty.gate.set()
    for copy in copies:
        assert copy.done.wait(5)
    assert faulty.calls == ["put"]  # the two the worker reached late were not run
    assert [c.result.outcome for c in copies[1:]] == ["timeout", "timeout"]  # type: ignore[union-attr]
    writer.close()


def test_a_store_abandoned_behind_a_hung_worker_lets_its_snapshot_go(
    store: Store, clock: HandClock
) -> None:
    """The worker hangs for good: a store queued behind it must not hold its host snapshot.

    The copy a worker claimed keeps its pages until its put returns (and
    writes them all); the one it never reached is abandoned at its timeout,
    and never run.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    writer = HiCache(
        config(), storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=1.0)
    )
    writer.insert(tokens(1, 1000))
    writer.insert(tokens(2, 2000))
    writer.poll()  # two stores: the first hangs the worker, the second waits in its queue
    storage = writer.storage
    assert storage is not None
    first, second = storage.in_flight().values()
    ends = time.monotonic() + 5.0
    while faulty.calls != ["put"] and time.monotonic() < ends:
        time.sleep(0.01)
    assert faulty.calls == ["put"]  # the worker claimed the first
    held = [weakref.ref(page) for page in second.snapshot]
    assert len(held) == 2
    clock.now += 1.0
    writer.poll()  # both timed out
    gc.collect()
    assert [page() for page in held] == [None, None]
    assert (first.snapshot, second.snapshot) == ([], [])
    assert writer.stats().storage_failures == {"store:timeout": 2}
    faulty.gate.set()
    assert first.done.wait(5)
    assert second.done.wait(5)
    assert faulty.calls == ["put"]  # the abandoned one was not run
    assert first.result is not None
    assert second.result is not None
    assert (first.result.held, first.result.outcome) == (1, "ok")  # late, to no one
    assert (second.result.held, second.result.outcome) == (0, "timeout")
    writer.close()


def test_a_query_slower_than_its_budget_backs_off_but_its_answer_stands(
    store: Store, clock: HandClock
) -> None:
    """Redis answers every EXISTS after 2 s: without a budget each lookup would wait as long."""
    toks, more, third = tokens(3), tokens(3, start=5000), tokens(3, start=7000)
    for prefix in (toks, more, third):
        stored_cache(store, prefix)
    faulty = FaultyStore(store)

    def slow() -> None:
        clock.now += 2.0

    faulty.after_exists = slow
    reader = HiCache(
        config(),
        storage=tier(
            faulty,
            clock=clock.monotonic,
            prefetch_policy="wait",
            query_budget=0.5,
            query_backoff=1.0,
            query_backoff_max=5.0,
        ),
    )
    storage = reader.storage
    assert storage is not None
    assert reader.match_prefix(toks).host_len == 3 * PAGE  # slow: the answer is used
    assert reader.match_prefix(more).host_len == 0  # backing off: asks nothing
    assert faulty.calls == ["exists_prefix", "get"]
    clock.now += 1.0
    assert reader.match_prefix(more).host_len == 3 * PAGE  # a trial, slow again: two seconds
    clock.now += 1.5
    assert reader.match_prefix(third).host_len == 0
    faulty.after_exists = None
    clock.now += 0.5
    assert reader.match_prefix(third).host_len == 3 * PAGE  # in time: the backoff ends
    assert faulty.calls == ["exists_prefix", "get"] * 3
    assert (storage.backoff.failures, storage.backoff.closed) == (0, False)
    assert reader.stats().storage_failures == {"query:slow": 2}
    assert reader.stats().prefetch == {"started": 3, "read": 3, "backing_off": 2}


def test_a_query_within_its_budget_ends_no_backoff_early_and_counts_nothing(
    store: Store, clock: HandClock
) -> None:
    """A budget exactly met is in time: no backoff, no failure counted."""
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)

    def just_in_time() -> None:
        clock.now += 0.5

    faulty.after_exists = just_in_time
    reader = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, prefetch_policy="wait", query_budget=0.5),
    )
    assert reader.match_prefix(toks).host_len == 3 * PAGE
    assert reader.storage is not None
    assert not reader.storage.backoff.closed
    assert reader.stats().storage_failures == {}


@pytest.mark.parametrize("fault", ["raises", "hangs"])
def test_a_store_that_fails_or_hangs_on_a_copy_backs_lookups_off(
    store: Store, clock: HandClock, fault: str
) -> None:
    """A server that fails a put (or never answers it) would fail the next lookup's query too."""
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    if fault == "raises":
        faulty.raises = {"put"}
    else:
        faulty.gate = threading.Event()
    threads = 0 if fault == "raises" else 1
    writer = HiCache(
        config(), storage=tier(faulty, clock=clock.monotonic, threads=threads, io_timeout=1.0)
    )
    writer.insert(tokens(2, start=9000))
    writer.poll()  # write_done: the store starts
    ends = time.monotonic() + 5.0
    while faulty.calls != ["put"] and time.monotonic() < ends:
        time.sleep(0.01)
    clock.now += 1.0  # past its io_timeout where it hangs
    writer.poll()  # the store failed
    assert writer.stats().storage_failures == {
        f"store:{'failed' if threads == 0 else 'timeout'}": 1
    }
    assert writer.match_prefix(toks).storage_len == 0  # backing off: asks nothing
    assert faulty.calls == ["put"]
    clock.now += 1.0
    assert writer.match_prefix(toks).storage_len == 3 * PAGE
    assert writer.stats().prefetch == {"backing_off": 1, "started": 1}
    if faulty.gate is not None:
        faulty.gate.set()
    writer.close()


def test_a_store_that_is_full_backs_no_lookup_off(tmp_path: Path) -> None:
    """No room is the store answering: its pages stay readable, so lookups keep asking."""
    toks = tokens(3)
    stored_cache(LocalFileStore(tmp_path), toks)
    faulty = FaultyStore(LocalFileStore(tmp_path, limit_bytes=0))
    writer = HiCache(config(), storage=tier(faulty))
    writer.insert(tokens(2, start=9000))
    writer.poll()
    writer.poll()
    assert writer.stats().storage_failures == {"store:full": 1}
    assert writer.match_prefix(toks).storage_len == 3 * PAGE
    assert faulty.calls == ["put", "exists_prefix", "get"]


def test_under_agreement_a_copy_that_failed_here_is_told_to_the_group_once(
    tmp_path: Path, clock: HandClock
) -> None:
    """The group backs off at the step that carries it; applying it later backs off no more."""
    faulty = FaultyStore(LocalFileStore(tmp_path))
    faulty.raises = {"put"}
    cache = HiCache(config(), storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0))
    storage = cache.storage
    assert storage is not None
    storage.agree_by(lambda found, asked: list(found))
    cache.insert(tokens(2))
    cache.poll()  # write_done: the store runs inline, and fails
    assert faulty.calls == ["put"]
    assert not storage.backoff.closed  # only the group decides
    assert storage.copies_failed_here()
    assert not storage.copies_failed_here()  # told once
    storage.back_off_for_copies(False)  # as the group would say where no rank's failed
    assert not storage.backoff.closed
    storage.back_off_for_copies(True)
    assert (storage.backoff.closed, storage.backoff.failures) == (True, 1)
    storage.accept(storage.report(2))
    assert cache.poll() == 1  # applied: no second backoff
    assert storage.backoff.failures == 1
    assert cache.log.storage_acks() == [("poll", ((1, "store", 0, "failed"),))]


def test_under_agreement_a_copy_reported_timed_out_stays_timed_out_when_its_put_returns(
    tmp_path: Path, clock: HandClock
) -> None:
    """A step reports a copy timed out; its put returns before the step asks what failed here.

    Both must read the same ending: the group applies the timeout, so it must
    back off for it, and a later report must not say the copy landed. The
    put still writes its pages, late, to no one.
    """
    faulty = FaultyStore(LocalFileStore(tmp_path))
    faulty.gate = threading.Event()
    cache = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=1.0, query_backoff=1.0),
    )
    storage = cache.storage
    assert storage is not None
    storage.agree_by(lambda found, asked: list(found))
    cache.insert(tokens(2))
    cache.poll()  # write_done: the store starts, and hangs in its put
    (first,) = storage.in_flight().values()
    ends = time.monotonic() + 5.0
    while faulty.calls != ["put"] and time.monotonic() < ends:
        time.sleep(0.01)
    assert faulty.calls == ["put"]
    clock.now += 1.0
    assert storage.report(2) == [2 * 0 + 1, -1]  # timed out here
    faulty.gate.set()
    assert first.done.wait(5)  # the put returns: too late
    assert first.result is not None
    assert (first.result.held, first.result.outcome) == (2, "ok")
    assert storage.copies_failed_here()  # it timed out here: the group backs off
    assert storage.report(2) == [2 * 0 + 1, -1]  # still timed out
    storage.back_off_for_copies(True)
    assert storage.accept([2 * 0 + 1, -1]) == 1
    assert cache.poll() == 1
    assert cache.log.storage_acks() == [("poll", ((1, "store", 0, "timeout"),))]
    assert [n.storage for n in cache.tree] == ["unstored"]
    assert (storage.backoff.closed, storage.backoff.failures) == (True, 1)
    cache.close()


class DownStore(FaultyStore):
    """A store that went away: its first put raises at once, every later one hangs at the gate."""

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        self.calls.append("put")
        if self.calls.count("put") == 1:
            raise RuntimeError("planted fault in put")
        assert self.gate is not None
        self.gate.wait()
        return self.inner.put(keys, pages)


def test_copies_one_outage_fails_in_different_polls_back_off_once(
    store: Store, clock: HandClock
) -> None:
    """Two backups in flight when the store goes down: one raises, the other hangs.

    They fail a poll apart (the second by its ``io_timeout``), but they are
    one outage, so the wait doubles once: the first lookup after one second
    asks the store again. Before, each poll with a failed copy doubled it.
    """
    faulty = DownStore(store)
    faulty.gate = threading.Event()
    writer = HiCache(
        config(),
        storage=tier(
            faulty,
            clock=clock.monotonic,
            threads=1,
            io_timeout=1.0,
            query_backoff=1.0,
            query_backoff_max=30.0,
        ),
    )
    storage = writer.storage
    assert storage is not None
    writer.insert(tokens(1, 1000))
    writer.insert(tokens(1, 2000))
    writer.poll()  # write_done: both stores start, on one worker
    first, _ = storage.in_flight().values()
    assert first.done.wait(5)  # it raised
    ends = time.monotonic() + 5.0
    while faulty.calls != ["put", "put"] and time.monotonic() < ends:
        time.sleep(0.01)  # the worker takes the second, and hangs at the gate
    assert faulty.calls == ["put", "put"]
    writer.poll()  # the first failed: back off one second
    assert writer.log.storage_acks() == [("poll", ((1, "store", 0, "failed"),))]
    assert (storage.backoff.closed, storage.backoff.failures) == (True, 1)
    assert storage.backoff.until == clock.now + 1.0
    clock.now += 1.0
    writer.poll()  # the second timed out: the same outage, no second backoff
    assert writer.log.storage_acks()[-1] == ("poll", ((2, "store", 0, "timeout"),))
    assert (storage.backoff.failures, storage.backoff.until) == (1, clock.now)
    assert writer.match_prefix(tokens(2, 5000)).storage_len == 0  # asks: the backoff passed
    assert faulty.calls == ["put", "put", "exists_prefix"]
    assert writer.stats().prefetch == {"none_stored": 1}
    assert (storage.backoff.closed, storage.backoff.failures) == (False, 0)
    faulty.gate.set()
    writer.close()


def test_a_copy_in_flight_when_a_query_fails_backs_off_no_more(
    store: Store, clock: HandClock
) -> None:
    """A failed key query backs lookups off; a store that then fails by its timeout is that outage."""
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    writer = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=2.0, query_backoff=1.0),
    )
    storage = writer.storage
    assert storage is not None
    writer.insert(tokens(2, 9000))
    writer.poll()  # write_done: the store starts, and hangs
    faulty.raises = {"exists_prefix"}
    assert writer.match_prefix(toks).storage_len == 0  # the query fails: back off one second
    assert (storage.backoff.failures, storage.backoff.until) == (1, clock.now + 1.0)
    clock.now += 2.0
    writer.poll()  # the store timed out: no second backoff
    assert writer.stats().storage_failures == {"store:timeout": 1}
    assert (storage.backoff.failures, storage.backoff.until) == (1, clock.now - 1.0)
    faulty.gate.set()
    writer.close()


def test_a_store_queued_but_not_started_when_lookups_back_off_is_a_new_trial(
    tmp_path: Path, clock: HandClock
) -> None:
    """A backup queued in the poll that backs off starts after it: its failure backs off again.

    It had not tried the store when the poll applied the first store's
    failure; it tries it as that poll ends, so its failure says the store is
    still down, and the wait doubles, as for any store started after a
    backoff. Before, every copy queued then counted as that outage's.
    """
    faulty = FaultyStore(LocalFileStore(tmp_path))
    faulty.raises = {"put"}
    writer = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0, query_backoff_max=30.0),
    )
    storage = writer.storage
    assert storage is not None
    writer.insert(tokens(2))
    writer.poll()  # write_done: the first store runs inline, and fails
    writer.insert(tokens(2, start=5000))
    writer.poll()  # the second's write_done queues its store; the first's failure backs off
    assert writer.log.storage_acks() == [("poll", ((1, "store", 0, "failed"),))]
    assert (storage.backoff.failures, storage.backoff.until) == (1, clock.now + 1.0)
    assert faulty.calls == ["put", "put"]  # the second started as that poll ended
    writer.poll()  # it failed: the store is still down
    assert writer.log.storage_acks()[-1] == ("poll", ((2, "store", 0, "failed"),))
    assert (storage.backoff.failures, storage.backoff.until) == (2, clock.now + 2.0)


def test_under_agreement_a_copy_in_flight_at_a_backoff_that_failed_elsewhere_ends_no_row(
    tmp_path: Path, clock: HandClock
) -> None:
    """The row of failures follows the group's outcome of a copy, not this rank's.

    The group backed off while the copy was in flight, and the backoff
    passed; the copy landed here but not on another rank (``peer_failed``
    here; there it may have timed out, its store down). Every rank keeps the
    row, as the rank whose store failed does: a rank that ended it would
    wait less after the next failure than the others, and the group, which
    ends a backoff only where every rank's wait passed, waits the longest.
    A copy not in flight at a backoff that landed short elsewhere ends the
    row on every rank: no rank's store failed it as a store that is down
    does, or the group would have backed off for it, with it in flight.
    """
    cache = HiCache(
        config(), storage=tier(LocalFileStore(tmp_path), clock=clock.monotonic, query_backoff=1.0)
    )
    storage = cache.storage
    assert storage is not None
    storage.agree_by(lambda found, asked: list(found))
    cache.insert(tokens(2))
    cache.poll()  # write_done: the store runs inline, and lands here
    storage.back_off_for_copies(True)  # another rank's store failed another copy: all back off
    assert (storage.backoff.closed, storage.backoff.failures) == (True, 1)
    clock.now += 1.0
    storage.resume_queries(True)  # every rank's wait has passed
    assert storage.report(2) == [2 * 2 + 1, -1]
    storage.accept([2 * 0 + 1, -1])  # another rank landed none, its store down
    assert cache.poll() == 1
    assert cache.log.storage_acks() == [("poll", ((1, "store", 0, "peer_failed"),))]
    assert (storage.backoff.closed, storage.backoff.failures) == (False, 1)
    cache.insert(tokens(2, start=5000))
    cache.poll()  # write_done: the store runs inline, and lands here
    assert storage.report(2) == [2 * 2 + 1, -1]
    storage.accept([2 * 1 + 1, -1])  # another rank's store was full after one page
    assert cache.poll() == 1
    assert cache.log.storage_acks()[-1] == ("poll", ((2, "store", 1, "peer_failed"),))
    assert (storage.backoff.closed, storage.backoff.failures) == (False, 0)


def test_no_backup_is_started_while_lookups_back_off(store: Store, clock: HandClock) -> None:
    """A host backup acknowledged during a backoff starts no store, and holds no pin for one.

    The store is known to be down: the backup would hold its host pin and
    snapshot until its ``io_timeout``. The node stays unstored, and the first
    lookup after the backoff that matches it stores it.
    """
    faulty = FaultyStore(store)
    faulty.raises = {"put"}
    writer = HiCache(config(), storage=tier(faulty, clock=clock.monotonic, query_backoff=1.0))
    storage = writer.storage
    assert storage is not None
    writer.insert(tokens(2))
    writer.poll()  # write_done: the store runs inline, and fails
    writer.poll()  # applied: back off
    assert storage.backoff.closed
    faulty.raises = set()
    later = tokens(2, start=5000)
    writer.insert(later)
    writer.poll()  # its host backup lands during the backoff: no store starts
    assert [(n.host, n.storage, n.pins) for n in writer.tree] == [
        ("backed", "unstored", 0),
        ("backed", "unstored", 0),
    ]
    assert dict(storage.in_flight()) == {}
    assert faulty.calls == ["put"]
    assert writer.stats().storage_failures == {"store:failed": 1, "store:backing_off": 1}
    clock.now += 1.0
    assert writer.match_prefix(later).device_len == 2 * PAGE  # the first lookup after: stores it
    writer.poll()
    assert {n.key[0]: n.storage for n in writer.tree} == {1000: "unstored", 5000: "stored"}
    assert faulty.calls == ["put", "put"]


def test_pages_a_timed_out_put_writes_late_are_found_again_by_key(
    store: Store, clock: HandClock
) -> None:
    """The bound docs/storage.md states: a claimed put is not stopped, and its pages count again.

    The worker is inside the put when the timeout is applied: the node is
    failed and its pages, written late, are not counted; the next store of
    the node (the first lookup after the backoff) finds them and counts them.
    """
    faulty = FaultyStore(store)
    faulty.gate = threading.Event()
    writer = HiCache(
        config(),
        storage=tier(faulty, clock=clock.monotonic, threads=1, io_timeout=1.0, query_backoff=1.0),
    )
    storage = writer.storage
    assert storage is not None
    toks = tokens(2)
    writer.insert(toks)
    writer.poll()  # write_done: the store starts, and hangs in its put
    (late,) = storage.in_flight().values()
    ends = time.monotonic() + 5.0
    while faulty.calls != ["put"] and time.monotonic() < ends:
        time.sleep(0.01)
    assert faulty.calls == ["put"]  # the worker claimed it
    clock.now += 1.0
    writer.poll()  # timed out: the node is unstored, nothing counted
    faulty.gate.set()
    assert late.done.wait(5)  # the put returns to no one, its pages written
    keys = page_keys(storage.namespace(), toks)
    assert store.exists_prefix(keys) == 2
    assert [n.storage for n in writer.tree] == ["unstored"]
    assert writer.stats().storage_pages == {"stored": 0}
    clock.now += 1.0
    writer.match_prefix(toks)  # the first lookup after the backoff stores the node again
    (again,) = storage.in_flight().values()
    assert again.done.wait(5)
    writer.poll()
    assert [n.storage for n in writer.tree] == ["stored"]
    assert writer.stats().storage_pages == {"stored": 2}
    writer.close()


def test_the_timeout_policy_returns_the_pages_read_within_its_deadline(store: Store) -> None:
    toks = tokens(3)
    stored_cache(store, toks)
    reader = HiCache(
        config(), storage=tier(store, threads=1, prefetch_policy="timeout", prefetch_timeout=5.0)
    )
    found = reader.match_prefix(toks)
    assert (found.host_len, found.storage_len) == (3 * PAGE, 0)
    assert reader.stats().prefetch == {"started": 1, "read": 1}
    reader.close()


def test_an_unstored_cached_prefix_another_server_stored_is_discovered(store: Store) -> None:
    toks = tokens(6)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, policy="off", prefetch_policy="wait"))
    reader.insert(toks[: 2 * PAGE])
    reader.poll()
    found = reader.match_prefix(toks)
    head, tail = reader.tree.walk(tuple(toks)).path
    assert (head.storage, tail.storage) == ("stored", "stored")
    assert [e for _, e in reader.log.transitions()][-4:] == [
        "discover",
        "born:discovered",
        "fetch",
        "fetch_done",
    ]
    assert found.host_len == 4 * PAGE
    assert reader.stats().storage_pages == {"discovered": 2, "fetched": 4}


def test_a_namespace_keys_its_pages_apart(store: Store) -> None:
    toks = tokens(3)
    writer = HiCache(config(), storage=tier(store))
    writer.insert(toks, namespace="lora-7")
    writer.poll()
    writer.poll()
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    assert reader.match_prefix(toks).host_len == 0
    assert reader.match_prefix(toks, namespace="lora-7").host_len == 3 * PAGE


def test_a_tuple_namespace_of_strs_and_ints_keys_its_pages_as_well(store: Store) -> None:
    toks = tokens(2)
    writer = HiCache(config(), storage=tier(store))
    writer.insert(toks, namespace=("lora", 7, b"v2"))
    writer.poll()
    writer.poll()
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    assert reader.match_prefix(toks, namespace=("lora", 7)).host_len == 0
    assert reader.match_prefix(toks, namespace=("lora", 7, b"v2")).host_len == 2 * PAGE


class _Adapter:
    """A namespace whose repr is its address: no other server writes it alike."""


@pytest.mark.parametrize(
    "namespace",
    [_Adapter(), 1.0, True, ("lora", 7.5), ("lora", (False,))],
    ids=["an object", "a float", "a bool", "a float in a tuple", "a bool deeper in"],
)
@pytest.mark.parametrize("op", ["match_prefix", "insert"])
def test_a_namespace_no_other_server_would_key_alike_is_refused_changing_nothing(
    store: Store, namespace: object, op: str
) -> None:
    """Its repr keys the stored pages: an address, or ``1.0`` sharing the tree of ``1``."""
    cache = HiCache(config(), storage=tier(store))
    cache.insert(tokens(2))
    cache.poll()
    before, log = states(cache), cache.log.recorded
    with pytest.raises(BadArgument) as refused:
        getattr(cache, op)(tokens(3), namespace=namespace)
    assert str(refused.value) == (
        f"{op}: namespace {namespace!r} cannot key stored pages: a storage tier needs None, "
        "a str, an int, bytes or a tuple of them, whose repr is the same on every server"
    )
    assert states(cache) == before
    assert cache.log.recorded == log
    assert cache.tiers.device.allocator.free_slots == cache.tiers.device.allocator.size - 2 * PAGE


def test_a_cache_without_storage_takes_any_hashable_namespace() -> None:
    cache = HiCache(config())
    cache.insert(tokens(2), namespace=_Adapter)
    assert cache.match_prefix(tokens(2), namespace=_Adapter).device_len == 2 * PAGE
    assert cache.match_prefix(tokens(2)).device_len == 0


def test_a_write_through_host_copy_never_lands_under_a_node_without_one(store: Store) -> None:
    """Invariant 3: under write-through the anchor of a prefetch holds a valid host copy."""
    toks = tokens(4)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    reader.insert(toks[:PAGE])  # its host copy is still being written
    assert reader.match_prefix(toks).host_len == 0
    assert reader.stats().prefetch == {"anchor_not_backed": 1}


# -- misuse -----------------------------------------------------------------------


def unchanged(
    cache: HiCache, call: Callable[[], object], error: type[Exception], text: str
) -> None:
    """``call`` raises ``error`` with exactly ``text`` and changes no node."""
    before = states(cache)
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == text
    assert states(cache) == before


def test_misuse_of_the_storage_events_is_refused_by_name_and_changes_nothing(
    store: Store,
) -> None:
    cache = HiCache(config(), storage=tier(store))
    cache.insert(tokens(2))
    (node,) = cache.tree
    i = node.id
    unchanged(
        cache,
        lambda: cache.fire("store", node),
        error_class("CopyInFlight"),
        f"node {i}: store refused in writing (pins=0): the host copy is still being written from the device",
    )
    unchanged(
        cache,
        lambda: cache.fire("fetch", node),
        error_class("CopyInFlight"),
        f"node {i}: fetch refused in writing (pins=0): a copy is already filling the host slots",
    )
    cache.poll()
    unchanged(
        cache,
        lambda: cache.fire("store_done", cache.tree.root()),
        BadArgument,
        "fire: node 0 is a namespace root, resident for good; store_done is for the nodes under it",
    )
    unchanged(
        cache,
        lambda: cache.fire("vanish", node),
        error_class("CopyInFlight"),
        f"node {i}: vanish refused in storing: our own copy to the store is in flight; its acknowledgement says what landed",
    )
    unchanged(
        cache,
        lambda: cache.fire("fetch_done", node),
        error_class("NotFetching"),
        f"node {i}: fetch_done refused in pinned (pins=1): no storage-to-host copy in flight",
    )
    cache.poll()
    unchanged(
        cache,
        lambda: cache.fire("store", node),
        error_class("AlreadyStored"),
        f"node {i}: store refused in stored: the store already holds this node's pages",
    )
    cache.fire("evict_host", node)  # by hand: the device copy stays
    unchanged(
        cache,
        lambda: cache.fire("fetch", node),
        error_class("AlreadyResident"),
        f"node {i}: fetch refused in evicted (pins=0, device resident): the device holds this node's KV; there is nothing to fetch",
    )
    unchanged(
        cache,
        lambda: cache.evict_storage(8),
        ConfigError,
        "evict_storage: the store is shared (owned=False): its own eviction deletes pages",
    )
    unchanged(
        cache,
        lambda: cache.fire("evict_storage", node),
        EffectFailed,
        f"node {i}: effect delete_storage of evict_storage failed: "
        "storage: the store is shared (owned=False): its own eviction deletes pages",
    )


def test_the_anchor_of_a_fetch_is_never_evicted(store: Store) -> None:
    """SGLang #9601: host eviction of the parent of a node being fetched is refused."""
    toks = tokens(4)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, policy="off"))
    reader.insert(toks[:PAGE])
    reader.poll()
    reader.evict(PAGE)  # the anchor is host-only now
    reader.match_prefix(toks)  # best effort: the tail is being fetched
    anchor, child = reader.tree.walk(tuple(toks)).path
    assert (anchor.host, anchor.device, child.host) == ("backed", "absent", "fetching")
    assert reader.evict_host(100) == 0
    unchanged(
        reader,
        lambda: reader.fire("evict_host", anchor),
        error_class("NotAHostLeaf"),
        f"node {anchor.id}: evict_host refused in backed (pins=0): a child is being fetched from storage under this node",
    )
    unchanged(
        reader,
        lambda: reader.load_back(child),
        error_class("NoHostCopy"),
        f"node {child.id}: load refused in fetching (pins=0): the host copy is still being fetched from storage",
    )
    reader.poll()
    assert device_kv_matches(reader, toks)


def test_a_fetch_needs_its_parent_cached() -> None:
    """ParentNotCached: pages under a parent no tier holds could never be reached."""
    machine = Residency(storage=True)
    parent = TreeNode(1, (1, 2), None)
    child = TreeNode(2, (3, 4), parent)
    for node in (parent, child):
        machine.engine.init(node, node.id, "discovered")
    with pytest.raises(error_class("ParentNotCached")) as info:
        machine.verb("fetch")(child)
    assert str(info.value) == (
        "node 2: fetch refused in evicted (pins=0): "
        "the parent is neither on the device nor on the host, nor being fetched"
    )
    assert (child.host, child.device, child.storage) == ("evicted", "absent", "stored")


def test_invariant_13_a_node_under_a_read_in_flight(store: Store) -> None:
    toks = tokens(4)
    stored_cache(store, toks)
    reader = HiCache(config(debug=False), storage=tier(store))
    reader.match_prefix(toks)
    (node,) = reader.tree
    reader.tree.add_leaf(node, (1, 2, 3, 4), ())
    with pytest.raises(InvariantViolation) as info:
        reader.check_invariants()
    assert str(info.value).startswith(
        f"invariant 13 broken at node {node.id} (fetching/absent (pins=0, locks=0), storage reading)"
    )


# -- storage eviction, metrics, lifecycle ------------------------------------------------


def test_an_owned_store_evicts_stored_leaves_children_first(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    cache = HiCache(config(), storage=tier(store, owned=True))
    head, more = tokens(2), tokens(2, start=5000)
    cache.insert(head)
    cache.insert(head + more)
    for _ in range(3):
        cache.poll()
    parent, child = cache.tree.walk(tuple(head + more)).path
    assert (parent.storage, child.storage) == ("stored", "stored")
    keys = list(parent.store_keys or ())
    with store.reading(keys):  # a read holds the parent's pages: it stays
        assert cache.evict_storage(100) == 2 * PAGE
    assert (parent.storage, child.storage) == ("stored", "unstored")
    assert cache.evict_storage(100) == 2 * PAGE
    assert (parent.storage, child.storage) == ("unstored", "unstored")
    assert store.capacity().pages == 0
    assert (parent.host, child.host) == ("backed", "backed")  # the local copies stay
    assert cache.stats().storage_pages["evicted"] == 4


def test_an_eviction_the_store_refuses_is_counted_and_keeps_the_nodes() -> None:
    """A server gone: every drop fails, which the stats said nothing of (0 tokens, no word)."""
    server = fakeredis.FakeServer()
    cache = HiCache(
        config(), storage=tier(RedisStore(fakeredis.FakeRedis(server=server)), owned=True)
    )
    for start in (1000, 2000, 3000):
        cache.insert(tokens(2, start))
    cache.poll()
    cache.poll()
    assert [n.storage for n in cache.tree] == ["stored"] * 3
    server.connected = False
    assert cache.evict_storage(100) == 0
    assert [n.storage for n in cache.tree] == ["stored"] * 3
    assert cache.stats().storage_failures == {"evict:failed": 3}
    assert list(cache.stats().storage_errors) == ["evict:failed"]


def test_evicted_storage_pages_count_only_what_the_store_still_held(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path)
    cache = HiCache(config(), storage=tier(store, owned=True))
    cache.insert(tokens(2))
    for _ in range(3):
        cache.poll()
    (node,) = cache.tree.walk(tuple(tokens(2))).path
    store.drop(list(node.store_keys or ())[1:])  # the store lost one page meanwhile
    assert cache.evict_storage(100) == 2 * PAGE
    assert cache.stats().storage_pages["evicted"] == 1


class _Uncounting(LocalFileStore):
    """A store whose ``drop`` answers no count of its pages (a user's, to a looser protocol)."""

    answer: object = None

    def drop(self, keys: Sequence[str]) -> Any:
        super().drop(keys)
        return self.answer


@pytest.mark.parametrize("answer", [None, True, -1, 99])
def test_a_drop_that_answers_no_count_still_evicts(tmp_path: Path, answer: object) -> None:
    """The pages were dropped: the node is unstored, and nothing is counted as evicted.

    ``+= None`` raised TypeError from the effect after the store had dropped
    the pages: ``evict_storage`` failed and the node stayed ``stored`` over
    pages that were gone.
    """
    store = _Uncounting(tmp_path)
    store.answer = answer
    cache = HiCache(config(), storage=tier(store, owned=True))
    cache.insert(tokens(2))
    for _ in range(3):
        cache.poll()
    (node,) = cache.tree
    assert cache.evict_storage(100) == 2 * PAGE
    assert node.storage == "unstored"
    assert store.capacity().pages == 0
    assert cache.stats().storage_pages["evicted"] == 0


def test_metrics_report_the_storage_tier(store: Store) -> None:
    toks = tokens(3)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    reader.match_prefix(toks)
    registry = CollectorRegistry()
    register(reader, registry, name="reader")
    text = generate_latest(registry).decode()
    assert 'fsm_cache_tokens{cache="reader",tier="storage"} 12.0' in text
    assert 'fsm_cache_storage_pages_total{cache="reader",event="fetched"} 3.0' in text
    assert 'fsm_cache_prefetch_total{cache="reader",outcome="started"} 1.0' in text
    assert 'fsm_cache_transitions_total{cache="reader",event="fetch_done"} 1.0' in text
    assert 'fsm_cache_storage_copies_in_flight{cache="reader"} 0.0' in text


def test_close_settles_the_storage_copies_and_reset_forgets_them(store: Store) -> None:
    cache = HiCache(config(), storage=tier(store, threads=1))
    cache.insert(tokens(2))
    cache.poll()
    (node,) = cache.tree
    assert node.storage == "storing"
    cache.reset()
    assert cache.storage is not None
    assert cache.storage.idle()
    assert list(cache.tree) == []
    cache.insert(tokens(2))
    cache.poll()
    cache.close()
    (node,) = cache.tree
    assert (node.storage, node.pins) == ("stored", 0)


def test_an_insert_through_a_node_being_fetched_adopts_it(store: Store) -> None:
    """A request that recomputed the prefix puts it on the device; the read still lands on the host."""
    toks, more = tokens(3), tokens(2, start=7000)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store))
    reader.match_prefix(toks)  # best effort: the read is in flight
    assert reader.insert(toks + more) == 0
    head, tail = reader.tree.walk(tuple(toks + more)).path
    assert [(n.host, n.device, n.storage) for n in (head, tail)] == [
        ("fetching", "resident", "reading"),
        ("unbacked", "resident", "unstored"),
    ]
    reader.poll()  # the read lands; the child's backup may start now
    assert [(n.host, n.storage) for n in (head, tail)] == [
        ("backed", "stored"),
        ("writing", "unstored"),
    ]
    reader.poll()
    reader.poll()
    assert [(n.host, n.storage) for n in (head, tail)] == [
        ("backed", "stored"),
        ("backed", "stored"),
    ]
    assert device_kv_matches(reader, toks + more)


def write_back_with_a_finished_store(store: Store) -> tuple[HiCache, list[list[int]]]:
    """A full write-back cache whose host pool a finished, unapplied store holds (pinned).

    Two pages of device and of host: the third insert evicted the first
    node, whose backup it waited for; its store then ran inline, and no poll
    applied it. Returns the cache and the four 2-page keys (the fourth not inserted).
    """
    cache = HiCache(
        config(device_pages=4, host_pages=2, write_policy="write_back"), storage=tier(store)
    )
    keys = [tokens(2, start=s) for s in (1000, 2000, 3000, 4000)]
    for key in keys[:3]:
        assert cache.insert(key) == 0
    (copy,) = cache.storage.in_flight().values()  # type: ignore[union-attr]
    assert (copy.kind, copy.done.is_set(), [list(n.key) for n in copy.nodes]) == (
        "store",
        True,
        [keys[0]],
    )
    assert cache.tiers.host.allocator.free_pages == 0
    return cache, keys


def test_an_allocation_applies_the_finished_stores_that_hold_its_host_room(store: Store) -> None:
    """A caller that never polls is never refused room its finished storage copies would free.

    The store's host pin kept the first node's host copy, so the write-back
    backup of the next victim found no host room: the allocation waited for
    and applied the host copies, never the storage copies, and the insert
    was refused (PoolExhausted) although one poll would have let it fit.
    """
    cache, keys = write_back_with_a_finished_store(store)
    assert cache.insert(keys[3]) == 0
    assert cache.log.storage_acks() == [("evict", ((1, "store", 2, "ok"),))]
    assert cache.match_prefix(keys[3]).device_len == 2 * PAGE
    assert cache.storage.in_flight()[2].nodes[0].key == tuple(keys[1])  # type: ignore[union-attr]
    cache.close()


def test_under_agreement_an_allocation_applies_only_the_copies_the_group_accepted(
    store: Store,
) -> None:
    """A store finished here alone waits for the group: the ranks refuse and evict alike."""
    cache, keys = write_back_with_a_finished_store(store)
    storage = cache.storage
    assert storage is not None
    storage.agree_by(lambda found, asked: list(found))
    before = states(cache)
    with pytest.raises(PoolExhausted):
        cache.insert(keys[3])
    assert (states(cache), len(storage.in_flight())) == (before, 1)
    assert cache.log.storage_acks() == []
    assert storage.accept(storage.report(2)) == 1  # the group's step, before it polls
    assert cache.insert(keys[3]) == 0
    assert cache.log.storage_acks() == [("evict", ((1, "store", 2, "ok"),))]
    cache.close()


def test_an_allocation_leaves_the_copies_of_the_nodes_it_holds_for_a_poll(store: Store) -> None:
    """A load short of room applies other finished stores, never its own chain's.

    Applying a store that landed part of its pages splits its node: applied
    inside the load's allocation, the chain it was about to load would have
    gained a prefix off the device, and the load would be refused half done.
    """
    faulty = FaultyStore(store)
    cache = HiCache(
        config(device_pages=4, host_pages=4, write_policy="write_back"), storage=tier(faulty)
    )
    first, second, third, fourth = (tokens(2, start=s) for s in (1000, 2000, 3000, 4000))
    cache.insert(first)
    cache.insert(second)
    faulty.put_fails_after = 1  # each store lands its first page of two
    cache.insert(third)  # evicts both: their backups, then their stores, unapplied
    cache.insert(fourth)
    assert [(c.done.is_set(), c.result.held) for c in cache.storage.in_flight().values()] == [  # type: ignore[union-attr]
        (True, 1),
        (True, 1),
    ]
    head = cache.match_prefix(first).last_host_node
    chain = cache.load_back(head)  # the device is full: a victim needs the host room
    assert chain == [head]
    assert (len(head.key), head.device, head.storage) == (2 * PAGE, "loading", "storing")
    assert cache.log.storage_acks() == [("evict", ((2, "store", 1, "failed"),))]
    cache.poll()  # the load lands; its node's store is applied now, and splits it
    assert cache.log.storage_acks()[-1] == ("poll", ((1, "store", 1, "failed"),))
    assert [(n.device, n.storage) for n in cache.tree.walk(tuple(first)).path] == [
        ("resident", "stored"),
        ("resident", "unstored"),
    ]
    assert device_kv_matches(cache, first)
    cache.close()


def test_a_split_keeps_the_storage_state_and_the_store_pin() -> None:
    """residency.split_prefix: the prefix of a node being stored holds a store pin of its own."""
    assert split_prefix("pinned", "resident", 0, "storing") == ("pinned", "resident", 1, 0)
    assert split_prefix("pinned", "loading", 2, "storing") == ("pinned", "loading", 2, 2)
    assert split_prefix("pinned", "resident", 1, "stored") == ("backed", "resident", 0, 1)
    assert split_prefix("fetching", "absent", 0, "reading") == ("fetching", "absent", 0, 0)
    assert split_prefix("pinned", "loading", 0) == ("pinned", "loading", 1, 0)


def test_a_torn_page_is_dropped_and_only_the_pages_before_it_are_used(tmp_path: Path) -> None:
    """A page that reads back torn is never used: it is dropped and the prefix ends before it."""
    toks = tokens(4)
    store, _, torn = torn_store(tmp_path, toks, page=2)
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    assert reader.match_prefix(toks).host_len == 2 * PAGE
    assert not torn.exists()
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "corrupt"),))]
    assert [e for _, e in reader.log.transitions()][-3:] == ["fetch_failed", "vanish", "delete"]
    assert device_kv_matches(reader, toks[: 2 * PAGE])


def test_a_redis_key_of_another_type_is_dropped_once_not_fetched_at_every_lookup() -> None:
    """A hash under a page's name: EXISTS counts it, MGET reads nil. Corrupt once, then gone."""
    server = fakeredis.FakeServer()
    store = RedisStore(fakeredis.FakeRedis(server=server), batch_pages=3)
    toks = tokens(4)
    writer = stored_cache(store, toks)
    keys = page_keys(writer.storage.namespace(), toks)  # type: ignore[union-attr]
    raw = fakeredis.FakeRedis(server=server)
    raw.delete(store.name(keys[2]))
    raw.hset(store.name(keys[2]), "planted", "by another client")
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    assert reader.match_prefix(toks).host_len == 2 * PAGE
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "corrupt"),))]
    assert not raw.exists(store.name(keys[2]))
    again = FaultyStore(store)
    second = HiCache(config(), storage=tier(again, prefetch_policy="wait"))
    assert second.match_prefix(toks).host_len == 2 * PAGE
    assert again.calls == ["exists_prefix", "get"]  # the two pages still stored, nothing more
    assert second.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "ok"),))]


# -- found by a review: fetches in flight under splits, host room, write-back --------------


def test_a_lookup_that_parts_inside_a_node_being_fetched_splits_it_soundly(store: Store) -> None:
    """Both parts wait for the same read (invariant 13 holds), and both land with it."""
    toks = tokens(8)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store))
    assert reader.match_prefix(toks).storage_len == 8 * PAGE  # the read is queued
    other = toks[: 2 * PAGE] + [7] * (2 * PAGE)
    found = reader.match_prefix(other)  # debug: invariants checked after it
    assert (found.device_len, found.host_len) == (0, 0)
    assert [(n, h, s) for _, n, h, _, s, _ in states(reader)] == [
        (2 * PAGE, "fetching", "reading"),
        (6 * PAGE, "fetching", "reading"),
    ]
    reader.poll()
    assert [(n, h, s) for _, n, h, _, s, _ in states(reader)] == [
        (2 * PAGE, "backed", "stored"),
        (6 * PAGE, "backed", "stored"),
    ]
    assert device_kv_matches(reader, toks)


def test_write_back_under_a_node_being_fetched_waits_so_a_failed_read_is_applied(
    store: Store,
) -> None:
    """An insert adopts the prefix of a node being fetched and hangs a leaf below it.

    The leaf's backup is refused (ParentFetching) until the read lands, so the
    read's failure can free the prefix's host slots instead of being refused
    for good (it was: the prefix stayed ``fetching`` with no copy in flight).
    """
    toks = tokens(8)
    stored_cache(store, toks)
    failing = FaultyStore(store)
    failing.gate, failing.raises = threading.Event(), {"get"}  # the read fails once let go
    reader = HiCache(config(write_policy="write_back"), storage=tier(failing, threads=1))
    reader.match_prefix(toks)
    other = toks[: 2 * PAGE] + [7] * (2 * PAGE)
    reader.insert(other)
    (leaf,) = (n for n in reader.tree if n.key[:1] == (7,))
    assert (leaf.parent.host, leaf.parent.device) == ("fetching", "resident")  # type: ignore[union-attr]
    with pytest.raises(error_class("ParentFetching")) as refused:
        reader.fire("write", leaf)
    assert str(refused.value) == (
        f"node {leaf.id}: write refused in unbacked (pins=0): the parent's host copy is still "
        "being read from storage; a failed read must be able to free it"
    )
    assert reader.backup([leaf]) == 0
    assert reader.evict(4 * PAGE) == 0  # nothing to evict without its backup
    failing.gate.set()
    for copy in list(reader.storage.in_flight().values()):  # type: ignore[union-attr]
        copy.done.wait(5)
    reader.poll()
    assert [(n, h, d, s) for _, n, h, d, s, _ in states(reader)] == [
        (2 * PAGE, "evicted", "resident", "stored"),
        (2 * PAGE, "unbacked", "resident", "unstored"),
    ]
    assert reader.storage.idle()  # type: ignore[union-attr]
    assert reader.backup([leaf]) == 1  # once the read has landed, the leaf may be backed up
    reader.close()


def _host_only(cache: HiCache, starts: Sequence[int], pages: int) -> None:
    """Insert one prefix of ``pages`` per start, back each up, and evict the device copies."""
    for start in starts:
        cache.insert(tokens(pages, start))
        cache.poll()
    cache.evict(10_000)


def test_a_fetch_the_host_cannot_hold_is_refused_before_evicting_anything(store: Store) -> None:
    toks = tokens(12)
    stored_cache(store, toks)
    small = HiCache(config(host_pages=8), storage=tier(store, policy="off"))
    _host_only(small, [5000], 4)
    before = states(small)
    found = small.match_prefix(toks)  # 12 pages can never fit 8
    assert (found.host_len, found.storage_len) == (0, 0)
    assert small.stats().prefetch == {"pool_exhausted": 1}
    assert states(small) == before
    assert small.match_prefix(tokens(4, 5000)).host_len == 4 * PAGE


def test_a_fetch_short_of_host_room_evicts_only_what_it_lacks(store: Store) -> None:
    toks = tokens(6)
    stored_cache(store, toks)
    small = HiCache(config(host_pages=12), storage=tier(store, policy="off", prefetch_capacity=48))
    _host_only(small, [5000, 6000, 7000], 2)
    _host_only(small, [8000], 1)
    assert small.tiers.host.allocator.free_pages == 5
    small.match_prefix(toks)  # 6 pages: one short
    kept = [n for n in small.tree if n.host == "backed" and n.device == "absent"]
    assert len(kept) == 3  # the oldest 2-page prefix went, nothing else
    assert small.tiers.host.allocator.free_pages == 1
    small.poll()
    assert device_kv_matches(small, toks)


def test_a_fetched_prefix_is_evicted_from_the_host_in_its_turn(store: Store) -> None:
    toks = tokens(3)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store, policy="off", prefetch_policy="wait"))
    _host_only(reader, [5000], 2)  # older: used before the fetch
    reader.match_prefix(toks)  # fetched: a host-only prefix, used last
    (fetched,) = [n for n in reader.tree if n.key[0] == toks[0]]
    assert (fetched.host, fetched.device) == ("backed", "absent")
    assert fetched.id in reader.evictor.host_candidates()
    assert reader.evict_host(2 * PAGE) == 2 * PAGE  # the older prefix first
    assert fetched.id in reader.tree.nodes
    assert reader.evict_host(3 * PAGE) == 3 * PAGE  # then the fetched one
    assert fetched.id not in reader.tree.nodes
    assert reader.tiers.host.allocator.free_pages == 32


# -- found by a review: what a failed fetch, a discover, a held torn page and close leave ---------


def test_a_failed_fetch_backs_up_what_an_insert_put_on_the_device(tmp_path: Path) -> None:
    """The part of a failed read an insert took onto the device, and its child, are backed up."""
    toks = tokens(4)
    store, _, _ = torn_store(tmp_path, toks, page=0)
    reader = HiCache(config(), storage=tier(store))
    reader.match_prefix(toks)  # the read runs inline; it is applied at the next poll
    other = toks[: 2 * PAGE] + tokens(2, start=50000)
    reader.insert(other)  # takes the fetching node's first two pages onto the device
    for _ in range(4):  # the failed read, then the host and storage backups
        reader.poll()
    head, tail = reader.tree.walk(tuple(other)).path
    assert [(n.host, n.device, n.storage) for n in (head, tail)] == [
        ("backed", "resident", "stored"),
        ("backed", "resident", "stored"),
    ]
    assert device_kv_matches(reader, other)


def test_a_failed_fetch_loses_no_hit_for_good(store: Store) -> None:
    """A read that failed once under a node an insert kept: once evicted, it is fetched again.

    The spec leaves a node whose fetch failed ``stored`` with no host copy;
    the runtime keeps it only while the device holds it (and backs it up),
    and removes it once no tier does, so a later lookup finds it by key.
    """
    toks = tokens(3)
    stored_cache(store, toks)
    faulty = FaultyStore(store)
    faulty.raises = {"get"}
    reader = HiCache(config(), storage=tier(faulty, query_backoff=0))  # asks again at once
    reader.match_prefix(toks)  # the read runs inline, and fails
    reader.insert(toks)  # a request recomputed the prefix meanwhile
    reader.poll()  # fetch_failed: the node stays on the device, and is backed up
    reader.poll()
    assert [(h, d, s) for _, _, h, d, s, _ in states(reader)] == [("backed", "resident", "stored")]
    faulty.raises = set()
    reader.evict(3 * PAGE)
    reader.evict_host(3 * PAGE)
    assert list(reader.tree) == []
    found = reader.match_prefix(toks)
    assert found.storage_len == 3 * PAGE
    reader.poll()
    assert reader.match_prefix(toks).host_len == 3 * PAGE
    assert reader.stats().prefetch == {"started": 2}
    assert reader.stats().storage_failures == {"fetch:failed": 1}


def test_close_settles_the_backup_a_fetch_applied_at_close_starts(store: Store) -> None:
    """A child recomputed under a node being fetched is backed up, not left writing, by close."""
    toks = tokens(3)
    stored_cache(store, toks)
    reader = HiCache(config(), storage=tier(store))
    reader.match_prefix(toks)  # the read runs inline; it is applied at close
    reader.insert(toks + tokens(2, start=70000))  # its backup waits for the read
    reader.close()
    assert [(n.host, n.device, n.storage) for n in reader.tree] == [
        ("backed", "resident", "stored"),
        ("backed", "resident", "stored"),
    ]
    assert reader.issued() == []


def test_a_child_is_stored_once_its_parent_is_discovered(tmp_path: Path) -> None:
    """Under write_through a child waits for its parent's pages, whoever stored them."""
    parent, child = tokens(2), tokens(2, start=30000)
    faulty = FaultyStore(LocalFileStore(tmp_path))
    faulty.raises = {"put"}
    cache = HiCache(config(), storage=tier(faulty, query_backoff=0))  # asks again at once
    cache.insert(parent)
    cache.insert(parent + child)
    for _ in range(3):  # the host backups; the parent's store fails; the child's never starts
        cache.poll()
    faulty.raises = set()
    stored_cache(LocalFileStore(tmp_path), parent)  # another server stores the parent
    cache.match_prefix(parent + child + tokens(2, start=40000))  # discovers the parent
    cache.poll()
    assert [(n.host, n.storage) for n in cache.tree] == [("backed", "stored"), ("backed", "stored")]
    assert cache.stats().storage_pages == {"stored": 2, "discovered": 2}
    assert faulty.calls == ["put", "exists_prefix", "exists_prefix", "put"]


def test_a_page_a_newer_version_wrote_is_left_in_the_store(tmp_path: Path) -> None:
    """Across an upgrade, a server of this version must not throw away the newer servers' pages."""
    toks = tokens(4)
    store = LocalFileStore(tmp_path)
    writer = stored_cache(store, toks)
    keys = page_keys(writer.storage.namespace(), toks)  # type: ignore[union-attr]
    newer = store.path(keys[2])
    newer.write_bytes(b"FSMPAGE4" + newer.read_bytes()[8:])
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    assert reader.match_prefix(toks).host_len == 2 * PAGE
    assert newer.exists()
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "later_format"),))]
    assert reader.stats().storage_failures == {"fetch:later_format": 1}
    assert [e for _, e in reader.log.transitions()][-3:] == ["fetch_failed", "vanish", "delete"]
    assert device_kv_matches(reader, toks[: 2 * PAGE])


def test_a_torn_page_another_read_holds_is_left_and_the_prefix_kept(tmp_path: Path) -> None:
    """The drop a read refuses waits for a later read; the intact pages before it are used."""
    toks = tokens(4)
    store, keys, torn = torn_store(tmp_path, toks, page=2)
    reader = HiCache(config(), storage=tier(store, prefetch_policy="wait"))
    with store.reading(keys):  # another fetch holds the pages
        assert reader.match_prefix(toks).host_len == 2 * PAGE
    assert torn.exists()
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 2, "corrupt"),))]
    assert device_kv_matches(reader, toks[: 2 * PAGE])
    assert reader.match_prefix(toks).host_len == 0  # the next read meets it and drops it
    assert not torn.exists()
