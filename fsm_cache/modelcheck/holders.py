"""Holder kinds: which events acquire and which give back each counter, read from the spec.

The model checker keeps ghost counts of what clients hold at each node
(:mod:`fsm_cache.modelcheck.state`). Only some counters count holders
(:attr:`Holders.counts`): one some event gives back (every transition of
the event subtracts one), or one a state carries (``counter = "pins"``,
drawn ``pinned(N)``: one state per holder count, as
:mod:`fsm_cache.engine.holds` reads it). A counter only ever raised or set
(tokens emitted, retries, a generation) counts events, not holders: nothing
gives it back, so it is neither accounted to holders (invariant 6) nor
owed back (liveness). On a holder count, an event whose every transition
adds one acquires it; one whose every transition subtracts one gives it back.
Holders are told apart by the regions their events are declared in: a
``load`` (host and device) is given back by ``load_done`` (host and device),
never by ``release`` (host only), so a client gives back only what it holds.

A give-back whose kind no event acquires cannot be paired with any hold (say
``take`` adds two and ``give`` subtracts one: one take and one give leave the
counter at one, held by nobody). That is a finding about the spec, reported
before anything is explored (:attr:`Holders.unpaired`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsm_cache.spec.machine import System


Hold = tuple[str, tuple[str, ...]]
"""A kind of holder: the counter it holds and the regions its events are declared in."""


@dataclass(frozen=True)
class Holders:
    """The spec's holder kinds and the events that acquire and give back each.

    Attributes:
        counts: The counters that count holders, in declaration order: those
            some event gives back or a state carries.
        acquires: Event to the holds it acquires (adds one to), of :attr:`counts` only.
        releases: Event to the holds it gives back (subtracts one from), each acquired by some event.
        kinds: The hold kinds, in order of their first acquiring event.
        propagating: Counters whose transitions propagate to ancestors.
        unpaired: One finding per give-back whose kind no event acquires.
    """

    counts: tuple[str, ...]
    acquires: dict[str, tuple[Hold, ...]]
    releases: dict[str, tuple[Hold, ...]]
    kinds: tuple[Hold, ...]
    propagating: frozenset[str]
    unpaired: tuple[str, ...]

    @classmethod
    def of(cls, system: System) -> Holders:
        """Return the holder kinds of ``system``."""
        releases = {event: _moved(system, event, -1) for event in system.event_names}
        given = {key[0] for keys in releases.values() for key in keys}
        carried = {s.counter for _, m in system.regions for s in m.states if s.counter}
        counts = tuple(c for c, _ in system.counters if c in given | carried)
        acquires = {
            event: tuple(k for k in _moved(system, event, 1) if k[0] in counts)
            for event in system.event_names
        }
        kinds = tuple(dict.fromkeys(h for hs in acquires.values() for h in hs))
        unpaired = tuple(
            _unpaired(system, event, key)
            for event, keys in releases.items()
            for key in keys
            if key not in kinds
        )
        propagating = frozenset(
            a.counter
            for _, m in system.regions
            for t in m.transitions
            if t.propagate
            for a in t.update.assigns
        )
        paired = {event: tuple(k for k in keys if k in kinds) for event, keys in releases.items()}
        return cls(counts, acquires, paired, kinds, propagating, unpaired)

    def acquirers(self, key: Hold) -> str:
        """Return the events that acquire hold ``key``, as messages name its holders (``pin``)."""
        return "/".join(event for event, keys in self.acquires.items() if key in keys)


def _moved(system: System, event: str, step: int) -> tuple[Hold, ...]:
    """Return the holds of the counters every transition of ``event`` moves by ``step``."""
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


def _unpaired(system: System, event: str, key: Hold) -> str:
    """Describe a give-back of ``key`` by ``event`` that no event acquires."""
    counter, regions = key
    composed = len(system.regions) > 1
    where = f" of {', '.join(regions)}" if composed else ""
    adds = "; ".join(
        f"{name} adds {' or '.join(map(str, steps))}"
        + (f" in {', '.join(system.regions_of(name))}" if composed else "")
        for name, steps in _additions(system, counter).items()
    )
    return (
        f"{counter}: {event} gives back one, but no event{where} takes one "
        f"({adds or 'nothing adds to it'}): its acquires and releases do not pair"
    )


def _additions(system: System, counter: str) -> dict[str, list[int]]:
    """Return each event that adds to ``counter``, with the amounts it adds, in spec order."""
    out: dict[str, list[int]] = {}
    for _, machine in system.regions:
        for t in machine.transitions:
            for a in t.update.assigns:
                if a.counter == counter and a.delta() > 0:
                    steps = out.setdefault(t.event, [])
                    if a.delta() not in steps:
                        steps.append(a.delta())
    return out
