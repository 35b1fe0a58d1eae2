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
