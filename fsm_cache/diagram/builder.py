"""Build the diagram IR from a spec: the one module of the package that reads spec objects.

Every picture in the docs is rendered from the same spec objects the engine
runs, so a diagram cannot say anything the runtime does not do. The renderers
never see those objects: :func:`build` copies what they draw into a
:class:`~fsm_cache.diagram.ir.Diagram`, in a stable order (states as declared,
edges and refusals by source state, then by declaration), so the committed
diagram files change only when the spec does.
"""

from __future__ import annotations

from fsm_cache.diagram.ir import (
    Diagram,
    DiagramBirth,
    DiagramEdge,
    DiagramRefusal,
    DiagramState,
    Region,
)
from fsm_cache.spec.machine import Birth, Forbid, MachineSpec, Spec, System


def build(spec: Spec) -> Diagram:
    """Return the diagram of a machine or a composition.

    A machine on its own is one region named ``state``; a composition keeps its
    region names, its own forbids become the diagram's cross-region refusals,
    and its births are drawn beside each region's initial state.
    """
    if isinstance(spec, MachineSpec):
        return Diagram(spec.name, spec.doc, False, (_region("state", spec),))
    regions = tuple(_region(name, machine) for name, machine in spec.regions)
    refusals = tuple(_cross_refusal(spec, f) for f in spec.forbids)
    births = tuple(_birth(spec, b) for b in spec.births)
    return Diagram(spec.name, spec.doc, True, regions, refusals, births)


def _birth(spec: System, birth: Birth) -> DiagramBirth:
    # Every region's state at the birth, so each region draws where the record starts.
    named = dict(birth.states)
    states = tuple((region, named.get(region, m.initial)) for region, m in spec.regions)
    return DiagramBirth(birth.name, birth.doc, states)


def _cross_refusal(spec: System, forbid: Forbid) -> DiagramRefusal:
    # A composition forbid's sources are states of the first region declaring its event.
    if not forbid.sources:
        return _refusal("", forbid)
    owner = spec.regions_of(forbid.event)[0]
    return _refusal(f"{owner} in [{', '.join(forbid.sources)}]", forbid)


def _region(name: str, machine: MachineSpec) -> Region:
    order = {state: i for i, state in enumerate(machine.state_names)}
    states = tuple(
        DiagramState(
            s.name,
            f"{s.name}({s.counter})" if s.counter else s.name,
            s.doc,
            str(s.invariant),
            s.name == machine.initial,
            s.final,
        )
        for s in machine.states
    )
    moves = sorted(
        ((order[src], i, src, t) for i, t in enumerate(machine.transitions) for src in t.sources),
        key=lambda move: move[:2],
    )
    edges = tuple(
        DiagramEdge(
            src, t.dest, t.event, str(t.guard), str(t.update), t.effect or "", t.propagate or ""
        )
        for _, _, src, t in moves
    )
    pairs = sorted(
        ((order[src], i, src, f) for i, f in enumerate(machine.forbids) for src in f.sources),
        key=lambda pair: pair[:2],
    )
    refusals = tuple(_refusal(src, f) for _, _, src, f in pairs)
    return Region(name, machine.name, machine.doc, states, edges, refusals)


def _refusal(state: str, forbid: Forbid) -> DiagramRefusal:
    when = " and ".join(str(c) for c in forbid.when)
    return DiagramRefusal(state, forbid.event, str(forbid.guard), when, forbid.error, forbid.reason)
