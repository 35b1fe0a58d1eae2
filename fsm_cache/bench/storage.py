"""``fsm-cache bench storage``: pages through each store against raw I/O of the same bytes.

One run, the same pages: a prefix of host pages is put through
:class:`~fsm_cache.storage.LocalFileStore` and read back with ``get``, against
raw file I/O of the same bytes (one file per page, written whole, read into a
preallocated tensor); then through :class:`~fsm_cache.storage.RedisStore`
against raw pipelined ``SET``/``MGET`` of the same bytes in the same batches,
on a ``redis-server`` the bench starts on 127.0.0.1 (skipped without one).
What the store adds is its header, the temporary file and rename, the byte
accounting and holds, ``SET NX`` and the header check on read. Median of
several repetitions, interleaved (which goes first alternates); the figures are ratios of the same run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsm_cache.storage import LocalFileStore, Namespace, page_keys
from fsm_cache.storage.codec import raw_bytes


@dataclass(frozen=True)
class StorageRow:
    """One backend and direction: the store's throughput and the raw I/O's, in GB/s."""

    backend: str
    direction: str
    store_gbps: float
    raw_gbps: float


@dataclass(frozen=True)
class StorageBenchResult:
    """Throughputs of one run.

    Attributes:
        pages: Pages per put and per get.
        page_bytes: Bytes of one page.
        reps: Repetitions (the median is shown).
        rows: One row per backend and direction.
        skipped: Why a backend did not run, one line each.
    """

    pages: int
    page_bytes: int
    reps: int
    rows: list[StorageRow]
    skipped: list[str]

    def format(self) -> str:
        """Render the table with the store / raw ratios."""
        total = self.pages * self.page_bytes / 2**20
        lines = [
            f"storage: {self.pages} pages of {self.page_bytes / 2**20:.2f} MiB "
            f"({total:,.0f} MiB) per put and get, median of {self.reps}",
            f"  {'':18}{'store GB/s':>11}{'raw GB/s':>11}{'store / raw':>13}",
        ]
        for row in self.rows:
            ratio = row.store_gbps / row.raw_gbps
            lines.append(
                f"  {row.backend + ' ' + row.direction:18}{row.store_gbps:11.2f}"
                f"{row.raw_gbps:11.2f}{ratio:12.2f}x"
            )
        lines += [f"  {line}" for line in self.skipped]
        return "\n".join(lines)


def run_storage_bench(quick: bool = False, reps: int | None = None) -> StorageBenchResult:
    """Measure both stores against raw I/O of the same pages."""
    reps = reps or (2 if quick else 6)
    layers, heads = (4, 2) if quick else (32, 8)
    count = 8 if quick else 64
    gen = torch.Generator().manual_seed(0)
    pages = [
        torch.randn(layers, 2, 16, heads, 128, generator=gen).to(torch.bfloat16)
        for _ in range(count)
    ]
    namespace = Namespace("bench", f"layers={layers},heads={heads}", 16)
    keys = page_keys(namespace, list(range(16 * count)))
    nbytes = pages[0].numel() * pages[0].element_size()
    with tempfile.TemporaryDirectory(prefix="fsm-bench-storage-") as scratch:
        rows = _local(Path(scratch), keys, pages, reps)
        skipped: list[str] = []
        try:
            rows += _redis(Path(scratch) / "redis", keys, pages, reps)
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            skipped.append(f"redis: skipped ({exc})")
    return StorageBenchResult(count, nbytes, reps, rows, skipped)


def _local(
    scratch: Path, keys: list[str], pages: list[torch.Tensor], reps: int
) -> list[StorageRow]:
    """Put and get through a local store, and write and read the same bytes as plain files."""
    raw_dir = scratch / "raw"
    raw_dir.mkdir()
    store = LocalFileStore(scratch / "store")
    times: dict[str, list[float]] = {"put": [], "get": [], "raw put": [], "raw get": []}

    def through_store() -> None:
        times["put"].append(_time(lambda: store.put(keys, pages)))
        times["get"].append(_time(lambda: store.get(keys)))
        store.drop(keys)

    def raw() -> None:
        times["raw put"].append(_time(lambda: _raw_write(raw_dir, keys, pages)))
        times["raw get"].append(_time(lambda: _raw_read(raw_dir, keys, pages)))
        for key in keys:
            (raw_dir / key).unlink()

    _alternate(reps, through_store, raw)
    return _rows("local file", times, pages)


def _redis(
    directory: Path, keys: list[str], pages: list[torch.Tensor], reps: int
) -> list[StorageRow]:
    """Put and get through a Redis store, and SET and MGET the same bytes on the same server."""
    from fsm_cache.storage import RedisStore
    from fsm_cache.testing.redis_server import RedisServer

    times: dict[str, list[float]] = {"put": [], "get": [], "raw put": [], "raw get": []}
    with RedisServer(directory) as server:
        client = server.client()
        store = RedisStore(client)
        batches = list(store.batches([page.numel() * page.element_size() for page in pages]))

        def through_store() -> None:
            times["put"].append(_time(lambda: store.put(keys, pages)))
            times["get"].append(_time(lambda: store.get(keys)))
            client.flushdb()

        def raw() -> None:
            times["raw put"].append(_time(lambda: _raw_set(client, batches, keys, pages)))
            times["raw get"].append(_time(lambda: _raw_mget(client, batches, keys, pages)))
            client.flushdb()

        _alternate(reps, through_store, raw)
    return _rows("redis", times, pages)


def _raw_write(directory: Path, keys: list[str], pages: list[torch.Tensor]) -> None:
    for key, page in zip(keys, pages, strict=True):
        with open(directory / key, "wb") as stream:
            stream.write(raw_bytes(page))


def _raw_read(directory: Path, keys: list[str], pages: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for key, page in zip(keys, pages, strict=True):
        into = torch.empty(page.numel() * page.element_size(), dtype=torch.uint8)
        with open(directory / key, "rb") as stream:
            stream.readinto(raw_bytes(into))
        out.append(into.view(page.dtype).reshape(page.shape))
    return out


def _raw_set(client: Any, batches: list[range], keys: list[str], pages: list[torch.Tensor]) -> None:
    for batch in batches:
        pipe = client.pipeline(transaction=False)
        for index in batch:
            pipe.set(keys[index], raw_bytes(pages[index]))
        pipe.execute()


def _raw_mget(
    client: Any, batches: list[range], keys: list[str], pages: list[torch.Tensor]
) -> list[torch.Tensor]:
    out = []
    for batch in batches:
        values = client.mget([keys[index] for index in batch])
        for index, value in zip(batch, values, strict=True):
            page = pages[index]
            into = torch.empty(len(value), dtype=torch.uint8)
            raw_bytes(into)[:] = value
            out.append(into.view(page.dtype).reshape(page.shape))
    return out


def _rows(
    backend: str, times: dict[str, list[float]], pages: list[torch.Tensor]
) -> list[StorageRow]:
    total = sum(page.numel() * page.element_size() for page in pages) / 1e9
    rate = {name: total / statistics.median(seconds) for name, seconds in times.items()}
    return [
        StorageRow(backend, "put", rate["put"], rate["raw put"]),
        StorageRow(backend, "get", rate["get"], rate["raw get"]),
    ]


def _alternate(reps: int, first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run both ``reps`` times, interleaved, swapping which goes first each time."""
    for rep in range(reps):
        for run in (first, second) if rep % 2 == 0 else (second, first):
            run()


def _time(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start
