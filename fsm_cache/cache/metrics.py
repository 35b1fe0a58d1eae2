"""What a cache reports: tier occupancy, hit rates, copies, transitions and refusals.

:class:`Counters` is updated by the cache as it works; :func:`snapshot`
combines it with a walk of the tree into a :class:`Stats`. :func:`register`
exposes the same figures to Prometheus through a custom collector, read at
scrape time so the hot path pays nothing for it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fsm_cache.cache.tree import RadixTree
from fsm_cache.memory.tiers import Tiers
from fsm_cache.residency import DEVICE_HELD, HOST_HELD, STORAGE_HELD


@dataclass
class Counters:
    """Running totals kept by the cache."""

    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    transitions: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    copy_bytes: Counter[str] = field(default_factory=Counter)
    copy_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    copy_failures: Counter[str] = field(default_factory=Counter)
    deleted_nodes: int = 0
    storage_pages: Counter[str] = field(default_factory=Counter)
    storage_bytes: Counter[str] = field(default_factory=Counter)
    storage_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    storage_failures: Counter[str] = field(default_factory=Counter)
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
        self, kind: str, seconds: float, pages: int, nbytes: int, outcome: str
    ) -> None:
        """Count one applied storage copy (``store`` or ``fetch``) and what it acknowledged.

        ``pages`` leading pages landed (``nbytes`` bytes); any outcome but
        ``ok`` also counts a failure of ``kind`` under that outcome
        (``store:timeout``, ``fetch:missing``, ...).
        """
        self.storage_seconds[kind] += seconds
        self.storage_pages["stored" if kind == "store" else "fetched"] += pages
        self.storage_bytes[kind] += nbytes
        if outcome != "ok":
            self.storage_failures[f"{kind}:{outcome}"] += 1


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


@dataclass(frozen=True)
class Stats:
    """A point-in-time report of a cache.

    Attributes:
        nodes: Tree nodes (roots excluded).
        device_tokens: Tokens whose KV the device holds or is loading.
        host_tokens: Tokens whose KV the host holds or is writing.
        device_hit_rate: Matched device tokens over looked-up tokens.
        host_hit_rate: Host-only matched tokens over looked-up tokens.
        pins: Pins outstanding, summed over nodes.
        locks: Locks outstanding on leaves of lock paths (a lock counts once).
        copies_in_flight: Copies started and not yet applied.
        bytes: Bytes copied per direction (``d2h``, ``h2d``).
        seconds: Seconds from start to applied acknowledgement, per direction.
        transitions: Applied transitions by event.
        refused: Refused transitions by event.
        states: Nodes per ``host/device`` state pair.
        storage_tokens: Tokens whose pages a storage tier holds or is being given.
        storage_in_flight: Copies to or from a storage tier started, not yet applied.
        storage_pages: Pages ``stored``, ``fetched``, ``discovered``, ``vanished``,
            ``evicted`` (from a store the cache owns).
        storage_bytes: Bytes of pages acknowledged per storage copy kind (``store``, ``fetch``).
        storage_failures: Storage copies that failed, by ``kind:outcome``.
        prefetch: What each lookup's prefetch decided (``started``, ``waited``,
            ``below_threshold``, ``rate_limited``, ``none_stored``, ...).
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
    prefetch: dict[str, int] = field(default_factory=dict)


def snapshot(cache: Observed, storage_in_flight: int = 0) -> Stats:
    """Return the :class:`Stats` of ``cache`` now (``storage_in_flight`` from its storage tier)."""
    nodes = list(cache.tree)
    c = cache.counters
    looked = max(c.lookup_tokens, 1)
    locks = sum(n.locks - sum(ch.locks for ch in n.children.values()) for n in nodes)
    return Stats(
        nodes=len(nodes),
        device_tokens=sum(len(n.key) for n in nodes if n.device in DEVICE_HELD),
        host_tokens=sum(len(n.key) for n in nodes if n.host in HOST_HELD),
        device_hit_rate=c.device_hit_tokens / looked,
        host_hit_rate=c.host_hit_tokens / looked,
        pins=sum(n.pins for n in nodes),
        locks=locks,
        copies_in_flight=len(cache.tiers.copier.in_flight()),
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
        prefetch=dict(c.prefetch),
    )


class _Collector:
    """A Prometheus collector that reads a cache's stats at scrape time."""

    def __init__(self, cache: Observed, prefix: str) -> None:
        self.cache = cache
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats, p = snapshot(self.cache), self.prefix
        tokens = GaugeMetricFamily(f"{p}_tokens", "Tokens held per tier", labels=["tier"])
        tokens.add_metric(["device"], stats.device_tokens)
        tokens.add_metric(["host"], stats.host_tokens)
        tokens.add_metric(["storage"], stats.storage_tokens)
        yield tokens
        hits = GaugeMetricFamily(
            f"{p}_hit_rate", "Matched tokens over looked-up tokens", labels=["tier"]
        )
        hits.add_metric(["device"], stats.device_hit_rate)
        hits.add_metric(["host"], stats.host_hit_rate)
        yield hits
        for name, value, text in (
            ("pins", stats.pins, "Host pins outstanding"),
            ("locks", stats.locks, "Device locks outstanding"),
            ("copies_in_flight", stats.copies_in_flight, "Copies started, not yet applied"),
            (
                "storage_copies_in_flight",
                stats.storage_in_flight,
                "Copies to or from the storage tier started, not yet applied",
            ),
        ):
            yield GaugeMetricFamily(f"{p}_{name}", text, value=value)
        yield _labelled(
            CounterMetricFamily(f"{p}_copy_bytes", "Bytes copied", labels=["direction"]),
            stats.bytes.items(),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_copy_seconds", "Copy seconds", labels=["direction"]),
            stats.seconds.items(),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_transitions", "Applied transitions", labels=["event"]),
            stats.transitions.items(),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_refused", "Refused transitions", labels=["event"]),
            stats.refused.items(),
        )
        yield _labelled(
            GaugeMetricFamily(f"{p}_nodes", "Nodes per residency state", labels=["state"]),
            stats.states.items(),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_storage_pages", "Storage tier pages", labels=["event"]),
            stats.storage_pages.items(),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_storage_bytes", "Storage tier bytes", labels=["kind"]),
            stats.storage_bytes.items(),
        )
        yield _labelled(
            CounterMetricFamily(
                f"{p}_storage_failures", "Failed storage copies", labels=["kind", "outcome"]
            ),
            ((tuple(k.split(":", 1)), v) for k, v in stats.storage_failures.items()),
        )
        yield _labelled(
            CounterMetricFamily(f"{p}_prefetch", "Prefetch decisions", labels=["outcome"]),
            stats.prefetch.items(),
        )


def _labelled(family: Any, items: Iterable[tuple[str | tuple[str, ...], float]]) -> Any:
    for label, value in sorted(items):
        family.add_metric([label] if isinstance(label, str) else list(label), value)
    return family


def register(cache: Observed, registry: Any = None, prefix: str = "fsm_cache") -> Any:
    """Expose ``cache``'s stats to Prometheus; returns the collector.

    Args:
        cache: The cache to report.
        registry: A ``prometheus_client.CollectorRegistry``; the default registry if None.
        prefix: Metric name prefix.
    """
    try:
        from prometheus_client import REGISTRY
    except ModuleNotFoundError as exc:  # prometheus-client comes with the metrics extra
        raise ModuleNotFoundError(f"{exc}: pip install 'fsm-cache[metrics]'") from exc

    collector = _Collector(cache, prefix)
    (registry or REGISTRY).register(collector)
    return collector
