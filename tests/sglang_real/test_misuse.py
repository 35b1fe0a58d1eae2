"""Misuse planted in SGLang's real caches: the patch refuses each at the call, changing nothing.

Stock SGLang either raises much later (``Host reference counter is already
zero.``), corrupts its counts, or frees memory a copy still uses; each test
shows the patched cache refusing the step where it is taken, with memory
and counts as they were.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_cache.compat.sglang import (
    BuiltBeforePatch,
    Children,
    HostRefCounterZero,
    Patch,
    PatchError,
    PatchUndone,
    ReadOnlyCounter,
    ResidencyMixin,
    patch,
)
from fsm_cache.engine import trail
from fsm_cache.errors import CopyInFlight, DuplicateAck, HostCopyPinned, StaleNode, error_class

from .conftest import Api, build_hiradix, hiradix_module, whole_state
from .fakes import FakeAllocator


AB = list(range(1, 13))


@pytest.fixture
def patched(sg: Api) -> Iterator[Any]:
    """SGLang's caches, patched in trail mode for the test."""
    del sg
    with patch(trail=True) as applied:
        yield applied


@pytest.fixture
def hiradix(
    sg: Api, allocator: FakeAllocator, patched: Any, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """A patched write-through ``HiRadixCache`` with one node, its backup acknowledged."""
    del patched
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through")
    sg.insert(cache, AB, allocator.take(len(AB)))
    cache.cache_controller.finish_writes()
    cache.writing_check()
    return cache


def only_child(cache: Any) -> Any:
    (node,) = cache.root_node.children.values()
    return node


def test_the_patch_checks_the_nodes_and_wraps_the_memory_moves(sg: Api, patched: Any) -> None:
    cache = sg.rc.RadixCache(sg.cache_params(FakeAllocator(8)))
    assert isinstance(cache.root_node, patched.node_class)
    assert "RadixCache.inc_lock_ref" in patched.wrapped
    assert (cache.root_node.lock_ref, cache.root_node.device) == (1, "resident")


def test_the_checked_node_is_one_class_over_sglangs_and_born_with_checked_children(
    sg: Api,
) -> None:
    stock = sg.rc.TreeNode
    with patch():
        node = sg.rc.TreeNode()
        assert type(node).__mro__[1:] == stock.__mro__  # one class deeper, no more
        assert (isinstance(node, ResidencyMixin), isinstance(node, stock)) == (True, True)
        assert (type(node.children), node.sealed) == (Children, False)
        assert "children" not in vars(type(node))  # SGLang's plain attribute, no property
        allocator = FakeAllocator(8)
        cache = sg.rc.RadixCache(sg.cache_params(allocator))
        sg.insert(cache, [1, 2], allocator.take(2))
        (leaf,) = cache.root_node.children.values()
        assert (cache.root_node.sealed, leaf.sealed, type(leaf.children)) == (True, True, Children)
        assert sg.rc.defaultdict is Children
    assert (sg.rc.TreeNode, sg.rc.defaultdict) == (stock, defaultdict)
    assert type(stock().children) is defaultdict


def line_of(function: Any, text: str) -> str:
    """``file.py:N in name`` of the first line of ``function`` containing ``text``."""
    function = inspect.unwrap(function)
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if text in line)
    name = function.__code__.co_filename.rsplit("/", 1)[-1]
    return f"{name}:{start + offset} in {function.__name__}"


def test_a_double_release_is_refused_with_sglangs_call_sites(sg: Api, hiradix: Any) -> None:
    node = only_child(hiradix)
    here = inspect.currentframe()
    assert here is not None
    node.protect_host()
    node.release_host()
    refused_at = here.f_lineno + 2
    with pytest.raises(HostRefCounterZero) as caught:
        node.release_host()  # a second cleanup path: the bug
    hi = type(hiradix)
    test = "test_a_double_release_is_refused_with_sglangs_call_sites"
    assert str(caught.value) == (
        f"Host reference counter is already zero. node {node.id}: release refused in "
        "backed (pins=0): release without a matching pin; "
        f"written at {line_of(vars(hi)['_inc_hit_count'], 'self.write_backup(node)')}; "
        f"locked at {line_of(hi.write_backup, 'self.inc_lock_ref(node)')}; "
        f"acknowledged at {line_of(hi.writing_check, 'self.ongoing_write_through.pop')}; "
        f"unlocked at {line_of(hi.writing_check, 'self.dec_lock_ref(backuped_node)')}; "
        f"pinned at test_misuse.py:{refused_at - 4} in {test}; "
        f"released at test_misuse.py:{refused_at - 3} in {test}; "
        f"refused at test_misuse.py:{refused_at} in {test}"
    )
    assert (node.host_ref_counter, node.host) == (0, "backed")


def test_a_release_with_no_pin_is_refused(hiradix: Any) -> None:
    node = only_child(hiradix)
    with pytest.raises(HostRefCounterZero):
        node.release_host()
    assert node.host_ref_counter == 0


def test_an_unlock_at_zero_changes_no_count(sg: Api, patched: Any) -> None:
    del patched
    allocator = FakeAllocator(16)
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, [1, 2, 3, 4], allocator.take(4))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    before = (cache.evictable_size(), cache.protected_size(), node.lock_ref)
    with pytest.raises(error_class("UnlockAtZero")) as caught:
        cache.dec_lock_ref(node)
    assert str(caught.value).startswith(
        f"node {node.id}: unlock refused in resident (locks=0): unlock without a matching lock"
    )
    assert (cache.evictable_size(), cache.protected_size(), node.lock_ref) == before


def test_a_lock_count_written_directly_is_refused(sg: Api, patched: Any) -> None:
    del patched
    allocator = FakeAllocator(16)
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, [1, 2, 3, 4], allocator.take(4))
    node = sg.match(cache, [1, 2, 3, 4])[1]
    with pytest.raises(ReadOnlyCounter):
        node.lock_ref += 1  # a code path bypassing inc_lock_ref and its ancestors
    assert (node.lock_ref, cache.evictable_size()) == (0, 4)


def test_evicting_a_pinned_host_copy_is_refused_before_it_is_freed(
    hiradix: Any, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    node = only_child(hiradix)
    node.protect_host()  # a backup to storage holds it
    hiradix.evict(len(AB))
    host = hiradix.cache_controller.mem_pool_host
    before = list(host.freed)
    # a fork that lost evict_host's host_ref_counter check
    monkeypatch.setattr(patched.node_class, "host_ref_counter", property(lambda _: 0))
    with pytest.raises(HostCopyPinned) as caught:
        hiradix.evict_host(len(AB))
    assert str(caught.value).startswith(
        f"node {node.id}: evict_host refused in pinned (pins=1): the host copy is pinned by a holder"
    )
    assert (host.freed, node.backuped, only_child(hiradix) is node) == (before, True, True)


def test_a_lost_load_acknowledgement_keeps_its_pages_from_being_freed(
    sg: Api, allocator: FakeAllocator, hiradix: Any
) -> None:
    node = only_child(hiradix)
    hiradix.evict(len(AB))
    found = hiradix.match_prefix(sg.key(AB))
    hiradix.init_load_back(found.last_host_node, found.host_hit_length)
    hiradix.ready_to_load_host_cache()
    hiradix.cache_controller.ack_load_queue.clear()  # the acknowledgement is lost
    hiradix.dec_lock_ref(node)  # the request ends as if its load had landed
    freed = [list(f) for f in allocator.freed]
    with pytest.raises(CopyInFlight) as caught:
        hiradix.evict(len(AB))  # stock SGLang frees the slots the copy still writes
    assert str(caught.value).startswith(
        f"node {node.id}: evict_device refused in loading (locks=0): "
        "a host-to-device copy is still writing the device slots"
    )
    assert (allocator.freed, node.evicted) == (freed, False)


def test_a_host_copy_freed_under_its_load_is_refused_as_the_loads(sg: Api, hiradix: Any) -> None:
    """A fork that frees the host copy itself (``host_value = None``) while a load reads it."""
    node = only_child(hiradix)
    hiradix.evict(len(AB))
    found = hiradix.match_prefix(sg.key(AB))
    hiradix.init_load_back(found.last_host_node, found.host_hit_length)
    host_value = node.host_value
    with pytest.raises(CopyInFlight) as caught:
        node.host_value = None
    assert str(caught.value).startswith(
        f"node {node.id}: evict_host refused in pinned (pins=1, device loading): "
        "a host-to-device copy still reads the host slots; "
    )
    assert (node.host_value, node.host, node.pins, node.host_ref_counter) == (
        host_value,
        "pinned",
        1,
        0,
    )


def test_a_stray_write_acknowledgement_is_refused(hiradix: Any) -> None:
    node = only_child(hiradix)
    ctl = hiradix.cache_controller
    hiradix.ongoing_write_through[node.id] = node  # bookkeeping that lost track of the ack
    ctl.write(node.value, node_id=node.id)  # a second copy's ack names the node again
    ctl.finish_writes()
    with pytest.raises(DuplicateAck):
        hiradix.writing_check()
    assert (node.host, node.id in hiradix.ongoing_write_through) == ("backed", True)


def test_a_stray_release_on_a_loading_node_is_sglangs_release_at_zero(
    sg: Api, hiradix: Any
) -> None:
    node = only_child(hiradix)
    hiradix.evict(len(AB))
    found = hiradix.match_prefix(sg.key(AB))
    hiradix.init_load_back(found.last_host_node, found.host_hit_length)
    # the load holds a pin of its own, which is not SGLang's to count or release
    assert (node.host_ref_counter, node.pins, node.device) == (0, 1, "loading")
    with pytest.raises(HostRefCounterZero) as caught:
        node.release_host()  # nobody called protect_host()
    assert isinstance(caught.value, RuntimeError)  # what SGLang's callers catch
    assert str(caught.value).startswith(
        f"Host reference counter is already zero. node {node.id}: release refused in "
        "pinned (pins=1, device loading): the last pin belongs to the load in flight; "
    )
    assert (node.host_ref_counter, node.pins, node.host) == (0, 1, "pinned")
    hiradix.ready_to_load_host_cache()
    hiradix.cache_controller.finish_loads()
    hiradix.loading_check()
    assert (node.host_ref_counter, node.lock_ref, node.device) == (0, 0, "resident")


def test_a_cache_driven_after_its_patch_is_undone_is_refused_clearly(sg: Api) -> None:
    allocator = FakeAllocator(16)
    applied = patch()
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, [1, 2, 3], allocator.take(3))
    node = sg.match(cache, [1, 2, 3])[1]
    forwarder = sg.base.__file__  # base_prefix_cache.py: its frames are skipped while patched
    assert trail.is_internal(forwarder)
    applied.undo()
    assert not trail.is_internal(forwarder)
    with pytest.raises(PatchUndone) as caught:
        cache.inc_lock_ref(node)  # SGLang's own walk again, over a checked node
    assert str(caught.value) == (
        f"node {node.id}: lock_ref changed after the patch that built the node was undone; "
        "build the cache again, or undo the patch only when its caches are gone"
    )
    assert (node.lock_ref, node.locks) == (0, 0)
    fresh = sg.rc.RadixCache(sg.cache_params(FakeAllocator(16)))  # built after: stock
    assert not isinstance(fresh.root_node, ResidencyMixin)


def tree_nodes(cache: Any) -> list[Any]:
    """Every node of ``cache``'s tree, its root included."""
    nodes, stack = [], [cache.root_node]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def test_node_ids_name_one_node_across_undo_and_sglangs_own_class(sg: Api) -> None:
    """SGLang numbers nodes with ``TreeNode.counter``; patched, its own class counts on with it.

    Nodes of SGLang's own class built while patched (by a module that
    imported ``TreeNode`` before the patch), stock nodes built after an undo
    while patched ones live on, and nodes of a second patch all take ids
    no other node has, numbered on as stock SGLang numbers them.
    """
    stock = sg.rc.TreeNode
    allocator = FakeAllocator(32)
    with patch():
        first = sg.rc.RadixCache(sg.cache_params(allocator))
        sg.insert(first, [1, 2, 3], allocator.take(3))
        sg.insert(first, [1, 2, 4], allocator.take(3)[2:])  # splits [1, 2, 3]
        meanwhile = stock()
    after = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(after, [5, 6], allocator.take(2))
    with patch():
        again = sg.rc.RadixCache(sg.cache_params(allocator))
        sg.insert(again, [7], allocator.take(1))
    nodes = [*tree_nodes(first), meanwhile, *tree_nodes(after), *tree_nodes(again)]
    ids = sorted(node.id for node in nodes)
    assert ids == list(range(ids[0], ids[0] + 9))  # 4 + 1 + 2 + 2 nodes, each its own id
    assert stock.counter == ids[-1] + 1


def test_a_patch_refused_for_one_module_leaves_every_module_as_it_was(sg: Api) -> None:
    stock = (sg.rc.TreeNode, sg.rc.defaultdict, vars(sg.rc.RadixCache)["inc_lock_ref"])
    with pytest.raises(PatchError) as caught:
        patch(sg.rc, sg.base)  # base_prefix_cache has no TreeNode: refused after radix_cache
    assert str(caught.value) == f"{sg.base.__name__}: no TreeNode class to check"
    assert (sg.rc.TreeNode, sg.rc.defaultdict, vars(sg.rc.RadixCache)["inc_lock_ref"]) == stock
    with patch() as applied:  # nothing was left patched
        assert sg.rc.TreeNode is applied.node_class


def test_an_undo_repeated_after_a_new_patch_leaves_the_new_one_in_place(sg: Api) -> None:
    first = patch()
    first.undo()
    with patch() as second:
        first.undo()  # a cleanup path that runs twice
        with pytest.raises(PatchError, match=r"patched already; undo that patch first$"):
            patch()
        assert sg.rc.TreeNode is second.node_class


def test_two_threads_patching_at_once_get_one_patch_and_one_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first ``patch()`` is held after its check; a second one meanwhile waits for it.

    Unserialized, the second passes the same check and patches SGLang while
    the first is held, and the first then fails on a ``TreeNode`` checked
    already (or, a step later, patches over the second).
    """
    patch_module = importlib.import_module("fsm_cache.compat.sglang.patch")
    warn = patch_module._warn_unchecked  # noqa: SLF001
    checked, second_done = threading.Event(), threading.Event()

    def held_after_its_check(patched: set[str]) -> None:
        if threading.current_thread().name == "first":
            checked.set()
            second_done.wait(3.0)  # the second patch() runs to its end now, or waits
        warn(patched)

    monkeypatch.setattr(patch_module, "_warn_unchecked", held_after_its_check)
    outcome: dict[str, Any] = {}

    def run() -> None:
        name = threading.current_thread().name
        try:
            outcome[name] = patch()
        except PatchError as exc:
            outcome[name] = str(exc)
        finally:
            if name == "second":
                second_done.set()

    first = threading.Thread(target=run, name="first")
    first.start()
    assert checked.wait(30.0)
    second = threading.Thread(target=run, name="second")
    second.start()
    first.join()
    second.join()
    for applied in outcome.values():
        if isinstance(applied, Patch):
            applied.undo()
    assert isinstance(outcome["first"], Patch), outcome["first"]
    assert outcome["second"].endswith(": patched already; undo that patch first")


FORK = """
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode


class ForkCache(RadixCache):
    def graft(self, key, value):  # builds its node itself, as LMCRadixCache.match_prefix does
        node = TreeNode()
        node.key, node.value, node.parent = key, value, self.root_node
        self.root_node.children[("graft", node.id)] = node
        self.evictable_size_ += len(value)
        return node
"""


def fork_module(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fork's module holding a subclass of SGLang's ``RadixCache`` and SGLang's ``TreeNode``."""
    module = types.ModuleType(name)
    exec(compile(FORK, f"<{name}>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_a_subclass_defined_before_the_patch_builds_checked_nodes(
    sg: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its module's ``TreeNode`` is SGLang's; patched, it is the checked one, until the undo.

    Unpatched, the subclass's nodes are SGLang's own in a checked tree, and
    their first lock walk is refused as "built before patch()"; a module
    imported while patched would build checked nodes after the undo.
    """
    fork = fork_module("fork_cache", monkeypatch)
    stock = fork.TreeNode
    allocator = FakeAllocator(16)
    with patch() as applied:
        cache = fork.ForkCache(sg.cache_params(allocator))
        node = cache.graft(sg.key([1, 2]), allocator.take(2))
        cache.inc_lock_ref(node)
        assert (type(node), node.locks, cache.protected_size()) == (applied.node_class, 1, 2)
        late = fork_module("fork_cache_late", monkeypatch)
        assert late.TreeNode is applied.node_class
    assert (fork.TreeNode, late.TreeNode, sg.rc.TreeNode) == (stock, stock, stock)


OWN_WALK = """
from sglang.srt.mem_cache.radix_cache import RadixCache


class OwnWalkCache(RadixCache):
    def inc_lock_ref(self, node):  # a fork's own lock walk, not calling SGLang's
        while node != self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            node = node.parent
"""


@pytest.mark.parametrize("defined", ["before", "after"])
def test_a_subclass_override_is_checked_whenever_its_module_was_imported(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, defined: str
) -> None:
    """A storage backend's module is imported on demand: often after ``patch()``.

    Its override of a wrapped method is wrapped either way, so another
    cache's node is refused before its walk moves a count (unwrapped, its
    walk is refused at its first step, ``ReadOnlyCounter``: a count moves
    only inside a checked walk).
    """

    def fork() -> Any:
        module = types.ModuleType("own_walk_cache")
        monkeypatch.setitem(sys.modules, module.__name__, module)  # as an import does, first
        exec(compile(OWN_WALK, "<own_walk_cache>", "exec"), module.__dict__)
        return module.OwnWalkCache

    early = fork() if defined == "before" else None
    with patch() as applied:
        subclass = early or fork()
        own = inspect.unwrap(vars(subclass)["inc_lock_ref"])
        other = sg.rc.RadixCache(sg.cache_params(allocator))
        sg.insert(other, AB, allocator.take(len(AB)))
        node = sg.match(other, AB)[1]
        cache = subclass(sg.cache_params(FakeAllocator(16)))
        with pytest.raises(StaleNode, match=f"^node {node.id}: inc_lock_ref walks up to node "):
            cache.inc_lock_ref(node)
        assert (node.lock_ref, other.evictable_size(), other.protected_size()) == (0, 12, 0)
        assert "OwnWalkCache.inc_lock_ref" in applied.wrapped
    assert vars(subclass)["inc_lock_ref"] is own  # the undo restores the fork's method
    assert "__init_subclass__" not in vars(sg.rc.RadixCache)
    late = fork()  # one defined after the undo is left as it is
    assert not hasattr(vars(late)["inc_lock_ref"], "__wrapped__")


def test_a_copy_in_a_cache_built_while_another_thread_patched_is_refused(
    sg: Api, allocator: FakeAllocator, patched: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ``__init__`` ran unpatched, its nodes are checked: its copies would never be acknowledged.

    Unrefused, the backup is fired and its acknowledgement is not (SGLang's
    dict acknowledges nothing): the node stays ``writing``, and the next
    eviction of it is refused as a copy in flight.
    """
    del patched
    hi = hiradix_module()
    with monkeypatch.context() as unreached:  # the patch had not reached them yet
        for cls in (sg.rc.RadixCache, hi.HiRadixCache):
            unreached.setattr(cls, "__init__", inspect.unwrap(vars(cls)["__init__"]))
        cache = build_hiradix(sg, allocator, monkeypatch, "write_through")
    assert isinstance(cache.root_node, ResidencyMixin)
    before = whole_state(cache, allocator)
    node = cache.root_node
    with pytest.raises(BuiltBeforePatch) as caught:
        cache.write_backup(node)
    assert str(caught.value) == (
        "HiRadixCache: write_backup in a cache built before patch() (ongoing_write_through "
        "is SGLang's dict, which acknowledges no copy); build the cache after patching; "
        "nothing changed"
    )
    with pytest.raises(BuiltBeforePatch, match=r"^HiRadixCache: load_back in a cache built "):
        cache.load_back(node)
    assert whole_state(cache, allocator) == before


def locked_leaf(sg: Api, allocator: FakeAllocator) -> tuple[Any, Any]:
    """A patched ``RadixCache`` holding ``AB`` in one leaf, which a running request locks."""
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, AB, allocator.take(len(AB)))
    node = sg.match(cache, AB)[1]
    cache.inc_lock_ref(node)
    return cache, node


def counts(cache: Any, allocator: FakeAllocator, node: Any) -> tuple[Any, ...]:
    """What a refusal must leave as it was: SGLang's sizes, the free slots, the node's place."""
    in_tree = node in cache.root_node.children.values()
    return (
        cache.evictable_size(),
        cache.protected_size(),
        allocator.available_size(),
        node.lock_ref,
        in_tree,
        node.value.tolist(),
    )


def test_an_unlock_after_a_reset_is_refused_before_a_count_moves(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    cache, node = locked_leaf(sg, allocator)
    old_root = cache.root_node
    cache.reset()  # flush_cache while a request holds its lock
    before = (cache.evictable_size(), cache.protected_size(), node.lock_ref, old_root.lock_ref)
    here = inspect.currentframe()
    assert here is not None
    refused_at = here.f_lineno + 2
    with pytest.raises(StaleNode) as caught:
        cache.dec_lock_ref(node)  # the request finishes: stock SGLang moves every count first
    test = "test_an_unlock_after_a_reset_is_refused_before_a_count_moves"
    assert str(caught.value) == (
        f"node {node.id}: dec_lock_ref walks up to node {old_root.id}, which is not this "
        "cache's root: the node is from before a reset() or from another cache; nothing "
        f"changed; locked at {line_of(locked_leaf, 'cache.inc_lock_ref(node)')}; "
        f"refused at test_misuse.py:{refused_at} in {test}"
    )
    after = (cache.evictable_size(), cache.protected_size(), node.lock_ref, old_root.lock_ref)
    assert after == before == (0, 0, 1, 1)


def test_a_lock_of_another_caches_node_is_refused_before_a_count_moves(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    other = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(other, AB, allocator.take(len(AB)))
    node = sg.match(other, AB)[1]
    cache = sg.rc.RadixCache(sg.cache_params(FakeAllocator(16)))
    with pytest.raises(StaleNode, match=f"^node {node.id}: inc_lock_ref walks up to node "):
        cache.inc_lock_ref(node)
    assert (node.lock_ref, other.root_node.lock_ref, other.evictable_size()) == (0, 1, 12)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)


def test_evicting_a_locked_leaf_is_refused_before_its_slots_are_freed(
    sg: Api, allocator: FakeAllocator, patched: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, node = locked_leaf(sg, allocator)
    # a fork whose eviction lost the lock check offers the locked leaf as a victim
    if hasattr(cache, "evictable_leaves"):
        cache.evictable_leaves.add(node)
    else:
        monkeypatch.setattr(cache, "_collect_leaves", lambda: [node])
    before = counts(cache, allocator, node)
    with pytest.raises(error_class("DeviceLocked")) as caught:
        sg.evict(cache, len(AB))
    rc = sg.rc.RadixCache
    assert str(caught.value) == (
        f"node {node.id}: evict_device refused in resident (locks=1): a running request "
        f"holds the device copy; locked at {line_of(locked_leaf, 'cache.inc_lock_ref(node)')}; "
        f"refused at {line_of(rc.evict, 'heapq.heappop(eviction_heap)')}"
    )
    assert counts(cache, allocator, node) == before
    assert before[2:] == (len(allocator.free_slots), 1, True, list(range(12)))


def test_a_regular_eviction_of_a_locked_node_is_refused_before_its_slots_are_freed(
    sg: Api, allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch, patched: Any
) -> None:
    cache = build_hiradix(sg, allocator, monkeypatch, "write_through_selective")
    sg.insert(cache, AB, allocator.take(len(AB)))
    node = only_child(cache)
    here = inspect.currentframe()
    assert here is not None
    cache.inc_lock_ref(node)
    locked_at = here.f_lineno - 1
    before = counts(cache, allocator, node)
    refused_at = here.f_lineno + 3
    with pytest.raises(error_class("DeviceLocked")) as caught:
        # SGLang's eviction step, called as a fork's loop that lost the lock check calls it
        cache._evict_regular(node)  # noqa: SLF001
    test = "test_a_regular_eviction_of_a_locked_node_is_refused_before_its_slots_are_freed"
    assert str(caught.value) == (
        f"node {node.id}: evict_device refused in resident (locks=1): a running request "
        f"holds the device copy; locked at test_misuse.py:{locked_at} in {test}; "
        f"refused at test_misuse.py:{refused_at} in {test}"
    )
    assert counts(cache, allocator, node) == before


def test_a_lock_of_a_node_evict_deleted_is_refused(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, AB, allocator.take(len(AB)))
    node = sg.match(cache, AB)[1]  # a request matched it...
    sg.evict(cache, len(AB))  # ...and the eviction freed it before the request locked it
    assert (node in cache.root_node.children.values(), node.deleted) == (False, True)
    before = (cache.evictable_size(), cache.protected_size(), node.lock_ref)
    here = inspect.currentframe()
    assert here is not None
    refused_at = here.f_lineno + 2
    with pytest.raises(StaleNode) as caught:
        cache.inc_lock_ref(node)  # stock SGLang counts the freed slots as protected
    test = "test_a_lock_of_a_node_evict_deleted_is_refused"
    evict = line_of(sg.rc.RadixCache.evict, "heapq.heappop(eviction_heap)")
    assert str(caught.value) == (
        f"node {node.id}: inc_lock_ref of a node SGLang's eviction deleted from the tree "
        "(its device slots were freed); match the prefix again; nothing changed; "
        f"deleted at {evict}; refused at test_misuse.py:{refused_at} in {test}"
    )
    assert (cache.evictable_size(), cache.protected_size(), node.lock_ref) == before == (0, 0, 0)


def test_a_fork_deleting_a_node_with_a_child_on_the_device_is_refused(
    sg: Api, allocator: FakeAllocator, patched: Any
) -> None:
    """A fork's own ``_delete_leaf`` of a node that is no leaf: refused at the removal.

    SGLang deletes the node with its subtree: the child, still on the device,
    would leave the tree with its slots, never to be matched or freed. The
    check is in the node's ``children``, which every deletion passes through.
    """
    cache = sg.rc.RadixCache(sg.cache_params(allocator))
    sg.insert(cache, AB[:6], allocator.take(6))
    value = allocator.take(len(AB))
    allocator.free(value[: sg.insert(cache, AB, value)])
    parent = only_child(cache)
    (child,) = parent.children.values()
    before = whole_state(cache, allocator)
    with pytest.raises(error_class("NotADeviceLeaf")) as caught:
        cache._delete_leaf(parent)  # noqa: SLF001
    removal = "children.pop" if sg.new else "del node.parent.children"
    assert str(caught.value) == (
        f"node {parent.id}: delete refused in resident (locks=0, host unbacked): a child is "
        f"still on the device (device residency is prefix-closed): node {child.id} "
        "(unbacked/resident) would leave the tree with it, its slots never freed; free the "
        "copies below it first; nothing changed; "
        f"refused at {line_of(sg.rc.RadixCache._delete_leaf, removal)}"  # noqa: SLF001
    )
    assert whole_state(cache, allocator) == before
    cache._delete_leaf(child)  # noqa: SLF001
    # a node whose children went first is deleted as SGLang deletes it
    cache._delete_leaf(parent)  # noqa: SLF001
    assert cache.root_node.children == {}
