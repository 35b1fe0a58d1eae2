"""The engine agrees with the reference on trees: parent and child rules, propagation, random runs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from records import configurations, outcome, run_both, step_lists, tree_pair, tree_values

from fsm_cache.engine.core import Engine
from fsm_cache.spec.machine import System
from fsm_cache.spec.shipped import residency_system
from fsm_cache.testing.reference import Reference


def representative(system: System) -> Iterator[dict[str, object]]:
    """Every region state with counters at 0 and 1."""
    return configurations(system, top=1)


def test_residency_tree_rules_agree_exhaustively() -> None:
    system = residency_system()
    engine, ref = Engine(system, trail=False), Reference(system)
    neighbours = [None, *configurations(system, top=0)]  # tree rules read states only
    checked = 0
    for me, other in itertools.product(representative(system), neighbours):
        roles = ("parent", "child") if other else ("alone",)
        for event, role in itertools.product(system.event_names, roles):
            ours, theirs = tree_pair(engine, [None] if role == "alone" else [None, 0])
            target = 1 if (other and role == "parent") else 0
            for nodes in (ours, theirs):
                for key, value in me.items():
                    setattr(nodes[target], key, value)
                if other:
                    for key, value in other.items():
                        setattr(nodes[1 - target], key, value)
            got = outcome(engine.fire, ours[target], event)
            assert got == outcome(ref.fire, theirs[target], event), (me, other, role, event)
            assert tree_values(system, ours) == tree_values(system, theirs)
            checked += 1
    assert checked > 5_000


def test_propagation_agrees_on_every_chain() -> None:
    system = residency_system()
    engine, ref = Engine(system, trail=False), Reference(system)
    device = system.machines["device"].state_names
    for states in itertools.product(device, repeat=3):
        for locks in itertools.product(range(2), repeat=3):
            for event in ("lock", "unlock"):
                ours, theirs = tree_pair(engine, [None, 0, 1])
                for nodes in (ours, theirs):
                    for node, state, count in zip(nodes, states, locks, strict=True):
                        node.device, node.locks = state, count  # type: ignore[attr-defined]
                assert outcome(engine.fire, ours[2], event) == outcome(ref.fire, theirs[2], event)
                assert tree_values(system, ours) == tree_values(system, theirs)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_residency_runs_agree(data: st.DataObject) -> None:
    system = residency_system()
    run_both(system, data.draw(step_lists(system)))
