"""Compile a :class:`System` into Python source, one checked function per event.

The engine runs generated code rather than interpreting the spec: each event
becomes a straight-line function of ``if`` tests on interned state strings and
counter comparisons, which is what makes a checked pin cost about as much as a
hand-written guarded counter. The source is generated from the spec objects
only, never from user strings: names are validated identifiers, and guards
were parsed into comparisons before they reach this module.

Every generated function checks everything first and only then writes the
record, so a refused event changes nothing.

:func:`compile_system` turns the text into functions the way attrs does: the
source is registered in :mod:`linecache` under a filename unique to each
engine (``<fsm_cache residency engine 3>``), so tracebacks, ``pdb`` and
``inspect`` show the generated line that refused, and two engines of one
system never share a name. The entry is dropped once nothing runs the code.
A system's module is generated and compiled once (the last 32 kept), and each
engine's functions are made from that code renamed to the engine's filename.
"""

from __future__ import annotations

import functools
import itertools
import linecache
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, MappingProxyType
from typing import Any

from fsm_cache.engine import runtime
from fsm_cache.engine import trail as trails
from fsm_cache.spec.guards import Assign, Condition, Guard
from fsm_cache.spec.machine import GUARDS_FAIL, Forbid, MachineSpec, System, Transition


Plan = tuple[tuple[tuple[str, object], ...], list[str], bool]
"""What a step returns: ``(assignments, effect names, propagates)``."""
Step = Callable[[Any], Plan]
Verb = Callable[[Any], None]
Refuser = Callable[[Any, int], None]
"""``refuse(rec, index)``: raise the refusal at ``index``; generated code calls it."""


@dataclass(frozen=True)
class Refusal:
    """What a generated function needs to raise: region, error class name and reason.

    ``others`` are the other regions a composition's rule reads: the message
    names their states, read only when the refusal is raised.
    """

    region: str
    event: str
    error: str
    reason: str
    others: tuple[str, ...] = ()


class Emitter:
    """Accumulates generated source and the refusals it refers to by index."""

    def __init__(self, system: System, *, trail: bool = False) -> None:
        self.system = system
        self.trail = trail
        self.refusals: list[Refusal] = []
        self.lines: list[str] = []
        self.event = ""
        self.inline = False
        """Commit inside each transition's branch and return (see :func:`compile_fast`)."""
        self.state = ""
        """The source state whose branch is being emitted."""
        self.read: set[str] = set()
        """Inline: the counters the branch being emitted has read into ``c_<counter>`` locals."""
        self.live: frozenset[str] | None = None
        """In a fast path with effects, the effect names bound to a hook that does something
        (a pure engine's ``no_effect`` stand-ins are left out); None while a step is emitted."""
        self.flagged: frozenset[str] = frozenset()
        """Not inline: the regions whose branches say in ``x_<region>`` which effect to run."""
        self.indent = 0
        """Levels added to every line emitted (a step's body inside a chain's loop)."""
        self.walk = True
        """In trail mode, whether the fast path being emitted walks past dispatch frames."""
        self.implied: dict[tuple[str, str, str], bool] = {}
        """Per (region, state, event): whether the last guard is implied (:func:`_last_guard_implied`)."""

    def refusal(self, region: str, error: str, reason: str, others: tuple[str, ...] = ()) -> int:
        """Register a refusal of the event being compiled and return its index."""
        self.refusals.append(Refusal(region, self.event, error, reason, others))
        return len(self.refusals) - 1

    def emit(self, depth: int, line: str) -> None:
        """Append one line at indentation ``depth`` (plus :attr:`indent`)."""
        self.lines.append("    " * (depth + self.indent) + line)


@dataclass(frozen=True)
class Compiled:
    """A system compiled into functions: what :func:`compile_system` returns.

    Attributes:
        source: The generated Python source.
        filename: The unique name the code was compiled under and is registered
            as in :mod:`linecache` (``<fsm_cache residency engine 3>``).
        steps: Every event's checking function, ``step(rec) -> plan``, which
            writes nothing.
        verbs: The events with a fast path: checked functions that commit inline,
            ``verb(rec)``. Every event without propagation has one where effects
            were given (effects run after the checks, before the commit), else
            every event with neither effects nor propagation. In trail mode they
            note the first caller outside fsm_cache's dispatch files, walking past them.
        refusals: What each ``_refuse(rec, index)`` of the source raises, by index.
        direct: In trail mode, the fast paths of events without effects, noting
            their immediate caller without the walk, for code outside fsm_cache
            to call; empty otherwise. Events with effects note the first caller
            outside the dispatch files always, as the plan path did.
    """

    source: str
    filename: str
    steps: Mapping[str, Step]
    verbs: Mapping[str, Verb]
    refusals: tuple[Refusal, ...]
    direct: Mapping[str, Verb]


_numbers = itertools.count(1)
"""Numbers compilations, so each gets its own filename (``next()`` is atomic)."""

_PLACEHOLDER = "<fsm_cache engine>"
"""The filename a generated module is compiled under once, before each engine renames it."""


@dataclass(frozen=True)
class _Generated:
    """A system's generated module, compiled: what every engine of it shares."""

    source: str
    code: CodeType
    refusals: tuple[Refusal, ...]
    steps: Mapping[str, str]
    fast: Mapping[str, str]
    direct: Mapping[str, str]


def compile_system(
    system: System,
    refuser: Callable[[Sequence[Refusal]], Refuser],
    *,
    trail: bool = False,
    history: int = 8,
    effects: Mapping[str, runtime.Effect] | None = None,
) -> Compiled:
    """Generate, register and compile ``system``'s functions; return them with their source.

    The source and its compiled code depend on the system, ``trail`` and
    which effects are given only, so the last few are kept
    (:func:`_generated`): a second engine of one system (a cache built per
    test, per request batch) renames the code to its own filename instead of
    generating and compiling it again, which was most of building a cache.

    Args:
        system: The machine or composition to compile.
        refuser: Given the refusals the source refers to by index, returns the
            ``_refuse(rec, index)`` the generated code calls to raise one.
        trail: Emit fast paths that note each event's call site on the record.
        history: How many events a record's trail keeps.
        effects: The hooks bound to every effect the spec names. Given, events
            with effects and no propagation get fast paths too, which call
            them; without, those events have steps only.
    """
    live: dict[str, runtime.Effect] = {}
    if effects is not None:
        live = {n: f for n, f in effects.items() if f is not runtime.no_effect}
    hooked = None if effects is None else frozenset(live)
    made = _generated(system, trail, hooked)
    filename = f"<fsm_cache {system.name} engine {next(_numbers)}>"
    namespace = _namespace(refuser(made.refusals), history, system.label, live)
    _register(made.source, filename, namespace["_registration"])
    exec(_renamed(made.code, filename), namespace)
    return Compiled(
        source=made.source,
        filename=filename,
        steps=MappingProxyType({event: namespace[name] for event, name in made.steps.items()}),
        verbs=MappingProxyType({event: namespace[name] for event, name in made.fast.items()}),
        refusals=made.refusals,
        direct=MappingProxyType({event: namespace[name] for event, name in made.direct.items()}),
    )


@functools.lru_cache(maxsize=32)
def _generated(system: System, trail: bool, hooked: frozenset[str] | None) -> _Generated:
    """Generate and compile ``system``'s module; ``hooked``: the effects given hooks, if any."""
    em = Emitter(system, trail=trail)
    steps = {event: compile_event(em, event) for event in system.event_names}
    hot = [event for event in system.event_names if not needs_general(system, event)]
    fast = {event: compile_fast(em, event) for event in hot}
    direct = {event: compile_fast(em, event, walk=False) for event in hot} if trail else {}
    if not trail:  # emitted after the others: the lines of the functions above do not move
        for event in system.event_names:
            if propagates(system, event) and not _has_effects(system, event):
                fast[event] = compile_chain(em, event)
    if hooked is not None:  # emitted last: the lines of the functions above do not move
        for event in system.event_names:
            if needs_general(system, event) and not propagates(system, event):
                fast[event] = compile_fast(em, event, live=hooked)
    source = "\n".join(em.lines)
    code = compile(source, _PLACEHOLDER, "exec")
    return _Generated(source, code, tuple(em.refusals), steps, fast, direct)


def _renamed(code: CodeType, filename: str) -> CodeType:
    """Return ``code`` and the code of every function in it, compiled under ``filename``."""
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


class _Registration:
    """Sits in the generated functions' globals: it dies with the last of them."""

    __slots__ = ("__weakref__",)


def _namespace(
    refuse: Refuser, history: int, label: str, effects: Mapping[str, runtime.Effect]
) -> dict[str, Any]:
    """Return the globals generated code runs with: the names it calls, and nothing else.

    Each effect hook is a global of its own, ``_fx_<name>`` (spec effect names
    are identifiers), so a fast path calls it with one global lookup.
    """
    return {
        **{f"_fx_{name}": hook for name, hook in effects.items()},
        "_label": label,
        "_effect_failed": runtime.effect_failed,
        "_refuse": refuse,
        "_parent_in": runtime.parent_in,
        "_WALK": range(runtime.WALK),
        "_looped": runtime.looped,
        "_child_in": runtime.child_in,
        "_getframe": runtime.caller_frame,
        "_INTERNAL": trails.internal_files(),
        "_deque": deque,
        "_history": history,
        "_registration": _Registration(),
    }


def _register(source: str, filename: str, owner: _Registration) -> None:
    """Put ``source`` in linecache as ``filename`` for as long as ``owner`` lives.

    The entry has no modification time, which is how :func:`linecache.checkcache`
    knows not to look for a file of that name and keeps it (attrs does the
    same). ``filename`` is also dispatch code that call sites skip over.
    """
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    trails.internal(filename)
    weakref.finalize(owner, _forget, filename).atexit = False


def _forget(filename: str) -> None:
    """Drop a compilation's source and dispatch mark once no function of it is left."""
    linecache.cache.pop(filename, None)
    trails.forget(filename)


def guard_expr(guard: Guard, local: bool = True) -> str:
    """Return a Python expression for ``guard`` over counter locals (``c_pins``)."""
    if not guard:
        return "True"
    name = "c_{}" if local else "rec.{}"
    return " and ".join(f"{name.format(t.counter)} {t.op} {t.value}" for t in guard.terms)


def condition_expr(cond: Condition) -> str:
    """Return a Python expression for a region/parent/children condition."""
    states = repr(tuple(cond.states))
    if cond.scope == "self":
        return f"rec.{cond.region} in {states}"
    if cond.scope == "parent":
        return f"_parent_in(rec, {cond.region!r}, {states})"
    return f"_child_in(rec, {cond.region!r}, {states})"


def needs_general(system: System, event: str) -> bool:
    """Whether ``event`` has effects or propagation and so needs the plan/commit path."""
    return any(t.effect is not None or t.propagate is not None for t in _of(system, event))


def propagates(system: System, event: str) -> bool:
    """Whether some transition of ``event`` propagates to other records (ancestors)."""
    return any(t.propagate is not None for t in _of(system, event))


def _of(system: System, event: str) -> Iterator[Transition]:
    """Every transition of ``event``, region by region."""
    for region in system.regions_of(event):
        yield from (t for t in system.machines[region].transitions if t.event == event)


def compile_event(em: Emitter, event: str) -> str:
    """Emit ``_step_<event>(rec)`` and return its name.

    The step checks, then returns a plan ``(assignments, effects, propagate)``
    without touching the record; :class:`~fsm_cache.engine.core.Engine` commits it.
    """
    name = f"_step_{event}"
    em.event = event
    em.emit(0, f"def {name}(rec):")
    counters = _step_body(em, event, effects=True)
    assigns = [f"({r!r}, n_{r})" for r in em.system.regions_of(event)]
    assigns += [f"({c!r}, c_{c})" for c in counters]
    em.emit(1, f"return ({', '.join(assigns)},), effects, propagate")
    em.emit(0, "")
    return name


def _step_body(em: Emitter, event: str, *, effects: bool) -> list[str]:
    """Emit a step's checks of ``rec``: ``c_``/``n_`` locals, ``propagate``; return the counters.

    With ``effects``, the effect names to run are collected in an ``effects`` list.
    """
    regions = em.system.regions_of(event)
    counters = [c for r in regions for c in em.system.machines[r].counter_names]
    for counter in counters:
        em.emit(1, f"c_{counter} = rec.{counter}")
    if effects:
        em.emit(1, "effects = []")
    em.emit(1, "propagate = False")
    for region in regions:
        _region_block(em, region, em.system.machines[region], event)
    _system_forbids(em, event)
    return counters


def _has_effects(system: System, event: str) -> bool:
    """Whether some transition of ``event`` names an effect."""
    return any(t.effect is not None for t in _of(system, event))


def compile_chain(em: Emitter, event: str) -> str:
    """Emit ``_fire_<event>(rec)`` for an event that propagates and has no effects.

    The plan path's semantics without its plans: ``rec``'s step is checked,
    then, if it propagates, every ancestor's up to the root, each on the
    values before the event (nothing is written until every node passed); a
    refusal raises at the first node that refuses, nearest first. Then each
    node is written, ``rec`` first. The step's body runs in a loop over the
    chain, so no plan, list of assignments or ``setattr`` is built per node:
    a lock or unlock of a path costs a few attribute reads and writes a node.

    The walk takes :data:`runtime.WALK` records at a time (a ``for`` over a
    range, where an unbounded ``while`` would walk a looping chain for ever);
    after each such stretch it checks the chain for a repeated record
    (:func:`runtime.looped` raises ParentLoop, with nothing written) and goes
    on if there is none.
    """
    name = f"_fire_{event}"
    em.event = event
    regions = em.system.regions_of(event)
    em.emit(0, f"def {name}(rec):")
    em.emit(1, "chain = []")
    em.emit(1, "while True:")
    em.emit(2, "for _ in _WALK:")
    em.indent = 2
    try:
        counters = _step_body(em, event, effects=False)
    finally:
        em.indent = 0
    values = ", ".join([*(f"n_{r}" for r in regions), *(f"c_{c}" for c in counters)])
    em.emit(3, f"chain.append((rec, {values}))")
    if not all(t.propagate is not None for t in _of(em.system, event)):
        em.emit(3, "if not propagate and len(chain) == 1:  # propagating: to the root")
        em.emit(4, "break")
    em.emit(3, "rec = getattr(rec, 'parent', None)")
    em.emit(3, "if rec is None:")
    em.emit(4, "break")
    em.emit(2, "else:  # a long walk: raise if the chain loops, else walk on")
    em.emit(3, f"_looped(chain, _label, {event!r})")
    em.emit(3, "continue")
    em.emit(2, "break")
    em.emit(1, f"for rec, {values} in chain:")
    for region in regions:
        em.emit(2, f"rec.{region} = n_{region}")
    for counter in counters:
        em.emit(2, f"rec.{counter} = c_{counter}")
    em.emit(0, "")
    return name


def compile_fast(
    em: Emitter, event: str, *, walk: bool = True, live: frozenset[str] | None = None
) -> str:
    """Emit ``_fire_<event>(rec)`` that checks and commits inline; return its name.

    For events without propagation: the common, hot case. When nothing is checked
    after a state's branch (one region, no composition forbid),
    each transition commits in its branch, writing only what changes: a pin on a
    pinned node writes one counter, as a bare counter does; and each branch reads
    only the counters its guards test, so a pin on a backed node reads its state
    and its pins once each, as the bare counter reads its count. With a trail,
    each commit first notes the call site: the first frame outside fsm_cache's
    dispatch files, or with ``walk`` false the immediate caller
    (``_direct_<event>``: ``_fire_<event>_at_caller`` would be the name of
    the fast path of an event named ``<event>_at_caller``). The note comes
    before the writes, so a record with no ``trail`` to note on is refused
    with nothing written.

    An event with effects needs ``live``, the effect names bound to a hook that
    does something: once every check has passed, those run in region order (the
    plan path's order), each failure raised as
    :class:`~fsm_cache.errors.EffectFailed` before anything is written; then the
    commit. A pure engine's ``no_effect`` stand-ins are not called at all.
    """
    name = f"_fire_{event}" if walk else f"_direct_{event}"
    em.event = event
    em.emit(0, f"def {name}(rec):")
    regions = em.system.regions_of(event)
    em.walk = walk
    if em.trail:
        _find_site(em, walk)
    inline = em.inline = _inlinable(em, event)
    calls = _effect_calls(em.system, event, live or frozenset())
    if not inline:  # inline branches read only the counters they test (see _state_body)
        _read_counters(em, event, live is not None)
        em.flagged = frozenset(r for r, _, always in calls if not always)
        for region in sorted(em.flagged, key=regions.index):
            em.emit(1, f"x_{region} = None")
    em.live = live
    try:
        for region in regions:
            _region_block(em, region, em.system.machines[region], event)
    finally:
        em.inline, em.live, em.flagged = False, None, frozenset()
    if not inline:
        _system_forbids(em, event)
        _run_then_commit(em, event, calls)
    em.emit(0, "")
    return name


def _read_counters(em: Emitter, event: str, used_only: bool) -> None:
    """Emit, not inline, the reads into ``c_<counter>`` locals of the event's regions' counters.

    With ``used_only`` (fast paths with effects) only those its branches read or write.
    """
    used = _used(em.system, event) if used_only else None
    for region in em.system.regions_of(event):
        for counter in em.system.machines[region].counter_names:
            if used is None or counter in used:
                em.emit(1, f"c_{counter} = rec.{counter}")


def _run_then_commit(em: Emitter, event: str, calls: list[tuple[str, list[str], bool]]) -> None:
    """Emit, not inline and after every check, the effect calls in region order, then the commit.

    In trail mode the call site is noted between the effects and the writes
    (:func:`_note_site`).
    """
    if em.trail and calls:
        _probe_trail(em, 1)
    if calls:
        _keep_fields(em, 1)
    for region, names, always in calls:
        if always:
            _call_effect(em, 1, names[0])
            continue
        for i, effect in enumerate(names):
            em.emit(1, f"{'if' if i == 0 else 'elif'} x_{region} == {effect!r}:")
            _call_effect(em, 2, effect)
    if em.trail:
        _note_site(em, event, 1)
    for region in em.system.regions_of(event):
        em.emit(1, f"rec.{region} = n_{region}")
    for counter in _assigned(em.system, event):
        em.emit(1, f"rec.{counter} = c_{counter}")


def _effect_calls(
    system: System, event: str, live: frozenset[str]
) -> list[tuple[str, list[str], bool]]:
    """Return, per region in order, the live effects ``event`` may run there.

    Each entry is ``(region, effect names, always)``: ``always`` when every
    transition of the event in that region runs the one effect, so every branch
    that does not refuse runs it and no flag needs to say so. Regions whose
    transitions run no live effect are left out.
    """
    calls = []
    for region in system.regions_of(event):
        effects = [t.effect for t in system.machines[region].transitions if t.event == event]
        names = list(dict.fromkeys(e for e in effects if e is not None and e in live))
        if names:
            calls.append((region, names, len(names) == 1 and all(e == names[0] for e in effects)))
    return calls


def _call_effect(em: Emitter, depth: int, effect: str) -> None:
    """Emit the call of ``effect``'s hook on ``rec``, a failure raised as EffectFailed.

    The message and the chained cause are :func:`runtime.run_effect`'s (the plan
    path's); ``try`` costs nothing until it catches. Then, as the plan path
    does, an effect that changed the record's fields (``was``, read by
    :func:`_keep_fields`) fails too, with :func:`runtime.meddled`'s reason:
    the writes that follow were computed before it ran.
    """
    em.emit(depth, "try:")
    em.emit(depth + 1, f"_fx_{effect}(rec)")
    em.emit(depth, "except Exception as exc:")
    em.emit(depth + 1, f"raise _effect_failed(exc, {effect!r}, {em.event!r}, rec, _label) from exc")
    em.emit(depth, f"if {_fields(em.system)} != was:")
    why = runtime.meddled(em.event)
    em.emit(
        depth + 1,
        f"raise _effect_failed(RuntimeError({why!r}), {effect!r}, {em.event!r}, rec, _label)",
    )


def _keep_fields(em: Emitter, depth: int) -> None:
    """Emit, before an event's effects run, ``was``: the record's states and counters then."""
    em.emit(depth, f"was = {_fields(em.system)}")


def _fields(system: System) -> str:
    """Return the tuple expression of a record's states and counters (what an effect may not change)."""
    names = [*(r for r, _ in system.regions), *(c for c, _ in system.counters)]
    return f"({', '.join(f'rec.{name}' for name in names)},)"


def _find_site(em: Emitter, walk: bool) -> None:
    """Emit, first in a trail-mode fast path, the lookup of the call site's frame ``f``.

    The site is the first frame outside fsm_cache's dispatch files (the
    outermost frame when every frame is in them, as :func:`trail.caller_site`
    has it), or with ``walk`` false the immediate caller, which saves the file
    test on every event. The frame is looked up before the checks rather than
    after them: the same work measured about 15 ns a pin+release faster there
    in ``fsm-cache bench engine`` (CPython 3.11: the same instructions in
    another order). A refusal drops it with the function's other locals.
    """
    em.emit(1, "f = _getframe(1)")
    if walk:
        em.emit(1, "c = f.f_code")
        em.emit(1, "while c.co_filename in _INTERNAL and f.f_back is not None:")
        em.emit(2, "f = f.f_back")
        em.emit(2, "c = f.f_code")


def _note_site(em: Emitter, event: str, depth: int) -> None:
    """Emit the note of ``event``'s call site on ``rec.trail``: the frame ``f``'s code and offset.

    :func:`_find_site` found the frame (and, walking, its code ``c``). The line
    is looked up only when a refusal names it (:func:`trail.site_of`). A
    record's first note finds its trail None and makes it (``try`` costs
    nothing until it catches). Emitted after every check and effect and
    before the writes: a record that has no ``trail`` at all raises
    AttributeError there, with nothing written.
    """
    code = "c" if em.walk else "f.f_code"
    entry = f"({event!r}, {code}, f.f_lasti)"
    em.emit(depth, "try:")
    em.emit(depth + 1, f"rec.trail.append({entry})")
    em.emit(depth, "except AttributeError:  # None: the record's first note")
    em.emit(depth + 1, f"rec.trail = _deque(({entry},), maxlen=_history)")


def _probe_trail(em: Emitter, depth: int) -> None:
    """Emit, in trail mode before an event's effects run, a read of ``rec.trail``.

    A record with no ``trail`` then raises AttributeError before any effect
    has run, not after (the note that follows the effects would). Only events
    with effects pay for it.
    """
    em.emit(depth, "rec.trail  # a record with no trail is refused before its effects run")


def _inlinable(em: Emitter, event: str) -> bool:
    """Whether ``event`` may commit inside its branches: nothing is checked after them.

    That holds with one region and no composition forbid.
    """
    regions = em.system.regions_of(event)
    return len(regions) == 1 and not em.system.forbids_for(event)


def _assigns(tr: Transition) -> tuple[Assign, ...]:
    """Return the assignments of ``tr``'s update that count, one per counter.

    Each assignment reads the counter's value on entry, as
    :meth:`~fsm_cache.spec.guards.Update.apply` defines it, so where an update
    built in Python assigns one counter twice (the grammar refuses that) only
    the last counts: ``n += 1, n += 1`` adds one, as the spec's meaning says.
    """
    last = {a.counter: a for a in tr.update.assigns}
    return tuple(a for a in tr.update.assigns if last[a.counter] is a)


def _used(system: System, event: str) -> set[str]:
    """Return the counters ``event``'s region branches read: guards they test, counters they write.

    Composition forbids read the record itself (:func:`_system_forbids`), not these locals.
    """
    used = set(_assigned(system, event))
    for region in system.regions_of(event):
        machine = system.machines[region]
        for tr in machine.transitions:
            if tr.event == event:
                used |= tr.guard.counters()
        for forbid in machine.forbids:
            if forbid.event == event:
                used |= forbid.guard.counters()
    return used


def _assigned(system: System, event: str) -> list[str]:
    """Return the counters some transition of ``event`` writes, in declaration order."""
    written: dict[str, None] = {}
    for region in system.regions_of(event):
        for tr in system.machines[region].transitions:
            if tr.event == event:
                written.update(dict.fromkeys(a.counter for a in tr.update.assigns))
    return list(written)


def _region_block(em: Emitter, region: str, machine: MachineSpec, event: str) -> None:
    em.emit(1, f"s_{region} = rec.{region}")
    first = True
    # States where the event can succeed are tested first, in the order the spec declares
    # their transitions (its authors put the common case first): the branches exclude each
    # other, so the order changes no outcome, and the hot case takes the fewest comparisons.
    legal = list(
        dict.fromkeys(s for t in machine.transitions if t.event == event for s in t.sources)
    )
    order = {name: i for i, name in enumerate(legal)}
    for state in sorted(machine.states, key=lambda st: order.get(st.name, len(order))):
        transitions = list(machine.transitions_for(state.name, event))
        forbids = list(machine.forbids_for(state.name, event))
        if not transitions and not forbids and not state.final:
            continue
        em.emit(1, f"{'if' if first else 'elif'} s_{region} == {state.name!r}:")
        first = False
        em.state = state.name
        if not transitions and not forbids:  # a final state: its own refusal, not the fallback's
            index = em.refusal(region, *machine.unanswered(state.name, event))
            em.emit(2, f"_refuse(rec, {index})")
            continue
        _state_body(em, region, transitions, forbids)
    fallback = em.refusal(region, *machine.unanswered("", event))  # a state not declared
    if first:
        em.emit(1, f"_refuse(rec, {fallback})")
        return
    em.emit(1, "else:")
    em.emit(2, f"_refuse(rec, {fallback})")


def _state_body(
    em: Emitter, region: str, transitions: list[Transition], forbids: list[Forbid]
) -> None:
    known = (region, em.state, em.event)
    implied = em.implied.get(known)
    if implied is None:  # the same for every kind of function emitted for the event
        machine = em.system.machines[region]
        implied = em.implied[known] = _last_guard_implied(machine, em.state, transitions, forbids)
    if em.inline:
        _read_tested(em, region, transitions, forbids, implied)
    # Forbids first, in declaration order: the first that holds is the refusal. A plain
    # (unguarded) forbid refuses outright, so nothing declared after it can apply.
    for forbid in forbids:
        index = em.refusal(region, forbid.error, forbid.reason)
        if not forbid.conditional:
            em.emit(2, f"_refuse(rec, {index})")
            return
        em.emit(2, f"if {guard_expr(forbid.guard)}:")
        em.emit(3, f"_refuse(rec, {index})")
    if len(transitions) == 1 and (implied or not transitions[0].guard):
        _transition_body(em, region, transitions[0], 2)
        return
    keyword = "if"
    for i, tr in enumerate(transitions):
        if implied and i == len(transitions) - 1:
            em.emit(2, "else:")
            _transition_body(em, region, tr, 3)
            return
        em.emit(2, f"{keyword} {guard_expr(tr.guard)}:")
        keyword = "elif"
        _transition_body(em, region, tr, 3)
    index = em.refusal(region, *GUARDS_FAIL)
    if keyword == "if":
        em.emit(2, f"_refuse(rec, {index})")
    else:
        em.emit(2, "else:")
        em.emit(3, f"_refuse(rec, {index})")


def _last_guard_implied(
    machine: MachineSpec, state: str, transitions: list[Transition], forbids: list[Forbid]
) -> bool:
    """Whether, in ``state``, the last transition's guard holds wherever nothing before it did.

    That is: every counter value the state's invariant allows, that no guarded
    forbid refuses and no earlier transition's guard takes, satisfies the last
    guard. The branch then need not test it (``else:``), and the generic refusal
    "no transition's guard holds" is unreachable there; validation's totality
    check says so of every loaded spec, and this asks it again of the system at
    hand, which may have been built without loading, and whose steps may then
    drive a counter negative. The engine keeps every invariant (see
    :func:`_inline_value`), so the invariant is as good as a test.

    Every guard compares one counter with a constant, so the values ``c - 1``,
    ``c`` and ``c + 1`` of each constant ``c`` meet every class of values the
    guards tell apart, negative ones included: checking those decides it exactly.
    """
    if not transitions or any(not f.conditional for f in forbids):
        return False
    invariant, last = machine.state(state).invariant, transitions[-1].guard
    before = [f.guard for f in forbids] + [t.guard for t in transitions[:-1]]
    guards = [invariant, last, *before]
    names = sorted({t.counter for g in guards for t in g.terms})
    axes = [
        sorted(
            {t.value + d for g in guards for t in g.terms if t.counter == name for d in (-1, 0, 1)}
        )
        for name in names
    ]
    for point in itertools.product(*axes):
        at = dict(zip(names, point, strict=True))
        if invariant.holds(at) and not any(g.holds(at) for g in before) and not last.holds(at):
            return False
    return True


def _read_tested(
    em: Emitter,
    region: str,
    transitions: list[Transition],
    forbids: list[Forbid],
    implied: bool,
) -> None:
    """Emit, inline, a read into ``c_<counter>`` of each counter a guard of this branch tests.

    Only the guards the branch emits count: none after a plain forbid, none of
    a lone unguarded transition, and not the last when the ones before imply it
    (``implied``). A counter the branch only assigns is read where it
    is written (``rec.pins = rec.pins + 1``): each counter is assigned once in a
    branch (:func:`_assigns`), so that read is still the value on entry.
    """
    tested: set[str] = set()
    for forbid in forbids:
        if not forbid.conditional:
            break
        tested |= forbid.guard.counters()
    else:
        for tr in transitions[:-1] if implied else transitions:
            tested |= tr.guard.counters()
    em.read = {c for c in em.system.machines[region].counter_names if c in tested}
    for counter in em.system.machines[region].counter_names:
        if counter in em.read:
            em.emit(2, f"c_{counter} = rec.{counter}")


def _transition_body(em: Emitter, region: str, tr: Transition, depth: int) -> None:
    effect = tr.effect if em.live is not None and tr.effect in em.live else None
    if em.inline:  # commit here: every check of this path has passed
        _inline_commit(em, region, tr, depth, effect)
        return
    em.emit(depth, f"n_{region} = {tr.dest!r}")
    for assign in _assigns(tr):
        em.emit(depth, f"c_{assign.counter} = {_value(assign)}")
    if em.live is None:
        if tr.effect is not None:
            em.emit(depth, f"effects.append({tr.effect!r})")
        if tr.propagate is not None:
            em.emit(depth, "propagate = True")
    elif effect is not None and region in em.flagged:
        em.emit(depth, f"x_{region} = {effect!r}")


def _inline_commit(
    em: Emitter, region: str, tr: Transition, depth: int, effect: str | None
) -> None:
    """Emit, inline, the transition's effect (if live), the trail's note and then its writes.

    Values are computed before the effect runs, from the values on entry, as
    the plan computes them before its effects: a constant needs no local.
    """
    values = [(a.counter, _inline_value(em, region, tr, a)) for a in _assigns(tr)]
    if effect is not None:
        for counter, value in values:
            if not value.isdigit():
                em.emit(depth, f"v_{counter} = {value}")
        values = [(c, v if v.isdigit() else f"v_{c}") for c, v in values]
        if em.trail:
            _probe_trail(em, depth)
        _keep_fields(em, depth)
        _call_effect(em, depth, effect)
    if em.trail:
        _note_site(em, em.event, depth)
    if tr.dest != em.state:
        em.emit(depth, f"rec.{region} = {tr.dest!r}")
    for counter, value in values:
        em.emit(depth, f"rec.{counter} = {value}")
    em.emit(depth, "return")


def _inline_value(em: Emitter, region: str, tr: Transition, assign: Assign) -> str:
    """Return the value an inline branch writes to ``assign``'s counter.

    Where the transition's guard or the branch's source state's invariant pins
    the counter (``pins == 1``; ``backed`` holds ``pins == 0``), the value is a
    constant (``rec.pins = 0``, ``rec.pins = 1``); otherwise it is computed
    from the local the branch read or, if it read none, from the record. The
    engine keeps every invariant (validation proves each step does), so the
    invariant is as good as a test.
    """
    invariant = em.system.machines[region].state(em.state).invariant
    terms = [*tr.guard.terms, *invariant.terms]
    known = [t.value for t in terms if t.counter == assign.counter and t.op == "=="]
    if known and assign.op != "=":
        return str(known[0] + assign.delta())
    read = f"c_{assign.counter}" if assign.counter in em.read else f"rec.{assign.counter}"
    return _value(assign, read)


def _value(assign: Assign, read: str = "") -> str:
    """Return the expression of one counter assignment over its value on entry.

    ``read`` is that value's expression: the local ``c_<counter>`` unless given.
    """
    if assign.op == "=":
        return str(assign.amount)
    return f"{read or f'c_{assign.counter}'} {assign.op[0]} {assign.amount}"


def _system_forbids(em: Emitter, event: str) -> None:
    regions = em.system.regions_of(event)
    owner = regions[0]
    for forbid in em.system.forbids_for(event):
        tests = [condition_expr(c) for c in forbid.when]
        if forbid.sources:
            tests.append(f"s_{owner} in {tuple(forbid.sources)!r}")
        if forbid.guard:
            tests.append(guard_expr(forbid.guard, local=False))
        index = em.refusal(owner, forbid.error, forbid.reason, forbid.others(owner))
        em.emit(1, f"if {' and '.join(tests) or 'True'}:")
        em.emit(2, f"_refuse(rec, {index})")
