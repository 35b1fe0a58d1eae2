"""HiCache's storage tier against pages that are stored but are not this cache's KV.

tests/test_cache_storage.py covers the tier at large; these are the faults a
review found in how the tier treats what a store gives back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
import torch

from fsm_cache.cache import storage_tier
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.storage_tier import StorageConfig, StoreResult
from fsm_cache.errors import CopyFailed, CorruptPage, InvariantViolation
from fsm_cache.memory.tiers import CacheConfig, synthetic_kv
from fsm_cache.storage import LocalFileStore, PutResult, RedisStore, Store


PAGE = 4


def cache(store: Store, prefetch_policy: str = "best_effort") -> HiCache:
    """A small checked CPU cache of 4-token pages over ``store``, copies run inline."""
    config = CacheConfig(
        device_pages=16,
        host_pages=32,
        page_size=PAGE,
        layers=1,
        heads=1,
        head_dim=4,
        device="cpu",
        debug=True,
        load_back_threshold=0,
    )
    tier = StorageConfig(
        store, model="test", threads=0, prefetch_threshold=PAGE, prefetch_policy=prefetch_policy
    )
    return HiCache(config, storage=tier)


def test_a_page_of_another_shape_is_dropped_like_a_torn_one(tmp_path: Path) -> None:
    """A page under the right key but of the wrong shape is dropped, not fetched at every lookup."""
    store = LocalFileStore(tmp_path)
    toks = list(range(1000, 1000 + 3 * PAGE))
    writer = cache(store)
    writer.insert(toks)
    writer.poll()  # the host backup lands: the store starts
    writer.poll()  # the store lands
    keys = list(writer.storage.keys_of(next(iter(writer.tree))))  # type: ignore[union-attr]
    flat = [page.reshape(-1) for page in store.get(keys)]  # the same bytes, another shape
    store.drop(keys)
    store.put(keys, flat)
    reader = cache(store, prefetch_policy="wait")
    assert reader.match_prefix(toks).host_len == 0
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 0, "corrupt"),))]
    assert store.exists_prefix(keys) == 0
    reader.match_prefix(toks)  # nothing stored: nothing fetched, nothing failed again
    assert dict(reader.stats().storage_failures) == {"fetch:corrupt": 1}


class NoDelete(fakeredis.FakeRedis):
    """A client whose ACL user may read and write pages but not delete them."""

    def delete(self, *names: Any) -> int:
        raise redis.exceptions.NoPermissionError(
            "NOPERM User reader has no permissions to run 'del'"
        )


def test_a_torn_page_the_store_cannot_drop_still_ends_the_prefix_before_it() -> None:
    """A drop the store refuses (a user without DEL, a read-only folder) keeps the intact prefix.

    The fetch failed whole when the drop raised: the pages before the torn one
    were thrown away too, and every later lookup fetched and failed again.
    """
    server = fakeredis.FakeServer()
    toks = list(range(1000, 1000 + 3 * PAGE))
    writer = cache(RedisStore(fakeredis.FakeRedis(server=server)))
    writer.insert(toks)
    writer.poll()  # the host backup lands: the store starts
    writer.poll()  # the store lands
    keys = list(writer.storage.keys_of(next(iter(writer.tree))))  # type: ignore[union-attr]
    raw = fakeredis.FakeRedis(server=server)
    name = f"fsm:page:{keys[1]}"
    raw.set(name, raw.get(name)[:-8])  # type: ignore[index]
    reader = cache(RedisStore(NoDelete(server=server)), prefetch_policy="wait")
    assert reader.match_prefix(toks).host_len == PAGE
    assert reader.log.storage_acks() == [("prefetch", ((1, "fetch", 1, "corrupt"),))]
    assert raw.exists(name)  # left for a read that may drop it
    assert reader.match_prefix(toks).host_len == PAGE  # the intact page stays cached


def stored(store: Store, toks: list[int]) -> list[str]:
    """Store ``toks``' pages through a writing cache; return their keys."""
    writer = cache(store)
    writer.insert(toks)
    writer.poll()  # the host backup lands: the store starts
    writer.poll()  # the store lands
    return list(writer.storage.keys_of(next(iter(writer.tree))))  # type: ignore[union-attr]


def fetched(reader: HiCache, toks: list[int]) -> list[tuple[int, str, str]]:
    """Look ``toks`` up, apply what was fetched, check the cache; return each node's state.

    Each node is (tokens, host state, storage state); the KV of every host
    prefix matched is loaded to the device and compared with what was written.
    """
    reader.match_prefix(toks)
    reader.poll()
    reader.check_invariants()
    assert reader.storage.idle()  # type: ignore[union-attr]
    found = reader.match_prefix(toks)
    if found.host_len:
        assert reader.load_back(found.last_host_node) is not None
        reader.poll()
        found = reader.match_prefix(toks)
    kv = reader.tiers.read_device(list(found.device_pages))
    assert torch.equal(kv, synthetic_kv(reader.tiers.device.layout, toks[: found.device_len]))
    return [(len(n.key), n.host, n.storage) for n in reader.tree]


@pytest.mark.parametrize("policy", ["best_effort", "wait"])
@pytest.mark.parametrize("wrong", ["half a page", "flat"])
def test_a_page_of_another_shape_before_a_torn_one_ends_the_prefix(
    tmp_path: Path, wrong: str, policy: str
) -> None:
    """The pages read again before a torn page are checked for shape and dtype too.

    They were not: a page of half a host page's shape (one of its two planes)
    was broadcast into the host page (wrong KV served for its tokens), and a
    flat page of the same bytes made the host write raise out of the poll
    (or of the waiting lookup), leaving two nodes reading with no copy in flight.
    """
    store = LocalFileStore(tmp_path)
    toks = list(range(1000, 1000 + 4 * PAGE))
    keys = stored(store, toks)
    page = store.get(keys[1:2])[0]
    store.drop(keys[1:2])
    store.put(keys[1:2], [page[:, :1].clone() if wrong == "half a page" else page.reshape(-1)])
    torn = store.path(keys[3])
    torn.write_bytes(torn.read_bytes()[:-8])
    reader = cache(store, prefetch_policy=policy)
    assert fetched(reader, toks) == [(PAGE, "backed", "stored")]  # as with no torn page
    origin = "prefetch" if policy == "wait" else "poll"
    assert reader.log.storage_acks()[0] == (origin, ((1, "fetch", 1, "corrupt"),))
    assert dict(reader.stats().storage_failures) == {"fetch:corrupt": 1}
    assert store.exists_prefix(keys) == 1  # the page of another shape was dropped
    assert reader.tiers.host.allocator.free_pages == 32 - 1


class NoDataPages(LocalFileStore):
    """A local store whose reads give pages with no data (on the meta device): copy_ raises."""

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        return [page.to("meta") for page in super().get(keys)]


def unwritten(reader: HiCache, toks: list[int], policy: str) -> CopyFailed:
    """Look ``toks`` up and apply the fetch, which raises; return its error, the cache checked.

    The fetch's nodes failed (nothing is left reading with no copy in flight)
    and were removed, their host pages freed.
    """
    if policy == "wait":
        with pytest.raises(CopyFailed) as failed:
            reader.match_prefix(toks)  # the lookup applies the fetch
    else:
        assert reader.match_prefix(toks).storage_len == len(toks)
        with pytest.raises(CopyFailed) as failed:
            reader.poll()
    reader.check_invariants()
    assert reader.storage.idle()  # type: ignore[union-attr]
    assert list(reader.tree) == []
    assert reader.tiers.host.allocator.free_pages == 32
    origin = "prefetch" if policy == "wait" else "poll"
    assert reader.log.storage_acks() == [(origin, ((1, "fetch", 0, "failed"),))]
    assert dict(reader.stats().storage_failures) == {"fetch:failed": 1}
    return failed.value


@pytest.mark.parametrize("policy", ["best_effort", "wait"])
def test_a_fetch_whose_pages_cannot_be_written_fails_its_nodes(tmp_path: Path, policy: str) -> None:
    """An error of torch's while writing fetched pages to the host fails the fetch, typed.

    It was raised as it came, after the copy had left the tier: its nodes
    stayed fetching and reading, with no copy in flight, for ever.
    """
    toks = list(range(1000, 1000 + 3 * PAGE))
    keys = stored(LocalFileStore(tmp_path), toks)
    store = NoDataPages(tmp_path)
    reader = cache(store, prefetch_policy=policy)
    error = unwritten(reader, toks, policy)
    cause = error.__cause__
    assert isinstance(cause, NotImplementedError)
    assert str(error) == (
        "storage: fetch 1: its pages could not be written to the host: "
        f"NotImplementedError: {cause}"
    )
    assert store.exists_prefix(keys) == 3  # the store is not at fault: its pages stay
    assert not reader.storage.backoff.closed  # type: ignore[union-attr]  # lookups ask it still


def test_close_finishes_when_a_fetch_it_applies_cannot_be_written(tmp_path: Path) -> None:
    """close() applies an unwritable fetch as failed, closes, then raises its error.

    It stopped at the error: the cache stayed open, its copy engine running.
    """
    toks = list(range(1000, 1000 + 3 * PAGE))
    stored(LocalFileStore(tmp_path), toks)
    reader = cache(NoDataPages(tmp_path))
    assert reader.match_prefix(toks).storage_len == len(toks)  # the fetch is in flight
    with pytest.raises(CopyFailed, match=r"^storage: fetch 1: its pages could not be written"):
        reader.close()
    assert reader.closed
    assert reader.tiers.closed
    assert reader.storage.idle()  # type: ignore[union-attr]
    assert list(reader.tree) == []
    assert reader.log.storage_acks() == [("wait", ((1, "fetch", 0, "failed"),))]
    reader.close()  # closed: nothing to do


@pytest.mark.parametrize("policy", ["best_effort", "wait"])
def test_the_host_write_never_broadcasts_a_page_of_another_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Should a read pass on a page of another shape, the host write refuses it.

    ``copy_`` broadcast a page of half a host page's shape into it: the fetch
    landed, and the cache served KV that is not its tokens'.
    """
    store = LocalFileStore(tmp_path)
    toks = list(range(1000, 1000 + 2 * PAGE))
    keys = stored(store, toks)
    page = store.get(keys[1:2])[0]
    store.drop(keys[1:2])
    store.put(keys[1:2], [page[:, :1].clone()])

    def unchecked(store: Store, keys: Sequence[str], shape: tuple[int, ...]) -> StoreResult:
        pages = store.get(keys)
        return StoreResult(len(pages), pages, "ok")

    monkeypatch.setattr(storage_tier, "_get", unchecked)
    error = unwritten(cache(store, prefetch_policy=policy), toks, policy)
    assert isinstance(error.__cause__, InvariantViolation)
    assert str(error) == (
        "storage: fetch 1: its pages could not be written to the host: InvariantViolation: "
        "storage: a fetch's pages do not fit the host: "
        "page 1 is torch.uint8 (1, 1, 4, 1, 8), not uint8 (1, 2, 4, 1, 8)"
    )


class PutAnswersMore(LocalFileStore):
    """A store whose put answers three results more than the pages it was given."""

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        return [*super().put(keys, pages), *[PutResult.STORED] * 3]


def test_a_put_answering_for_more_pages_than_given_fails_the_store(tmp_path: Path) -> None:
    """The extra results were counted as stored pages: the node was ``stored``, counted ``full``."""
    writer = cache(PutAnswersMore(tmp_path))
    writer.insert(list(range(8)))
    writer.poll()  # the host backup lands: the store starts
    writer.poll()  # the store's answer is applied
    assert [(n.host, n.storage, n.pins) for n in writer.tree] == [("backed", "unstored", 0)]
    assert writer.stats().storage_failures == {"store:failed": 1}
    assert writer.log.storage_acks() == [("poll", ((1, "store", 0, "failed"),))]


class GetAnswersMore(LocalFileStore):
    """A store whose get answers every page twice."""

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        pages = super().get(keys)
        return pages + pages


class RereadAnswersMore(LocalFileStore):
    """A store whose second page is torn, and whose read again before it answers every page twice."""

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        if len(keys) > 1:
            raise CorruptPage("here", keys[1], "torn")
        pages = super().get(keys)
        return pages + pages


@pytest.mark.parametrize(
    "store_class", [GetAnswersMore, RereadAnswersMore], ids=["first read", "read again"]
)
def test_a_get_answering_more_pages_than_keys_fails_the_fetch_as_the_stores(
    tmp_path: Path, store_class: type[LocalFileStore]
) -> None:
    """The extra pages made ``poll()`` raise CopyFailed, as if the host could not be written.

    The read again of the pages before a torn one is checked as the first read is.
    """
    stored(LocalFileStore(tmp_path), list(range(8)))
    reader = cache(store_class(tmp_path))
    assert reader.match_prefix(list(range(8))).storage_len == 8
    assert reader.poll() == 1
    assert reader.stats().storage_failures == {"fetch:failed": 1}
    assert list(reader.tree) == []  # the node the lookup found is gone with its failed fetch
    reader.check_invariants()
