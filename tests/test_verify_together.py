"""fsm-cache verify runs its targets side by side, at most ``jobs`` processes at once.

A target proved in one CrossHair process (a user's module, checked whole)
ran alone, the other core idle, as did the checks on every representative
input; now every target shares the run's slots. These tests put a stand-in
for CrossHair on the path of the processes started (``python -m crosshair``),
which marks itself running in a folder and answers as each test needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from processes import all_gone

from fsm_cache.contracts import exhaustive, verify
from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.errors import FsmCacheError


_MODULE = (
    "import icontract\n\n\n"
    "@icontract.ensure(lambda result: result >= 0, 'never negative')\n"
    "def one(n: int) -> int:\n    return abs(n)\n"
)

_FAKE = """\
import os, pathlib, sys, time

MARKS = pathlib.Path({marks!r})
TARGET = pathlib.Path(sys.argv[-1])
NAME = TARGET.stem
MARK = MARKS / f"{{NAME}}.{{os.getpid()}}"
MARK.touch()


def until(ready, most=30.0):
    \"\"\"Wait until ready() holds, at most ``most`` seconds.\"\"\"
    deadline = time.monotonic() + most
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.02)


def running():
    return len(list(MARKS.glob("*.*")))


def report():
    for i, line in enumerate(TARGET.read_text().splitlines(), 1):
        if line.startswith("@icontract.ensure"):
            print(f"{{TARGET}}:{{i}}: info: Confirmed over all paths.")


{body}
"""


def _fake(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch | None = None) -> Path:
    """Write the stand-in CrossHair running ``body``; return the folder it marks itself in.

    With ``monkeypatch``, the processes this test's process starts find it.
    """
    marks = tmp_path / "marks"
    marks.mkdir()
    fake = tmp_path / "fake" / "crosshair"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(_FAKE.format(marks=str(marks), body=body))
    if monkeypatch is not None:
        monkeypatch.setenv("PYTHONPATH", _path(tmp_path))
    return marks


def _path(tmp_path: Path) -> str:
    """Return a PYTHONPATH that finds the stand-in first, then what this test finds."""
    return os.pathsep.join([str(tmp_path / "fake"), *filter(None, [os.environ.get("PYTHONPATH")])])


def _modules(tmp_path: Path, *names: str) -> list[str]:
    """Write a contracts module of one contract per name; return their files."""
    paths = []
    for name in names:
        path = tmp_path / f"{name}.py"
        path.write_text(_MODULE)
        paths.append(str(path))
    return paths


def _pids(marks: Path) -> list[int]:
    return [int(p.suffix[1:]) for p in marks.glob("*.*")]


def _side_by_side(child: subprocess.Popen[str] | subprocess.Popen[bytes], marks: Path) -> list[int]:
    """Wait until the stand-in CrossHair of both targets runs; return their pids."""
    deadline = time.monotonic() + 60
    while len(_pids(marks)) < 2 and time.monotonic() < deadline:
        assert child.poll() is None, "the run ended before CrossHair ran"
        time.sleep(0.05)
    workers = _pids(marks)
    assert len(workers) == 2, "the two targets did not run side by side"
    return workers


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_interrupt_stops_the_crosshair_of_every_target_in_flight(tmp_path: Path) -> None:
    """Two modules, each proved whole in one process, run at once; a SIGINT stops both.

    They ran one after the other (the second never started while the first
    ran); side by side, the interrupt must take every target's process with
    it, and end the run at once.
    """
    marks = _fake(tmp_path, "time.sleep(60)")
    first, second = _modules(tmp_path, "contracts_first", "contracts_second")
    run = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from fsm_cache.contracts import verify\n"
        "import crosshair.codeconfig\n"  # the real one reads the directives
        "os.environ['PYTHONPATH'] = sys.argv[3]\n"
        "verify.run([sys.argv[1], sys.argv[2]], 2, with_controls=False)\n"
    )
    argv = [sys.executable, "-c", run, first, second, _path(tmp_path)]
    with subprocess.Popen(argv) as child:
        workers = _side_by_side(child, marks)
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) == -signal.SIGINT  # an uncaught KeyboardInterrupt
    assert all_gone(workers)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_sigterm_stops_the_crosshair_of_every_target_as_an_interrupt_does(
    tmp_path: Path,
) -> None:
    """``fsm-cache verify`` ended at once on a SIGTERM, its CrossHair processes left running.

    A supervisor, ``kill`` or ``timeout`` sends SIGTERM; Python leaves it to
    the system, so nothing stopped them. Run as the command line runs it,
    the run must stop as on SIGINT, say so, and exit 143.
    """
    marks = _fake(tmp_path, "time.sleep(60)")
    first, second = _modules(tmp_path, "contracts_first", "contracts_second")
    run = (
        "import os, sys\n"
        "import crosshair.codeconfig\n"  # the real one reads the directives
        "from fsm_cache.cli.main import main\n"
        "os.environ['PYTHONPATH'] = sys.argv[1]\n"
        "sys.exit(main(['verify', '--jobs', '2', *sys.argv[2:]]))\n"
    )
    argv = [sys.executable, "-c", run, _path(tmp_path), first, second]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        workers = _side_by_side(child, marks)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
    assert (child.returncode, out, err) == (143, "", "terminated\n")
    assert all_gone(workers)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_error_in_one_target_stops_the_others_and_is_the_one_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CrossHair failing on one module kills the other's process, and its error is reported.

    The other target's process, killed, is no failure of its own: the run
    raises the error that stopped it.
    """
    marks = _fake(
        tmp_path,
        "if NAME == 'contracts_bad':\n"
        "    until(lambda: running() == 2)\n"
        "    print('crosshair: boom', file=sys.stderr)\n"
        "    sys.exit(2)\n"
        "time.sleep(60)\n"
        "(MARKS.parent / 'good.done').touch()\n",
        monkeypatch,
    )
    good, bad = _modules(tmp_path, "contracts_good", "contracts_bad")
    with pytest.raises(FsmCacheError) as caught:
        verify.run([good, bad], 2, with_controls=False)
    assert str(caught.value) == f"CrossHair failed on {Path(bad).resolve()}: crosshair: boom"
    pids = _pids(marks)
    assert len(pids) == 2
    assert all_gone(pids)
    assert not (tmp_path / "good.done").exists()  # killed, not left to finish


def test_rows_come_in_the_order_given_whichever_target_ends_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first target ends last; its rows still come first, as when they ran in turn."""
    _fake(
        tmp_path,
        "if NAME == 'contracts_slow':\n"
        "    until(lambda: (MARKS / 'quick.done').exists())\n"
        "report()\n"
        "if NAME == 'contracts_quick':\n"
        "    (MARKS / 'quick.done').touch()\n",
        monkeypatch,
    )
    slow, quick = _modules(tmp_path, "contracts_slow", "contracts_quick")
    result = verify.run([slow, quick], 2, with_controls=False)
    assert [(r.target, r.function, r.status) for r in result["rows"]] == [
        ("contracts_slow", "one", crosshair_run.CONFIRMED),
        ("contracts_quick", "one", crosshair_run.CONFIRMED),
    ]


def test_no_more_crosshair_processes_run_at_once_than_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CrossHair's budgets are wall-clock: three targets at ``--jobs 2`` never run three at once.

    Each stand-in waits, a while, for a third to be running beside it, and
    notes how many it saw.
    """
    marks = _fake(
        tmp_path,
        "until(lambda: running() >= 3, most=1.5)\n"
        "(MARKS.parent / f'seen.{NAME}').write_text(str(running()))\n"
        "MARK.unlink()\n"
        "report()\n",
        monkeypatch,
    )
    names = ("contracts_a", "contracts_b", "contracts_c")
    result = verify.run(_modules(tmp_path, *names), 2, with_controls=False)
    assert [r.target for r in result["rows"]] == list(names)
    assert {(marks.parent / f"seen.{name}").read_text() for name in names} <= {"1", "2"}


def test_a_check_in_this_process_takes_a_slot(tmp_path: Path) -> None:
    """A check on every representative input waits while ``jobs`` processes run, as one does.

    At ``jobs`` 1, with a process running, the check does not run; once the
    run is stopped, it never does.
    """
    workers = crosshair_run.Workers()
    started = threading.Event()
    outcomes: list[object] = []

    def hold() -> None:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        with workers.process(argv, tmp_path, 1) as child:
            started.set()
            child.communicate()

    def check() -> None:
        try:
            outcomes.append(workers.in_process(1, lambda: "ran"))
        except FsmCacheError as exc:
            outcomes.append(str(exc))

    holder = threading.Thread(target=hold)
    holder.start()
    assert started.wait(timeout=30)
    asker = threading.Thread(target=check)
    asker.start()
    asker.join(timeout=1.0)
    assert outcomes == []  # waiting for the slot the process holds
    workers.stop()
    asker.join(timeout=30)
    holder.join(timeout=30)
    assert outcomes == ["verification was interrupted"]


def test_a_module_loaded_while_another_of_its_name_loads_keeps_its_own_entry(
    tmp_path: Path,
) -> None:
    """Two generated modules share a name when their specs do (``contracts_host_residency``).

    Registered under that name alone, a load nested in another (or beside it,
    on another thread) replaced the first's entry, then removed it: the
    first's own removal raised ``KeyError``.
    """
    inner = tmp_path / "inner" / "contracts_same.py"
    inner.parent.mkdir()
    inner.write_text("import dataclasses\n\n\n@dataclasses.dataclass\nclass R:\n    x: int\n")
    outer = tmp_path / "outer" / "contracts_same.py"
    outer.parent.mkdir()
    outer.write_text(
        "import pathlib\n"
        "from fsm_cache.contracts import exhaustive\n\n"
        f"exhaustive.input_counts(pathlib.Path({str(inner)!r}), {{}}, [])\n"
    )
    assert exhaustive.input_counts(outer, {}, []) == {}
    assert not [name for name in sys.modules if "contracts_same" in name]
