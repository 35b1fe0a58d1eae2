"""What a cache reports: tier occupancy, hit rates, copies, transitions and refusals.

:class:`Counters` is updated by the cache as it works; :func:`snapshot`
combines it with a walk of the tree into a :class:`Stats`. :func:`register`
exposes the same figures to Prometheus through a custom collector, read at
scrape time so the hot path pays nothing for it. Every series carries a
``cache`` label naming its cache, so that several caches can share a registry.
A counter's totals start again when its cache is reset, as a process's do when
it restarts; each counter sample carries when its totals started (the
``_created`` series), so a scraper tells that reset from counts going down.

A scrape runs on a thread of its own (``prometheus_client.start_http_server``'s)
while the scheduler's thread works the cache, and takes no lock of the cache:
:func:`snapshot` copies each container it walks in one step, so that what the
cache changes meanwhile makes its figures a moment stale, never an error, and a
cache that still cannot be read leaves only its own series out of that scrape.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fsm_cache.cache.tree import RadixTree
from fsm_cache.errors import BadArgument
from fsm_cache.memory.tiers import Tiers
from fsm_cache.residency import DEVICE_HELD, HOST_HELD, STORAGE_HELD


def _now() -> float:
    """Seconds since the epoch, as Prometheus's ``_created`` timestamps are."""
    return time.time()


@dataclass
class Counters:
    """Running totals kept by the cache, since :attr:`since` (built or reset)."""

    since: float = field(default_factory=_now, compare=False)
    """When these totals started: the ``_created`` of every Prometheus counter."""
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    transitions: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    copy_bytes: Counter[str] = field(default_factory=Counter)
    copy_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    copy_failures: Counter[str] = field(default_factory=Counter)
    deleted_nodes: int = 0
    evicted_tokens: Counter[str] = field(default_factory=Counter)
    """Tokens evicted per tier (``device``, ``host``), by whatever path evicted them;
    an unbacked leaf that write-through deletes from the device counts as device."""
    storage_pages: Counter[str] = field(default_factory=Counter)
    storage_bytes: Counter[str] = field(default_factory=Counter)
    storage_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    storage_failures: Counter[str] = field(default_factory=Counter)
    storage_errors: dict[str, str] = field(default_factory=dict)
    """The last reason a store gave for each ``kind:outcome`` of :attr:`storage_failures`."""
    prefetch: Counter[str] = field(default_factory=Counter)

    def looked_up(self, tokens: int, device: int, host: int) -> None:
        """Count one lookup of ``tokens``, ``device`` of them on the device and ``host`` host-only."""
        self.lookup_tokens += tokens
        self.device_hit_tokens += device
        self.host_hit_tokens += host

    def copied(self, direction: str, seconds: float, nbytes: int, ok: bool) -> None:
        """Count one applied copy: its seconds, and its bytes if it succeeded, else a failure."""
        self.copy_seconds[direction] += seconds
        if ok:
            self.copy_bytes[direction] += nbytes
        else:
            self.copy_failures[direction] += 1

    def storage_copied(
        self,
        kind: str,
        seconds: float,
        pages: int,
        nbytes: int,
        outcome: str,
        *,
        error: str | None = None,
    ) -> None:
        """Count one applied storage copy (``store`` or ``fetch``) and what it acknowledged.

        ``pages`` leading pages landed (``nbytes`` bytes); any outcome but
        ``ok`` also counts a failure of ``kind`` under that outcome
        (``store:timeout``, ``fetch:missing``, ...), and keeps ``error``, what
        the store raised, as that failure's latest reason: a count says a
        store fails, its reason says why, and one per outcome stays small.
        """
        self.storage_seconds[kind] += seconds
        self.storage_pages["stored" if kind == "store" else "fetched"] += pages
        self.storage_bytes[kind] += nbytes
        if outcome != "ok":
            self.storage_failures[f"{kind}:{outcome}"] += 1
            if error is not None:
                self.storage_errors[f"{kind}:{outcome}"] = error


class Observed(Protocol):
    """What the stats read of a cache."""

    @property
    def tree(self) -> RadixTree:
        """The radix tree."""
        ...

    @property
    def tiers(self) -> Tiers:
        """The pools and the copy engine."""
        ...

    @property
    def counters(self) -> Counters:
        """The running totals."""
        ...

    def issued(self) -> list[int]:
        """Return the ids of copies started and not yet applied."""
        ...


class Reported(Protocol):
    """What a Prometheus collector reads of a cache: its :class:`Stats`."""

    def stats(self) -> Stats:
        """Return the cache's stats now (its storage tier's copies included)."""
        ...


@dataclass(frozen=True)
class Stats:
    """A point-in-time report of a cache.

    Attributes:
        nodes: Tree nodes (roots excluded).
        device_tokens: Tokens whose KV the device holds or is loading.
        host_tokens: Tokens whose KV the host holds or is writing.
        device_hit_rate: Matched device tokens over looked-up tokens, since
            ``counted_since`` (a lifetime average: for a rate over a window,
            divide the increases of ``hit_tokens`` and ``lookup_tokens``).
        host_hit_rate: Host-only matched tokens over looked-up tokens, likewise.
        pins: Pins outstanding, summed over nodes.
        locks: Locks outstanding on leaves of lock paths (a lock counts once),
            a namespace root's included (the lock of a request that matched nothing).
        copies_in_flight: Copies between the device and the host started and
            not yet applied (:meth:`~fsm_cache.cache.hicache.HiCache.issued`),
            whatever the copy engine reports of them.
        bytes: Bytes copied per direction (``d2h``, ``h2d``).
        seconds: Seconds from start to applied acknowledgement, per direction.
        copy_failures: Copies whose acknowledgement reported failure, per direction.
        lookup_tokens: Tokens looked up (a partial last page too), since ``counted_since``.
        hit_tokens: Of those, tokens matched on the device (``device``) and
            on the host only (``host``).
        transitions: Applied transitions by event.
        refused: Transitions not applied, by event: refused by the spec, or
            their effect failed (the log tells a failure from outside apart).
        states: Nodes per ``host/device`` state pair.
        storage_tokens: Tokens whose pages a storage tier holds or is being given.
        storage_in_flight: Copies to or from a storage tier started, not yet applied.
        storage_pages: Pages ``stored``, ``fetched``, ``discovered``, ``vanished``,
            ``evicted`` (from a store the cache owns).
        storage_bytes: Bytes of pages acknowledged per storage copy kind (``store``, ``fetch``).
        storage_failures: Storage copies that failed, by ``kind:outcome``, and
            key queries that answered after their budget (``query:slow``), and
            backups not started because lookups back off (``store:backing_off``),
            and evictions the store refused (``evict:failed``; the nodes stay
            ``stored``).
        storage_errors: The latest reason a store gave (what it raised) for each
            ``kind:outcome`` of ``storage_failures`` that had one. Not
            exported to Prometheus: free text would make a label without bound.
        prefetch: What each lookup's prefetch decided (``started``, ``waited``,
            ``below_threshold``, ``rate_limited``, ``none_stored``,
            ``query_failed``, ``backing_off``, ...).
        counted_since: When the running totals above started (the cache built
            or reset), seconds since the epoch; not compared, as a
            reset cache's stats equal a new one's.
    """

    nodes: int
    device_tokens: int
    host_tokens: int
    device_hit_rate: float
    host_hit_rate: float
    pins: int
    locks: int
    copies_in_flight: int
    bytes: dict[str, int]
    seconds: dict[str, float]
    transitions: dict[str, int]
    refused: dict[str, int]
    states: dict[str, int]
    storage_tokens: int = 0
    storage_in_flight: int = 0
    storage_pages: dict[str, int] = field(default_factory=dict)
    storage_bytes: dict[str, int] = field(default_factory=dict)
    storage_failures: dict[str, int] = field(default_factory=dict)
    storage_errors: dict[str, str] = field(default_factory=dict)
    prefetch: dict[str, int] = field(default_factory=dict)
    copy_failures: dict[str, int] = field(default_factory=dict)
    lookup_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    counted_since: float = field(default=0.0, compare=False)


def snapshot(cache: Observed, storage_in_flight: int = 0) -> Stats:
    """Return the :class:`Stats` of ``cache`` now (``storage_in_flight`` from its storage tier).

    Another thread may call it while the cache's own thread works the cache (a
    scrape does): every dict it walks is first copied whole by ``list()`` or
    ``dict()``, which no other Python thread can interleave with, so the walk
    never sees a dict change size under it. The figures are those of the
    moments each was read.
    """
    nodes = list(cache.tree)
    c = cache.counters
    looked = max(c.lookup_tokens, 1)
    held = [*list(cache.tree.roots.values()), *nodes]  # a miss's lock is its root's
    locks = sum(n.locks - sum(ch.locks for ch in list(n.children.values())) for n in held)
    return Stats(
        nodes=len(nodes),
        device_tokens=sum(len(n.key) for n in nodes if n.device in DEVICE_HELD),
        host_tokens=sum(len(n.key) for n in nodes if n.host in HOST_HELD),
        device_hit_rate=c.device_hit_tokens / looked,
        host_hit_rate=c.host_hit_tokens / looked,
        pins=sum(n.pins for n in nodes),
        locks=locks,
        copies_in_flight=len(cache.issued()),
        bytes=dict(c.copy_bytes),
        seconds=dict(c.copy_seconds),
        transitions=dict(c.transitions),
        refused=dict(c.refused),
        states=dict(Counter(f"{n.host}/{n.device}" for n in nodes)),
        storage_tokens=sum(len(n.key) for n in nodes if n.storage in STORAGE_HELD),
        storage_in_flight=storage_in_flight,
        storage_pages=dict(c.storage_pages),
        storage_bytes=dict(c.storage_bytes),
        storage_failures=dict(c.storage_failures),
        storage_errors=dict(c.storage_errors),
        prefetch=dict(c.prefetch),
        copy_failures=dict(c.copy_failures),
        lookup_tokens=c.lookup_tokens,
        hit_tokens={"device": c.device_hit_tokens, "host": c.host_hit_tokens},
        counted_since=c.since,
    )


_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("tokens", "gauge", "Tokens held per tier", ("tier",)),
    (
        "hit_rate",
        "gauge",
        "Matched tokens over looked-up tokens, since the counters started",
        ("tier",),
    ),
    ("lookup_tokens", "counter", "Tokens looked up", ()),
    ("hit_tokens", "counter", "Looked-up tokens matched, per tier", ("tier",)),
    ("pins", "gauge", "Host pins outstanding", ()),
    ("locks", "gauge", "Device locks outstanding", ()),
    ("copies_in_flight", "gauge", "Copies started, not yet applied", ()),
    (
        "storage_copies_in_flight",
        "gauge",
        "Copies to or from the storage tier started, not yet applied",
        (),
    ),
    ("copy_bytes", "counter", "Bytes copied", ("direction",)),
    ("copy_seconds", "counter", "Copy seconds", ("direction",)),
    ("copy_failures", "counter", "Copies that failed", ("direction",)),
    ("transitions", "counter", "Applied transitions", ("event",)),
    ("refused", "counter", "Refused transitions", ("event",)),
    ("nodes", "gauge", "Nodes per residency state", ("state",)),
    ("storage_pages", "counter", "Storage tier pages", ("event",)),
    ("storage_bytes", "counter", "Storage tier bytes", ("kind",)),
    ("storage_failures", "counter", "Failed storage copies", ("kind", "outcome")),
    ("prefetch", "counter", "Prefetch decisions", ("outcome",)),
    (
        "scrape_errors",
        "counter",
        "Scrapes that could not read the cache's stats, so left its other series out",
        (),
    ),
)
"""Each metric: name after the prefix, type, help text, and labels after ``cache``.

``scrape_errors`` is the collector's own count (:meth:`Collector.collect`); every
other metric is a figure of the cache's :class:`Stats` (:func:`_samples`).
"""

_TRIES = 3
"""Reads of a cache's stats a scrape makes before it gives that cache up."""

Samples = dict[str, list[tuple[tuple[str, ...], float]]]


def _samples(stats: Stats) -> Samples:
    """Return each metric's label values and value for one cache's ``stats``."""

    def by(items: Iterable[tuple[str, float]]) -> list[tuple[tuple[str, ...], float]]:
        return [((label,), value) for label, value in sorted(items)]

    return {
        "tokens": [
            (("device",), stats.device_tokens),
            (("host",), stats.host_tokens),
            (("storage",), stats.storage_tokens),
        ],
        "hit_rate": [(("device",), stats.device_hit_rate), (("host",), stats.host_hit_rate)],
        "lookup_tokens": [((), stats.lookup_tokens)],
        "hit_tokens": by(stats.hit_tokens.items()),
        "pins": [((), stats.pins)],
        "locks": [((), stats.locks)],
        "copies_in_flight": [((), stats.copies_in_flight)],
        "storage_copies_in_flight": [((), stats.storage_in_flight)],
        "copy_bytes": by(stats.bytes.items()),
        "copy_seconds": by(stats.seconds.items()),
        "copy_failures": by(stats.copy_failures.items()),
        "transitions": by(stats.transitions.items()),
        "refused": by(stats.refused.items()),
        "nodes": by(stats.states.items()),
        "storage_pages": by(stats.storage_pages.items()),
        "storage_bytes": by(stats.storage_bytes.items()),
        "storage_failures": sorted(
            ((k.split(":", 1)[0], k.split(":", 1)[1]), v) for k, v in stats.storage_failures.items()
        ),
        "prefetch": by(stats.prefetch.items()),
    }


class Collector:
    """A Prometheus collector that reads the stats of named caches at scrape time.

    One collector serves every cache registered with one registry under one
    prefix, so the registry sees each metric name once; each series carries
    a ``cache`` label with its cache's name.

    Args:
        prefix: Metric name prefix.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._caches: dict[str, Reported] = {}
        self._failed: Counter[str] = Counter()
        """Scrapes that could not read each cache, since it was added."""
        self._lock = threading.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the caches reported, in registration order."""
        with self._lock:
            return tuple(self._caches)

    def add(self, cache: Reported, name: str | None = None) -> str:
        """Report ``cache`` under ``name`` (a fresh ``cache<N>`` if None); return the name.

        Raises:
            BadArgument: ``cache`` has no ``stats()``, or is reported already
                (under any name: its figures would count twice in every sum),
                or ``name`` is not a non-empty str or names a cache reported already.
        """
        _check_cache(cache)
        _check_name(name)
        with self._lock:
            for known, reported in self._caches.items():
                if reported is cache:
                    raise BadArgument(f"register: this cache is registered already, as {known!r}")
            if name is None:
                name = f"cache{next(_NUMBERS)}"
                while name in self._caches:  # a name a caller gave
                    name = f"cache{next(_NUMBERS)}"
            elif name in self._caches:
                raise BadArgument(f"register: a cache named {name!r} is registered already")
            self._caches[name] = cache
        return name

    def remove(self, name: str) -> None:
        """Stop reporting the cache called ``name``.

        Raises:
            BadArgument: No cache of that name is reported.
        """
        with self._lock:
            if self._caches.pop(name, None) is None:
                raise BadArgument(f"register: no cache named {name!r} is registered")
            self._failed.pop(name, None)

    def describe(self) -> Iterator[Any]:
        """Yield every metric family, without samples (what the registry checks names against)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Any]:
        """Yield every metric family with a sample set per cache reported.

        A cache whose stats cannot be read (:func:`_read` gave up) is left out
        of this scrape, and counted in its ``scrape_errors`` series, rather
        than ending the scrape: the registry's other caches still report.
        """
        families = self._families()
        with self._lock:
            caches = list(self._caches.items())
        counters = {metric for metric, kind, _, _ in _FAMILIES if kind == "counter"}
        for name, cache in caches:
            try:
                stats = _read(cache)
                samples = _samples(stats)
            except Exception:  # whatever it was, only this cache's series go
                with self._lock:
                    if name in self._caches:
                        self._failed[name] += 1
                continue
            for metric, rows in samples.items():
                family = families[metric]
                for labels, value in rows:
                    if metric in counters:
                        family.add_metric([name, *labels], value, created=stats.counted_since)
                    else:
                        family.add_metric([name, *labels], value)
        with self._lock:
            failed = [(name, self._failed[name]) for name, _ in caches]
        for name, count in failed:
            families["scrape_errors"].add_metric([name], count)
        yield from families.values()

    def _families(self) -> dict[str, Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        out: dict[str, Any] = {}
        for metric, kind, text, labels in _FAMILIES:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            out[metric] = family(f"{self.prefix}_{metric}", text, labels=["cache", *labels])
        return out


def _read(cache: Reported) -> Stats:
    """Return ``cache.stats()``, read again (up to :data:`_TRIES` in all) while it raises RuntimeError.

    A container changing size under a walk raises RuntimeError (``dictionary
    changed size during iteration``); :func:`snapshot` copies what it walks, so
    only a cache of another kind, or a read the copies do not cover, still can.
    Read again, the figures are a moment later's.
    """
    for _ in range(_TRIES - 1):
        with contextlib.suppress(RuntimeError):
            return cache.stats()
    return cache.stats()


def _check_name(name: object) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise BadArgument(f"register: name must be a non-empty str, got {name!r}")


def _check_cache(cache: object) -> None:
    """Refuse what a scrape could not read: every later scrape of the registry would fail."""
    if not callable(getattr(cache, "stats", None)):
        raise BadArgument(
            f"register: cache must have a stats() method (a HiCache), got {type(cache).__name__}"
        )


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
"""What Prometheus takes as a metric name, so as the prefix of one."""


def _check_target(registry: object, prefix: object) -> None:
    """Refuse a registry that cannot register and a prefix that makes no metric name."""
    if registry is not None and not callable(getattr(registry, "register", None)):
        raise BadArgument(
            "register: registry must be a prometheus_client CollectorRegistry or None, "
            f"got {type(registry).__name__}"
        )
    if not isinstance(prefix, str) or _METRIC_NAME.fullmatch(prefix) is None:
        raise BadArgument(
            f"register: prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), "
            f"got {prefix!r}"
        )


_NUMBERS = itertools.count(1)
"""Numbers of the generated cache names (``cache1``, ``cache2``, ...), unique in the process."""

_SHARED: weakref.WeakKeyDictionary[Any, dict[str, Collector]] = weakref.WeakKeyDictionary()
"""The collector of each registry, by prefix, as last registered (the registry's own
``unregister`` may have dropped it since)."""

_SHARED_LOCK = threading.Lock()


def register(
    cache: Reported, registry: Any = None, prefix: str = "fsm_cache", name: str | None = None
) -> Collector:
    """Expose ``cache``'s stats to Prometheus; returns the collector that reports it.

    Every cache registered with one registry under one prefix is reported by
    one collector, each series labelled ``cache="<name>"``, so two caches in
    one process never clash. Counters are exposed with the ``_total`` suffix
    (``fsm_cache_transitions_total``).

    Args:
        cache: The cache to report.
        registry: A ``prometheus_client.CollectorRegistry``; the default registry if None.
        prefix: Metric name prefix.
        name: The value of the ``cache`` label; None for a fresh ``cache<N>``.

    A collector the registry's own ``unregister`` dropped is not used again:
    the cache goes to a new collector, registered in its place.

    Raises:
        BadArgument: ``cache`` has no ``stats()`` or is registered with the
            registry under the prefix already, ``registry`` cannot register
            collectors, ``prefix`` makes no Prometheus metric name or makes a
            series another collector of the registry has, ``name`` is not a
            non-empty str, or another cache of the registry has it already;
            nothing was registered.
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.registry import DuplicateTimeseries
    except ModuleNotFoundError as exc:  # prometheus-client comes with the metrics extra
        raise ModuleNotFoundError(f"{exc}: pip install 'fsm-cache[metrics]'") from exc

    _check_cache(cache)
    _check_target(registry, prefix)
    _check_name(name)
    target = REGISTRY if registry is None else registry
    with _SHARED_LOCK:
        by_prefix = _SHARED.setdefault(target, {})
        held = by_prefix.get(prefix)
        # prometheus_client tells no one whether it still has a collector, but it
        # refuses one whose series it has: a new one registers only if ``held`` is
        # gone (or never was), and ``held`` has every series if it is still there.
        collector = Collector(prefix)
        try:
            target.register(collector)
        except DuplicateTimeseries as exc:
            if held is None or not _families_in(collector, exc.duplicates):
                clash = ", ".join(sorted(exc.duplicates))
                raise BadArgument(
                    f"register: prefix {prefix!r} makes series the registry has already: {clash}"
                ) from exc
            collector = held
        else:
            by_prefix[prefix] = collector
    collector.add(cache, name)
    return collector


def _families_in(collector: Collector, names: set[str]) -> bool:
    """Whether ``names`` has every metric family ``collector`` reports: one like it has them."""
    return all(family.name in names for family in collector.describe())
