"""Diagrams generated from specs: Mermaid, Graphviz DOT, SVG and Markdown tables.

A spec becomes a small, renderer-neutral :class:`Diagram` (regions of states,
edges and refusals, in a stable order), and each format is one function of
that diagram: :mod:`fsm_cache.diagram.mermaid`, :mod:`fsm_cache.diagram.dot` (DOT and
SVG) and :mod:`fsm_cache.diagram.markdown` (Markdown). Every picture in the docs is rendered from the same spec objects
the engine runs, so a diagram cannot say anything the runtime does not do.

Conventions shared by all formats: an edge reads ``event [guard] / update``;
a state that carries a counter is one state drawn as ``pinned(pins)``; the
initial state is entered from a start point and final states lead to an end
point; a composition draws each region as a composite state, side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fsm_cache.errors import FsmCacheError
from fsm_cache.spec.machine import Forbid, MachineSpec, Spec, System


FORMATS = ("mermaid", "dot", "svg", "md")
HIGHLIGHT_FILL = "#ffd54f"
HIGHLIGHT_STROKE = "#e65100"


class DiagramError(FsmCacheError):
    """A diagram cannot be made: unknown format or state, or Graphviz is missing for SVG."""


@dataclass(frozen=True)
class Node:
    """One state as drawn: ``label`` shows its counter, e.g. ``pinned(pins)``."""

    name: str
    label: str
    doc: str
    invariant: str
    initial: bool
    final: bool


@dataclass(frozen=True)
class Edge:
    """One move of ``event`` from ``source`` to ``dest`` (a transition has one per source)."""

    source: str
    dest: str
    event: str
    guard: str
    update: str
    effect: str
    propagate: str

    @property
    def label(self) -> str:
        """The edge text, ``event [guard] / update``."""
        guard = f" [{self.guard}]" if self.guard else ""
        update = f" / {self.update}" if self.update else ""
        return f"{self.event}{guard}{update}"


@dataclass(frozen=True)
class Refusal:
    """A refused pair: ``event`` in ``state`` raises ``error``.

    For a composition's refusal, ``state`` is a condition on the region owning the
    event (``host in [backed]``), or empty for any state.
    """

    state: str
    event: str
    guard: str
    when: str
    error: str
    reason: str


@dataclass(frozen=True)
class Region:
    """One machine as drawn, in its region of a composition (``state`` when alone)."""

    name: str
    machine: str
    doc: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    refusals: tuple[Refusal, ...]


@dataclass(frozen=True)
class Diagram:
    """What every renderer draws: regions, cross-region refusals and highlighted states.

    Attributes:
        name: The spec's name.
        doc: What the spec models.
        composed: Whether the spec is a composition (regions drawn as composite states).
        regions: The machines, in region order.
        refusals: The composition's cross-region and tree refusals.
        highlight: ``(region, state)`` pairs to mark, e.g. where a node was.
    """

    name: str
    doc: str
    composed: bool
    regions: tuple[Region, ...]
    refusals: tuple[Refusal, ...] = ()
    highlight: frozenset[tuple[str, str]] = frozenset()


def build(spec: Spec) -> Diagram:
    """Return the diagram of a machine or a composition."""
    if isinstance(spec, MachineSpec):
        return Diagram(spec.name, spec.doc, False, (_region("state", spec),))
    regions = tuple(_region(name, machine) for name, machine in spec.regions)
    refusals = tuple(_cross_refusal(spec, f) for f in spec.forbids)
    return Diagram(spec.name, spec.doc, True, regions, refusals)


def _cross_refusal(spec: System, forbid: Forbid) -> Refusal:
    # A composition forbid's sources are states of the first region declaring its event.
    if not forbid.sources:
        return _refusal("", forbid)
    owner = spec.regions_of(forbid.event)[0]
    return _refusal(f"{owner} in [{', '.join(forbid.sources)}]", forbid)


def _region(name: str, machine: MachineSpec) -> Region:
    order = {state: i for i, state in enumerate(machine.state_names)}
    nodes = tuple(
        Node(
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
        Edge(src, t.dest, t.event, str(t.guard), str(t.update), t.effect or "", t.propagate or "")
        for _, _, src, t in moves
    )
    pairs = sorted(
        ((order[src], i, src, f) for i, f in enumerate(machine.forbids) for src in f.sources),
        key=lambda pair: pair[:2],
    )
    refusals = tuple(_refusal(src, f) for _, _, src, f in pairs)
    return Region(name, machine.name, machine.doc, nodes, edges, refusals)


def _refusal(state: str, forbid: Forbid) -> Refusal:
    when = " and ".join(str(c) for c in forbid.when)
    return Refusal(state, forbid.event, str(forbid.guard), when, forbid.error, forbid.reason)


def highlight(diagram: Diagram, where: str) -> Diagram:
    """Return ``diagram`` with one state marked, named ``STATE`` or ``REGION=STATE``.

    Raises:
        DiagramError: No such region or state, or a bare state name is ambiguous.
    """
    region_name, _, state = where.rpartition("=")
    found = [
        (r.name, state)
        for r in diagram.regions
        if region_name in ("", r.name) and state in (n.name for n in r.nodes)
    ]
    if len(found) != 1:
        known = ", ".join(f"{r.name}={n.name}" for r in diagram.regions for n in r.nodes)
        why = "is ambiguous" if found else "names no state"
        msg = f"{diagram.name}: highlight {where!r} {why}; known: {known}"
        raise DiagramError(msg)
    return replace(diagram, highlight=diagram.highlight | {found[0]})


# -- shared by the renderers --------------------------------------------------


def parallel(region: Region) -> dict[tuple[str, str], list[str]]:
    """Group edge labels by (source, dest), in edge order.

    Both Mermaid and Graphviz draw parallel edges and self-loops on top of each
    other, hiding labels; one edge per pair of states, one line per move, keeps
    every label readable.
    """
    pairs: dict[tuple[str, str], list[str]] = {}
    for edge in region.edges:
        pairs.setdefault((edge.source, edge.dest), []).append(edge.label)
    return pairs


def state_id(diagram: Diagram, region: str, state: str) -> str:
    """Return a state's identifier in a rendering (region-qualified when composed)."""
    return f"{region}_{state}" if diagram.composed else state


def condition_text(refusal: Refusal) -> str:
    """Return ``state and when and guard``: the condition under which ``refusal`` applies."""
    return " and ".join(part for part in (refusal.state, refusal.when, refusal.guard) if part)


def refusal_line(refusal: Refusal) -> str:
    """Return ``event when condition: error``, one line per cross-region refusal."""
    return f"{refusal.event} when {condition_text(refusal)}: {refusal.error}"


def _renderers() -> dict[str, Callable[[Diagram], str]]:
    # The format modules build on this one, so they are imported when used.
    from fsm_cache.diagram import dot as graphviz
    from fsm_cache.diagram import markdown as tables
    from fsm_cache.diagram import mermaid

    return {
        "mermaid": mermaid.mermaid,
        "dot": graphviz.dot,
        "svg": graphviz.svg,
        "md": tables.markdown_tables,
    }


def render(spec: Spec, fmt: str, *, mark: tuple[str, ...] = ()) -> str:
    """Render ``spec`` in ``fmt`` (one of :data:`FORMATS`), highlighting the states in ``mark``.

    Raises:
        DiagramError: Unknown format or highlighted state, or no Graphviz for SVG.
    """
    renderer = _renderers().get(fmt)
    if renderer is None:
        msg = f"unknown diagram format {fmt!r} (known: {', '.join(FORMATS)})"
        raise DiagramError(msg)
    diagram = build(spec)
    for where in mark:
        diagram = highlight(diagram, where)
    return renderer(diagram)
