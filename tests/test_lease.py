"""Leases: release once, name the first release on a second, release on exceptions, report leaks.

Leaks are reported three ways: leases still open, leases collected while held
(recorded while recording is on) and live records still holding a counter.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fsm_cache.compat.sglang import ResidencyMixin
from fsm_cache.engine import lease as leases
from fsm_cache.engine.core import Engine
from fsm_cache.engine.holds import Held, held_records
from fsm_cache.errors import (
    BadArgument,
    EffectFailed,
    LeaseError,
    ReadOnlyAttribute,
    ReleaseAtZero,
    SpecError,
    error_class,
)
from fsm_cache.residency import Node, Residency
from fsm_cache.spec.loader import machine_from_dict
from fsm_cache.spec.shipped import host_machine, residency_system


HERE = os.path.basename(__file__)


def here() -> int:
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


@pytest.fixture
def engine() -> Engine:
    return Engine(host_machine(), trail=False)


def backed(engine: Engine) -> Any:
    rec = engine.new(7)
    rec.state = "backed"
    return rec


def test_a_lease_pins_and_releases_once(engine: Engine) -> None:
    rec = backed(engine)
    taken = here() + 1
    lease = engine.lease(rec)
    assert (rec.state, rec.pins) == ("pinned", 1)
    assert (lease.held, lease.event, lease.record) == (True, "pin", rec)
    assert str(lease.taken_at) == f"{HERE}:{taken} in test_a_lease_pins_and_releases_once"
    assert engine.leases.outstanding() == [lease]
    released = here() + 1
    lease.release()
    assert (rec.state, rec.pins) == ("backed", 0)
    assert not lease.held
    assert engine.leases.outstanding() == []
    with pytest.raises(LeaseError) as info:
        lease.release()
    where = "test_a_lease_pins_and_releases_once"
    assert str(info.value) == (
        f"node 7: lease (pin taken at {HERE}:{taken} in {where}) "
        f"already released at {HERE}:{released} in {where}"
    )
    assert (rec.state, rec.pins) == ("backed", 0)


def test_a_released_lease_cannot_be_made_held_again(engine: Engine) -> None:
    """``released_at`` had a setter (for the book's ``void``): writing None there re-armed the lease.

    Its next ``release()`` then fired a second release, the double release
    leases exist to prevent.
    """
    rec = backed(engine)
    other = engine.lease(rec)
    lease = engine.lease(rec)
    lease.release()
    site = lease.released_at
    with pytest.raises(AttributeError):
        lease.released_at = None  # type: ignore[misc]
    assert (lease.held, lease.released_at) == (False, site)
    with pytest.raises(LeaseError):
        lease.release()
    assert (rec.state, rec.pins) == ("pinned", 1)
    other.release()


@pytest.mark.parametrize("copy_of", [copy.copy, copy.deepcopy])
def test_a_copy_of_a_lease_is_the_lease(engine: Engine, copy_of: Callable[[Any], Any]) -> None:
    """A copy was a second held receipt outside the book: two releases took another's pin."""
    rec = backed(engine)
    other = engine.lease(rec)
    lease = engine.lease(rec)
    request = {"lease": lease}
    assert copy_of(request)["lease"] is lease
    lease.release()
    with pytest.raises(LeaseError):
        copy_of(lease).release()
    assert (rec.state, rec.pins, other.held) == ("pinned", 1, True)
    other.release()


def test_a_lease_cannot_be_pickled(engine: Engine) -> None:
    rec = backed(engine)
    lease = engine.lease(rec)
    with pytest.raises(TypeError) as caught:
        pickle.dumps(lease)
    assert str(caught.value) == f"cannot pickle {lease!r}: a lease holds a pin in this process only"
    lease.release()


def test_a_with_block_releases_on_exceptions(engine: Engine) -> None:
    rec = backed(engine)
    seen: list[int] = []

    def abort_request() -> None:
        with engine.lease(rec):
            seen.append(rec.pins)
            raise KeyError("request aborted")

    with pytest.raises(KeyError):
        abort_request()
    assert seen == [1]
    assert engine.leases.outstanding() == []
    assert rec.pins == 0


def test_a_with_block_after_an_explicit_release_does_not_release_again(engine: Engine) -> None:
    rec = backed(engine)
    with engine.lease(rec) as lease:
        lease.release()
    assert (rec.state, rec.pins) == ("backed", 0)


def test_a_refused_acquire_gives_no_lease(engine: Engine) -> None:
    rec = engine.new(7)
    with pytest.raises(Exception, match="pin refused in unbacked"):
        engine.lease(rec)
    assert engine.leases.outstanding() == []


def test_a_lease_with_an_unknown_release_event_pins_nothing(engine: Engine) -> None:
    rec = backed(engine)
    with pytest.raises(SpecError) as info:
        engine.lease(rec, "pin", "unpin")
    assert str(info.value) == (
        f"{engine.system.source}: unknown event 'unpin' (events: write, write_done, "
        "write_failed, pin, release, evict_host, load, load_done, load_failed); "
        "Engine.lease fires 'pin' and 'release' unless given others"
    )


def test_a_lease_on_a_spec_without_pin_names_the_defaults() -> None:
    """A spec whose events are not pin and release is told why 'release' was asked for."""
    door = machine_from_dict(
        {
            "machine": {"name": "door", "initial": "shut"},
            "states": {"shut": {}, "open": {}},
            "transition": [
                {"event": "open_it", "source": "shut", "dest": "open"},
                {"event": "shut_it", "source": "open", "dest": "shut"},
            ],
            "forbid": [
                {"event": "open_it", "source": "open", "error": "Open", "reason": "open"},
                {"event": "shut_it", "source": "shut", "error": "Shut", "reason": "shut"},
            ],
        }
    )
    engine = Engine(door, trail=False)
    with pytest.raises(SpecError) as info:
        engine.lease(engine.new(1))
    assert str(info.value) == (
        "<python>: unknown event 'release' (events: open_it, shut_it); "
        "Engine.lease fires 'pin' and 'release' unless given others"
    )


def door_machine(counted: bool) -> Any:
    """A door that opens and shuts: a state flag, or (``counted``) a count of 0 or 1."""
    if not counted:
        return machine_from_dict(
            {
                "machine": {"name": "door", "initial": "shut"},
                "states": {"shut": {}, "open": {}},
                "transition": [
                    {"event": "open_it", "source": "shut", "dest": "open"},
                    {"event": "shut_it", "source": "open", "dest": "shut"},
                ],
                "forbid": [
                    {"event": "open_it", "source": "open", "error": "Open", "reason": "open"},
                    {"event": "shut_it", "source": "shut", "error": "Shut", "reason": "shut"},
                ],
            }
        )
    return machine_from_dict(
        {
            "machine": {"name": "door", "initial": "shut"},
            "counters": {"opened": 0},
            "states": {
                "shut": {"invariant": "opened == 0"},
                "open": {"invariant": "opened == 1", "counter": "opened"},
            },
            "transition": [
                {"event": "open_it", "source": "shut", "dest": "open", "update": "opened = 1"},
                {"event": "shut_it", "source": "open", "dest": "shut", "update": "opened = 0"},
            ],
            "forbid": [
                {"event": "open_it", "source": "open", "error": "Open", "reason": "open"},
                {"event": "shut_it", "source": "shut", "error": "Shut", "reason": "shut"},
            ],
        }
    )


def test_a_lease_on_a_flag_kept_as_a_state_is_refused() -> None:
    """A door's open changes a state only: nothing in the spec says what gives it back.

    It used to be leased with any release, ``open_it`` itself included, whose
    ``release()`` then failed or opened the door again.
    """
    engine = Engine(door_machine(counted=False), trail=True)
    door = engine.new(1)
    for release in ("shut_it", "open_it"):
        with pytest.raises(BadArgument) as info:
            engine.lease(door, "open_it", release)
        assert str(info.value) == (
            "Engine.lease: open_it takes no hold of door: it adds one to no count"
            " that an event gives back, so no release would give back what it took"
        )
        assert (door.state, door.trail) == ("shut", None)
    assert engine.leases.outstanding() == []


def test_a_flag_kept_as_a_count_is_a_hold_and_is_leased() -> None:
    engine = Engine(door_machine(counted=True), trail=False)
    door = engine.new(1)
    with engine.lease(door, "open_it", "shut_it") as lease:
        assert (door.state, door.opened) == ("open", 1)
        with pytest.raises(error_class("Open")):
            engine.lease(door, "open_it", "shut_it")  # the one holder holds it
    assert (door.state, door.opened, lease.held) == ("shut", 0, False)
    with pytest.raises(BadArgument) as info:
        engine.lease(door, "open_it", "open_it")
    assert str(info.value) == (
        "Engine.lease: open_it gives back nothing, not what open_it takes (opened);"
        " shut_it gives it back"
    )
    assert (door.state, door.opened) == ("shut", 0)


@pytest.mark.parametrize(
    ("acquire", "release", "message"),
    [
        (
            "write",
            "write",
            "Engine.lease: write takes no hold of residency: it adds one to no count"
            " that an event gives back, so no release would give back what it took",
        ),
        (
            "pin",
            "pin",
            "Engine.lease: pin gives back nothing, not what pin takes (pins of host);"
            " release gives it back",
        ),
        (
            "pin",
            "unlock",
            "Engine.lease: unlock gives back locks of device, not what pin takes"
            " (pins of host); release gives it back",
        ),
        (
            "load",
            "release",
            "Engine.lease: release gives back pins of host, not what load takes"
            " (pins of host, device); load_done and load_failed give it back",
        ),
        (
            "lock",
            "load_done",
            "Engine.lease: load_done gives back pins of host, device, not what lock takes"
            " (locks of device); unlock gives it back",
        ),
    ],
)
def test_a_lease_whose_release_does_not_give_back_what_its_acquire_takes_is_refused(
    acquire: str, release: str, message: str
) -> None:
    """``lease(rec, "write", "write")`` was accepted: its release wrote again.

    Nothing is fired: the record keeps its states, counters and trail.
    """
    engine = Engine(residency_system(), trail=True)
    rec = engine.new(3)
    rec.host, rec.device = "backed", "absent"
    for _ in range(2):  # the second answer is the one kept from the first
        with pytest.raises(BadArgument) as info:
            engine.lease(rec, acquire, release)
        assert str(info.value) == message
        assert (rec.host, rec.device, rec.pins, rec.locks, rec.trail) == (
            "backed",
            "absent",
            0,
            0,
            None,
        )
    assert engine.leases.outstanding() == []


def test_a_load_is_leased_with_its_own_give_back() -> None:
    engine = Engine(residency_system(), trail=False)
    rec = engine.new(3)
    rec.host, rec.device = "backed", "absent"
    with engine.lease(rec, "load", "load_done"):
        assert (rec.host, rec.device, rec.pins) == ("pinned", "loading", 1)
    assert (rec.host, rec.device, rec.pins) == ("backed", "resident", 0)


def test_a_failed_load_closes_its_lease_by_naming_load_failed() -> None:
    """A load leased with load_done could not be closed once its copy failed.

    ``load_failed`` gives the load's pin back as ``load_done`` does, but the
    lease fired only ``load_done``, which a failed copy refuses: the lease
    stayed held for good and the pytest plugin reported a correct test's
    lease as dropped.
    """
    engine = Engine(residency_system(), trail=False)
    rec = engine.new(3)
    rec.host, rec.device = "backed", "absent"
    lease = engine.lease(rec, "load", "load_done")
    assert lease.gives == ("load_done", "load_failed")
    lease.release("load_failed")
    assert (rec.host, rec.device, rec.pins, lease.held) == ("backed", "absent", 0, False)
    assert engine.leases.outstanding() == []
    with pytest.raises(LeaseError, match="already released at"):
        lease.release("load_done")
    again = engine.lease(rec, "load", "load_failed")
    assert again.gives == ("load_failed", "load_done")
    again.release("load_done")
    assert (rec.host, rec.device, rec.pins) == ("backed", "resident", 0)


@pytest.mark.parametrize("event", ["release", "unlock", "load", "nope", 7])
def test_a_release_naming_what_does_not_give_back_the_acquire_is_refused(event: object) -> None:
    """Only the give-backs of what the acquire took may be named; nothing fires otherwise."""
    engine = Engine(residency_system(), trail=True)
    rec = engine.new(3)
    rec.host, rec.device = "backed", "absent"
    taken = here() + 1
    lease = engine.lease(rec, "load", "load_done")
    before = (rec.host, rec.device, rec.pins, rec.locks, list(rec.trail))
    with pytest.raises(BadArgument) as info:
        lease.release(event)  # type: ignore[arg-type]
    site = f"{HERE}:{taken} in test_a_release_naming_what_does_not_give_back_the_acquire_is_refused"
    assert str(info.value) == (
        f"node 3: lease (load taken at {site}) cannot be released by {event!r}:"
        " load_done or load_failed gives back what load takes"
    )
    assert (rec.host, rec.device, rec.pins, rec.locks, list(rec.trail)) == before
    assert lease.held
    assert engine.leases.outstanding() == [lease]
    lease.release("load_failed")
    assert not lease.held


def test_a_lease_opened_without_give_backs_is_released_by_release_alone(engine: Engine) -> None:
    rec = backed(engine)
    engine.fire(rec, "pin")
    lease = engine.leases.open(rec, engine.verb("release"), "pin", "node")
    assert lease.gives == ()
    with pytest.raises(BadArgument, match=r"'release': release\(\) without an event gives back"):
        lease.release("release")
    assert (rec.state, rec.pins, lease.held) == ("pinned", 1, True)
    lease.release()
    assert (rec.state, rec.pins, lease.held) == ("backed", 0, False)


def test_voiding_leases_without_a_site_is_refused(engine: Engine) -> None:
    rec = backed(engine)
    lease = engine.lease(rec)
    with pytest.raises(BadArgument) as info:
        engine.leases.void(None)  # type: ignore[arg-type]
    assert str(info.value) == "LeaseBook.void: site must be a Site, got None"
    assert lease.held
    assert engine.leases.outstanding() == [lease]
    lease.release()
    assert (rec.state, rec.pins) == ("backed", 0)


def test_a_release_refused_by_the_machine_keeps_the_lease_held(engine: Engine) -> None:
    rec = backed(engine)
    lease = engine.lease(rec)
    engine.fire(rec, "release")  # someone else released the pin behind the lease's back
    with pytest.raises(ReleaseAtZero):
        lease.release()
    assert lease.held
    assert engine.leases.outstanding() == [lease]
    rec.state, rec.pins = "pinned", 1
    lease.release()


def test_a_release_asked_for_by_an_effect_of_itself_is_refused() -> None:
    """An effect of the release that releases the same lease again is refused, not fired.

    It used to fire the release again from inside its own effect, and so on
    until the recursion limit: an EffectFailed nested a thousand deep.
    """
    spec = machine_from_dict(
        {
            "machine": {"name": "job", "initial": "idle", "label": "job"},
            "counters": {"holders": 0},
            "states": {"idle": {"invariant": "holders >= 0", "counter": "holders"}},
            "transition": [
                {"event": "take", "source": "idle", "dest": "idle", "update": "holders += 1"},
                {
                    "event": "give",
                    "source": "idle",
                    "dest": "idle",
                    "guard": "holders >= 1",
                    "update": "holders -= 1",
                    "effect": "notify",
                },
            ],
            "forbid": [
                {
                    "event": "give",
                    "source": "idle",
                    "guard": "holders == 0",
                    "error": "GiveAtZero",
                    "reason": "nothing held",
                }
            ],
        }
    )
    again: list[leases.Lease] = []

    def notify(rec: Any) -> None:
        for lease in again:
            lease.release()

    engine = Engine(spec, effects={"notify": notify}, trail=False)
    rec = engine.new(1)
    lease, other = engine.lease(rec, "take", "give"), engine.lease(rec, "take", "give")
    again.append(lease)
    with pytest.raises(EffectFailed) as info:
        lease.release()
    message = f"job 1: lease (take taken at {lease.taken_at}) is being released"
    assert str(info.value) == f"job 1: effect notify of give failed: {message}"
    assert isinstance(info.value.__cause__, LeaseError)
    assert (rec.holders, lease.held, other.held) == (2, True, True)
    again.clear()
    lease.release()
    other.release()
    assert (rec.holders, lease.held, other.held) == (0, False, False)


def test_init_voids_the_leases_held_on_the_record_it_starts_afresh(engine: Engine) -> None:
    """A lease on a record that ``init`` starts afresh is stale: its release is refused.

    It used to release whatever the record's new life held: here the pin of a
    new holder, who would then be the one refused at zero.
    """
    rec, other = backed(engine), backed(engine)
    stale, kept = engine.lease(rec), engine.lease(other)
    started = here() + 1
    engine.init(rec, 7)
    for event in ("write", "write_done", "pin"):  # the record's new life, and its own holder
        engine.fire(rec, event)
    with pytest.raises(LeaseError) as info:
        stale.release()
    where = "test_init_voids_the_leases_held_on_the_record_it_starts_afresh"
    assert str(info.value) == (
        f"node 7: lease (pin taken at {stale.taken_at}) "
        f"was voided at {HERE}:{started} in {where}: what it held was reset"
    )
    assert (rec.state, rec.pins) == ("pinned", 1)
    assert engine.leases.outstanding() == [kept]
    kept.release()


@pytest.fixture
def recording() -> Iterator[None]:
    """Record dropped leases during the test, and forget the ones it made afterwards."""
    before = leases.record_dropped(True)
    known = {id(x) for x in leases.dropped_leases()}
    yield
    leases.forget_dropped(new_drops(known))
    leases.record_dropped(before)


def new_drops(known: set[int]) -> list[leases.Dropped]:
    return [x for x in leases.dropped_leases() if id(x) not in known]


def test_an_unreleased_lease_warns_and_is_recorded_when_collected(
    engine: Engine, recording: None
) -> None:
    rec = backed(engine)
    taken = here() + 1
    held = [engine.lease(rec)]
    site = f"{HERE}:{taken} in test_an_unreleased_lease_warns_and_is_recorded_when_collected"
    assert repr(held[0]) == f"<Lease pin on node 7, taken at {site}, held>"
    gc.collect()
    known = {id(x) for x in leases.dropped_leases()}
    with pytest.warns(ResourceWarning) as record:
        held.clear()  # drops the last reference: collected at once (no cycle)
    assert [str(w.message) for w in record] == [
        f"node 7: lease (pin taken at {site}) was never released"
    ]
    assert engine.leases.outstanding() == []
    assert rec.pins == 1
    dropped = new_drops(known)
    assert [str(x) for x in dropped] == [f"node 7: pin taken at {site}"]
    assert (dropped[0].label, dropped[0].ident, dropped[0].event) == ("node", 7, "pin")
    leases.forget_dropped(dropped)
    assert new_drops(known) == []


def test_a_lease_dropped_in_a_reference_cycle_is_recorded_when_collected(
    engine: Engine, recording: None
) -> None:
    rec = backed(engine)
    cycle: list[Any] = [engine.lease(rec)]
    cycle.append(cycle)
    known = {id(x) for x in leases.dropped_leases()}
    del cycle
    with pytest.warns(ResourceWarning, match="node 7: lease"):
        gc.collect()
    assert [(x.ident, x.event) for x in new_drops(known)] == [(7, "pin")]


def test_a_dropped_lease_says_whether_it_was_taken_before_a_mark(
    engine: Engine, recording: None
) -> None:
    """What lets the pytest plugin excuse a test's own leases, not those it was handed."""
    handed = engine.lease(backed(engine))
    mark = leases.lease_mark()
    later = engine.new(8)
    later.state = "backed"
    known = {id(x) for x in leases.dropped_leases()}
    with pytest.warns(ResourceWarning):
        engine.lease(later)  # taken after the mark, dropped at once
    with pytest.warns(ResourceWarning):
        del handed
    dropped = new_drops(known)
    assert [(x.ident, x.order > mark) for x in dropped] == [(8, True), (7, False)]
    assert repr(dropped[0]) == (
        f"Dropped(label='node', ident=8, event='pin', taken_at={dropped[0].taken_at!r})"
    )


def test_dropped_leases_are_not_kept_unless_recording(engine: Engine) -> None:
    before = leases.record_dropped(False)
    known = {id(x) for x in leases.dropped_leases()}
    try:
        with pytest.warns(ResourceWarning):
            engine.lease(backed(engine))  # the receipt is dropped at once
    finally:
        assert leases.record_dropped(before) is False
    assert new_drops(known) == []


def test_a_released_lease_is_collected_silently(engine: Engine) -> None:
    lease = engine.lease(backed(engine))
    lease.release()
    del lease
    gc.collect()  # filterwarnings = error: a warning here would fail the test


def test_locks_can_be_leased_too() -> None:
    engine = Engine(residency_system(), trail=False)
    rec = engine.new(3)
    lease = engine.lease(rec, "lock", "unlock")
    assert rec.locks == 1
    lease.release()
    assert rec.locks == 0
    assert repr(lease).endswith(f"released at {lease.released_at}>")


def test_outstanding_lists_leases_oldest_site_first(engine: Engine) -> None:
    first = engine.lease(backed(engine))
    second = engine.lease(backed(engine))
    assert engine.leases.outstanding() == [first, second]
    second.release()
    first.release()


def test_held_records_finds_pins_taken_without_a_lease(engine: Engine) -> None:
    bare, leased, idle = backed(engine), engine.new(8), engine.new(9)
    leased.state = "backed"
    engine.fire(bare, "pin")
    lease = engine.lease(leased)
    assert held_records([engine]) == [
        Held("node", 7, "pinned (pins=1)"),
        Held("node", 8, "pinned (pins=1)"),
    ]
    assert str(held_records([engine])[0]) == "node 7: pinned (pins=1)"
    engine.fire(bare, "release")
    lease.release()
    assert held_records([engine]) == []
    assert idle.state == "unbacked"


def test_held_records_names_the_sites_in_trail_mode() -> None:
    engine = Engine(host_machine(), trail=True)
    rec = engine.new(4)
    line = here() + 2
    for event in ("write", "write_done", "pin"):
        engine.fire(rec, event)
    where = f"{HERE}:{line} in test_held_records_names_the_sites_in_trail_mode"
    assert [str(h) for h in held_records([engine])] == [
        f"node 4: pinned (pins=1); written at {where}; acknowledged at {where}; pinned at {where}"
    ]


def test_held_records_finds_locks_and_sglang_nodes_and_skips_garbage() -> None:
    residency = Residency(trail=False)

    class TreeNode(ResidencyMixin):
        """An SGLang-style node: plain instance attributes, no slots."""

        def __init__(self, ident: int) -> None:
            super().__init__()
            self.id = ident
            self.parent: Any = None
            self.children = {}

    TreeNode.residency = residency

    node, locked, garbage = TreeNode(3), TreeNode(5), TreeNode(6)
    for each in (node, garbage):
        residency.write(each)
        residency.write_done(each)
        each.protect_host()
    root = TreeNode(4)
    root.lock_ref = 1  # SGLang's reset: the cache's own lock on its root, never reported
    node.parent = locked.parent = root
    locked.inc_lock_ref()
    garbage.children = {"self": garbage}  # only a reference cycle keeps it alive
    del garbage, each
    assert [str(h) for h in held_records([residency.engine])] == [
        "node 3: pinned/resident (pins=1, locks=0)",
        "node 5: unbacked/resident (pins=0, locks=1)",
    ]
    node.release_host()
    locked.dec_lock_ref()
    assert held_records([residency.engine]) == []


def test_held_records_finds_pins_on_standalone_nodes_and_roots() -> None:
    residency = Residency(trail=False)
    alone, root = Node(11, host="backed"), Node(12, host="backed")
    child = Node(13, parent=root)
    root.children = {"a": child}
    residency.pin(alone)  # bare pins: only the counters say so
    residency.pin(root)
    residency.lock(child)  # propagated: the root's lock is its child's, reported once
    assert (root.locks, child.locks) == (1, 1)
    assert [str(h) for h in held_records([residency.engine])] == [
        "node 11: pinned/resident (pins=1, locks=0)",
        "node 12: pinned/resident (pins=1, locks=1)",
        "node 13: unbacked/resident (pins=0, locks=1)",
    ]
    residency.release(alone)
    residency.release(root)
    residency.unlock(child)
    assert held_records([residency.engine]) == []


def test_held_records_ignores_objects_that_only_look_like_records(engine: Engine) -> None:
    class Lookalike:
        def __init__(self) -> None:
            self.id, self.state, self.pins = 1, "pinned", 1

    class Derived:
        __slots__ = ("id", "state")
        id: int
        state: str
        pins = 1  # a class attribute is not a record field

    fake = Lookalike()
    fake.state = "stuck"  # not a state of the machine
    derived = Derived()
    derived.id, derived.state = 2, "pinned"
    assert held_records([engine]) == []
    assert (fake.pins, derived.pins) == (1, 1)


@pytest.mark.parametrize(
    ("name", "value"), [("record", None), ("event", "lock"), ("label", "job"), ("serial", 0)]
)
def test_what_a_lease_says_cannot_be_assigned(engine: Engine, name: str, value: object) -> None:
    """A lease is the receipt of what was taken: its record, event, label and serial are fixed.

    They were plain slots: a lease given another record released that
    record's pin, one given another event passed for a lock receipt, and a
    smaller serial made a later lease the oldest one a record released first.
    """
    rec = backed(engine)
    first, lease = engine.lease(rec), engine.lease(rec)
    with pytest.raises(ReadOnlyAttribute) as info:
        setattr(lease, name, value)
    assert str(info.value) == (
        f"Lease.{name} cannot be set (to {value!r}): a lease is the receipt of what was taken;"
        " take another lease"
    )
    assert isinstance(info.value, AttributeError)
    assert (lease.record, lease.event, lease.label) == (rec, "pin", "node")
    assert (first.serial, lease.serial) == (1, 2)
    assert engine.leases.oldest(rec, "pin") is first
    lease.release()
    first.release()
    assert (rec.state, rec.pins) == ("backed", 0)
