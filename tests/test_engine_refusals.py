"""Every kind of refusal of the shipped residency specs, exact messages, nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest
from records import Node, snapshot

from fsm_cache import errors
from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition, error_class
from fsm_cache.spec.guards import TRUE, parse_guard, parse_update
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, StateSpec, System, Transition
from fsm_cache.spec.shipped import residency_system


@pytest.fixture
def engine() -> Engine:
    return Engine(residency_system(), trail=False)


# (host, device, pins, locks), event, error class name, message after "node 17: "
REFUSALS = [
    # plain forbids of each region
    (
        ("backed", "resident", 0, 0),
        "release",
        "ReleaseAtZero",
        "release refused in backed (pins=0): release without a matching pin",
    ),
    (
        ("unbacked", "resident", 0, 0),
        "pin",
        "NoHostCopy",
        "pin refused in unbacked (pins=0): no valid host copy to pin",
    ),
    (
        ("writing", "resident", 0, 0),
        "write",
        "CopyInFlight",
        "write refused in writing (pins=0): a device-to-host copy of this node is already in flight",
    ),
    (
        ("pinned", "resident", 2, 0),
        "write",
        "AlreadyBacked",
        "write refused in pinned (pins=2): the host already holds a valid copy",
    ),
    (
        ("backed", "resident", 0, 0),
        "write_done",
        "DuplicateAck",
        "write_done refused in backed (pins=0): no device-to-host copy in flight: a duplicate or stray acknowledgement",
    ),
    (
        ("evicted", "resident", 0, 0),
        "write_failed",
        "DuplicateAck",
        "write_failed refused in evicted (pins=0): no device-to-host copy in flight to fail",
    ),
    (
        ("pinned", "resident", 1, 0),
        "evict_host",
        "HostCopyPinned",
        "evict_host refused in pinned (pins=1): the host copy is pinned by a holder",
    ),
    (
        ("writing", "resident", 0, 0),
        "evict_host",
        "CopyInFlight",
        "evict_host refused in writing (pins=0): a device-to-host copy is still writing the host slots",
    ),
    (
        ("backed", "absent", 0, 0),
        "lock",
        "NotResident",
        "lock refused in absent (locks=0): the device copy was freed; load it back first",
    ),
    (
        ("backed", "loading", 0, 0),
        "evict_device",
        "CopyInFlight",
        "evict_device refused in loading (locks=0): a host-to-device copy is still writing the device slots",
    ),
    (
        ("backed", "resident", 0, 0),
        "load",
        "AlreadyResident",
        "load refused in resident (locks=0): the device already holds this node or is loading it",
    ),
    # guarded forbids
    (
        ("backed", "resident", 0, 0),
        "unlock",
        "UnlockAtZero",
        "unlock refused in resident (locks=0): unlock without a matching lock",
    ),
    (
        ("backed", "resident", 0, 2),
        "evict_device",
        "DeviceLocked",
        "evict_device refused in resident (locks=2): a running request holds the device copy",
    ),
    # an event of both regions: the host region is checked first, then the device region
    (
        ("unbacked", "absent", 0, 0),
        "load",
        "NoHostCopy",
        "load refused in unbacked (pins=0): no valid host copy to load from",
    ),
    (
        ("pinned", "resident", 1, 0),
        "load_done",
        "NotLoading",
        "load_done refused in resident (locks=0): no host-to-device copy in flight",
    ),
    (
        ("backed", "loading", 0, 0),
        "load_done",
        "NotLoading",
        "load_done refused in backed (pins=0): no host-to-device copy in flight",
    ),
    # cross-region forbids: reported in the first region that declares the event,
    # naming the state of each other region the rule reads
    (
        ("unbacked", "absent", 0, 0),
        "write",
        "DeviceAbsent",
        "write refused in unbacked (pins=0, device absent): a backup copies from the device and the device holds no valid copy",
    ),
    (
        ("writing", "resident", 0, 0),
        "evict_device",
        "CopyInFlight",
        "evict_device refused in resident (locks=0, host writing): a device-to-host copy still reads the device slots",
    ),
    (
        ("evicted", "resident", 0, 0),
        "evict_device",
        "NoHostCopy",
        "evict_device refused in resident (locks=0, host evicted): the device copy is the only copy; back it up or delete the node",
    ),
    (
        ("backed", "loading", 0, 0),
        "evict_host",
        "CopyInFlight",
        "evict_host refused in backed (pins=0, device loading): a host-to-device copy still reads the host slots",
    ),
    # region rules before cross-region rules
    (
        ("backed", "absent", 0, 0),
        "write",
        "AlreadyBacked",
        "write refused in backed (pins=0): the host already holds a valid copy",
    ),
]


@pytest.mark.parametrize(("state", "event", "error", "message"), REFUSALS)
def test_refusals_raise_the_declared_class_and_change_nothing(
    engine: Engine, state: tuple[str, str, int, int], event: str, error: str, message: str
) -> None:
    host, device, pins, locks = state
    node = Node(engine, 17, host=host, device=device, pins=pins, locks=locks)
    before = snapshot(engine, node)
    assert not engine.allowed(node, event)
    with pytest.raises(IllegalTransition) as info:
        engine.fire(node, event)
    assert type(info.value) is error_class(error)
    assert str(info.value) == f"node 17: {message}"
    exc = info.value
    assert (exc.instance, exc.event, exc.history, exc.site, exc.sites) == (17, event, "", None, ())
    assert snapshot(engine, node) == before


def test_refusal_carries_its_fields(engine: Engine) -> None:
    node = Node(engine, 3, host="backed")
    with pytest.raises(errors.ReleaseAtZero) as info:
        engine.verb("release")(node)
    exc = info.value
    assert isinstance(exc, RuntimeError)
    assert (exc.label, exc.instance, exc.state, exc.counters) == ("node", 3, "backed", {"pins": 0})
    assert (exc.event, exc.reason) == ("release", "release without a matching pin")


DOOR = """
[machine]
name = "door"
initial = "closed"
[states]
open = { doc = "open" }
closed = { doc = "closed" }
[[transition]]
event = "open_door"
source = "closed"
dest = "open"
[[forbid]]
event = "open_door"
source = "open"
error = "AlreadyOpen"
reason = "already open"
[[transition]]
event = "close_door"
source = "open"
dest = "closed"
[[forbid]]
event = "close_door"
source = "closed"
error = "AlreadyClosed"
reason = "already closed"
"""

BOLT = """
[machine]
name = "bolt"
initial = "unlocked"
[states]
unlocked = { doc = "unlocked" }
locked = { doc = "locked" }
[[transition]]
event = "lock"
source = "unlocked"
dest = "locked"
[[forbid]]
event = "lock"
source = "locked"
error = "AlreadyLocked"
reason = "already locked"
[[transition]]
event = "unlock"
source = "locked"
dest = "unlocked"
[[forbid]]
event = "unlock"
source = "unlocked"
error = "NotLocked"
reason = "not locked"
"""

HOUSE = """
[composition]
name = "house"
label = "door"
[composition.regions]
door = "door.toml"
bolt = "bolt.toml"
[[forbid]]
event = "lock"
when = ["door in [open]", "bolt in [unlocked]"]
error = "DoorOpen"
reason = "cannot bolt an open door"
[[forbid]]
event = "open_door"
when = "bolt in [locked]"
error = "Bolted"
reason = "the door is bolted"
"""


@pytest.fixture
def house(tmp_path: Path) -> Engine:
    """A door and its bolt: each refuses the other's event across regions."""
    for name, text in (("door", DOOR), ("bolt", BOLT), ("house", HOUSE)):
        (tmp_path / f"{name}.toml").write_text(text, encoding="utf-8")
    return Engine(load_spec(tmp_path / "house.toml"), trail=False)


@pytest.mark.parametrize("verb", [False, True])
def test_a_cross_region_refusal_names_the_other_regions_state(house: Engine, verb: bool) -> None:
    rec = house.new(1)
    house.fire(rec, "lock")
    with pytest.raises(IllegalTransition) as info:
        house.verb("open_door")(rec) if verb else house.fire(rec, "open_door")
    assert (
        str(info.value) == "door 1: open_door refused in closed (bolt locked): the door is bolted"
    )
    assert (info.value.state, info.value.others) == ("closed", {"bolt": "locked"})
    assert (rec.door, rec.bolt) == ("closed", "locked")


def test_a_rule_reading_its_own_region_names_only_the_others(house: Engine) -> None:
    rec = house.new(2)
    house.fire(rec, "open_door")
    with pytest.raises(IllegalTransition) as info:
        house.fire(rec, "lock")
    assert (
        str(info.value) == "door 2: lock refused in unlocked (door open): cannot bolt an open door"
    )
    assert info.value.others == {"door": "open"}


def test_a_regions_own_refusal_names_no_other_region(house: Engine) -> None:
    rec = house.new(3)
    house.fire(rec, "open_door")
    with pytest.raises(IllegalTransition) as info:
        house.fire(rec, "open_door")
    assert str(info.value) == "door 3: open_door refused in open: already open"
    assert info.value.others == {}


TREE_REFUSALS = [
    # parent, node, child states as (host, device); event; class; message
    (
        None,
        ("backed", "resident"),
        ("unbacked", "resident"),
        "evict_device",
        "NotADeviceLeaf",
        "node 2: evict_device refused in resident (locks=0): a child is still on the device (device residency is prefix-closed)",
    ),
    (
        None,
        ("backed", "resident"),
        ("unbacked", "loading"),
        "evict_device",
        "NotADeviceLeaf",
        "node 2: evict_device refused in resident (locks=0): a child is still on the device (device residency is prefix-closed)",
    ),
    (
        None,
        ("backed", "resident"),
        ("writing", "resident"),
        "evict_host",
        "NotAHostLeaf",
        "node 2: evict_host refused in backed (pins=0): a child still holds a host copy",
    ),
    (
        ("backed", "absent"),
        ("backed", "absent"),
        None,
        "load",
        "ParentNotResident",
        "node 2: load refused in backed (pins=0): the parent is not on the device (device residency is prefix-closed)",
    ),
]


@pytest.mark.parametrize(("parent", "node", "child", "event", "error", "message"), TREE_REFUSALS)
def test_tree_rules(  # noqa: PLR0917 -- one argument per table column
    engine: Engine,
    parent: tuple[str, str] | None,
    node: tuple[str, str],
    child: tuple[str, str] | None,
    event: str,
    error: str,
    message: str,
) -> None:
    up = None if parent is None else Node(engine, 1, host=parent[0], device=parent[1])
    me = Node(engine, 2, up, host=node[0], device=node[1])
    kids = [] if child is None else [Node(engine, 3, me, host=child[0], device=child[1])]
    everyone = [r for r in (up, me, *kids) if r is not None]
    before = snapshot(engine, *everyone)
    with pytest.raises(IllegalTransition) as info:
        engine.fire(me, event)
    assert (type(info.value), str(info.value)) == (error_class(error), message)
    assert snapshot(engine, *everyone) == before
    # with the tree rule satisfied the same event is legal
    for rec in [*kids, *([up] if up else [])]:
        rec.host, rec.device = "evicted", "resident"
    for rec in kids:
        rec.device = "absent"
    assert engine.allowed(me, event)


def test_children_may_be_any_iterable(engine: Engine) -> None:
    node = Node(engine, 2, host="backed")
    node.children = [Node(engine, 3, device="loading")]
    assert not engine.allowed(node, "evict_device")
    node.children = []
    assert engine.allowed(node, "evict_device")


def chain(engine: Engine, locks: list[int], device: str = "resident") -> list[Node]:
    nodes: list[Node] = []
    for i, count in enumerate(locks):
        nodes.append(Node(engine, i, nodes[-1] if nodes else None, device=device, locks=count))
    return nodes


def test_lock_and_unlock_propagate_to_every_ancestor(engine: Engine) -> None:
    root, mid, leaf = chain(engine, [0, 0, 0])
    engine.fire(leaf, "lock")
    engine.fire(mid, "lock")
    assert [root.locks, mid.locks, leaf.locks] == [2, 2, 1]
    engine.fire(leaf, "unlock")
    assert [root.locks, mid.locks, leaf.locks] == [1, 1, 0]


def test_propagation_is_all_or_nothing(engine: Engine) -> None:
    root, mid, leaf = chain(engine, [1, 1, 1])
    root.device = "absent"
    before = snapshot(engine, root, mid, leaf)
    with pytest.raises(error_class("NotResident")) as info:
        engine.fire(leaf, "lock")
    assert (
        str(info.value)
        == "node 0: lock refused in absent (locks=1): the device copy was freed; load it back first"
    )
    assert snapshot(engine, root, mid, leaf) == before

    root.device, mid.locks = "resident", 0
    before = snapshot(engine, root, mid, leaf)
    with pytest.raises(errors.UnlockAtZero) as unlock:
        engine.fire(leaf, "unlock")
    assert (
        str(unlock.value)
        == "node 1: unlock refused in resident (locks=0): unlock without a matching lock"
    )
    assert snapshot(engine, root, mid, leaf) == before


def test_a_guard_the_invariant_and_the_earlier_guards_imply_is_not_tested() -> None:
    """`pinned` holds pins >= 1, so a release that is not the last (pins == 1) is pins >= 2."""
    source = Engine(residency_system(), trail=False).source
    release = source[source.index("def _fire_release(rec):") :]
    release = release[: release.index("\ndef ")]
    assert "c_pins == 1" in release
    assert ">= 2" not in release
    assert "c_pins >= 1" not in release  # writing: the forbid at pins == 0 came first


def _two_guards(last: str) -> Engine:
    """A machine whose release in `held` takes pins == 1 first and then ``last``; unvalidated."""
    held = StateSpec("held", invariant=parse_guard("pins >= 1"), counter="pins")
    moves = (
        Transition(
            "release", ("held",), "free", parse_guard("pins == 1"), parse_update("pins -= 1")
        ),
        Transition("release", ("held",), "held", parse_guard(last), parse_update("pins -= 1")),
    )
    machine = MachineSpec("m", "held", (("pins", 1),), (held, StateSpec("free")), moves)
    return Engine(System.single(machine), trail=False)


def test_a_guard_not_implied_is_tested_and_its_gap_refused() -> None:
    """Built without validation, pins == 2 leaves pins >= 3 uncovered: that gap is refused."""
    engine = _two_guards("pins == 2")
    rec = engine.new(17)
    rec.pins = 3
    with pytest.raises(IllegalTransition) as info:
        engine.fire(rec, "release")
    assert (
        str(info.value)
        == "instance 17: release refused in held (pins=3): no transition's guard holds"
    )
    assert (rec.state, rec.pins) == ("held", 3)
    rec.pins = 2  # back in the guards' range, so the test leaves nothing held
    engine.fire(rec, "release")
    engine.fire(rec, "release")
    engine.fire(rec := engine.new(18), "release")
    assert (rec.state, rec.pins) == ("free", 0)
    covered = _two_guards("pins >= 2")
    rec = covered.new(19)
    rec.pins = 3
    covered.fire(rec, "release")
    assert (rec.state, rec.pins) == ("held", 2)
    covered.fire(rec, "release")
    covered.fire(rec, "release")
    assert (rec.state, rec.pins) == ("free", 0)
    assert "pins >= 2" not in covered.source


@pytest.mark.parametrize("trail", [False, True])
def test_a_gap_below_zero_is_still_refused(trail: bool) -> None:
    """Unvalidated, `take` drives x negative: x == 0 then x >= 1 leaves x < 0 uncovered."""
    moves = (
        Transition("take", ("s",), "s", TRUE, parse_update("x -= 1")),
        Transition("release", ("s",), "s", parse_guard("x == 0"), parse_update("x += 1")),
        Transition("release", ("s",), "s", parse_guard("x >= 1"), parse_update("x -= 1")),
    )
    engine = Engine(
        System.single(MachineSpec("m", "s", (("x", 0),), (StateSpec("s"),), moves)), trail=trail
    )
    rec = engine.new(1)
    engine.fire(rec, "take")  # the engine's own step
    message = "instance 1: release refused in s (x=-1): no transition's guard holds"
    with pytest.raises(IllegalTransition) as info:
        engine.fire(rec, "release")
    assert str(info.value).startswith(message)
    with pytest.raises(IllegalTransition) as info:
        engine.plan(rec, "release")
    assert str(info.value).startswith(message)
    assert rec.x == -1
