"""The page allocator: exhaustion, refusals that change nothing, conservation, alignment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fsm_cache.errors import (
    BadArgument,
    DoubleFree,
    ForeignSlot,
    InvariantViolation,
    NotASlot,
    PoolError,
    PoolExhausted,
)
from fsm_cache.memory.pages import FREE, PageAllocator, check_pages, pages_of, slots_of


def snapshot(a: PageAllocator) -> tuple[list[int], list[int]]:
    return list(a.free_list), list(a.owners)


def test_fresh_pool_hands_out_ascending_pages() -> None:
    a = PageAllocator("host", 8, 4)
    assert a.alloc(12, owner=1) == [0, 1, 2]
    assert a.alloc(4, owner=2) == [3]
    assert (a.size, a.free_slots, a.used_slots, a.free_pages) == (32, 16, 16, 4)
    a.check()


def test_exhaustion_message_is_exact_and_nothing_changes() -> None:
    a = PageAllocator("device", 4, 16)
    a.alloc(32)
    before = snapshot(a)
    with pytest.raises(PoolExhausted) as info:
        a.alloc(48)
    assert str(info.value) == "device pool exhausted: requested 48 slots, 32 free"
    assert (info.value.pool, info.value.requested, info.value.free) == ("device", 48, 32)
    assert snapshot(a) == before


def test_unaligned_or_negative_request_is_refused() -> None:
    a = PageAllocator("host", 4, 16)
    with pytest.raises(PoolError) as info:
        a.alloc(17, owner=3)
    assert str(info.value) == "host pool: cannot allocate 17 slots for owner 3 (page_size 16)"
    with pytest.raises(PoolError):
        a.alloc(-16)
    with pytest.raises(PoolError):
        a.alloc(16, owner=FREE)
    assert a.free_pages == 4


def test_zero_slots_is_an_empty_run() -> None:
    a = PageAllocator("host", 0, 16)
    assert a.alloc(0) == []
    a.check()


def test_bad_construction_is_refused() -> None:
    with pytest.raises(PoolError) as info:
        PageAllocator("host", 4, 0)
    assert str(info.value) == "host pool: need ints num_pages >= 0 and page_size >= 1, got 4 and 0"


def test_double_free_is_refused_and_changes_nothing() -> None:
    a = PageAllocator("host", 4, 2)
    pages = a.alloc(4, owner=7)
    a.free(pages, owner=7)
    before = snapshot(a)
    with pytest.raises(DoubleFree) as info:
        a.free(pages, owner=7)
    assert str(info.value) == "host pool: page 0 is already free"
    assert snapshot(a) == before


def test_page_listed_twice_is_a_double_free_and_nothing_is_freed() -> None:
    a = PageAllocator("host", 4, 2)
    a.alloc(6, owner=1)
    before = snapshot(a)
    with pytest.raises(DoubleFree) as info:
        a.free([0, 1, 0], owner=1)
    assert str(info.value) == "host pool: page 0 is listed twice"
    assert snapshot(a) == before


def test_a_held_page_listed_twice_is_named_so_by_free_and_reassign() -> None:
    a = PageAllocator("host", 4, 16)
    first, second = a.alloc(32, owner=5)
    before = snapshot(a)
    with pytest.raises(DoubleFree) as freed:
        a.free([first, second, first], owner=5)
    assert str(freed.value) == f"host pool: page {first} is listed twice"
    with pytest.raises(DoubleFree) as moved:
        a.reassign([second, second], 5, 6)
    assert str(moved.value) == f"host pool: page {second} is listed twice"
    assert snapshot(a) == before


def test_foreign_and_out_of_range_frees_change_nothing() -> None:
    a = PageAllocator("device", 4, 2)
    mine = a.alloc(4, owner=1)
    theirs = a.alloc(2, owner=2)
    before = snapshot(a)
    with pytest.raises(ForeignSlot) as info:
        a.free([*mine, *theirs], owner=1)
    assert str(info.value) == "device pool: page 2 is owned by 2, not 1"
    with pytest.raises(ForeignSlot) as info:
        a.free([mine[0], 4], owner=1)
    assert str(info.value) == "device pool: page 4 outside 0..3"
    with pytest.raises(ForeignSlot):
        a.free([-1], owner=1)
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", ["a", None, 1.5])
def test_a_page_that_is_not_an_int_is_refused_by_name_and_changes_nothing(bad: object) -> None:
    a = PageAllocator("device", 4, 1)
    mine = a.alloc(3, owner=1)
    before = snapshot(a)
    message = f"device pool: page {bad!r} is not an int"
    for call in (
        lambda: a.free([mine[0], bad], owner=1),  # type: ignore[list-item]
        lambda: a.reassign((bad,), owner=1, new_owner=2),  # type: ignore[arg-type]
        lambda: a.owner_of(bad),  # type: ignore[arg-type]
        lambda: a.free([1.0], owner=1),  # type: ignore[list-item]
    ):
        with pytest.raises(ForeignSlot) as info:
            call()
        assert str(info.value) in {message, "device pool: page 1.0 is not an int"}
    assert not a.all_owned_by((bad,), 1)  # type: ignore[arg-type]
    assert snapshot(a) == before


def refuses(a: PageAllocator, given: Any, culprit: object) -> None:
    """Every call of ``a`` on ``given`` (owner 1's) refuses ``culprit``, naming it; nothing moves."""
    before = snapshot(a)
    calls: list[Callable[[], object]] = [
        lambda: a.free(given, owner=1),
        lambda: a.reassign(given, owner=1, new_owner=2),
    ]
    for call in calls:
        with pytest.raises(ForeignSlot) as info:
            call()
        assert str(info.value) == f"device pool: page {culprit!r} is not an int"
    assert (a.owned(given, 1), a.all_owned_by(given, 1)) == (None, False)
    assert snapshot(a) == before


@pytest.mark.parametrize(
    "given",
    [
        *([False, True], [0, True], (0, True), [True, 0], [3, False], [True]),
        *([0, 1.0], (0, 1.0), [0, 1.0, 2], [2, 3.0], (1, 2.0, 3)),
    ],
    ids=[
        *("bools", "a run ending in True", "a tuple run", "True first", "False last", "True"),
        *("a run ending in a float", "a float run", "a float inside", "from page 2", "inside"),
    ],
)
def test_a_bool_or_float_is_no_page_and_every_call_refuses_it_changing_nothing(
    given: list[object],
) -> None:
    """True equals page 1, False page 0 and 1.0 page 1, in a run too: none is a page.

    A run is compared with the pool's pages by value, so each passed as the page it equals.
    """
    a = PageAllocator("device", 4, 1)
    a.alloc(4, owner=1)  # pages 0 to 3
    culprit = next(p for p in given if type(p) in (bool, float))
    refuses(a, given, culprit)
    with pytest.raises(ForeignSlot, match=f"page {culprit!r} is not an int"):
        a.owner_of(culprit)  # type: ignore[arg-type]
    assert a.run_of(given) is None  # type: ignore[arg-type]


def test_a_numpy_bool_is_no_page_either() -> None:
    np = pytest.importorskip("numpy")
    a = PageAllocator("device", 4, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    for given, culprit in (
        ([np.True_], np.True_),
        ([0, np.True_], np.True_),
        (np.array([False, True]), np.False_),
    ):
        refuses(a, given, culprit)


def test_a_numpy_float_is_no_page_in_a_run_either() -> None:
    np = pytest.importorskip("numpy")
    a = PageAllocator("device", 4, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    given = [0, np.float64(1.0)]
    refuses(a, given, given[1])
    assert a.run_of(given) is None


class IndexingBool:
    """A numpy bool as numpy before 2.3 has it (2.2 is the newest on Python 3.10).

    Its ``__index__`` gives 0 or 1 (numpy 2.2 only warns), so it indexes a
    list as page 0 or 1, which numpy 2.3 and later refuse.
    """

    dtype = "bool"

    def __init__(self, value: bool) -> None:
        self.value = value

    def __index__(self) -> int:
        return int(self.value)

    def __eq__(self, other: object) -> bool:
        return other == int(self.value)

    def __lt__(self, other: int) -> bool:
        return int(self.value) < other

    def __gt__(self, other: int) -> bool:
        return int(self.value) > other

    def __le__(self, other: int) -> bool:
        return int(self.value) <= other

    def __ge__(self, other: int) -> bool:
        return int(self.value) >= other

    def __hash__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return f"np.{self.value}_"


@pytest.mark.parametrize(
    "given",
    [
        [IndexingBool(True)],
        [0, IndexingBool(True)],
        [1, IndexingBool(False)],
        [3, IndexingBool(True)],
    ],
    ids=["alone", "after page 0", "before page 1", "not a run"],
)
def test_a_numpy_bool_that_indexes_a_list_is_no_page_either(given: list[object]) -> None:
    """Numpy 2.2's bool indexes the owners as page 0 or 1: the pool refuses it by its dtype."""
    a = PageAllocator("device", 4, 1)
    a.alloc(4, owner=1)  # pages 0 to 3
    culprit = next(p for p in given if type(p) is IndexingBool)
    refuses(a, given, culprit)
    with pytest.raises(ForeignSlot, match=f"page {culprit!r} is not an int"):
        a.owner_of(culprit)  # type: ignore[arg-type]


def test_a_bool_tensor_is_no_page_either() -> None:
    """A bool tensor indexes a list as page 0 or 1: the pool refuses it by its dtype."""
    torch = pytest.importorskip("torch")
    a = PageAllocator("device", 4, 1)
    a.alloc(4, owner=1)  # pages 0 to 3
    true = torch.tensor(True)
    for given, culprit in (
        ([true], true),
        ([0, true], true),
        ([3, true], true),
        (torch.tensor([False, True]), torch.tensor(False)),
    ):
        refuses(a, given, culprit)
    assert a.owned(torch.tensor([0, 1]), 1) == (0, 1)  # an int tensor's pages are pages


@pytest.mark.parametrize("pages", ["numpy", "numpy, not a run", "a run with a numpy integer"])
def test_pages_go_back_to_the_free_list_as_the_pools_own_ints(pages: str) -> None:
    """A page that passed as the page it equals is stored as that page, not as given."""
    np = pytest.importorskip("numpy")
    given: list[object] = [np.int64(0), np.int64(1)]
    if "not" in pages:
        given = given[::-1]
    elif "a run" in pages:
        given = [0, np.int64(1)]
    a = PageAllocator("device", 4, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    a.free(given, owner=1)  # type: ignore[arg-type]
    assert sorted(a.free_list) == [0, 1, 2, 3]
    assert {type(p) for p in a.free_list} == {int}
    assert {type(p) for p in a.alloc(4, owner=2)} == {int}
    a.check()


@pytest.mark.parametrize(
    ("given", "owned"),
    [
        ([0, 1], (0, 1)),
        ((3, 0), (3, 0)),
        ([False, True], None),  # a bool is no page, though it equals one
        ([0, True], None),
        ((0, True), None),
        ([True, 3], None),
        ([0, 1.0], None),  # a float is no page, though it equals one: in a run too
        ((0, 1.0), None),
        ([3, 1.0], None),  # not a run: a float never indexes the pool
        ([1, 1], None),
        ([True, 1], None),
        ([-1, 0], None),
        ([3, 4], None),  # page 4 is outside the pool
        ([0, 2, 3], None),  # page 2 is the other owner's
        ([], ()),
    ],
)
def test_owned_pages_come_back_as_the_pools_own_ints(
    given: list[object], owned: tuple[int, ...] | None
) -> None:
    """``owned`` is ``all_owned_by`` that also hands back the pool's page objects."""
    a = PageAllocator("device", 4, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    a.alloc(1, owner=2)  # page 2
    a.alloc(1, owner=1)  # page 3
    before = snapshot(a)
    got = a.owned(given, 1)  # type: ignore[arg-type]
    assert got == owned
    assert a.all_owned_by(given, 1) is (owned is not None)  # type: ignore[arg-type]
    if got:
        assert [type(p) for p in got] == [int] * len(got)
        assert all(p is a.owned((p,), 1)[0] for p in got)  # type: ignore[index]
    assert snapshot(a) == before


def test_numpy_pages_are_checked_as_the_pages_they_stand_for() -> None:
    """An array of pages is no truth value, and a numpy page fault names the page itself."""
    np = pytest.importorskip("numpy")
    a = PageAllocator("device", 8, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    assert a.owned(np.array([0]), 1) == (0,)
    assert a.owned(np.array([1, 0]), 1) == (1, 0)
    assert a.owned(np.array([], dtype=np.int64), 1) == ()
    assert a.owned(np.array([0, 5]), 1) is None
    assert a.all_owned_by(np.array([0]), 2) is False
    assert a.owner_of(np.int64(1)) == 1
    with pytest.raises(DoubleFree) as freed:
        a.free([np.int64(0), np.int64(5)], owner=1)
    assert str(freed.value) == "device pool: page 5 is already free"
    with pytest.raises(ForeignSlot) as caught:
        a.owner_of(np.int64(9))
    assert str(caught.value) == "device pool: page 9 outside 0..7"
    assert sorted(a.free_list) == [2, 3, 4, 5, 6, 7]


def test_reassign_moves_ownership_for_a_split() -> None:
    a = PageAllocator("device", 4, 2)
    pages = a.alloc(8, owner=1)
    a.reassign(pages[2:], owner=1, new_owner=9)
    assert [a.owner_of(p) for p in pages] == [1, 1, 9, 9]
    with pytest.raises(ForeignSlot):
        a.free(pages, owner=1)
    a.free(pages[:2], owner=1)
    a.free(pages[2:], owner=9)
    assert a.free_pages == 4
    with pytest.raises(DoubleFree):
        a.reassign(pages[:1], owner=1, new_owner=2)
    with pytest.raises(PoolError):
        a.reassign(pages[:1], owner=1, new_owner=-5)


def test_free_pages_are_no_owners_own_to_free_or_hand_over() -> None:
    """FREE owns no page: free pages passed as its own were listed twice, or handed out."""
    a = PageAllocator("device", 4, 1)
    before = snapshot(a)
    calls: list[Callable[[], None]] = [
        lambda: a.free([0, 1], FREE),
        lambda: a.reassign([0], FREE, 5),
    ]
    for call in calls:
        with pytest.raises(PoolError) as info:
            call()
        assert str(info.value) == "device pool: owner must be an integer >= 0, got -1"
        assert snapshot(a) == before
    a.check()
    assert a.alloc(4, owner=1) == [0, 1, 2, 3]  # each page once


@pytest.mark.parametrize("bad", [-5, FREE, 2.5, True, None, "7"])
def test_an_owner_that_is_no_integer_at_least_0_is_refused_whole(bad: object) -> None:
    a = PageAllocator("device", 4, 2)
    pages = a.alloc(4, owner=1)
    before = snapshot(a)
    message = f"device pool: owner must be an integer >= 0, got {bad!r}"
    calls: list[Callable[[], None]] = [
        lambda: a.reassign(pages, owner=1, new_owner=bad),  # type: ignore[arg-type]
        lambda: a.reassign(pages, owner=bad, new_owner=2),  # type: ignore[arg-type]
        lambda: a.free(pages, owner=bad),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(PoolError) as info:
            call()
        assert str(info.value) == message
        assert snapshot(a) == before


def test_pages_as_a_numpy_array_are_freed_as_a_list_is() -> None:
    np = pytest.importorskip("numpy")
    a = PageAllocator("device", 4, 1)
    pages = a.alloc(3, owner=np.int64(2))
    a.reassign(np.array(pages), 2, np.int64(3))
    a.free(np.array(pages), owner=3)
    a.check()
    assert a.free_pages == 4
    assert all(type(p) is int for p in a.free_list)  # the pool's own pages, not numpy's


def test_owner_of_reports_free_and_refuses_out_of_range() -> None:
    a = PageAllocator("host", 2, 1)
    assert a.owner_of(1) == FREE
    with pytest.raises(ForeignSlot):
        a.owner_of(2)


def test_slots_are_whole_aligned_pages() -> None:
    assert slots_of([2, 0], 4) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert pages_of([8, 9, 10, 11, 0, 1, 2, 3], 4) == [2, 0]
    with pytest.raises(ForeignSlot) as info:
        pages_of([1, 2, 3], 4)
    assert str(info.value) == "3 slots is not a multiple of page_size 4"
    with pytest.raises(ForeignSlot) as info:
        pages_of([1, 2, 3, 4], 4)
    assert str(info.value) == "slots are not whole pages of size 4"


@pytest.mark.parametrize(
    ("slots", "odd"),
    [([0.0, 1, 2, 3], 0.0), ([4, 5, 6, 7.0], 7.0), ([8, 9, 10, 11, 4.0, 5, 6, 7], 4.0)],
    ids=["first of a run", "last of a run", "first of a page out of order"],
)
def test_a_float_slot_at_a_page_size_above_one_is_refused(slots: list[float], odd: float) -> None:
    """A float where a range needs an int raised a bare TypeError out of pages_of."""
    with pytest.raises(ForeignSlot) as info:
        pages_of(slots, 4)  # type: ignore[arg-type]
    assert str(info.value) == f"slot {odd!r} is not an int"


@pytest.mark.parametrize(
    ("slots", "odd"),
    [([True] * 4, True), ([4, 5, True], True), ([0, 1, 2, 3, 4, False, 6, 7], False)],
    ids=["not whole pages", "not a multiple of the page size", "not page-aligned"],
)
def test_a_bool_slot_is_named_before_what_else_is_wrong(slots: list[int], odd: bool) -> None:
    """A bool equals slot 0 or 1, and is no slot: that, not the other fault, is the refusal."""
    with pytest.raises(NotASlot) as info:
        pages_of(slots, 4)
    assert isinstance(info.value, BadArgument)
    assert str(info.value) == f"slot {odd!r} is not an int"


def test_a_bool_page_is_named_before_a_page_that_is_free() -> None:
    """The pool names the bool (a BadArgument too), not the free page listed before it."""
    a = PageAllocator("device", 4, 1)
    a.alloc(2, owner=1)  # pages 0 and 1
    before = snapshot(a)
    calls: list[Callable[[], None]] = [
        lambda: a.free([3, True], owner=1),
        lambda: a.reassign([3, True], 1, 2),
    ]
    for call in calls:
        with pytest.raises(NotASlot) as info:
            call()
        assert isinstance(info.value, BadArgument)
        assert str(info.value) == "device pool: page True is not an int"
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda free, owners: free.append(free[-1]), "host pool: a page is on the free list twice"),
        (
            lambda free, owners: owners.__setitem__(free[0], 5),
            "host pool: free-listed page 3 is owned",
        ),
        (
            lambda free, owners: free.pop(),
            "host pool: conservation broken: 1 free + 2 used != 4 pages",
        ),
    ],
)
def test_check_names_what_broke(
    corrupt: Callable[[list[int], list[int]], object], message: str
) -> None:
    a = PageAllocator("host", 4, 1)
    a.alloc(2)
    a.check()
    free, owners = snapshot(a)
    corrupt(free, owners)
    with pytest.raises(InvariantViolation) as info:
        check_pages(a.name, a.num_pages, free, owners)
    assert str(info.value) == message


def test_views_are_read_only_snapshots() -> None:
    a = PageAllocator("host", 4, 1)
    a.alloc(1, owner=3)
    assert (a.free_list, a.owners) == ((3, 2, 1), (3, FREE, FREE, FREE))
    assert isinstance(a.free_list, tuple)
    assert isinstance(a.owners, tuple)


def test_importing_pools_does_not_import_torch() -> None:
    code = "import sys, fsm_cache.memory.pages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/reassign sequences against a model of who owns what."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PageAllocator("host", 16, 4)
        self.held: dict[int, list[int]] = {}

    @rule(owner=st.integers(0, 5), pages=st.integers(0, 20))
    def alloc(self, owner: int, pages: int) -> None:
        free = self.pool.free_pages
        if pages > free:
            with pytest.raises(PoolExhausted):
                self.pool.alloc(pages * 4, owner)
            return
        got = self.pool.alloc(pages * 4, owner)
        owned = {p for run in self.held.values() for p in run}
        assert len(got) == pages
        assert not owned.intersection(got)
        self.held.setdefault(owner, []).extend(got)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, r in self.held.items() if r)))
        run = self.held[owner]
        k = data.draw(st.integers(1, len(run)))
        self.pool.free(run[:k], owner)
        self.held[owner] = run[k:]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def refused_free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, r in self.held.items() if r)))
        page = self.held[owner][0]
        before = snapshot(self.pool)
        with pytest.raises((DoubleFree, ForeignSlot)):
            self.pool.free([page, page], owner)
        with pytest.raises(ForeignSlot):
            self.pool.free([page], owner + 1)
        assert snapshot(self.pool) == before

    @rule(
        pages=st.lists(st.integers(0, 15), max_size=4),
        owner=st.integers(FREE - 1, 6),
        new_owner=st.integers(FREE - 1, 6),
    )
    def free_or_reassign_anything(self, pages: list[int], owner: int, new_owner: int) -> None:
        """Any pages, free ones included, by any owner: done exactly when the model allows."""
        allowed = (
            owner >= 0
            and len(set(pages)) == len(pages)
            and all(p in self.held.get(owner, ()) for p in pages)
        )
        before = snapshot(self.pool)
        with pytest.raises(PoolError) if not allowed or new_owner < 0 else nullcontext():
            self.pool.reassign(pages, owner, new_owner)
            self.pool.reassign(pages, new_owner, owner)  # and back, so the model stays
        assert snapshot(self.pool) == before
        if not allowed:
            with pytest.raises(PoolError):
                self.pool.free(pages, owner)
            assert snapshot(self.pool) == before
            return
        self.pool.free(pages, owner)
        self.held[owner] = [p for p in self.held.get(owner, []) if p not in pages]

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), new_owner=st.integers(0, 5))
    def reassign(self, data: st.DataObject, new_owner: int) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, r in self.held.items() if r)))
        page = self.held[owner].pop()
        self.pool.reassign([page], owner, new_owner)
        self.held.setdefault(new_owner, []).append(page)

    @invariant()
    def conserves(self) -> None:
        self.pool.check()
        owned = [p for run in self.held.values() for p in run]
        assert len(owned) == len(set(owned))
        assert self.pool.used_slots == 4 * len(owned)
        assert self.pool.free_slots + self.pool.used_slots == self.pool.size
        for owner, run in self.held.items():
            assert all(self.pool.owner_of(p) == owner for p in run)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize(
    ("slots", "owner"), [(32.0, 1), (True, 1), ("32", 1), (32, 1.5), (32, None)]
)
def test_an_allocation_of_no_integer_size_or_owner_is_refused_whole(
    slots: object, owner: object
) -> None:
    a = PageAllocator("host", 4, 16)
    before = snapshot(a)
    with pytest.raises(PoolError) as info:
        a.alloc(slots, owner=owner)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"host pool: cannot allocate {slots!r} slots for owner {owner!r}: both must be integers"
    )
    assert snapshot(a) == before


@pytest.mark.parametrize(("pages", "size"), [(2.5, 16), (4, 1.5), (None, 16), (True, 16)])
def test_an_allocator_of_no_integer_size_is_refused(pages: object, size: object) -> None:
    with pytest.raises(PoolError) as info:
        PageAllocator("host", pages, size)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"host pool: need ints num_pages >= 0 and page_size >= 1, got {pages} and {size}"
    )


def test_an_empty_allocator_says_it_has_no_pages() -> None:
    with pytest.raises(ForeignSlot) as info:
        PageAllocator("device", 0, 16).owner_of(0)
    assert str(info.value) == "device pool: page 0 outside the pool, which has no pages"
