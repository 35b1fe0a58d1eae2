"""The engine agrees with the ``transitions`` reference: exhaustively and on random runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from records import configurations, outcome, run_both, step_lists, values
from transitions import Machine

from fsm_cache.engine.core import Engine
from fsm_cache.errors import EffectFailed
from fsm_cache.spec.loader import load_spec, spec_from_dict
from fsm_cache.spec.machine import MachineSpec, Spec, System, as_system
from fsm_cache.spec.shipped import load_shipped
from fsm_cache.spec.validate import bound
from fsm_cache.testing.reference import Record, Reference


Outcome = tuple[type, str] | None

COUNTERS = {
    "machine": {"name": "counters", "initial": "idle", "label": "job"},
    "counters": {"a": 0, "b": 1},
    "states": {
        "idle": {"invariant": "a == 0"},
        "busy": {"invariant": "a >= 1"},
        "done": {"final": True},
    },
    "transition": [
        {"event": "start", "source": "idle", "dest": "busy", "update": "a += 1, b = 0"},
        {"event": "start", "source": "busy", "dest": "busy", "guard": "a <= 2", "update": "a += 1"},
        {"event": "stop", "source": "busy", "dest": "idle", "guard": "a == 1", "update": "a -= 1"},
        {
            "event": "stop",
            "source": "busy",
            "dest": "busy",
            "guard": "a >= 2 and b == 0",
            "update": "a -= 1",
            "effect": "note",
        },
        {"event": "finish", "source": "idle", "dest": "done", "effect": "archive"},
        {
            "event": "bump",
            "source": ["idle", "busy"],
            "dest": "idle",
            "guard": "a == 0 and b < 3",
            "update": "b += 1",
        },
    ],
    "forbid": [
        {
            "event": "start",
            "source": "busy",
            "guard": "a >= 3",
            "error": "Saturated",
            "reason": "full",
        },
        {"event": "stop", "source": "idle", "error": "NotBusy", "reason": "nothing running"},
        {
            "event": "stop",
            "source": "busy",
            "guard": "a >= 2 and b >= 1",
            "error": "Sticky",
            "reason": "b set",
        },
        {"event": "finish", "source": "busy", "error": "NotBusy", "reason": "still running"},
        {
            "event": "bump",
            "source": ["idle", "busy"],
            "guard": "b >= 3",
            "error": "Saturated",
            "reason": "b full",
        },
        {"event": "bump", "source": "busy", "guard": "b <= 2", "error": "Busy", "reason": "busy"},
    ],
}


VALVE = """
[machine]
name = "valve"
initial = "shut"
[counters]
flow = 0
[states]
shut = { invariant = "flow == 0" }
open = {}
[[transition]]
event = "open"
source = "shut"
dest = "open"
[[forbid]]
event = "open"
source = "open"
error = "AlreadyOpen"
reason = "open already"
[[transition]]
event = "close"
source = "open"
dest = "shut"
guard = "flow == 0"
[[forbid]]
event = "close"
source = "open"
guard = "flow >= 1"
error = "Flowing"
reason = "still flowing"
[[forbid]]
event = "close"
source = "shut"
error = "AlreadyShut"
reason = "shut already"
[[transition]]
event = "push"
source = "open"
dest = "open"
update = "flow += 1"
propagate = "ancestors"
[[forbid]]
event = "push"
source = "shut"
error = "AlreadyShut"
reason = "cannot push through a shut valve"
[[transition]]
event = "drain"
source = "open"
dest = "open"
guard = "flow >= 1"
update = "flow -= 1"
propagate = "ancestors"
[[forbid]]
event = "drain"
source = "open"
guard = "flow == 0"
error = "Dry"
reason = "nothing to drain"
[[forbid]]
event = "drain"
source = "shut"
error = "Dry"
reason = "shut"
[[transition]]
event = "sync"
source = ["shut", "open"]
dest = "open"
effect = "valve_sync"
"""
LAMP = """
[machine]
name = "lamp"
initial = "off"
[counters]
lux = 0
[states]
off = { invariant = "lux == 0" }
on = { invariant = "lux >= 1" }
[[transition]]
event = "on"
source = "off"
dest = "on"
update = "lux = 1"
[[forbid]]
event = "on"
source = "on"
error = "AlreadyOn"
reason = "on already"
[[transition]]
event = "off"
source = "on"
dest = "off"
update = "lux = 0"
[[forbid]]
event = "off"
source = "off"
error = "AlreadyOff"
reason = "off already"
[[transition]]
event = "sync"
source = "on"
dest = "on"
guard = "lux <= 2"
update = "lux += 1"
[[forbid]]
event = "sync"
source = "on"
guard = "lux >= 3"
error = "TooBright"
reason = "bright enough"
[[forbid]]
event = "sync"
source = "off"
error = "AlreadyOff"
reason = "sync needs light"
"""
PLANT = """
[composition]
name = "plant"
label = "unit"
[composition.regions]
valve = "valve.toml"
lamp = "lamp.toml"
[[forbid]]
event = "open"
when = "lamp in [off]"
error = "Dark"
reason = "open only with the lamp on"
[[forbid]]
event = "push"
source = ["open"]
guard = "lux >= 2"
error = "TooBright"
reason = "no pushing in glare"
[[forbid]]
event = "push"
when = "parent valve in [shut]"
error = "Blocked"
reason = "the parent valve is shut"
[[forbid]]
event = "off"
when = ["any child lamp in [on]", "valve in [open]"]
error = "ChildLit"
reason = "a child is lit"
"""


@pytest.fixture(scope="module")
def plant(tmp_path_factory: pytest.TempPathFactory) -> System:
    folder = tmp_path_factory.mktemp("plant")
    for name, text in (("valve", VALVE), ("lamp", LAMP), ("plant", PLANT)):
        (folder / f"{name}.toml").write_text(text, encoding="utf-8")
    spec = load_spec(folder / "plant.toml")
    assert isinstance(spec, System)
    return spec


def pair(
    engine: Engine, ref: Reference, ident: int, config: dict[str, object]
) -> tuple[Record, Record]:
    a, b = Record(ident), Record(ident)
    engine.init(a, ident)
    engine.init(b, ident)
    for key, value in config.items():
        setattr(a, key, value)
        setattr(b, key, value)
    return a, b


def agree_everywhere(spec: Spec, **kwargs: Any) -> int:
    system = as_system(spec)
    engine, ref = Engine(spec, trail=False, **kwargs), Reference(spec, **kwargs)
    checked = 0
    for config in configurations(system):
        for event in system.event_names:
            a, b = pair(engine, ref, 5, config)
            assert outcome(engine.fire, a, event) == outcome(ref.fire, b, event), (config, event)
            assert values(system, a) == values(system, b), (config, event)
            checked += 1
    return checked


@pytest.mark.parametrize("name", ["host_residency", "device_residency", "residency"])
def test_shipped_specs_agree_exhaustively(name: str) -> None:
    assert agree_everywhere(load_shipped(name)) > 50


def test_a_user_spec_agrees_exhaustively() -> None:
    spec = spec_from_dict(COUNTERS)
    assert isinstance(spec, MachineSpec)
    # per value of b: idle takes a = 0, busy a >= 1, done any a; four events each
    assert agree_everywhere(spec) == (1 + bound(spec) + bound(spec) + 1) * (bound(spec) + 1) * 4


def test_a_user_spec_agrees_with_effects_and_failures() -> None:
    calls: dict[str, list[str]] = {"engine": [], "reference": []}

    def effects(log: list[str]) -> dict[str, Callable[[Any], None]]:
        def note(rec: Any) -> None:
            log.append(f"note {rec.a}")

        def archive(rec: Any) -> None:
            raise ValueError(f"no archive for {rec.id}")

        return {"note": note, "archive": archive}

    spec = spec_from_dict(COUNTERS)
    engine = Engine(spec, effects=effects(calls["engine"]), trail=False)
    ref = Reference(spec, effects=effects(calls["reference"]))
    for config in configurations(as_system(spec)):
        for event in ("stop", "finish"):
            a, b = pair(engine, ref, 1, config)
            assert outcome(engine.fire, a, event) == outcome(ref.fire, b, event)
            assert values(as_system(spec), a) == values(as_system(spec), b)
    assert calls["engine"] == calls["reference"] != []
    a, b = pair(engine, ref, 1, {"state": "idle", "a": 0, "b": 0})
    assert outcome(engine.fire, a, "finish") == (
        EffectFailed,
        "job 1: effect archive of finish failed: no archive for 1",
    )
    assert outcome(ref.fire, b, "finish") == outcome(engine.fire, a, "finish")


def test_a_user_composition_agrees_exhaustively(plant: System) -> None:
    # valve: shut at flow 0, open at flow 0..4; lamp: off at lux 0, on at lux 1..6; 7 events
    configs = (1 + 5) * (1 + 6)
    assert agree_everywhere(plant, effects={"valve_sync": lambda rec: None}) == configs * 7


def test_the_reference_is_built_on_transitions(plant: System) -> None:
    ref = Reference(plant)
    assert set(ref.machines) == {"valve", "lamp"}
    assert all(isinstance(m, Machine) and not m.auto_transitions for m in ref.machines.values())
    rec = ref.new(1)
    assert values(plant, rec) == ("shut", "off", 0, 0)
    assert ref.allowed(rec, "on")
    assert not ref.allowed(rec, "open")


# -- trees: parent and children conditions, propagation to ancestors -----------


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_plant_runs_agree(plant: System, data: st.DataObject) -> None:
    run_both(plant, data.draw(step_lists(plant)), effects={"valve_sync": lambda rec: None})
