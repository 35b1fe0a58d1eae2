"""A SIGTERM while a command takes it (:func:`fsm_cache.shell.terminating`) stops it as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

import pytest

from fsm_cache.contracts.runner import Workers
from fsm_cache.shell import INTERRUPTED, TERMINATED, Terminated, run_command, terminating


@pytest.fixture(autouse=True)
def _default_sigterm() -> None:
    """These tests send SIGTERM to pytest's process: only where the system's default is set."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM is handled here already")


def _sigterm() -> None:
    """Send this process a SIGTERM, only while a handler of ours would take it."""
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_raises_once_and_the_default_is_back_after() -> None:
    """Raised once: one sent again while the command stops is ignored, so stopping is not cut short."""

    def stopping() -> None:
        with terminating():
            try:
                _sigterm()
            finally:
                _sigterm()  # while it stops: ignored

    with pytest.raises(Terminated):
        stopping()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_command_a_sigterm_stops_says_so_and_exits_143(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def command() -> int:
        with terminating():
            _sigterm()
        return 0

    assert run_command(command) == TERMINATED == 143
    assert capsys.readouterr() == ("", "terminated\n")


def test_a_sigterm_handler_of_the_caller_is_left_as_it_is() -> None:
    seen: list[int] = []

    def handler(number: int, _frame: FrameType | None) -> None:
        seen.append(number)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with terminating():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]


def test_a_sigterm_while_a_verify_run_waits_for_its_targets_stops_them() -> None:
    """Sent as the run's ``with`` ended well, it left without stopping the targets still running."""
    seen: list[bool] = []

    def target(share: Workers) -> None:
        deadline = time.monotonic() + 10
        while not share.stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(share.stopped)

    def verify_run() -> None:
        with Workers() as run:
            run.submit(target)
            timer.start()  # the SIGTERM comes while __exit__ waits for the target

    timer = threading.Timer(0.2, _sigterm)
    with pytest.raises(Terminated):
        verify_run()
    timer.join()
    assert seen == [True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _Dropping:
    """Raises KeyboardInterrupt from ``__del__``, where Python drops it, as an import lock's callback."""

    def __del__(self) -> None:
        raise KeyboardInterrupt


def test_a_ctrl_c_python_drops_still_ends_the_command_as_interrupted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Ctrl-C that landed in such a callback printed a traceback, and the command exited 0."""

    def command() -> int:
        _Dropping()  # dropped as soon as made: its __del__ raises where Python ignores it
        return 0

    assert run_command(command) == INTERRUPTED == 130
    assert capsys.readouterr() == ("", "interrupted\n")


def test_an_unraisable_error_that_is_no_ctrl_c_is_left_to_the_hook_there_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[type[BaseException] | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: seen.append(raised.exc_type))

    class Failing:
        def __del__(self) -> None:
            raise ValueError("in __del__")

    def command() -> int:
        Failing()
        return 0

    assert run_command(command) == 0
    assert seen == [ValueError]


class _DroppingTerm:
    """Raises Terminated (a SIGTERM's) from ``__del__``, where Python drops it."""

    def __del__(self) -> None:
        raise Terminated


def test_a_sigterm_python_drops_ends_the_command_as_terminated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def command() -> int:
        _DroppingTerm()
        return 0

    assert run_command(command) == TERMINATED
    assert capsys.readouterr() == ("", "terminated\n")
