"""fsm-cache check: model states, tree operations, invariants, exploration and the CLI."""

from __future__ import annotations

import argparse
import json
import re
from array import array
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from pools import ACCEPTED, pool

from fsm_cache.cache.tree import RadixTree
from fsm_cache.cli.main import main as cli_main
from fsm_cache.errors import ConfigError, SpecError
from fsm_cache.modelcheck import check, copies, invariants, liveness, lookup, progress, treeops
from fsm_cache.modelcheck.copies import VALID
from fsm_cache.modelcheck.explore import Bounds, Explorer, Result
from fsm_cache.modelcheck.forest import Trees
from fsm_cache.modelcheck.state import Choices, Layout, NodeEntry, canonical
from fsm_cache.modelcheck.traces import label
from fsm_cache.policy import WritePolicy
from fsm_cache.residency import DEVICE_READABLE
from fsm_cache.spec.loader import load_snapshot, load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import (
    device_machine,
    load_shipped,
    residency_system,
    shipped_spec_paths,
    spec_dir,
)


BUGS = spec_dir() / "bugs_detected"
RESIDENCY = Layout.of(residency_system())


def rec(parent: int, *fields: int | str) -> NodeEntry:
    """Return a residency node entry (states, counters, holds) with the memory its states claim."""
    return RESIDENCY.entry(parent, *fields)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    check.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.of(residency_system())


Shipped = Callable[[WritePolicy | None], tuple[Explorer, Result]]


@pytest.fixture(scope="module")
def shipped(layout: Layout) -> Shipped:
    """The shipped spec on 3 nodes, pins and locks up to 2, explored once per policy.

    Several tests read the same search (its result, the explorer's settling
    events); none changes it.
    """
    made: dict[WritePolicy | None, tuple[Explorer, Result]] = {}

    def of(policy: WritePolicy | None) -> tuple[Explorer, Result]:
        if policy not in made:
            explorer = Explorer(layout, Bounds({"pins": 2, "locks": 2}), policy=policy)
            made[policy] = explorer, explorer.run(check.shapes(layout, 3))
        return made[policy]

    return of


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
    pinned = rec(0, "pinned", "resident", 1, 0, 1, 0, 0)
    b = (layout.fresh(-1), pinned, layout.fresh(0))
    c = (layout.fresh(-1), layout.fresh(0), pinned)
    assert canonical(b)[0] == canonical(c)[0]
    assert canonical(a)[0] != canonical(b)[0]
    assert canonical(c)[1] == (0, 2, 1)  # the pinned child sorts first


def test_split_gives_the_prefix_locks_but_leaves_client_pins_on_the_suffix(
    layout: Layout,
) -> None:
    pinned_locked = rec(-1, "pinned", "resident", 1, 1, 1, 0, 1)
    after = treeops.split(layout, (pinned_locked, None), 0, 1)
    assert after == (
        rec(1, "pinned", "resident", 1, 1, 1, 0, 1),
        rec(-1, "backed", "resident", 0, 1, 0, 0, 0),
    )
    assert invariants.violation(layout, after) is None


def test_split_of_a_loading_node_gives_the_prefix_the_loads_pin(layout: Layout) -> None:
    loading = rec(-1, "pinned", "loading", 2, 0, 1, 1, 0)  # a client's pin and the load's
    after = treeops.split(layout, (loading, None), 0, 1)
    assert after == (
        rec(1, "pinned", "loading", 2, 0, 1, 1, 0),
        rec(-1, "pinned", "loading", 1, 0, 0, 1, 0),
    )
    assert invariants.violation(layout, after) is None
    replay = Explorer(layout, Bounds({})).replay
    acked = replay.apply(after, ("event", 1, "load_done"))  # the prefix's share of the copy
    assert acked is not None
    assert acked[1] == rec(-1, "backed", "resident", 0, 0, 0, 0, 0)
    assert replay.apply(acked, ("event", 1, "load_done")) is None  # given back once


@pytest.mark.parametrize("device", ["resident", "loading", "absent"])
@pytest.mark.parametrize("host", ["unbacked", "writing", "backed", "pinned", "evicted"])
def test_the_model_splits_as_the_cache_does(layout: Layout, host: str, device: str) -> None:
    """treeops.split and RadixTree.split give the prefix the same residency."""
    tree = RadixTree(page_size=1)
    node = tree.add_leaf(tree.root(), (1, 2), (10, 11))
    node.host, node.device, node.pins, node.locks = host, device, 2, 1  # type: ignore[assignment]
    prefix = tree.split(node, 1)
    entry = rec(-1, host, device, 2, 1, 1, 1, 1)
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
    writing_absent = rec(-1, "writing", "absent", 0, 0, 0, 0, 0)
    assert invariants.violation(layout, (writing_absent,)) == (
        "invariant 5: node 0: a device-to-host copy reads a device copy that is absent"
    )
    unaccounted = rec(-1, "pinned", "resident", 1, 0, 0, 0, 0)
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
    assert out[0].endswith("unlock_skips_ancestor.toml: 2 nodes (chain), pins <= 2, locks <= 2")
    assert out[1].startswith("  states explored: ")
    assert out[2].startswith("  before reduction: ")
    assert out[3].startswith("  states/s: ")
    assert out[4].startswith("  time: ")
    assert out[5:] == [
        "  violation: invariant 6: node 0: locks is 1 but its holders account for 0",
        "  shortest trace (2 steps):",
        "    start: chain",
        "    node 1: lock",
        "    node 1: unlock",
    ]


GATE = """\
[machine]
name = "gate"
initial = "open"

[counters]
n = 0

[states]
open = { invariant = "n >= 0", counter = "n" }
shut = { invariant = "n == 0", final = true }

[[transition]]
event = "take"
source = "open"
dest = "open"
guard = "n < 5"
update = "n += 1"

[[forbid]]
event = "take"
source = "open"
guard = "n >= 5"
error = "GateFull"
reason = "five are in"

[[transition]]
event = "give"
source = "open"
dest = "open"
guard = "n >= 1"
update = "n -= 1"

[[forbid]]
event = "give"
source = "open"
guard = "n == 0"
error = "GateEmpty"
reason = "nobody is in"

[[transition]]
event = "shut"
source = "open"
dest = "shut"
guard = "n == 0"

[[forbid]]
event = "shut"
source = "open"
guard = "n >= 1"
error = "GateInUse"
reason = "someone is in"
"""
"""Up to five holders, each refusal guarded at five."""


def test_a_guard_the_bounds_never_reach_is_named_with_the_bound_that_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gate = tmp_path / "gate.toml"
    gate.write_text(GATE)
    assert _cli(["check", str(gate), "--nodes", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        f"{gate}: 1 node, n <= 2",
        "  not explored: n above 2, where a comparison turns at 5 (--max-count 5 reaches it)",
    ]
    assert _cli(["check", str(gate), "--nodes", "1", "--max-count", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["specs"][0]["unexplored"] == {}


def test_the_shipped_specs_default_bounds_reach_every_guard(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``StorePinHeld``'s ``pins == 2`` answers otherwise only at 3 where it is read.

    A node being stored and loaded holds two pins already, so under
    ``pins <= 2`` no client ever pinned it: the release such a client may
    make (``pins >= 3``) went unexplored at the default bounds. A spec with a
    storage region now runs to three pins (``check.STORAGE_PINS``).
    """
    assert _cli(["check", "--nodes", "1", "--no-controls", "--json"]) == 0
    specs = json.loads(capsys.readouterr().out)["specs"]
    assert len(specs) > 6
    unexplored = {(Path(s["spec"]).name, s["policy"]): s["unexplored"] for s in specs}
    assert [key for key, gap in unexplored.items() if gap] == []
    assert (
        _cli(
            [
                "check",
                "--nodes",
                "1",
                "--max-pins",
                "2",
                str(spec_dir() / "residency_storage.toml"),
                "--json",
            ]
        )
        == 0
    )
    (below,) = json.loads(capsys.readouterr().out)["specs"]
    assert below["unexplored"] == {"pins": 3}


def test_a_release_past_the_store_and_load_pins_is_reached_only_at_three(
    tmp_path: Path,
) -> None:
    """Without its ``pins == 2`` guard, ``StorePinHeld`` refuses every release of such a node.

    A client that pinned a node then stored and loaded could never give its
    pin back; ``pins <= 2`` never has that client, so the check passed it
    without a word. Three pins find it.
    """
    for spec in spec_dir().glob("*.toml"):
        (tmp_path / spec.name).write_text(spec.read_text(encoding="utf-8"))
    path = tmp_path / "residency_storage.toml"
    both = 'when = ["storage in [storing]", "device in [loading]"]\nguard = "pins == 2"\n'
    text = path.read_text(encoding="utf-8")
    assert both in text
    path.write_text(text.replace(both, both.replace('guard = "pins == 2"\n', "")))
    assert check.unexplored(path, {"pins": 2, "locks": 1}) == {}  # no guard left to name it
    quiet = check.check_spec(path, 2, Bounds({"pins": 2, "locks": 1}))
    assert (quiet.violation, quiet.stopped) == (None, None)
    found = check.check_spec(path, 2, Bounds({"pins": 3, "locks": 1}))
    assert found.violation == (
        "invariant 6: node 1: release is refused (StorePinHeld) though pin holds pins there "
        "(pins=3)"
    )


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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "0"], "check: --nodes must be >= 1, got 0"),
        (["--max-pins", "-1"], "check: --max-pins must be >= 0, got -1"),
        (["--max-locks", "-2"], "check: --max-locks must be >= 0, got -2"),
        (["--max-count", "-1"], "check: --max-count must be >= 0, got -1"),
    ],
)
def test_bad_bounds_are_refused_naming_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(SpecError) as refused:
        _cli(["check", *flags])
    assert str(refused.value) == message


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
        found = {s: nxt for s, nxt, _ in explorer.successors(forest) if s[0] == "event"}
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
    parent = rec(-1, "unbacked", "resident", 0, 0, 0, 0, 0)
    backed = rec(0, "backed", "resident", 0, 0, 0, 0, 0)
    assert invariants.violation(layout, (parent, backed)) is None  # no policy: no invariant 3
    assert invariants.violation(layout, (parent, backed), WRITE_THROUGH) == (
        "invariant 3: node 1 is backed on the host but its parent node 0 is unbacked"
    )
    writing = rec(-1, "writing", "resident", 0, 0, 0, 0, 0)
    below = rec(0, "writing", "resident", 0, 0, 0, 0, 0)  # one copy, split in two
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
    writing = rec(-1, "writing", "resident", 0, 0, 0, 0, 0)
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


def test_shipped_residency_holds_under_write_through(shipped: Shipped) -> None:
    result = shipped(WRITE_THROUGH)[1]
    assert result.violation is None
    assert 0 < result.states < shipped(None)[1].states


def test_a_policy_needs_residency_regions() -> None:
    with pytest.raises(SpecError) as info:
        _cli(["check", "--policy", "write_through", str(spec_dir() / "host_residency.toml")])
    assert info.value.problems == [
        "host_residency: the write_through policy needs host and device regions with pins "
        "and locks counters (no host region, no device region, no locks counter)"
    ]


def test_a_policy_names_the_counter_a_residency_spec_lacks(tmp_path: Path) -> None:
    """``pins`` renamed consistently: the regions are there, the counter the split reads is not."""
    host = (spec_dir() / "host_residency.toml").read_text()
    (tmp_path / "host.toml").write_text(re.sub(r"\bpins\b", "holds", host))
    composed = (spec_dir() / "residency.toml").read_text().replace("pins == 1", "holds == 1")
    composed = composed.replace('"host_residency.toml"', '"host.toml"')
    device = spec_dir() / "device_residency.toml"
    (tmp_path / "residency.toml").write_text(
        composed.replace('"device_residency.toml"', f'"{device}"')
    )
    with pytest.raises(SpecError) as info:
        _cli(["check", "--policy", "write_through", str(tmp_path / "residency.toml")])
    assert info.value.problems == [
        "residency: the write_through policy needs host and device regions with pins "
        "and locks counters (no pins counter)"
    ]


def test_a_policy_finds_the_backup_by_the_copy_it_starts(tmp_path: Path) -> None:
    """Events are named freely under a policy too: ``write`` renamed explores as ``write``."""
    for name in ("host", "device"):
        text = (spec_dir() / f"{name}_residency.toml").read_text()
        text = re.sub(r'(event = ")write(_done|_failed)?"', r'\1backup\2"', text)
        (tmp_path / f"{name}_residency.toml").write_text(
            re.sub(r"^write", "backup", text, flags=re.M)
        )
    composed = (spec_dir() / "residency.toml").read_text()
    (tmp_path / "residency.toml").write_text(
        re.sub(r'(event = ")write(_done|_failed)?"', r'\1backup\2"', composed)
    )
    renamed = Layout.of(as_system(load_spec(tmp_path / "residency.toml")))
    assert "backup" in renamed.system.event_names
    assert "write" not in renamed.system.event_names
    choices = Choices.of(renamed, WRITE_THROUGH)
    assert (choices.backup, choices.prefetch) == (frozenset({"backup"}), frozenset({"fetch"}))
    assert dict(choices.joined) == {"backup_done": "writing", "backup_failed": "writing"}
    shapes, bounds = check.shapes(renamed, 2), Bounds({"pins": 2, "locks": 2})
    result = Explorer(renamed, bounds, policy=WRITE_THROUGH).run(shapes)
    assert result.violation is None
    shipped = Layout.of(residency_system())
    assert (
        result.states
        == Explorer(shipped, bounds, policy=WRITE_THROUGH).run(check.shapes(shipped, 2)).states
    )


def _two_writes(tmp_path: Path) -> Path:
    """The shipped residency spec with a second backup event: ``rewrite`` backs up an evicted node."""
    for spec in spec_dir().glob("*.toml"):
        (tmp_path / spec.name).write_text(spec.read_text())
    host = tmp_path / "host_residency.toml"
    text = host.read_text().replace(
        "write       = { doc",
        'rewrite     = { doc = "Back up again after an eviction.", past = "rewritten" }\n'
        "write       = { doc",
        1,
    )
    split = (
        'event = "write"\nsource = "unbacked"\ndest = "writing"\neffect = "start_write"\n\n'
        '[[transition]]\nevent = "rewrite"\nsource = "evicted"\ndest = "writing"\n'
        'effect = "start_write"'
    )
    both = 'event = "write"\nsource = ["unbacked", "evicted"]\ndest = "writing"\neffect = "start_write"'
    assert text.count(both) == 1
    text = text.replace(both, split)
    for rule in re.findall(r'\[\[forbid\]\]\nevent = "write"\n.*?(?=\n\n|\Z)', text, flags=re.S):
        text = text.replace(rule, rule + "\n\n" + rule.replace('"write"', '"rewrite"'), 1)
    text += (
        '\n[[forbid]]\nevent = "write"\nsource = "evicted"\nerror = "UseRewrite"\n'
        'reason = "rewrite backs up an evicted node"\n'
        '\n[[forbid]]\nevent = "rewrite"\nsource = "unbacked"\nerror = "UseWrite"\n'
        'reason = "write backs up a node never backed"\n'
    )
    host.write_text(text)
    composed = tmp_path / "residency.toml"
    text = composed.read_text()
    rule = re.search(r'\[\[forbid\]\]\nevent = "write"\n.*?(?=\n\n)', text, flags=re.S)
    assert rule is not None
    composed.write_text(
        text.replace(rule[0], rule[0] + "\n\n" + rule[0].replace('"write"', '"rewrite"'), 1)
    )
    return composed


def test_a_policy_decides_every_event_that_starts_a_backup(tmp_path: Path) -> None:
    """Two events run start_write: the policy gates both, in whatever order they are declared."""
    layout = Layout.of(as_system(load_spec(_two_writes(tmp_path))))
    choices = Choices.of(layout, WRITE_THROUGH)
    assert choices.backup == frozenset({"write", "rewrite"})
    result = Explorer(layout, Bounds({"pins": 2, "locks": 2}), policy=WRITE_THROUGH).run(
        check.shapes(layout, 2)
    )
    assert result.violation is None


def _renamed(tmp_path: Path, region: str, old: str, new: str) -> Path:
    """Return the shipped residency spec with ``region``'s state ``old`` renamed ``new`` throughout."""
    for name in ("host", "device"):
        text = (spec_dir() / f"{name}_residency.toml").read_text()
        if name == region:
            text = re.sub(rf"\b{old}\b", new, text)
        (tmp_path / f"{name}_residency.toml").write_text(text)
    composed = (spec_dir() / "residency.toml").read_text()
    (tmp_path / "residency.toml").write_text(re.sub(rf"\b{old}\b", new, composed))
    return tmp_path / "residency.toml"


@pytest.mark.parametrize(
    ("region", "old", "new", "wanted"),
    [
        ("host", "backed", "valid", "writing, backed, pinned"),
        ("host", "pinned", "held", "writing, backed, pinned"),
        ("host", "writing", "copying", "writing, backed, pinned"),
        ("device", "resident", "onchip", "resident, loading"),
        ("device", "loading", "inflight", "resident, loading"),
    ],
)
def test_a_residency_region_without_the_reference_states_is_refused(
    tmp_path: Path, region: str, old: str, new: str, wanted: str
) -> None:
    """The residency checks read the design's state names: a renamed one would give false alarms."""
    path = _renamed(tmp_path, region, old, new)
    assert load_spec(path)  # a valid spec, renamed consistently
    with pytest.raises(ConfigError) as info:
        check.check_spec(path, 2, Bounds({}))
    assert str(info.value) == (
        f"check: residency: the {region} region has no state {old}: the residency checks read "
        f"the {region} states by the names of docs/residency.md ({wanted}); name them "
        "so, or give the region another name to check the spec as plain machines"
    )


def test_the_cli_refuses_a_renamed_reference_state_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _renamed(tmp_path, "host", "backed", "valid")
    assert cli_main(["check", "--nodes", "2", str(path)]) == 2
    assert capsys.readouterr().err.startswith(
        "error: check: residency: the host region has no state backed: "
    )


@pytest.mark.parametrize("refused", ["policy", "renamed"])
def test_a_spec_refused_after_another_is_refused_before_any_is_explored(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    refused: str,
) -> None:
    """The first spec's search (minutes on four nodes) was done, then lost to the second's refusal."""

    def run(*_: object, **__: object) -> None:
        raise AssertionError("a spec was explored though another is refused")

    monkeypatch.setattr(check, "check_spec", run)
    good = str(spec_dir() / "residency.toml")
    if refused == "policy":
        argv = ["--policy", "write_through", good, str(spec_dir() / "host_residency.toml")]
        why = "host_residency: the write_through policy needs host and device regions"
    else:
        argv = [good, str(_renamed(tmp_path, "host", "backed", "valid"))]
        why = "check: residency: the host region has no state backed: "
    assert cli_main(["check", "--nodes", "2", *argv]) == 2
    out, err = capsys.readouterr()
    assert (out, err.startswith(f"error: {why}"), len(err.splitlines())) == ("", True, 1)


def test_states_the_checker_does_not_read_may_be_renamed(tmp_path: Path) -> None:
    result = check.check_spec(_renamed(tmp_path, "host", "evicted", "freed"), 2, Bounds({}))
    assert result.violation is None
    assert result.states > 0


def test_cli_names_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(spec_dir() / "residency.toml")
    status = _cli(["check", "--policy", "write_through", "--nodes", "2", spec])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0] == (f"{spec} (write_through policy): 2 nodes (chain), pins <= 2, locks <= 2")
    assert out[-1] == "  no invariant violated"


def test_the_default_run_adds_write_through_on_three_nodes_and_sizes_storage_specs() -> None:
    parser = argparse.ArgumentParser()
    check.register(parser.add_subparsers())
    shipped = shipped_spec_paths()
    residency = spec_dir() / "residency.toml"
    storage = spec_dir() / "residency_storage.toml"
    own = {storage: (3, 3, 1)}  # a spec with a storage region: its own tree size, pins and locks
    files = {p: load_snapshot(p)[1] for p in shipped}  # each target carries what its spec read
    assert check.targets(parser.parse_args(["check"])) == [
        *((p, "none", *own.get(p, (4, 2, 2)), files[p], str(p)) for p in shipped),
        (residency, "write_through", 3, 2, 2, files[residency], str(residency)),
        (storage, "write_through", 3, 3, 1, files[storage], str(storage)),
    ]
    assert check.targets(parser.parse_args(["check", "--policy", "write_through"])) == [
        (residency, "write_through", 4, 2, 2, files[residency], str(residency)),
        (storage, "write_through", 3, 3, 1, files[storage], str(storage)),
    ]
    named = parser.parse_args(["check", str(residency), str(storage)])
    assert check.targets(named) == [
        (residency, "none", 4, 2, 2, files[residency], str(residency)),
        (storage, "none", 3, 3, 1, files[storage], str(storage)),
    ]
    given = parser.parse_args(
        ["check", "--nodes", "2", "--max-pins", "2", "--max-locks", "2", str(storage)]
    )
    assert check.targets(given) == [(storage, "none", 2, 2, 2, files[storage], str(storage))]


def test_the_default_storage_run_reaches_every_pins_comparison(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At two pins, StorePinHeld's ``pins == 2`` was never met by a client pin: not explored."""
    storage = str(spec_dir() / "residency_storage.toml")
    assert cli_main(["check", storage, "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "pins <= 3" in out
    assert "not explored" not in out


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
    loading = rec(-1, "pinned", "loading", 1, 0, 0, 1, 0)  # the load's pin; no client pin
    unlock = ("unlock", ("locks", ("device",)))  # no lock held at all: asked too
    assert layout.unheld(loading) == [("release", ("pins", ("host",))), unlock]
    assert layout.unheld(rec(-1, "pinned", "loading", 2, 0, 1, 1, 0)) == [unlock]  # a client pin
    assert layout.unheld(rec(-1, "pinned", "resident", 1, 0, 1, 0, 0)) == [
        ("load_done", ("pins", ("host", "device"))),
        ("load_failed", ("pins", ("host", "device"))),
        unlock,
    ]
    replay = Explorer(layout, Bounds({})).replay
    assert not replay.accepts((loading,), 0, "release")  # LoadPinHeld
    accepts = partial(replay.accepts, (loading,))
    assert invariants.unheld_give_back(layout, (loading,), accepts) is None


def test_a_release_taking_the_loads_pin_is_a_violation_without_load_pin_held() -> None:
    layout = Layout.of(as_system(load_spec(TAKES_LOAD_PIN)))
    loading = rec(-1, "pinned", "loading", 1, 0, 0, 1, 0)
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


@pytest.mark.parametrize(
    "spec",
    [
        "residency.toml",
        "residency_storage.toml",
        "bugs_detected/release_takes_load_pin.toml",
        "bugs_detected/load_pin_guard_dropped.toml",
        "bugs_detected/release_takes_store_pin.toml",
    ],
)
def test_tabled_give_back_answers_agree_with_engine_allowed(spec: str) -> None:
    """The explorer's per-context dry runs and lookups say what the whole tree says."""
    path, ops = spec_dir() / spec, treeops
    if path.suffix == ".py":
        path, ops = check.load_ops(path)
    layout = Layout.of(as_system(load_spec(path)))
    explorer = Explorer(layout, Bounds({"pins": 2, "locks": 2}), ops)
    explorer.slots = 3
    trees, replay = explorer.trees, explorer.replay
    frontier = [trees.encode(nodes) for nodes in check.shapes(layout, 3).values()]
    seen, wrong = set(frontier), 0
    while frontier and len(seen) < 3000:
        forest = frontier.pop()
        flat = trees.decode(forest, explorer.slots)
        found = (
            invariants.unheld_give_back(layout, flat, partial(replay.accepts, flat))
            or invariants.refused_give_back(layout, flat, partial(replay.refusal, flat))
            or lookup.first_violation(layout, flat, explorer.match)
        )
        assert explorer.passes(forest) is (found is None), flat
        wrong += found is not None
        fresh = [nxt for _, nxt, _ in explorer.successors(forest) if nxt not in seen]
        seen.update(fresh)
        frontier += fresh
    assert len(seen) >= 3000
    assert bool(wrong) is spec.startswith("bugs_detected/")


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
    assert out[0] == f"{path}: 2 nodes (chain), holders <= 2"
    assert out[1:4] == [
        "  states explored: 0 (symmetry reduced)",
        "  before reduction: 0 numbered states (each tree in every numbering of its 2 slots)",
        "  states/s: 0",
    ]
    assert out[5:] == [
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


# -- memory: pages and copies in flight ------------------------------------------

EVICT_HOST_LEAVES_WRITING = BUGS / "evict_host_leaves_writing.toml"
WRITE_FAILED_LANDS_BACKED = BUGS / "write_failed_lands_backed.toml"


def test_copies_and_their_acknowledgements_are_read_from_the_effects(layout: Layout) -> None:
    memory = layout.memory
    assert memory.tiers == ("host", "device")
    assert memory.copying == {"host": {"writing": copies.D2H}, "device": {"loading": copies.H2D}}
    assert {event: [(a.copy.name, a.ok) for a in acks] for event, acks in memory.acks.items()} == {
        "write_done": [("device-to-host", True)],
        "write_failed": [("device-to-host", False)],
        "load_done": [("host-to-device", True)],
        "load_failed": [("host-to-device", False)],
    }
    assert [memory.claims("host", s) for s in ("unbacked", "writing", "backed", "evicted")] == [
        "free",
        "filling from device",
        "valid",
        "free",
    ]
    assert memory.reports == {}  # no store: nothing reports pages on its own
    assert layout.pages(layout.fresh(-1)) == ("free", "valid", "")  # inserted with its KV
    planted = Layout.of(as_system(load_spec(EVICT_HOST_LEAVES_WRITING))).memory
    assert "evict_host" not in planted.acks  # it may leave backed too: not an acknowledgement
    assert Layout.of(as_system(load_shipped("host_residency"))).memory.width == 0


def test_memory_follows_copies_in_flight(layout: Layout) -> None:
    replay = Explorer(layout, Bounds({})).replay
    node = (layout.fresh(-1),)
    written = replay.apply(node, ("event", 0, "write"))
    assert written is not None
    assert written == (layout.entry(-1, "writing", "resident", 0, 0, 0, 0, 0),)
    assert [layout.pages(e) for e in written if e is not None] == [
        ("filling from device", "valid", "")
    ]
    failed = replay.apply(written, ("event", 0, "write_failed"))
    assert failed == node  # failed, then its pages freed
    assert invariants.violation(layout, written) is None


def test_freeing_pages_a_copy_writes_is_a_violation() -> None:
    """evict_host may leave writing: every state invariant holds, the ghost pages do not."""
    layout = Layout.of(as_system(load_spec(EVICT_HOST_LEAVES_WRITING)))
    replay = Explorer(layout, Bounds({})).replay
    written = replay.apply((layout.fresh(-1),), ("event", 0, "write"))
    assert written is not None
    evicted = replay.apply(written, ("event", 0, "evict_host"))
    assert evicted is not None
    assert [layout.state(e, "host") for e in evicted if e is not None] == ["evicted"]
    message = "invariant 5: node 0: evict_host frees host pages that a device-to-host copy in flight still writes"
    assert invariants.violation(layout, evicted) == message
    result = check.check_spec(EVICT_HOST_LEAVES_WRITING, 3, Bounds({}))
    assert result.violation == message
    assert result.trace == ["start: chain", "node 0: write", "node 0: evict_host"]


def test_a_failed_copy_marked_valid_is_a_violation() -> None:
    result = check.check_spec(WRITE_FAILED_LANDS_BACKED, 3, Bounds({}))
    assert result.violation == (
        "valid data: node 0: write_failed marks a failed device-to-host copy valid (host backed)"
    )
    assert result.trace == ["start: chain", "node 0: write", "node 0: write_failed"]


WRITE_FAILED_KEEPS_PAGES = BUGS / "write_failed_keeps_pages.toml"
LOAD_FAILED_KEEPS_PAGES = BUGS / "load_failed_keeps_pages.toml"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            WRITE_FAILED_KEEPS_PAGES,
            "copy write: no acknowledgement reports a failure (write_done, write_failed both "
            "leave the host pages valid): a failed copy would be taken as KV",
        ),
        (
            LOAD_FAILED_KEEPS_PAGES,
            "copy load: no acknowledgement reports a failure (load_done, load_failed both "
            "leave the device pages valid): a failed copy would be taken as KV",
        ),
    ],
)
def test_a_copy_no_acknowledgement_of_which_reports_a_failure_is_a_finding(
    path: Path, message: str
) -> None:
    """Pages and states agree on every path: only the acknowledgements' outcomes tell."""
    assert Layout.of(as_system(load_spec(path))).memory.unfailing == (message,)
    result = check.check_spec(path, 3, Bounds({}))
    assert (result.violation, result.states, result.trace) == (message, 0, [])


def test_a_copy_with_a_single_acknowledgement_that_cannot_fail_is_a_finding(
    tmp_path: Path,
) -> None:
    """write_failed is gone: write_done alone acknowledges every backup, failed or not."""
    host = (spec_dir() / "host_residency.toml").read_text()
    host = re.sub(r"\[\[(transition|forbid)\]\]\nevent = \"write_failed\"\n(.+\n)+?\n", "", host)
    host = host.replace(
        'write_failed = { doc = "The device-to-host copy failed; its host slots are freed.", past = "failed" }\n',
        "",
    )
    assert "write_failed" not in host
    (tmp_path / "host.toml").write_text(host)
    composed = (spec_dir() / "residency.toml").read_text()
    composed = composed.replace('"host_residency.toml"', '"host.toml"')
    composed = composed.replace(
        '"device_residency.toml"', f'"{spec_dir() / "device_residency.toml"}"'
    )
    (tmp_path / "residency.toml").write_text(composed)
    result = check.check_spec(tmp_path / "residency.toml", 2, Bounds({}))
    assert result.violation == (
        "copy write: no acknowledgement reports a failure (write_done leaves the host pages "
        "valid): a failed copy would be taken as KV"
    )


def test_the_shipped_copies_can_each_fail(layout: Layout) -> None:
    assert layout.memory.unfailing == ()


@pytest.mark.parametrize(
    ("states", "pages", "message"),
    [
        (
            ("backed", "resident"),
            ("failed from device", "valid"),
            "valid data: node 0: host backed claims valid host pages, "
            "but the device-to-host copy that filled them failed",
        ),
        (
            ("pinned", "resident"),
            ("filling from device", "valid"),
            "valid data: node 0: host pinned claims valid host pages, "
            "but the device-to-host copy filling them has not completed",
        ),
        (
            ("backed", "resident"),
            ("free", "valid"),
            "valid data: node 0: host backed claims valid host pages, but the node holds no host pages",
        ),
        (
            ("unbacked", "loading"),
            ("free", "valid"),
            "valid data: node 0: device loading claims a host-to-device copy in flight, "
            "but none is (the device pages are valid)",
        ),
        (
            ("evicted", "resident"),
            ("valid", "valid"),
            "invariant 7: node 0: host evicted claims no host pages, but the node still holds valid ones",
        ),
    ],
)
def test_what_a_state_claims_is_what_its_pages_hold(
    layout: Layout, states: tuple[str, str], pages: tuple[str, str], message: str
) -> None:
    pins = 1 if states[0] == "pinned" else 0
    entry = (-1, *states, pins, 0, pins, 0, 0, *pages, "")
    assert invariants.memory_claims(layout, (entry,), 0, entry) == message
    assert (
        invariants.memory_claims(
            layout,
            (rec(-1, *states, pins, 0, pins, 0, 0),),
            0,
            rec(-1, *states, pins, 0, pins, 0, 0),
        )
        is None
    )


# -- lookups -----------------------------------------------------------------------

MATCH_SKIPS_LOADING = BUGS / "match_skips_loading.py"


def test_a_lookup_stops_at_the_first_node_not_resident(layout: Layout) -> None:
    path = [
        rec(-1, "backed", "resident", 0, 0, 0, 0, 0),
        rec(0, "pinned", "loading", 1, 0, 0, 1, 0),
        rec(1, "backed", "resident", 0, 0, 0, 0, 0),  # loaded first, or adopted
    ]
    assert lookup.match_prefix(layout, path) == lookup.Match((0,), (1, 2))
    assert lookup.violation(layout, path, [0, 1, 2], lookup.match_prefix(layout, path)) is None
    _, ops = check.load_ops(MATCH_SKIPS_LOADING)
    skipping = ops.match_prefix(layout, path)
    assert skipping == lookup.Match((0, 2), (1,))
    assert lookup.violation(layout, path, [0, 1, 2], skipping) == (
        "lookup: node 2: match_prefix reports it on the device past node 1, which is loading"
    )
    assert lookup.first_violation(layout, tuple(path)) is None


def test_a_lookup_handing_out_pages_being_filled_is_a_violation(layout: Layout) -> None:
    path = [rec(-1, "pinned", "loading", 1, 0, 0, 1, 0)]
    held = lookup.Match((0,), ())  # a lookup that counts a loading node as matched
    assert lookup.violation(layout, path, [0], held) == (
        "lookup: node 0: match_prefix hands out its device pages, which hold no valid KV (filling)"
    )
    assert lookup.violation(layout, path, [0], lookup.Match((), ())) == (
        "lookup: node 0: match_prefix reports nodes [] on the device and [] as a host hit, not the path [0]"
    )


def test_the_explorer_tables_lookups_as_the_whole_tree_answers(layout: Layout) -> None:
    chain = (
        rec(-1, "backed", "resident", 0, 0, 0, 0, 0),
        rec(0, "pinned", "loading", 1, 0, 0, 1, 0),
        rec(1, "backed", "resident", 0, 0, 0, 0, 0),
    )
    _, ops = check.load_ops(MATCH_SKIPS_LOADING)
    for module, passes in ((treeops, True), (ops, False)):
        explorer = Explorer(layout, Bounds({}), module)
        explorer.slots = 3
        assert explorer.passes(explorer.trees.encode(chain)) is passes
        assert (lookup.first_violation(layout, chain, explorer.match) is None) is passes


def test_a_lookup_past_a_loading_node_is_found_with_its_trace() -> None:
    path, ops = check.load_ops(MATCH_SKIPS_LOADING)
    result = check.check_spec(path, 3, Bounds({}), ops)
    assert result.violation == (
        "lookup: node 2: match_prefix reports it on the device past node 1, which is loading"
    )
    assert result.trace[-4:] == [
        "node 1: evict_device",
        "node 1: load",
        "node 2: load",
        "node 2: load_done",
    ]


# -- give-backs: the other half ------------------------------------------------------

GUARD_DROPPED = BUGS / "load_pin_guard_dropped.toml"


def test_a_give_back_its_holder_holds_is_owed(layout: Layout) -> None:
    loading = rec(-1, "pinned", "loading", 2, 1, 1, 1, 1)  # a client pin, the load's, a lock
    assert layout.owed(loading) == [
        ("release", ("pins", ("host",))),
        ("load_done", ("pins", ("host", "device"))),
        ("unlock", ("locks", ("device",))),
    ]  # load_failed may be refused: the cache copies again
    replay = Explorer(layout, Bounds({})).replay
    assert (
        invariants.refused_give_back(layout, (loading,), partial(replay.refusal, (loading,)))
        is None
    )


def test_a_refused_give_back_its_holder_holds_is_a_violation() -> None:
    layout = Layout.of(as_system(load_spec(GUARD_DROPPED)))
    loading = rec(-1, "pinned", "loading", 2, 0, 1, 1, 0)
    replay = Explorer(layout, Bounds({})).replay
    assert invariants.refused_give_back(
        layout, (loading,), partial(replay.refusal, (loading,))
    ) == (
        "invariant 6: node 0: release is refused (LoadPinHeld) though pin holds pins there (pins=2)"
    )
    result = check.check_spec(GUARD_DROPPED, 3, Bounds({}))
    assert result.violation == (
        "invariant 6: node 2: release is refused (LoadPinHeld) though pin holds pins there (pins=2)"
    )
    assert result.trace == [
        "start: chain",
        "node 2: write",
        "node 2: write_done",
        "node 2: pin",
        "node 2: evict_device",
        "node 2: load",
    ]


LOAD_DONE_WAITS = """
[[forbid]]
event = "load_done"
when = "any child device in [resident, loading]"
error = "NotADeviceLeaf"
reason = "a child is on the device under this node"
"""


def test_a_load_done_refused_while_the_load_holds_is_a_refused_give_back(tmp_path: Path) -> None:
    """A finished load must be acknowledged at once: no need to wait for liveness to see it."""
    shipped = (spec_dir() / "residency.toml").read_text()
    for region in ("host", "device"):
        here = f'{region} = "{region}_residency.toml"'
        shipped = shipped.replace(here, f'{region} = "{spec_dir() / region}_residency.toml"')
    path = tmp_path / "load_done_waits.toml"
    path.write_text(shipped + LOAD_DONE_WAITS)
    result = check.check_spec(path, 3, Bounds({}))
    assert result.violation == (
        "invariant 6: node 1: load_done is refused (NotADeviceLeaf) though load holds pins there (pins=1)"
    )
    assert result.trace[-2:] == ["node 1: load", "node 2: load"]  # a chain load


# -- liveness ----------------------------------------------------------------------

WRITE_ACK_WAITS = BUGS / "write_ack_waits_for_children.toml"


def test_settling_is_decided_in_order_of_weight_or_backwards() -> None:
    """0 settled; 1 settles into 0; 2 loops on itself; 3 settles only into 2."""
    weight = array("l", [0, 1, 1, 2])
    first = array("l", [0, 0, 1, 2, 3])
    dst = array("l", [0, 2, 2])
    assert liveness.settles(weight, first, dst) == bytearray([1, 1, 0, 0])
    assert liveness.backward(weight, first, dst) == bytearray([1, 1, 0, 0])
    climbing = array("l", [0, 1, 2])  # 1 settles only through 2, which is heavier
    first, dst = array("l", [0, 0, 1, 2]), array("l", [2, 0])
    assert liveness.settles(climbing, first, dst) == bytearray([1, 1, 1])


def test_a_copy_that_can_never_finish_is_a_liveness_violation() -> None:
    # 2 nodes: a chain of two has a node above a device leaf, the copy that never finishes
    result = check.check_spec(WRITE_ACK_WAITS, 2, Bounds({}))
    assert result.violation == (
        "liveness: node 0: its device-to-host copy can never finish "
        "(write_done: NotADeviceLeaf; write_failed: NotADeviceLeaf)"
    )
    assert result.trace == ["start: chain", "node 0: write"]
    assert result.states > 1000  # found once everything was explored


@pytest.mark.parametrize("policy", [None, WRITE_THROUGH])
def test_every_state_of_the_shipped_spec_settles(
    shipped: Shipped, policy: WritePolicy | None
) -> None:
    """A failed load under a child still on the device is copied again, and may complete."""
    explorer, result = shipped(policy)
    assert result.violation is None
    assert {"write_done", "load_done", "release", "unlock"} <= explorer.settling


def test_the_caches_lookup_hands_out_what_the_model_derives_as_readable() -> None:
    """HiCache's lookup rule (DEVICE_READABLE) is the model's, derived from the spec's effects."""
    device = device_machine()
    derived = {s.name for s in device.states if RESIDENCY.memory.claims("device", s.name) == VALID}
    assert derived == DEVICE_READABLE


# -- a storage tier ------------------------------------------------------------------

STORAGE = spec_dir() / "residency_storage.toml"
DEEPEST_FIRST = """
[[forbid]]
event = "fetch_failed"
when = "any child host in [fetching, backed, pinned]"
error = "NotAHostLeaf"
reason = "a child holds or is filling a host copy under this node; fail the chain deepest node first"
"""
"""The rule the checker found missing from residency_storage.toml (a prefix's fetch failed
under a suffix still being fetched, then the store dropped the prefix: invariant 2)."""


def _storage_spec(tmp_path: Path) -> Path:
    """Return a copy of the shipped specs' three-tier composition in ``tmp_path``."""
    for path in spec_dir().glob("*.toml"):
        (tmp_path / path.name).write_text(path.read_text())
    assert DEEPEST_FIRST in (tmp_path / STORAGE.name).read_text()
    return tmp_path / STORAGE.name


@pytest.fixture(scope="module")
def storage() -> Layout:
    return Layout.of(as_system(load_spec(STORAGE)))


def srec(storage: Layout, parent: int, *fields: int | str) -> NodeEntry:
    """Return a three-tier node entry: host, device, storage, pins, locks, then the holds of
    pin, load, store and lock; with the memory its states claim."""
    return storage.entry(parent, *fields)


def test_the_storage_tier_is_a_third_tier_of_memory_read_from_the_effects(
    storage: Layout,
) -> None:
    memory = storage.memory
    assert memory.tiers == ("host", "device", "storage")
    assert memory.copying == {
        "host": {"writing": copies.D2H, "fetching": copies.S2H},
        "device": {"loading": copies.H2D},
        "storage": {"storing": copies.H2S},
    }
    assert {event: [(a.copy.name, a.ok) for a in acks] for event, acks in memory.acks.items()} == {
        "write_done": [("device-to-host", True)],
        "write_failed": [("device-to-host", False)],
        "fetch_done": [("storage-to-host", True)],
        "fetch_failed": [("storage-to-host", False)],
        "load_done": [("host-to-device", True)],
        "load_failed": [("host-to-device", False)],
        "store_done": [("host-to-storage", True)],
        "store_failed": [("host-to-storage", False)],  # no pages to free: it leads to unstored
    }
    assert memory.reports == {"storage": frozenset({"discover", "vanish"})}
    assert storage.holders.acquires["store"] == (("pins", ("host", "storage")),)
    assert storage.copy_holds == {
        ("pins", ("host", "device")): (copies.H2D,),
        ("pins", ("host", "storage")): (copies.H2S,),
    }
    assert [memory.claims("storage", s) for s in ("unstored", "storing", "stored", "reading")] == [
        "free",
        "filling from host",
        "valid",
        "valid",
    ]


def test_a_node_found_in_storage_is_born_discovered(storage: Layout) -> None:
    parent = srec(storage, -1, "backed", "resident", "unstored", 0, 0, 0, 0, 0, 0)
    born = treeops.born(storage, (parent, None), 0, 1, "discovered")
    assert born == (parent, srec(storage, 0, "evicted", "absent", "stored", 0, 0, 0, 0, 0, 0))
    assert born is not None
    assert born[1] is not None
    assert storage.pages(born[1]) == ("free", "free", "valid", "")
    assert treeops.born(storage, born, 0, 1, "discovered") is None  # the slot is taken
    assert label((parent, None), ("born", 0, "discovered")) == (
        "insert node 1 under node 0, born discovered"
    )


def test_a_store_pins_and_reads_the_host_copy_until_it_is_acknowledged(storage: Layout) -> None:
    replay = Explorer(storage, Bounds({})).replay
    backed = (srec(storage, -1, "backed", "resident", "unstored", 0, 0, 0, 0, 0, 0),)
    storing = replay.apply(backed, ("event", 0, "store"))
    assert storing == (srec(storage, -1, "pinned", "resident", "storing", 1, 0, 0, 0, 1, 0),)
    assert storage.pages(storing[0]) == ("valid", "valid", "filling from host", "")
    assert replay.refusal(storing, 0, "release") == "StorePinHeld"
    assert replay.apply(storing, ("event", 0, "release")) is None  # no client holds a pin
    assert replay.refusal(storing, 0, "evict_host") == "HostCopyPinned"
    done = replay.apply(storing, ("event", 0, "store_done"))
    assert done == (srec(storage, -1, "backed", "resident", "stored", 0, 0, 0, 0, 0, 0),)
    assert replay.apply(storing, ("event", 0, "store_failed")) == backed  # the store's pages
    assert invariants.violation(storage, storing) is None


def test_a_fetch_fills_new_host_pages_from_the_store(storage: Layout) -> None:
    replay = Explorer(storage, Bounds({})).replay
    parent = srec(storage, -1, "backed", "resident", "unstored", 0, 0, 0, 0, 0, 0)
    found = (parent, storage.born(0, "discovered"))
    fetching = replay.apply(found, ("event", 1, "fetch"))
    assert fetching is not None
    assert fetching[1] is not None
    assert fetching[1][1:4] == ("fetching", "absent", "reading")
    assert storage.pages(fetching[1]) == ("filling from storage", "free", "valid", "")
    assert replay.refusal(fetching, 1, "vanish") == "ReadInFlight"
    assert replay.refusal(fetching, 0, "evict_host") == "NotAHostLeaf"  # SGLang #9601
    done = replay.apply(fetching, ("event", 1, "fetch_done"))
    assert done is not None
    assert done[1] is not None
    assert (done[1][1:4], storage.pages(done[1])) == (
        ("backed", "absent", "stored"),
        ("valid", "free", "valid", ""),
    )
    assert replay.apply(fetching, ("event", 1, "fetch_failed")) == found  # host pages freed
    assert invariants.violation(storage, fetching) is None


def test_what_the_store_reports_moves_its_pages(storage: Layout) -> None:
    replay = Explorer(storage, Bounds({})).replay
    stored = (srec(storage, -1, "backed", "resident", "stored", 0, 0, 0, 0, 0, 0),)
    gone = replay.apply(stored, ("event", 0, "vanish"))
    assert gone == (srec(storage, -1, "backed", "resident", "unstored", 0, 0, 0, 0, 0, 0),)
    assert replay.apply(gone, ("event", 0, "discover")) == stored
    step = storage.memory.step
    states = {"host": "backed", "device": "resident", "storage": "unstored"}
    reading = ("filling from storage", "free", "valid", "")
    assert step(reading, "vanish", (), states)[-1] == (
        "invariant 5|vanish frees storage pages that a storage-to-host copy in flight still reads"
    )


def test_the_prefix_of_a_node_being_stored_holds_the_stores_pin(storage: Layout) -> None:
    storing = srec(storage, -1, "pinned", "resident", "storing", 2, 0, 1, 0, 1, 0)  # and a client
    after = treeops.split(storage, (storing, None), 0, 1)
    assert after == (
        srec(storage, 1, "pinned", "resident", "storing", 2, 0, 1, 0, 1, 0),
        srec(storage, -1, "pinned", "resident", "storing", 1, 0, 0, 0, 1, 0),
    )
    assert invariants.violation(storage, after) is None
    reading = srec(storage, -1, "fetching", "absent", "reading", 0, 0, 0, 0, 0, 0)
    halves = treeops.split(storage, (reading, None), 0, 1)
    assert halves is not None
    assert [e[1:4] for e in halves if e is not None] == [("fetching", "absent", "reading")] * 2


def test_a_node_held_only_in_storage_stays_and_goes_with_a_parent_holding_nothing(
    storage: Layout,
) -> None:
    nothing = srec(storage, -1, "evicted", "absent", "unstored", 0, 0, 0, 0, 0, 0)
    stored = storage.born(0, "discovered")
    alone = ((-1, *stored[1:]),)
    assert treeops.prune(storage, alone) == alone  # its data is in the store
    assert treeops.prune(storage, (nothing, stored)) == (None, None)  # unreachable below
    fetching = srec(storage, 0, "fetching", "absent", "reading", 0, 0, 0, 0, 0, 0)
    kept = treeops.prune(storage, (nothing, fetching))
    assert kept == (nothing, fetching)  # a copy in flight below: the node cannot go
    assert invariants.violation(storage, kept) == (
        "invariant 2: node 0 holds its data nowhere but cannot be deleted (it has children)"
    )
    trees = Trees(storage)
    prune = partial(treeops.prune_forest, storage, trees, memo={})
    assert prune(trees.encode((nothing, stored))) == ()  # as the explorer prunes
    assert trees.decode(prune(trees.encode(kept)), 2) == kept


def test_invariant_2_says_why_a_node_holding_nothing_is_still_in_the_tree(
    storage: Layout,
) -> None:
    """A dataless node the tree operations kept (an ``--ops`` prune) is not blamed on children."""
    nothing = srec(storage, -1, "evicted", "absent", "unstored", 0, 0, 0, 0, 0, 0)
    assert invariants.violation(storage, (nothing,)) == (
        "invariant 2: node 0 holds its data nowhere but the tree operations did not delete it "
        "(a leaf)"
    )
    stored = storage.born(0, "discovered")
    assert invariants.violation(storage, (nothing, stored)) == (
        "invariant 2: node 0 holds its data nowhere but the tree operations did not delete it "
        "(nothing below it holds a copy of its own)"
    )
    fetching = srec(storage, 0, "fetching", "absent", "reading", 0, 0, 0, 0, 0, 0)
    assert invariants.violation(storage, (nothing, fetching)) == (
        "invariant 2: node 0 holds its data nowhere but cannot be deleted (it has children)"
    )


def test_a_lookup_stops_at_a_node_being_fetched_or_held_only_in_storage(
    storage: Layout,
) -> None:
    path = [
        srec(storage, -1, "backed", "resident", "stored", 0, 0, 0, 0, 0, 0),
        srec(storage, 0, "backed", "absent", "unstored", 0, 0, 0, 0, 0, 0),
        srec(storage, 1, "fetching", "absent", "reading", 0, 0, 0, 0, 0, 0),
        srec(storage, 2, "evicted", "absent", "stored", 0, 0, 0, 0, 0, 0),
    ]
    found = lookup.match_prefix(storage, path)
    assert found == lookup.Match((0,), (1,))
    assert lookup.violation(storage, path, [0, 1, 2, 3], found) is None
    assert lookup.violation(storage, path, [0, 1, 2, 3], lookup.Match((0,), (1, 2, 3))) == (
        "lookup: node 2: match_prefix reports it as a host hit, but it holds no valid KV "
        "on the host or the device (host fetching, filling)"
    )
    assert lookup.violation(storage, path, [0, 1, 2, 3], lookup.Match((0,), ())) == (
        "lookup: node 3: match_prefix reports nodes [0] on the device and [] as a host hit, "
        "not the path [0, 1]"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            ("backed", "resident", "storing", 0, 0, 0, 0, 0, 0),
            "invariant 5: node 0: a host-to-storage copy reads a host copy that is backed",
        ),
        (
            ("fetching", "absent", "stored", 0, 0, 0, 0, 0, 0),
            "invariant 5: node 0: a storage-to-host copy reads a storage copy that is stored",
        ),
        (
            ("evicted", "absent", "reading", 0, 0, 0, 0, 0, 0),
            "invariant 5: node 0: storage reading, but no storage-to-host copy fills the host "
            "(host evicted)",
        ),
        (
            ("pinned", "resident", "storing", 1, 0, 1, 0, 0, 0),
            "invariant 6: node 0: a host-to-storage copy is in flight but store holds no pins there",
        ),
        (
            ("pinned", "resident", "stored", 1, 0, 0, 0, 1, 0),
            "invariant 6: node 0: store holds pins but no host-to-storage copy is in flight",
        ),
    ],
)
def test_storage_copies_are_checked_on_both_sides(
    storage: Layout, fields: tuple[int | str, ...], message: str
) -> None:
    entry = srec(storage, -1, *fields)
    assert invariants.violation(storage, (entry,)) == message


def test_the_storage_composition_holds_and_settles_on_two_nodes(tmp_path: Path) -> None:
    path = _storage_spec(tmp_path)
    layout = Layout.of(as_system(load_spec(path)))
    explorer = Explorer(layout, Bounds({"pins": 2, "locks": 1}))
    result = explorer.run(check.shapes(layout, 2))
    assert result.violation is None
    assert result.states > 3000
    assert {"store_done", "store_failed", "fetch_done", "fetch_failed"} <= explorer.settling
    assert {"discover", "vanish"}.isdisjoint(explorer.settling)  # the store's, not a copy's
    through = check.check_spec(path, 2, Bounds({"locks": 1}), policy=WritePolicy.WRITE_THROUGH)
    assert through.violation is None
    assert 0 < through.states < result.states


def test_a_fetch_failing_above_one_still_in_flight_is_found_without_the_deepest_first_rule(
    tmp_path: Path,
) -> None:
    """Why DEEPEST_FIRST: a failed prefix whose pages the store then drops holds nothing."""
    path = _storage_spec(tmp_path)
    text = path.read_text().replace(DEEPEST_FIRST, "")
    path.write_text(text)
    result = check.check_spec(path, 2, Bounds({"locks": 1}))
    assert result.violation is not None
    assert result.violation.startswith("invariant 2: ")
    assert result.trace[-3:] == [
        "split node 0: prefix node 1",
        "node 1: fetch_failed",
        "node 1: vanish",
    ]


STORE_WAITS = "".join(
    f"""
[[forbid]]
event = "{event}"
when = "any child storage in [stored]"
error = "NotAStorageLeaf"
reason = "planted: a store's acknowledgement waits for its children"
"""
    for event in ("store_done", "store_failed")
)


def test_a_store_whose_acknowledgements_are_refused_is_found(tmp_path: Path) -> None:
    """A store the cache must fail after a timeout, or acknowledge, but the spec refuses both."""
    path = _storage_spec(tmp_path)
    with path.open("a") as file:
        file.write(STORE_WAITS)
    result = check.check_spec(path, 2, Bounds({"locks": 1}))
    assert result.violation == (
        "invariant 6: node 0: store_done is refused (NotAStorageLeaf) though store holds pins "
        "there (pins=1)"
    )
    assert result.trace[-2:] == ["node 0: store", "node 1: discover"]


STORE_WITHOUT_COPY = BUGS / "store_without_copy.toml"
FETCH_FAILED_ON_DEVICE = BUGS / "fetch_failed_refused_on_device.toml"


def test_the_stores_reports_are_the_events_its_region_alone_declares() -> None:
    """A ``store`` that starts no copy still takes a host pin: the cache's act, not the store's word."""
    shipped = Layout.of(as_system(load_spec(STORAGE))).memory
    assert shipped.reports == {"storage": frozenset({"discover", "vanish"})}
    mutant = Layout.of(as_system(load_spec(STORE_WITHOUT_COPY))).memory
    assert "store" not in mutant.acks  # it starts no copy, so nothing acknowledges one
    assert mutant.reports == {"storage": frozenset({"discover", "vanish"})}


def test_a_store_that_never_copies_claims_pages_nobody_wrote() -> None:
    result = check.check_spec(STORE_WITHOUT_COPY, 2, Bounds({"locks": 1}))
    assert result.violation == (
        "valid data: node 0: storage storing claims valid storage pages, but the node holds "
        "no storage pages"
    )
    assert result.trace == ["start: chain", "node 0: write", "node 0: write_done", "node 0: store"]


def test_the_failure_pass_leaves_out_the_steps_that_complete_a_copy_to_or_from_the_store() -> None:
    """``~state`` marks a step completing such a copy: taken in the first pass, left out in the second."""
    first, dst = array("l", [0, 2, 3, 3]), array("l", [1, ~2, ~2])
    (every_first, every), (kept_first, kept) = liveness.passes(first, dst)
    assert (list(every_first), list(every)) == ([0, 2, 3, 3], [1, 2, 2])
    assert (list(kept_first), list(kept)) == ([0, 1, 1, 1], [1])
    storage = Layout.of(as_system(load_spec(STORAGE))).memory
    assert storage.final_successes == {"store_done", "fetch_done"}
    assert RESIDENCY.memory.final_successes == frozenset()  # a load or a backup is copied again


def test_a_fetch_whose_failure_is_refused_for_good_is_found_though_it_may_complete() -> None:
    """The storage tier never copies again after a failed fetch: its fetch_failed must come."""
    result = check.check_spec(FETCH_FAILED_ON_DEVICE, 2, Bounds({"locks": 1}))
    assert result.violation == (
        "liveness: node 1: its storage-to-host copy can never fail (fetch_failed: DeviceHoldsKV)"
    )
    assert result.trace[-2:] == ["node 1: fetch", "node 1: adopt"]


def test_a_read_lands_in_order_so_a_suffix_never_lands_above_a_prefix_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why ``Choices.ordered``: a suffix landed first keeps its prefix from failing (NotAHostLeaf)."""
    layout = Layout.of(as_system(load_spec(STORAGE)))
    assert Choices.of(layout, None).ordered == {"fetch_done": "fetching"}
    assert Choices.of(RESIDENCY, None).ordered == {}
    monkeypatch.setattr(Choices, "behind", lambda *_: False)
    result = check.check_spec(STORAGE, 2, Bounds({"locks": 1}))
    assert result.violation == (
        "liveness: node 1: its storage-to-host copy can never fail (fetch_failed: NotAHostLeaf)"
    )
    assert result.trace[-2:] == ["split node 0: prefix node 1", "node 0: fetch_done"]


CANCEL_HOST = """\
[machine]
extends = "{specs}/host_storage_residency.toml"
name = "host_cancel"

[counters]
cancels = 0

[events]
cancel = {{ doc = "Give up the read of a suffix whose prefix is still read.", past = "cancelled" }}

[[transition]]
event = "cancel"
source = "fetching"
dest = "evicted"
effect = "free_host"
update = "cancels += 1"

[[forbid]]
event = "cancel"
source = ["unbacked", "writing", "backed", "pinned", "evicted"]
error = "NotFetching"
reason = "no storage-to-host copy in flight"
"""

CANCEL_STORAGE = """\
[machine]
extends = "{specs}/storage_residency.toml"
name = "storage_cancel"

[events]
cancel = {{ doc = "Give up the read.", past = "cancelled" }}

[[transition]]
event = "cancel"
source = "reading"
dest = "stored"

[[forbid]]
event = "cancel"
source = ["unstored", "storing", "stored"]
error = "NotReading"
reason = "no storage-to-host copy in flight"
"""

CANCEL = """\
[composition]
name = "cancel"
doc = "Host and storage without a device: a read below one still in flight may be given up."

[composition.regions]
host = "host.toml"
storage = "storage.toml"

[[forbid]]
event = "cancel"
when = "parent host in [unbacked, writing, backed, pinned, evicted]"
error = "ParentLanded"
reason = "only the suffix of a read still in flight above is given up"
""" + "".join(
    f"""
[[forbid]]
event = "{event}"
when = "storage in [storing]"
guard = "pins == 1"
error = "StorePinHeld"
reason = "the last pin belongs to the store in flight"
"""
    for event in ("release", "load_done", "load_failed")
)


def test_only_a_fetchs_success_acknowledgements_wait_for_the_parents_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Choices.ordered`` holds back what the pages account reads as a fetch's success, no other exit.

    Without a device the nodes keep no pages, so no acknowledgement is known
    and none waits: the search is the one that fires every exit from
    ``fetching`` in any order. Holding back every exit lost each state where
    a child's read is given up (``cancel``, counted) under its parent's.
    """
    specs = spec_dir().as_posix()
    (tmp_path / "host.toml").write_text(CANCEL_HOST.format(specs=specs))
    (tmp_path / "storage.toml").write_text(CANCEL_STORAGE.format(specs=specs))
    (tmp_path / "cancel.toml").write_text(CANCEL)
    bounds = Bounds({"pins": 2, "cancels": 1})
    result = check.check_spec(tmp_path / "cancel.toml", 2, bounds)
    monkeypatch.setattr(Choices, "behind", lambda *_: False)
    every_order = check.check_spec(tmp_path / "cancel.toml", 2, bounds)
    assert (result.violation, result.states) == (None, every_order.states) == (None, 1444)
    assert Choices.of(Layout.of(as_system(load_spec(tmp_path / "cancel.toml"))), None).ordered == {}
    # With pages, a fetch_failed accepted from backed too acknowledges nothing (it may fire
    # after the read landed), and an evict_host that may leave writing ends no backup.
    after_done = Layout.of(as_system(load_spec(BUGS / "fetch_failed_after_done.toml")))
    assert Choices.of(after_done, None).ordered == {"fetch_done": "fetching"}
    leaves = Layout.of(as_system(load_spec(EVICT_HOST_LEAVES_WRITING)))
    assert Choices.of(leaves, WRITE_THROUGH).joined == {
        "write_done": "writing",
        "write_failed": "writing",
    }


def test_the_two_storage_machines_alone_are_checked_cheaply() -> None:
    for name in ("storage_residency.toml", "host_storage_residency.toml"):
        result = check.check_spec(spec_dir() / name, 4, Bounds({"pins": 2}))
        assert result.violation is None
        assert result.states > 500


def test_a_single_machine_is_explored_past_a_pin_it_cannot_release_by_every_event() -> None:
    """A pin in host_residency alone is given back by release or load_done: one suffices.

    The machine alone holds no pages, so no give-back is owed at once (a
    refusal may be a wait): liveness decides whether each pin can be given back.
    """
    layout = Layout.of(as_system(load_shipped("host_residency")))
    result = check.check_spec(spec_dir() / "host_residency.toml", 1, Bounds({"pins": 2}))
    assert (result.violation, result.states) == (None, 8)  # unbacked ... pinned(2), evicted
    assert not layout.at_once
    assert layout.owed((-1, "writing", 1, 1)) == []


def test_the_report_names_each_starting_tree_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Small trees make the shapes one: two nodes are a chain, three a chain and a fan-out.

    The report said ``(chain, fan-out, binary)`` whatever the size, naming
    three shapes where one or two trees were started from.
    """
    assert {n: list(check.starting_shapes(n)) for n in (1, 2, 3, 4)} == {
        1: ["chain"],
        2: ["chain"],
        3: ["chain", "fan-out"],
        4: ["chain", "fan-out", "binary"],
    }
    device = spec_dir() / "device_residency.toml"
    starts = check.shapes(Layout.of(as_system(load_spec(device))), 3)
    assert list(starts) == ["chain", "fan-out"]
    assert len(set(starts.values())) == 2
    for nodes, tree in (
        ("1", "1 node"),
        ("2", "2 nodes (chain)"),
        ("3", "3 nodes (chain, fan-out)"),
    ):
        assert _cli(["check", str(device), "--nodes", nodes, "--json"]) == 0
        shapes = json.loads(capsys.readouterr().out)["specs"][0]["shapes"]
        assert shapes == list(check.starting_shapes(int(nodes)))
        assert _cli(["check", str(device), "--nodes", nodes]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"{device}: {tree}, locks <= 2"


def test_the_report_counts_one_node_slot_and_step_in_the_singular() -> None:
    """``1 nodes``, ``its 1 slots`` and ``shortest trace (1 steps)`` read as typos in a user's CI log."""
    one = {
        "spec": "slot.toml",
        "policy": "none",
        "nodes": 1,
        "shapes": ["chain"],
        "bounds": {"borrows": 2},
        "unexplored": {},
        "symmetry": True,
        "seconds": 0.5,
        "states": 3,
        "numbered": 3,
        "violation": "invariant 8: node 0: borrows is -1",
        "trace": ["start: chain", "node 0: give_back"],
        "stopped": None,
        "past_ceiling": 0,
    }
    assert check.report({"specs": [one], "controls": []}).splitlines() == [
        "slot.toml: 1 node, borrows <= 2",
        "  states explored: 3 (symmetry reduced)",
        "  before reduction: 3 numbered states (each tree in every numbering of its 1 slot)",
        "  states/s: 6",
        "  time: 0.50 s",
        "  violation: invariant 8: node 0: borrows is -1",
        "  shortest trace (1 step):",
        "    start: chain",
        "    node 0: give_back",
    ]
    two = {**one, "nodes": 2, "trace": ["start: chain", "node 0: borrow", "node 1: give_back"]}
    text = check.report({"specs": [two], "controls": []})
    assert "slot.toml: 2 nodes (" in text
    assert "numbering of its 2 slots)" in text
    assert "  shortest trace (2 steps):" in text


_GATE = """\
[machine]
name = "gate"
initial = "shut"

[states]
shut = {}
ajar = {}

[[transition]]
event = "open"
source = "shut"
dest = "ajar"

[[forbid]]
event = "open"
source = "ajar"
error = "AlreadyOpen"
reason = "the gate is open"

[[transition]]
event = "close"
source = "ajar"
dest = "shut"

[[forbid]]
event = "close"
source = "shut"
error = "AlreadyShut"
reason = "the gate is shut"

[[transition]]
event = "acquire"
source = ["shut", "ajar"]
dest = "shut"

[[transition]]
event = "release"
source = ["shut", "ajar"]
dest = "shut"
"""

_GATED = """\
[composition]
name = "gated"

[composition.regions]
slot = "slot.toml"
gate = "gate.toml"

[[forbid]]
event = "release"
when = "gate in [shut]"
error = "GateShut"
reason = "release through the open gate"

[[forbid]]
event = "open"
when = "slot in [idle]"
error = "NothingBorrowed"
reason = "the gate opens for a holder"
"""


@pytest.mark.parametrize("born", [False, True], ids=["no-birth", "birth"])
def test_a_birth_of_a_spec_without_tiers_is_explored_at_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], born: bool
) -> None:
    """Without host and device regions the trees keep their starting shape.

    So no node enters a tree after the start, and a birth was never explored: a
    release at zero (the pool accepts it) that only a node born ``stray`` (slot
    idle behind an open gate, which no run from ``idle``/``shut`` reaches) can
    make passed the check. Each node of each starting tree is now fresh or born.
    """
    (tmp_path / "slot.toml").write_text(pool(at_zero=ACCEPTED))
    (tmp_path / "gate.toml").write_text(_GATE)
    births = '\n[composition.births.stray]\nstates = { slot = "idle", gate = "ajar" }\n'
    spec = tmp_path / "gated.toml"
    spec.write_text(_GATED + (births if born else ""))
    status = cli_main(["check", str(spec), "--nodes", "2", "--json"])
    (found,) = json.loads(capsys.readouterr().out)["specs"]
    if not born:
        assert (status, found["violation"], found["states"]) == (0, None, 25)
        return
    assert (status, found["violation"], found["trace"]) == (
        1,
        "invariant 6: node 1: release is accepted though nothing holds holders there "
        "(holders=0, no acquire to give back)",
        ["start: chain, node 1 stray"],
    )


def test_births_at_the_start_are_bounded_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each node fresh or born is 2**N starting trees a shape: 40 nodes are refused at once."""
    (tmp_path / "slot.toml").write_text(pool(at_zero=ACCEPTED))
    (tmp_path / "gate.toml").write_text(_GATE)
    spec = tmp_path / "gated.toml"
    spec.write_text(_GATED + '\n[composition.births.stray]\nstates = { gate = "ajar" }\n')
    status = cli_main(["check", str(spec), "--nodes", "40"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err.strip() == (
        f"error: check: 40 nodes make {3 * 2**40} starting trees, at most 100000: each node "
        "of each shape starts fresh or born stray, as no node enters a tree of a spec "
        "without host and device regions later"
    )


REFETCH_HOST = """\
[machine]
extends = "SPECS/host_storage_residency.toml"
name = "host_refetch"

[states]
refetching = { doc = "A second read into the host.", invariant = "pins == 0" }

[events]
refetch = { doc = "Start a second kind of read.", past = "refetched" }
refetch_done = { doc = "The second read landed.", past = "refetch acknowledged" }

[[transition]]
event = "refetch"
source = "evicted"
dest = "refetching"
effect = "start_fetch"

[[transition]]
event = "refetch_done"
source = "refetching"
dest = "backed"

[[transition]]
event = "fetch_failed"
source = "refetching"
dest = "evicted"
effect = "free_host"

[[forbid]]
event = "write"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "write_done"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "write_failed"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "pin"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "release"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "evict_host"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "load"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "load_done"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "load_failed"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "store"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "store_done"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "store_failed"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "fetch"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "fetch_done"
source = "refetching"
error = "CopyInFlight"
reason = "a second read is in flight"

[[forbid]]
event = "refetch"
source = ["unbacked", "writing", "backed", "pinned", "fetching", "refetching"]
error = "CopyInFlight"
reason = "not evicted"

[[forbid]]
event = "refetch_done"
source = ["unbacked", "writing", "backed", "pinned", "evicted", "fetching"]
error = "NotFetching"
reason = "no second read"
"""
"""A host machine with a second kind of read (``refetching``), filled by the same copy as a fetch."""

REFETCH_STORAGE = """\
[machine]
extends = "SPECS/storage_residency.toml"
name = "storage_refetch"

[events]
refetch = { doc = "Start a second kind of read.", past = "refetched" }
refetch_done = { doc = "The second read landed.", past = "refetch acknowledged" }

[[transition]]
event = "refetch"
source = "stored"
dest = "reading"

[[forbid]]
event = "refetch"
source = ["unstored", "storing", "reading"]
error = "NotStored"
reason = "nothing stored to read"

[[transition]]
event = "refetch_done"
source = "reading"
dest = "stored"

[[forbid]]
event = "refetch_done"
source = ["unstored", "storing", "stored"]
error = "NotReading"
reason = "no read"
"""

REFETCH = """\
[composition]
extends = "SPECS/residency_storage.toml"
name = "refetch"
doc = "residency_storage with a second read state."

[composition.regions]
host = "host.toml"
storage = "stor.toml"

[[forbid]]
event = "refetch"
when = "device in [resident, loading]"
error = "AlreadyResident"
reason = "on device"

[[forbid]]
event = "refetch"
when = ["parent device in [absent]", "parent host in [unbacked, evicted]"]
error = "ParentNotCached"
reason = "parent not cached"

[[forbid]]
event = "evict_host"
when = "any child host in [refetching]"
error = "NotAHostLeaf"
reason = "a child is being read"

[[forbid]]
event = "write"
when = "parent host in [refetching]"
error = "ParentFetching"
reason = "parent being read"

[[forbid]]
event = "fetch_failed"
when = "any child host in [refetching]"
error = "NotAHostLeaf"
reason = "a child is being read"
"""


def test_an_acknowledgement_out_of_another_state_the_copy_fills_waits_for_nothing(
    tmp_path: Path,
) -> None:
    """``refetch_done`` acknowledges the storage-to-host copy out of ``refetching``, not ``fetching``.

    Read by copy alone, it was held back under a parent still ``fetching``
    and applied to ``fetching`` ancestors under write-through.
    """
    for name, text in (
        ("host.toml", REFETCH_HOST),
        ("stor.toml", REFETCH_STORAGE),
        ("comp.toml", REFETCH),
    ):
        (tmp_path / name).write_text(text.replace("SPECS", spec_dir().as_posix()))
    layout = Layout.of(as_system(load_spec(tmp_path / "comp.toml")))
    assert Choices.of(layout, None).ordered == {"fetch_done": "fetching"}
    assert Choices.of(layout, WRITE_THROUGH).joined == {
        "write_done": "writing",
        "write_failed": "writing",
        "fetch_done": "fetching",
    }
