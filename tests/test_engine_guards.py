"""What the engine refuses that no spec declares: looping parents, re-entrant effects, settings.

A parent chain that loops, and an effect that fires its own event at its
record, used to run until memory or the recursion limit ran out; each is
now refused with a typed error that names the records, and nothing is
written. ``trail`` and ``history`` are compiled in, so assigning them is
refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from records import Node, snapshot

from fsm_cache.engine.core import Engine
from fsm_cache.engine.runtime import WALK
from fsm_cache.errors import (
    BadArgument,
    EffectFailed,
    EffectReentered,
    ParentLoop,
    ReadOnlyAttribute,
)
from fsm_cache.spec.loader import spec_from_dict
from fsm_cache.spec.shipped import load_shipped, residency_system


pytestmark = pytest.mark.timeout(60)  # the old code walked a looping chain for ever

TRAILS = pytest.mark.parametrize("trail", [False, True], ids=["plain", "trail"])

RING = {
    "machine": {"name": "ring", "initial": "idle", "label": "item"},
    "counters": {"n": 0},
    "states": {"idle": {"invariant": "n >= 0", "counter": "n"}, "gone": {"final": True}},
    "transition": [
        # grab propagates and has an effect: the plan path (Engine._general)
        {
            "event": "grab",
            "source": "idle",
            "dest": "idle",
            "update": "n += 1",
            "propagate": "ancestors",
            "effect": "grabbed",
        },
        {"event": "a", "source": "idle", "dest": "idle", "effect": "on_a"},
        {"event": "b", "source": "idle", "dest": "idle", "effect": "on_b"},
        {"event": "c", "source": "idle", "dest": "idle"},
        {"event": "drop", "source": "idle", "dest": "gone"},
    ],
}


class Item:
    """A record of ``RING`` with a parent."""

    id: int
    state: str
    n: int

    def __init__(self, engine: Engine, ident: int, parent: Item | None = None) -> None:
        engine.init(self, ident)
        self.parent = parent


def ring_engine(trail: bool, **hooks: Callable[[Any], None]) -> Engine:
    bound = {"grabbed": _nothing, "on_a": _nothing, "on_b": _nothing, **hooks}
    return Engine(spec_from_dict(RING), effects=bound, trail=trail)


def _nothing(rec: Any) -> None:
    del rec


def path(engine: Engine, length: int) -> list[Node]:
    """Return ``length`` nodes, ids from 0, each the parent of the next."""
    nodes = [Node(engine, 0)]
    for ident in range(1, length):
        nodes.append(Node(engine, ident, nodes[-1]))
    return nodes


def looped_pair(engine: Engine) -> tuple[Node, Node]:
    """Return nodes 1 and 2, each the other's parent."""
    one = Node(engine, 1)
    two = Node(engine, 2, one)
    one.parent = two
    return one, two


# -- parent chains that loop -------------------------------------------------------


@TRAILS
@pytest.mark.parametrize("event", ["lock", "unlock"])
def test_an_event_walking_a_looping_chain_is_refused_and_changes_nothing(
    trail: bool, event: str
) -> None:
    engine = Engine(residency_system(), trail=trail)
    one, two = looped_pair(engine)
    if event == "unlock":
        one.locks = two.locks = 1
    before = snapshot(engine, one, two)
    with pytest.raises(ParentLoop) as info:
        engine.fire(two, event)
    assert str(info.value) == (
        f"node 2: its parent chain loops (node 2 -> node 1 -> node 2); {event} was not applied"
    )
    assert isinstance(info.value, BadArgument)
    assert snapshot(engine, one, two) == before


@TRAILS
def test_a_record_that_is_its_own_parent_is_refused(trail: bool) -> None:
    engine = Engine(residency_system(), trail=trail)
    node = Node(engine, 3)
    node.parent = node
    with pytest.raises(ParentLoop) as info:
        engine.verb("lock")(node)
    assert (
        str(info.value) == "node 3: its parent chain loops (node 3 -> node 3); lock was not applied"
    )
    assert node.locks == 0


def test_a_loop_above_the_record_names_the_walk_to_the_repeat() -> None:
    engine = Engine(residency_system(), trail=False)
    one, two = looped_pair(engine)
    leaf = Node(engine, 7, two)
    with pytest.raises(ParentLoop) as info:
        engine.fire(leaf, "lock")
    assert str(info.value) == (
        "node 7: its parent chain loops (node 7 -> node 2 -> node 1 -> node 2); lock was not applied"
    )
    assert [leaf.locks, two.locks, one.locks] == [0, 0, 0]


def test_a_loop_longer_than_a_walk_is_found_and_named_in_short() -> None:
    engine = Engine(residency_system(), trail=False)
    nodes = path(engine, WALK + 100)
    nodes[0].parent = nodes[-1]
    last = len(nodes) - 1
    with pytest.raises(ParentLoop) as info:
        engine.fire(nodes[-1], "lock")
    assert str(info.value) == (
        f"node {last}: its parent chain loops (node {last} -> node {last - 1} -> node {last - 2}"
        f" -> node {last - 3} -> ... -> node 1 -> node 0 -> node {last}); lock was not applied"
    )
    assert {node.locks for node in nodes} == {0}


def test_a_chain_deeper_than_a_walk_that_does_not_loop_is_walked_whole() -> None:
    engine = Engine(residency_system(), trail=False)
    nodes = path(engine, 2 * WALK + 5)
    engine.fire(nodes[-1], "lock")
    assert {node.locks for node in nodes} == {1}
    engine.fire(nodes[-1], "unlock")
    assert {node.locks for node in nodes} == {0}


@TRAILS
def test_the_plan_path_and_allowed_refuse_a_looping_chain_too(trail: bool) -> None:
    calls: list[int] = []
    engine = ring_engine(trail, grabbed=lambda rec: calls.append(rec.id))
    one = Item(engine, 1)
    two = Item(engine, 2, one)
    one.parent = two
    message = "item 2: its parent chain loops (item 2 -> item 1 -> item 2); grab was not applied"
    for call in (lambda: engine.fire(two, "grab"), lambda: engine.allowed(two, "grab")):
        with pytest.raises(ParentLoop) as info:
            call()
        assert str(info.value) == message
    assert (one.n, two.n, calls) == (0, 0, [])
    one.parent = None
    engine.fire(two, "grab")
    assert (one.n, two.n, calls) == (1, 1, [2, 1])


# -- effects that fire their own event ------------------------------------------------


def residency_effects(**hooks: Callable[[Any], None]) -> dict[str, Callable[[Any], None]]:
    machines = residency_system().machines.values()
    names = {t.effect for m in machines for t in m.transitions if t.effect is not None}
    return {name: hooks.get(name, _nothing) for name in names}


@TRAILS
def test_an_effect_that_fires_its_own_event_is_refused_at_the_first_reentry(
    trail: bool,
) -> None:
    runs: list[int] = []
    engines: list[Engine] = []

    def start_write(rec: Any) -> None:
        runs.append(rec.id)
        engines[0].fire(rec, "write")

    engine = Engine(
        residency_system(), effects=residency_effects(start_write=start_write), trail=trail
    )
    engines.append(engine)
    node = Node(engine, 4)
    before = snapshot(engine, node)
    with pytest.raises(EffectReentered) as info:
        engine.fire(node, "write")
    assert str(info.value) == (
        "node 4: write fired while its effect start_write was already running on the record;"
        " the re-entrant write was refused before start_write ran again"
    )
    assert isinstance(info.value, EffectFailed)
    assert runs == [4]  # the effect ran once, not to the recursion limit
    assert snapshot(engine, node) == before
    depth, cause = 0, info.value.__cause__
    while cause is not None:
        depth, cause = depth + 1, cause.__cause__
    assert depth <= 2


@TRAILS
def test_an_event_sharing_a_running_effect_is_named_as_the_one_that_fired(trail: bool) -> None:
    """Two events bound to one effect: the second, fired from it, never fired before.

    The message said the second event "fired again", pointing a reader at a
    firing of it that never happened.
    """
    engines: list[Engine] = []

    def shared(rec: Any) -> None:
        engines[0].fire(rec, "b")

    transitions = [
        {**t, "effect": "on_a"} if t["event"] == "b" else t
        for t in RING["transition"]  # type: ignore[attr-defined]
    ]
    engine = Engine(
        spec_from_dict({**RING, "transition": transitions}),
        effects={"grabbed": _nothing, "on_a": shared},
        trail=trail,
    )
    engines.append(engine)
    item = Item(engine, 6)
    before = snapshot(engine, item)
    with pytest.raises(EffectReentered) as info:
        engine.fire(item, "a")
    assert str(info.value) == (
        "item 6: b fired while its effect on_a was already running on the record;"
        " the re-entrant b was refused before on_a ran again"
    )
    assert snapshot(engine, item) == before


@TRAILS
def test_an_effect_that_fires_its_event_through_another_is_refused(trail: bool) -> None:
    runs: list[str] = []
    engines: list[Engine] = []

    def on_a(rec: Any) -> None:
        runs.append("on_a")
        engines[0].fire(rec, "b")

    def on_b(rec: Any) -> None:
        runs.append("on_b")
        engines[0].fire(rec, "a")

    engine = ring_engine(trail, on_a=on_a, on_b=on_b)
    engines.append(engine)
    item = Item(engine, 5)
    before = snapshot(engine, item)
    with pytest.raises(EffectReentered) as info:
        engine.fire(item, "a")
    assert str(info.value) == (
        "item 5: a fired while its effect on_a was already running on the record;"
        " the re-entrant a was refused before on_a ran again"
    )
    assert runs == ["on_a", "on_b"]
    assert snapshot(engine, item) == before


@pytest.mark.parametrize("back", [1, 2], ids=["first-record", "second-record"])
def test_a_reentry_while_the_effect_runs_on_two_records_is_refused(back: int) -> None:
    """``on_a`` of item 1 fires ``a`` at item 2, whose ``on_a`` fires ``a`` at item ``back``."""
    engines: list[Engine] = []
    items: dict[int, Item] = {}
    runs: list[int] = []
    firing = [True]

    def on_a(rec: Any) -> None:
        runs.append(rec.id)
        if firing[0]:
            engines[0].fire(items[2 if rec.id == 1 else back], "a")

    engine = ring_engine(False, on_a=on_a)
    engines.append(engine)
    items.update({i: Item(engine, i) for i in (1, 2)})
    before = snapshot(engine, items[1], items[2])
    with pytest.raises(EffectReentered) as info:
        engine.fire(items[1], "a")
    assert str(info.value) == (
        f"item {back}: a fired while its effect on_a was already running on the record;"
        " the re-entrant a was refused before on_a ran again"
    )
    assert runs == [1, 2]
    assert snapshot(engine, items[1], items[2]) == before
    firing[0] = False  # nothing is left marked as running on either record
    engine.fire(items[1], "a")
    engine.fire(items[2], "a")
    assert runs == [1, 2, 1, 2]


@TRAILS
def test_an_effect_may_fire_events_at_other_records(trail: bool) -> None:
    """The same event, another event, and an event with an effect of its own, elsewhere."""
    engines: list[Engine] = []
    items: dict[int, Item] = {}
    runs: list[str] = []

    def on_a(rec: Any) -> None:
        runs.append(f"on_a {rec.id}")
        if rec.id == 1:
            engines[0].fire(items[2], "a")  # the same event (and effect), another record
            engines[0].fire(items[2], "b")  # another event with an effect
            engines[0].fire(items[3], "c")  # another event without one

    def on_b(rec: Any) -> None:
        runs.append(f"on_b {rec.id}")
        engines[0].fire(items[3], "grab")  # an effect on the plan path

    def grabbed(rec: Any) -> None:
        runs.append(f"grabbed {rec.id}")

    engine = ring_engine(trail, on_a=on_a, on_b=on_b, grabbed=grabbed)
    engines.append(engine)
    items.update({i: Item(engine, i) for i in (1, 2, 4)})
    items[3] = Item(engine, 3, items[4])
    engine.fire(items[1], "a")
    assert runs == ["on_a 1", "on_a 2", "on_b 2", "grabbed 3", "grabbed 4"]
    assert [items[i].n for i in (1, 2, 3, 4)] == [0, 0, 1, 1]
    engine.fire(items[1], "a")  # and again: the effects left nothing behind
    assert [items[i].n for i in (1, 2, 3, 4)] == [0, 0, 2, 2]


def test_an_effect_that_failed_can_run_again() -> None:
    """A hook that raised is not left marked as running on the record."""
    fail = [True]

    def on_a(rec: Any) -> None:
        if fail[0]:
            raise OSError("boom")

    engine = ring_engine(False, on_a=on_a)
    item = Item(engine, 6)
    with pytest.raises(EffectFailed) as info:
        engine.fire(item, "a")
    assert str(info.value) == "item 6: effect on_a of a failed: boom"
    fail[0] = False
    engine.fire(item, "a")


# -- settings compiled into the engine ----------------------------------------------


@pytest.mark.parametrize(("name", "value"), [("trail", True), ("history", 3)])
def test_trail_and_history_cannot_be_assigned(name: str, value: object) -> None:
    engine = Engine(residency_system(), trail=False, history=5)
    with pytest.raises(ReadOnlyAttribute) as info:
        setattr(engine, name, value)
    assert str(info.value) == (
        f"Engine.{name} cannot be set (to {value!r}): the engine's functions were compiled"
        f" with {name}; build another Engine(spec, {name}=...)"
    )
    assert isinstance(info.value, AttributeError)
    assert (engine.trail, engine.history) == (False, 5)
    node = Node(engine, 1)
    engine.fire(node, "lock")
    assert node.trail is None  # still no trail mode


def test_the_system_the_record_class_and_the_lease_book_cannot_be_assigned() -> None:
    """``system``, ``Record`` and ``leases`` used to be plain attributes, silently replaced.

    A replaced system changed what messages and :meth:`Engine.bad_record` read
    but not the compiled functions; a replaced book forgot the leases handed
    out, so ``init`` no longer voided them and a stale lease released the pin
    of the record's next life.
    """
    engine = Engine(residency_system(), trail=False)
    system, book, record = engine.system, engine.leases, engine.Record
    rec = engine.new(1)
    rec.host = "backed"
    lease = engine.lease(rec)
    tries: list[tuple[str, object, str]] = [
        (
            "system",
            load_shipped("host_residency"),
            "Engine.system cannot be set (to MachineSpec(n...sidency.toml')): the engine's"
            " functions were compiled from it; build another Engine(spec)",
        ),
        (
            "Record",
            dict,
            "Engine.Record cannot be set (to <class 'dict'>): the engine's functions"
            " were compiled for its records; build another Engine(spec) for another record class",
        ),
        (
            "leases",
            None,
            "Engine.leases cannot be set (to None): the engine opens its"
            " leases in it and init voids them there; release them, or void them with"
            " Engine.leases.void(site)",
        ),
    ]
    for name, value, message in tries:
        with pytest.raises(ReadOnlyAttribute) as info:
            setattr(engine, name, value)
        assert str(info.value) == message
        assert isinstance(info.value, AttributeError)
    assert (engine.system, engine.leases, engine.Record) == (system, book, record)
    assert type(engine.new(2)) is record
    engine.init(rec, 1)
    assert not lease.held  # the engine's own book voided it


def test_a_built_engine_takes_no_attribute_it_was_not_built_with() -> None:
    """A typo (``engine.trails = True``) set a new attribute and changed nothing, silently."""
    engine = Engine(residency_system(), trail=False)
    before = dict(vars(engine))
    for name in ("trails", "foo", "Records"):
        with pytest.raises(ReadOnlyAttribute) as info:
            setattr(engine, name, True)
        assert str(info.value) == (
            f"Engine.{name} cannot be set (to True): an engine has no such attribute"
            " (its settings are Engine(spec, ...)'s arguments)"
        )
        assert isinstance(info.value, AttributeError)
    assert vars(engine) == before
    assert not engine.trail


@pytest.mark.parametrize("name", ["system", "Record", "leases"])
def test_what_the_engine_is_built_with_cannot_be_deleted(name: str) -> None:
    """Deleted, it could be set again past the guard, which lets only a missing one be set."""
    engine = Engine(residency_system(), trail=False)
    kept = getattr(engine, name)
    with pytest.raises(ReadOnlyAttribute) as info:
        delattr(engine, name)
    why = {
        "system": "the engine's functions were compiled from it; build another Engine(spec)",
        "Record": "the engine's functions were compiled for its records; build another"
        " Engine(spec) for another record class",
        "leases": "the engine opens its leases in it and init voids them there; release them,"
        " or void them with Engine.leases.void(site)",
    }[name]
    assert str(info.value) == f"Engine.{name} cannot be deleted: {why}"
    assert getattr(engine, name) is kept
