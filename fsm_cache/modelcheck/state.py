"""The model checker's state: a small tree of nodes, each a record of the spec, as tuples.

A model state is a tuple with one entry per node slot: ``None`` for a free
slot, else ``(parent, *region states, *counters, *holds, *memory)``.
``parent`` is a slot index or ``-1`` under the (unmodelled, always resident)
radix root. ``holds`` are ghost counters: how many acquisitions of a counter
clients made directly at this node and have not given back (``pin`` minus
``release``, ``lock`` minus ``unlock``, ``load`` minus its acknowledgement).
They are what the counters must account for, so a tree operation or
transition that loses a count is caught. Which events acquire and give back
which counter, and so the kinds of holds, is read from the spec
(:mod:`fsm_cache.spec.holders`). ``memory`` is the ghost account of the
node's pages and copies in flight, moved by the spec's effects
(:mod:`fsm_cache.modelcheck.copies`; no fields for specs without ``host`` and
``device`` regions), which the states' claims are checked against.

What the cache itself chooses among the steps the spec allows (its write
policy, how it acknowledges a copy) is :class:`Choices`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

from fsm_cache.errors import ConfigError, SpecError
from fsm_cache.modelcheck.copies import COPIES, EFFECTS, Copy, Fields, Memory, final
from fsm_cache.policy import PolicyNode, WritePolicy, parent_allows_backup, wants_backup
from fsm_cache.residency import FETCHING, DeviceState, HostState
from fsm_cache.spec.holders import Hold, Holders
from fsm_cache.spec.machine import System


NodeEntry = tuple[int | str, ...]
Nodes = tuple[NodeEntry | None, ...]

RESIDENCY_REGIONS = ("host", "device")
"""The regions of a residency record (:attr:`Layout.residency`)."""

RESIDENCY_COUNTERS = ("pins", "locks")
"""The counters of a residency record: host pins and device locks, read by the split."""

REFERENCE_STATES: Mapping[str, tuple[str, ...]] = {
    "host": ("writing", "backed", "pinned"),
    "device": ("resident", "loading"),
    "storage": ("storing", "stored", "reading"),
}
"""Per residency region, the states the checker reads by name.

They are the design's (``shared/design/residency.md``): the state sets of
:mod:`fsm_cache.residency` that say where a tier holds pages and where it is
valid, the invariants that read a copy on both sides (invariants 1, 3, 5),
the split (:func:`fsm_cache.residency.split_prefix`) and the radix root a
write policy reads. A host region beside a storage region reads
:data:`~fsm_cache.residency.FETCHING` too.
"""


def reference_states(system: System) -> None:
    """Refuse a spec whose residency regions lack the state names the checker reads.

    A region named ``host``, ``device`` or ``storage`` is checked against the
    design's invariants, which read :data:`REFERENCE_STATES` by name: with a
    state renamed, the checks would read the renamed state as another and
    report false violations, or skip what they no longer find. A spec whose
    regions carry other names is checked as plain machines.

    Raises:
        ConfigError: A residency region lacks one of those states; the message
            names the spec, the region and the states.
    """
    regions = dict(system.regions)
    for region, names in REFERENCE_STATES.items():
        if region not in regions:
            continue
        wanted = (*names, FETCHING) if region == "host" and "storage" in regions else names
        have = {state.name for state in regions[region].states}
        missing = [name for name in wanted if name not in have]
        if missing:
            states = ", ".join(missing)
            raise ConfigError(
                f"check: {system.name}: the {region} region has no state {states}: the residency "
                f"checks read the {region} states by the names of docs/residency.md "
                f"({', '.join(wanted)}); name them so, or give the region another name to "
                "check the spec as plain machines"
            )


@dataclass(frozen=True)
class Layout:
    """Where each field lives in a node entry, and the spec's counter roles.

    Attributes:
        system: The spec.
        regions: Region names, in order.
        counters: Counter names, in order.
        holders: The holder kinds, and the events that acquire and give back each.
        memory: The ghost memory of a node: tiers, copies and their acknowledgements.
        copy_holds: The holder kinds that are copies in flight (``load``, ``store``), each
            with the copies its acquiring events start (one, or one per
            region for an event that starts a copy in two).
    """

    system: System
    regions: tuple[str, ...]
    counters: tuple[str, ...]
    holders: Holders
    memory: Memory
    copy_holds: Mapping[Hold, tuple[Copy, ...]]
    _steps: dict[tuple[object, ...], Fields] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, system: System) -> Layout:
        """Return the layout of ``system``'s node entries."""
        regions = tuple(r for r, _ in system.regions)
        counters = tuple(c for c, _ in system.counters)
        holders, memory = Holders.of(system), Memory.of(system)
        return cls(system, regions, counters, holders, memory, _copy_holds(system, holders, memory))

    def state(self, entry: NodeEntry, region: str) -> str:
        """Return the state of ``region`` in a node entry."""
        return str(entry[1 + self.regions.index(region)])

    def counter(self, entry: NodeEntry, name: str) -> int:
        """Return counter ``name`` of a node entry."""
        return int(entry[1 + len(self.regions) + self.counters.index(name)])

    @cached_property
    def batch_pins(self) -> Mapping[Hold, tuple[Copy, ...]]:
        """The pin holder kinds of :attr:`copy_holds` whose acquiring event starts several copies.

        Only these can hold fewer pins than copies in flight (a batch that
        loads and stores under one pin); empty for the shipped specs, so a
        split reads no copies for them.
        """
        return {k: c for k, c in self.copy_holds.items() if k[0] == "pins" and len(c) > 1}

    @cached_property
    def base(self) -> int:
        """Index of the first hold in an entry."""
        return 1 + len(self.regions) + len(self.counters)

    @cached_property
    def mbase(self) -> int:
        """Index of the first ghost memory field in an entry."""
        return self.base + len(self.holders.kinds)

    def pages(self, entry: NodeEntry) -> Fields:
        """Return the ghost memory of a node entry (:mod:`fsm_cache.modelcheck.copies`)."""
        return entry[self.mbase :]

    def hold(self, entry: NodeEntry, key: Hold) -> int:
        """Return the ghost holds of ``key``."""
        return int(entry[self.base + self.holders.kinds.index(key)])

    def held(self, entry: NodeEntry, name: str) -> int:
        """Return every hold on counter ``name``."""
        return sum(self.hold(entry, key) for key in self.holders.kinds if key[0] == name)

    def fresh(self, parent: int) -> NodeEntry:
        """Return a new node under ``parent`` in the initial states with initial counters."""
        states = tuple(m.initial for _, m in self.system.regions)
        counters = tuple(v for _, v in self.system.counters)
        return self.entry(parent, *states, *counters, *(0 for _ in self.holders.kinds))

    def born(self, parent: int, birth: str) -> NodeEntry:
        """Return a new node under ``parent`` born as the spec's ``birth`` says, with initial counters.

        Its memory is what its states claim: a node born ``discovered`` has
        valid pages in the store and none of its own.

        Raises:
            KeyError: The spec declares no such birth.
        """
        born = self.system.born(birth)
        states = tuple(born[r] for r in self.regions)
        counters = tuple(v for _, v in self.system.counters)
        return self.entry(parent, *states, *counters, *(0 for _ in self.holders.kinds))

    @property
    def births(self) -> tuple[str, ...]:
        """The names of the spec's births besides every region's initial state."""
        return tuple(b.name for b in self.system.births)

    def entry(self, parent: int, *fields: int | str) -> NodeEntry:
        """Return the entry of a node with ``fields`` (states, counters, holds) and the memory they claim.

        The memory of a new node is what its states say it holds: a node is
        inserted with the KV a request computed on the device.
        """
        states = dict(zip(self.regions, (str(f) for f in fields), strict=False))
        return (parent, *fields, *self.memory.fresh(states))

    def stepped(self, entry: NodeEntry, event: str, effects: Sequence[str]) -> NodeEntry:
        """Return ``entry`` (already in its new states) with its memory moved by ``event``'s ``effects``."""
        if not self.memory.tiers:
            return entry
        states = entry[1 : 1 + len(self.regions)]
        key = (self.pages(entry), event, tuple(effects), states)
        memory = self._steps.get(key)
        if memory is None:
            named = dict(zip(self.regions, (str(s) for s in states), strict=True))
            memory = self._steps[key] = self.memory.step(key[0], event, effects, named)
        return (*entry[: self.mbase], *memory)

    def owed(self, entry: NodeEntry) -> list[tuple[str, Hold]]:
        """Return the give-backs ``(event, hold)`` the node's holders may fire now, and must.

        Each must be accepted at once (the other half of invariant 6) where
        holders give back without waiting (:attr:`at_once`): a client that
        holds a pin must be able to release it. A copy's failure
        acknowledgement (``load_failed``) is exempt: where the spec refuses
        it, the cache copies again (the node stays as it is), and the
        success acknowledgement gives the hold back. Elsewhere none is owed at
        once: liveness decides whether each can be given back in the end.
        """
        if not self.at_once:
            return []
        return [
            (event, key)
            for event, keys in self.holders.releases.items()
            for key in keys
            if self.hold(entry, key) > 0 and not self.memory.failure(event)
        ]

    @property
    def at_once(self) -> bool:
        """Whether a give-back its holder holds must be accepted at once: on the cache's records.

        The cache never waits to give back: a finishing request releases its
        pins and moves on, a copy is acknowledged when it ends. So on records
        that hold pages (``host``, ``device`` or ``storage`` regions) a refused
        give-back is a violation where it is refused. On other specs a refusal
        may be a wait that ends (``release`` refused while a query is in
        flight, accepted after ``query_done``); liveness tells a wait from a
        deadlock there (:func:`~fsm_cache.modelcheck.liveness.settling`).
        """
        return bool(self.memory.tiers)

    def unsettled(self, entry: NodeEntry) -> int:
        """Return what at the node waits to finish: its holds and its copies in flight (0: settled)."""
        holds = sum(int(h) for h in entry[self.base : self.mbase])
        return holds + len(self.memory.in_flight(self.pages(entry)))

    def with_holds(self, entry: NodeEntry, deltas: dict[Hold, int]) -> NodeEntry:
        """Return ``entry`` with its ghost holds moved by ``deltas``."""
        out = list(entry)
        for key, delta in deltas.items():
            index = self.base + self.holders.kinds.index(key)
            out[index] = int(out[index]) + delta
        return tuple(out)

    def has(self, region: str) -> bool:
        """Whether the spec has a region of this name."""
        return region in self.regions

    @property
    def residency(self) -> bool:
        """Whether nodes are residency records: ``host`` and ``device`` regions, ``pins`` and ``locks``."""
        return set(RESIDENCY_REGIONS) <= set(self.regions) and set(RESIDENCY_COUNTERS) <= set(
            self.counters
        )

    def deltas(self, event: str) -> dict[Hold, int]:
        """Return how ``event`` moves the ghost holds of the node it is fired at."""
        out = dict.fromkeys(self.holders.acquires[event], 1)
        out.update(dict.fromkeys(self.holders.releases[event], -1))
        return out

    def gives_back_unheld(self, entry: NodeEntry, event: str) -> bool:
        """Whether ``event`` would give back a hold the node's clients do not have."""
        return any(self.hold(entry, key) == 0 for key in self.holders.releases[event])

    def unheld(self, entry: NodeEntry) -> list[tuple[str, Hold]]:
        """Return the give-backs ``(event, hold)`` the spec must refuse at the node.

        ``event`` gives back ``hold``, which no client holds at the node, while
        holders of another kind hold the same counter there (a ``release`` where
        the only pin is the one a ``load`` holds), or while nothing holds it (the
        count is 0: a ``release`` with nothing pinned). Clients never fire these;
        the spec must refuse them, or a client's give-back takes what it never
        held, or gives back what nobody took.
        """
        return [
            (event, key)
            for event, keys in self.holders.releases.items()
            for key in keys
            if self.hold(entry, key) == 0
            and (
                self.counter(entry, key[0]) == 0
                or any(
                    self.hold(entry, k) > 0
                    for k in self.holders.kinds
                    if k[0] == key[0] and k != key
                )
            )
        ]

    def over(self, entry: NodeEntry, bounds: list[int]) -> bool:
        """Whether a counter of ``entry`` is past its ceiling (``bounds``, in counter order)."""
        start = 1 + len(self.regions)
        values = entry[start : start + len(bounds)]
        return any(int(v) > b for v, b in zip(values, bounds, strict=True))


def _copy_holds(system: System, holders: Holders, memory: Memory) -> dict[Hold, tuple[Copy, ...]]:
    """Return the holder kinds whose acquiring events start copies, with the copies they start."""
    if not memory.tiers:
        return {}
    out: dict[Hold, tuple[Copy, ...]] = {}
    for event, keys in holders.acquires.items():
        starts = {
            effect.starts
            for _, machine in system.regions
            for t in machine.transitions
            if t.event == event and (effect := EFFECTS.get(t.effect or "")) and effect.starts
        }
        for key in keys:
            copies = (*out.get(key, ()), *starts)
            out[key] = tuple(c for c in COPIES if c in copies)
    return {key: copies for key, copies in out.items() if copies}


Wants = Callable[[WritePolicy, PolicyNode, int], bool]
"""A policy's decision to start a backup, as :func:`fsm_cache.policy.wants_backup`."""

BACKUP = "write"
"""The event a write policy decides on, as the shipped specs name it: the one whose effect is
``start_write`` (:func:`started_by`), whatever a spec names it."""

PREFETCH = "fetch"
"""The event that fills a host copy from storage, as the shipped specs name it; a spec without
one has its prefetches found by the copy they start (:func:`_prefetches`); under a write
policy, only where a backup could start."""


def started_by(layout: Layout, effect: str, named: str) -> frozenset[str]:
    """Return the events of ``layout``'s spec whose transitions run ``effect``.

    Events are named freely (check.md), so the backups and the fetches a
    policy decides on are found by the copies they start, however many
    events start one; ``{named}`` (the shipped specs' name) where none does.
    """
    found = frozenset(
        t.event
        for machine in layout.system.machines.values()
        for t in machine.transitions
        if t.effect == effect
    )
    return found or frozenset({named})


@dataclass(frozen=True)
class PolicyView:
    """A node as a write policy reads it (a :class:`fsm_cache.policy.PolicyNode`)."""

    host: HostState
    device: DeviceState
    hit_count: int
    parent: PolicyView | None


ROOT = PolicyView("backed", "resident", 0, None)
"""The radix root, as :meth:`fsm_cache.cache.tree.RadixTree.root` makes it."""


@dataclass(frozen=True)
class Choices:
    """What the cache chooses to do among the steps the spec allows, under a write policy.

    Without a policy, every step the spec allows may happen, and copies are
    acknowledged one node at a time in any order, but for one: a fetch from
    storage lands its pages in order (as under a policy, below), so its success
    (``fetch_done``) is not fired at a node whose parent's host copy is still
    being fetched (a split of a node being fetched, or a node fetched below
    one): the parent's share lands first (:attr:`ordered`). The cache
    acknowledges a read's nodes top down, the landed prefix first, and
    fails the rest (``storage_tier``); a suffix landed above a prefix still
    in flight would keep the prefix's failure from ever being applied
    (``NotAHostLeaf``), which no cache reaches. A user spec's batch that
    ends a copy to or from the store together with another (``sync_done``:
    a store and a load) lands likewise, its store's pages in order, so it
    is not fired at a node whose parent is still being stored: a suffix's
    batch landed first would keep the prefix's failure, which fails its
    load too, from being applied (``NotADeviceLeaf``). A store alone is
    acknowledged in any order, as the cache's hand acknowledgements may be:
    its failure is accepted whatever lies below. Under a write policy:

    * a backup (an event that runs ``start_write``, :func:`started_by`) starts only where
      :func:`fsm_cache.policy.wants_backup` says so (the model asks it for a
      node hit often enough: it does not count hits);
    * a backup in flight is acknowledged as HiCache does it, for a whole copy
      at once: a split of a node being written adds the prefix to the copy
      (``transfers.on_split``), and the policy starts a child's backup only
      under a backed parent, so a chain of nodes being written is one copy.
      Its acknowledgement is fired at the chain's lowest node and applied to
      the chain up to its top;
    * a fetch from storage lands its pages in order, so its success
      (``fetch_done``) is fired likewise at the lowest node of a chain being
      fetched and applied up to its top, and its failures node by node;
    * a prefetch from storage (:func:`_prefetches`) fills a host copy as a backup
      does, so it starts only under a parent the policy would back a node up
      under (:func:`fsm_cache.policy.parent_allows_backup`: under
      write-through, a parent with a valid host copy, or the root), as
      HiCache's prefetch anchors only there.

    Attributes:
        policy: The write policy, or None.
        joined: The events acknowledging a copy as one, each with the host state
            of that copy in flight (``write_done``, ``write_failed``: ``writing``,
            where ``write`` leads; ``fetch_done``: ``fetching``, where ``fetch``
            leads, since pages land in order: a fetch fails node by node, deepest
            first). A pin taken while a copy is in flight stays in that state.
            Only the copy's acknowledgements, as the pages account reads them
            (:func:`_acknowledging`): another exit from the copying state is
            fired as the spec allows.
        ordered: Without a policy, the events acknowledging a fetch's success,
            or a batch's that ends a copy to or from the store with another,
            each with the state of that copy in flight (``fetch_done``:
            ``fetching``; ``sync_done``: ``storing``): not fired at a node
            whose parent is in that state. Empty on a spec whose nodes keep
            no pages: the checker cannot tell its acknowledgements, so every
            order is explored.
        ordered_in: The region of each :attr:`ordered` state, where it is not
            the host's (``sync_done``: ``storage``).
        backup: The events the policy decides on: those whose transitions run
            ``start_write`` (``write`` in the shipped specs).
        prefetch: The events that stand for the cache's prefetch
            (:func:`_prefetches`): ``fetch`` where the spec has one, else those
            whose transitions run ``start_fetch``.
    """

    policy: WritePolicy | None = None
    joined: Mapping[str, str] = field(default_factory=dict)
    wants: Wants = wants_backup
    ordered: Mapping[str, str] = field(default_factory=dict)
    ordered_in: Mapping[str, str] = field(default_factory=dict)
    backup: frozenset[str] = frozenset({BACKUP})
    prefetch: frozenset[str] = frozenset({PREFETCH})

    @classmethod
    def of(cls, layout: Layout, policy: WritePolicy | None, wants: Wants = wants_backup) -> Choices:
        """Return the choices of ``policy`` on the residency spec of ``layout``.

        ``wants`` decides where backups start: HiCache's own
        :func:`~fsm_cache.policy.wants_backup`, or a broken variant (a control).

        Raises:
            SpecError: A policy is given for a spec whose nodes are not residency records.
        """
        if policy is None:
            if not layout.has("host"):
                return cls()
            ordered = _in_order(layout)
            return cls(
                ordered={event: state for event, (_, state) in ordered.items()},
                ordered_in={e: region for e, (region, _) in ordered.items() if region != "host"},
            )
        if not layout.residency:
            missing = [
                *(f"no {r} region" for r in RESIDENCY_REGIONS if not layout.has(r)),
                *(f"no {c} counter" for c in RESIDENCY_COUNTERS if c not in layout.counters),
            ]
            raise SpecError(
                [
                    f"{layout.system.name}: the {policy.value} policy needs host and device "
                    f"regions with pins and locks counters ({', '.join(missing)})"
                ]
            )
        backup = started_by(layout, "start_write", BACKUP)
        prefetch = _prefetches(layout)
        joined = {
            **_acknowledging(layout, backup, False),
            **_acknowledging(layout, prefetch, True),
        }
        return cls(policy, joined, wants, backup=backup, prefetch=prefetch)

    def fires(self, layout: Layout, event: str, node: NodeEntry, parent: NodeEntry | None) -> bool:
        """Whether the cache fires ``event`` at ``node`` under ``parent`` (None: the root)."""
        if self.policy is None or (event not in self.backup and event not in self.prefetch):
            return True
        # Above a modelled parent is the root or another node; the policy asks only which.
        up = ROOT if parent is None else PolicyView(*_residency(layout, parent), 0, ROOT)
        view = PolicyView(*_residency(layout, node), 1, up)
        if event in self.prefetch:
            return parent_allows_backup(self.policy, view)
        return self.wants(self.policy, view, 1)

    def behind(self, layout: Layout, event: str, parent: NodeEntry | None) -> bool:
        """Whether ``event`` waits for the parent's share of a fetch or a batch to land (None: the root).

        The parent's state is read only for an event :attr:`ordered` holds,
        which only a spec with a host region has.
        """
        copying = self.ordered.get(event)
        if copying is None or parent is None:
            return False
        return layout.state(parent, self.ordered_in.get(event, "host")) == copying

    def waits(self, event: str, children: list[str]) -> bool:
        """Whether ``event`` waits for a child's: the node shares its copy with a child (host states)."""
        copying = self.joined.get(event)
        return copying is not None and copying in children

    def joins(self, layout: Layout, event: str, ancestor: NodeEntry) -> bool:
        """Whether ``event``, acknowledging the copy of a child, applies to ``ancestor`` too."""
        copying = self.joined.get(event)
        return copying is not None and layout.state(ancestor, "host") == copying


def _prefetches(layout: Layout) -> frozenset[str]:
    """Return the events that stand for the cache's prefetch: ``fetch`` where the spec has it.

    Every backup is the policy's (:func:`started_by`), but a spec may read
    from the store in more than one way, and only the prefetch is the cache's
    (a ``refetch`` into a ``refetching`` state of its own is another copy,
    acknowledged in any order); a spec that names no ``fetch`` has its reads
    found by the copy they start.
    """
    found = started_by(layout, "start_fetch", PREFETCH)
    return frozenset({PREFETCH}) if PREFETCH in found else found


def _in_order(layout: Layout) -> dict[str, tuple[str, str]]:
    """Return the successes that land a parent's share first, each with its copy's region and state.

    A fetch's (:func:`_acknowledging` of the prefetches, :func:`_prefetches`), and a batch's:
    an event acknowledging several copies, one of them to or from the store
    (:func:`~fsm_cache.modelcheck.copies.final`), with the state that copy
    is in flight in.
    """
    memory = layout.memory
    out = {
        event: ("host", state)
        for event, state in _acknowledging(layout, _prefetches(layout), True).items()
    }
    for event, acks in memory.acks.items():
        landing = [a for a in acks if a.ok and final(a.copy)] if len(acks) > 1 else []
        if landing and event not in out:
            ack = landing[0]
            copying = memory.copying[ack.region]
            out[event] = (ack.region, next(s for s, c in copying.items() if c == ack.copy))
    return out


def _acknowledging(layout: Layout, starts: frozenset[str], successes_only: bool) -> dict[str, str]:
    """Return the host events that acknowledge the copies ``starts`` begin, each with its copying state.

    They are the copy's acknowledgements as the pages account reads them from
    the spec's effects (:attr:`fsm_cache.modelcheck.copies.Memory.acks`), not
    every exit from the copying state: an event that may also fire
    elsewhere (a ``fetch_failed`` accepted from ``backed`` too) acknowledges
    nothing, and holding it back would hold it back from every state. Nor
    one that acknowledges the same copy out of another state it fills (a
    second kind of read, ``refetching``): it does not leave this one. A spec
    whose nodes keep no pages (no ``host`` and ``device`` regions) has no
    acknowledgement the checker can tell, so none is held back there.

    ``successes_only``: only those that report its success (a failure is
    applied node by node).
    """
    host = layout.system.machines["host"].transitions
    out: dict[str, str] = {}
    for start in starts:
        copying = next((t.dest for t in host if t.event == start), None)
        copy = layout.memory.copying.get("host", {}).get(str(copying))
        leaving = {t.event for t in host if copying in t.sources and t.dest != copying}
        out.update(
            (event, str(copying))
            for event, acks in layout.memory.acks.items()
            for ack in acks
            if copy is not None and ack.region == "host" and ack.copy == copy
            if event in leaving and (ack.ok or not successes_only)
        )
    return out


def _residency(layout: Layout, entry: NodeEntry) -> tuple[HostState, DeviceState]:
    return (
        cast("HostState", layout.state(entry, "host")),
        cast("DeviceState", layout.state(entry, "device")),
    )


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
    out: list[NodeEntry | None] = []
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
