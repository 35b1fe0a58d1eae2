"""Negative controls keep yielding their findings; the shipped specs yield none."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsm_cache.contracts import runner as crosshair_run
from fsm_cache.contracts import verify
from fsm_cache.contracts.runner import Options, Row
from fsm_cache.modelcheck import check
from fsm_cache.modelcheck.explore import Bounds
from fsm_cache.modelcheck.state import Layout
from fsm_cache.spec.controls import Control, control_dir, controls
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import shipped_spec_paths


ALL = controls()
ISSUE_CLASSES = {
    "release_without_guard.toml",  # a release without its guard
    "evict_host_while_pinned.toml",  # host eviction allowed while pinned
    "split_drops_pins.py",  # a split that drops the pins
    "evict_device_while_writing.toml",  # device eviction while a copy still reads
    "unlock_skips_ancestor.toml",  # an unlock that skips an ancestor
}


MISSED_CLASSES = {
    "evict_host_leaves_writing.toml": "invariant 5",  # frees host pages a copy still writes
    "write_failed_lands_backed.toml": "valid data",  # a failed copy claims a valid host copy
    "load_pin_guard_dropped.toml": "invariant 6",  # a client can never release its pin
    "match_skips_loading.py": "lookup",  # a lookup hands out KV past a loading node
    "write_ack_waits_for_children.toml": "liveness",  # a copy that can never finish
}
"""Classes the checker let through before it kept pages, copies, lookups and liveness."""

STORAGE_CLASSES = {
    "release_takes_store_pin.toml": "invariant 6",  # a client release takes a store's pin
    "evict_prefetch_anchor.toml": "invariant 2",  # SGLang #9601: a prefetch's parent evicted
    "evict_storage_while_reading.toml": "invariant 5",  # deleted while a fetch reads it
    "fetch_failed_after_done.toml": "valid data",  # SGLang #13483: freed on both paths
    "store_ack_applied_whole.py": "valid data",  # SGLang #39444: a partial store acked whole
    "fetch_ignores_parent.toml": "invariant 2",  # fetched under a parent nobody holds
    "store_without_copy.toml": "valid data",  # marked stored, no copy ever started
    "fetch_failed_refused_on_device.toml": "liveness",  # a failed read that can never end
}
"""The storage tier's bug classes (issue 16), each caught by the model checker."""

UNFAILING_CLASSES = {
    "write_failed_keeps_pages.toml": "copy write",  # a failed backup taken as a valid host copy
    "load_failed_keeps_pages.toml": "copy load",  # a failed load taken as a valid device copy
}
"""Copies whose acknowledgements all report success: pages and states agree on every path."""


def test_every_class_the_issue_lists_has_a_control() -> None:
    assert {c.name for c in ALL} >= ISSUE_CLASSES


@pytest.mark.parametrize("name", sorted(MISSED_CLASSES))
def test_every_class_the_checker_missed_has_a_control_found_by_its_check(name: str) -> None:
    control = next(c for c in ALL if c.name == name)
    assert control.tool == "check"
    assert control.finding.startswith(f"violation: {MISSED_CLASSES[name]}: ")
    assert {c.tool for c in ALL} == {"validate", "verify", "check"}


@pytest.mark.parametrize("name", sorted(STORAGE_CLASSES))
def test_every_storage_bug_class_has_a_control_found_by_its_check(name: str) -> None:
    control = next(c for c in ALL if c.name == name)
    assert control.tool == "check"
    assert control.finding.startswith(f"violation: {STORAGE_CLASSES[name]}: ")
    spec = check.load_ops(control.path)[0] if control.path.suffix == ".py" else control.path
    assert Layout.of(as_system(load_spec(spec))).memory.tiers == ("host", "device", "storage")


@pytest.mark.parametrize("name", sorted(UNFAILING_CLASSES))
def test_every_copy_that_cannot_fail_has_a_control_found_before_exploring(name: str) -> None:
    control = next(c for c in ALL if c.name == name)
    assert control.tool == "check"
    assert control.finding.startswith(f"violation: {UNFAILING_CLASSES[name]}: ")
    result = check.check_spec(control.path, 3, Bounds({}))
    assert (result.violation, result.states) == (control.finding.removeprefix("violation: "), 0)


def test_every_control_file_has_an_expected_finding() -> None:
    parts = {p.name for p in control_dir().glob("*.*.toml")}  # machines a control composes
    tops = {p.name for p in control_dir().iterdir() if p.suffix in (".toml", ".py")} - parts
    assert tops == {c.name for c in ALL}


@pytest.mark.stage
@pytest.mark.parametrize("control", [c for c in ALL if c.tool != "verify"], ids=lambda c: c.name)
def test_validate_and_check_controls_yield_their_finding(control: Control) -> None:
    assert check.check_control(control) == control.expected


@pytest.mark.stage
@pytest.mark.parametrize("control", [c for c in ALL if c.tool == "verify"], ids=lambda c: c.name)
def test_verify_controls_yield_their_counterexample(control: Control, tmp_path: Path) -> None:
    assert control.matches(
        verify.verify_control(control, verify.options_for(control.path), tmp_path)
    )


VERIFY_CONTROL = Control(Path("c.py"), "verify", "m.f: no page twice: counterexample: f(1, 1)")


def test_a_verify_control_finds_its_counterexample_past_a_contract_left_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load CrossHair ran out of time on the allocator's first contract, which now
    fails a run; the control then named that row and was LOST, its bug found all the same."""
    rows = [
        Row("m", "f", "pages conserved", crosshair_run.WITHIN_BUDGET),
        Row("m", "f", "no page twice", crosshair_run.COUNTEREXAMPLE, "f(1, 1)"),
    ]
    monkeypatch.setattr(verify, "verify_module", lambda name, options, *_: rows)
    found = verify.verify_control(VERIFY_CONTROL, Options(), Path())
    assert found == "verify: m.f: no page twice: counterexample: f(1, 1)"
    assert VERIFY_CONTROL.matches(found)
    rows.pop()  # no counterexample: the unknown row is the finding, and the control is lost
    found = verify.verify_control(VERIFY_CONTROL, Options(), Path())
    assert found == "verify: m.f: pages conserved: no counterexample within budget"
    assert not VERIFY_CONTROL.matches(found)


@pytest.mark.parametrize(
    ("found", "ok"),
    [
        ("verify: m.f: no page twice: counterexample: f(1, 1)", True),
        ("verify: m.f: no page twice: counterexample: f(3, 0)", True),  # other search order
        ("verify: m.f: no page twice: no counterexample within budget", False),
        ("verify: m.g: no page twice: counterexample: g(1, 1)", False),
        ("verify: m.f: pages conserved: counterexample: f(1, 1)", False),
        ("", False),
    ],
)
def test_a_verify_control_matches_on_function_and_contract_not_arguments(
    found: str, ok: bool
) -> None:
    assert VERIFY_CONTROL.matches(found) is ok


def test_other_controls_match_exactly() -> None:
    control = Control(Path("c.toml"), "check", "violation: invariant 6: node 0: locks is 1")
    assert control.matches("check: violation: invariant 6: node 0: locks is 1")
    assert not control.matches("check: violation: invariant 6: node 1: locks is 1")


@pytest.mark.stage
@pytest.mark.parametrize("path", shipped_spec_paths(), ids=lambda p: p.name)
def test_shipped_specs_hold_in_the_model_checker(path: Path) -> None:
    """On three nodes; a spec with a storage region on one fewer than its own size, to stay short."""
    nodes, _, locks = check.sized(path, None, None, None)
    small = 3 if nodes >= check.NODES else nodes - 1
    result = check.check_spec(path, small, Bounds({"pins": 2, "locks": locks}))
    assert result.violation is None
    assert result.states > 0


CROSSHAIR_TIMEOUT = 900
"""Seconds a whole CrossHair proof may take, past the suite's 300: on a loaded two-core machine
residency.toml's took 270 s and the pool contracts' 233 s (each contract keeps its own budget)."""


@pytest.mark.stage
@pytest.mark.timeout(CROSSHAIR_TIMEOUT)
@pytest.mark.parametrize("path", shipped_spec_paths(), ids=lambda p: p.name)
def test_shipped_specs_have_no_counterexample(path: Path, tmp_path: Path) -> None:
    rows = verify.verify_spec(path, verify.options_for(path), tmp_path)
    assert rows
    assert [r for r in rows if r.failed] == []


@pytest.mark.stage
@pytest.mark.timeout(CROSSHAIR_TIMEOUT)
def test_pool_contracts_have_no_counterexample() -> None:
    """Every one proved, with the budgets ``make verify`` has (a tighter one may leave some unknown)."""
    options = verify.options_for(verify.target_file(verify.POOL_CONTRACTS))
    rows = verify.verify_module(verify.POOL_CONTRACTS, options)
    assert {r.function for r in rows} == {"alloc_twice", "alloc_free"}
    assert [r for r in rows if r.failed] == []


def test_a_verify_control_is_read_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The control's files were read to validate it, then read again to verify it."""
    (control,) = [c for c in ALL if c.tool == "verify" and c.path.suffix == ".toml"]

    def read_again(path: Path) -> None:
        raise AssertionError(f"{path} read again")

    def proved(name: str, module: Path, options: Options, **_: bool) -> list[Row]:
        return [Row(name, "pin", "the step follows the spec", crosshair_run.COUNTEREXAMPLE, "x")]

    monkeypatch.setattr(verify, "load_snapshot", read_again)
    monkeypatch.setattr(crosshair_run, "prove", proved)
    found = verify.verify_control(control, Options(), tmp_path)
    assert found == "verify: host_residency.pin: the step follows the spec: counterexample: x"
