"""Validation rules: names, determinism, totality, safety, reachability, compositions."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fsm_cache.errors import SpecError
from fsm_cache.guards import parse_guard
from fsm_cache.loader import load_spec
from fsm_cache.shipped import load_shipped, shipped_spec_paths
from fsm_cache.spec import MachineSpec, StateSpec, System
from fsm_cache.validate import bound, problems, validate, valuations


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
    text += '\n[events]\nexit = { doc = "typo" }\n'
    assert found(tmp_path, text) == [
        "machine.initial: unknown state 'shut'",
        "states.open.invariant: unknown counter 'm'",
        "states.open.counter: unknown counter 'k'",
        "transition[1].dest: unknown state 'close'",
        "transition[2]: unknown counter 'z'",
        "forbid[0].source: unknown state 'ajar'",
        "forbid[0].error: error class names are CapitalisedIdentifiers, got 'empty'",
        "forbid[1].guard: unknown counter 'q'",
        "events.exit: unknown event",
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


@pytest.mark.parametrize("name", ["id", "trail", "parent", "children", "state", "class", "if"])
def test_counters_may_not_shadow_record_attributes_or_keywords(tmp_path: Path, name: str) -> None:
    text = GATE.replace("n = 0", f"n = 0\n{name} = 0")
    assert found(tmp_path, text) == [
        f"counters.{name}: {name!r} is reserved (a Python keyword or a record attribute)"
    ]


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
        "states.open: unreachable from closed",
        "states.open: not final and has no transition out",
    ]


def test_every_shipped_spec_validates() -> None:
    paths = shipped_spec_paths()
    assert [p.name for p in paths] == [
        "device_residency.toml",
        "host_residency.toml",
        "residency.toml",
    ]
    for path in paths:
        assert problems(load_spec(path)) == []


def test_valuations_are_the_exact_representatives() -> None:
    host = load_shipped("host_residency")
    assert isinstance(host, MachineSpec)
    assert bound(host) == 5  # largest constant 2, largest step 1, plus 2
    pinned = host.state("pinned").invariant
    assert list(valuations(host, pinned)) == [{"pins": v} for v in range(1, 6)]
    assert list(valuations(host, parse_guard("pins == 0"))) == [{"pins": 0}]


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


def test_region_problems_keep_their_own_file() -> None:
    broken = MachineSpec("g", "nowhere", (), (StateSpec("a", final=True),), (), source="g.toml")
    with pytest.raises(SpecError) as info:
        validate(System("s", (("g", broken),), source="s.toml"))
    assert info.value.problems == ["g.toml: machine.initial: unknown state 'nowhere'"]


def test_a_final_state_needs_no_exit_and_no_coverage() -> None:
    states = (StateSpec("a"), StateSpec("done", final=True))
    from fsm_cache.spec import Transition

    spec = MachineSpec("m", "a", (), states, (Transition("finish", ("a",), "done"),))
    assert problems(spec) == []
    assert list(itertools.islice(valuations(spec, parse_guard("")), 3)) == [{}]
