# mypy: allow-untyped-decorators
"""Contracts on the page allocators, for CrossHair: conservation and single hand-out.

:func:`harness` builds the checked functions for an allocator class, so the
same contracts check :class:`~fsm_cache.memory.pages.PageAllocator` here and a
deliberately broken allocator in ``specs/bugs_detected``. Pool sizes are
bounded by preconditions (at most 4 pages of at most 2 slots): the allocator
does not branch on sizes beyond "enough free pages or not", so small pools
reach every path. Two allocations over those bounds take CrossHair about
12 s per contract to exhaust, hence the longer budget below.
"""

# crosshair: per_condition_timeout=30

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import icontract

from fsm_cache.errors import PoolError
from fsm_cache.memory.pages import PageAllocator, slots_of


class Allocs(NamedTuple):
    """What two allocations from one pool returned, and the pool after them."""

    refused: bool
    first: list[int]
    second: list[int]
    free: int
    used: int
    size: int


class Freed(NamedTuple):
    """A pool after an allocation was freed, and whether a second free was refused."""

    free: int
    size: int
    second_free_refused: bool
    free_after_refusal: int


def harness(allocator: type[PageAllocator], module: str) -> dict[str, Callable[..., Any]]:
    """Return the contract-checked functions for ``allocator``, attributed to ``module``."""
    fns = {"alloc_twice": _alloc_twice(allocator), "alloc_free": _alloc_free(allocator)}
    for fn in fns.values():
        fn.__module__ = module
    return fns


def _alloc_twice(allocator: type[PageAllocator]) -> Callable[..., Allocs]:
    @icontract.require(lambda num_pages, page_size: 0 <= num_pages <= 3 and 1 <= page_size <= 2)
    @icontract.require(lambda first, second: 0 <= first <= 6 and 0 <= second <= 6)
    @icontract.ensure(
        lambda result: result.free + result.used == result.size, "allocation conserves slots"
    )
    @icontract.ensure(
        lambda result: all(s not in result.second for s in result.first),
        "no slot is handed out twice",
    )
    @icontract.ensure(
        lambda result, num_pages, page_size, first, second: (
            result.refused
            == (
                first % page_size != 0
                or second % page_size != 0
                or first + second > num_pages * page_size
            )
        ),
        "an allocation is refused only when misaligned or more than is free",
    )
    def alloc_twice(num_pages: int, page_size: int, first: int, second: int) -> Allocs:
        """Allocate ``first`` then ``second`` slots from a fresh pool."""
        pool = allocator("device", num_pages, page_size)
        try:
            a = slots_of(pool.alloc(first, owner=1), page_size)
            b = slots_of(pool.alloc(second, owner=2), page_size)
        except PoolError:
            return Allocs(True, [], [], pool.free_slots, pool.used_slots, pool.size)
        return Allocs(False, a, b, pool.free_slots, pool.used_slots, pool.size)

    return alloc_twice


def _alloc_free(allocator: type[PageAllocator]) -> Callable[..., Freed]:
    @icontract.require(lambda num_pages, page_size: 0 <= num_pages <= 4 and 1 <= page_size <= 2)
    @icontract.require(lambda num_pages, page_size, n: 1 <= n <= num_pages * page_size)
    @icontract.require(lambda page_size, n: n % page_size == 0)
    @icontract.ensure(lambda result: result.free == result.size, "free gives every slot back")
    @icontract.ensure(lambda result: result.second_free_refused, "a second free is refused")
    @icontract.ensure(
        lambda result: result.free_after_refusal == result.free,
        "a refused free changes nothing",
    )
    def alloc_free(num_pages: int, page_size: int, n: int) -> Freed:
        """Allocate ``n`` slots, free them, then free them again."""
        pool = allocator("host", num_pages, page_size)
        pages = pool.alloc(n, owner=1)
        pool.free(pages, owner=1)
        free = pool.free_slots
        try:
            pool.free(pages, owner=1)
        except PoolError:
            return Freed(free, pool.size, True, pool.free_slots)
        return Freed(free, pool.size, False, pool.free_slots)

    return alloc_free


globals().update(harness(PageAllocator, __name__))
