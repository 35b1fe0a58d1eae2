"""A reader that goes away (``fsm-cache ... | head -1``): a quiet exit 141, never an error.

Python ignores SIGPIPE and raises BrokenPipeError at the next write instead;
the CLI used to report that as ``error: [Errno 32] Broken pipe`` (exit 2), and
when stderr was the closed pipe, failed on the report itself (exit 1, the
traceback lost). Each subprocess test hands the command a pipe whose reader is
already gone, so the first write fails whatever the buffering.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.shell import OUTPUT_CLOSED
from fsm_cache.spec.shipped import spec_dir


def closed_reader(*argv: str, into: str, module: str = "fsm_cache") -> tuple[int, bytes]:
    """Run ``python -m MODULE ARGV`` with ``into`` (stdout or stderr) a pipe nobody reads.

    Returns the exit status and what the other stream received.
    """
    read, write = os.pipe()
    os.close(read)
    stdout, stderr = (write, subprocess.PIPE) if into == "stdout" else (subprocess.PIPE, write)
    try:
        done = subprocess.run(
            [sys.executable, "-m", module, *argv],
            env={**os.environ, "FSM_CACHE_PURE": "1"},
            stdout=stdout,
            stderr=stderr,
            check=False,
        )
    finally:
        os.close(write)
    return done.returncode, done.stderr if into == "stdout" else done.stdout


def test_the_status_is_what_a_shell_reports_of_sigpipe() -> None:
    assert OUTPUT_CLOSED == 128 + 13


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", str(spec_dir() / "host_residency.toml")],
        ["diagram", str(spec_dir() / "residency.toml")],
        ["types", str(spec_dir() / "residency.toml")],
        ["demo", "--requests", "0"],
    ],
    ids=["validate", "diagram", "types", "demo"],
)
def test_a_closed_stdout_ends_the_command_quietly(argv: list[str]) -> None:
    assert closed_reader(*argv, into="stdout") == (OUTPUT_CLOSED, b"")


def test_a_closed_stderr_ends_the_command_quietly(tmp_path: Path) -> None:
    """The error lines of a bad spec cannot be written: no traceback, none of stdout lost."""
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n", encoding="utf-8")
    good = spec_dir() / "host_residency.toml"
    status, out = closed_reader("validate", str(good), str(bad), into="stderr")
    assert (status, out.decode()) == (
        OUTPUT_CLOSED,
        f"ok: {good} (machine host_residency: 5 states, 15 transitions, 14 refusals)\n",
    )


AUDITED = Path(__file__).parent / "audit_corpus" / "abort_retract.py"
"""A module the audit has findings in: it writes them to stdout."""
AUDIT_ENTRIES = {"cli": ("fsm_cache", ["audit"]), "module": ("fsm_cache.audit", [])}
"""``python -m fsm_cache audit`` and ``python -m fsm_cache.audit``: the same command."""


@pytest.mark.parametrize("entry", AUDIT_ENTRIES, ids=str)
def test_a_closed_stdout_ends_the_audit_quietly_from_either_entry(entry: str) -> None:
    module, argv = AUDIT_ENTRIES[entry]
    assert closed_reader(*argv, str(AUDITED), into="stdout", module=module) == (
        OUTPUT_CLOSED,
        b"",
    )


@pytest.mark.parametrize("entry", AUDIT_ENTRIES, ids=str)
def test_a_closed_stderr_ends_the_audit_quietly_from_either_entry(
    entry: str, tmp_path: Path
) -> None:
    module, argv = AUDIT_ENTRIES[entry]
    missing = str(tmp_path / "missing.py")
    assert closed_reader(*argv, missing, into="stderr", module=module) == (OUTPUT_CLOSED, b"")


class _Gone(io.StringIO):
    """A stream whose reader has left: every write fails as a closed pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_main_returns_the_status_and_writes_no_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", _Gone())
    assert main(["validate", str(spec_dir() / "host_residency.toml")]) == OUTPUT_CLOSED
    assert capsys.readouterr().err == ""


def test_main_returns_the_status_when_the_error_lines_cannot_be_written(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "stderr", _Gone())
    assert main(["validate", str(tmp_path / "missing.toml")]) == OUTPUT_CLOSED
    assert main(["types", str(tmp_path / "missing.toml")]) == OUTPUT_CLOSED


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill")
@pytest.mark.parametrize(
    "argv",
    [
        ["validate", str(spec_dir() / "host_residency.toml")],
        ["diagram", str(spec_dir() / "residency.toml")],
        ["--help"],
    ],
    ids=["validate", "diagram", "help"],
)
def test_a_full_stdout_is_one_error_naming_stdout(argv: list[str]) -> None:
    """``> /dev/full`` gave ``error: [Errno 28] ...``, then ``Exception ignored`` and exit 120.

    The text left in stdout's buffer failed again in the interpreter's flush
    at exit; ``--help`` failed there alone, after argparse's exit 0.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "fsm_cache", *argv],
            env={**env, "FSM_CACHE_PURE": "1"},
            stdout=full,
            stderr=subprocess.PIPE,
            check=False,
        )
    assert (done.returncode, done.stderr) == (
        2,
        b"error: cannot write to stdout: No space left on device\n",
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill")
@pytest.mark.parametrize(
    ("unbuffered", "argv"),
    [
        (True, ["validate", str(spec_dir() / "host_residency.toml")]),
        (True, ["types", str(spec_dir() / "residency.toml")]),
        (True, ["audit", str(AUDITED)]),
        (False, ["diagram", "--format", "md", *map(str, sorted(spec_dir().glob("*.toml")))]),
    ],
    ids=["unbuffered-validate", "unbuffered-types", "unbuffered-audit", "longer-than-the-buffer"],
)
def test_a_full_stdout_is_named_when_the_write_itself_fails(
    unbuffered: bool, argv: list[str]
) -> None:
    """A write that fails before the last flush said ``error: [Errno 28] No space left on device``.

    So did every command's with ``PYTHONUNBUFFERED=1``, and an output
    longer than stdout's buffer (all the specs' Markdown, some 48 kB).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "fsm_cache", *argv],
            env={**env, "FSM_CACHE_PURE": "1", **({"PYTHONUNBUFFERED": "1"} if unbuffered else {})},
            stdout=full,
            stderr=subprocess.PIPE,
            check=False,
        )
    assert (done.returncode, done.stderr) == (
        2,
        b"error: cannot write to stdout: No space left on device\n",
    )


def test_stdout_is_put_back_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The command writes through a stand-in that names stdout; the caller gets its own back."""
    before = sys.stdout
    assert main(["validate", str(spec_dir() / "host_residency.toml")]) == 0
    assert sys.stdout is before
    assert capsys.readouterr().out.startswith("ok: ")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill")
@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("fsm_cache", ["--help"]),
        ("fsm_cache", ["check", "--help"]),
        ("fsm_cache", ["--version"]),
        ("fsm_cache.audit", ["--help"]),
    ],
    ids=["help", "command-help", "version", "audit-help"],
)
def test_help_to_a_full_unbuffered_stdout_is_an_error(module: str, argv: list[str]) -> None:
    """With ``PYTHONUNBUFFERED=1`` argparse swallowed the failed write: nothing written, exit 0."""
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", module, *argv],
            env={**os.environ, "FSM_CACHE_PURE": "1", "PYTHONUNBUFFERED": "1"},
            stdout=full,
            stderr=subprocess.PIPE,
            check=False,
        )
    assert (done.returncode, done.stderr) == (
        2,
        b"error: cannot write to stdout: No space left on device\n",
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fill")
@pytest.mark.parametrize(
    "argv",
    [["validate", "no-such-spec.toml"], ["types", "no-such-spec.toml"], ["check", "--nodes", "x"]],
    ids=["validate", "types", "usage"],
)
def test_a_full_stderr_leaves_the_status_to_tell(argv: list[str]) -> None:
    """``2> /dev/full`` turned exit 2 into 120: the error lines failed again in the exit's flush."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            [sys.executable, "-m", "fsm_cache", *argv],
            env={**env, "FSM_CACHE_PURE": "1"},
            stdout=subprocess.PIPE,
            stderr=full,
            check=False,
        )
    assert (done.returncode, done.stdout) == (2, b"")


def closed_before_start(fd: int, *argv: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m fsm_cache ARGV`` with descriptor ``fd`` closed (``>&-``, ``2>&-``)."""
    return subprocess.run(
        [sys.executable, "-m", "fsm_cache", *argv],
        env={**os.environ, "FSM_CACHE_PURE": "1"},
        capture_output=True,
        preexec_fn=lambda: os.close(fd),  # in the child, before Python starts
        check=False,
    )


@pytest.mark.parametrize(
    "argv",
    [["validate", str(spec_dir() / "host_residency.toml")], ["--help"]],
    ids=["validate", "help"],
)
def test_a_stdout_closed_before_the_start_is_one_error(argv: list[str]) -> None:
    """``>&-`` makes stdout None to Python: the first write was an AttributeError traceback."""
    done = closed_before_start(1, *argv)
    assert (done.returncode, done.stderr) == (
        2,
        b"error: cannot write to stdout: Bad file descriptor\n",
    )


def test_a_stderr_closed_before_the_start_takes_the_errors(tmp_path: Path) -> None:
    """``2>&-`` makes stderr None to Python, and print(file=None) wrote the errors to stdout."""
    good = spec_dir() / "host_residency.toml"
    done = closed_before_start(2, "validate", str(good), str(tmp_path / "missing.toml"))
    assert (done.returncode, done.stdout.decode()) == (
        2,
        f"ok: {good} (machine host_residency: 5 states, 15 transitions, 14 refusals)\n",
    )
