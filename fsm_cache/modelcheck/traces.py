"""Steps on flat model states (numbered nodes), and the replay of a trace on them.

The explorer works on interned canonical states (:class:`~fsm_cache.modelcheck.forest.Trees`)
and tabled per-node answers (:mod:`fsm_cache.modelcheck.answers`). Here a step is applied
to a plain model state instead: an event is fired by
:meth:`~fsm_cache.engine.core.Engine.fire` on records of every node, linked as the
tree is, and a tree operation is the ops module's. The explorer applies tree
operations this way, and a violation's trace is replayed this way on the
starting tree, so node numbers stay put and every event of the trace is
fired again through the engine itself.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition
from fsm_cache.modelcheck import treeops
from fsm_cache.modelcheck.state import (
    Choices,
    Layout,
    NodeEntry,
    Nodes,
    ancestors,
    canonical,
    children,
)


TraceStep = tuple[Any, ...]
"""``("event", node, name)``, ``("insert", parent)``, ``("born", parent, birth)``,
``("split", node)`` or ``("start", shape)``."""


class Replay:
    """Applies steps to flat model states.

    Args:
        layout: The node layout of the spec.
        bounds: Counter ceilings in counter order (an event past one is not fired).
        ops: The module providing ``insert``, ``born``, ``split`` and ``prune``.
        choices: What the cache chooses among the steps the spec allows.
        symmetry: Whether the explorer numbered the steps of a trace in
            canonical order (:func:`~fsm_cache.modelcheck.state.canonical`) or,
            without symmetry reduction, in slot order
            (:func:`slot_order`).
    """

    def __init__(
        self,
        layout: Layout,
        bounds: list[int],
        ops: ModuleType | Any,
        choices: Choices | None = None,
        *,
        symmetry: bool = True,
    ) -> None:
        self.layout = layout
        self.symmetry = symmetry
        self.bounds = bounds
        self.ops = ops
        self.choices = choices or Choices()
        self.engine = Engine(layout.system, trail=False)
        self.Rec: type = type("Rec", (), {"__slots__": (*self.engine.slots, "parent", "children")})
        self.fields = (*layout.regions, *layout.counters)

    def apply(self, nodes: Nodes, step: TraceStep) -> Nodes | None:
        """Return the state after ``step`` (None if it is refused or does not apply)."""
        if step[0] == "event":
            return self.event(nodes, int(step[1]), str(step[2]))
        slot = next((i for i, e in enumerate(nodes) if e is None), None)
        if slot is None:
            return None
        if step[0] == "insert":
            return self.ops.insert(self.layout, nodes, int(step[1]), slot)  # type: ignore[no-any-return]
        if step[0] == "born":
            return self.ops.born(self.layout, nodes, int(step[1]), slot, str(step[2]))  # type: ignore[no-any-return]
        return self.ops.split(self.layout, nodes, int(step[1]), slot)  # type: ignore[no-any-return]

    def event(self, nodes: Nodes, index: int, event: str) -> Nodes | None:
        """Fire ``event`` at node ``index`` through the engine; None if refused or past a bound."""
        layout = self.layout
        if layout.gives_back_unheld(_at(nodes, index), event):
            return None  # clients only give back what they hold
        if not self._chosen(nodes, index, event):
            return None  # the cache does not fire it here
        recs = self._records(nodes)
        try:
            propagates = self.engine.plan(recs[index], event)[2]
            joined = [] if propagates else self._joined(nodes, index, event)
            chain = [index, *ancestors(nodes, index)] if propagates else [index, *joined]
            effects = {n: self.engine.plan(recs[n], event)[1] for n in chain}
            for n in [*reversed(joined), index]:  # a copy's nodes are acknowledged top down
                self.engine.fire(recs[n], event)
        except IllegalTransition:
            return None
        out = list(nodes)
        for n in chain:
            old = _at(nodes, n)
            new = (old[0], *(getattr(recs[n], f) for f in self.fields), *old[layout.base :])
            out[n] = layout.stepped(new, event, effects[n])
        out[index] = layout.with_holds(_at(out, index), layout.deltas(event))
        if any(layout.over(_at(out, n), self.bounds) for n in chain):
            return None
        if any(treeops.dataless(layout, _at(out, n)) for n in chain):
            return self.ops.prune(layout, tuple(out))  # type: ignore[no-any-return]
        return tuple(out)

    def accepts(self, nodes: Nodes, index: int, event: str) -> bool:
        """Whether the engine accepts ``event`` at node ``index``, whoever holds what (a dry run)."""
        return self.engine.allowed(self._records(nodes)[index], event)

    def refusal(self, nodes: Nodes, index: int, event: str) -> str | None:
        """Return the error class the engine refuses ``event`` at node ``index`` with (None: accepted).

        A dry run on records rebuilt for the purpose, whoever holds what.
        """
        try:
            self.engine.fire(self._records(nodes)[index], event)
        except IllegalTransition as exc:
            return type(exc).__name__
        return None

    def _chosen(self, nodes: Nodes, index: int, event: str) -> bool:
        """Whether the cache fires ``event`` at node ``index`` itself (its policy, its copies)."""
        entry = _at(nodes, index)
        parent = int(entry[0])
        if self.choices.policy is None:  # any step the spec allows, a read landing in order
            above = _at(nodes, parent) if parent >= 0 else None
            return not self.choices.behind(self.layout, event, above)
        if not self.choices.fires(
            self.layout, event, entry, nodes[parent] if parent >= 0 else None
        ):
            return False
        below = [self.layout.state(_at(nodes, c), "host") for c in children(nodes, index)]
        return not self.choices.waits(event, below)

    def _joined(self, nodes: Nodes, index: int, event: str) -> list[int]:
        """Return the ancestors that ``event`` at ``index`` acknowledges too (one shared copy)."""
        out = []
        for n in ancestors(nodes, index):
            if not self.choices.joins(self.layout, event, _at(nodes, n)):
                break
            out.append(n)
        return out

    def trace(self, steps: list[TraceStep], start: Nodes) -> tuple[list[str], Nodes]:
        """Replay ``steps`` on the starting tree ``start``; return their labels and the end.

        ``steps[0]`` is ``("start", shape)``; the others were taken in canonical
        states, numbered as :func:`~fsm_cache.modelcheck.state.canonical` numbers
        them (:func:`slot_order` without symmetry
        reduction), and are fired here at the nodes those numbers stand for:
        the labels name the slots of the replayed tree, the same node by the
        same number from the first step to the last.
        """
        nodes = start
        lines = [f"start: {steps[0][1]}"]
        perm = self.numbering(nodes)
        for step in steps[1:]:
            where = int(step[1])
            concrete: TraceStep = (step[0], perm[where] if where >= 0 else -1, *step[2:])
            lines.append(label(nodes, concrete))
            after = self.apply(nodes, concrete)
            assert after is not None, f"replay refused {concrete}"
            nodes = after
            perm = self.numbering(nodes)
        return lines, nodes

    def numbering(self, nodes: Nodes) -> tuple[int, ...]:
        """Return the slot of each node as the explorer numbers them: ``out[k]`` is node ``k``'s."""
        return canonical(nodes)[1] if self.symmetry else slot_order(nodes)

    def _records(self, nodes: Nodes) -> dict[int, Any]:
        """Return a record per node, linked to its parent's and children's."""
        recs: dict[int, Any] = {}
        for i, entry in enumerate(nodes):
            if entry is not None:
                rec = recs[i] = self.Rec()
                rec.id, rec.trail = i, None
                for name, value in zip(self.fields, entry[1:], strict=False):
                    setattr(rec, name, value)
        for i, rec in recs.items():
            rec.parent = recs.get(int(_at(nodes, i)[0]))
            rec.children = [recs[c] for c in children(nodes, i)]
        return recs


def slot_order(nodes: Nodes) -> tuple[int, ...]:
    """Return the slots of ``nodes`` in preorder, siblings in slot order: ``out[k]`` is node ``k``'s.

    Without symmetry reduction the explorer numbers a state's nodes so
    (:meth:`~fsm_cache.modelcheck.forest.Trees.where`), as with it it numbers
    them in :func:`~fsm_cache.modelcheck.state.canonical`'s order.
    """
    out: list[int] = []

    def visit(parent: int) -> None:
        for i in children(nodes, parent):
            out.append(i)
            visit(i)

    visit(-1)
    return tuple(out)


def label(nodes: Nodes, step: TraceStep) -> str:
    """Return how a trace shows ``step`` taken in ``nodes`` (with the slot it fills)."""
    slot = next((i for i, e in enumerate(nodes) if e is None), -1)
    if step[0] == "event":
        return f"node {step[1]}: {step[2]}"
    if step[0] == "split":
        return f"split node {step[1]}: prefix node {slot}"
    where = "the root" if int(step[1]) < 0 else f"node {step[1]}"
    born = f", born {step[2]}" if step[0] == "born" else ""
    return f"insert node {slot} under {where}{born}"


def _at(nodes: Nodes | list[NodeEntry | None], index: int) -> NodeEntry:
    entry = nodes[index]
    assert entry is not None
    return entry
