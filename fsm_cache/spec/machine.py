"""Machine specifications as data: states, counters, transitions and refusals.

A :class:`MachineSpec` is what a ``[machine]`` TOML file declares; a
:class:`System` composes several machines ("regions") over one record, for
example the host and device residency of a tree node, and adds refusals that
look across regions or along the tree. Everything downstream (the engine, the
``transitions`` reference, the contracts, the model checker and the diagrams)
reads these objects; no rule lives anywhere else.

Specs are built from TOML by :func:`fsm_cache.spec.loader.load_spec`, or from
Python with :func:`machine_from_dict`, which takes the same shape as the TOML.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fsm_cache.spec.guards import NO_UPDATE, TRUE, Comparison, Condition, Guard, Update


NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
"""A name in a spec (a state, event, counter, effect, region or birth): an ASCII letter,
then letters, digits or underscores, and no Python keyword. Names become Python
identifiers in generated code, so a leading underscore (Python's own), other scripts
(which Python rewrites) and a trailing newline are out."""
NOT_A_NAME = "not an identifier"

GUARDS_FAIL = ("IllegalTransition", "no transition's guard holds")
"""The refusal ``(error class name, reason)`` of an event whose transitions from the
state all have guards that fail, where no refusal of the state's holds either."""


NOT_A_TITLE = "not one line of printable text (no line break, tab or other control character)"
"""Why a machine's or composition's ``name`` is refused: it is shown in diagrams, stubs,
messages and Markdown headings, where a line break would start a line of its own."""


def bad_title(value: object) -> str | None:
    """Return why ``value`` cannot be a machine's or composition's ``name``, or None if it can.

    A spec's name is free text (``residency v2``, ``host/device``), but one
    non-empty line of printable characters (:meth:`str.isprintable`): a line
    break in it would inject lines into a Mermaid diagram or a Markdown document.
    """
    if not isinstance(value, str) or not value:
        return "missing or not a string"
    if not value.isprintable():
        return NOT_A_TITLE
    return None


def bad_name(value: object) -> str | None:
    """Return why ``value`` cannot be a name in a spec (see :data:`NAME`), or None if it can."""
    if not isinstance(value, str) or NAME.fullmatch(value) is None:
        return NOT_A_NAME
    if keyword.iskeyword(value):
        return f"{value!r} is a Python keyword"
    return None


def _origin(origins: tuple[tuple[str, str], ...], key: str) -> str:
    """Return the file ``origins`` (a spec's ``(key, file)`` pairs) names for ``key``, else ""."""
    return next((file for at, file in origins if at == key), "")


@dataclass(frozen=True)
class StateSpec:
    """One state of a machine.

    Attributes:
        name: The state's name, unique in its machine.
        doc: What the state means, shown in docs and diagrams.
        final: A final state needs no way out; events there are refused.
        invariant: A guard over counters that holds whenever the machine is here.
        counter: A counter carried by the state, drawn as ``pinned(N)``.
        source: The file that declares it (a base's, for one a spec inherits
            through ``extends``), so a fault of it names the file and the key
            it has there; "" for the spec's own file. Not compared.
    """

    name: str
    doc: str = ""
    final: bool = False
    invariant: Guard = TRUE
    counter: str | None = None
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class Transition:
    """``event`` moves the machine from any of ``sources`` to ``dest``.

    Attributes:
        event: The event's name.
        sources: The states it is legal from.
        dest: The state it leads to.
        guard: Counter condition that must hold (checked before anything changes).
        update: Counter assignments applied with the move.
        effect: Name of a hook bound at run time, run after the checks and
            before the commit; if it raises, nothing changes.
        propagate: ``"ancestors"`` to fire the same step on every ancestor too,
            all checked before any is changed.
        doc: Why the transition exists.
        source: The file that declares it (a base's, for one a spec inherits
            through ``extends``), so a fault of it names the file and the key
            it has there; "" for the spec's own file. Not compared.
    """

    event: str
    sources: tuple[str, ...]
    dest: str
    guard: Guard = TRUE
    update: Update = NO_UPDATE
    effect: str | None = None
    propagate: str | None = None
    doc: str = ""
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class Forbid:
    """A declared refusal: ``event`` from ``sources`` raises ``error``.

    Attributes:
        event: The refused event.
        sources: States it is refused in; empty means any state (compositions).
        error: Name of the exception class raised, an IllegalTransition subclass.
        reason: Human reason, the tail of the error message.
        guard: Refuse only when this counter condition holds.
        when: Refuse only when every condition holds (other regions, parent, children).
        source: The file that declares it (a base's, for one a spec inherits
            through ``extends``), so a fault of it names the file and the key
            it has there; "" for the spec's own file. Not compared.
    """

    event: str
    sources: tuple[str, ...]
    error: str
    reason: str
    guard: Guard = TRUE
    when: tuple[Condition, ...] = ()
    source: str = field(default="", compare=False)

    @property
    def conditional(self) -> bool:
        """Whether the refusal depends on a guard or a condition (vs. a plain gap-filler)."""
        return bool(self.guard) or bool(self.when)

    def others(self, owner: str) -> tuple[str, ...]:
        """Return the regions besides ``owner`` whose state on the record this refusal reads.

        A refusal names the state of each, so ``open_door refused in closed`` says
        why: ``(bolt locked)``. Tree conditions read other records and are left out.
        """
        regions = (c.region for c in self.when if c.scope == "self" and c.region != owner)
        return tuple(dict.fromkeys(regions))


@dataclass(frozen=True)
class EventSpec:
    """Documentation of an event: what it means and how history names it.

    Attributes:
        name: The event's name.
        doc: What the event means.
        past: How trails name it (``pinned``).
        source: The file that declares it (a base's, for one a spec inherits
            through ``extends``), so a fault of it names the file and the key
            it has there; "" for the spec's own file. Not compared.
    """

    name: str
    doc: str = ""
    past: str = ""
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class MachineSpec:
    """One state machine, as declared by a ``[machine]`` file.

    Attributes:
        name: The machine's name.
        initial: The state new instances start in.
        counters: Counter names with their initial values, in declaration order.
        states: Every state, in declaration order.
        transitions: Every transition, in declaration order: a base's first,
            for a spec that extends another (error locations count each
            file's own: ``transition[3]`` of the file a transition's
            ``source`` names).
        forbids: Every declared refusal, in declaration order.
        events: Optional documentation of events.
        doc: What the machine models.
        label: How instances are called in messages (``node 17: ...``).
        source: The file the spec came from, used in error locations.
        origins: ``(key, file)`` for each key of the spec that another file
            declares: ``counters.pins`` and ``machine.initial`` a base sets,
            by the file that sets it, however far down a chain of
            ``extends`` (:meth:`origin`). Counters and the initial state are
            plain values with no ``source`` of their own, so a fault of one
            is named here in the file a reader finds it in. Not compared.
    """

    name: str
    initial: str
    counters: tuple[tuple[str, int], ...]
    states: tuple[StateSpec, ...]
    transitions: tuple[Transition, ...]
    forbids: tuple[Forbid, ...] = ()
    events: tuple[EventSpec, ...] = ()
    doc: str = ""
    label: str = "instance"
    source: str = "<python>"
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def origin(self, key: str) -> str:
        """Return the file that declares ``key`` (``counters.pins``) when another does, else ""."""
        return _origin(self.origins, key)

    def state(self, name: str) -> StateSpec:
        """Return the state called ``name``.

        Raises:
            KeyError: No such state.
        """
        for state in self.states:
            if state.name == name:
                return state
        raise KeyError(name)

    @property
    def state_names(self) -> tuple[str, ...]:
        """The state names in declaration order."""
        return tuple(state.name for state in self.states)

    @property
    def counter_names(self) -> tuple[str, ...]:
        """The counter names in declaration order."""
        return tuple(name for name, _ in self.counters)

    @property
    def event_names(self) -> tuple[str, ...]:
        """Every event the machine knows, in order of first mention."""
        seen: dict[str, None] = {}
        for event in (*(t.event for t in self.transitions), *(f.event for f in self.forbids)):
            seen.setdefault(event, None)
        return tuple(seen)

    def event_doc(self, name: str) -> EventSpec:
        """Return the documentation of event ``name`` (empty if undocumented)."""
        return next((e for e in self.events if e.name == name), EventSpec(name))

    def transitions_for(self, state: str, event: str) -> Iterator[Transition]:
        """Yield the transitions of ``event`` leaving ``state``, in declaration order."""
        return (t for t in self.transitions if t.event == event and state in t.sources)

    def forbids_for(self, state: str, event: str) -> Iterator[Forbid]:
        """Yield the refusals of ``event`` in ``state``, in declaration order."""
        return (
            f for f in self.forbids if f.event == event and (not f.sources or state in f.sources)
        )

    def unanswered(self, state: str, event: str) -> tuple[str, str]:
        """Return the refusal ``(error class name, reason)`` of an event ``state`` declares nothing for.

        Totality leaves such a pair only in a final state, which has ended:
        the event is refused with ``FinalState``, saying so (``closed is
        final: nothing leaves it``, or ``only reopen leaves it`` where the spec
        declares a way out). A state the machine does not declare (a record
        written by hand) refuses every event with the base class. The engine,
        :mod:`fsm_cache.spec.meaning` and the reference model all read this.
        """
        found = next((s for s in self.states if s.name == state), None)
        if found is None or not found.final:
            return "IllegalTransition", f"{event} is not defined in this state"
        leaving = dict.fromkeys(t.event for t in self.transitions if state in t.sources)
        if not leaving:
            return "FinalState", f"{state} is final: nothing leaves it"
        return "FinalState", f"{state} is final: only {', '.join(leaving)} leave it"


@dataclass(frozen=True)
class Birth:
    """A way a record comes into being other than in every region's initial state.

    A tree node is normally born with the KV a request computed on the device
    (each region's ``initial``). A composition may declare other births: a
    node created for a prefix a storage tier already holds is born with no
    device or host copy and a stored one.

    Attributes:
        name: The birth's name (``discovered``).
        states: ``(region, state)`` for the regions not born in their initial state.
        doc: When records are born this way.
        source: The file that declares the birth (a base's, for an inherited
            one), so a fault of it names where to fix it; not compared.
    """

    name: str
    states: tuple[tuple[str, str], ...]
    doc: str = ""
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class System:
    """Machines composed over one record, each in its own named region.

    An event fires in every region whose machine declares it, in region
    order, and is legal only if every such region allows it (a synchronous
    product). ``forbids`` add refusals that read other regions' states or the
    record's parent and children.

    Attributes:
        name: The composition's name.
        regions: ``(region name, machine)`` pairs; the region name is the
            record attribute that holds that machine's state.
        forbids: Cross-region and structural refusals.
        doc: What the composition models.
        label: How instances are called in messages.
        source: The file the composition came from.
        births: Ways records are born besides every region's initial state.
        origins: ``(key, file)`` for each region a base composition declares
            and this one keeps (``composition.regions.host``), by the file
            that declares it (:meth:`origin`), as for a machine's
            :attr:`MachineSpec.origins`. Not compared.
    """

    name: str
    regions: tuple[tuple[str, MachineSpec], ...]
    forbids: tuple[Forbid, ...] = ()
    doc: str = ""
    label: str = "instance"
    source: str = "<python>"
    births: tuple[Birth, ...] = ()
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    _event_regions: dict[str, tuple[str, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def single(cls, machine: MachineSpec) -> System:
        """Wrap one machine as a one-region system whose region is ``state``."""
        return cls(
            machine.name,
            (("state", machine),),
            doc=machine.doc,
            label=machine.label,
            source=machine.source,
        )

    def origin(self, key: str) -> str:
        """Return the file that declares ``key`` (``composition.regions.host``) when another does, else ""."""
        return _origin(self.origins, key)

    @property
    def machines(self) -> dict[str, MachineSpec]:
        """Region name to machine."""
        return dict(self.regions)

    @property
    def past_tenses(self) -> dict[str, str]:
        """Each event that declares a past tense, to it (``pin`` to ``pinned``), for call-site accounts."""
        return {e.name: e.past for _, m in self.regions for e in m.events if e.past}

    @property
    def counters(self) -> tuple[tuple[str, int], ...]:
        """Every region's counters with initial values, in region order."""
        return tuple(pair for _, machine in self.regions for pair in machine.counters)

    @property
    def event_names(self) -> tuple[str, ...]:
        """Every event of every region, in order of first mention."""
        seen: dict[str, None] = {}
        for _, machine in self.regions:
            for event in machine.event_names:
                seen.setdefault(event, None)
        return tuple(seen)

    @property
    def effect_names(self) -> frozenset[str]:
        """Every effect a transition of some region names (what an engine must bind)."""
        return frozenset(
            t.effect for _, m in self.regions for t in m.transitions if t.effect is not None
        )

    def unknown_event(self, event: str) -> str:
        """Return the problem line of firing ``event``, which no region declares, naming the events."""
        return f"{self.source}: unknown event {event!r} (events: {', '.join(self.event_names)})"

    def regions_of(self, event: str) -> tuple[str, ...]:
        """Return the regions whose machine declares ``event``, in region order."""
        cached = self._event_regions.get(event)
        if cached is None:
            cached = tuple(r for r, m in self.regions if event in m.event_names)
            self._event_regions[event] = cached
        return cached

    def region_of_counter(self, counter: str) -> str:
        """Return the region that owns ``counter``.

        Raises:
            KeyError: No region declares it.
        """
        for region, machine in self.regions:
            if counter in machine.counter_names:
                return region
        raise KeyError(counter)

    def forbids_for(self, event: str) -> tuple[Forbid, ...]:
        """Return the cross-region refusals of ``event``, in declaration order."""
        return tuple(f for f in self.forbids if f.event == event)

    def born(self, birth: str | None = None) -> dict[str, str]:
        """Return every region's state at ``birth`` (``None``: the initial states).

        Raises:
            KeyError: The composition declares no such birth.
        """
        states = {region: machine.initial for region, machine in self.regions}
        if birth is not None:
            found = [b for b in self.births if b.name == birth]
            if not found:
                raise KeyError(birth)
            states.update(found[0].states)
        return states


Spec = MachineSpec | System


def compared(machines: Iterable[MachineSpec], *extra: Guard) -> dict[str, list[int]]:
    """Return, per counter of ``machines``, the constants guards compare it with.

    The guards are every state's invariant, transition's guard and forbid's
    guard of each machine, then ``extra`` (a composition's refusals, say); a
    term on a counter no machine declares is left out. Validation's
    representatives and the search's counter caps both start from these, so
    the two read one list of what a spec compares.
    """
    machines = list(machines)
    found: dict[str, list[int]] = {name: [] for m in machines for name in m.counter_names}
    for term in comparisons(machines, *extra):
        if term.counter in found:
            found[term.counter].append(term.value)
    return found


def comparisons(machines: Iterable[MachineSpec], *extra: Guard) -> Iterator[Comparison]:
    """Yield every comparison of ``machines``' guards, then of ``extra``, as :func:`compared` reads them.

    Every state's invariant, transition's guard and forbid's guard, in that
    order, machine by machine; terms on counters no machine declares included.
    """
    machines = list(machines)
    guards = [s.invariant for m in machines for s in m.states]
    guards += [t.guard for m in machines for t in m.transitions]
    guards += [f.guard for m in machines for f in m.forbids] + list(extra)
    for guard in guards:
        yield from guard.terms


def as_system(spec: Spec) -> System:
    """Return ``spec`` as a system (a machine becomes a one-region system)."""
    return spec if isinstance(spec, System) else System.single(spec)
