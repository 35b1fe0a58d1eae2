"""The SGLang drop-in's parts on a small SGLang-shaped node (no SGLang needed).

SGLang's own code runs against them in tests/sglang_real (``make test-sglang``);
these pin down each rule: fields are events once a node is attached, counters
move only in checked walks, splits and chains are acknowledged together.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import threading
import types
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from fsm_cache.compat.sglang import (
    AckBook,
    BuiltBeforePatch,
    Children,
    PatchError,
    ReadOnlyCounter,
    RemovedInUse,
    ResidencyMixin,
    absent_chain,
    back_out,
    deleting,
    loading,
    patch,
    ride,
    walk,
    walked,
)
from fsm_cache.compat.sglang.scope import CounterStep, counter_step
from fsm_cache.compat.sglang.unified import LockBook, ReceiptBook, lock_of
from fsm_cache.engine import trail
from fsm_cache.errors import (
    BadArgument,
    HostCopyPinned,
    IllegalTransition,
    LeaseError,
    NoHostCopy,
    StaleNode,
    error_class,
)
from fsm_cache.residency import Residency


class TreeNode:
    """SGLang's node, residency part, as it is before the migration."""

    def __init__(self, ident: int = 0) -> None:
        self.children: Any = defaultdict(TreeNode)
        self.parent: Any = None
        self.value: Any = None
        self.host_value: Any = None
        self.lock_ref = 0
        self.host_ref_counter = 0
        self.id = ident


class Checked(ResidencyMixin, TreeNode):
    residency = Residency()


def state(n: Checked) -> tuple[str, str, int, int]:
    return (n.host, n.device, n.pins, n.locks)


def tree(*values: Any) -> list[Checked]:
    """A root and a chain below it, one node per value (device slots; None: evicted)."""
    root = Checked(0)
    root.value, root.host_value, root.lock_ref = [], [], 1
    nodes = [root]
    for ident, value in enumerate(values, start=1):
        node = Checked(ident)
        node.parent, node.value = nodes[-1], value
        nodes[-1].children[ident] = node
        nodes.append(node)
    return nodes


def backed(node: Checked, slots: Any) -> None:
    """Back ``node`` up the way write_backup and writing_check do."""
    node.machine().write(node)
    node.host_value = slots
    node.machine().write_done(node)


def test_a_fresh_node_follows_its_fields_until_attached() -> None:
    root, node = tree([1, 2])
    assert (root.sealed, node.sealed) == (True, True)  # attaching a child seals both
    assert (type(root.children), type(node.children)) == (Children, Children)
    assert state(root) == ("backed", "resident", 0, 1)  # the cache's own lock on its root
    assert state(node) == ("unbacked", "resident", 0, 0)
    fresh = Checked(9)
    assert (fresh.evicted, fresh.backuped, fresh.device) == (True, False, "absent")
    fresh.value, fresh.host_value = [3], [4]
    assert state(fresh) == ("backed", "resident", 0, 0)


def test_host_slots_are_the_write_and_clearing_them_frees() -> None:
    _, node = tree([1, 2])
    node.host_value = [8, 9]  # write_backup without firing write first: inferred
    assert state(node)[0] == "writing"
    node.machine().write_done(node)
    node.protect_host()
    with pytest.raises(HostCopyPinned) as caught:
        node.host_value = None
    assert str(caught.value) == (
        "node 1: evict_host refused in pinned (pins=1): the host copy is pinned by a holder"
    )
    assert (node.host_value, state(node)) == ([8, 9], ("pinned", "resident", 1, 0))
    node.release_host()
    node.value = None
    node.host_value = None
    assert state(node)[:2] == ("evicted", "absent")


def test_device_slots_are_evictions_and_recomputations() -> None:
    _, node = tree([1, 2])
    with pytest.raises(NoHostCopy) as caught:
        node.value = None
    assert str(caught.value) == (
        "node 1: evict_device refused in resident (locks=0, host unbacked): "
        "the device copy is the only copy; back it up or delete the node"
    )
    assert node.value == [1, 2]
    backed(node, [8, 9])
    node.value = None
    assert state(node) == ("backed", "absent", 0, 0)
    node.value = [5, 6]  # insert over an evicted node: the request recomputed its KV
    assert state(node) == ("backed", "resident", 0, 0)
    node.value = [6]  # a split slices the slots: no event
    assert state(node) == ("backed", "resident", 0, 0)


def test_lock_ref_moves_only_inside_a_checked_walk() -> None:
    root, a, b = tree([1], [2])
    with pytest.raises(ReadOnlyCounter) as caught:
        b.lock_ref += 1
    assert str(caught.value) == (
        "node 2: lock_ref is driven by the residency machines; "
        "use cache.inc_lock_ref(node)/cache.dec_lock_ref(node)"
    )
    with walk(b, "lock") as path:
        assert path == [b, a]
        for n in path:
            n.lock_ref += 1
    assert (root.lock_ref, a.lock_ref, b.lock_ref) == (1, 1, 1)  # the root: no walk counts it
    with walk(b, "lock"), pytest.raises(ReadOnlyCounter):
        b.lock_ref += 2  # one step per node, by one
    b.dec_lock_ref()
    assert (a.locks, b.locks) == (0, 0)


def test_a_walk_refused_anywhere_changes_nothing() -> None:
    _, a, b = tree([1], [2])
    backed(a, [7])
    backed(b, [8])
    b.value = None
    a.value = None
    with pytest.raises(error_class("NotResident")), walk(b, "lock"):
        pytest.fail("the walk must refuse before its block runs")
    assert (a.locks, b.locks) == (0, 0)


def test_a_split_prefix_rides_on_its_childs_copy() -> None:
    root, node = tree([1, 2, 3, 4])
    node.machine().write(node)
    node.host_value = [8, 9, 10, 11]
    book = AckBook("write_done", {node.id: node})
    prefix = Checked(5)  # _split_node, field by field
    prefix.children = {3: node}
    prefix.parent, prefix.lock_ref = root, node.lock_ref
    prefix.value, node.value = node.value[:2], node.value[2:]
    prefix.host_value, node.host_value = node.host_value[:2], node.host_value[2:]
    node.parent = prefix
    root.children[1] = prefix
    assert (state(prefix), prefix.ack_with is node) == (("writing", "resident", 0, 0), True)
    book.pop(node.id)
    assert (state(prefix), state(node)) == (("backed", "resident", 0, 0),) * 2
    assert prefix.ack_with is None


def test_a_loaded_chain_is_acknowledged_together_or_backed_out() -> None:
    _, a, b = tree([1], [2])
    backed(a, [7])
    backed(b, [8])
    b.value = None
    a.value = None
    chain = absent_chain(b)
    assert chain == [a, b]
    loading(chain)  # load_back: before the controller allocates
    back_out(chain)  # no device memory: SGLang returns None
    assert (state(a), state(b)) == (("backed", "absent", 0, 0),) * 2
    loading(chain)
    a.value, b.value = [3], [4]
    ride(chain, b)
    AckBook("load_done", {b.id: b}).pop(b.id)
    assert (state(a), state(b)) == (("backed", "resident", 0, 0),) * 2


def test_host_ref_counter_takes_only_the_count_it_reads_while_a_load_holds_a_pin() -> None:
    _, node = tree([1])
    backed(node, [7])
    node.protect_host()
    node.value = None
    loading([node])  # the load's own pin: SGLang's count leaves it out
    assert (node.pins, node.host_ref_counter) == (2, 1)
    node.host_ref_counter = 1  # SGLang writing the count it reads: no change
    with pytest.raises(ReadOnlyCounter) as caught:
        node.host_ref_counter = 2
    assert str(caught.value) == (
        "node 1: host_ref_counter is driven by the residency machines; "
        "use protect_host()/release_host()"
    )
    assert (node.pins, node.host_ref_counter) == (2, 1)


def test_a_node_in_use_cannot_leave_the_tree() -> None:
    root, node = tree([1])
    node.inc_lock_ref()
    with pytest.raises(RemovedInUse) as caught:
        del root.children[1]
    assert str(caught.value) == (
        "node 1: removed from the tree in unbacked/resident (pins=0, locks=1); "
        "release its holders and wait for its copies first"
    )
    assert root.children[1] is node
    node.dec_lock_ref()
    assert root.children.pop(1) is node


def test_a_node_with_a_copy_below_it_cannot_leave_the_tree() -> None:
    """Deleting a node deletes its subtree: a child holding a copy in a tier is refused.

    Whoever deletes it: the eviction's check (:func:`deleting`, before SGLang
    frees anything) or the removal itself (``del``/``pop``, a fork's own
    ``_delete_leaf``), with the spec's refusal of dropping a copy above a child's.
    """
    root, a, b = tree([1], [2])
    backed(b, [8])
    b.value = None  # b: host only, under the unbacked a
    host_leaf = (
        "node 1: delete refused in unbacked (pins=0, device resident): a child still holds a "
        "host copy: node 2 (backed/absent) would leave the tree with it, its slots never "
        "freed; free the copies below it first; nothing changed"
    )
    with pytest.raises(error_class("NotAHostLeaf")) as caught:
        deleting(a)
    assert (str(caught.value), a.deleted) == (host_leaf, False)
    with pytest.raises(error_class("NotAHostLeaf")) as caught:
        del root.children[1]
    assert str(caught.value) == host_leaf
    with pytest.raises(error_class("NotAHostLeaf")) as caught:
        root.children.pop(1, None)
    assert str(caught.value) == host_leaf
    b.value = [4]  # b back on the device
    with pytest.raises(
        error_class("NotADeviceLeaf"), match=r"^node 1: delete refused in resident "
    ):
        root.children.pop(1)
    assert (root.children[1], a.children[2], state(a)) == (a, b, ("unbacked", "resident", 0, 0))
    b.value = None
    b.host_value = None  # its host copy evicted first, as SGLang's evict_host does
    del a.children[2]
    deleting(a)
    assert (root.children.pop(1), a.deleted) == (a, True)


def test_a_load_failed_while_locked_is_refused() -> None:
    _, node = tree([1])
    backed(node, [7])
    node.value = None
    loading([node])
    node.value = [3]
    node.inc_lock_ref()
    with pytest.raises(error_class("DeviceLocked")):
        node.machine().load_failed(node)
    assert state(node) == ("pinned", "loading", 1, 1)


# -- the lock walk's fast check --------------------------------------------------


def test_the_lock_walks_fast_check_is_read_off_the_spec() -> None:
    engine = Checked.machine().engine
    assert counter_step(engine, "lock") == CounterStep(
        "device", "locks", 1, {"resident": 0, "loading": 0}
    )
    assert counter_step(engine, "unlock") == CounterStep(
        "device", "locks", -1, {"resident": 1, "loading": 1}
    )
    assert counter_step(engine, "release") is None  # a rule reads the device region too
    assert counter_step(engine, "evict_device") is None  # moves a state, not a count


@pytest.mark.parametrize("event", ["lock", "unlock", "pin"])
def test_the_fast_check_agrees_with_the_full_one_at_every_count(event: str) -> None:
    engine = Checked.machine().engine
    fast = counter_step(engine, event)  # type: ignore[arg-type]
    assert fast is not None
    plan = engine.planner(event)
    regions = engine.system.machines
    for host, device, pins, locks in itertools.product(
        regions["host"].state_names, regions["device"].state_names, range(6), range(6)
    ):
        rec = engine.new()
        rec.host, rec.device, rec.pins, rec.locks = host, device, pins, locks
        count = getattr(rec, fast.counter)
        try:
            assigns, effects, _ = plan(rec)
        except IllegalTransition:
            pure = False
        else:
            changed = {a: v for a, v in assigns if getattr(rec, a) != v}
            pure = not effects and changed == {fast.counter: count + fast.delta}
        floor = fast.least.get(getattr(rec, fast.region))
        assert pure == (floor is not None and count >= floor), (host, device, pins, locks)


class LockCache:
    """A cache with SGLang's lock loop: bookkeeping, then one step per node, up to the root."""

    def __init__(self, root: ResidencyMixin, twice: bool = False) -> None:
        self.root_node = root
        self.disable = False
        self.twice = twice
        self.counted = 0

    def loop(self, node: Any, step: int) -> None:
        if self.disable:
            return
        while node is not self.root_node:
            self.counted += step  # SGLang's evictable_size_ moves here, before the step
            node.lock_ref += step
            if self.twice:
                node.lock_ref += step
            node = node.parent


def decorated(event: str, step: int) -> Callable[[LockCache, Any], None]:
    def method(self: LockCache, node: Any) -> None:
        self.loop(node, step)

    return walked(event, Checked.machine())(method)  # type: ignore[arg-type]


inc_lock_ref, dec_lock_ref = decorated("lock", 1), decorated("unlock", -1)


def armed(*nodes: Checked) -> list[Any]:
    return [n.pending for n in nodes]


def test_a_walked_lock_steps_each_node_once_and_leaves_none_armed() -> None:
    root, a, b = tree([1], [2])
    cache = LockCache(root)
    inc_lock_ref(cache, b)
    assert (a.locks, b.locks, root.locks, cache.counted, armed(a, b)) == (1, 1, 1, 2, [None, None])
    dec_lock_ref(cache, b)
    assert (a.locks, b.locks, cache.counted, armed(a, b)) == (0, 0, 0, [None, None])


def test_a_walked_lock_refused_anywhere_runs_nothing() -> None:
    root, a, b = tree([1], [2])
    cache = LockCache(root)
    with pytest.raises(error_class("UnlockAtZero")):
        dec_lock_ref(cache, b)
    assert (cache.counted, a.locks, b.locks, armed(a, b)) == (0, 0, 0, [None, None])
    backed(a, [7])
    backed(b, [8])
    b.value = None
    a.value = None
    with pytest.raises(error_class("NotResident")):
        inc_lock_ref(cache, b)
    assert (cache.counted, a.locks, b.locks, armed(a, b)) == (0, 0, 0, [None, None])
    cache.disable = True
    inc_lock_ref(cache, b)  # a disabled cache's walk returns at once, unchecked
    assert (cache.counted, b.locks) == (0, 0)


def test_a_walked_lock_that_steps_a_node_twice_is_refused() -> None:
    root, a, b = tree([1], [2])
    cache = LockCache(root, twice=True)
    with pytest.raises(ReadOnlyCounter):
        inc_lock_ref(cache, b)
    assert (b.locks, armed(a, b)) == (1, [None, None])  # the checked step, and no more


def next_line() -> int:
    """The line after the caller's current one."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


class Trailed(ResidencyMixin, TreeNode):
    residency = Residency(trail=True)


def trailed_chain() -> tuple[Trailed, Trailed]:
    """A trail-mode root and one node under it."""
    root, node = Trailed(0), Trailed(1)
    root.value, root.host_value, root.lock_ref = [], [], 1
    node.parent, node.value = root, [5]
    root.children[1] = node
    return root, node


def test_a_walks_steps_are_noted_where_the_walk_was_called() -> None:
    root, node = trailed_chain()
    cache = LockCache(root)
    lock, unlock = (walked(e, Trailed.machine())(LockCache.loop) for e in ("lock", "unlock"))
    first = next_line()
    lock(cache, node, 1)
    unlock(cache, node, -1)  # the request's release...
    with pytest.raises(error_class("UnlockAtZero")) as caught:
        unlock(cache, node, -1)  # ...and a second cleanup path: both calls are named
    test = f"test_sglang_compat.py:{{}} in {test_a_walks_steps_are_noted_where_the_walk_was_called.__name__}"
    assert str(caught.value) == (
        "node 1: unlock refused in resident (locks=0): unlock without a matching lock; "
        f"locked at {test.format(first)}; unlocked at {test.format(first + 1)}; "
        f"refused at {test.format(first + 3)}"
    )
    assert (node.locks, cache.counted, node.pending) == (0, 0, None)


def test_a_nodes_own_lock_walk_is_noted_at_its_caller() -> None:
    _, node = trailed_chain()
    first = next_line()
    node.inc_lock_ref()
    node.dec_lock_ref()
    test = "test_a_nodes_own_lock_walk_is_noted_at_its_caller"
    assert [(event, str(site)) for event, site in trail.sites(node.trail)] == [
        ("lock", f"test_sglang_compat.py:{first} in {test}"),
        ("unlock", f"test_sglang_compat.py:{first + 1} in {test}"),
    ]


def test_a_walk_that_ends_at_another_root_is_refused_before_the_loop() -> None:
    old_root, a, b = tree([1], [2])
    cache = LockCache(old_root)
    inc_lock_ref(cache, b)
    cache.root_node = tree()[0]  # reset(): a new root; the lock's path still ends at the old one
    with pytest.raises(StaleNode) as caught:
        dec_lock_ref(cache, b)
    assert str(caught.value) == (
        "node 2: method walks up to node 0, which is not this cache's root: the node is from "
        "before a reset() or from another cache; nothing changed"
    )
    assert (cache.counted, a.locks, b.locks, armed(a, b)) == (2, 1, 1, [None, None])


def test_a_victim_is_checked_before_its_slots_are_freed_and_then_cannot_be_locked() -> None:
    root, a, b = tree([1], [2])
    cache = LockCache(root)
    inc_lock_ref(cache, b)
    with pytest.raises(error_class("DeviceLocked")):
        deleting(b)  # a fork's eviction offers a locked leaf
    assert (state(b), b.deleted) == (("unbacked", "resident", 0, 1), False)
    dec_lock_ref(cache, b)
    deleting(b)  # SGLang frees the only copy and deletes the node: no event, a mark
    assert (state(b), b.deleted) == (("unbacked", "resident", 0, 0), True)
    with pytest.raises(StaleNode, match=r"^node 2: lock of a node SGLang's eviction deleted"):
        walk(b, "lock")
    with pytest.raises(StaleNode, match=r"^node 2: method of a node SGLang's eviction deleted"):
        inc_lock_ref(cache, b)
    assert (cache.counted, a.locks, b.locks) == (0, 0, 0)
    del a.children[2]  # SGLang's _delete_leaf
    backed(a, [7])
    deleting(a)  # with a host copy, the device eviction fires
    assert (state(a), a.deleted) == (("backed", "absent", 0, 0), False)


# -- the patch, on a module shaped like SGLang's -----------------------------------

SGLANG_SHAPED = """
from collections import defaultdict


class TreeNode:
    counter = 0

    def __init__(self):
        self.children = defaultdict(TreeNode)
        self.parent = None
        self.value = None
        self.lock_ref = 0
        self.id = TreeNode.counter
        TreeNode.counter += 1


class RadixCache:
    def __init__(self):
        self.disable = False
        self.reset()

    def reset(self):
        self.root_node = TreeNode()
        self.root_node.value = []
        self.root_node.lock_ref = 1

    def insert(self, key, value):
        node = TreeNode()
        node.parent, node.value = self.root_node, value
        self.root_node.children[key] = node
        return node

    def inc_lock_ref(self, node):
        while node is not self.root_node:
            node.lock_ref += 1
            node = node.parent
"""


@pytest.fixture
def shaped(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("sglang_shaped_radix_cache")
    exec(compile(SGLANG_SHAPED, module.__name__, "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_the_patch_builds_a_flat_checked_node_with_checked_children(
    shaped: types.ModuleType,
) -> None:
    stock = shaped.TreeNode
    with patch(shaped) as applied:
        cache = shaped.RadixCache()
        node = cache.insert(1, [5, 6])
        assert type(node) is applied.node_class
        assert type(node).__mro__[1:] == stock.__mro__  # SGLang's class, one level down
        assert isinstance(node, ResidencyMixin)
        assert issubclass(shaped.TreeNode, ResidencyMixin)
        assert (cache.root_node.sealed, node.sealed, type(node.children)) == (True, True, Children)
        assert "children" not in vars(shaped.TreeNode)  # built as Children: no property
        cache.inc_lock_ref(node)
        assert (node.lock_ref, cache.root_node.lock_ref, node.pending) == (1, 1, None)
        with pytest.raises(ReadOnlyCounter):
            node.lock_ref += 1
    assert (shaped.TreeNode, shaped.defaultdict) == (stock, defaultdict)


def test_building_a_node_while_patched_writes_no_class_namespace(
    shaped: types.ModuleType,
) -> None:
    """SGLang's ``TreeNode.counter += 1`` moves the one count, not a class's namespace.

    A write into a class's namespace (or its base's) costs the class every
    lookup CPython cached for its nodes; SGLang builds a node per request.
    """
    stock = shaped.TreeNode
    with patch(shaped):
        checked: Any = shaped.TreeNode
        cache = shaped.RadixCache()
        count, namespace = vars(stock)["counter"], dict(vars(checked))
        first, second = cache.insert(1, [5]), cache.insert(2, [6])
        assert (vars(stock)["counter"], dict(vars(checked))) == (count, namespace)
        assert vars(stock)["counter"] is count
        assert (first.id + 1, second.id + 1) == (second.id, stock.counter)
        assert checked.counter == stock.counter
        checked.counter = 0  # 0.5.6's HiRadixCache.reset numbers anew
        assert (cache.insert(3, [7]).id, stock.counter) == (0, 1)
    assert (type(vars(stock)["counter"]), stock.counter) == (int, 1)  # SGLang's int again
    checked.counter += 1  # the checked class, after the undo: SGLang's int, as stock
    assert (type(vars(stock)["counter"]), stock.counter) == (int, 2)


def test_sglangs_own_class_numbered_anew_while_patched_numbers_the_checked_one(
    shaped: types.ModuleType,
) -> None:
    stock = shaped.TreeNode  # what a module that imported it before the patch holds
    with patch(shaped):
        cache = shaped.RadixCache()
        first = cache.insert(1, [5])
        own = stock()  # SGLang's class: numbered on with the checked one
        stock.counter = 0  # 0.5.6's HiRadixCache.reset through that module: an int, as stock
        second, third = cache.insert(2, [6]), cache.insert(3, [7])
        assert not isinstance(vars(stock)["counter"], int)  # a count again, from there on
    ids = [n.id for n in (cache.root_node, first, own)]
    assert ids == list(range(ids[0], ids[0] + 3))
    assert (second.id, third.id) == (0, 1)
    assert (type(vars(stock)["counter"]), stock.counter) == (int, 2)


SHARING = """
from sglang_shaped_radix_cache import TreeNode


class RadixCache:
    def __init__(self):
        self.disable = False
        self.root_node = TreeNode()
        self.root_node.value = []
        self.root_node.lock_ref = 1

    def insert(self, key, value):
        node = TreeNode()
        node.parent, node.value = self.root_node, value
        self.root_node.children[key] = node
        return node
"""


@pytest.mark.parametrize("first_undone", [True, False])
def test_two_patches_over_one_sglang_node_class_share_its_count(
    shaped: types.ModuleType, monkeypatch: pytest.MonkeyPatch, first_undone: bool
) -> None:
    """Two modules importing one ``TreeNode``, each under a patch of its own: one count."""
    other = types.ModuleType("sglang_shaped_other_cache")
    exec(compile(SHARING, other.__name__, "exec"), other.__dict__)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    stock = shaped.TreeNode
    first, second = patch(shaped), patch(other)
    assert first.node_class is not second.node_class
    ours, theirs = shaped.RadixCache(), other.RadixCache()
    nodes = [ours.root_node, theirs.root_node, ours.insert(1, [5]), theirs.insert(1, [6])]
    (first if first_undone else second).undo()
    assert (type(vars(stock)["counter"]), stock.counter) == (int, nodes[-1].id + 1)
    still = theirs if first_undone else ours
    nodes += [still.insert(2, [7]), stock(), still.insert(3, [8])]
    (second if first_undone else first).undo()
    ids = [n.id for n in nodes]
    assert ids == list(range(ids[0], ids[0] + 7))
    assert (type(vars(stock)["counter"]), stock.counter) == (int, ids[-1] + 1)


def test_a_cache_built_before_the_patch_is_refused_before_its_walk_runs(
    shaped: types.ModuleType,
) -> None:
    cache = shaped.RadixCache()  # SGLang's own nodes
    node = cache.insert(1, [5, 6])
    with patch(shaped), pytest.raises(BuiltBeforePatch) as caught:
        cache.inc_lock_ref(node)
    assert str(caught.value) == (
        f"node {node.id}: inc_lock_ref of a node built before patch() (SGLang's own TreeNode, "
        "unchecked); build the cache after patching; nothing changed"
    )
    assert (node.lock_ref, cache.root_node.lock_ref) == (0, 1)
    stock_error = "'NoneType' object has no attribute 'deleted'"
    with patch(shaped), pytest.raises(AttributeError, match=stock_error):
        cache.inc_lock_ref(None)  # not a node: an AttributeError, as stock


REGISTERING = """
class Registering(RadixCache):
    registered = []

    def __init_subclass__(cls, tag="", **kwargs):
        super().__init_subclass__(**kwargs)
        Registering.registered.append((cls.__name__, tag))
"""

LATER = """
from sglang_shaped_radix_cache import Registering, TreeNode


class Later(Registering, tag="later"):
    def inc_lock_ref(self, node):
        while node is not self.root_node:
            node.lock_ref += 1
            node = node.parent
"""


def test_a_subclass_defined_while_patched_is_adopted_beside_its_own_init_subclass(
    shaped: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    exec(compile(REGISTERING, shaped.__name__, "exec"), shaped.__dict__)
    registering = vars(shaped.RadixCache).get("__init_subclass__")
    hook = vars(shaped.Registering)["__init_subclass__"]
    later = types.ModuleType("sglang_shaped_later")
    monkeypatch.setitem(sys.modules, later.__name__, later)
    with patch(shaped) as applied:
        exec(compile(LATER, later.__name__, "exec"), later.__dict__)
        assert shaped.Registering.registered == [("Later", "later")]  # its own hook ran
        assert "Later.inc_lock_ref" in applied.wrapped
        cache = later.Later()
        node = cache.insert(1, [5, 6])
        cache.inc_lock_ref(node)  # wrapped: a checked walk (unwrapped: ReadOnlyCounter)
        assert (type(node), node.lock_ref) == (applied.node_class, 1)
    assert vars(shaped.RadixCache).get("__init_subclass__") is registering is None
    assert vars(shaped.Registering)["__init_subclass__"] is hook
    assert not hasattr(vars(later.Later)["inc_lock_ref"], "__wrapped__")


@dataclass
class Receipt:
    """SGLang 0.5.23's ``DecLockRefParams``: the anchor and the components the acquire left."""

    node_id: int
    skipped_lock_components: tuple[str, ...] = ()


class TreeCore:
    """SGLang 0.5.23's tree core, as the boundary reads it: ``is_root`` looks the node id up."""

    def __init__(self, nodes: set[int]) -> None:
        self.nodes = nodes

    def is_root(self, node_id: int) -> bool:
        if node_id not in self.nodes:
            raise KeyError(node_id)  # the Python core's node map
        return node_id == 0


class UnifiedCache:
    """SGLang 0.5.23's ``UnifiedRadixCache``, lock boundary only: counts per node id, as its core."""

    def __init__(self) -> None:
        self.disable = False
        self.reset()

    def reset(self) -> None:
        self.refs: dict[int, int] = {}
        self.tree_core = TreeCore({0, 7, 8, 9})

    def inc_lock_ref(self, node_id: int) -> Receipt:
        self.refs[node_id] = self.refs.get(node_id, 0) + 1
        return Receipt(node_id)

    def dec_lock_ref(self, node_id: int, params: Receipt) -> None:
        assert params.node_id == node_id, "receipt anchored elsewhere"
        if "FULL" in params.skipped_lock_components:  # an auxiliary component's part only
            return
        assert self.refs.get(node_id, 0) > 0, f"lock_ref=0 on node {node_id}"
        self.refs[node_id] -= 1

    inc_host_lock_ref = inc_lock_ref
    dec_host_lock_ref = dec_lock_ref


def boundary_module(cache: type | None = UnifiedCache) -> types.ModuleType:
    """A module standing in for 0.5.23's ``unified_radix_cache``, defining ``cache`` if given."""
    module = types.ModuleType("sglang.srt.mem_cache.unified_radix_cache")
    if cache is not None:
        module.UnifiedRadixCache = cache  # type: ignore[attr-defined]
    return module


def test_the_lock_boundary_refuses_a_release_with_no_acquire_left_before_sglang_runs() -> None:
    module = boundary_module()
    with patch(module, trail=False) as applied:
        assert applied.wrapped[-1] == "UnifiedRadixCache.reset"
        cache = module.UnifiedRadixCache()
        one, two, other = cache.inc_lock_ref(7), cache.inc_lock_ref(7), cache.inc_lock_ref(8)
        cache.dec_lock_ref(7, one)
        with pytest.raises(BadArgument) as elsewhere:
            cache.dec_lock_ref(8, two)  # refused before SGLang's assert (a panic on Rust)
        assert str(elsewhere.value) == (
            "UnifiedCache: dec_lock_ref on node 8 given a receipt anchored on node 7; a "
            "receipt is released on the node it was taken on; nothing changed"
        )
        cache.dec_lock_ref(8, other)  # node 8's receipt is still out
        cache.dec_lock_ref(7, Receipt(7, ("FULL",)))  # a part that holds no FULL lock
        cache.dec_lock_ref(7, two)
        with pytest.raises(error_class("UnlockAtZero")) as caught:
            cache.dec_lock_ref(7, two)
        assert str(caught.value) == (
            "node 7: unlock refused in resident (locks=0): unlock without a matching lock"
        )
        assert cache.refs == {7: 0, 8: 0}  # SGLang's method never ran
        cache.dec_host_lock_ref(7, cache.inc_host_lock_ref(7))
        with pytest.raises(error_class("ReleaseAtZero")):
            cache.dec_host_lock_ref(7, one)
        held = cache.inc_lock_ref(9)
        cache.reset()
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(9, held)
        cache.disable = True  # SGLang's disabled cache returns before its core: unchecked
        with pytest.raises(AssertionError, match="lock_ref=0"):
            cache.dec_lock_ref(9, held)


def test_the_lock_boundary_refuses_an_acquire_on_a_node_the_tree_does_not_have() -> None:
    module = boundary_module()
    with patch(module, trail=False):
        cache = module.UnifiedRadixCache()
        with pytest.raises(StaleNode) as stale:
            cache.inc_lock_ref(5)
        assert str(stale.value) == (
            "UnifiedCache: inc_lock_ref on node 5, which is not in the tree (evicted, or "
            "from before a reset); match the prefix again; nothing changed"
        )
        with pytest.raises(BadArgument, match=r"^UnifiedCache: inc_host_lock_ref given None"):
            cache.inc_host_lock_ref(None)
        assert cache.refs == {}  # SGLang's acquires never ran
        cache.dec_lock_ref(7, cache.inc_lock_ref(7))


def test_the_lock_boundary_tells_two_receipts_on_one_node_apart() -> None:
    module = boundary_module()
    with patch(module, trail=False):
        cache = module.UnifiedRadixCache()
        first, second = cache.inc_lock_ref(7), cache.inc_lock_ref(7)
        cache.dec_lock_ref(7, first)
        with pytest.raises(LeaseError) as twice:
            cache.dec_lock_ref(7, first)  # second is out: counting alone let this pass
        assert str(twice.value) == (
            f"node 7: dec_lock_ref refused: this receipt (Receipt at {id(first):#x}) was "
            "released already; the node's 1 other receipt(s) out stay held; nothing changed"
        )
        assert cache.refs == {7: 1}  # SGLang's method never ran
        cache.dec_lock_ref(7, second)
        wrapper = vars(module.UnifiedRadixCache)["dec_lock_ref"]
        book = inspect.getclosurevars(wrapper).nonlocals["self"].books[cache]
        assert len(book.spent) == 2
        book.sweep()
        assert len(book.spent) == 2  # both receipts still held here
        del first, second, twice  # freed (the refusal's frames held one): the book forgets them
        book.sweep()
        assert book.spent == {}


@dataclass
class MapReceipt(Receipt):
    """A ``DecLockRefParams`` made by hand, its two uuid maps one object."""

    component_lock_uuids: dict[str, int] = field(default_factory=dict)
    component_host_lock_uuids: dict[str, int] = field(default_factory=dict)


def test_the_lock_boundary_forgets_a_lock_whose_receipt_shares_one_map_twice() -> None:
    module = boundary_module()
    with patch(module, trail=False):
        cache = module.UnifiedRadixCache()
        cache.inc_lock_ref(7)
        uuids: dict[str, int] = {}
        receipt = MapReceipt(7, component_lock_uuids=uuids, component_host_lock_uuids=uuids)
        cache.dec_lock_ref(7, receipt)
        wrapper = vars(module.UnifiedRadixCache)["dec_lock_ref"]
        book = inspect.getclosurevars(wrapper).nonlocals["self"].books[cache]
        del receipt, uuids  # nothing but the book holds the map: no copy can come back
        book.sweep()
        assert book.spent == {}


def own_locks(through_base: str) -> type[UnifiedCache]:
    """A subclass overriding the lock pair: one method through the base's, the other on its own.

    ``through_base`` names the one that calls ``super()``; the other moves the
    counts itself, as an override calling ``self.tree_core`` directly does.
    """

    class OwnLocks(UnifiedCache):
        def inc_lock_ref(self, node_id: int) -> Receipt:
            if through_base == "inc_lock_ref":
                return super().inc_lock_ref(node_id)
            self.refs[node_id] = self.refs.get(node_id, 0) + 1
            return Receipt(node_id)

        def dec_lock_ref(self, node_id: int, params: Receipt) -> None:
            if through_base == "dec_lock_ref":
                super().dec_lock_ref(node_id, params)
            else:
                self.refs[node_id] -= 1

    return OwnLocks


@pytest.mark.parametrize("defined", ["before", "after"])
@pytest.mark.parametrize("through_base", ["inc_lock_ref", "dec_lock_ref"])
def test_a_subclass_override_of_the_lock_boundary_is_checked_and_counted_once(
    defined: str, through_base: str
) -> None:
    """Whether its override calls the base's or not, and whenever it was defined.

    Unwrapped, an acquire that skips the base's went uncounted (its release
    was refused on a correct server) and a release that skips it went
    unchecked; wrapped naively, one that calls the base's counts twice.
    """
    module = boundary_module()
    early = own_locks(through_base) if defined == "before" else None
    stock = {name: vars(UnifiedCache)[name] for name in ("inc_lock_ref", "dec_lock_ref")}
    with patch(module, trail=False) as applied:
        subclass = early or own_locks(through_base)
        own = {name: inspect.unwrap(vars(subclass)[name]) for name in stock}
        assert {"OwnLocks.inc_lock_ref", "OwnLocks.dec_lock_ref"} <= set(applied.wrapped)
        cache = subclass()
        first, second = cache.inc_lock_ref(7), cache.inc_lock_ref(7)
        cache.dec_lock_ref(7, first)
        with pytest.raises(LeaseError) as twice:
            cache.dec_lock_ref(7, first)  # second is out: SGLang would take its lock
        assert str(twice.value) == (
            f"node 7: dec_lock_ref refused: this receipt (Receipt at {id(first):#x}) was "
            "released already; the node's 1 other receipt(s) out stay held; nothing changed"
        )
        assert cache.refs == {7: 1}  # the override never ran
        cache.dec_lock_ref(7, second)  # counted once each: second is still out
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(7, second)
        assert cache.refs == {7: 0}
    assert {name: vars(subclass)[name] for name in stock} == own  # the undo restores them
    assert {name: vars(UnifiedCache)[name] for name in stock} == stock
    assert "__init_subclass__" not in vars(UnifiedCache)
    late = own_locks(through_base)  # one defined after the undo is left as it is
    assert not hasattr(vars(late)["dec_lock_ref"], "__wrapped__")


def mixed_locks() -> type[UnifiedCache]:
    """A subclass whose lock pair comes from a mixin ahead of the cache, moving the counts itself."""

    class OwnLocksMixin:
        refs: dict[int, int]

        def inc_lock_ref(self, node_id: int) -> Receipt:
            self.refs[node_id] = self.refs.get(node_id, 0) + 1
            return Receipt(node_id)

        def dec_lock_ref(self, node_id: int, params: Receipt) -> None:
            self.refs[node_id] -= 1

    class Mixed(OwnLocksMixin, UnifiedCache):
        pass

    return Mixed


@pytest.mark.parametrize("defined", ["before", "after"])
def test_a_mixins_override_of_the_lock_boundary_is_checked_and_counted(defined: str) -> None:
    """A mixin's method ahead of the cache in the MRO is the subclass's override.

    Unwrapped (only the subclass's own namespace was looked at), its lock was
    not counted, so its correct release was refused, and a receipt it
    released twice went unchecked.
    """
    module = boundary_module()
    early = mixed_locks() if defined == "before" else None
    with patch(module, trail=False) as applied:
        subclass = early or mixed_locks()
        mixin = subclass.__mro__[1]
        own = {name: vars(mixin)[name] for name in ("inc_lock_ref", "dec_lock_ref")}
        assert {"Mixed.inc_lock_ref", "Mixed.dec_lock_ref"} <= set(applied.wrapped)
        cache = subclass()
        first, second = cache.inc_lock_ref(7), cache.inc_lock_ref(7)
        cache.dec_lock_ref(7, first)
        with pytest.raises(LeaseError) as twice:
            cache.dec_lock_ref(7, first)
        assert str(twice.value) == (
            f"node 7: dec_lock_ref refused: this receipt (Receipt at {id(first):#x}) was "
            "released already; the node's 1 other receipt(s) out stay held; nothing changed"
        )
        assert cache.refs == {7: 1}  # the mixin's method never ran
        cache.dec_lock_ref(7, second)
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(7, Receipt(7))
        assert cache.refs == {7: 0}
        assert {name: vars(mixin)[name] for name in own} == own  # the mixin is left as it is
    assert not {"inc_lock_ref", "dec_lock_ref"} & set(vars(subclass))  # the undo deletes them
    assert {name: vars(mixin)[name] for name in own} == own


@pytest.mark.parametrize("through_base", [True, False])
def test_a_reset_override_that_locks_after_its_reset_keeps_the_lock_counted(
    through_base: bool,
) -> None:
    """The book is cleared once per reset, where the tree is dropped, not after the override.

    An override that called the base's ``reset`` and then locked a node had
    the book cleared a second time on its return: the lock was lost, and its
    correct release refused. One that drops the tree itself still clears it.
    """

    class Pinning(UnifiedCache):
        def reset(self) -> None:
            if through_base:
                super().reset()
                self.pinned = self.inc_lock_ref(0)
            else:  # its own tree, no lock: the book is cleared on its return
                self.refs = {}
                self.tree_core = TreeCore({0, 7, 8, 9})

    module = boundary_module()
    with patch(module, trail=False):
        cache = Pinning()
        held = cache.inc_lock_ref(7)
        cache.reset()
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(7, held)  # dropped with the tree
        if through_base:
            cache.dec_lock_ref(0, cache.pinned)
            with pytest.raises(error_class("UnlockAtZero")):
                cache.dec_lock_ref(0, cache.pinned)
            assert cache.refs == {0: 0}


def test_an_override_calling_the_base_for_another_node_counts_its_own() -> None:
    """What an override is counted for is its own node: a base call for another counts that one.

    Keyed by method alone, the base's call for node 8 stood for the
    override's lock of node 7, which was then not counted, and its correct
    release refused.
    """

    class Neighbour(UnifiedCache):
        def inc_lock_ref(self, node_id: int) -> Receipt:
            if node_id == 7:
                self.neighbour = super().inc_lock_ref(8)
            self.refs[node_id] = self.refs.get(node_id, 0) + 1
            return Receipt(node_id)

    module = boundary_module()
    with patch(module, trail=False):
        cache = Neighbour()
        receipt = cache.inc_lock_ref(7)
        cache.dec_lock_ref(7, receipt)
        cache.dec_lock_ref(8, cache.neighbour)
        assert cache.refs == {7: 0, 8: 0}
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(8, Receipt(8))


def test_nested_overrides_record_a_call_once() -> None:
    """An override calling ``super()`` into one that moves the core itself is counted once.

    The inner override recorded its call, and the outer, seeing the base's
    not reached, recorded it again: a release with no lock left passed the
    book and reached SGLang's ``assert``.
    """

    class Inner(UnifiedCache):
        def inc_lock_ref(self, node_id: int) -> Receipt:
            self.refs[node_id] = self.refs.get(node_id, 0) + 1
            return Receipt(node_id)

    class Outer(Inner):
        def inc_lock_ref(self, node_id: int) -> Receipt:
            return super().inc_lock_ref(node_id)

    module = boundary_module()
    with patch(module, trail=False):
        cache = Outer()
        cache.dec_lock_ref(7, cache.inc_lock_ref(7))
        with pytest.raises(error_class("UnlockAtZero")):
            cache.dec_lock_ref(7, Receipt(7))
        assert cache.refs == {7: 0}


def test_an_override_that_moves_the_core_after_the_base_raised_is_counted() -> None:
    """The base's wrapper marked the call reached before SGLang's method ran, and raised."""

    class Boom(Exception):
        pass

    class Flaky(UnifiedCache):
        fail = False

        def inc_lock_ref(self, node_id: int) -> Receipt:
            if self.fail:
                self.fail = False
                raise Boom
            return super().inc_lock_ref(node_id)

        dec_lock_ref = UnifiedCache.dec_lock_ref  # the patched class defines the whole boundary
        inc_host_lock_ref = UnifiedCache.inc_host_lock_ref
        dec_host_lock_ref = UnifiedCache.dec_host_lock_ref
        reset = UnifiedCache.reset

    module = boundary_module(Flaky)
    with patch(module, trail=False):

        class Fallback(Flaky):
            def inc_lock_ref(self, node_id: int) -> Receipt:
                try:
                    return super().inc_lock_ref(node_id)
                except Boom:  # the lock taken on the core by hand, as the base would
                    self.refs[node_id] = self.refs.get(node_id, 0) + 1
                    return Receipt(node_id)

        cache = Fallback()
        cache.fail = True
        receipt = cache.inc_lock_ref(7)
        assert cache.refs == {7: 1}
        cache.dec_lock_ref(7, receipt)  # its correct release: refused as UnlockAtZero before
        assert cache.refs == {7: 0}


def test_a_base_call_on_another_thread_does_not_stand_for_an_overrides_own() -> None:
    """Whether a wrapper inside an override's call recorded it is asked of this thread's calls only."""

    class Threaded(UnifiedCache):
        def inc_lock_ref(self, node_id: int) -> Receipt:
            other = threading.Thread(
                target=lambda: taken.append(super(Threaded, self).inc_lock_ref(7))
            )
            other.start()
            other.join()
            self.refs[node_id] = self.refs.get(node_id, 0) + 1
            return Receipt(node_id)

    taken: list[Receipt] = []
    module = boundary_module()
    with patch(module, trail=False):
        cache = Threaded()
        own = cache.inc_lock_ref(7)
        cache.dec_lock_ref(7, taken[0])
        cache.dec_lock_ref(7, own)  # counted: the other thread's lock was that thread's
        assert cache.refs == {7: 0}


def test_a_boundary_module_without_its_cache_class_is_refused() -> None:
    with pytest.raises(PatchError) as caught:
        patch(boundary_module(None))
    assert str(caught.value) == (
        "sglang.srt.mem_cache.unified_radix_cache: no UnifiedRadixCache defining "
        "inc_lock_ref, dec_lock_ref, inc_host_lock_ref, dec_host_lock_ref, reset to check; "
        "see docs/sglang.md for the releases patch() supports"
    )


class SlotReceipt:
    """A receipt with the two uuid maps that cannot be weakly referenced (``__slots__``)."""

    __slots__ = ("component_host_lock_uuids", "component_lock_uuids", "node_id")

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.component_lock_uuids: dict[str, int] = {}
        self.component_host_lock_uuids: dict[str, int] = {}


def test_a_receipt_that_cannot_be_weakly_referenced_released_twice_is_not_called_a_copy() -> None:
    book = ReceiptBook(Residency(trail=False))
    receipt = SlotReceipt(1)
    book.spend(receipt)
    with pytest.raises(LeaseError) as caught:
        book.check_receipt(1, "unlock", receipt, "dec_lock_ref")
    assert str(caught.value) == (
        f"node 1: dec_lock_ref refused: this receipt (SlotReceipt at {id(receipt):#x}) was "
        "released already (or a copy of it was); the node's 0 other receipt(s) out stay "
        "held; nothing changed"
    )


def test_a_lock_book_pairs_each_receipt_with_its_node_until_it_comes_back_or_is_dropped() -> None:
    """``RadixCache``'s book (0.5.23): a receipt out is refused on another node; reset forgets all."""
    book = LockBook(Residency(trail=False))
    here, there = types.SimpleNamespace(id=1), types.SimpleNamespace(id=2)
    receipt, dropped = MapReceipt(0), MapReceipt(0)
    book.take(here, lock_of(receipt), book.ready())
    book.take(here, lock_of(dropped), book.ready())
    with pytest.raises(BadArgument) as caught:
        book.refuse_elsewhere(there, receipt, lock_of(receipt), "dec_lock_ref")
    assert str(caught.value) == (
        f"node 2: dec_lock_ref refused: this receipt (MapReceipt at {id(receipt):#x}) is of a "
        "lock taken on node 1, and a receipt is released on the node it was taken on; the "
        "locks on both nodes stay held; nothing changed"
    )
    book.refuse_elsewhere(here, receipt, lock_of(receipt), "dec_lock_ref")  # its own node
    del dropped  # never released, and no copy left to come back: the sweep drops it
    book.sweep()
    assert list(book.out) == [lock_of(receipt)[0]]
    book.spend(receipt)  # back: no longer out, and remembered as come back
    assert (list(book.out), list(book.spent)) == ([], [lock_of(receipt)[0]])
    book.refuse_elsewhere(there, receipt, lock_of(receipt), "dec_lock_ref")  # not out: not its
    book.take(there, lock_of(MapReceipt(0)), book.ready())
    book.clear()  # the cache's reset: the tree the locks were on is gone
    assert (book.out, book.spent, book.sweep_at) == ({}, {}, 256)
    for _ in range(3 * 256):  # dropped unreleased: readying the book for a lock sweeps them
        book.take(here, lock_of(MapReceipt(0)), book.ready())
    assert 0 < len(book.out) <= 256
