"""The model checker's state: a small tree of nodes, each a record of the spec, as tuples.

A model state is a tuple with one entry per node slot: ``None`` for a free
slot, else ``(parent, *region states, *counters, *holds)``. ``parent`` is a
slot index or ``-1`` under the (unmodelled, always resident) radix root.
``holds`` are ghost counters: how many acquisitions of a counter clients made
directly at this node and have not given back (``pin`` minus ``release``,
``lock`` minus ``unlock``, ``load`` minus its acknowledgement). They are what
the counters must account for, so a tree operation or transition that loses
a count is caught.

Which events acquire and release which counter is read from the spec: an
event whose every transition adds one to a counter acquires it, one whose
every transition subtracts one releases it. Holders are told apart by the
regions their events are declared in: a ``load`` (host and device) is given
back by ``load_done`` (host and device), never by ``release`` (host only), so
a client can give back only what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsm_cache.spec import System


Entry = tuple[int | str, ...]
Hold = tuple[str, tuple[str, ...]]
"""A kind of holder: the counter it holds and the regions its events are declared in."""
Nodes = tuple[Entry | None, ...]


@dataclass(frozen=True)
class Layout:
    """Where each field lives in a node entry, and the spec's counter roles.

    Attributes:
        system: The spec.
        regions: Region names, in order.
        counters: Counter names, in order.
        acquires: Event to the holds it acquires (adds one to).
        releases: Event to the holds it releases.
        holds: The hold keys ``(counter, regions of the holder's events)``.
        propagating: Counters whose transitions propagate to ancestors.
    """

    system: System
    regions: tuple[str, ...]
    counters: tuple[str, ...]
    acquires: dict[str, tuple[Hold, ...]]
    releases: dict[str, tuple[Hold, ...]]
    holds: tuple[Hold, ...]
    propagating: frozenset[str]

    @classmethod
    def of(cls, system: System) -> Layout:
        """Return the layout of ``system``'s node entries."""
        acquires: dict[str, tuple[Hold, ...]] = {}
        releases: dict[str, tuple[Hold, ...]] = {}
        for event in system.event_names:
            acquires[event] = _moved(system, event, 1)
            releases[event] = _moved(system, event, -1)
        propagating = frozenset(
            a.counter
            for _, m in system.regions
            for t in m.transitions
            if t.propagate
            for a in t.update.assigns
        )
        holds = tuple(dict.fromkeys(h for hs in acquires.values() for h in hs))
        return cls(
            system,
            tuple(r for r, _ in system.regions),
            tuple(c for c, _ in system.counters),
            acquires,
            releases,
            holds,
            propagating,
        )

    def state(self, entry: Entry, region: str) -> str:
        """Return the state of ``region`` in a node entry."""
        return str(entry[1 + self.regions.index(region)])

    def counter(self, entry: Entry, name: str) -> int:
        """Return counter ``name`` of a node entry."""
        return int(entry[1 + len(self.regions) + self.counters.index(name)])

    @property
    def base(self) -> int:
        """Index of the first hold in an entry."""
        return 1 + len(self.regions) + len(self.counters)

    def hold(self, entry: Entry, key: Hold) -> int:
        """Return the ghost holds of ``key``."""
        return int(entry[self.base + self.holds.index(key)])

    def held(self, entry: Entry, name: str) -> int:
        """Return every hold on counter ``name``."""
        return sum(self.hold(entry, key) for key in self.holds if key[0] == name)

    def fresh(self, parent: int) -> Entry:
        """Return a new node under ``parent`` in the initial states with initial counters."""
        states = tuple(m.initial for _, m in self.system.regions)
        counters = tuple(v for _, v in self.system.counters)
        return (parent, *states, *counters, *(0 for _ in self.holds))

    def with_holds(self, entry: Entry, deltas: dict[Hold, int]) -> Entry:
        """Return ``entry`` with its ghost holds moved by ``deltas``."""
        out = list(entry)
        for key, delta in deltas.items():
            index = self.base + self.holds.index(key)
            out[index] = int(out[index]) + delta
        return tuple(out)

    def has(self, region: str) -> bool:
        """Whether the spec has a region of this name."""
        return region in self.regions

    def deltas(self, event: str) -> dict[Hold, int]:
        """Return how ``event`` moves the ghost holds of the node it is fired at."""
        out = dict.fromkeys(self.acquires[event], 1)
        out.update(dict.fromkeys(self.releases[event], -1))
        return out

    def gives_back_unheld(self, entry: Entry, event: str) -> bool:
        """Whether ``event`` would give back a hold the node's clients do not have."""
        return any(self.hold(entry, key) == 0 for key in self.releases[event])

    def over(self, entry: Entry, bounds: list[int]) -> bool:
        """Whether a counter of ``entry`` is past its ceiling (``bounds``, in counter order)."""
        start = 1 + len(self.regions)
        values = entry[start : start + len(bounds)]
        return any(int(v) > b for v, b in zip(values, bounds, strict=True))


def canonical(nodes: Nodes) -> tuple[Nodes, tuple[int, ...]]:
    """Return the canonical relabelling of a model state and where each node came from.

    Sibling subtrees are sorted by content and nodes renumbered in preorder,
    so states that differ only in how their nodes are numbered (the same tree
    built in another order, interchangeable siblings) are explored once.
    ``perm[k]`` is the slot of ``nodes`` that canonical node ``k`` was.
    """
    kids: dict[int, list[int]] = {}
    for i, entry in enumerate(nodes):
        if entry is not None:
            kids.setdefault(int(entry[0]), []).append(i)
    keys: dict[int, tuple[object, ...]] = {}

    def key(i: int) -> tuple[object, ...]:
        entry = nodes[i]
        assert entry is not None
        below = tuple(sorted(key(c) for c in kids.get(i, ())))
        keys[i] = (entry[1:], below)
        return keys[i]

    roots = sorted(kids.get(-1, ()), key=key)
    order: list[int] = []

    def visit(i: int) -> None:
        order.append(i)
        for c in sorted(kids.get(i, ()), key=keys.__getitem__):
            visit(c)

    for r in roots:
        visit(r)
    where = {old: new for new, old in enumerate(order)}
    out: list[Entry | None] = []
    for old in order:
        entry = nodes[old]
        assert entry is not None
        parent = int(entry[0])
        out.append((where[parent] if parent >= 0 else -1, *entry[1:]))
    out += [None] * (len(nodes) - len(order))
    return tuple(out), tuple(order)


def children(nodes: Nodes, index: int) -> list[int]:
    """Return the slots whose parent is ``index``."""
    return [i for i, e in enumerate(nodes) if e is not None and e[0] == index]


def ancestors(nodes: Nodes, index: int) -> list[int]:
    """Return ``index``'s ancestors, nearest first."""
    out = []
    entry = nodes[index]
    while entry is not None and int(entry[0]) >= 0:
        out.append(int(entry[0]))
        entry = nodes[int(entry[0])]
    return out


def _moved(system: System, event: str, step: int) -> tuple[Hold, ...]:
    found: list[Hold] = []
    for region in system.regions_of(event):
        machine = system.machines[region]
        trs = [t for t in machine.transitions if t.event == event]
        for name in machine.counter_names:
            if trs and all(
                any(
                    a.counter == name and a.op != "=" and a.delta() == step
                    for a in t.update.assigns
                )
                for t in trs
            ):
                found.append((name, system.regions_of(event)))
    return tuple(found)


Forest = tuple[int, ...]
"""A canonical model state: its root subtrees' ids, in canonical order."""


class Trees:
    """Interned subtrees: the explorer's compact, canonical form of model states.

    A node's *local* is its entry without the parent (``entry[1:]``), interned
    as a small int; a subtree is its root's local and its child subtrees,
    interned as a small int too (equal ids: isomorphic subtrees). Siblings are
    kept in the order :func:`canonical` sorts them, so a :data:`Forest` lists
    its nodes in preorder exactly as ``canonical`` numbers them, and states
    are compared and hashed as short tuples of ints.

    Args:
        layout: The node layout of the spec.
    """

    def __init__(self, layout: Layout) -> None:
        self.regions = len(layout.regions)
        self.locals: list[Entry] = []
        self.stid: list[int] = []
        """Local id to the id of its region states."""
        self.states: list[Entry] = []
        """Region-states id to the region states."""
        self.local: list[int] = []
        """Subtree id to its root's local id."""
        self.kids: list[Forest] = []
        self.key: list[tuple[object, ...]] = []
        """Subtree id to the sort key of :func:`canonical`."""
        self.kid_states: list[tuple[int, ...]] = []
        """Subtree id to its root's children's region-state ids, sorted."""
        self.size: list[int] = []
        """Subtree id to its number of nodes."""
        self._lids: dict[Entry, int] = {}
        self._stids: dict[Entry, int] = {}
        self._sids: dict[tuple[int, Forest], int] = {}
        self._swaps: dict[tuple[int, int, int, int], int] = {}

    def lid(self, local: Entry) -> int:
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
        """Return ``(subtree, parent's index)`` per node, numbered as :func:`canonical` does."""
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
        out: list[Entry | None] = [(p, *self.locals[self.local[s]]) for s, p in order]
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
