"""``check`` judges acquires and give-backs by what their steps do, and refuses give-backs of nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from pools import ACCEPTED, REFUSED, pool
from reader_specs import ALL_AT_ONCE, FINAL_HOLD

from fsm_cache.cli.main import main
from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout
from fsm_cache.spec import changes as spec_changes
from fsm_cache.spec import validate
from fsm_cache.spec.changes import changes
from fsm_cache.spec.guards import Guard
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import MachineSpec, as_system
from fsm_cache.spec.validate import representatives


def _pool(
    tmp_path: Path,
    acquire: str = "holders += 1",
    last: str = "holders -= 1",
    at_zero: str = REFUSED,
) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(pool(acquire, last, at_zero))
    return path


def _layout(path: Path) -> Layout:
    return Layout.of(as_system(load_spec(path)))


HOLD = ("holders", ("state",))


def test_an_assignment_the_source_state_pins_is_an_acquire(tmp_path: Path) -> None:
    """``holders = 1`` from ``idle`` (``holders == 0``) adds one: the pool pairs and checks clean."""
    path = _pool(tmp_path, acquire="holders = 1")
    holders = _layout(path).holders
    assert holders.acquires["acquire"] == (HOLD,)
    assert holders.releases["release"] == (HOLD,)
    assert holders.unpaired == ()
    result = check.check_spec(path, 3, Bounds({}))
    assert (result.violation, result.stopped) == (None, None)
    assert result.states == 45


def test_an_assignment_the_guard_pins_is_a_give_back(tmp_path: Path) -> None:
    """``holders = 0`` guarded ``holders == 1`` subtracts one: the last release gives back."""
    path = _pool(tmp_path, last="holders = 0")
    assert _layout(path).holders.releases["release"] == (HOLD,)
    result = check.check_spec(path, 3, Bounds({}))
    assert (result.violation, result.stopped) == (None, None)
    assert result.states == 45


def test_an_assignment_nothing_pins_adds_no_one_amount(tmp_path: Path) -> None:
    """``holders = 1`` guarded ``holders >= 2`` subtracts one at 2, two at 3, and so on."""
    path = _pool(tmp_path)
    old = 'guard = "holders >= 2"\nupdate = "holders -= 1"'
    path.write_text(path.read_text().replace(old, 'guard = "holders >= 2"\nupdate = "holders = 1"'))
    machine = as_system(load_spec(path)).machines["state"]
    found = changes(machine, "release")["holders"]
    assert {(2, -1), (3, -2)} <= found  # values a representative stands for alone
    assert max(found) == (4, None)  # and 4 stands for every value from 4 up
    assert _layout(path).holders.releases["release"] == ()


def test_changes_computes_each_states_representatives_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The representatives ``changes`` draws valuations from are the ones it reads."""
    machine = as_system(load_spec(_pool(tmp_path))).machines["state"]
    asked: list[Guard] = []

    def counted(spec: MachineSpec, *extra: Guard) -> dict[str, tuple[int, ...]]:
        asked.extend(extra)
        return representatives(spec, *extra)

    monkeypatch.setattr(validate, "representatives", counted)
    monkeypatch.setattr(spec_changes, "representatives", counted)
    assert changes(machine, "release")["holders"]
    assert asked == [state.invariant for state in machine.states]


def test_a_give_back_accepted_with_nothing_held_is_named(tmp_path: Path) -> None:
    """``release`` from ``idle`` to ``idle`` gives back what nobody took: found at the start."""
    path = _pool(tmp_path, at_zero=ACCEPTED)
    layout = _layout(path)
    assert layout.holders.releases["release"] == (HOLD,)
    assert layout.unheld(layout.fresh(-1)) == [("release", HOLD)]
    result = check.check_spec(path, 3, Bounds({}))
    assert result.violation == (
        "invariant 6: node 0: release is accepted though nothing holds holders there "
        "(holders=0, no acquire to give back)"
    )
    assert result.trace == ["start: chain"]


def test_a_give_back_refused_at_zero_is_no_finding(tmp_path: Path) -> None:
    layout = _layout(_pool(tmp_path))
    assert layout.unheld(layout.fresh(-1)) == [("release", HOLD)]  # asked, and refused
    result = check.check_spec(_pool(tmp_path), 3, Bounds({}))
    assert (result.violation, result.stopped, result.states) == (None, None, 45)


BUSY = """
[machine]
name = "conn_busy"
initial = "idle"

[counters]
holders = 0

[states]
idle = { invariant = "holders == 0" }
leased = { invariant = "holders >= 1", counter = "holders" }
busy = { invariant = "holders >= 1", counter = "holders" }

[[transition]]
event = "acquire"
source = ["idle", "leased"]
dest = "leased"
update = "holders += 1"

[[forbid]]
event = "acquire"
source = "busy"
error = "QueryInFlight"
reason = "a query is in flight"

[[transition]]
event = "release"
source = "leased"
dest = "leased"
guard = "holders >= 2"
update = "holders -= 1"

[[transition]]
event = "release"
source = "leased"
dest = "idle"
guard = "holders == 1"
update = "holders -= 1"

[[forbid]]
event = "release"
source = "idle"
error = "ReleaseAtZero"
reason = "release without a matching acquire"

[[forbid]]
event = "release"
source = "busy"
error = "QueryInFlight"
reason = "wait for the query to finish"

[[transition]]
event = "query"
source = "leased"
dest = "busy"

[[forbid]]
event = "query"
source = ["idle", "busy"]
error = "NotLeased"
reason = "lease the connection, and one query at a time"

[[transition]]
event = "query_done"
source = "busy"
dest = "leased"

[[forbid]]
event = "query_done"
source = ["idle", "leased"]
error = "StrayAck"
reason = "no query in flight"
"""


def test_a_give_back_refused_until_an_acknowledgement_is_a_wait(tmp_path: Path) -> None:
    """``release`` refused while a query is in flight is accepted after ``query_done``."""
    path = tmp_path / "busy.toml"
    path.write_text(BUSY)
    result = check.check_spec(path, 3, Bounds({}))
    assert (result.violation, result.stopped) == (None, None)
    assert result.states > 9  # past the state where release is first refused


TREE = """
[composition]
name = "tree_leases"
label = "node"

[composition.regions]
conn = "pool.toml"

[[forbid]]
event = "release"
when = "any child conn in [leased]"
error = "ChildStillLeased"
reason = "children release first"
"""

PARENTS_FIRST = """
[[forbid]]
event = "release"
when = "parent conn in [leased]"
error = "ParentStillLeased"
reason = "parents release first"
"""


def test_a_give_back_refused_until_a_child_gives_back_is_a_wait(tmp_path: Path) -> None:
    _pool(tmp_path)
    path = tmp_path / "tree.toml"
    path.write_text(TREE)
    result = check.check_spec(path, 3, Bounds({}))
    assert (result.violation, result.stopped) == (None, None)


def test_a_give_back_nothing_re_enables_is_a_deadlock(tmp_path: Path) -> None:
    """Children release first and parents release first: a leased parent and child never do."""
    _pool(tmp_path)
    path = tmp_path / "tree.toml"
    path.write_text(TREE + PARENTS_FIRST)
    result = check.check_spec(path, 3, Bounds({}))
    assert result.violation == (
        "liveness: node 0: acquire can never give back its holders (release: ChildStillLeased)"
    )
    assert result.trace == ["start: chain", "node 0: acquire", "node 1: acquire"]


def _served(tmp_path: Path) -> Path:
    """The pool, each release also counting the lease it served (``served``, only ever raised)."""
    path = _pool(tmp_path, last="holders -= 1, served += 1")
    text = path.read_text().replace("holders = 0\n", "holders = 0\nserved = 0\n")
    more = 'guard = "holders >= 2"\nupdate = "holders -= 1'
    path.write_text(text.replace(more, f"{more}, served += 1"))
    return path


def test_a_give_back_only_a_ceiling_cuts_is_taken_to_settle_and_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At ``served`` 2 a ``release`` would take it past its ceiling, so it is not fired.

    Liveness read that as a holder that can never give back, a finding the
    spec does not have: ``acquire can never give back its holders (release:
    waits)``, the engine accepting the release it named. Such states are taken
    to settle, and the report says how many it could not decide.
    """
    path = _served(tmp_path)
    result = check.check_spec(path, 1, Bounds({}))
    assert (result.violation, result.stopped, result.states) == (None, None, 9)
    assert result.past_ceiling == 3  # served 2 with 1 or 2 holders, and served 1 with 2
    assert main(["check", "--nodes", "1", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  not explored: past the ceilings, where 3 states settle (each only by a step that "
        "takes a counter past its ceiling); liveness takes them to settle"
    )


def test_a_deadlock_is_found_beside_give_backs_a_ceiling_cuts(tmp_path: Path) -> None:
    """Taking the states past a ceiling to settle leaves those that never settle stuck."""
    _served(tmp_path)  # pool.toml, which the tree composes
    path = tmp_path / "tree.toml"
    path.write_text(TREE + PARENTS_FIRST)
    result = check.check_spec(path, 3, Bounds({}))
    assert result.violation == (
        "liveness: node 0: acquire can never give back its holders (release: ChildStillLeased)"
    )
    assert result.trace == ["start: chain", "node 0: acquire", "node 1: acquire"]
    assert result.past_ceiling > 0


def test_a_hold_no_event_gives_back_says_so(tmp_path: Path) -> None:
    """A final state that keeps its readers, with no event that gives one back.

    The finding named no event at all: ``load can never give back its
    readers ()``.
    """
    path = tmp_path / "final.toml"
    path.write_text(FINAL_HOLD)
    result = check.check_spec(path, 1, Bounds({}))
    assert result.violation == (
        "liveness: node 0: load can never give back its readers (no event of the spec does)"
    )
    assert result.trace == ["start: chain", "node 0: load"]


def test_an_account_that_fails_names_the_steps_it_does_not_count(tmp_path: Path) -> None:
    """``done`` sets ``readers = 0``: not one down, so no give-back, and one reader failed it.

    The finding read as if a reader who loaded and finished broke the
    account, without saying that ``done`` was not counted as a give-back.
    """
    path = tmp_path / "all.toml"
    path.write_text(ALL_AT_ONCE)
    result = check.check_spec(path, 1, Bounds({}))
    assert result.violation == (
        "invariant 6: node 0: readers is 0 but its holders account for 1 (done moves readers "
        "by other steps than one up or one down, so the check counts it as neither a hold nor "
        "a give-back)"
    )
    assert result.trace == ["start: chain", "node 0: load", "node 0: done"]
