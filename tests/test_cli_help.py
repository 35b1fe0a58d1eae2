"""``fsm-cache COMMAND --help``: plain text, whatever markup the docstrings it is drawn from use."""

from __future__ import annotations

import pytest

from fsm_cache.cli.main import build_parser, main
from fsm_cache.shell import Parser


COMMANDS = ["audit", "bench", "check", "demo", "diagram", "types", "validate", "verify"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_rest_markup(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """``check --help`` and ``verify --help`` opened with ````fsm-cache check````: reST's marks."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fsm-cache {command} ")
    assert "``" not in out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_says_what_the_command_does(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """``demo --help`` and ``bench --help`` went from usage to options, saying nothing of what they do."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    paragraphs = capsys.readouterr().out.split("\n\n")
    assert not paragraphs[1].startswith(("options:", "positional arguments:")), paragraphs[1]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--bogus"], "fsm-cache: error: unrecognized arguments: --bogus; "),
        (["validate", "--bogus"], "fsm-cache validate: error: unrecognized arguments: --bogus; "),
        (["validate", "-x"], "fsm-cache validate: error: unrecognized arguments: -x; "),
        (["audit", "--bog=1"], "fsm-cache audit: error: unrecognized arguments: --bog=1; "),
    ],
)
def test_an_unknown_option_is_named_before_a_missing_argument(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """argparse checks required arguments first: ``fsm-cache --bogus`` only said COMMAND was missing."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    missing = "COMMAND" if len(argv) == 1 else ("PATH" if argv[0] == "audit" else "SPEC")
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"{said}the following arguments are required: {missing}"


def test_unknown_options_are_read_as_argparse_reads_them() -> None:
    """A prefix of an option, ``--opt=value``, a negative number and all after ``--`` are not unknown."""
    parser = build_parser()
    assert isinstance(parser, Parser)
    given = ["--vers", "--version=1", "-5", "-h", "-hx", "--v", "-x", "--nope=1", "--", "--after"]
    assert parser.unknown_options(given) == ["-x", "--nope=1"]
