"""The pytest plugin: trail mode, spec items, the fsm_spec marker and leaks at the end of the run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from reader_specs import STUCK_AT_THREE

from fsm_cache.modelcheck.check import TOO_MANY_NODES
from fsm_cache.spec.shipped import spec_dir


pytest_plugins = ["pytester"]

BUGS = spec_dir() / "bugs_detected"

RECORD = """
from fsm_cache.engine.core import Engine
from fsm_cache.spec.shipped import host_machine

ENGINE = Engine(host_machine())
NODES = []


def backed(ident):
    rec = ENGINE.new(ident)
    NODES.append(rec)
    ENGINE.fire(rec, "write")
    ENGINE.fire(rec, "write_done")
    return rec
"""
"""A test module's prelude: a live engine, and nodes the module keeps alive."""

GATE = """
[machine]
name = "gate"
initial = "open"

[counters]
holders = 0

[states]
open = {{ invariant = "holders == 0" }}
held = {{ invariant = "holders >= 1", counter = "holders" }}

[[transition]]
event = "take"
source = ["open", "held"]
dest = "held"
update = "holders += {take}"

[[transition]]
event = "give"
source = "held"
dest = "open"
guard = "holders == 1"
update = "{last}"

[[transition]]
event = "give"
source = "held"
dest = "held"
guard = "holders >= 2"
update = "holders -= 1"

[[forbid]]
event = "give"
source = "open"
error = "GiveAtZero"
reason = "nobody holds it"
"""
"""A two-state user spec: ``take`` adds ``take`` holders, the last ``give`` does ``last``."""
GOOD_GATE = GATE.format(take=1, last="holders -= 1")
BROKEN_GATE = GATE.format(take=2, last="holders = 0")
"""A take that adds two holders: verify and check both find it."""


@pytest.fixture
def pytester(pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester, its runs without Hypothesis's pytest plugin (``-p no:hypothesispytest``).

    No run here uses Hypothesis, and its plugin imports all of it as a run
    starts: two thirds of the CPU time of a run that collects a test or two.
    Every other installed plugin, fsm_cache's among them, loads as in any run.
    """
    pytester.plugins.append("no:hypothesispytest")
    return pytester


def line_of(path: Path, text: str) -> int:
    """Return the number of the first line of the file at ``path`` that contains ``text``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def leaks(result: pytest.RunResult) -> list[str]:
    """Return the lines of the run's ``fsm_cache leaks`` section."""
    lines = result.stdout.lines
    starts = [i for i, line in enumerate(lines) if " fsm_cache leaks " in line]
    if not starts:
        return []
    section = lines[starts[0] + 1 :]
    return section[: next(i for i, line in enumerate(section) if line.startswith("="))]


def test_fsm_trail_turns_on_trail_mode(pytester: pytest.Pytester) -> None:
    """Engines built as a conftest is imported too: it was turned on only after that."""
    pytester.makeconftest(
        """
        import pytest
        from fsm_cache.engine.core import Engine
        from fsm_cache.spec.shipped import host_machine

        ENGINE = Engine(host_machine())

        @pytest.fixture
        def conftest_engine():
            return ENGINE
        """
    )
    pytester.makepyfile(
        """
        import os
        from fsm_cache.engine.core import Engine
        from fsm_cache.spec.shipped import host_machine

        def test_trail(conftest_engine):
            assert os.environ["FSM_CACHE_TRAIL"] == "1"
            assert Engine(host_machine()).trail
            assert conftest_engine.trail
        """
    )
    result = pytester.runpytest_subprocess("--fsm-trail")
    result.assert_outcomes(passed=1)
    assert "DeprecationWarning" not in result.stdout.str()


def test_fsm_audit_is_a_deprecated_spelling_of_fsm_trail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        from fsm_cache.engine.core import Engine
        from fsm_cache.spec.shipped import host_machine

        def test_trail():
            assert os.environ["FSM_CACHE_TRAIL"] == "1"
            assert Engine(host_machine()).trail
        """
    )
    result = pytester.runpytest_subprocess("--fsm-audit")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*DeprecationWarning: --fsm-audit is deprecated; pass --fsm-trail instead"]
    )


def test_leaked_lease_fails_the_run(pytester: pytest.Pytester) -> None:
    module = pytester.makepyfile(
        RECORD
        + """
HELD = []

def test_leaks():
    HELD.append(ENGINE.lease(backed(7)))
"""
    )
    taken = line_of(module, "HELD.append")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1)
    assert leaks(result) == [
        "fsm_cache: 1 lease(s) never released:",
        f"  <Lease pin on node 7, taken at {module.name}:{taken} in test_leaks, held>",
        "fsm_cache: 1 record(s) still held:",
        "  node 7: pinned (pins=1)",
    ]


def test_leaks_found_by_xdist_workers_fail_the_run(pytester: pytest.Pytester) -> None:
    """Each worker hands its report to the controller, which prints it and fails the run.

    Before, the workers' reports and exit statuses never reached the user: the run passed.
    """
    module = pytester.makepyfile(
        RECORD
        + """
HELD = []

def test_leaks():
    HELD.append(ENGINE.lease(backed(7)))

def test_passes():
    pass
"""
    )
    taken = line_of(module, "HELD.append")
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2)
    found = leaks(result)
    worker = re.fullmatch(r"fsm_cache: 1 lease\(s\) never released \(on (gw[01])\):", found[0])
    assert worker is not None, found
    assert found == [
        f"fsm_cache: 1 lease(s) never released (on {worker[1]}):",
        f"  <Lease pin on node 7, taken at {module.name}:{taken} in test_leaks, held>",
        f"fsm_cache: 1 record(s) still held (on {worker[1]}):",
        "  node 7: pinned (pins=1)",
    ]


def test_xdist_workers_that_leak_nothing_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(RECORD + "\ndef test_releases():\n    ENGINE.lease(backed(7)).release()\n")
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    assert leaks(result) == []


def test_dropped_receipt_fails_the_run(pytester: pytest.Pytester) -> None:
    """The lease is collected at once, its node stays pinned: both are reported."""
    module = pytester.makepyfile(
        RECORD
        + """
def test_drops_its_receipt():
    ENGINE.lease(backed(7))
"""
    )
    taken = line_of(module, "ENGINE.lease")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert leaks(result) == [
        "fsm_cache: 1 lease(s) dropped while held:",
        f"  node 7: pin taken at {module.name}:{taken} in test_drops_its_receipt"
        f" (collected during {module.name}::test_drops_its_receipt)",
        "fsm_cache: 1 record(s) still held:",
        "  node 7: pinned (pins=1)",
    ]


SITES = (  # the lines each event in trail mode is fired from, found by their text
    '"write"',
    '"write_done"',
    '"pin"',
    ".write(node)",
    ".write_done(node)",
    "node.protect_host()",
)


def test_pins_without_a_lease_fail_the_run_and_name_their_sites_in_trail_mode(
    pytester: pytest.Pytester,
) -> None:
    module = pytester.makepyfile(
        RECORD
        + """
from fsm_cache.compat.sglang import ResidencyMixin

class TreeNode(ResidencyMixin):
    def __init__(self, ident):
        super().__init__()
        self.id, self.parent, self.children = ident, None, {}

def test_bare_pin():
    ENGINE.fire(backed(8), "pin")

def test_sglang_protect_host():
    node = TreeNode(9)
    node.parent = TreeNode(0)  # a root's counts are its children's: not reported
    NODES.append(node)
    TreeNode.machine().write(node)
    TreeNode.machine().write_done(node)
    node.protect_host()
"""
    )
    result = pytester.runpytest_subprocess("--fsm-trail")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    written, acked, pinned, *compat = (f"{module.name}:{line_of(module, x)}" for x in SITES)
    assert leaks(result) == [
        "fsm_cache: 2 record(s) still held:",
        f"  node 8: pinned (pins=1); written at {written} in backed;"
        f" acknowledged at {acked} in backed; pinned at {pinned} in test_bare_pin",
        "  node 9: pinned/resident (pins=1, locks=0);"
        f" written at {compat[0]} in test_sglang_protect_host;"
        f" acknowledged at {compat[1]} in test_sglang_protect_host;"
        f" pinned at {compat[2]} in test_sglang_protect_host",
    ]


def test_ini_options_turn_leak_checks_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(RECORD + "\ndef test_drops():\n    ENGINE.lease(backed(7))\n")
    pytester.makeini("[pytest]\nfsm_leases = false\nfsm_holds = false\n")
    result = pytester.runpytest_subprocess("-W", "ignore::ResourceWarning")
    assert result.ret == pytest.ExitCode.OK
    assert leaks(result) == []


def test_allow_leaks_excuses_a_lease_dropped_on_purpose(pytester: pytest.Pytester) -> None:
    """Only the marker, or a test forgetting its own, excuses a dropped lease; no test hides others'.

    The plugin reported from the process-wide log: a test that forgot the
    whole log, as the docs advised, forgot what every earlier test had
    dropped, and one that turned recording off hid every later leak. The
    teardown of a module fixture runs in its last test's: what it dropped was
    excused by that test's marker, hidden when the test turned recording off,
    and said to be collected during the test itself.
    """
    module = pytester.makepyfile(
        """
        import pytest
        from fsm_cache.engine.core import Engine
        from fsm_cache.engine.lease import dropped_leases, forget_dropped, record_dropped
        from fsm_cache.spec.shipped import host_machine

        def hold(ident):
            engine = Engine(host_machine())
            rec = engine.new(ident)
            rec.state = "backed"
            return engine.lease(rec)

        def drop(ident):
            hold(ident)

        @pytest.fixture(scope="module")
        def handed():
            lease = hold(5)
            yield
            del lease  # in the teardown of the module's last test

        @pytest.fixture
        def own():
            lease = hold(6)
            yield
            del lease  # in the marked test's own teardown: excused

        @pytest.mark.fsm_allow_leaks
        def test_on_purpose(handed, own):
            drop(1)

        def test_by_mistake():
            drop(2)

        def test_forgets_what_it_dropped_by_hand():
            drop(3)
            forget_dropped(dropped_leases())

        def test_turns_recording_off():
            record_dropped(False)

        def test_later_by_mistake():
            drop(4)

        @pytest.mark.fsm_allow_leaks
        def test_last():
            record_dropped(False)
        """
    )
    result = pytester.runpytest_subprocess("-W", "ignore::ResourceWarning")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    taken = f"{module.name}:{line_of(module, 'return engine.lease(rec)')} in hold"
    assert leaks(result) == [
        "fsm_cache: 3 lease(s) dropped while held:",
        f"  node 2: pin taken at {taken} (collected during {module.name}::test_by_mistake)",
        f"  node 4: pin taken at {taken} (collected during {module.name}::test_later_by_mistake)",
        f"  node 5: pin taken at {taken}"
        f" (collected during the teardown of {module.name}::test_last)",
    ]


def test_leases_dropped_in_reference_cycles_are_collected_during_their_test(
    pytester: pytest.Pytester,
) -> None:
    module = pytester.makepyfile(
        """
        import gc
        import pytest
        from fsm_cache.engine.core import Engine
        from fsm_cache.spec.shipped import host_machine

        gc.disable()  # no collection but the plugin's: a cycle outlives its test unless it collects

        def drop_in_a_cycle(ident):
            engine = Engine(host_machine())
            rec = engine.new(ident)
            rec.state = "backed"
            cycle = [engine.lease(rec)]
            cycle.append(cycle)

        @pytest.mark.fsm_allow_leaks
        def test_on_purpose():
            drop_in_a_cycle(3)

        def test_by_mistake():
            drop_in_a_cycle(4)

        def test_after():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-W", "ignore::ResourceWarning")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3)
    assert leaks(result) == [
        "fsm_cache: 1 lease(s) dropped while held:",
        f"  node 4: pin taken at {module.name}:{line_of(module, 'cycle = [')} in drop_in_a_cycle"
        f" (collected during {module.name}::test_by_mistake)",
    ]


def test_released_leases_pass(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        RECORD
        + """
def test_releases():
    rec = backed(7)
    with ENGINE.lease(rec):
        assert rec.pins == 1
"""
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.OK
    assert leaks(result) == []


def test_leases_a_session_fixture_releases_at_teardown_pass(pytester: pytest.Pytester) -> None:
    """The check runs after every fixture is torn down, even on a run cut short by pytest.exit."""
    pytester.makepyfile(
        RECORD
        + """
import pytest

@pytest.fixture(scope="session")
def pinned():
    rec = backed(7)
    lease = ENGINE.lease(rec)
    yield rec
    lease.release()

def test_stops_the_run(pinned):
    assert pinned.pins == 1
    pytest.exit("stopped")
"""
    )
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert leaks(result) == []


def test_ini_specs_become_check_and_verify_items(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        f"""
        [pytest]
        fsm_specs =
            {spec_dir() / "device_residency.toml"}
            {BUGS / "unlock_skips_ancestor.toml"}
        fsm_check_nodes = 2
        """
    )
    # Item names hold the spec's absolute path, so select by the name's
    # prefix rather than by a bare word the checkout's path may contain.
    chosen = "fsm-check or (fsm-verify and device_residency.toml)"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", chosen)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*unlock_skips_ancestor.toml: violation: invariant 6: node 0: locks is 1 but its holders account for 0"
        ]
    )


def test_the_pytest_plugin_fails_a_spec_whose_check_stopped(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from fsm_cache.modelcheck.budget import Budget

        init = Budget.__init__

        def low(self, *args, **kwargs):
            kwargs.update(floor=1 << 30, available=lambda: 1 << 29)
            init(self, *args, **kwargs)

        Budget.__init__ = low
        """
    )
    residency = spec_dir() / "residency.toml"
    pytester.makeini(f"[pytest]\nfsm_specs =\n    {residency}\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-check")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*{residency}: check stopped after * states, not exhaustive: "
            "0.50 GiB of memory left, under the 1.00 GiB a check keeps free"
        ]
    )


FULL_GATE = GOOD_GATE.replace(
    'dest = "held"\nupdate = "holders += 1"',
    'dest = "held"\nguard = "holders < 5"\nupdate = "holders += 1"',
) + (
    '\n[[forbid]]\nevent = "take"\nsource = "held"\nguard = "holders >= 5"\n'
    'error = "GateFull"\nreason = "five hold it"\n'
)
"""A gate refusing a sixth holder: under the default ``holders <= 2`` that refusal is never met."""


def test_fsm_check_runs_the_check_command_with_its_ceilings_and_notes(
    pytester: pytest.Pytester,
) -> None:
    """``fsm-check`` and the marker size a spec as ``fsm-cache check PATH --nodes N`` does.

    They checked every spec with pins and locks up to 2, where the command
    takes a spec with a storage region to 3 pins: without its ``pins == 2``
    guard, ``StorePinHeld`` refuses every release of a node stored and loaded
    with a client's pin, which only a third pin reaches, so the item passed
    a spec the command fails. And the command's ``not explored`` lines were
    dropped: they are a warning on a pass.
    """
    for spec in spec_dir().glob("*.toml"):
        (pytester.path / spec.name).write_text(spec.read_text(encoding="utf-8"))
    storage = pytester.path / "residency_storage.toml"
    both = 'when = ["storage in [storing]", "device in [loading]"]\nguard = "pins == 2"\n'
    text = storage.read_text(encoding="utf-8")
    assert both in text
    storage.write_text(text.replace(both, both.replace('guard = "pins == 2"\n', "")))
    pytester.makefile(".toml", gate=FULL_GATE)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.fsm_spec("gate.toml", verify=False)
        def test_gate():
            pass
        """
    )
    pytester.makeini(
        "[pytest]\nfsm_specs = residency_storage.toml gate.toml\nfsm_check_nodes = 1\n"
    )
    chosen = "fsm-check or test_gate"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", chosen)
    result.assert_outcomes(passed=2, failed=1, warnings=2)
    result.stdout.fnmatch_lines(
        [
            f"{storage}: violation: invariant 6: node 0: release is refused (StorePinHeld) "
            "though pin holds pins there (pins=3)",
        ]
    )
    gate = pytester.path / "gate.toml"
    note = "not explored: holders above 2, where a comparison turns at 5 (--max-count 5 reaches it)"
    # both passing checks warn it: pytest's summary lists one warning under the two items
    result.stdout.fnmatch_lines(["*::test_gate", "gate.toml::fsm-check", f"  {gate}:0: *"])
    warned = [line.strip() for line in result.stdout.lines if "SpecUnexplored" in line]
    assert warned == [f"{gate}:0: SpecUnexplored: {note}"]


def test_the_pytest_plugin_fails_a_spec_crosshair_ran_out_of_time_on(
    pytester: pytest.Pytester,
) -> None:
    """The verdict of ``fsm-cache verify``: a contract left unknown is not proved, so it fails.

    In a millisecond a loaded machine may not even meet the precondition
    (a clean-clone ``make test`` did, for one function and not the other):
    ``not analysed``, which fails as well. Each row is one or the other.
    """
    pytester.makefile(".toml", gate=GOOD_GATE)
    pytester.makepyprojecttoml("[tool.fsm_cache.verify]\nper_condition_timeout = 0.001\n")
    pytester.makeini("[pytest]\nfsm_specs = gate.toml\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-verify")
    result.assert_outcomes(failed=1)
    gate = f"{pytester.path / 'gate.toml'}: gate."
    rows = [line for line in result.stdout.lines if line.startswith(gate)]
    unknown = [row for row in rows if row.endswith(": no counterexample within budget")]
    unmet = [row for row in rows if row.endswith(": not analysed: unable to meet precondition")]
    assert rows
    assert len(unknown) + len(unmet) == len(rows), rows
    if unknown:
        result.stdout.fnmatch_lines(
            ["* contract(s) unknown: CrossHair ran out of time before exhausting their paths; *"]
        )


def test_the_pytest_items_read_the_options_fsm_cache_verify_reads(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec's pyproject gives its options, run from the root or a folder with its own."""
    pytester.makepyprojecttoml(
        """
        [tool.pytest.ini_options]
        fsm_specs = ["specs/gate.toml"]

        [tool.fsm_cache.verify]
        per_condition_timeout = 3
        jobs = 1
        """
    )
    (pytester.path / "specs").mkdir()
    (pytester.path / "specs" / "gate.toml").write_text(GOOD_GATE)
    (pytester.path / "tools").mkdir()
    (pytester.path / "tools" / "pyproject.toml").write_text("[project]\nname = 'tools'\n")
    pytester.makeconftest(
        """
        from fsm_cache.contracts import runner, verify

        def verify_spec(path, options, workdir):
            return [runner.Row("gate", "take", repr(options), runner.COUNTEREXAMPLE)]

        verify.verify_spec = verify_spec
        """
    )
    shown = "*gate.take: Options(analysis_kind='icontract', per_condition_timeout=3.0, per_path_timeout=5.0, jobs=1): counterexample"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-verify")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([shown])
    monkeypatch.chdir(pytester.path / "tools")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-verify", "../specs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([shown])


def test_marker_model_checks_before_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.fsm_spec({str(spec_dir() / "residency.toml")!r}, verify=False)
        def test_good():
            pass

        @pytest.mark.fsm_spec({str(BUGS / "evict_device_while_writing.toml")!r}, verify=False)
        def test_bad():
            pass
        """
    )
    pytester.makeini("[pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*violation: invariant 5: node 1: a device-to-host copy reads a device copy that is absent"
        ]
    )


COUNTING = """
import pathlib

import fsm_cache.contracts.verify as verify
import fsm_cache.modelcheck.check as check


def counted(name, run):
    def counting(*args, **kwargs):
        with pathlib.Path("calls.txt").open("a") as calls:
            calls.write(name + "\\n")
        return run(*args, **kwargs)

    return counting


check.check_spec = counted("check", check.check_spec)
verify.verify_spec = counted("verify", verify.verify_spec)
"""


def test_a_spec_many_tests_name_is_checked_and_verified_once_a_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".toml", gate=GOOD_GATE)
    pytester.makeconftest(COUNTING)
    pytester.makepyfile(
        """
        import pathlib

        import pytest

        @pytest.mark.fsm_spec("gate.toml")
        def test_one():
            pass

        @pytest.mark.fsm_spec("gate.toml")
        @pytest.mark.fsm_spec("gate.toml")
        def test_named_twice():
            pass

        @pytest.mark.fsm_spec("gate.toml", verify=False)
        def test_check_only():
            pass

        def test_edit_the_spec():
            spec = pathlib.Path("gate.toml")
            spec.write_text(spec.read_text() + "\\n# edited\\n")

        @pytest.mark.fsm_spec("gate.toml")
        def test_after_the_edit():
            pass
        """
    )
    pytester.makeini("[pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=5)
    calls = (pytester.path / "calls.txt").read_text().split()
    assert calls == ["check", "verify", "check", "verify"]


def setup_errors(result: pytest.RunResult) -> dict[str, str]:
    """Return each test's setup error text, by test name."""
    found: dict[str, str] = {}
    name = ""
    for line in result.stdout.lines:
        if " ERROR at setup of " in line:
            name = line.split(" ERROR at setup of ")[1].split(" ")[0]
            found[name] = ""
        elif line.startswith(("=", "_")):
            name = ""
        elif name:
            found[name] += line + "\n"
    return found


def test_marker_verifies_and_model_checks_a_user_spec(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", gate=GOOD_GATE, broken=BROKEN_GATE)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.fsm_spec("gate.toml")
        def test_good():
            pass

        @pytest.mark.fsm_spec("broken.toml")
        def test_both():
            pass

        @pytest.mark.fsm_spec("broken.toml", verify=False)
        def test_check_only():
            pass

        @pytest.mark.fsm_spec("broken.toml", check=False)
        def test_verify_only():
            pass

        @pytest.mark.fsm_spec("broken.toml", check=False, verify=False)
        def test_neither():
            pass

        @pytest.mark.fsm_spec("broken.toml", verfy=False)
        def test_misspelt():
            pass

        @pytest.mark.fsm_spec("missing.toml")
        def test_missing():
            pass
        """
    )
    pytester.makeini("[pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rN")
    result.assert_outcomes(passed=2, errors=5)
    broken = pytester.path / "broken.toml"
    # the last give-back is written `holders = 0`, pinned to -1 by its guard: check pairs it
    check = [
        f"{broken}: violation: holders: give gives back one, but no event takes one"
        " (take adds 2): its acquires and releases do not pair",
    ]
    verify = f"{broken}: gate.take: holders moves by at most one (held(N) counts holders): counterexample: take("
    errors = {name: text.splitlines() for name, text in setup_errors(result).items()}
    assert sorted(errors) == [
        "test_both",
        "test_check_only",
        "test_missing",
        "test_misspelt",
        "test_verify_only",
    ]
    assert errors["test_check_only"][:1] == check
    assert errors["test_both"][:1] == check
    assert errors["test_both"][1].startswith(verify)
    assert errors["test_verify_only"][0].startswith(verify)
    assert not any(line.startswith(verify) for line in errors["test_check_only"])
    assert not any(line.endswith("do not pair") for line in errors["test_verify_only"])
    assert errors["test_misspelt"][0] == (
        "fsm_spec takes one spec path, verify= and check=:"
        " Mark(name='fsm_spec', args=('broken.toml',), kwargs={'verfy': False})"
    )
    missing = pytester.path / "missing.toml"
    assert errors["test_missing"] == [f"{missing}: cannot read: No such file or directory"]


@pytest.mark.parametrize("nodes", ["0", "-1", "three"])
def test_a_tree_size_that_checks_nothing_is_a_usage_error(
    pytester: pytest.Pytester, nodes: str
) -> None:
    """0 nodes explored one empty state and passed any spec, a known-bad control included."""
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini(f"[pytest]\nfsm_check_nodes = {nodes}\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: fsm_check_nodes must be a whole number >= 1, got '{nodes}'"]
    )


def test_a_tree_size_in_a_native_toml_table_is_a_number(pytester: pytest.Pytester) -> None:
    """pytest 9's ``[tool.pytest]`` table holds ``fsm_check_nodes = 2`` as an int: it was refused."""
    pytester.makepyfile(
        """
        from fsm_cache.pytest_plugin import check_nodes

        def test_nodes(request):
            assert check_nodes(request.config) == 2
        """
    )
    pytester.makepyprojecttoml("[tool.pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("name", ["fsm_leases", "fsm_holds"])
def test_a_leak_switch_that_is_no_bool_is_a_usage_error_before_anything_runs(
    pytester: pytest.Pytester, name: str
) -> None:
    """A bad ``fsm_holds`` was read only at the end of the run, after every test had run."""
    pytester.makepyfile("def test_runs():\n    pass\n")
    pytester.makeini(f"[pytest]\n{name} = 2\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {name} must be true or false: invalid truth value '2'"])
    assert "passed" not in result.stdout.str()


def test_a_tree_size_check_refuses_is_a_usage_error_before_anything_runs(
    pytester: pytest.Pytester,
) -> None:
    """It was accepted, and each ``fsm-check`` item then failed on it."""
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini("[pytest]\nfsm_check_nodes = 500\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: fsm_check_nodes must be at most 128, got 500 ({TOO_MANY_NODES})"]
    )


@pytest.mark.parametrize("separator", [" ", "\n    ", "  \n    "])
def test_ini_specs_are_separated_by_spaces_or_lines(
    pytester: pytest.Pytester, separator: str
) -> None:
    pytester.makeini(
        f"[pytest]\nfsm_specs = a.toml{separator}'b c.toml'\n    d.toml\n",
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    names = [line for line in result.stdout.lines if "fsm-" in line]
    assert names == [
        f"{name}::fsm-{kind}"
        for name in ("a.toml", "b c.toml", "d.toml")
        for kind in ("verify", "check")
    ]


def spec_project(
    pytester: pytest.Pytester, specs: str = "specs/gate.toml specs/broken.toml"
) -> None:
    """Lay out a project: two tests under ``tests/``, two user specs under ``specs/``."""
    lay_out(pytester.path, specs)


def lay_out(path: Path, specs: str = "specs/gate.toml specs/broken.toml") -> None:
    """Lay out :func:`spec_project`'s project at ``path``."""
    (path / "tests").mkdir()
    (path / "tests" / "test_a.py").write_text(
        "def test_x():\n    pass\n\n\ndef test_y():\n    pass\n", encoding="utf-8"
    )
    (path / "specs").mkdir()
    (path / "specs" / "gate.toml").write_text(GOOD_GATE, encoding="utf-8")
    (path / "specs" / "broken.toml").write_text(BROKEN_GATE, encoding="utf-8")
    ini = f"[pytest]\ntestpaths = tests\nfsm_specs = {specs}\nfsm_check_nodes = 2\n"
    (path / "tox.ini").write_text(ini, encoding="utf-8")


def collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    """Return the node ids ``pytest --collect-only ARGS`` lists, in order."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", *args)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    return [line for line in result.stdout.lines if "::" in line]


COLLECTIONS = """
import json
import os
import sys

import pytest

for i, (where, *args) in enumerate(json.loads(sys.argv[1])):
    os.chdir(where)
    print(f"@@ {i} starts", flush=True)
    code = pytest.main(["-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args])
    print(f"@@ {i} exits {int(code)}", flush=True)
"""
"""A child that runs ``pytest.main`` once per run its argument lists: a directory, then args."""


class Collection(NamedTuple):
    """What one ``pytest --collect-only`` run of :func:`spec_project`'s project printed."""

    ret: int
    lines: list[str]

    def ids(self) -> list[str]:
        """The node ids it lists, in order."""
        assert self.ret == pytest.ExitCode.OK, self.lines
        return [line for line in self.lines if "::" in line]


TESTS = ["tests/test_a.py::test_x", "tests/test_a.py::test_y"]
GATE_ITEMS = ["specs/gate.toml::fsm-verify", "specs/gate.toml::fsm-check"]
BROKEN_ITEMS = ["specs/broken.toml::fsm-verify", "specs/broken.toml::fsm-check"]


def test_spec_items_are_collected_counted_and_deselected_like_tests(
    pytester: pytest.Pytester,
) -> None:
    """They come after the suite's tests, and ``-k`` counts them among the deselected."""
    spec_project(pytester)
    assert collected(pytester) == TESTS + GATE_ITEMS + BROKEN_ITEMS
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-check")
    result.assert_outcomes(passed=1, failed=1, deselected=4)
    result.stdout.fnmatch_lines(
        [
            "collected 6 items / 4 deselected / 2 selected",
            "*_ fsm-check[[]specs/broken.toml[]] _*",
            f"{pytester.path / 'specs' / 'broken.toml'}: violation: holders: give gives back one,"
            " but no event takes one (take adds 2): its acquires and releases do not pair",
        ]
    )


REACHED = [
    ((), TESTS + GATE_ITEMS + BROKEN_ITEMS),
    ((".",), TESTS + GATE_ITEMS + BROKEN_ITEMS),
    (("specs",), GATE_ITEMS + BROKEN_ITEMS),
    (("specs/broken.toml",), BROKEN_ITEMS),
    (("specs/broken.toml::fsm-check",), BROKEN_ITEMS[1:]),
    (("tests/test_a.py", "specs/gate.toml"), TESTS + GATE_ITEMS),
    (("tests",), TESTS),
    (("tests/test_a.py",), TESTS),
    (("tests/test_a.py::test_x",), TESTS[:1]),
]
"""The arguments of a run of :func:`spec_project`, and the node ids it collects."""


LEFT_OUT = [
    (("tests",), "specs/gate.toml, specs/broken.toml"),
    (("tests", "specs/gate.toml"), "specs/broken.toml"),
    (("tests/test_a.py::test_x", "specs/broken.toml::fsm-check"), "specs/gate.toml"),
]
"""The arguments of a run that leaves specs out, and the specs it says it left."""
EVERY = [(), ("specs",), ("specs/gate.toml", "specs/broken.toml")]
"""The arguments of runs that reach every spec."""
COLLECTED = [
    *(("", "--collect-only", "-q", *args) for args, _ in REACHED),
    ("tests", "--collect-only", "-q"),
    ("specs", "--collect-only", "-q"),
    *(("", "--collect-only", *args) for args, _ in LEFT_OUT),
    *(("", "--collect-only", *args) for args in EVERY),
]
"""Every ``--collect-only`` run of :func:`spec_project`'s project the tests below look at:
the directory it starts from (under the project), then its arguments."""


@pytest.fixture(scope="module")
def collections(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Collection]:
    """What each run of :data:`COLLECTED` printed, by the run.

    One child process makes them all, each by its own ``pytest.main`` from its
    own directory, in a project laid out once: starting a child (Python,
    pytest, the plugins) cost more than the collection it made. The runs
    only collect, so none changes what the others see.
    """
    root = tmp_path_factory.mktemp("spec-project")
    lay_out(root)
    env = {**os.environ, "PY_COLORS": "0", "HOME": str(root)}
    env.pop("PYTEST_ADDOPTS", None)
    runs = json.dumps([[str(root / where), *args] for where, *args in COLLECTED])
    child = subprocess.run(
        [sys.executable, "-c", COLLECTIONS, runs],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=False,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    found: dict[tuple[str, ...], Collection] = {}
    lines: list[str] = []
    for line in child.stdout.splitlines():
        marker = re.fullmatch(r"@@ (\d+) (starts|exits) ?(-?\d*)", line)
        if marker is None:
            lines.append(line)
        elif marker[2] == "starts":
            lines = []
        else:
            found[COLLECTED[int(marker[1])]] = Collection(int(marker[3]), lines)
    assert len(found) == len(COLLECTED), child.stdout + child.stderr
    return found


@pytest.mark.parametrize(
    ("args", "expected"), [pytest.param(*x, id=" ".join(x[0]) or "no-args") for x in REACHED]
)
def test_spec_items_are_collected_where_the_arguments_reach_the_spec(
    collections: dict[tuple[str, ...], Collection], args: tuple[str, ...], expected: list[str]
) -> None:
    """The whole session, a directory above the spec or the spec itself runs it; other tests do not."""
    run = ("", "--collect-only", "-q", *args)
    assert collections[run].ids() == expected


@pytest.mark.parametrize(("args", "left"), LEFT_OUT)
def test_a_run_that_reaches_no_spec_says_which_it_left_out(
    collections: dict[tuple[str, ...], Collection], args: tuple[str, ...], left: str
) -> None:
    """A CI that names its test folder sees that it no longer checks the specs."""
    run = ("", "--collect-only", *args)
    assert (
        f"fsm_specs not collected (no argument reaches them): {left}; "
        "run pytest without arguments, or name them, to check them"
    ) in collections[run].lines


@pytest.mark.parametrize("args", EVERY)
def test_a_run_that_reaches_every_spec_says_nothing_of_them(
    collections: dict[tuple[str, ...], Collection], args: tuple[str, ...]
) -> None:
    run = ("", "--collect-only", *args)
    lines = collections[run].lines
    assert sum("fsm-check" in line for line in lines) == 2, lines  # it reached both
    assert not any("fsm_specs not collected" in line for line in lines)


def test_no_arguments_in_a_subdirectory_collect_only_the_specs_under_it(
    collections: dict[tuple[str, ...], Collection],
) -> None:
    assert collections["tests", "--collect-only", "-q"].ids() == TESTS
    assert collections["specs", "--collect-only", "-q"].ids() == GATE_ITEMS + BROKEN_ITEMS


def test_last_failed_reruns_only_the_spec_item_that_failed(pytester: pytest.Pytester) -> None:
    spec_project(pytester)
    first = pytester.runpytest_subprocess("-k", "not fsm-verify")
    first.assert_outcomes(passed=3, failed=1, deselected=2)
    again = pytester.runpytest_subprocess("--lf", "-k", "not fsm-verify")
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines(["FAILED specs/broken.toml::fsm-check - *"])


@pytest.mark.parametrize("args", [(), ("specs",)])
def test_a_missing_spec_fails_its_items_naming_the_file(
    pytester: pytest.Pytester, args: tuple[str, ...]
) -> None:
    """The rest of the session still runs: the loader's message is each item's failure."""
    spec_project(pytester, specs="specs/gate.toml specs/missing.toml")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "not fsm-verify", *args)
    result.assert_outcomes(passed=1 if args else 3, failed=1, deselected=2)
    missing = pytester.path / "specs" / "missing.toml"
    result.stdout.fnmatch_lines(
        [
            "*_ fsm-check[[]specs/missing.toml[]] _*",
            f"{missing}: cannot read: No such file or directory",
        ]
    )


def test_a_composed_spec_is_checked_again_once_a_region_file_changes(
    pytester: pytest.Pytester,
) -> None:
    for name in ("residency", "host_residency", "device_residency"):
        pytester.makefile(".toml", **{name: (spec_dir() / f"{name}.toml").read_text()})
    pytester.makeconftest(COUNTING)
    pytester.makepyfile(
        """
        import os
        import pathlib

        import pytest

        @pytest.mark.fsm_spec("residency.toml", verify=False)
        def test_before():
            pass

        def test_edit_a_region():
            region = pathlib.Path("host_residency.toml")
            region.write_text(region.read_text() + "\\n# edited\\n")

        @pytest.mark.fsm_spec("residency.toml", verify=False)
        def test_after_the_edit():
            pass

        def test_replace_the_spec_keeping_its_size_and_time():
            spec = pathlib.Path("residency.toml")
            before = spec.stat()
            spec.write_text(spec.read_text().replace("# The", "# the", 1))
            os.utime(spec, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p does
            assert spec.stat().st_size == before.st_size

        @pytest.mark.fsm_spec("./residency.toml", verify=False)
        def test_after_the_copy():
            pass
        """
    )
    pytester.makeini("[pytest]\nfsm_check_nodes = 2\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=5)
    calls = (pytester.path / "calls.txt").read_text().split()
    assert calls == ["check", "check", "check"]


@pytest.mark.parametrize("table", [False, True], ids=["ini", "pyproject"])
def test_the_ceiling_a_warning_names_can_be_set_for_fsm_check(
    pytester: pytest.Pytester, table: bool
) -> None:
    """The warning said ``--max-count 4 reaches it``, which no setting of the plugin could do."""
    pytester.makefile(".toml", stuck=STUCK_AT_THREE)
    pytester.makefile(".toml", gate=FULL_GATE)  # counts holders too: the setting bounds both
    names = "stuck.toml gate.toml"
    pytester.makeini(f"[pytest]\nfsm_specs = {names}\nfsm_check_nodes = 1\n")
    before = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-check")
    before.assert_outcomes(passed=2, warnings=2)
    stuck = pytester.path / "stuck.toml"
    note = "not explored: readers above 2, where a comparison turns at 4 (--max-count 4 reaches it)"
    assert f"{stuck}:0: SpecUnexplored: {note}" in [line.strip() for line in before.stdout.lines]
    (pytester.path / "tox.ini").unlink()
    if table:
        pytester.makepyprojecttoml(
            f'[tool.pytest]\nfsm_specs = {names.split()!r}\nfsm_check_nodes = "1"\n'
            'fsm_check_max_count = "5"\n'
        )
    else:
        pytester.makeini(
            f"[pytest]\nfsm_specs = {names}\nfsm_check_nodes = 1\nfsm_check_max_count = 5\n"
        )
    after = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "fsm-check")
    after.assert_outcomes(passed=1, failed=1)  # the gate explored to 5: no warning left
    after.stdout.fnmatch_lines(
        [
            f"{stuck}: violation: liveness: node 0: load can never give back its readers "
            "(done: WaitForOthers)"
        ]
    )


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("-1", "fsm_check_max_count must be a whole number >= 0, got '-1'"),
        ("four", "fsm_check_max_count must be a whole number >= 0, got 'four'"),
        (
            "65",
            "fsm_check_max_count must be at most 64, got 65 (each value of a counter is a "
            "state of its own on every node)",
        ),
    ],
)
def test_a_ceiling_fsm_check_cannot_take_is_a_usage_error(
    pytester: pytest.Pytester, value: str, error: str
) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini(f"[pytest]\nfsm_check_max_count = {value}\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {error}"])
