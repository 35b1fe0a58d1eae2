"""Loading specs: every structural fault is a SpecError naming the file and the key."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import too_big_toml
from hypothesis import given, settings
from hypothesis import strategies as st
from shipped_files import STORAGE_FILES

import fsm_cache
from fsm_cache.errors import BadArgument, SpecError
from fsm_cache.spec import loader
from fsm_cache.spec.guards import parse_condition, parse_guard, parse_update
from fsm_cache.spec.loader import (
    MAX_DEPTH,
    NOT_IN_SNAPSHOT,
    load_snapshot,
    load_spec,
    machine_from_dict,
    shown,
    spec_files,
    spec_from_dict,
)
from fsm_cache.spec.machine import EventSpec, Forbid, MachineSpec, StateSpec, System, Transition
from fsm_cache.spec.shipped import load_shipped, shipped_names, spec_dir
from fsm_cache.spec.validate import problems as validate_problems


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


LAMP = """
[machine]
name = "lamp"
initial = "off"
label = "lamp"
doc = "A push button lamp."

[counters]
n = 0

[states]
off = { doc = "dark", invariant = "n == 0" }
on = { invariant = "n >= 1", counter = "n" }

[events]
press = { doc = "push", past = "pressed" }
unpress = { doc = "let go" }

[[transition]]
event = "press"
source = ["off", "on"]
dest = "on"
update = "n += 1"
effect = "glow"

[[transition]]
event = "unpress"
source = "on"
dest = "off"
guard = "n == 1"
update = "n -= 1"

[[transition]]
event = "unpress"
source = "on"
dest = "on"
guard = "n >= 2"
update = "n -= 1"

[[forbid]]
event = "unpress"
source = "off"
error = "UnpressAtZero"
reason = "nothing pressed"
"""


def write(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def test_a_valid_machine_loads_into_spec_objects(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, LAMP))
    assert isinstance(spec, MachineSpec)
    assert (spec.name, spec.initial, spec.label, spec.doc) == (
        "lamp",
        "off",
        "lamp",
        "A push button lamp.",
    )
    assert spec.source == str(tmp_path / "spec.toml")
    assert spec.counters == (("n", 0),)
    assert spec.states[0] == StateSpec("off", "dark", invariant=parse_guard("n == 0"))
    assert spec.state("on").counter == "n"
    assert spec.transitions[0] == Transition(
        "press", ("off", "on"), "on", update=parse_update("n += 1"), effect="glow"
    )
    assert spec.forbids == (Forbid("unpress", ("off",), "UnpressAtZero", "nothing pressed"),)
    assert spec.event_names == ("press", "unpress")
    assert spec.event_doc("press").past == "pressed"
    assert spec.event_doc("unpress") == EventSpec("unpress", "let go")
    assert spec.event_doc("undeclared") == EventSpec("undeclared")


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    assert problems(missing) == [f"{missing}: cannot read: No such file or directory"]
    assert problems(tmp_path) == [f"{tmp_path}: cannot read: Is a directory"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.timeout(20)  # before the fix, reading a named pipe waited for a writer forever
def test_a_file_that_is_not_a_regular_file_is_not_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    assert problems(fifo) == [f"{fifo}: cannot read: not a regular file (a named pipe)"]
    assert problems(Path("/dev/null")) == [
        "/dev/null: cannot read: not a regular file (a character device)"
    ]
    write(tmp_path, LAMP, "lamp.toml")
    comp = write(
        tmp_path,
        "[composition]\nname = 'c'\nextends = 'pipe.toml'\n[composition.regions]\n"
        "a = 'pipe.toml'\nb = 'lamp.toml'\n",
        "c.toml",
    )
    assert problems(comp) == [
        f"{comp}: composition.extends: cannot read {fifo}: not a regular file (a named pipe)",
        f"{comp}: composition.regions.a: cannot read {fifo}: not a regular file (a named pipe)",
    ]


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[machine]\nname = \n")
    assert problems(path) == [f"{path}: invalid TOML: Invalid value (at line 2, column 8)"]


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bytes.toml"
    path.write_bytes(b"name = '\xff'\n")
    [line] = problems(path)
    assert line.startswith(f"{path}: invalid TOML: 'utf-8' codec can't decode byte 0xff")


def test_missing_tables_are_all_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "[machine]\n")
    assert problems(path) == [
        f"{path}: states: missing: a table of NAME = {{ doc = ... }}",
        f"{path}: machine.name: missing or not a string",
        f"{path}: machine.initial: missing or not a string",
    ]


@pytest.mark.parametrize("text", ["", "title = 'x'\n"])
def test_a_file_with_no_spec_table_is_one_line(tmp_path: Path, text: str) -> None:
    """An empty file said ``machine: missing table`` and three more missing keys."""
    path = write(tmp_path, text)
    region = write(
        tmp_path, "[composition]\nname = 'c'\n[composition.regions]\nr = 'spec.toml'\n", "c.toml"
    )
    unknown = [
        f"{path}: title: unknown key (allowed: counters, events, forbid, machine, states, transition)"
    ]
    line = f"{path}: holds no [machine] or [composition] table; a spec file is one of them"
    assert problems(path) == [*unknown[: len(text)], line]
    assert problems(region) == [*unknown[: len(text)], line]


def test_a_file_with_both_tables_says_so(tmp_path: Path) -> None:
    """It was read as a composition: ``machine: unknown key (allowed: composition, forbid)``."""
    both = LAMP + "\n[composition]\nname = 'x'\n"
    path = write(tmp_path, both)
    comp = write(
        tmp_path, "[composition]\nname = 'c'\n[composition.regions]\nr = 'spec.toml'\n", "c.toml"
    )
    line = f"{path}: holds both a [machine] and a [composition] table; a spec file is one of them"
    assert problems(path) == [line]
    assert problems(comp) == [line]


@pytest.mark.parametrize(("given", "named"), [(None, "NoneType"), (3, "int"), (b"a.toml", "bytes")])
def test_a_path_of_another_type_is_a_bad_argument(given: object, named: str) -> None:
    """``load_spec(None)`` raised a bare TypeError from inside pathlib."""
    said = f"path must be a spec file's path (str or os.PathLike), got {named}"
    with pytest.raises(BadArgument) as info:
        load_spec(given)  # type: ignore[arg-type]
    assert str(info.value) == f"load_spec: {said}"
    with pytest.raises(BadArgument) as info:
        load_snapshot(given)  # type: ignore[arg-type]
    assert str(info.value) == f"load_snapshot: {said}"


def test_unknown_keys(tmp_path: Path) -> None:
    text = LAMP.replace('label = "lamp"', 'lable = "lamp"')
    text = text.replace('dest = "off"', 'dest = "off"\nguards = "n == 1"')
    text = text.replace('doc = "dark",', 'doc = "dark", final = false, colour = "red",')
    text = text.replace('past = "pressed"', 'past = "pressed", tense = 1')
    text = text.replace('reason = "nothing pressed"', 'reason = "nothing pressed"\nerrors = "X"')
    text += "\n[[transitions]]\nevent = 'x'\n"
    path = write(tmp_path, text)
    assert problems(path) == [
        f"{path}: transitions: unknown key (allowed: counters, events, forbid, machine, states, transition)",
        f"{path}: machine.lable: unknown key (allowed: doc, extends, initial, label, name)",
        f"{path}: states.off.colour: unknown key (allowed: counter, doc, final, invariant)",
        f"{path}: transition[1].guards: unknown key (allowed: dest, doc, effect, event, guard, propagate, source, update)",
        f"{path}: forbid[0].errors: unknown key (allowed: error, event, guard, reason, source, when)",
        f"{path}: events.press.tense: unknown key (allowed: doc, past)",
    ]


def test_malformed_guards_and_updates_name_their_key(tmp_path: Path) -> None:
    text = LAMP.replace('guard = "n == 1"', 'guard = "n = 1"')
    text = text.replace('update = "n += 1"', 'update = "n ++"')
    text = text.replace('invariant = "n == 0"', "invariant = 0")
    text = text.replace(
        'reason = "nothing pressed"', 'reason = "nothing pressed"\nguard = "n >= x"'
    )
    path = write(tmp_path, text)
    assert problems(path) == [
        f"{path}: states.off.invariant: must be a string, got 0",
        f"{path}: transition[0].update: expected COUNTER += INT, COUNTER -= INT or COUNTER = INT, got 'n ++'",
        f"{path}: transition[1].guard: expected COUNTER OP INT (OP one of == != < <= > >=), got 'n = 1'",
        f"{path}: forbid[0].guard: expected COUNTER OP INT (OP one of == != < <= > >=), got 'n >= x'",
    ]


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_guard, "n >= \uff14"),  # a fullwidth 4: Python's int() reads it as 4
        (parse_guard, "n\u00a0>= 1"),  # a no-break space
        (parse_update, "n += \u0663"),  # an Arabic-Indic 3
        (parse_condition, "parent\u2003a in [on]"),  # an em space
    ],
)
def test_the_expression_grammar_is_ascii(parse: Any, text: str) -> None:
    """Other scripts' digits and spaces parsed: a fullwidth 4 loaded as ``n >= 4``."""
    with pytest.raises(ValueError, match="expected "):
        parse(text)


def test_bad_names_and_shapes(tmp_path: Path) -> None:
    text = LAMP.replace("n = 0\n", 'n = -1\nm = "zero"\n')
    text = text.replace("on = {", '"on air" = { final = true }\non = {')
    text = text.replace('event = "press"', 'event = "press now"')
    text = text.replace('source = ["off", "on"]', "source = []")
    text = text.replace('effect = "glow"', 'effect = "glow!"\npropagate = "children"')
    text = text.replace('error = "UnpressAtZero"', "error = 3")
    text = text.replace('reason = "nothing pressed"', "")
    path = write(tmp_path, text)
    assert problems(path) == [
        f"{path}: counters.n: initial value must be an integer >= 0, got -1",
        f"{path}: counters.m: initial value must be an integer >= 0, got 'zero'",
        f"{path}: states.on air: not an identifier",
        f"{path}: transition[0].event: missing or not an identifier: 'press now'",
        f"{path}: transition[0].source: must be a state name or a list of them, got []",
        f"{path}: transition[0].effect: not an identifier: 'glow!'",
        f"{path}: transition[0].propagate: must be 'ancestors', got 'children'",
        f"{path}: forbid[0].error: missing or not an identifier: 3",
        f"{path}: forbid[0].reason: missing or not a string",
    ]


def test_tables_of_the_wrong_type(tmp_path: Path) -> None:
    text = LAMP.replace("[counters]\nn = 0\n", "")
    text = text.replace(
        '[events]\npress = { doc = "push", past = "pressed" }\nunpress = { doc = "let go" }\n', ""
    )
    text = text.replace("[[forbid]]\nevent", "[[forbidden]]\nevent")
    path = write(tmp_path, "counters = 1\nevents = [1]\nforbid = 2\n" + text)
    assert problems(path) == [
        f"{path}: forbidden: unknown key (allowed: counters, events, forbid, machine, states, transition)",
        f"{path}: counters: must be a table of NAME = INT",
        f"{path}: forbid: must be an array of tables ([[forbid]])",
        f"{path}: events: must be a table of EVENT = {{ doc = ..., past = ... }}",
    ]


def test_bad_when_conditions(tmp_path: Path) -> None:
    data = {
        "composition": {"name": "c", "regions": {"lamp": "lamp.toml"}},
        "forbid": [
            {"event": "press", "when": 5, "error": "E", "reason": "r"},
            {"event": "press", "when": ["lamp on [x]"], "error": "E", "reason": "r"},
            {"event": "press", "when": [7], "error": "E", "reason": "r"},
        ],
    }
    write(tmp_path, LAMP, "lamp.toml")
    with pytest.raises(SpecError) as info:
        spec_from_dict(data, source="c.toml", base=tmp_path)
    assert info.value.problems == [
        "c.toml: forbid[0].when: must be a condition or a list of them, got 5",
        "c.toml: forbid[1].when: expected [parent|any child] REGION in [STATE, ...], got 'lamp on [x]'",
        "c.toml: forbid[2].when: must be a string, got 7",
    ]


def test_composition_loads_regions_relative_to_its_file(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    text = """
[composition]
name = "room"
label = "room"

[composition.regions]
lamp = "lamp.toml"

[[forbid]]
event = "press"
when = "lamp in [on]"
guard = "n >= 3"
error = "TooBright"
reason = "three presses are enough"
"""
    spec = load_spec(write(tmp_path, text, "room.toml"))
    assert isinstance(spec, System)
    assert spec.machines["lamp"].name == "lamp"
    assert spec.forbids == (
        Forbid(
            "press",
            (),
            "TooBright",
            "three presses are enough",
            parse_guard("n >= 3"),
            (parse_condition("lamp in [on]"),),
        ),
    )


def test_composition_faults(tmp_path: Path) -> None:
    write(
        tmp_path,
        "[composition]\nname = 'inner'\n[composition.regions]\nx = 'lamp.toml'\n",
        "inner.toml",
    )
    write(tmp_path, LAMP, "lamp.toml")
    no_regions = write(tmp_path, "[composition]\nnames = 'c'\n[[forbids]]\n", "a.toml")
    assert problems(no_regions) == [
        f"{no_regions}: forbids: unknown key (allowed: composition, forbid)",
        f"{no_regions}: composition.names: unknown key (allowed: births, doc, extends, label, name, regions)",
        f"{no_regions}: composition.regions: missing: a table of REGION = 'machine.toml'",
    ]
    nested = write(tmp_path, "[composition]\n[composition.regions]\nx = 'inner.toml'\n", "b.toml")
    assert problems(nested) == [
        f"{nested}: composition.regions.x: inner.toml is not a [machine] file",
        f"{nested}: composition.name: missing or not a string",
    ]
    missing = write(
        tmp_path, "[composition]\nname='c'\n[composition.regions]\nx = 'no.toml'\n", "c.toml"
    )
    assert problems(missing) == [
        f"{missing}: composition.regions.x: cannot read {tmp_path / 'no.toml'}: No such file or directory"
    ]
    odd = write(
        tmp_path, "[composition]\nname='d'\n[composition.regions]\nx = 3\ny = ''\n", "d.toml"
    )
    assert problems(odd) == [
        f"{odd}: composition.regions.x: must be the file name of a machine, got 3",
        f"{odd}: composition.regions.y: must be the file name of a machine, got ''",
    ]
    itself = write(
        tmp_path, "[composition]\nname='e'\n[composition.regions]\nx = 'e.toml'\n", "e.toml"
    )
    assert problems(itself) == [
        f"{itself}: composition.regions.x: a cycle: {itself}, whose region x is {itself}"
    ]


def test_a_composition_reports_its_regions_faults_with_its_own(tmp_path: Path) -> None:
    broken = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "n = 1"'), "lamp.toml")
    toml = write(tmp_path, "[machine\n", "bad.toml")
    comp = write(
        tmp_path,
        "[composition]\n[composition.regions]\na = 'lamp.toml'\nb = 'bad.toml'\n",
        "c.toml",
    )
    assert problems(comp) == [
        f"{broken}: transition[1].guard: expected COUNTER OP INT (OP one of == != < <= > >=), got 'n = 1'",
        f"{toml}: invalid TOML: Expected ']' at the end of a table declaration (at line 1, column 9)",
        f"{comp}: composition.name: missing or not a string",
    ]


def test_text_fields_must_be_strings_and_flags_booleans(tmp_path: Path) -> None:
    text = LAMP.replace('label = "lamp"', "label = 3").replace('"A push button lamp."', "5")
    text = text.replace('doc = "dark"', 'doc = 1, final = "yes"').replace(
        'counter = "n"', "counter = 2"
    )
    text = text.replace('past = "pressed"', "past = false").replace(
        'unpress = { doc = "let go" }', "unpress = { doc = [] }"
    )
    text = text.replace('effect = "glow"', 'effect = "glow"\ndoc = 7')
    path = write(tmp_path, text)
    assert problems(path) == [
        f"{path}: states.off.final: must be true or false, got 'yes'",
        f"{path}: states.off.doc: must be a string, got 1",
        f"{path}: states.on.counter: must be a counter name, got 2",
        f"{path}: transition[0].doc: must be a string, got 7",
        f"{path}: events.press.past: must be a string, got False",
        f"{path}: events.unpress.doc: must be a string, got []",
        f"{path}: machine.doc: must be a string, got 5",
        f"{path}: machine.label: must be a string, got 3",
    ]
    comp = write(
        tmp_path,
        "[composition]\nname = 'c'\ndoc = 1\nlabel = 2\n[composition.regions]\nx = 'spec.toml'\n",
        "c.toml",
    )
    write(tmp_path, LAMP)
    assert problems(comp) == [
        f"{comp}: composition.doc: must be a string, got 1",
        f"{comp}: composition.label: must be a string, got 2",
    ]


def test_toml_nested_too_deeply_is_invalid(tmp_path: Path) -> None:
    path = write(tmp_path, "a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert problems(path) == [f"{path}: invalid TOML: nested too deeply"]


def test_integers_too_long_to_convert_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, LAMP.replace("n = 0", "n = 1" + "0" * 5000))
    assert problems(path) == [f"{path}: invalid TOML: {too_big_toml.too_many_digits(5001)}"]
    path = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "n == 1' + "0" * 1000 + '"'))
    assert problems(path) == [
        f"{path}: transition[1].guard: an integer has 1001 digits, more than 1000"
    ]


def test_machine_from_dict_does_not_validate() -> None:
    spec = machine_from_dict({"machine": {"name": "m", "initial": "nowhere"}, "states": {"a": {}}})
    assert spec.initial == "nowhere"
    assert spec.source == "<python>"


def test_data_too_deep_or_not_a_table_is_refused_before_it_is_read() -> None:
    """Nesting past MAX_DEPTH, a table holding itself, odd keys: a SpecError, never a RecursionError."""
    deep: list[object] = []
    for _ in range(10_000):
        deep = [deep]
    data: dict[str, Any] = {
        "machine": {"name": "m", "initial": "a"},
        "states": {"a": {"final": deep}},
    }
    loop: dict[str, object] = {"machine": {"name": "m", "initial": "a"}}
    loop["states"] = {"a": loop}
    cases = [
        (data, "<python>: states.a.final: nested deeper than 64 levels"),
        (loop, "<python>: states.a.states: nested deeper than 64 levels"),
        (
            [data],
            "<python>: the top level must be a table, got [{'machine': {'initial': 'a', 'name': 'm'}, 'states': {'a': {...}}}]",
        ),
        ({"states": {1: {}}}, "<python>: states: keys must be strings, got 1"),
        ({2: {}}, "<python>: keys must be strings, got 2"),
    ]
    for bad, message in cases:
        for build in (spec_from_dict, machine_from_dict):
            with pytest.raises(SpecError) as info:
                build(bad)  # type: ignore[arg-type]
            assert info.value.problems == [message]
    shallow: list[object] = []
    for _ in range(MAX_DEPTH - 4):  # MAX_DEPTH levels: the top table, states, a, and these lists
        shallow = [shallow]
    data["states"]["a"]["final"] = shallow
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert info.value.problems == [
        "<python>: states.a.final: must be true or false, got [[[[...]]]]"
    ]


def test_values_too_large_to_print_are_named_not_printed() -> None:
    data = {"machine": {"name": "m", "initial": "a"}, "states": {"a": {"final": 10**5000}}}
    data["counters"] = {"n": 10**5000}
    with pytest.raises(SpecError) as info:
        spec_from_dict(data)
    assert info.value.problems == [
        "<python>: counters.n: initial value has more than 1000 digits",
        "<python>: states.a.final: must be true or false, got a value too large to show",
    ]
    assert shown("x" * 1000) == "'" + "x" * 37 + "..." + "x" * 38 + "'"


_WORDS = ["off", "on", "press", "unpress", "n", "n >= 1", "n += 1", "ancestors", "Oops", ""]
_SCALARS = st.one_of(
    st.sampled_from(_WORDS),
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
    st.floats(),
    st.datetimes(),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(_WORDS) | st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _places(data: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every key and index path in ``data``: the places a fuzzed value may go."""
    out = [path]
    if isinstance(data, dict):
        for key, value in data.items():
            out += _places(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _places(value, (*path, i))
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_no_value_anywhere_makes_anything_but_a_spec_error(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Any value put in any place of a valid machine or composition: a spec or a SpecError."""
    folder = tmp_path_factory.mktemp("regions")
    write(folder, LAMP, "lamp.toml")
    machine = tomllib.loads(LAMP)
    composition = {
        "composition": {"name": "c", "regions": {"one": "lamp.toml"}},
        "forbid": [{"event": "press", "when": "one in [on]", "error": "E", "reason": "r"}],
    }
    spec = data.draw(st.sampled_from([machine, composition]))
    *above, last = data.draw(st.sampled_from(_places(spec)[1:]))
    holder: Any = spec
    for key in above:
        holder = holder[key]
    holder[last] = data.draw(_VALUES)
    if data.draw(st.booleans()) and isinstance(holder, dict):
        holder[data.draw(st.sampled_from(_WORDS))] = data.draw(_VALUES)
    try:
        spec_from_dict(spec, base=folder)
    except SpecError as exc:
        problems = exc.problems
    else:
        return
    assert problems
    assert all(line.startswith(("<python>: ", f"{folder}")) for line in problems)


# -- extends and births ---------------------------------------------------------
DIMMER = """
[machine]
extends = "lamp.toml"
name = "dimmer"

[states]
dim = { doc = "half", invariant = "n == 0" }

[events]
turn = { doc = "turn the knob" }

[[transition]]
event = "turn"
source = "off"
dest = "dim"

[[transition]]
event = "turn"
source = "dim"
dest = "off"

[[forbid]]
event = "turn"
source = "on"
error = "TooBright"
reason = "already on"

[[forbid]]
event = "press"
source = "dim"
error = "Dimmed"
reason = "dimmed"

[[forbid]]
event = "unpress"
source = "dim"
error = "UnpressAtZero"
reason = "nothing pressed"
"""


def test_an_extending_machine_follows_its_base(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    spec = load_spec(write(tmp_path, DIMMER, "dimmer.toml"))
    base = load_spec(tmp_path / "lamp.toml")
    assert isinstance(spec, MachineSpec)
    assert isinstance(base, MachineSpec)
    assert (spec.name, spec.initial, spec.label, spec.doc) == ("dimmer", "off", "lamp", base.doc)
    assert spec.state_names == ("off", "on", "dim")
    assert spec.transitions[: len(base.transitions)] == base.transitions
    assert spec.forbids[: len(base.forbids)] == base.forbids
    assert spec.event_names == ("press", "unpress", "turn")


def test_an_extension_must_keep_its_base_total(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    partial = DIMMER.replace('event = "press"\nsource = "dim"', 'event = "turn"\nsource = "dim"')
    assert any(
        "states.dim: event 'press' is neither a transition nor a forbid" in line
        for line in problems(write(tmp_path, partial, "dimmer.toml"))
    )


def test_a_counter_redeclared_down_a_chain_is_named_where_it_is(tmp_path: Path) -> None:
    """It was named in the file at the top of the chain, which declares no counter."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    dimmer = write(
        tmp_path, DIMMER.replace("[states]", "[counters]\nn = 1\n\n[states]"), "dimmer.toml"
    )
    top = write(tmp_path, "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n", "top.toml")
    assert problems(top) == [
        f"{dimmer}: counters.n: already a counter of the base {lamp} "
        "(a spec that extends another may not redeclare its counters)"
    ]


def test_an_extending_spec_counts_its_own_tables(tmp_path: Path) -> None:
    """A fault found validating the whole counted the base's tables first: transition[4], of two."""
    write(tmp_path, LAMP, "lamp.toml")
    text = DIMMER.replace('source = "dim"\ndest = "off"', 'source = "dim"\ndest = "nowhere"')
    text = text.replace('event = "unpress"\nsource = "dim"', 'event = "unpress"\nsource = "gone"')
    dimmer = write(tmp_path, text, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: transition[1].dest: unknown state 'nowhere'",
        f"{dimmer}: forbid[2].source: unknown state 'gone'",
    ]


def test_a_base_entry_is_named_in_its_base(tmp_path: Path) -> None:
    """It was named in the spec that extends it, where no such entry is written."""
    lamp = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "m == 1"'), "lamp.toml")
    dimmer = write(tmp_path, DIMMER, "dimmer.toml")
    assert problems(lamp) == [f"{lamp}: transition[1].guard: unknown counter 'm'"]
    assert problems(dimmer) == [
        f"{lamp}: transition[1].guard: unknown counter 'm'; found validating {dimmer}, which extends it"
    ]


def test_a_fault_across_files_names_each_entry_in_its_file(tmp_path: Path) -> None:
    """An overlap with a base's transition names it in the base; a base state left open, too."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    again = '[[transition]]\nevent = "press"\nsource = "off"\ndest = "on"\nupdate = "n += 1"\n'
    dimmer = write(tmp_path, DIMMER.replace("[[forbid]]", again + "[[forbid]]", 1), "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: transition[2]: overlaps transition[0] of {lamp} on press in off when n=0 "
        "(non-deterministic)"
    ]
    open_on = DIMMER.replace('event = "turn"\nsource = "on"', 'event = "turn"\nsource = "dim"')
    dimmer = write(tmp_path, open_on, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: forbid[0]: overlaps transition[1] on turn in dim when n=0",
        f"{dimmer}: events.turn: neither a transition nor a forbid in states.on of {lamp} "
        "for every value of n (not total)",
    ]


UNPRESS_OFF = '[[transition]]\nevent = "unpress"\nsource = "off"\ndest = "off"\n\n'
"""A transition of ``unpress`` in ``off``, which LAMP's ``forbid[0]`` refuses."""


def test_an_overlap_with_a_base_forbid_is_filed_in_the_extension(tmp_path: Path) -> None:
    """It was filed under the base's forbid, in a file the extension's author may not own."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    dimmer = write(
        tmp_path, DIMMER.replace("[[forbid]]", UNPRESS_OFF + "[[forbid]]", 1), "dimmer.toml"
    )
    assert problems(dimmer) == [
        f"{dimmer}: transition[2]: overlaps forbid[0] of {lamp} on unpress in off when n=0"
    ]
    top = write(tmp_path, "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n", "top.toml")
    assert problems(top) == [
        f"{dimmer}: transition[2]: overlaps forbid[0] of {lamp} on unpress in off when n=0; "
        f"found validating {top}, which extends it"
    ]
    refuse = '[[forbid]]\nevent = "press"\nsource = "off"\nerror = "Off"\nreason = "r"\n\n'
    dimmer = write(tmp_path, DIMMER.replace("[[forbid]]", refuse + "[[forbid]]", 1), "dimmer.toml")
    assert problems(dimmer) == [  # the forbid is the later entry: filed there, as before
        f"{dimmer}: forbid[0]: overlaps transition[0] of {lamp} on press in off when n=0"
    ]


def test_an_overlap_with_a_shipped_forbid_is_filed_in_the_extension(tmp_path: Path) -> None:
    """The shipped spec lies in site-packages: the line must name the file its user can edit."""
    host = load_shipped("host_residency").source
    text = "[machine]\nextends = 'fsm_cache:host_residency'\nname = 'mine'\n\n"
    text += '[[transition]]\nevent = "write"\nsource = "writing"\ndest = "writing"\n'
    mine = write(tmp_path, text, "mine.toml")
    assert problems(mine) == [
        f"{mine}: transition[0]: overlaps forbid[1] of {host} on write in writing when pins=0"
    ]


TOUCH = """\
[machine]
extends = 'fsm_cache:host_residency'
name = 'my_host'

[events]
touch = { doc = "A reader looks at the host copy." }

[[transition]]
event = "touch"
source = ["unbacked", "writing", "backed", "evicted"]
dest = "unbacked"
"""
"""An extension of the shipped host machine whose new event ``touch`` leaves ``pinned`` open."""


def test_a_gap_an_extension_adds_to_a_shipped_state_is_filed_at_its_event(
    tmp_path: Path,
) -> None:
    """It was filed at ``states.pinned`` of the shipped spec, in site-packages; the event is the extension's."""
    host = load_shipped("host_residency").source
    mine = write(tmp_path, TOUCH.replace('"writing", "backed"', '"backed"'), "my_host.toml")
    assert problems(mine) == [
        f"{mine}: events.touch: neither a transition nor a forbid in states.writing of {host} "
        "for every value of pins (not total)",
        f"{mine}: events.touch: neither a transition nor a forbid in states.pinned of {host} "
        "for every value of pins (not total)",
    ]


def test_a_gap_of_an_event_declared_by_a_use_is_filed_at_its_first_use(tmp_path: Path) -> None:
    """Without ``[events]``, a use declares the event: the base-most file's first one."""
    base = "[machine]\nname = 'b'\ninitial = 'x'\n\n[states]\nx = {}\ny = {}\n\n"
    base += "[[transition]]\nevent = 'go'\nsource = 'x'\ndest = 'y'\n\n"
    base += "[[transition]]\nevent = 'go'\nsource = 'y'\ndest = 'x'\n"
    b = write(tmp_path, base, "b.toml")
    text = "[machine]\nextends = 'b.toml'\nname = 'e'\n\n[states]\nz = {}\n\n"
    text += "[[transition]]\nevent = 'go'\nsource = 'z'\ndest = 'x'\n\n"
    text += "[[forbid]]\nevent = 'jump'\nsource = 'z'\nerror = 'No'\nreason = 'no'\n\n"
    text += "[[transition]]\nevent = 'jump'\nsource = 'x'\ndest = 'z'\n"
    e = write(tmp_path, text, "e.toml")
    assert problems(e) == [
        f"{e}: transition[1].event: neither a transition nor a forbid in states.y of {b} (not total)"
    ]


def test_a_gap_in_a_state_no_older_than_its_event_stays_filed_at_the_state(
    tmp_path: Path,
) -> None:
    """A state of the event's own file, or of a file built on it, is where the gap is fixed."""
    write(tmp_path, LAMP, "lamp.toml")
    base_event = DIMMER.replace('event = "press"\nsource = "dim"', 'event = "turn"\nsource = "dim"')
    dimmer = write(tmp_path, base_event, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: forbid[1]: overlaps transition[1] on turn in dim when n=0",
        f"{dimmer}: states.dim: event 'press' is neither a transition nor a forbid when n=0 (not total)",
    ]
    own_event = DIMMER.replace('[[transition]]\nevent = "turn"\nsource = "dim"\ndest = "off"\n', "")
    dimmer = write(tmp_path, own_event, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: states.dim: event 'turn' is neither a transition nor a forbid when n=0 (not total)",
        f"{dimmer}: states.dim: not final and has no transition out",
    ]


def test_a_gap_found_through_a_chain_is_filed_at_the_event_in_the_middle_file(
    tmp_path: Path,
) -> None:
    """The file that declares the event may itself be a base: the line says how it is reached."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    forbid = (
        '[[forbid]]\nevent = "turn"\nsource = "on"\nerror = "TooBright"\nreason = "already on"\n\n'
    )
    open_on = DIMMER.replace(forbid, "")
    dimmer = write(tmp_path, open_on, "dimmer.toml")
    top = write(tmp_path, "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n", "top.toml")
    gap = (
        f"{dimmer}: events.turn: neither a transition nor a forbid in states.on of {lamp} "
        "for every value of n (not total)"
    )
    assert problems(dimmer) == [gap]
    assert problems(top) == [f"{gap}; found validating {top}, which extends it"]


def test_a_base_two_levels_down_is_said_to_be_reached_through_the_files_between(
    tmp_path: Path,
) -> None:
    """It was said to be found validating a spec 'which extends it', which it extends only through another."""
    lamp = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "m == 1"'), "lamp.toml")
    dimmer = write(tmp_path, DIMMER, "dimmer.toml")
    top = write(tmp_path, "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n", "top.toml")
    four = write(tmp_path, "[machine]\nextends = 'top.toml'\nname = 'four'\n", "four.toml")
    fault = f"{lamp}: transition[1].guard: unknown counter 'm'; found validating"
    assert problems(top) == [f"{fault} {top}, which builds on it through {dimmer}"]
    assert problems(four) == [f"{fault} {four}, which builds on it through {top}, {dimmer}"]


def test_a_base_fault_found_with_no_chain_known_says_the_spec_builds_on_it(
    tmp_path: Path,
) -> None:
    """Validated without the loader's chains, a base is not said to be extended directly."""
    lamp = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "m == 1"'), "lamp.toml")
    data = tomllib.loads(DIMMER)
    spec = machine_from_dict(data, str(tmp_path / "dimmer.toml"), tmp_path)
    assert validate_problems(spec) == [
        f"{lamp}: transition[1].guard: unknown counter 'm'; "
        f"found validating {spec.source}, which builds on it"
    ]


def test_a_name_redeclared_two_levels_down_names_the_file_declaring_it(tmp_path: Path) -> None:
    """It named the base the spec extends, which declares neither n nor off."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    dimmer = write(tmp_path, DIMMER, "dimmer.toml")
    text = "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n[counters]\nn = 0\n"
    top = write(tmp_path, text + "[states]\noff = {}\ndim = {}\n", "top.toml")
    rule = "(a spec that extends another may not redeclare its"
    assert problems(top) == [
        f"{top}: counters.n: already a counter of {lamp}, which this spec builds on through "
        f"{dimmer} {rule} counters)",
        f"{top}: states.off: already a state of {lamp}, which this spec builds on through "
        f"{dimmer} {rule} states)",
        f"{top}: states.dim: already a state of the base {dimmer} {rule} states)",
    ]


def test_an_event_of_the_base_redeclared_is_refused(tmp_path: Path) -> None:
    """A second doc of a base event loaded, and was ignored: the base's was the one read."""
    lamp = write(tmp_path, LAMP, "lamp.toml")
    text = DIMMER.replace('turn = { doc = "turn the knob" }', 'turn = {}\npress = { doc = "mine" }')
    dimmer = write(tmp_path, text, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: events.press: already an event of the base {lamp} "
        "(a spec that extends another may not redeclare its events)"
    ]


def test_a_base_counter_fault_is_named_in_the_file_declaring_it(tmp_path: Path) -> None:
    """A counter carried no file, so its fault was named in the spec that extends its base."""
    lamp = write(tmp_path, LAMP.replace("n = 0\n", "n = 0\nid = 0\n"), "lamp.toml")
    dimmer = write(tmp_path, DIMMER, "dimmer.toml")
    top = write(tmp_path, "[machine]\nextends = 'dimmer.toml'\nname = 'top'\n", "top.toml")
    reserved = f"{lamp}: counters.id: 'id' is reserved (a record attribute or a name of the generated code)"
    assert problems(dimmer) == [f"{reserved}; found validating {dimmer}, which extends it"]
    assert problems(top) == [
        f"{reserved}; found validating {top}, which builds on it through {dimmer}"
    ]
    write(tmp_path, LAMP.replace("n = 0\n", "n = 1\n"), "lamp.toml")
    assert problems(dimmer) == [
        f"{lamp}: counters.n: initial value 1 breaks the invariant of the initial state off "
        f"(n == 0); found validating {dimmer}, which extends it"
    ]


def test_an_inherited_initial_state_is_named_in_the_file_choosing_it(tmp_path: Path) -> None:
    """An unknown ``initial`` of a base was named in the spec that extends it, which sets none."""
    lamp = write(tmp_path, LAMP.replace('initial = "off"', 'initial = "of"'), "lamp.toml")
    dimmer = write(tmp_path, DIMMER, "dimmer.toml")
    assert problems(dimmer) == [
        f"{lamp}: machine.initial: unknown state 'of'; found validating {dimmer}, which extends it"
    ]
    write(tmp_path, LAMP, "lamp.toml")
    chosen = write(
        tmp_path, DIMMER.replace('name = "dimmer"', 'name = "d"\ninitial = "on"'), "d.toml"
    )
    assert problems(chosen) == [
        f"{chosen}: machine.initial: the invariant of the initial state on (n >= 1) is broken "
        f"by the initial value 0 of counters.n of {lamp}"
    ]


def test_a_base_composition_region_fault_is_named_in_the_base(tmp_path: Path) -> None:
    """A region a base composition names was faulted in the composition that extends it."""
    write(tmp_path, LAMP, "lamp.toml")
    one = write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\nerror = 'lamp.toml'\n",
        "one.toml",
    )
    two = extending_one(tmp_path, "")
    assert problems(two) == [
        f"{one}: composition.regions.error: not a usable region name (an identifier that is no "
        f"keyword, record attribute or counter); found validating {two}, which extends it"
    ]


def lamp_counting(counter: str) -> str:
    """Return LAMP with its counter ``n`` called ``counter``."""
    return re.sub(r"\bn\b", counter, LAMP)


def test_a_region_clash_an_extension_brings_is_named_in_the_extension(tmp_path: Path) -> None:
    """A counter an extension adds, named like a base's region, was filed in the base.

    The shipped spec validates on its own: the fix is in the file that adds the counter.
    """
    write(tmp_path, lamp_counting("host"), "mh.toml")
    mine = write(
        tmp_path,
        "[composition]\nextends = 'fsm_cache:residency'\nname = 'mine'\n"
        "[composition.regions]\nextra = 'mh.toml'\n",
        "mine.toml",
    )
    assert problems(mine) == [
        f"{mine}: composition.regions.extra: counter 'host' is also the name of region 'host' "
        "(each is an attribute of the record); rename one"
    ]


def test_a_counter_clash_of_a_replaced_region_is_named_in_the_extension(tmp_path: Path) -> None:
    """A region replaced in place keeps its place: order did not tell which file is at fault."""
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, lamp_counting("m"), "switch.toml")
    write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'lamp.toml'\nb = 'switch.toml'\n",
        "one.toml",
    )
    two = extending_one(tmp_path, "[composition.regions]\na = 'switch.toml'\n")
    assert problems(two) == [f"{two}: composition.regions.a: counter 'm' also in region 'b'"]


def test_a_type_an_extension_brings_is_named_in_the_extension(tmp_path: Path) -> None:
    """A region added makes the alias ``BState``: a base counter or region of that name was filed in the base."""
    write(tmp_path, lamp_counting("BState"), "mb.toml")
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, lamp_counting("k"), "mk.toml")
    five = write(
        tmp_path,
        "[composition]\nname = 'five'\n[composition.regions]\na = 'mb.toml'\n",
        "five.toml",
    )
    six = write(
        tmp_path,
        "[composition]\nextends = 'five.toml'\nname = 'six'\n[composition.regions]\nb = 'lamp.toml'\n",
        "six.toml",
    )
    assert load_spec(five).name == "five"
    typed = (
        "is the type of the states of region 'b' in the types fsm-cache types writes, where a "
        "field of that name would hide it from the fields after it (mypy rejects the file); rename one"
    )
    assert problems(six) == [
        f"{six}: composition.regions.b: counter 'BState' of region 'a' {typed}"
    ]
    write(
        tmp_path,
        "[composition]\nname = 'five'\n[composition.regions]\nBState = 'mk.toml'\n",
        "five.toml",
    )
    assert load_spec(five).name == "five"
    assert problems(six) == [f"{six}: composition.regions.b: region 'BState' {typed}"]


def test_a_region_clash_inside_the_base_is_still_named_in_the_base(tmp_path: Path) -> None:
    """Two regions of the base clash: the base's fault, found through each spec built on it."""
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, lamp_counting("a"), "ma.toml")
    one = write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'lamp.toml'\nb = 'ma.toml'\n"
        "c = 'lamp.toml'\n",
        "one.toml",
    )
    write(tmp_path, lamp_counting("k"), "mk.toml")
    two = extending_one(tmp_path, "[composition.regions]\nd = 'mk.toml'\n")
    three = write(tmp_path, "[composition]\nextends = 'two.toml'\nname = 'three'\n", "three.toml")
    name = (
        f"{one}: composition.regions.a: not a usable region name (an identifier that is no "
        "keyword, record attribute or counter)"
    )
    twice = f"{one}: composition.regions.c: counter 'n' also in region 'a'"
    assert problems(two) == [
        f"{name}; found validating {two}, which extends it",
        f"{twice}; found validating {two}, which extends it",
    ]
    assert problems(three) == [
        f"{name}; found validating {three}, which builds on it through {two}",
        f"{twice}; found validating {three}, which builds on it through {two}",
    ]


def test_an_extending_composition_counts_its_own_forbids(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    refuse = "[[forbid]]\nevent = 'press'\nwhen = '{} in [on]'\nerror = 'Busy'\nreason = 'busy'\n"
    write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'lamp.toml'\n"
        + refuse.format("a"),
        "one.toml",
    )
    two = extending_one(tmp_path, refuse.format("z"))
    assert problems(two) == [f"{two}: forbid[0].when: unknown region 'z'"]


def test_extends_faults_name_the_key(tmp_path: Path) -> None:
    missing = write(tmp_path, DIMMER, "dimmer.toml")
    assert problems(missing)[0].startswith(f"{missing}: machine.extends: cannot read ")
    write(tmp_path, "[machine]\nextends = 'loop.toml'\n", "loop.toml")
    looped = write(tmp_path, "[machine]\nextends = 'loop.toml'\n", "start.toml")
    loop = tmp_path / "loop.toml"
    assert problems(looped) == [f"{loop}: machine.extends: a cycle: {loop} extends {loop}"]
    write(tmp_path, "[composition]\nname = 'c'\n[composition.regions]\nx = 'lamp.toml'\n", "c.toml")
    write(tmp_path, LAMP, "lamp.toml")
    wrong = write(tmp_path, "[machine]\nextends = 'c.toml'\n", "wrong.toml")
    assert f"{wrong}: machine.extends: c.toml is not a [machine] file" in problems(wrong)


def test_a_base_that_does_not_load_is_reported_once(tmp_path: Path) -> None:
    missing = write(tmp_path, "[machine]\nextends = 'nope.toml'\nname = 'a'\n", "a.toml")
    assert problems(missing) == [
        f"{missing}: machine.extends: cannot read {tmp_path / 'nope.toml'}: No such file or directory"
    ]
    composition = write(tmp_path, "[composition]\nextends = 'a.toml'\nname = 'c'\n", "c.toml")
    # A base of the wrong kind is not built: its faults are not c's.
    assert problems(composition) == [
        f"{composition}: composition.extends: a.toml is not a [composition] file",
    ]
    write(tmp_path, "[composition]\nextends = 'e.toml'\nname = 'd'\n", "d.toml")
    e = write(tmp_path, "[composition]\nextends = 'd.toml'\nname = 'e'\n", "e.toml")
    d = tmp_path / "d.toml"
    assert problems(e) == [
        f"{d}: composition.extends: a cycle: {e} extends {d} extends {e}",
    ]


def test_a_cycle_of_two_machines_is_reported_once(tmp_path: Path) -> None:
    one = write(tmp_path, "[machine]\nextends = 'two.toml'\nname = 'one'\n", "one.toml")
    two = write(tmp_path, "[machine]\nextends = './one.toml'\nname = 'two'\n", "two.toml")
    assert problems(one) == [  # one file, named as it was first reached
        f"{two}: machine.extends: a cycle: {one} extends {two} extends {one}"
    ]


def test_a_chain_too_long_is_reported_once(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "s10.toml")
    for i in range(10):
        write(tmp_path, f"[machine]\nextends = 's{i + 1}.toml'\nname = 's{i}'\n", f"s{i}.toml")
    assert problems(tmp_path / "s0.toml") == [
        f"{tmp_path / 's8.toml'}: machine.extends: more than 8 specs extend one another"
    ]
    assert isinstance(load_spec(tmp_path / "s2.toml"), MachineSpec)


def test_a_cycle_through_a_region_and_an_extends_is_refused(tmp_path: Path) -> None:
    """A region's machine that extends the composition holding it is a cycle, not a RecursionError."""
    machine = write(tmp_path, "[machine]\nname = 'a'\nextends = 'c.toml'\n", "a.toml")
    composition = write(
        tmp_path, "[composition]\nname = 'c'\n[composition.regions]\nr = 'a.toml'\n", "c.toml"
    )
    assert problems(composition) == [
        f"{machine}: machine.extends: a cycle: {composition}, whose region r is {machine} "
        f"extends {composition}"
    ]
    # From the machine's side the composition is a base of the wrong kind, refused unbuilt.
    assert problems(machine) == [f"{machine}: machine.extends: c.toml is not a [machine] file"]


def test_a_cycle_through_a_base_compositions_region_is_refused(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    write(
        tmp_path,
        "[composition]\nname = 'base'\n[composition.regions]\nr = 'm.toml'\n",
        "base.toml",
    )
    m = write(tmp_path, "[machine]\nname = 'm'\nextends = 'top.toml'\n", "m.toml")
    top = write(
        tmp_path,
        "[composition]\nname = 'top'\nextends = 'base.toml'\n[composition.regions]\nx = 'lamp.toml'\n",
        "top.toml",
    )
    base = tmp_path / "base.toml"
    assert problems(top) == [
        f"{m}: machine.extends: a cycle: {top} extends {base}, whose region r is {m} extends {top}"
    ]


def test_chains_of_extends_count_apart_on_either_side_of_a_region(tmp_path: Path) -> None:
    """A composition's chain and its region's chain are bounded each by MAX_EXTENDS, not together."""
    write(tmp_path, LAMP, "m9.toml")
    for i in range(9):
        write(tmp_path, f"[machine]\nextends = 'm{i + 1}.toml'\nname = 'm{i}'\n", f"m{i}.toml")
    write(tmp_path, "[composition]\nname = 'c9'\n[composition.regions]\nr = 'm1.toml'\n", "c9.toml")
    for i in range(9):
        write(tmp_path, f"[composition]\nextends = 'c{i + 1}.toml'\nname = 'c{i}'\n", f"c{i}.toml")
    assert isinstance(load_spec(tmp_path / "c1.toml"), System)  # 9 compositions, then 9 machines
    assert problems(tmp_path / "c0.toml") == [
        f"{tmp_path / 'c8.toml'}: composition.extends: more than 8 specs extend one another"
    ]
    (tmp_path / "c9.toml").write_text(
        "[composition]\nname = 'c9'\n[composition.regions]\nr = 'm0.toml'\n", encoding="utf-8"
    )
    assert problems(tmp_path / "c9.toml") == [
        f"{tmp_path / 'm8.toml'}: machine.extends: more than 8 specs extend one another"
    ]


def test_regions_that_fan_out_through_extends_are_read_once(tmp_path: Path) -> None:
    """Ten regions per composition, each a machine extending the next composition: one line, not 10**3."""
    for i in range(3):
        regions = "".join(f"{r} = 'm{i + 1}.toml'\n" for r in "abcdefghij")
        write(
            tmp_path,
            f"[composition]\nname = 'c{i}'\n[composition.regions]\n{regions}",
            f"c{i}.toml",
        )
        write(
            tmp_path, f"[machine]\nname = 'm{i + 1}'\nextends = 'c{i + 1}.toml'\n", f"m{i + 1}.toml"
        )
    write(tmp_path, LAMP, "c3.toml")
    assert problems(tmp_path / "c0.toml") == [
        f"{tmp_path / 'm1.toml'}: machine.extends: c1.toml is not a [machine] file"
    ]


def test_a_file_reached_twice_in_one_load_is_read_and_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lamp.toml is one's region and dimmer's base: read once, and its fault named once."""
    reads: list[Path] = []

    def counted(path: Path, name: str | None = None) -> Any:
        reads.append(path)
        return read(path, name)

    read = loader.read_bytes  # spied on: one read per file a load reaches
    monkeypatch.setattr(loader, "read_bytes", counted)
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, DIMMER, "dimmer.toml")
    write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'lamp.toml'\n",
        "one.toml",
    )
    two = write(
        tmp_path,
        "[composition]\nname = 'two'\nextends = 'one.toml'\n[composition.regions]\na = './dimmer.toml'\n",
        "two.toml",
    )
    assert isinstance(load_spec(two), System)
    assert sorted(p.name for p in reads) == ["dimmer.toml", "lamp.toml", "one.toml", "two.toml"]
    broken = write(tmp_path, LAMP.replace('guard = "n == 1"', 'guard = "n = 1"'), "lamp.toml")
    assert problems(two) == [
        f"{broken}: transition[1].guard: expected COUNTER OP INT (OP one of == != < <= > >=), got 'n = 1'"
    ]


def test_a_redeclared_base_state_is_named_with_its_base(tmp_path: Path) -> None:
    lamp = write(tmp_path, LAMP, "lamp.toml")
    text = DIMMER.replace('dim = { doc = "half", invariant = "n == 0" }', 'off = { doc = "again" }')
    dimmer = write(tmp_path, text, "dimmer.toml")
    assert problems(dimmer) == [
        f"{dimmer}: states.off: already a state of the base {lamp} "
        "(a spec that extends another may not redeclare its states)"
    ]


def test_an_extending_composition_replaces_and_adds_regions(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, DIMMER, "dimmer.toml")
    switch = re.sub(r"\bn\b", "m", LAMP).replace('"lamp"', '"switch"')
    write(tmp_path, switch, "switch.toml")
    write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'lamp.toml'\n",
        "one.toml",
    )
    two = write(
        tmp_path,
        "[composition]\nextends = 'one.toml'\nname = 'two'\n"
        "[composition.regions]\na = 'dimmer.toml'\nb = 'switch.toml'\n"
        "[composition.births.dark]\ndoc = 'born dimmed'\nstates = { a = 'dim' }\n",
        "two.toml",
    )
    spec = load_spec(two)
    assert isinstance(spec, System)
    assert [(r, m.name) for r, m in spec.regions] == [("a", "dimmer"), ("b", "switch")]
    assert spec.born() == {"a": "off", "b": "off"}
    assert spec.born("dark") == {"a": "dim", "b": "off"}
    with pytest.raises(KeyError):
        spec.born("bright")


def test_birth_faults(tmp_path: Path) -> None:
    write(tmp_path, LAMP, "lamp.toml")
    bad = write(
        tmp_path,
        "[composition]\nname = 'c'\n[composition.regions]\na = 'lamp.toml'\n"
        "[composition.births.lit]\nstates = { a = 'on' }\n"
        "[composition.births.odd]\nstates = { z = 'on', a = 'nowhere' }\n"
        "[composition.births.empty]\nstates = {}\n",
        "bad.toml",
    )
    assert problems(bad) == [
        f"{bad}: composition.births.empty.states: must be a table of REGION = 'state', got {{}}",
    ]
    bad.write_text(bad.read_text().replace("[composition.births.empty]\nstates = {}\n", ""))
    assert problems(bad) == [
        f"{bad}: composition.births.lit.states.a: the initial counters (n=0) break the invariant of on (n >= 1)",
        f"{bad}: composition.births.odd.states.z: unknown region (regions: a)",
        f"{bad}: composition.births.odd.states.a: unknown state 'nowhere' of a (states of lamp: off, on)",
    ]


def born_one(tmp_path: Path) -> Path:
    """Write lamp, dimmer and switch, and ``one.toml``: a dimmer and a switch, born ``dark``."""
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, DIMMER, "dimmer.toml")
    write(tmp_path, re.sub(r"\bn\b", "m", LAMP).replace('"lamp"', '"switch"'), "switch.toml")
    return write(
        tmp_path,
        "[composition]\nname = 'one'\n[composition.regions]\na = 'dimmer.toml'\nb = 'switch.toml'\n"
        "[composition.births.dark]\nstates = { a = 'dim' }\n",
        "one.toml",
    )


def extending_one(tmp_path: Path, body: str) -> Path:
    return write(tmp_path, f"[composition]\nextends = 'one.toml'\nname = 'two'\n{body}", "two.toml")


def test_a_birth_of_the_base_redeclared_is_named_with_its_base(tmp_path: Path) -> None:
    """It was 'declared twice', twice, and named neither the base nor the rule."""
    one = born_one(tmp_path)
    two = extending_one(tmp_path, "[composition.births.dark]\nstates = { a = 'dim' }\n")
    assert problems(two) == [
        f"{two}: composition.births.dark: already a birth of the base {one} "
        "(a spec that extends another may not redeclare its births)"
    ]


def test_a_birth_redeclared_two_levels_down_names_the_file_declaring_it(tmp_path: Path) -> None:
    """It named the base the spec extends, which declares no birth."""
    one = born_one(tmp_path)
    two = extending_one(tmp_path, "")
    body = "[composition]\nextends = 'two.toml'\nname = 'three'\n"
    three = write(
        tmp_path, body + "[composition.births.dark]\nstates = { a = 'dim' }\n", "three.toml"
    )
    assert problems(three) == [
        f"{three}: composition.births.dark: already a birth of {one}, which this spec builds on "
        f"through {two} (a spec that extends another may not redeclare its births)"
    ]


def test_two_births_of_the_same_states_are_refused(tmp_path: Path) -> None:
    """A region a birth leaves out is in its initial state: b off makes the base's dark again."""
    born_one(tmp_path)
    two = extending_one(
        tmp_path, "[composition.births.dimmed]\nstates = { a = 'dim', b = 'off' }\n"
    )
    assert problems(two) == [
        f"{two}: composition.births.dimmed: the same states as birth dark (a dim, b off)"
    ]


def test_a_birth_of_the_initial_states_is_refused(tmp_path: Path) -> None:
    """It was accepted: a second name for what ``Engine.new`` without a birth does."""
    born_one(tmp_path)
    two = extending_one(tmp_path, "[composition.births.plain]\nstates = { a = 'off' }\n")
    assert problems(two) == [
        f"{two}: composition.births.plain: the initial states (a off, b off): "
        "a node given no birth is born so"
    ]


def test_a_base_birth_the_extending_regions_lack_names_the_base(tmp_path: Path) -> None:
    """Replacing the dimmer by the lamp leaves dark's state undeclared; the fault is the base's birth."""
    one = born_one(tmp_path)
    two = extending_one(tmp_path, "[composition.regions]\na = 'lamp.toml'\n")
    assert problems(two) == [
        f"{one}: composition.births.dark.states.a: unknown state 'dim' of a "
        f"(states of lamp: off, on); found validating {two}, which extends it"
    ]


def test_an_extending_birth_of_a_missing_region_or_a_broken_invariant(tmp_path: Path) -> None:
    born_one(tmp_path)
    two = extending_one(
        tmp_path,
        "[composition.births.far]\nstates = { c = 'on' }\n"
        "[composition.births.lit]\nstates = { b = 'on' }\n",
    )
    assert problems(two) == [
        f"{two}: composition.births.far.states.c: unknown region (regions: a, b)",
        f"{two}: composition.births.lit.states.b: the initial counters (m=0) break the invariant of on (m >= 1)",
    ]


MINE = """
[composition]
extends = "fsm_cache:residency"
name = "mine"

[composition.regions]
host = "fsm_cache:host_residency"
"""


def test_a_spec_extends_a_shipped_spec_by_name(tmp_path: Path) -> None:
    """``fsm_cache:NAME`` reads the shipped copy, in extends and in a region, from any folder."""
    spec = load_spec(write(tmp_path, MINE, "mine.toml"))
    residency = load_shipped("residency")
    assert isinstance(spec, System)
    assert isinstance(residency, System)
    assert (spec.name, spec.regions, spec.forbids) == ("mine", residency.regions, residency.forbids)
    assert spec_files(tmp_path / "mine.toml") == [
        tmp_path / "mine.toml",
        spec_dir() / "residency.toml",
        spec_dir() / "host_residency.toml",
        spec_dir() / "device_residency.toml",
    ]


def test_a_name_no_shipped_spec_has_is_refused_with_the_names(tmp_path: Path) -> None:
    names = ", ".join(shipped_names())
    assert "residency" in names.split(", ")
    text = MINE.replace("fsm_cache:residency", "fsm_cache:residency.toml")
    text = text.replace("fsm_cache:host_residency", "fsm_cache:../specs/host_residency")
    mine = write(tmp_path, text, "mine.toml")
    assert problems(mine) == [
        f"{mine}: composition.extends: no shipped spec 'residency.toml' (shipped: {names})",
        f"{mine}: composition.regions.host: no shipped spec '../specs/host_residency' "
        f"(shipped: {names})",
    ]
    machine = write(tmp_path, "[machine]\nextends = 'fsm_cache:residency'\n", "m.toml")
    assert problems(machine) == [
        f"{machine}: machine.extends: fsm_cache:residency is not a [machine] file"
    ]


def test_a_shipped_name_reads_the_installed_copy(tmp_path: Path) -> None:
    """From a wheel's layout (the specs inside the package), run outside the checkout."""
    site = tmp_path / "site"
    package = Path(fsm_cache.__file__).resolve().parent
    shutil.copytree(
        package, site / "fsm_cache", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    shutil.copytree(
        spec_dir(), site / "fsm_cache" / "specs", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "work"
    work.mkdir()
    write(work, MINE, "mine.toml")
    script = (
        "import sys; from fsm_cache.cli.main import main; from fsm_cache.spec.loader import spec_files; "
        "print(*spec_files(__import__('pathlib').Path('mine.toml'))[1:], sep='\\n'); "
        "sys.exit(main(['validate', 'mine.toml']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "FSM_CACHE_PURE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    shipped = site / "fsm_cache" / "specs"
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        str(shipped / "residency.toml"),
        str(shipped / "host_residency.toml"),
        str(shipped / "device_residency.toml"),
        "ok: mine.toml (composition mine of host, device: 8 states, 24 transitions, 35 refusals)",
    ]


def test_the_shipped_storage_composition_builds_on_residency() -> None:
    base, storage = load_shipped("residency"), load_shipped("residency_storage")
    assert isinstance(base, System)
    assert isinstance(storage, System)
    assert [r for r, _ in storage.regions] == ["host", "device", "storage"]
    assert storage.forbids[: len(base.forbids)] == base.forbids
    host = storage.machines["host"]
    assert (
        host.transitions[: len(base.machines["host"].transitions)]
        == base.machines["host"].transitions
    )
    assert storage.born("discovered") == {
        "host": "evicted",
        "device": "absent",
        "storage": "stored",
    }


# -- snapshots ---------------------------------------------------------------------


def test_a_snapshot_builds_the_spec_it_was_read_as_once_every_file_is_gone(
    tmp_path: Path,
) -> None:
    for name in STORAGE_FILES:
        (tmp_path / name).write_bytes((spec_dir() / name).read_bytes())
    spec, files = load_snapshot(tmp_path / "residency_storage.toml")
    assert spec == load_spec(tmp_path / "residency_storage.toml")
    assert files == {
        str((tmp_path / name).resolve()): (spec_dir() / name).read_bytes() for name in STORAGE_FILES
    }
    for name in STORAGE_FILES:
        (tmp_path / name).unlink()
    assert load_spec(tmp_path / "residency_storage.toml", files) == spec


def test_a_file_a_snapshot_lacks_is_not_read_from_disk(tmp_path: Path) -> None:
    for name in ("residency.toml", "host_residency.toml", "device_residency.toml"):
        (tmp_path / name).write_bytes((spec_dir() / name).read_bytes())
    spec = tmp_path / "residency.toml"
    _, files = load_snapshot(spec)
    device = tmp_path / "device_residency.toml"
    del files[str(device.resolve())]
    with pytest.raises(SpecError) as raised:
        load_spec(spec, files)
    assert raised.value.problems == [
        f"{spec}: composition.regions.device: cannot read {device}: {NOT_IN_SNAPSHOT}"
    ]
    with pytest.raises(SpecError) as raised:
        load_spec(spec, {})
    assert raised.value.problems == [f"{spec}: cannot read: {NOT_IN_SNAPSHOT}"]


BUFFER = """
[machine]
name = "buffer"
initial = "free"

[counters]
refs = 0

[states]
free = { invariant = "refs == 0" }
ready = { invariant = "refs == 0" }
held = { invariant = "refs >= 1", counter = "refs" }

[[transition]]
event = "acquire"
source = ["ready", "held"]
dest = "held"
update = "refs += 1"

[[transition]]
event = "release"
source = "held"
dest = "held"
guard = "refs >= 2"
update = "refs -= 1"

[[transition]]
event = "release"
source = "held"
dest = "ready"
guard = "refs == 1"
update = "refs -= 1"

[[transition]]
event = "reclaim"
source = "ready"
dest = "free"

[[transition]]
event = "fill"
source = "free"
dest = "ready"

[[forbid]]
event = "acquire"
source = "free"
error = "NotReady"
reason = "no data"

[[forbid]]
event = "release"
source = ["free", "ready"]
error = "ReleaseAtZero"
reason = "not held"

[[forbid]]
event = "reclaim"
source = ["free", "held"]
error = "BufferBusy"
reason = "only a ready buffer is reclaimed"

[[forbid]]
event = "fill"
source = ["ready", "held"]
error = "AlreadyFilled"
reason = "filled"
"""


def test_the_buffer_is_valid() -> None:
    """The spec the tests below break validates as it is."""
    assert load_spec_text(BUFFER).name == "buffer"


def load_spec_text(text: str) -> MachineSpec:
    spec = spec_from_dict(tomllib.loads(text), "buffer.toml")
    assert isinstance(spec, MachineSpec)
    return spec


def spec_problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec_text(text)
    return info.value.problems


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ('event = "reclaim"\nsource = "ready"', "reclam", "transition[3]"),
        ('event = "release"\nsource = ["free", "ready"]', "relese", "forbid[1]"),
    ],
)
def test_a_misspelt_event_is_pointed_at(old: str, new: str, said: str) -> None:
    """``reclam`` in one transition gave a totality line per state, none naming the transition.

    ``reclaim`` is used once too, by a forbid listing more states: it is
    taken for the name meant, and its use is named.
    """
    meant = old.split('"')[1]
    there = " (forbid[2])" if meant == "reclaim" else ""
    assert spec_problems(BUFFER.replace(old, old.replace(meant, new))) == [
        f"buffer.toml: {said}.event: {new!r} appears in no other transition or forbid; "
        f"did you mean {meant!r}{there}?"
    ]


def test_a_misspelt_event_leaves_the_gaps_it_does_not_explain() -> None:
    """Only the gaps the slip leaves are dropped: another event's stay, after the hint."""
    text = BUFFER.replace(
        'event = "reclaim"\nsource = "ready"', 'event = "reclam"\nsource = "ready"'
    )
    text = text.replace(
        'source = ["free", "ready"]\nerror = "ReleaseAtZero"',
        'source = "free"\nerror = "ReleaseAtZero"',
    )
    assert spec_problems(text) == [
        "buffer.toml: transition[3].event: 'reclam' appears in no other transition or forbid; "
        "did you mean 'reclaim' (forbid[2])?",
        "buffer.toml: states.ready: event 'release' is neither a transition nor a forbid when refs=0 (not total)",
    ]


def test_an_event_used_once_and_total_is_no_slip() -> None:
    """``fills``, close to ``fill`` and used once, covers every state: a spec may have it."""
    text = (
        BUFFER
        + '\n[[transition]]\nevent = "fills"\nsource = ["free", "ready", "held"]\ndest = "free"\nupdate = "refs = 0"\n'
    )
    assert "fills" in load_spec_text(text).event_names


@pytest.mark.parametrize("key", ["transition", "forbid"])
def test_a_state_named_twice_in_a_source_list_is_refused(key: str) -> None:
    """``source = ["ready", "ready", "held"]`` was accepted without a word."""
    old = (
        'source = ["ready", "held"]\ndest'
        if key == "transition"
        else 'source = ["free", "held"]\nerror'
    )
    text = BUFFER.replace(old, old.replace('["', '["held", "'))
    index = 0 if key == "transition" else 2
    assert spec_problems(text) == [f"buffer.toml: {key}[{index}].source: state 'held' named twice"]


def test_a_repeated_transition_without_a_guard_is_named_as_a_whole() -> None:
    """It was reported at ``transition[5].guard``, a key the transition did not have."""
    text = BUFFER + '\n[[transition]]\nevent = "reclaim"\nsource = "ready"\ndest = "free"\n'
    assert spec_problems(text) == [
        "buffer.toml: transition[5]: overlaps transition[3] on reclaim in ready when refs=0 "
        "(non-deterministic)"
    ]


# -- the files a spec is read from ----------------------------------------------


def test_the_files_of_a_spec_are_those_its_load_reads_in_its_order() -> None:
    """:func:`spec_files` walked the files itself, a second rule beside the loader's.

    It pushed and popped them, so the regions came before the base they
    extend; it is now the loader's own walk: the spec, its base and the
    base's regions, then its own regions, each once.
    """
    path = spec_dir() / "residency_storage.toml"
    files = spec_files(path)
    assert [file.name for file in files] == [
        "residency_storage.toml",
        "residency.toml",
        "host_residency.toml",
        "device_residency.toml",
        "host_storage_residency.toml",
        "storage_residency.toml",
    ]
    assert all(file.parent == spec_dir() for file in files)
    _, read = load_snapshot(path)
    assert sorted(os.path.realpath(file) for file in files) == sorted(read)


def test_the_files_of_a_spec_that_does_not_load_are_those_it_reached(tmp_path: Path) -> None:
    """A file that cannot be read is among them (what reads them must see it appear);
    one past where the load stopped following (a region of the wrong kind) is not."""
    write(tmp_path, LAMP, "lamp.toml")
    write(tmp_path, "[machine]\nextends = 'loop.toml'\n", "loop.toml")
    inner = "[composition]\nname = 'inner'\n[composition.regions]\nr = 'lamp.toml'\n"
    write(tmp_path, inner, "inner.toml")
    regions = "x = 'missing.toml'\ny = './loop.toml'\nz = 'inner.toml'\nw = 'loop.toml'\n"
    comp = write(tmp_path, f"[composition]\nname = 'c'\n[composition.regions]\n{regions}", "c.toml")
    names = ("missing.toml", "loop.toml", "inner.toml")
    assert spec_files(comp) == [comp, *(tmp_path / name for name in names)]
