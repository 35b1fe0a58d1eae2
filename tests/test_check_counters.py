"""``check`` on counters that count holders and counters that do not (tokens, retries)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import residency_system, spec_dir


STREAM = """
[machine]
name = "stream"
initial = "open"

[counters]
tokens = 0

[states]
open = { doc = "accepting tokens" }
closed = { doc = "done", final = true }

[[transition]]
event = "emit"
source = "open"
dest = "open"
guard = "tokens < 4096"
update = "tokens += 1"

[[forbid]]
event = "emit"
source = "open"
guard = "tokens >= 4096"
error = "BudgetSpent"
reason = "token budget spent"

[[transition]]
event = "close"
source = "open"
dest = "closed"
"""

JOB = """
[machine]
name = "job"
initial = "queued"

[counters]
tokens = 0
retries = 0

[states]
queued = { doc = "q", invariant = "tokens == 0" }
running = { doc = "r", invariant = "tokens >= 0" }
done = { doc = "d", final = true }

[[transition]]
event = "start"
source = "queued"
dest = "running"

[[transition]]
event = "emit"
source = "running"
dest = "running"
update = "tokens += 1"

[[transition]]
event = "fail"
source = "running"
dest = "queued"
guard = "retries < 3"
update = "retries += 1, tokens = 0"

[[transition]]
event = "fail"
source = "running"
dest = "done"
guard = "retries >= 3"

[[transition]]
event = "finish"
source = "running"
dest = "done"

[[forbid]]
event = "start"
source = "running"
error = "AlreadyRunning"
reason = "running"

[[forbid]]
event = "emit"
source = "queued"
error = "NotRunning"
reason = "not running"

[[forbid]]
event = "fail"
source = "queued"
error = "NotRunning"
reason = "not running"

[[forbid]]
event = "finish"
source = "queued"
error = "NotRunning"
reason = "not running"
"""

KEPT = """
[machine]
name = "kept"
initial = "free"

[counters]
pins = 0

[states]
free = { doc = "f", invariant = "pins == 0" }
pinned = { doc = "p", invariant = "pins >= 1", counter = "pins" }

[[transition]]
event = "pin"
source = ["free", "pinned"]
dest = "pinned"
update = "pins += 1"

[[transition]]
event = "drop"
source = "pinned"
dest = "free"
update = "pins = 0"

[[forbid]]
event = "drop"
source = "free"
error = "NotPinned"
reason = "not pinned"
"""


def _spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_only_counters_given_back_or_carried_count_holders(tmp_path: Path) -> None:
    def counts(text: str) -> tuple[str, ...]:
        return Layout.of(as_system(load_spec(_spec(tmp_path, text)))).holders.counts

    assert Layout.of(residency_system()).holders.counts == ("pins", "locks")
    assert counts(STREAM) == ()
    assert counts(JOB) == ()
    assert counts(KEPT) == ("pins",)


@pytest.mark.parametrize("text", [STREAM, JOB], ids=["tokens", "retries"])
def test_a_counter_no_holder_holds_is_neither_accounted_nor_owed(tmp_path: Path, text: str) -> None:
    result = check.check_spec(_spec(tmp_path, text), 2, Bounds({}))
    assert (result.violation, result.stopped) == (None, None)
    assert result.states > 1


def test_a_carried_count_nothing_gives_back_is_still_accounted(tmp_path: Path) -> None:
    """``pinned(pins)`` counts holders: a ``drop`` that zeroes it loses a pin."""
    result = check.check_spec(_spec(tmp_path, KEPT), 1, Bounds({}))
    assert result.violation == (
        "invariant 6: node 0: pins is 0 but its holders account for 1 (drop moves pins by other "
        "steps than one up or one down, so the check counts it as neither a hold nor a give-back)"
    )
    assert result.trace == ["start: chain", "node 0: pin", "node 0: drop"]


PLAIN = """
[machine]
name = "plain"
initial = "off"

[states]
off = { doc = "off" }
on = { doc = "on" }

[[transition]]
event = "flip"
source = "off"
dest = "on"

[[transition]]
event = "flip"
source = "on"
dest = "off"
"""


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    status = main(["check", "--nodes", "2", *argv])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    ("text", "argv", "expected"),
    [
        (JOB, ("--max-count", "0"), ("tokens <= 0, retries <= 0", {"tokens": 0, "retries": 0})),
        (STREAM, (), ("tokens <= 2", {"tokens": 2})),
        (KEPT, ("--max-pins", "1"), ("pins <= 1", {"pins": 1})),
        (PLAIN, (), ("no counters", {})),
    ],
    ids=["other-counters", "default-count", "pins", "none"],
)
def test_the_report_names_the_bound_of_each_counter_the_spec_has(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    text: str,
    argv: tuple[str, ...],
    expected: tuple[str, dict[str, int]],
) -> None:
    shown, bounds = expected
    path = _spec(tmp_path, text)
    _, out = _cli(capsys, *argv, str(path))
    assert out[0] == f"{path}: 2 nodes (chain), {shown}"
    _, out = _cli(capsys, "--json", *argv, str(path))
    assert json.loads("\n".join(out))["specs"][0]["bounds"] == bounds


def test_the_report_of_a_one_region_shipped_spec_names_its_own_counter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = spec_dir() / "device_residency.toml"
    assert _cli(capsys, "--max-locks", "1", str(path))[1][0] == (
        f"{path}: 2 nodes (chain), locks <= 1"
    )
