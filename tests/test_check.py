"""fsm-cache check: model states, tree operations, invariants, exploration and the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from fsm_cache import check, invariants, treeops
from fsm_cache.errors import SpecError
from fsm_cache.explore import Bounds, Explorer
from fsm_cache.model import Layout, canonical
from fsm_cache.shipped import residency_system, spec_dir


BUGS = spec_dir() / "bugs_detected"


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    check.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.of(residency_system())


def test_layout_reads_counter_roles_from_the_spec(layout: Layout) -> None:
    assert layout.acquires["pin"] == (("pins", ("host",)),)
    assert layout.releases["release"] == (("pins", ("host",)),)
    assert layout.acquires["load"] == (("pins", ("host", "device")),)
    assert layout.releases["load_done"] == (("pins", ("host", "device")),)
    assert layout.acquires["lock"] == (("locks", ("device",)),)
    assert layout.propagating == frozenset({"locks"})


def test_canonical_form_ignores_numbering(layout: Layout) -> None:
    a = (layout.fresh(-1), layout.fresh(0), layout.fresh(0))
    pinned = ("pinned", "resident", 1, 0, 1, 0, 0)
    b = (layout.fresh(-1), (0, *pinned), layout.fresh(0))
    c = (layout.fresh(-1), layout.fresh(0), (0, *pinned))
    assert canonical(b)[0] == canonical(c)[0]
    assert canonical(a)[0] != canonical(b)[0]
    assert canonical(c)[1] == (0, 2, 1)  # the pinned child sorts first


def test_split_carries_states_counters_and_holds(layout: Layout) -> None:
    locked = (-1, "pinned", "resident", 1, 1, 1, 0, 1)
    nodes = (locked, None)
    after = treeops.split(layout, nodes, 0, 1)
    assert after == (
        (1, "pinned", "resident", 1, 1, 1, 0, 1),
        (-1, "pinned", "resident", 1, 1, 1, 0, 0),
    )
    assert after is not None
    assert invariants.violation(layout, after) is None


def test_invariants_name_the_node(layout: Layout) -> None:
    writing_absent = (-1, "writing", "absent", 0, 0, 0, 0, 0)
    assert invariants.violation(layout, (writing_absent,)) == (
        "invariant 5: node 0: a device-to-host copy reads a device copy that is absent"
    )
    unaccounted = (-1, "pinned", "resident", 1, 0, 0, 0, 0)
    assert invariants.violation(layout, (unaccounted,)) == (
        "invariant 6: node 0: pins is 1 but its holders account for 0"
    )


def test_shipped_residency_holds_on_two_nodes(layout: Layout) -> None:
    result = Explorer(layout, Bounds({"pins": 2, "locks": 2})).run(check.shapes(layout, 2))
    assert result.violation is None
    assert result.states > 100


def test_violation_trace_is_shortest_and_replayed() -> None:
    result = check.check_spec(BUGS / "evict_device_while_writing.toml", 3, Bounds({}))
    assert (
        result.violation
        == "invariant 5: node 2: a device-to-host copy reads a device copy that is absent"
    )
    assert result.trace == ["start: chain", "node 2: write", "node 2: evict_device"]


def test_cli_prints_figures_and_exits_1_on_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    status = _cli(["check", str(BUGS / "unlock_skips_ancestor.toml"), "--nodes", "2"])
    out = capsys.readouterr().out.splitlines()
    assert status == 1
    assert out[0].endswith(
        "unlock_skips_ancestor.toml: 2 nodes (chain, fan-out, binary), pins <= 2, locks <= 2"
    )
    assert out[1].startswith("  states explored: ")
    assert out[2].startswith("  states/s: ")
    assert out[3].startswith("  time: ")
    assert out[4:] == [
        "  violation: invariant 6: node 0: locks is 1 but its holders account for 0",
        "  shortest trace (2 steps):",
        "    start: chain",
        "    node 1: lock",
        "    node 1: unlock",
    ]


def test_cli_json_and_ops_module(capsys: pytest.CaptureFixture[str]) -> None:
    ops = BUGS / "split_drops_pins.py"
    status = _cli(
        ["check", "--json", "--nodes", "2", "--ops", str(ops), str(spec_dir() / "residency.toml")]
    )
    out = json.loads(capsys.readouterr().out)
    assert status == 1
    assert out["specs"][0]["violation"].startswith(
        "invariant 8: node 1: host pinned requires pins >= 1"
    )
    assert any(step.startswith("split node") for step in out["specs"][0]["trace"])


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(SpecError, match=r"^check: --nodes must be >= 1 and counter bounds >= 0$"):
        _cli(["check", "--nodes", "0"])


def test_ops_module_must_name_its_spec(tmp_path: Path) -> None:
    path = tmp_path / "ops.py"
    path.write_text("x = 1\n")
    with pytest.raises(SpecError) as info:
        check.load_ops(path)
    assert info.value.problems == [f"{path}: names no SPEC = 'path/to/spec.toml'"]


def test_tabled_answers_agree_with_engine_fire(layout: Layout) -> None:
    """Per-node plan answers, combined along chains, give exactly what Engine.fire does."""
    explorer = Explorer(layout, Bounds({"pins": 2, "locks": 2}))
    explorer.slots = 3
    trees = explorer.trees
    frontier = [trees.encode(nodes) for nodes in check.shapes(layout, 3).values()]
    seen = set(frontier)
    while frontier and len(seen) < 3000:
        forest = frontier.pop()
        flat = trees.decode(forest, explorer.slots)
        found = {s: nxt for s, nxt in explorer.successors(forest) if s[0] == "event"}
        for k in range(sum(e is not None for e in flat)):
            for event in layout.system.event_names:
                fired = explorer.replay.apply(flat, ("event", k, event))
                want = None if fired is None else trees.encode(fired)
                assert found.get(("event", k, event)) == want, (flat, k, event)
        fresh = [nxt for nxt in found.values() if nxt not in seen]
        seen.update(fresh)
        frontier += fresh
    assert len(seen) >= 3000
