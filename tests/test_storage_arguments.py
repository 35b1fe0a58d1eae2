"""Bad arguments to the storage layer: a typed error naming what is wrong, and nothing changed.

Every constructor and method of :mod:`fsm_cache.storage` checks its arguments
before it creates a file, reserves a byte or asks a server anything, and says
which argument is wrong and what it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
import torch

from fsm_cache.errors import BadArgument, StorageFull, StoreFailed
from fsm_cache.storage import (
    Budget,
    Capacity,
    LocalFileStore,
    Namespace,
    PutResult,
    RedisStore,
    Store,
    page_keys,
)


NS = Namespace("m", "l", 4)
KEYS = page_keys(NS, list(range(8)))


def pages_of(count: int) -> list[torch.Tensor]:
    """Return ``count`` small pages."""
    return [torch.full((2, 4), float(i)) for i in range(count)]


def refused(call: Callable[[], object]) -> str:
    """Return the message of the BadArgument ``call`` raises."""
    with pytest.raises(BadArgument) as caught:
        call()
    return str(caught.value)


def tree(root: Path) -> list[str]:
    """Return every path under ``root``, relative to it."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# ---------------------------------------------------------------- LocalFileStore


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limit_bytes": math.nan}, "limit_bytes must be an int, not nan"),
        ({"limit_bytes": 1.5}, "limit_bytes must be an int, not 1.5"),
        ({"limit_bytes": True}, "limit_bytes must be an int, not True"),
        ({"limit_bytes": "100"}, "limit_bytes must be an int, not '100'"),
        ({"limit_bytes": -1}, "limit_bytes must be at least 0, not -1"),
        ({"durable": "yes"}, "durable must be a bool, not 'yes'"),
        ({"durable": 1}, "durable must be a bool, not 1"),
    ],
)
def test_local_bad_options_are_refused_before_the_directory_is_made(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    """A NaN limit used to be taken, and every put then raised StorageFull."""
    assert refused(lambda: LocalFileStore(tmp_path / "store", **options)) == message
    assert tree(tmp_path) == []


@pytest.mark.parametrize(
    ("root", "message"),
    [
        (5, "root must be a str or os.PathLike path, not int"),
        (None, "root must be a str or os.PathLike path, not NoneType"),
        (b"/tmp/store", "root must be a str or os.PathLike path, not bytes"),
        ("", "root must name a directory, not ''"),
        ("store\0x", "root 'store\\x00x' is not a valid path: embedded null byte"),
    ],
)
def test_local_a_root_that_is_not_a_path_is_bad_argument(root: object, message: str) -> None:
    """Not a TypeError or ValueError from pathlib: a BadArgument naming root."""
    assert refused(lambda: LocalFileStore(root)) == message  # type: ignore[arg-type]


def test_local_a_root_that_is_not_a_directory_is_bad_argument(tmp_path: Path) -> None:
    """A file at the root, above it, or where its temporary directory goes: nothing is made."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / ".tmp").write_text("x")
    before = tree(tmp_path)
    cases = {
        tmp_path / "file": f"root {tmp_path}/file is not a directory",
        tmp_path / "file" / "sub": f"root {tmp_path}/file/sub: {tmp_path}/file is not a directory",
        tmp_path / "dir": f"root {tmp_path}/dir: {tmp_path}/dir/.tmp is not a directory",
    }
    for root, message in cases.items():
        assert refused(partial(LocalFileStore, root)) == message
    assert tree(tmp_path) == before


def test_local_a_folder_another_process_makes_meanwhile_is_no_obstacle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks opening stores side by side under one new folder: the one that loses the race opens.

    The folder does not exist when this process asks whether it is a
    directory, and does, made by the other rank, when it asks whether
    anything is there.
    """
    shared = tmp_path / "shared"
    exists = Path.exists

    def made_meanwhile(self: Path, *args: Any, **options: Any) -> bool:
        if self == shared:
            shared.mkdir(exist_ok=True)  # the other rank, between the two looks
        return exists(self, *args, **options)

    monkeypatch.setattr(Path, "exists", made_meanwhile)
    store = LocalFileStore(shared / "rank1")
    assert (shared / "rank1" / ".tmp").is_dir()
    store.close()


def test_local_a_directory_that_cannot_be_made_is_store_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error creating the directory is StoreFailed (open), not a raw OSError."""

    def fails(self: Path, *args: object, **options: object) -> None:
        raise OSError(5, "Input/output error", str(self))

    monkeypatch.setattr(Path, "mkdir", fails)
    with pytest.raises(StoreFailed) as caught:
        LocalFileStore(tmp_path / "store")
    assert str(caught.value) == (
        f"local {tmp_path}/store: open failed: "
        f"OSError: [Errno 5] Input/output error: '{tmp_path}/store/.tmp'"
    )
    assert (caught.value.operation, caught.value.acknowledged) == ("open", 0)


def test_local_path_refuses_what_is_not_a_page_key(tmp_path: Path) -> None:
    """``path`` names a file under the root only for a page key, never ``../`` anything."""
    store = LocalFileStore(tmp_path)
    assert (
        refused(lambda: store.path("../../etc/passwd"))
        == "key 0 is not a page key (64 lowercase hex digits): '../../etc/passwd'"
    )
    assert store.path(KEYS[0]) == tmp_path / KEYS[0][:2] / f"{KEYS[0]}.page"


def test_local_reading_checks_its_keys(tmp_path: Path) -> None:
    """``reading`` refuses None before it holds anything."""
    store = LocalFileStore(tmp_path)

    def hold() -> None:
        with store.reading(None):  # type: ignore[arg-type]
            pass

    assert refused(hold) == "keys must be a sequence of page keys, not NoneType"


# ---------------------------------------------------------------- both stores


@pytest.fixture(params=["local", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each backend, empty."""
    if request.param == "local":
        return LocalFileStore(tmp_path / "pages")
    return RedisStore(fakeredis.FakeRedis(), batch_pages=3)


def test_every_call_refuses_keys_and_pages_that_are_not_sequences(store: Store) -> None:
    """None, a lone key or a lone tensor: a BadArgument naming the argument, the store untouched."""
    store.put(KEYS[:1], pages_of(1))
    nothing: Any = None
    for call in (store.exists_prefix, store.get, store.drop):
        assert (
            refused(partial(call, nothing)) == "keys must be a sequence of page keys, not NoneType"
        )
        assert refused(partial(call, KEYS[0])) == "keys must be a sequence of page keys, not str"
    cases: list[tuple[Any, Any, str]] = [
        (None, pages_of(1), "keys must be a sequence of page keys, not NoneType"),
        (KEYS, None, "pages must be a sequence of tensors, not NoneType"),
        (KEYS, torch.stack(pages_of(2)), "pages must be a sequence of tensors, not Tensor"),
        (iter(KEYS), pages_of(2), "keys must be a sequence of page keys, not list_iterator"),
    ]
    for keys, pages, message in cases:
        assert refused(partial(store.put, keys, pages)) == message
    assert store.exists_prefix(KEYS) == 1
    if isinstance(store, LocalFileStore):  # fakeredis answers no INFO
        assert store.capacity() == Capacity(store.capacity().used_bytes, 0, None, 1)


def test_put_says_which_page_is_empty_and_which_is_elsewhere(store: Store) -> None:
    """An empty CPU page is empty; a page on another device is there (not 'not cpu')."""
    assert refused(lambda: store.put(KEYS, [pages_of(1)[0], torch.empty(0, 3)])) == (
        "page 1 is empty (shape [0, 3])"
    )
    assert refused(lambda: store.put(KEYS, [torch.empty(2, device="meta"), torch.empty(0)])) == (
        "page 0 is on meta, not the CPU"
    )
    assert store.exists_prefix(KEYS) == 0


# ---------------------------------------------------------------- Namespace and page_keys


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Namespace("m", "l", 4.0), "page_size must be an int, not 4.0"),  # type: ignore[arg-type]
        (lambda: Namespace("m", "l", True), "page_size must be an int, not True"),
        (lambda: Namespace("m", "l", "4"), "page_size must be an int, not '4'"),  # type: ignore[arg-type]
        (lambda: Namespace("m", "l", 4, rank=True, ranks=2), "rank must be an int, not True"),
        (lambda: Namespace("m", "l", 4, rank=-1, ranks=2), "rank must be at least 0, not -1"),
        (lambda: Namespace("m", "l", 4, ranks=2.0), "ranks must be an int, not 2.0"),  # type: ignore[arg-type]
        (lambda: Namespace("m", "l", 4, ranks=0), "ranks must be at least 1, not 0"),
        (lambda: Namespace(5, "l", 4), "model must be a non-empty str, not 5"),  # type: ignore[arg-type]
        (lambda: Namespace("", "l", 4), "model must be a non-empty str, not ''"),
        (lambda: Namespace("m", None, 4), "layout must be a non-empty str, not None"),  # type: ignore[arg-type]
        (lambda: Namespace("m", "l", 4, tree=5), "tree must be a str or None, not 5"),  # type: ignore[arg-type]
        (lambda: Namespace.for_layout("m", "l"), "layout must be a KVLayout, not str"),  # type: ignore[arg-type]
    ],
)
def test_namespace_fields_of_the_wrong_type_are_refused(
    make: Callable[[], object], message: str
) -> None:
    """``page_size=4.0`` or ``rank=True`` would digest as another namespace than 4 or 1."""
    assert refused(make) == message


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: page_keys(NS, None), "tokens must be a sequence of ints, not NoneType"),  # type: ignore[arg-type]
        (lambda: page_keys(NS, "abcd"), "tokens must be a sequence of ints, not str"),  # type: ignore[arg-type]
        (lambda: page_keys(NS, {1, 2, 3, 4}), "tokens must be a sequence of ints, not set"),  # type: ignore[arg-type]
        (lambda: page_keys(None, [1, 2, 3, 4]), "namespace must be a Namespace, not NoneType"),  # type: ignore[arg-type]
    ],
)
def test_page_keys_refuses_what_is_not_tokens(call: Callable[[], object], message: str) -> None:
    """No TypeError from len() or struct, and no set hashed in whatever order it iterates."""
    assert refused(call) == message


# ---------------------------------------------------------------- Budget and Capacity


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Budget("disk", True), "limit_bytes must be an int, not True"),
        (lambda: Budget("disk", math.nan), "limit_bytes must be an int, not nan"),  # type: ignore[arg-type]
        (lambda: Capacity(0, 0, True, 0), "limit_bytes must be an int, not True"),
        (lambda: Capacity(-1, 0, None, 0), "used_bytes must be at least 0, not -1"),
        (lambda: Capacity(0, 0.5, None, 0), "reserved_bytes must be an int, not 0.5"),  # type: ignore[arg-type]
        (lambda: Capacity(0, 0, None, 1.0), "pages must be an int, not 1.0"),  # type: ignore[arg-type]
    ],
)
def test_byte_counts_must_be_ints(call: Callable[[], object], message: str) -> None:
    """``True`` is not a limit of one byte, nor NaN one that nothing fits under."""
    assert refused(call) == message


def test_budget_reserves_only_a_count_of_bytes() -> None:
    """A NaN or bool reservation is refused, with nothing reserved."""
    budget = Budget("disk", 100)
    bad: list[tuple[Any, str]] = [
        (math.nan, "nbytes must be an int, not nan"),
        (True, "nbytes must be an int, not True"),
        (-1, "nbytes must be at least 0, not -1"),
    ]
    for nbytes, message in bad:
        assert refused(partial(budget.reserve, nbytes)) == message
    assert refused(lambda: budget.add(2.5)) == "nbytes must be an int, not 2.5"  # type: ignore[arg-type]
    assert refused(lambda: budget.remove(None)) == "nbytes must be an int, not None"  # type: ignore[arg-type]
    assert refused(lambda: budget.commit("r")) == "reservation must be a Reservation, not str"  # type: ignore[arg-type]
    assert (budget.used_bytes, budget.reserved_bytes) == (0, 0)
    with pytest.raises(StorageFull):
        budget.reserve(101)


# ---------------------------------------------------------------- RedisStore


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_pages": True}, "batch_pages must be an int, not True"),
        ({"batch_pages": math.nan}, "batch_pages must be an int, not nan"),
        ({"batch_pages": 0}, "batch_pages must be at least 1, not 0"),
        ({"batch_bytes": 1.5}, "batch_bytes must be an int, not 1.5"),
        ({"batch_bytes": 0}, "batch_bytes must be at least 1, not 0"),
        ({"prefix": 5}, "prefix must be a str, not 5"),
        ({"prefix": b"fsm:"}, "prefix must be a str, not b'fsm:'"),
    ],
)
def test_redis_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    """``batch_bytes=1.5`` used to be taken, and a get then failed slicing by a float."""
    assert refused(lambda: RedisStore(fakeredis.FakeRedis(), **options)) == message


def test_redis_a_client_that_is_not_one_is_refused() -> None:
    """Not an AttributeError from deep inside: a BadArgument naming the client's type."""
    assert refused(lambda: RedisStore(5)) == (  # type: ignore[arg-type]
        "client must be a redis.Redis client (with a connection_pool), not int"
    )


def test_redis_a_client_that_decodes_replies_is_refused() -> None:
    """A page is bytes: a client that decodes replies as text stored pages it could never read.

    Every get of them failed with a raw UnicodeDecodeError, and the pages
    it put were found by every exists_prefix.
    """
    assert refused(lambda: RedisStore(fakeredis.FakeRedis(decode_responses=True))) == (
        "client must return values as bytes, not decode them (decode_responses=True)"
    )
    assert refused(lambda: RedisStore.connect("redis://h/0?decode_responses=yes")) == (
        "client must return values as bytes, not decode them (decode_responses='yes')"
    )


def test_redis_name_refuses_what_is_not_a_page_key() -> None:
    """``name(None)`` used to give ``fsm:page:None``."""
    store = RedisStore(fakeredis.FakeRedis())
    assert refused(lambda: store.name(None)) == (  # type: ignore[arg-type]
        "key 0 is not a page key (64 lowercase hex digits): None"
    )
    assert store.name(KEYS[0]) == f"fsm:page:{KEYS[0]}"


def test_redis_connect_refuses_a_bad_url_or_option_and_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The url is not echoed (it may hold a password); a client made for a refused store is closed."""
    assert refused(lambda: RedisStore.connect(5)) == "url must be a str, not int"  # type: ignore[arg-type]
    assert refused(lambda: RedisStore.connect("http://:secret@host")) == (
        "url is not a Redis URL: Redis URL must specify one of the following schemes "
        "(redis://, rediss://, unix://)"
    )
    closed: list[bool] = []

    class Client(fakeredis.FakeRedis):
        def close(self) -> None:
            closed.append(True)
            super().close()

    monkeypatch.setattr(redis.Redis, "from_url", lambda url: Client())
    assert refused(lambda: RedisStore.connect("redis://h", batch_pages=0)) == (
        "batch_pages must be at least 1, not 0"
    )
    assert closed == [True]
    # a misspelt option was a bare TypeError
    assert refused(lambda: RedisStore.connect("redis://h", batch=4)) == (
        "RedisStore.connect: RedisStore.__init__() got an unexpected keyword argument 'batch'"
    )
    assert closed == [True, True]
    assert RedisStore.connect("redis://h").put(KEYS[:1], pages_of(1)) == [PutResult.STORED]
