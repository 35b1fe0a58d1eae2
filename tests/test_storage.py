"""The storage backends: chained keys, the page format, the byte budget, local files, Redis.

Redis here is fakeredis, in process; tests/test_storage_redis_server.py runs
the shared store against a real ``redis-server``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_cache.errors import (
    BadArgument,
    CorruptPage,
    LaterFormatPage,
    PageInUse,
    ReservationError,
    StorageError,
    StorageFull,
    StoreFailed,
)
from fsm_cache.memory.kv import KVLayout
from fsm_cache.storage import (
    Budget,
    Capacity,
    LocalFileStore,
    Namespace,
    PutResult,
    RedisStore,
    Store,
    codec,
    page_keys,
    stored_prefix,
)


NS = Namespace("llama-3-8b@main", "layers=2,planes=2,heads=2,head_dim=4,dtype=bfloat16", 4)
S, P, F = PutResult.STORED, PutResult.PRESENT, PutResult.FULL
K = PutResult.SKIPPED


def pages_of(count: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Return ``count`` distinct host pages ``[layers, planes, page_size, heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 4, 2, 4, generator=gen).to(dtype) for _ in range(count)]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Whether the pages are bit for bit the same, shape and dtype included."""
    return len(got) == len(want) and all(
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(got, want, strict=True)
    )


def page_bytes(key: str, page: torch.Tensor) -> int:
    """Return what one stored page takes (header and bytes)."""
    return len(codec.encode(key, page))


# ---------------------------------------------------------------- keys


def test_keys_chain_sglangs_digest_from_the_namespace_root() -> None:
    """Each key is sha256(parent key || tokens as uint32 LE), the first chained from the root."""
    tokens = list(range(8))
    first, second = page_keys(NS, tokens)
    root = bytes.fromhex(NS.root())
    assert first == hashlib.sha256(root + struct.pack("<4I", 0, 1, 2, 3)).hexdigest()
    assert (
        second == hashlib.sha256(bytes.fromhex(first) + struct.pack("<4I", 4, 5, 6, 7)).hexdigest()
    )
    assert page_keys(NS, tokens[4:], parent=first) == [second]


def test_a_key_names_its_whole_prefix() -> None:
    """The same page after different prefixes has different keys; shared prefixes share keys."""
    a = page_keys(NS, [1, 2, 3, 4, 9, 9, 9, 9])
    b = page_keys(NS, [1, 2, 3, 5, 9, 9, 9, 9])
    c = page_keys(NS, [1, 2, 3, 4, 9, 9, 9, 8])
    assert (a[0] == b[0], a[1] == b[1]) == (False, False)
    assert (a[0] == c[0], a[1] == c[1]) == (True, False)


@pytest.mark.parametrize(
    "other",
    [
        Namespace("llama-3-8b@v2", NS.layout, 4),
        Namespace(NS.model, "layers=2,planes=1,heads=1,head_dim=4,dtype=bfloat16", 4),
        Namespace(NS.model, NS.layout, 4, rank=1, ranks=2),
        Namespace(NS.model, NS.layout, 4, rank=0, ranks=2),
    ],
)
def test_namespaces_never_share_keys(other: Namespace) -> None:
    """Another model, layout or rank starts another chain."""
    assert page_keys(other, [1, 2, 3, 4]) != page_keys(NS, [1, 2, 3, 4])


def test_page_size_is_part_of_the_namespace() -> None:
    """The same tokens paged by 2 or by 4 never share a key."""
    two = Namespace(NS.model, NS.layout, 2)
    assert set(page_keys(two, [1, 2, 3, 4])).isdisjoint(page_keys(NS, [1, 2, 3, 4]))


def test_namespace_for_layout() -> None:
    """A KV layout names its shape and dtype, and brings its page size."""
    layout = KVLayout(layers=32, heads=8, head_dim=128, dtype=torch.float16, page_size=16)
    ns = Namespace.for_layout("m", layout, rank=3, ranks=4)
    assert ns == Namespace("m", "layers=32,planes=2,heads=8,head_dim=128,dtype=float16", 16, 3, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: page_keys(NS, [1, 2, 3]), "3 tokens is not a whole number of pages of 4"),
        (
            lambda: page_keys(NS, [1, 2, 3, -1]),
            "token -1 at 3 does not fit an unsigned 32-bit integer",
        ),
        (
            lambda: page_keys(NS, [1, 2, 3, 2**32]),
            "token 4294967296 at 3 does not fit an unsigned 32-bit integer",
        ),
        (
            lambda: page_keys(NS, [1, 2, 3, 4], parent="ab"),
            "key 0 is not a page key (64 lowercase hex digits): 'ab'",
        ),
        (lambda: Namespace("m", "l", 0), "page_size must be at least 1, not 0"),
        (lambda: Namespace("m", "l", 4, rank=2, ranks=2), "rank 2 is outside a group of 2"),
    ],
)
def test_bad_key_arguments_are_refused(call: object, message: str) -> None:
    """Keys refuse what they cannot key, with a typed error that says why."""
    with pytest.raises(BadArgument) as caught:
        call()  # type: ignore[operator]
    assert str(caught.value) == message


def test_no_tokens_no_keys() -> None:
    """An empty sequence has no pages."""
    assert page_keys(NS, []) == []


# ---------------------------------------------------------------- page format


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]
)
def test_codec_round_trips_every_dtype_bit_for_bit(dtype: torch.dtype) -> None:
    """A page's bytes, shape and dtype come back exactly."""
    page = pages_of(1, dtype=dtype)[0]
    key = page_keys(NS, [1, 2, 3, 4])[0]
    assert same([codec.decode("here", key, codec.encode(key, page))], [page])


def test_codec_copies_a_strided_page() -> None:
    """A non-contiguous page is stored as its logical content."""
    page = pages_of(1)[0].transpose(0, 4)
    key = page_keys(NS, [1, 2, 3, 4])[0]
    assert same([codec.decode("here", key, codec.encode(key, page))], [page.contiguous()])


def test_codec_refuses_foreign_torn_and_misnamed_values() -> None:
    """Each way a value can fail to be the page its key names is a CorruptPage saying which."""
    one, two = page_keys(NS, list(range(8)))
    value = codec.encode(one, pages_of(1)[0])
    cases = {
        b"hello": "no page header",
        value[:-1]: "255 bytes after a header of 256",
        value + b"x": "257 bytes after a header of 256",
        value[:12] + b"!" + value[13:]: "unreadable page header",
    }
    for bad, problem in cases.items():
        with pytest.raises(CorruptPage) as caught:
            codec.decode("there", one, bad)
        assert str(caught.value) == f"there: not a valid page {one[:12]}: {problem}"
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", two, value)
    assert str(caught.value) == f"there: not a valid page {two[:12]}: header names page {one[:12]}"
    lying = value.replace(b'"shape":[2,2,4,2,4]', b'"shape":[2,2,4,2,5]')
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", one, lying)
    assert caught.value.problem == "header's bfloat16 [2, 2, 4, 2, 5] does not make 256 bytes"


def test_put_arguments_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    """Bad pages are refused with BadArgument and the store is untouched."""
    store = LocalFileStore(tmp_path)
    keys = page_keys(NS, list(range(8)))
    cases = [
        (keys, pages_of(1), "2 keys for 1 pages"),
        (keys, [pages_of(1)[0], "page"], "page 1 is a str, not a torch.Tensor"),
        (keys, [pages_of(1)[0], torch.empty(0)], "page 1 is empty (shape [0])"),
        (
            [keys[0], "../x"],
            pages_of(2),
            "key 1 is not a page key (64 lowercase hex digits): '../x'",
        ),
    ]
    for bad_keys, bad_pages, message in cases:
        with pytest.raises(BadArgument) as caught:
            store.put(bad_keys, bad_pages)  # type: ignore[arg-type]
        assert str(caught.value) == message
    assert store.exists_prefix(keys) == 0
    assert store.capacity() == Capacity(0, 0, None, 0)


# ---------------------------------------------------------------- budget


def test_budget_reserve_commit_abort() -> None:
    """Reservations count until settled; a commit counts as used, an abort gives back."""
    budget = Budget("disk", 100)
    first, second = budget.reserve(60), budget.reserve(40)
    assert (budget.reserved_bytes, budget.free()) == (100, 0)
    budget.commit(first)
    budget.abort(second)
    assert (budget.used_bytes, budget.reserved_bytes, budget.free()) == (60, 0, 40)


def test_budget_refuses_what_does_not_fit_and_changes_nothing() -> None:
    """A reservation over the free bytes is StorageFull, with nothing reserved."""
    budget = Budget("disk", 100)
    budget.reserve(70)
    with pytest.raises(StorageFull) as caught:
        budget.reserve(31)
    assert str(caught.value) == "disk: cannot reserve 31 bytes, 30 free"
    assert (budget.reserved_bytes, caught.value.requested, caught.value.free) == (70, 31, 30)


@pytest.mark.parametrize(
    ("first", "second"), [("commit", "abort"), ("abort", "commit"), ("commit", "commit")]
)
def test_a_reservation_settles_once(first: str, second: str) -> None:
    """Settling twice is a ReservationError and counts nothing twice."""
    budget = Budget("disk", None)
    reservation = budget.reserve(10)
    getattr(budget, first)(reservation)
    used = budget.used_bytes
    with pytest.raises(ReservationError) as caught:
        getattr(budget, second)(reservation)
    done = "committed" if first == "commit" else "aborted"
    want = "committed" if second == "commit" else "aborted"
    assert str(caught.value) == f"disk: reservation 1 (10 bytes) cannot be {want}: already {done}"
    assert (budget.used_bytes, budget.reserved_bytes) == (used, 0)


# ---------------------------------------------------------------- both backends, one contract


@pytest.fixture(params=["local", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each backend, empty."""
    if request.param == "local":
        return LocalFileStore(tmp_path / "pages")
    return RedisStore(fakeredis.FakeRedis(), batch_pages=3)


def test_a_stored_prefix_reads_back_bit_exact(store: Store) -> None:
    """Put, count, get: the pages come back exactly, in order."""
    keys, pages = page_keys(NS, list(range(28))), pages_of(7)
    assert store.put(keys, pages) == [S] * 7
    assert store.exists_prefix(keys) == 7
    assert same(store.get(keys), pages)
    assert same(store.get(keys[2:5]), pages[2:5])


def test_a_second_writer_finds_the_pages_present(store: Store) -> None:
    """Content addressing: writing the same prefix again writes nothing."""
    keys, pages = page_keys(NS, list(range(16))), pages_of(4)
    store.put(keys[:2], pages[:2])
    assert store.put(keys, pages) == [P, P, S, S]
    assert stored_prefix([P, P, S, S]) == 4


def test_a_missing_page_ends_the_prefix(store: Store) -> None:
    """Drop a middle page: the count and the read stop before it; later pages are not read."""
    keys, pages = page_keys(NS, list(range(24))), pages_of(6)
    store.put(keys, pages)
    assert store.drop([keys[3]]) == 1
    assert store.exists_prefix(keys) == 3
    assert same(store.get(keys), pages[:3])
    assert store.exists_prefix(keys[4:]) == 2
    assert store.drop(keys) == 5
    assert store.drop(keys) == 0
    assert (store.exists_prefix(keys), store.get(keys)) == (0, [])


def test_every_call_checks_its_keys_first(store: Store) -> None:
    """A bad key anywhere refuses the whole call before the store is asked anything."""
    keys = page_keys(NS, list(range(8)))
    store.put(keys, pages_of(2))
    bad = [keys[0], keys[1].upper()]
    for call in (store.exists_prefix, store.get, store.drop):
        with pytest.raises(BadArgument, match=r"^key 1 is not a page key"):
            call(bad)
    assert store.exists_prefix(keys) == 2


# ---------------------------------------------------------------- local files


def test_local_pages_are_files_named_by_key(tmp_path: Path) -> None:
    """One file per page, no temporary file left, and a new store over the directory finds them."""
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    LocalFileStore(tmp_path).put(keys, pages)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(f"{k[:2]}/{k}.page" for k in keys)
    again = LocalFileStore(tmp_path)
    size = page_bytes(keys[0], pages[0])
    assert again.capacity() == Capacity(3 * size, 0, None, 3)
    assert same(again.get(keys), pages)


def test_a_relative_root_stays_where_the_store_was_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative root was looked up afresh at each call: a ``chdir`` moved the store.

    Its pages then read as missing, and a folder of the same name under the
    new working directory took its writes, unchecked.
    """
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    opened, elsewhere = tmp_path / "opened", tmp_path / "elsewhere"
    opened.mkdir()
    (elsewhere / "kv" / ".tmp").mkdir(parents=True)
    monkeypatch.chdir(opened)
    store = LocalFileStore("kv")
    assert store.root == opened / "kv"
    store.put(keys[:1], pages[:1])
    monkeypatch.chdir(elsewhere)
    assert store.exists_prefix(keys[:1]) == 1
    store.put(keys[1:], pages[1:])
    assert store.exists_prefix(keys) == 2
    assert not [p for p in (elsewhere / "kv").rglob("*") if p.is_file()]


def test_local_temporary_files_of_a_crashed_writer_are_deleted_at_open(tmp_path: Path) -> None:
    """A writer killed mid-page leaves its temporary file; the next store over the directory
    deletes it, and leaves alone those of live writers, of other hosts and of unknown form."""
    crash = (
        "import os, sys, torch\n"
        "from fsm_cache.storage import codec\n"
        "from fsm_cache.storage.keys import Namespace, page_keys\n"
        "from fsm_cache.storage.local import LocalFileStore\n"
        "store = LocalFileStore(sys.argv[1])\n"
        "def dies(fd, key, page):\n"
        "    os.write(fd, b'part of a page')\n"
        "    os._exit(9)\n"
        "codec.write = dies\n"
        "key = page_keys(Namespace('m', 'l', 4), list(range(4)))\n"
        "store.put(key, [torch.zeros(2)])\n"
    )
    done = subprocess.run([sys.executable, "-c", crash, str(tmp_path)], check=False)
    assert done.returncode == 9
    (left,) = (tmp_path / ".tmp").iterdir()
    host, pid = left.name.split(".")[1:3]
    assert int(pid) != os.getpid()
    key = left.name.split(".")[0]
    kept = [
        f"{key}.{host}.{os.getpid()}.1.tmp",  # a live writer: this process
        f"{key}.elsewhere.{pid}.1.tmp",  # another host's process of the same number
        f"{key}.{pid}.1.tmp",  # a name without a host
    ]
    for name in kept:
        (tmp_path / ".tmp" / name).write_bytes(b"x")
    store = LocalFileStore(tmp_path)
    assert store.reaped == 1
    assert sorted(p.name for p in (tmp_path / ".tmp").iterdir()) == sorted(kept)
    assert store.capacity().pages == 0
    assert LocalFileStore(tmp_path).reaped == 0


def test_local_pages_written_by_another_process_are_found(tmp_path: Path) -> None:
    """Two stores over one directory: one writes, the other discovers, reads, and counts it."""
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    reader, writer = LocalFileStore(tmp_path), LocalFileStore(tmp_path)
    writer.put(keys, pages)
    assert reader.capacity().pages == 0
    assert reader.exists_prefix(keys) == 2
    assert reader.capacity().pages == 2
    assert same(reader.get(keys), pages)
    writer.drop(keys[1:])
    assert (reader.exists_prefix(keys), reader.capacity().pages) == (1, 1)


def test_local_a_prefix_another_process_dropped_is_forgotten_whole(tmp_path: Path) -> None:
    """A get or an exists_prefix that misses a page forgets every counted page whose file is gone."""
    keys, pages = page_keys(NS, list(range(16))), pages_of(4)
    reader, writer = LocalFileStore(tmp_path), LocalFileStore(tmp_path)
    writer.put(keys, pages)
    assert reader.exists_prefix(keys) == 4
    writer.drop(keys)
    assert reader.get(keys) == []
    assert reader.capacity() == Capacity(0, 0, None, 0)
    writer.put(keys, pages)
    assert reader.exists_prefix(keys) == 4
    writer.drop(keys[:2])
    writer.drop(keys[3:])
    assert reader.exists_prefix(keys) == 0
    assert reader.capacity().pages == 1  # the third page is still on disk


def test_local_pages_another_process_dropped_make_no_room_by_evicting(tmp_path: Path) -> None:
    """Pages counted but gone from the disk never make a put evict a page still stored."""
    keys, pages = page_keys(NS, list(range(16))), pages_of(5)
    other = page_keys(NS, list(range(100, 104)))
    writer = LocalFileStore(tmp_path)
    writer.put(keys[:1], pages[:1])
    size = writer.capacity().used_bytes
    writer.drop(keys[:1])
    reader = LocalFileStore(tmp_path, limit_bytes=4 * size)
    assert reader.put(other, pages[4:]) == [S]
    writer.put(keys, pages[:4])
    assert reader.exists_prefix(keys) == 4
    writer.drop(keys)
    reader.get(keys)
    assert reader.put(keys[:1], pages[:1]) == [S]
    assert reader.exists_prefix(other) == 1


def test_local_torn_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    """A file cut short or holding another page is a CorruptPage naming the file."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys, pages)
    path = store.path(keys[1])
    data = path.read_bytes()
    header = len(codec.header(keys[1], pages[1]))
    for cut, problem in [
        (header + 100, "100 bytes after a header of 256"),
        (40, f"header cut short: 28 of {header - 12} bytes"),
    ]:
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptPage) as caught:
            store.get(keys)
        assert str(caught.value) == f"{path}: not a valid page {keys[1][:12]}: {problem}"
    path.write_bytes(store.path(keys[0]).read_bytes())
    with pytest.raises(CorruptPage, match=f"header names page {keys[0][:12]}$"):
        store.get(keys)
    assert same(store.get(keys[:1]), pages[:1])


def test_local_capacity_evicts_least_recent_unread_pages(tmp_path: Path) -> None:
    """Past the limit, the least recently used pages go, a prefix's tail before its head."""
    a_keys, a_pages = page_keys(NS, list(range(16))), pages_of(4, seed=1)
    b_keys, b_pages = page_keys(NS, list(range(100, 116))), pages_of(4, seed=2)
    size = page_bytes(a_keys[0], a_pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=6 * size)
    store.put(a_keys, a_pages)
    assert store.put(b_keys, b_pages) == [S] * 4
    assert store.exists_prefix(a_keys) == 2
    assert store.exists_prefix(b_keys) == 4
    assert store.capacity() == Capacity(6 * size, 0, 6 * size, 6)


def test_local_eviction_refuses_pages_a_read_holds(tmp_path: Path) -> None:
    """Held pages are neither evicted nor dropped: the put finds no room, the drop is refused."""
    keys, pages = page_keys(NS, list(range(24))), pages_of(6)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=4 * size)
    store.put(keys[:4], pages[:4])
    with store.reading(keys) as held:
        assert held == 4
        assert store.put(keys[4:], pages[4:]) == [F, K]
        with pytest.raises(PageInUse) as caught:
            store.drop([keys[5], keys[2]])
        assert str(caught.value) == f"page {keys[2][:12]}: drop refused: held by 1 read(s)"
        assert store.exists_prefix(keys) == 4
    assert store.capacity() == Capacity(4 * size, 0, 4 * size, 4)
    assert store.put(keys[4:], pages[4:]) == [S, S]
    # the prefix's head was the most recently used, so the eviction took its tail
    assert (store.exists_prefix(keys), store.exists_prefix(keys[4:])) == (2, 2)


def test_local_a_put_never_evicts_its_own_prefix(tmp_path: Path) -> None:
    """Room for 3 pages, a put of 4: the fourth is FULL, the first three stay."""
    keys, pages = page_keys(NS, list(range(16))), pages_of(4)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=3 * size)
    assert store.put(keys, pages) == [S, S, S, F]
    assert store.exists_prefix(keys) == 3


def test_local_a_page_larger_than_the_limit_evicts_nothing(tmp_path: Path) -> None:
    """What can never fit is FULL at once; no page is evicted for it."""
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=size + 10)
    store.put(keys[:1], pages[:1])
    big = torch.zeros(1024, dtype=torch.uint8)
    assert store.put(keys[1:], [big]) == [F]
    assert store.exists_prefix(keys) == 1


def test_local_a_failed_write_leaves_no_file_and_no_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error mid-put is StoreFailed; the pages before it stay, nothing else is left."""
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    store = LocalFileStore(tmp_path, limit_bytes=1 << 20)
    real = os.replace
    calls = []

    def failing(src: str, dst: str, **folders: int) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst, **folders)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(StoreFailed) as caught:
        store.put(keys, pages)
    assert str(caught.value) == (
        f"local {tmp_path}: put failed after 1 of 3 pages: OSError: [Errno 28] No space left on device"
    )
    assert caught.value.acknowledged == 1
    assert list((tmp_path / ".tmp").iterdir()) == []
    size = page_bytes(keys[0], pages[0])
    assert store.capacity() == Capacity(size, 0, 1 << 20, 1)
    monkeypatch.setattr(os, "replace", real)
    assert store.put(keys, pages) == [P, S, S]


def test_local_durable_writes_sync_the_page_then_its_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """durable=True fsyncs each page file, then its shard (the rename) and, once, the root."""
    synced: list[object] = []

    def spy(fd: int) -> None:
        info = os.fstat(fd)
        synced.append(info.st_ino if stat.S_ISDIR(info.st_mode) else "file")

    store = LocalFileStore(tmp_path, durable=True)
    keys = page_keys(NS, list(range(12)))
    monkeypatch.setattr(os, "fsync", spy)
    store.put(keys[:2], pages_of(2))
    root, first, second = (
        os.stat(p).st_ino for p in [tmp_path, *(store.path(k).parent for k in keys[:2])]
    )
    assert synced == ["file", root, first, "file", root, second]
    synced.clear()
    store.drop(keys[:1])
    store.put(keys, pages_of(3))  # the first shard's entry in the root is synced already
    assert synced == ["file", first, "file", root, os.stat(store.path(keys[2]).parent).st_ino]


def test_local_ignores_what_is_not_a_page_file(tmp_path: Path) -> None:
    """Stray files in the directory are neither indexed nor counted."""
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.page").write_text("x")
    (tmp_path / "README").write_text("x")
    assert LocalFileStore(tmp_path).capacity() == Capacity(0, 0, None, 0)


# ---------------------------------------------------------------- Redis (fakeredis)


def fake(**options: object) -> tuple[fakeredis.FakeServer, RedisStore]:
    """Return a fake server and a store on it that reports itself as 127.0.0.1:6399."""
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server, host="127.0.0.1", port=6399)
    return server, RedisStore(client, **options)  # type: ignore[arg-type]


def test_redis_one_value_per_page_under_the_prefix() -> None:
    """Each page is one key holding header and bytes; nothing else is written."""
    server, store = fake()
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys, pages)
    raw = fakeredis.FakeRedis(server=server)
    assert sorted(raw.keys()) == sorted(f"fsm:page:{k}".encode() for k in keys)
    assert raw.get(f"fsm:page:{keys[0]}") == codec.encode(keys[0], pages[0])


def test_redis_set_nx_keeps_the_first_writer() -> None:
    """Two clients store the same prefix: the second writes nothing."""
    server, first = fake()
    second = RedisStore(fakeredis.FakeRedis(server=server))
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    assert first.put(keys[:2], pages[:2]) == [S, S]
    assert second.put(keys, pages) == [P, P, S]
    assert same(first.get(keys), pages)


def test_redis_batches_split_by_pages_and_bytes() -> None:
    """Round trips carry at most batch_pages pages and about batch_bytes bytes."""
    _, store = fake(batch_pages=2, batch_bytes=600)
    assert [list(r) for r in store.batches([256] * 5)] == [[0, 1], [2, 3], [4]]
    _, store = fake(batch_pages=8, batch_bytes=600)
    assert [list(r) for r in store.batches([256] * 5)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in store.batches([1000, 1])] == [[0], [1]]
    with pytest.raises(BadArgument) as caught:
        fake(batch_pages=0)
    assert str(caught.value) == "batch_pages must be at least 1, not 0"


def test_redis_a_corrupt_value_is_a_clear_error() -> None:
    """A value that is not the page its key names is a CorruptPage naming the Redis key."""
    server, store = fake()
    keys = page_keys(NS, list(range(8)))
    store.put(keys, pages_of(2))
    fakeredis.FakeRedis(server=server).set(f"fsm:page:{keys[1]}", codec.MAGIC + b"\x05\0\0\0{oops")
    with pytest.raises(CorruptPage) as caught:
        store.get(keys)
    where = f"redis 127.0.0.1:6399 fsm:page:{keys[1]}"
    assert str(caught.value) == f"{where}: not a valid page {keys[1][:12]}: unreadable page header"


def test_redis_a_key_of_another_type_is_corrupt_once_not_missing_again_and_again() -> None:
    """EXISTS counts a hash under a page's name and MGET reads it as nil: say what it is."""
    server, store = fake()
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    store.put(keys[:1], pages[:1])
    fakeredis.FakeRedis(server=server).hset(f"fsm:page:{keys[1]}", "field", "value")
    assert store.exists_prefix(keys) == 2
    with pytest.raises(CorruptPage) as caught:
        store.get(keys)
    where = f"redis 127.0.0.1:6399 fsm:page:{keys[1]}"
    assert (
        str(caught.value) == f"{where}: not a valid page {keys[1][:12]}: a Redis hash, not a page"
    )
    assert caught.value.key == keys[1]
    assert store.drop([keys[1]]) == 1  # what a cache does with a corrupt page: once
    assert store.exists_prefix(keys) == 1
    assert store.put(keys, pages) == [P, S, S]
    assert same(store.get(keys), pages)


class CountingClient(fakeredis.FakeRedis):
    """A client that counts its pipelines' round trips."""

    trips = 0

    def pipeline(self, transaction: bool = True, shard_hint: object = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        executor = pipe.execute

        def execute(raise_on_error: bool = True) -> list[object]:
            self.trips += 1
            answers: list[object] = executor(raise_on_error)
            return answers

        setattr(pipe, "execute", execute)  # noqa: B010 (a method of the instance, for this test)
        return pipe


def test_redis_a_put_replaces_a_key_of_another_type_instead_of_calling_it_present() -> None:
    """SET NX leaves a hash and answers as if the page were there: the put overwrites it.

    The put asks each key's TYPE in the SET NX's own round trip; only a key of
    another type costs one more, to overwrite it.
    """
    client = CountingClient(host="127.0.0.1", port=6399)
    store = RedisStore(client)
    keys, pages = page_keys(NS, list(range(16))), pages_of(4)
    assert store.put(keys[:1], pages[:1]) == [S]
    assert store.put(keys[:3], pages[:3]) == [P, S, S]
    assert client.trips == 2  # one round trip a batch, PRESENT pages included
    client.hset(store.name(keys[3]), "field", "value")
    assert store.put(keys, pages) == [P, P, P, S]
    assert client.trips == 4
    assert same(store.get(keys), pages)


def test_redis_a_key_of_another_type_a_full_server_cannot_replace_is_full() -> None:
    """The overwrite of a key of another type refused for memory is FULL; later batches are not sent."""
    client = OneRefusedClient()
    store = RedisStore(client, batch_pages=2)
    keys, pages = page_keys(NS, list(range(16))), pages_of(4)
    client.hset(store.name(keys[1]), "field", "value")
    client.refuse, client.overwrites_only = store.name(keys[1]), True
    assert store.put(keys, pages) == [S, F, K, K]
    assert client.type(store.name(keys[1])) == b"none"


def test_redis_a_read_that_misses_a_page_still_ends_the_prefix() -> None:
    """The type query after a nil finds nothing there: a shorter prefix, no error."""
    _, store = fake()
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    store.put([keys[0], keys[2]], [pages[0], pages[2]])
    assert same(store.get(keys), pages[:1])


def test_redis_a_server_gone_is_store_failed() -> None:
    """Every operation on a server that went away fails with StoreFailed, changing nothing."""
    server, store = fake()
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys[:1], pages[:1])
    server.connected = False
    cause = "FakeRedis is emulating a connection error."
    calls: dict[str, tuple[Callable[[], object], str]] = {
        "put": (lambda: store.put(keys, pages), " after 0 of 2 pages"),
        "exists": (lambda: store.exists_prefix(keys), " after 0 of 2 pages"),
        "get": (lambda: store.get(keys), " after 0 of 2 pages"),
        "drop": (lambda: store.drop(keys), " after 0 of 2 pages"),
        "capacity": (store.capacity, ""),
    }
    for operation, (call, done) in calls.items():
        with pytest.raises(StoreFailed) as caught:
            call()
        assert str(caught.value) == f"redis 127.0.0.1:6399: {operation} failed{done}: {cause}"
        assert isinstance(caught.value, StorageError)
    server.connected = True
    assert store.exists_prefix(keys) == 1


def test_redis_capacity_needs_info() -> None:
    """A server that does not answer INFO (fakeredis) says so as StoreFailed."""
    _, store = fake()
    with pytest.raises(
        StoreFailed, match=r"^redis 127\.0\.0\.1:6399: capacity failed: unknown command 'info'"
    ):
        store.capacity()


class InfoClient(fakeredis.FakeRedis):
    """A Redis-compatible server whose ``INFO memory`` answers ``answer``."""

    answer: dict[str, object]

    def info(self, section: object = None, *args: object, **options: object) -> Any:
        return dict(self.answer)


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ({"maxmemory": 0}, "INFO memory has no used_memory"),
        ({"used_memory": "12M"}, "INFO memory's used_memory is '12M', not a byte count"),
        ({"used_memory": -1}, "INFO memory's used_memory is -1, not a byte count"),
        ({"used_memory": 10, "maxmemory": 1.5}, "INFO memory's maxmemory is 1.5, not a byte count"),
    ],
)
def test_redis_capacity_from_an_info_without_byte_counts_is_store_failed(
    answer: dict[str, object], cause: str
) -> None:
    """A server whose INFO lacks or garbles a byte count fails as StoreFailed, not a KeyError."""
    client = InfoClient(host="127.0.0.1", port=6399)
    client.answer = {"used_memory": 10, "maxmemory": 0}
    assert RedisStore(client).capacity() == Capacity(10, 0, None, None)
    client.answer = answer
    with pytest.raises(StoreFailed) as caught:
        RedisStore(client).capacity()
    assert str(caught.value) == f"redis 127.0.0.1:6399: capacity failed: {cause}"


class OddClient(fakeredis.FakeRedis):
    """A client of another make: socket errors of its own, and answers no Redis gives."""

    raises: BaseException | None = None
    deleted: object = 0
    info_answer: object = None

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        if self.raises is not None:
            pipe.execute = self._raise  # type: ignore[method-assign,assignment]
        return pipe

    def _raise(self, *args: object) -> Any:
        assert self.raises is not None
        raise self.raises

    def delete(self, *names: Any) -> Any:
        return self.deleted

    def info(self, section: object = None, *args: object, **options: object) -> Any:
        return self.info_answer


@pytest.mark.parametrize(
    "error",
    [ConnectionResetError(104, "Connection reset by peer"), TimeoutError("timed out")],
    ids=["reset", "timeout"],
)
def test_redis_a_clients_own_socket_error_is_store_failed(error: OSError) -> None:
    """Only redis-py's own errors were a StoreFailed: an OSError of another client escaped bare."""
    client = OddClient(host="127.0.0.1", port=6399)
    client.raises = error
    store = RedisStore(client)
    with pytest.raises(StoreFailed) as caught:
        store.exists_prefix(page_keys(NS, list(range(8))))
    assert str(caught.value) == f"redis 127.0.0.1:6399: exists failed after 0 of 2 pages: {error}"


def test_redis_answers_no_server_gives_are_store_failed() -> None:
    """A DEL answered None, or an INFO answered None, raised a bare TypeError."""
    client = OddClient(host="127.0.0.1", port=6399)
    store = RedisStore(client)
    client.deleted = None
    with pytest.raises(StoreFailed) as caught:
        store.drop(page_keys(NS, list(range(8))))
    assert str(caught.value) == (
        "redis 127.0.0.1:6399: drop failed after 0 of 2 pages: DEL of 2 keys answered None, not a"
        " count of them"
    )
    with pytest.raises(StoreFailed) as caught:
        store.capacity()
    assert str(caught.value) == (
        "redis 127.0.0.1:6399: capacity failed: INFO memory answered NoneType, not fields"
    )


def test_redis_store_without_the_client_names_the_extra() -> None:
    """Without the redis package, RedisStore says which extra brings it; the package still imports."""
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "import fsm_cache.storage as s\n"
        "try:\n    s.RedisStore\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == (
        "fsm_cache.storage.RedisStore talks to the server with the redis package, which comes "
        "with the storage extra: pip install 'fsm-cache[storage]'\n"
    )


def test_local_concurrent_writers_of_one_prefix_count_each_page_once(tmp_path: Path) -> None:
    """Four threads put the same prefix at once: every page is stored once and counted once."""
    import threading

    keys, pages = page_keys(NS, list(range(64))), pages_of(16)
    store = LocalFileStore(tmp_path, limit_bytes=1 << 20)
    results: list[list[PutResult]] = []
    start = threading.Barrier(4)

    def writer() -> None:
        start.wait()
        results.append(store.put(keys, pages))

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(set(result) <= {S, P} for result in results)
    size = page_bytes(keys[0], pages[0])
    assert store.capacity() == Capacity(16 * size, 0, 1 << 20, 16)
    assert same(store.get(keys), pages)
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_local_a_page_found_while_its_put_places_it_is_neither_evicted_nor_counted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread finds a page between its file's rename and its put's settling.

    The lookup indexed the file while its bytes were still reserved: counted
    twice, they made another put evict the page to make room that was free,
    and the first put then acknowledged a page no longer on disk.
    """
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=2 * size)  # room for both pages
    rename = os.replace
    meanwhile: list[object] = []

    def placed(*args: Any, **options: Any) -> None:
        rename(*args, **options)
        if not meanwhile:  # the first page is in place, its put not yet settled
            meanwhile.append(store.exists_prefix(keys[:1]))
            meanwhile.append(store.put(keys[1:], pages[1:]))

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", placed)
        assert store.put(keys[:1], pages[:1]) == [S]
    assert meanwhile == [1, [S]]
    assert same(store.get(keys[:1]), pages[:1])  # acknowledged, and there
    assert store.capacity() == Capacity(2 * size, 0, 2 * size, 2)


def test_local_a_page_another_put_of_it_settled_is_not_evicted_while_its_own_put_places_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second put of the same page settles first, indexing it; the first is still placing it.

    Eviction skipped pages being read but not pages being written: a put
    that needed room deleted the page between the first put's rename and its
    settling, and the first put then acknowledged a page no longer on disk.
    """
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=2 * size)
    rename = os.replace
    meanwhile: list[object] = []

    def on_another_thread(at: slice) -> None:  # a temporary file is named per thread
        worker = threading.Thread(target=lambda: meanwhile.append(store.put(keys[at], pages[at])))
        worker.start()
        worker.join()

    first: list[bool] = []

    def placed(*args: Any, **options: Any) -> None:
        if first:  # the puts made meanwhile place their files plainly
            rename(*args, **options)
            return
        first.append(True)
        on_another_thread(slice(0, 1))  # settles, indexes the page
        rename(*args, **options)  # the first put's file is in place, not settled
        on_another_thread(slice(1, 2))  # needs room

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", placed)
        assert store.put(keys[:1], pages[:1]) == [S]
    assert meanwhile == [[S], [F]]  # no room but the page being written
    assert store.exists_prefix(keys[:1]) == 1  # acknowledged, and there
    assert same(store.get(keys[:1]), pages[:1])


class RefusingPipeline:
    """A pipeline whose server answers every SET with ``answer`` (and finds no key's TYPE)."""

    def __init__(self, answer: Exception) -> None:
        self.answer = answer
        self.answers: list[object] = []

    def set(self, *args: object, **options: object) -> None:
        self.answers.append(self.answer)

    def type(self, name: str) -> None:
        self.answers.append(b"none")

    def execute(self, raise_on_error: bool = True) -> list[object]:
        return self.answers


class RefusingClient:
    """A client of a server that refuses writes (a read-only replica, a full server)."""

    def __init__(self, answer: Exception) -> None:
        self.answer = answer
        self.connection_pool = fakeredis.FakeRedis(host="127.0.0.1", port=6399).connection_pool

    def pipeline(self, transaction: bool) -> RefusingPipeline:
        return RefusingPipeline(self.answer)


def test_redis_a_full_server_is_full_and_a_refusing_one_is_store_failed() -> None:
    """An OOM answer is FULL and stops the put; any other refusal of a SET is StoreFailed."""
    import redis

    keys, pages = page_keys(NS, list(range(24))), pages_of(6)
    oom = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    full = RedisStore(RefusingClient(oom), batch_pages=2)  # type: ignore[arg-type]
    assert full.put(keys, pages) == [F, F, K, K, K, K]
    readonly = redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
    refusing = RedisStore(RefusingClient(readonly), batch_pages=2)  # type: ignore[arg-type]
    with pytest.raises(StoreFailed) as caught:
        refusing.put(keys, pages)
    assert str(caught.value) == (
        "redis 127.0.0.1:6399: put failed after 0 of 6 pages: "
        "You can't write against a read only replica."
    )


class OneRefusedClient(fakeredis.FakeRedis):
    """A server that answers OOM to the SETs of one page (``refuse``) and stores the rest.

    With ``overwrites_only``, only a SET without NX (one that replaces a key) is refused.
    """

    refuse = ""
    overwrites_only = False

    def pipeline(self, transaction: bool = True, shard_hint: object = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        executor = pipe.execute

        def execute(raise_on_error: bool = True) -> list[object]:
            import redis

            commands = [args for args, _ in pipe.command_stack]
            answers: list[object] = executor(raise_on_error)
            refused = False
            for index, (command, name, *rest) in enumerate(commands):
                if name != self.refuse:
                    continue
                if command == "TYPE" and refused:
                    answers[index] = b"none"
                elif command == "SET" and not (self.overwrites_only and "NX" in rest):
                    refused = True
                    self.delete(name)
                    answers[index] = redis.exceptions.OutOfMemoryError("OOM over 'maxmemory'")
            return answers

        setattr(pipe, "execute", execute)  # noqa: B010 (a method of the instance, for this test)
        return pipe


def test_redis_sends_no_batch_after_a_page_was_refused_inside_one() -> None:
    """The refused page is mid-batch: its batch's later pages went with it, later batches do not."""
    client = OneRefusedClient()
    store = RedisStore(client, batch_pages=3)
    keys, pages = page_keys(NS, list(range(24))), pages_of(6)
    client.refuse = store.name(keys[1])
    assert store.put(keys, pages) == [S, F, S, K, K, K]
    assert [client.exists(store.name(key)) for key in keys] == [1, 0, 1, 0, 0, 0]


def test_redis_an_error_reply_is_store_failed() -> None:
    """NOPERM, BUSY, MISCONF ... are StoreFailed like a lost connection, never a raw redis error."""
    import redis

    class Refusing(fakeredis.FakeRedis):
        def pipeline(self, transaction: bool = True, shard_hint: object = None) -> Any:
            pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)

            def execute(raise_on_error: bool = True) -> list[object]:
                raise redis.exceptions.NoPermissionError("NOPERM no permissions to run 'exists'")

            setattr(pipe, "execute", execute)  # noqa: B010 (a method of the instance)
            return pipe

        def delete(self, *names: Any) -> int:
            raise redis.exceptions.BusyLoadingError("LOADING Redis is loading the dataset")

    store = RedisStore(Refusing(host="127.0.0.1", port=6399))
    keys = page_keys(NS, list(range(8)))
    with pytest.raises(StoreFailed) as caught:
        store.exists_prefix(keys)
    assert str(caught.value) == (
        "redis 127.0.0.1:6399: exists failed after 0 of 2 pages: "
        "NOPERM no permissions to run 'exists'"
    )
    with pytest.raises(StoreFailed) as caught:
        store.drop(keys)
    assert str(caught.value).endswith("LOADING Redis is loading the dataset")


def test_redis_a_drop_that_fails_part_way_acknowledges_the_batches_deleted() -> None:
    """A drop whose second batch fails says the first batch's pages were dropped, not none."""
    import redis

    class FailsSecond(fakeredis.FakeRedis):
        deletes = 0

        def delete(self, *names: Any) -> int:
            FailsSecond.deletes += 1
            if FailsSecond.deletes == 2:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            return int(super().delete(*names))

    server = fakeredis.FakeServer()
    client = FailsSecond(server=server, host="127.0.0.1", port=6399)
    store = RedisStore(client, batch_pages=2)
    keys = page_keys(NS, list(range(16)))
    store.put(keys, pages_of(4))
    with pytest.raises(StoreFailed) as caught:
        store.drop(keys)
    assert str(caught.value) == (
        "redis 127.0.0.1:6399: drop failed after 2 of 4 pages: Connection closed by server."
    )
    assert caught.value.acknowledged == 2
    assert store.exists_prefix(keys[2:]) == 2
    assert store.exists_prefix(keys) == 0


def test_a_local_write_that_fails_with_anything_gives_its_bytes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalFileStore(
        tmp_path, limit_bytes=3 * page_bytes(page_keys(NS, [0] * 4)[0], pages_of(1)[0])
    )
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)

    def interrupted(*args: object) -> None:
        raise MemoryError("planted")

    monkeypatch.setattr(codec, "write", interrupted)
    with pytest.raises(MemoryError):
        store.put(keys[:1], pages[:1])
    assert store.capacity().reserved_bytes == 0
    monkeypatch.undo()
    assert store.put(keys, pages) == [S, S, S]
    assert store.capacity().reserved_bytes == 0


def test_a_tree_namespace_is_a_field_of_its_own() -> None:
    """No model id spells another model's adapter; the model's own keys are as they were."""
    adapter = Namespace("llama", NS.layout, 4, tree="'adapter-7'")
    spelled = Namespace("llama#'adapter-7'", NS.layout, 4)
    assert page_keys(adapter, [1, 2, 3, 4]) != page_keys(spelled, [1, 2, 3, 4])
    fields = ["llama", NS.layout, 4, 0, 1]
    encoded = json.dumps(fields, separators=(",", ":")).encode()
    assert (
        Namespace("llama", NS.layout, 4).root()
        == hashlib.sha256(b"fsm_cache.storage/keys/v1\0" + encoded).hexdigest()
    )


def test_codec_refuses_a_shape_of_booleans() -> None:
    one = page_keys(NS, list(range(4)))[0]
    value = codec.encode(one, torch.zeros(4, 1, 1, 1, dtype=torch.uint8))
    lying = value.replace(b'"shape":[4,1,1,1]', b'"shape":[true, 4]')  # as long, 4 "elements"
    assert len(lying) == len(value)
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", one, lying)
    assert caught.value.problem == "header's uint8 [True, 4] does not make 4 bytes"


QUANTIZED = [torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4]


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_codec_refuses_a_header_naming_a_quantized_dtype(dtype: torch.dtype) -> None:
    """A header is data: a dtype put refuses to store is a CorruptPage naming it, never a page."""
    key, body = page_keys(NS, list(range(4)))[0], bytes(4)

    def value(name: str, shape: list[int]) -> bytes:
        covered = json.dumps([key, name, shape, 4], separators=(",", ":")).encode()
        crc = f"{zlib.crc32(body, zlib.crc32(covered)):08x}"
        fields = {"key": key, "dtype": name, "shape": shape, "nbytes": 4, "crc32": crc}
        head = json.dumps(fields, separators=(",", ":")).encode()
        return struct.pack("<8sI", codec.MAGIC, len(head)) + head + body

    assert codec.decode("here", key, value("uint8", [4])).dtype == torch.uint8
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", key, value(name, [4 // dtype.itemsize]))
    assert caught.value.problem == f"header's dtype is quantized ({name}), not of a plain dtype"


@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_codec_refuses_bytes_viewed_as_a_quantized_dtype(dtype: torch.dtype) -> None:
    """Plain bytes viewed as a quantized dtype (``is_quantized`` is False) are refused too."""
    page = torch.zeros(8, dtype=torch.uint8).view(dtype)
    assert not page.is_quantized
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(BadArgument) as caught:
        codec.check_pages(page_keys(NS, list(range(4))), [page])
    assert str(caught.value) == f"page 0 is quantized ({name}), not of a plain dtype"


def test_codec_round_trips_a_complex32_page_without_a_warning() -> None:
    """put stores complex32 (chalf) pages, so get reads them back, with no warning under -W error."""
    page = torch.arange(16, dtype=torch.uint8).view(torch.complex32).reshape(2, 2)
    key = page_keys(NS, [1, 2, 3, 4])[0]
    codec.check_pages([key], [page])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same([codec.decode("here", key, codec.encode(key, page))], [page])


# ---------------------------------------------------------------- properties


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 10))
@settings(max_examples=60, deadline=None)
def test_keys_of_a_split_sequence_chain_through_the_split(tokens: list[int], cut: int) -> None:
    """Keying a sequence whole or as a parent and a child (chained) gives the same keys."""
    pages = len(tokens) // 4
    tokens = tokens[: pages * 4]
    cut = min(cut, pages)
    whole = page_keys(NS, tokens)
    head = page_keys(NS, tokens[: cut * 4])
    tail = page_keys(NS, tokens[cut * 4 :], parent=head[-1] if head else None)
    assert head + tail == whole
    assert len(set(whole)) == len(whole)


@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "drop", "get"]), st.integers(0, 5), st.integers(1, 6)),
        max_size=25,
    )
)
@settings(max_examples=40, deadline=None)
def test_local_store_accounting_matches_the_disk(ops: list[tuple[str, int, int]]) -> None:
    """After any sequence of puts, drops and gets under a limit, the books match the files.

    The used bytes are the bytes of the page files, never over the limit, with
    nothing reserved between calls; a prefix counts to its first missing page,
    and what a get returns is bit for bit what was put under those keys.
    """
    import tempfile

    sequences = [page_keys(NS, list(range(s * 100, s * 100 + 24))) for s in range(6)]
    contents = {
        key: page
        for seed, keys in enumerate(sequences)
        for key, page in zip(keys, pages_of(6, seed=seed), strict=True)
    }
    size = page_bytes(sequences[0][0], contents[sequences[0][0]])
    with tempfile.TemporaryDirectory() as root:
        store = LocalFileStore(root, limit_bytes=10 * size)
        for op, which, count in ops:
            keys = sequences[which][:count]
            if op == "put":
                results = store.put(keys, [contents[k] for k in keys])
                assert stored_prefix(results) == (results.index(F) if F in results else count)
            elif op == "drop":
                store.drop(keys)
            else:
                got = store.get(keys)
                assert same(got, [contents[k] for k in keys[: len(got)]])
            files = list(Path(root).glob("??/*.page"))
            capacity = store.capacity()
            assert capacity.used_bytes == sum(p.stat().st_size for p in files) <= 10 * size
            assert (capacity.reserved_bytes, capacity.pages) == (0, len(files))
            present = [store.path(k).exists() for k in keys]
            assert store.exists_prefix(keys) == [*present, False].index(False)


# ---------------------------------------------------------------- found by a review


def fill(root: Path, count: int) -> tuple[list[str], list[torch.Tensor], int]:
    """Store a chain of ``count`` pages under ``root`` (no limit); return its keys, pages, page size."""
    keys, pages = page_keys(NS, list(range(4 * count))), pages_of(count)
    LocalFileStore(root).put(keys, pages)
    return keys, pages, page_bytes(keys[0], pages[0])


def test_local_a_put_over_a_limit_already_exceeded_frees_the_whole_excess(tmp_path: Path) -> None:
    """Pages found at start may exceed the limit: a put evicts all the excess, or nothing at all."""
    keys, pages, size = fill(tmp_path, 10)
    other = page_keys(NS, list(range(100, 108)))
    store = LocalFileStore(tmp_path, limit_bytes=4 * size)
    with store.reading(keys[:8]):  # 2 unheld pages cannot make room for 7
        assert store.put(other[:1], pages[:1]) == [F]
        assert store.capacity() == Capacity(10 * size, 0, 4 * size, 10)
    assert store.put(other[:1], pages[:1]) == [S]
    assert store.capacity() == Capacity(4 * size, 0, 4 * size, 4)
    assert store.exists_prefix(keys) == 3  # the chain's tail went first


@pytest.mark.parametrize("how", ["restart", "found", "found past a known head"])
def test_local_pages_it_did_not_use_are_evicted_tail_first(tmp_path: Path, how: str) -> None:
    """Pages indexed at start or found from another process lose their tail first, not their head."""
    keys, pages = page_keys(NS, list(range(32))), pages_of(8)
    other = page_keys(NS, list(range(100, 104)))
    size = page_bytes(keys[0], pages[0])
    writer = LocalFileStore(tmp_path)
    if how == "restart":
        writer.put(keys, pages)
        store = LocalFileStore(tmp_path, limit_bytes=8 * size)
    else:
        store = LocalFileStore(tmp_path, limit_bytes=8 * size)
        if how == "found past a known head":
            writer.put(keys[:1], pages[:1])
            assert store.exists_prefix(keys) == 1
        writer.put(keys, pages)
        assert store.exists_prefix(keys) == 8
    assert store.put(other, pages[:1]) == [S]
    assert store.exists_prefix(keys) == 7
    assert not store.path(keys[-1]).exists()


def first_format(key: str, page: torch.Tensor) -> bytes:
    """Return ``page`` as a page of the first format (``FSMPAGE1``: no checksum)."""
    fields = {"key": key, "dtype": "bfloat16", "shape": list(page.shape), "nbytes": 256}
    head = json.dumps(fields, separators=(",", ":")).encode()
    return struct.pack("<8sI", b"FSMPAGE1", len(head)) + head + codec.encode(key, page)[-256:]


def disk_bytes(store: LocalFileStore, keys: list[str]) -> int:
    """Bytes the page files of ``keys`` take on disk (those that exist)."""
    return sum(store.path(k).stat().st_size for k in keys if store.path(k).exists())


@pytest.mark.parametrize("damage", ["torn", "zeroed", "first format", "another key's"])
def test_local_a_put_replaces_a_damaged_page_it_finds_instead_of_calling_it_present(
    tmp_path: Path, damage: str
) -> None:
    """PRESENT is what a later read gets back: a page there that reads as corrupt is replaced."""
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    good = codec.encode(keys[1], pages[1])
    bad = {
        "torn": good[:-8],
        "zeroed": good[:-16] + bytes(16),  # torn at an intact length: only the checksum says
        "first format": first_format(keys[1], pages[1]),
        "another key's": codec.encode(keys[0], pages[0]),
    }[damage]
    LocalFileStore(tmp_path).put(keys[:1], pages[:1])
    store = LocalFileStore(tmp_path)
    store.path(keys[1]).parent.mkdir(exist_ok=True)
    store.path(keys[1]).write_bytes(bad)
    assert store.exists_prefix(keys) == 2  # indexed at the damaged page's size
    assert store.put(keys, pages) == [P, S]
    assert same(store.get(keys), pages)
    assert store.capacity().used_bytes == disk_bytes(store, keys)
    assert store.capacity().pages == 2


def test_local_a_damaged_page_a_full_put_cannot_replace_stays_counted(tmp_path: Path) -> None:
    """A put that answers FULL for a damaged page leaves it indexed and counted, as before it.

    It was forgotten before the room for its replacement was sought: on FULL the
    file stayed on disk uncounted, and the limit overrun, until a lookup found it.
    """
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    size = page_bytes(keys[0], pages[0])
    torn = codec.encode(keys[1], pages[1])[:40]
    store = LocalFileStore(tmp_path, limit_bytes=size + len(torn) + 10)
    assert store.put(keys[:1], pages[:1]) == [S]
    store.path(keys[1]).parent.mkdir(exist_ok=True)
    store.path(keys[1]).write_bytes(torn)
    assert store.exists_prefix(keys) == 2  # indexed at the torn page's size
    before = (store.capacity(), store.exists_prefix(keys[1:]))
    assert store.put(keys, pages) == [P, F]  # the first page is held: no room for the second
    assert (store.capacity(), store.exists_prefix(keys[1:])) == before
    assert store.capacity().used_bytes == disk_bytes(store, keys)
    assert store.path(keys[1]).read_bytes() == torn


def test_local_a_damaged_page_is_replaced_where_only_its_own_bytes_make_room(
    tmp_path: Path,
) -> None:
    """The bytes of the damaged page a put replaces count as room: nothing else is evicted."""
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    size = page_bytes(keys[0], pages[0])
    store = LocalFileStore(tmp_path, limit_bytes=2 * size)
    assert store.put(keys[:1], pages[:1]) == [S]
    store.path(keys[1]).parent.mkdir(exist_ok=True)
    store.path(keys[1]).write_bytes(codec.encode(keys[1], pages[1])[:-8])
    assert store.exists_prefix(keys) == 2  # full but for 8 bytes
    assert store.put(keys[1:], pages[1:]) == [S]
    assert same(store.get(keys), pages)
    assert store.capacity().used_bytes == disk_bytes(store, keys) == 2 * size


def test_local_a_put_leaves_a_page_of_a_later_format_it_finds(tmp_path: Path) -> None:
    """A newer version's page is whole: PRESENT, for the servers that read it, and kept."""
    keys, pages = page_keys(NS, list(range(4))), pages_of(1)
    later = b"FSMPAGE4" + codec.encode(keys[0], pages[0])[8:]
    store = LocalFileStore(tmp_path)
    store.path(keys[0]).parent.mkdir()
    store.path(keys[0]).write_bytes(later)
    assert store.put(keys, pages) == [P]
    assert store.path(keys[0]).read_bytes() == later


def test_local_a_drop_while_a_put_places_its_page_leaves_no_phantom_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropped between its rename and its count, a page was counted stored with no file."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(4))), pages_of(1)
    real, dropped = os.replace, []

    def place_then_drop(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        dropped.append(store.drop(keys))  # another thread, at the worst moment

    monkeypatch.setattr(os, "replace", place_then_drop)
    assert store.put(keys, pages) == [S]
    monkeypatch.undo()
    assert (store.capacity().pages, store.path(keys[0]).exists()) == (1, True)
    assert store.capacity().used_bytes == disk_bytes(store, keys)
    assert dropped == [0]  # the drop came first: the put stored the page after it
    assert same(store.get(keys), pages)
    assert store.drop(keys) == 1  # a drop after the put deletes it, as ever
    assert store.capacity().used_bytes == 0


def test_codec_a_torn_page_of_intact_length_is_corrupt(tmp_path: Path) -> None:
    """Bytes lost under an intact length (a power loss) fail the checksum: CorruptPage, never KV."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys, pages)
    value = codec.encode(keys[1], pages[1])
    torn = value[:-16] + bytes(16)
    body = torn[len(codec.header(keys[1], pages[1])) :]
    covered = json.dumps([keys[1], "bfloat16", list(pages[1].shape), 256], separators=(",", ":"))
    start = zlib.crc32(covered.encode())
    problem = (
        f"crc32 of the header and bytes is {zlib.crc32(body, start):08x}, "
        f"the header says {zlib.crc32(value[-256:], start):08x}"
    )
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", keys[1], torn)
    assert caught.value.problem == problem
    store.path(keys[1]).write_bytes(torn)
    with pytest.raises(CorruptPage) as caught:
        store.get(keys)
    assert str(caught.value) == f"{store.path(keys[1])}: not a valid page {keys[1][:12]}: {problem}"


def test_codec_refuses_pages_of_the_first_format(tmp_path: Path) -> None:
    """A page written before pages had a checksum (FSMPAGE1) is corrupt: it cannot be verified."""
    key, page = page_keys(NS, list(range(4)))[0], pages_of(1)[0]
    fields = {"key": key, "dtype": "bfloat16", "shape": list(page.shape), "nbytes": 256}
    head = json.dumps(fields, separators=(",", ":")).encode()
    old = struct.pack("<8sI", b"FSMPAGE1", len(head)) + head + codec.encode(key, page)[-256:]
    problem = "a page of the first format (FSMPAGE1), with no checksum"
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", key, old)
    assert caught.value.problem == problem
    store = LocalFileStore(tmp_path)
    store.path(key).parent.mkdir()
    store.path(key).write_bytes(old)
    with pytest.raises(CorruptPage, match=rf"{key[:12]}: {re.escape(problem)}$"):
        store.get([key])


def test_codec_reads_a_page_of_a_later_format_as_such(tmp_path: Path) -> None:
    """FSMPAGE4 on: a newer version's page, not a torn one (a cache leaves it stored)."""
    key, page = page_keys(NS, list(range(4)))[0], pages_of(1)[0]
    later = b"FSMPAGE4" + codec.encode(key, page)[8:]
    problem = "a page of a later format (FSMPAGE4), written by a newer version"
    with pytest.raises(LaterFormatPage) as caught:
        codec.decode("there", key, later)
    assert str(caught.value) == f"there: not a valid page {key[:12]}: {problem}"
    assert isinstance(caught.value, CorruptPage)  # caught wherever a corrupt page is
    store = LocalFileStore(tmp_path)
    store.path(key).parent.mkdir()
    store.path(key).write_bytes(later)
    with pytest.raises(LaterFormatPage, match=rf"{key[:12]}: {re.escape(problem)}$"):
        store.get([key])
    for magic in (b"FSMPAGE0", b"FSMPAGE:", b"FSMPAGEX"):  # not a later version's: no header
        with pytest.raises(CorruptPage) as torn:
            codec.decode("there", key, magic + later[8:])
        assert type(torn.value) is CorruptPage
        assert torn.value.problem == "no page header"


def test_codec_a_deeply_nested_header_is_corrupt() -> None:
    """JSON nested past the parser's recursion limit is an unreadable header, not a RecursionError."""
    key = page_keys(NS, list(range(4)))[0]
    for nested in (b"[" * 60000, b"[" * 30000 + b"]" * 30000):
        with pytest.raises(CorruptPage) as caught:
            codec.decode("there", key, struct.pack("<8sI", codec.MAGIC, len(nested)) + nested)
        assert caught.value.problem == "unreadable page header"


def test_conjugate_and_negative_views_are_stored_as_their_values(store: Store) -> None:
    """A conj or neg view's memory holds the values before the view: they are resolved first."""
    base = torch.randn(4, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    views = [base.conj(), base[:1, 0].conj().imag, base.conj().t()]  # imag: a neg view
    keys = page_keys(NS, list(range(12)))
    store.put(keys, views)
    want = [
        v.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format) for v in views
    ]
    assert same(store.get(keys), want)
    decoded = [
        codec.decode("here", k, codec.encode(k, v)) for k, v in zip(keys, views, strict=True)
    ]
    assert same(decoded, want)


def odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose memory is not their content as one block of a plain dtype."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized: deprecated; nested: a prototype
        return {
            "sparse_coo": torch.eye(4).to_sparse(),
            "sparse_csr": torch.eye(4).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        }


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("sparse_coo", "page 1 is a sparse_coo tensor, not a dense (strided) one"),
        ("sparse_csr", "page 1 is a sparse_csr tensor, not a dense (strided) one"),
        ("quantized", "page 1 is quantized (qint8), not of a plain dtype"),
        ("nested", "page 1 is a nested tensor, not a dense one"),
    ],
)
def test_put_refuses_tensors_that_are_not_dense_memory(
    store: Store, kind: str, message: str
) -> None:
    """Sparse, quantized and nested pages are BadArgument before the first page is written."""
    keys = page_keys(NS, list(range(8)))
    with pytest.raises(BadArgument) as caught:
        store.put(keys, [pages_of(1)[0], odd_tensors()[kind]])
    assert str(caught.value) == message
    assert store.exists_prefix(keys) == 0


def test_local_disk_errors_are_store_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails on the disk is StoreFailed, saying how many pages were read before it."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys, pages)

    def eio(fd: int, buffers: object) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "readv", eio)
    with pytest.raises(StoreFailed) as caught:
        store.get(keys)
    assert str(caught.value) == (
        f"local {tmp_path}: get failed after 0 of 2 pages: OSError: [Errno 5] Input/output error"
    )
    assert store.capacity().pages == 2


@pytest.mark.parametrize("make", [Path.mkdir, os.mkfifo])
def test_local_a_non_file_at_a_page_path_is_corrupt(tmp_path: Path, make: Any) -> None:
    """A directory or a FIFO where a page should be reads as CorruptPage (without blocking)."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(8))), pages_of(2)
    store.put(keys[:1], pages[:1])
    path = store.path(keys[1])
    path.parent.mkdir(exist_ok=True)
    make(path)
    with pytest.raises(CorruptPage) as caught:
        store.get(keys)
    assert str(caught.value) == f"{path}: not a valid page {keys[1][:12]}: not a regular file"
    assert same(store.get(keys[:1]), pages[:1])


def test_local_a_page_that_cannot_be_deleted_is_store_failed(tmp_path: Path) -> None:
    """A drop that cannot delete a page's file is StoreFailed; the pages before it are dropped."""
    store = LocalFileStore(tmp_path)
    keys, pages = page_keys(NS, list(range(12))), pages_of(3)
    store.put(keys[:1], pages[:1])
    path = store.path(keys[1])
    path.parent.mkdir(exist_ok=True)
    path.mkdir()
    assert store.exists_prefix(keys) == 2
    with pytest.raises(StoreFailed) as caught:
        store.drop(keys)
    assert str(caught.value) == (
        f"local {tmp_path}: drop failed after 1 of 3 pages: "
        f"IsADirectoryError: [Errno 21] Is a directory: '{path}'"
    )
    assert (store.exists_prefix(keys[:1]), store.capacity().used_bytes) == (0, 0)


def rewritten(value: bytes, old: bytes, new: bytes) -> bytes:
    """Return the stored page ``value`` with ``old`` replaced by ``new`` in its header (resized)."""
    magic, length = struct.unpack_from("<8sI", value)
    head = value[12 : 12 + length]
    assert old in head
    head = head.replace(old, new)
    return struct.pack("<8sI", magic, len(head)) + head + value[12 + length :]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"dtype":"bfloat16"', b'"dtype":"float16"'),  # another dtype of the same size
        (b'"shape":[2,2,4,2,4]', b'"shape":[4,2,2,2,4]'),  # two dims swapped: two bits
    ],
    ids=["dtype", "shape"],
)
def test_codec_a_header_naming_another_dtype_or_shape_of_its_bytes_is_corrupt(
    old: bytes, new: bytes
) -> None:
    """The checksum covers the header's fields: the same bytes under another dtype are not the page."""
    key, page = page_keys(NS, list(range(4)))[0], pages_of(1)[0]
    lying = rewritten(codec.encode(key, page), old, new)
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", key, lying)
    assert caught.value.problem.startswith("crc32 of the header and bytes is ")


INT3: torch.dtype = torch.int3  # type: ignore[attr-defined]  # a sub-byte dtype torch's stubs omit


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, INT3], ids=str)
def test_codec_every_bit_flipped_in_a_header_is_corrupt(dtype: torch.dtype) -> None:
    """No single bit flipped in a header (magic, length, JSON) reads as a page: int3 became int1."""
    key = page_keys(NS, list(range(4)))[0]
    page = torch.arange(24, dtype=torch.uint8).view(dtype).reshape(2, -1)
    value = codec.encode(key, page)
    for at in range(len(codec.header(key, page))):
        for bit in range(8):
            flipped = bytearray(value)
            flipped[at] ^= 1 << bit
            with pytest.raises(CorruptPage):
                codec.decode("there", key, bytes(flipped))


def test_codec_pages_of_the_second_format_are_still_read(tmp_path: Path) -> None:
    """FSMPAGE2 pages (checksum of the bytes alone) read back; FSMPAGE3 pages claiming it do not."""
    key, page = page_keys(NS, list(range(4)))[0], pages_of(1)[0]
    body = codec.encode(key, page)[-256:]
    fields = {"key": key, "dtype": "bfloat16", "shape": list(page.shape), "nbytes": 256}
    fields["crc32"] = f"{zlib.crc32(body):08x}"
    head = json.dumps(fields, separators=(",", ":")).encode()
    second = struct.pack("<8sI", b"FSMPAGE2", len(head)) + head + body
    assert same([codec.decode("here", key, second)], [page])
    store = LocalFileStore(tmp_path)
    store.path(key).parent.mkdir()
    store.path(key).write_bytes(second)
    assert same(store.get([key]), [page])
    torn = second[:-1] + b"\xff"
    with pytest.raises(CorruptPage) as caught:
        codec.decode("there", key, torn)
    assert caught.value.problem == (
        f"crc32 of the bytes is {zlib.crc32(torn[-256:]):08x}, the header says {fields['crc32']}"
    )
    claiming = b"FSMPAGE2" + codec.encode(key, page)[8:]  # one bit of the magic flipped
    with pytest.raises(CorruptPage, match=r"^there: not a valid page .*: crc32 of the bytes is "):
        codec.decode("there", key, claiming)


class LosesAnAnswer(fakeredis.FakeRedis):
    """A client (or proxy) whose round trips lose their last answer once ``losing`` is set."""

    losing = False

    def pipeline(self, transaction: bool = True, shard_hint: object = None) -> Any:
        pipe = super().pipeline(transaction=transaction, shard_hint=shard_hint)
        execute = pipe.execute

        def short(raise_on_error: bool = True) -> list[object]:
            return self._short(execute(raise_on_error))

        setattr(pipe, "execute", short)  # noqa: B010 (a method of the instance)
        return pipe

    def mget(self, keys: Any, *args: Any) -> Any:
        return self._short(super().mget(keys, *args))

    def _short(self, answers: list[Any]) -> list[Any]:
        return answers[:-1] if self.losing else answers


def test_redis_a_round_trip_short_of_an_answer_is_store_failed_not_shifted() -> None:
    """Answers are matched to pages by position: one lost would acknowledge a page never stored."""
    server = fakeredis.FakeServer()
    client = LosesAnAnswer(server=server, host="127.0.0.1", port=6399)
    store = RedisStore(client, batch_pages=2)
    keys, pages = page_keys(NS, list(range(24))), pages_of(6)
    client.losing = True
    failures: dict[str, tuple[Callable[[], object], str]] = {
        "put": (lambda: store.put(keys, pages), "answers to 3 of 4 commands"),  # SET NX, TYPE
        "exists": (lambda: store.exists_prefix(keys), "answers to 1 of 2 commands"),
        "get": (lambda: store.get(keys), "answers to 0 of 1 commands"),
    }
    for operation, (call, cause) in failures.items():
        with pytest.raises(StoreFailed) as caught:
            call()
        assert str(caught.value) == (
            f"redis 127.0.0.1:6399: {operation} failed after 0 of 6 pages: {cause}"
        )
        assert caught.value.acknowledged == 0
    client.losing = False
    assert store.exists_prefix(keys) == 2  # the first batch landed; its answer did not


@pytest.mark.parametrize("how", ["commit", "abort"])
def test_a_reservation_settles_only_in_the_budget_that_made_it(how: str) -> None:
    """Another budget's reservation is refused: settling it would count bytes never reserved."""
    mine, other = Budget("disk", 100), Budget("other", 100)
    reservation = other.reserve(60)
    with pytest.raises(ReservationError) as caught:
        getattr(mine, how)(reservation)
    want = "committed" if how == "commit" else "aborted"
    assert (
        str(caught.value)
        == f"disk: reservation 1 (60 bytes) cannot be {want}: another budget made it"
    )
    assert (mine.used_bytes, mine.reserved_bytes, mine.free()) == (0, 0, 100)
    assert (other.reserved_bytes, reservation.settled) == (60, "")
    getattr(other, how)(reservation)
    assert other.reserved_bytes == 0
