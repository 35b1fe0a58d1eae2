"""``fsm-cache demo``: what its summary claims and how it shows the planted double release."""

from __future__ import annotations

import ast
import inspect

import pytest

from fsm_cache.cli import demo
from fsm_cache.cli.main import main


def call_line(method: str) -> int:
    """Return the line of the demo method ``method``'s one call into the residency machine."""
    tree = ast.parse(inspect.getsource(demo))
    (function,) = [
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == method
    ]
    (call,) = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self.machine"
    ]
    return call.lineno


@pytest.fixture
def output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run a short demo on a console wide enough that no line wraps; return its lines."""
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["demo", "--requests", "30"]) == 0
    return capsys.readouterr().out.splitlines()


def test_planted_double_release_names_all_three_sites(output: list[str]) -> None:
    """The refusal names the refused release's site as well as the pin's and the first release's."""
    pinned = call_line("backup_to_storage")
    released = call_line("drain_backup")
    refused = call_line("release_aborted_request")
    assert output[-3:] == [
        "planted bug: two cleanup paths release one storage-backup pin",
        "refused: node 17: release refused in backed (pins=0): release without a matching pin; "
        f"pinned at demo.py:{pinned} in backup_to_storage; "
        f"released at demo.py:{released} in drain_backup; "
        f"refused at demo.py:{refused} in release_aborted_request",
        "node 17 is unchanged: backed/resident (pins=0, locks=0)",
    ]


def test_summary_claims_only_the_invariants_one_cache_checks(output: list[str]) -> None:
    """Invariant 10 is across ranks: the summary says it is not checked here."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output if "│" in line]
    assert [
        "invariant checks passed",
        "3 (invariants 1-9, 11-12, every 10 requests; "
        "10 is agreement across ranks, not checked on one cache)",
    ] in rows
    assert ["refused transitions", "0"] in rows
    assert ["cached prefixes read back bit-exact", "30 of 30"] in rows


def test_the_third_tier_is_stored_by_one_cache_and_prefetched_by_another(
    output: list[str],
) -> None:
    """Cache A stores after its host backups; cache B, empty, fetches every prompt bit-exact."""
    start = output.index(next(line for line in output if line.startswith("three tiers: ")))
    stored, fetched = output[start : start + 2]
    assert stored.startswith(
        "three tiers: cache A backed 3 prompts up to the host, then stored them in a local "
        "file store (15 pages, "
    )
    assert fetched == (
        "cache B, empty, prefetched them on lookup (15 pages) and loaded them to its device: "
        "3 of 3 prompts bit-exact"
    )


def test_a_negative_request_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--requests -3`` is bad input: exit 2 with the reason, nothing served."""
    assert main(["demo", "--requests", "-3"]) == 2
    assert capsys.readouterr().err == "error: demo: --requests must be >= 0, got -3\n"


def test_an_unknown_write_policy_is_a_usage_error_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--policy bogus`` was named as the config's ``write_policy``, and --help listed no choice."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--policy", "bogus"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()[-1]) == (
        "",
        "fsm-cache demo: error: argument --policy: invalid choice: 'bogus' "
        "(choose from 'write_through', 'write_through_selective', 'write_back')",
    )


def test_a_cached_prefix_whose_kv_differs_fails_the_demo_in_its_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 1 with the count and the requests named: it was an AssertionError's traceback."""
    from fsm_cache.memory import tiers

    written = tiers.synthetic_kv
    monkeypatch.setattr(tiers, "synthetic_kv", lambda layout, tokens: written(layout, tokens) + 1)
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["demo", "--requests", "30"]) == 1
    output = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in output if "│" in line]
    assert ["cached prefixes read back bit-exact", "0 of 30"] in rows
    named = [line for line in output if line.startswith("KV of request ")]
    assert named == [  # conversation/turn of the first three (the trace regenerates turn 1)
        "KV of request 0/1 differs from what was written",
        "KV of request 1/1 differs from what was written",
        "KV of request 1/1 differs from what was written",
    ]
