"""The engine's answers per node context: what one event does to one node, tabled.

An event changes the node it is fired at and, when it propagates, every
ancestor too, all or nothing (:meth:`~fsm_cache.engine.core.Engine.fire`). Each
node's part is checked by :meth:`~fsm_cache.engine.core.Engine.plan` on that node
alone, which reads the node's states and counters and its parent's and
children's region states and nothing else. So each node's answer is tabled on
exactly that (its *context*), and an event's outcome on a chain of nodes is
the combination of its nodes' answers: refused if any of them refuses, in
node-to-root order as the engine checks them. Under a write policy
(:class:`~fsm_cache.modelcheck.state.Choices`) an acknowledgement of a backup likewise
changes the ancestors the same copy serves.

Clients give back only what they hold, so the tables also answer, per node
chain, whether the engine would accept a give-back the node's clients hold
none of (:meth:`Answers.takes_unheld`): a dry run, asked only at nodes where
another kind of holder holds the counter, or nothing does; and whether it would refuse one
they do hold (:meth:`Answers.refuses_owed`), asked at nodes with holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsm_cache.engine.core import Engine
from fsm_cache.errors import IllegalTransition
from fsm_cache.modelcheck.forest import Trees
from fsm_cache.modelcheck.state import Choices, Layout, NodeEntry
from fsm_cache.spec.holders import Hold


Context = tuple[int, int, tuple[int, ...]]
"""A node's local id, its parent's region-states id (-1: none) and its children's, sorted."""
Answer = tuple[int, bool] | None
"""The node's new local id and whether the event propagates to the ancestors; None: refused."""


class Answers:
    """Tabled per-node answers of the engine, on interned node contexts.

    Args:
        layout: The node layout of the spec.
        trees: The interned subtrees the contexts are read from.
        bounds: Counter ceilings in counter order (an answer past one is a refusal).
        choices: What the cache chooses among the steps the spec allows.
        settling: The settling events (:func:`~fsm_cache.modelcheck.liveness.settling`):
            an answer of one that only a ceiling refuses is kept in :attr:`past`.

    Attributes:
        past: The answers ``(event, context, fired)`` of settling events that the
            engine accepts but that take a counter past its ceiling (:meth:`cut`).
    """

    def __init__(
        self,
        layout: Layout,
        trees: Trees,
        bounds: list[int],
        choices: Choices | None = None,
        settling: frozenset[str] = frozenset(),
    ) -> None:
        self.layout = layout
        self.trees = trees
        self.bounds = bounds
        self.choices = choices or Choices()
        self.settling = settling
        self.past: set[tuple[str, int, bool]] = set()
        self.engine = Engine(layout.system, trail=False)
        self.Rec: type = type("Rec", (), {"__slots__": (*self.engine.slots, "parent", "children")})
        self.fields = (*layout.regions, *layout.counters)
        self.contexts: list[Context] = []
        self._ids: dict[Context, int] = {}
        self._at: dict[tuple[int, int], int] = {}
        self._table: dict[tuple[str, int, bool], Answer] = {}
        self._enabled: dict[int, list[tuple[str, int, bool]]] = {}
        self._unheld: dict[int, list[str]] = {}
        self._owed: dict[int, list[list[str]]] = {}
        self._free: dict[tuple[str, int], bool | None] = {}
        self._records: dict[int, Any] = {}
        self._by_states: dict[int, tuple[str, ...]] = {}
        self._views: dict[int, Any] = {}
        self.events = layout.system.event_names
        self._sources = _sources(layout)

    def context(self, sid: int, up: int) -> int:
        """Return the id of the context of subtree ``sid``'s root under region states ``up``."""
        found = self._at.get((sid, up))
        if found is None:
            trees = self.trees
            ctx = (trees.local[sid], up, trees.kid_states[sid])
            found = self._at[(sid, up)] = self._ids.setdefault(ctx, len(self.contexts))
            if found == len(self.contexts):
                self.contexts.append(ctx)
        return found

    def moves(self, chain: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """Return each event the node accepts, with the new locals of the chain it changes.

        Args:
            chain: The contexts of the node and of its ancestors, nearest first.

        Returns:
            ``(event, locals)`` in event order, the node's new local first, then
            those of the ancestors it propagates to (or whose copy it
            acknowledges too); an event any of them refuses is left out.
        """
        out = []
        for event, lid, propagates in self.enabled(chain[0]):
            lids = [lid]
            for ctx in chain[1:]:
                if not (propagates or self._joins(event, ctx)):
                    break
                above = self.answer(event, ctx, False)
                if above is None:
                    lids = []
                    break
                lids.append(above[0])
            if lids:
                out.append((event, tuple(lids)))
        return out

    def takes_unheld(self, chain: tuple[int, ...]) -> bool:
        """Whether the node accepts a give-back its clients hold none of (another holder's count).

        Args:
            chain: The contexts of the node and of its ancestors, nearest first.
        """
        events = self._give_backs(self._unheld, self.layout.unheld, chain)
        return any(self.accepts(event, chain) for event in events)

    def refuses_owed(self, chain: tuple[int, ...]) -> bool:
        """Whether the node refuses every give-back of a kind its holders hold.

        As :func:`~fsm_cache.modelcheck.invariants.refused_give_back` decides
        it: one accepted give-back per held kind suffices (where one machine
        alone cannot tell a pin from a load, each gives back its own way).

        Args:
            chain: The contexts of the node and of its ancestors, nearest first.
        """
        lid = self.contexts[chain[0]][0]
        owed = self._owed.get(lid)
        if owed is None:
            by_kind: dict[Hold, list[str]] = {}
            for event, key in self.layout.owed((0, *self.trees.locals[lid])):
                by_kind.setdefault(key, []).append(event)
            owed = self._owed[lid] = list(by_kind.values())
        return not all(any(self.accepts(event, chain) for event in events) for events in owed)

    def _give_backs(
        self,
        memo: dict[int, list[str]],
        find: Callable[[NodeEntry], list[tuple[str, Hold]]],
        chain: tuple[int, ...],
    ) -> list[str]:
        """The events ``find`` names at the node of ``chain``, memoised by its local state."""
        lid = self.contexts[chain[0]][0]
        events = memo.get(lid)
        if events is None:
            entry: NodeEntry = (0, *self.trees.locals[lid])
            events = memo[lid] = [event for event, _ in find(entry)]
        return events

    def accepts(self, event: str, chain: tuple[int, ...]) -> bool:
        """Whether the engine accepts ``event`` fired at the node of ``chain``, whoever holds what.

        A dry run of the spec alone, as :meth:`~fsm_cache.engine.core.Engine.allowed`
        answers it: no ghost holds, no choices of the cache, no counter bounds.
        """
        key = (event, chain[0])
        if key not in self._free:
            try:
                self._free[key] = self.engine.plan(self._context_record(chain[0]), event)[2]
            except IllegalTransition:
                self._free[key] = None
        propagates = self._free[key]
        if propagates is None:
            return False
        return not propagates or all(
            self.answer(event, ctx, False) is not None for ctx in chain[1:]
        )

    def cut(self, chain: tuple[int, ...]) -> bool:
        """Whether a ceiling alone refuses a settling event at the node of ``chain``.

        The engine accepts it, at the node and at every ancestor it changes,
        but one of them would take a counter past its ceiling (a give-back
        that also counts what it served): liveness cannot tell where that
        step leads. Read from the answers :meth:`moves` asked for the chain,
        so it is asked after it.
        """
        if not self.past:
            return False
        for event in self.settling:
            if (event, chain[0], True) in self.past:
                return True
            answer = self._table.get((event, chain[0], True))
            if answer is None:
                continue
            for ctx in chain[1:]:
                if not (answer[1] or self._joins(event, ctx)):
                    break
                if (event, ctx, False) in self.past:
                    return True
                if self.answer(event, ctx, False) is None:
                    break
        return False

    def _joins(self, event: str, ctx: int) -> bool:
        """Whether ``event``, acknowledging a copy below, applies to the node of ``ctx`` too."""
        if event not in self.choices.joined:
            return False
        lid = self.contexts[ctx][0]
        return self.choices.joins(self.layout, event, (0, *self.trees.locals[lid]))

    def enabled(self, ctx: int) -> list[tuple[str, int, bool]]:
        """Return the events the node of context ``ctx`` accepts: name, new local, propagates."""
        found = self._enabled.get(ctx)
        if found is None:
            stid = self.trees.stid[self.contexts[ctx][0]]
            found = self._enabled[ctx] = [
                (event, *answer)
                for event in self._candidates(stid)
                if (answer := self.answer(event, ctx, True)) is not None
            ]
        return found

    def answer(self, event: str, ctx: int, fired: bool) -> Answer:
        """Return the answer of the node of context ``ctx``: fired at it, or propagated to it."""
        key = (event, ctx, fired)
        if key not in self._table:
            self._table[key] = self._ask(event, ctx, fired)
        return self._table[key]

    def _ask(self, event: str, at: int, fired: bool) -> Answer:
        layout = self.layout
        lid, up, kids = self.contexts[at]
        entry: NodeEntry = (0, *self.trees.locals[lid])
        if not self._sourced(event, self.trees.stid[lid]):
            return None  # a region's machine has no transition of it from the node's state
        if fired and layout.gives_back_unheld(entry, event):
            return None  # clients only give back what they hold
        if fired and not self._chosen(event, entry, up, kids):
            return None  # the cache does not fire it here
        try:
            assigns, effects, propagates = self.engine.plan(self._context_record(at), event)
        except IllegalTransition:
            return None
        values: dict[str, Any] = dict(zip(self.fields, entry[1:], strict=False))
        values.update(assigns)
        after: NodeEntry = (0, *(values[f] for f in self.fields), *entry[layout.base :])
        after = layout.stepped(after, event, effects)
        if fired:
            after = layout.with_holds(after, layout.deltas(event))
        if layout.over(after, self.bounds):
            if event in self.settling:
                self.past.add((event, at, fired))
            return None
        return self.trees.lid(after[1:]), propagates

    def _chosen(self, event: str, entry: NodeEntry, up: int, kids: tuple[int, ...]) -> bool:
        """Whether the cache fires ``event`` at the node itself (its policy, its copies)."""
        if self.choices.policy is None:  # any step the spec allows, a read landing in order
            if event not in self.choices.ordered:  # hot: build no entry for the common case
                return True
            above = (0, *self.trees.states[up]) if up >= 0 else None
            return not self.choices.behind(self.layout, event, above)
        states = self.trees.states
        parent = (0, *states[up]) if up >= 0 else None
        if not self.choices.fires(self.layout, event, entry, parent):
            return False
        return not self.choices.waits(
            event, [self.layout.state((0, *states[s]), "host") for s in kids]
        )

    def _candidates(self, stid: int) -> tuple[str, ...]:
        """Return the events that may be accepted in the region states ``stid`` (:meth:`_sourced`)."""
        found = self._by_states.get(stid)
        if found is None:
            found = self._by_states[stid] = tuple(e for e in self.events if self._sourced(e, stid))
        return found

    def _sourced(self, event: str, stid: int) -> bool:
        """Whether every region declaring ``event`` has a transition of it from the node's state.

        Where one has none, the spec refuses the event whatever the guards and
        the tree say (every state of a machine handles every event, by a
        transition or a refusal: validation checks it), so the engine is not asked.
        """
        states = self.trees.states[stid]
        return all(states[i] in sources for i, sources in self._sources[event])

    def _context_record(self, at: int) -> Any:
        """Return the record of the node of context ``at`` (built once: plans only read it)."""
        rec = self._records.get(at)
        if rec is None:
            lid, up, kids = self.contexts[at]
            rec = self._records[at] = self._record((0, *self.trees.locals[lid]), up, kids)
        return rec

    def _record(self, entry: NodeEntry, up: int, kids: tuple[int, ...]) -> Any:
        """Return a record of the node, with views of its parent's and children's region states."""
        rec = self._view(entry[1:])
        rec.parent = self._states_view(up) if up >= 0 else None
        rec.children = [self._states_view(s) for s in kids]
        return rec

    def _states_view(self, stid: int) -> Any:
        """Return the view of a neighbour's region states ``stid`` (shared: nothing writes it)."""
        view = self._views.get(stid)
        if view is None:
            view = self._views[stid] = self._view(self.trees.states[stid])
        return view

    def _view(self, values: NodeEntry) -> Any:
        rec = self.Rec()
        rec.id, rec.trail, rec.parent, rec.children = 0, None, None, []
        for name, value in zip(self.fields, values, strict=False):
            setattr(rec, name, value)
        return rec


def _sources(layout: Layout) -> dict[str, tuple[tuple[int, frozenset[str]], ...]]:
    """Per event, each region declaring it (by index) with the states its transitions leave."""
    system = layout.system
    return {
        event: tuple(
            (
                layout.regions.index(region),
                frozenset(
                    s
                    for t in system.machines[region].transitions
                    if t.event == event
                    for s in t.sources
                ),
            )
            for region in system.regions_of(event)
        )
        for event in system.event_names
    }
