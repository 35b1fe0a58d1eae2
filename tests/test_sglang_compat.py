"""The SGLang drop-in: slot fields must agree with the residency the machines hold."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from fsm_cache.compat.sglang import ResidencyMixin, SlotsOutOfStep
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


def node(ident: int = 3) -> Checked:
    made = Checked(ident)
    made.value = [0, 1]  # _insert_helper: the request's device slots
    return made


def refused(n: Checked, field: str, slots: Any) -> str:
    before = (n.host, n.device, n.value, n.host_value)
    with pytest.raises(SlotsOutOfStep) as info:
        setattr(n, field, slots)
    assert (n.host, n.device, n.value, n.host_value) == before
    return str(info.value)


def test_the_original_init_is_accepted_as_it_is() -> None:
    n = node()
    assert (n.host, n.device, n.value, n.host_value, n.lock_ref) == (
        "unbacked",
        "resident",
        [0, 1],
        None,
        0,
    )


def test_host_slots_need_a_write_first() -> None:
    n = node()
    assert refused(n, "host_value", [8, 9]) == (
        "node 3: host_value set while host is unbacked; fire write first (machine().write(node))"
    )
    Checked.machine().write(n)
    n.host_value = [8, 9]
    assert refused(n, "host_value", None) == (
        "node 3: host_value cleared while host is writing; "
        "fire write_failed first (machine().write_failed(node))"
    )
    Checked.machine().write_done(n)
    assert n.backuped
    assert refused(n, "host_value", None) == (
        "node 3: host_value cleared while host is backed; "
        "fire evict_host first (machine().evict_host(node))"
    )


def test_device_slots_follow_eviction_and_load() -> None:
    n = node(4)
    machine = Checked.machine()
    machine.write(n)
    n.host_value = [8, 9]
    machine.write_done(n)
    assert refused(n, "value", None) == (
        "node 4: value cleared while device is resident; "
        "fire evict_device first (machine().evict_device(node))"
    )
    machine.evict_device(n)
    n.value = None
    assert n.evicted
    assert refused(n, "value", [5, 6]) == (
        "node 4: value set while device is absent; fire load first (machine().load(node))"
    )
    machine.load(n)
    n.value = [5, 6]
    machine.load_done(n)
    assert (n.host, n.device, n.value) == ("backed", "resident", [5, 6])
