"""``fsm-cache COMMAND --help``: plain text, whatever markup the docstrings it is drawn from use."""

from __future__ import annotations

import pytest

from fsm_cache.cli.main import main
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


def _options(parser: Parser, positional: str) -> None:
    """Give ``parser`` a flag ``--verbose``, a ``-1`` that looks like a number, and ``positional``."""
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("-1", dest="one", action="store_true")
    if positional == "--out":
        parser.add_argument("--out", required=True)
        parser.add_argument("rest", nargs="*")
    else:
        parser.add_argument(positional)


@pytest.mark.parametrize(
    ("abbrev", "required", "argv", "unknown"),
    [
        # A prefix of an option is that option; --name=value is named whole.
        (True, "--out", ["--verb", "--nope=1", "-x", "rest"], "--nope=1 -x"),
        # Without abbreviations, a prefix is no option (it used to be taken for one).
        (False, "X", ["--verb"], "--verb"),
        (True, "X", ["--verb"], ""),
        # With an option that looks like a negative number, -5 is an option (it used to be a value).
        (True, "X", ["-5"], "-5"),
        # An argument with a space is a value (it used to be named as an option).
        (True, "--out", ["--a b"], ""),
        # What follows -- is a value; an unknown -x before it is not.
        (True, "--out", ["-x", "--", "--after"], "-x"),
    ],
)
def test_the_unknown_arguments_named_are_those_argparse_leaves(
    capsys: pytest.CaptureFixture[str],
    abbrev: bool,
    required: str,
    argv: list[str],
    unknown: str,
) -> None:
    """argparse says which arguments it does not recognise; a matcher of our own disagreed with it."""
    parser = Parser(prog="t", allow_abbrev=abbrev)
    _options(parser, required)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    named = f"unrecognized arguments: {unknown}; " if unknown else ""
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"t: error: {named}the following arguments are required: {required}"
    assert parser.unrecognized(argv) == unknown.split()
    with pytest.raises(SystemExit):  # still required after the parse that asked argparse
        parser.parse_args([])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"t: error: the following arguments are required: {required}"
