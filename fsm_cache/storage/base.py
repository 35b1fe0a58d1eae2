"""What every storage backend offers: the :class:`Store` Protocol and its result types.

A store maps page keys (:mod:`fsm_cache.storage.keys`) to immutable pages. Keys
are content-addressed, so a page written twice is the same page and a second
writer is a no-op. Everything is a prefix, as in SGLang's HiCache storage:
:meth:`Store.exists_prefix` counts leading keys, :meth:`Store.get` stops at the
first page missing, :meth:`Store.put` writes no batch after the first page it
could not store (a stored page whose parent is missing can never be fetched). A store may lose a page at any time (the local store's own
eviction, another process, a Redis server's ``maxmemory`` policy): the caller
sees a shorter prefix, never a page without its bytes. Torch-free: pages are
typed as tensors for checkers only.

The two argument refusals every part of the storage layer shares live here, so
each is written once: of a value that is not a count (:func:`check_count`, on
:func:`fsm_cache.numeric.whole`, the package's rule for ints) and of one that is
not a sequence of keys, pages or tokens (:func:`check_sequence`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fsm_cache.errors import BadArgument
from fsm_cache.numeric import whole


if TYPE_CHECKING:
    import torch


class PutResult(enum.Enum):
    """What a put did with one page.

    Attributes:
        STORED: Written by this put.
        PRESENT: Already stored (by anyone); nothing written.
        FULL: Not stored: no room for it, even after evicting what nobody reads.
        SKIPPED: Not attempted: a page before it was not stored, and a page
            whose parent is missing can never be fetched.
    """

    STORED = "stored"
    PRESENT = "present"
    FULL = "full"
    SKIPPED = "skipped"

    @property
    def held(self) -> bool:
        """Whether the store holds the page after the put."""
        return self in (PutResult.STORED, PutResult.PRESENT)


def stored_prefix(results: Sequence[PutResult]) -> int:
    """Return how many leading pages of a put the store holds (the prefix to acknowledge)."""
    for index, result in enumerate(results):
        if not result.held:
            return index
    return len(results)


def check_count(name: str, value: object, least: int = 0) -> int:
    """Return ``value`` if it is an int of at least ``least``: a count of bytes, pages or ranks.

    A bool is not a count (``True`` would be one byte), nor is a float, even a
    whole one: ``4.0`` digests to another namespace than 4 and cannot slice,
    and NaN passes every comparison with a bound by failing it.

    Raises:
        BadArgument: Naming ``name`` and the value.
    """
    if not whole(value, None):
        raise BadArgument(f"{name} must be an int, not {value!r}")
    if value < least:
        raise BadArgument(f"{name} must be at least {least}, not {value}")
    return value


def check_sequence(name: str, value: object, of: str) -> None:
    """Refuse ``value`` unless it is an ordered sequence (a list, a tuple), and not text.

    Keys, pages and tokens are read by position and sliced: None has no
    length, a set or an iterator no positions, a str is one key's characters,
    and a tensor of pages is one tensor.

    Raises:
        BadArgument: ``{name} must be a sequence of {of}``, naming the type given.
    """
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise BadArgument(f"{name} must be a sequence of {of}, not {type(value).__name__}")


@dataclass(frozen=True)
class Capacity:
    """How much a store holds and may hold.

    Attributes:
        used_bytes: Bytes of stored pages (headers included).
        reserved_bytes: Bytes reserved by writes in progress.
        limit_bytes: The most the store holds, or None when unbounded.
        pages: Pages stored, or None where the store cannot count them cheaply.
    """

    used_bytes: int
    reserved_bytes: int
    limit_bytes: int | None
    pages: int | None

    def __post_init__(self) -> None:
        check_count("used_bytes", self.used_bytes)
        check_count("reserved_bytes", self.reserved_bytes)
        if self.limit_bytes is not None:
            check_count("limit_bytes", self.limit_bytes)
        if self.pages is not None:
            check_count("pages", self.pages)

    @property
    def free_bytes(self) -> int | None:
        """Bytes neither used nor reserved, or None when unbounded."""
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.used_bytes - self.reserved_bytes)


class Store(Protocol):
    """A page store: the local-file default or a shared server.

    Every method validates all of its arguments before touching the store, and
    raises :class:`~fsm_cache.errors.BadArgument` for keys or pages that are not
    a sequence (:func:`check_sequence`) and for a key that is not a page key, so
    a refused call changes nothing.
    """

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Return how many leading ``keys`` the store holds (a hint: pages may vanish)."""
        ...

    def get(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Return the leading pages of ``keys`` the store holds, in order, each verified.

        The list is shorter than ``keys`` when a page is missing; pages after the
        first missing one are not read.

        Raises:
            CorruptPage: A page read back is not the page its key names.
            StoreFailed: The store went away.
        """
        ...

    def put(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[PutResult]:
        """Store ``pages`` under ``keys``, in order; return what happened to each page.

        Raises:
            StoreFailed: The store went away part-way; its ``acknowledged``
                leading pages are held, the rest are not known to be (a
                batch whose answer was lost may have landed).
        """
        ...

    def drop(self, keys: Sequence[str]) -> int:
        """Delete ``keys``' pages; return how many were stored.

        Raises:
            PageInUse: A read holds one of them (local store); nothing was dropped.
        """
        ...

    def capacity(self) -> Capacity:
        """Return what the store holds and may hold."""
        ...

    def close(self) -> None:
        """Release the store's connections and files; the pages stay stored."""
        ...
