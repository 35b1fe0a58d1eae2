"""``fsm-cache check --compositional``: the checker's properties for every tree size at once.

The enumerative search (:mod:`fsm_cache.modelcheck.explore`) explores every
state of one tree size; 4 nodes of ``residency.toml`` are about 2 million
states, 5 about 76 million. This module instead computes a set of
*neighbourhood views*, one per node of a tree of any size, closed under
every step (Namjoshi and Trefler's split invariants). A view of a node is::

    (ps, lid, ka, kany, ksum, kbusy)

``ps`` its parent's region states (-1: a root); ``lid`` its own local (states,
counters, ghost holds and pages); ``ka`` which ``any child`` conditions of the
spec some child meets, plus whether some child holds data and whether some
child holds a copy of its own, not forgettable (pruning reads both);
``kany`` whether it has children; ``ksum`` the sum of its children's
propagating counters (invariant 6 reads it); ``kbusy`` whether some child is
unsettled (the liveness rule reads it). A child view *fits* a parent view
when its ``ps`` is the parent's states, its atoms are among the parent's
``ka``, its count is at most the parent's ``ksum``, and busy implies ``kbusy``.

**Soundness.** By induction on steps, every view of every node of every
reachable tree, of any size, is in the fixpoint: a step changes the region
states of the node it fires at only; propagation changes the ancestors'
counters alone (side condition 2: every transition of a propagating event
is a self-loop with no effect and no acknowledgement, whichever one an
ancestor takes), which only the node and its parent read (via ``ksum``); so
each view a step changes is computed here from two fitting views of the
same real tree, both in the fixpoint already. Every check is a predicate on
one view or one fitting pair, so a tree that breaks one has a view or pair
here that does. A prune deletes a node that lost its data with every node
below it when all of them are forgettable (they hold pages in the store
alone, :func:`~fsm_cache.modelcheck.treeops.prune`): the view reads that
off its children's atoms, as every view is checked to have no child holding
a copy of its own where its node is forgettable (else a finding), so the
children's children are forgettable too, and so on down. A birth is a new
leaf under any node, or a new root. Where a child's step changes its
parent's view, the parent's other children meet some union of atoms inside
the parent's ``ka`` that some children's region states give (states that
pass the checks reading states alone); where they are all settled, states
with no copy in flight (a state claiming pages a copy fills has it in
flight, by ``memory_claims``). The lookups (:mod:`fsm_cache.modelcheck.lookup`) read a
whole path, and follow from a node check: ``memory_claims`` makes each
node's pages exactly what its states claim, so a path of nodes that each
pass holds the pages the checker's own ``match_prefix`` finds (the reason
``--ops``, whose lookups may differ, is refused). The views over-approximate: a finding here may be spurious,
so :func:`fsm_cache.modelcheck.check.handle` looks for a trace on 2 and 3 nodes
and reports "not proven" without one.

**Liveness** is a sufficient rule: every view of an unsettled node whose
children are all settled has a settling event enabled that lowers its
unsettled measure (a propagating one is a give-back of the propagated count,
accepted by every fitting parent, and above it by :meth:`Views.pairs`).
A copy to or from the store may fail for good, so its success acknowledgement
does not count as that step (the enumerative check's second pass leaves it
out; a tree that settles without it settles with it too). Settling a
deepest unsettled node first then always has a step, and the sum
of the measures strictly drops (a prune only deletes nodes): a propagated step leaves an ancestor's
measure as it was (it gains no hold, as only the node fired at does, and by
side condition 2 it starts, ends and frees no copy there).

The argument holds only for the specs of :func:`refusal`'s side conditions,
which are checked from the spec's data before anything runs.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm_cache.errors import NotCompositional
from fsm_cache.modelcheck import treeops
from fsm_cache.modelcheck.copies import FILLING, REMOTE
from fsm_cache.modelcheck.copies import kind as page_kind
from fsm_cache.modelcheck.explore import Explorer
from fsm_cache.modelcheck.invariants import (
    NODE_ONLY,
    Check,
    copies_safe,
    storage_copies_safe,
    violation_at,
)
from fsm_cache.modelcheck.state import RESIDENCY_REGIONS, Layout, NodeEntry
from fsm_cache.residency import DEVICE_HELD


View = tuple[int, int, int, int, int, int]
"""``(ps, lid, ka, kany, ksum, kbusy)``: one node's neighbourhood, as the module docstring says."""

Info = tuple[int, int, int, bool, int]
"""A local's region-states id, propagated count, unsettled measure, whether dataless, child atoms."""

Key = tuple[int, int, int, int]
"""What fitting reads of a view: a parent's :meth:`Views.parent_key`, a child's :meth:`Views.child_key`."""

Item = tuple[str, Any, int]
"""What a step at or through a node shows a fitting neighbour (:meth:`Views.register`).

From a parent: ``(MOVE, states, 0)``, its new region states; ``(ACCEPT,
event, 0)``, a propagating event (by index) it accepts from below. From a
child: ``(STEP, outcome, 0)``, one of its own steps: its atoms and count
before, the propagating event (or ``""``), its atoms and count change
after, whether it is unsettled and stays, whether it is pruned;
``(THROUGH, event, change)``, a propagating event from below that reaches
its parent, with the count change."""

Merge = tuple[int, int, int, bool, int, bool]
"""What a parent's views after a child's step read (:meth:`Views._merged`).

``(ka, old_atoms, kbusy, busy, atoms, gone)``: the parent's child atoms and
whether a child is unsettled; the child's atoms before and after (0 where
pruned), whether it is unsettled after, whether it was pruned."""

MOVE, ACCEPT, STEP, THROUGH = "move", "accept", "step", "through"
"""The kinds of :data:`Item`."""

ENUMERATIVE = "use the enumerative check (fsm-cache check without --compositional)"
"""How every refusal of :func:`refusal` ends: the check that covers the spec."""

INSERT = "insert"
"""A node's own step adding a fresh leaf below it (:func:`~fsm_cache.modelcheck.treeops.insert`)."""

BORN = "born"
"""A node's own step adding a leaf born below it (:func:`~fsm_cache.modelcheck.treeops.born`)."""

STORAGE = "storage"
"""The region of the storage tier, the one region besides a residency record's (side condition 4)."""

PROPAGATES = "ancestors"
"""The only ``propagate`` value a transition may take (:class:`~fsm_cache.spec.machine.Transition`)."""


STATES_ONLY: frozenset[Check] = frozenset({copies_safe, storage_copies_safe})
"""The node checks that read its region states alone: a child's states, whatever its counts, keep them."""


def _refused(where: str, condition: str, why: str) -> str:
    return f"check --compositional: {where}: side condition {condition}: {why}; {ENUMERATIVE}"


def refusal(path: str | Path, layout: Layout) -> list[str]:
    """Return why the spec at ``path`` is outside the class the compositional check is sound for.

    Each line names the side condition it fails; an empty list: the spec is
    in the class. The conditions are read from the spec's data alone:

    1. the only tree conditions are ``parent R in [...]`` and ``any child R in
       [...]`` forbids (a transition never reads the tree);
    2. every propagating transition (``propagate = "ancestors"``) is a
       self-loop on its region's states that moves one counter by 1; every
       transition of its event, in any region, is a self-loop without an
       effect, and the event acknowledges no copy (an ancestor takes
       whichever transition of the event its own states take, so the
       propagation changes its counters alone: not its states, which its
       children and parent read, nor its pages or holds, which its unsettled
       measure counts);
    3. those counters are exactly the propagating holder counts invariant 6 sums;
    4. the nodes are residency records: a ``host`` and a ``device`` region,
       ``pins`` and ``locks``, and a ``storage`` region or no other (its
       memory tier is what tells a forgettable node, which a prune deletes
       with the dataless node above it).

    Births (a leaf under any node, or a root) are covered.

    No ``--policy`` and no ``--ops`` are the command line's conditions
    (:func:`option_refusal`). The split is not a condition: the prefix's
    view is built from the split's own result.
    """
    where = str(path)
    out = []
    scopes = {c.scope for f in _forbids(layout) for c in f.when} - {"self", "parent", "child"}
    if scopes:
        out.append(
            _refused(where, "1 (tree conditions)", f"a forbid reads the tree as {sorted(scopes)}")
        )
    problems, moved = _propagation(where, layout)
    out += problems
    holders = layout.holders
    if moved != set(holders.propagating) or not holders.propagating <= set(holders.counts):
        out.append(
            _refused(
                where,
                "3 (propagated counts)",
                f"propagating transitions move {sorted(moved)}, invariant 6 sums "
                f"{sorted(holders.propagating & set(holders.counts))} over children",
            )
        )
    elif len(moved) > 1:  # a view sums its children's propagated counts as one
        out.append(
            _refused(
                where,
                "3 (propagated counts)",
                f"propagating transitions move {' and '.join(sorted(moved))}: a view "
                "carries one sum of its children's counts, so one counter may propagate",
            )
        )
    if not layout.residency or not set(layout.regions) <= {*RESIDENCY_REGIONS, STORAGE}:
        out.append(
            _refused(
                where,
                "4 (residency regions)",
                f"its regions are {', '.join(layout.regions)}, not {' and '.join(RESIDENCY_REGIONS)} "
                f"with pins and locks, and no other but {STORAGE}",
            )
        )
    return out


def _propagation(where: str, layout: Layout) -> tuple[list[str], set[str]]:
    """Return side condition 2's refusals, and the counters the propagating transitions move."""
    system = layout.system
    out: list[str] = []
    moved: set[str] = set()
    spread = {t.event for _, m in system.regions for t in m.transitions if t.propagate is not None}
    for region, machine in system.regions:
        for t in machine.transitions:
            if t.event not in spread:
                continue
            named = f"{region} transition {t.event} from {', '.join(t.sources)} to {t.dest}"
            if t.propagate is None:
                # an ancestor applies whichever transition of the event its own states take
                if set(t.sources) != {t.dest}:
                    out.append(
                        _refused(
                            where,
                            "2 (propagation)",
                            f"{named} changes the states of the ancestors {t.event} "
                            "propagates to (they take it too), not as a self-loop",
                        )
                    )
            else:
                steps = [a.delta() for a in t.update.assigns]
                if (
                    t.propagate != PROPAGATES
                    or set(t.sources) != {t.dest}
                    or steps not in ([1], [-1])
                ):
                    out.append(
                        _refused(
                            where,
                            "2 (propagation)",
                            f"{named} propagates ({t.update or 'no update'}), not as a self-loop "
                            "moving one counter by 1",
                        )
                    )
                moved |= t.update.counters()
            if t.effect is not None:
                out.append(
                    _refused(
                        where,
                        "2 (propagation)",
                        f"{named} runs {t.effect} at the ancestors {t.event} propagates to "
                        "(they take it too)",
                    )
                )
    out += _propagating_events(where, layout, spread)
    return out, moved


def _propagating_events(where: str, layout: Layout, spread: set[str]) -> list[str]:
    """Return side condition 2's refusals of whole propagating events (``spread``).

    One propagating in two regions could cancel at the node it fires at and
    still move the ancestors' counts; one acknowledging a copy would end it
    at the ancestors too.
    """
    out: list[str] = []
    regions: dict[str, set[str]] = {}
    for region, machine in layout.system.regions:
        for t in machine.transitions:
            if t.propagate is not None:
                regions.setdefault(t.event, set()).add(region)
    for event, named_in in sorted(regions.items()):
        if len(named_in) > 1:  # its steps could cancel at the node and still move the ancestors
            out.append(
                _refused(
                    where,
                    "2 (propagation)",
                    f"{event} propagates in {' and '.join(sorted(named_in))}, not in one region",
                )
            )
    for event in sorted(spread & set(layout.memory.acks)):
        out.append(
            _refused(
                where,
                "2 (propagation)",
                f"{event} propagates and acknowledges a copy (at the ancestors too)",
            )
        )
    return out


def option_refusal(options: dict[str, object]) -> list[str]:
    """Return why command-line options put a run outside the compositional check's class.

    Args:
        options: The value of each of ``--policy`` and ``--ops`` (None: not given).
    """
    out = []
    if options.get("--policy") not in (None, "none"):
        out.append(
            _refused(
                f"--policy {options['--policy']}",
                "5 (no write policy)",
                "a policy's acknowledgements change several nodes' states at once",
            )
        )
    if options.get("--ops") is not None:
        out.append(
            _refused(
                f"--ops {options['--ops']}",
                "6 (the checker's own tree operations)",
                "an ops module's hooks may read or change any node",
            )
        )
    return out


def _forbids(layout: Layout) -> list[Any]:
    system = layout.system
    return [*system.forbids, *(f for _, m in system.regions for f in m.forbids)]


def _unions(masks: list[int]) -> set[int]:
    """Return every union of some of ``masks`` (the empty one included)."""
    out, todo = {0}, [0]
    for mask in todo:
        for more in (mask | m for m in masks):
            if more not in out:
                out.add(more)
                todo.append(more)
    return out


def _submasks(mask: int) -> list[int]:
    out, x = [], mask
    while True:
        out.append(x)
        if x == 0:
            return out
        x = (x - 1) & mask


@dataclass
class Proof:
    """What :meth:`Views.run` found.

    Attributes:
        views: How many views the fixpoint holds (when it stopped, on a finding).
        finding: The first property a view or fitting pair breaks; None: none.
        view: That view, shown; empty when none.
        seconds: CPU seconds of the fixpoint.
    """

    views: int
    finding: str | None
    view: str
    seconds: float


class Views:
    """The neighbourhood-view fixpoint of one spec, on the explorer's own answer tables.

    Args:
        explorer: An explorer of a spec :func:`refusal` takes, with no policy
            and the checker's own tree operations; its answers (the engine per
            node context), trees (interned locals) and settling events are used.

    Raises:
        NotCompositional: The spec is outside the class (:func:`refusal`).
    """

    def __init__(self, explorer: Explorer) -> None:
        layout = explorer.layout
        problems = refusal(Path(layout.system.name), layout)
        if problems:
            raise NotCompositional(problems)
        self.layout = layout
        self.answers = explorer.answers
        self.trees = explorer.trees
        self.settling = explorer.settling
        self.completes = explorer.completes
        self.remote = bool(REMOTE & set(layout.memory.tiers))
        regions = layout.regions
        self.conds = sorted(
            {
                (regions.index(c.region), frozenset(c.states))
                for f in _forbids(layout)
                for c in f.when
                if c.scope == "child"
            },
            key=repr,
        )
        self.data = 1 << len(self.conds)
        self.local = self.data << 1
        self.prop = set(layout.holders.propagating)
        self.events = sorted(
            {t.event for _, m in layout.system.regions for t in m.transitions if t.propagate}
        )
        self.gives = [
            e for e, keys in layout.holders.releases.items() if any(k[0] in self.prop for k in keys)
        ]
        self.seen: set[View] = set()
        self.work: list[View] = []
        self._own: dict[int, list[tuple[str, int | None, bool]]] = {}
        self._rested: dict[tuple[int, int], list[int]] = {}
        # the checks of a view that read its node's local alone, or its engine context alone
        self._checked: dict[tuple[str, int], str | None] = {}
        self._merges: dict[Merge, list[tuple[int, int, int]]] = {}
        # the pairing of popped views by key (register): each key's views, the keys that
        # fit it, and the items its views show the other side and those reaching it, in
        # the order they came (dicts, not sets: a set's order follows the hash seed, and
        # so did the views explored before a finding and which one was shown)
        self.parent_groups: dict[Key, list[View]] = {}
        self.child_groups: dict[Key, list[View]] = {}
        self.pkeys: dict[int, list[Key]] = defaultdict(list)
        self.ckeys: dict[int, list[Key]] = defaultdict(list)
        self.kids_of: dict[Key, list[Key]] = {}
        self.parents_of: dict[Key, list[Key]] = {}
        self.to_kids: dict[Key, dict[Item, None]] = {}
        self.from_kids: dict[Key, dict[Item, None]] = {}
        self.to_parents: dict[Key, dict[Item, None]] = {}
        self.from_parents: dict[Key, dict[Item, None]] = {}
        self.finding: tuple[str, View] | None = None
        self._info: dict[int, Info] = {}
        self._ctx: dict[tuple[int, int, int, int], int] = {}
        fresh = layout.fresh(-1)
        self.fresh = self.trees.lid(fresh[1:])
        self.leaves = [self.fresh] + [self.trees.lid(layout.born(-1, b)[1:]) for b in layout.births]
        """The locals a new leaf takes: fresh (an insert), then each birth's."""
        kinds = self._kinds(fresh[1 + len(regions) :])
        # a representative set of children for each union of child atoms (engine contexts)
        self.rep: dict[int, tuple[int, ...]] = {0: ()}
        groups: list[tuple[int, list[int]]] = [(0, [])]
        for mask, group in groups:
            for lid in kinds:
                more = mask | self.info(lid)[4]
                if more not in self.rep:
                    kids = [*group, lid]
                    self.rep[more] = self.trees.order([self.trees.sid(k, ()) for k in kids])
                    groups.append((more, kids))
        self.calm = _unions([self.info(lid)[4] for lid in kinds if not self._filling(lid)])
        """The unions of atoms that settled children may meet."""

    def _kinds(self, rest: NodeEntry) -> list[int]:
        """Return a local (with ``rest`` after its states) per combination of states a child may be in.

        Those that keep the checks reading states alone (every view is checked).
        """
        layout = self.layout
        combos = itertools.product(*(m.state_names for _, m in layout.system.regions))
        return [
            lid
            for lid in (self.trees.lid((*st, *rest)) for st in combos)
            if violation_at(layout, (self.entry(lid),), 0, None, only=STATES_ONLY.__contains__)
            is None
        ]

    def _filling(self, lid: int) -> bool:
        """Whether a local's states claim pages a copy fills: the copy is in flight (``memory_claims``)."""
        memory, e = self.layout.memory, self.entry(lid)
        return any(
            page_kind(memory.claims(t, self.layout.state(e, t))) == FILLING for t in memory.tiers
        )

    def entry(self, lid: int) -> NodeEntry:
        """Return the node entry of a local, as a root."""
        return (-1, *self.trees.locals[lid])

    def info(self, lid: int) -> Info:
        """Return what the views read of a local (:data:`Info`)."""
        found = self._info.get(lid)
        if found is None:
            layout, e = self.layout, self.entry(lid)
            stid = self.trees.stid[lid]
            named = dict(zip(layout.regions, self.trees.states[stid], strict=True))
            atoms = sum(
                1 << i for i, (r, ss) in enumerate(self.conds) if self.trees.states[stid][r] in ss
            )
            memory = layout.memory
            claimed = tuple(memory.claims(t, str(named[t])) for t in memory.tiers)
            if memory.holds(claimed):
                atoms |= self.data
            if memory.local(claimed):  # not forgettable (treeops.forgettable, by its claims)
                atoms |= self.local
            found = self._info[lid] = (
                stid,
                sum(layout.counter(e, c) for c in self.prop),
                layout.unsettled(e),
                treeops.dataless(layout, e),
                atoms,
            )
        return found

    def context(self, v: View) -> int:
        """Return the engine context of a view's node: its local, parent states, representative kids."""
        key = (v[1], v[0], v[2], v[3])
        found = self._ctx.get(key)
        if found is None:
            kids = self.rep[v[2]] if (v[3] or v[2]) else ()
            found = self._ctx[key] = self.answers.context(self.trees.sid(v[1], kids), v[0])
        return found

    def add(self, v: View) -> None:
        """Add a view (checked) to the fixpoint and the work list, unless it is there already."""
        if v in self.seen or self.finding:
            return
        self.seen.add(v)
        self.work.append(v)
        bad = self.check(v)
        if bad:
            self.finding = (bad, v)

    def check(self, v: View) -> str | None:
        """Return the first property one view breaks, or None."""
        ps, lid, _, kany, ksum, _ = v
        layout, e = self.layout, self.entry(lid)
        if ("node", lid) not in self._checked:  # they read the node's local alone
            self._checked["node", lid] = violation_at(
                layout, (e,), 0, None, only=NODE_ONLY.__contains__
            )
        found = self._checked["node", lid]
        if found:
            return found
        if ps >= 0 and layout.state(e, "device") in DEVICE_HELD:
            up = dict(zip(layout.regions, self.trees.states[ps], strict=True))
            if up["device"] not in DEVICE_HELD:
                return "invariant 1: a node is on the device but its parent is not"
        for name in layout.holders.counts:
            want = layout.held(e, name) + (ksum if name in self.prop else 0)
            if layout.counter(e, name) != want:
                return (
                    f"invariant 6: {name} is {layout.counter(e, name)} but its holders "
                    f"account for {want}"
                )
        if self.info(lid)[3] and kany:
            return (
                "invariant 2: a node holds its data nowhere but cannot be deleted (it has children)"
            )
        if v[2] & self.local and not self.info(lid)[4] & self.local:
            return (
                "compositional: a node holding its data in storage alone has a child holding "
                "a copy of its own (the views read a pruned subtree off the children alone)"
            )
        return self.give_backs(v)

    def give_backs(self, v: View) -> str | None:
        """Return how the node's own give-backs break invariant 6 (ancestors accepting), or None."""
        c = self.context(v)
        if ("give-back", c) in self._checked:  # they read the node's engine context alone
            return self._checked["give-back", c]
        found = None
        if self.answers.takes_unheld((c,)):
            found = "invariant 6: a give-back no client holds is accepted"
        elif self.answers.refuses_owed((c,)):
            found = "invariant 6: a give-back its holder holds is refused"
        self._checked["give-back", c] = found
        return found

    def fits(self, pv: View, cv: View) -> bool:
        """Whether the child view ``cv`` may sit under the parent view ``pv`` in one tree."""
        return bool(pv[3]) and self.keys_fit(self.parent_key(pv), self.child_key(cv))

    def parents(self, v: View) -> list[View]:
        """Return the views that fit above ``v``, of those paired so far (all, once run).

        Read from the views grouped by key (:meth:`register`).
        """
        if v[0] < 0:
            return []
        ck = self.child_key(v)
        keys = self.parents_of.get(ck)
        if keys is None:
            keys = [pk for pk in self.pkeys[ck[0]] if self.keys_fit(pk, ck)]
        return [p for pk in keys for p in self.parent_groups[pk]]

    def own(self, v: View) -> list[tuple[str, int | None, bool]]:
        """Return the node's own steps, each with whether it propagates to the ancestors.

        Each accepted event, a split and an insert below the node; they
        depend on the node's engine context alone, so they are tabled by it.
        """
        ctx = self.context(v)
        found = self._own.get(ctx)
        if found is not None:
            return found
        out: list[tuple[str, int | None, bool]] = list(self.answers.enabled(self.context(v)))
        layout, e = self.layout, self.entry(v[1])
        prefix = (
            *treeops.prefix_fields(layout, e),
            *treeops.prefix_holds(layout, e),
            *layout.pages(e),
        )
        out.append(("split", self.trees.lid(prefix), False))
        if layout.state(e, "device") == "resident":  # a request computed it below (treeops.insert)
            out.append((INSERT, self.leaves[0], False))
        out += [(BORN, lid, False) for lid in self.leaves[1:]]  # under any node (treeops.born)
        self._own[ctx] = out
        return out

    def step_node(self, v: View) -> None:
        """Add the views a node's own steps give it (and a split's prefix, a new leaf's)."""
        ps, lid, ka, kany, ksum, kbusy = v
        for kind, new, _ in self.own(v):
            assert new is not None
            ni, si = self.info(new), self.info(lid)
            if kind in (INSERT, BORN):  # its count and copies are the spec's initial ones
                self.add((ps, lid, ka | ni[4], 1, ksum + ni[1], int(kbusy or ni[2] > 0)))
                self.add((si[0], new, 0, 0, 0, 0))
                continue
            if kind == "split":
                self.add((ni[0], lid, ka, kany, ksum, kbusy))
                self.add((ps, new, si[4], 1, si[1], int(si[2] > 0)))
            elif not self._prunes(v, kind, new):
                self.add((ps, new, ka, kany, ksum, kbusy))

    def _prunes(self, v: View, kind: str, new: int) -> bool:
        """Whether ``kind`` takes ``v``'s node to ``new``, a local with no data, and it is pruned.

        It is, with the nodes below it, when every node below it is
        forgettable (:func:`~fsm_cache.modelcheck.treeops.prune`): no child
        meets the atom of a node that is not, and by :meth:`check` no
        forgettable node has one that is not, so neither has any node below.
        """
        return kind != "split" and self.info(new)[3] and not v[2] & self.local

    def parent_key(self, pv: View) -> Key:
        """Return what a child's fit reads of a parent view with children: states, atoms, sum, busy."""
        return (self.info(pv[1])[0], pv[2], pv[4], pv[5])

    def child_key(self, cv: View) -> Key:
        """Return what a parent's fit reads of a child view: parent states, atoms, count, busy."""
        _, locks, busy, _, atoms = self.info(cv[1])
        return (cv[0], atoms, locks, int(busy > 0))

    @staticmethod
    def keys_fit(pk: Key, ck: Key) -> bool:
        """Whether children of key ``ck`` fit under parents of key ``pk`` (:meth:`fits`)."""
        return bool(
            ck[0] == pk[0] and ck[1] & ~pk[1] == 0 and ck[2] <= pk[2] and (pk[3] or not ck[3])
        )

    def register(self, v: View) -> None:
        """Pair a popped view with every fitting view, as a parent and as a child.

        A pair's step changes the parent's view in a way that depends on the
        parent and on an *item* of the child (one of its steps' outcomes, or
        a propagation it lets through from below), and the child's view in a
        way that depends on the child and an item of the parent (states a
        step leaves it in, or a propagation it accepts); whether they fit
        depends on their keys alone (:meth:`keys_fit`). So the items of each
        key's views are pooled, pooled items flow along the fitting keys, and
        each view takes every item that reaches its key: the views of every
        fitting pair's step, without visiting every pair.
        """
        if v[3]:
            self._register_parent(v)
        if v[0] >= 0:
            self._register_child(v)

    def _register_parent(self, v: View) -> None:
        """:meth:`register` ``v`` as a parent: take its key's items, hand on its own."""
        pk = self.parent_key(v)
        group = self.parent_groups.get(pk)
        if group is None:
            group = self.parent_groups[pk] = []
            self.from_kids[pk] = {}
            self.to_kids[pk] = {}
            self.pkeys[pk[0]].append(pk)
            self.kids_of[pk] = [ck for ck in self.ckeys[pk[0]] if self.keys_fit(pk, ck)]
            for ck in self.kids_of[pk]:
                self.parents_of[ck].append(pk)
                self._give_up(pk, self.to_parents[ck])
        group.append(v)
        self._take_from_kids(v, list(self.from_kids[pk]))
        for item in self._parent_items(v):
            if item not in self.to_kids[pk]:
                self.to_kids[pk][item] = None
                for ck in self.kids_of[pk]:
                    self._give_down(ck, (item,))

    def _register_child(self, v: View) -> None:
        """:meth:`register` ``v`` as a child: take its key's items, hand on its own."""
        ck = self.child_key(v)
        group = self.child_groups.get(ck)
        if group is None:
            group = self.child_groups[ck] = []
            self.from_parents[ck] = {}
            self.to_parents[ck] = {}
            self.ckeys[ck[0]].append(ck)
            self.parents_of[ck] = [pk for pk in self.pkeys[ck[0]] if self.keys_fit(pk, ck)]
            for pk in self.parents_of[ck]:
                self.kids_of[pk].append(ck)
                self._give_down(ck, self.to_kids[pk])
        group.append(v)
        for item in list(self.from_parents[ck]):
            self.take_from_parent(v, item)
        for item in self._child_items(v):
            if item not in self.to_parents[ck]:
                self.to_parents[ck][item] = None
                for pk in self.parents_of[ck]:
                    self._give_up(pk, (item,))

    def _give_down(self, ck: Key, items: Any) -> None:
        """Hand a parent's items to the children of key ``ck`` (each new one to each child)."""
        have = self.from_parents[ck]
        for item in list(items):
            if item not in have:
                have[item] = None
                for cv in list(self.child_groups[ck]):
                    self.take_from_parent(cv, item)

    def _give_up(self, pk: Key, items: Any) -> None:
        """Hand a child's items to the parents of key ``pk`` (each new one to each parent)."""
        have = self.from_kids[pk]
        for item in list(items):
            if item not in have:
                have[item] = None
                for pv in list(self.parent_groups[pk]):
                    self.take_from_child(pv, item)

    def _parent_items(self, pv: View) -> list[Item]:
        """Return what a step at or through ``pv``'s node shows its children.

        The region states a step leaves it in (where it is not pruned), and
        the propagating events it accepts from below.
        """
        pc = self.context(pv)
        return [
            *((MOVE, up, 0) for up in self._moved(pv)),
            *(
                (ACCEPT, i, 0)
                for i, event in enumerate(self.events)
                if self.answers.answer(event, pc, False) is not None
            ),
        ]

    def _moved(self, pv: View) -> set[int]:
        """Return the region states a step of ``pv``'s node leaves it in, where it stays."""
        return {
            self.info(new)[0]
            for kind, new, _ in self.own(pv)
            if kind not in (INSERT, BORN) and new is not None and not self._prunes(pv, kind, new)
        }

    def take_from_parent(self, cv: View, item: Item) -> None:
        """Add the views of child ``cv`` after a step of a fitting parent showing ``item``."""
        kind, arg, _ = item
        if kind == MOVE:  # the parent's states changed
            if arg != cv[0]:
                self.add((arg, *cv[1:]))
            return
        through = self._through(cv, self.events[arg])  # the parent accepts it from below cv
        if through is not None:
            new, dl = through
            self.add((cv[0], new, cv[2], 1, cv[4] + dl, cv[5]))

    def _through(self, cv: View, event: str) -> tuple[int, int] | None:
        """Return the local and count change of ``cv``'s node that ``event`` from below gives it.

        None: it does not reach the node's parent (refused, no change, or a
        give-back with nothing below to give it back).
        """
        if not cv[3]:
            return None
        through = self.answers.answer(event, self.context(cv), False)
        if through is None:
            return None
        dl = self.info(through[0])[1] - self.info(cv[1])[1]
        if dl == 0 or (dl < 0 and cv[4] < 1):
            return None
        return through[0], dl

    def _child_items(self, cv: View) -> list[Item]:
        """Return what a step at or through ``cv``'s node shows its parent.

        Per own step (not a new leaf): its outcome (:data:`Item`); per
        propagating event it lets through from below, the event and the
        count change.
        """
        ci = self.info(cv[1])
        out: list[Item] = []
        for kind, new, prop in self.own(cv):
            if kind in (INSERT, BORN) or new is None:
                continue
            ni = self.info(new)
            gone = self._prunes(cv, kind, new)
            busy = bool(ni[2]) and not gone
            out.append(
                (STEP, (ci[4], ci[1], kind if prop else "", ni[4], ni[1] - ci[1], busy, gone), 0)
            )
        for i, event in enumerate(self.events):
            through = self._through(cv, event)
            if through is not None:
                out.append((THROUGH, i, through[1]))
        return out

    def _rests(self, ka: int, old_atoms: int) -> list[int]:
        """Return the atoms the other children of a node of child atoms ``ka`` may meet (tabled).

        Besides a child of ``old_atoms``: those the child does not meet are
        met by another, and any union of children's atoms may be.
        """
        found = self._rested.get((ka, old_atoms))
        if found is None:
            need = ka & ~old_atoms
            found = [r for r in _submasks(ka) if r & need == need and r in self.rep]
            self._rested[(ka, old_atoms)] = found
        return found

    def take_from_child(self, pv: View, item: Item) -> None:
        """Add the views of parent ``pv`` after a step of a fitting child showing ``item``."""
        self._take_from_kids(pv, (item,))

    def _take_from_kids(self, pv: View, items: Iterable[Item]) -> None:
        """:meth:`take_from_child` each of ``items`` in turn (a new parent takes its key's)."""
        ps, lid, ka, _, ksum, kbusy = pv
        seen, merges, answer = self.seen, self._merges, self.answers.answer
        for kind, arg, change in items:
            if kind == THROUGH:  # a propagating step from below the child reaches this node too
                ans = answer(self.events[arg], self.context(pv), False)
                if ans is not None:
                    self.add((ps, ans[0], ka, 1, ksum + change, kbusy))
                continue
            assert isinstance(arg, tuple)
            old_atoms, locks, event, atoms, dl, busy, gone = arg
            key = (ka, old_atoms, kbusy, busy, 0 if gone else atoms, gone)
            merged = merges.get(key)
            if merged is None:
                merged = self._merged(key)
            if not merged:
                continue
            at = lid
            if gone:
                count = ksum - locks
            else:
                count = ksum + dl
                if event:  # a propagating step at the child reaches this node too
                    ans = answer(event, self.context(pv), False)
                    if ans is None:
                        continue
                    at = ans[0]
            for a, k, b in merged:
                v = (ps, at, a, k, count, b)
                if v not in seen:
                    self.add(v)

    def _merged(self, key: Merge) -> list[tuple[int, int, int]]:
        """Return the ``(ka, kany, kbusy)`` of a parent's views after a child's step (tabled).

        ``key`` (:data:`Merge`): the parent's child atoms ``ka`` and
        ``kbusy``; the child met ``old_atoms`` and meets ``atoms`` after, is
        unsettled after (``busy``), or was pruned (``gone``). Its other
        children meet any of :meth:`_rests`, settled ones calm atoms alone;
        each outcome once, in the order they first come (so the work list is
        as one view at a time would leave it).
        """
        ka, old_atoms, kbusy, busy, atoms, gone = key
        found = self._merges.get(key)
        if found is not None:
            return found
        out: dict[tuple[int, int, int], None] = {}
        for r, b in itertools.product(self._rests(ka, old_atoms), (0, 1) if kbusy else (0,)):
            if not b and r not in self.calm:  # settled other children meet calm atoms alone
                continue
            b2 = 1 if busy else b
            if not gone:
                # the prefix replaces the child, or a step (a count too) stays at the child
                out[(r | atoms, 1, b2)] = None
                continue
            # pruned: the other children meet r (none left where r is empty and all settled)
            if not (r or b2):
                out[(0, 0, 0)] = None
            if r & self.data:  # other children hold data (else they were pruned)
                out[(r, 1, b2)] = None
        found = self._merges[key] = list(out)
        return found

    def pairs(self) -> tuple[str, View] | None:
        """Return a propagating give-back of a locked child that a fitting parent refuses."""
        for pk, group in self.parent_groups.items():
            if not any(ck[2] >= 1 for ck in self.kids_of[pk]):  # no locked child fits
                continue
            for pv in group:
                for e in self.gives:
                    if self.answers.answer(e, self.context(pv), False) is None:
                        return f"invariant 6: {e} propagated to an ancestor is refused", pv
        return None

    def liveness(self) -> tuple[str, View] | None:
        """Return a view of an unsettled node with settled children and no settling step."""
        for v in self.seen:
            before = self.info(v[1])[2]
            if v[5] or not before:
                continue
            enabled = self.answers.enabled(self.context(v))
            if not any(self.settles(v, ev) for ev in enabled):
                e = self.entry(v[1])
                shown = ", ".join(f"{r} {self.layout.state(e, r)}" for r in self.layout.regions)
                if any(self.settles(v, ev, failed=False) for ev in enabled):
                    return (
                        f"liveness: a node can never settle where its copy to or from the "
                        f"store fails ({shown})",
                        v,
                    )
                return f"liveness: a node can never settle ({shown})", v
        return None

    def settles(self, v: View, enabled: tuple[str, int, bool], *, failed: bool = True) -> bool:
        """Whether an enabled event settles the node of ``v``: lowers its measure, is accepted.

        A propagating one must be accepted by the parent (every fitting view)
        and by the ancestors above it, which :meth:`pairs` checks for the
        give-backs of a propagating count alone (the parent holds one then):
        any other propagating event is not taken to settle. ``failed``: the
        success of a copy whose failure is final (to or from the store) is
        not taken either, so one rule decides both passes of the enumerative
        liveness check (:func:`~fsm_cache.modelcheck.liveness.passes`): a
        tree that settles where those copies fail settles where they complete.
        """
        event, new, propagates = enabled
        if event not in self.settling or self.info(new)[2] >= self.info(v[1])[2]:
            return False
        if failed and event in self.completes:
            return False
        return not propagates or (
            event in self.gives
            and all(self.answers.answer(event, self.context(p), False) for p in self.parents(v))
        )

    def show(self, v: View) -> str:
        """Return a view as the report shows it."""
        e = self.entry(v[1])
        layout = self.layout
        node = ", ".join(
            [f"{r} {layout.state(e, r)}" for r in layout.regions]
            + [f"{c} {layout.counter(e, c)}" for c in layout.counters]
        )
        parent = (
            "none (a root)"
            if v[0] < 0
            else ", ".join(
                f"{r} {s}" for r, s in zip(layout.regions, self.trees.states[v[0]], strict=True)
            )
        )
        atoms = [
            f"any child {self.layout.regions[r]} in [{', '.join(sorted(ss))}]"
            for r, ss in self.conds
        ]
        met = [a for i, a in enumerate(atoms) if v[2] >> i & 1]
        if v[2] & self.data:
            met.append("a child holds data")
        if v[2] & self.local and self.remote:
            met.append("a child holds a copy of its own")
        return (
            f"node ({node}); parent ({parent}); children: {'yes' if v[3] else 'none'}"
            f"{' (' + '; '.join(met) + ')' if met else ''}, their "
            f"{'/'.join(sorted(self.prop))} {v[4]}{', one unsettled' if v[5] else ''}"
        )

    def run(self) -> Proof:
        """Compute the fixpoint from fresh roots, inner nodes and leaves; check every view."""
        started = time.process_time()
        early = (*self.layout.holders.unpaired, *self.layout.memory.unfailing)
        if early:
            return Proof(0, early[0], "", time.process_time() - started)
        fi = self.info(self.fresh)
        for ps in (-1, fi[0]):
            for kany in (0, 1):
                kids = (fi[4], 1, fi[1], int(fi[2] > 0)) if kany else (0, 0, 0, 0)
                self.add((ps, self.fresh, *kids))
        for born in self.leaves[1:]:  # a birth under the radix root (treeops.born)
            self.add((-1, born, 0, 0, 0, 0))
        while self.work and not self.finding:
            v = self.work.pop()
            self.step_node(v)
            self.register(v)
        found = self.finding or self.pairs() or self.liveness()
        seconds = time.process_time() - started
        if found is None:
            return Proof(len(self.seen), None, "", seconds)
        return Proof(len(self.seen), found[0], self.show(found[1]), seconds)


def report(
    entries: list[dict[str, Any]],
    enumerative: Callable[[dict[str, Any]], str],
    not_explored: Callable[[dict[str, int], dict[str, int]], list[str]],
) -> str:
    """Return the human summary of ``check --compositional``'s entries.

    A ceiling below where a comparison turns is said under the first line,
    as the enumerative report says it: a proof for every tree size holds
    only up to the ceilings.

    Args:
        entries: One per spec: its :class:`Proof`'s fields, ``spec``, ``bounds``,
            ``unexplored`` (:func:`fsm_cache.modelcheck.check.unexplored`),
            ``wall_seconds`` and ``trace`` (the enumerative search's entry on a
            finding, else None).
        enumerative: The enumerative check's report of a run's result
            (:func:`fsm_cache.modelcheck.check.report`), for the trace.
        not_explored: The enumerative report's lines for ``unexplored``
            (:func:`fsm_cache.modelcheck.check.not_explored`).
    """
    lines = []
    for e in entries:
        bounds = ", ".join(f"{name} <= {most}" for name, most in e["bounds"].items())
        lines.append(f"{e['spec']}: every tree size (compositional), {bounds or 'no counters'}")
        lines += [f"  {line}" for line in not_explored(e["bounds"], e["unexplored"])]
        lines.append(f"  views explored: {e['views']}")
        lines.append(f"  cpu time: {e['seconds']:.2f} s")
        lines.append(f"  time: {e['wall_seconds']:.2f} s")
        if not e["finding"]:
            lines.append("  no invariant violated: holds for every tree size")
            continue
        lines.append(f"  compositional finding: {e['finding']}")
        if e["view"]:
            lines.append(f"  at the view: {e['view']}")
        trace = e["trace"]
        if trace and trace["violation"]:
            lines.append(f"  found by the enumerative check on {trace['nodes']} nodes:")
            shown = enumerative({"specs": [trace], "controls": []})
            lines += [f"    {line}" for line in shown.splitlines()]
        else:
            lines.append(
                "  not proven: the enumerative check on 2 and 3 nodes finds no violation "
                "(the views over-approximate; try more nodes without --compositional)"
            )
    return "\n".join(lines)
