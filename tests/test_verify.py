"""fsm-cache verify: generated contracts, the spec's meaning, CrossHair rows and options."""

from __future__ import annotations

import argparse
import enum
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import symtable
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import too_big_toml
from pools import ACCEPTED, REFUSED, pool
from processes import all_gone
from tier_specs import TIER

from fsm_cache.cli.main import main
from fsm_cache.contracts import exhaustive, verify
from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.contracts.generate import generate
from fsm_cache.contracts.runner import Contract, Options, Row
from fsm_cache.engine.core import Engine
from fsm_cache.errors import FsmCacheError, IllegalTransition, SpecError
from fsm_cache.spec.loader import load_spec, spec_from_dict
from fsm_cache.spec.machine import System, as_system
from fsm_cache.spec.meaning import step
from fsm_cache.spec.shipped import load_shipped, residency_system, spec_dir
from fsm_cache.spec.validate import valuations


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    verify.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


def test_meaning_agrees_with_the_engine_on_every_state_and_valuation() -> None:
    system = residency_system()
    engine = Engine(system)
    host, device = system.machines["host"], system.machines["device"]
    checked = 0
    for hs, ds in itertools.product(host.states, device.states):
        for hc, dc in itertools.product(
            valuations(host, hs.invariant), valuations(device, ds.invariant)
        ):
            for event in system.event_names:
                rec = engine.new(1)
                rec.host, rec.device = hs.name, ds.name
                for name, value in {**hc, **dc}.items():
                    setattr(rec, name, value)
                want = step(system, event, {"host": hs.name, "device": ds.name}, {**hc, **dc})
                try:
                    engine.fire(rec, event)
                    got: tuple[object, ...] = ("", rec.host, rec.device, rec.pins, rec.locks)
                except IllegalTransition as exc:
                    got = (type(exc).__name__, rec.host, rec.device, rec.pins, rec.locks)
                assert got == want, (hs.name, ds.name, hc, dc, event)
                checked += 1
    assert checked > 500


def test_meaning_refuses_release_at_zero_and_changes_nothing() -> None:
    out = step(
        residency_system(),
        "release",
        {"host": "backed", "device": "resident"},
        {"pins": 0, "locks": 0},
    )
    assert out == ("ReleaseAtZero", "backed", "resident", 0, 0)


def test_meaning_reads_the_parent_and_children() -> None:
    system = residency_system()
    states = {"host": "backed", "device": "absent"}
    counters = {"pins": 0, "locks": 0}
    assert (
        step(system, "load", states, counters, parent={"host": "backed", "device": "absent"})[0]
        == "ParentNotResident"
    )
    assert step(system, "load", states, counters) == ("", "pinned", "loading", 1, 0)
    kids = [{"host": "backed", "device": "absent"}]
    assert step(system, "evict_host", states, counters, children=kids)[0] == "NotAHostLeaf"


def test_generated_module_holds_the_engines_code_and_the_contracts(tmp_path: Path) -> None:
    path = spec_dir() / "residency.toml"
    module = generate(residency_system(), path)
    assert "def _fire_pin(rec):" in module.source
    assert "def _fire_write(rec):" in module.source  # effects: the fast path a cache runs
    assert "        _fx_start_write(rec)\n" in module.source
    assert "def _step_lock(rec):" in module.source  # propagates: the plan path
    assert "'release changes pins by exactly -1'" in module.source
    assert "'pins moves by at most one (writing(N), pinned(N) count holders)'" in module.source
    assert (
        "def _event_load(host: _HostState, device: _DeviceState, pins: int, locks: int, parent_device: _Optional[_DeviceState]) -> _Result:"
        in module.source
    )
    assert module.functions == residency_system().event_names
    written = module.write(tmp_path)
    assert written.name == "contracts_residency.py"
    compile(written.read_text(), str(written), "exec")


def test_device_spec_confirmed_over_all_paths(tmp_path: Path) -> None:
    rows = verify.verify_spec(spec_dir() / "device_residency.toml", Options(), tmp_path)
    assert rows
    assert {r.status for r in rows} == {crosshair_run.CONFIRMED}
    assert {r.function for r in rows} == set(residency_system().machines["device"].event_names)
    assert "lock changes locks by exactly +1" in {r.contract for r in rows if r.function == "lock"}


_DOOR = """\
[machine]
name = "door"
initial = "shut"

[states]
shut = {}
open = {}

[[transition]]
event = "swing"
source = "shut"
dest = "open"

[[transition]]
event = "swing"
source = "open"
dest = "shut"
"""


def _bell(counter: str) -> str:
    """A machine that counts its rings in ``counter``, carried by ``ringing``.

    As ``ringing`` carries it, the module holds the contract ``counter moves
    by at most one``, which reads the counter beside the result's.
    """
    return f"""\
[machine]
name = "bell"
initial = "quiet"

[counters]
{counter} = 0

[states]
quiet = {{}}
ringing = {{ counter = "{counter}" }}

[[transition]]
event = "ring"
source = "quiet"
dest = "ringing"
update = "{counter} += 1"

[[transition]]
event = "ring"
source = "ringing"
dest = "quiet"
"""


def _house(door: str, when: str) -> str:
    """A composition of a door (as region ``door``) and the bell, ring refused ``when``."""
    forbid = f'\n[[forbid]]\nevent = "ring"\nwhen = "{when}"\nerror = "Open"\nreason = "open"\n'
    return f"""\
[composition]
name = "house"

[composition.regions]
{door} = "door.toml"
bell = "bell.toml"
{forbid if when else ""}"""


# Names the loader accepts that once made the module the generated code broke on: a
# parameter for the parent's or a child's state named as a counter, a region named as
# a method's receiver, a state Enum refuses as a member name, a counter named as a
# builtin a contract called (abs: `abs(result.abs - abs)` called the int), a counter or
# region named as the argument icontract gives a postcondition itself (OLD).
_CLASHES = {
    "a counter named as the parent's state": ("parent_door", "door", "parent door in [open]"),
    "a counter named as a child's state": ("child1_door", "door", "any child door in [open]"),
    "a region named self": ("rings", "self", ""),
    "a state named mro": ("rings", "door", ""),
    "a counter named abs": ("abs", "door", ""),
    "a counter named OLD": ("OLD", "door", ""),
    "a region named OLD": ("rings", "OLD", "parent OLD in [open]"),
}


@pytest.mark.parametrize("case", list(_CLASHES))
def test_names_the_loader_accepts_are_verified(tmp_path: Path, case: str) -> None:
    counter, door, when = _CLASHES[case]
    (tmp_path / "door.toml").write_text(
        _DOOR.replace("shut", "mro") if case.endswith("mro") else _DOOR
    )
    (tmp_path / "bell.toml").write_text(_bell(counter))
    path = tmp_path / "house.toml"
    path.write_text(_house(door, when))
    module = generate(as_system(load_spec(path)), path)
    compile(module.source, "contracts_house.py", "exec")
    rows = verify.verify_spec(path, Options(), tmp_path)
    assert {r.function for r in rows} == {"swing", "ring"}
    assert {r.status for r in rows} == {crosshair_run.CONFIRMED}


# Builtins (and names icontract and the module use) that fsm-cache validate accepts as
# names: the module's code that takes a spec's names calls none of them, so each is
# checked as any other name, in every role the loader lets it take.
_BUILTIN_NAMES = (
    "abs", "all", "any", "dict", "getattr", "int", "isinstance", "len", "list", "max", "min",
    "object", "print", "range", "set", "setattr", "str", "sum", "tuple", "type",
    "Exception", "RuntimeError", "State", "OLD",
)  # fmt: skip

_TYPED = frozenset({"int", "object", "State"})
"""Of those, the types ``fsm-cache types`` annotates fields with, which the loader refuses
as a counter's or a region's name: these are a state, an event and an effect only."""


def _named_door(name: str) -> str:
    """A door whose open state, event and effect are all called ``name``."""
    return f"""\
[machine]
name = "door"
initial = "shut"

[states]
shut = {{}}
{name} = {{}}

[[transition]]
event = "{name}"
source = "shut"
dest = "{name}"
effect = "{name}"

[[transition]]
event = "{name}"
source = "{name}"
dest = "shut"
"""


def _named_house(folder: Path, name: str, region: str, counter: str) -> Path:
    """Write a house of a :func:`_named_door` (region ``region``) and a bell counting in ``counter``.

    Its rules read the parent's door and the children's bells, so the checked
    functions take a neighbour's states too.
    """
    folder.mkdir()
    (folder / "door.toml").write_text(_named_door(name))
    (folder / "bell.toml").write_text(_bell(counter))
    path = folder / "house.toml"
    path.write_text(f"""\
[composition]
name = "house"

[composition.regions]
{region} = "door.toml"
bell = "bell.toml"

[[forbid]]
event = "ring"
when = "parent {region} in [{name}]"
error = "Open"
reason = "the parent is open"

[[forbid]]
event = "{name}"
when = "any child bell in [ringing]"
error = "Ringing"
reason = "a child rings"
""")
    return path


@pytest.mark.parametrize("name", _BUILTIN_NAMES)
def test_names_of_builtins_are_checked_on_every_input_in_every_role(
    tmp_path: Path, name: str
) -> None:
    field = name not in _TYPED
    houses = {_named_house(tmp_path / "region", name, name if field else "door", "rings"): "rings"}
    if field:
        houses[_named_house(tmp_path / "counter", name, "door", name)] = name
    for path, counter in houses.items():
        system = as_system(load_spec(path))
        module = generate(system, path)
        written = module.write(path.parent)
        rows = exhaustive.check_module("house", written, exhaustive.counter_domains(system))
        reported = [module.reported(r) for r in rows]
        assert {r.function for r in reported} == {name, "ring"}
        moves = f"{counter} moves by at most one (ringing(N) counts holders)"
        assert moves in {r.contract for r in reported}
        assert [(r.function, r.contract, r.detail) for r in reported if r.failed] == []


def _global_reads(table: symtable.SymbolTable, names: Collection[str], inside: bool) -> set[str]:
    """Return the globals and builtins read without a leading ``_`` where ``names`` may be bound.

    That is in a function or lambda taking one of ``names`` as a parameter,
    and in every scope inside one (a comprehension), where a spec's name
    would be read for a builtin of the same name.
    """
    params = table.get_parameters() if isinstance(table, symtable.Function) else ()
    inside = inside or bool(set(params) & set(names))
    found = set()
    if inside:
        found = {
            s.get_name()
            for s in table.get_symbols()
            if s.is_global() and s.is_referenced() and not s.get_name().startswith("_")
        }
    for child in table.get_children():
        found |= _global_reads(child, names, inside)
    return found


@pytest.mark.parametrize("spec", [*sorted(p.name for p in spec_dir().glob("*.toml")), "house"])
def test_code_taking_a_specs_names_reads_no_builtin(tmp_path: Path, spec: str) -> None:
    path = (
        _named_house(tmp_path / "house", "open", "door", "rings")
        if spec == "house"
        else spec_dir() / spec
    )
    system = as_system(load_spec(path))
    names = [n for n, _ in (*system.regions, *system.counters)]
    source = generate(system, path).source
    assert _global_reads(symtable.symtable(source, "contracts.py", "exec"), names, False) == set()


def test_a_neighbours_state_named_as_a_counter_is_spelled_apart(tmp_path: Path) -> None:
    (tmp_path / "door.toml").write_text(_DOOR)
    (tmp_path / "bell.toml").write_text(_bell("parent_door"))
    path = tmp_path / "house.toml"
    path.write_text(_house("door", "parent door in [open]"))
    module = generate(as_system(load_spec(path)), path)
    assert (
        "def _event_ring(door: _DoorState, bell: _BellState, parent_door: int, "
        "_parent_door: _Optional[_DoorState]) -> _Result:"
    ) in module.source


def test_a_state_enum_refuses_is_a_member_no_state_is_named() -> None:
    spec = {
        "machine": {"name": "lamp", "initial": "mro"},
        "states": {"mro": {}, "mro_": {}},
        "transition": [
            {"event": "turn", "source": "mro", "dest": "mro_"},
            {"event": "turn", "source": "mro_", "dest": "mro"},
        ],
    }
    module = generate(as_system(spec_from_dict(spec)), "lamp.toml")
    line = "_State = _enum.Enum('State', [('mro__', 'mro'), ('mro_', 'mro_')])"
    assert f"\n{line}\n" in module.source
    made: dict[str, Any] = {"_enum": enum}
    exec(line, made)
    assert [m.value for m in made["_State"]] == ["mro", "mro_"]


_HOST_MUTANTS = {
    # event: (the engine's function, what it says, the mutant), one realistic slip each
    "release": ("_fire_release", "if c_pins == 1:", "if c_pins == 2:"),  # guard off by one
    "load_done": ("_fire_load_done", "_refuse(rec, 34)", "return"),  # a give-back at zero
    "pin": ("_fire_pin", "rec.pins = rec.pins + 1", "rec.pins = rec.pins + 2"),
    "write_failed": ("_fire_write_failed", "if c_pins >= 1:", "if c_pins > 1:"),
    "load_failed": ("_fire_load_failed", "rec.pins = c_pins - 1", "rec.pins = c_pins"),
    # the right class from another event's table: pin's NoHostCopy, "no valid host copy to pin"
    "evict_host": ("_fire_evict_host", "_refuse(rec, 23)", "_refuse(rec, 15)"),
}


def test_crosshair_refutes_each_slip_in_the_engines_counter_code(tmp_path: Path) -> None:
    """The spec is right and the code the engine runs is not: only CrossHair can tell.

    Every spec-level control is a bug in a spec; these are bugs in the generated
    code, found only by comparing it with the spec (``the step follows the spec``)
    and by the counter contracts. Each event's slip is refuted, and only it.
    """
    path = spec_dir() / "host_residency.toml"
    module = generate(as_system(load_spec(path)), path)
    source = module.source
    for function, old, new in _HOST_MUTANTS.values():
        start = source.index(f"def {function}(rec):")
        body = source[start : source.index("\ndef ", start + 1)]
        assert old in body, function
        source = source.replace(body, body.replace(old, new, 1))
    planted = tmp_path / "contracts_host_residency.py"
    planted.write_text(source)
    rows = [
        module.reported(r)
        for r in crosshair_run.prove("host", planted, Options(), by_function=True)
    ]
    refuted: dict[str, set[str]] = {}
    for row in rows:
        if row.status != crosshair_run.CONFIRMED:
            assert row.status == crosshair_run.COUNTEREXAMPLE, row
            assert row.detail.startswith(f"{row.function}(State."), row
            refuted.setdefault(row.function, set()).add(row.contract)
    holders = "pins moves by at most one (writing(N), pinned(N) count holders)"
    assert refuted == {
        "release": {
            "every state's invariant holds",
            holders,
            "release changes pins by exactly -1",
            "the step follows the spec",
        },
        "load_done": {"load_done changes pins by exactly -1", "the step follows the spec"},
        "pin": {holders, "pin changes pins by exactly +1", "the step follows the spec"},
        "write_failed": {"every state's invariant holds", "the step follows the spec"},
        "load_failed": {"load_failed changes pins by exactly -1", "the step follows the spec"},
        "evict_host": {"the step follows the spec"},
    }
    confirmed = {"write", "write_done", "load"}
    assert {r.function for r in rows} - set(refuted) == confirmed


def test_cli_json_rows_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    status = _cli(["verify", "--json", str(spec_dir() / "device_residency.toml")])
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    assert out["controls"] == []
    assert out["rows"][0]["target"] == "device_residency"
    assert all(r["status"] == "confirmed over all paths" for r in out["rows"])


def test_cli_reports_a_counterexample_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status = _cli(["verify", str(spec_dir() / "bugs_detected" / "pin_steps_by_two.toml")])
    out = capsys.readouterr().out
    assert status == 1
    assert "counterexample: pin(State.backed, 0)" in out
    assert out.splitlines()[-1].startswith("contracts: ") is False
    assert "1 counterexample" in out


_EXITS_AT_IMPORT = """
import os
import sys

from icontract import ensure


@ensure(lambda result: result >= 0)
def square(x: int) -> int:
    return x * x


sys.exit({status})
"""


def test_a_module_that_exits_when_imported_is_named_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CrossHair imports the module: ``sys.exit()`` there ended it with nothing printed.

    Status 3 read ``CrossHair failed on FILE: no output``, and status 0 left
    each contract ``CrossHair did not report this contract``: neither said why.
    """
    exits = tmp_path / "exits.py"
    exits.write_text(_EXITS_AT_IMPORT.format(status=3))
    assert main(["verify", str(exits)]) == 2
    assert capsys.readouterr().err == (
        f"error: CrossHair failed on {exits}: it exited with status 3 and printed nothing,"
        " as when the module calls sys.exit() while it is imported\n"
    )
    # killed by a signal (the out-of-memory killer, say): it was said to call sys.exit()
    exits.write_text(_EXITS_AT_IMPORT.replace("sys.exit({status})", "os.kill(os.getpid(), 9)"))
    assert main(["verify", str(exits)]) == 2
    assert capsys.readouterr().err == (
        f"error: CrossHair failed on {exits}: it was killed by SIGKILL and printed nothing"
        " (out of memory, or stopped from outside)\n"
    )
    exits.write_text(_EXITS_AT_IMPORT.format(status=0))
    assert main(["verify", str(exits)]) == 1
    (row, _) = capsys.readouterr().out.splitlines()
    assert row.split("  ")[-1] == (
        "not analysed: CrossHair did not report this contract: it printed nothing at all, as"
        " when the module exits with status 0 (sys.exit()) while it is imported"
    )


def test_unknown_target_is_a_clear_error() -> None:
    with pytest.raises(
        SpecError, match=r"^no_such\.module: not a spec file, a \.py file or an importable module$"
    ):
        verify.verify_target("no_such.module", Options(), Path())


def test_a_target_that_is_no_module_file_says_what_it_is(tmp_path: Path) -> None:
    """A folder, a named pipe or a frozen module were each ``no such file``."""
    folder = tmp_path / "d.py"
    folder.mkdir()
    pipe = tmp_path / "fifo.py"
    os.mkfifo(pipe)
    cases = [
        (str(folder), "Is a directory"),
        (str(pipe), "not a regular file (a named pipe)"),
        (str(tmp_path / "gone.py"), "no such file"),
    ]
    found = importlib.util.find_spec("os.path")
    if found is not None and not found.has_location:  # frozen in CPython 3.11
        cases.append(("os.path", f"a {found.origin} module, with no source file to verify"))
    for target, why in cases:
        with pytest.raises(SpecError) as caught:
            verify.verify_target(target, Options(), Path())
        assert str(caught.value) == f"{target}: {why}"


def test_parse_maps_lines_to_contracts() -> None:
    known = {
        ("/m.py", 10): Contract("/m.py", 10, 10, "pin", "a", (9, 16)),
        ("/m.py", 11): Contract("/m.py", 11, 11, "pin", "b", (9, 16)),
        ("/m.py", 12): Contract("/m.py", 12, 12, "pin", "c", (9, 16)),
        # a decorator over lines 20 to 23: CrossHair names its lambda's line, 21
        ("/m.py", 20): Contract("/m.py", 20, 23, "unpin", "d", (19, 30)),
    }
    report = (
        "/m.py:10: info: Confirmed over all paths.\n"
        "/m.py:11: error: false when calling pin(State.backed, 0) (which returns Result(error=''))\n"
        "/m.py:12: info: Unable to meet precondition.\n"
        "/m.py:21: info: Confirmed over all paths.\n"
    )
    assert crosshair_run.read_report("m", report, known) == (
        {
            ("/m.py", 10): (crosshair_run.CONFIRMED, ""),
            ("/m.py", 11): (crosshair_run.COUNTEREXAMPLE, "pin(State.backed, 0)"),
            ("/m.py", 12): (crosshair_run.NOT_ANALYSED, "unable to meet precondition"),
            ("/m.py", 20): (crosshair_run.CONFIRMED, ""),
        },
        [],
    )


_TWO_FUNCTIONS = """import icontract


@icontract.ensure(lambda result: result >= 0, "never negative")
def good(n: int) -> int:
    return abs(n)


@icontract.require(lambda n: 0 < n < 0)
@icontract.ensure(lambda result: result >= 0, "never negative")
def impossible(n: int) -> int:
    return n


@icontract.ensure(lambda result: result >= 0, "never negative")
@icontract.ensure(lambda result: result <= 5, "at most five")
def seven(n: int) -> int:
    if n == 7:
        raise ValueError("seven")
    return min(abs(n), 5)
"""


def test_a_report_on_a_functions_other_lines_is_on_each_of_its_contracts(
    tmp_path: Path,
) -> None:
    """CrossHair reports a precondition it cannot meet on that precondition's line, and a raise
    in a body on the body's line, once for all of a function's contracts. Both were put on
    the contract just above: the previous function's, which had been confirmed, and one
    contract of ``seven``, the other left "not reported"."""
    path = tmp_path / "two.py"
    path.write_text(_TWO_FUNCTIONS)
    rows = crosshair_run.prove("two", path, Options())
    assert [(r.function, r.contract, r.verdict()) for r in rows] == [
        ("good", "never negative", crosshair_run.CONFIRMED),
        ("impossible", "never negative", "not analysed: unable to meet precondition"),
        ("seven", "never negative", "counterexample: seven(7) raises ValueError: seven"),
        ("seven", "at most five", "counterexample: seven(7) raises ValueError: seven"),
    ]


def test_row_verdicts() -> None:
    assert (
        Row("t", "f", "c", crosshair_run.WITHIN_BUDGET).verdict()
        == "no counterexample within budget"
    )
    bad = Row("t", "f", "c", crosshair_run.COUNTEREXAMPLE, "f(1)")
    assert bad.verdict() == "counterexample: f(1)"
    assert bad.failed
    assert Row("t", "f", "c", crosshair_run.WITHIN_BUDGET).failed  # unknown is not proved
    assert not Row("t", "f", "c", crosshair_run.CONFIRMED).failed
    assert not Row("t", "f", "c", exhaustive.CONFIRMED_EVERY_INPUT, "4 inputs").failed


_ENDLESS = """# crosshair: per_condition_timeout=0.5
import icontract


@icontract.require(lambda n: n >= 0)
@icontract.ensure(lambda result: result == 0, "counts down to zero")
def count_down(n: int) -> int:
    while n > 0:  # a path for every n: CrossHair never exhausts them
        n -= 1
    return n
"""


def test_a_contract_crosshair_runs_out_of_time_on_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It holds, but CrossHair only tried some n: exit 0 reported a proof there was none of."""
    path = tmp_path / "endless.py"
    path.write_text(_ENDLESS)
    status = _cli(["verify", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    assert lines[0] == "endless.count_down  counts down to zero  no counterexample within budget"
    assert lines[1].startswith("1 contracts: 0 confirmed over all paths, ")
    assert lines[2:] == [
        "1 contract(s) unknown: CrossHair ran out of time before exhausting their paths; "
        "raise per_condition_timeout in [tool.fsm_cache.verify] of pyproject.toml, or in the "
        "module's '# crosshair:' directive, to prove or refute them"
    ]


def test_options_come_from_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        "[tool.fsm_cache.verify]\nper_condition_timeout = 3\njobs = 1\n"
    )
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    assert verify.load_options(sub) == Options(per_condition_timeout=3.0, jobs=1)


def test_a_spec_gets_its_projects_options_wherever_verify_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI read the pyproject of the working directory, the pytest items the spec's.

    Run from a sub-package with a pyproject of its own (or from outside the
    project), ``fsm-cache verify`` proved a spec with other budgets than its
    ``fsm-verify`` item; now both read the pyproject nearest the spec.
    """
    root = tmp_path / "project"
    (root / "specs").mkdir(parents=True)
    (root / "tools").mkdir()
    (root / "pyproject.toml").write_text(
        "[tool.fsm_cache.verify]\nper_condition_timeout = 3\njobs = 1\n"
    )
    (root / "tools" / "pyproject.toml").write_text("[project]\nname = 'tools'\n")
    (tmp_path / "pyproject.toml").write_text("[tool.fsm_cache.verify]\njobs = 4\n")
    (root / "specs" / "door.toml").write_text(_BUILTIN_EVENTS)
    given: list[Options] = []

    def verify_target(target: str, options: Options, *_: object) -> list[Row]:
        given.append(options)
        return []

    monkeypatch.setattr(verify, "verify_target", verify_target)
    runs = [
        (root, "specs/door.toml"),
        (root / "specs", "door.toml"),
        (root / "tools", "../specs/door.toml"),
        (tmp_path, "project/specs/door.toml"),
    ]
    for cwd, spec in runs:
        monkeypatch.chdir(cwd)
        assert main(["verify", spec]) == 0
    assert main(["verify", "--jobs", "2", "project/specs/door.toml"]) == 0
    capsys.readouterr()
    pinned = Options(per_condition_timeout=3.0, jobs=1)
    assert given == [pinned] * len(runs) + [Options(per_condition_timeout=3.0, jobs=2)]
    assert verify.options_for(root / "specs" / "door.toml") == pinned  # the pytest items' call


def test_options_default_without_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert verify.load_options(tmp_path) == Options()


def test_bad_option_is_named(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.fsm_cache.verify]\nper_condition_timout = 3\n")
    with pytest.raises(SpecError) as info:
        verify.load_options(tmp_path)
    assert info.value.problems == [
        f"{path}: tool.fsm_cache.verify.per_condition_timout: unknown option"
    ]
    path.write_text("[tool.fsm_cache.verify]\njobs = 'two'\n")
    with pytest.raises(SpecError) as info:
        verify.load_options(tmp_path)
    assert info.value.problems == [f"{path}: tool.fsm_cache.verify.jobs: expected int"]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("jobs = 100000000000", "jobs: must be at most 256, got 100000000000"),
        ("per_path_timeout = inf", "per_path_timeout: must be at most 3600, got inf"),
        ("per_condition_timeout = nan", "per_condition_timeout: must be > 0, got nan"),
        (
            "analysis_kind = 'bogus --evil'",
            "analysis_kind: must be one or more of PEP316, asserts, deal, hypothesis, "
            "icontract, comma-separated, got 'bogus --evil'",
        ),
    ],
)
def test_an_option_out_of_range_is_named(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(f"[tool.fsm_cache.verify]\n{line}\n")
    with pytest.raises(SpecError) as info:
        verify.load_options(tmp_path)
    assert info.value.problems == [f"{path}: tool.fsm_cache.verify.{problem}"]


def test_analysis_kinds_may_be_combined(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        "[tool.fsm_cache.verify]\nanalysis_kind = 'icontract,asserts'\n"
    )
    assert verify.load_options(tmp_path) == Options(analysis_kind="icontract,asserts")


def test_a_modules_crosshair_directive_sets_its_budget(tmp_path: Path) -> None:
    path = tmp_path / "contracts.py"
    path.write_text(
        "# crosshair: per_condition_timeout=30 per_path_timeout=5\n"
        "def f() -> None:\n"
        "    # crosshair: per_path_timeout=9\n"  # a function's own directive: not the module's
        "    pass\n"
    )
    assert crosshair_run.with_directives(Options(jobs=1), path) == Options(
        per_condition_timeout=30.0, per_path_timeout=5.0, jobs=1
    )
    path.write_text("x = 1\n")
    assert crosshair_run.with_directives(Options(jobs=1), path) == Options(jobs=1)


def test_a_malformed_crosshair_directive_is_named(tmp_path: Path) -> None:
    path = tmp_path / "contracts.py"
    path.write_text("x = 1\n# crosshair: per_condition_timout=30\n")
    with pytest.raises(FsmCacheError) as info:
        crosshair_run.with_directives(Options(), path)
    assert (
        str(info.value) == f'{path}:2: crosshair directive: Unknown option: "per_condition_timout"'
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_interrupt_stops_crosshair_at_once(tmp_path: Path) -> None:
    """A SIGINT to fsm_cache alone waited for each CrossHair worker to finish its contracts.

    A terminal's Ctrl-C reaches CrossHair too; an IDE's stop button or ``kill -INT``
    reaches fsm_cache's process only, and leaving the thread pool waited for the
    workers: two minutes on ``residency.toml`` before ``interrupted``. The proof runs
    in a process of its own, as the command line does, and gets the SIGINT once both
    (stand-in) CrossHair processes run; it must end at once, and take them with it.
    (A user's module is checked whole, in one process: split by function, as a
    generated module is, it runs in two.)
    """
    running = tmp_path / "running"
    running.mkdir()
    fake = tmp_path / "fake" / "crosshair"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(running)!r}, str(os.getpid())).touch()\n"
        "time.sleep(60)\n"
    )
    module = tmp_path / "contracts_two.py"
    module.write_text(
        "import icontract\n\n\n"
        "@icontract.ensure(lambda result: result >= 0, 'never negative')\n"
        "def one(n: int) -> int:\n    return abs(n)\n\n\n"
        "@icontract.ensure(lambda result: result >= 0, 'never negative')\n"
        "def two(n: int) -> int:\n    return abs(n)\n"
    )
    path = [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    # The real CrossHair reads the directives; its processes run the stand-in. A shell
    # starts background jobs with SIGINT ignored (`make test &`), and a process keeps
    # that: the proof takes SIGINT as Python does by default, whoever started pytest.
    proof = (
        "import os, pathlib, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from fsm_cache.contracts.runner import Options, prove\n"
        "import crosshair.codeconfig\n"
        "os.environ['PYTHONPATH'] = sys.argv[2]\n"
        "prove('two', pathlib.Path(sys.argv[1]), Options(jobs=2), by_function=True)\n"
    )
    argv = [sys.executable, "-c", proof, str(module), os.pathsep.join(path)]
    with subprocess.Popen(argv) as child:
        deadline = time.monotonic() + 60
        while len(list(running.iterdir())) < 2 and time.monotonic() < deadline:
            assert child.poll() is None, "the proof ended before CrossHair ran"
            time.sleep(0.05)
        workers = [int(p.name) for p in running.iterdir()]
        assert len(workers) == 2
        began = time.monotonic()
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == -signal.SIGINT  # an uncaught KeyboardInterrupt
    assert time.monotonic() - began < 30
    assert all_gone(workers)


def test_the_allocator_contracts_set_a_budget_that_exhausts_them() -> None:
    from fsm_cache.contracts import pages as pool_contracts

    options = crosshair_run.with_directives(Options(), Path(pool_contracts.__file__))
    assert options.per_condition_timeout == 30.0


# -- three regions: every representative input ------------------------------------
def test_a_three_region_composition_is_checked_on_every_representative_input(
    tmp_path: Path,
) -> None:
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    rows = verify.verify_spec(spec_dir() / "residency_storage.toml", Options(), tmp_path)
    assert {r.status for r in rows} == {exhaustive.CONFIRMED_EVERY_INPUT}
    assert {r.function for r in rows} == set(storage.event_names)
    fetch = [r for r in rows if r.function == "fetch" and r.contract == "the step follows the spec"]
    # host 6 x device 3 x storage 4 x pins 5 x locks 4 x a parent: its device 3 x host 6,
    # or none (its states are None alike: 19 of the 4 x 7 that counted None apart)
    assert [r.detail for r in fetch] == [f"{6 * 3 * 4 * 5 * 4 * (3 * 6 + 1)} inputs"]
    assert exhaustive.counter_domains(storage) == {"pins": (0, 1, 2, 3, 4), "locks": (0, 1, 2, 3)}


_TIERS = {
    "tier.toml": TIER.format(name="tier"),
    "mark.toml": TIER.format(name="mark"),
    "flag.toml": TIER.format(name="flag"),
    "pair.toml": """
[composition]
name = "pair"
label = "node"
doc = "Two tiers side by side."

[composition.regions]
tier = "tier.toml"
mark = "mark.toml"

[[forbid]]
event = "drop"
when = "mark in [filling]"
error = "CopyInFlight"
reason = "the mark is still being filled"
""",
    "tiers.toml": """
[composition]
extends = "pair.toml"
name = "tiers"
doc = "The two tiers, and a third."

[composition.regions]
flag = "flag.toml"
""",
}
"""A composition of three regions, checked on every input as ``residency_storage`` is,
that extends a base with a refusal of its own, on 27 inputs per event against its 200,000:
what the tests below check (which route a spec takes, which version of its files is
proved) is decided by its regions and its files, not by how many inputs it has."""


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        # a refusal's reason in the base the composition extends: the steps the contracts
        # were generated from refuse with the old reason, the spec read again the new
        (
            "pair.toml",
            'reason = "the mark is still being filled"',
            'reason = "the mark is being filled"',
        ),
        # a region of that base no longer TOML: the spec read again did not load
        ("mark.toml", "[machine]", "[machine"),
    ],
    ids=["reworded", "garbled"],
)
def test_a_spec_saved_over_while_it_is_verified_is_proved_as_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, old: str, new: str
) -> None:
    """The contracts module read the spec's files again when imported: two versions mixed."""
    for name, text in _TIERS.items():
        (tmp_path / name).write_text(text)
    generated = generate

    def then_saved_over(*args: Any, **kwargs: Any) -> Any:
        module = generated(*args, **kwargs)
        text = (tmp_path / file).read_text()
        assert old in text or new in text  # saved over after the first module generated
        (tmp_path / file).write_text(text.replace(old, new, 1))  # as an editor saves it
        return module

    monkeypatch.setattr(verify, "generate", then_saved_over)
    work = tmp_path / "work"
    work.mkdir()
    rows = verify.verify_spec(tmp_path / "tiers.toml", Options(), work)
    assert {r.status for r in rows} == {exhaustive.CONFIRMED_EVERY_INPUT}
    assert {r.function for r in rows} == {"fill", "drop"}


def test_every_input_finds_a_planted_bug_in_the_engines_code(tmp_path: Path) -> None:
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    module = generate(storage, spec_dir() / "residency_storage.toml")
    planted = module.source.replace(
        "if rec.storage in ('storing',) and rec.pins == 1:", "if False:"
    )
    assert planted != module.source
    path = tmp_path / "contracts_planted.py"
    path.write_text(planted)
    rows = _checked(path, storage, "release")
    bad = [module.reported(r) for r in rows if r.status == crosshair_run.COUNTEREXAMPLE]
    assert {(r.function, r.contract) for r in bad} == {("release", "the step follows the spec")}
    assert bad[0].detail == (
        "release(host=HostState.writing, device=DeviceState.resident, "
        "storage=StorageState.storing, pins=1, locks=0)"
    )


@pytest.mark.parametrize(
    ("slip", "event", "call"),
    [
        # StorePinHeld, but "the last pin belongs to the store in flight (storage storing)":
        # the reason and the regions named of the other StorePinHeld
        (
            ("_fire_release", "_refuse(rec, 32)", "_refuse(rec, 31)"),
            "release",
            "release(host=HostState.writing, device=DeviceState.loading, "
            "storage=StorageState.storing, pins=2, locks=0)",
        ),
        # NotLoading with its reason, but the host's: "load_done refused in pinned (pins=1)"
        # where the device refuses, "refused in resident (locks=0)"
        (
            ("_fire_load_done", "_refuse(rec, 57)", "_refuse(rec, 53)"),
            "load_done",
            "load_done(host=HostState.pinned, device=DeviceState.resident, "
            "storage=StorageState.unstored, pins=1, locks=0)",
        ),
    ],
)
def test_a_refusal_of_the_right_class_with_the_wrong_message_is_a_counterexample(
    tmp_path: Path, slip: tuple[str, str, str], event: str, call: str
) -> None:
    """The contracts compared a refusal's class alone: another reason or region passed."""
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    module = generate(storage, spec_dir() / "residency_storage.toml")
    path = _planted(tmp_path, storage, *slip)
    rows = _checked(path, storage, event)
    bad = [module.reported(r) for r in rows if r.failed]
    assert [(r.function, r.contract, r.verdict()) for r in bad] == [
        (event, "the step follows the spec", f"{crosshair_run.COUNTEREXAMPLE}: {call}")
    ]


def _checked(path: Path, system: System, event: str) -> list[Row]:
    """Check the event a slip is planted in, on every representative input.

    A slip in ``_fire_EVENT`` reaches only ``_event_EVENT``, its one caller;
    the module's other functions are the shipped module's, which the verify
    stage checks whole (about twenty seconds here, against a fraction of one).
    """
    return exhaustive.check_module(
        "planted", path, exhaustive.counter_domains(system), {f"_event_{event}"}
    )


def _planted(tmp_path: Path, system: System, function: str, old: str, new: str) -> Path:
    """Write the contracts module of ``system`` with ``old`` replaced in the engine's ``function``."""
    module = generate(system, spec_dir() / "residency_storage.toml")
    start = module.source.index(f"def {function}(rec):")
    body = module.source[start : module.source.index("\ndef ", start + 1)]
    assert old in body
    path = tmp_path / "contracts_planted.py"
    path.write_text(module.source.replace(body, body.replace(old, new, 1)))
    return path


def test_every_input_reaches_a_constant_only_the_code_compares_with(tmp_path: Path) -> None:
    """The spec's values for pins stop at 4; a release that misfires at 9 was confirmed."""
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    path = _planted(
        tmp_path, storage, "_fire_release", "if c_pins == 1:", "if c_pins == 1 or c_pins == 9:"
    )
    domains = exhaustive.counter_domains(storage)
    rows = _checked(path, storage, "release")
    bad = {r.contract: r.detail for r in rows if r.status == crosshair_run.COUNTEREXAMPLE}
    assert bad.get("the step follows the spec") == (
        "_event_release(host=HostState.pinned, device=DeviceState.resident, "
        "storage=StorageState.unstored, pins=9, locks=0)"
    )
    assert {r.function for r in rows if r.failed} == {"_event_release"}
    assert exhaustive.code_constants(path, domains) == {"pins": {0, 1, 2, 9}, "locks": {0, 1}}
    assert exhaustive.widened(domains, path)["pins"] == (0, 1, 2, 3, 4, 9, 10)


def test_code_that_raises_on_an_input_is_a_counterexample_not_a_traceback(
    tmp_path: Path,
) -> None:
    """A refusal registered at the wrong index raised IndexError out of ``fsm-cache verify``."""
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    path = _planted(tmp_path, storage, "_fire_evict_host", "_refuse(rec, 33)", "_refuse(rec, 9999)")
    rows = _checked(path, storage, "evict_host")
    bad = [r for r in rows if r.failed]
    assert {r.function for r in bad} == {"_event_evict_host"}
    assert {r.status for r in bad} == {crosshair_run.COUNTEREXAMPLE}
    assert len(bad) == len([r for r in rows if r.function == "_event_evict_host"])
    assert bad[0].detail == (
        "_event_evict_host(host=HostState.unbacked, device=DeviceState.resident, "
        "storage=StorageState.unstored, pins=0, locks=0, child1_host=None, child2_host=None, "
        "child3_host=None) raises IndexError: tuple index out of range"
    )


def test_a_contract_that_raises_on_an_input_is_a_counterexample(tmp_path: Path) -> None:
    path = tmp_path / "contracts_divide.py"
    path.write_text(
        "import icontract\n\n\n"
        "@icontract.ensure(lambda result: 12 // result > 0, 'twelve over it is positive')\n"
        "def same(n: int) -> int:\n"
        "    return n\n\n\n"
        "@icontract.ensure(lambda result: result >= 0, 'never negative')\n"
        "def twelve_over(n: int) -> int:\n"
        "    return 12 // n\n"
    )
    rows = exhaustive.check_module("divide", path, {"n": (0, 1, 2)})
    assert [(r.function, r.verdict()) for r in rows] == [
        (
            "same",
            "counterexample: same(n=0): the contract raises "
            "ZeroDivisionError: integer division or modulo by zero",
        ),
        (
            "twelve_over",
            "counterexample: twelve_over(n=0) raises "
            "ZeroDivisionError: integer division or modulo by zero",
        ),
    ]


def test_a_domain_too_large_is_not_analysed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exhaustive, "MAX_INPUTS", 100)
    rows = verify.verify_spec(spec_dir() / "residency_storage.toml", Options(), tmp_path)
    assert all(r.failed for r in rows)
    assert rows[0].verdict() == f"{crosshair_run.NOT_ANALYSED}: 10080 inputs, more than 100"
    # a function that reads children is tried without its extra child (a third, over
    # evict_host's 3 classes or none), and says so
    assert {r.verdict() for r in rows if r.function == "evict_host"} == {
        f"{crosshair_run.NOT_ANALYSED}: {282240 // 4} inputs, more than 100; "
        "families without their extra child (282240 inputs with it, more than 100)"
    }


def test_every_input_finds_a_planted_bug_in_an_effectful_fast_path(tmp_path: Path) -> None:
    storage = load_shipped("residency_storage")
    assert isinstance(storage, System)
    module = generate(storage, spec_dir() / "residency_storage.toml")
    start = module.source.index("def _fire_write(rec):")
    body = module.source[start : module.source.index("\ndef ", start + 1)]
    planted = module.source.replace(
        body, body.replace("        n_host = 'writing'", "        n_host = 'backed'", 1)
    )
    assert planted != module.source
    path = tmp_path / "contracts_planted.py"
    path.write_text(planted)
    rows = _checked(path, storage, "write")
    bad = {
        (module.reported(r).function, r.contract)
        for r in rows
        if r.status == crosshair_run.COUNTEREXAMPLE
    }
    assert ("write", "the step follows the spec") in bad
    assert {function for function, _ in bad} == {"write"}


_BUILTIN_EVENTS = """
[machine]
name = "door"
initial = "closed"

[counters]
locks = 0

[states]
closed = { doc = "closed", invariant = "locks == 0" }
int = { doc = "a state named like a builtin", invariant = "locks == 0" }
locked = { doc = "locked", invariant = "locks >= 1", counter = "locks" }

[[transition]]
event = "int"
source = "closed"
dest = "int"

[[transition]]
event = "bool"
source = "int"
dest = "closed"

[[transition]]
event = "type"
source = ["closed", "locked"]
dest = "locked"
update = "locks += 1"

[[transition]]
event = "abs"
source = "locked"
dest = "closed"
guard = "locks == 1"
update = "locks -= 1"

[[transition]]
event = "abs"
source = "locked"
dest = "locked"
guard = "locks >= 2"
update = "locks -= 1"

[[forbid]]
event = "int"
source = ["int", "locked"]
error = "NotClosed"
reason = "not closed"

[[forbid]]
event = "bool"
source = ["closed", "locked"]
error = "NotInt"
reason = "not int"

[[forbid]]
event = "type"
source = "int"
error = "NotThere"
reason = "not there"

[[forbid]]
event = "abs"
source = ["closed", "int"]
error = "UnlockAtZero"
reason = "not locked"
"""


def test_events_named_like_builtins_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "builtins.toml"
    path.write_text(_BUILTIN_EVENTS)
    system = as_system(load_spec(path))
    module = generate(system, path)
    assert module.functions == ("int", "bool", "type", "abs")
    assert "def _event_int(state: _State, locks: int) -> _Result:" in module.source
    written = module.write(tmp_path)
    rows = exhaustive.check_module("door", written, exhaustive.counter_domains(system))
    reported = [module.reported(r) for r in rows]
    assert {r.status for r in reported} == {exhaustive.CONFIRMED_EVERY_INPUT}
    assert {r.function for r in reported} == {"int", "bool", "type", "abs"}


def test_rows_name_the_event_not_the_checked_function() -> None:
    module = generate(residency_system(), spec_dir() / "residency.toml")
    row = Row("residency", "_event_pin", "c", crosshair_run.COUNTEREXAMPLE, "_event_pin(x=1)")
    assert module.reported(row) == Row("residency", "pin", "c", row.status, "pin(x=1)")
    other = Row("residency", "_event_nope", "c", crosshair_run.CONFIRMED)
    assert module.reported(other) == other


@pytest.mark.usefixtures("default_recursion_limit")
@too_big_toml.CASES
def test_a_pyproject_too_big_for_tomllib_is_bad_input_not_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str,
    message: str,
) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        verify.load_options(tmp_path)
    assert info.value.problems == [f"{path}: invalid TOML: {message}"]
    (tmp_path / "door.toml").write_text(_BUILTIN_EVENTS)
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "door.toml"]) == 2
    assert capsys.readouterr() == ("", f"error: {path}: invalid TOML: {message}\n")


@pytest.mark.parametrize(
    ("init", "why"),
    [
        ("raise RuntimeError('package init failed')\n", "RuntimeError: package init failed"),
        ("import sys\nsys.exit(4)\n", "SystemExit: 4"),
    ],
)
def test_a_package_that_cannot_be_imported_is_named_not_a_traceback_or_an_exit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    init: str,
    why: str,
) -> None:
    package = tmp_path / "fsm_verify_broken_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(init, encoding="utf-8")
    (package / "contracts.py").write_text("", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["verify", "fsm_verify_broken_pkg.contracts"]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: fsm_verify_broken_pkg.contracts: cannot import: {why}\n",
    )


def test_what_an_imported_package_prints_stays_off_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "fsm_verify_noisy_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("print('hello from the package')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["verify", "fsm_verify_noisy_pkg.missing", "--json"]) == 2
    finally:
        sys.modules.pop("fsm_verify_noisy_pkg", None)
    assert capsys.readouterr() == (
        "",
        "hello from the package\nerror: fsm_verify_noisy_pkg.missing: "
        "not a spec file, a .py file or an importable module\n",
    )


@pytest.mark.parametrize(
    ("jobs", "problem"),
    [
        ("0", "must be > 0, got 0"),
        ("-1", "must be > 0, got -1"),
        ("99999999999999", "must be at most 256, got 99999999999999"),
    ],
)
def test_jobs_out_of_range_on_the_command_line_is_refused_as_in_pyproject(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], jobs: str, problem: str
) -> None:
    def run(*_: object, **__: object) -> None:
        raise AssertionError("verify ran with --jobs out of range")

    monkeypatch.setattr(verify, "run", run)
    assert main(["verify", "--jobs", jobs, str(spec_dir() / "host_residency.toml")]) == 2
    assert capsys.readouterr() == ("", f"error: --jobs: {problem}\n")


def _pool_rows(tmp_path: Path, text: str) -> list[Row]:
    path = tmp_path / "pool.toml"
    path.write_text(text)
    system = as_system(load_spec(path))
    module = generate(system, path)
    written = module.write(tmp_path)
    rows = exhaustive.check_module("pool", written, exhaustive.counter_domains(system))
    return [module.reported(r) for r in rows]


def test_an_assignment_the_source_pins_gets_its_exact_change_contract(tmp_path: Path) -> None:
    """``holders = 1`` from ``idle`` and ``holders = 0`` guarded ``holders == 1`` move by one."""
    rows = _pool_rows(tmp_path, pool("holders = 1", "holders = 0", REFUSED))
    exact = {(r.function, r.contract, r.status) for r in rows if "by exactly" in r.contract}
    assert exact == {
        ("acquire", "acquire changes holders by exactly +1", exhaustive.CONFIRMED_EVERY_INPUT),
        ("release", "release changes holders by exactly -1", exhaustive.CONFIRMED_EVERY_INPUT),
    }


def test_a_release_accepted_at_zero_refutes_its_exact_change_contract(tmp_path: Path) -> None:
    """``release`` from ``idle`` to ``idle`` gives back nothing: its -1 contract names the input."""
    rows = _pool_rows(tmp_path, pool("holders = 1", "holders = 0", ACCEPTED))
    bad = [r for r in rows if r.status == crosshair_run.COUNTEREXAMPLE]
    assert [(r.function, r.contract, r.detail) for r in bad] == [
        ("release", "release changes holders by exactly -1", "release(state=State.idle, holders=0)")
    ]


def test_every_bad_target_is_reported_before_any_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad target after a good one was found only once the good one was verified.

    That is minutes of CrossHair on a composition, thrown away by the error;
    now every target is loaded or found first, and every fault is reported.
    """

    def prove(*_: object, **__: object) -> list[Row]:
        raise AssertionError("a target was verified though another is bad")

    monkeypatch.setattr(crosshair_run, "prove", prove)
    monkeypatch.setattr(exhaustive, "check_module", prove)
    missing = tmp_path / "missing.toml"
    status = main(
        ["verify", str(spec_dir() / "host_residency.toml"), str(missing), "no_such.module"]
    )
    assert (status, capsys.readouterr()) == (
        2,
        (
            "",
            f"error: {missing}: cannot read: No such file or directory\n"
            "error: no_such.module: not a spec file, a .py file or an importable module\n",
        ),
    )


def test_no_controls_with_targets_is_refused_where_no_control_would_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The controls run only without targets: ``--no-controls`` with some was dropped unsaid."""

    def run(*_: object, **__: object) -> None:
        raise AssertionError("verify ran though the command line is refused")

    monkeypatch.setattr(verify, "run", run)
    assert main(["verify", "--no-controls", str(spec_dir() / "host_residency.toml")]) == 2
    assert capsys.readouterr() == (
        "",
        "error: verify: --no-controls skips the negative controls, which run only without "
        "SPEC_OR_MODULE arguments; this run has none to skip\n",
    )


def test_a_target_named_twice_in_any_spelling_is_verified_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each repeat was verified again: seconds to minutes of CrossHair for the same rows."""
    verified: list[str] = []

    def verify_target(target: str, *_: object) -> list[Row]:
        verified.append(target)
        return []

    monkeypatch.setattr(verify, "verify_target", verify_target)
    monkeypatch.chdir(spec_dir())
    host = "host_residency.toml"
    again = f"../{spec_dir().name}/{host}"
    argv = ["verify", host, verify.POOL_CONTRACTS, again, verify.POOL_CONTRACTS]
    assert main(argv) == 0
    assert verified == [host, verify.POOL_CONTRACTS]


def test_a_module_named_and_given_as_its_file_is_verified_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fsm_cache.contracts.pages`` and its ``.py`` file are one module: it was proved twice."""
    verified: list[str] = []

    def verify_target(target: str, *_: object) -> list[Row]:
        verified.append(target)
        return []

    monkeypatch.setattr(verify, "verify_target", verify_target)
    from fsm_cache.contracts import pages

    file = pages.__file__
    assert file is not None
    assert main(["verify", verify.POOL_CONTRACTS, file]) == 0
    assert main(["verify", file, verify.POOL_CONTRACTS]) == 0
    assert verified == [verify.POOL_CONTRACTS, file]


def test_a_spec_is_checked_by_its_regions_not_its_files_suffix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A composition of three regions in ``fsm_specs`` as ``x.spec`` went to CrossHair.

    Its file's suffix decided, so its pytest item left contracts unknown after
    minutes where ``fsm-cache verify`` checks every representative input.
    """

    def prove(*_: object) -> list[Row]:
        raise AssertionError("CrossHair was run on a composition of three regions")

    monkeypatch.setattr(crosshair_run, "prove", prove)
    for name, text in _TIERS.items():  # three regions, as residency_storage has
        (tmp_path / name).write_text(text)
    odd = tmp_path / "tiers.spec"
    (tmp_path / "tiers.toml").rename(odd)
    rows = verify.verify_spec(odd, Options(), tmp_path)
    assert {r.status for r in rows} == {exhaustive.CONFIRMED_EVERY_INPUT}
    assert {r.function for r in rows} == {"fill", "drop"}


def test_jobs_where_crosshair_proves_no_target_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A composition of three regions is checked on every input: ``--jobs`` was dropped unsaid."""
    given: list[int] = []

    def run(targets: list[str], jobs: int | None, with_controls: bool) -> dict[str, object]:
        assert jobs is not None
        given.append(jobs)
        return {"rows": [], "controls": [], "seconds": 0.0}

    monkeypatch.setattr(verify, "run", run)
    three = str(spec_dir() / "residency_storage.toml")
    assert main(["verify", "--jobs", "3", three]) == 2
    assert capsys.readouterr() == (
        "",
        "error: verify: --jobs 3 sets CrossHair's processes, and no target is proved by "
        "CrossHair: a composition of 3 or more regions is checked on every representative "
        f"input ({three})\n",
    )
    assert main(["verify", "--jobs", "3", three, str(spec_dir() / "host_residency.toml")]) == 0
    assert given == [3]


def test_verify_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without CrossHair it ended in a ModuleNotFoundError traceback from deep inside."""
    monkeypatch.setattr(crosshair_run, "EXTRA_MODULES", ("crosshair", "no_such_module_here"))
    want = (
        "verification needs no_such_module_here, not installed here; the verify extra "
        "brings it: pip install 'fsm-cache[verify]'"
    )
    spec = spec_dir() / "device_residency.toml"
    assert main(["verify", str(spec)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"error: {want}\n")
    with pytest.raises(FsmCacheError) as caught:
        verify.verify_spec(spec, Options(), tmp_path)
    assert str(caught.value) == want
    assert list(tmp_path.iterdir()) == []  # nothing generated
