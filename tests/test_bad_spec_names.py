"""Spec names and files that once passed the checks and then broke a command (a review's findings).

Each input gets one clear line and exit status 2 (or a clean stale-file report),
never a traceback, and no generated code runs anything a name smuggles in.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fsm_cache.cli.main import main
from fsm_cache.diagram import render
from fsm_cache.errors import BadArgument
from fsm_cache.modelcheck.check import check_spec
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, StateSpec, System
from fsm_cache.spec.stubs import stub
from fsm_cache.spec.validate import problems


BASE = """
[machine]
name = "m"
initial = "idle"

[counters]
pins = 0

[states]
idle = { invariant = "pins == 0" }
held = { invariant = "pins >= 1" }

[[transition]]
event = "pin"
source = ["idle", "held"]
dest = "held"
update = "pins += 1"

[[transition]]
event = "release"
source = "held"
dest = "held"
guard = "pins >= 2"
update = "pins -= 1"

[[transition]]
event = "release"
source = "held"
dest = "idle"
guard = "pins == 1"
update = "pins -= 1"

[[forbid]]
event = "release"
source = "idle"
error = "ReleaseAtZero"
reason = "no pin"
"""


def write(folder: Path, text: str, name: str = "m.toml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, (out + err).strip()


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (
            'event = "pin"',
            'event = "pin\\n"',
            "transition[0].event: missing or not an identifier: 'pin\\n'",
        ),
        ('event = "pin"', 'event = "class"', "transition[0].event: 'class' is a Python keyword"),
        (
            'event = "pin"',
            'event = "_take"',
            "transition[0].event: missing or not an identifier: '_take'",
        ),
        (  # a list, as a source takes: it read as no name at all
            'event = "pin"',
            'event = ["pin"]',
            "transition[0].event: one name, not a list: ['pin']",
        ),
        (  # shown inline in a refusal's message: a line break forged a line of its own
            'reason = "no pin"',
            'reason = "no pin\\nerror: forged\\u001b[31m"',
            "forbid[0].reason: not one line of printable text (no line break, tab or other "
            "control character): 'no pin\\nerror: forged\\x1b[31m'",
        ),
        (
            'initial = "idle"',
            'initial = "idle"\nlabel = "line1\\nline2\\u0007"',
            "machine.label: not one line of printable text (no line break, tab or other "
            "control character): 'line1\\nline2\\x07'",
        ),
        ("pins = 0\n", "pins = 0\n__init__ = 0\n", "counters.__init__: not an identifier"),
        ("pins = 0\n", "pins = 0\nrec = 0\n", "counters.rec: 'rec' is reserved"),
        (
            'update = "pins += 1"',
            'update = "pins += 1"\neffect = ["go"]',
            "transition[0].effect: one name, not a list: ['go']",
        ),
        (
            'update = "pins += 1"',
            'update = "pins += 1"\neffect = nan',
            "transition[0].effect: not an identifier: nan",
        ),
        (
            'update = "pins += 1"',
            'update = "pins += 1"\neffect = true',
            "transition[0].effect: not an identifier: True",
        ),
        (
            'update = "pins += 1"',
            'update = "pins += 1"\neffect = "go\\n"',
            "transition[0].effect: not an identifier: 'go\\n'",
        ),
    ],
)
def test_a_name_that_is_no_plain_identifier_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, old: str, new: str, problem: str
) -> None:
    path = write(tmp_path, BASE.replace(old, new, 1))
    for command in ("validate", "check", "verify"):
        status, text = run(capsys, command, str(path))
        assert status == 2
        assert f"{path}: {problem}" in text


def test_an_events_table_names_its_bad_event_where_it_is_declared(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``[events] return = ...`` was never named: only its uses were, or ``events[0]`` if unused.

    The loader reads ``[events]`` after the transitions and forbids, and says so in that order.
    """
    declared = BASE.replace(
        "[[transition]]", '[events]\nreturn = { past = "returned" }\n\n[[transition]]', 1
    )
    used = write(tmp_path, declared.replace('"release"', '"return"'), "used.toml")
    assert run(capsys, "validate", str(used)) == (
        2,
        "\n".join(
            f"error: {used}: {where}: 'return' is a Python keyword"
            for where in (
                "transition[1].event",
                "transition[2].event",
                "forbid[0].event",
                "events.return",
            )
        ),
    )
    unused = write(tmp_path, declared, "unused.toml")
    assert run(capsys, "validate", str(unused)) == (
        2,
        f"error: {unused}: events.return: 'return' is a Python keyword",
    )


def test_a_region_name_python_would_rewrite_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write(tmp_path, BASE, "base.toml")
    for region in ("ﬁ", "__class__"):
        comp = write(
            tmp_path,
            f'[composition]\nname = "c"\n[composition.regions]\n"{region}" = "base.toml"\n',
            "c.toml",
        )
        status, text = run(capsys, "validate", str(comp))
        assert (status, text) == (
            2,
            f"error: {comp}: composition.regions.{region}: not a usable region name "
            "(an identifier that is no keyword, record attribute or counter)",
        )


def test_a_counter_redeclared_by_an_extending_spec_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = write(tmp_path, BASE, "base.toml")
    child = write(
        tmp_path, '[machine]\nextends = "base.toml"\nname = "x"\n[counters]\npins = 0\n', "x.toml"
    )
    status, text = run(capsys, "validate", str(child))
    assert (status, text) == (
        2,
        f"error: {child}: counters.pins: already a counter of the base {base} (a spec that "
        "extends another may not redeclare its counters)",
    )


def test_verify_takes_names_that_were_its_own(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An event named Result, a spec name with a space or a slash: all contracts confirmed."""
    for old, new in (('event = "pin"', 'event = "Result"'), ('name = "m"', 'name = "m v2.1/x"')):
        path = write(tmp_path, BASE.replace(old, new).replace('"pin"', '"Result"'))
        status, text = run(capsys, "verify", str(path))
        assert status == 0, text
        assert text.splitlines()[-1].startswith("8 contracts: 8 confirmed over all paths")


def test_a_spec_name_never_becomes_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = 'x"""; import os; os.environ["FSM_PWNED"] = "1"; """'
    path = write(tmp_path, BASE.replace('name = "m"', f"name = '{payload}'"))
    module = tmp_path / "stub_m.py"
    module.write_text(stub(load_spec(path)), encoding="utf-8")
    monkeypatch.delenv("FSM_PWNED", raising=False)
    loaded = _import(module)
    assert "FSM_PWNED" not in __import__("os").environ
    assert payload in (loaded.__doc__ or "")


def test_a_spec_without_events_gets_a_stub_that_imports(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[machine]\nname = "still"\ninitial = "a"\n[states]\na = { final = true }\n'
    )
    module = tmp_path / "stub_still.py"
    module.write_text(stub(load_spec(path)), encoding="utf-8")
    assert _import(module).Event.__name__ == "NoReturn"


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop(path.stem, None)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[tool\n", "invalid TOML: Expected ']' at the end of a table declaration"),
        ("[tool]\nfsm_cache = 5\n", "tool.fsm_cache: expected a table"),
        ("[tool.fsm_cache]\nverify = 'fast'\n", "tool.fsm_cache.verify: expected a table"),
        ("[tool.fsm_cache.verify]\njobs = 0\n", "tool.fsm_cache.verify.jobs: must be > 0, got 0"),
        (
            "[tool.fsm_cache.verify]\nper_condition_timeout = -1\n",
            "tool.fsm_cache.verify.per_condition_timeout: must be > 0, got -1.0",
        ),
    ],
)
def test_verify_refuses_a_bad_pyproject(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    problem: str,
) -> None:
    path = write(tmp_path, BASE)
    (tmp_path / "pyproject.toml").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    status, out = run(capsys, "verify", str(path))
    assert status == 2
    assert out.startswith(f"error: {tmp_path / 'pyproject.toml'}: {problem}")


def test_verify_and_check_refuse_a_module_that_is_no_python(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = write(tmp_path, BASE)
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n", encoding="utf-8")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    binary = tmp_path / "binary.py"
    binary.write_bytes(b"\xff\xfe\x00")
    assert run(capsys, "verify", str(broken)) == (
        2,
        f"error: {broken}:1: not valid Python: invalid syntax",
    )
    status, text = run(capsys, "verify", str(binary))
    assert (status, text.split(": cannot read the module:")[0]) == (2, f"error: {binary}")
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"x = 1\0\n")
    status, text = run(capsys, "verify", str(nul))  # ValueError on 3.10, no line on 3.11
    assert (status, text.split(": not valid Python:")[0]) == (2, f"error: {nul}")
    deep = tmp_path / "deep.py"
    deep.write_text("x = " + "-" * 20000 + "1\n", encoding="utf-8")
    assert run(capsys, "verify", str(deep)) == (
        2,
        f"error: {deep}: too deeply nested to parse",
    )
    status, text = run(capsys, "check", "--nodes", "2", "--ops", str(raising), str(spec))
    assert (status, text) == (2, f"error: {raising}: cannot import: RuntimeError: boom")


def test_a_file_that_is_not_utf8_is_no_file_of_ours(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """fsm-cache writes UTF-8 with a mark: such a file is refused, as ``--write`` refuses it."""
    spec = write(tmp_path, BASE)
    target = tmp_path / "m.pyi"
    target.write_bytes(b"\xff\xfe")
    assert run(capsys, "types", str(spec), "--check", str(target)) == (
        2,
        f"error: {target}: is not a types file fsm-cache wrote",
    )
    diagram = tmp_path / "m.mmd"
    diagram.write_bytes(b"\xff\xfe")
    assert run(capsys, "diagram", str(spec), "-o", str(diagram), "--check") == (
        2,
        f"error: {diagram}: is not a diagram file fsm-cache wrote",
    )


def test_check_spec_refuses_a_tree_of_no_nodes(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    for nodes in (0, -1):
        with pytest.raises(BadArgument) as refused:
            check_spec(path, nodes, Bounds({}))
        assert str(refused.value) == f"check: nodes must be an int >= 1, got {nodes}"


def test_a_markdown_cell_keeps_its_pipe_and_its_lines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = BASE.replace(
        'held = { invariant = "pins >= 1" }',
        'held = { invariant = "pins >= 1", doc = "held by a | b" }',
    )
    path = write(tmp_path, text)
    status, out = run(capsys, "diagram", "--format", "md", str(path))
    assert status == 0
    assert "held by a \\| b |" in out


_NOT_A_TITLE = "not one line of printable text (no line break, tab or other control character)"


@pytest.mark.parametrize(
    "name", ["door\\n    open --> locked : forged", "end\\nstate X", "a\\tb", ""]
)
def test_a_spec_name_must_be_one_printable_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    path = write(tmp_path, BASE.replace('name = "m"', f'name = "{name}"'))
    status, text = run(capsys, "validate", str(path))
    assert status == 2
    shown = repr(name.encode().decode("unicode_escape"))
    why = "missing or not a string" if not name else _NOT_A_TITLE
    assert text == f"error: {path}: machine.name: {why}: {shown}"


def test_a_composition_name_must_be_one_printable_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write(tmp_path, BASE, "m.toml")
    comp = write(
        tmp_path, '[composition]\nname = "c\\nd"\n[composition.regions]\na = "m.toml"\n', "c.toml"
    )
    status, text = run(capsys, "validate", str(comp))
    assert (status, text) == (2, f"error: {comp}: composition.name: {_NOT_A_TITLE}: 'c\\nd'")


def test_a_name_built_in_code_is_checked_and_escaped_by_every_renderer() -> None:
    name = "door\n    open --> locked : forged `x`"
    spec = MachineSpec(name, "a", (), (StateSpec("a", final=True),), (), source="<python>")
    assert problems(spec) == [f"<python>: machine.name: {name!r}: {_NOT_A_TITLE}"]
    escaped = "door\\n    open --> locked : forged `x`"
    lines = render(spec, "mermaid").splitlines()
    assert lines[1] == f"    %% {escaped}: generated by fsm-cache diagram"
    assert all("forged" not in line for line in lines[2:])
    assert render(spec, "dot").splitlines()[:2] == [
        f"// {escaped}: generated by fsm-cache diagram",
        'digraph "door\\\\n    open --> locked : forged `x`" {',
    ]
    system = System(name, (("one", spec), ("two", spec)), source="<python>")
    assert render(system, "md").splitlines()[2] == f"**Region `one`: `` {escaped} ``**"
