"""The shared store against a real ``redis-server`` on 127.0.0.1 (``make test`` installs it).

Each test starts its own server on a free loopback port and kills it at the
end. Without ``redis-server`` on PATH they skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from fsm_cache.errors import CorruptPage, StoreFailed
from fsm_cache.storage import Namespace, PutResult, RedisStore, page_keys
from fsm_cache.testing import redis_server
from fsm_cache.testing.redis_server import KillsServer, RedisServer, redis_server_path


pytestmark = [
    pytest.mark.redis_server,
    pytest.mark.skipif(
        redis_server_path() is None,
        reason="redis-server is not installed (make test installs it with .ci/system-deps)",
    ),
]

NS = Namespace("llama-3-8b@main", "layers=4,planes=2,heads=8,head_dim=64,dtype=bfloat16", 16)
S = PutResult.STORED


def pages_of(count: int, seed: int) -> list[torch.Tensor]:
    """Return ``count`` distinct 64 KiB host pages ``[layers, planes, page_size, heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 2, 16, 8, 64, generator=gen).to(torch.bfloat16) for _ in range(count)]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Whether the pages are bit for bit the same, shape and dtype included."""
    return len(got) == len(want) and all(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(got, want, strict=True)
    )


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server with no memory cap."""
    with RedisServer(tmp_path / "redis") as running:
        yield running


def test_a_port_taken_before_the_server_binds_it_is_left_for_a_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free port may be taken before the server binds it (``pytest -n 2``): it tries another.

    The server on the taken port exits; its start took the other server's answer
    for its own, and the test then used the other test's server.
    """
    with RedisServer(tmp_path / "first") as first:
        taken, free = [first.port], redis_server.free_port
        monkeypatch.setattr(redis_server, "free_port", lambda: taken.pop() if taken else free())
        with RedisServer(tmp_path / "second") as second:
            assert second.port != first.port
            second.client().set("whose", b"second")
            assert (first.client().get("whose"), second.client().get("whose")) == (None, b"second")


def test_two_clients_share_pages_bit_exact(server: RedisServer) -> None:
    """One server's store writes a prefix; another client's store discovers and fetches it."""
    writer, reader = RedisStore(server.client()), RedisStore(server.client())
    keys, pages = page_keys(NS, list(range(16 * 12))), pages_of(12, seed=1)
    assert reader.exists_prefix(keys) == 0
    assert writer.put(keys[:8], pages[:8]) == [S] * 8
    assert reader.exists_prefix(keys) == 8
    assert same(reader.get(keys), pages[:8])
    assert reader.put(keys, pages) == [PutResult.PRESENT] * 8 + [S] * 4
    assert same(writer.get(keys), pages)
    capacity = reader.capacity()
    assert capacity.used_bytes > 12 * pages[0].numel() * 2
    assert (capacity.limit_bytes, capacity.pages) == (None, None)


def test_a_key_of_another_type_reads_as_corrupt_on_a_real_server(server: RedisServer) -> None:
    """A real server's MGET answers nil for a list, as fakeredis does; TYPE tells them apart."""
    store = RedisStore(server.client())
    keys, pages = page_keys(NS, list(range(16 * 3))), pages_of(3, seed=2)
    store.put(keys[:1], pages[:1])
    server.client().rpush(store.name(keys[1]), b"not a page")
    assert store.exists_prefix(keys) == 2
    with pytest.raises(CorruptPage) as caught:
        store.get(keys)
    assert caught.value.problem == "a Redis list, not a page"
    assert store.drop([keys[1]]) == 1
    assert store.put(keys, pages) == [PutResult.PRESENT, S, S]
    assert same(store.get(keys), pages)


def test_a_put_overwrites_a_key_of_another_type_on_a_real_server(server: RedisServer) -> None:
    """A real server's SET NX leaves a list and answers nil: TYPE tells the put to replace it."""
    store = RedisStore(server.client())
    keys, pages = page_keys(NS, list(range(16 * 3))), pages_of(3, seed=3)
    store.put(keys[:1], pages[:1])
    server.client().rpush(store.name(keys[1]), b"not a page")
    assert store.put(keys, pages) == [PutResult.PRESENT, S, S]
    assert same(store.get(keys), pages)


def test_maxmemory_lru_drops_pages_and_the_prefix_shortens(tmp_path: Path) -> None:
    """Under a maxmemory cap the server evicts pages; a prefix counts and reads to its first gap.

    Which pages an approximated LRU evicts is the server's choice, so the test
    checks what holds whatever it chose: the old prefix is no longer whole,
    the count stops at its first missing page, a read returns exactly that many
    pages bit for bit, and every page still there reads whole (a value holds
    header and bytes together, so none is ever half evicted).
    """
    with RedisServer(tmp_path / "redis", maxmemory=8 << 20, policy="allkeys-lru") as server:
        store, raw = RedisStore(server.client(), batch_pages=4), server.client()
        old_keys, old_pages = page_keys(NS, list(range(16 * 24))), pages_of(24, seed=2)
        assert store.put(old_keys, old_pages) == [S] * 24
        assert store.exists_prefix(old_keys) == 24
        for start in range(1, 9):  # 192 more pages, 12 MiB, through an 8 MiB cap
            tokens = list(range(start * 10_000, start * 10_000 + 16 * 24))
            store.put(page_keys(NS, tokens), pages_of(24, seed=2 + start))
        present = [bool(raw.exists(store.name(key))) for key in old_keys]
        assert not all(present)
        first_gap = present.index(False)
        assert store.exists_prefix(old_keys) == first_gap
        assert same(store.get(old_keys), old_pages[:first_gap])
        survivors = [i for i, here in enumerate(present) if here]
        for i in survivors:
            assert same(store.get([old_keys[i]]), [old_pages[i]])
        assert store.capacity().limit_bytes == 8 << 20


def test_a_full_server_refuses_pages_and_the_put_stops(tmp_path: Path) -> None:
    """Under ``noeviction`` a full server refuses a page: FULL, and later batches are not sent."""
    with RedisServer(tmp_path / "redis", maxmemory=3 << 20, policy="noeviction") as server:
        store = RedisStore(server.client(), batch_pages=4)
        keys, pages = page_keys(NS, list(range(16 * 64))), pages_of(64, seed=20)
        results = store.put(keys, pages)
        stored = results.index(PutResult.FULL)
        assert 0 < stored < 64
        assert set(results[:stored]) == {S}
        sent = min(64, (stored // 4 + 1) * 4)  # the batch that met the cap was sent whole
        assert set(results[sent:]) == {PutResult.SKIPPED}
        assert store.exists_prefix(keys) == stored
        assert same(store.get(keys), pages[:stored])


def test_server_killed_mid_store_fails_it_and_loses_nothing_else(tmp_path: Path) -> None:
    """A server killed between a put's batches fails the put with StoreFailed.

    The server keeps an append-only file synced on every write, so once it is
    started again it holds every page it acknowledged: the earlier prefix
    whole, and of the failed put exactly the batch acknowledged before the kill.
    """
    with RedisServer(tmp_path / "redis", durable=True) as server:
        first_keys, first_pages = page_keys(NS, list(range(16 * 4))), pages_of(4, seed=10)
        keys, pages = page_keys(NS, list(range(50_000, 50_000 + 16 * 6))), pages_of(6, seed=11)
        writer = RedisStore(server.client(), batch_pages=2)
        assert writer.put(first_keys, first_pages) == [S] * 4
        killing = KillsServer(server.client(), server, kill_at=2)
        dying = RedisStore(killing, batch_pages=2)  # type: ignore[arg-type]
        with pytest.raises(StoreFailed) as caught:
            dying.put(keys, pages)
        failed = caught.value
        assert str(failed) == (
            f"redis 127.0.0.1:{server.port}: put failed after 2 of 6 pages: {failed.__cause__}"
        )
        assert (failed.operation, failed.acknowledged, failed.total) == ("put", 2, 6)
        assert isinstance(failed.__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(StoreFailed, match=f"^redis 127.0.0.1:{server.port}: exists failed"):
            writer.exists_prefix(first_keys)

        server.start()
        reader = RedisStore(server.client())
        assert reader.exists_prefix(first_keys) == 4
        assert same(reader.get(first_keys), first_pages)
        assert reader.exists_prefix(keys) == 2
        assert same(reader.get(keys), pages[:2])
        assert writer.put(keys, pages) == [PutResult.PRESENT] * 2 + [S] * 4
