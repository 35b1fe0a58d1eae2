"""``check`` judges acquires and give-backs by what their steps do, and refuses give-backs of nothing."""

from __future__ import annotations

from pathlib import Path

from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.holders import changes
from fsm_cache.modelcheck.state import Layout
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system


POOL = """
[machine]
name = "conn_pool"
initial = "idle"

[counters]
holders = 0

[states]
idle = { invariant = "holders == 0" }
leased = { invariant = "holders >= 1", counter = "holders" }

[[transition]]
event = "acquire"
source = "idle"
dest = "leased"
update = "ACQUIRE"

[[transition]]
event = "acquire"
source = "leased"
dest = "leased"
update = "holders += 1"

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
update = "LAST"
AT_ZERO
"""

REFUSED = """
[[forbid]]
event = "release"
source = "idle"
error = "ReleaseAtZero"
reason = "release without a matching acquire"
"""

ACCEPTED = """
[[transition]]
event = "release"
source = "idle"
dest = "idle"
"""


def _pool(
    tmp_path: Path,
    acquire: str = "holders += 1",
    last: str = "holders -= 1",
    at_zero: str = REFUSED,
) -> Path:
    path = tmp_path / "pool.toml"
    text = POOL.replace("ACQUIRE", acquire).replace("LAST", last).replace("AT_ZERO", at_zero)
    path.write_text(text)
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

