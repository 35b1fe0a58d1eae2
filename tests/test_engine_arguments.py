"""The engine's own arguments: a wrong type or value is named in a typed error, nothing built.

Specs, effects and trail flags are checked where an engine is built; a record
that is not one is named by :meth:`Engine.fire` and the other methods that take
one, on the path that already failed, so the per-event functions pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from records import Node

from fsm_cache.engine.core import Engine
from fsm_cache.errors import BadArgument, SpecError
from fsm_cache.residency import Residency, configure
from fsm_cache.spec.loader import machine_from_dict
from fsm_cache.spec.machine import MachineSpec, StateSpec, System, Transition
from fsm_cache.spec.shipped import host_machine, residency_system


GATE = machine_from_dict(
    {
        "machine": {"name": "gate", "initial": "shut"},
        "states": {"shut": {}, "open": {}},
        "transition": [
            {"event": "open", "source": "shut", "dest": "open"},
            {"event": "shut", "source": "open", "dest": "shut"},
        ],
        "forbid": [
            {"event": "open", "source": "open", "error": "Open", "reason": "open"},
            {"event": "shut", "source": "shut", "error": "Shut", "reason": "shut"},
        ],
    }
)
"""A machine that names no effect."""


NOT_A_RECORD = "is not a record of residency: it has no id, host, device, pins, locks"


@pytest.fixture
def engine() -> Engine:
    return Engine(residency_system(), trail=False)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Engine(5), "Engine: spec must be a MachineSpec or System, got 5"),  # type: ignore[arg-type]
        (
            lambda: Engine(host_machine(), effects=5),  # type: ignore[arg-type]
            "Engine: effects must be a mapping of effect names to callables, or None; got 5",
        ),
        (
            lambda: Engine(host_machine(), effects={"start_write": print, "free_host": "x"}),  # type: ignore[dict-item]
            "Engine: effect 'free_host' must be callable, got 'x'",
        ),
        (
            lambda: Engine(
                host_machine(), effects={"start_write": print, "free_hots": print}
            ),  # a misspelt effect: it would bind nothing
            "Engine: effects binds 'free_hots', not an effect of host_residency "
            "(its effects: free_host, start_write)",
        ),
        (
            lambda: Engine(residency_system(), effects={"on_load": print, 7: print}),  # type: ignore[dict-item]
            "Engine: effects binds 'on_load', 7, not effects of residency "
            "(its effects: adopt_device, free_device, free_host, start_load, start_write)",
        ),
        (
            lambda: Engine(GATE, effects={"on_open": print}),
            "Engine: effects binds 'on_open', not an effect of gate (it names no effect)",
        ),
        (
            lambda: Engine(host_machine(), trail="x"),  # type: ignore[arg-type]
            "Engine: trail must be a bool or None, got 'x'",
        ),
        (
            lambda: Engine(host_machine(), audit=1),  # type: ignore[arg-type]
            "Engine: audit must be a bool or None, got 1",
        ),
        (
            lambda: Residency(trail="yes"),  # type: ignore[arg-type]
            "Residency: trail must be a bool or None, got 'yes'",
        ),
        (
            lambda: Residency(storage="yes"),  # type: ignore[arg-type]
            "Residency: storage must be a bool, got 'yes'",
        ),
        (
            lambda: configure(trail=0),  # type: ignore[arg-type]
            "configure: trail must be a bool or None, got 0",
        ),
    ],
)
def test_a_bad_constructor_argument_is_named(build: Callable[[], object], message: str) -> None:
    with pytest.raises(BadArgument) as info:
        build()
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("call", "where"),
    [
        (lambda e, rec: e.fire(rec, "write"), "fire"),
        (lambda e, rec: e.allowed(rec, "write"), "allowed"),
        (lambda e, rec: e.plan(rec, "write"), "plan"),
        (lambda e, rec: e.lease(rec), "lease"),
        (lambda e, rec: e.describe(rec), "describe"),
        (lambda e, rec: e.counters(rec), "counters"),
    ],
)
@pytest.mark.parametrize("rec", [None, 5, "node"])
def test_a_record_that_is_not_one_is_named(
    engine: Engine, call: Callable[[Engine, Any], object], where: str, rec: object
) -> None:
    with pytest.raises(BadArgument) as info:
        call(engine, rec)
    assert str(info.value) == f"Engine.{where}: rec {rec!r} {NOT_A_RECORD}"
    assert not engine.leases.outstanding()


def test_an_ancestor_that_is_not_a_record_is_named_and_nothing_changes(engine: Engine) -> None:
    node = Node(engine, 2)
    node.parent = 5  # type: ignore[assignment]
    with pytest.raises(BadArgument) as info:
        engine.fire(node, "lock")
    assert str(info.value) == f"Engine.fire: rec's ancestor 5 {NOT_A_RECORD}"
    assert node.locks == 0


def test_a_record_missing_some_attributes_is_told_which(engine: Engine) -> None:
    class Half:
        id, host, device = 1, "backed", "resident"

    with pytest.raises(BadArgument) as info:
        engine.fire(Half(), "release")
    assert str(info.value).startswith("Engine.fire: rec <")
    assert str(info.value).endswith("> is not a record of residency: it has no pins, locks")


@pytest.mark.parametrize(
    ("call", "where"),
    [
        (lambda e, rec: e.fire(rec, ["write"]), "fire"),
        (lambda e, rec: e.allowed(rec, ["write"]), "allowed"),
        (lambda e, rec: e.plan(rec, ["write"]), "plan"),
        (lambda e, rec: e.lease(rec, ["pin"]), "lease"),
        (lambda e, _: e.verb(["write"]), "verb"),
        (lambda e, _: e.planner(["write"]), "planner"),
    ],
)
def test_an_event_that_is_no_string_is_named(
    engine: Engine, call: Callable[[Engine, Any], object], where: str
) -> None:
    node = engine.new(1)
    with pytest.raises(BadArgument) as info:
        call(engine, node)
    event = "['pin']" if where == "lease" else "['write']"
    assert str(info.value) == f"Engine.{where}: event must be a str, got {event}"
    assert engine.describe(node) == "unbacked/resident (pins=0, locks=0)"


def test_an_unknown_region_is_a_spec_error(engine: Engine) -> None:
    with pytest.raises(SpecError) as info:
        engine.counters(engine.new(1), "nope")
    source = residency_system().source
    assert str(info.value) == f"{source}: unknown region 'nope' (regions: host, device)"
    assert engine.counters(engine.new(1), "device") == {"locks": 0}


def test_a_verb_reads_its_record_unchecked(engine: Engine) -> None:
    """The per-event functions check nothing but the spec: a non-record fails as Python does."""
    with pytest.raises(AttributeError):
        engine.verb("pin")(None)


class Slotted:
    """The base of slotted record classes: no ``__dict__``, so no room for what a slot lacks."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<slotted>"


def slotted(engine: Engine, *, trail: bool, **state: object) -> Any:
    """Return a residency record whose class has a ``trail`` slot only if ``trail``."""
    names = engine.slots if trail else engine.slots[:-1]
    kind = type("Record", (Slotted,), {"__slots__": names})
    rec = kind()
    values = {"id": 7, "host": "backed", "device": "resident", "pins": 0, "locks": 0}
    for name, value in {**values, **state}.items():
        setattr(rec, name, value)
    return rec


def fields(engine: Engine, rec: Any) -> list[object]:
    """Every record field ``rec`` holds, or a marker for one it does not."""
    return [getattr(rec, name, "<unset>") for name in engine.slots]


@pytest.mark.parametrize(
    ("event", "state"),
    [
        ("pin", {}),  # inline fast path
        ("write", {"host": "unbacked"}),  # effects: the fast path with effects
        ("lock", {}),  # propagates: the plan path in trail mode
    ],
)
def test_in_trail_mode_a_record_with_no_trail_is_named_before_anything_changes(
    event: str, state: dict[str, object]
) -> None:
    """Trail mode notes each event on ``rec.trail``; a record without one changes nothing.

    The note used to follow the writes: the event was applied, then
    AttributeError raised, so the caller saw a failure that had changed the
    record (and, with effects, that had run them).
    """
    called: list[str] = []
    effects = dict.fromkeys(residency_system().effect_names, called.append)
    engine = Engine(residency_system(), effects=effects, trail=True)
    rec = slotted(engine, trail=False, **state)
    before = fields(engine, rec)
    with pytest.raises(BadArgument) as info:
        engine.fire(rec, event)
    assert (
        str(info.value)
        == "Engine.fire: rec <slotted> is not a record of residency: it has no trail"
    )
    assert fields(engine, rec) == before
    with pytest.raises(BadArgument) as info:  # it used to say True: fire would accept it
        engine.allowed(rec, event)
    assert str(info.value) == (
        "Engine.allowed: rec <slotted> is not a record of residency: it has no trail"
    )
    with pytest.raises(AttributeError):  # a verb reads its record unchecked, and changes nothing
        engine.verb(event)(rec)
    assert fields(engine, rec) == before
    assert called == []
    plain = Engine(residency_system(), effects=effects, trail=False)
    plain.fire(rec, event)  # outside trail mode a trail is never read
    assert fields(engine, rec) != before


def test_init_of_an_object_that_cannot_hold_a_record_changes_nothing() -> None:
    """``init`` writes every field or none; it used to write the id and stop at the first gap."""
    engine = Engine(residency_system(), trail=False)
    kind = type("Record", (Slotted,), {"__slots__": ("id", "host", "device")})
    rec = kind()
    rec.id = "old"
    with pytest.raises(BadArgument) as info:
        engine.init(rec, 7)
    assert str(info.value) == (
        "Engine.init: rec <slotted> is not a record of residency: it cannot hold pins"
    )
    assert (rec.id, hasattr(rec, "host"), hasattr(rec, "device")) == ("old", False, False)
    full = slotted(engine, trail=True, host="pinned", pins=2)
    engine.init(full, 8)
    assert fields(engine, full) == [8, "unbacked", "resident", 0, 0, None]


def test_init_of_an_object_whose_setter_refuses_a_field_changes_nothing() -> None:
    """A setter that raises (a property checking its value) leaves the object as it was.

    Only AttributeError and TypeError were undone: a ValueError from the setter of
    ``pins`` left the new id and states written and escaped untyped.
    """
    engine = Engine(residency_system(), trail=False)

    class Guarded(Slotted):
        __slots__ = ("counted", "device", "host", "id", "locks", "trail")
        counted: int
        device: str
        host: str
        id: object
        locks: int
        trail: object

        @property
        def pins(self) -> int:
            return self.counted

        @pins.setter
        def pins(self, value: int) -> None:
            raise ValueError(f"pins are counted elsewhere, not set to {value}")

    rec = Guarded()
    rec.id, rec.host, rec.device, rec.counted, rec.locks, rec.trail = (
        5,
        "pinned",
        "absent",
        1,
        0,
        None,
    )
    with pytest.raises(BadArgument) as info:
        engine.init(rec, 7)
    assert str(info.value) == (
        "Engine.init: rec <slotted> is not a record of residency: it cannot hold pins"
    )
    assert str(info.value.__cause__) == "pins are counted elsewhere, not set to 0"
    assert (rec.id, rec.host, rec.device, rec.pins) == (5, "pinned", "absent", 1)


@pytest.mark.parametrize("call", ["new", "init"])
@pytest.mark.parametrize("birth", [3, ["discovered"]])
def test_a_birth_that_is_no_string_is_named(call: str, birth: object) -> None:
    engine = Engine(residency_system(), trail=False)
    rec = engine.new(1)
    with pytest.raises(BadArgument) as info:
        engine.new(2, birth) if call == "new" else engine.init(rec, 2, birth)  # type: ignore[arg-type]
    assert str(info.value) == f"Engine.{call}: birth must be a str or None, got {birth!r}"
    assert rec.id == 1


@pytest.mark.parametrize(
    ("states", "counters", "message"),
    [
        (5, {}, "Engine.bad_record: states must be a mapping, got 5"),
        ({}, None, "Engine.bad_record: counters must be a mapping, got None"),
        (
            [("host", "backed")],
            {},
            "Engine.bad_record: states must be a mapping, got [('host', 'backed')]",
        ),
    ],
)
def test_bad_record_names_an_argument_that_is_no_mapping(
    engine: Engine, states: object, counters: object, message: str
) -> None:
    """It raised TypeError (``'int' object is not iterable``), which no caller catches as ours."""
    with pytest.raises(BadArgument) as info:
        engine.bad_record(states, counters)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize("region", [5, ["host"]])
def test_a_region_that_is_no_string_is_named(engine: Engine, region: object) -> None:
    """Named as an event or a birth that is no str is, not as an unknown region."""
    with pytest.raises(BadArgument) as info:
        engine.counters(engine.new(1), region)  # type: ignore[arg-type]
    assert str(info.value) == f"Engine.counters: region must be a str or None, got {region!r}"


def test_an_empty_region_name_is_unknown_not_every_region(engine: Engine) -> None:
    """``counters(rec, "")`` returned every region's counters, as if no region were named."""
    with pytest.raises(SpecError) as info:
        engine.counters(engine.new(1), "")
    source = residency_system().source
    assert str(info.value) == f"{source}: unknown region '' (regions: host, device)"


def counting(counter: str) -> MachineSpec:
    """A machine, built in code and never validated, whose one counter is ``counter``."""
    return machine_from_dict(
        {
            "machine": {"name": "m", "initial": "a"},
            "counters": {counter: 0},
            "states": {"a": {}},
            "transition": [
                {"event": "go", "source": "a", "dest": "a", "update": f"{counter} += 1"}
            ],
        }
    )


@pytest.mark.parametrize("counter", ["id", "trail", "parent", "state"])
def test_a_spec_whose_counter_is_named_like_a_record_attribute_is_refused(counter: str) -> None:
    """A counter called ``id`` used to be a second ``id`` slot: each event rewrote the record's id.

    ``trail`` broke every event in trail mode, ``parent`` the walk to the
    ancestors, ``state`` the single machine's region. Validation refused them
    in files; a spec built in code reached the engine unchecked.
    """
    with pytest.raises(SpecError) as info:
        Engine(counting(counter), trail=False)
    assert str(info.value) == (
        f"<python>: counters.{counter}: {counter!r} is reserved "
        "(a record attribute or a name of the generated code)"
    )


def test_a_spec_name_that_is_no_identifier_never_becomes_generated_code() -> None:
    """An event name is written into the engine's generated source: it must be an identifier."""
    event = "go(rec):\n    pass\nimport os\ndef _step_x"
    spec = MachineSpec(
        "m", "a", (), (StateSpec("a"),), (Transition(event, ("a",), "a"),), source="<python>"
    )
    with pytest.raises(SpecError) as info:
        Engine(spec, trail=False)
    assert str(info.value) == f"<python>: transition[0].event: {event!r}: not an identifier"


def test_a_composition_whose_region_is_named_like_a_record_attribute_is_refused() -> None:
    spec = counting("n")
    system = System("c", (("parent", spec), ("other", spec)), source="<c>")
    with pytest.raises(SpecError) as info:
        Engine(system, trail=False)
    assert str(info.value).splitlines() == [
        "<c>: composition.regions.parent: not a usable region name "
        "(an identifier that is no keyword, record attribute or counter)",
        "<c>: composition.regions.other: counter 'n' also in region 'parent'",
    ]
