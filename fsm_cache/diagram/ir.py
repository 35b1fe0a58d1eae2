"""The diagram IR: what every renderer draws, and helpers that read only it.

:func:`fsm_cache.diagram.builder.build` turns a spec into a small,
renderer-neutral :class:`Diagram` (regions of states, edges and refusals, in a
stable order). Each format is then one function of that diagram, in a module
that imports this one and nothing of the spec: :mod:`fsm_cache.diagram.mermaid`,
:mod:`fsm_cache.diagram.dot` (DOT and SVG) and :mod:`fsm_cache.diagram.markdown`.
Keeping the spec out of the renderers means a new format needs to learn only
these six classes, and a change to the spec model touches only the builder.

Conventions shared by all formats: an edge reads ``event [guard] / update``;
a state that carries a counter is one state drawn as ``pinned(pins)``; the
initial state is entered from a start point and final states lead to an end
point; a composition draws each region as a composite state, side by side, and
each of its births (a record created in other states) as a start of its own in
every region, labelled with the birth's name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsm_cache.errors import FsmCacheError


HIGHLIGHT_FILL = "#ffd54f"
HIGHLIGHT_STROKE = "#e65100"


class DiagramError(FsmCacheError):
    """A diagram cannot be made: unknown format or state, or Graphviz is missing for SVG."""


@dataclass(frozen=True, slots=True)
class DiagramState:
    """One state as drawn.

    Attributes:
        name: The state's name in its machine.
        label: The name as drawn, with its counter if it carries one, e.g. ``pinned(pins)``.
        doc: What the state means.
        invariant: The state's invariant, as the spec writes it.
        initial: Whether the machine starts here.
        final: Whether the machine ends here.
    """

    name: str
    label: str
    doc: str
    invariant: str
    initial: bool
    final: bool


@dataclass(frozen=True, slots=True)
class DiagramEdge:
    """One move of ``event`` from ``source`` to ``dest`` (a transition has one per source).

    Attributes:
        source: The state the move leaves.
        dest: The state the move enters.
        event: The event that makes the move.
        guard: The guard, or empty when there is none.
        update: The counter update, or empty when there is none.
        effect: The effect the move runs, or empty.
        propagate: The region the event is passed on to, or empty.
    """

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


@dataclass(frozen=True, slots=True)
class DiagramRefusal:
    """A refused pair: ``event`` in ``state`` raises ``error``.

    Attributes:
        state: The refusing state; for a composition's refusal, a condition on the
            region owning the event (``host in [backed]``), or empty for any state.
        event: The refused event.
        guard: The guard under which it is refused, or empty.
        when: The conditions on other regions, joined by ``and``, or empty.
        error: The error class the refusal raises.
        reason: Why the pair is refused, in words.
    """

    state: str
    event: str
    guard: str
    when: str
    error: str
    reason: str


@dataclass(frozen=True, slots=True)
class Region:
    """One machine as drawn, in its region of a composition (``state`` when alone).

    Attributes:
        name: The region's name, ``state`` for a machine on its own.
        machine: The machine's name.
        doc: What the machine models.
        states: Its states, in declaration order.
        edges: Its moves, by source state then transition order.
        refusals: Its refused pairs, by state then forbid order.
    """

    name: str
    machine: str
    doc: str
    states: tuple[DiagramState, ...]
    edges: tuple[DiagramEdge, ...]
    refusals: tuple[DiagramRefusal, ...]


@dataclass(frozen=True, slots=True)
class DiagramBirth:
    """A way a composition's record is born other than in every region's initial state.

    Attributes:
        name: The birth's name (``discovered``).
        doc: When records are born this way.
        states: ``(region, state)`` for every region, in region order: the state the
            birth names, or the region's initial state where it names none.
    """

    name: str
    doc: str
    states: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Diagram:
    """What every renderer draws: regions, cross-region refusals and highlighted states.

    Attributes:
        name: The spec's name.
        doc: What the spec models.
        composed: Whether the spec is a composition (regions drawn as composite states).
        regions: The machines, in region order.
        refusals: The composition's cross-region and tree refusals.
        births: The composition's births, in declaration order.
        highlight: ``(region, state)`` pairs to mark, e.g. where a node was.
    """

    name: str
    doc: str
    composed: bool
    regions: tuple[Region, ...]
    refusals: tuple[DiagramRefusal, ...] = ()
    births: tuple[DiagramBirth, ...] = ()
    highlight: frozenset[tuple[str, str]] = frozenset()


def highlight(diagram: Diagram, where: str) -> Diagram:
    """Return ``diagram`` with one state marked, named ``STATE`` or ``REGION=STATE``.

    Raises:
        DiagramError: No such region or state, or a bare state name is ambiguous.
    """
    region_name, _, state = where.rpartition("=")
    found = [
        (r.name, state)
        for r in diagram.regions
        if region_name in ("", r.name) and state in (s.name for s in r.states)
    ]
    if len(found) != 1:
        known = ", ".join(f"{r.name}={s.name}" for r in diagram.regions for s in r.states)
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


def births_in(diagram: Diagram, region: str) -> list[tuple[str, str]]:
    """Return ``(birth, state)`` for each birth of ``diagram``: where ``region`` starts by it."""
    return [(b.name, dict(b.states)[region]) for b in diagram.births]


# -- identifiers ---------------------------------------------------------------
#
# Every id below is built from spec names (:data:`fsm_cache.spec.machine.NAME`: an
# ASCII letter, then letters, digits and underscores) by ``_escaped``, which doubles
# each underscore, so that in an escaped name every run of underscores has even
# length and the name starts with a letter. A single ``_`` then joins a region to a
# state; start points and Mermaid's composite states begin with an underscore.


def _escaped(name: str) -> str:
    """Return ``name`` with each underscore doubled (a name without one is unchanged)."""
    return name.replace("_", "__")


def state_id(diagram: Diagram, region: str, state: str) -> str:
    """Return a state's identifier in a rendering: ``REGION_STATE`` when composed.

    Both names are escaped (each ``_`` doubled), so ``a.b_c`` is ``a_b__c`` and
    ``a_b.c`` is ``a__b_c``. The map is injective: a composed id holds exactly one
    run of underscores of odd length, made of the escaped region's trailing run
    plus the joining ``_`` (a state name starts with a letter), so the region is
    what precedes that run's last underscore and the state what follows it, each
    unescaped by halving its runs. It starts with a letter, so it is no start point
    (:func:`start_id`, :func:`birth_id`) nor Mermaid composite (:func:`composite_id`),
    which start with ``_``; and no Mermaid end point either (``root_start``,
    ``COMPOSITE_start``, ``COMPOSITE_end``): a machine's ids hold only even runs,
    a composite's implicit ones start with ``_``.
    """
    return f"{_escaped(region)}_{_escaped(state)}" if diagram.composed else _escaped(state)


def start_id(diagram: Diagram, region: str) -> str:
    """Return the id of a region's start point: ``__start_REGION``, ``__start`` when alone.

    After its ``__start`` prefix it holds an escaped region name or nothing, so it
    is injective and, starting with ``_``, never a state's id (:func:`state_id`).
    """
    return f"__start_{_escaped(region)}" if diagram.composed else "__start"


def birth_id(diagram: Diagram, region: str, birth: str) -> str:
    """Return the id of a birth's start point in a region: ``__birth_`` then ``REGION_BIRTH``.

    What follows the ``__birth_`` prefix is :func:`state_id`'s ``REGION_STATE`` with
    the birth for the state (the birth alone when not composed), so it is injective
    for the reason that one is; the prefix tells it from :func:`start_id` and, starting
    with ``_``, from every state's id.
    """
    return f"__birth_{state_id(diagram, region, birth)}"


def composite_id(region: str) -> str:
    """Return the Mermaid id of a region's composite state: ``_REGION``.

    Mermaid names a composite's start and end points ``ID_start`` and ``ID_end``:
    with the region's own escaped name for ``ID``, a state ``start`` of region
    ``host`` (``host_start``) would be that start point. A leading ``_`` keeps the
    composite, and both of its points, apart from every state (:func:`state_id`).
    """
    return f"_{_escaped(region)}"


def condition_text(refusal: DiagramRefusal) -> str:
    """Return ``state and when and guard``: the condition under which ``refusal`` applies."""
    return " and ".join(part for part in (refusal.state, refusal.when, refusal.guard) if part)


def refusal_line(refusal: DiagramRefusal) -> str:
    """Return ``event when condition: error``, one line per cross-region refusal."""
    return f"{refusal.event} when {condition_text(refusal)}: {refusal.error}"


def one_line(text: str) -> str:
    r"""Return ``text`` with each unprintable character escaped (``\n``, ``\x1b``): one line.

    Loading refuses a spec name with a line break (:func:`fsm_cache.spec.machine.bad_title`);
    renderers still pass names through this, so a diagram built some other way cannot
    inject lines into a Mermaid file or a Markdown document either.
    """
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
