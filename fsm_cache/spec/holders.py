"""Holder kinds: which events acquire and which give back each counter, read from the spec.

Two readers ask this one classification: the model checker, which keeps ghost
counts of what clients hold at each node (:mod:`fsm_cache.modelcheck.state`),
and :meth:`~fsm_cache.engine.core.Engine.lease`, which hands out a lease only
when its release gives back what its acquire takes. It lives here, below both,
so that the two read one rule. Only some counters count holders
(:attr:`Holders.counts`): one some event gives back, or one a state carries
(``counter = "pins"``, drawn ``pinned(N)``: one state per holder count, as
:mod:`fsm_cache.engine.holds` reads it). A counter only ever raised or set
(tokens emitted, retries, a generation) counts events, not holders: nothing
gives it back, so it is neither accounted to holders (invariant 6) nor
owed back (liveness).

An event is judged by what its steps do to the counter, as the spec's own
meaning computes them (:func:`changes`), not by how its updates are
spelled: ``holders = 1`` from a state whose invariant pins ``holders == 0``
adds one, and ``holders = 0`` guarded by ``holders == 1`` subtracts one. On
a holder count, an event every step of which adds one acquires it; one
every step of which subtracts one gives it back. A give-back may also be
accepted where the count is 0, changing nothing: it gives back what nobody
holds, and the checker reports it where it is accepted
(:meth:`~fsm_cache.modelcheck.state.Layout.unheld`) rather than taking the
event for no give-back at all.
Holders are told apart by the regions their events are declared in: a
``load`` (host and device) is given back by ``load_done`` (host and device),
never by ``release`` (host only), so a client gives back only what it holds.

A give-back whose kind no event acquires cannot be paired with any hold (say
``take`` adds two and ``give`` subtracts one: one take and one give leave the
counter at one, held by nobody). That is a finding about the spec, reported
before anything is explored (:attr:`Holders.unpaired`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsm_cache.spec.changes import Change, changes
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
        uneven: Per counter of :attr:`counts`, the events that move it by
            other steps than one up or one down alike (``readers = 0`` from
            any count): counted as neither an acquire nor a give-back, which
            a finding of the holders' account says.
    """

    counts: tuple[str, ...]
    acquires: dict[str, tuple[Hold, ...]]
    releases: dict[str, tuple[Hold, ...]]
    kinds: tuple[Hold, ...]
    propagating: frozenset[str]
    unpaired: tuple[str, ...]
    uneven: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, system: System) -> Holders:
        """Return the holder kinds of ``system``."""
        moves = {event: _event_changes(system, event) for event in system.event_names}
        releases = {event: _moved(system, event, moves[event], -1) for event in moves}
        given = {key[0] for keys in releases.values() for key in keys}
        carried = {s.counter for _, m in system.regions for s in m.states if s.counter}
        counts = tuple(c for c, _ in system.counters if c in given | carried)
        acquires = {
            event: tuple(k for k in _moved(system, event, moves[event], 1) if k[0] in counts)
            for event in moves
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
        uneven = {
            name: tuple(
                event
                for event, by_region in moves.items()
                if any(_uneven(found.get(name, set())) for found in by_region.values())
            )
            for name in counts
        }
        return cls(counts, acquires, paired, kinds, propagating, unpaired, uneven)

    def givers(self, acquire: str) -> tuple[str, ...]:
        """Return the events that give back exactly what ``acquire`` takes, in declaration order.

        The rule a lease is held to: :meth:`~fsm_cache.engine.core.Engine.lease`
        pairs ``acquire`` only with one of these, and its ``release(event)``
        fires only one of these. Empty where ``acquire`` takes no hold, or no
        event gives back what it takes. ``acquire`` must be an event of the spec.
        """
        takes = set(self.acquires[acquire])
        if not takes:
            return ()
        return tuple(event for event, keys in self.releases.items() if set(keys) == takes)

    def acquirers(self, key: Hold) -> str:
        """Return the events that acquire hold ``key``, as messages name its holders (``pin``)."""
        return "/".join(event for event, keys in self.acquires.items() if key in keys)


def _event_changes(system: System, event: str) -> dict[str, dict[str, set[Change]]]:
    """Return :func:`changes` of ``event`` in each region that declares it."""
    return {region: changes(system.machines[region], event) for region in system.regions_of(event)}


def _moved(
    system: System, event: str, moves: dict[str, dict[str, set[Change]]], step: int
) -> tuple[Hold, ...]:
    """Return the holds of the counters every step of ``event`` moves by ``step`` (see :func:`_steps_by`)."""
    return tuple(
        (name, system.regions_of(event))
        for region, by_counter in moves.items()
        for name, found in by_counter.items()
        if _steps_by(found, step)
    )


def _steps_by(found: set[Change], step: int) -> bool:
    """Whether the steps ``found`` move a counter by ``step``, and at least one does.

    A give-back (``step`` -1) may also leave a count of 0 as it is: accepted
    with nothing held, which the checker reports where it can happen.
    """
    moving = [change for before, change in found if not (step < 0 and before == change == 0)]
    return bool(moving) and all(change == step for change in moving)


def _uneven(found: set[Change]) -> bool:
    """Whether the steps ``found`` move a counter, but not all by one up or all by one down."""
    moving = [change for _, change in found if change != 0]
    return bool(moving) and not (_steps_by(found, 1) or _steps_by(found, -1))


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
