"""The held-slots fast paths of issue 15 give the answers of the general paths.

Each shortcut (a checked :class:`TokenKey`, the tree's last walk, match
results that flatten their pages on first read, page runs recognised in C)
is compared with what the cache answers without it, on workloads that make
the shortcut's reason to be stale happen: splits, evictions, deletions, and
pages freed and handed out again in another order.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_cache import TokenKey
from fsm_cache.cache.hicache import HiCache
from fsm_cache.cache.replay import replay
from fsm_cache.errors import BadArgument, DoubleFree, ForeignSlot
from fsm_cache.memory.pages import PageAllocator, pages_of, run_start, slots_of
from fsm_cache.memory.tickets import PageSet
from fsm_cache.memory.tiers import CacheConfig


def make(page: int = 2, pages: int = 64, host: int = 0) -> HiCache:
    """A small debug-mode cache: every operation checks every invariant after it."""
    return HiCache(
        CacheConfig(
            device_pages=pages,
            host_pages=host,
            page_size=page,
            layers=1,
            heads=1,
            head_dim=4,
            debug=True,
        )
    )


def serve(cache: HiCache, tokens: list[int] | TokenKey) -> tuple[int, tuple[int, ...]]:
    """Match, evict if short, insert with held slots, free the cached part; the answers."""
    match = cache.match_prefix(tokens)
    page = cache.config.page_size
    need = len(tokens) - len(tokens) % page - match.device_len
    free = cache.tiers.device.allocator.free_slots
    if need > free:
        cache.evict(need - free)
    held = cache.alloc_slots(need)
    cached = cache.insert(tokens, slots_of(match.device_pages, page) + held)
    return cached, match.device_pages


class TestTokenKey:
    def test_is_checked_when_built_with_the_cache_message(self) -> None:
        with pytest.raises(BadArgument) as caught:
            TokenKey([3, -1])
        assert str(caught.value) == "TokenKey: tokens[1] is -1; ids and slots are 0 <= id < 2**64"
        with pytest.raises(BadArgument) as caught:
            TokenKey("abc")  # type: ignore[arg-type]
        assert str(caught.value) == "TokenKey: tokens must be a sequence of ints, got str"

    def test_holds_python_ints_from_a_tensor(self) -> None:
        key = TokenKey(torch.tensor([5, 6, 7]))
        assert key == (5, 6, 7)
        assert all(type(t) is int for t in key)

    def test_ids_that_stand_for_ints_are_held_as_ints(self) -> None:
        ids = torch.arange(100, 104)
        for passed in (
            list(ids),
            [100, *list(ids[1:3]), 103],
            [np.int64(i) for i in range(100, 104)],
        ):
            key = TokenKey(passed)
            assert key == (100, 101, 102, 103)
            assert [type(t) for t in key] == [int] * 4

    def test_a_bool_tensor_among_the_ids_is_refused(self) -> None:
        with pytest.raises(BadArgument) as caught:
            TokenKey([7, *list(torch.tensor([True, False]))])
        assert str(caught.value) == "TokenKey: tokens[1] is tensor(True), not an int"

    def test_a_list_of_tensor_ids_matches_what_it_inserted(self) -> None:
        """A list(tensor) of ids was kept as tensors, hashed by identity: never matched again."""
        cache = make(page=2)
        ids = torch.arange(100, 108)
        assert cache.insert(list(ids)) == 0
        cache.insert([1, 2, 3, 4])  # another walk: the tree's last walk no longer answers
        assert cache.match_prefix(list(ids)).device_len == 8
        assert cache.match_prefix(ids.tolist()).device_len == 8
        free = cache.tiers.device.allocator.free_pages
        assert cache.insert(ids.tolist()) == 8
        assert cache.tiers.device.allocator.free_pages == free  # not cached twice
        assert {type(t) for node in cache.tree for t in node.key} == {int}

    def test_a_cache_answers_a_key_as_it_answers_the_list(self) -> None:
        rng = random.Random(3)
        prompts = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
        requests = [
            rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randrange(9))]
            for _ in range(40)
        ]
        plain, keyed = make(pages=24), make(pages=24)
        for tokens in requests:
            assert serve(plain, tokens) == serve(keyed, TokenKey(tokens))
        assert [n.key for n in plain.tree] == [n.key for n in keyed.tree]

    def test_a_subclass_is_checked_again(self) -> None:
        class Sneaky(TokenKey):
            pass

        sneaky = tuple.__new__(Sneaky, (1, -2))  # built past the check
        with pytest.raises(BadArgument, match=r"tokens\[1\] is -2"):
            make().match_prefix(sneaky)


class TestLastWalk:
    def test_a_split_between_match_and_insert_is_seen(self) -> None:
        cache = make()
        serve(cache, [1, 2, 3, 4, 5, 6])
        assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_len == 6
        cache.insert([1, 2, 9, 9], [0, 0, *cache.alloc_slots(2)])  # splits the walked node
        assert sorted(len(n.key) for n in cache.tree) == [2, 2, 4]
        assert cache.insert([1, 2, 3, 4, 5, 6], [0] * 6) == 6
        assert sorted(len(n.key) for n in cache.tree) == [2, 2, 4]
        assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_len == 6

    def test_an_eviction_between_match_and_insert_is_seen(self) -> None:
        cache = make(pages=4)
        serve(cache, [1, 2, 3, 4])
        match = cache.match_prefix([1, 2, 3, 4])
        assert match.device_len == 4
        cache.evict(8)  # deletes the node the match walked
        assert cache.match_prefix([1, 2, 3, 4]).device_len == 0
        assert cache.insert([1, 2, 3, 4], cache.alloc_slots(4)) == 0
        assert cache.match_prefix([1, 2, 3, 4]).device_len == 4


class TestMatchPages:
    def test_pages_are_those_of_the_lookup_after_a_split(self) -> None:
        cache = make()
        serve(cache, [1, 2, 3, 4, 5, 6])
        match = cache.match_prefix([1, 2, 3, 4, 5, 6])
        before = tuple(match.page_runs)
        serve(cache, [1, 2, 3, 4, 7, 8])  # splits the matched node
        assert match.device_pages == tuple(p for run in before for p in run)
        assert len(match.device_pages) * 2 == match.device_len


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=1, max_size=60),
    st.randoms(use_true_random=False),
)
@settings(max_examples=60, deadline=None)
def test_pool_runs_behave_as_any_pages(
    page: int, steps: list[tuple[bool, int]], rng: random.Random
) -> None:
    """Allocate, free in shuffled order and reassign: owners as a plain model says."""
    pool = PageAllocator("device", 16, page)
    owners: dict[int, int] = {}
    held: list[list[int]] = []
    for alloc, n in steps:
        if alloc and n <= 16 - len(owners):
            got = pool.alloc(n * page, owner=0)
            assert not set(got) & owners.keys()
            owners.update(dict.fromkeys(got, 0))
            held.append(got)
            assert pages_of(slots_of(got, page), page) == got
        elif held:
            pages = held.pop(rng.randrange(len(held)))
            rng.shuffle(pages)
            if pages and rng.random() < 0.5:
                pool.reassign(tuple(pages), 0, 7)
                with pytest.raises(ForeignSlot):
                    pool.reassign(pages, 0, 8)
                pool.free(pages, 7)
            else:
                pool.free(pages, 0)
            if pages:
                with pytest.raises(DoubleFree):
                    pool.free(pages, 0)
            for p in pages:
                del owners[p]
        assert pool.owners == tuple(owners.get(p, -1) for p in range(16))
        pool.check()


@pytest.mark.parametrize(
    ("src", "dst"),
    [((3, 4, 5), (10, 11, 12)), ((5, 3), (0, 1)), ((7,), (9,)), ((1, 2), (4, 2)), ((), ())],
)
def test_a_ticket_carries_the_runs_its_copy_moves_by(
    src: tuple[int, ...], dst: tuple[int, ...]
) -> None:
    """The runs checked at start are the ones the mover would find, and the bytes land."""
    cache = make(page=1, pages=16, host=16)
    copier = cache.tiers.copier
    device, host = cache.tiers.device, cache.tiers.host
    if len(set(dst)) != len(dst):
        with pytest.raises(ValueError, match="listed twice"):
            copier.start_write(src, dst)
        return
    kv = torch.arange(16 * device.words[0].numel(), dtype=device.words.dtype).view_as(device.words)
    device.words.copy_(kv)
    ticket = copier.start_write(src, dst)
    assert ticket.runs == (run_start(src), run_start(dst))
    copier.drain()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(host.words[d], kv[s])


def test_an_ownership_check_is_not_remembered_past_a_change() -> None:
    """A tuple found owned stays found only until some page changes hands."""
    pool = PageAllocator("device", 16, 1)
    scattered = tuple(pool.alloc(6, owner=0)[::-2])  # not a run: the general path
    run = tuple(pool.alloc(3, owner=0))
    for pages in (scattered, run):
        assert pool.all_owned_by(pages, 0)
        assert not pool.all_owned_by(pages, 4)
        pool.reassign(pages, 0, 4)
        assert not pool.all_owned_by(pages, 0)
        assert pool.all_owned_by(pages, 4)
        pool.free(pages[:1], 4)
        assert not pool.all_owned_by(pages, 4)
        with pytest.raises(DoubleFree):
            pool.free(pages, 4)
    pool.check()


@given(st.lists(st.integers(-2, 20), max_size=8), st.booleans())
@settings(max_examples=200, deadline=None)
def test_a_pool_finds_the_runs_run_start_finds_inside_it(pages: list[int], as_tuple: bool) -> None:
    """``run_of`` is :func:`run_start` for pages inside the pool, and None past its ends."""
    pool = PageAllocator("host", 16, 1)
    given_pages = tuple(pages) if as_tuple else pages
    inside = all(0 <= p < 16 for p in pages)
    assert pool.run_of(given_pages) == (run_start(pages) if inside else None)
    assert pool.run_of(range(3, 6)) is None  # not a list or tuple: callers check it the long way


@pytest.mark.parametrize("load", [False, True])
def test_a_run_to_run_copy_lands_each_page_where_it_was_sent(load: bool) -> None:
    """The CPU engine's one-copy path moves page ``src + i`` to ``dst + i``, either way."""
    cache = make(page=1, pages=16, host=16)
    copier = cache.tiers.copier
    device, host = cache.tiers.device, cache.tiers.host
    source = host if load else device
    kv = torch.arange(16 * source.words[0].numel(), dtype=source.words.dtype)
    source.words.copy_(kv.view_as(source.words))
    target = device if load else host
    target.words.fill_(-1)
    src, dst = (2, 3, 4, 5), (9, 10, 11, 12)
    ticket = copier.start_load(src, dst) if load else copier.start_write(src, dst)
    assert ticket.runs == (2, 9)
    (done,) = copier.drain()
    assert done.ok
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(target.words[d], source.words[s])
    untouched = [p for p in range(16) if p not in dst]
    assert bool((target.words[untouched] == -1).all())


_HOLDS = st.lists(
    st.tuples(st.booleans(), st.integers(0, 12), st.integers(1, 5), st.booleans()),
    max_size=12,
)


@given(_HOLDS, st.lists(st.integers(0, 20), max_size=6), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_a_page_set_of_runs_and_pages_is_the_multiset_it_was_given(
    holds: list[tuple[bool, int, int, bool]], probe: list[int], rng: random.Random
) -> None:
    """Runs held as ranges and pages held in the set answer as one plain multiset would."""
    held = PageSet()
    model: Counter[int] = Counter()
    added: list[tuple[list[int], int | None]] = []
    for as_run, first, n, duplicate in holds:
        pages = list(range(first, first + n))
        if not as_run and duplicate:
            pages.append(first)  # a page listed twice is held twice
        how = first if as_run else None
        held.add(pages, how)
        model.update(pages)
        added.append((pages, how))
    rng.shuffle(added)
    for pages, how in added[: len(added) // 2]:
        held.remove(pages, how)
        model.subtract(pages)
    live = {p for p, c in model.items() if c > 0}
    assert set(held) == live
    assert len(held) == len(live)
    assert bool(held) == bool(live)
    assert held.frozen() == frozenset(live)
    assert all((p in held) == (p in live) for p in range(25))
    assert held.isdisjoint(probe) == live.isdisjoint(probe)
    if probe:
        run = list(range(probe[0], probe[0] + len(probe)))
        assert held.isdisjoint(run, probe[0]) == live.isdisjoint(run)


def test_a_busy_run_refuses_what_overlaps_it_and_frees_once_reported() -> None:
    """A run a copy reads keeps its pages from being freed or overwritten until the poll."""
    cache = make(page=1, pages=16, host=16)
    copier = cache.tiers.copier
    copier.start_write((2, 3, 4, 5), (8, 9, 10, 11))
    assert copier.device_busy((5, 6))
    assert copier.device_busy([0, 4])
    assert not copier.device_busy((6, 7))
    assert not copier.device_busy([0, 1, 7])
    assert copier.host_busy((11, 12))
    assert not copier.host_busy((12, 13))
    with pytest.raises(ValueError, match=r"^copy: host page 10 is still in use by an unreported"):
        copier.start_write((12, 13), (10, 12))
    assert copier.busy_device_pages() == frozenset({2, 3, 4, 5})
    copier.poll()
    assert not copier.device_busy((2, 3, 4, 5))
    assert not copier.host_busy([8])
    assert copier.busy_host_pages() == frozenset()


@pytest.mark.parametrize("as_key", [False, True])
def test_the_log_keeps_slots_packed_and_a_replay_runs_them(as_key: bool) -> None:
    """Slot lists are logged as ``array('Q')`` of the same ids; replaying them gives the same run."""
    cache = make(page=2, pages=32, host=32)
    key = TokenKey(range(8))
    slots = cache.alloc_slots(8)
    cache.insert(key, TokenKey(slots) if as_key else slots)
    spare = cache.alloc_slots(4)
    cache.free_slots(spare)
    cache.poll()
    logged = dict(cache.log.operations())
    assert isinstance(logged["insert"][2], array)
    assert logged["insert"][2].typecode == "Q"
    assert logged["insert"][2].tolist() == slots
    assert logged["free_slots"][0].tolist() == spare
    again = replay(cache.log, cache.config)
    assert again.log.transitions() == cache.log.transitions()
    assert [n.device_pages for n in again.tree.nodes.values()] == [
        n.device_pages for n in cache.tree.nodes.values()
    ]


def test_bad_slots_are_refused_before_anything_is_logged() -> None:
    """A slot list that is not non-negative ints is refused by name, and nothing is recorded."""
    cache = make(page=1, pages=8)
    before = cache.log.recorded
    with pytest.raises(BadArgument, match=r"^insert: slots\[1\] is -3; ids and slots are"):
        cache.insert([1, 2], [0, -3])
    with pytest.raises(BadArgument, match=r"^free_slots: slots\[0\] is 1.5, not an int$"):
        cache.free_slots([1.5])  # type: ignore[list-item]
    assert cache.log.recorded == before
