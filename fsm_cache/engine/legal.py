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
beside a device ``absent``. The search of those runs is the spec layer's
(:mod:`fsm_cache.spec.reach`), which validation reads too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from fsm_cache.numeric import whole
from fsm_cache.spec.machine import MachineSpec, System
from fsm_cache.spec.reach import Point, runs


def unknown_state(region: str, machine: MachineSpec, state: object) -> str | None:
    """Return why ``state`` is not a state of ``region``'s machine, or None if it is."""
    if isinstance(state, str) and state in machine.state_names:
        return None
    known = ", ".join(machine.state_names)
    return f"{region} {state!r} is not a state of {machine.name} ({known})"


@dataclass(frozen=True)
class Legal:
    """The records a system allows: known states, counts their invariants allow, reachable.

    Attributes:
        system: The system the records run on.
        reached: Every record some run reaches, counters capped
            (:func:`~fsm_cache.spec.reach.runs`).
        top: Each counter's cap (:func:`~fsm_cache.spec.reach.ceilings`).
        complete: Whether the search saw every record (it stops at
            :data:`~fsm_cache.spec.reach.RECORD_LIMIT`).
    """

    system: System
    reached: frozenset[Point]
    top: Mapping[str, int]
    complete: bool = True

    @classmethod
    def of(cls, system: System) -> Legal:
        """Return the legal records of ``system``, from the search validation made.

        :func:`~fsm_cache.spec.reach.runs` searches each system once, so a
        spec loaded (and so validated) is not searched again here. The search
        stops at :data:`~fsm_cache.spec.reach.RECORD_LIMIT` records; past it,
        no record is called unreachable.
        """
        found = runs(system)
        return cls(system, found.points, found.top, found.complete)

    def problem(self, states: Mapping[str, object], counters: Mapping[str, object]) -> str | None:
        """Return why no record could be in ``states`` with ``counters``, or None if one can.

        Args:
            states: State by region; a region left out is in its initial state.
            counters: Value by counter; a counter left out has its initial value.

        Returns:
            The first problem, naming the region or counter and its value: the
            unknown regions and counters, all of them in one line (in the order
            given, regions first); an unknown state, a count that is no int >= 0
            or that its state's invariant forbids, or a record no run reaches.
        """
        system = self.system
        stray = [name for name in states if name not in system.machines]
        stray += [name for name in counters if name not in self.top and name not in stray]
        if stray:
            return self._stray_problem(stray)
        full = {region: states.get(region, m.initial) for region, m in system.regions}
        values = {name: counters.get(name, v) for name, v in system.counters}
        found = self._state_problem(full) or _count_problem(values)
        if found is not None:
            return found
        # Checked just above: every state is one of its machine's, every count an int.
        named, counts = cast("dict[str, str]", full), cast("dict[str, int]", values)
        return self._invariant_problem(named, counts) or self._reach_problem(named, counts)

    def _stray_problem(self, stray: list[str]) -> str:
        """Name the names that are no region or counter, and those given as the other kind.

        A counter given as a region (or a region as a counter) is named as what
        it is, so the fix reads off the message.
        """
        system = self.system
        swapped = [
            f"{name!r} is a counter of {system.name}, not a region"
            if name in self.top
            else f"{name!r} is a region of {system.name}, not a counter"
            for name in stray
            if name in self.top or name in system.machines
        ]
        unknown = [name for name in stray if name not in self.top and name not in system.machines]
        if unknown:
            names = ", ".join(map(repr, unknown))
            what = "is no region or counter" if len(unknown) == 1 else "are no regions or counters"
            swapped.append(f"{names} {what} of {system.name}")
        return "; ".join(swapped)

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
        if (combination, capped) in self.reached or not self.complete:
            return None
        where = ", ".join(f"{region} {state}" for region, state in states.items())
        if any(point[0] == combination for point in self.reached):
            where += " with " + ", ".join(f"{name}={value}" for name, value in values.items())
        return f"no run of {self.system.name} reaches {where}"


def _count_problem(values: Mapping[str, object]) -> str | None:
    """Return why a counter's value is not an int >= 0 (bools are not counts), or None."""
    for name, value in values.items():
        if not whole(value):
            return f"{name} must be an int >= 0, got {value!r}"
    return None
