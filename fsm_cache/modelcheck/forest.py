"""Interned subtrees: the explorer's compact, canonical form of model states.

A model state (:mod:`fsm_cache.modelcheck.state`) numbers its nodes by slot; two states
that differ only in how slots are numbered, or in the order of siblings, are
the same tree. :class:`Trees` interns each subtree as a small int, so the
explorer stores and compares whole states as short tuples of ints.

That is the checker's symmetry reduction: sibling subtrees are
interchangeable (nothing in the spec, the invariants or liveness reads a
node's number), so a state stands for every numbering of its tree. With
``symmetry=False`` each subtree keeps the slot of its root and siblings stay
in slot order, so every numbering is a state of its own: the unreduced
space, explored to show the reduction finds what it would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby

from fsm_cache.modelcheck.state import Layout, NodeEntry, Nodes


Forest = tuple[int, ...]
"""A canonical model state: its root subtrees' ids, in canonical order."""


class Trees:
    """Interned subtrees: the explorer's compact, canonical form of model states.

    A node's *local* is its entry without the parent (``entry[1:]``), interned
    as a small int; a subtree is its root's local and its child subtrees,
    interned as a small int too (equal ids: isomorphic subtrees). Siblings are
    kept in the order :func:`~fsm_cache.modelcheck.state.canonical` sorts them, so a :data:`Forest` lists
    its nodes in preorder exactly as ``canonical`` numbers them, and states
    are compared and hashed as short tuples of ints.

    Args:
        layout: The node layout of the spec.
        symmetry: Merge states that differ only in node numbering (False:
            a subtree is also its root's slot, and siblings sort by slot).
    """

    def __init__(self, layout: Layout, *, symmetry: bool = True) -> None:
        self.regions = len(layout.regions)
        self.symmetry = symmetry
        self.locals: list[NodeEntry] = []
        self.stid: list[int] = []
        """Local id to the id of its region states."""
        self.states: list[NodeEntry] = []
        """Region-states id to the region states."""
        self.local: list[int] = []
        """Subtree id to its root's local id."""
        self.kids: list[Forest] = []
        self.key: list[tuple[object, ...]] = []
        """Subtree id to its sort key: :func:`~fsm_cache.modelcheck.state.canonical`'s, or its slot without symmetry."""
        self.kid_states: list[tuple[int, ...]] = []
        """Subtree id to its root's children's region-state ids, sorted."""
        self.size: list[int] = []
        """Subtree id to its number of nodes."""
        self.slot: list[int] = []
        """Subtree id to its root's slot (-1 under symmetry: numbering is not kept)."""
        self._lids: dict[NodeEntry, int] = {}
        self._stids: dict[NodeEntry, int] = {}
        self._sids: dict[tuple[int, Forest, int], int] = {}
        self._swaps: dict[tuple[int, int, int, int], int] = {}
        self._automorphisms: dict[int, int] = {}

    def lid(self, local: NodeEntry) -> int:
        """Return the id of a node's local (its entry without the parent)."""
        found = self._lids.get(local)
        if found is None:
            found = self._lids[local] = len(self.locals)
            self.locals.append(local)
            states = local[: self.regions]
            if states not in self._stids:
                self._stids[states] = len(self.states)
                self.states.append(states)
            self.stid.append(self._stids[states])
        return found

    def sid(self, lid: int, kids: Forest, slot: int = -1) -> int:
        """Return the id of the subtree of root ``lid`` in ``slot`` over ``kids`` (in canonical order).

        Under symmetry the slot is dropped, so every numbering of a tree is one subtree.
        """
        slot = -1 if self.symmetry else slot
        found = self._sids.get((lid, kids, slot))
        if found is None:
            found = self._sids[(lid, kids, slot)] = len(self.local)
            self.local.append(lid)
            self.kids.append(kids)
            self.slot.append(slot)
            if slot < 0:
                self.key.append((self.locals[lid], tuple(self.key[k] for k in kids)))
            else:
                self.key.append((slot,))
            self.kid_states.append(tuple(sorted(self.stid[self.local[k]] for k in kids)))
            self.size.append(1 + sum(self.size[k] for k in kids))
        return found

    def order(self, sids: list[int]) -> Forest:
        """Return subtrees in canonical order."""
        if len(sids) < 2:  # most of them: a leaf's children, a chain's child
            return tuple(sids)
        return tuple(sorted(sids, key=self.key.__getitem__))

    def encode(self, nodes: Nodes) -> Forest:
        """Return the canonical form of a model state."""
        below: dict[int, list[int]] = {}
        for i, entry in enumerate(nodes):
            if entry is not None:
                below.setdefault(int(entry[0]), []).append(i)

        def sub(i: int) -> int:
            entry = nodes[i]
            assert entry is not None
            kids = self.order([sub(c) for c in below.get(i, ())])
            return self.sid(self.lid(entry[1:]), kids, i)

        return self.order([sub(r) for r in below.get(-1, ())])

    def preorder(self, forest: Forest) -> list[tuple[int, int]]:
        """Return ``(subtree, parent's index)`` per node, numbered as :func:`~fsm_cache.modelcheck.state.canonical` does."""
        out: list[tuple[int, int]] = []

        def visit(sids: Forest, parent: int) -> None:
            for s in sids:
                here = len(out)
                out.append((s, parent))
                visit(self.kids[s], here)

        visit(forest, -1)
        return out

    def decode(self, forest: Forest, slots: int) -> Nodes:
        """Return the model state of ``forest`` in ``slots`` slots, each node where :meth:`where` puts it."""
        order = self.preorder(forest)
        if self.symmetry:  # numbered in preorder
            out: list[NodeEntry | None] = [(p, *self.locals[self.local[s]]) for s, p in order]
            return (*out, *([None] * (slots - len(out))))
        where = [self.slot[s] for s, _ in order]
        out = [None] * slots
        for (s, p), at in zip(order, where, strict=True):
            out[at] = (where[p] if p >= 0 else -1, *self.locals[self.local[s]])
        return tuple(out)

    def where(self, forest: Forest) -> Sequence[int]:
        """Return the slot of each node of ``forest``, in preorder.

        Under symmetry a node's slot is its place in the preorder (the
        numbering of :func:`~fsm_cache.modelcheck.state.canonical`); without,
        the slot it was kept in.
        """
        if self.symmetry:
            return range(sum(self.size[s] for s in forest))
        return [self.slot[s] for s, _ in self.preorder(forest)]

    def numberings(self, forest: Forest, slots: int) -> int:
        """Return how many numbered states ``forest`` stands for: its tree in every numbering of ``slots`` slots.

        A numbered state places each node in a slot of its own (siblings in
        slot order), so a tree of ``n`` nodes has ``slots! / (slots - n)!``
        placements; placements that differ by swapping equal sibling subtrees,
        at any depth, are one numbered state. Summed over the states explored,
        that is what a search of numbered states started from every numbering
        of the starting shapes explores. Without symmetry a state is numbered
        already: 1.
        """
        if not self.symmetry:
            return 1
        nodes = sum(self.size[s] for s in forest)
        if len(forest) == 1:  # a third of the states: the root subtree's own count, tabled
            return math.perm(slots, nodes) // self._symmetries_of(forest[0])
        return math.perm(slots, nodes) // self._symmetries(forest)

    def _symmetries(self, sids: Forest) -> int:
        """Return the automorphisms of the subtrees ``sids`` (siblings in canonical order, so equal ones adjacent)."""
        count = 1
        for sid, equal in groupby(sids):
            same = sum(1 for _ in equal)
            count *= math.factorial(same) * self._symmetries_of(sid) ** same
        return count

    def _symmetries_of(self, sid: int) -> int:
        """Return the automorphisms of subtree ``sid`` (tabled)."""
        found = self._automorphisms.get(sid)
        if found is None:
            found = self._automorphisms[sid] = self._symmetries(self.kids[sid])
        return found

    def swap(self, sid: int, old: int, new: int, lid: int) -> int:
        """Return subtree ``sid`` with child ``old`` replaced by ``new`` and root local ``lid``."""
        kids = self.kids[sid]
        if len(kids) == 1:  # a chain: nothing to sort, and the subtree's own table is the memo
            return self.sid(lid, (new,), self.slot[sid])
        found = self._swaps.get((sid, old, new, lid))
        if found is None:
            moved = list(kids)
            moved[moved.index(old)] = new
            found = self.sid(lid, self.order(moved), self.slot[sid])
            self._swaps[(sid, old, new, lid)] = found
        return found

    def lift(self, order: list[tuple[int, int]], k: int, lids: tuple[int, ...]) -> int:
        """Return the subtree of ``order`` with node ``k`` and its nearest ancestors given new locals.

        Args:
            order: A root subtree's ``(subtree, parent's index)`` per node (:meth:`preorder`).
            k: The node whose local changes, by its index in ``order``.
            lids: The new locals of node ``k`` and of its nearest ancestors, nearest
                first; the ancestors past them keep theirs.

        The explorer asks this for every event step of every root subtree (millions on
        four nodes), so :meth:`sid` and :meth:`swap` are inlined where their tables
        already hold the answer: the same subtrees, interned in the same order.
        """
        sids, swaps, kids = self._sids, self._swaps, self.kids
        keep = not self.symmetry
        old, parent = order[k]
        slot = self.slot[old] if keep else -1
        new = sids.get((lids[0], kids[old], slot))
        if new is None:
            new = self.sid(lids[0], kids[old], slot)
        at, given = 1, len(lids)
        while parent >= 0:
            sid, parent = order[parent]
            lid = lids[at] if at < given else self.local[sid]
            at += 1
            if len(kids[sid]) == 1:  # a chain: as swap, its subtree's own table is the memo
                slot = self.slot[sid] if keep else -1
                found = sids.get((lid, (new,), slot))
                if found is None:
                    found = self.sid(lid, (new,), slot)
            else:
                found = swaps.get((sid, old, new, lid))
                if found is None:
                    found = self.swap(sid, old, new, lid)
            old, new = sid, found
        return new

    def swap_root(self, forest: Forest, old: int, new: int) -> Forest:
        """Return ``forest`` with root subtree ``old`` replaced by ``new``."""
        if len(forest) == 2:  # the common case, without a sort
            other = forest[1] if forest[0] == old else forest[0]
            key = self.key
            return (other, new) if key[new] > key[other] else (new, other)
        roots = list(forest)
        roots[roots.index(old)] = new
        return self.order(roots)
