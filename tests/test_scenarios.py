"""The hazards of shared/design/residency.md, each replayed against the residency machines."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import pytest

from fsm_cache.compat.sglang import HostRefCounterZero, ResidencyMixin
from fsm_cache.errors import DuplicateAck, IllegalTransition, ReleaseAtZero
from fsm_cache.residency import Node, Residency


AUDITED = Residency(trail=True)


class AuditedNode(Node):
    """A node class whose verbs fire through a trail-mode engine."""

    __slots__ = ()
    machine = staticmethod(lambda: AUDITED)


def _line() -> int:
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


class StorageBackup:
    """A storage backup that pins a node's host copy while it copies to storage."""

    def __init__(self, node: AuditedNode) -> None:
        self.node = node

    def start(self) -> int:
        AUDITED.pin(self.node)
        return _line() - 1

    def retract(self) -> int:
        AUDITED.release(self.node)
        return _line() - 1

    def drain(self) -> int:
        AUDITED.release(self.node)
        return _line() - 1


def test_two_cleanup_paths_releasing_one_pin_are_named() -> None:
    """Retraction and eviction both release one pin: the second is refused naming both sites."""
    node = AuditedNode(17, host="backed")
    backup = StorageBackup(node)
    pinned_at = backup.start()
    retracted_at = backup.retract()
    with pytest.raises(ReleaseAtZero) as caught:
        backup.drain()
    drained_at = inspect.getsourcelines(StorageBackup.drain)[1] + 1
    assert str(caught.value) == (
        "node 17: release refused in backed (pins=0): release without a matching pin; "
        f"pinned at test_scenarios.py:{pinned_at} in start; "
        f"released at test_scenarios.py:{retracted_at} in retract; "
        f"refused at test_scenarios.py:{drained_at} in drain"
    )
    assert (node.host, node.pins) == ("backed", 0)


def test_exception_between_pin_and_release_releases_the_pin() -> None:
    """A ``with`` lease gives its pin back when the body raises."""
    node = Node(3, host="backed")

    def stage() -> None:
        with node.pin():
            assert node.pins == 1
            raise ValueError("staging failed")

    with pytest.raises(ValueError, match="staging failed"):
        stage()
    assert (node.host, node.pins) == ("backed", 0)


@pytest.mark.fsm_allow_leaks  # the dropped receipt is the point of the test
def test_replaced_prefetch_record_reports_the_leaked_pin() -> None:
    """A second prefetch overwriting the first record leaks a pin, and the warning says where."""
    node = Node(5, host="backed")
    ongoing_prefetch = {"req-1": node.pin()}
    first_line = _line() - 1
    with pytest.warns(ResourceWarning) as warned:
        ongoing_prefetch["req-1"] = node.pin()
    gc.collect()
    assert str(warned[0].message) == (
        f"node 5: lease (pin taken at test_scenarios.py:{first_line} in "
        "test_replaced_prefetch_record_reports_the_leaked_pin) was never released"
    )
    assert node.pins == 2  # the leaked pin is still there: nothing hides it
    ongoing_prefetch.pop("req-1").release()
    assert node.pins == 1


def test_outstanding_leases_list_the_leak() -> None:
    """An engine lists the leases still held, oldest first, for an end-of-test leak check."""
    res = Residency()
    node = Node(9, host="backed")
    first = res.lease(node)
    second = res.lease(node)
    assert res.engine.leases.outstanding() == [first, second]
    first.release()
    assert res.engine.leases.outstanding() == [second]
    second.release()


def test_duplicate_copy_acknowledgement_is_refused() -> None:
    """A second write_done for one copy is refused and changes nothing."""
    node = Node(4)
    node.write()
    node.write_done()
    with pytest.raises(DuplicateAck) as caught:
        node.write_done()
    assert str(caught.value) == (
        "node 4: write_done refused in backed (pins=0): "
        "no device-to-host copy in flight: a duplicate or stray acknowledgement"
    )
    assert node.host == "backed"


def test_release_of_a_never_written_node_is_refused() -> None:
    """Releasing a node whose host copy was never written fails at the call, not later."""
    node = Node(8)
    with pytest.raises(ReleaseAtZero) as caught:
        node.release()
    assert str(caught.value) == (
        "node 8: release refused in unbacked (pins=0): release without a matching pin"
    )


def test_pin_of_a_copy_still_being_written_holds_it_once_it_lands() -> None:
    """A holder may pin a copy in flight (issue 14): the ack lands in pinned, a failure is refused."""
    node = Node(6)
    node.write()
    lease = node.pin()
    assert (node.host, node.pins) == ("writing", 1)
    with pytest.raises(IllegalTransition) as caught:
        node.write_failed()
    assert str(caught.value) == (
        "node 6: write_failed refused in writing (pins=1): "
        "holders pinned the copy being written; copy it again instead of failing it"
    )
    assert (node.host, node.pins) == ("writing", 1)
    node.write_done()
    assert (node.host, node.pins) == ("pinned", 1)
    lease.release()
    assert (node.host, node.pins) == ("backed", 0)


def _loading_node() -> Node:
    """A host-only node whose load back is in flight under a device-resident parent."""
    parent = Node(1, host="backed")
    node = Node(2, host="backed", device="absent", parent=parent)
    parent.children["a"] = node
    node.load()
    assert node.residency() == "pinned/loading (pins=1, locks=0)"
    return node


def test_release_cannot_take_the_pin_a_load_holds() -> None:
    """A bare release during a load is refused: the last pin is the load's, not a client's."""
    node = _loading_node()
    with pytest.raises(IllegalTransition) as caught:
        node.release()
    assert type(caught.value).__name__ == "LoadPinHeld"
    assert str(caught.value) == (
        "node 2: release refused in pinned (pins=1, device loading): the last pin belongs to the load in flight"
    )
    assert node.residency() == "pinned/loading (pins=1, locks=0)"
    node.load_done()
    assert node.residency() == "backed/resident (pins=0, locks=0)"


def test_a_failed_load_gives_its_pin_back_after_a_refused_release() -> None:
    """After the refused release the load can still fail cleanly, returning its pin."""
    node = _loading_node()
    with pytest.raises(IllegalTransition, match="the last pin belongs to the load in flight"):
        node.release()
    Residency().verb("load_failed")(node)
    assert node.residency() == "backed/absent (pins=0, locks=0)"


def test_client_pins_around_a_load_are_released_freely() -> None:
    """A client's own pins, taken before or during the load, come back; only the load's stays."""
    parent = Node(1, host="backed")
    node = Node(2, host="backed", device="absent", parent=parent)
    before = node.pin()
    node.load()
    during = node.pin()
    assert node.pins == 3
    before.release()
    during.release()
    assert node.residency() == "pinned/loading (pins=1, locks=0)"
    node.load_done()
    assert node.residency() == "backed/resident (pins=0, locks=0)"


class OldTreeNode:
    """The residency part of SGLang's TreeNode, as an existing cache has it."""

    counter = 0

    def __init__(self) -> None:
        self.children: Any = {}
        self.parent: OldTreeNode | None = None
        self.value: list[int] | None = None
        self.host_value: list[int] | None = None
        self.lock_ref = 0
        self.host_ref_counter = 0
        self.id = OldTreeNode.counter
        OldTreeNode.counter += 1


class TreeNode(ResidencyMixin, OldTreeNode):
    """The drop-in: the old node class with checked residency."""

    residency = AUDITED


class TestSGLangDropIn:
    """The SGLang-style API on top of the residency machines."""

    def test_release_host_at_zero_keeps_sglang_text_and_adds_history(self) -> None:
        """The message starts with SGLang's text, then names the node and the earlier release."""
        node = TreeNode()
        node.host = "backed"
        node.protect_host()
        protected = _line() - 1
        node.release_host()
        released = _line() - 1
        refused = _line() + 2
        with pytest.raises(RuntimeError) as caught:
            node.release_host()
        assert isinstance(caught.value, HostRefCounterZero)
        assert str(caught.value) == (
            f"Host reference counter is already zero. node {node.id}: release refused in "
            "backed (pins=0): release without a matching pin; "
            f"pinned at test_scenarios.py:{protected} in "
            "test_release_host_at_zero_keeps_sglang_text_and_adds_history; "
            f"released at test_scenarios.py:{released} in "
            "test_release_host_at_zero_keeps_sglang_text_and_adds_history; "
            f"refused at test_scenarios.py:{refused} in "
            "test_release_host_at_zero_keeps_sglang_text_and_adds_history"
        )

    def test_properties_mirror_the_machines(self) -> None:
        """host_ref_counter, lock_ref, backuped and evicted read the fields and the machines."""
        root, node = TreeNode(), TreeNode()
        root.value = []
        node.parent, node.value = root, [1, 2]
        root.children[1] = node  # attaching seals the node: its fields are events from now on
        assert ((node.host, node.device, node.pins, node.locks), node.backuped, node.evicted) == (
            ("unbacked", "resident", 0, 0),
            False,
            False,
        )
        AUDITED.write(node)  # write_backup: fired before the controller allocates
        node.host_value = [7, 8]
        assert node.backuped
        AUDITED.write_done(node)
        node.protect_host()
        assert node.host_ref_counter == 1
        node.inc_lock_ref()
        assert (node.lock_ref, root.lock_ref) == (1, 0)  # the root is not counted
        node.dec_lock_ref()
        node.release_host()
        node.value = None  # _evict_backuped: the assignment is evict_device
        assert (node.evicted, node.device) == (True, "absent")

    def test_counters_cannot_be_assigned(self) -> None:
        """Direct writes to the counters are refused with the verbs to use instead."""
        node = TreeNode()
        with pytest.raises(AttributeError) as caught:
            node.host_ref_counter = 1
        assert str(caught.value) == (
            f"node {node.id}: host_ref_counter is driven by the residency machines; "
            "use protect_host()/release_host()"
        )
        assert node.host_ref_counter == 0
