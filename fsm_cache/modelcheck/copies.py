"""Pages and copies in flight: what the spec's effects do to memory, kept as ghost fields.

The spec moves a node's states; its *effects* (``start_write``,
``start_load``, ``adopt_device``, ``free_host``, ``free_device``) move
memory, and the cache binds them to real pages
(:class:`fsm_cache.cache.effects.MemoryEffects`). The model keeps its own
account of that memory, per node and per tier (the ``host`` and ``device``
regions), apart from the states, as it keeps ghost holds apart from the
counters: each tier's pages are :data:`FREE`, being filled by a copy in
flight (:data:`FILLING`), :data:`VALID`, or hold the result of a copy that
failed (:data:`FAILED`). A ``fault`` field records a step that broke memory
(freed pages a copy still reads, a failed copy marked valid); the invariants
report it with the node (:mod:`fsm_cache.modelcheck.invariants`).

What each effect does is :data:`EFFECTS`, the model of ``MemoryEffects``.
Everything else is read from the spec: a copy's *copying state* is where the
transition running its start effect leads (``writing``, ``loading``); its
*acknowledgements* are the events every transition of which, in that
region, leaves the copying state (``write_done``, ``write_failed``,
``load_done``, ``load_failed``; an ``evict_host`` that may also leave
``backed`` is not one); an acknowledgement that frees the pages the copy
fills reports its failure, any other its success. What a state *claims*
about its tier follows from the design's state sets
(:data:`~fsm_cache.residency.HOST_HELD`, :data:`~fsm_cache.residency.DEVICE_HELD`)
and the copying states: a copying state claims a copy filling the tier,
another held state claims valid data, the rest claim no pages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fsm_cache.residency import DEVICE_HELD, HOST_HELD
from fsm_cache.spec.machine import System, Transition


FREE = "free"
"""The node holds no pages in the tier."""
FILLING = "filling"
"""The node's pages in the tier are being filled by a copy in flight."""
VALID = "valid"
"""The node's pages in the tier hold its KV."""
FAILED = "failed"
"""The node's pages in the tier hold what a failed copy left: no valid KV."""

HELD: Mapping[str, frozenset[str]] = {"host": HOST_HELD, "device": DEVICE_HELD}
"""Per tier, the states of its region in which the node holds pages there."""


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

EFFECTS: Mapping[str, Effect] = {
    "start_write": Effect(starts=D2H),
    "start_load": Effect(starts=H2D),
    "adopt_device": Effect(fills="device"),
    "free_host": Effect(frees="host"),
    "free_device": Effect(frees="device"),
}
"""The spec's effects as :class:`fsm_cache.cache.effects.MemoryEffects` binds them to pages."""

COPIES: Mapping[str, Copy] = {e.starts.fills: e.starts for e in EFFECTS.values() if e.starts}
"""Per tier, the copy that fills it."""


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
        copying: Per tier, the states of its region that claim a copy filling it.
        copies: Per tier, the copy that fills it.
        acks: The acknowledgement events, each with its copy and outcome.
    """

    tiers: tuple[str, ...]
    copying: Mapping[str, frozenset[str]]
    copies: Mapping[str, Copy]
    acks: Mapping[str, Ack]

    @classmethod
    def of(cls, system: System) -> Memory:
        """Return the memory model of ``system``'s nodes, read from its effects."""
        regions = dict(system.regions)
        if not set(HELD) <= set(regions):
            return cls((), {}, {}, {})
        copying: dict[str, frozenset[str]] = {}
        acks: dict[str, Ack] = {}
        for region, machine in system.regions:
            starts = [
                (t, copy)
                for t in machine.transitions
                if (copy := _effect(t).starts) is not None and copy.fills == region
            ]
            if not starts:
                continue
            copy = starts[0][1]
            states = frozenset(t.dest for t, _ in starts)
            copying[region] = states
            for event in machine.event_names:
                trs = [t for t in machine.transitions if t.event == event]
                if trs and all(set(t.sources) <= states and _effect(t).starts is None for t in trs):
                    ok = not any(_effect(t).frees == copy.fills for t in trs)
                    acks[event] = Ack(copy, region, ok)
        return cls(tuple(HELD), copying, COPIES, acks)

    @property
    def width(self) -> int:
        """How many ghost fields a node has: one per tier and the fault, or none."""
        return len(self.tiers) + 1 if self.tiers else 0

    def claims(self, tier: str, state: str) -> str:
        """Return what the state ``state`` of ``tier``'s region says about the tier's pages."""
        if state in self.copying.get(tier, ()):
            return FILLING
        return VALID if state in HELD[tier] else FREE

    def fresh(self, states: Mapping[str, str]) -> Fields:
        """Return the memory of a new node: what its states claim (a request computed its KV)."""
        if not self.tiers:
            return ()
        return (*(self.claims(t, states[t]) for t in self.tiers), "")

    def failure(self, event: str) -> bool:
        """Whether ``event`` acknowledges a copy's failure (the cache may copy again instead)."""
        ack = self.acks.get(event)
        return ack is not None and not ack.ok

    def in_flight(self, fields: Fields) -> list[Copy]:
        """Return the copies in flight at a node (those filling one of its tiers)."""
        return [self.copies[t] for t, s in zip(self.tiers, fields, strict=False) if s == FILLING]

    def holds(self, fields: Fields) -> bool:
        """Whether a node still holds pages in some tier (or a copy is filling them)."""
        return any(s != FREE for s in fields[: len(self.tiers)])

    def step(
        self, fields: Fields, event: str, effects: Sequence[str], states: Mapping[str, str]
    ) -> Fields:
        """Return a node's memory after ``event``, which ran ``effects`` and left it in ``states``.

        An acknowledgement first completes its copy (the copy finished before
        the cache fired it), then the effects run in order. The first step
        that breaks memory is kept as the fault.
        """
        if not self.tiers or fields[-1]:
            return fields
        status = dict(zip(self.tiers, (str(s) for s in fields), strict=False))
        fault = ""
        ack = self.acks.get(event)
        if ack is not None:
            fault = _acknowledge(self, status, event, ack, states[ack.region])
        for name in effects:
            effect = EFFECTS.get(name)
            if effect is not None and not fault:
                fault = _run(self.copies, status, event, effect)
        return (*(status[t] for t in self.tiers), fault)


def _effect(t: Transition) -> Effect:
    return EFFECTS.get(t.effect or "", Effect())


def _acknowledge(memory: Memory, status: dict[str, str], event: str, ack: Ack, state: str) -> str:
    """Complete ``ack``'s copy in ``status``; return a fault, or ``""``."""
    tier = ack.copy.fills
    if status[tier] != FILLING:
        return f"valid data|{event} acknowledges a {ack.copy.name} copy that is not in flight"
    status[tier] = VALID if ack.ok else FAILED
    if not ack.ok and memory.claims(tier, state) == VALID:
        return (
            f"valid data|{event} marks a failed {ack.copy.name} copy valid ({ack.region} {state})"
        )
    return ""


def _run(copies: Mapping[str, Copy], status: dict[str, str], event: str, effect: Effect) -> str:
    """Apply ``effect`` to ``status`` (``copies``: the copy filling each tier); return a fault."""
    if effect.starts is not None:
        return _take(status, event, effect.starts.fills) or _start(status, event, effect.starts)
    if effect.fills is not None:
        fault = _take(status, event, effect.fills)
        if not fault:
            status[effect.fills] = VALID
        return fault
    if effect.frees is not None:
        return _free(copies, status, event, effect.frees)
    return ""


def _take(status: dict[str, str], event: str, tier: str) -> str:
    """Return the fault of taking pages in ``tier`` where the node holds some already."""
    if status[tier] != FREE:
        return f"invariant 7|{event} takes {tier} pages the node already holds"
    return ""


def _start(status: dict[str, str], event: str, copy: Copy) -> str:
    """Start ``copy``: it must read valid KV; the pages it fills are in flight."""
    if status[copy.reads] != VALID:
        source = status[copy.reads]
        return f"invariant 5|{event} starts a {copy.name} copy from {copy.reads} pages that hold no valid KV ({source})"
    status[copy.fills] = FILLING
    return ""


def _free(copies: Mapping[str, Copy], status: dict[str, str], event: str, tier: str) -> str:
    """Free the pages of ``tier``: held, and no copy in flight reads or writes them."""
    if status[tier] == FREE:
        return f"invariant 7|{event} frees {tier} pages the node does not hold"
    if status[tier] == FILLING:
        return f"invariant 5|{event} frees {tier} pages that a {copies[tier].name} copy in flight still writes"
    for filled, copy in copies.items():
        if copy.reads == tier and status[filled] == FILLING:
            return f"invariant 5|{event} frees {tier} pages that a {copy.name} copy in flight still reads"
    status[tier] = FREE
    return ""
