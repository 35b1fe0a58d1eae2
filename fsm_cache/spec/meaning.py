"""The meaning of one step, computed by interpreting the spec objects.

This is the reference the contracts compare the engine's generated code
against: it reads :class:`~fsm_cache.spec.machine.Transition` and
:class:`~fsm_cache.spec.machine.Forbid` objects directly and never looks at generated
source. It follows the engine's documented precedence: regions in order; in
each region the state's refusals first, in declaration order (a refusal with
no guard refuses outright), then its transitions by guard; then the
composition's refusals in order. The
first refusal wins and a refused step changes nothing.

Pure Python over plain dicts and strings, so CrossHair can execute it
symbolically with symbolic counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsm_cache.spec.guards import Condition
from fsm_cache.spec.machine import GUARDS_FAIL, Forbid, MachineSpec, System, Transition


Outcome = tuple[object, ...]
"""``(error, *region states, *counters)``; ``error`` is ``""`` when the step is taken."""

Refused = tuple[str, str, str, str, tuple[str, ...]]
"""A refusal as the engine raises it: ``(error class name, region, event, reason, others)``.

``region`` is the region whose state and counters its message shows, ``others``
the other regions of the record a composition's rule reads, whose states it
names after them (:meth:`~fsm_cache.spec.machine.Forbid.others`): with the
record, they make its whole message
(``node 17: release refused in backed (pins=0): <reason>``)."""

View = Mapping[str, str]
"""Region states of a record seen from a neighbour (its parent or a child)."""


def step(
    system: System,
    event: str,
    states: Mapping[str, str],
    counters: Mapping[str, int],
    *,
    parent: View | None = None,
    children: Sequence[View] = (),
) -> Outcome:
    """Return what ``event`` does to one record, as the spec says.

    Args:
        system: The spec.
        event: The event fired.
        states: The record's state per region.
        counters: The record's counters.
        parent: The parent's region states, or None at the top of the tree.
        children: The children's region states.

    Returns:
        ``(error, *states, *counters)`` in region and counter declaration
        order: the refusal's error class name and the unchanged record, or
        ``""`` and the record after the step.
    """
    refused, *record = explained(system, event, states, counters, parent=parent, children=children)
    return (refused[0] if isinstance(refused, tuple) and refused else "", *record)


def explained(
    system: System,
    event: str,
    states: Mapping[str, str],
    counters: Mapping[str, int],
    *,
    parent: View | None = None,
    children: Sequence[View] = (),
) -> Outcome:
    """Return :func:`step`'s outcome with the whole refusal in place of its error class.

    The contracts compare the engine's code with this: a refusal of the right
    class with another reason, or shown in another region, is a wrong step.

    Returns:
        ``(refusal, *states, *counters)``: the :data:`Refused` and the
        unchanged record, or ``()`` and the record after the step.
    """
    new_states = dict(states)
    new_counters = dict(counters)
    for region in system.regions_of(event):
        found = region_step(system.machines[region], event, states[region], counters)
        if not isinstance(found, Transition):
            error, reason = found
            return _shaped(system, (error, region, event, reason, ()), states, counters)
        new_states[region] = found.dest
        for assign in found.update.assigns:
            new_counters[assign.counter] = assign.apply(counters[assign.counter])
    owner = system.regions_of(event)[0]
    forbid = composed_refusal(system, event, states, counters, parent=parent, children=children)
    if forbid is not None:
        refusal = (forbid.error, owner, event, forbid.reason, forbid.others(owner))
        return _shaped(system, refusal, states, counters)
    return _shaped(system, (), new_states, new_counters)


def composed_refusal(
    system: System,
    event: str,
    states: Mapping[str, str],
    counters: Mapping[str, int],
    *,
    parent: View | None = None,
    children: Sequence[View] = (),
) -> Forbid | None:
    """Return the first of the composition's refusals of ``event`` that holds, or None.

    The last check of :func:`explained`, read on its own: a caller that knows a
    region's refusal has a more precise cause across regions (a host copy
    pinned by a load, not by a holder) can name it. Arguments as :func:`step`'s.
    """
    owner = system.regions_of(event)[0]
    for forbid in system.forbids_for(event):
        if _refuses(forbid, owner, states, counters, (parent, children)):
            return forbid
    return None


def region_step(
    machine: MachineSpec, event: str, state: str, counters: Mapping[str, int]
) -> Transition | tuple[str, str]:
    """Return the transition ``event`` takes in one region, or the refusal's error name and reason."""
    transitions = list(machine.transitions_for(state, event))
    forbids = list(machine.forbids_for(state, event))
    if not transitions and not forbids:
        return machine.unanswered(state, event)
    for forbid in forbids:
        if forbid.guard.holds(counters):
            return forbid.error, forbid.reason
    for tr in transitions:
        if tr.guard.holds(counters):
            return tr
    return GUARDS_FAIL


def condition_holds(
    cond: Condition, states: Mapping[str, str], parent: View | None, children: Sequence[View]
) -> bool:
    """Return whether a ``when`` condition holds for a record and its neighbours."""
    if cond.scope == "self":
        return states[cond.region] in cond.states
    if cond.scope == "parent":
        return parent is not None and parent[cond.region] in cond.states
    return any(child[cond.region] in cond.states for child in children)


def _refuses(
    forbid: Forbid,
    owner: str,
    states: Mapping[str, str],
    counters: Mapping[str, int],
    around: tuple[View | None, Sequence[View]],
) -> bool:
    parent, children = around
    if not all(condition_holds(c, states, parent, children) for c in forbid.when):
        return False
    if forbid.sources and states[owner] not in forbid.sources:
        return False
    return forbid.guard.holds(counters)


def _shaped(
    system: System, error: object, states: Mapping[str, str], counters: Mapping[str, int]
) -> Outcome:
    return (
        error,
        *(states[region] for region, _ in system.regions),
        *(counters[name] for name, _ in system.counters),
    )
