"""The engine agrees with the reference on trees: parent and child rules, propagation, random runs."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from records import configurations, outcome, run_both, step_lists, tree_pair, tree_values

from fsm_cache.engine.core import Engine
from fsm_cache.errors import ParentLoop
from fsm_cache.spec.machine import System
from fsm_cache.spec.shipped import residency_system
from fsm_cache.testing.reference import Record, Reference


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


def looping_pair(engine: Engine, length: int, back: int) -> tuple[list[Record], list[Record]]:
    """Two identical chains of ``length`` nodes, each the parent of the next, node 0's ``back``."""
    ours, theirs = tree_pair(engine, [None, *range(length - 1)])
    for nodes in (ours, theirs):
        nodes[0].parent = nodes[back]
        nodes[back].children.append(nodes[0])
    return ours, theirs


def allowed(ask: Callable[[Any, str], bool], rec: Any, event: str) -> object:
    """Return what ``ask`` answers, or the type and message of what it raised."""
    try:
        return ask(rec, event)
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.timeout(60)  # the reference used to walk a looping chain for ever
@pytest.mark.parametrize("event", ["lock", "unlock"])
def test_the_reference_refuses_a_looping_chain_as_the_engine_does(event: str) -> None:
    system = residency_system()
    engine, ref = Engine(system, trail=False), Reference(system)
    ours, theirs = looping_pair(engine, 3, 2)
    for nodes in (ours, theirs):
        for node in nodes:
            node.locks = 1 if event == "unlock" else 0  # type: ignore[attr-defined]
    message = "node 1: its parent chain loops (node 1 -> node 0 -> node 2 -> node 1)"
    refused = (ParentLoop, f"{message}; {event} was not applied")
    assert outcome(engine.fire, ours[1], event) == refused
    assert outcome(ref.fire, theirs[1], event) == refused
    with pytest.raises(ParentLoop):
        ref.allowed(theirs[1], event)
    assert tree_values(system, ours) == tree_values(system, theirs)
    assert {node.locks for node in theirs} == {1 if event == "unlock" else 0}  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_looping_chains_agree(data: st.DataObject) -> None:
    """On a chain that loops, the engine and the reference give the same refusal or ParentLoop.

    An ancestor before the repeat that refuses is named, as on any chain;
    otherwise both refuse the loop itself, and neither changes a record.
    """
    system = residency_system()
    engine, ref = Engine(system, trail=False), Reference(system)  # a trail adds sites
    length = data.draw(st.integers(1, 6), label="length")
    back = data.draw(st.integers(0, length - 1), label="node 0's parent")
    ours, theirs = looping_pair(engine, length, back)
    pick = st.sampled_from(list(configurations(system, top=1)))
    for ours_node, theirs_node in zip(ours, theirs, strict=True):
        for key, value in data.draw(pick).items():
            setattr(ours_node, key, value)
            setattr(theirs_node, key, value)
    walking = st.sampled_from(["lock", "unlock"])  # the events that propagate, drawn often
    events = st.one_of(walking, st.sampled_from(system.event_names))
    steps = st.tuples(st.integers(0, length - 1), events)
    for index, event in data.draw(st.lists(steps, min_size=1, max_size=20), label="steps"):
        got = outcome(engine.fire, ours[index], event)
        assert got == outcome(ref.fire, theirs[index], event), (index, event)
        assert allowed(engine.allowed, ours[index], event) == allowed(
            ref.allowed, theirs[index], event
        )
        assert tree_values(system, ours) == tree_values(system, theirs)
