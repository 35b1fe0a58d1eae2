"""Validation rules: names, determinism, totality, safety, reachability, compositions."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsm_cache.errors import SpecError
from fsm_cache.spec import reach
from fsm_cache.spec import validate as validate_module
from fsm_cache.spec.guards import Assign, Comparison, Guard, Update, parse_guard, parse_update
from fsm_cache.spec.loader import load_spec, machine_from_dict
from fsm_cache.spec.machine import (
    Birth,
    Forbid,
    MachineSpec,
    Spec,
    StateSpec,
    System,
    Transition,
    as_system,
    compared,
)
from fsm_cache.spec.shipped import load_shipped, shipped_spec_paths
from fsm_cache.spec.validate import bound, problems, representatives, validate, valuations


if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


# A valid counter machine; each test breaks one rule by adding or replacing a line.
HEAD = """
[machine]
name = "gate"
initial = "closed"

[counters]
n = 0

[states]
closed = { invariant = "n == 0" }
open = { invariant = "n >= 1" }
"""
OPEN = """
[[transition]]
event = "enter"
source = ["closed", "open"]
dest = "open"
update = "n += 1"
"""
LEAVE = """
[[transition]]
event = "leave"
source = "open"
dest = "closed"
guard = "n == 1"
update = "n -= 1"

[[transition]]
event = "leave"
source = "open"
dest = "open"
guard = "n >= 2"
update = "n -= 1"
"""
REFUSE = """
[[forbid]]
event = "leave"
source = "closed"
error = "Empty"
reason = "nobody inside"
"""
GATE = HEAD + OPEN + LEAVE + REFUSE


def found(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "gate.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    prefix = f"{path}: "
    assert all(line.startswith(prefix) for line in info.value.problems)
    return [line.removeprefix(prefix) for line in info.value.problems]


def test_the_base_machine_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "gate.toml"
    path.write_text(GATE, encoding="utf-8")
    assert problems(load_spec(path)) == []


def test_unknown_and_missing_names(tmp_path: Path) -> None:
    text = GATE.replace('initial = "closed"', 'initial = "shut"')
    text = text.replace(
        'open = { invariant = "n >= 1" }', 'open = { invariant = "m >= 1", counter = "k" }'
    )
    text = text.replace('dest = "closed"', 'dest = "close"')
    text = text.replace('guard = "n >= 2"', 'guard = "n >= 2 and z < 1"')
    text = text.replace('source = "closed"', 'source = ["closed", "ajar"]')
    text = text.replace('error = "Empty"', 'error = "empty"')
    text += '\n[[forbid]]\nevent = "enter"\nsource = "open"\nguard = "q == 9"\nerror = "Full"\nreason = "r"\n'
    text += '\n[events]\nenter = {}\nleave = {}\nexit = { doc = "never used" }\n'
    assert found(tmp_path, text) == [
        "machine.initial: unknown state 'shut'",
        "states.open.invariant: unknown counter 'm'",
        "states.open.counter: unknown counter 'k'",
        "transition[1].dest: unknown state 'close'",
        "transition[2].guard: unknown counter 'z'",
        "forbid[0].source: unknown state 'ajar'",
        "forbid[0].error: error class names are CapitalisedIdentifiers, got 'empty'",
        "forbid[1].guard: unknown counter 'q'",
        "events.exit: declared but no transition or forbid uses it",
    ]


def test_an_unknown_counter_is_located_in_the_guard_or_the_update(tmp_path: Path) -> None:
    text = GATE.replace('update = "n += 1"', 'update = "m += 1"')
    text = text.replace('guard = "n >= 2"', 'guard = "n >= 2 and z < 1"')
    text = text.replace(
        'guard = "n == 1"\nupdate = "n -= 1"', 'guard = "y == 1"\nupdate = "y -= 1"'
    )
    assert found(tmp_path, text) == [
        "transition[0].update: unknown counter 'm'",
        "transition[1].guard: unknown counter 'y'",
        "transition[1].update: unknown counter 'y'",
        "transition[2].guard: unknown counter 'z'",
    ]


def test_an_events_table_is_the_closed_list_of_events(tmp_path: Path) -> None:
    text = GATE + "\n[events]\nenter = {}\nleave = {}\n"
    text += '\n[[forbid]]\nevent = "frobnicate"\nsource = "open"\nerror = "E"\nreason = "r"\n'
    text = text.replace('event = "enter"', 'event = "entre"')
    assert found(tmp_path, text) == [
        "transition[0].event: unknown event 'entre' (declared in [events]: enter, leave)",
        "forbid[1].event: unknown event 'frobnicate' (declared in [events]: enter, leave)",
        "events.enter: declared but no transition or forbid uses it",
    ]


def test_machine_forbids_need_sources_and_no_conditions(tmp_path: Path) -> None:
    text = (
        GATE
        + '\n[[forbid]]\nevent = "leave"\nwhen = "gate in [closed]"\nerror = "E"\nreason = "r"\n'
    )
    assert found(tmp_path, text) == [
        "forbid[1].when: a machine file cannot use conditions; use a composition",
        "forbid[1].source: a machine's forbid must name its states",
    ]


@pytest.mark.parametrize(
    "name", ["id", "trail", "parent", "children", "state", "rec", "result", "error"]
)
def test_counters_may_not_shadow_record_attributes(tmp_path: Path, name: str) -> None:
    text = GATE.replace("n = 0", f"n = 0\n{name} = 0")
    assert found(tmp_path, text) == [
        f"counters.{name}: {name!r} is reserved (a record attribute or a name of the generated code)"
    ]


@pytest.mark.parametrize("name", ["class", "if", "None"])
def test_counters_may_not_be_keywords(tmp_path: Path, name: str) -> None:
    text = GATE.replace("n = 0", f"n = 0\n{name} = 0")
    assert found(tmp_path, text) == [f"counters.{name}: {name!r} is a Python keyword"]


def test_overlapping_guards_are_non_deterministic(tmp_path: Path) -> None:
    text = GATE.replace('guard = "n >= 2"', 'guard = "n >= 1"')
    assert found(tmp_path, text) == [
        "transition[2].guard: overlaps transition[1] on leave in open when n=1 (non-deterministic)",
        "transition[2].update: breaks the invariant of open (n >= 1) from open when n=1",
    ]


def test_a_forbid_overlapping_a_transition(tmp_path: Path) -> None:
    text = (
        GATE
        + '\n[[forbid]]\nevent = "leave"\nsource = "open"\nguard = "n >= 5"\nerror = "Crowd"\nreason = "r"\n'
    )
    assert found(tmp_path, text) == ["forbid[1]: overlaps transition[2] on leave in open when n=5"]


def test_gaps_are_not_total(tmp_path: Path) -> None:
    assert found(tmp_path, HEAD + OPEN + LEAVE) == [
        "states.closed: event 'leave' is neither a transition nor a forbid when n=0 (not total)"
    ]
    text = GATE.replace('guard = "n >= 2"', 'guard = "n >= 3"')
    assert found(tmp_path, text) == [
        "states.open: event 'leave' is neither a transition nor a forbid when n=2 (not total)"
    ]


TOOL = """
[machine]
name = "tool"
initial = "idle"
[counters]
uses = 0
pins = 0
[states]
idle = { invariant = "pins == 0" }
busy = { invariant = "pins >= 1" }
worn = { invariant = "uses >= 1", final = true }
[[transition]]
event = "take"
source = ["idle", "busy"]
dest = "busy"
update = "pins += 1, uses += 1"
[[transition]]
event = "give"
source = "busy"
dest = "idle"
guard = "pins == 1"
update = "pins -= 1"
[[transition]]
event = "give"
source = "busy"
dest = "busy"
guard = "pins >= 2"
update = "pins -= 1"
[[forbid]]
event = "give"
source = "idle"
error = "NotTaken"
reason = "nobody holds it"
[[transition]]
event = "retire"
source = "busy"
dest = "worn"
guard = "uses >= 3 and pins == 1"
update = "pins -= 1"
"""
"""A tool whose ``retire`` idle does not answer whatever the counters, busy only below 3 uses."""


def test_a_gap_that_holds_for_every_value_of_a_counter_says_so(tmp_path: Path) -> None:
    """It said ``when uses=0``, a condition the gap does not have; a value pinned stays."""
    assert found(tmp_path, TOOL)[:2] == [
        "states.idle: event 'retire' is neither a transition nor a forbid "
        "when pins=0, for every value of uses (not total)",
        "states.busy: event 'retire' is neither a transition nor a forbid when uses=0, pins=1 (not total)",
    ]
    text = TOOL.replace('guard = "uses >= 3 and pins == 1"', 'guard = "pins == 1"')
    text = text.replace('idle = { invariant = "pins == 0" }', "idle = {}")
    assert found(tmp_path, text)[:1] == [
        "states.idle: event 'retire' is neither a transition nor a forbid "
        "for every value of uses and pins (not total)",
    ]


def test_gaps_without_counters_say_always(tmp_path: Path) -> None:
    text = """
[machine]
name = "flip"
initial = "a"
[states]
a = {}
b = {}
[[transition]]
event = "flip"
source = "a"
dest = "b"
[[transition]]
event = "flop"
source = "b"
dest = "a"
[[forbid]]
event = "flip"
source = "b"
error = "E"
reason = "r"
"""
    assert found(tmp_path, text) == [
        "states.a: event 'flop' is neither a transition nor a forbid (not total)"
    ]


def test_updates_that_go_negative_or_break_the_destination_invariant(tmp_path: Path) -> None:
    text = GATE.replace(
        'guard = "n == 1"\nupdate = "n -= 1"', 'guard = "n == 1"\nupdate = "n -= 2"'
    )
    text = text.replace('guard = "n >= 2"\nupdate = "n -= 1"', 'guard = "n >= 2"\nupdate = "n = 0"')
    assert found(tmp_path, text) == [
        "transition[1].update: drives n negative from open when n=1",
        "transition[2].update: breaks the invariant of open (n >= 1) from open when n=2",
    ]


def test_unreachable_states_and_dead_ends(tmp_path: Path) -> None:
    text = (
        HEAD
        + 'stuck = { invariant = "n == 0" }\nlimbo = { final = true }\n'
        + OPEN
        + LEAVE
        + REFUSE
    )
    text += '\n[[forbid]]\nevent = "enter"\nsource = ["stuck"]\nerror = "E"\nreason = "r"\n'
    text += '\n[[forbid]]\nevent = "leave"\nsource = ["stuck"]\nerror = "E"\nreason = "r"\n'
    assert found(tmp_path, text) == [
        "states.stuck: unreachable from closed",
        "states.stuck: not final and has no transition out",
        "states.limbo: unreachable from closed",
    ]


def test_a_transition_whose_guard_never_holds_reaches_nothing(tmp_path: Path) -> None:
    text = HEAD.replace('open = { invariant = "n >= 1" }', "open = {}") + OPEN.replace(
        'source = ["closed", "open"]', 'source = ["closed", "open"]\nguard = "n >= 9"'
    )
    text += '\n[[forbid]]\nevent = "enter"\nsource = ["closed", "open"]\nguard = "n <= 8"\nerror = "E"\nreason = "r"\n'
    assert found(tmp_path, text) == [
        "states.closed: not final and has no way out: no transition out has a guard that can hold there (invariant n == 0)",
        "states.open: unreachable from closed",
        "states.open: not final and has no transition out (each of its transitions leads back to it)",
    ]


# A state entered from closed whose one way out needs n >= 1 where its invariant says n == 0.
JAM = """
[[transition]]
event = "jam"
source = "closed"
dest = "jammed"

[[forbid]]
event = "jam"
source = ["open", "jammed"]
error = "E"
reason = "r"

[[transition]]
event = "unjam"
source = "jammed"
dest = "closed"
guard = "n >= 1"
update = "n = 0"

[[forbid]]
event = "unjam"
source = "jammed"
guard = "n == 0"
error = "Stuck"
reason = "r"

[[forbid]]
event = "unjam"
source = ["closed", "open"]
error = "E"
reason = "r"

[[forbid]]
event = "enter"
source = "jammed"
error = "E"
reason = "r"

[[forbid]]
event = "leave"
source = "jammed"
error = "E"
reason = "r"
"""


def test_a_state_whose_only_exit_never_fires_has_no_way_out(tmp_path: Path) -> None:
    text = HEAD + 'jammed = { invariant = "n == 0" }\n' + OPEN + LEAVE + REFUSE + JAM
    assert found(tmp_path, text) == [
        "states.jammed: not final and has no way out: no transition out has a guard that can hold there (invariant n == 0)",
        "transition[4].guard: never holds in jammed (invariant n == 0): the transition can never fire",
    ]


def test_a_transition_that_never_fires_is_a_fault(tmp_path: Path) -> None:
    shut = (
        '\n[[transition]]\nevent = "shut"\nsource = "open"\ndest = "closed"\nguard = "n == 0"\n'
        '\n[[forbid]]\nevent = "shut"\nsource = "open"\nguard = "n >= 1"\nerror = "E"\nreason = "r"\n'
        '\n[[forbid]]\nevent = "shut"\nsource = "closed"\nerror = "E"\nreason = "r"\n'
    )
    assert found(tmp_path, GATE + shut) == [
        "transition[3].guard: never holds in open (invariant n >= 1): the transition can never fire"
    ]


def test_a_guard_may_choose_among_a_transitions_sources(tmp_path: Path) -> None:
    # reset's guard holds in closed only; open, where it never holds, refuses it.
    reset = (
        '\n[[transition]]\nevent = "reset"\nsource = ["closed", "open"]\ndest = "closed"\nguard = "n == 0"\n'
        '\n[[forbid]]\nevent = "reset"\nsource = "open"\nerror = "E"\nreason = "r"\n'
    )
    (tmp_path / "gate.toml").write_text(GATE + reset, encoding="utf-8")
    assert problems(load_spec(tmp_path / "gate.toml")) == []
    dead = reset.replace("n == 0", "n < 0").replace(
        'source = "open"', 'source = ["closed", "open"]'
    )
    assert found(tmp_path, GATE + dead) == [
        "transition[3].guard: never holds in closed (invariant n == 0) nor in open (invariant n >= 1): the transition can never fire"
    ]


def test_a_state_reached_only_where_its_exit_is_shut_is_a_deadlock(tmp_path: Path) -> None:
    # jammed has no invariant, so unjam's guard can hold there; but jam enters it with n == 0.
    text = HEAD + "jammed = {}\n" + OPEN + LEAVE + REFUSE + JAM
    assert found(tmp_path, text) == [
        "states.jammed: deadlock when n=0: every event is refused there (enter: E, leave: E, jam: E, unjam: Stuck) and it is not final; reached from closed by jam"
    ]
    (tmp_path / "gate.toml").write_text(text.replace("jammed = {}", "jammed = { final = true }"))
    assert problems(load_spec(tmp_path / "gate.toml")) == []


def test_a_state_no_run_reaches_with_the_counters_its_way_in_needs(tmp_path: Path) -> None:
    # jam needs n >= 5 and closed allows it (no invariant), but no run leaves n above 0 there.
    text = HEAD.replace('closed = { invariant = "n == 0" }', "closed = {}") + "jammed = {}\n"
    text += (
        OPEN
        + LEAVE
        + JAM.replace(
            'source = "closed"\ndest = "jammed"',
            'source = "closed"\ndest = "jammed"\nguard = "n >= 5"',
        )
    )
    text += '\n[[forbid]]\nevent = "leave"\nsource = "closed"\nerror = "E"\nreason = "r"\n'
    text += '\n[[forbid]]\nevent = "jam"\nsource = "closed"\nguard = "n <= 4"\nerror = "E"\nreason = "r"\n'
    assert found(tmp_path, text) == [
        "states.jammed: unreachable from closed (every way in needs counters no run from closed has)"
    ]


def test_every_shipped_spec_validates() -> None:
    paths = shipped_spec_paths()
    assert [p.name for p in paths] == [
        "device_residency.toml",
        "host_residency.toml",
        "host_storage_residency.toml",
        "residency.toml",
        "residency_storage.toml",
        "storage_residency.toml",
    ]
    for path in paths:
        assert problems(load_spec(path)) == []


def test_valuations_are_the_exact_representatives() -> None:
    host = load_shipped("host_residency")
    assert isinstance(host, MachineSpec)
    assert bound(host) == 5  # largest constant 2, largest step 1, plus 2
    # Constants 0, 1, 2 and steps +1, -1: critical points c - d are 0..3, plus one past each.
    assert representatives(host) == {"pins": (0, 1, 2, 3, 4)}
    pinned = host.state("pinned").invariant
    assert list(valuations(host, pinned)) == [{"pins": v} for v in range(1, 5)]
    assert list(valuations(host, parse_guard("pins == 0"))) == [{"pins": 0}]
    # The constants of the invariant asked about count too.
    assert list(valuations(host, parse_guard("pins >= 7"))) == [{"pins": v} for v in (7, 8, 9)]


def test_caps_and_representatives_read_one_list_of_constants() -> None:
    """The search's caps and validation's representatives start from :func:`compared`."""
    host = MachineSpec(
        "m",
        "a",
        (("n", 0), ("k", 3)),
        (StateSpec("a", invariant=parse_guard("n <= 6")),),
        (Transition("go", ("a",), "a", guard=parse_guard("n < 2 and k >= 5 and x == 99")),),
        (Forbid("go", ("a",), "E", "r", guard=parse_guard("n >= 2")),),
    )
    extra = parse_guard("n == 9")
    # Invariants, then transition guards, then forbid guards, then extra; x is no counter.
    assert compared([host], extra) == {"n": [6, 2, 2, 9], "k": [5]}
    assert representatives(host, extra) == {"n": (0, 1, 2, 3, 6, 7, 9, 10), "k": (0, 1, 5, 6)}
    # A composition's own refusals count for its caps; an initial value above every
    # constant sets the cap (k starts at 3, compared with 5: cap 6).
    system = System("s", (("r", host),), forbids=(Forbid("go", (), "E", "r", guard=extra),))
    assert reach.ceilings(system) == {"n": 10, "k": 6}


def test_a_spec_built_with_lists_is_searched_too() -> None:
    """A list where a tuple belongs makes a spec unhashable; its runs are searched all the same."""
    text = HEAD + "jammed = {}\n" + OPEN + LEAVE + REFUSE + JAM
    spec = machine_from_dict(tomllib.loads(text))
    listed = dataclasses.replace(spec, states=cast("tuple[StateSpec, ...]", list(spec.states)))
    with pytest.raises(TypeError):
        hash(listed)
    assert problems(listed) == [
        "<python>: states.jammed: deadlock when n=0: every event is refused there (enter: E, leave: E, jam: E, unjam: Stuck) and it is not final; reached from closed by jam"
    ]


def test_composition_rules(tmp_path: Path) -> None:
    path = tmp_path / "gate.toml"
    path.write_text(GATE, encoding="utf-8")
    (tmp_path / "door.toml").write_text(GATE.replace('"gate"', '"door"'), encoding="utf-8")
    text = """
[composition]
name = "hall"
[composition.regions]
gate = "gate.toml"
door = "door.toml"
[[forbid]]
event = "knock"
error = "E"
reason = "r"
[[forbid]]
event = "enter"
source = ["ajar", "open"]
guard = "k >= 1"
when = ["any child hall in [open]", "gate in [shut]"]
error = "lowercase"
reason = "r"
"""
    comp = tmp_path / "hall.toml"
    comp.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(comp)
    assert info.value.problems == [
        f"{comp}: composition.regions.door: counter 'n' also in region 'gate'",
        f"{comp}: forbid[0].event: no region declares 'knock'",
        f"{comp}: forbid[1].guard: unknown counter 'k'",
        f"{comp}: forbid[1].error: error class names are CapitalisedIdentifiers, got 'lowercase'",
        f"{comp}: forbid[1].source: unknown state 'ajar' of region 'gate'",
        f"{comp}: forbid[1].when: unknown region 'hall'",
        f"{comp}: forbid[1].when: unknown state 'shut' of gate",
    ]


def test_composition_region_names_must_be_usable_attributes() -> None:
    gate = MachineSpec("g", "a", (("n", 0),), (StateSpec("a", final=True),), (), source="g.toml")
    for region in ("trail", "n", "class", "a-b"):
        system = System("s", ((region, gate),), source="s.toml")
        assert problems(system) == [
            f"s.toml: composition.regions.{region}: not a usable region name (an identifier that is no keyword, record attribute or counter)"
        ]


def test_names_of_a_spec_built_in_code_are_spelled_as_in_a_file() -> None:
    states = (StateSpec("a"), StateSpec("done", final=True))
    moves = (
        Transition("pin\n", ("a",), "done"),
        Transition("finish", ("a",), "done", effect="__init__"),
    )
    spec = MachineSpec("m", "a", (("class", 0),), states, moves, source="<python>")
    assert problems(spec) == [
        "<python>: counters[0]: 'class': 'class' is a Python keyword",
        "<python>: transition[0].event: 'pin\\n': not an identifier",
        "<python>: transition[1].effect: '__init__': not an identifier",
    ]
    gate = MachineSpec("g", "a", (), (StateSpec("a", final=True),), (), source="g.toml")
    born = System("s", (("g", gate),), births=(Birth("new born", (("g", "a"),)),), source="s.toml")
    assert problems(born) == ["s.toml: composition.births[0]: 'new born': not an identifier"]


def test_a_birth_declared_twice_is_reported_once() -> None:
    """Each of the two was reported: the same line twice."""
    states = (StateSpec("a"), StateSpec("b", final=True))
    gate = MachineSpec("g", "a", (), states, (Transition("go", ("a",), "b"),), source="g.toml")
    twice = (Birth("x", (("g", "b"),)), Birth("x", (("g", "b"),)))
    born = System("s", (("g", gate),), births=twice, source="s.toml")
    assert problems(born) == ["s.toml: composition.births.x: declared twice"]


def test_a_state_declared_twice_is_named() -> None:
    states = (StateSpec("a", final=True), StateSpec("b", final=True), StateSpec("a"))
    spec = MachineSpec("m", "a", (), states, (), source="m.toml")
    assert problems(spec)[0] == (
        "m.toml: states.a: declared twice (a spec that extends another may not redeclare its states)"
    )


def test_region_problems_keep_their_own_file() -> None:
    broken = MachineSpec("g", "nowhere", (), (StateSpec("a", final=True),), (), source="g.toml")
    with pytest.raises(SpecError) as info:
        validate(System("s", (("g", broken),), source="s.toml"))
    assert info.value.problems == ["g.toml: machine.initial: unknown state 'nowhere'"]


def test_a_final_state_needs_no_exit_and_no_coverage() -> None:
    states = (StateSpec("a"), StateSpec("done", final=True))
    spec = MachineSpec("m", "a", (), states, (Transition("finish", ("a",), "done"),))
    assert problems(spec) == []
    assert list(itertools.islice(valuations(spec, parse_guard("")), 3)) == [{}]


def test_big_constants_cost_a_few_representatives(tmp_path: Path) -> None:
    text = GATE.replace("n = 0", "n = 0\ntokens = 0").replace(
        'guard = "n == 1"', 'guard = "n == 1 and tokens <= 4096"'
    )
    text += '\n[[forbid]]\nevent = "leave"\nsource = "open"\nguard = "n == 1 and tokens > 4096"\nerror = "Full"\nreason = "r"\n'
    path = tmp_path / "gate.toml"
    path.write_text(text, encoding="utf-8")
    spec = load_spec(path)
    assert isinstance(spec, MachineSpec)
    assert representatives(spec) == {"n": (0, 1, 2, 3, 4), "tokens": (0, 1, 4096, 4097)}


def test_a_fault_at_a_big_constant_is_found_exactly(tmp_path: Path) -> None:
    huge = 99999999999999999999
    text = GATE.replace("n = 0", "n = 0\ntokens = 0").replace(
        'guard = "n >= 2"', f'guard = "n >= 2 and n <= {huge}"'
    )
    text += f'\n[[transition]]\nevent = "leave"\nsource = "open"\ndest = "open"\nguard = "n >= {huge}"\nupdate = "n -= 1"\n'
    text += '\n[[transition]]\nevent = "spend"\nsource = "open"\ndest = "open"\nguard = "tokens >= 4095"\nupdate = "tokens -= 5000"\n'
    text += '\n[[forbid]]\nevent = "spend"\nsource = ["closed", "open"]\nguard = "tokens <= 4094"\nerror = "Broke"\nreason = "r"\n'
    text += '\n[[forbid]]\nevent = "spend"\nsource = ["closed"]\nguard = "tokens >= 4095"\nerror = "Shut"\nreason = "r"\n'
    assert found(tmp_path, text) == [
        f"transition[3].guard: overlaps transition[2] on leave in open when n={huge}, tokens=0 (non-deterministic)",
        "transition[4].update: drives tokens negative from open when n=1, tokens=4095",
    ]


def test_forbids_that_overlap_are_an_ambiguous_refusal(tmp_path: Path) -> None:
    text = (
        GATE
        + '\n[[forbid]]\nevent = "leave"\nsource = ["closed"]\nguard = "n <= 5"\nerror = "Shut"\nreason = "r"\n'
    )
    assert found(tmp_path, text) == [
        "forbid[1]: overlaps forbid[0] on leave in closed when n=0 (ambiguous refusal)"
    ]


def test_initial_counters_must_satisfy_the_initial_invariant(tmp_path: Path) -> None:
    text = GATE.replace("n = 0", "n = 2")
    assert found(tmp_path, text) == [
        "counters.n: initial value 2 breaks the invariant of the initial state closed (n == 0)"
    ]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (
            "SpecError",
            "'SpecError' is fsm_cache's own SpecError, not a refusal; choose another name",
        ),
        (
            "LeaseError",
            "'LeaseError' is fsm_cache's own LeaseError, not a refusal; choose another name",
        ),
        ("ValueError", "'ValueError' is a Python builtin, not a refusal; choose another name"),
        ("Exception", "'Exception' is a Python builtin, not a refusal; choose another name"),
        ("True", "'True' is a Python keyword"),
    ],
)
def test_error_names_may_not_clash_with_other_classes(
    tmp_path: Path, name: str, problem: str
) -> None:
    text = GATE.replace('error = "Empty"', f'error = "{name}"')
    assert found(tmp_path, text) == [f"forbid[0].error: {problem}"]


def test_refusals_fsm_cache_predefines_are_welcome(tmp_path: Path) -> None:
    for name in ("IllegalTransition", "ReleaseAtZero"):
        path = tmp_path / "gate.toml"
        path.write_text(GATE.replace('error = "Empty"', f'error = "{name}"'), encoding="utf-8")
        assert problems(load_spec(path)) == []


def _dense(spec: MachineSpec, invariant: Guard) -> Iterator[dict[str, int]]:
    """Every valuation from 0 to ``bound``: the exhaustive search representatives replace."""
    names = spec.counter_names
    for values in itertools.product(range(bound(spec) + 1), repeat=len(names)):
        counters = dict(zip(names, values, strict=True))
        if invariant.holds(counters):
            yield counters


_OPS = st.sampled_from(["==", "!=", "<", "<=", ">", ">="])
_GUARDS = st.lists(
    st.builds(Comparison, st.sampled_from(["a", "b"]), _OPS, st.integers(-1, 6)), max_size=2
).map(lambda terms: Guard(tuple(terms)))
_UPDATES = st.lists(
    st.builds(
        Assign, st.sampled_from(["a", "b"]), st.sampled_from(["+=", "-=", "="]), st.integers(0, 4)
    ),
    max_size=2,
    unique_by=lambda a: a.counter,
).map(lambda assigns: Update(tuple(assigns)))
_STATES = st.sampled_from(["p", "q", "r"])


@st.composite
def _machines(draw: st.DrawFn) -> MachineSpec:
    states = tuple(StateSpec(n, invariant=draw(_GUARDS), final=draw(st.booleans())) for n in "pqr")
    transitions = draw(
        st.lists(
            st.builds(
                Transition,
                st.sampled_from(["x", "y"]),
                st.tuples(_STATES),
                _STATES,
                _GUARDS,
                _UPDATES,
            ),
            min_size=1,
            max_size=4,
        )
    )
    forbids = draw(
        st.lists(
            st.builds(
                Forbid,
                st.sampled_from(["x", "y"]),
                st.tuples(_STATES),
                st.just("E"),
                st.just("r"),
                _GUARDS,
            ),
            max_size=3,
        )
    )
    return MachineSpec("m", "p", (("a", 0), ("b", 0)), states, tuple(transitions), tuple(forbids))


def _step(update: str, dest_invariant: str, guard: str = "") -> MachineSpec:
    """A machine whose one step from ``p`` can break ``q``'s invariant."""
    states = (StateSpec("p"), StateSpec("q", invariant=parse_guard(dest_invariant), final=True))
    step = Transition("x", ("p",), "q", parse_guard(guard), parse_update(update))
    return MachineSpec("m", "p", (("a", 0), ("b", 0)), states, (step,))


@settings(max_examples=200, deadline=None)
@given(_machines())
# Faults found only through a critical point c - d: a += 2 breaks a <= 4 first at a = 3
# (point 4 - 2 = 2, plus one); a -= 2 breaks a != 5 only at a = 7 (point 5 + 2).
@example(_step("a += 2", "a <= 4"))
@example(_step("a -= 2", "a != 5", guard="a >= 2"))
def test_representatives_find_what_an_exhaustive_search_finds(spec: MachineSpec) -> None:
    exact = problems(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validate_module, "valuations", _dense)
        assert exact == problems(spec)


def test_the_examples_above_are_faults() -> None:
    assert problems(_step("a += 2", "a <= 4")) == [
        "<python>: transition[0].update: breaks the invariant of q (a <= 4) from p when a=3, b=0"
    ]
    assert problems(_step("a -= 2", "a != 5", guard="a >= 2")) == [
        "<python>: states.p: event 'x' is neither a transition nor a forbid when a=0, for every value of b (not total)",
        "<python>: transition[0].update: breaks the invariant of q (a != 5) from p when a=7, b=0",
    ]


def _two_states(name: str, a: str, b: str, there: str, back: str) -> str:
    """A machine of two states without counters: ``there`` goes a to b, ``back`` b to a."""
    return f"""
[machine]
name = "{name}"
initial = "{a}"
[states]
{a} = {{}}
{b} = {{}}
[[transition]]
event = "{there}"
source = "{a}"
dest = "{b}"
[[forbid]]
event = "{there}"
source = "{b}"
error = "Already{b.capitalize()}"
reason = "r"
[[transition]]
event = "{back}"
source = "{b}"
dest = "{a}"
[[forbid]]
event = "{back}"
source = "{a}"
error = "Already{a.capitalize()}"
reason = "r"
"""


HOUSE = """
[composition]
name = "house"
[composition.regions]
door = "door.toml"
bolt = "bolt.toml"
[[forbid]]
event = "lock"
when = "door in [open]"
error = "DoorOpen"
reason = "r"
[[forbid]]
event = "open_door"
when = "bolt in [locked]"
error = "Bolted"
reason = "r"
"""


def _house(tmp_path: Path, rules: str) -> Path:
    (tmp_path / "door.toml").write_text(
        _two_states("door", "closed", "open", "open_door", "close_door"), encoding="utf-8"
    )
    (tmp_path / "bolt.toml").write_text(
        _two_states("bolt", "unlocked", "locked", "lock", "unlock"), encoding="utf-8"
    )
    path = tmp_path / "house.toml"
    path.write_text(HOUSE + rules, encoding="utf-8")
    return path


def test_a_composed_record_that_refuses_every_event_is_a_deadlock(tmp_path: Path) -> None:
    assert problems(load_spec(_house(tmp_path, ""))) == []
    rule = '[[forbid]]\nevent = "unlock"\nwhen = "door in [closed]"\nerror = "NoKeyhole"\nreason = "r"\n'
    path = _house(tmp_path, rule)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems == [
        f"{path}: composition: deadlock at door closed, bolt locked: every event is refused there (open_door: Bolted, close_door: AlreadyClosed, lock: AlreadyLocked, unlock: NoKeyhole) and no region is final; reached from the initial states by lock"
    ]


def test_a_region_state_the_composition_never_reaches(tmp_path: Path) -> None:
    rules = '[[forbid]]\nevent = "open_door"\nwhen = "bolt in [unlocked]"\nerror = "Jammed"\nreason = "r"\n'
    path = _house(tmp_path, rules)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems == [
        f"{path}: composition.regions.door: state open: unreachable in the composition (no run from a birth reaches it)"
    ]


def test_a_birth_is_where_a_run_may_start(tmp_path: Path) -> None:
    # Born open, the door is no longer unreachable; born locked and closed, the record is stuck.
    rules = '[[forbid]]\nevent = "open_door"\nwhen = "bolt in [unlocked]"\nerror = "Jammed"\nreason = "r"\n'
    ajar = '[composition.births.ajar]\nstates = { door = "open" }\n'
    assert problems(load_spec(_house(tmp_path, ajar + rules))) == []
    shut = '[composition.births.shut]\nstates = { bolt = "locked" }\n'
    rule = '[[forbid]]\nevent = "unlock"\nwhen = "door in [closed]"\nerror = "NoKeyhole"\nreason = "r"\n'
    path = _house(tmp_path, shut + rule)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems[0].endswith(
        "and no region is final; a record is born there (birth shut)"
    )


def test_tree_rules_are_read_for_a_record_without_neighbours(tmp_path: Path) -> None:
    # A parent waiting on its child and a child on its parent is a tree's deadlock, not a
    # record's: alone, neither rule refuses, and fsm-cache check is what explores trees.
    rules = (
        '[[forbid]]\nevent = "unlock"\nwhen = "any child door in [closed]"\nerror = "E"\nreason = "r"\n'
        '[[forbid]]\nevent = "unlock"\nwhen = "parent door in [closed]"\nerror = "E"\nreason = "r"\n'
    )
    assert problems(load_spec(_house(tmp_path, rules))) == []


def test_a_final_region_ends_the_record(tmp_path: Path) -> None:
    rule = '[[forbid]]\nevent = "unlock"\nwhen = "door in [closed]"\nerror = "NoKeyhole"\nreason = "r"\n'
    path = _house(tmp_path, rule)
    bolt = (tmp_path / "bolt.toml").read_text(encoding="utf-8")
    (tmp_path / "bolt.toml").write_text(
        bolt.replace("locked = {}", "locked = { final = true }")
        .replace(
            'event = "unlock"\nsource = "locked"\ndest = "unlocked"',
            'event = "unlock"\nsource = "unlocked"\ndest = "unlocked"',
        )
        .replace(
            '[[forbid]]\nevent = "unlock"\nsource = "unlocked"\nerror = "AlreadyUnlocked"\nreason = "r"\n',
            "",
        ),
        encoding="utf-8",
    )
    assert problems(load_spec(path)) == []


def test_a_search_past_the_record_limit_claims_no_unreachable_state(tmp_path: Path) -> None:
    # far is reached after a million climbs: past the limit, so it is not called unreachable.
    text = """
[machine]
name = "climb"
initial = "near"
[counters]
n = 0
[states]
near = {}
far = {}
[[transition]]
event = "climb"
source = "near"
dest = "near"
update = "n += 1"
[[transition]]
event = "arrive"
source = "near"
dest = "far"
guard = "n >= 1000000"
[[forbid]]
event = "arrive"
source = "near"
guard = "n < 1000000"
error = "E"
reason = "r"
[[transition]]
event = "back"
source = "far"
dest = "near"
update = "n = 0"
[[forbid]]
event = "back"
source = "near"
error = "E"
reason = "r"
[[forbid]]
event = "climb"
source = "far"
error = "E"
reason = "r"
[[forbid]]
event = "arrive"
source = "far"
error = "E"
reason = "r"
"""
    path = tmp_path / "climb.toml"
    path.write_text(text, encoding="utf-8")
    assert problems(load_spec(path)) == []
    assert reach.RECORD_LIMIT == 10_000


# A buffer filled (FILL, when GUARD holds) and drained; a few records, however large its counts.
BUFFER = """
[machine]
name = "buf"
initial = "empty"
[counters]
bytes = START
[states]
empty = {}
full = {}
[[transition]]
event = "fill"
source = "empty"
dest = "full"
guard = "GUARD"
update = "FILL"
[[transition]]
event = "drain"
source = "full"
dest = "empty"
guard = "EMPTIES"
update = "DRAIN"
[[forbid]]
event = "fill"
source = "full"
error = "AlreadyFull"
reason = "full"
[[forbid]]
event = "drain"
source = "empty"
error = "AlreadyEmpty"
reason = "empty"
"""


def _buffer(
    tmp_path: Path,
    start: int,
    fill: str,
    drain: str = "bytes = 0",
    *,
    guard: str = "",
    drains: str = "",
) -> Spec:
    """Return :data:`BUFFER`, each guard given with a forbid where it fails (``a < c``: ``a >= c``)."""
    text = BUFFER.replace("START", str(start)).replace("GUARD", guard).replace("EMPTIES", drains)
    text = text.replace("FILL", fill).replace("DRAIN", drain)
    for event, source, holds in (("fill", "empty", guard), ("drain", "full", drains)):
        if holds:
            fails = holds.replace("<", ">=") if "<" in holds else holds.replace(">=", "<")
            text += f'[[forbid]]\nevent = "{event}"\nsource = "{source}"\nguard = "{fails}"\nerror = "No"\nreason = "r"\n'
    path = tmp_path / "buf.toml"
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


@pytest.mark.parametrize(
    ("start", "fill", "guard", "reached"),
    [
        # Past the cap (2**63) and set back to 0: no range of 2**63 values to build.
        (
            2**63 - 1,
            "bytes += 1",
            "",
            {("empty", 2**63 - 1), ("full", 2**63), ("empty", 0), ("full", 1)},
        ),
        # Set past the cap of a guard's constant, then to 0: 0 alone, not every value below the cap.
        (0, "bytes = 2000000", "bytes < 1000000", {("empty", 0), ("full", 1000001)}),
        (0, "bytes = 2000000000000", "bytes < 1000000000000", {("empty", 0), ("full", 10**12 + 1)}),
    ],
)
def test_a_counter_set_below_its_cap_lands_on_that_value_alone(
    tmp_path: Path, start: int, fill: str, guard: str, reached: set[tuple[str, int]]
) -> None:
    spec = _buffer(tmp_path, start, fill, guard=guard)
    assert problems(spec) == []
    found = reach.search(as_system(spec), limit=100)  # the old spread passed 100 before counting
    assert found.complete
    assert {(states[0], counts[0]) for states, counts in found.ways} == reached


def test_a_spread_past_the_record_limit_stops_the_search(tmp_path: Path) -> None:
    """A counter at its cap lowered by a large amount stands for that many records: counted, lazily."""
    # `bytes >= 100000` caps the counter at 100001; drained from there it may be anything from 1 up.
    spec = _buffer(tmp_path, 0, "bytes += 200000", "bytes -= 100000", drains="bytes >= 100000")
    system = as_system(spec)
    found = reach.search(system, limit=100)
    assert not found.complete
    assert len(found.ways) == 101
    assert problems(spec) == []


def test_a_spread_from_the_cap_stands_for_every_value_not_just_the_critical_ones(
    tmp_path: Path,
) -> None:
    """From the cap 11, `x -= 3` lands on 8, 9, 10 or 11: 9 alone leads, by 6 and 3, to 0 and b.

    The critical values (:func:`~fsm_cache.spec.guards.critical_values`) between 8
    and 11 are 10 and 11: they stand for every value of one step, not of a run.
    """
    text = """
[machine]
name = "ce"
initial = "a"
[counters]
x = 1
[states]
a = {}
b = { final = true }
[[transition]]
event = "up"
source = "a"
dest = "a"
update = "x += 20"
[[transition]]
event = "down"
source = "a"
dest = "a"
guard = "x >= 3"
update = "x -= 3"
[[forbid]]
event = "down"
source = "a"
guard = "x < 3"
error = "Low"
reason = "low"
[[transition]]
event = "peek"
source = "a"
dest = "a"
guard = "x >= 10"
[[forbid]]
event = "peek"
source = "a"
guard = "x < 10"
error = "Low"
reason = "low"
[[transition]]
event = "win"
source = "a"
dest = "b"
guard = "x == 0"
[[forbid]]
event = "win"
source = "a"
guard = "x != 0"
error = "No"
reason = "no"
"""
    path = tmp_path / "ce.toml"
    path.write_text(text, encoding="utf-8")
    spec = load_spec(path)
    assert problems(spec) == []
    found = reach.runs(as_system(spec))
    assert found.run_to((("b",), (0,))) == ("", ["up", "down", "down", "down", "down", "win"])


def _unused(text: str, count: int) -> str:
    """Return ``text`` with ``count`` more counters, which nothing reads."""
    return text.replace("n = 0\n", "n = 0\n" + "".join(f"c{i} = 0\n" for i in range(count)), 1)


def test_a_check_asks_no_more_valuations_for_counters_it_does_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each check enumerates the counters it reads: unused counters cost no valuations.

    Each of the ten would double what a product over every counter asks (a
    thousandfold), as each counter a check reads multiplies it.
    """
    asked: list[dict[str, int]] = []

    def counted(*args: Any) -> Iterator[dict[str, int]]:
        for values in allowed(*args):
            asked.append(values)
            yield values

    allowed = validate_module.allowed
    monkeypatch.setattr(validate_module, "allowed", counted)
    seen = []
    for count in (0, 10):
        path = tmp_path / f"gate{count}.toml"
        path.write_text(_unused(GATE, count), encoding="utf-8")
        spec = load_spec(path)
        asked.clear()
        assert problems(spec) == []
        seen.append(len(asked))
    assert seen[0] == seen[1] > 0


def test_what_a_problem_names_of_counters_it_does_not_read(tmp_path: Path) -> None:
    """The values a problem shows are those of the full product's first valuation that shows it."""
    gap = _unused(HEAD + OPEN + LEAVE, 2)
    assert found(tmp_path, gap) == [
        "states.closed: event 'leave' is neither a transition nor a forbid when n=0, for every value of c0 and c1 (not total)"
    ]
    crowd = '\n[[forbid]]\nevent = "leave"\nsource = "open"\nguard = "n >= 5"\nerror = "Crowd"\nreason = "r"\n'
    assert found(tmp_path, _unused(GATE + crowd, 2)) == [
        "forbid[1]: overlaps transition[2] on leave in open when n=5, c0=0, c1=0"
    ]
    sink = '\n[[transition]]\nevent = "sink"\nsource = "open"\ndest = "open"\nupdate = "n -= 2"\n'
    sink += '\n[[forbid]]\nevent = "sink"\nsource = "closed"\nerror = "E"\nreason = "r"\n'
    assert found(tmp_path, _unused(GATE + sink, 2)) == [
        "transition[3].update: drives n negative from open when n=1, c0=0, c1=0"
    ]


def test_a_check_reading_too_many_counters_together_is_refused(tmp_path: Path) -> None:
    """18 counters in one guard make 2**18 valuations: past the limit, one line, not hours."""
    names = [f"c{i}" for i in range(18)]
    counters = "".join(f"{name} = 0\n" for name in names)
    guard = " and ".join(f"{name} == 0" for name in names)
    text = f"""
[machine]
name = "wide"
initial = "s"
[counters]
{counters}[states]
s = {{}}
t = {{ final = true }}
[[transition]]
event = "go"
source = "s"
dest = "t"
guard = "{guard}"
"""
    assert found(tmp_path, text) == [
        f"states.s: a check there reads 18 counters together ({', '.join(names)}): 262144 "
        "valuations of their representatives, more than validation tries (100000); "
        "let one guard, invariant or update read fewer"
    ]
    assert validate_module.VALUATION_LIMIT == 100_000
