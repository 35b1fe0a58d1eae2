"""Page-granular slot allocators for the device and host KV pools.

Pure Python and torch-free, so that CrossHair can analyse it and so that the
cache's accounting can be tested without tensors. A pool of ``num_pages``
pages holds ``num_pages * page_size`` slots; slot ``s`` lives in page
``s // page_size``. The allocator hands out and takes back whole pages, named
by their page index; :func:`slots_of` expands pages into slot indices.

Every used page records its owner (a node id), so a free by the wrong owner is
refused, and :meth:`PageAllocator.check` can verify conservation at any time.
Every refusal raises a :class:`~fsm_cache.errors.PoolError` and changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat

from fsm_cache.errors import (
    DoubleFree,
    ForeignSlot,
    InvariantViolation,
    NotASlot,
    PoolError,
    PoolExhausted,
)
from fsm_cache.numeric import as_index, boolean, whole


FREE = -1
"""The owner recorded for a page that is free; real owners are ``>= 0``."""

REQUEST = 0
"""The owner of pages a request holds (tree nodes own theirs by node id, from 1)."""


def slots_of(pages: Iterable[int], page_size: int) -> list[int]:
    """Return the slot indices of ``pages``, page by page, in order.

    Postcondition: the result has ``len(pages) * page_size`` entries and page
    ``p`` contributes ``p*page_size .. p*page_size + page_size - 1``.
    """
    pages = list(pages)
    if page_size == 1:  # every page is one slot
        return pages
    if run_start(pages) is not None:  # pages handed out together: one range of slots
        return list(range(pages[0] * page_size, (pages[-1] + 1) * page_size))
    return list(chain.from_iterable(range(p * page_size, (p + 1) * page_size) for p in pages))


def pages_of(slots: Sequence[int], page_size: int) -> list[int]:
    """Return the pages whose slots are exactly ``slots`` (the inverse of :func:`slots_of`).

    A bool is no slot, though it equals 0 or 1; at page size 1 the slots are
    the pages, which the pool refuses as bools itself. A bool among slots
    that are refused for another reason too (too few, not whole pages) is
    what the refusal names: it is the fault the caller has to see first.

    Raises:
        NotASlot: A slot is a bool, or no int (a float).
        ForeignSlot: ``slots`` is not a run of whole, aligned pages.
    """
    try:
        if len(slots) % page_size:
            raise ForeignSlot(f"{len(slots)} slots is not a multiple of page_size {page_size}")
        if page_size == 1:  # every slot is a whole page
            return list(slots)
        return _pages_of(slots, page_size)
    except (ForeignSlot, TypeError) as refused:  # a TypeError: a float where a range needs an int
        _refuse_bools(slots)
        if isinstance(refused, ForeignSlot):
            raise
        odd = next(s for s in slots if not hasattr(s, "__index__"))
        raise NotASlot(f"slot {odd!r} is not an int") from None


def _pages_of(slots: Sequence[int], page_size: int) -> list[int]:
    """:func:`pages_of` at a page size above one; a float where a range needs an int raises TypeError."""
    if slots and slots[0] % page_size == 0 and run_start(slots) is not None:
        if slots[0] == 0:  # only page 0's first two slots can be bools
            _refuse_bools(slots[:2])
        return list(range(slots[0] // page_size, (slots[-1] + 1) // page_size))
    pages = [s // page_size for s in slots[::page_size]]
    if slots_of(pages, page_size) != list(slots):
        raise ForeignSlot(f"slots are not whole pages of size {page_size}")
    if 0 in pages:
        at = pages.index(0) * page_size
        _refuse_bools(slots[at : at + 2])
    return pages


def _refuse_bools(slots: Sequence[int]) -> None:
    """Refuse a bool among ``slots``: it equals slot 0 or 1, and is none.

    Raises:
        NotASlot: One of ``slots`` is a bool, naming the first.
    """
    for slot in slots:
        if boolean(slot):
            raise NotASlot(f"slot {slot!r} is not an int") from None


def _holds_bool(pages: Sequence[int]) -> bool:
    """Whether ``pages`` (ints, or what stands for them) hold a bool: Python's, numpy's, torch's.

    A bool equals page 0 or 1 and indexes a list as that page, so the checks
    by value take it. So does a bool tensor, and a numpy bool on numpy
    before 2.3 (2.2 is the newest on Python 3.10: its ``__index__`` only
    warns; later ones index nothing). An array or a tensor of pages says by
    its dtype; in a list, the types are gathered in one loop in C, and only
    pages of a type other than ``int`` (rare) are looked at one by one.
    """
    if getattr(pages, "dtype", None) is not None:  # an array or tensor: its pages share its dtype
        return boolean(pages)
    kinds = set(map(type, pages))
    if bool in kinds:
        return True
    kinds.discard(int)
    return bool(kinds) and any(boolean(page) for page in pages if type(page) in kinds)


def _ints(run: Sequence[int]) -> bool:
    """Whether ``run``, equal page by page to a run of the pool's pages, holds only ints.

    A float (``1.0``, numpy's) equals the page it would stand for, so the
    comparison of a run by value takes it, though it is no page. A sum of
    ints is an int, and one float (or numpy number) among them makes it
    another type: one loop in C, paid once per call where a run is found (a
    numpy integer in a run sends it to the general checks, which take it).
    """
    return type(sum(run)) is int


def outside(num_pages: int) -> str:
    """How a refusal says a page is not in a pool of ``num_pages`` pages (one may have none)."""
    if num_pages:
        return f"outside 0..{num_pages - 1}"
    return "outside the pool, which has no pages"


def page_index(name: str, num_pages: int, page: object) -> int:
    """Return the int ``page`` stands for, refusing it unless it is a page of the pool.

    The one test of a single page that the allocator and the KV pools
    (:meth:`~fsm_cache.memory.kv.KVPool.check_pages`) share, so both take and
    word the same pages: a numpy integer or a one-element integer tensor is
    the page it stands for (:func:`~fsm_cache.numeric.as_index`), as the
    argument checks take it; a bool is no page, though it equals page 0 or 1,
    and neither is a float.

    Args:
        name: The pool's name in messages (``device``, ``host``).
        num_pages: Pages in the pool.
        page: What the caller gave as a page.

    Raises:
        NotASlot: ``page`` is not an int (``device pool: page True is not an int``).
        ForeignSlot: ``page`` is outside ``0..num_pages - 1``.
    """
    index = page if type(page) is int else as_index(page)
    if index is None:
        raise NotASlot(f"{name} pool: page {page!r} is not an int")
    if not 0 <= index < num_pages:
        raise ForeignSlot(f"{name} pool: page {index} {outside(num_pages)}")
    return index


def run_start(pages: Sequence[int]) -> int | None:
    """Return the first page if ``pages`` is one run of consecutive ascending pages, else None.

    The test runs in C (one comparison with a ``range``), so the common case of
    pages handed out together costs no Python loop.
    """
    if not pages:
        return None
    first = pages[0]
    if pages[-1] - first != len(pages) - 1:
        return None
    if len(pages) > 2:
        run = range(first, first + len(pages))
        if (pages != tuple(run)) if isinstance(pages, tuple) else (list(pages) != list(run)):
            return None
    return first


@dataclass
class PageAllocator:
    """Free-list allocator of whole pages, with an owner per used page.

    Invariants (checked by :meth:`check`): ``len(free) + used == num_pages``;
    each free page appears once in the free list and has owner ``FREE``; each
    used page has exactly one owner ``>= 0``.

    Attributes:
        name: The pool's name in messages (``device``, ``host``).
        num_pages: Pages in the pool; ``>= 0``.
        page_size: Slots per page; ``>= 1``.
    """

    name: str
    num_pages: int
    page_size: int
    _free: list[int] = field(init=False, repr=False)
    _index: list[int] = field(init=False, repr=False)
    _last_run: tuple[int, ...] = field(init=False, repr=False)
    _verified: tuple[int, ...] = field(init=False, repr=False)
    _verified_owner: int = field(init=False, repr=False)
    _owner: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not whole(self.num_pages) or not whole(self.page_size, 1):
            raise PoolError(
                f"{self.name} pool: need ints num_pages >= 0 and page_size >= 1, "
                f"got {self.num_pages} and {self.page_size}"
            )
        # A stack popped from the end: fresh pools hand out ascending runs.
        # Page numbers as int objects shared by the free list and every run handed out, so
        # that _is_run compares a run with its slice of _index by identity, in C.
        self._index = list(range(self.num_pages))
        self._free = self._index[::-1]
        self._last_run: tuple[int, ...] = ()
        self._verified: tuple[int, ...] = ()  # pages all_owned_by last found owned ...
        self._verified_owner = FREE  # ... by this owner, until an owner changes
        self._owner = [FREE] * self.num_pages

    @property
    def size(self) -> int:
        """Slots in the pool."""
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages currently free."""
        return len(self._free)

    @property
    def free_slots(self) -> int:
        """Slots currently free."""
        return len(self._free) * self.page_size

    @property
    def used_slots(self) -> int:
        """Slots currently owned."""
        return self.size - self.free_slots

    @property
    def free_list(self) -> tuple[int, ...]:
        """The free pages, in the order of the stack: the last is handed out first."""
        return tuple(self._free)

    @property
    def owners(self) -> tuple[int, ...]:
        """The owner of each page, by page index (``FREE`` for a free page)."""
        return tuple(self._owner)

    def alloc(self, num_slots: int, owner: int = REQUEST) -> list[int]:
        """Take ``num_slots // page_size`` free pages for ``owner``.

        Preconditions: ``num_slots >= 0`` and a multiple of ``page_size``;
        ``owner >= 0``. Postcondition: the pages returned were free and are now
        owned by ``owner``; ``free_slots`` dropped by ``num_slots``.

        Raises:
            PoolError: ``num_slots`` is negative, not page-aligned or not an
                integer (a bool is not), or ``owner`` is not an integer ``>= 0``.
            PoolExhausted: fewer than ``num_slots`` slots are free.
        """
        if (type(num_slots) is not int or type(owner) is not int) and (
            as_index(num_slots) is None or as_index(owner) is None
        ):  # a float would pass the checks below and fail half-way; a numpy integer is fine
            raise PoolError(
                f"{self.name} pool: cannot allocate {num_slots!r} slots for owner {owner!r}: "
                "both must be integers"
            )
        if num_slots < 0 or num_slots % self.page_size or owner < 0:
            raise PoolError(
                f"{self.name} pool: cannot allocate {num_slots} slots for owner {owner} "
                f"(page_size {self.page_size})"
            )
        n = num_slots // self.page_size
        if n > len(self._free):
            raise PoolExhausted(self.name, num_slots, self.free_slots)
        if n == 0:
            return []
        pages = self._free[: -n - 1 : -1]  # the top n, last pushed first: one copy
        del self._free[-n:]
        self._set_owner(pages, owner)
        return pages

    def free(self, pages: Sequence[int], owner: int = REQUEST) -> None:
        """Give ``pages`` back; all of them, or none if any is refused.

        Precondition: every page is in range, used, owned by ``owner``, and
        listed once. Postcondition: those pages are free.

        Raises:
            PoolError: ``owner`` is not an integer ``>= 0`` (``FREE`` owns no
                page: free pages would pass as its own and be listed twice).
            NotASlot: a page is not an int (a bool is not), named before any
                other fault.
            ForeignSlot: a page is out of range, or owned by someone else.
            DoubleFree: a page is already free or listed twice.
        """
        self._check_owner(owner)
        run = self._check_owned(pages, owner)
        self._set_owner(pages, FREE, run)
        # The pool's own page objects, never the caller's: a numpy integer that
        # passed as the page it equals must not be handed out later.
        if run:
            first = pages[0]
            self._free.extend(reversed(self._index[first : first + len(pages)]))
        else:
            self._free.extend(map(self._index.__getitem__, reversed(pages)))

    def reassign(self, pages: Sequence[int], owner: int, new_owner: int) -> None:
        """Hand ``pages`` from ``owner`` to ``new_owner`` (a radix split); all or none.

        Raises:
            PoolError: ``owner`` or ``new_owner`` is not an integer ``>= 0``
                (``FREE`` owns no page: free pages would be handed out while
                still on the free list).
            NotASlot: a page is not an int (a bool is not), named before any
                other fault.
            ForeignSlot: a page is out of range, or owned by someone else.
            DoubleFree: a page is free or listed twice.
        """
        self._check_owner(owner)
        self._check_owner(new_owner)
        self._set_owner(pages, new_owner, self._check_owned(pages, owner))

    def owner_of(self, page: int) -> int:
        """Return the owner of ``page``, or ``FREE``.

        Raises:
            NotASlot: ``page`` is not an int (a bool is not).
            ForeignSlot: ``page`` is outside the pool.
        """
        return self._owner[self._check_range(page)]

    def all_owned_by(self, pages: Sequence[int], owner: int) -> bool:
        """Return whether every page of ``pages`` is in the pool, owned by ``owner``, listed once.

        A bool is no page (though it equals page 0 or 1): False.

        A fast test (its loops run in C) for the checks that then name the
        first page at fault when it is False.
        """
        return self._owned_run(pages, owner) is not None

    def _owned_run(self, pages: Sequence[int], owner: int) -> bool | None:
        """:meth:`all_owned_by`, saying how: None where it is False, else whether ``pages`` is a run.

        A run (:meth:`_is_run`) is found once, for the check and for the
        update after it.
        """
        if len(pages) == 0:  # not ``not pages``: a numpy array has no truth value
            return False
        if pages is self._verified and owner == self._verified_owner:
            # this very tuple passed for this owner, and no owner changed since
            return self._is_run(pages)
        run = self._is_run(pages)
        if run and _ints(pages):  # distinct and in range
            first = pages[0]
            found = self._owner[first : first + len(pages)].count(owner) == len(pages)
        else:
            found = self._each_owned_by(pages, owner)
        if not found:
            return None
        if type(pages) is tuple:
            self._verified, self._verified_owner = pages, owner
        return run

    def _each_owned_by(self, pages: Sequence[int], owner: int) -> bool:
        """:meth:`all_owned_by` of pages that are not a run of ints (its loops run in C too)."""
        try:
            low = min(pages)
            if low < 0 or max(pages) >= self.num_pages or len(set(pages)) != len(pages):
                return False
            if low <= 1 and _holds_bool(pages):  # only pages 0 and 1 can be bools
                return False
            return list(map(self._owner.__getitem__, pages)).count(owner) == len(pages)
        except TypeError:  # a page that is not an int: the caller's check names it
            return False

    def owned(self, pages: Sequence[int], owner: int) -> tuple[int, ...] | None:
        """Return ``pages`` as the pool's own page ints if :meth:`all_owned_by` holds, else None.

        For a caller that keeps pages it was given: a numpy integer that
        equals a page becomes the page itself (a bool, which equals page 0 or
        1, is no page: None), and the pages kept take the identity shortcuts of the
        pool's later checks. The result is remembered as checked, like a
        tuple :meth:`all_owned_by` found owned.
        """
        n = len(pages)  # not ``not pages``: a numpy array has no truth value
        if n == 0:
            return ()
        own = self._own_run(pages)
        if own is not None:  # distinct and in range
            first = own[0]
            if self._owner[first : first + n].count(owner) != n:
                return None
            self._last_run = own
        else:
            try:
                low = min(pages)
                if (
                    low < 0
                    or max(pages) >= self.num_pages
                    or len(set(pages)) != n
                    or (low <= 1 and _holds_bool(pages))  # only pages 0 and 1 can be bools
                ):
                    return None
                own = tuple(map(self._index.__getitem__, pages))  # a float raises here
            except TypeError:  # a page that is not an int: the caller's check names it
                return None
            if list(map(self._owner.__getitem__, own)).count(owner) != n:
                return None
        self._verified, self._verified_owner = own, owner
        return own

    def _own_run(self, pages: Sequence[int]) -> tuple[int, ...] | None:
        """The pool's own pages of the run ``pages`` is (a list or tuple), else None.

        :meth:`_is_run`, returning the slice of ``_index`` it compares with.
        """
        first = pages[0]
        if type(first) is not int or type(pages) not in (list, tuple):
            return None
        n = len(pages)
        if not 0 <= first <= self.num_pages - n or pages[-1] != first + n - 1:
            return None
        if first == 0 and n > 1 and boolean(pages[1]):  # True equals page 1: no run of pages
            return None
        run = self._index[first : first + n]
        own = tuple(run)
        if not (pages == run if type(pages) is list else pages == own):
            return None
        return own if _ints(pages) else None

    def run_of(self, pages: Sequence[int]) -> int | None:
        """Return the first page if ``pages`` is one ascending run inside this pool, else None.

        :func:`run_start` for pages of this pool, several times cheaper on the
        pages it handed out: they are compared with the pool's own page
        numbers by identity, in C. A run is distinct and in range, so a caller
        that gets a page back need not check either. Pages in any other
        sequence (an array, a tensor: no truth value to test) answer None.
        """
        if (type(pages) is tuple or type(pages) is list) and pages and self._is_run(pages):
            first: int = pages[0]
            return first if _ints(pages) else None
        return None

    def _is_run(self, pages: Sequence[int]) -> bool:
        """Return whether ``pages`` is ``p, p + 1, ...`` inside the pool (as fresh pools hand out).

        Compared in C with the run's slice of ``_index``; other sequences than
        lists and tuples take the general paths.
        """
        if pages is self._last_run:
            return True
        first, n = pages[0], len(pages)
        if type(first) is not int or not 0 <= first <= self.num_pages - n:
            return False
        if pages[-1] != first + n - 1 or (first == 0 and n > 1 and boolean(pages[1])):
            return False  # not a run; or True in it, equal to page 1 but no page
        run = self._index[first : first + n]
        if isinstance(pages, list):
            return pages == run
        if type(pages) is tuple and pages == tuple(run):
            self._last_run = pages  # immutable: a check and the update after it test it once
            return True
        return False

    def _set_owner(self, pages: Sequence[int], owner: int, run: bool | None = None) -> None:
        """Record ``owner`` for each of ``pages``, which are distinct (every caller checked that).

        A run of pages is one slice assignment, in C, instead of a loop.
        ``run`` says whether ``pages`` is one (:meth:`_is_run`), if the caller knows.
        """
        if len(pages) == 0:  # not ``not pages``: a numpy array has no truth value
            return
        self._verified = ()  # every earlier ownership check is void now
        if self._is_run(pages) if run is None else run:
            first = pages[0]
            self._owner[first : first + len(pages)] = [owner] * len(pages)
        else:
            deque(map(self._owner.__setitem__, pages, repeat(owner)), maxlen=0)  # a loop in C

    def _check_range(self, page: object) -> int:
        """Return the int ``page`` stands for (:func:`page_index` in this pool)."""
        return page_index(self.name, self.num_pages, page)

    def _check_owner(self, owner: int) -> None:
        """Refuse an owner that is not an integer ``>= 0``, as :meth:`alloc` takes them.

        ``FREE`` in particular: every free page is recorded as its, so the
        ownership checks would pass free pages for it.
        """
        if type(owner) is int and owner >= 0:
            return  # the common case
        index = as_index(owner)
        if index is None or index < 0:
            raise PoolError(f"{self.name} pool: owner must be an integer >= 0, got {owner!r}")

    def _check_owned(self, pages: Sequence[int], owner: int) -> bool:
        """Refuse ``pages`` unless all are in the pool, owned by ``owner``, listed once.

        Returns:
            Whether ``pages`` is a run (:meth:`_is_run`), for the update after.

        Raises:
            NotASlot: A page is not an int (a bool, named before any other fault).
            ForeignSlot: A page is out of range, or another owner's.
            DoubleFree: A page is free or listed twice.
        """
        run = self._owned_run(pages, owner)
        if run is not None:
            return run  # the common case, checked in C; otherwise name the first fault
        for p in pages:  # a bool first: it equals page 0 or 1, so the checks below may take it
            if boolean(p):
                self._check_range(p)
        seen: set[int] = set()
        for p in pages:
            self._check_range(p)
            if p in seen:
                raise DoubleFree(f"{self.name} pool: page {p} is listed twice")
            held = self._owner[p]
            if held == FREE:
                raise DoubleFree(f"{self.name} pool: page {p} is already free")
            if held != owner:
                raise ForeignSlot(f"{self.name} pool: page {p} is owned by {held}, not {owner}")
            seen.add(p)
        return len(pages) > 0 and self._is_run(pages)

    def check(self) -> None:
        """Verify conservation and single ownership (:func:`check_pages` of this pool).

        Raises:
            InvariantViolation: naming the first broken invariant.
        """
        check_pages(self.name, self.num_pages, self._free, self._owner)


def check_pages(name: str, num_pages: int, free: Sequence[int], owners: Sequence[int]) -> None:
    """Verify a pool's free list and owners: the invariants :meth:`PageAllocator.check` checks.

    Args:
        name: The pool's name in messages.
        num_pages: Pages in the pool.
        free: The free list (:attr:`PageAllocator.free_list`).
        owners: The owner of each page (:attr:`PageAllocator.owners`).

    Raises:
        InvariantViolation: naming the first broken invariant.
    """
    if len(set(free)) != len(free):
        raise InvariantViolation(f"{name} pool: a page is on the free list twice")
    for p in free:
        if not 0 <= p < num_pages or owners[p] != FREE:
            raise InvariantViolation(f"{name} pool: free-listed page {p} is owned")
    used = sum(1 for o in owners if o != FREE)
    if used + len(free) != num_pages:
        raise InvariantViolation(
            f"{name} pool: conservation broken: {len(free)} free + {used} used != {num_pages} pages"
        )
