"""Breadth-first exploration of every reachable model state, firing events through the engine.

Each step is either a spec event on one node, fired by
:class:`~fsm_cache.engine.Engine` on records rebuilt from the model state (so
the checker checks the spec's real semantics, refusals and propagation
included), or a tree operation of :mod:`fsm_cache.treeops`. The engine's
answer depends only on the node, its ancestors when the event propagates,
their parents' and children's states, so answers are memoised on exactly
that. Parent pointers give the shortest event sequence to any state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fsm_cache import treeops
from fsm_cache.engine import Engine
from fsm_cache.errors import IllegalTransition
from fsm_cache.invariants import violation
from fsm_cache.model import Entry, Layout, Nodes, ancestors, canonical, children


Step = tuple[Any, ...]
"""``("event", node, name)``, ``("insert", parent)`` or ``("split", node)``."""
Key = tuple[object, ...]
Tails = tuple[tuple[int | str, ...], ...]


@dataclass
class Bounds:
    """How far the exploration goes: counter ceilings (events past them are not fired)."""

    counters: dict[str, int]
    default: int = 2


@dataclass
class Result:
    """What an exploration found.

    Attributes:
        states: Distinct model states explored.
        violation: The first violated invariant, or None.
        trace: The shortest sequence of steps reaching it (first: the initial shape).
    """

    states: int
    violation: str | None = None
    trace: list[str] = field(default_factory=list)


class Explorer:
    """Explores one spec's model states.

    Args:
        layout: The node layout of the spec.
        bounds: Counter ceilings.
        ops: The module providing ``insert``, ``split`` and ``prune``
            (:mod:`fsm_cache.treeops`, or a broken variant).
    """

    def __init__(self, layout: Layout, bounds: Bounds, ops: ModuleType | Any = treeops) -> None:
        self.layout = layout
        self.bounds = [bounds.counters.get(c, bounds.default) for c in layout.counters]
        self.ops = ops
        self.engine = Engine(layout.system, audit=False)
        slots = (*self.engine.slots, "parent", "children")
        self.Rec: type = type("Rec", (), {"__slots__": slots})
        self.memo: dict[Key, Tails | None] = {}
        self.events = layout.system.event_names
        self.propagates = {e: self._propagates(e) for e in layout.system.event_names}
        self.base = 1 + len(layout.regions)

    def run(self, initial: dict[str, Nodes], tick: Callable[[int], None] | None = None) -> Result:
        """Explore from the named initial states; stop at the first violation."""
        seen: dict[Nodes, tuple[Nodes | None, Step]] = {}
        starts: dict[Nodes, tuple[str, Nodes]] = {}
        queue: deque[Nodes] = deque()
        for name, nodes in initial.items():
            start, _ = canonical(nodes)
            if start in seen:
                continue  # the same tree as an earlier shape (small trees)
            seen[start] = (None, ("start", name))
            starts[start] = (name, nodes)
            found = violation(self.layout, start)
            if found is not None:
                return self._found(len(seen), seen, starts, start)
            queue.append(start)
        while queue:
            current = queue.popleft()
            for step, concrete in self.successors(current):
                nxt, _ = canonical(concrete)
                if nxt in seen:
                    continue
                seen[nxt] = (current, step)
                found = violation(self.layout, nxt)
                if found is not None:
                    return self._found(len(seen), seen, starts, nxt)
                queue.append(nxt)
            if tick is not None and len(seen) % 4096 < 64:
                tick(len(seen))
        return Result(len(seen))

    def successors(self, nodes: Nodes) -> Iterator[tuple[Step, Nodes]]:
        """Yield every step from ``nodes`` with its result: events on each node, then tree operations."""
        contexts: dict[int, Key] = {}
        present = [i for i, e in enumerate(nodes) if e is not None]
        for i in present:
            for event in self.events:
                nxt = self._event(nodes, i, event, contexts)
                if nxt is not None:
                    yield ("event", i, event), nxt
        for step in (*(("split", i) for i in present), *(("insert", p) for p in (-1, *present))):
            nxt = self.apply(nodes, step)
            if nxt is not None:
                yield step, nxt

    def apply(self, nodes: Nodes, step: Step) -> Nodes | None:
        """Return the state after ``step`` (None if it is refused or does not apply)."""
        if step[0] == "event":
            return self._event(nodes, int(step[1]), str(step[2]), {})
        slot = next((i for i, e in enumerate(nodes) if e is None), None)
        if slot is None:
            return None
        if step[0] == "insert":
            return self.ops.insert(self.layout, nodes, int(step[1]), slot)  # type: ignore[no-any-return]
        return self.ops.split(self.layout, nodes, int(step[1]), slot)  # type: ignore[no-any-return]

    def _event(
        self, nodes: Nodes, index: int, event: str, contexts: dict[int, Key]
    ) -> Nodes | None:
        chain = [index, *ancestors(nodes, index)] if self.propagates[event] else [index]
        for n in chain:
            if n not in contexts:
                contexts[n] = self._context(nodes, n)
        key = (event, *(contexts[n] for n in chain))
        if key in self.memo:
            tails = self.memo[key]
        else:
            tails = self.memo[key] = self._outcome(nodes, chain, event)
        if tails is None:
            return None
        out = list(nodes)
        for n, tail in zip(chain, tails, strict=True):
            out[n] = (self._entry(nodes, n)[0], *tail)
        if any(treeops.dataless(self.layout, (0, *tail)) for tail in tails):
            return self.ops.prune(self.layout, tuple(out))  # type: ignore[no-any-return]
        return tuple(out)

    def _outcome(self, nodes: Nodes, chain: list[int], event: str) -> Tails | None:
        """Fire ``event`` through the engine; return the chain's new entries (without parents)."""
        layout = self.layout
        entry = self._entry(nodes, chain[0])
        if any(layout.hold(entry, h) == 0 for h in layout.releases[event]):
            return None  # clients only give back what they hold
        changed = self._engine_step(nodes, chain, event)
        if changed is None:
            return None
        deltas = dict.fromkeys(layout.acquires[event], 1)
        deltas.update(dict.fromkeys(layout.releases[event], -1))
        tails: list[tuple[int | str, ...]] = [
            (*fields, *self._entry(nodes, n)[layout.base :])
            for n, fields in zip(chain, changed, strict=True)
        ]
        tails[0] = layout.with_holds((0, *tails[0]), deltas)[1:]
        if any(self._over(t) for t in tails):
            return None
        return tuple(tails)

    def _over(self, tail: tuple[object, ...]) -> bool:
        start = len(self.layout.regions)
        counters = tail[start : start + len(self.bounds)]
        return any(int(str(v)) > b for v, b in zip(counters, self.bounds, strict=True))

    def _context(self, nodes: Nodes, index: int) -> Key:
        entry = self._entry(nodes, index)
        parent = int(entry[0])
        up = self._states(nodes[parent]) if parent >= 0 else None
        kids = tuple(sorted(self._states(nodes[c]) for c in children(nodes, index)))
        return (entry[1:], up, kids)

    def _states(self, entry: Entry | None) -> tuple[object, ...]:
        assert entry is not None
        return tuple(entry[1 : self.base])

    def _engine_step(self, nodes: Nodes, chain: list[int], event: str) -> Tails | None:
        recs = {n: self._record(nodes, n) for n in chain}
        for n in chain:
            parent = int(self._entry(nodes, n)[0])
            recs[n].parent = recs.get(parent) or (
                self._view(nodes, parent) if parent >= 0 else None
            )
            recs[n].children = [recs.get(c) or self._view(nodes, c) for c in children(nodes, n)]
        try:
            self.engine.fire(recs[chain[0]], event)
        except IllegalTransition:
            return None
        names = (*self.layout.regions, *self.layout.counters)
        return tuple(tuple(getattr(recs[n], f) for f in names) for n in chain)

    def _record(self, nodes: Nodes, index: int) -> Any:
        entry = self._entry(nodes, index)
        rec = self.Rec()
        rec.id = index
        rec.trail = None
        for offset, name in enumerate((*self.layout.regions, *self.layout.counters)):
            setattr(rec, name, entry[1 + offset])
        return rec

    def _view(self, nodes: Nodes, index: int) -> Any:
        rec = self._record(nodes, index)
        rec.parent, rec.children = None, []
        return rec

    @staticmethod
    def _entry(nodes: Nodes, index: int) -> Entry:
        entry = nodes[index]
        assert entry is not None
        return entry

    def _propagates(self, event: str) -> bool:
        system = self.layout.system
        return any(
            t.propagate is not None
            for r in system.regions_of(event)
            for t in system.machines[r].transitions
            if t.event == event
        )

    def _found(
        self,
        count: int,
        seen: dict[Nodes, tuple[Nodes | None, Step]],
        starts: dict[Nodes, tuple[str, Nodes]],
        last: Nodes,
    ) -> Result:
        """Return the violation at ``last``, described in the replayed tree's node numbers."""
        lines, nodes = self._trace(seen, starts, last)
        return Result(count, violation(self.layout, nodes), lines)

    def _trace(
        self,
        seen: dict[Nodes, tuple[Nodes | None, Step]],
        starts: dict[Nodes, tuple[str, Nodes]],
        last: Nodes,
    ) -> tuple[list[str], Nodes]:
        """Replay the steps reaching ``last`` on the initial tree, so node numbers stay put."""
        steps: list[Step] = []
        current: Nodes | None = last
        while current is not None:
            previous, step = seen[current]
            steps.append(step)
            first = current
            current = previous
        name, nodes = starts[first]
        lines = [f"start: {name}"]
        perm = canonical(nodes)[1]
        for step in steps[-2::-1]:
            concrete: Step = (
                step[0],
                *(perm[int(step[1])] if int(step[1]) >= 0 else -1,),
                *step[2:],
            )
            lines.append(_label(nodes, concrete))
            after = self.apply(nodes, concrete)
            assert after is not None
            nodes = after
            perm = canonical(nodes)[1]
        return lines, nodes


def _label(nodes: Nodes, step: Step) -> str:
    slot = next((i for i, e in enumerate(nodes) if e is None), -1)
    if step[0] == "event":
        return f"node {step[1]}: {step[2]}"
    if step[0] == "split":
        return f"split node {step[1]}: prefix node {slot}"
    where = "the root" if int(step[1]) < 0 else f"node {step[1]}"
    return f"insert node {slot} under {where}"
