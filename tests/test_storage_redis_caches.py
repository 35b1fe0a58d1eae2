"""Two HiCache servers sharing KV through a real ``redis-server`` on 127.0.0.1.

One cache stores what it computed; another, with nothing cached, finds the
prefix by key and fetches it, bit for bit. A ``maxmemory`` LRU cap that drops
pages mid-prefix leaves the reader the surviving prefix only, and a server
killed in the middle of a store fails that store and loses nothing else.
Each test starts its own server; without ``redis-server`` on PATH they skip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.storage import RedisStore, page_keys
from fsm_cache.testing.redis_server import KillsServer, RedisServer, redis_server_path


pytestmark = [
    pytest.mark.redis_server,
    pytest.mark.skipif(
        redis_server_path() is None,
        reason="redis-server is not installed (make test installs it with .ci/system-deps)",
    ),
]

PAGE = 16
MODEL = "llama-3-8b@main"


def config() -> CacheConfig:
    """A CPU cache of 128 KiB pages (4 layers, 8 heads of 64, float16, 16 tokens a page)."""
    return CacheConfig(
        device_pages=32,
        host_pages=64,
        page_size=PAGE,
        layers=4,
        heads=8,
        head_dim=64,
        dtype="float16",
        device="cpu",
        debug=True,
        load_back_threshold=0,
    )


def cache_on(store: RedisStore, **overrides: Any) -> HiCache:
    settings: dict[str, Any] = {"model": MODEL, "threads": 0, "prefetch_policy": "wait"}
    settings.update(overrides)
    return HiCache(config(), storage=StorageConfig(store, prefetch_threshold=PAGE, **settings))


def tokens(pages: int, start: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def store_all(cache: HiCache, toks: Sequence[int]) -> None:
    """Insert ``toks`` and apply the host backup, then the storage backup."""
    cache.insert(toks)
    cache.poll()
    cache.poll()


def fetched_bit_exact(cache: HiCache, toks: Sequence[int], want_tokens: int) -> bool:
    """Look ``toks`` up (a prefetch waits for its read), load the host part, compare its KV."""
    found = cache.match_prefix(toks)
    if found.host_len != want_tokens or found.device_len:
        return False
    if want_tokens:
        assert cache.load_back(found.last_host_node) is not None
        cache.poll()
    found = cache.match_prefix(toks[:want_tokens])
    kv = cache.tiers.read_device(list(found.device_pages))
    return found.device_len == want_tokens and torch.equal(
        kv, synthetic_kv(cache.tiers.device.layout, toks[:want_tokens])
    )


def test_one_server_stores_and_another_fetches_the_prefix_bit_exact(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as server:
        writer = cache_on(RedisStore(server.client()))
        reader = cache_on(RedisStore(server.client()))
        toks = tokens(6, start=1000)
        store_all(writer, toks)
        assert [n.storage for n in writer.tree] == ["stored"]
        assert fetched_bit_exact(reader, toks + tokens(2, start=9000), 6 * PAGE)
        (node,) = reader.tree
        assert (node.storage, node.store_keys) == ("stored", next(iter(writer.tree)).store_keys)
        assert reader.stats().storage_pages == {"fetched": 6}
        writer.close()
        reader.close()


def test_an_lru_cap_that_drops_pages_mid_prefix_leaves_the_surviving_prefix(
    tmp_path: Path,
) -> None:
    """The reader gets the prefix up to the first page the cap dropped, and nothing past it.

    The server's LRU clock ticks once a second: the head of the prefix is read
    a tick after it was stored and the filler written a tick later, and the
    server samples every key, so the tail of the prefix is the least recently
    used and goes first.
    """
    with RedisServer(tmp_path / "redis", maxmemory=8 << 20, policy="allkeys-lru") as server:
        raw = server.client()
        raw.config_set("maxmemory-samples", 64)
        store = RedisStore(server.client(), batch_pages=4)
        writer = cache_on(store)
        toks = tokens(24, start=1000)  # 3 MiB of pages
        store_all(writer, toks)
        assert writer.storage is not None
        keys = page_keys(writer.storage.namespace(), toks)
        assert store.exists_prefix(keys) == 24
        time.sleep(1.1)
        store.get(keys[:8])  # the head of the prefix is now the more recently used
        time.sleep(1.1)
        filler, start = RedisStore(server.client(), batch_pages=4), 100_000
        while all(raw.exists(store.name(k)) for k in keys):  # fill until a page of it is dropped
            more = tokens(4, start=start)
            filler.put(page_keys(writer.storage.namespace(), more), filler_pages(4, start))
            start += 4 * PAGE
        present = [bool(raw.exists(store.name(k))) for k in keys]
        first_gap = present.index(False)
        assert 0 < first_gap < 24
        reader = cache_on(RedisStore(server.client()))
        assert fetched_bit_exact(reader, toks, first_gap * PAGE)
        assert reader.stats().storage_pages == {"fetched": first_gap}
        writer.close()
        reader.close()


def filler_pages(count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 255, (128 << 10,), dtype=torch.uint8, generator=gen) for _ in range(count)
    ]


def test_a_server_killed_mid_store_fails_the_store_and_loses_nothing_else(
    tmp_path: Path,
) -> None:
    """The store of the second prefix dies after its first batch: that batch stays acknowledged.

    The writer keeps every node and its local KV; a restarted server (its
    append-only file synced on every write) gives a second cache the first
    prefix whole and the acknowledged head of the second.
    """
    with RedisServer(tmp_path / "redis", durable=True) as server:
        killing = KillsServer(server.client(), server)
        writer = cache_on(RedisStore(killing, batch_pages=2))  # type: ignore[arg-type]
        first, second = tokens(4, start=1000), tokens(6, start=50_000)
        store_all(writer, first)
        writer.insert(second)
        killing.kill_at = killing.pipelines + 2  # the second batch of the next put
        writer.poll()  # the host copy lands; the store starts and the server dies under it
        writer.poll()
        head, rest = writer.tree.walk(tuple(second)).path
        assert [(len(n.key), n.storage, n.host, n.pins) for n in (head, rest)] == [
            (2 * PAGE, "stored", "backed", 0),
            (4 * PAGE, "unstored", "backed", 0),
        ]
        (acked,) = writer.log.storage_acks()[-1][1]
        assert acked == (2, "store", 2, "failed")
        assert writer.stats().storage_failures == {"store:failed": 1}
        for toks in (first, second):  # nothing else lost: every node and its KV is still here
            found = writer.match_prefix(toks)
            kv = writer.tiers.read_device(list(found.device_pages))
            assert found.device_len == len(toks)
            assert torch.equal(kv, synthetic_kv(writer.tiers.device.layout, toks))
        assert next(iter(writer.tree.walk(tuple(first)).path)).storage == "stored"

        server.start()
        reader = cache_on(RedisStore(server.client()))
        assert fetched_bit_exact(reader, first, 4 * PAGE)
        assert fetched_bit_exact(reader, second, 2 * PAGE)
        reader.close()
