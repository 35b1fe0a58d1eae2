"""Small random specs and trees for the engine's property tests.

The specs are built as objects, never validated: the engine compiles any
machine or composition, and a property that holds for every record whose
counters satisfy its states' invariants must hold for these too. They mix
what the code generator treats apart: one or two regions, a lone machine,
events shared by both regions, guards a state's invariant implies, plain and
guarded refusals, final states, updates that assign one counter twice,
effects, propagation to ancestors, and a composition's refusals that read the
other region, the parent and the children.

A tree is four records (root > mid > leaf, and a sibling of the leaf under
mid), each drawn in any declared state (now and then one no machine declares)
with counters its states' invariants allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from fsm_cache.engine.core import Engine
from fsm_cache.spec.guards import TRUE, Assign, Guard, Update, parse_condition, parse_guard
from fsm_cache.spec.machine import Forbid, MachineSpec, Spec, StateSpec, System, Transition


STATES = ("idle", "held", "busy", "gone")
EVENTS = ("go", "hold", "drop", "kick")
COUNTERS = (("n", "m"), ("p", "q"))
"""Each machine's counter names: a composition's two regions never share one."""
EFFECTS = ("fx_a", "fx_b")
ERRORS = ("Nope", "ReleaseAtZero", "IllegalTransition")
OPS = ("==", "!=", "<", "<=", ">", ">=")
UNDECLARED = "limbo"
"""A state no machine declares: a record written by hand."""


@st.composite
def guards(draw: st.DrawFn, counters: tuple[str, ...]) -> Guard:
    """Return no guard, or a conjunction of one or two comparisons of ``counters``."""
    if not counters or draw(st.booleans()):
        return TRUE
    terms = draw(
        st.lists(
            st.tuples(st.sampled_from(counters), st.sampled_from(OPS), st.integers(0, 2)),
            min_size=1,
            max_size=2,
        )
    )
    return parse_guard(" and ".join(f"{c} {op} {v}" for c, op, v in terms))


@st.composite
def updates(draw: st.DrawFn, counters: tuple[str, ...]) -> Update:
    """Return assignments to ``counters``; one counter may be assigned twice."""
    if not counters:
        return Update()
    assigns = draw(
        st.lists(
            st.builds(
                Assign,
                st.sampled_from(counters),
                st.sampled_from(("+=", "-=", "=")),
                st.integers(0, 2),
            ),
            max_size=2,
        )
    )
    return Update(tuple(assigns))


@st.composite
def invariants(draw: st.DrawFn, counters: tuple[str, ...]) -> Guard:
    """Return a state invariant that some value in 0..3 of each counter satisfies."""
    if not counters or draw(st.booleans()):
        return TRUE
    counter = draw(st.sampled_from(counters))
    return parse_guard(
        draw(st.sampled_from((f"{counter} == 0", f"{counter} >= 1", f"{counter} <= 2")))
    )


@st.composite
def machines(draw: st.DrawFn, index: int, events: tuple[str, ...]) -> MachineSpec:
    """Return a machine over some of ``events``, with states, counters and refusals drawn."""
    names = STATES[: draw(st.integers(2, len(STATES)))]
    counters = COUNTERS[index][: draw(st.integers(0, 2))]
    states = tuple(
        StateSpec(
            name,
            final=draw(st.sampled_from((False, False, False, True))),
            invariant=draw(invariants(counters)),
        )
        for name in names
    )
    transitions: list[Transition] = []
    forbids: list[Forbid] = []
    for event in events:
        for _ in range(draw(st.integers(0, 2))):
            transitions.append(
                Transition(
                    event,
                    tuple(
                        draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
                    ),
                    draw(st.sampled_from(names)),
                    guard=draw(guards(counters)),
                    update=draw(updates(counters)),
                    effect=draw(st.sampled_from((None, None, *EFFECTS))),
                    propagate=draw(st.sampled_from((None, None, "ancestors"))),
                )
            )
        if draw(st.integers(0, 3)) == 0 or not any(t.event == event for t in transitions):
            forbids.append(
                Forbid(
                    event,
                    tuple(draw(st.lists(st.sampled_from(names), max_size=2, unique=True))),
                    draw(st.sampled_from(ERRORS)),
                    f"{event} is refused here ({len(forbids)})",
                    guard=draw(guards(counters)),
                )
            )
    return MachineSpec(
        f"m{index}",
        names[0],
        tuple((c, draw(st.integers(0, 1))) for c in counters),
        states,
        tuple(transitions),
        tuple(forbids),
        label="job",
    )


@st.composite
def conditions(draw: st.DrawFn, regions: tuple[tuple[str, MachineSpec], ...]) -> str:
    """Return a ``when`` condition on this record's, the parent's or any child's region."""
    region, machine = draw(st.sampled_from(regions))
    scope = draw(st.sampled_from(("", "parent ", "any child ")))
    states = draw(
        st.lists(st.sampled_from(machine.state_names), min_size=1, max_size=2, unique=True)
    )
    return f"{scope}{region} in [{', '.join(states)}]"


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    """Return a lone machine, or a composition of one or two machines with refusals of its own."""
    first = draw(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=3, unique=True))
    one = draw(machines(0, tuple(first)))
    if draw(st.integers(0, 3)) == 0:
        return one
    regions: tuple[tuple[str, MachineSpec], ...] = (("a", one),)
    if draw(st.booleans()):
        second = draw(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=3, unique=True))
        regions += (("b", draw(machines(1, tuple(second)))),)
    events = tuple(dict.fromkeys(e for _, m in regions for e in m.event_names))
    forbids = []
    for i in range(draw(st.integers(0, 2))):
        event = draw(st.sampled_from(events))
        owner = next(m for _, m in regions if event in m.event_names)
        sources = draw(st.lists(st.sampled_from(owner.state_names), max_size=2, unique=True))
        when = draw(st.lists(conditions(regions), max_size=2))
        counters = tuple(c for _, m in regions for c in m.counter_names)
        forbids.append(
            Forbid(
                event,
                tuple(sources),
                draw(st.sampled_from(ERRORS)),
                f"the composition refuses {event} ({i})",
                guard=draw(guards(counters)),
                when=tuple(parse_condition(text) for text in when),
            )
        )
    return System("sys", regions, tuple(forbids), label="thing")


class Rec:
    """A tree record with every attribute the engine reads: parent and children too."""

    id: int
    trail: Any

    def __init__(self, engine: Engine, ident: int, parent: Rec | None) -> None:
        engine.init(self, ident)
        self.parent = parent
        self.children: dict[int, Rec] = {}
        if parent is not None:
            parent.children[ident] = self

    def __repr__(self) -> str:
        return f"Rec({self.id})"


@dataclass
class Tree:
    """Four records: root (1) > mid (2) > leaf (3), and sib (4) beside the leaf."""

    records: tuple[Rec, ...]


@st.composite
def trees(draw: st.DrawFn, engine: Engine) -> Tree:
    """Return a tree of ``engine``'s records in drawn states, each region's invariant kept."""
    root = Rec(engine, 1, None)
    mid = Rec(engine, 2, root)
    records = (root, mid, Rec(engine, 3, mid), Rec(engine, 4, mid))
    for rec in records:
        for region, machine in engine.system.regions:
            state = draw(st.sampled_from((*machine.states, None)))
            if state is None:
                setattr(rec, region, UNDECLARED)
                invariant = TRUE
            else:
                setattr(rec, region, state.name)
                invariant = state.invariant
            for counter in machine.counter_names:
                terms = [t for t in invariant.terms if t.counter == counter]
                allowed = [v for v in range(4) if all(t.holds({counter: v}) for t in terms)]
                setattr(rec, counter, draw(st.sampled_from(allowed)))
    return Tree(records)
