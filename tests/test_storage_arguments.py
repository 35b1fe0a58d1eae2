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
import torch

from fsm_cache.errors import BadArgument, StorageFull
from fsm_cache.storage import (
    Budget,
    Capacity,
    LocalFileStore,
    Namespace,
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
