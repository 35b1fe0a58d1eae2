"""Interned subtrees: the explorer's compact, canonical form of model states.

A model state (:mod:`fsm_cache.modelcheck.state`) numbers its nodes by slot; two states
that differ only in how slots are numbered, or in the order of siblings, are
the same tree. :class:`Trees` interns each subtree as a small int, so the
explorer stores and compares whole states as short tuples of ints.
"""

from __future__ import annotations

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
    """

    def __init__(self, layout: Layout) -> None:
        self.regions = len(layout.regions)
        self.locals: list[NodeEntry] = []
        self.stid: list[int] = []
        """Local id to the id of its region states."""
        self.states: list[NodeEntry] = []
        """Region-states id to the region states."""
        self.local: list[int] = []
        """Subtree id to its root's local id."""
        self.kids: list[Forest] = []
        self.key: list[tuple[object, ...]] = []
        """Subtree id to the sort key of :func:`~fsm_cache.modelcheck.state.canonical`."""
        self.kid_states: list[tuple[int, ...]] = []
        """Subtree id to its root's children's region-state ids, sorted."""
        self.size: list[int] = []
        """Subtree id to its number of nodes."""
        self._lids: dict[NodeEntry, int] = {}
        self._stids: dict[NodeEntry, int] = {}
        self._sids: dict[tuple[int, Forest], int] = {}
        self._swaps: dict[tuple[int, int, int, int], int] = {}

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

    def sid(self, lid: int, kids: Forest) -> int:
        """Return the id of the subtree of root ``lid`` over ``kids`` (in canonical order)."""
        found = self._sids.get((lid, kids))
        if found is None:
            found = self._sids[(lid, kids)] = len(self.local)
            self.local.append(lid)
            self.kids.append(kids)
            self.key.append((self.locals[lid], tuple(self.key[k] for k in kids)))
            self.kid_states.append(tuple(sorted(self.stid[self.local[k]] for k in kids)))
            self.size.append(1 + sum(self.size[k] for k in kids))
        return found

    def order(self, sids: list[int]) -> Forest:
        """Return subtrees in canonical order."""
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
            return self.sid(self.lid(entry[1:]), self.order([sub(c) for c in below.get(i, ())]))

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
        """Return the model state of ``forest`` in ``slots`` slots, numbered canonically."""
        order = self.preorder(forest)
        out: list[NodeEntry | None] = [(p, *self.locals[self.local[s]]) for s, p in order]
        return (*out, *([None] * (slots - len(out))))

    def swap(self, sid: int, old: int, new: int, lid: int) -> int:
        """Return subtree ``sid`` with child ``old`` replaced by ``new`` and root local ``lid``."""
        found = self._swaps.get((sid, old, new, lid))
        if found is None:
            kids = list(self.kids[sid])
            kids[kids.index(old)] = new
            found = self._swaps[(sid, old, new, lid)] = self.sid(lid, self.order(kids))
        return found

    def swap_root(self, forest: Forest, old: int, new: int) -> Forest:
        """Return ``forest`` with root subtree ``old`` replaced by ``new``."""
        roots = list(forest)
        roots[roots.index(old)] = new
        return self.order(roots)
