"""Symmetry reduction in ``fsm-cache check``: fewer states, the same verdicts, traces on real nodes.

The explorer keeps one state per tree whatever its node numbering (sibling
subtrees are interchangeable); ``--no-symmetry`` keeps every numbering. These
tests hold the reduced run to the unreduced one, and the unreduced one to a
plain search over numbered states that fires every step through the engine.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fsm_cache.modelcheck import check, treeops
from fsm_cache.modelcheck.explore import Bounds, Explorer, Result
from fsm_cache.modelcheck.forest import Trees
from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes, canonical
from fsm_cache.modelcheck.traces import Replay, TraceStep, slot_order
from fsm_cache.policy import WritePolicy
from fsm_cache.spec.controls import Control, controls
from fsm_cache.spec.loader import load_spec
from fsm_cache.spec.machine import as_system
from fsm_cache.spec.shipped import residency_system, spec_dir


BOUNDS = Bounds({"pins": 2, "locks": 2})
CHECKED = controls(tools=("check",))


@pytest.fixture(scope="module")
def layout() -> Layout:
    return Layout.of(residency_system())


def _steps(nodes: Nodes, events: tuple[str, ...], births: tuple[str, ...] = ()) -> list[TraceStep]:
    """Every step the explorer tries in ``nodes``, on slots: events, splits, inserts, births."""
    present = [i for i, entry in enumerate(nodes) if entry is not None]
    return [
        *(("event", i, event) for i in present for event in events),
        *(("split", i) for i in present),
        *(("insert", p) for p in (-1, *present)),
        *(("born", p, b) for b in births for p in (-1, *present)),
    ]


def _numbered_states(
    layout: Layout, replay: Replay, nodes: int, *, renumbered: bool = False
) -> set[Nodes]:
    """Every numbered state reachable from the starting shapes, each step fired on slots.

    With ``renumbered``, from every numbering of each shape, not only its own.
    """
    seen = set(check.shapes(layout, nodes).values())
    if renumbered:
        orders = list(itertools.permutations(range(nodes)))
        seen = {_renumbered(shape, to) for shape in seen for to in orders}
    frontier = list(seen)
    events, births = layout.system.event_names, layout.births  # each a property built anew
    while frontier:
        state = frontier.pop()
        for step in _steps(state, events, births):
            after = replay.apply(state, step)
            if after is not None and after not in seen:
                seen.add(after)
                frontier.append(after)
    return seen


def test_without_symmetry_every_numbered_state_is_explored_and_with_it_one_per_tree(
    layout: Layout,
) -> None:
    """The unreduced count is a plain search's; the reduced count is its number of trees."""
    explorer = Explorer(layout, BOUNDS)
    numbered = _numbered_states(layout, explorer.replay, 2)
    shapes = check.shapes(layout, 2)
    unreduced = Explorer(layout, BOUNDS, symmetry=False).run(shapes)
    reduced = explorer.run(shapes)
    assert unreduced.states == len(numbered)
    assert reduced.states == len({canonical(state)[0] for state in numbered})
    assert reduced.states < unreduced.states
    assert reduced.violation is unreduced.violation is None
    assert reduced.numbered == unreduced.numbered == unreduced.states


def test_the_storage_composition_explores_every_numbering_and_birth(tmp_path: Path) -> None:
    """Three regions and a birth: the unreduced run is a plain search, the reduced its trees.

    On the shipped composition.
    """
    path = spec_dir() / "residency_storage.toml"
    layout = Layout.of(as_system(load_spec(path)))
    bounds = Bounds({"pins": 1, "locks": 1})
    explorer = Explorer(layout, bounds)
    numbered = _numbered_states(layout, explorer.replay, 2)
    shapes = check.shapes(layout, 2)
    unreduced = Explorer(layout, bounds, symmetry=False).run(shapes)
    reduced = explorer.run(shapes)
    assert reduced.violation is unreduced.violation is None
    assert unreduced.states == len(numbered)
    assert reduced.states == len({canonical(state)[0] for state in numbered})
    assert reduced.numbered == unreduced.numbered == unreduced.states
    assert any(layout.state(e, "storage") == "reading" for n in numbered for e in n if e)


def test_the_shipped_spec_holds_with_fewer_states_under_symmetry_and_write_through(
    layout: Layout,
) -> None:
    policy = WritePolicy.WRITE_THROUGH
    shapes = check.shapes(layout, 2)
    reduced = Explorer(layout, BOUNDS, policy=policy).run(shapes)
    unreduced = Explorer(layout, BOUNDS, policy=policy, symmetry=False).run(shapes)
    assert reduced.violation is unreduced.violation is None
    assert 0 < reduced.states < unreduced.states


def test_two_numberings_of_one_tree_are_one_state_only_under_symmetry(layout: Layout) -> None:
    pinned = layout.entry(0, "pinned", "resident", 1, 0, 1, 0, 0)
    fresh = layout.fresh(0)
    one = (layout.fresh(-1), pinned, fresh)
    other = (layout.fresh(-1), fresh, pinned)
    assert Trees(layout).encode(one) == Trees(layout).encode(other)
    labelled = Trees(layout, symmetry=False)
    assert labelled.encode(one) != labelled.encode(other)
    gap = (None, layout.fresh(-1), layout.entry(1, "pinned", "resident", 1, 0, 1, 0, 0))
    for state in (one, other, gap, (layout.fresh(-1), None, fresh)):
        assert labelled.decode(labelled.encode(state), 3) == state


def _renumbered(state: Nodes, to: tuple[int, ...]) -> Nodes:
    """Return ``state`` with the node in slot ``i`` moved to slot ``to[i]``."""
    out: list[NodeEntry | None] = [None] * len(state)
    for i, entry in enumerate(state):
        if entry is not None:
            parent = int(entry[0])
            out[to[i]] = (to[parent] if parent >= 0 else -1, *entry[1:])
    return tuple(out)


def test_a_tree_stands_for_as_many_numbered_states_as_its_distinct_renumberings(
    layout: Layout,
) -> None:
    """Counted against brute force: every permutation of the slots, the distinct results.

    Equal sibling subtrees at two depths, different siblings, free slots, and
    two equal roots.
    """
    fresh, pinned = layout.fresh, layout.entry(0, "pinned", "resident", 1, 0, 1, 0, 0)
    deep = (fresh(-1), fresh(0), fresh(0), fresh(1), fresh(1), fresh(2), fresh(2))
    cases: list[tuple[Nodes, int]] = [
        ((None, None, None), 1),
        ((fresh(-1), None, None), 3),
        ((fresh(-1), fresh(0), fresh(0)), 3),
        ((fresh(-1), fresh(0), pinned), 6),
        ((fresh(-1), fresh(0), fresh(1), None), 24),
        ((fresh(-1), fresh(-1), None), 3),
        ((fresh(-1), fresh(0), fresh(0), fresh(1), fresh(2)), 60),
        (deep, 630),
    ]
    trees = Trees(layout)
    for state, expected in cases:
        slots = len(state)
        distinct = {_renumbered(state, to) for to in itertools.permutations(range(slots))}
        assert trees.numberings(trees.encode(state), slots) == len(distinct) == expected
    assert Trees(layout, symmetry=False).numberings(trees.encode(deep), 7) == 1


def test_the_numbered_count_is_a_search_from_every_numbering_of_the_shapes() -> None:
    """On a spec whose trees keep their shape, ``--no-symmetry`` starts from one numbering each.

    The count stands for a search started from all of them, the space the
    reduction is a quotient of; from its own numbering only, fewer.
    """
    layout = Layout.of(as_system(load_spec(spec_dir() / "host_residency.toml")))
    explorer = Explorer(layout, BOUNDS)
    reduced = explorer.run(check.shapes(layout, 3))
    every = _numbered_states(layout, explorer.replay, 3, renumbered=True)
    unreduced = Explorer(layout, BOUNDS, symmetry=False).run(check.shapes(layout, 3))
    assert reduced.numbered == len(every) == 4608
    assert reduced.states < unreduced.states == len(_numbered_states(layout, explorer.replay, 3))
    assert unreduced.states < len(every)


def test_slot_order_numbers_siblings_by_slot(layout: Layout) -> None:
    root = layout.fresh(-1)
    assert slot_order((layout.fresh(2), root, root)) == (1, 2, 0)
    assert slot_order((layout.fresh(1), root, layout.fresh(1))) == (1, 0, 2)


def _control(control: Control) -> tuple[Path, ModuleType | Any, WritePolicy | None]:
    """Return a control's spec, the tree operations it runs with and its policy."""
    path, ops = control.path, treeops
    if path.suffix == ".py":
        path, ops = check.load_ops(path)
    return path, ops, check.POLICIES[getattr(ops, "POLICY", "none")]


SMALL_TREE = {
    "write_ack_waits_for_children.toml": 2,
    "fetch_ignores_parent.toml": 2,
    "evict_prefetch_anchor.toml": 2,
    "fetch_failed_refused_on_device.toml": 2,
    # the costliest on 3 nodes: on 2, each is found by the same trace length, and the
    # reduction still merges numberings (fewer states than without it), so it is exercised
    "evict_storage_while_reading.toml": 2,
    "load_under_absent_parent.toml": 2,
    "match_skips_loading.py": 2,
    "split_drops_pins.py": 2,
    "store_ack_applied_whole.py": 2,
}
"""Controls found only once every state is explored, or deep in a three-region space, or
deep in a large one, on a tree small enough to keep the test short (the finding may name
another node there)."""


def _bounds(path: Path, nodes: int) -> Bounds:
    """The bounds ``check_control`` runs a control under (locks as :func:`check.sized` says)."""
    return Bounds({"locks": check.sized(path, nodes, None, None)[2]})


@functools.cache
def _check(control: Control, *, symmetry: bool) -> Result:
    """Run a control as ``check_control`` does, once per module: several tests read the result."""
    path, ops, policy = _control(control)
    nodes = SMALL_TREE.get(control.name, check.CONTROL_NODES)
    return check.check_spec(
        path, nodes, _bounds(path, nodes), ops, policy=policy, symmetry=symmetry
    )


@pytest.mark.parametrize("control", CHECKED, ids=lambda c: c.name)
def test_every_control_yields_its_finding_at_the_same_depth_without_symmetry(
    control: Control,
) -> None:
    """Same finding, same node, shortest trace of the same length: the reduction loses nothing."""
    reduced, unreduced = _check(control, symmetry=True), _check(control, symmetry=False)
    node = re.compile(r"node \d+")
    assert node.sub("node N", f"violation: {unreduced.violation}") == node.sub(
        "node N", control.finding
    )
    assert unreduced.violation == reduced.violation
    assert len(unreduced.trace) == len(reduced.trace)
    assert reduced.states <= unreduced.states
    if control.name in SMALL_TREE:  # the reduction merges numberings on the small tree too
        assert reduced.states < unreduced.states


def test_check_control_passes_the_choice_on() -> None:
    control = next(c for c in CHECKED if c.name == "evict_host_while_pinned.toml")
    assert check.check_control(control, symmetry=False) == control.expected


LABEL = re.compile(
    r"node (?P<node>\d+): (?P<event>\w+)"
    r"|split node (?P<split>\d+): prefix node (?P<prefix>\d+)"
    r"|insert node (?P<slot>\d+) under (?:the root|node (?P<parent>\d+))(?:, born (?P<birth>\w+))?"
)


def _replay_labels(replay: Replay, start: Nodes, labels: list[str]) -> Nodes:
    """Fire a printed trace on ``start`` by the node numbers it prints; check each new node's."""
    nodes = start
    for line in labels:
        found = LABEL.fullmatch(line)
        assert found is not None, line
        free = next(i for i, entry in enumerate(nodes) if entry is None) if None in nodes else -1
        step: TraceStep
        if found["event"]:
            step = ("event", int(found["node"]), found["event"])
        elif found["split"]:
            assert int(found["prefix"]) == free
            step = ("split", int(found["split"]))
        else:
            assert int(found["slot"]) == free
            parent = -1 if found["parent"] is None else int(found["parent"])
            step = (
                ("insert", parent) if found["birth"] is None else ("born", parent, found["birth"])
            )
        after = replay.apply(nodes, step)
        assert after is not None, line
        nodes = after
    return nodes


UNTRACED = {"write_failed_keeps_pages.toml", "load_failed_keeps_pages.toml"}
"""Controls found in the spec before anything is explored (a copy that cannot fail): no trace."""

BORN = {
    "evict_prefetch_anchor.toml",
    "evict_storage_while_reading.toml",
    "fetch_failed_refused_on_device.toml",
}
"""Controls whose trace hangs a node born in storage (found in the store, then fetched)."""


@pytest.mark.parametrize("symmetry", [True, False])
@pytest.mark.parametrize("control", CHECKED, ids=lambda c: c.name)
def test_a_printed_trace_replays_by_its_node_numbers(control: Control, symmetry: bool) -> None:
    """Each line names a real slot of the starting tree; fired as printed, it ends in the finding.

    Every control's trace, whatever its finding: a state's invariants, a
    give-back, a lookup, or a state that cannot settle (named by what is
    read on the end state, the engine asked anew, never the explorer's tables).
    """
    path, ops, policy = _control(control)
    result = _check(control, symmetry=symmetry)
    if control.name in UNTRACED:
        assert result.trace == []
        return
    layout = Layout.of(as_system(load_spec(path)))
    nodes = SMALL_TREE.get(control.name, check.CONTROL_NODES)
    shape = result.trace[0].removeprefix("start: ")
    start = check.shapes(layout, nodes)[shape]
    explorer = Explorer(layout, _bounds(path, nodes), ops, policy, symmetry=symmetry)
    end = _replay_labels(explorer.replay, start, result.trace[1:])
    liveness = (result.violation or "").startswith("liveness: ")
    failed = "can never fail" in (result.violation or "")  # the pass where store copies fail
    found = explorer.stuck(end, failed=failed) if liveness else explorer.finding(end)
    assert found == result.violation
    assert (explorer.finding(end) is None) is liveness  # a stuck state keeps every invariant
    born = any("born" in line for line in result.trace)
    assert born is (control.name in BORN)


def test_the_cli_turns_the_reduction_off_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(spec_dir() / "residency.toml")
    runs = {}
    for flags in ([], ["--no-symmetry"]):
        parser = argparse.ArgumentParser()
        check.register(parser.add_subparsers())
        args = parser.parse_args(["check", "--json", "--nodes", "2", spec, *flags])
        assert args.handler(args) == 0
        runs[bool(flags)] = json.loads(capsys.readouterr().out)["specs"][0]
    assert runs[False]["symmetry"] is True
    assert runs[True]["symmetry"] is False
    assert runs[False]["states"] < runs[True]["states"]
    assert runs[False]["numbered"] == runs[True]["numbered"] == runs[True]["states"]
    parser = argparse.ArgumentParser()
    check.register(parser.add_subparsers())
    args = parser.parse_args(["check", "--nodes", "2", spec, "--no-symmetry"])
    args.handler(args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  states explored: {runs[True]['states']} (no symmetry reduction)"
    assert lines[2].startswith("  states/s: ")  # no "before reduction": these are numbered
    args = parser.parse_args(["check", "--nodes", "2", spec])
    args.handler(args)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [
        f"  states explored: {runs[False]['states']} (symmetry reduced)",
        f"  before reduction: {runs[True]['states']} numbered states (each tree in every "
        "numbering of its 2 slots)",
    ]


def _tree_steps_agree(explorer: Explorer, layout: Layout, nodes: int) -> set[str]:
    """Walk every state; in each with a free slot, the tabled tree operations must be the fired ones.

    Returns the kinds of the tree operations compared.
    """
    trees = explorer.trees
    explorer.slots = nodes
    frontier = [trees.encode(state) for state in check.shapes(layout, nodes).values()]
    seen, compared = set(frontier), set[str]()
    while frontier:
        forest = frontier.pop()
        assert explorer.local_ops
        tabled = list(explorer.successors(forest))
        if sum(trees.size[s] for s in forest) < nodes:
            explorer.local_ops = False
            assert tabled == list(explorer.successors(forest)), trees.decode(forest, nodes)
            explorer.local_ops = True
            compared.update(step[0] for step, _, _ in tabled)
        fresh = [nxt for _, nxt, _ in tabled if nxt not in seen]
        seen.update(fresh)
        frontier += fresh
    return compared


def test_tabled_tree_operations_are_the_ones_fired_on_slots(layout: Layout) -> None:
    """Splits, inserts and births read off each root subtree's table: same steps, same states, same order."""
    assert _tree_steps_agree(Explorer(layout, BOUNDS), layout, 3) == {"event", "split", "insert"}
    storage = Layout.of(as_system(load_spec(spec_dir() / "residency_storage.toml")))
    explorer = Explorer(storage, Bounds({"pins": 1, "locks": 1}))
    assert _tree_steps_agree(explorer, storage, 2) == {"event", "split", "insert", "born"}


def test_a_control_with_its_own_tree_operations_fires_them_on_slots() -> None:
    """A control's ``split`` or ``insert`` may touch anything: its steps are never tabled."""
    path, ops = check.load_ops(spec_dir() / "bugs_detected" / "split_drops_pins.py")
    layout = Layout.of(as_system(load_spec(path)))
    assert not Explorer(layout, BOUNDS, ops).local_ops
    assert not Explorer(layout, BOUNDS, symmetry=False).local_ops
    assert Explorer(layout, BOUNDS).local_ops


def test_replacing_one_of_two_root_subtrees_keeps_canonical_order(layout: Layout) -> None:
    trees = Trees(layout)
    pinned = trees.encode((layout.entry(-1, "pinned", "resident", 1, 0, 1, 0, 0),))[0]
    fresh = trees.encode((layout.fresh(-1),))[0]
    chain = trees.encode((layout.fresh(-1), layout.fresh(0)))[0]
    for a, b, new in [(pinned, fresh, chain), (fresh, pinned, chain), (chain, fresh, pinned)]:
        forest = trees.order([a, b])
        for old in forest:
            rest = [s for s in forest if s != old] or [old]
            assert trees.swap_root(forest, old, new) == trees.order([*rest[:1], new])


def test_sibling_subtrees_are_interchangeable_at_any_depth(layout: Layout) -> None:
    """Siblings that differ only below them, in any slot order, are one tree; a real difference is not."""
    pinned = ("pinned", "resident", 1, 0, 1, 0, 0)
    trees = Trees(layout)
    # node 0 over siblings 1 and 2; one sibling has a pinned child, the other a fresh one
    one = (
        layout.fresh(-1),
        layout.fresh(0),
        layout.fresh(0),
        layout.entry(1, *pinned),
        layout.fresh(2),
    )
    other = (  # the same tree, the sibling with the fresh child in the lower slot
        layout.fresh(-1),
        layout.fresh(3),
        layout.entry(4, *pinned),
        layout.fresh(0),
        layout.fresh(0),
    )
    assert trees.encode(one) == trees.encode(other)
    assert canonical(one)[0] == canonical(other)[0]
    moved = (*one[:3], layout.entry(1, *pinned), layout.fresh(1))  # both children under node 1
    assert trees.encode(moved) != trees.encode(one)


@pytest.mark.parametrize("symmetry", [True, False])
def test_lifting_new_locals_up_a_path_is_the_tree_with_them(layout: Layout, symmetry: bool) -> None:
    """``Trees.lift`` (each event step of each root subtree) is the tree with the new locals, encoded anew."""
    trees = Trees(layout, symmetry=symmetry)
    pinned = trees.lid(layout.entry(-1, "pinned", "resident", 1, 0, 1, 0, 0)[1:])
    # a chain of three under the root, and a leaf beside it: chains and fan-outs on the way up
    tree = (layout.fresh(-1), layout.fresh(0), layout.fresh(1), layout.fresh(0))
    (root,) = trees.encode(tree)
    order = trees.preorder((root,))
    flat, where = trees.decode((root,), len(tree)), trees.where((root,))
    lifted = 0
    for k in range(len(order)):
        path = [k]
        while order[path[-1]][1] >= 0:
            path.append(order[path[-1]][1])
        for given in range(1, len(path) + 1):
            changed = list(flat)
            for i in path[:given]:
                entry = changed[where[i]]
                assert entry is not None
                changed[where[i]] = (entry[0], *trees.locals[pinned])
            (expected,) = trees.encode(tuple(changed))
            assert trees.lift(order, k, (pinned,) * given) == expected, (k, given)
            lifted += 1
    assert lifted == 1 + 2 + 3 + 2  # the root, its two children, the chain's leaf
