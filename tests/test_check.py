"""fsm-cache check: model states, tree operations, invariants, exploration and the CLI."""

from __future__ import annotations

import argparse
import json
import re
from functools import partial
from pathlib import Path

import pytest

from fsm_cache.cache.tree import RadixTree
from fsm_cache.errors import SpecError
from fsm_cache.modelcheck import check, invariants, progress, treeops
from fsm_cache.modelcheck.explore import Bounds, Explorer
from fsm_cache.modelcheck.state import Layout, canonical
from fsm_cache.policy import WritePolicy
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import load_shipped, residency_system, shipped_spec_paths, spec_dir


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
    holders = layout.holders
    assert holders.acquires["pin"] == (("pins", ("host",)),)
    assert holders.releases["release"] == (("pins", ("host",)),)
    assert holders.acquires["load"] == (("pins", ("host", "device")),)
    assert holders.releases["load_done"] == (("pins", ("host", "device")),)
    assert holders.acquires["lock"] == (("locks", ("device",)),)
    assert holders.kinds == (
        ("pins", ("host",)),
        ("pins", ("host", "device")),
        ("locks", ("device",)),
    )
    assert holders.propagating == frozenset({"locks"})
    assert holders.unpaired == ()
    assert holders.acquirers(("pins", ("host", "device"))) == "load"


def test_canonical_form_ignores_numbering(layout: Layout) -> None:
    a = (layout.fresh(-1), layout.fresh(0), layout.fresh(0))
    pinned = ("pinned", "resident", 1, 0, 1, 0, 0)
    b = (layout.fresh(-1), (0, *pinned), layout.fresh(0))
    c = (layout.fresh(-1), layout.fresh(0), (0, *pinned))
    assert canonical(b)[0] == canonical(c)[0]
    assert canonical(a)[0] != canonical(b)[0]
    assert canonical(c)[1] == (0, 2, 1)  # the pinned child sorts first


def test_split_gives_the_prefix_locks_but_leaves_client_pins_on_the_suffix(
    layout: Layout,
) -> None:
    pinned_locked = (-1, "pinned", "resident", 1, 1, 1, 0, 1)
    after = treeops.split(layout, (pinned_locked, None), 0, 1)
    assert after == (
        (1, "pinned", "resident", 1, 1, 1, 0, 1),
        (-1, "backed", "resident", 0, 1, 0, 0, 0),
    )
    assert invariants.violation(layout, after) is None


def test_split_of_a_loading_node_gives_the_prefix_the_loads_pin(layout: Layout) -> None:
    loading = (-1, "pinned", "loading", 2, 0, 1, 1, 0)  # a client's pin and the load's
    after = treeops.split(layout, (loading, None), 0, 1)
    assert after == (
        (1, "pinned", "loading", 2, 0, 1, 1, 0),
        (-1, "pinned", "loading", 1, 0, 0, 1, 0),
    )
    assert invariants.violation(layout, after) is None
    replay = Explorer(layout, Bounds({})).replay
    acked = replay.apply(after, ("event", 1, "load_done"))  # the prefix's share of the copy
    assert acked is not None
    assert acked[1] == (-1, "backed", "resident", 0, 0, 0, 0, 0)
    assert replay.apply(acked, ("event", 1, "load_done")) is None  # given back once


@pytest.mark.parametrize("device", ["resident", "loading", "absent"])
@pytest.mark.parametrize("host", ["unbacked", "writing", "backed", "pinned", "evicted"])
def test_the_model_splits_as_the_cache_does(layout: Layout, host: str, device: str) -> None:
    """treeops.split and RadixTree.split give the prefix the same residency."""
    tree = RadixTree(page_size=1)
    node = tree.add_leaf(tree.root(), (1, 2), (10, 11))
    node.host, node.device, node.pins, node.locks = host, device, 2, 1  # type: ignore[assignment]
    prefix = tree.split(node, 1)
    entry = (-1, host, device, 2, 1, 1, 1, 1)
    model = treeops.split(layout, (entry, None), 0, 1)
    assert model is not None
    assert model[1] is not None
    assert model[1][1:5] == (prefix.host, prefix.device, prefix.pins, prefix.locks)


def test_split_copies_everything_in_specs_without_residency_regions() -> None:
    layout = Layout.of(as_system(load_shipped("host_residency")))
    pinned = (-1, "pinned", 2, 2)  # two holders: every holder holds both halves
    after = treeops.split(layout, (pinned, None), 0, 1)
    assert after == ((1, "pinned", 2, 2), (-1, "pinned", 2, 2))


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


@pytest.mark.parametrize("policy", [None, WritePolicy.WRITE_THROUGH])
def test_tabled_answers_agree_with_engine_fire(layout: Layout, policy: WritePolicy | None) -> None:
    """Per-node plan answers, combined along chains, give exactly what Engine.fire does."""
    explorer = Explorer(layout, Bounds({"pins": 2, "locks": 2}), policy=policy)
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


WRITE_THROUGH = WritePolicy.WRITE_THROUGH


def test_invariant_3_backups_are_prefix_closed_under_write_through(layout: Layout) -> None:
    parent = (-1, "unbacked", "resident", 0, 0, 0, 0, 0)
    backed = (0, "backed", "resident", 0, 0, 0, 0, 0)
    assert invariants.violation(layout, (parent, backed)) is None  # no policy: no invariant 3
    assert invariants.violation(layout, (parent, backed), WRITE_THROUGH) == (
        "invariant 3: node 1 is backed on the host but its parent node 0 is unbacked"
    )
    writing = (-1, "writing", "resident", 0, 0, 0, 0, 0)
    below = (0, "writing", "resident", 0, 0, 0, 0, 0)  # one copy, split in two
    assert invariants.violation(layout, (writing, below), WRITE_THROUGH) is None
    assert invariants.violation(layout, (writing, backed), WRITE_THROUGH) == (
        "invariant 3: node 1 is backed on the host but its parent node 0 is writing"
    )


def test_write_through_starts_a_backup_only_under_a_backed_parent(layout: Layout) -> None:
    chain = check.shapes(layout, 2)["chain"]
    free = Explorer(layout, Bounds({})).replay
    policy = Explorer(layout, Bounds({}), policy=WRITE_THROUGH).replay
    assert free.apply(chain, ("event", 1, "write")) is not None
    assert policy.apply(chain, ("event", 1, "write")) is None
    written = policy.apply(chain, ("event", 0, "write"))  # under the root
    assert written is not None
    backed = policy.apply(written, ("event", 0, "write_done"))
    assert backed is not None
    assert policy.apply(backed, ("event", 1, "write")) is not None


def test_write_through_acknowledges_a_split_copy_at_once(layout: Layout) -> None:
    """A split of a node being written puts the prefix in the copy: one ack settles both."""
    replay = Explorer(layout, Bounds({}), policy=WRITE_THROUGH).replay
    writing = (-1, "writing", "resident", 0, 0, 0, 0, 0)
    split = treeops.split(layout, (writing, None), 0, 1)
    assert split is not None
    assert replay.apply(split, ("event", 1, "write_failed")) is None  # the prefix waits
    failed = replay.apply(split, ("event", 0, "write_failed"))
    assert failed is not None
    assert [layout.state(e, "host") for e in failed if e is not None] == ["unbacked", "unbacked"]
    free = Explorer(layout, Bounds({})).replay  # no policy: any order, one node at a time
    alone = free.apply(split, ("event", 1, "write_failed"))
    assert alone is not None
    assert [layout.state(e, "host") for e in alone if e is not None] == ["writing", "unbacked"]


def test_shipped_residency_holds_under_write_through(layout: Layout) -> None:
    shapes = check.shapes(layout, 3)
    bounds = Bounds({"pins": 2, "locks": 2})
    result = Explorer(layout, bounds, policy=WRITE_THROUGH).run(shapes)
    assert result.violation is None
    assert 0 < result.states < Explorer(layout, bounds).run(shapes).states


def test_a_policy_needs_residency_regions() -> None:
    with pytest.raises(SpecError) as info:
        _cli(["check", "--policy", "write_through", str(spec_dir() / "host_residency.toml")])
    assert info.value.problems == [
        "host_residency: the write_through policy needs host and device regions"
    ]


def test_cli_names_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(spec_dir() / "residency.toml")
    status = _cli(["check", "--policy", "write_through", "--nodes", "2", spec])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0] == (
        f"{spec} (write_through policy): 2 nodes (chain, fan-out, binary), pins <= 2, locks <= 2"
    )
    assert out[-1] == "  no invariant violated"


def test_the_default_run_adds_write_through_on_three_nodes() -> None:
    parser = argparse.ArgumentParser()
    check.register(parser.add_subparsers())
    shipped = shipped_spec_paths()
    residency = spec_dir() / "residency.toml"
    assert check.targets(parser.parse_args(["check"])) == [
        *((p, "none", 4) for p in shipped),
        (residency, "write_through", 3),
    ]
    assert check.targets(parser.parse_args(["check", "--policy", "write_through"])) == [
        (residency, "write_through", 4)
    ]
    assert check.targets(parser.parse_args(["check", "x.toml"])) == [(Path("x.toml"), "none", 4)]


def test_ops_module_policy_must_be_known(tmp_path: Path) -> None:
    path = tmp_path / "ops.py"
    path.write_text("SPEC = 'x.toml'\nPOLICY = 'write_back'\n")
    with pytest.raises(SpecError) as info:
        check.load_ops(path)
    assert info.value.problems == [f"{path}: POLICY must be one of none, write_through"]


def test_progress_off_a_terminal_is_plain_lines_on_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    spec = str(spec_dir() / "residency.toml")
    assert _cli(["check", "--nodes", "2", "--progress", spec]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines
    assert all(re.fullmatch(r"residency\.toml: \d+ states, \d+ states/s", line) for line in lines)
    assert captured.out.startswith(f"{spec}: 2 nodes")


def test_no_progress_off_a_terminal_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["check", "--nodes", "2", str(spec_dir() / "residency.toml")]) == 0
    assert capsys.readouterr().err == ""


TAKES_LOAD_PIN = BUGS / "release_takes_load_pin.toml"


def test_a_release_taking_the_loads_pin_is_refused_by_the_shipped_spec(layout: Layout) -> None:
    loading = (-1, "pinned", "loading", 1, 0, 0, 1, 0)  # the load's pin; no client pin
    assert layout.unheld(loading) == [("release", ("pins", ("host",)))]
    assert layout.unheld((-1, "pinned", "loading", 2, 0, 1, 1, 0)) == []  # a client pin too
    assert layout.unheld((-1, "pinned", "resident", 1, 0, 1, 0, 0)) == [
        ("load_done", ("pins", ("host", "device"))),
        ("load_failed", ("pins", ("host", "device"))),
    ]
    replay = Explorer(layout, Bounds({})).replay
    assert not replay.accepts((loading,), 0, "release")  # LoadPinHeld
    accepts = partial(replay.accepts, (loading,))
    assert invariants.unheld_give_back(layout, (loading,), accepts) is None


def test_a_release_taking_the_loads_pin_is_a_violation_without_load_pin_held() -> None:
    layout = Layout.of(as_system(load_spec(TAKES_LOAD_PIN)))
    loading = (-1, "pinned", "loading", 1, 0, 0, 1, 0)
    accepts = partial(Explorer(layout, Bounds({})).replay.accepts, (loading,))
    assert invariants.unheld_give_back(layout, (loading,), accepts) == (
        "invariant 6: node 0: release would take pins held by load (pins=1, none held by pin)"
    )
    result = check.check_spec(TAKES_LOAD_PIN, 3, Bounds({}))
    assert result.violation == (
        "invariant 6: node 2: release would take pins held by load (pins=1, none held by pin)"
    )
    assert result.trace == [
        "start: chain",
        "node 2: write",
        "node 2: write_done",
        "node 2: evict_device",
        "node 2: load",
    ]


@pytest.mark.parametrize("spec", ["residency.toml", "bugs_detected/release_takes_load_pin.toml"])
def test_tabled_give_back_answers_agree_with_engine_allowed(spec: str) -> None:
    """The explorer's per-context dry runs say what Engine.allowed says on the whole tree."""
    layout = Layout.of(as_system(load_spec(spec_dir() / spec)))
    explorer = Explorer(layout, Bounds({"pins": 2, "locks": 2}))
    explorer.slots = 3
    trees, replay = explorer.trees, explorer.replay
    frontier = [trees.encode(nodes) for nodes in check.shapes(layout, 3).values()]
    seen, taking = set(frontier), 0
    while frontier and len(seen) < 3000:
        forest = frontier.pop()
        flat = trees.decode(forest, explorer.slots)
        found = invariants.unheld_give_back(layout, flat, partial(replay.accepts, flat))
        assert explorer.passes(forest) is (found is None), flat
        taking += found is not None
        fresh = [nxt for _, nxt in explorer.successors(forest) if nxt not in seen]
        seen.update(fresh)
        frontier += fresh
    assert len(seen) >= 3000
    assert bool(taking) is (spec != "residency.toml")


STEPS_BY_TWO = """\
[machine]
name = "steps"
initial = "idle"

[counters]
holders = 0

[states]
idle = { invariant = "holders == 0" }
held = { invariant = "holders >= 1", counter = "holders" }

[[transition]]
event = "take"
source = ["idle", "held"]
dest = "held"
update = "holders += 2"

[[transition]]
event = "give"
source = "held"
dest = "idle"
guard = "holders == 1"
update = "holders -= 1"

[[transition]]
event = "give"
source = "held"
dest = "held"
guard = "holders >= 2"
update = "holders -= 1"

[[forbid]]
event = "give"
source = "idle"
error = "ReleaseAtZero"
reason = "nothing to give back"
"""


def test_a_release_no_acquire_pairs_with_is_a_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A take of two and a give of one never balance: found before exploring, no traceback."""
    path = tmp_path / "steps.toml"
    path.write_text(STEPS_BY_TWO)
    assert _cli(["check", "--nodes", "2", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 2 nodes (chain, fan-out, binary), pins <= 2, locks <= 2"
    assert out[1:3] == ["  states explored: 0", "  states/s: 0"]
    assert out[4:] == [
        "  violation: holders: give gives back one, but no event takes one (take adds 2): "
        "its acquires and releases do not pair"
    ]
    layout = Layout.of(as_system(load_spec(path)))
    assert layout.holders.releases == {"take": (), "give": ()}  # nothing to hold: no crash
    assert layout.unheld(layout.fresh(-1)) == []


COUNTED = """\
[machine]
name = "counted"
initial = "free"

[counters]
n = 0

[states]
free = { invariant = "n == 0" }
held = { invariant = "n >= 1", counter = "n" }

[[transition]]
event = "take"
source = ["free", "held"]
dest = "held"
update = "n += 1"

[[transition]]
event = "give"
source = "held"
dest = "free"
guard = "n == 1"
update = "n -= 1"

[[transition]]
event = "give"
source = "held"
dest = "held"
guard = "n >= 2"
update = "n -= 1"

[[forbid]]
event = "give"
source = "free"
error = "ReleaseAtZero"
reason = "nothing to give back"
"""

WATCHER = """\
[machine]
name = "watcher"
initial = "idle"

[states]
idle = {}
seen = {}

[[transition]]
event = "give"
source = "idle"
dest = "seen"

[[transition]]
event = "give"
source = "seen"
dest = "idle"
"""

COMPOSED = """\
[composition]
name = "composed"

[composition.regions]
a = "counted.toml"
b = "watcher.toml"
"""


def test_an_unpaired_release_in_a_composition_names_the_regions(tmp_path: Path) -> None:
    """``give`` is declared in a and b, ``take`` in a alone: different holders, no pair."""
    for name, text in (("counted", COUNTED), ("watcher", WATCHER), ("composed", COMPOSED)):
        (tmp_path / f"{name}.toml").write_text(text)
    result = check.check_spec(tmp_path / "composed.toml", 2, Bounds({}))
    assert result.violation == (
        "n: give gives back one, but no event of a, b takes one (take adds 1 in a): "
        "its acquires and releases do not pair"
    )
    assert (result.states, result.trace) == (0, [])
    single = check.check_spec(tmp_path / "counted.toml", 2, Bounds({}))
    assert single.violation is None  # alone, take and give pair
