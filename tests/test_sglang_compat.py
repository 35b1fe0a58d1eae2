"""The SGLang drop-in's parts on a small SGLang-shaped node (no SGLang needed).

SGLang's own code runs against them in tests/sglang_real (``make test-sglang``);
these pin down each rule: fields are events once a node is attached, counters
move only in checked walks, splits and chains are acknowledged together.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from fsm_cache.compat.sglang import (
    AckBook,
    ReadOnlyCounter,
    RemovedInUse,
    ResidencyMixin,
    absent_chain,
    back_out,
    loading,
    ride,
    walk,
)
from fsm_cache.errors import HostCopyPinned, NoHostCopy, error_class
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
        "node 1: evict_device refused in resident (locks=0): "
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
