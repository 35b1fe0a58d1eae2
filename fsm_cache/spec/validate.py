"""Load-time validation of specs: names, determinism, totality, safety, reachability.

Every check looks at one step from one counter valuation, and guards,
invariants and updates are simple enough (``COUNTER OP INT`` conjunctions;
``+=``, ``-=``, ``=`` a constant) that a handful of values per counter stands
for all of them: :func:`representatives` says which, and
:func:`fsm_cache.spec.guards.critical_values` why that is exact. So a guard
``tokens <= 4096`` costs a few values, not four thousand.
"""

from __future__ import annotations

import builtins
import difflib
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

from fsm_cache import errors
from fsm_cache.errors import FsmCacheError, IllegalTransition, SpecError, error_class
from fsm_cache.spec.guards import Guard, critical_values
from fsm_cache.spec.machine import (
    Birth,
    EventSpec,
    Forbid,
    MachineSpec,
    Spec,
    StateSpec,
    System,
    Transition,
    as_system,
    bad_name,
    bad_title,
    compared,
)
from fsm_cache.spec.meaning import step
from fsm_cache.spec.reach import Record, Runs, replay, runs
from fsm_cache.spec.stubs import annotation_types, state_alias


# Attributes every record has besides regions and counters (see Engine.slots and the
# tree protocol), and the region name of a single machine: counters may not shadow them.
RESERVED = frozenset({"id", "trail", "parent", "children", "state", "rec", "result", "error"})
"""Names no counter or region may take: a record's own attributes, and the names the
generated contracts module gives a record, a step's result and its refusal."""


_Line = tuple[str, str]
"""One problem: the file holding the entry it names ("" for the spec's own) and ``KEY: message``."""

_Entry = StateSpec | EventSpec | Transition | Forbid | Birth


Chains = Mapping[str, Sequence[str]]
"""The files each spec file builds on through ``extends``, its own base first, by its file as
named: the loader's, which alone has followed them. A file it does not name builds on nothing
known, and its base's faults are said to be found in a spec that builds on it."""


def validate(spec: Spec, chains: Chains | None = None) -> None:
    """Raise :class:`SpecError` listing every problem of ``spec``; return if none.

    Args:
        spec: The spec to check.
        chains: The files each of its files builds on (:data:`Chains`), which
            tell how a base's fault is reached, and which of two files is the
            later, whose entry a fault between them is filed under.
    """
    found = problems(spec, chains)
    if found:
        raise SpecError(found)


def problems(spec: Spec, chains: Chains | None = None) -> list[str]:
    """Return one located line per problem of ``spec`` (empty when valid); ``chains`` as :func:`validate`.

    Raises:
        SpecError: A check reads counters with more than :data:`VALUATION_LIMIT`
            valuations; the one line names the state and the counters.
    """
    chains = chains or {}
    if isinstance(spec, System):
        return _system_problems(spec, chains)
    chain = tuple(chains.get(spec.source, ()))
    names = _name_problems(spec)
    if names:
        return _located(spec, names, chain)
    slips, gaps = _slips(spec, chain)
    lines = [
        *slips,
        *_initial(spec, chain),
        *_determinism(spec, chain),
        *gaps,
        *_safety(spec),
        *_liveness(spec),
    ]
    if not lines:  # the search runs the spec's steps, so they must be well defined
        lines = list(_records(spec))
    return _located(spec, lines, chain)


def _located(spec: Spec, lines: Iterable[_Line], chain: Sequence[str]) -> list[str]:
    """Return each line as reported: ``FILE: KEY: message``, FILE the file that holds KEY.

    An entry a spec inherits through ``extends`` is named in its base's file,
    by the key it has there (``transition[4]`` counts the base's tables), as
    reading the base reports it: one name for one entry, the one a reader
    finds in the file. The line also names the spec it was found validating,
    and the files ``chain`` (the files ``spec`` builds on, its base first)
    says it reaches the base through, since the fault may be the whole's (a
    base state an added event leaves uncovered) and the fix in the spec that
    builds on it.
    """
    return [
        f"{file}: {text}; found validating {spec.source}, {_reached(file, chain)}"
        if file
        else f"{spec.source}: {text}"
        for file, text in lines
    ]


def _reached(file: str, chain: Sequence[str]) -> str:
    """Return how a spec reaches its base ``file``, ``chain`` the files it builds on.

    ``which extends it`` when ``file`` is its own base; otherwise the files
    between them, when ``chain`` names them.
    """
    if file not in chain:
        return "which builds on it"
    through = chain[: chain.index(file)]
    return f"which builds on it through {', '.join(through)}" if through else "which extends it"


def _later(file: str, other: str, chain: Sequence[str]) -> bool:
    """Return whether the file ``file`` builds on ``other`` (:func:`_held`'s names, "" the spec's own).

    A fault between entries of two files is the later one's: the one its
    author wrote knowing of the other, and may edit, where the other may be
    a shipped spec in site-packages. Files ``chain`` does not name are not
    told apart.
    """
    return _depth(file, chain) < _depth(other, chain)


def _depth(file: str, chain: Sequence[str]) -> int:
    """Return how many ``extends`` lie between the spec and ``file``: 0 its own, past ``chain`` unknown."""
    if not file:
        return 0
    return 1 + chain.index(file) if file in chain else len(chain) + 1


def _held(spec: Spec, entry: _Entry) -> str:
    """Return the file that holds ``entry`` when it is not ``spec``'s own, else ""."""
    return "" if entry.source in ("", spec.source) else entry.source


def _places(spec: Spec, kind: str, entries: Sequence[Transition | Forbid]) -> list[_Line]:
    """Return each of ``entries``' file (:func:`_held`) and key there: ``transition[1]``.

    The index counts the ``[[kind]]`` tables of the entry's own file from 0, as
    written, wherever the spec that extends it puts them.
    """
    counts: dict[str, int] = {}
    out = []
    for entry in entries:
        file = _held(spec, entry)
        counts[file] = counts.get(file, 0) + 1
        out.append((file, f"{kind}[{counts[file] - 1}]"))
    return out


def _named(spec: Spec, place: _Line, at: str) -> str:
    """Return ``place``'s key as a line in the file ``at`` names it.

    That is the key alone in the entry's own file, and ``transition[2] of base.toml``
    in another's.
    """
    file, key = place
    return key if file == at else f"{key} of {file or spec.source}"


def bound(spec: MachineSpec) -> int:
    """Return a counter value past which no guard or invariant changes its truth.

    The values 0..bound include every one of :func:`representatives`; tests that
    want a dense range rather than the few exact representatives use it.
    """
    constants = [abs(t.value) for s in spec.states for t in s.invariant.terms]
    constants += [abs(t.value) for tr in spec.transitions for t in tr.guard.terms]
    constants += [abs(t.value) for f in spec.forbids for t in f.guard.terms]
    constants += [v for _, v in spec.counters]
    steps = [a.amount for tr in spec.transitions for a in tr.update.assigns]
    return max(constants, default=0) + max(steps, default=0) + 2


def representatives(spec: MachineSpec, *extra: Guard) -> dict[str, tuple[int, ...]]:
    """Return, per counter, ascending values that stand for every value it can take.

    Each counter's :func:`~fsm_cache.spec.guards.critical_values` (which says why they
    are exact) for the constants it is compared with
    (:func:`~fsm_cache.spec.machine.compared`: every invariant, guard and forbid
    guard, and the ``extra`` guards) and the steps updates move it by.
    Guards are conjunctions and updates assign counters one by one, so the
    counters are independent: the product of these meets every class of
    valuations that any check tells apart.
    """
    constants = compared([spec], *extra)
    steps: dict[str, list[int]] = {name: [] for name in spec.counter_names}
    for assign in (a for tr in spec.transitions for a in tr.update.assigns):
        steps.get(assign.counter, []).append(assign.delta())
    return {name: critical_values(constants[name], steps[name]) for name in spec.counter_names}


def valuations(spec: MachineSpec, invariant: Guard) -> Iterator[dict[str, int]]:
    """Yield the exact representative counter valuations that satisfy ``invariant``.

    The product of :func:`representatives` over the counters, in ascending
    lexicographic order, keeping those where ``invariant`` holds; checking a
    property of one step on these is checking it on every valuation.
    """
    yield from allowed(spec.counter_names, representatives(spec, invariant), invariant)


VALUATION_LIMIT = 100_000
"""The most counter valuations one check of one state may ask: the product, over the counters
it reads, of their representatives. Past it validation would run for minutes or hours (each
counter read multiplies the product), so the spec is refused, naming the state and counters."""


def _read(
    spec: MachineSpec, state: str, invariant: Guard, counters: Iterable[str]
) -> Iterator[dict[str, int]]:
    """Yield :func:`valuations` of ``invariant`` for a check in ``state`` that reads only ``counters``.

    The valuations where each counter neither ``counters`` nor ``invariant``
    names is at its least representative: the others are checked over all of
    theirs. Guards, invariants and updates read counters one by one, so a
    counter the check does not read answers it alike at each of its values:
    a check asks only as many valuations as the counters it reads have, however
    many the machine declares. And since the full product runs in ascending
    lexicographic order, its first valuation where the check finds a problem
    is the first of these, so what a problem names is the same.

    Raises:
        SpecError: The counters read have more than :data:`VALUATION_LIMIT`
            valuations.
    """
    reps = representatives(spec, invariant)
    read = set(counters) | invariant.counters()
    names = [name for name in spec.counter_names if name in read]
    count = math.prod(len(reps[name]) for name in names)
    if count > VALUATION_LIMIT:
        msg = (
            f"{spec.source}: states.{state}: a check there reads {len(names)} counters together "
            f"({', '.join(names)}): {count} valuations of their representatives, more than "
            f"validation tries ({VALUATION_LIMIT}); let one guard, invariant or update read fewer"
        )
        raise SpecError([msg])
    held = {name: reps[name][0] for name in spec.counter_names}
    for values in allowed(names, reps, invariant):
        yield {**held, **values}  # in declaration order, as valuations yields them


def allowed(
    names: Sequence[str], reps: Mapping[str, tuple[int, ...]], invariant: Guard
) -> Iterator[dict[str, int]]:
    """Yield the valuations of ``names`` drawn from ``reps`` that satisfy ``invariant``.

    :func:`valuations` for a caller that holds the representatives already
    (:func:`representatives` of the machine and ``invariant``), so they are
    not computed twice.
    """
    # The invariant is a conjunction of single-counter terms: filter each axis alone.
    axes = [
        [
            v
            for v in reps[name]
            if all(t.holds({name: v}) for t in invariant.terms if t.counter == name)
        ]
        for name in names
    ]
    for values in itertools.product(*axes):
        yield dict(zip(names, values, strict=True))


def _when(counters: dict[str, int]) -> str:
    """Return `` when pins=0, locks=1`` (empty for a machine without counters)."""
    shown = ", ".join(f"{k}={v}" for k, v in counters.items())
    return f" when {shown}" if shown else ""


def _spelling(spec: MachineSpec) -> Iterator[str]:
    """Each name of ``spec`` that :func:`~fsm_cache.spec.machine.bad_name` refuses, located.

    The loader refuses them in files; this pass refuses them in specs built
    in code, which never pass through it.
    """
    named = [
        *((f"states[{i}]", st.name) for i, st in enumerate(spec.states)),
        *((f"counters[{i}]", name) for i, name in enumerate(spec.counter_names)),
        *((f"events[{i}]", ev.name) for i, ev in enumerate(spec.events)),
        *((f"transition[{i}].event", tr.event) for i, tr in enumerate(spec.transitions)),
        *(
            (f"transition[{i}].effect", tr.effect)
            for i, tr in enumerate(spec.transitions)
            if tr.effect is not None
        ),
        *((f"forbid[{i}].event", fb.event) for i, fb in enumerate(spec.forbids)),
    ]
    if (bad := bad_title(spec.name)) is not None:
        yield f"machine.name: {spec.name!r}: {bad}"
    for where, name in named:
        if (bad := bad_name(name)) is not None:
            yield f"{where}: {name!r}: {bad}"


def layout_problems(spec: Spec) -> list[str]:
    """Return one located line per name of ``spec`` that a record or generated code cannot use.

    The part of :func:`problems` the engine relies on to compile a spec at all,
    and the part it checks on every spec it is given (validation proper runs
    when a spec is loaded; a spec built in code never passes through it): every
    name an identifier that is no keyword, since names become Python
    identifiers in generated code; no state or counter declared twice; no
    counter or region named like an attribute every record has (``id``,
    ``trail``, ``parent``) or like another region's counter, since each
    becomes a slot of the record.
    """
    if isinstance(spec, MachineSpec):
        lines = list(_spelling(spec)) or [f"{key}: {why}" for key, why in _clashes(spec)]
        return [f"{spec.source}: {line}" for line in lines]
    out: dict[str, None] = {}  # ordered, each line once (regions may share a machine)
    for _, machine in spec.regions:
        out.update(dict.fromkeys(layout_problems(machine)))
    own = [line for region, _ in spec.regions for _, line in _region_clashes(spec, region, ())]
    return [*out, *(f"{spec.source}: {line}" for line in own)]


def _clashes(spec: MachineSpec) -> list[tuple[str, str]]:
    """``(key, why)`` for each state and counter of ``spec`` declared twice, and each counter named as reserved."""
    out = [
        (f"states.{s}", "declared twice (a spec that extends another may not redeclare its states)")
        for s in dict.fromkeys(spec.state_names)
        if spec.state_names.count(s) > 1
    ]
    out += [
        (
            f"counters.{c}",
            "declared twice (a spec that extends another may not redeclare its counters)",
        )
        for c in dict.fromkeys(spec.counter_names)
        if spec.counter_names.count(c) > 1
    ]
    return out + [
        (f"counters.{c}", f"{c!r} is reserved (a record attribute or a name of the generated code)")
        for c in spec.counter_names
        if _reserved(c)
    ]


def _region_clashes(system: System, region: str, chain: Sequence[str]) -> list[_Line]:
    """Whether ``region`` is no usable name, and each of its counters an earlier region has too.

    A name that is no identifier, or one reserved, is the region's own fault,
    filed in the file that declares it (:meth:`System.origin`). A clash with
    another region's name (a counter called ``region``, a counter in both) is
    filed at the later of the two files (:func:`_filed`), keyed by the region
    that file declares, ``chain`` as :func:`_later`.
    """
    held = system.origin(f"composition.regions.{region}")
    holders = [name for name, machine in system.regions if region in machine.counter_names]
    later = [s for s in holders if s != region and _filed(system, region, s, chain)[1] == s]
    out = []
    # "state" is the region name of a single machine (System.single), so it stays allowed;
    # a counter called `region` that no later file brings makes the name unusable here.
    if bad_name(region) is not None or region in RESERVED - {"state"} or len(later) < len(holders):
        out.append(
            (
                held,
                f"composition.regions.{region}: not a usable region name (an identifier that is no keyword, record attribute or counter)",
            )
        )
    out += [
        (
            system.origin(f"composition.regions.{s}"),
            f"composition.regions.{s}: counter {region!r} is also the name of region {region!r} (each is an attribute of the record); rename one",
        )
        for s in later
    ]
    seen: dict[str, str] = {}  # each counter's latest region so far, as validation names it
    for name, machine in system.regions:
        for counter in machine.counter_names:
            if name == region and counter in seen:
                file, at, other = _filed(system, region, seen[counter], chain)
                out.append(
                    (
                        file,
                        f"composition.regions.{at}: counter {counter!r} also in region {other!r}",
                    )
                )
            seen[counter] = name
        if name == region:
            break
    return out


def _filed(system: System, region: str, other: str, chain: Sequence[str]) -> tuple[str, str, str]:
    """Return where a clash between the names of ``region`` and ``other`` is filed.

    That is ``(file, at, other)``: the file (:meth:`System.origin`) of the
    region of the two that a later file declares (:func:`_later`; ``region``
    when neither does), that region, and the other. The later file's author
    wrote it knowing of the other, and may edit it, where the other may be a
    shipped spec.
    """
    mine = system.origin(f"composition.regions.{region}")
    theirs = system.origin(f"composition.regions.{other}")
    if _later(theirs, mine, chain):
        return theirs, other, region
    return mine, region, other


def _name_problems(spec: MachineSpec) -> list[_Line]:
    spelling = list(_spelling(spec))
    if spelling:  # the checks below put names into messages and generated code
        return [("", line) for line in spelling]
    states, counters = set(spec.state_names), set(spec.counter_names)
    own = [] if spec.initial in states else [("machine.initial", f"unknown state {spec.initial!r}")]
    own += _clashes(spec)
    typed = annotation_types(System.single(spec))
    own += [(f"counters.{c}", _typed(c, typed[c])) for c in spec.counter_names if c in typed]
    out = [(spec.origin(key), f"{key}: {why}") for key, why in own]
    for st in spec.states:
        file = _held(spec, st)
        out += [
            (file, f"states.{st.name}.invariant: unknown counter {c!r}")
            for c in st.invariant.counters() - counters
        ]
        if st.counter is not None and st.counter not in counters:
            out.append((file, f"states.{st.name}.counter: unknown counter {st.counter!r}"))
    for (file, key), tr in zip(
        _places(spec, "transition", spec.transitions), spec.transitions, strict=True
    ):
        out += [(file, line) for line in _transition_names(spec, key, tr)]
    for (file, key), fb in zip(_places(spec, "forbid", spec.forbids), spec.forbids, strict=True):
        out += [(file, line) for line in _forbid_names(spec, key, fb)]
    used = set(spec.event_names)
    return out + [
        (_held(spec, e), f"events.{e.name}: declared but no transition or forbid uses it")
        for e in spec.events
        if e.name not in used
    ]


def _transition_names(spec: MachineSpec, where: str, tr: Transition) -> list[str]:
    states = spec.state_names
    out = _undeclared(spec, f"{where}.event", tr.event)
    out += [f"{where}.source: unknown state {s!r}" for s in tr.sources if s not in states]
    out += _repeated(f"{where}.source", tr.sources)
    out += [f"{where}.dest: unknown state {tr.dest!r}"] if tr.dest not in states else []
    known = set(spec.counter_names)
    for key, used in (("guard", tr.guard.counters()), ("update", tr.update.counters())):
        out += [f"{where}.{key}: unknown counter {c!r}" for c in sorted(used - known)]
    return out


def _forbid_names(spec: MachineSpec, where: str, fb: Forbid) -> list[str]:
    out = _undeclared(spec, f"{where}.event", fb.event)
    out += [f"{where}.source: unknown state {s!r}" for s in fb.sources if s not in spec.state_names]
    out += _repeated(f"{where}.source", fb.sources)
    unknown = fb.guard.counters() - set(spec.counter_names)
    out += [f"{where}.guard: unknown counter {c!r}" for c in sorted(unknown)]
    if fb.when:
        out.append(f"{where}.when: a machine file cannot use conditions; use a composition")
    if not fb.sources:
        out.append(f"{where}.source: a machine's forbid must name its states")
    return out + _error_name(where, fb.error)


def _repeated(where: str, sources: Sequence[str]) -> list[str]:
    """Each state a source list names more than once: a slip, which would otherwise pass unseen."""
    return [
        f"{where}: state {s!r} named twice" for s in dict.fromkeys(sources) if sources.count(s) > 1
    ]


def _undeclared(spec: MachineSpec, where: str, event: str) -> list[str]:
    """An ``[events]`` table, when a machine has one, is the closed list of its events."""
    declared = [e.name for e in spec.events]
    if not declared or event in declared:
        return []
    return [f"{where}: unknown event {event!r} (declared in [events]: {', '.join(declared)})"]


def _typed(name: str, what: str, of: str | None = None) -> str:
    """Return why a record field may not be called ``name``: ``fsm-cache types`` annotates with it.

    ``of`` is given where the line is filed at another region than the one
    ``name`` belongs to: the fault is then a clash of two regions' names,
    either of which may be renamed, and ``of`` says whose ``name`` is
    (`` of region 'a'`` for a counter, empty for a region).
    """
    return (
        f"{name!r}{of or ''} is {what} in the types fsm-cache types writes, where a field of that "
        f"name would hide it from the fields after it (mypy rejects the file); rename {'it' if of is None else 'one'}"
    )


def _reserved(name: str) -> bool:
    return name in RESERVED  # keywords are refused by the spelling pass first


def _error_name(where: str, name: str) -> list[str]:
    if not name or not name[0].isupper():
        return [f"{where}.error: error class names are CapitalisedIdentifiers, got {name!r}"]
    # A refusal named like another class would be a different class of the same name:
    # `except SpecError` would not catch it, nor would `except ValueError`.
    if hasattr(builtins, name):
        return [f"{where}.error: {name!r} is a Python builtin, not a refusal; choose another name"]
    own = getattr(errors, name, None)
    refusal = isinstance(own, type) and issubclass(own, IllegalTransition)
    if isinstance(own, type) and issubclass(own, FsmCacheError) and not refusal:
        return [
            f"{where}.error: {name!r} is fsm_cache's own {name}, not a refusal; choose another name"
        ]
    error_class(name)
    return []


def _initial(spec: MachineSpec, chain: Sequence[str]) -> Iterator[_Line]:
    """Each counter whose initial value breaks the invariant of the initial state.

    Filed at the counter, in the file that declares it, unless a file that
    builds on that one chose the initial state: then at its ``machine.initial``.
    """
    invariant = spec.state(spec.initial).invariant
    values = dict(spec.counters)
    broken = {t.counter for t in invariant.terms if not t.holds(values)}
    chosen = spec.origin("machine.initial")
    for name in (n for n in spec.counter_names if n in broken):
        declared = spec.origin(f"counters.{name}")
        if _later(chosen, declared, chain):
            held = _named(spec, (declared, f"counters.{name}"), chosen)
            yield (
                chosen,
                f"machine.initial: the invariant of the initial state {spec.initial} ({invariant}) is broken by the initial value {values[name]} of {held}",
            )
        else:
            yield (
                declared,
                f"counters.{name}: initial value {values[name]} breaks the invariant of the initial state {spec.initial} ({invariant})",
            )


def _determinism(spec: MachineSpec, chain: Sequence[str]) -> Iterator[_Line]:
    """Each overlap of two transitions, a transition and a forbid, or two forbids.

    One is filed under the later of the two entries, ``chain`` (the files
    ``spec`` builds on) ordering two files: two transitions or two forbids
    at the one listed second, a transition and a forbid at the forbid,
    unless the transition's file builds on the forbid's.
    """
    moved = _places(spec, "transition", spec.transitions)
    refused = _places(spec, "forbid", spec.forbids)
    for st in spec.states:
        for event in spec.event_names:
            moves = [
                (i, t)
                for i, t in enumerate(spec.transitions)
                if t.event == event and st.name in t.sources
            ]
            refusals = [
                (k, f)
                for k, f in enumerate(spec.forbids)
                if f.event == event and st.name in f.sources
            ]
            at = f"on {event} in {st.name}"
            for (i, a), (j, b) in itertools.combinations(moves, 2):
                both = _overlap(spec, st, a.guard, b.guard)
                if both is not None:  # at the guard that lets it overlap, if it has one
                    file, key = moved[j]
                    where = f"{key}{'.guard' if b.guard else ''}"
                    other = _named(spec, moved[i], file)
                    yield file, f"{where}: overlaps {other} {at}{_when(both)} (non-deterministic)"
            for n, (k, fb) in enumerate(refusals):
                file, key = refused[k]
                for i, tr in moves:
                    both = _overlap(spec, st, tr.guard, fb.guard)
                    if both is None:
                        continue
                    tr_file, tr_key = moved[i]
                    if _later(tr_file, file, chain):  # the base's forbid, met by an added move
                        other = _named(spec, refused[k], tr_file)
                        yield tr_file, f"{tr_key}: overlaps {other} {at}{_when(both)}"
                    else:
                        other = _named(spec, moved[i], file)
                        yield file, f"{key}: overlaps {other} {at}{_when(both)}"
                for m, earlier in refusals[:n]:
                    both = _overlap(spec, st, earlier.guard, fb.guard)
                    if both is not None:
                        other = _named(spec, refused[m], file)
                        yield file, f"{key}: overlaps {other} {at}{_when(both)} (ambiguous refusal)"


def _overlap(spec: MachineSpec, state: StateSpec, a: Guard, b: Guard) -> dict[str, int] | None:
    """Return a counter valuation ``state``'s invariant allows where both guards hold, if any."""
    read = a.counters() | b.counters()
    valued = _read(spec, state.name, state.invariant, read)
    return next((c for c in valued if a.holds(c) and b.holds(c)), None)


def _totality(spec: MachineSpec, chain: Sequence[str]) -> Iterator[tuple[str, str, _Line]]:
    """Each state, event and line where the event is neither a transition nor a forbid.

    A gap is filed at the state, unless the event is declared in a file that
    builds on the state's (:func:`_later`): then it is the event's gap, filed at
    the event's declaration (:func:`_declarations`), where its author may add
    the missing transition or forbid, where the state's file may be a shipped
    spec the author cannot edit.
    """
    declared = _declarations(spec, chain)
    for st in spec.states:
        if st.final:
            continue
        state = (_held(spec, st), f"states.{st.name}")
        for event in spec.event_names:
            covers = [t.guard for t in spec.transitions_for(st.name, event)]
            covers += [f.guard for f in spec.forbids_for(st.name, event)]
            read = {name for guard in covers for name in guard.counters()}
            # A counter no cover reads holds one value here; _gap_when calls it free all the same.
            allowed = list(_read(spec, st.name, st.invariant, read))
            gaps = [c for c in allowed if not any(g.holds(c) for g in covers)]
            if not gaps:
                continue
            when = _gap_when(st.invariant, allowed, gaps)
            file, key = declared[event]
            if _later(file, state[0], chain):
                line = f"{key}: neither a transition nor a forbid in {_named(spec, state, file)}{when} (not total)"
                yield st.name, event, (file, line)
            else:
                line = f"{state[1]}: event {event!r} is neither a transition nor a forbid{when} (not total)"
                yield st.name, event, (state[0], line)


def _declarations(spec: MachineSpec, chain: Sequence[str]) -> dict[str, _Line]:
    """Return each event's declaration: its ``[events]`` entry, else its first use in the earliest file.

    The earliest file is the base-most one (:func:`_depth`) that uses the event:
    a machine without ``[events]`` declares an event by using it, and the file
    that used it first is the one every later file found it in.
    """
    uses: list[tuple[_Line, Transition | Forbid]] = [
        *zip(_places(spec, "transition", spec.transitions), spec.transitions, strict=True),
        *zip(_places(spec, "forbid", spec.forbids), spec.forbids, strict=True),
    ]
    out: dict[str, _Line] = {}
    for (file, key), entry in sorted(uses, key=lambda use: -_depth(use[0][0], chain)):
        out.setdefault(entry.event, (file, f"{key}.event"))
    out.update({event.name: (_held(spec, event), f"events.{event.name}") for event in spec.events})
    return out


def _slips(spec: MachineSpec, chain: Sequence[str]) -> tuple[list[_Line], list[_Line]]:
    """Return the events that look misspelt, located, and the totality gaps they do not explain.

    An event one transition or forbid uses and nothing else does, whose name
    is close to another event's (``reclam``, where the rest say ``reclaim``),
    is a slip when it is not total and the other name is missing in a state
    its one use lists: the one use is named, with the name meant, instead of
    the gaps it leaves, its own in every state and the other name's in the
    states its one use lists. A machine with an ``[events]`` table has no
    slips: an undeclared name is refused as such. Without one, the spec's own
    names are the list to check spelling against, and the name more of it
    agrees on (more uses, then more states listed) is taken for the one
    meant. Where the other name is used once too, its use is named beside
    it, so a guess the wrong way round still shows both. An event that is
    total on its own is no slip.
    """
    gaps = list(_totality(spec, chain))
    if spec.events:
        return [], [line for _, _, line in gaps]
    uses: dict[str, list[tuple[_Line, tuple[str, ...]]]] = {}
    for place, tr in zip(
        _places(spec, "transition", spec.transitions), spec.transitions, strict=True
    ):
        uses.setdefault(tr.event, []).append((place, tr.sources))
    for place, fb in zip(_places(spec, "forbid", spec.forbids), spec.forbids, strict=True):
        uses.setdefault(fb.event, []).append((place, fb.sources))
    gapped: dict[str, set[str]] = {}
    for state, event, _ in gaps:
        gapped.setdefault(event, set()).add(state)
    weight = {
        event: (len(places), len({s for _, sources in places for s in sources}))
        for event, places in uses.items()
    }
    slips: list[_Line] = []
    explained = set()
    for event, places in uses.items():
        if len(places) != 1 or event not in gapped:
            continue
        close = difflib.get_close_matches(event, [e for e in uses if e != event], 1, _CLOSE)
        if not close:
            continue
        ((file, where), sources), meant = places[0], close[0]
        if not gapped.get(meant, set()) & set(sources) or weight[meant] < weight[event]:
            continue
        there = f" ({_named(spec, uses[meant][0][0], file)})" if len(uses[meant]) == 1 else ""
        slips.append(
            (
                file,
                f"{where}.event: {event!r} appears in no other transition or forbid; "
                f"did you mean {meant!r}{there}?",
            )
        )
        explained |= {(state, gap) for state, gap, _ in gaps if gap == event}
        explained |= {(state, meant) for state in sources}
    return slips, [line for state, event, line in gaps if (state, event) not in explained]


_CLOSE = 0.8
"""How alike (:class:`difflib.SequenceMatcher`'s ratio) an event's name must be to another's to
be taken for a misspelling of it: ``reclam`` and ``reclaim`` are 0.92, ``pin`` and ``unpin`` 0.75."""


def _gap_when(invariant: Guard, allowed: list[dict[str, int]], gaps: list[dict[str, int]]) -> str:
    """Return the condition of a totality gap: its first valuation, less what it does not depend on.

    A counter the gap holds for whatever its value (of those the state's
    invariant allows, more than one) is named ``for every value of uses``
    rather than given the value of the first gap, which would read as a
    condition: `` when uses=0`` for a gap that has none.

    Args:
        invariant: The state's invariant.
        allowed: The representative valuations it allows (:func:`_read`: a
            product of one axis per counter the event's guards read, the
            others held at one value, which this calls free as it would at
            every value of theirs).
        gaps: Those of ``allowed`` no transition or forbid covers, in order.
    """
    missing = {tuple(sorted(c.items())) for c in gaps}
    free = []
    for name in gaps[0]:
        values = {c[name] for c in allowed}
        # Representatives stand for every value, so a gap at each of them is one at all.
        if not _pinned(invariant, name) and all(
            tuple(sorted({**c, name: v}.items())) in missing for c in gaps for v in values
        ):
            free.append(name)
    shown = _when({k: v for k, v in gaps[0].items() if k not in free})
    if not free:
        return shown
    every = f"for every value of {' and '.join(free)}"
    return f"{shown}, {every}" if shown else f" {every}"


def _pinned(invariant: Guard, counter: str) -> bool:
    """Return whether ``invariant`` allows ``counter`` one value only (``n == 0``)."""
    terms = [t for t in invariant.terms if t.counter == counter]
    # Every value past the largest constant answers alike: two past it are all of them.
    top = max((t.value for t in terms), default=0) + 2
    return sum(all(t.holds({counter: v}) for t in terms) for v in range(max(top, 0) + 1)) == 1


def _safety(spec: MachineSpec) -> Iterator[_Line]:
    names = set(spec.state_names)
    for (file, key), tr in zip(
        _places(spec, "transition", spec.transitions), spec.transitions, strict=True
    ):
        if tr.dest not in names:
            continue
        dest = spec.state(tr.dest)
        read = tr.guard.counters() | tr.update.counters() | dest.invariant.counters()
        for source in tr.sources:
            for before in _read(spec, source, spec.state(source).invariant, read):
                if not tr.guard.holds(before):
                    continue
                after = tr.update.apply(before)
                negative = [k for k, v in after.items() if v < 0]
                if negative:
                    yield (
                        file,
                        f"{key}.update: drives {negative[0]} negative from {source}{_when(before)}",
                    )
                    break
                if not dest.invariant.holds(after):
                    yield (
                        file,
                        f"{key}.update: breaks the invariant of {dest.name} ({dest.invariant}) from {source}{_when(before)}",
                    )
                    break


def _liveness(spec: MachineSpec) -> Iterator[_Line]:
    reached, frontier = {spec.initial}, [spec.initial]
    while frontier:
        state = frontier.pop()
        for tr in spec.transitions:
            if state in tr.sources and tr.dest not in reached and _enabled(spec, state, tr.guard):
                reached.add(tr.dest)
                frontier.append(tr.dest)
    for st in spec.states:
        if st.name not in reached:
            yield _held(spec, st), f"states.{st.name}: unreachable from {spec.initial}"
        if not st.final:
            yield from _way_out(spec, st)
    for (file, key), tr in zip(
        _places(spec, "transition", spec.transitions), spec.transitions, strict=True
    ):
        # A source list shares one transition among states, its guard choosing among
        # them; only a guard that holds in none of them says a move never made.
        if tr.sources and not any(_enabled(spec, s, tr.guard) for s in tr.sources):
            where = " nor in ".join(f"{s}{_under(spec.state(s))}" for s in tr.sources)
            yield file, f"{key}.guard: never holds in {where}: the transition can never fire"


def _way_out(spec: MachineSpec, st: StateSpec) -> Iterator[_Line]:
    """A non-final state needs a transition out whose guard can hold under its invariant."""
    moves = [t for t in spec.transitions if st.name in t.sources]
    exits = [t for t in moves if t.dest != st.name]
    if not exits:
        loops = " (each of its transitions leads back to it)" if moves else ""
        yield _held(spec, st), f"states.{st.name}: not final and has no transition out{loops}"
    elif not any(_enabled(spec, st.name, t.guard) for t in exits):
        yield (
            _held(spec, st),
            f"states.{st.name}: not final and has no way out: no transition out has a guard that can hold there{_under(st)}",
        )


def _under(st: StateSpec) -> str:
    """Return `` (invariant pins >= 1)``, or nothing for a state without one."""
    return f" (invariant {st.invariant})" if st.invariant else ""


def _enabled(spec: MachineSpec, state: str, guard: Guard) -> bool:
    invariant = spec.state(state).invariant
    return any(guard.holds(c) for c in _read(spec, state, invariant, guard.counters()))


def _system_problems(system: System, chains: Chains) -> list[str]:
    """Return the problems of each region's machine, then the composition's own.

    A machine that several regions share (one file two regions name) is
    validated once: its problems are its file's, the same lines whichever
    region reaches it, so they are reported once, as the loader reports a
    file's own faults once however often a load reaches it.
    """
    out: list[_Line] = []
    inner: dict[str, None] = {}  # ordered, each line once
    validated: set[int] = set()  # the machines already validated, by identity
    chain = tuple(chains.get(system.source, ()))
    for region, machine in system.regions:
        if id(machine) not in validated:
            validated.add(id(machine))
            inner.update(dict.fromkeys(problems(machine, chains)))
        out += _region_clashes(system, region, chain)
    if (bad := bad_title(system.name)) is not None:
        out.append(("", f"composition.name: {system.name!r}: {bad}"))
    out += _alias_problems(system, chain)
    out += _annotation_problems(system, chain)
    for (file, key), fb in zip(
        _places(system, "forbid", system.forbids), system.forbids, strict=True
    ):
        out += [(file, line) for line in _system_forbid_problems(system, key, fb)]
    out += _birth_problems(system)
    if not inner and not out:  # the search runs the spec's steps, so they must be well defined
        out = list(_records(system))
    return [*inner, *_located(system, out, chain)]


def _records(spec: Spec) -> Iterator[_Line]:
    """Each deadlock a run reaches, then each state no run reaches, searching whole records.

    The checks above look at one state of one machine; these follow runs of
    the whole record (every region, its counters, the composition's rules)
    from its births, with :func:`fsm_cache.spec.reach.runs` (the search the
    engine's record checks read too). Tree rules are read for a record with no
    parent and no children, where none refuses: neighbours only add refusals,
    so a deadlock found is one in any tree, and a state missed is missed in
    every tree.
    """
    found = runs(as_system(spec))
    yield from _deadlocks(spec, found)
    if found.complete:
        yield from _unreached(spec, found)


def _deadlocks(spec: Spec, runs: Runs) -> Iterator[_Line]:
    """Each combination of states where a reached record refuses every event, none final.

    The first (shortest) run to each is replayed with exact counters, so the
    record named is one a run really reaches, whatever the search's caps.
    """
    system, shown = runs.system, set()
    for point in (p for p in runs.ways if p in runs.stuck and p[0] not in shown):
        here = dict(zip(system.machines, point[0], strict=True))
        if any(system.machines[r].state(s).final for r, s in here.items()):
            continue
        birth, events = runs.run_to(point)
        record = replay(system, birth, events)
        if record is None or record[0] != here:
            continue
        refused = [(e, step(system, e, *record)[0]) for e in system.event_names]
        if any(error == "" for _, error in refused):
            continue
        shown.add(point[0])
        yield _deadlock(spec, record, refused, _run(spec, birth, events))


def _deadlock(
    spec: Spec,
    record: Record,
    refused: list[tuple[str, object]],
    run: str,
) -> _Line:
    """Return the line naming a deadlocked ``record``, each event's refusal, and ``run``."""
    reasons = ", ".join(f"{event}: {error}" for event, error in refused)
    every = f"every event is refused there ({reasons})"
    if isinstance(spec, System):
        where = ", ".join(f"{region} {state}" for region, state in record[0].items())
        return (
            "",
            f"composition: deadlock at {where}{_when(record[1])}: {every} and no region is final; {run}",
        )
    state = spec.state(record[0]["state"])
    return _held(
        spec, state
    ), f"states.{state.name}: deadlock{_when(record[1])}: {every} and it is not final; {run}"


def _run(spec: Spec, birth: str, events: list[str]) -> str:
    """Return how a run reaches a record: ``reached from closed by jam, unjam``."""
    if isinstance(spec, System):
        origin = f"birth {birth}" if birth else "the initial states"
    else:
        origin = spec.initial
    if not events:
        return f"a record is born there ({origin})"
    return f"reached from {origin} by {', '.join(events)}"


def _unreached(spec: Spec, runs: Runs) -> Iterator[_Line]:
    """Each region state no reached record has."""
    regions = list(runs.system.machines)
    seen = {pair for point in runs.ways for pair in zip(regions, point[0], strict=True)}
    for region, machine in runs.system.regions:
        for state in (s for s in machine.state_names if (region, s) not in seen):
            if isinstance(spec, System):
                yield (
                    "",
                    f"composition.regions.{region}: state {state}: unreachable in the composition (no run from a birth reaches it)",
                )
            else:
                held = _held(spec, spec.state(state))
                yield (
                    held,
                    f"states.{state}: unreachable from {spec.initial} (every way in needs counters no run from {spec.initial} has)",
                )


def _alias_problems(system: System, chain: Sequence[str]) -> Iterator[_Line]:
    """Each region whose ``fsm-cache types`` alias (``DoorState``) an earlier region has too.

    The alias camel-cases the region name, so ``door`` and ``Door``, or ``my_door``
    and ``my__door``, would declare one alias twice; the second region is
    refused, or the first where a later file declares it (:func:`_filed`).
    """
    owners: dict[str, str] = {}
    for region, _ in system.regions:
        alias = state_alias(system, region)
        if alias in owners:
            file, at, other = _filed(system, region, owners[alias], chain)
            yield (
                file,
                f"composition.regions.{at}: region {other!r} has the same type "
                f"alias {alias} (fsm-cache types camel-cases region names); rename one",
            )
        else:
            owners[alias] = region


def _annotation_problems(system: System, chain: Sequence[str]) -> Iterator[_Line]:
    """Each region, or counter, named like a type the composition's stub annotates with.

    A counter named ``int`` or ``object`` is its machine file's fault, reported
    there; here are the names only the composition gives a meaning to: the
    region aliases (a region ``HostState`` beside the region ``host``). A
    region named ``int`` is its own fault; a name like another region's alias
    is a clash of the two, filed at the later file's region (:func:`_filed`).
    """
    typed = annotation_types(system)
    aliases = {state_alias(system, region): region for region, _ in system.regions}
    for region, machine in system.regions:
        if region in typed:
            file, at, _ = _filed(system, region, aliases.get(region, region), chain)
            yield (
                file,
                f"composition.regions.{at}: "
                + (
                    _typed(region, typed[region])
                    if at == region
                    else f"region {_typed(region, typed[region], '')}"
                ),
            )
        own = annotation_types(System.single(machine))  # reported in the machine's file
        for counter in machine.counter_names:
            if counter in typed and counter not in own:
                file, at, _ = _filed(system, region, aliases[counter], chain)
                yield (
                    file,
                    f"composition.regions.{at}: "
                    + (
                        f"counter {_typed(counter, typed[counter])}"
                        if at == region
                        else f"counter {_typed(counter, typed[counter], f' of region {region!r}')}"
                    ),
                )


def _birth_problems(system: System) -> Iterator[_Line]:
    """Each birth names known regions and states whose invariants hold at the initial counters.

    A name declared twice is reported once, at the second; a birth whose
    states, with every region it leaves out in its initial state, are those
    of an earlier birth is a second name for one way to be born, and one
    whose states are the initial states is a name for the birth every node
    without one has (``Engine.new`` with no ``birth``). A birth a
    base declares is named in the base (:func:`_located`): the spec that
    extends it may have replaced the region its state belonged to.
    """
    machines = system.machines
    seen: dict[tuple[tuple[str, str], ...], str] = {}  # each way to be born, by its first name
    initial = tuple(system.born().items())
    for i, birth in enumerate(system.births):
        if (bad := bad_name(birth.name)) is not None:
            yield "", f"composition.births[{i}]: {birth.name!r}: {bad}"
            continue
        where, file = f"composition.births.{birth.name}", _held(system, birth)
        if birth.name in (b.name for b in system.births[:i]):
            yield file, f"{where}: declared twice"
            continue
        faults = list(_birth_state_problems(machines, birth))
        yield from ((file, f"{where}.states.{fault}") for fault in faults)
        if faults:
            continue
        born = tuple(system.born(birth.name).items())
        states = ", ".join(f"{region} {state}" for region, state in born)
        if born == initial:
            yield file, f"{where}: the initial states ({states}): a node given no birth is born so"
        elif born in seen:
            yield file, f"{where}: the same states as birth {seen[born]} ({states})"
        seen.setdefault(born, birth.name)


def _birth_state_problems(machines: Mapping[str, MachineSpec], birth: Birth) -> Iterator[str]:
    """Each ``REGION: fault`` of a birth's states: an unknown region or state, a broken invariant."""
    for region, state in birth.states:
        machine = machines.get(region)
        if machine is None:
            yield f"{region}: unknown region (regions: {', '.join(machines)})"
        elif state not in machine.state_names:
            known = ", ".join(machine.state_names)
            yield f"{region}: unknown state {state!r} of {region} (states of {machine.name}: {known})"
        elif not (invariant := machine.state(state).invariant).holds(dict(machine.counters)):
            initial = ", ".join(f"{name}={value}" for name, value in machine.counters)
            yield f"{region}: the initial counters ({initial}) break the invariant of {state} ({invariant})"


def _system_forbid_problems(system: System, where: str, fb: Forbid) -> list[str]:
    machines = system.machines
    out = (
        []
        if fb.event in system.event_names
        else [f"{where}.event: no region declares {fb.event!r}"]
    )
    unknown = fb.guard.counters() - machine_counters(system)
    out += [f"{where}.guard: unknown counter {c!r}" for c in sorted(unknown)]
    out += _error_name(where, fb.error)
    # The engine tests a composition forbid's sources against the first region
    # that declares the event (the region the refusal is reported in).
    owners = system.regions_of(fb.event)
    out += [
        f"{where}.source: unknown state {s!r} of region {owners[0]!r}"
        for s in fb.sources
        if owners and s not in machines[owners[0]].state_names
    ]
    out += _repeated(f"{where}.source", fb.sources)
    for cond in fb.when:
        if cond.region not in machines:
            out.append(f"{where}.when: unknown region {cond.region!r}")
            continue
        known = machines[cond.region].state_names
        out += [
            f"{where}.when: unknown state {s!r} of {cond.region}"
            for s in cond.states
            if s not in known
        ]
    return out


def machine_counters(system: System) -> set[str]:
    """Return every counter name of every region of ``system``."""
    return {c for _, machine in system.regions for c in machine.counter_names}
