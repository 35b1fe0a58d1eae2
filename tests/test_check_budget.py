"""A check that cannot finish stops and says so: a state cap, and memory kept free."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsm_cache.cli.main import main
from fsm_cache.errors import BadArgument, ConfigError
from fsm_cache.modelcheck import check, explore
from fsm_cache.modelcheck.budget import Budget, available_memory, default_floor
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.spec.controls import controls
from fsm_cache.spec.shipped import spec_dir


RESIDENCY = spec_dir() / "residency.toml"
BUGS = spec_dir() / "bugs_detected"
GIB = 1 << 30


def test_a_state_cap_stops_the_search_there_and_says_it_is_not_exhaustive() -> None:
    result = check.check_spec(RESIDENCY, 3, Bounds({}), budget=Budget(max_states=500))
    assert result.states == 500
    assert result.violation is None
    assert result.stopped == "the cap of 500 states (--max-states) was reached"


def test_a_cap_above_the_space_changes_nothing() -> None:
    whole = check.check_spec(RESIDENCY, 2, Bounds({}), budget=Budget(floor=None))
    capped = check.check_spec(RESIDENCY, 2, Bounds({}), budget=Budget(max_states=whole.states + 1))
    assert (capped.states, capped.stopped, capped.violation) == (whole.states, None, None)
    exact = check.check_spec(RESIDENCY, 2, Bounds({}), budget=Budget(max_states=whole.states))
    assert (exact.states, exact.stopped) == (whole.states, None)  # no state past the cap was met


def test_a_violation_before_the_cap_is_still_the_finding() -> None:
    result = check.check_spec(
        BUGS / "unlock_skips_ancestor.toml", 2, Bounds({}), budget=Budget(max_states=10_000)
    )
    assert result.stopped is None
    assert result.violation == "invariant 6: node 0: locks is 1 but its holders account for 0"


def test_low_memory_stops_the_search_with_what_is_left() -> None:
    low = Budget(floor=GIB, available=lambda: GIB // 4)
    result = check.check_spec(RESIDENCY, 3, Bounds({}), budget=low)
    assert result.violation is None
    assert 0 < result.states < 27_597  # stopped well before the 3-node space is explored
    assert result.stopped == "0.25 GiB of memory left, under the 1.00 GiB a check keeps free"


def test_unknown_or_ample_memory_never_stops_a_search() -> None:
    whole = check.check_spec(RESIDENCY, 2, Bounds({}), budget=Budget(floor=None))
    for available in (lambda: None, lambda: 64 * GIB):
        result = check.check_spec(RESIDENCY, 2, Bounds({}), budget=Budget(available=available))
        assert (result.states, result.stopped) == (whole.states, None)


def test_a_time_limit_stops_the_search_at_the_first_reading_past_it() -> None:
    readings: list[float] = []

    def clock() -> float:
        readings.append(100.0 + 4.0 * len(readings))  # 100 at the start, then 104, 108, ...
        return readings[-1]

    timed = Budget(max_seconds=10, floor=None, clock=clock)
    result = check.check_spec(RESIDENCY, 3, Bounds({}), budget=timed)
    assert readings == [100.0, 104.0, 108.0, 112.0]  # stopped at the first reading past 110
    assert result.violation is None
    assert 0 < result.states < 27_597
    assert result.stopped == "the limit of 10 s (--max-seconds) was reached"
    assert Budget(max_seconds=0.5, floor=None, clock=clock).exhausted(None) is None  # no deadline


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_states": 0}, "check: --max-states must be >= 1, got 0"),
        ({"max_seconds": 0.0}, "check: --max-seconds must be > 0, got 0"),
        ({"max_seconds": float("nan")}, "check: --max-seconds must be > 0, got nan"),
    ],
)
def test_a_budget_that_allows_nothing_is_refused(given: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(**given)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_time_is_checked_before_memory() -> None:
    both = Budget(max_seconds=1, floor=GIB, available=lambda: 0, clock=lambda: 5.0)
    assert both.exhausted(2.0) == "the limit of 1 s (--max-seconds) was reached"
    assert both.exhausted(9.0) == "0.00 GiB of memory left, under the 1.00 GiB a check keeps free"


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683664 kB\nMemAvailable:    2097152 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 2 * GIB  # no cgroup files: meminfo alone
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert available_memory(meminfo, cgroup) == 2 * GIB  # no limit
    (cgroup / "memory.max").write_text(f"{GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB // 4}\n")
    assert available_memory(meminfo, cgroup) == GIB * 3 // 4  # the container's limit is lower
    (cgroup / "memory.current").write_text(f"{2 * GIB}\n")
    assert available_memory(meminfo, cgroup) == 0  # over its limit
    assert available_memory(tmp_path / "none", tmp_path / "none") is None
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_memory(meminfo, tmp_path / "none") is None
    meminfo.write_text("MemAvailable: lots kB\n")
    assert available_memory(meminfo, tmp_path / "none") is None


def test_the_default_floor_is_a_sixteenth_of_the_memory_and_at_least_1_gib(
    tmp_path: Path,
) -> None:
    meminfo, cgroup, member = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "member"
    cgroup.mkdir()
    member.write_text("0::/\n")
    assert default_floor(meminfo, cgroup, member) == GIB  # nothing known
    meminfo.write_text("MemTotal:       67108864 kB\nMemAvailable:   1 kB\n")
    assert default_floor(meminfo, cgroup, member) == 4 * GIB  # 64 GiB machine
    (cgroup / "memory.max").write_text(f"{32 * GIB}\n")
    assert default_floor(meminfo, cgroup, member) == 2 * GIB  # a 32 GiB container on it
    (cgroup / "memory.max").write_text(f"{4 * GIB}\n")
    assert default_floor(meminfo, cgroup, member) == GIB  # small: the 1 GiB least
    (cgroup / "memory.max").write_text(f"{2 * GIB}\n")
    assert default_floor(meminfo, cgroup, member) == GIB // 2  # under 4 GiB: a quarter
    (cgroup / "memory.max").write_text(f"{GIB}\n")
    assert default_floor(meminfo, cgroup, member) == GIB // 4
    assert Budget().floor == default_floor()


def test_a_check_in_a_1_gib_container_runs_to_the_end(tmp_path: Path) -> None:
    """With 0.8 GiB left of a 1 GiB limit, a check needing kilobytes is not stopped for memory."""
    meminfo, cgroup, member = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "member"
    meminfo.write_text("MemTotal:       24683664 kB\nMemAvailable:   20000000 kB\n")
    cgroup.mkdir()
    member.write_text("0::/\n")
    (cgroup / "memory.max").write_text(f"{GIB}\n")
    (cgroup / "memory.current").write_text(f"{200 << 20}\n")
    budget = Budget(
        floor=default_floor(meminfo, cgroup, member),
        available=lambda: available_memory(meminfo, cgroup, member),
    )
    assert budget.short_of_memory() is None
    result = check.check_spec(RESIDENCY, 2, Bounds({}), budget=budget)
    assert (result.states, result.stopped, result.violation) == (1294, None, None)


def test_the_limits_of_the_process_cgroup_and_those_above_it_count(tmp_path: Path) -> None:
    """The process's cgroup is read from its ``0::`` line; the tightest limit on the way up wins."""
    meminfo, root, member = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "member"
    meminfo.write_text("MemTotal:       67108864 kB\nMemAvailable:   33554432 kB\n")
    service = root / "system.slice" / "ci.service"
    service.mkdir(parents=True)
    (service / "memory.max").write_text(f"{8 * GIB}\n")
    (service / "memory.current").write_text(f"{GIB}\n")
    (root / "system.slice" / "memory.max").write_text(f"{3 * GIB}\n")
    (root / "system.slice" / "memory.current").write_text(f"{2 * GIB}\n")
    member.write_text("12:memory:/elsewhere\n0::/system.slice/ci.service\n")
    assert available_memory(meminfo, root, member) == GIB  # the slice: 3 GiB less 2 in use
    assert default_floor(meminfo, root, member) == 3 * GIB // 4  # 3 GiB limit: a quarter
    member.write_text("0::/system.slice/gone.scope\n")  # a cgroup since removed: those above
    assert available_memory(meminfo, root, member) == GIB
    for odd in ("1:memory:/x\n", "0::/../..\n", ""):  # cgroup v1 only, or nonsense: the root
        member.write_text(odd)
        assert available_memory(meminfo, root, member) == 32 * GIB
    assert available_memory(meminfo, root, tmp_path / "none") == 32 * GIB


def test_the_cli_reports_a_stopped_check_and_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", str(RESIDENCY), "--nodes", "3", "--max-states", "700"])
    out = capsys.readouterr().out.splitlines()
    assert status == check.STOPPED == 3
    assert out[0] == f"{RESIDENCY}: 3 nodes (chain, fan-out), pins <= 2, locks <= 2"
    assert out[1] == "  states explored: 700 (symmetry reduced)"
    assert re.fullmatch(
        r"  before reduction: \d+ numbered states \(each tree in every numbering of its 3 slots\)",
        out[2],
    )
    assert out[5:] == [
        "  stopped: the cap of 700 states (--max-states) was reached",
        "  no invariant violated in the states explored; NOT exhaustive",
    ]


def test_a_cap_below_the_starting_shapes_keeps_the_first_of_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two starting trees on 3 nodes (the fan-out is the binary tree): a cap of 1 or 2 explores that many."""
    for cap in (1, 2):
        result = check.check_spec(
            RESIDENCY, 3, Bounds({}), budget=Budget(max_states=cap, floor=None)
        )
        assert (result.states, result.violation) == (cap, None)
        assert result.stopped == f"the cap of {cap} states (--max-states) was reached"
    assert main(["check", str(RESIDENCY), "--nodes", "3", "--max-states", "1"]) == check.STOPPED
    assert capsys.readouterr().out.splitlines()[1] == "  states explored: 1 (symmetry reduced)"


def test_a_violation_in_a_starting_tree_counts_the_starts_up_to_it(tmp_path: Path) -> None:
    """Every node starts with a lock no one holds: the first tree is the finding, alone."""
    for name in ("residency.toml", "host_residency.toml", "device_residency.toml"):
        text = (spec_dir() / name).read_text()
        if name == "device_residency.toml":
            text = text.replace("\nlocks = 0 ", "\nlocks = 1 ", 1)
            assert "\nlocks = 1 " in text
        (tmp_path / name).write_text(text)
    result = check.check_spec(tmp_path / "residency.toml", 3, Bounds({}))
    assert (result.states, result.numbered) == (1, 6)  # the chain, in its 3! numberings
    assert result.trace == ["start: chain"]
    assert result.violation is not None
    assert result.violation.startswith("invariant 6: node ")


def test_the_cli_json_names_why_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["check", "--json", str(RESIDENCY), "--nodes", "2", "--max-states", "9"])
    spec = json.loads(capsys.readouterr().out)["specs"][0]
    assert status == 3
    assert (spec["states"], spec["stopped"]) == (
        9,
        "the cap of 9 states (--max-states) was reached",
    )


def test_a_finding_outranks_a_stop_in_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    bug = str(BUGS / "unlock_skips_ancestor.toml")
    status = main(["check", bug, str(RESIDENCY), "--nodes", "2", "--max-states", "50"])
    out = capsys.readouterr().out
    assert status == 1
    assert "  violation: invariant 6: node 0: locks is 1 but its holders account for 0" in out
    assert "  stopped: the cap of 50 states (--max-states) was reached" in out


@pytest.mark.parametrize("bad", ["0", "-1.5", "nan"])
def test_a_time_limit_not_above_zero_is_refused(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(RESIDENCY), "--max-seconds", bad]) == 2
    err = capsys.readouterr()
    assert err.out == ""
    assert err.err == f"error: check: --max-seconds must be > 0, got {float(bad):g}\n"


@pytest.mark.parametrize("bad", ["0", "-5"])
def test_a_cap_below_one_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(RESIDENCY), "--max-states", bad]) == 2
    err = capsys.readouterr()
    assert err.out == ""
    assert err.err == f"error: check: --max-states must be >= 1, got {bad}\n"


def test_a_control_that_stops_short_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Budget, "__init__", _low_memory_init(Budget.__init__))
    control = next(c for c in controls() if c.name == "unlock_skips_ancestor.toml")
    found = check.check_control(control)
    assert found == "check: stopped: 0.50 GiB of memory left, under the 1.00 GiB a check keeps free"
    assert not control.matches(found)


def _low_memory_init(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``Budget.__init__`` so that every budget made reads half a GiB available."""

    def wrapped(self: Budget, *args: object, **kwargs: object) -> None:
        kwargs.update(floor=GIB, available=lambda: GIB // 2)
        init(self, *args, **kwargs)

    return wrapped


WIDE = 32
"""Nodes of a tree on which one expansion adds more states than a reading window held."""


@pytest.mark.parametrize(
    ("kwargs", "most"),
    [
        ({"max_seconds": 1.0, "floor": None}, explore.TIME_STATES),
        ({"floor": GIB, "available": lambda: 0}, explore.TIME_STATES),
    ],
    ids=["time", "memory"],
)
def test_a_wide_tree_reads_its_budget_by_the_states_it_adds(
    kwargs: dict[str, Any], most: int
) -> None:
    """Each expansion of a 32-node tree adds dozens of states; the budget is read anyway.

    The clock is past the deadline at its first reading after the start, or
    the memory is short, so the search stops at its first reading: within
    :data:`~fsm_cache.modelcheck.explore.TIME_STATES` states of its start.
    """
    readings: list[float] = []

    def clock() -> float:
        readings.append(0.0 if not readings else 10.0)
        return readings[-1]

    budget = Budget(clock=clock, **kwargs)
    spec = spec_dir() / "device_residency.toml"
    result = check.check_spec(spec, WIDE, Bounds({}), budget=budget)
    assert result.stopped is not None
    assert result.states <= len(check.SHAPES) + most


def test_a_tree_past_max_nodes_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--nodes 2000 was a RecursionError, 3 million ran 33 s and 1.8 GB past --max-seconds 5."""
    why = "every state of the tree is explored: 4 nodes are already about 2 million states"
    status = main(["check", str(RESIDENCY), "--nodes", "129", "--max-states", "1"])
    assert (status, *capsys.readouterr()) == (
        2,
        "",
        f"error: check: --nodes must be at most 128, got 129 ({why})\n",
    )
    assert check.MAX_NODES == 128
    with pytest.raises(BadArgument) as refused:
        check.check_spec(RESIDENCY, 129, Bounds({}), budget=Budget(max_states=1))
    assert str(refused.value) == f"check: nodes must be at most 128, got 129 ({why})"


@pytest.mark.parametrize("flag", ["--max-pins", "--max-locks", "--max-count"])
def test_a_counter_bound_past_max_bound_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """--max-count 1000000 ran for minutes into gigabytes and printed nothing."""
    why = "each value of a counter is a state of its own on every node"
    status = main(["check", str(RESIDENCY), flag, "65", "--max-states", "1"])
    assert (status, *capsys.readouterr()) == (
        2,
        "",
        f"error: check: {flag} must be at most 64, got 65 ({why})\n",
    )
    assert check.MAX_BOUND == 64


def test_the_largest_tree_is_set_up_checked_and_traced(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """On MAX_NODES nodes the starting trees are built, checked and replayed in a trace at once."""
    for name in ("residency.toml", "host_residency.toml", "device_residency.toml"):
        text = (spec_dir() / name).read_text()
        if name == "device_residency.toml":  # every node starts with a lock no one holds
            text = text.replace("\nlocks = 0 ", "\nlocks = 1 ", 1)
        (tmp_path / name).write_text(text)
    result = check.check_spec(tmp_path / "residency.toml", check.MAX_NODES, Bounds({}))
    assert (result.states, result.trace) == (1, ["start: chain"])
    assert result.violation is not None
    assert result.violation.startswith("invariant 6: node ")
    status = main(["check", str(RESIDENCY), "--nodes", "128", "--max-seconds", "0.5"])
    assert status == check.STOPPED
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "  stopped: the limit of 0.5 s (--max-seconds) was reached",
        "  no invariant violated in the states explored; NOT exhaustive",
    ]
