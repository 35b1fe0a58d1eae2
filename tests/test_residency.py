"""The residency spec against the design's event table, over the whole matrix.

The oracle below is written from shared/design/residency.md, independently of
the spec files: every (host state, device state, event, pins, locks) either
reaches the state the design says or raises the error class and message it
says, and a refusal changes nothing.
"""

from __future__ import annotations

import itertools

import pytest

from fsm_cache.errors import BadArgument, IllegalTransition, ReadOnlyAttribute, ReleaseAtZero
from fsm_cache.residency import Node, Residency, ResidencyRecord


HOST = ("unbacked", "writing", "backed", "pinned", "evicted")
DEVICE = ("resident", "loading", "absent")
EVENTS = (
    "write",
    "write_done",
    "write_failed",
    "pin",
    "release",
    "evict_host",
    "lock",
    "unlock",
    "evict_device",
    "load",
    "load_done",
    "load_failed",
    "adopt",
)
REASONS = {
    "CopyInFlight/write": "a device-to-host copy of this node is already in flight",
    "AlreadyBacked": "the host already holds a valid copy",
    "DeviceAbsent": "a backup copies from the device and the device holds no valid copy",
    "DuplicateAck/write_done": "no device-to-host copy in flight: a duplicate or stray acknowledgement",
    "DuplicateAck/write_failed": "no device-to-host copy in flight to fail",
    "NoHostCopy/pin": "no valid host copy to pin",
    "ReleaseAtZero": "release without a matching pin",
    "LoadPinHeld": "the last pin belongs to the load in flight",
    "HostCopyPinned": "the host copy is pinned by a holder",
    "HostCopyPinned/write_failed": (
        "holders pinned the copy being written; copy it again instead of failing it"
    ),
    "CopyInFlight/evict_host/host": "a device-to-host copy is still writing the host slots",
    "CopyInFlight/evict_host/device": "a host-to-device copy still reads the host slots",
    "NoHostCopy/evict_host": "no host copy to evict",
    "NotResident/lock": "the device copy was freed; load it back first",
    "UnlockAtZero": "unlock without a matching lock",
    "DeviceLocked": "a running request holds the device copy",
    "CopyInFlight/evict_device/device": "a host-to-device copy is still writing the device slots",
    "CopyInFlight/evict_device/host": "a device-to-host copy still reads the device slots",
    "NotResident/evict_device": "the device copy is already freed",
    "NoHostCopy/evict_device": "the device copy is the only copy; back it up or delete the node",
    "NoHostCopy/load": "no valid host copy to load from",
    "AlreadyResident": "the device already holds this node or is loading it",
    "NotLoading": "no host-to-device copy in flight",
    "DeviceLocked/load_failed": (
        "a running request holds the loading device copy; unlock it before failing the load"
    ),
}

Row = tuple[str, str, int, int]
Refusal = tuple[str, str, str]  # error class, refusing region, reason key


def _host_pins(pins: int) -> tuple[str, int]:
    return ("pinned" if pins else "backed", pins)


def oracle(event: str, h: str, d: str, pins: int, locks: int) -> Row | Refusal:  # noqa: PLR0911, PLR0912
    """The design's event table, for one node without parent or children."""
    if event == "write":
        if h == "writing":
            return ("CopyInFlight", "host", "CopyInFlight/write")
        if h in ("backed", "pinned"):
            return ("AlreadyBacked", "host", "AlreadyBacked")
        if d != "resident":
            return ("DeviceAbsent", "host", "DeviceAbsent")
        return ("writing", d, pins, locks)
    if event in ("write_done", "write_failed"):
        if h != "writing":
            return ("DuplicateAck", "host", f"DuplicateAck/{event}")
        if event == "write_done":  # pins taken while the copy ran now hold it (issue 14)
            return (_host_pins(pins)[0], d, pins, locks)
        if pins:  # a holder waits for this copy: it is copied again, not failed
            return ("HostCopyPinned", "host", "HostCopyPinned/write_failed")
        return ("unbacked", d, pins, locks)
    if event == "pin":
        if h == "writing":  # a holder may pin a copy in flight (SGLang's prefetch anchor)
            return ("writing", d, pins + 1, locks)
        if h not in ("backed", "pinned"):
            return ("NoHostCopy", "host", "NoHostCopy/pin")
        return ("pinned", d, pins + 1, locks)
    if event == "release":
        if h not in ("pinned", "writing") or not pins:
            return ("ReleaseAtZero", "host", "ReleaseAtZero")
        if d == "loading" and pins == 1:  # the load holds a pin until load_done
            return ("LoadPinHeld", "host", "LoadPinHeld")
        held = "writing" if h == "writing" else _host_pins(pins - 1)[0]
        return (held, d, pins - 1, locks)
    if event == "evict_host":
        if h == "pinned":
            return ("HostCopyPinned", "host", "HostCopyPinned")
        if h == "writing":
            return ("CopyInFlight", "host", "CopyInFlight/evict_host/host")
        if h in ("unbacked", "evicted"):
            return ("NoHostCopy", "host", "NoHostCopy/evict_host")
        if d == "loading":
            return ("CopyInFlight", "host", "CopyInFlight/evict_host/device")
        return ("evicted", d, pins, locks)
    if event == "lock":
        if d == "absent":
            return ("NotResident", "device", "NotResident/lock")
        return (h, d, pins, locks + 1)
    if event == "unlock":
        if d == "absent" or locks == 0:
            return ("UnlockAtZero", "device", "UnlockAtZero")
        return (h, d, pins, locks - 1)
    if event == "evict_device":
        if d == "resident" and locks:
            return ("DeviceLocked", "device", "DeviceLocked")
        if d == "loading":
            return ("CopyInFlight", "device", "CopyInFlight/evict_device/device")
        if d == "absent":
            return ("NotResident", "device", "NotResident/evict_device")
        if h == "writing":
            return ("CopyInFlight", "device", "CopyInFlight/evict_device/host")
        if h in ("unbacked", "evicted"):
            return ("NoHostCopy", "device", "NoHostCopy/evict_device")
        return (h, "absent", pins, locks)
    if event == "load":
        if h not in ("backed", "pinned"):
            return ("NoHostCopy", "host", "NoHostCopy/load")
        if d != "absent":
            return ("AlreadyResident", "device", "AlreadyResident")
        return ("pinned", "loading", pins + 1, locks)
    if event == "adopt":
        if d != "absent":
            return ("AlreadyResident", "device", "AlreadyResident")
        return (h, "resident", pins, locks)
    if h != "pinned" or d != "loading":
        return ("NotLoading", "host" if h != "pinned" else "device", "NotLoading")
    if event == "load_failed" and locks:
        return ("DeviceLocked", "device", "DeviceLocked/load_failed")
    return (
        _host_pins(pins - 1)[0],
        "resident" if event == "load_done" else "absent",
        pins - 1,
        locks,
    )


def _valid(h: str, d: str, pins: int, locks: int) -> bool:
    pins_ok = h == "writing" or (pins >= 1) == (h == "pinned")
    return pins_ok and not (d == "absent" and locks)


# The keys of the composition's cross-region rules, with the other region each one reads:
# its message names that region's state after the counter.
CROSS_REGION = {
    "DeviceAbsent": "device",
    "LoadPinHeld": "device",
    "CopyInFlight/evict_host/device": "device",
    "CopyInFlight/evict_device/host": "host",
    "NoHostCopy/evict_device": "host",
}


MATRIX = [
    (event, h, d, pins, locks)
    for event, h, d, pins, locks in itertools.product(EVENTS, HOST, DEVICE, (0, 1, 2), (0, 1, 2))
    if _valid(h, d, pins, locks)
]
RES = Residency(trail=False)


def _record(h: str, d: str, pins: int, locks: int) -> ResidencyRecord:
    # Set field by field: the matrix also covers pairs no run reaches (host writing beside
    # device absent), which the constructor refuses, to pin down what the engine does there.
    rec = ResidencyRecord(7)
    rec.host, rec.device, rec.pins, rec.locks = h, d, pins, locks  # type: ignore[assignment]
    return rec


def _snapshot(rec: ResidencyRecord) -> Row:
    return (rec.host, rec.device, rec.pins, rec.locks)


@pytest.mark.parametrize(("event", "h", "d", "pins", "locks"), MATRIX)
def test_matrix(event: str, h: str, d: str, pins: int, locks: int) -> None:
    """Each step reaches the design's next state, or raises its exact error and changes nothing."""
    rec = _record(h, d, pins, locks)
    expected = oracle(event, h, d, pins, locks)
    if len(expected) == 4:
        RES.verb(event)(rec)  # type: ignore[arg-type]
        assert _snapshot(rec) == expected
        return
    error, region, key = expected
    state, counter = (h, f"pins={pins}") if region == "host" else (d, f"locks={locks}")
    other = CROSS_REGION.get(key)
    if other is not None:
        counter += f", {other} {d if other == 'device' else h}"
    with pytest.raises(IllegalTransition) as caught:
        RES.verb(event)(rec)  # type: ignore[arg-type]
    assert type(caught.value).__name__ == error
    assert str(caught.value) == f"node 7: {event} refused in {state} ({counter}): {REASONS[key]}"
    assert _snapshot(rec) == (h, d, pins, locks)


def test_matrix_is_complete() -> None:
    """Every event is exercised in every valid combination of states and counts."""
    # host x pins: 4 states at 0 pins + pinned and writing at 1 and 2; device x locks: 3 + 3 + 1
    assert len(MATRIX) == len(EVENTS) * 8 * 7


def test_release_at_zero_is_a_runtime_error() -> None:
    """Existing ``except RuntimeError`` handlers keep catching release-at-zero."""
    assert issubclass(ReleaseAtZero, RuntimeError)
    with pytest.raises(RuntimeError, match="release without a matching pin"):
        RES.release(_record("backed", "resident", 0, 0))


class TestTreeRules:
    """Rules that read the parent or the children of a node."""

    def test_load_needs_a_device_resident_parent(self) -> None:
        """A load under an absent parent is refused; under a loading parent it is allowed."""
        parent = Node(1, host="backed", device="absent")
        child = Node(2, host="backed", device="absent", parent=parent)
        parent.children["a"] = child
        with pytest.raises(IllegalTransition) as caught:
            child.load()
        assert str(caught.value) == (
            "node 2: load refused in backed (pins=0): the parent is not on the device "
            "(device residency is prefix-closed)"
        )
        parent.load()
        child.load()
        assert (parent.device, child.device, child.pins) == ("loading", "loading", 1)

    def test_device_eviction_takes_only_device_leaves(self) -> None:
        """A node with a device-resident child keeps its device copy."""
        parent = Node(1, host="backed")
        parent.children["a"] = Node(2, host="backed", parent=parent)
        with pytest.raises(IllegalTransition, match="a child is still on the device"):
            parent.evict_device()
        parent.children["a"].evict_device()
        parent.evict_device()
        assert parent.device == "absent"

    def test_host_eviction_takes_only_host_leaves(self) -> None:
        """A node whose child still holds a host copy keeps its own."""
        parent = Node(1, host="backed")
        child = Node(2, host="backed", parent=parent)
        parent.children["a"] = child
        with pytest.raises(IllegalTransition, match="a child still holds a host copy") as caught:
            parent.evict_host()
        assert type(caught.value).__name__ == "NotAHostLeaf"
        child.evict_host()
        parent.evict_host()
        assert (parent.host, child.host) == ("evicted", "evicted")

    def test_lock_propagates_to_every_ancestor_or_none(self) -> None:
        """Locking a node locks its ancestors; a refused unlock changes no ancestor."""
        root = Node(0, host="backed")
        mid = Node(1, host="backed", parent=root)
        leaf = Node(2, host="backed", parent=mid)
        lease = leaf.lock()
        assert (root.locks, mid.locks, leaf.locks) == (1, 1, 1)
        lease.release()
        mid.locks = 1  # a corrupted count above the leaf: the unlock must refuse as a whole
        root.locks = 0
        mid.children["x"] = leaf
        with pytest.raises(IllegalTransition) as caught:
            RES.unlock(mid)
        assert (
            str(caught.value)
            == "node 0: unlock refused in resident (locks=0): unlock without a matching lock"
        )
        assert (root.locks, mid.locks) == (0, 1)


HOST_STATES = "unbacked, writing, backed, pinned, evicted"
REACHED = {
    ("unbacked", "resident"),
    ("writing", "resident"),
    ("backed", "resident"),
    ("backed", "absent"),
    ("pinned", "resident"),
    ("pinned", "loading"),
    ("pinned", "absent"),
    ("evicted", "resident"),
    ("evicted", "absent"),
}
"""What the design's event table reaches: a copy in flight keeps what it reads (a backup
the device copy, a load a pinned host copy), and the device copy is dropped only for a
host copy."""


class TestConstruction:
    """A record is built only in states and counts the spec can reach; bad ones change nothing."""

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"host": "pinned"}, "host pinned requires pins >= 1, got pins=0"),
            ({"host": "backed", "pins": 1}, "host backed requires pins == 0, got pins=1"),
            ({"device": "absent", "locks": 2}, "device absent requires locks == 0, got locks=2"),
            ({"host": "nope"}, f"host 'nope' is not a state of host_residency ({HOST_STATES})"),
            (
                {"device": None},
                "device None is not a state of device_residency (resident, loading, absent)",
            ),
            ({"host": "writing", "pins": -1}, "pins must be an int >= 0, got -1"),
            ({"host": "pinned", "pins": True}, "pins must be an int >= 0, got True"),
            ({"locks": "1"}, "locks must be an int >= 0, got '1'"),
            (
                {"host": "writing", "device": "absent"},
                "no run of residency reaches host writing, device absent",
            ),
            (
                {"host": "backed", "device": "loading"},
                "no run of residency reaches host backed, device loading",
            ),
            (
                {"device": "absent"},
                "no run of residency reaches host unbacked, device absent",
            ),
        ],
    )
    @pytest.mark.parametrize("cls", [Node, ResidencyRecord])
    def test_a_state_the_spec_does_not_allow_is_refused(
        self, cls: type[ResidencyRecord], kwargs: dict[str, object], message: str
    ) -> None:
        """Unknown states, counts a state's invariant forbids and unreachable pairs all raise."""
        with pytest.raises(BadArgument) as caught:
            cls(17, **kwargs)  # type: ignore[arg-type]
        assert str(caught.value) == f"{cls.__name__}(17): {message}"

    @pytest.mark.parametrize(("host", "device"), sorted(REACHED))
    def test_every_reachable_pair_is_built(self, host: str, device: str) -> None:
        """Each pair some run reaches is accepted, with counts its states allow."""
        pins = 2 if host == "pinned" else 0
        node = Node(5, host=host, device=device, pins=pins, locks=0 if device == "absent" else 3)  # type: ignore[arg-type]
        assert node.residency() == (
            f"{host}/{device} (pins={pins}, locks={0 if device == 'absent' else 3})"
        )

    def test_the_reachable_pairs_are_the_designs(self) -> None:
        """The engine's reachable pairs are exactly the design's, derived from the spec."""
        engine = Residency(trail=False).engine
        legal = {
            (host, device)
            for host, device in itertools.product(HOST, DEVICE)
            if engine.bad_record({"host": host, "device": device}, {"pins": int(host == "pinned")})
            is None
        }
        assert legal == REACHED

    def test_a_pinned_node_releases_its_pins_and_no_more(self) -> None:
        """The reviewer's double release: pins stop at zero, the third release is refused."""
        node = Node(17, host="pinned", pins=2)
        node.release()
        node.release()
        assert node.residency() == "backed/resident (pins=0, locks=0)"
        with pytest.raises(ReleaseAtZero) as caught:
            node.release()
        assert str(caught.value) == (
            "node 17: release refused in backed (pins=0): release without a matching pin"
        )

    def test_a_state_set_by_hand_is_named_when_an_event_reads_it(self) -> None:
        """A record whose state was overwritten with a non-state raises BadArgument, not a refusal."""
        node = Node(3)
        node.host = "nope"  # type: ignore[assignment]
        with pytest.raises(BadArgument) as caught:
            node.pin()
        assert str(caught.value) == (
            f"node 3: host 'nope' is not a state of host_residency ({HOST_STATES})"
        )
        assert node.residency() == "nope/resident (pins=0, locks=0)"


@pytest.mark.parametrize("kind", ["load", "write", "release", "unlock", ["pin", "pin"], None])
def test_a_lease_of_a_kind_that_is_neither_pin_nor_lock_is_refused(kind: object) -> None:
    """Any kind but ``pin`` was leased with ``unlock`` as its release.

    ``lease(rec, "load")`` was refused by the engine for a release the caller
    never wrote (``unlock gives back locks of device, not what load takes``);
    ``lease(rec, ["pin", "pin"])`` for an event that is no str.
    """
    res = Residency(trail=True)
    rec = ResidencyRecord(4, host="backed")
    with pytest.raises(BadArgument) as caught:
        res.lease(rec, kind)  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"Residency.lease: kind must be 'pin' or 'lock', got {kind!r}; lease another event"
        " with Residency.engine.lease(rec, acquire, release)"
    )
    assert (rec.host, rec.device, rec.pins, rec.locks, rec.trail) == (
        "backed",
        "resident",
        0,
        0,
        None,
    )
    assert res.engine.leases.outstanding() == []
    with res.lease(rec, "lock"), res.lease(rec):
        assert (rec.host, rec.pins, rec.locks) == ("pinned", 1, 1)
    assert (rec.host, rec.pins, rec.locks) == ("backed", 0, 0)


ENGINE_FIXED = (
    "its verbs are this engine's, bound when the residency was built; build another Residency"
)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("engine", None, ENGINE_FIXED),
        ("pin", None, "it is Residency.engine.verb('pin'), bound when the residency was built"),
        ("adopt", 3, "it is Residency.engine.verb('adopt'), bound when the residency was built"),
        ("lease", None, "it is a method of Residency"),
        (
            "trial",
            True,
            "a Residency has no attribute 'trial', only its engine and a verb per event",
        ),
        (
            "relase",
            None,
            "a Residency has no attribute 'relase', only its engine and a verb per event;"
            " did you mean 'release'?",
        ),
    ],
)
def test_what_a_residency_is_built_with_cannot_be_assigned(
    name: str, value: object, why: str
) -> None:
    """``residency.engine = other`` used to rebind silently, and a typo was kept, read by nothing.

    The verbs stayed the old engine's, so a rebound engine's leases and
    ``allowed`` disagreed with what ``pin`` fired.
    """
    res = Residency(trail=False)
    kept = dict(vars(res))
    with pytest.raises(ReadOnlyAttribute) as info:
        setattr(res, name, value)
    assert str(info.value) == f"Residency.{name} cannot be set (to {value!r}): {why}"
    assert isinstance(info.value, AttributeError)
    assert vars(res) == kept
    rec = ResidencyRecord(2, host="backed")
    res.pin(rec)
    assert res.engine.allowed(rec, "release")
    assert rec.residency() == "pinned/resident (pins=1, locks=0)"


@pytest.mark.parametrize(("name", "why"), [("engine", ENGINE_FIXED), ("release", None)])
def test_what_a_residency_is_built_with_cannot_be_deleted(name: str, why: str | None) -> None:
    """Deleted, it could be bound again past the guard, which binds only a missing one."""
    res = Residency(trail=False)
    kept = getattr(res, name)
    with pytest.raises(ReadOnlyAttribute) as info:
        delattr(res, name)
    why = why or f"it is Residency.engine.verb({name!r}), bound when the residency was built"
    assert str(info.value) == f"Residency.{name} cannot be deleted: {why}"
    assert getattr(res, name) is kept


def test_a_residency_binds_its_engine_and_a_verb_per_event_as_plain_attributes() -> None:
    """Reading ``residency.pin`` (per pin in the cache) stays an instance-dict read."""
    res = Residency(trail=False)
    assert set(vars(res)) == {"engine", *EVENTS}
    for event in EVENTS:
        assert vars(res)[event] is getattr(res, event)
        assert vars(res)[event] is res.engine.verb(event)
