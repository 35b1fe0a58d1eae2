"""Options and positionals in any order: ``fsm-cache check A.toml --nodes 5 B.toml``.

argparse fills a list of positionals from one run of them only, so an option
between two specs left the second ``unrecognized``. Every subcommand's parser
parses intermixed now; ``--`` still ends the options.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache.cli.main import build_parser, main
from fsm_cache.spec.shipped import spec_dir


A = str(spec_dir() / "residency.toml")
B = str(spec_dir() / "host_residency.toml")


@pytest.mark.parametrize(
    ("argv", "dest", "option", "value"),
    [
        (["check", A, "--nodes", "5", B], "specs", "nodes", 5),
        (["check", A, "--json", B, "--jobs", "2"], "specs", "jobs", 2),
        (["validate", A, "--", B], "specs", None, None),
        (["verify", A, "--json", B], "targets", "json", True),
        (["diagram", A, "--format", "dot", B], "specs", "format", "dot"),
        (["audit", A, "--format", "json", B], "paths", "format", "json"),
    ],
)
def test_an_option_between_positionals_leaves_them_one_list(
    argv: list[str], dest: str, option: str | None, value: object
) -> None:
    args = build_parser().parse_args(argv)
    assert [str(path) for path in getattr(args, dest)] == [A, B]
    if option is not None:
        assert getattr(args, option) == value


@pytest.mark.parametrize(
    ("argv", "specs"),
    [
        (["validate", "--", "-x.toml"], ["-x.toml"]),
        (["check", "--nodes", "5", "--", "-x.toml"], ["-x.toml"]),
        (["check", A, "--nodes", "5", B, "--", "-c.toml"], [A, B, "-c.toml"]),
        (["validate", A, "--", "--"], [A, "--"]),
        (["diagram", "--format", "dot", "--", "--format"], ["--format"]),
    ],
)
def test_what_follows_double_dash_is_positional(argv: list[str], specs: list[str]) -> None:
    """The first intermixed pass took ``--`` for an empty run of positionals and dropped it."""
    args = build_parser().parse_args(argv)
    assert [str(path) for path in args.specs] == specs
    assert getattr(args, "nodes", 5) == 5
    assert getattr(args, "format", "dot") in ("dot", None)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["check", "--nodes"], "fsm-cache check: error: argument --nodes: expected one argument"),
        (
            ["types", A, "--write", "x.pyi", "--check", "y.pyi"],
            "fsm-cache types: error: argument --check: not allowed with argument --write",
        ),
        (["types", A, "--bogus"], "fsm-cache: error: unrecognized arguments: --bogus"),
        (
            ["types", "--", "-"],
            "fsm-cache types: error: argument SPEC: '-' (stdin or stdout) "
            "names no file here; give a path (./- for one named -)",
        ),
        (
            ["types", "--bogus", "--write", "x.pyi"],
            "fsm-cache types: error: unrecognized arguments: --bogus; "
            "the following arguments are required: SPEC",
        ),
        (
            ["diagram", "--highlight"],
            "fsm-cache diagram: error: argument --highlight: expected one argument",
        ),
    ],
)
def test_usage_errors_read_as_before(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == said


@pytest.mark.parametrize(
    ("argv", "unknown"),
    [
        (["validate", "A", "--bogus", "B"], "--bogus"),
        (["validate", A, "--bogus", B, "-y", B], "--bogus -y"),
        (["check", A, "--nodes", "5", "--bogus=1", B], "--bogus=1"),
        (["diagram", "A", "--bogus", "B", "--format", "dot", "C"], "--bogus"),
        # types takes one SPEC: B really is unrecognised, named where it stood.
        (["types", "A", "--bogus", "B"], "--bogus B"),
        (["types", "A", "B", "--bogus"], "B --bogus"),
        (["types", "A", "--bogus", "--", "--bogus"], "--bogus --bogus"),
    ],
)
def test_an_unknown_option_between_positionals_is_named_alone(
    capsys: pytest.CaptureFixture[str], argv: list[str], unknown: str
) -> None:
    """The intermixed parse's second pass read the positionals after the unknown option as extras.

    ``validate A --bogus B`` said ``unrecognized arguments: --bogus B``,
    though ``B`` is a SPEC like ``A``.
    """
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr() == (
        "",
        "usage: fsm-cache [-h] [--version] COMMAND ...\n"
        f"fsm-cache: error: unrecognized arguments: {unknown}\n",
    )


def test_an_unknown_option_between_specs_is_a_usage_error_of_the_command() -> None:
    """Run as a user runs it: exit 2, the usage and one error line, no traceback, nothing read."""
    done = subprocess.run(
        [sys.executable, "-m", "fsm_cache", "validate", "A", "--bogus", "B"],
        env={**os.environ, "FSM_CACHE_PURE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        "usage: fsm-cache [-h] [--version] COMMAND ...\n"
        "fsm-cache: error: unrecognized arguments: --bogus\n",
    )


def test_audit_of_two_paths_with_an_option_between(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The command runs on both paths, reporting as the option between them says."""
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    first, second = str(tmp_path / "a.py"), str(tmp_path / "b.py")
    assert main(["audit", first, "--format", "json", second]) == 0
    assert capsys.readouterr().out.startswith(("{", "["))
