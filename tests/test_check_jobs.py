"""``fsm-cache check --jobs``: searches side by side in other processes, the same report."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import IllegalTransition, SpecError, error_class
from fsm_cache.modelcheck import check, treeops
from fsm_cache.modelcheck.budget import Budget
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.spec.controls import controls
from fsm_cache.spec.loader import NOT_IN_SNAPSHOT, load_snapshot
from fsm_cache.spec.shipped import spec_dir


HOST = spec_dir() / "host_residency.toml"
DEVICE = spec_dir() / "device_residency.toml"
STORAGE = spec_dir() / "storage_residency.toml"
STORAGE_THREE = spec_dir() / "residency_storage.toml"
HOST_STORAGE = spec_dir() / "host_storage_residency.toml"
BROKEN = spec_dir() / "bugs_detected" / "evict_host_while_pinned.toml"
SPLIT_DROPS_PINS = spec_dir() / "bugs_detected" / "split_drops_pins.py"


def checked(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """Run ``check --json`` and return its exit status and its report without the timings."""
    status = main(["check", "--json", *argv])
    result = json.loads(capsys.readouterr().out)
    for spec in result["specs"]:
        assert spec.pop("seconds") >= 0
    return status, result


@pytest.fixture
def not_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any search run in this process: under ``--jobs`` they run in others."""

    def run(*_: object, **__: object) -> None:
        raise AssertionError("a search ran in the process that ordered it")

    monkeypatch.setattr(check, "check_spec", run)


def test_jobs_run_the_searches_in_other_processes_and_report_the_same(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [str(HOST), str(DEVICE), str(STORAGE), "--nodes", "3"]
    alone = checked(capsys, *specs)
    explore = check.check_spec
    monkeypatch.setattr(check, "check_spec", lambda *_, **__: pytest.fail("ran here"))
    side_by_side = checked(capsys, *specs, "--jobs", "2")
    monkeypatch.setattr(check, "check_spec", explore)
    assert side_by_side == alone
    assert alone[0] == 0
    assert [s["spec"] for s in alone[1]["specs"]] == [str(HOST), str(DEVICE), str(STORAGE)]


@pytest.mark.usefixtures("not_here")
def test_a_violation_found_in_another_process_is_reported_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, result = checked(capsys, str(HOST), str(BROKEN), "--nodes", "3", "--jobs", "2")
    assert status == 1
    host, broken = result["specs"]
    assert host["violation"] is None
    assert broken["violation"] == (
        "invariant 6: node 0: pins is 0 but its holders account for 1 (evict_host moves pins by "
        "other steps than one up or one down, so the check counts it as neither a hold nor a "
        "give-back)"
    )
    assert broken["trace"][0].startswith("start: ")


def test_the_violation_and_its_trace_match_the_search_run_here(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(HOST), str(BROKEN), "--nodes", "3"]
    assert checked(capsys, *argv, "--jobs", "2") == checked(capsys, *argv)


def test_the_controls_found_in_other_processes_are_those_found_here() -> None:
    chosen = controls(tools=("validate", "check"))[:4]
    assert len(chosen) == 4
    alone = check.searched([], chosen, treeops, jobs=1, symmetry=True)
    assert check.searched([], chosen, treeops, jobs=2, symmetry=True) == alone
    assert all(c.matches(found) for c, found in zip(chosen, alone[1], strict=True))


def test_an_ops_module_is_checked_here_whatever_the_jobs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, result = checked(capsys, "--ops", str(SPLIT_DROPS_PINS), "--nodes", "3", "--jobs", "2")
    assert status == 1
    assert result["specs"][0]["violation"].endswith(
        ": host pinned requires pins >= 1 (pins=0, locks=0)"
    )


@pytest.mark.usefixtures("not_here")
@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_fewer_than_one_job_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], jobs: str
) -> None:
    assert main(["check", str(HOST), "--jobs", jobs]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: check: --jobs must be >= 1, got {jobs}\n"


def test_a_search_that_raises_in_another_process_fails_as_it_does_here(tmp_path: Path) -> None:
    spec = tmp_path / "host.toml"
    spec.write_bytes(HOST.read_bytes())
    bounded = check.ceilings(spec, 2, 2, 2)
    # planned without the spec's bytes: the worker's load, from them alone, raises
    planned = check.Search(spec, "none", 2, bounded, Bounds(bounded, 2), True, Budget(), False, {})
    errors = []
    for jobs in (1, 2):
        with pytest.raises(SpecError) as raised:
            check.searched([planned, planned], [], treeops, jobs=jobs, symmetry=True)
        errors.append((str(raised.value), raised.value.problems))
    assert errors[1] == errors[0]
    assert errors[0][1] == [f"{spec}: cannot read: {NOT_IN_SNAPSHOT}"]


_RAISES_SPEC_MADE = (
    "from fsm_cache.errors import error_class\n"
    "raise error_class('EvictedWhileHeldInWorker')(label='node', instance=2, state='held', "
    "counters={'pins': 1}, event='evict', reason='a pin holds it')"
)
"""A worker's code raising a refusal of a class a spec names, made in the worker first."""


def test_a_refusal_of_a_class_a_spec_named_comes_back_from_a_worker_whole() -> None:
    """Such a class is made at run time: the pool got a ``PicklingError`` in its place."""
    context = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(1, mp_context=context) as pool,
        pytest.raises(IllegalTransition) as raised,
    ):
        pool.submit(exec, _RAISES_SPEC_MADE).result()
    assert type(raised.value) is error_class("EvictedWhileHeldInWorker")
    assert str(raised.value) == "node 2: evict refused in held (pins=1): a pin holds it"
    assert raised.value.counters == {"pins": 1}


def test_a_ctrl_c_while_the_workers_spawn_interrupts_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGINT was ignored while workers spawned: an interrupt then was lost, the run went on.

    The test takes SIGINT as Python does by default, as the command does (a
    pytest started as a background job has it ignored, and an interrupt the
    process ignores is rightly lost). The interrupt is sent to the main
    thread: in the command, every thread there is was started in the window
    and blocks it too, so a Ctrl-C waits for the main thread; under
    pytest-xdist, threads started before the window would take it, ignored.
    """
    submit = ProcessPoolExecutor.submit
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted(pool: ProcessPoolExecutor, *args: Any, **kwargs: Any) -> Any:
        # as a Ctrl-C lands while a worker spawns
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return submit(pool, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", interrupted)
    _, files = load_snapshot(HOST)
    bounded = check.ceilings(HOST, 2, 2, 2, files=files)
    planned = check.Search(
        HOST, "none", 2, bounded, Bounds(bounded, 2), True, Budget(), False, files
    )
    try:
        with pytest.raises(KeyboardInterrupt):
            check.searched([planned, planned], [], treeops, jobs=2, symmetry=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert multiprocessing.active_children() == []


def _workers_of(pid: int) -> list[int]:
    """Return the pool workers among the children of process ``pid`` (not its resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text(encoding="ascii").rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return found


@contextlib.contextmanager
def _searching() -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """Run ``check --jobs 2`` on two long searches; yield it and its workers once they search.

    It runs in a session of its own, ended whole at the end, whatever the test did.
    """
    # A shell starts background jobs with SIGINT ignored (`make test &`), and a process
    # keeps that: the command takes SIGINT as Python does by default, whoever started pytest.
    command = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from fsm_cache.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    specs = [str(STORAGE_THREE), str(HOST_STORAGE)]
    argv = [sys.executable, "-c", command, "check", *specs, "--jobs", "2", "--max-seconds", "60"]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            deadline = time.monotonic() + 60
            while len(_workers_of(child.pid)) < 2 and time.monotonic() < deadline:
                assert child.poll() is None, "the check ended before its workers ran"
                time.sleep(0.05)
            pool = _workers_of(child.pid)
            assert len(pool) == 2
            # the command ignores SIGINT while it starts its workers, and an interrupt then
            # is lost: a test's comes once it takes SIGINT again (a second's sleep was a guess)
            while _ignores_interrupts(child.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _ignores_interrupts(child.pid)
            yield child, pool
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_ctrl_c_to_the_group_is_one_line_and_ends_every_worker() -> None:
    """A terminal's Ctrl-C reaches the workers too: each printed its own interrupt."""
    with _searching() as (child, pool):
        # whether a worker prints its interrupt races the parent's terminate: what it
        # does with SIGINT is read first, so the test does not pass by that race
        assert [_ignores_interrupts(pid) for pid in pool] == [True, True]
        os.killpg(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=30)
    assert (child.returncode, out, err) == (130, "", "interrupted\n")
    deadline = time.monotonic() + 10
    while _alive(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pool)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_worker_killed_mid_search_fails_the_run_instead_of_hanging_it() -> None:
    """An out-of-memory kill of a worker left its result awaited for ever."""
    with _searching() as (child, pool):
        os.kill(pool[0], signal.SIGKILL)
        try:
            out, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the check waited for the killed worker's result")
    assert (child.returncode, out, err) == (2, "", f"error: {check.WORKER_LOST}\n")
    deadline = time.monotonic() + 10
    while _alive(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pool)


def _alive(pids: list[int]) -> bool:
    """Whether any of ``pids`` still runs (a zombie left to be reaped has ended)."""
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return True
    return False


def _ignores_interrupts(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask, from ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False
