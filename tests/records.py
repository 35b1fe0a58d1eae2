"""Records and comparisons shared by the engine and reference tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import strategies as st

from fsm_cache.engine.core import Engine
from fsm_cache.spec.machine import System
from fsm_cache.spec.validate import bound
from fsm_cache.testing.reference import Record, Reference


Outcome = tuple[type, str] | None


class Node:
    """A tree node carrying every attribute the engine reads, children in a dict."""

    id: int
    host: str
    device: str
    pins: int
    locks: int
    trail: Any

    def __init__(
        self, engine: Engine, ident: int, parent: Node | None = None, **state: Any
    ) -> None:
        engine.init(self, ident)
        self.parent = parent
        self.children: dict[int, Node] | list[Node] = {}
        if parent is not None:
            assert isinstance(parent.children, dict)
            parent.children[ident] = self
        for key, value in state.items():
            setattr(self, key, value)


def snapshot(engine: Engine, *recs: Any) -> list[tuple[object, ...]]:
    return [tuple(getattr(rec, slot) for slot in engine.slots) for rec in recs]


def outcome(fire: Callable[[Any, str], None], rec: Any, event: str) -> Outcome:
    try:
        fire(rec, event)
    except Exception as exc:
        return type(exc), str(exc)
    return None


def values(system: System, rec: Any) -> tuple[object, ...]:
    names = [r for r, _ in system.regions] + [c for c, _ in system.counters]
    return tuple(getattr(rec, name) for name in names)


def configurations(system: System, top: int | None = None) -> Iterator[dict[str, object]]:
    """Yield every combination of region states and counter values 0..bound the invariants allow.

    Each region's counters satisfy its state's invariant: the engine keeps
    every invariant (validation proves each step does), and its fast paths
    rely on it (``pin`` from ``backed``, where ``pins == 0``, writes 1).
    """
    axes: list[list[tuple[str, object]]] = []
    for region, machine in system.regions:
        axes.append([(region, s) for s in machine.state_names])
        limit = bound(machine) if top is None else top
        axes += [[(c, v) for v in range(limit + 1)] for c in machine.counter_names]
    for combo in itertools.product(*axes):
        config = dict(combo)
        if all(
            machine.state(str(config[region])).invariant.holds(config)  # type: ignore[arg-type]
            for region, machine in system.regions
        ):
            yield config


def tree_pair(engine: Engine, shape: list[int | None]) -> tuple[list[Record], list[Record]]:
    """Build two identical trees; ``shape[i]`` is the parent index of node i (None: a root)."""
    trees: tuple[list[Record], list[Record]] = ([], [])
    for nodes in trees:
        for i, parent in enumerate(shape):
            node = Record(i)
            engine.init(node, i)
            if parent is not None:
                node.parent = nodes[parent]
                nodes[parent].children.append(node)
            nodes.append(node)
    return trees


def tree_values(system: System, nodes: list[Record]) -> list[tuple[object, ...]]:
    return [values(system, node) for node in nodes]


SHAPE = [None, 0, 0, 1, 3, 1]  # a root, two children, a grandchild chain and a sibling


def run_both(system: System, steps: list[tuple[int, str]], **kwargs: Any) -> None:
    engine, ref = Engine(system, trail=False, **kwargs), Reference(system, **kwargs)
    ours, theirs = tree_pair(engine, SHAPE)
    for index, event in steps:
        got = outcome(engine.fire, ours[index], event)
        assert got == outcome(ref.fire, theirs[index], event), (index, event)
        assert tree_values(system, ours) == tree_values(system, theirs)


def step_lists(system: System) -> st.SearchStrategy[list[tuple[int, str]]]:
    step = st.tuples(st.integers(0, len(SHAPE) - 1), st.sampled_from(system.event_names))
    return st.lists(step, min_size=50, max_size=200)
