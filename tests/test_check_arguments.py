"""``fsm-cache check``'s arguments: an option it would not use is refused, never dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import BadArgument
from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.spec.shipped import spec_dir


HOST = spec_dir() / "host_residency.toml"
DEVICE = spec_dir() / "device_residency.toml"
STORAGE = spec_dir() / "storage_residency.toml"
SPLIT_DROPS_PINS = spec_dir() / "bugs_detected" / "split_drops_pins.py"


@pytest.fixture
def unexplored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything is explored: a refused command line checks nothing."""

    def run(*_: object, **__: object) -> None:
        raise AssertionError("a spec was explored though the command line is refused")

    monkeypatch.setattr(check, "check_spec", run)


@pytest.mark.usefixtures("unexplored")
@pytest.mark.parametrize(
    ("argv", "errors"),
    [
        (
            [str(HOST), "--max-locks", "3"],
            [
                "check: --max-locks 3 bounds a counter named locks, and no spec checked has one "
                f"({HOST}: pins)"
            ],
        ),
        (
            [str(DEVICE), "--max-pins", "0"],
            [
                "check: --max-pins 0 bounds a counter named pins, and no spec checked has one "
                f"({DEVICE}: locks)"
            ],
        ),
        (
            [str(HOST), str(STORAGE), "--max-count", "5", "--max-locks", "1"],
            [
                "check: --max-locks 1 bounds a counter named locks, and no spec checked has one "
                f"({HOST}: pins; {STORAGE}: no counters)",
                "check: --max-count 5 bounds counters not named pins or locks, and no spec "
                f"checked has one ({HOST}: pins; {STORAGE}: no counters)",
            ],
        ),
    ],
)
def test_a_counter_bound_no_spec_has_is_refused_naming_the_option_and_the_specs(
    capsys: pytest.CaptureFixture[str], argv: list[str], errors: list[str]
) -> None:
    """``--max-locks 3`` on a spec counting pins alone was dropped without a word, exit 0."""
    assert main(["check", "--nodes", "1", *argv]) == 2
    assert capsys.readouterr() == ("", "".join(f"error: {e}\n" for e in errors))


def test_a_counter_bound_one_spec_has_applies_to_that_spec(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["check", "--nodes", "1", "--json", "--max-locks", "1", str(HOST), str(DEVICE)]
    assert main(argv) == 0
    bounds = [s["bounds"] for s in json.loads(capsys.readouterr().out)["specs"]]
    assert bounds == [{"pins": 2}, {"locks": 1}]


def test_the_default_bounds_are_given_to_no_spec_without_their_counter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Leaving an option out never refuses a spec that lacks its counter."""
    assert main(["check", "--nodes", "1", "--json", str(STORAGE), str(HOST)]) == 0
    bounds = [s["bounds"] for s in json.loads(capsys.readouterr().out)["specs"]]
    assert bounds == [{}, {"pins": 2}]


@pytest.mark.usefixtures("unexplored")
@pytest.mark.parametrize("argv", [[str(HOST)], ["--ops", str(SPLIT_DROPS_PINS)]])
def test_no_controls_is_refused_where_no_control_would_run(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """The controls run only without SPEC and --ops: ``--no-controls`` there was dropped unsaid."""
    assert main(["check", "--nodes", "1", "--no-controls", *argv]) == 2
    assert capsys.readouterr() == (
        "",
        "error: check: --no-controls skips the negative controls, which run only without "
        "SPEC arguments and --ops; this run has none to skip\n",
    )


def test_a_spec_named_twice_in_any_spelling_is_checked_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each repeat was searched again: minutes on four nodes, for the same result."""
    monkeypatch.chdir(HOST.parent)
    other = f"../{HOST.parent.name}/{HOST.name}"
    assert main(["check", "--nodes", "1", "--json", HOST.name, str(DEVICE), other]) == 0
    specs = [s["spec"] for s in json.loads(capsys.readouterr().out)["specs"]]
    assert specs == [HOST.name, str(DEVICE)]


KEPT_FROM_THREE = """
[machine]
name = "kept"
initial = "free"

[counters]
pins = 0
generation = 3

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
"""A ``drop`` that loses a pin (found after ``pin``, ``drop``), and a counter that starts at 3."""


def test_a_counter_that_starts_above_its_ceiling_is_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No step is taken past a ceiling: every step was refused, and the start alone passed.

    ``generation`` starts at 3, past the default ceiling of 2, so even ``pin``
    (which leaves it alone) was cut: one state explored, ``no invariant
    violated``, exit status 0, and the lost pin never found.
    """
    path = tmp_path / "kept.toml"
    path.write_text(KEPT_FROM_THREE)
    refusal = (
        "check: kept: generation starts at 3, above its ceiling 2 (--max-count): no step is "
        "taken past a ceiling, so nothing would be explored; give --max-count 3 or more"
    )
    with pytest.raises(BadArgument) as caught:
        check.check_spec(path, 1, Bounds({}))
    assert str(caught.value) == refusal
    assert main(["check", "--nodes", "1", str(path)]) == 2
    assert capsys.readouterr() == ("", f"error: {refusal}\n")
    found = check.check_spec(path, 1, Bounds({}, 3))
    assert found.violation == (
        "invariant 6: node 0: pins is 0 but its holders account for 1 (drop moves pins by other "
        "steps than one up or one down, so the check counts it as neither a hold nor a give-back)"
    )
    assert found.trace == ["start: chain", "node 0: pin", "node 0: drop"]


def test_a_counter_that_starts_above_every_ceiling_is_not_told_to_raise_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It was told ``give --max-count 65 or more``, which the command then refused."""
    path = tmp_path / "kept.toml"
    path.write_text(KEPT_FROM_THREE.replace("generation = 3", "generation = 65"))
    assert main(["check", "--nodes", "1", str(path)]) == 2
    assert capsys.readouterr() == (
        "",
        "error: check: kept: generation starts at 65, above its ceiling 2 (--max-count): no "
        "step is taken past a ceiling, so nothing would be explored; no ceiling check takes "
        "reaches it (--max-count is at most 64: each value of a counter is a state of its "
        "own on every node); start it lower\n",
    )


@pytest.mark.usefixtures("unexplored")
def test_every_bad_spec_is_reported_before_the_exit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first bad spec's errors were printed, where ``validate`` prints every one's."""
    monkeypatch.chdir(tmp_path)
    Path("a.toml").write_text('[machine]\nname = "a"\n', encoding="utf-8")
    Path("b.toml").write_text('[machine]\nname = "b"\n', encoding="utf-8")
    assert main(["check", "--nodes", "1", "a.toml", str(HOST), "b.toml"]) == 2
    assert capsys.readouterr() == (
        "",
        "error: a.toml: states: missing: a table of NAME = { doc = ... }\n"
        "error: a.toml: machine.initial: missing or not a string\n"
        "error: b.toml: states: missing: a table of NAME = { doc = ... }\n"
        "error: b.toml: machine.initial: missing or not a string\n",
    )
