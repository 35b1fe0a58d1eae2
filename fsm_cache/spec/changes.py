"""How each step of an event moves a machine's counters, read from the spec's own meaning.

The model checker (which events acquire and give back holders) and the
contracts (``changes ... by exactly``) both ask this; it lives here, below
both, so the two read one rule.
"""

from __future__ import annotations

from fsm_cache.spec.machine import MachineSpec, Transition
from fsm_cache.spec.meaning import region_step
from fsm_cache.spec.validate import allowed, representatives


Change = tuple[int, int | None]
"""``(value before, change)`` of one counter in one step; the change None where the step
assigns the counter a value that is not one amount away from every value it stands for."""


def changes(machine: MachineSpec, event: str) -> dict[str, set[Change]]:
    """Return how the steps of ``event`` that ``machine`` accepts move each of its counters.

    Each state's representative valuations (:func:`~fsm_cache.spec.validate.valuations`,
    those its invariant allows, drawn by :func:`~fsm_cache.spec.validate.allowed`
    from the representatives computed once per state) are stepped by the spec's
    own meaning (:func:`~fsm_cache.spec.meaning.region_step`); a refusal is no step. A
    representative stands for a class of values no guard tells apart, so an
    increment moves the whole class alike, but an assignment (``holders = 1``)
    adds one amount only where the class is that one value (the invariant or
    the guard pins it): elsewhere its change is None.
    """
    out: dict[str, set[Change]] = {name: set() for name in machine.counter_names}
    for state in machine.states:
        reps = representatives(machine, state.invariant)
        for values in allowed(machine.counter_names, reps, state.invariant):
            taken = region_step(machine, event, state.name, values)
            if not isinstance(taken, Transition):
                continue
            after = taken.update.apply(values)
            for name, before in values.items():
                # A class of one value is followed by the next representative.
                pinned = before + 1 in reps[name]
                assigned = any(a.counter == name and a.op == "=" for a in taken.update.assigns)
                change = None if assigned and not pinned else after[name] - before
                out[name].add((before, change))
    return out
