"""SGLang 0.5.23's real ``UnifiedRadixCache``, checked at its lock boundary, on both tree cores.

The cache keeps its counters in a tree core by node id: the compiled Rust
one (SGLang's default) or ``UnifiedTreeCore`` in Python. Stock, a lock
released twice trips an ``assert`` in the core's walk (the Rust core panics
and refuses every later call: the cache is dead), or passes silently when
another request's lock holds the nodes the walk meets. Patched, the release
with no acquire left on its node is refused at its call, typed, with the
call sites in trail mode, and the tree is as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import importlib
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fsm_cache.compat.sglang import BuiltBeforePatch, patch
from fsm_cache.compat.sglang.unified import SWEEP
from fsm_cache.errors import (
    BadArgument,
    LeaseError,
    ReleaseAtZero,
    StaleNode,
    UnlockAtZero,
)

from .conftest import Api
from .fakes import FakeAllocator


UNIFIED = "sglang.srt.mem_cache.unified_radix_cache"
CORES = {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}
"""SGLang's tree cores, by the name ``tree_core_backend`` selects, and their classes."""

SHARED, LEFT, RIGHT = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


@pytest.fixture(scope="module")
def unified() -> Any:
    """0.5.23's ``unified_radix_cache`` module; skip where SGLang has none or msgspec is missing."""
    if importlib.util.find_spec(UNIFIED) is None:
        pytest.skip("this SGLang has no UnifiedRadixCache")
    # Its tree cores build msgspec structs; the stand-in for a missing msgspec cannot.
    pytest.importorskip("msgspec", reason="make test-sglang installs msgspec in the side venv")
    return importlib.import_module(UNIFIED)


@pytest.fixture(params=sorted(CORES))
def core(request: pytest.FixtureRequest) -> str:
    """The tree core the cache is built on."""
    return str(request.param)


@pytest.fixture
def patched(unified: Any) -> Iterator[Any]:
    """SGLang's caches, patched in trail mode for the test."""
    del unified
    with patch(trail=True) as applied:
        yield applied


def build(sg: Api, unified: Any, allocator: FakeAllocator, core: str, **options: Any) -> Any:
    """A full-attention ``UnifiedRadixCache`` on ``core`` holding ``SHARED+LEFT`` and ``SHARED+RIGHT``."""
    types = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    params = sg.cache_params(
        allocator, tree_components=(types.ComponentType.FULL,), tree_core_backend=core, **options
    )
    cache = unified.UnifiedRadixCache(params)
    assert type(cache.tree_core).__name__ == CORES[core]  # no silent fallback to the other
    for ids in (SHARED + LEFT, SHARED + RIGHT):
        sg.insert(cache, ids, allocator.take(len(ids)))
    return cache


def anchor(sg: Api, cache: Any, ids: list[int]) -> Any:
    """The node id a match of ``ids`` ends at (what the scheduler locks)."""
    return sg.match(cache, ids)[1]


def whole_state(cache: Any, allocator: FakeAllocator, capfd: pytest.CaptureFixture[str]) -> Any:
    """The tree with every node's lock count (the core's own print), sizes and free device slots.

    Node ids are left out (the Python core numbers nodes process-wide) and the
    lines are sorted (the Rust core prints siblings in no fixed order).
    """
    capfd.readouterr()
    cache.pretty_print()  # the Rust core prints from Rust: read through the file descriptor
    tree = sorted(re.sub(r"\[\d+\]", "[]", capfd.readouterr().out).splitlines())
    return tree, cache.evictable_size(), cache.protected_size(), list(allocator.free_slots)


def test_a_double_release_is_refused_at_its_call_and_changes_nothing(
    sg: Api,
    unified: Any,
    *,
    patched: Any,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    del patched
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    here = inspect.currentframe()
    assert here is not None
    receipt = cache.inc_lock_ref(node).to_dec_params()
    cache.dec_lock_ref(node, receipt)
    before = whole_state(cache, allocator, capfd)
    refused_at = here.f_lineno + 2
    with pytest.raises(UnlockAtZero) as caught:
        cache.dec_lock_ref(node, receipt)  # a second cleanup path: the bug
    test = "test_a_double_release_is_refused_at_its_call_and_changes_nothing"
    assert str(caught.value) == (
        f"node {node}: unlock refused in resident (locks=0): unlock without a matching "
        f"lock; locked at test_unified_real.py:{refused_at - 5} in {test}; "
        f"unlocked at test_unified_real.py:{refused_at - 4} in {test}; "
        f"refused at test_unified_real.py:{refused_at} in {test}"
    )
    assert whole_state(cache, allocator, capfd) == before
    receipt = cache.inc_lock_ref(node).to_dec_params()  # the cache still serves
    assert cache.protected_size() == len(SHARED + LEFT)
    cache.dec_lock_ref(node, receipt)
    assert whole_state(cache, allocator, capfd) == before


def test_stock_sglang_trips_at_the_walk_and_the_rust_core_is_dead_after(
    sg: Api, unified: Any, allocator: FakeAllocator, core: str
) -> None:
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    receipt = cache.inc_lock_ref(node).to_dec_params()
    cache.dec_lock_ref(node, receipt)
    with pytest.raises((AssertionError, RuntimeError), match="hit lock_ref=0 on node"):
        cache.dec_lock_ref(node, receipt)
    if core == "rust":
        with pytest.raises(RuntimeError, match="mutex poisoned"):
            cache.inc_lock_ref(node)


def test_a_release_that_sglang_takes_silently_from_an_ancestor_is_refused(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    leaf, shared = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED)
    cache.inc_lock_ref(leaf)  # a running request holds SHARED + LEFT
    receipt = cache.inc_lock_ref(shared).to_dec_params()
    cache.dec_lock_ref(shared, receipt)
    before = whole_state(cache, allocator, capfd)
    if mode == "stock":  # SGLang takes the leaf's lock off the shared prefix, silently
        cache.dec_lock_ref(shared, receipt)
        assert cache.protected_size() == len(LEFT)
        return
    with pytest.raises(UnlockAtZero, match=f"^node {shared}: unlock refused in resident"):
        cache.dec_lock_ref(shared, receipt)
    assert whole_state(cache, allocator, capfd) == before
    assert cache.protected_size() == len(SHARED + LEFT)


def test_a_host_lock_released_twice_is_refused(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + RIGHT)
    receipt = cache.inc_host_lock_ref(node).to_dec_params()
    cache.dec_host_lock_ref(node, receipt)
    before = whole_state(cache, allocator, capfd)
    if mode == "stock":  # no host copy to lock: SGLang's receipt holds nothing, and says nothing
        cache.dec_host_lock_ref(node, receipt)
        return
    with pytest.raises(ReleaseAtZero, match=f"^node {node}: release refused in backed"):
        cache.dec_host_lock_ref(node, receipt)
    assert whole_state(cache, allocator, capfd) == before


def test_receipts_pair_per_node_and_reset_forgets_them(
    sg: Api, unified: Any, patched: Any, allocator: FakeAllocator, core: str
) -> None:
    del patched
    cache = build(sg, unified, allocator, core)
    leaf, shared = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED)
    one, two = (cache.inc_lock_ref(leaf).to_dec_params() for _ in range(2))
    lock = cache.lock(shared)  # 0.5.23's scheduler locks through lock()/unlock()
    cache.dec_lock_ref(leaf, two)
    cache.dec_lock_ref(leaf, one)
    cache.unlock(lock)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
    stale = cache.inc_lock_ref(leaf).to_dec_params()
    cache.reset()  # flush_cache: the tree and the receipts on it are gone
    with pytest.raises(UnlockAtZero):
        cache.dec_lock_ref(leaf, stale)
    sg.insert(cache, SHARED + LEFT, allocator.take(8))
    node = anchor(sg, cache, SHARED + LEFT)
    cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())
    assert (cache.protected_size(), cache.evictable_size()) == (0, 8)


def test_a_cache_built_before_the_patch_is_refused(
    sg: Api, unified: Any, allocator: FakeAllocator, core: str, capfd: pytest.CaptureFixture[str]
) -> None:
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    receipt = cache.inc_lock_ref(node).to_dec_params()
    before = whole_state(cache, allocator, capfd)
    with patch(), pytest.raises(BuiltBeforePatch) as caught:
        cache.dec_lock_ref(node, receipt)
    assert str(caught.value) == (
        "UnifiedRadixCache: dec_lock_ref in a cache built before patch() (the receipts it "
        "gave out are not known); build the cache after patching; nothing changed"
    )
    assert whole_state(cache, allocator, capfd) == before
    cache.dec_lock_ref(node, receipt)  # SGLang's own again


def test_a_disabled_cache_runs_sglangs_methods_unchecked(
    sg: Api, unified: Any, patched: Any, core: str
) -> None:
    del patched
    types = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    params = sg.cache_params(
        FakeAllocator(8),
        disable=True,
        tree_components=(types.ComponentType.FULL,),
        tree_core_backend=core,
    )
    cache = unified.UnifiedRadixCache(params)
    receipt = cache.inc_lock_ref(cache.root_node_handle()).to_dec_params()
    for _ in range(2):  # SGLang's disabled cache holds nothing: nothing to refuse
        cache.dec_lock_ref(cache.root_node_handle(), receipt)


def test_the_patch_wraps_the_lock_boundary_and_undo_restores_it(unified: Any) -> None:
    stock = dict(vars(unified.UnifiedRadixCache))
    names = ["inc_lock_ref", "dec_lock_ref", "inc_host_lock_ref", "dec_host_lock_ref", "reset"]
    with patch() as applied:
        assert [w for w in applied.wrapped if w.startswith("UnifiedRadixCache.")] == [
            f"UnifiedRadixCache.{name}" for name in names
        ]
        assert all(vars(unified.UnifiedRadixCache)[n] is not stock[n] for n in names)
    assert all(vars(unified.UnifiedRadixCache)[n] is stock[n] for n in names)


def test_the_stock_and_patched_caches_agree_on_a_lock_stream(
    sg: Api, unified: Any, core: str, capfd: pytest.CaptureFixture[str]
) -> None:
    def run() -> list[Any]:
        allocator = FakeAllocator(64)
        cache = build(sg, unified, allocator, core)
        leaf, shared = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED)
        seen: list[Any] = []
        held = [cache.lock(leaf), cache.lock(shared), cache.lock(leaf)]
        host = cache.inc_host_lock_ref(shared).to_dec_params()
        seen.append(whole_state(cache, allocator, capfd))
        for lock in (held.pop(1), *held):
            cache.unlock(lock)
            seen.append(whole_state(cache, allocator, capfd))
        cache.dec_host_lock_ref(shared, host)
        sg.evict(cache, 8)
        seen.append(whole_state(cache, allocator, capfd))
        return seen

    stock = run()
    with patch(trail=True):
        assert run() == stock


def test_outside_trail_mode_a_double_release_is_refused_without_call_sites(
    sg: Api, unified: Any, allocator: FakeAllocator, core: str
) -> None:
    with patch(trail=False):
        cache = build(sg, unified, allocator, core)
        node = anchor(sg, cache, SHARED + LEFT)
        receipt = cache.inc_lock_ref(node).to_dec_params()
        cache.dec_lock_ref(node, receipt)
        with pytest.raises(UnlockAtZero) as caught:
            cache.dec_lock_ref(node, receipt)
        assert str(caught.value) == (
            f"node {node}: unlock refused in resident (locks=0): unlock without a matching lock"
        )
        assert cache.protected_size() == 0
        cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())


def test_a_receipt_released_in_parts_is_taken_as_sglang_takes_it(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # MambaComponent._alloc_mamba_slot (enable_mamba_extra_buffer_lazy) releases a running
    # request's Mamba lock alone, then its unlock releases the rest: one lock, two releases.
    cache = build(sg, unified, allocator, core)
    lock = cache.lock(anchor(sg, cache, SHARED + LEFT))
    held = whole_state(cache, allocator, capfd)
    types = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    ct = types.ComponentType.MAMBA  # _alloc_mamba_slot's own lines, on a FULL-only cache
    only_mamba = tuple(c for c in cache.tree_components if c != ct)
    cache.dec_lock_ref(
        lock.node, dataclasses.replace(lock.receipt, skipped_lock_components=only_mamba)
    )
    assert whole_state(cache, allocator, capfd) == held  # FULL is still locked
    lock.receipt.skipped_lock_components += (ct,)
    cache.unlock(lock)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
    if mode == "patched":  # and the FULL lock is counted back: a second unlock is refused
        with pytest.raises(UnlockAtZero):
            cache.unlock(lock)


def test_a_receipt_given_to_another_node_is_refused_before_the_core_panics(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    left, right = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED + RIGHT)
    receipt = cache.inc_lock_ref(left).to_dec_params()
    cache.inc_lock_ref(right)
    before = whole_state(cache, allocator, capfd)
    if mode == "stock":  # an assert (Python core) or a panic that kills the cache (Rust core)
        with pytest.raises((AssertionError, RuntimeError), match="anchored on node"):
            cache.dec_lock_ref(right, receipt)
        return
    with pytest.raises(BadArgument) as caught:
        cache.dec_lock_ref(right, receipt)
    assert str(caught.value) == (
        f"UnifiedRadixCache: dec_lock_ref on node {right} given a receipt anchored on node "
        f"{left}; a receipt is released on the node it was taken on; nothing changed"
    )
    assert whole_state(cache, allocator, capfd) == before
    cache.dec_lock_ref(left, receipt)  # the cache still serves, and the book still pairs it
    with pytest.raises(UnlockAtZero):
        cache.dec_lock_ref(left, receipt)


def test_trail_mode_keeps_the_call_sites_of_the_last_released_nodes_only(
    sg: Api, unified: Any, allocator: FakeAllocator, core: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.import_module("fsm_cache.compat.sglang.unified"), "KEPT", 1)
    with patch(trail=True):
        cache = build(sg, unified, allocator, core)
        left, right = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED + RIGHT)
        stale = {node: cache.inc_lock_ref(node).to_dec_params() for node in (left, right)}
        for node in (left, right):
            cache.dec_lock_ref(node, stale[node])
        with pytest.raises(UnlockAtZero) as kept:
            cache.dec_lock_ref(right, stale[right])
        with pytest.raises(UnlockAtZero) as dropped:
            cache.dec_lock_ref(left, stale[left])
    assert "; locked at test_unified_real.py:" in str(kept.value)
    assert str(dropped.value).startswith(
        f"node {left}: unlock refused in resident (locks=0): unlock without a matching "
        "lock; refused at test_unified_real.py:"
    )


def test_a_release_sglang_raises_on_after_the_check_is_not_recorded(
    sg: Api,
    unified: Any,
    *,
    patched: Any,
    allocator: FakeAllocator,
    core: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    del patched
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    receipt = cache.inc_lock_ref(node).to_dec_params()
    with monkeypatch.context() as broken:
        broken.setattr(cache.tree_core, "dec_lock_ref", _raise)
        with pytest.raises(OSError, match="core failed"):
            cache.dec_lock_ref(node, receipt)
    assert cache.protected_size() == len(SHARED + LEFT)
    cache.dec_lock_ref(node, receipt)  # the book still holds the receipt SGLang kept
    with pytest.raises(UnlockAtZero):
        cache.dec_lock_ref(node, receipt)


def _raise(*args: Any) -> None:
    """A tree core call that fails (what a caller's ``except`` keeps the receipt through)."""
    raise OSError("core failed")


def test_an_acquire_on_a_node_the_tree_does_not_have_is_refused_at_its_call(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    gone = anchor(sg, cache, SHARED + LEFT)
    sg.evict(cache, 12)  # every node but the root: the matched id names nothing now
    before = whole_state(cache, allocator, capfd)
    types = importlib.import_module("sglang.srt.mem_cache.unified_cache.component_type")
    full = (types.ComponentType.FULL,)  # an acquire that skips FULL is checked too
    acquires: list[tuple[str, Callable[[Any], Any]]] = [
        ("inc_lock_ref", cache.inc_lock_ref),
        ("inc_host_lock_ref", cache.inc_host_lock_ref),
        ("inc_lock_ref", functools.partial(cache.inc_lock_ref, skip_lock_components=full)),
    ]
    for call, acquire in acquires:
        if mode == "stock":  # the core's own lookup: a KeyError (TypeError on Rust for None)
            with pytest.raises(KeyError):
                acquire(gone)
            with pytest.raises((KeyError, TypeError)):
                acquire(None)
            continue
        with pytest.raises(StaleNode) as stale:
            acquire(gone)
        assert str(stale.value) == (
            f"UnifiedRadixCache: {call} on node {gone}, which is not in the tree (evicted, "
            "or from before a reset); match the prefix again; nothing changed"
        )
        with pytest.raises(BadArgument) as bad:
            acquire(None)
        assert str(bad.value) == (
            f"UnifiedRadixCache: {call} given None, not a node id; nothing changed"
        )
        assert whole_state(cache, allocator, capfd) == before
    sg.insert(cache, SHARED, allocator.take(4))  # the cache still serves, and the book pairs
    node = anchor(sg, cache, SHARED)
    cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)


def test_an_acquire_on_another_caches_node_id_is_refused_naming_that_cache(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    one, allocator = build(sg, unified, FakeAllocator(64), core), FakeAllocator(64)
    two = build(sg, unified, allocator, core)
    sg.insert(one, [13, 14, 15, 16], FakeAllocator(64).take(4))
    extra = anchor(sg, one, [13, 14, 15, 16])  # a node two has no id for, on either core
    shared = anchor(sg, one, SHARED + LEFT)  # the Rust core numbers two's nodes alike
    before = whole_state(two, allocator, capfd)
    if mode == "stock":
        with pytest.raises(KeyError):
            two.inc_lock_ref(extra)
        return
    with pytest.raises(StaleNode) as caught:
        two.inc_lock_ref(extra)
    assert str(caught.value) == (
        (
            f"UnifiedRadixCache: inc_lock_ref on node {extra}, which is not in the tree but "
            f"another cache's (UnifiedRadixCache at {id(one):#x}); a node id is its own "
            "cache's; nothing changed"
        )
        if core == "python"  # the Rust core counts ids per cache: a stale id is another's too
        else (
            f"UnifiedRadixCache: inc_lock_ref on node {extra}, which is not in the tree "
            "(evicted, or from before a reset); match the prefix again; nothing changed"
        )
    )
    assert whole_state(two, allocator, capfd) == before
    if core == "python":  # ids are process-wide: every id of one's is refused on two
        with pytest.raises(StaleNode, match="not in the tree but another cache's"):
            two.inc_host_lock_ref(shared)
        return
    # The Rust core counts ids per cache: one's id names a node of two's, and is taken as it
    # (an id is a plain int, and a receipt's fields none of the cache's own).
    assert shared == anchor(sg, two, SHARED + LEFT)
    two.unlock(two.lock(shared))
    assert whole_state(two, allocator, capfd) == before


def test_a_receipt_released_twice_while_another_is_out_on_its_node_is_refused(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    here = inspect.currentframe()
    assert here is not None
    first = cache.inc_lock_ref(node).to_dec_params()  # two requests lock the same prefix
    second = cache.inc_lock_ref(node).to_dec_params()
    cache.dec_lock_ref(node, first)
    before = whole_state(cache, allocator, capfd)
    if mode == "stock":  # SGLang takes the second request's lock: its prefix is evictable
        cache.dec_lock_ref(node, first)
        assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
        return
    refused_at = here.f_lineno + 2
    with pytest.raises(LeaseError) as caught:
        cache.dec_lock_ref(node, first)  # the first request's second cleanup path: the bug
    test = "test_a_receipt_released_twice_while_another_is_out_on_its_node_is_refused"
    assert str(caught.value) == (
        f"node {node}: dec_lock_ref refused: this receipt (DecLockRefParams at "
        f"{id(first):#x}) was released already; the node's 1 other receipt(s) out stay "
        f"held; nothing changed; released at test_unified_real.py:{refused_at - 8} in "
        f"{test}; refused at test_unified_real.py:{refused_at} in {test}"
    )
    assert whole_state(cache, allocator, capfd) == before
    assert cache.protected_size() == len(SHARED + LEFT)  # the second request's lock holds
    cache.dec_lock_ref(node, second)
    with pytest.raises(UnlockAtZero):  # no receipt left: the count refuses it first
        cache.dec_lock_ref(node, first)
    again = cache.lock(node)  # a new lock on the node: an old receipt still is not one
    with pytest.raises(LeaseError, match=f"^node {node}: dec_lock_ref refused: this receipt"):
        cache.dec_lock_ref(node, second)
    other = cache.lock(node)  # the scheduler's way: lock() and unlock(), the same check
    cache.unlock(again)
    with pytest.raises(LeaseError, match=r"released at unified_radix_cache\.py:\d+ in unlock;"):
        cache.unlock(again)
    cache.unlock(other)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)


def test_a_host_receipt_released_twice_while_another_is_out_is_refused(
    sg: Api, unified: Any, patched: Any, allocator: FakeAllocator, core: str
) -> None:
    del patched
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + RIGHT)
    first, second = (cache.inc_host_lock_ref(node).to_dec_params() for _ in range(2))
    cache.dec_host_lock_ref(node, first)
    with pytest.raises(LeaseError) as caught:
        cache.dec_host_lock_ref(node, first)
    assert str(caught.value).startswith(
        f"node {node}: dec_host_lock_ref refused: this receipt (DecLockRefParams at "
        f"{id(first):#x}) was released already; the node's 1 other receipt(s) out stay held"
    )
    cache.dec_host_lock_ref(node, second)
    with pytest.raises(ReleaseAtZero):
        cache.dec_host_lock_ref(node, second)


def test_a_lock_released_through_a_copy_of_its_receipt_is_refused(
    sg: Api,
    unified: Any,
    *,
    mode: str,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    here = inspect.currentframe()
    assert here is not None
    first, second = cache.lock(node), cache.lock(node)  # two requests lock the same prefix
    cache.dec_lock_ref(node, dataclasses.replace(first.receipt))  # a copy, dropped at once
    before = whole_state(cache, allocator, capfd)
    if mode == "stock":  # SGLang takes the second request's lock: its prefix is evictable
        cache.dec_lock_ref(node, first.receipt)
        assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
        return
    test = "test_a_lock_released_through_a_copy_of_its_receipt_is_refused"
    refused_at = here.f_lineno + 2
    with pytest.raises(LeaseError) as caught:
        cache.dec_lock_ref(node, first.receipt)  # the original, after its copy: the bug
    assert str(caught.value) == (
        f"node {node}: dec_lock_ref refused: this receipt (DecLockRefParams at "
        f"{id(first.receipt):#x}) shares its lock with a receipt released already (a copy: "
        "dataclasses.replace or copy.copy keep its uuid maps); the node's 1 other "
        "receipt(s) out stay held; nothing changed; released at "
        f"test_unified_real.py:{refused_at - 9} in {test}; refused at "
        f"test_unified_real.py:{refused_at} in {test}"
    )
    assert whole_state(cache, allocator, capfd) == before
    third = cache.lock(node)
    cache.unlock(third)
    with pytest.raises(LeaseError, match=r"shares its lock with a receipt released already"):
        cache.dec_lock_ref(node, copy.copy(third.receipt))  # a copy, after its original
    with pytest.raises(LeaseError, match=r"shares its lock with a receipt released already"):
        cache.dec_lock_ref(node, dataclasses.replace(third.receipt, skipped_lock_components=()))
    cache.unlock(second)  # separate receipts with equal fields are separate locks
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)


def test_a_released_lock_is_remembered_while_its_receipt_or_a_copy_is_held(
    sg: Api, unified: Any, patched: Any, allocator: FakeAllocator, core: str
) -> None:
    del patched
    cache = build(sg, unified, allocator, core)
    wrapper = vars(unified.UnifiedRadixCache)["dec_lock_ref"]
    book = inspect.getclosurevars(wrapper).nonlocals["self"].books[cache]
    node = anchor(sg, cache, SHARED + LEFT)
    kept = cache.lock(node)
    for _ in range(2 * SWEEP):  # a request's lock, released and dropped (req.lock = None)
        cache.unlock(cache.lock(node))
        assert len(book.spent) < SWEEP  # the book sweeps itself as it grows
    cache.unlock(kept)
    book.sweep()
    assert [entry.receipt() for entry in book.spent.values()] == [kept.receipt]
    held = copy.copy(kept.receipt)  # a copy keeps the lock's uuid maps, and so its entry
    del kept
    gc.collect()
    book.sweep()
    assert len(book.spent) == 1
    other = cache.lock(node)  # a lock out for the copy to take: refused by its entry alone
    with pytest.raises(LeaseError, match="shares its lock with a receipt released already"):
        cache.dec_lock_ref(node, held)
    del held
    book.sweep()
    assert book.spent == {}
    cache.unlock(other)
    stale = cache.lock(node)
    cache.unlock(stale)
    cache.reset()  # the tree is gone, and with it what the book knew
    assert book.spent == {}


def test_a_caches_own_stale_id_is_not_blamed_on_another_cache_nor_its_failure(
    sg: Api,
    unified: Any,
    patched: Any,
    *,
    core: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    del patched
    allocator = FakeAllocator(64)
    one, two = build(sg, unified, FakeAllocator(64), core), build(sg, unified, allocator, core)
    sg.insert(one, [13, 14, 15, 16], FakeAllocator(64).take(4))
    anchor(sg, one, [13, 14, 15, 16])
    stale = anchor(sg, two, SHARED + LEFT)
    two.reset()
    stale_message = (
        f"UnifiedRadixCache: inc_lock_ref on node {stale}, which is not in the tree "
        "(evicted, or from before a reset); match the prefix again; nothing changed"
    )
    before = whole_state(two, allocator, capfd)
    if core == "rust":  # two's old id is one's live node: still two's own stale id
        with pytest.raises(StaleNode) as caught:
            two.inc_lock_ref(stale)
        assert str(caught.value) == stale_message
        assert whole_state(two, allocator, capfd) == before
    one.tree_core = _Poisoned()  # another cache broken (a panicked Rust core raises so)
    with pytest.raises(StaleNode) as refused:
        two.inc_lock_ref(stale)
    assert str(refused.value) == stale_message
    assert whole_state(two, allocator, capfd) == before


class _Poisoned:
    """A tree core that fails every call, as a Rust core does after a panic (Python's name)."""

    def is_root(self, node_id: int) -> bool:
        raise RuntimeError("mutex poisoned")


_Poisoned.__name__ = "UnifiedTreeCore"


OWN_LOCKS = """
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class OwnLocksCache(UnifiedRadixCache):
    def inc_lock_ref(self, node_id, skip_lock_components=()):
        if THROUGH_BASE == "inc_lock_ref":
            return super().inc_lock_ref(node_id, skip_lock_components)
        return self.tree_core.inc_lock_ref(node_id, skip_lock_components)

    def dec_lock_ref(self, node_id, params, skip_swa=False):
        if THROUGH_BASE == "dec_lock_ref":
            return super().dec_lock_ref(node_id, params, skip_swa)
        return self.tree_core.dec_lock_ref(node_id, params, skip_swa)
"""
"""A fork's subclass: one of the lock pair through SGLang's method, the other on the core."""


@pytest.mark.parametrize("defined", ["before", "after"])
@pytest.mark.parametrize("through_base", ["inc_lock_ref", "dec_lock_ref"])
def test_a_subclass_override_of_the_lock_pair_is_checked_and_counted_once(
    sg: Api,
    unified: Any,
    *,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    defined: str,
    through_base: str,
) -> None:
    """An override on the core is checked, one through SGLang's counted once, whenever defined.

    Unwrapped, a lock taken on the core was not counted (its unlock was
    refused on a correct server), and an unlock on the core went unchecked
    (SGLang took the other request's lock).
    """

    def fork() -> Any:
        module = types.ModuleType("own_locks_cache")
        module.THROUGH_BASE = through_base  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(OWN_LOCKS, "<own_locks_cache>", "exec"), module.__dict__)
        return module

    early = fork() if defined == "before" else None
    with patch(trail=False) as applied:
        module = early or fork()
        assert "OwnLocksCache.dec_lock_ref" in applied.wrapped
        cache = build(
            sg, types.SimpleNamespace(UnifiedRadixCache=module.OwnLocksCache), allocator, core
        )
        node = anchor(sg, cache, SHARED + LEFT)
        first, second = cache.lock(node), cache.lock(node)  # two requests lock one prefix
        cache.unlock(first)
        before = whole_state(cache, allocator, capfd)
        with pytest.raises(LeaseError, match=f"^node {node}: dec_lock_ref refused: this receipt"):
            cache.unlock(first)
        assert whole_state(cache, allocator, capfd) == before
        assert cache.protected_size() == len(SHARED + LEFT)  # the second request's lock holds
        cache.unlock(second)  # each counted once: second's lock is still out
        with pytest.raises(UnlockAtZero):
            cache.unlock(second)
        assert (cache.protected_size(), cache.evictable_size()) == (0, 12)


def load_fork(monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Any:
    """A module ``name`` of a fork, executed from ``source`` (removed from ``sys.modules`` after)."""
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


MIXED = """
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class CoreLocks:
    def inc_lock_ref(self, node_id, skip_lock_components=()):
        return self.tree_core.inc_lock_ref(node_id, skip_lock_components)

    def dec_lock_ref(self, node_id, params, skip_swa=False):
        return self.tree_core.dec_lock_ref(node_id, params, skip_swa)


class MixedCache(CoreLocks, UnifiedRadixCache):
    pass
"""
"""A fork's subclass whose lock pair, on the core, comes from a mixin ahead of SGLang's class."""


@pytest.mark.parametrize("defined", ["before", "after"])
def test_a_mixins_override_of_the_lock_pair_is_checked_and_counted(
    sg: Api,
    unified: Any,
    *,
    allocator: FakeAllocator,
    core: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    defined: str,
) -> None:
    """A mixin's lock pair, ahead of SGLang's in the MRO, is checked and counted as the subclass's.

    Unwrapped, a lock it took on the core was not counted (its correct
    unlock was refused) and an unlock it made twice went unchecked.
    """
    early = load_fork(monkeypatch, "mixed_cache", MIXED) if defined == "before" else None
    with patch(trail=False) as applied:
        module = early or load_fork(monkeypatch, "mixed_cache", MIXED)
        assert "MixedCache.dec_lock_ref" in applied.wrapped
        cache = build(
            sg, types.SimpleNamespace(UnifiedRadixCache=module.MixedCache), allocator, core
        )
        node = anchor(sg, cache, SHARED + LEFT)
        first, second = cache.lock(node), cache.lock(node)
        cache.unlock(first)
        before = whole_state(cache, allocator, capfd)
        with pytest.raises(LeaseError, match=f"^node {node}: dec_lock_ref refused: this receipt"):
            cache.unlock(first)
        assert whole_state(cache, allocator, capfd) == before
        assert cache.protected_size() == len(SHARED + LEFT)  # the second request's lock holds
        cache.unlock(second)
        with pytest.raises(UnlockAtZero):
            cache.unlock(second)
        assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
    assert "dec_lock_ref" not in vars(module.MixedCache)  # the undo deletes the wrapper
    assert "dec_lock_ref" in vars(module.CoreLocks)


PINNED = """
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class PinnedCache(UnifiedRadixCache):
    def reset(self):
        super().reset()
        self.pinned = self.lock(self.root_node_handle())
"""
"""A fork's subclass that locks the new root after SGLang's ``reset``."""


def test_a_reset_override_that_locks_after_sglangs_reset_keeps_the_lock(
    sg: Api,
    unified: Any,
    patched: Any,
    allocator: FakeAllocator,
    core: str,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The book is cleared by SGLang's ``reset``, not again when the override returns.

    Cleared twice, the override's lock was lost and its correct unlock
    refused.
    """
    module = load_fork(monkeypatch, "pinned_cache", PINNED)
    cache = build(sg, types.SimpleNamespace(UnifiedRadixCache=module.PinnedCache), allocator, core)
    cache.reset()
    cache.unlock(cache.pinned)
    with pytest.raises(UnlockAtZero):
        cache.unlock(cache.pinned)


NEIGHBOUR = """
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class NeighbourCache(UnifiedRadixCache):
    neighbours = {}

    def inc_lock_ref(self, node_id, skip_lock_components=()):
        other = self.neighbours.get(node_id)
        if other is not None:
            self.neighbour = super().inc_lock_ref(other, skip_lock_components).to_dec_params()
        return self.tree_core.inc_lock_ref(node_id, skip_lock_components)
"""
"""A fork's subclass whose lock also takes another node's, through SGLang's method."""


def test_an_override_locking_another_node_through_sglangs_counts_its_own(
    sg: Api,
    unified: Any,
    patched: Any,
    allocator: FakeAllocator,
    core: str,
    *,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's call for another node counts that node's lock, and the override's its own.

    Counted per method alone, SGLang's call stood for the override's lock,
    whose correct unlock was then refused.
    """
    module = load_fork(monkeypatch, "neighbour_cache", NEIGHBOUR)
    cache = build(
        sg, types.SimpleNamespace(UnifiedRadixCache=module.NeighbourCache), allocator, core
    )
    node, other = anchor(sg, cache, SHARED + LEFT), anchor(sg, cache, SHARED + RIGHT)
    cache.neighbours = {node: other}
    lock = cache.lock(node)
    assert cache.protected_size() == 12  # both branches held
    cache.unlock(lock)
    cache.dec_lock_ref(other, cache.neighbour)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
    with pytest.raises(UnlockAtZero):
        cache.unlock(lock)


def test_a_deep_copy_of_a_receipt_is_counted_and_nothing_in_it_tells_it_apart(
    sg: Api, unified: Any, patched: Any, allocator: FakeAllocator, core: str
) -> None:
    """Why a deep copy is only counted: it holds no object of its original's that another lock lacks.

    A ``dataclasses.replace`` or ``copy.copy`` copy keeps its original's uuid
    maps; a deep copy has maps of its own, and what else a ``FULL``-only
    receipt holds (the anchor's id, the skipped components) is what every
    receipt on the node holds: the same value, and on either core the same object.
    """
    del patched
    cache = build(sg, unified, allocator, core)
    node = anchor(sg, cache, SHARED + LEFT)
    lock, other = cache.lock(node), cache.lock(node)
    copied = copy.deepcopy(lock.receipt)
    assert copied == lock.receipt == other.receipt
    ids = [{id(value) for value in vars(r).values()} for r in (copied, lock.receipt, other.receipt)]
    assert ids[0] & ids[1] <= ids[2]
    cache.unlock(lock)
    cache.dec_lock_ref(node, copied)  # counted: the node's second lock (other's, for SGLang)
    with pytest.raises(UnlockAtZero):  # and no lock is left on the node to take
        cache.dec_lock_ref(node, copied)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 12)
