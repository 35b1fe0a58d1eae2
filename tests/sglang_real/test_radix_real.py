"""SGLang's real ``RadixCache`` (0.5.6 and 0.5.23) on the CPU: stock, then with the drop-in.

Each scenario runs in both modes of ``conftest.mode``. The stock runs
record SGLang's own results (match lengths, slots freed by eviction); the
patched runs must give the same results.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from fsm_cache.errors import BadArgument, LeaseError, error_class

from .conftest import Api, whole_state
from .fakes import FakeAllocator


def slots(allocator: FakeAllocator, ids: list[int]) -> Any:
    """Device slots for ``ids``, as a request's prefill would have allocated them."""
    return allocator.take(len(ids))


def build(sg: Api, allocator: FakeAllocator) -> Any:
    return sg.rc.RadixCache(sg.cache_params(allocator))


def test_root(sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest) -> None:
    cache = build(sg, allocator)
    root = cache.root_node
    assert (root.lock_ref, len(root.value), cache.evictable_size(), cache.total_size()) == (
        1,
        0,
        0,
        0,
    )


def test_insert_and_match(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = build(sg, allocator)
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12]]
    prefixes = [sg.insert(cache, s, slots(allocator, s)) for s in seqs]
    assert prefixes == [0, 3, 2, 4, 0]
    # the duplicates the caller would free; the tree keeps its own slots
    assert cache.total_size() == 3 + 2 + 2 + 5
    assert cache.evictable_size() == 12
    assert sg.match(cache, [1, 2, 3, 13, 14])[0] == 3
    assert sg.match(cache, [1, 2, 4, 5, 6, 7, 99])[0] == 6
    assert sg.match(cache, [7])[0] == 0


def test_match_inside_a_node_splits_it(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = build(sg, allocator)
    value = slots(allocator, [1] * 6)
    assert sg.insert(cache, [1, 2, 3, 4, 5, 6], value) == 0
    length, prefix = sg.match(cache, [1, 2, 3])
    assert length == 3
    (leaf,) = prefix.children.values()
    assert (len(prefix.key), len(leaf.key), leaf.parent is prefix) == (3, 3, True)
    assert prefix.value.tolist() + leaf.value.tolist() == value.tolist()
    assert sg.match(cache, [1, 2, 3, 4, 5, 6])[0] == 6


def test_lock_protects_from_eviction(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = build(sg, allocator)
    a, b = [1, 2, 3, 4], [10, 11, 12, 13]
    a_slots, b_slots = slots(allocator, a), slots(allocator, b)
    sg.insert(cache, a, a_slots)
    sg.insert(cache, b, b_slots)
    node = sg.match(cache, a)[1]
    cache.inc_lock_ref(node)
    assert (node.lock_ref, cache.evictable_size(), cache.protected_size()) == (1, 4, 4)
    sg.evict(cache, 8)
    assert allocator.freed == [b_slots.tolist()]
    assert sg.match(cache, b)[0] == 0
    assert sg.match(cache, a)[0] == 4
    cache.dec_lock_ref(node)
    assert (node.lock_ref, cache.evictable_size(), cache.protected_size()) == (0, 4, 0)
    sg.evict(cache, 4)
    assert allocator.freed == [b_slots.tolist(), a_slots.tolist()]
    assert cache.total_size() == 0


def test_split_of_a_locked_node(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = build(sg, allocator)
    value = slots(allocator, [1] * 6)
    sg.insert(cache, [1, 2, 3, 4, 5, 6], value)
    leaf = sg.match(cache, [1, 2, 3, 4, 5, 6])[1]
    cache.inc_lock_ref(leaf)
    prefix = sg.match(cache, [1, 2, 3])[1]
    assert (prefix.lock_ref, leaf.lock_ref, leaf.parent is prefix) == (1, 1, True)
    cache.dec_lock_ref(leaf)
    assert (prefix.lock_ref, leaf.lock_ref, cache.evictable_size()) == (0, 0, 6)
    sg.evict(cache, 6)
    assert allocator.freed == [value[3:].tolist(), value[:3].tolist()]


def test_lru_eviction_order(
    sg: Api, allocator: FakeAllocator, mode: str, request: pytest.FixtureRequest
) -> None:
    cache = build(sg, allocator)
    seqs = [[1, 2], [3, 4], [5, 6]]
    held = [slots(allocator, s).tolist() for s in seqs]
    for s, v in zip(seqs, held, strict=True):
        sg.insert(cache, s, sg.rc.torch.tensor(v))
    sg.match(cache, [1, 2])  # touched: now the most recent
    sg.evict(cache, 2)
    assert allocator.freed == [held[1]]
    sg.evict(cache, 4)
    assert allocator.freed == [held[1], held[2], held[0]]
    assert cache.evictable_size() == 0


def test_a_lock_released_twice_while_another_request_holds_its_node_is_refused(
    sg: Api, allocator: FakeAllocator, mode: str
) -> None:
    """0.5.23's ``RadixCache`` counts locks per node: a receipt released twice took another's lock.

    Two requests lock one prefix; the first one's ``unlock`` runs twice (a
    second cleanup path). Stock SGLang takes the second request's lock off
    the prefix, which becomes evictable under it. Patched, the second release
    is refused by its receipt, changing nothing; with no lock left on the
    node, the count refuses it first (``UnlockAtZero``), as before.
    """
    if not sg.new:
        pytest.skip(f"sglang {sg.version} has no lock receipts (dec_lock_ref(node) only)")
    cache = build(sg, allocator)
    sg.insert(cache, [1, 2, 3, 4], slots(allocator, [1, 2, 3, 4]))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    first, second = cache.lock(node), cache.lock(node)
    released_at = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    cache.unlock(first)
    before = whole_state(cache, allocator)
    if mode == "stock":
        cache.unlock(first)  # the second request's lock is gone: its prefix is evictable
        assert (node.lock_ref, cache.protected_size(), cache.evictable_size()) == (0, 0, 4)
        return
    with pytest.raises(LeaseError) as caught:
        cache.unlock(first)
    test = "test_a_lock_released_twice_while_another_request_holds_its_node_is_refused"
    assert str(caught.value) == (
        f"node {node.id}: dec_lock_ref refused: this receipt (DecLockRefParams at "
        f"{id(first.receipt):#x}) was released already; the 1 lock(s) on the node stay held; "
        f"nothing changed; released at test_radix_real.py:{released_at} in {test}; refused "
        f"at test_radix_real.py:{released_at + 7} in {test}"
    )
    assert whole_state(cache, allocator) == before
    copied = dataclasses.replace(first.receipt)  # a copy shares the lock: refused too
    with pytest.raises(LeaseError, match="shares its lock with a receipt released already"):
        cache.dec_lock_ref(node, copied)
    cache.unlock(second)
    with pytest.raises(error_class("UnlockAtZero")):  # no lock left: the count refuses first
        cache.unlock(second)
    again = cache.lock(node)  # a new lock: the old receipts still are not it
    with pytest.raises(LeaseError, match=f"^node {node.id}: dec_lock_ref refused: this receipt"):
        cache.unlock(second)
    cache.unlock(again)
    assert (node.lock_ref, cache.protected_size(), cache.evictable_size()) == (0, 0, 4)
    empty = cache.lock(cache.root_node)  # an empty match: the root's lock moves nothing
    cache.unlock(empty)
    cache.unlock(empty)  # nor does its release, stock or patched
    assert (cache.root_node.lock_ref, cache.protected_size()) == (1, 0)


def test_a_lock_released_on_another_node_than_its_own_is_refused(
    sg: Api, allocator: FakeAllocator, mode: str
) -> None:
    """0.5.23's ``RadixCache`` receipt names no node: released elsewhere, it took that node's lock.

    A request's ``TreeLock`` is released with another node (a caller that
    pairs ``req.lock.receipt`` with the wrong ``last_node``). Stock SGLang
    walks up from the node it is given: the other request's lock is taken
    off its prefix, which becomes evictable under it, and the first lock is
    never released. Patched, ``lock`` notes the node each receipt is taken
    on, and the release is refused before the walk, naming both nodes and
    where the lock was taken; changing nothing.
    """
    if not sg.new:
        pytest.skip(f"sglang {sg.version} has no lock receipts (dec_lock_ref(node) only)")
    cache = build(sg, allocator)
    sg.insert(cache, [1, 2, 3, 4], slots(allocator, [1, 2, 3, 4]))
    sg.insert(cache, [5, 6, 7, 8], slots(allocator, [5, 6, 7, 8]))
    mine, theirs = sg.match(cache, [1, 2, 3, 4])[1], sg.match(cache, [5, 6, 7, 8])[1]
    taken_at = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    lock = cache.lock(mine)
    other = cache.lock(theirs)
    moved = dataclasses.replace(lock, node=theirs)  # the receipt, paired with the wrong node
    before = whole_state(cache, allocator)
    if mode == "stock":
        cache.unlock(moved)  # the other request's lock is gone; this one's is never released
        assert (mine.lock_ref, theirs.lock_ref, cache.evictable_size()) == (1, 0, 4)
        return
    with pytest.raises(BadArgument) as caught:
        cache.unlock(moved)
    test = "test_a_lock_released_on_another_node_than_its_own_is_refused"
    assert str(caught.value) == (
        f"node {theirs.id}: dec_lock_ref refused: this receipt (DecLockRefParams at "
        f"{id(lock.receipt):#x}) is of a lock taken on node {mine.id}, and a receipt is "
        "released on the node it was taken on; the locks on both nodes stay held; nothing "
        f"changed; taken at test_radix_real.py:{taken_at} in {test}; refused at "
        f"test_radix_real.py:{taken_at + 9} in {test}"
    )
    assert whole_state(cache, allocator) == before
    with pytest.raises(BadArgument, match=f"^node {theirs.id}: .* taken on node {mine.id},"):
        cache.dec_lock_ref(theirs, dataclasses.replace(lock.receipt))  # a copy: the same lock
    root = cache.root_node
    with pytest.raises(BadArgument, match=f"^node {root.id}: .* taken on node {mine.id},"):
        cache.dec_lock_ref(root, lock.receipt)  # the root's walk moves nothing: a lost lock
    cache.unlock(other)
    with pytest.raises(BadArgument, match=f"^node {theirs.id}: .* taken on node {mine.id},"):
        cache.unlock(moved)  # no lock left there: refused as another node's all the same
    cache.unlock(lock)  # its own node: SGLang's release, as stock
    empty = cache.lock(root)  # an empty match's lock is its node's too
    with pytest.raises(BadArgument, match=f"^node {mine.id}: .* taken on node {root.id},"):
        cache.dec_lock_ref(mine, empty.receipt)
    cache.unlock(empty)
    cache.unlock(empty)  # on its own node (the root) it moves nothing, as before
    assert (mine.lock_ref, theirs.lock_ref, cache.protected_size(), cache.evictable_size()) == (
        0,
        0,
        0,
        8,
    )


def test_a_lock_whose_book_cannot_be_kept_is_not_taken(
    sg: Api, allocator: FakeAllocator, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The patch's ``lock`` readies the book before SGLang takes the lock: a refusal takes none.

    Readied after, a book that raised (here: a cache refusing the weak
    reference its book's entry goes with) left the node locked, and the
    caller, given no ``TreeLock``, could never release it.
    """
    if not sg.new or mode == "stock":
        pytest.skip("the book of 0.5.23's lock receipts is the patch's")
    from fsm_cache.compat.sglang.patch import Patch

    cache = build(sg, allocator)
    sg.insert(cache, [1, 2, 3, 4], slots(allocator, [1, 2, 3, 4]))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    before = whole_state(cache, allocator)

    def refuse(self: Patch, cache: Any, machine: Any) -> Any:
        raise TypeError(f"cannot create weak reference to {type(cache).__name__!r} object")

    with monkeypatch.context() as refusing:
        refusing.setattr(Patch, "book", refuse)
        with pytest.raises(TypeError, match=r"^cannot create weak reference"):
            cache.lock(node)
    assert whole_state(cache, allocator) == before
    assert (node.lock_ref, cache.protected_size(), cache.evictable_size()) == (0, 0, 4)
    cache.unlock(cache.lock(node))  # a book made, the lock is taken and released as ever
    assert whole_state(cache, allocator) == before


def lock_book(sg: Api, cache: Any) -> Any:
    """The patch's book of ``cache``'s locks (None before the first one)."""
    wrapper = vars(sg.rc.RadixCache)["dec_lock_ref"]
    return inspect.getclosurevars(wrapper).nonlocals["books"].get(id(cache))


def test_reset_forgets_the_locks_of_the_tree_it_drops(
    sg: Api, allocator: FakeAllocator, mode: str
) -> None:
    """``reset`` (``flush_cache``) drops the tree: the patch's book of its locks goes with it."""
    if not sg.new or mode == "stock":
        pytest.skip("the book of 0.5.23's lock receipts is the patch's")
    cache = build(sg, allocator)
    sg.insert(cache, [1, 2, 3, 4], slots(allocator, [1, 2, 3, 4]))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    done, _held = cache.lock(node), cache.lock(node)  # both receipts held: no sweep drops them
    cache.unlock(done)
    book = lock_book(sg, cache)
    assert (len(book.spent), len(book.out)) == (1, 1)
    cache.reset()
    assert (book.spent, book.out) == ({}, {})  # not held until a sweep: gone with the tree
    assert lock_book(sg, cache) is book
