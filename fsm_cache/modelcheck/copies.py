"""Pages and copies in flight: what the spec's effects do to memory, kept as ghost fields.

The spec moves a node's states; its *effects* (``start_write``,
``start_load``, ``adopt_device``, ``free_host``, ``free_device``, and with a
storage tier ``start_store``, ``start_fetch``, ``delete_storage``) move
memory, and the cache binds them to real pages
(:class:`fsm_cache.cache.effects.MemoryEffects`). The model keeps its own
account of that memory, per node and per tier (the ``host``, ``device`` and,
where the spec has one, ``storage`` regions), apart from the states, as it
keeps ghost holds apart from the counters: each tier's pages are
:data:`FREE`, being filled by a copy in flight (``filling from`` the tier it
reads, :func:`filling`), :data:`VALID`, or hold the result of a copy that
failed (``failed from`` that tier). A ``fault`` field records a step that
broke memory (freed pages a copy still reads, a failed copy marked valid);
the invariants report it with the node (:mod:`fsm_cache.modelcheck.invariants`).

What each effect does is :data:`EFFECTS`, the model of ``MemoryEffects``.
Copies are read from the spec: a copy's *copying state* is where the
transition running its start effect leads (``writing``, ``loading``,
``storing``, ``fetching``); its *acknowledgements* are the events every
transition of which, in that region, leaves that copying state
(``write_done``, ``write_failed``, ``load_done``, ``load_failed``,
``store_done``, ``store_failed``, ``fetch_done``, ``fetch_failed``; an
``evict_host`` that may also leave ``backed`` is not one). One event may
acknowledge a copy in each of several regions (one batch that ends a load
and a store at once): each of its acknowledgements is kept, and it completes
every copy it acknowledges. An acknowledgement reports its copy's failure when it frees the pages the copy
fills or leads only to states that claim none (``store_failed``: the store's
pages are not the cache's to free), and its success otherwise. A real copy
can fail, so a copy that no event ends in a failure (freeing the pages it
fills, or in a state that claims none) is a finding about the spec
(:attr:`Memory.unfailing`): a failed copy would be taken as valid KV (a
``write_failed`` that lands in ``backed`` and frees nothing). What a state
*claims* about its tier follows from the design's state sets (:data:`HELD`)
and the copying states: a copying state claims a copy filling the tier,
another held state claims valid data, the rest claim no pages.

The storage tier is the store's, not the cache's (:data:`REMOTE`): the store
may drop pages at any time and may hold pages this cache never wrote. An
event of its region alone that runs no effect and acknowledges no copy
reports what the store did, and the pages follow what its new state claims
(``discover``: the store holds them; ``vanish``: it dropped them), checked
as any take or free is: no pages appear where the node holds some, none
vanish while a copy reads or writes them. An event another region declares
too (``store`` takes a host pin) is the cache's own: it moves the store's
pages by its effects alone, so a ``store`` that marks the node stored
without starting a copy leaves the state claiming pages nobody wrote. A
failed store leaves no pages the cache holds.

A copy to or from the store ends for good when it fails (:func:`final`):
the storage tier never copies again (a later lookup starts a new copy),
where a copy between the cache's own tiers whose failure the spec refuses is
copied again. Liveness asks that every state settle with those copies
failing (:attr:`Memory.final_successes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fsm_cache.residency import DEVICE_HELD, HOST_HELD, STORAGE_HELD
from fsm_cache.spec.machine import System, Transition


FREE = "free"
"""The node holds no pages in the tier."""
FILLING = "filling"
"""The node's pages in the tier are being filled by a copy in flight (see :func:`filling`)."""
VALID = "valid"
"""The node's pages in the tier hold its KV."""
FAILED = "failed"
"""The node's pages in the tier hold what a failed copy left: no valid KV (see :func:`failed`)."""

HELD: Mapping[str, frozenset[str]] = {
    "host": HOST_HELD,
    "device": DEVICE_HELD,
    "storage": STORAGE_HELD,
}
"""Per tier, the states of its region in which the node holds pages there (tiers in order)."""

LOCAL = ("host", "device")
"""The tiers whose pages the cache allocates and frees: a spec without both keeps no memory."""

REMOTE = frozenset({"storage"})
"""Tiers whose pages a store holds: it may drop them or hold pages the cache never wrote."""


@dataclass(frozen=True)
class Copy:
    """A copy between the tiers.

    Attributes:
        reads: The tier it reads (its pages must stay, and hold valid KV).
        fills: The tier it writes.
        name: How messages call it.
    """

    reads: str
    fills: str
    name: str

    @property
    def filling(self) -> str:
        """The status of the pages it fills while it is in flight."""
        return filling(self)


def filling(copy: Copy) -> str:
    """Return the status of pages ``copy`` is filling: ``filling from`` the tier it reads."""
    return f"{FILLING} from {copy.reads}"


def failed(copy: Copy) -> str:
    """Return the status of pages ``copy`` left when it failed: ``failed from`` the tier it read."""
    return f"{FAILED} from {copy.reads}"


def final(copy: Copy) -> bool:
    """Whether a failure of ``copy`` is final: it reads or fills a tier the store owns.

    The store may have dropped the pages a read wants, or refuse the pages a
    write brings, for good, so the storage tier does not copy again: its
    failure acknowledgement is the only way the copy ends. A copy between
    the cache's own tiers still has its source (a load's pin holds the host
    copy), and the cache copies again where the spec refuses its failure.
    """
    return copy.reads in REMOTE or copy.fills in REMOTE


def kind(status: object) -> str:
    """Return what a status is, without the copy: ``free``, ``filling``, ``valid`` or ``failed``."""
    return str(status).split(" ", 1)[0]


@dataclass(frozen=True)
class Effect:
    """What one of the spec's effects does to a node's memory.

    Attributes:
        starts: The copy it starts (it takes pages in the tier the copy fills).
        fills: A tier it gives pages that already hold the KV (a recomputation).
        frees: A tier whose pages it gives back.
    """

    starts: Copy | None = None
    fills: str | None = None
    frees: str | None = None


D2H = Copy("device", "host", "device-to-host")
H2D = Copy("host", "device", "host-to-device")
H2S = Copy("host", "storage", "host-to-storage")
S2H = Copy("storage", "host", "storage-to-host")

EFFECTS: Mapping[str, Effect] = {
    "start_write": Effect(starts=D2H),
    "start_load": Effect(starts=H2D),
    "adopt_device": Effect(fills="device"),
    "free_host": Effect(frees="host"),
    "free_device": Effect(frees="device"),
    "start_store": Effect(starts=H2S),
    "start_fetch": Effect(starts=S2H),
    "delete_storage": Effect(frees="storage"),
}
"""The spec's effects as :class:`fsm_cache.cache.effects.MemoryEffects` binds them to pages."""

COPIES: tuple[Copy, ...] = tuple(e.starts for e in EFFECTS.values() if e.starts)
"""Every copy between the tiers."""


@dataclass(frozen=True)
class Ack:
    """An event acknowledging a copy.

    Attributes:
        copy: The copy it acknowledges.
        region: The region of the copying state it leaves.
        ok: Whether it reports the copy's success (else its failure).
    """

    copy: Copy
    region: str
    ok: bool


Fields = tuple[int | str, ...]
"""A node's ghost memory: one status per tier, then the fault (``""``: none)."""


@dataclass(frozen=True)
class Memory:
    """The ghost memory of a spec's nodes: tiers, copying states and acknowledgements.

    Specs without ``host`` and ``device`` regions have no tiers and no fields.

    Attributes:
        tiers: The tiers (regions) whose memory is kept, in order.
        copying: Per tier, its region's copying states, each with the copy that fills the tier there.
        acks: The acknowledgement events, each with what it acknowledges: one
            copy and outcome per region whose copying state it leaves, in
            region order.
        reports: Per remote tier, the events of its region alone by which the store reports what it did.
        unfailing: One finding per copy that events end, but none in a
            failure (:func:`_unfailing`).
    """

    tiers: tuple[str, ...]
    copying: Mapping[str, Mapping[str, Copy]]
    acks: Mapping[str, tuple[Ack, ...]]
    reports: Mapping[str, frozenset[str]]
    unfailing: tuple[str, ...] = ()

    @classmethod
    def of(cls, system: System) -> Memory:
        """Return the memory model of ``system``'s nodes, read from its effects."""
        regions = dict(system.regions)
        if not set(LOCAL) <= set(regions):
            return cls((), {}, {}, {})
        tiers = tuple(t for t in HELD if t in regions)
        copying: dict[str, dict[str, Copy]] = {}
        for region, machine in system.regions:
            for t in machine.transitions:
                copy = _effect(t).starts
                if copy is not None and copy.fills == region:
                    copying.setdefault(region, {})[t.dest] = copy
        acks: dict[str, tuple[Ack, ...]] = {}
        for region, machine in system.regions:
            states = copying.get(region, {})
            for event in machine.event_names:
                trs = [t for t in machine.transitions if t.event == event]
                sources = {s for t in trs for s in t.sources}
                if not trs or not sources <= set(states) or any(_effect(t).starts for t in trs):
                    continue
                served = {states[s] for s in sources}
                if len(served) == 1:
                    copy = served.pop()
                    frees = any(_effect(t).frees == copy.fills for t in trs)
                    empty = all(t.dest not in HELD[region] for t in trs)
                    acks[event] = (*acks.get(event, ()), Ack(copy, region, not (frees or empty)))
        moves = {t.event for _, m in system.regions for t in m.transitions if t.effect in EFFECTS}
        # An event another region declares too is the cache's own, not the store's word.
        reports = {
            tier: frozenset(
                e
                for e in regions[tier].event_names
                if e not in {*acks, *moves}
                and not any(e in m.event_names for r, m in system.regions if r != tier)
            )
            for tier in tiers
            if tier in REMOTE
        }
        return cls(tiers, copying, acks, reports, _unfailing(system, copying))

    @property
    def width(self) -> int:
        """How many ghost fields a node has: one per tier and the fault, or none."""
        return len(self.tiers) + 1 if self.tiers else 0

    def claims(self, tier: str, state: str) -> str:
        """Return what the state ``state`` of ``tier``'s region says about the tier's pages."""
        copy = self.copying.get(tier, {}).get(state)
        if copy is not None:
            return copy.filling
        return VALID if state in HELD[tier] else FREE

    def fresh(self, states: Mapping[str, str]) -> Fields:
        """Return the memory of a new node: what its states claim (a request computed its KV)."""
        if not self.tiers:
            return ()
        return (*(self.claims(t, states[t]) for t in self.tiers), "")

    @property
    def final_successes(self) -> frozenset[str]:
        """The success acknowledgements of copies whose failure is final (:func:`final`).

        A copy that failed never completes, so where such a copy fails, its
        failure acknowledgement alone can end it: liveness asks that every
        state settle without these events too.
        """
        return frozenset(
            e for e, acks in self.acks.items() if any(a.ok and final(a.copy) for a in acks)
        )

    def failure(self, event: str) -> bool:
        """Whether ``event`` acknowledges a copy's failure (the cache may copy again instead)."""
        return any(not a.ok for a in self.acks.get(event, ()))

    def acknowledging(self, copy: Copy) -> list[str]:
        """Return the events that acknowledge ``copy`` (with or without other copies)."""
        return [e for e, acks in self.acks.items() if any(a.copy == copy for a in acks)]

    def in_flight(self, fields: Fields) -> list[Copy]:
        """Return the copies in flight at a node (those filling one of its tiers)."""
        return [
            c
            for t, s in zip(self.tiers, fields, strict=False)
            for c in COPIES
            if c.fills == t and s == c.filling
        ]

    def holds(self, fields: Fields) -> bool:
        """Whether a node still holds pages in some tier (or a copy is filling them)."""
        return any(s != FREE for s in fields[: len(self.tiers)])

    def local(self, fields: Fields) -> bool:
        """Whether a node holds pages in a tier of its own (not a store's) or a copy is in flight."""
        return any(
            s != FREE and (t not in REMOTE or kind(s) != VALID)
            for t, s in zip(self.tiers, fields, strict=False)
        )

    def step(
        self, fields: Fields, event: str, effects: Sequence[str], states: Mapping[str, str]
    ) -> Fields:
        """Return a node's memory after ``event``, which ran ``effects`` and left it in ``states``.

        An acknowledgement first completes its copies (each finished before
        the cache fired it), then the effects run in order, then what the
        store reports moves its pages. The first step that breaks memory is
        kept as the fault.
        """
        if not self.tiers or fields[-1]:
            return fields
        status = dict(zip(self.tiers, (str(s) for s in fields), strict=False))
        fault = ""
        for ack in self.acks.get(event, ()):
            if not fault:
                fault = _acknowledge(self, status, event, ack, states[ack.region])
        for name in effects:
            effect = EFFECTS.get(name)
            if effect is not None and not fault:
                fault = _run(status, event, effect)
        for tier, events in self.reports.items():
            if event in events and not fault:
                fault = _report(status, event, tier, self.claims(tier, states[tier]))
        return (*(status[t] for t in self.tiers), fault)


def _effect(t: Transition) -> Effect:
    return EFFECTS.get(t.effect or "", Effect())


def _unfailing(system: System, copying: Mapping[str, Mapping[str, Copy]]) -> tuple[str, ...]:
    """Return a finding for each copy that no event can end in a failure.

    A copy between the tiers can fail (a transfer error, a timeout), and the
    cache then fires an event that takes the node out of the copying state.
    Each event that does so is one of the copy's acknowledgements here,
    whether or not it may fire elsewhere too; one reports a failure when a
    transition of it out of the copying state frees the pages the copy fills
    or leads to a state that claims none. If none does, a failed copy is
    taken as the KV. A copy that nothing ends is left to liveness (it can
    never finish).
    """
    out = []
    for region, machine in system.regions:
        for state, copy in copying.get(region, {}).items():
            starts: list[str] = []
            ends: dict[str, bool] = {}
            for t in machine.transitions:
                if _effect(t).starts == copy and t.dest == state:
                    starts += [] if t.event in starts else [t.event]
                elif state in t.sources and t.dest != state and not _effect(t).starts:
                    fails = _effect(t).frees == copy.fills or t.dest not in HELD[region]
                    ends[t.event] = ends.get(t.event, False) or fails
            if not ends or any(ends.values()):
                continue
            verb = "leaves" if len(ends) == 1 else "both leave" if len(ends) == 2 else "all leave"
            out.append(
                f"copy {', '.join(starts)}: no acknowledgement reports a failure "
                f"({', '.join(ends)} {verb} the {copy.fills} pages valid): "
                "a failed copy would be taken as KV"
            )
    return tuple(out)


def _acknowledge(memory: Memory, status: dict[str, str], event: str, ack: Ack, state: str) -> str:
    """Complete ``ack``'s copy in ``status``; return a fault, or ``""``."""
    tier = ack.copy.fills
    if status[tier] != ack.copy.filling:
        return f"valid data|{event} acknowledges a {ack.copy.name} copy that is not in flight"
    status[tier] = VALID if ack.ok else failed(ack.copy)
    if not ack.ok and tier in REMOTE:
        status[tier] = FREE  # what a failed store left is the store's, not the node's
    if not ack.ok and memory.claims(tier, state) == VALID:
        return (
            f"valid data|{event} marks a failed {ack.copy.name} copy valid ({ack.region} {state})"
        )
    return ""


def _run(status: dict[str, str], event: str, effect: Effect) -> str:
    """Apply ``effect`` to ``status``; return a fault, or ``""``."""
    if effect.starts is not None:
        return _take(status, event, effect.starts.fills) or _start(status, event, effect.starts)
    if effect.fills is not None:
        fault = _take(status, event, effect.fills)
        if not fault:
            status[effect.fills] = VALID
        return fault
    if effect.frees is not None:
        return _free(status, event, effect.frees)
    return ""


def _report(status: dict[str, str], event: str, tier: str, claim: str) -> str:
    """Move the store's pages of ``tier`` as ``event`` reports it (to ``claim``); return a fault."""
    if claim == VALID and status[tier] == FREE:
        status[tier] = VALID
    elif claim == VALID and kind(status[tier]) != VALID:
        return _take(status, event, tier)
    elif claim == FREE and status[tier] != FREE:
        return _free(status, event, tier)
    return ""


def _take(status: dict[str, str], event: str, tier: str) -> str:
    """Return the fault of taking pages in ``tier`` where the node holds some already."""
    if status[tier] != FREE:
        return f"invariant 7|{event} takes {tier} pages the node already holds"
    return ""


def _start(status: dict[str, str], event: str, copy: Copy) -> str:
    """Start ``copy``: it must read valid KV; the pages it fills are in flight."""
    if status[copy.reads] != VALID:
        source = kind(status[copy.reads])
        return f"invariant 5|{event} starts a {copy.name} copy from {copy.reads} pages that hold no valid KV ({source})"
    status[copy.fills] = copy.filling
    return ""


def _free(status: dict[str, str], event: str, tier: str) -> str:
    """Free the pages of ``tier``: held, and no copy in flight reads or writes them."""
    if status[tier] == FREE:
        return f"invariant 7|{event} frees {tier} pages the node does not hold"
    for copy in COPIES:
        if copy.fills == tier and status[tier] == copy.filling:
            return f"invariant 5|{event} frees {tier} pages that a {copy.name} copy in flight still writes"
    for copy in COPIES:
        if copy.reads == tier and status.get(copy.fills) == copy.filling:
            return f"invariant 5|{event} frees {tier} pages that a {copy.name} copy in flight still reads"
    status[tier] = FREE
    return ""


def copy_into(tier: str, status: object) -> Copy | None:
    """Return the copy a ``filling``/``failed`` status of ``tier``'s pages names (None: another status)."""
    return next(
        (c for c in COPIES if c.fills == tier and str(status) in (c.filling, failed(c))), None
    )
