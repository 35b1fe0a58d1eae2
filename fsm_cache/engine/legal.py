"""Which records can exist: the region states a spec's runs reach, and the counts each allows.

A record handed to the engine is only as good as the states and counters it
starts with: a ``pinned`` host with no pins would let two releases drive the
count to -2, since the engine trusts each state's invariant (its fast paths
write ``pins = 0`` on the last release without reading). So whoever builds a
record from a caller's states and counts asks :class:`Legal` first.

Everything is derived from the spec, never restated: the states each region
declares, each state's counter ``invariant`` (a state drawn ``pinned(pins)``
carries ``pins >= 1``), counters that are never negative (validation's safety
rule), and the combinations of region states that some run of the spec
reaches from a birth. The last is what the composition's cross-region
refusals decide: ``write`` is refused without a device copy and
``evict_device`` while a backup reads it, so no run has a host ``writing``
beside a device ``absent``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from fsm_cache.spec.machine import MachineSpec, System
from fsm_cache.spec.meaning import step


States = tuple[str, ...]
"""One state per region, in region order."""
Point = tuple[States, tuple[int, ...]]
"""A record as reachability sees it: its states, then its counters in declaration order,
each capped at its :func:`ceilings` value."""


def unknown_state(region: str, machine: MachineSpec, state: object) -> str | None:
    """Return why ``state`` is not a state of ``region``'s machine, or None if it is."""
    if isinstance(state, str) and state in machine.state_names:
        return None
    known = ", ".join(machine.state_names)
    return f"{region} {state!r} is not a state of {machine.name} ({known})"


def ceilings(system: System) -> dict[str, int]:
    """Return, per counter, a value from which up every comparison the spec makes answers alike.

    One more than the largest constant the counter is compared with (or starts
    at): every guard, invariant and refusal then holds of all values from the
    ceiling up or of none, so the ceiling stands for all of them.
    """
    guards = [forbid.guard for forbid in system.forbids]
    for _, machine in system.regions:
        guards += [state.invariant for state in machine.states]
        guards += [t.guard for t in machine.transitions] + [f.guard for f in machine.forbids]
    top = {name: max(value, 0) + 1 for name, value in system.counters}
    for term in (term for guard in guards for term in guard.terms):
        if term.counter in top:
            top[term.counter] = max(top[term.counter], term.value + 1)
    return top


def reachable(system: System) -> frozenset[Point]:
    """Return every record some run of ``system`` reaches: its states and capped counters.

    A run starts at a birth (every region's initial state, or a declared
    birth, with the initial counters) and fires events as the spec's reference
    semantics (:func:`~fsm_cache.spec.meaning.step`) takes them. Counters are
    capped at their :func:`ceilings`, where the cap stands for every value from
    it up: a step down from the cap may land anywhere between its result and
    the cap. Tree rules are read for a record with no parent and no children,
    where none of them refuses. Both keep the search finite and only add
    records, so one left out is reached by no run in any tree.
    """
    regions = [region for region, _ in system.regions]
    names, top = [name for name, _ in system.counters], ceilings(system)
    births = [system.born(None), *(system.born(b.name) for b in system.births)]
    initial = tuple(min(value, top[name]) for name, value in system.counters)
    seen = {(tuple(born[r] for r in regions), initial) for born in births}
    frontier = list(seen)
    while frontier:
        states, counts = frontier.pop()
        here = dict(zip(regions, states, strict=True))
        values = dict(zip(names, counts, strict=True))
        for event in system.event_names:
            outcome = step(system, event, here, values)
            if outcome[0] != "":
                continue
            after = tuple(str(s) for s in outcome[1 : len(regions) + 1])
            moved = [int(str(v)) for v in outcome[len(regions) + 1 :]]
            for point in _spread(after, counts, moved, [top[n] for n in names]):
                if point not in seen:
                    seen.add(point)
                    frontier.append(point)
    return frozenset(seen)


def _spread(
    states: States, before: tuple[int, ...], after: list[int], top: list[int]
) -> Iterator[Point]:
    """Yield the capped records a step to ``states`` and ``after`` stands for.

    A counter at its cap stands for every value from it up, so a step that
    lowers it lands anywhere from its result up to the cap.
    """
    choices = [
        range(value, cap + 1) if was == cap and value < cap else (min(value, cap),)
        for was, value, cap in zip(before, after, top, strict=True)
    ]
    for counts in itertools.product(*choices):
        yield states, counts


@dataclass(frozen=True)
class Legal:
    """The records a system allows: known states, counts their invariants allow, reachable.

    Attributes:
        system: The system the records run on.
        reached: Every record some run reaches, counters capped (:func:`reachable`).
        top: Each counter's cap (:func:`ceilings`).
    """

    system: System
    reached: frozenset[Point]
    top: Mapping[str, int]

    @classmethod
    def of(cls, system: System) -> Legal:
        """Return the legal records of ``system``, its reachable records searched once."""
        return cls(system, reachable(system), ceilings(system))

    def problem(self, states: Mapping[str, object], counters: Mapping[str, object]) -> str | None:
        """Return why no record could be in ``states`` with ``counters``, or None if one can.

        Args:
            states: State by region; a region left out is in its initial state.
            counters: Value by counter; a counter left out has its initial value.

        Returns:
            The first problem, naming the region or counter and its value: an
            unknown region, counter or state, a count that is no int >= 0 or
            that its state's invariant forbids, or a record no run reaches.
        """
        system = self.system
        stray = (set(states) - set(system.machines)) or (set(counters) - set(self.top))
        if stray:
            return f"{sorted(map(repr, stray))[0]} is no region or counter of {system.name}"
        full = {region: states.get(region, m.initial) for region, m in system.regions}
        values = {name: counters.get(name, v) for name, v in system.counters}
        found = self._state_problem(full) or _count_problem(values)
        if found is not None:
            return found
        # Checked just above: every state is one of its machine's, every count an int.
        named, counts = cast("dict[str, str]", full), cast("dict[str, int]", values)
        return self._invariant_problem(named, counts) or self._reach_problem(named, counts)

    def _state_problem(self, states: Mapping[str, object]) -> str | None:
        for region, machine in self.system.regions:
            found = unknown_state(region, machine, states[region])
            if found is not None:
                return found
        return None

    def _invariant_problem(
        self, states: Mapping[str, str], values: Mapping[str, int]
    ) -> str | None:
        for region, machine in self.system.regions:
            invariant = machine.state(states[region]).invariant
            if not invariant.holds(values):
                shown = ", ".join(f"{c}={values[c]}" for c in machine.counter_names)
                return f"{region} {states[region]} requires {invariant}, got {shown}"
        return None

    def _reach_problem(self, states: Mapping[str, str], values: Mapping[str, int]) -> str | None:
        combination = tuple(states.values())
        capped = tuple(min(value, self.top[name]) for name, value in values.items())
        if (combination, capped) in self.reached:
            return None
        where = ", ".join(f"{region} {state}" for region, state in states.items())
        if any(point[0] == combination for point in self.reached):
            where += " with " + ", ".join(f"{name}={value}" for name, value in values.items())
        return f"no run of {self.system.name} reaches {where}"


def _count_problem(values: Mapping[str, object]) -> str | None:
    """Return why a counter's value is not an int >= 0 (bools are not counts), or None."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name} must be an int >= 0, got {value!r}"
    return None
