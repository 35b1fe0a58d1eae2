"""``fsm-cache validate``: one line per file or problem, exit 2 on any failure, no traceback."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    status = main(["validate", *args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def test_the_shipped_specs_are_ok(capsys: pytest.CaptureFixture[str]) -> None:
    host, residency = spec_dir() / "host_residency.toml", spec_dir() / "residency.toml"
    status, out, err = run(capsys, str(host), str(residency))
    assert (status, err) == (0, [])
    assert len(out) == 2
    assert out[0].startswith(f"ok: {host} (machine host_residency: 5 states, ")
    assert out[1].startswith(f"ok: {residency} (composition residency of host, device: 8 states, ")


def test_the_summary_counts_what_the_file_declares(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "flip.toml"
    path.write_text(FLIP, encoding="utf-8")
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(path), str(comp)) == (
        0,
        [
            f"ok: {path} (machine flip: 2 states, 2 transitions, 2 refusals)",
            f"ok: {comp} (composition pair of one: 2 states, 2 transitions, 3 refusals)",
        ],
        [],
    )


FLIP = """
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
error = "Flipped"
reason = "already flipped"
[[forbid]]
event = "flop"
source = "a"
error = "Flopped"
reason = "already flopped"
"""
PAIR = """
[composition]
name = "pair"
[composition.regions]
one = "flip.toml"
[[forbid]]
event = "flip"
when = "one in [b]"
error = "Stuck"
reason = "stuck"
"""


def test_every_problem_of_every_file_is_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = tmp_path / "flip.toml"
    good.write_text(FLIP, encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        FLIP.replace('source = "b"\ndest', 'source = "c"\ndest').replace(
            "= {}\n[[", "= {}\nc = { final = true }\n[[", 1
        ),
        encoding="utf-8",
    )
    toml = tmp_path / "broken.toml"
    toml.write_text("[machine\n", encoding="utf-8")
    missing = tmp_path / "missing.toml"
    status, out, err = run(capsys, str(bad), str(good), str(toml), str(missing), str(tmp_path))
    assert status == 2
    assert out == [f"ok: {good} (machine flip: 2 states, 2 transitions, 2 refusals)"]
    assert err == [
        f"error: {bad}: states.b: event 'flop' is neither a transition nor a forbid (not total)",
        f"error: {bad}: states.b: not final and has no transition out",
        f"error: {bad}: states.c: unreachable from a",
        f"error: {toml}: invalid TOML: Expected ']' at the end of a table declaration (at line 1, column 9)",
        f"error: {missing}: cannot read: No such file or directory",
        f"error: {tmp_path}: cannot read: Is a directory",
    ]


def test_a_spec_error_in_a_region_file_names_that_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "flip.toml").write_text(
        FLIP.replace('initial = "a"', 'initial = "z"'), encoding="utf-8"
    )
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(comp)) == (
        2,
        [],
        [f"error: {tmp_path / 'flip.toml'}: machine.initial: unknown state 'z'"],
    )


SPEND = """
[machine]
name = "budget"
initial = "open"
[counters]
tokens = 0
[states]
open = {}
closed = { final = true }
[[transition]]
event = "close"
source = "open"
dest = "closed"
[[transition]]
event = "spend"
source = "open"
dest = "open"
guard = "tokens <= 4096"
[[transition]]
event = "spend"
source = "open"
dest = "open"
guard = "tokens >= 99999999999999999999"
[[forbid]]
event = "spend"
source = "open"
guard = "tokens >= 4097 and tokens <= 99999999999999999998"
error = "OverBudget"
reason = "too many tokens"
"""


def test_big_constants_are_findings_not_tracebacks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = tmp_path / "budget.toml"
    good.write_text(SPEND, encoding="utf-8")
    gap = tmp_path / "gap.toml"
    gap.write_text(SPEND.replace("99999999999999999998", "99999999999999999997"), encoding="utf-8")
    huge = tmp_path / "huge.toml"
    huge.write_text(SPEND.replace("4096", "4" + "0" * 1000), encoding="utf-8")
    assert run(capsys, str(good), str(gap), str(huge)) == (
        2,
        [f"ok: {good} (machine budget: 2 states, 3 transitions, 1 refusals)"],
        [
            f"error: {gap}: states.open: event 'spend' is neither a transition nor a forbid when tokens=99999999999999999998 (not total)",
            f"error: {huge}: transition[1].guard: an integer has 1001 digits, more than 1000",
        ],
    )


def test_a_counter_past_its_cap_set_back_is_validated_not_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Filled past 2**63 and drained to 0: the search once built range(0, 2**63 + 1).
    path = tmp_path / "buf.toml"
    path.write_text(
        """
[machine]
name = "buf"
initial = "empty"
[counters]
bytes = 9223372036854775807
[states]
empty = {}
full = {}
[[transition]]
event = "fill"
source = "empty"
dest = "full"
update = "bytes += 1"
[[transition]]
event = "drain"
source = "full"
dest = "empty"
update = "bytes = 0"
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
""",
        encoding="utf-8",
    )
    assert run(capsys, str(path)) == (
        0,
        [f"ok: {path} (machine buf: 2 states, 2 transitions, 2 refusals)"],
        [],
    )


def test_a_missing_region_file_names_the_composition_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    comp = tmp_path / "pair.toml"
    comp.write_text(PAIR, encoding="utf-8")
    assert run(capsys, str(comp)) == (
        2,
        [],
        [
            f"error: {comp}: composition.regions.one: cannot read {tmp_path / 'flip.toml'}: No such file or directory"
        ],
    )


def test_no_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    _, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        "fsm-cache validate: error: the following arguments are required: SPEC"
    )


def test_an_empty_path_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``''`` would be read as the working directory (``.: cannot read: Is a directory``)."""
    with pytest.raises(SystemExit) as info:
        main(["validate", str(spec_dir() / "residency.toml"), ""])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()[-1]) == (
        "",
        "fsm-cache validate: error: argument SPEC: an empty path names no file",
    )


def test_version_is_the_installed_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``fsm-cache --version`` prints the distribution's version and exits 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"fsm-cache {version('fsm-cache')}\n"


def test_python_dash_m_fsm_cache_is_the_command_line() -> None:
    """``python -m fsm_cache`` runs what the console script runs, exit status included."""
    import subprocess
    from importlib.metadata import version

    ran = subprocess.run(
        [sys.executable, "-m", "fsm_cache", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (ran.returncode, ran.stdout, ran.stderr) == (
        0,
        f"fsm-cache {version('fsm-cache')}\n",
        "",
    )
    bad = subprocess.run(
        [sys.executable, "-m", "fsm_cache", "validate", "no-such.toml"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr


def test_nesting_too_deep_is_a_finding_not_a_recursion_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Defect 9: a value thousands of levels deep is reported, not a RecursionError traceback.

    Brackets overflow tomllib's recursive parser; dotted keys parse without
    recursion into tables just as deep, which quoting back used to overflow.
    The keys have 1000 parts: newer parsers (tomli 2.5, Python 3.10's here) refuse
    a key of more parts than the recursion limit, as "nested too deeply".
    """
    brackets = tmp_path / "brackets.toml"
    brackets.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    dotted = tmp_path / "dotted.toml"
    dotted.write_text(
        FLIP.replace("a = {}", "a = {}\nb.final." + ".".join(["x"] * 998) + " = 1", 1).replace(
            "b = {}\n", ""
        ),
        encoding="utf-8",
    )
    headers = tmp_path / "headers.toml"
    headers.write_text("[" + ".".join(["t"] * 1000) + "]\n", encoding="utf-8")
    # tomllib's parser recurses per bracket: under a limit an earlier test (or a tool) raised,
    # the brackets parse and the depth check reports them instead; hold the default here
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        found = run(capsys, str(brackets), str(dotted), str(headers))
    finally:
        sys.setrecursionlimit(limit)
    assert found == (
        2,
        [],
        [
            f"error: {brackets}: invalid TOML: nested too deeply",
            f"error: {dotted}: states.b.final: nested deeper than 64 levels",
            f"error: {headers}: t.t.t: nested deeper than 64 levels",
        ],
    )


def test_files_that_are_no_spec_at_all(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Binary garbage, another encoding, an empty file, a huge file: one line each, exit 2."""
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(bytes(range(256)))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(FLIP.replace('"already flipped"', '"d\u00e9j\u00e0"').encode("latin-1"))
    empty = tmp_path / "empty.toml"
    empty.write_bytes(b"")
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as file:
        file.truncate(16 * 2**20 + 1)  # sparse: costs no disk
    status, out, err = run(capsys, str(garbage), str(latin), str(empty), str(huge))
    assert (status, out) == (2, [])
    assert err == [
        f"error: {garbage}: invalid TOML: 'utf-8' codec can't decode byte 0x80 in position 128: invalid start byte",
        f"error: {latin}: invalid TOML: 'utf-8' codec can't decode byte 0xe9 in position 238: invalid continuation byte",
        f"error: {empty}: holds no [machine] or [composition] table; a spec file is one of them",
        f"error: {huge}: larger than 16 MiB; not a spec file",
    ]


ALL_INTS = """
[machine]
name = 1
initial = 2
doc = 3
label = 4
[counters]
n = "0"
big = 1{zeros}
[states]
a = {{ doc = 5, final = 6, invariant = 7, counter = 8 }}
b = 9
[events]
flip = {{ doc = 10, past = 11 }}
[[transition]]
event = 12
source = 13
dest = 14
guard = 15
update = 16
effect = 17
propagate = 18
doc = 19
[[forbid]]
event = 20
source = 21
error = 22
reason = 23
guard = 24
when = 25
""".format(zeros="0" * 1000)


def test_every_field_of_the_wrong_type_is_a_located_finding(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "ints.toml"
    path.write_text(ALL_INTS, encoding="utf-8")
    comp = tmp_path / "comp.toml"
    comp.write_text(
        "[composition]\nname = 1\ndoc = 2\nlabel = 3\n"
        'regions = { one = 4, two = "", three = "a\\u0000b", four = [] }\n'
        "[[forbid]]\nevent = 5\nwhen = [6]\nerror = 7\nreason = 8\n"
        "[[forbid]]\nevent = 'e'\nwhen = 9\nerror = 'E'\nreason = 'r'\nsource = 10\n",
        encoding="utf-8",
    )
    odd = tmp_path / "odd.toml"
    odd.write_text("composition = 1\nforbid = {}\n", encoding="utf-8")
    status, out, err = run(capsys, str(path), str(comp), str(odd))
    assert (status, out) == (2, [])
    assert err == [
        f"error: {path}: counters.n: initial value must be an integer >= 0, got '0'",
        f"error: {path}: counters.big: initial value has more than 1000 digits",
        f"error: {path}: states.a.invariant: must be a string, got 7",
        f"error: {path}: states.a.final: must be true or false, got 6",
        f"error: {path}: states.a.counter: must be a counter name, got 8",
        f"error: {path}: states.a.doc: must be a string, got 5",
        f"error: {path}: states.b: must be a table",
        f"error: {path}: transition[0].guard: must be a string, got 15",
        f"error: {path}: transition[0].update: must be a string, got 16",
        f"error: {path}: transition[0].event: missing or not an identifier: 12",
        f"error: {path}: transition[0].dest: missing or not an identifier: 14",
        f"error: {path}: transition[0].source: must be a state name or a list of them, got 13",
        f"error: {path}: transition[0].effect: not an identifier: 17",
        f"error: {path}: transition[0].propagate: must be 'ancestors', got 18",
        f"error: {path}: transition[0].doc: must be a string, got 19",
        f"error: {path}: forbid[0].guard: must be a string, got 24",
        f"error: {path}: forbid[0].when: must be a condition or a list of them, got 25",
        f"error: {path}: forbid[0].source: must be a state name or a list of them, got 21",
        f"error: {path}: forbid[0].event: missing or not an identifier: 20",
        f"error: {path}: forbid[0].error: missing or not an identifier: 22",
        f"error: {path}: forbid[0].reason: missing or not a string",
        f"error: {path}: events.flip.doc: must be a string, got 10",
        f"error: {path}: events.flip.past: must be a string, got 11",
        f"error: {path}: machine.name: missing or not a string",
        f"error: {path}: machine.initial: missing or not a string",
        f"error: {path}: machine.doc: must be a string, got 3",
        f"error: {path}: machine.label: must be a string, got 4",
        f"error: {comp}: composition.regions.one: must be the file name of a machine, got 4",
        f"error: {comp}: composition.regions.two: must be the file name of a machine, got ''",
        f"error: {comp}: composition.regions.three: must be the file name of a machine, got 'a\\x00b'",
        f"error: {comp}: composition.regions.four: must be the file name of a machine, got []",
        f"error: {comp}: forbid[0].when: must be a string, got 6",
        f"error: {comp}: forbid[0].event: missing or not an identifier: 5",
        f"error: {comp}: forbid[0].error: missing or not an identifier: 7",
        f"error: {comp}: forbid[0].reason: missing or not a string",
        f"error: {comp}: forbid[1].when: must be a condition or a list of them, got 9",
        f"error: {comp}: forbid[1].source: must be a state name or a list of them, got 10",
        f"error: {comp}: composition.name: missing or not a string",
        f"error: {comp}: composition.doc: must be a string, got 2",
        f"error: {comp}: composition.label: must be a string, got 3",
        f"error: {odd}: composition: missing table",
        f"error: {odd}: composition.regions: missing: a table of REGION = 'machine.toml'",
    ]


def test_long_values_are_quoted_short(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "long.toml"
    path.write_text(
        FLIP.replace("a = {}", f"a = {{ final = {list(range(100_000))} }}", 1), encoding="utf-8"
    )
    assert run(capsys, str(path)) == (
        2,
        [],
        [f"error: {path}: states.a.final: must be true or false, got [0, 1, 2, 3, 4, 5, ...]"],
    )


def _validate_quietly(path: Path) -> int:
    """Run ``fsm-cache validate PATH`` with its output discarded; return its status."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["validate", str(path)])


_JUNK = ["[counters]", "n = 0", "n = -1", "x = [[[1]]]", "guard = 'n >= 1'", "[states.a]"]
_LINES = st.sampled_from([*FLIP.splitlines(), *PAIR.splitlines(), *_JUNK, "[[x]]", "a.b.c = {}"])


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
        st.lists(_LINES, max_size=30).map(lambda lines: "\n".join(lines).encode()),
    )
)
def test_no_file_content_makes_a_traceback(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    """Whatever the file holds, validate answers 0 or 2: a finding, never a traceback."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "flip.toml").write_text(FLIP, encoding="utf-8")  # for compositions' regions
    path = folder / "spec.toml"
    path.write_bytes(content)
    assert _validate_quietly(path) in (0, 2)


@pytest.mark.parametrize(
    "command",
    [["validate"], ["diagram"], ["check", "--max-states", "100"]],
    ids=["validate", "diagram", "check"],
)
def test_a_cycle_through_a_region_is_an_error_line_in_every_command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """A region whose machine extends the composition: one error line, exit 2, no RecursionError."""
    machine = tmp_path / "a.toml"
    machine.write_text("[machine]\nname = 'a'\nextends = 'c.toml'\n", encoding="utf-8")
    composition = tmp_path / "c.toml"
    composition.write_text(
        "[composition]\nname = 'c'\n[composition.regions]\nr = 'a.toml'\n", encoding="utf-8"
    )
    assert main([*command, str(composition)]) == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == (
        "",
        [
            f"error: {machine}: machine.extends: a cycle: {composition}, whose region r is "
            f"{machine} extends {composition}"
        ],
    )


@pytest.mark.parametrize(
    "command",
    [["validate"], ["diagram"], ["types"], ["verify"], ["check", "--max-states", "100"]],
    ids=["validate", "diagram", "types", "verify", "check"],
)
def test_a_fault_of_a_machine_two_regions_share_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """A machine file two regions name was validated, and its faults printed, once per region."""
    machine = tmp_path / "flip.toml"
    machine.write_text(FLIP.replace('dest = "b"', 'dest = "bb"'), encoding="utf-8")
    composition = tmp_path / "twins.toml"
    composition.write_text(
        "[composition]\nname = 'twins'\n[composition.regions]\n"
        "left = 'flip.toml'\nright = './flip.toml'\n",
        encoding="utf-8",
    )
    assert main([*command, str(composition)]) == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == (
        "",
        [f"error: {machine}: transition[0].dest: unknown state 'bb'"],
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.timeout(20)  # before the fix, validate waited for a writer forever
def test_a_named_pipe_is_an_error_line_not_a_wait(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    comp = tmp_path / "comp.toml"
    comp.write_text("[composition]\nname = 'c'\n[composition.regions]\na = 'fifo.toml'\n")
    assert run(capsys, str(fifo), str(comp)) == (
        2,
        [],
        [
            f"error: {fifo}: cannot read: not a regular file (a named pipe)",
            f"error: {comp}: composition.regions.a: cannot read {fifo}: not a regular file (a named pipe)",
        ],
    )


def test_a_composed_deadlock_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name, there, back in (("door", "open_door", "close_door"), ("bolt", "lock", "unlock")):
        (tmp_path / f"{name}.toml").write_text(
            f'[machine]\nname = "{name}"\ninitial = "a"\n[states]\na = {{}}\nb = {{}}\n'
            f'[[transition]]\nevent = "{there}"\nsource = "a"\ndest = "b"\n'
            f'[[forbid]]\nevent = "{there}"\nsource = "b"\nerror = "E"\nreason = "r"\n'
            f'[[transition]]\nevent = "{back}"\nsource = "b"\ndest = "a"\n'
            f'[[forbid]]\nevent = "{back}"\nsource = "a"\nerror = "E"\nreason = "r"\n',
            encoding="utf-8",
        )
    house = tmp_path / "house.toml"
    house.write_text(
        '[composition]\nname = "house"\n[composition.regions]\ndoor = "door.toml"\nbolt = "bolt.toml"\n'
        '[[forbid]]\nevent = "lock"\nwhen = "door in [b]"\nerror = "DoorOpen"\nreason = "r"\n'
        '[[forbid]]\nevent = "open_door"\nwhen = "bolt in [b]"\nerror = "Bolted"\nreason = "r"\n'
        '[[forbid]]\nevent = "unlock"\nwhen = "door in [a]"\nerror = "NoKeyhole"\nreason = "r"\n',
        encoding="utf-8",
    )
    status, out, err = run(capsys, str(house))
    assert (status, out) == (2, [])
    assert err == [
        f"error: {house}: composition: deadlock at door a, bolt b: every event is refused there (open_door: Bolted, close_door: E, lock: E, unlock: NoKeyhole) and no region is final; reached from the initial states by lock"
    ]


def test_a_file_named_twice_is_validated_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``validate d.toml ./d.toml`` printed each line twice, an error as well as an ``ok:``."""
    monkeypatch.chdir(tmp_path)
    Path("bad.toml").write_text("x = [\n", encoding="utf-8")
    shipped = spec_dir() / "host_residency.toml"
    status, out, err = run(
        capsys, "fsm_cache:host_residency", str(shipped), "bad.toml", "./bad.toml"
    )
    assert (status, out) == (
        2,
        [f"ok: {shipped} (machine host_residency: 5 states, 15 transitions, 14 refusals)"],
    )
    assert len(err) == 1
    assert err[0].startswith("error: bad.toml: invalid TOML: ")


def test_a_file_name_with_a_line_break_or_an_escape_stays_on_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A name holding ``\\nerror: fake.toml`` printed a forged line, and an escape coloured the terminal."""
    forged = tmp_path / "nl\nerror: fake.toml"
    forged.write_text("junk [")
    coloured = tmp_path / "red\x1b[31m.toml"
    coloured.write_text("[machine]\n")
    assert main(["validate", str(forged), str(coloured)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"error: {tmp_path}/nl\\nerror: fake.toml: invalid TOML: ")
    assert all(line.startswith(f"error: {tmp_path}/") for line in lines)  # none forged
    assert all(line.startswith(f"error: {tmp_path}/red\\x1b[31m.toml: ") for line in lines[1:])
    assert "\x1b" not in err
