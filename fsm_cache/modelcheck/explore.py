"""Breadth-first exploration of every reachable model state, firing events through the engine.

Each step is either a spec event on one node, or a tree operation of
:mod:`fsm_cache.modelcheck.treeops` (applied by :mod:`fsm_cache.modelcheck.traces`). An event's
outcome is the engine's own (:mod:`fsm_cache.modelcheck.answers`: per-node
:meth:`~fsm_cache.engine.core.Engine.plan` answers, tabled on each node's context
and combined along the chain it propagates to), so the checker checks the
spec's real semantics, refusals and propagation included. Under a write
policy, the cache's own choices (:class:`~fsm_cache.modelcheck.state.Choices`) narrow
the events to those HiCache fires. The events of a root subtree depend on
that subtree alone, so they are tabled per root subtree, with whether a node
in it accepts a give-back its clients hold none of, or refuses one they hold
(both halves of invariant 6, :func:`~fsm_cache.modelcheck.invariants.unheld_give_back`
and :func:`~fsm_cache.modelcheck.invariants.refused_give_back`), and whether its
lookups answer as callers rely on (:mod:`fsm_cache.modelcheck.lookup`). Parent
pointers give the shortest step sequence to any state. Once every state is
explored, the settling steps recorded on the way show whether every state
can still settle (:mod:`fsm_cache.modelcheck.liveness`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from fsm_cache.modelcheck import liveness, lookup, treeops
from fsm_cache.modelcheck.answers import Answers
from fsm_cache.modelcheck.budget import Budget
from fsm_cache.modelcheck.forest import Forest, Trees
from fsm_cache.modelcheck.invariants import (
    NODE_ONLY,
    Check,
    refused_give_back,
    unheld_give_back,
    violation,
    violation_at,
)
from fsm_cache.modelcheck.state import Choices, Layout, NodeEntry, Nodes
from fsm_cache.modelcheck.traces import Replay, TraceStep
from fsm_cache.policy import WritePolicy, wants_backup


Move = tuple[str, tuple[int, ...], bool, int]
"""An enabled event at a node: its name, the new locals of the node and the ancestors
it changed (nearest first), whether one of them holds its data nowhere, and whether it
settles (:data:`SETTLES`, :data:`COMPLETES` or 0)."""
Successor = tuple[TraceStep, int, bool, int]
"""An event step in a root subtree: the step, the new subtree (before pruning), whether to
prune, and whether it settles (:data:`SETTLES`, :data:`COMPLETES` or 0)."""
Root = tuple[list[Successor], bool]
"""A root subtree's event steps, and whether a node in it answers wrongly: accepts a
give-back its clients do not hold, refuses one they hold, or is looked up wrongly."""
Edge = tuple[TraceStep, Forest, int]
"""A step from a state: the step, the state it leads to, and whether it settles (as :data:`Move`)."""

SETTLES = 1
"""A settling step (:func:`~fsm_cache.modelcheck.liveness.settling`) that a failed copy may take too."""
COMPLETES = -1
"""A settling step that completes a copy whose failure is final
(:attr:`~fsm_cache.modelcheck.copies.Memory.final_successes`): where that copy
failed it never comes, so the failure pass of liveness leaves it out."""


TIME_STATES = 16
"""A search reads its clock (``--max-seconds``) once per this many states added...

Adding a state is what costs most on a large tree (checking a new tree of a
hundred nodes takes milliseconds), so a search stops within this many states
of its deadline, however many states one expansion adds."""

TIME_EXPANSIONS = 64
"""... and once per this many states expanded, so a search adding no states stops as soon."""

MEMORY_READS = 16
"""A search reads the available memory at every this many readings of its clock (a reading of
the memory costs tens of microseconds, one of the clock a fraction of one)."""


class Pace:
    """When a search reads its budget (time, memory, its state cap) and reports progress.

    The search reads it once :attr:`due` states are held (every
    :data:`TIME_STATES` added, and at the cap) and once :attr:`timed` states
    are expanded (every :data:`TIME_EXPANSIONS`). Each reading reads the
    clock; the first and every :data:`MEMORY_READS`-th after it read the
    memory too; one that stops nothing reports progress.

    Args:
        budget: What the search may spend.
        tick: Where progress goes (the states so far), or None.

    Attributes:
        due: The count of states held at which :meth:`added` must be asked.
        timed: The count of states expanded at which :meth:`expanded` must be asked.
    """

    def __init__(self, budget: Budget, tick: Callable[[int], None] | None) -> None:
        self.budget = budget
        self.tick = tick
        self.cap = budget.cap()
        self.deadline = budget.deadline()
        self.readings = 0
        self.due = min(self.cap, TIME_STATES)
        self.timed = TIME_EXPANSIONS

    def added(self, states: int) -> str | None:
        """Return why a search holding ``states`` states (at least :attr:`due`) stops, or None."""
        if states >= self.cap:
            return self.budget.capped()
        self.due = min(self.cap, states + TIME_STATES)
        return self._read(states)

    def expanded(self, count: int, states: int) -> str | None:
        """Return why a search that expanded ``count`` states (at least :attr:`timed`) stops, or None."""
        self.timed = count + TIME_EXPANSIONS
        return self._read(states)

    def _read(self, states: int) -> str | None:
        self.readings += 1
        short = self.budget.late(self.deadline)
        if short is None and self.readings % MEMORY_READS == 1:
            short = self.budget.short_of_memory()
        if short is None and self.tick is not None:
            self.tick(states)
        return short


CEILING = 2
"""The ceiling of a counter its run names none for (the default of :attr:`Bounds.default`).

A module constant, not read from the class: compiled (``make compile``), a
dataclass's field is no class attribute."""


@dataclass
class Bounds:
    """How far the exploration goes: counter ceilings (events past them are not fired)."""

    counters: dict[str, int]
    default: int = CEILING

    def ceiling(self, counter: str) -> int:
        """Return the ceiling of ``counter``: its own, else :attr:`default`."""
        return self.counters.get(counter, self.default)

    def __reduce__(self) -> tuple[type[Bounds], tuple[dict[str, int], int]]:
        """Pickle as the arguments that make it: a compiled class pickles only so (``--jobs``)."""
        return Bounds, (self.counters, self.default)


@dataclass
class Result:
    """What an exploration found.

    Attributes:
        states: Distinct model states explored.
        violation: The first violated invariant, or None.
        trace: The shortest sequence of steps reaching it (first: the initial shape).
        stopped: Why the search stopped before it was exhaustive (its
            :class:`~fsm_cache.modelcheck.budget.Budget` ran out), or None when
            it was: every invariant held in the states explored, and liveness
            was not decided.
        numbered: The numbered states the states explored stand for, before
            the symmetry reduction: each tree in every numbering of its slots
            (:meth:`~fsm_cache.modelcheck.forest.Trees.numberings`); ``states``
            without the reduction.
        past_ceiling: The states whose liveness the ceilings leave undecided:
            they settle only by a settling step that takes a counter past its
            ceiling (a give-back that counts what it served), which is not
            fired, so what follows it is not explored. They are taken to
            settle rather than reported stuck; 0 when none.
    """

    states: int
    violation: str | None = None
    trace: list[str] = field(default_factory=list)
    stopped: str | None = None
    numbered: int = 0
    past_ceiling: int = 0


class Explorer:
    """Explores one spec's model states.

    Args:
        layout: The node layout of the spec.
        bounds: Counter ceilings.
        ops: The module providing ``insert``, ``born``, ``split`` and ``prune``
            (:mod:`fsm_cache.modelcheck.treeops`, or a broken variant), and optionally
            ``wants_backup`` (default :func:`fsm_cache.policy.wants_backup`).
        policy: The write policy the cache follows: it decides where backups
            start, and adds its invariants (None: any event the spec allows).
        symmetry: Explore one state per tree whatever its node numbering
            (:class:`~fsm_cache.modelcheck.forest.Trees`); False explores every
            numbering, the unreduced space (same verdicts, more states).
    """

    def __init__(
        self,
        layout: Layout,
        bounds: Bounds,
        ops: ModuleType | Any = treeops,
        policy: WritePolicy | None = None,
        *,
        symmetry: bool = True,
    ) -> None:
        self.layout = layout
        ceilings = [bounds.ceiling(c) for c in layout.counters]
        self.ops = ops
        self.policy = policy
        self.match: lookup.Lookup = getattr(ops, "match_prefix", lookup.match_prefix)
        self.settling = liveness.settling(layout)
        self.completes = layout.memory.final_successes & self.settling
        self.looks = lookup.applies(layout)
        self.trees = Trees(layout, symmetry=symmetry)
        choices = Choices.of(layout, policy, getattr(ops, "wants_backup", wants_backup))
        self.answers = Answers(layout, self.trees, ceilings, choices, self.settling)
        self.replay = Replay(layout, ceilings, ops, choices, symmetry=symmetry)
        self.slots = 0
        self.moves: dict[tuple[int, ...], tuple[list[Move], bool, bool]] = {}
        self.roots: dict[int, Root] = {}
        self.past: set[int] = set()
        """Root subtrees in which a ceiling alone cuts a settling step (:meth:`Answers.cut`)."""
        self.holds: dict[tuple[int, int], bool] = {}
        self.node_holds: dict[tuple[int, int, tuple[int, ...]], bool] = {}
        self.alone: dict[int, bool] = {}
        self.pruned: dict[int, int | None] = {}
        self.dataless: dict[int, bool] = {}
        self.looked: dict[tuple[int, ...], bool] = {}
        self.weights: dict[int, int] = {}
        self.sound: dict[int, bool] = {}
        """Root subtree to whether every invariant holds in it (:meth:`passes`)."""
        self.event_steps: dict[tuple[int, str], TraceStep] = {}
        self.grown: dict[int, dict[tuple[str, ...], list[tuple[int, int]]]] = {}
        self.leaves: dict[tuple[str, ...], int | None] = {}
        self.kinds: list[tuple[str, tuple[str, ...]]] = [
            ("split", ()),
            ("insert", ()),
            *(("born", (b,)) for b in layout.births),
        ]
        """The tree operations, in the order the explorer tries them (a birth names its kind)."""
        self.local_ops = symmetry and all(
            getattr(ops, name) is getattr(treeops, name) for name in ("insert", "born", "split")
        )
        """Whether tree operations are tabled per root subtree (:meth:`_grown`): only the
        checker's own, which change one root subtree, and only where numbering is not kept."""

    def run(
        self,
        initial: dict[str, Nodes],
        tick: Callable[[int], None] | None = None,
        budget: Budget | None = None,
    ) -> Result:
        """Explore from the named initial states; stop at the first violation.

        A spec whose give-backs do not pair with its acquires is a finding
        before anything is explored (:attr:`fsm_cache.spec.holders.Holders.unpaired`),
        and so is a copy none of whose acknowledgements reports a failure
        (:attr:`fsm_cache.modelcheck.copies.Memory.unfailing`).
        Once every state is explored and every invariant holds in each, the
        first state (in breadth-first order, so with a shortest trace) that
        cannot settle is the finding (:mod:`fsm_cache.modelcheck.liveness`).
        A search that exhausts ``budget`` (default: a :class:`Budget` that
        keeps a sixteenth of the memory, at least 1 GiB or a quarter under 4
        GiB, free) stops with its reason in :attr:`Result.stopped`.
        :attr:`Result.numbered` counts the numbered states the states
        explored stand for.
        """
        forests: list[Forest] = []
        result = self._search(initial, forests, tick, budget if budget is not None else Budget())
        numberings, slots = self.trees.numberings, self.slots
        result.numbered = sum(numberings(forest, slots) for forest in forests)
        return result

    def reachable(
        self, initial: dict[str, Nodes], budget: Budget | None = None
    ) -> tuple[Result, list[Nodes]]:
        """Explore as :meth:`run` does; return its result and every state it explored.

        The states are flat model states (:mod:`fsm_cache.modelcheck.state`),
        numbered as :func:`~fsm_cache.modelcheck.state.canonical` numbers them,
        in breadth-first order: what a differential test holds the cache's own
        trees to (every tree the cache reaches within the bounds must be one).
        """
        forests: list[Forest] = []
        result = self._search(initial, forests, None, budget if budget is not None else Budget())
        return result, [self.trees.decode(forest, self.slots) for forest in forests]

    def _search(
        self,
        initial: dict[str, Nodes],
        forests: list[Forest],
        tick: Callable[[int], None] | None,
        budget: Budget,
    ) -> Result:
        """:meth:`run`'s search, keeping the states it explores in ``forests``."""
        pace = Pace(budget, tick)  # the clock starts before the starting states are checked
        findings = (*self.layout.holders.unpaired, *self.layout.memory.unfailing)
        if findings:
            return Result(0, findings[0])
        index, parents, steps, starts = self._starts(initial, forests)
        early = self._at_start(forests, parents, steps, starts, budget)
        if early is not None:
            return early
        # The settling steps of state s lead to dst[first[s]:first[s + 1]]; one that
        # completes a copy whose failure is final is stored as ~state (COMPLETES).
        first, dst = array("l"), array("l")
        settle, passes = dst.append, self.passes
        at = 0
        while at < len(forests):
            first.append(len(dst))
            for step, nxt, settles in self.successors(forests[at]):
                found = index.get(nxt)
                if found is not None:
                    if settles:
                        settle(found if settles > 0 else ~found)
                    continue
                found = index[nxt] = len(forests)
                if found >= pace.due:
                    short = pace.added(found)
                    if short is not None:
                        return Result(found, stopped=short)
                forests.append(nxt)
                parents.append(at)
                steps.append(step)
                if not passes(nxt):
                    return self._found(parents, steps, starts, found, forests)
                if settles:
                    settle(found if settles > 0 else ~found)
            at += 1
            if at >= pace.timed:
                short = pace.expanded(at, len(forests))
                if short is not None:
                    return Result(len(forests), stopped=short)
        first.append(len(dst))
        return self._live(forests, (first, dst), parents, steps, starts)

    def _starts(
        self, initial: dict[str, Nodes], forests: list[Forest]
    ) -> tuple[dict[Forest, int], array[int], list[TraceStep], dict[int, Nodes]]:
        """Put the search's first states in ``forests``; return their index, parents, steps and starting trees.

        A shape that is the same tree as an earlier one (small trees) is left out.
        """
        index: dict[Forest, int] = {}
        parents = array("l")
        steps: list[TraceStep] = []
        starts: dict[int, Nodes] = {}
        for name, nodes in initial.items():
            self.slots = len(nodes)
            start = self.trees.encode(nodes)
            if start not in index:
                index[start] = len(forests)
                starts[len(forests)] = nodes
                forests.append(start)
                parents.append(-1)
                steps.append(("start", name))
        return index, parents, steps, starts

    def _at_start(
        self,
        forests: list[Forest],
        parents: Sequence[int],
        steps: list[TraceStep],
        starts: dict[int, Nodes],
        budget: Budget,
    ) -> Result | None:
        """Return the search's end among its starting states, or None to search on.

        A cap below their number keeps the first of them and stops there (with
        a starting tree of each distinct shape: one on one or two nodes, two on
        three, three on four and more; times the ways a node may be born).
        A starting state that breaks an invariant is the finding either way,
        and the states explored are those up to it.
        """
        over = len(forests) > budget.cap()
        if over:
            del forests[budget.cap() :]
        bad = next((i for i, start in enumerate(forests) if not self.passes(start)), None)
        if bad is not None:
            del forests[bad + 1 :]  # the starts after it were never checked
            return self._found(parents, steps, starts, bad, forests)
        return Result(len(forests), stopped=budget.capped()) if over else None

    def successors(self, forest: Forest) -> Iterator[Edge]:
        """Yield every step from ``forest`` with its result: events on each node, then tree operations.

        Each comes with whether it settles (an acknowledgement, or a give-back).
        Nodes are numbered in preorder, as :func:`~fsm_cache.modelcheck.state.canonical` numbers them.
        A state of one root subtree (a third of them) takes a shorter path (:meth:`_one_root`).
        """
        if len(forest) == 1:
            return self._one_root(forest[0])
        return self._many(forest)

    def _many(self, forest: Forest) -> Iterator[Edge]:
        """Yield every step from ``forest`` of several root subtrees, as :meth:`successors` does."""
        trees = self.trees
        at = 0
        for root in forest:
            for step, new, gone, settles in self._root(root)[0]:
                nxt = trees.swap_root(forest, root, new)
                if gone:
                    nxt = self._prune(nxt)
                yield (step if not at else self._step(at + step[1], step[2])), nxt, settles
            at += trees.size[root]
        if at < self.slots:
            for step, nxt in self._tree_steps(forest, at):
                yield step, nxt, False

    def _one_root(self, root: int) -> Iterator[Edge]:
        """Yield every step from the state of root subtree ``root`` alone, as :meth:`successors` does."""
        for step, new, gone, settles in self._root(root)[0]:
            yield step, self._prune((new,)) if gone else (new,), settles
        size = self.trees.size[root]
        if size < self.slots:
            for step, nxt in self._tree_steps((root,), size):
                yield step, nxt, False

    def _tree_steps(self, forest: Forest, count: int) -> Iterator[tuple[TraceStep, Forest]]:
        """Yield the tree operations from ``forest`` (of ``count`` nodes): splits, inserts, births.

        With the checker's own tree operations under symmetry reduction, each
        root subtree's are tabled (:meth:`_grown`): an operation at a node
        changes only its root subtree, one under the root adds a leaf there.
        """
        if self.local_ops:
            yield from self._tree_steps_tabled(forest)
            return
        flat = self.trees.decode(forest, self.slots)
        where = self.trees.where(forest)
        present = range(count)
        steps: list[tuple[str, int, tuple[str, ...]]] = [
            *(("split", i, ()) for i in present),
            *(("insert", p, ()) for p in (-1, *present)),
            *(("born", p, (b,)) for b in self.layout.births for p in (-1, *present)),
        ]
        for kind, node, rest in steps:
            step: TraceStep = (kind, node, *rest)
            at = where[node] if node >= 0 else -1
            nxt = self.replay.apply(flat, (kind, at, *rest))
            if nxt is not None:
                yield step, self.trees.encode(nxt)

    def _tree_steps_tabled(self, forest: Forest) -> Iterator[tuple[TraceStep, Forest]]:
        """:meth:`_tree_steps` from the tables of each root subtree, in the same order."""
        trees = self.trees
        grown = [self._grown(root) for root in forest]
        for kind, rest in self.kinds:
            if kind != "split":
                leaf = self._leaf(kind, rest)
                if leaf is not None:
                    yield (kind, -1, *rest), trees.order([*forest, leaf])
            at = 0
            for root, ops in zip(forest, grown, strict=True):
                for i, new in ops.get((kind, *rest), ()):
                    nxt = (new,) if len(forest) == 1 else trees.swap_root(forest, root, new)
                    yield (kind, at + i, *rest), nxt
                at += trees.size[root]

    def _grown(self, root: int) -> dict[tuple[str, ...], list[tuple[int, int]]]:
        """Return the tree operations at the nodes of root subtree ``root``: per kind, node and result (tabled)."""
        found = self.grown.get(root)
        if found is None:
            size = self.trees.size[root]
            flat = self.trees.decode((root,), size + 1)
            found = {}
            for kind, rest in self.kinds:
                for i in range(size):
                    nxt = self.replay.apply(flat, (kind, i, *rest))
                    if nxt is not None:
                        (new,) = self.trees.encode(nxt)
                        found.setdefault((kind, *rest), []).append((i, new))
            self.grown[root] = found
        return found

    def _leaf(self, kind: str, rest: tuple[str, ...]) -> int | None:
        """Return the subtree an insert or a birth under the root adds (tabled; None: refused)."""
        key = (kind, *rest)
        if key not in self.leaves:
            nxt = self.replay.apply((None,), (kind, -1, *rest))
            self.leaves[key] = None if nxt is None else self.trees.encode(nxt)[0]
        return self.leaves[key]

    def _root(self, root: int) -> Root:
        """Return the tabled steps of root subtree ``root`` (see :meth:`_root_steps`)."""
        found = self.roots.get(root)
        if found is None:
            found = self.roots[root] = self._root_steps(root)
        return found

    def _root_steps(self, root: int) -> Root:
        """Return the events enabled in root subtree ``root``, numbered in its preorder.

        With them, whether a node in it answers wrongly: accepts a give-back
        its clients hold none of, refuses one they hold, or is looked up
        otherwise than callers rely on (:meth:`_path_ok`).
        """
        trees = self.trees
        lift = trees.lift
        order = trees.preorder((root,))
        chains: list[tuple[int, ...]] = []
        paths: list[tuple[int, ...]] = []
        out: list[Successor] = []
        wrong = past = False
        for k, (sid, parent) in enumerate(order):
            up = trees.stid[trees.local[order[parent][0]]] if parent >= 0 else -1
            chain = (self.answers.context(sid, up), *(chains[parent] if parent >= 0 else ()))
            chains.append(chain)
            paths.append((*(paths[parent] if parent >= 0 else ()), trees.local[sid]))
            found = self.moves.get(chain)
            if found is None:
                gives = self.answers.takes_unheld(chain) or self.answers.refuses_owed(chain)
                moves = self._moves(chain)  # asks every answer a cut would be read from
                found = self.moves[chain] = (moves, gives, self.answers.cut(chain))
            wrong = wrong or found[1] or not self._path_ok(paths[k])
            past = past or found[2]
            for event, lids, gone, settles in found[0]:
                out.append((self._step(k, event), lift(order, k, lids), gone, settles))
        if past:
            self.past.add(root)
        return out, wrong

    def _moves(self, chain: tuple[int, ...]) -> list[Move]:
        """Return the enabled events at the node of context ``chain`` (then its ancestors')."""
        return [
            (event, lids, any(self._dataless(i) for i in lids), self._settles(event))
            for event, lids in self.answers.moves(chain)
        ]

    def _settles(self, event: str) -> int:
        """Return whether ``event`` settles: :data:`SETTLES`, :data:`COMPLETES` or 0."""
        if event not in self.settling:
            return 0
        return COMPLETES if event in self.completes else SETTLES

    def _step(self, node: int, event: str) -> TraceStep:
        """Return the step firing ``event`` at ``node``, one shared tuple per pair (states keep millions)."""
        found = self.event_steps.get((node, event))
        if found is None:
            found = self.event_steps[(node, event)] = ("event", node, event)
        return found

    def _dataless(self, lid: int) -> bool:
        found = self.dataless.get(lid)
        if found is None:
            found = self.dataless[lid] = treeops.dataless(self.layout, (0, *self.trees.locals[lid]))
        return found

    def _prune(self, forest: Forest) -> Forest:
        """Delete the nodes that hold their data nowhere, as the ops module does."""
        if self.ops.prune is treeops.prune:
            return treeops.prune_forest(self.layout, self.trees, forest, self.pruned)
        flat = self.ops.prune(self.layout, self.trees.decode(forest, self.slots))
        return self.trees.encode(flat)

    def passes(self, forest: Forest) -> bool:
        """Whether every invariant holds in ``forest``: in its nodes, its give-backs and its lookups."""
        sound = self.sound
        for sid in forest:
            found = sound.get(sid)
            if found is None:
                found = sound[sid] = self._sub_holds(sid, -1) and not self._root(sid)[1]
            if not found:
                return False
        return True

    def _path_ok(self, path: tuple[int, ...]) -> bool:
        """Whether the lookup of the path of locals ``path`` answers as callers rely on (tabled)."""
        found = self.looked.get(path)
        if found is None and not self.looks:
            found = self.looked[path] = True
        if found is None:
            entries = [(-1, *self.trees.locals[lid]) for lid in path]
            ids = range(len(path))
            answer = self.match(self.layout, entries)
            found = self.looked[path] = lookup.violation(self.layout, entries, ids, answer) is None
        return found

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
        """Check a node of local ``lid`` under local ``up`` over ``kids`` on its neighbourhood.

        The checks that read the node alone (:data:`~fsm_cache.modelcheck.invariants.NODE_ONLY`)
        run once per local, the others once per neighbourhood.
        """
        alone = self.alone.get(lid)
        if alone is None:
            entry = (-1, *self.trees.locals[lid])
            alone = self.alone[lid] = (
                violation_at(self.layout, (entry,), 0, self.policy, only=NODE_ONLY.__contains__)
                is None
            )
        if not alone:
            return False
        locals_ = self.trees.locals
        entries: list[NodeEntry | None] = [(-1, *locals_[up])] if up >= 0 else []
        me = len(entries)
        entries.append((me - 1, *locals_[lid]))
        entries += [(me, *locals_[c]) for c in kids]
        return violation_at(self.layout, tuple(entries), me, self.policy, only=_around) is None

    def _trace(
        self, parents: Sequence[int], steps: list[TraceStep], starts: dict[int, Nodes], last: int
    ) -> tuple[list[str], Nodes]:
        """Replay the steps reaching state ``last`` on its starting tree: labels and the end."""
        path: list[TraceStep] = []
        at = last
        while True:
            path.append(steps[at])
            if parents[at] < 0:
                break
            at = parents[at]
        return self.replay.trace(path[::-1], starts[at])

    def _found(
        self,
        parents: Sequence[int],
        steps: list[TraceStep],
        starts: dict[int, Nodes],
        last: int,
        forests: list[Forest],
    ) -> Result:
        """Return the violation at state ``last``, described in the replayed tree's node numbers."""
        lines, nodes = self._trace(parents, steps, starts, last)
        found = (
            self.finding(nodes)
            or "checker: the tabled answers found a violation that the replayed state does not show"
        )
        return Result(len(forests), found, lines)

    def finding(self, nodes: Nodes) -> str | None:
        """Return the first violation the flat state ``nodes`` shows, or None.

        Read on the state itself, with the engine asked anew
        (:class:`~fsm_cache.modelcheck.traces.Replay`), never from the
        explorer's tables: how a violation found on the interned states is
        described once its trace is replayed, and how a replayed trace is
        shown to end where it was found.
        """
        replay = self.replay
        return (
            violation(self.layout, nodes, self.policy)
            or unheld_give_back(
                self.layout, nodes, lambda i, event: replay.accepts(nodes, i, event)
            )
            or refused_give_back(
                self.layout, nodes, lambda i, event: replay.refusal(nodes, i, event)
            )
            or lookup.first_violation(self.layout, nodes, self.match)
        )

    def stuck(self, nodes: Nodes, *, failed: bool = False) -> str:
        """Describe the flat state ``nodes``, which cannot settle (:func:`~fsm_cache.modelcheck.liveness.stuck`).

        ``failed``: it cannot settle where the copies whose failure is final
        fail (it can where they complete).
        """
        replay = self.replay
        return liveness.stuck(
            self.layout,
            nodes,
            lambda at, i, event: replay.apply(at, ("event", i, event)),
            replay.refusal,
            without=self.completes if failed else frozenset(),
        )

    def _live(
        self,
        forests: list[Forest],
        edges: tuple[array[int], array[int]],
        parents: Sequence[int],
        steps: list[TraceStep],
        starts: dict[int, Nodes],
    ) -> Result:
        """Return the first state that cannot settle, with its trace, or a clean result.

        Where some copy's failure is final (a copy to or from the store), a
        state that settles must also settle where those copies fail: a second
        pass leaves out the steps that complete them
        (:func:`~fsm_cache.modelcheck.liveness.passes`).

        Args:
            forests: The explored states, in breadth-first order.
            edges: The settling steps: per state the offset of its first one,
                and where each leads.
            parents: Each state's predecessor (-1: a start).
            steps: The step from its predecessor.
            starts: The starting trees, by state.
        """
        weight = self._weight
        unsettled = array("l", (sum(weight(sid) for sid in f) for f in forests))
        every, failing = liveness.passes(*edges) if self.completes else (edges, None)
        first, past = self._unsettled(forests, unsettled, every)
        if first >= 0:
            lines, nodes = self._trace(parents, steps, starts, first)
            return Result(len(forests), self.stuck(nodes), lines, past_ceiling=past)
        if failing is not None:  # every state settles; does it where final copies fail?
            first, _ = self._unsettled(forests, unsettled, failing)
            if first >= 0:
                lines, nodes = self._trace(parents, steps, starts, first)
                found = self.stuck(nodes, failed=True)
                return Result(len(forests), found, lines, past_ceiling=past)
        return Result(len(forests), past_ceiling=past)

    def _unsettled(
        self, forests: list[Forest], unsettled: array[int], edges: tuple[array[int], array[int]]
    ) -> tuple[int, int]:
        """Return the first state that cannot settle by ``edges`` (-1: none), and how many past the ceilings.

        A state that settles only past a ceiling (a settling step there is cut)
        is taken to settle: its weight in ``unsettled`` is set to 0.
        """
        good = liveness.settles(unsettled, *edges)
        first = good.find(0)
        if first < 0 or not self.past:
            return first, 0
        for i, forest in enumerate(forests):
            if not good[i] and any(sid in self.past for sid in forest):
                unsettled[i] = 0
        hoped = liveness.settles(unsettled, *edges)
        return hoped.find(0), sum(hoped) - sum(good)

    def _weight(self, sid: int) -> int:
        """Return the copies in flight and holds of subtree ``sid`` (tabled; 0: settled)."""
        found = self.weights.get(sid)
        if found is None:
            trees = self.trees
            here = self.layout.unsettled((-1, *trees.locals[trees.local[sid]]))
            found = self.weights[sid] = here + sum(self._weight(k) for k in trees.kids[sid])
        return found


def _around(check: Check) -> bool:
    """Whether ``check`` reads the node's parent or children (it is not one of ``NODE_ONLY``)."""
    return check not in NODE_ONLY
