"""``fsm-cache bench storage``: backup and prefetch through HiCache against the stores' own I/O.

One run, the same pages, three paths for each backend and direction:

* **HiCache**. Backup: a cache whose device pages already hold the KV
  inserts the prompt; its write-through host backup lands, the storage tier
  stores the host pages, and the bench polls until every node is ``stored``.
  Prefetch: a second cache on the same store looks the prompt up under the
  ``wait`` policy (the key query, host slots, the read on a worker thread, the
  copy into host memory); its host pages are then compared byte for byte with
  the pages inserted.
* **store**: ``store.put`` and ``store.get`` of the same pages under the same
  keys, the floor of what the cache can do with that backend.
* **raw I/O**: the same bytes without the store (local: one plain file per page,
  written whole, read into a preallocated tensor; Redis: pipelined ``SET`` and
  ``MGET`` in the store's batches).

The backends are :class:`~fsm_cache.storage.LocalFileStore` in a temporary
directory and :class:`~fsm_cache.storage.RedisStore` on a ``redis-server``
the bench starts on 127.0.0.1 (:mod:`fsm_cache.testing.redis_server`), or on
``fakeredis`` in process when there is no ``redis-server`` on PATH; the table
says which. Every page read back is checked bit-exact; a mismatch raises
:class:`~fsm_cache.errors.CorruptPage` naming the path and the page. Each
repetition runs every path once, the order rotated, and the table shows the
best of the repetitions: these machines are shared, so only the ratios of one
run mean anything.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.errors import ConfigError, CorruptPage, StoreFailed
from fsm_cache.memory.pages import pages_of
from fsm_cache.memory.tiers import CacheConfig
from fsm_cache.storage import LocalFileStore, Namespace, Store, page_keys, stored_prefix
from fsm_cache.storage.codec import raw_bytes


T = TypeVar("T")

PATHS = ("HiCache", "store", "raw I/O")
"""The paths measured for each backend and direction, the cache's first."""
DIRECTIONS = ("backup", "prefetch")
"""Host to storage (a put), and storage to host (a get)."""
REDIS_MODES = ("auto", "server", "fake", "off")
"""Which Redis the bench uses: a real server if on PATH else fakeredis, either one, or none."""
MODEL = "fsm-cache-bench"
PAGE_SIZE = 16
HEAD_DIM = 128
IO_TIMEOUT = 60.0
"""Seconds a backup or a prefetch may take before the bench calls it failed."""


@dataclass(frozen=True)
class StorageRow:
    """The best time of one path, for one backend and direction.

    Attributes:
        backend: ``local file`` or ``redis``.
        direction: ``backup`` or ``prefetch``.
        path: ``HiCache``, ``store`` or ``raw I/O``.
        seconds: The fastest repetition.
        pages: Pages moved per repetition.
        page_bytes: Bytes of one page.
    """

    backend: str
    direction: str
    path: str
    seconds: float
    pages: int
    page_bytes: int

    @property
    def pages_per_s(self) -> float:
        """Pages moved per second."""
        return self.pages / self.seconds

    @property
    def mb_per_s(self) -> float:
        """Megabytes (10^6 bytes) moved per second."""
        return self.pages * self.page_bytes / self.seconds / 1e6


@dataclass(frozen=True)
class StorageBenchResult:
    """Throughputs of one run.

    Attributes:
        pages: Pages per backup and per prefetch.
        page_bytes: Bytes of one page.
        reps: Repetitions (the best is shown).
        rows: One row per backend, direction and path (:data:`PATHS`).
        backends: What each backend ran on, one line each.
        skipped: Why a backend did not run, one line each.
    """

    pages: int
    page_bytes: int
    reps: int
    rows: list[StorageRow]
    backends: list[str]
    skipped: list[str]

    def row(self, backend: str, direction: str, path: str) -> StorageRow:
        """Return the row of ``path`` for ``backend`` and ``direction``.

        Raises:
            KeyError: No such row (the backend was skipped).
        """
        for row in self.rows:
            if (row.backend, row.direction, row.path) == (backend, direction, path):
                return row
        raise KeyError(f"no row for {backend} {direction} {path}")

    def ratio(self, backend: str, direction: str, path: str, over: str) -> float:
        """Return the throughput of ``path`` over that of ``over`` (same backend and direction)."""
        row, base = self.row(backend, direction, path), self.row(backend, direction, over)
        return base.seconds / row.seconds

    def format(self) -> str:
        """Render the table: pages/s, MB/s, the cache over the store and raw I/O, the store over raw I/O."""
        total = self.pages * self.page_bytes / 2**20
        lines = [
            f"storage: {self.pages} pages of {self.page_bytes / 2**20:.2f} MiB ({total:,.1f} MiB) "
            f"per backup and per prefetch, best of {self.reps}, interleaved",
            *(f"  {line}" for line in self.backends),
            f"  {'':30}{'pages/s':>9}{'MB/s':>9}{'/ store':>10}{'/ raw I/O':>11}",
        ]
        for backend in dict.fromkeys(row.backend for row in self.rows):
            for direction in DIRECTIONS:
                for path in PATHS:
                    lines.append(self._line(backend, direction, path))
        lines += [f"  {line}" for line in self.skipped]
        return "\n".join(lines)

    def _line(self, backend: str, direction: str, path: str) -> str:
        row = self.row(backend, direction, path)
        label = f"{backend} {direction}" if path == PATHS[0] else ""
        name = {"store": "store.put" if direction == "backup" else "store.get"}.get(path, path)
        over_store = (
            f"{self.ratio(backend, direction, path, 'store'):.2f}x" if path == "HiCache" else ""
        )
        over_raw = (
            f"{self.ratio(backend, direction, path, 'raw I/O'):.2f}x" if path != "raw I/O" else ""
        )
        speed = f"{row.pages_per_s:9.1f}{row.mb_per_s:9.1f}"
        return f"  {label:20}{name:10}{speed}{over_store:>10}{over_raw:>11}".rstrip()


@dataclass(frozen=True)
class Workload:
    """The pages every path moves, their keys, and the bench caches' configuration.

    Attributes:
        config: The caches' configuration (pools of exactly ``len(pages)`` pages).
        tokens: The prompt: ``len(pages)`` whole pages of token ids.
        keys: The pages' keys, as the cache's storage tier computes them.
        pages: The pages as the host pool holds them (uint8), what every path
            writes and what every read is compared with.
        kv: The same bytes in the device pool's layout, written into the
            writer cache's device pages before its insert.
    """

    config: CacheConfig
    tokens: list[int]
    keys: list[str]
    pages: list[torch.Tensor]
    kv: torch.Tensor

    @classmethod
    def make(cls, pages: int, layers: int, heads: int) -> Workload:
        """Return ``pages`` pages of random bytes for a ``layers`` x ``heads`` bfloat16 cache."""
        config = CacheConfig(
            device_pages=pages,
            host_pages=pages,
            page_size=PAGE_SIZE,
            layers=layers,
            heads=heads,
            head_dim=HEAD_DIM,
            dtype="bfloat16",
            trail=False,
        )
        layout = config.layout()
        row = HEAD_DIM * layout.itemsize
        gen = torch.Generator().manual_seed(0)
        shape = (pages, layers, layout.planes, PAGE_SIZE, heads, row)
        data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        kv = data.permute(1, 2, 0, 3, 4, 5).reshape(
            layers, layout.planes, pages * PAGE_SIZE, heads, row
        )
        tokens = list(range(pages * PAGE_SIZE))
        keys = page_keys(Namespace.for_layout(MODEL, layout), tokens)
        return cls(config, tokens, keys, list(data.unbind(0)), kv.view(layout.dtype))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.pages[0].numel()

    def storage(self, store: Store) -> StorageConfig:
        """Return the storage tier of a bench cache: store after the host backup, wait for reads."""
        return StorageConfig(
            store,
            model=MODEL,
            prefetch_threshold=PAGE_SIZE,
            prefetch_policy="wait",
            prefetch_capacity=len(self.tokens),
            io_timeout=IO_TIMEOUT,
        )

    def check(self, where: str, got: Sequence[torch.Tensor]) -> None:
        """Raise :class:`CorruptPage` unless ``got`` holds every page, bit for bit.

        Args:
            where: The backend and path, for the message.
            got: The pages read back, in key order.
        """
        if len(got) != len(self.pages):
            key = self.keys[min(len(got), len(self.keys) - 1)]
            raise CorruptPage(where, key, f"{len(got)} of {len(self.pages)} pages came back")
        for index, (page, want) in enumerate(zip(got, self.pages, strict=True)):
            flat = page.contiguous().view(torch.uint8).reshape(-1)
            if flat.numel() != want.numel():
                problem = f"page {index} has {flat.numel()} bytes, not {want.numel()}"
                raise CorruptPage(where, self.keys[index], problem)
            differ = (flat != want.reshape(-1)).nonzero()
            if differ.numel():
                problem = (
                    f"page {index} differs from the page inserted, first at byte {int(differ[0])}"
                )
                raise CorruptPage(where, self.keys[index], problem)


class Backend(Protocol):
    """A store under test and the raw I/O of the same bytes beside it."""

    name: str
    store: Store

    def raw_put(self, work: Workload) -> None:
        """Write the workload's bytes without the store."""

    def raw_get(self, work: Workload) -> list[torch.Tensor]:
        """Read them back without the store."""

    def clear(self, work: Workload) -> None:
        """Remove every page any path wrote."""


class LocalBackend:
    """:class:`LocalFileStore` under ``scratch/store``, plain page files under ``scratch/raw``."""

    name = "local file"

    def __init__(self, scratch: Path) -> None:
        self.store: Store = LocalFileStore(scratch / "store")
        self.raw = scratch / "raw"
        self.raw.mkdir()

    def raw_put(self, work: Workload) -> None:
        """One file per page, written whole."""
        for key, page in zip(work.keys, work.pages, strict=True):
            with open(self.raw / key, "wb") as stream:
                stream.write(raw_bytes(page))

    def raw_get(self, work: Workload) -> list[torch.Tensor]:
        """Each file read into a preallocated tensor."""
        out = []
        for key, page in zip(work.keys, work.pages, strict=True):
            into = torch.empty_like(page)
            with open(self.raw / key, "rb") as stream:
                stream.readinto(raw_bytes(into))
            out.append(into)
        return out

    def clear(self, work: Workload) -> None:
        """Drop the store's pages and delete the plain files."""
        self.store.drop(work.keys)
        for key in work.keys:
            (self.raw / key).unlink(missing_ok=True)


class RedisBackend:
    """:class:`RedisStore` on ``client``, and pipelined ``SET``/``MGET`` of the same bytes."""

    name = "redis"

    def __init__(self, client: Any) -> None:
        from fsm_cache.storage import RedisStore

        self.client = client
        self.redis = RedisStore(client)
        self.store: Store = self.redis

    def _batches(self, work: Workload) -> list[range]:
        return list(self.redis.batches([page.numel() for page in work.pages]))

    def raw_put(self, work: Workload) -> None:
        """``SET`` each page's bytes, a pipeline per batch of the store's."""
        for batch in self._batches(work):
            pipe = self.client.pipeline(transaction=False)
            for index in batch:
                pipe.set(work.keys[index], raw_bytes(work.pages[index]))
            pipe.execute()

    def raw_get(self, work: Workload) -> list[torch.Tensor]:
        """``MGET`` each batch, each value copied into a tensor of the page's shape."""
        out = []
        for batch in self._batches(work):
            values = self.client.mget([work.keys[index] for index in batch])
            for index, value in zip(batch, values, strict=True):
                into = torch.empty_like(work.pages[index])
                raw_bytes(into)[:] = value
                out.append(into)
        return out

    def clear(self, work: Workload) -> None:
        """Delete the store's keys of the pages and the raw keys alike."""
        self.client.delete(*work.keys, *(self.redis.name(key) for key in work.keys))


COPIES_HELD = 8
"""About how many copies of the pages a storage bench holds at once: the workload and
its device layout, each cache's device and host pools, and the pages read back."""


def _check_fits(pages: int, page_bytes: int) -> None:
    """Refuse a bench whose pages cannot fit in the memory free now, before allocating any.

    Raises:
        ConfigError: :data:`COPIES_HELD` copies of the pages exceed the free memory.
    """
    need = pages * page_bytes * COPIES_HELD
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: let the allocator say
        return
    if need > free:
        raise ConfigError(
            f"bench storage: {pages} pages of {page_bytes / 2**20:.2f} MiB need about "
            f"{need / 2**30:.1f} GiB of memory ({COPIES_HELD} copies); {free / 2**30:.1f} GiB "
            "is free: pass fewer --pages"
        )


def run_storage_bench(
    quick: bool = False,
    reps: int | None = None,
    pages: int | None = None,
    *,
    layers: int | None = None,
    heads: int | None = None,
    redis: str = "auto",
) -> StorageBenchResult:
    """Measure backup and prefetch through HiCache against ``store.put``/``get`` and raw I/O.

    Args:
        quick: Small pages and few of them (smoke tests).
        reps: Repetitions (default 8, 2 with ``quick``); the best is kept.
        pages: Pages per backup and prefetch (default 64, 8 with ``quick``).
        layers: Layers of a page (default 32, 4 with ``quick``).
        heads: KV heads of a page (default 8, 2 with ``quick``); with 16
            tokens of 128 bfloat16 dims, the default page is 2 MiB.
        redis: ``auto`` (a real ``redis-server`` if on PATH, else fakeredis),
            ``server``, ``fake`` or ``off``.

    Raises:
        ConfigError: The pages would not fit in the memory free now.
        CorruptPage: A page read back (by any path) is not the page written.
        StoreFailed: A backup or prefetch did not move every page.
        ValueError: ``redis`` is not one of :data:`REDIS_MODES`.
    """
    if redis not in REDIS_MODES:
        raise ValueError(f"redis must be one of {', '.join(REDIS_MODES)}, got {redis!r}")
    reps = reps or (2 if quick else 8)
    pages = pages or (8 if quick else 64)
    layers, heads = layers or (4 if quick else 32), heads or (2 if quick else 8)
    _check_fits(pages, layers * 2 * PAGE_SIZE * heads * HEAD_DIM * 2)  # bfloat16 K and V
    work = Workload.make(pages, layers, heads)
    with (
        tempfile.TemporaryDirectory(prefix="fsm-bench-storage-") as scratch,
        contextlib.ExitStack() as stack,
    ):
        backends: list[Backend] = [LocalBackend(Path(scratch))]
        described = [f"local file: LocalFileStore under {tempfile.gettempdir()}"]
        skipped: list[str] = []
        try:
            found = _open_redis(redis, Path(scratch) / "redis", stack)
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            skipped.append(f"redis: skipped ({exc})")
        else:
            if found is not None:
                backends.append(RedisBackend(found[0]))
                described.append(f"redis: {found[1]}")
        runs = _Runs(work, stack)
        for rep in range(reps):
            for backend in backends:
                for path in PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]:
                    runs.run(path, backend)
    rows = [
        StorageRow(backend, direction, path, min(seconds), len(work.pages), work.page_bytes)
        for (backend, direction, path), seconds in runs.times.items()
    ]
    return StorageBenchResult(len(work.pages), work.page_bytes, reps, rows, described, skipped)


def _open_redis(mode: str, directory: Path, stack: contextlib.ExitStack) -> tuple[Any, str] | None:
    """Return a client of the Redis the mode asks for and a line saying what it is, or None.

    Raises:
        FileNotFoundError: ``server`` without a ``redis-server`` on PATH.
        ModuleNotFoundError: The ``redis`` package (or, for fakeredis, ``fakeredis``) is missing.
    """
    if mode == "off":
        return None
    from fsm_cache.testing.redis_server import RedisServer, redis_server_path

    if mode == "server" or (mode == "auto" and redis_server_path() is not None):
        server = stack.enter_context(RedisServer(directory))
        client = server.client()
        version = client.info("server")["redis_version"]
        return client, f"redis-server {version} on 127.0.0.1:{server.port} (a real server)"
    import fakeredis

    why = "" if mode == "fake" else ", no redis-server on PATH"
    return fakeredis.FakeRedis(), f"fakeredis {fakeredis.__version__} in process{why}"


Times = dict[tuple[str, str, str], list[float]]
"""Seconds of each repetition, by backend, direction and path."""


class _Runs:
    """The three paths over one workload, their times, and each backend's two caches.

    A backend's writer and reader caches are built once, their host pools
    touched before anything is timed (a running server's memory is mapped
    already), and reset after each repetition.
    """

    def __init__(self, work: Workload, stack: contextlib.ExitStack) -> None:
        self.work = work
        self.times: Times = {}
        self._stack = stack
        self._caches: dict[str, tuple[HiCache, HiCache]] = {}

    def run(self, path: str, backend: Backend) -> None:
        """Run ``path`` once on ``backend``, then remove every page it wrote."""
        runs = {"HiCache": self._through_cache, "store": self._through_store, "raw I/O": self._raw}
        runs[path](backend)
        backend.clear(self.work)

    def _record(self, backend: Backend, direction: str, path: str, seconds: float) -> None:
        self.times.setdefault((backend.name, direction, path), []).append(seconds)

    def _pair(self, backend: Backend) -> tuple[HiCache, HiCache]:
        pair = self._caches.get(backend.name)
        if pair is None:
            work, pages = self.work, range(len(self.work.pages))
            writer, reader = (
                self._stack.enter_context(HiCache(work.config, storage=work.storage(backend.store)))
                for _ in range(2)
            )
            for cache in (writer, reader):
                cache.tiers.host.fill(pages, 0)
            pair = self._caches[backend.name] = (writer, reader)
        return pair

    def _through_cache(self, backend: Backend) -> None:
        """Back the pages up through one cache, then prefetch them into the other."""
        work, (writer, reader) = self.work, self._pair(backend)
        try:
            slots = writer.alloc_slots(len(work.tokens))
            writer.tiers.device.write(pages_of(slots, PAGE_SIZE), work.kv)
            seconds, _ = _timed(lambda: _backup(writer, work, slots, backend.name))
            self._record(backend, "backup", "HiCache", seconds)
            held = backend.store.exists_prefix(work.keys)
            if held != len(work.keys):
                raise StoreFailed(
                    backend.name, "backup", acknowledged=held, total=len(work.keys), cause="lost"
                )
            seconds, found = _timed(lambda: reader.match_prefix(work.tokens))
            if found.host_len != len(work.tokens):
                done = found.host_len // PAGE_SIZE
                raise StoreFailed(
                    backend.name,
                    "prefetch",
                    acknowledged=done,
                    total=len(work.keys),
                    cause="not read",
                )
            path = reader.tree.walk(tuple(work.tokens)).path
            host = torch.tensor([p for node in path for p in node.host_pages], dtype=torch.long)
            work.check(
                f"{backend.name} prefetch through HiCache",
                list(reader.tiers.host.pages.index_select(0, host).unbind(0)),
            )
            self._record(backend, "prefetch", "HiCache", seconds)
        finally:
            writer.reset()
            reader.reset()

    def _through_store(self, backend: Backend) -> None:
        """``store.put`` the pages, then ``store.get`` them."""
        work, store = self.work, backend.store
        seconds, results = _timed(lambda: store.put(work.keys, work.pages))
        held = stored_prefix(results)
        if held != len(work.keys):
            raise StoreFailed(
                backend.name, "put", acknowledged=held, total=len(work.keys), cause="not stored"
            )
        self._record(backend, "backup", "store", seconds)
        seconds, got = _timed(lambda: store.get(work.keys))
        work.check(f"{backend.name} store.get", got)
        self._record(backend, "prefetch", "store", seconds)

    def _raw(self, backend: Backend) -> None:
        """Write the same bytes without the store, then read them back."""
        seconds, _ = _timed(lambda: backend.raw_put(self.work))
        self._record(backend, "backup", "raw I/O", seconds)
        seconds, got = _timed(lambda: backend.raw_get(self.work))
        self.work.check(f"{backend.name} raw read", got)
        self._record(backend, "prefetch", "raw I/O", seconds)


def _backup(cache: HiCache, work: Workload, slots: list[int], where: str) -> None:
    """Insert the pages and poll until every node is stored (the host backup first)."""
    tier = cache.storage
    if tier is None:
        raise ConfigError("bench storage: the cache has no storage tier")
    cache.insert(work.tokens, slots)
    deadline = time.monotonic() + IO_TIMEOUT
    while True:
        cache.poll()
        nodes = list(cache.tree)
        if nodes and all(node.storage == "stored" for node in nodes):
            return
        failed = dict(cache.counters.storage_failures)
        if failed or time.monotonic() > deadline:
            held = sum(len(n.key) for n in nodes if n.storage == "stored") // PAGE_SIZE
            cause = f"failures {failed}" if failed else f"not stored in {IO_TIMEOUT} s"
            raise StoreFailed(where, "backup", acknowledged=held, total=len(work.keys), cause=cause)
        for copy in list(tier.in_flight().values()):
            copy.done.wait(max(0.0, deadline - time.monotonic()))


def _timed(call: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result
