"""Path arguments of every subcommand: a path that names nothing, or a folder, is a usage error.

``fsm-cache validate``, ``diagram`` and ``types`` refused an empty path from
the start; ``check``, ``verify`` and ``audit`` took it as the working
directory (``audit ''`` audited it, ``--config ''`` read ``.``) or as no
argument at all (``check --ops ''`` ran every shipped spec and control).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.spec.shipped import spec_dir


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    """Run ``fsm-cache ARGV``, which must be refused by the parser; return (stdout, last stderr line)."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    return out, err.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["check", ""], "SPEC"),
        (["check", "--ops", ""], "--ops"),
        (["verify", ""], "SPEC_OR_MODULE"),
        (["audit", ""], "PATH"),
        (["audit", "{spec}", "--config", ""], "--config"),
    ],
)
def test_an_empty_path_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], argument: str
) -> None:
    spec = str(spec_dir() / "host_residency.toml")
    command = argv[0]
    assert usage_error(capsys, *(a.format(spec=spec) for a in argv)) == (
        "",
        f"fsm-cache {command}: error: argument {argument}: an empty path names no file",
    )


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["validate", "-"], "SPEC"),
        (["types", "-"], "SPEC"),
        (["diagram", "-"], "SPEC"),
        (["diagram", "{spec}", "--write", "--dir", "-"], "--dir"),
        (["check", "-"], "SPEC"),
        (["check", "--ops", "-"], "--ops"),
        (["verify", "-"], "SPEC_OR_MODULE"),
        (["audit", "-"], "PATH"),
        (["audit", "{spec}", "--config", "-"], "--config"),
    ],
)
def test_a_path_to_read_of_dash_is_refused_as_no_stdin(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    argument: str,
) -> None:
    """``cat d.toml | fsm-cache validate -`` said ``-: cannot read: No such file or directory``.

    And where a file named ``-`` was there, read it: no command reads stdin.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_bytes((spec_dir() / "host_residency.toml").read_bytes())
    spec = str(spec_dir() / "host_residency.toml")
    assert usage_error(capsys, *(a.format(spec=spec) for a in argv)) == (
        "",
        f"fsm-cache {argv[0]}: error: argument {argument}: '-' (stdin or stdout) names no file "
        "here; give a path (./- for one named -)",
    )


def test_a_spec_file_named_dash_is_spelled_dot_slash_dash(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_bytes((spec_dir() / "host_residency.toml").read_bytes())
    assert main(["validate", "./-"]) == 0
    assert capsys.readouterr().out == (
        "ok: ./- (machine host_residency: 5 states, 15 transitions, 14 refusals)\n"
    )


@pytest.mark.parametrize("command", ["validate", "types", "diagram"])
@pytest.mark.parametrize(
    "case",
    [
        (None, "cannot read: No such file or directory"),
        ("x\n", "invalid TOML: Expected '=' after a key in a key/value pair (at line 1, column 2)"),
        ("[machine]\n", "machine.name: missing or not a string"),
    ],
)
def test_a_spec_file_named_dash_is_named_as_given_in_its_problems(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
    case: tuple[str | None, str],
) -> None:
    """``validate ./-`` said ``error: -: ...``: the name that means stdin, not the file given."""
    text, problem = case
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / "-").write_text(text)
    assert main([command, "./-"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"error: ./-: {problem}" in err.splitlines()


@pytest.mark.parametrize("command", ["validate", "types", "diagram", "verify"])
def test_a_file_too_large_is_named_as_given(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
) -> None:
    """``validate ./huge.toml`` said ``error: huge.toml: larger than 16 MiB``: the path normalised."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with (tmp_path / "sub" / "huge.toml").open("wb") as file:
        file.truncate(16 * 2**20 + 1)  # sparse: costs no disk
    (tmp_path / "sub" / "small.toml").write_text("[machine]\nextends = './huge.toml'\n")
    assert main([command, "./sub/huge.toml"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: ./sub/huge.toml: larger than 16 MiB; not a spec file\n",
    )
    assert main([command, "./sub/small.toml"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: ./sub/./huge.toml: larger than 16 MiB; not a spec file\n",
    )


BAD_FORBID = "[[forbid]]\nevent = 'flip'\nerror = 'Bad'\nreason = 'r'\nbogus = 1\n"
"""A refusal with a key no refusal has: one problem, named by the file that holds it."""


@pytest.mark.parametrize(
    ("extends", "named"),
    [
        ("base.toml", "./sub/base.toml"),
        ("./base.toml", "./sub/./base.toml"),
        ("../sub/base.toml", "./sub/../sub/base.toml"),
    ],
)
def test_a_file_reached_through_extends_is_named_from_the_file_as_given(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    extends: str,
    named: str,
) -> None:
    """The extending file as the user named it, then ``extends`` as written: a path to open from here.

    ``validate ./sub/child.toml`` named its base ``sub/base.toml``: the
    path normalised, where the file it was reached from kept its ``./``.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    base = (spec_dir() / "host_residency.toml").read_text(encoding="utf-8")
    (tmp_path / "sub" / "base.toml").write_text(base + BAD_FORBID)
    (tmp_path / "sub" / "child.toml").write_text(f"[machine]\nname = 'c'\nextends = '{extends}'\n")
    assert main(["validate", "./sub/child.toml"]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: {named}: forbid[14].bogus: unknown key "
        "(allowed: error, event, guard, reason, source, when)\n",
    )


def test_a_file_an_extends_or_a_region_cannot_read_is_named_from_the_file_as_given(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A composition's regions are reached as a base is: named the same way."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.toml").write_text("[machine]\nname = 'c'\nextends = 'none.toml'\n")
    (tmp_path / "sub" / "both.toml").write_text(
        "[composition]\nname = 'b'\n[composition.regions]\nr = 'm/none.toml'\n"
    )
    assert main(["validate", "./sub/child.toml", "./sub/both.toml"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: ./sub/child.toml: machine.extends: "
        "cannot read ./sub/none.toml: No such file or directory\n"
        "error: ./sub/both.toml: composition.regions.r: "
        "cannot read ./sub/m/none.toml: No such file or directory\n",
    )


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["types", "{spec}", "--write", "out/"], "--write"),
        (["types", "{spec}", "--write", "new/."], "--write"),
        (["types", "{spec}", "--check", "out/"], "--check"),
        (["diagram", "{spec}", "-o", "drawn/"], "-o/--output"),
        (["diagram", "{spec}", "--write", "-o", "drawn/.."], "-o/--output"),
    ],
)
def test_an_output_file_that_names_a_folder_is_refused(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    argument: str,
) -> None:
    """``--write out/`` wrote a file named ``out``: the path asks for a folder, not a file."""
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "residency.toml")
    assert usage_error(capsys, *(a.format(spec=spec) for a in argv)) == (
        "",
        f"fsm-cache {argv[0]}: error: argument {argument}: {argv[-1]}: names a folder, not a file",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["diagram", "{spec}", "-o", "-"],
        ["diagram", "{spec}", "--write", "-o", "-"],
        ["types", "{spec}", "--write", "-"],
    ],
)
def test_an_output_file_of_dash_is_stdout(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
) -> None:
    """``diagram -o -`` wrote a file named ``-``: to most tools ``-`` is stdout."""
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "host_residency.toml")
    command = [a.format(spec=spec) for a in argv]
    assert main(command[:2]) == 0
    printed = capsys.readouterr()
    assert main(command) == 0
    assert capsys.readouterr() == printed
    assert list(tmp_path.iterdir()) == []


def test_a_file_to_check_of_dash_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--check -`` read a file named ``-``: stdout cannot be compared, so no ``-`` is checked."""
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "host_residency.toml")
    assert usage_error(capsys, "types", spec, "--check", "-") == (
        "",
        "fsm-cache types: error: argument --check: '-' (stdin or stdout) names no file here; "
        "give a path (./- for one named -)",
    )
    assert main(["diagram", spec, "--check", "-o", "-"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: -o - is stdout: --check compares a file; give the file to check\n",
    )
    assert list(tmp_path.iterdir()) == []


def test_a_diagram_file_named_dash_is_printed_as_a_path_not_as_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``diagram -o ./-`` printed ``wrote -``, which reads as "wrote to stdout"."""
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "host_residency.toml")
    assert main(["diagram", spec, "-o", "./-"]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / '-'}\n"
    assert main(["diagram", spec, "--check", "-o", "./-"]) == 0
    assert capsys.readouterr().out == "1 diagram files match their specs\n"
    assert [p.name for p in tmp_path.iterdir()] == ["-"]


def test_a_file_named_dash_is_spelled_dot_slash_dash(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = str(spec_dir() / "host_residency.toml")
    assert main(["types", spec, "--write", "./-"]) == 0
    assert main(["types", spec, "--check", "./-"]) == 0
    named = tmp_path / "-"
    assert capsys.readouterr().out == f"wrote {named}\n{named} matches {spec}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["-"]


def test_a_file_name_that_is_not_utf8_is_printed_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A name stdout cannot encode is escaped as on stderr, never a UnicodeEncodeError traceback.

    Linux file names are bytes; Python carries those that are not UTF-8 as
    lone surrogates, which a strict UTF-8 stdout (most locales') cannot write.
    """
    spec = tmp_path / os.fsdecode(b"flip\xff.toml")
    shutil.copyfile(spec_dir() / "host_residency.toml", spec)
    shown = str(spec).encode("utf-8", "backslashreplace").decode("ascii")
    assert sys.stdout.errors == "strict"  # as under en_US.UTF-8
    status = main(["validate", str(spec)])
    assert (status, capsys.readouterr().out) == (
        0,
        f"ok: {shown} (machine host_residency: 5 states, 15 transitions, 14 refusals)\n",
    )
    assert sys.stdout.errors == "strict"  # as it was: main changes it for its own run only


def test_text_stdout_cannot_encode_is_escaped(tmp_path: Path) -> None:
    """A spec's doc drawn to an ASCII stdout (``PYTHONIOENCODING=ascii``, a Latin-1 locale)."""
    text = (spec_dir() / "host_residency.toml").read_text(encoding="utf-8")
    spec = tmp_path / "accent.toml"
    spec.write_text(
        text.replace('doc = "Only the device', 'doc = "D\u00e9j\u00e0: only the device')
    )
    done = subprocess.run(
        [sys.executable, "-m", "fsm_cache", "diagram", "--format", "md", str(spec)],
        env={**os.environ, "FSM_CACHE_PURE": "1", "PYTHONIOENCODING": "ascii"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "D\\xe9j\\xe0: only the device" in done.stdout


def test_check_names_a_spec_as_given(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``check ./x.toml`` said ``x.toml`` in its report and its problems: a ``Path`` drops ``./``."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(spec_dir() / "host_residency.toml", tmp_path / "x.toml")
    assert main(["check", "./x.toml", "--nodes", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("./x.toml: 2 nodes")
    assert main(["check", "./missing.toml"]) == 2
    assert capsys.readouterr().err == (
        "error: ./missing.toml: cannot read: No such file or directory\n"
    )
