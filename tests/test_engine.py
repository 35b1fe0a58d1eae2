"""The checked engine on the shipped residency specs: every kind of refusal, check-then-act."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from records import Node, snapshot

from fsm_cache import errors
from fsm_cache.bench.engine import record_bytes, run_engine_bench
from fsm_cache.engine.core import Engine
from fsm_cache.errors import BadArgument, EffectFailed, IllegalTransition, SpecError, error_class
from fsm_cache.spec import reach
from fsm_cache.spec.loader import machine_from_dict, spec_from_dict
from fsm_cache.spec.machine import Forbid, System, as_system
from fsm_cache.spec.meaning import step
from fsm_cache.spec.shipped import host_machine, load_shipped, residency_system
from fsm_cache.spec.validate import problems


@pytest.fixture
def engine() -> Engine:
    return Engine(residency_system(), trail=False)


def test_a_full_lifecycle(engine: Engine) -> None:
    root = Node(engine, 0)
    node = Node(engine, 5, root)
    for event in ("write", "write_done", "pin", "pin", "release", "evict_device"):
        engine.fire(node, event)
    assert engine.describe(node) == "pinned/absent (pins=1, locks=0)"
    for event in ("load", "load_done", "release", "evict_host"):
        engine.fire(node, event)
    assert engine.describe(node) == "evicted/resident (pins=0, locks=0)"


def effect_engine(calls: list[str], fail: str = "") -> Engine:
    def hook(name: str) -> Any:
        def run(rec: Any) -> None:
            calls.append(f"{name} {rec.id} {rec.host}/{rec.device}")
            if name == fail:
                raise OSError("boom")

        return run

    return Engine(residency_system(), effects={n: hook(n) for n in effect_names()}, trail=False)


def effect_names() -> list[str]:
    machines = residency_system().machines.values()
    return sorted({t.effect for m in machines for t in m.transitions if t.effect is not None})


def test_effects_run_after_the_checks_and_before_the_commit() -> None:
    calls: list[str] = []
    engine = effect_engine(calls)
    node = Node(engine, 4)
    engine.fire(node, "write")
    assert calls == ["start_write 4 unbacked/resident"]
    assert node.host == "writing"
    with pytest.raises(errors.CopyInFlight):
        engine.fire(node, "evict_device")
    assert calls == ["start_write 4 unbacked/resident"]


def test_a_failing_effect_leaves_the_record_unchanged() -> None:
    calls: list[str] = []
    engine = effect_engine(calls, fail="free_device")
    node = Node(engine, 9, host="backed", device="resident")
    before = snapshot(engine, node)
    with pytest.raises(EffectFailed) as info:
        engine.fire(node, "evict_device")
    assert str(info.value) == "node 9: effect free_device of evict_device failed: boom"
    assert isinstance(info.value.__cause__, OSError)
    assert snapshot(engine, node) == before
    assert calls == ["free_device 9 backed/resident"]


def test_every_named_effect_must_be_bound() -> None:
    with pytest.raises(SpecError) as info:
        Engine(residency_system(), effects={"start_write": print})
    source = residency_system().source
    assert {"free_device", "free_host", "start_load", "start_write"} <= set(effect_names())
    assert info.value.problems == [
        f"{source}: effect {name!r} is not bound"
        for name in effect_names()
        if name != "start_write"
    ]


def test_unknown_events(engine: Engine) -> None:
    node = engine.new(1)
    source = residency_system().source
    for call in (lambda: engine.fire(node, "fly"), lambda: engine.allowed(node, "fly")):
        with pytest.raises(SpecError) as info:
            call()
        assert str(info.value) == (
            f"{source}: unknown event 'fly' (events: write, write_done, write_failed, pin, "
            "release, evict_host, load, load_done, load_failed, lock, unlock, evict_device, "
            "adopt)"
        )


GATE = {
    "machine": {"name": "gate", "initial": "shut", "label": "gate"},
    "states": {"shut": {}, "open": {}, "gone": {"final": True}},
    "transition": [
        {"event": "open", "source": "shut", "dest": "open"},
        {"event": "close", "source": "open", "dest": "shut"},
        {"event": "remove", "source": ["shut", "open"], "dest": "gone"},
    ],
    "forbid": [
        {"event": "open", "source": "open", "error": "GateJammed", "reason": "already open"},
        {"event": "close", "source": "shut", "error": "GateJammed", "reason": "already shut"},
    ],
}


def test_a_user_spec_names_its_own_error_classes() -> None:
    engine = Engine(spec_from_dict(GATE), trail=False)
    gate = engine.new("north")
    assert engine.slots == ("id", "state", "trail")
    assert repr(gate) == "gate.Record(id='north', state='shut')"
    engine.fire(gate, "open")
    with pytest.raises(IllegalTransition) as info:
        engine.fire(gate, "open")
    jammed = type(info.value)
    assert jammed.__name__ == "GateJammed"
    assert jammed.__module__ == "fsm_cache.errors"
    assert jammed is error_class("GateJammed")
    assert str(info.value) == "gate north: open refused in open: already open"


@pytest.mark.parametrize("trail", [False, True])
def test_an_event_in_a_final_state_is_refused_as_final(trail: bool) -> None:
    """A final state has ended: what it declares nothing for is a FinalState refusal."""
    engine = Engine(spec_from_dict(GATE), trail=trail)
    gate = engine.new("north")
    engine.fire(gate, "remove")
    for event in ("open", "close", "remove"):
        assert not engine.allowed(gate, event)
        with pytest.raises(errors.FinalState) as final:
            engine.fire(gate, event)
        assert type(final.value) is error_class("FinalState")
        assert str(final.value).split("; ")[0] == (
            f"gate north: {event} refused in gone: gone is final: nothing leaves it"
        )
        assert gate.state == "gone"
    assert step(as_system(spec_from_dict(GATE)), "close", {"state": "gone"}, {})[0] == "FinalState"


def test_a_final_state_with_a_way_out_names_it() -> None:
    revive = {"event": "revive", "source": "gone", "dest": "shut"}
    alive = {"event": "revive", "source": ["shut", "open"], "error": "Alive", "reason": "alive"}
    base: dict[str, Any] = GATE
    spec = {**base, "transition": [*base["transition"], revive], "forbid": [*base["forbid"], alive]}
    engine = Engine(spec_from_dict(spec), trail=False)
    gate = engine.new(2)
    engine.fire(gate, "remove")
    with pytest.raises(errors.FinalState) as final:
        engine.fire(gate, "open")
    assert str(final.value) == "gate 2: open refused in gone: gone is final: only revive leave it"
    engine.fire(gate, "revive")
    assert gate.state == "shut"


def test_a_class_another_thread_created_first_is_the_one_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    theirs: list[type[IllegalTransition]] = []

    class Racing(dict[str, type[IllegalTransition]]):
        """Another thread stores the class between this thread's look-up and its store."""

        def get(self, key: str, default: Any = None) -> Any:
            found = super().get(key, default)
            if found is None:
                theirs.append(type(key, (IllegalTransition,), {}))
                self[key] = theirs[0]
            return found

    monkeypatch.setattr(errors, "_CREATED", Racing())
    assert error_class("DoorRace") is theirs[0]
    assert error_class("DoorRace") is theirs[0]


@pytest.mark.parametrize("history", [-1, True, 2.5, "8", None])
def test_a_bad_history_is_refused_before_anything_is_built(history: Any) -> None:
    with pytest.raises(BadArgument) as info:
        Engine(host_machine(), trail=True, history=history)
    assert str(info.value) == f"Engine: history must be an int >= 0, got {history!r}"


@pytest.mark.parametrize(("history", "kept"), [(0, 0), (2, 2), (2**70, sys.maxsize)])
def test_any_history_from_zero_up_is_kept(history: int, kept: int) -> None:
    engine = Engine(host_machine(), trail=True, history=history)
    rec = engine.new(4)
    for event in ("write", "write_done", "pin"):
        engine.fire(rec, event)
    assert (engine.history, rec.trail.maxlen, len(rec.trail)) == (kept, kept, min(kept, 3))
    assert rec.pins == 1


def test_records_are_slotted_and_start_initial(engine: Engine) -> None:
    node = engine.new(8)
    assert engine.slots == ("id", "host", "device", "pins", "locks", "trail")
    assert not hasattr(node, "__dict__")
    assert engine.describe(node) == "unbacked/resident (pins=0, locks=0)"
    assert engine.counters(node, "host") == {"pins": 0}
    assert [m.name for m in engine.machines()] == ["host_residency", "device_residency"]
    assert set(engine.events) == set(residency_system().event_names)


def test_a_single_machine_runs_alone() -> None:
    engine = Engine(host_machine(), trail=False)
    rec = engine.new(1)
    rec.state = "backed"
    engine.verb("pin")(rec)
    engine.verb("pin")(rec)
    assert (rec.state, rec.pins) == ("pinned", 2)


def test_records_stay_under_100_bytes() -> None:
    assert record_bytes(10_000) < 100


def test_the_bench_reports_every_figure() -> None:
    bench = run_engine_bench(n=200, repeat=1)
    assert min(bench.bare_ns, bench.engine_ns, bench.trail_ns, bench.transitions_ns) > 0
    text = bench.format()
    assert text.splitlines()[0] == "pin+release pairs: n=200, best of 1 in CPU time"
    assert "bytes per residency record: " in text
    assert set(bench.targets()) == {
        "engine <= 1.25x bare",
        "trail <= 3.0x bare",
        "transitions >= 20x engine",
        "< 100 bytes per record",
    }


def test_the_first_declared_forbid_that_holds_decides() -> None:
    # Validation refuses overlapping forbids of one machine; a composition's own forbids
    # may overlap and are tried in declaration order, which is what the engine must do.
    spec = machine_from_dict(
        {
            "machine": {"name": "m", "initial": "a"},
            "counters": {"n": 0},
            "states": {"a": {}, "b": {}},
            "transition": [
                {"event": "go", "source": "a", "dest": "b"},
                {"event": "back", "source": "b", "dest": "a"},
            ],
            "forbid": [
                {"event": "go", "source": "b", "error": "Plain", "reason": "declared first"},
                {
                    "event": "go",
                    "source": "b",
                    "guard": "n >= 1",
                    "error": "Guarded",
                    "reason": "r",
                },
                {
                    "event": "back",
                    "source": "a",
                    "guard": "n >= 1",
                    "error": "Guarded",
                    "reason": "r",
                },
                {"event": "back", "source": "a", "error": "Plain", "reason": "declared second"},
            ],
        }
    )
    engine = Engine(spec, trail=False)
    rec = engine.new(1)
    rec.n = 1
    with pytest.raises(IllegalTransition) as back:
        engine.fire(rec, "back")
    assert str(back.value) == "instance 1: back refused in a (n=1): r"
    engine.fire(rec, "go")
    with pytest.raises(IllegalTransition) as go:
        engine.fire(rec, "go")
    assert str(go.value) == "instance 1: go refused in b (n=1): declared first"


def test_a_record_may_be_born_as_its_composition_declares() -> None:
    engine = Engine(load_shipped("residency_storage"))
    rec = engine.new(7, birth="discovered")
    assert (rec.host, rec.device, rec.storage, rec.pins, rec.locks) == (
        "evicted",
        "absent",
        "stored",
        0,
        0,
    )
    assert (engine.new(8).host, engine.new(8).storage) == ("unbacked", "unstored")
    with pytest.raises(SpecError) as info:
        engine.init(rec, 9, birth="computed")
    assert info.value.problems[0].endswith("unknown birth 'computed' (declared: discovered)")
    assert (rec.id, rec.host, rec.storage) == (7, "evicted", "stored")


STORAGE_RECORDS = [
    ({}, {}, None),
    ({"host": "pinned", "device": "loading", "storage": "storing"}, {"pins": 2}, None),
    (
        {"host": "pinned", "device": "loading", "storage": "storing"},
        {"pins": 1},
        "no run of residency_storage reaches host pinned, device loading, storage storing"
        " with pins=1, locks=0",
    ),
    (
        {"host": "fetching", "storage": "stored"},
        {},
        "no run of residency_storage reaches host fetching, device resident, storage stored",
    ),
    ({"host": "fetching", "storage": "reading", "device": "absent"}, {}, None),
    (
        {"storage": "lost"},
        {},
        "storage 'lost' is not a state of storage_residency (unstored, storing, stored, reading)",
    ),
    ({"hots": "backed"}, {}, "'hots' is no region or counter of residency_storage"),
    ({}, {"pinz": 1}, "'pinz' is no region or counter of residency_storage"),
    (
        {"hots": "backed", "device": "resident", "stroage": "stored"},
        {"pinz": 1, "pins": 0, "lokcs": 2},
        "'hots', 'stroage', 'pinz', 'lokcs' are no regions or counters of residency_storage",
    ),
    ({}, {"locks": 2.0}, "locks must be an int >= 0, got 2.0"),
    ({"pins": 1}, {}, "'pins' is a counter of residency_storage, not a region"),
    (
        {"pins": 1, "hots": "backed"},
        {"storage": "stored"},
        "'pins' is a counter of residency_storage, not a region; 'storage' is a region of "
        "residency_storage, not a counter; 'hots' is no region or counter of residency_storage",
    ),
]


@pytest.mark.parametrize(("states", "counters", "problem"), STORAGE_RECORDS)
def test_bad_record_says_what_no_run_of_the_spec_reaches(
    states: dict[str, object], counters: dict[str, object], problem: str | None
) -> None:
    """A store in flight holds a pin of its own, so a load beside it makes two; a fetch reads."""
    engine = Engine(load_shipped("residency_storage"), trail=False)
    assert engine.bad_record(states, counters) == problem


def test_bad_record_of_a_single_machine_reads_its_state_region() -> None:
    engine = Engine(host_machine(), trail=False)
    assert engine.bad_record({"state": "pinned"}, {"pins": 3}) is None
    assert (
        engine.bad_record({"state": "pinned"}, {}) == "state pinned requires pins >= 1, got pins=0"
    )


METER = {
    "machine": {"name": "meter", "initial": "idle"},
    "counters": {"n": 0},
    "states": {"idle": {"invariant": "n == 0"}, "counting": {"invariant": "n >= 1"}},
    "transition": [
        {"event": "tick", "source": "idle", "dest": "counting", "update": "n += 1"},
        {
            "event": "tick",
            "source": "counting",
            "dest": "counting",
            "guard": "n < 1000000",
            "update": "n += 1",
        },
        {
            "event": "reset",
            "source": "counting",
            "dest": "idle",
            "guard": "n >= 1000000",
            "update": "n = 0",
        },
    ],
    "forbid": [
        {
            "event": "tick",
            "source": "counting",
            "guard": "n >= 1000000",
            "error": "Full",
            "reason": "full",
        },
        {"event": "reset", "source": "idle", "error": "Idle", "reason": "nothing counted"},
        {
            "event": "reset",
            "source": "counting",
            "guard": "n < 1000000",
            "error": "NotFull",
            "reason": "not full",
        },
    ],
}
"""A counter compared with a million: a million records its runs reach."""


@pytest.mark.timeout(10)  # the unbounded search took 15 s and a million records here
def test_bad_record_searches_no_further_than_validation_does() -> None:
    engine = Engine(spec_from_dict(METER), trail=False)
    assert engine.bad_record({"state": "counting"}, {"n": 999_999}) is None
    assert engine.bad_record({"state": "idle"}, {"n": 5}) == "state idle requires n == 0, got n=5"


LAMP = {
    "machine": {"name": "lamp", "initial": "off"},
    "states": {"off": {}, "on": {}},
    "transition": [
        {"event": "flip", "source": "off", "dest": "on"},
        {"event": "flip", "source": "on", "dest": "off"},
    ],
}
"""Two states, each reached from the other by ``flip``."""


def _counting_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the steps any search of a spec's runs takes from now on."""
    fired: list[str] = []
    fire = reach.fire

    def counted(system: System, event: str, record: reach.Record) -> reach.Record | None:
        fired.append(event)
        return fire(system, event, record)

    monkeypatch.setattr(reach, "fire", counted)
    return fired


def test_bad_record_reads_the_search_validation_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading validates, which searches the runs; the engines' record checks search no more."""
    spec = spec_from_dict(LAMP)
    fired = _counting_steps(monkeypatch)
    for _ in range(2):  # each engine wraps the machine in a system of its own, an equal one
        engine = Engine(spec, trail=False)
        assert engine.bad_record({"state": "on"}, {}) is None
        assert (
            engine.bad_record({"state": "dim"}, {})
            == "state 'dim' is not a state of lamp (off, on)"
        )
    assert fired == []


def test_a_spec_forced_to_change_is_searched_as_it_now_is() -> None:
    """Searches are kept per spec; one whose frozen fields are forced gets its own."""
    lamp = machine_from_dict(LAMP)
    system = System("room", (("lamp", lamp),))
    assert problems(system) == []
    assert Engine(system, trail=False).bad_record({"lamp": "on"}, {}) is None
    refusal = Forbid("flip", (), "Stuck", "the switch is stuck")
    object.__setattr__(system, "forbids", (refusal,))  # frozen: forced, as no caller should
    engine = Engine(system, trail=False)
    assert engine.bad_record({"lamp": "on"}, {}) == "no run of room reaches lamp on"
    assert problems(system) == [
        "<python>: composition: deadlock at lamp off: every event is refused there "
        "(flip: Stuck) and no region is final; a record is born there (the initial states)",
        "<python>: composition.regions.lamp: state on: unreachable in the composition "
        "(no run from a birth reaches it)",
    ]
