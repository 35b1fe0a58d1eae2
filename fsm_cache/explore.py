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
from fsm_cache.invariants import violation, violation_at
from fsm_cache.model import Entry, Forest, Layout, Nodes, Trees, ancestors, canonical, children


Step = tuple[Any, ...]
"""``("event", node, name)``, ``("insert", parent)`` or ``("split", node)``."""
Key = tuple[object, ...]
Tails = tuple[tuple[int | str, ...], ...]
Move = tuple[str, tuple[int, ...], bool]
"""An enabled event at a node: its name, the new locals of the node and the ancestors
it changed (nearest first), and whether one of them holds its data nowhere."""


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
        self.trees = Trees(layout)
        self.slots = 0
        self.ctxs: dict[tuple[int, int, tuple[int, ...]], int] = {}
        self.ctx_ids: dict[tuple[int, int], int] = {}
        self.moves: dict[tuple[int, ...], list[Move]] = {}
        self.local_moves: dict[int, list[tuple[int, Move]]] = {}
        self.prop_moves: dict[tuple[int, ...], list[tuple[int, Move]]] = {}
        self.local_events = tuple(e for e in self.events if not self.propagates[e])
        self.prop_events = tuple(e for e in self.events if self.propagates[e])
        self.answers: dict[Key, Tails | None] = {}
        self.holds: dict[tuple[int, int], bool] = {}
        self.node_holds: dict[tuple[int, int, tuple[int, ...]], bool] = {}
        self.pruned: dict[int, int | None] = {}

    def run(self, initial: dict[str, Nodes], tick: Callable[[int], None] | None = None) -> Result:
        """Explore from the named initial states; stop at the first violation."""
        seen: dict[Forest, tuple[Forest | None, Step]] = {}
        starts: dict[Forest, tuple[str, Nodes]] = {}
        queue: deque[Forest] = deque()
        for name, nodes in initial.items():
            self.slots = len(nodes)
            start = self.trees.encode(nodes)
            if start in seen:
                continue  # the same tree as an earlier shape (small trees)
            seen[start] = (None, ("start", name))
            starts[start] = (name, nodes)
            if not self._holds(start):
                return self._found(len(seen), seen, starts, start)
            queue.append(start)
        while queue:
            current = queue.popleft()
            for step, nxt in self.successors(current):
                if nxt in seen:
                    continue
                seen[nxt] = (current, step)
                if not self._holds(nxt):
                    return self._found(len(seen), seen, starts, nxt)
                queue.append(nxt)
            if tick is not None and len(seen) % 4096 < 64:
                tick(len(seen))
        return Result(len(seen))

    def successors(self, forest: Forest) -> Iterator[tuple[Step, Forest]]:
        """Yield every step from ``forest`` with its result: events on each node, then tree operations.

        Nodes are numbered in preorder, as :func:`~fsm_cache.model.canonical` numbers them.
        """
        trees = self.trees
        order = trees.preorder(forest)
        chains: list[tuple[int, ...]] = []
        flat: Nodes | None = None
        for k, (sid, parent) in enumerate(order):
            up = trees.stid[trees.local[order[parent][0]]] if parent >= 0 else -1
            chain = (self._ctx(sid, up), *(chains[parent] if parent >= 0 else ()))
            chains.append(chain)
            moves = self.moves.get(chain)
            if moves is None:
                flat = flat or trees.decode(forest, self.slots)
                moves = self.moves[chain] = self._moves(flat, k, chain)
            for event, lids, gone in moves:
                yield ("event", k, event), self._after(forest, order, k, lids, gone)
        if len(order) < self.slots:
            flat = flat or trees.decode(forest, self.slots)
            present = range(len(order))
            for step in (
                *(("split", i) for i in present),
                *(("insert", p) for p in (-1, *present)),
            ):
                nxt = self.apply(flat, step)
                if nxt is not None:
                    yield step, trees.encode(nxt)

    def _ctx(self, sid: int, up: int) -> int:
        """Return the id of a node's context: its local, its parent's and children's states."""
        found = self.ctx_ids.get((sid, up))
        if found is None:
            trees = self.trees
            ctx = (trees.local[sid], up, trees.kid_states[sid])
            found = self.ctx_ids[(sid, up)] = self.ctxs.setdefault(ctx, len(self.ctxs))
        return found

    def _moves(self, nodes: Nodes, k: int, chain: tuple[int, ...]) -> list[Move]:
        """Return the enabled events at node ``k`` (of context ``chain``) and their results.

        Events that do not propagate depend on the node's context alone, those
        that do on its ancestors' too: each kind is tabled on what it reads.
        """
        local = self.local_moves.get(chain[0])
        if local is None:
            local = self.local_moves[chain[0]] = self._fired(nodes, [k], self.local_events)
        up = self.prop_moves.get(chain)
        if up is None:
            above = [k, *ancestors(nodes, k)]
            up = self.prop_moves[chain] = self._fired(nodes, above, self.prop_events)
        return [move for _, move in sorted(local + up, key=lambda m: m[0])]

    def _fired(
        self, nodes: Nodes, chain: list[int], events: tuple[str, ...]
    ) -> list[tuple[int, Move]]:
        out = []
        for event in events:
            move = self._fire(nodes, chain, event)
            if move is not None:
                out.append((self.events.index(event), move))
        return out

    def _fire(self, nodes: Nodes, chain: list[int], event: str) -> Move | None:
        """Fire ``event`` at ``chain[0]`` through the engine: None if refused, else its move."""
        tails = self._outcome(nodes, chain, event)
        if tails is None:
            return None
        lids = tuple(self.trees.lid(t) for t in tails)
        return (event, lids, any(treeops.dataless(self.layout, (0, *t)) for t in tails))

    def _after(
        self,
        forest: Forest,
        order: list[tuple[int, int]],
        k: int,
        lids: tuple[int, ...],
        gone: bool,
    ) -> Forest:
        """Return ``forest`` with node ``k`` and its nearest ancestors given new locals."""
        trees = self.trees
        old, parent = order[k]
        new = trees.sid(lids[0], trees.kids[old])
        at = 1
        while parent >= 0:
            sid, parent = order[parent]
            lid = lids[at] if at < len(lids) else trees.local[sid]
            old, new = sid, trees.swap(sid, old, new, lid)
            at += 1
        out = (new,) if len(forest) == 1 else trees.swap_root(forest, old, new)
        if not gone:
            return out
        if self.ops.prune is treeops.prune:
            return treeops.prune_forest(self.layout, trees, out, self.pruned)
        return trees.encode(self.ops.prune(self.layout, trees.decode(out, self.slots)))

    def _holds(self, forest: Forest) -> bool:
        """Whether every invariant holds in ``forest``."""
        return all(self._sub_holds(sid, -1) for sid in forest)

    def _sub_holds(self, sid: int, up: int) -> bool:
        found = self.holds.get((sid, up))
        if found is None:
            trees = self.trees
            lid = trees.local[sid]
            kids = tuple(trees.local[c] for c in trees.kids[sid])
            here = (lid, up, kids)
            if here not in self.node_holds:
                self.node_holds[here] = self._node_holds(lid, up, kids)
            found = self.node_holds[here] and all(self._sub_holds(c, lid) for c in trees.kids[sid])
            self.holds[(sid, up)] = found
        return found

    def _node_holds(self, lid: int, up: int, kids: tuple[int, ...]) -> bool:
        """Check a node of local ``lid`` under local ``up`` over ``kids`` on its neighbourhood."""
        locals_ = self.trees.locals
        entries: list[Entry | None] = [(-1, *locals_[up])] if up >= 0 else []
        me = len(entries)
        entries.append((me - 1, *locals_[lid]))
        entries += [(me, *locals_[c]) for c in kids]
        return violation_at(self.layout, tuple(entries), me) is None

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
        key = (event, *(self._context(nodes, n, self.layout.base) for n in chain))
        if key not in self.answers:
            self.answers[key] = self._engine_step(nodes, chain, event)
        changed = self.answers[key]
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

    def _context(self, nodes: Nodes, index: int, end: int | None = None) -> Key:
        """Return what the engine reads of a node: its fields (up to ``end``), its neighbours' states."""
        entry = self._entry(nodes, index)
        parent = int(entry[0])
        up = self._states(nodes[parent]) if parent >= 0 else None
        kids = tuple(sorted(self._states(nodes[c]) for c in children(nodes, index)))
        return (entry[1:end], up, kids)

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
        seen: dict[Forest, tuple[Forest | None, Step]],
        starts: dict[Forest, tuple[str, Nodes]],
        last: Forest,
    ) -> Result:
        """Return the violation at ``last``, described in the replayed tree's node numbers."""
        lines, nodes = self._trace(seen, starts, last)
        return Result(count, violation(self.layout, nodes), lines)

    def _trace(
        self,
        seen: dict[Forest, tuple[Forest | None, Step]],
        starts: dict[Forest, tuple[str, Nodes]],
        last: Forest,
    ) -> tuple[list[str], Nodes]:
        """Replay the steps reaching ``last`` on the initial tree, so node numbers stay put."""
        steps: list[Step] = []
        current: Forest | None = last
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
